"""Tracing pattern functions into graphs, in the IR of the graph they will be matched against.

A pattern is plain PyTorch. It is traced with ``torch.export`` (the
"export" IR) and, decomposed, into core ATen ("core_aten"); aot_autograd's
("aot"), inductor's ("inductor") and Torch-TensorRT's ("tensorrt",
"tensorrt_aot") IRs are traced with their decomposition tables; more plug in
through :data:`TRACERS`. Parameters annotated ``float``/``int`` are
scalars captured from the matched graph: the pattern is traced with a
sentinel value and every literal equal to it marks a capture site.
Traced patterns are cached per (rule, IR, dtype).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import operator
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from fxkern.errors import SpecError

log = logging.getLogger("fxkern")

SCALAR_TYPES = (float, int, bool)
# Unusual values, so a literal equal to one of them in a traced pattern is the parameter;
# each scalar parameter gets its own (the k-th adds k steps).
SENTINELS = {float: 0.0123456789012, int: 98765431}
SENTINEL_STEP = {float: 1.0009765625e-7, int: 7}


def sentinel(py_type: type, k: int) -> Any:
    return SENTINELS[py_type] + k * SENTINEL_STEP[py_type]

# Nodes that only assert facts about a value; they never keep a match from being replaced (is_inert).
ASSERTION_TARGETS = {
    "aten._assert_tensor_metadata.default",
    "aten._assert_scalar.default",
    "aten.sym_constrain_range_for_size.default",
    "aten._assert_async.msg",
}


def is_inert(node: fx.Node) -> bool:
    """Whether ``node`` never keeps a match from being replaced, and goes with the node it reads: an
    assertion (ASSERTION_TARGETS), or one output of a multi-output op that nothing reads
    (``x.max(-1).values`` leaves the indices' ``getitem``, in a pattern and in a model)."""
    if node.op != "call_function":
        return False
    return node.target in _assertion_ops() or (node.target is operator.getitem and not node.users)


@functools.cache
def _assertion_ops() -> FrozenSet[Any]:
    """ASSERTION_TARGETS as ops, those this torch has (a set lookup: the pass asks of every user)."""
    found = set()
    for name in ASSERTION_TARGETS:
        namespace, op, overload = name.split(".")
        found.add(getattr(getattr(getattr(torch.ops, namespace), op, None), overload, None))
    return frozenset(found - {None})


@dataclass(frozen=True)
class Param:
    """One pattern parameter: a tensor, or a scalar captured from the graph."""

    name: str
    kind: str  # "tensor" or "scalar"
    py_type: Optional[type] = None


@dataclass
class Pattern:
    """A traced pattern: its graph, parameters, output nodes and scalar capture sites."""

    graph: fx.Graph
    params: Tuple[Param, ...]
    placeholders: Tuple[fx.Node, ...]  # one per tensor param, in param order
    outputs: Tuple[fx.Node, ...]
    captures: Dict[Tuple[str, int, Any], str] = field(default_factory=dict)  # (node name, arg index path) -> param
    # literal sites whose number the pattern computed from its inputs' sizes (x.shape[-1]), and the IR
    sized: Dict[Tuple[Any, ...], Any] = field(default_factory=dict)
    ir: str = ""

    @property
    def op_nodes(self) -> List[fx.Node]:
        return [n for n in self.graph.nodes if n.op == "call_function"]


def pattern_params(fn: Callable[..., Any]) -> Tuple[Param, ...]:
    """Read the pattern's parameters: annotated float/int/bool ones are scalars."""
    sig = inspect.signature(fn)
    params = []
    try:
        hints = inspect.get_annotations(fn, eval_str=True)
    except Exception:  # unresolvable string annotations: fall back to the raw ones
        hints = {}
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise SpecError(f"pattern {fn.__name__}: *args/**kwargs are not allowed; name every parameter")
        if p.kind == p.KEYWORD_ONLY:
            raise SpecError(f"pattern {fn.__name__}: parameter {p.name!r} is keyword-only; the pattern is called "
                            f"with its arguments in order, so put it before the *")
        ann = hints.get(p.name, p.annotation)
        if ann in SCALAR_TYPES or ann in ("float", "int", "bool"):
            py_type = ann if isinstance(ann, type) else {"float": float, "int": int, "bool": bool}[ann]
            params.append(Param(p.name, "scalar", py_type))
        else:
            params.append(Param(p.name, "tensor"))
    if not any(p.kind == "tensor" for p in params):
        raise SpecError(f"pattern {fn.__name__}: needs at least one tensor parameter")
    return tuple(params)


class _Call(torch.nn.Module):
    def __init__(self, fn: Callable[..., Any], scalars: Dict[int, Any], n: int):
        super().__init__()
        self.fn, self.scalars, self.n = fn, scalars, n

    def forward(self, *tensors):
        it = iter(tensors)
        args = [self.scalars[i] if i in self.scalars else next(it) for i in range(self.n)]
        return self.fn(*args)


def default_example_inputs(params: Sequence[Param], dtype: torch.dtype) -> List[Any]:
    """Tensors of one generic shape, scalars as sentinels: a pattern of elementwise and last-axis ops
    traces to the same graph whatever the rank, so these match inputs of any rank."""
    out = []
    k = 0
    for p in params:
        if p.kind == "tensor":
            out.append(torch.randn(4, 8).to(dtype))
        else:
            out.append(sentinel(p.py_type, k) if p.py_type in SENTINELS else True)
            k += 1
    return out


def _call(fn, params, example_inputs) -> Tuple["_Call", List[Any]]:
    """``fn`` with its scalar parameters bound to their examples, and the tensors it is called with."""
    scalars = {i: v for i, (p, v) in enumerate(zip(params, example_inputs)) if p.kind == "scalar"}
    return _Call(fn, scalars, len(params)), [v for p, v in zip(params, example_inputs) if p.kind == "tensor"]


def _export(fn, params, example_inputs) -> torch.export.ExportedProgram:
    call, tensors = _call(fn, params, example_inputs)
    return torch.export.export(call, tuple(tensors))


def _export_graph(fn, params, example_inputs, decompose: bool, table: Optional[dict] = None) -> fx.Graph:
    ep = _export(fn, params, example_inputs)
    if decompose:
        ep = ep.run_decompositions() if table is None else ep.run_decompositions(table)
    return ep.graph_module.graph


def _core_aten_graph(fn, params, example_inputs) -> fx.Graph:
    """Export, then decompose to core ATen. A graph whose every op is already a core ATen op that the
    default table leaves alone is returned as exported: decomposing it would change nothing and costs
    0.2-0.4 s a pattern (most of a first ``apply``)."""
    ep = _export(fn, params, example_inputs)
    if all(keeps_core_op(n.target) for n in ep.graph.nodes if n.op == "call_function"):
        return ep.graph_module.graph
    return ep.run_decompositions().graph_module.graph


class _Together(torch.nn.Module):
    """Several patterns' calls, each on its own inputs, as one program returning a tuple of their
    results (whose leaves the exported graph returns in order)."""

    def __init__(self, calls: List[Tuple[_Call, int]]):
        super().__init__()
        self.calls = calls

    def forward(self, *tensors):
        outs, k = [], 0
        for call, n in self.calls:
            outs.append(call(*tensors[k:k + n]))
            k += n
        return tuple(outs)


def decompose_together(requests: Sequence[Tuple[Callable[..., Any], Sequence[Any]]],
                       ir: str = "core_aten") -> List[Optional[fx.Graph]]:
    """The graphs in ``ir`` (core ATen, or Torch-TensorRT's) of these patterns (each a function and
    its example inputs), decomposed in one go, for :func:`trace`'s ``graph=``; None for a pattern left
    to its own trace. ``run_decompositions()`` costs about 150 ms a call however small the program,
    and the library's patterns, decomposed one by one, made 4 of a first ``apply``'s 5 s: they are
    exported as one program, decomposed once, and split again. A pattern that mutates its inputs,
    reads a tensor it does not take, or was given examples that are not dense tensors leaves every
    pattern to its own trace, which says what is wrong."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    found: List[Optional[fx.Graph]] = [None] * len(requests)
    todo = []
    for i, (fn, examples) in enumerate(requests):
        params = pattern_params(fn)
        call, tensors = _call(fn, params, examples)
        if len(examples) != len(params) or not all(isinstance(v, torch.Tensor) for v in tensors):
            continue
        # each its own copies: export takes one tensor passed twice (rules share examples) as one input;
        # strides kept, which preserve_format does for dense tensors only
        copies = [v.clone(memory_format=torch.preserve_format) for v in tensors]
        if any(c.stride() != v.stride() for c, v in zip(copies, tensors)):
            continue
        todo.append((i, call, copies))
    if len(todo) < 2:
        return found
    together = _Together([(c, len(t)) for _, c, t in todo])
    try:
        with warnings.catch_warnings(), unset_fake_temporarily():
            warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*", category=FutureWarning)
            ep = torch.export.export(together, tuple(t for _, _, ts in todo for t in ts))
            ep = ep.run_decompositions() if ir == "core_aten" else ep.run_decompositions(_tensorrt_table())
    except Exception:  # noqa: BLE001 - each pattern's own trace says what is wrong with it
        return found
    kinds = torch.export.graph_signature
    if (any(s.kind != kinds.InputKind.USER_INPUT for s in ep.graph_signature.input_specs)
            or any(s.kind != kinds.OutputKind.USER_OUTPUT for s in ep.graph_signature.output_specs)):
        return found  # constants lifted, or inputs mutated: their outputs come first, and the split is off
    graph = ep.graph_module.graph
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    outputs = list(graph.find_nodes(op="output")[0].args[0])
    spec = ep.call_spec.out_spec  # the tuple of the patterns' results: how many leaves each has
    counts = [c.num_leaves for c in (spec.children() if callable(getattr(spec, "children", None)) else spec.children_specs)]
    parts = []
    for (i, _, tensors), n_out in zip(todo, counts):
        mine, inputs = inputs[:len(tensors)], inputs[len(tensors):]
        outs, outputs = outputs[:n_out], outputs[n_out:]
        part = _part(graph, mine, outs)
        if part is None:
            return found
        parts.append((i, part))
    for i, part in parts:
        found[i] = part
    return found


def _part(graph: fx.Graph, inputs: List[fx.Node], outputs: List[fx.Node]) -> Optional[fx.Graph]:
    """The nodes computing ``outputs`` from ``inputs``, as a graph of their own (None when they read
    anything else)."""
    needed, todo = set(), list(outputs)
    while todo:
        n = todo.pop()
        if n in needed:
            continue
        needed.add(n)
        todo.extend(n.all_input_nodes)
    if any(n.op == "placeholder" and n not in inputs for n in needed) or any(n.op == "get_attr" for n in needed):
        return None
    part, env = fx.Graph(), {}
    for n in inputs:
        env[n] = part.placeholder(n.name)
        env[n].meta = dict(n.meta)
    for n in graph.nodes:
        if n in needed and n.op == "call_function":
            env[n] = part.create_node(n.op, n.target, fx.node.map_arg(n.args, env.__getitem__),
                                      fx.node.map_arg(n.kwargs, env.__getitem__))
            env[n].meta = dict(n.meta)
    part.output(tuple(env[o] for o in outputs))
    return part


def keeps_core_op(target: Any) -> bool:
    """True for an ATen op that decomposing to core ATen (the default table) leaves as it is."""
    return (isinstance(target, torch._ops.OpOverload) and torch.Tag.core in target.tags
            and target not in _decomposed_ops())


@functools.cache
def _decomposed_ops() -> FrozenSet[Any]:
    """The ops the default core ATen table decomposes (read once: building the table takes 0.1 s)."""
    return frozenset(torch.export.default_decompositions().keys())


def _make_fx_graph(fn, params, example_inputs, decompositions=None) -> fx.Graph:
    """ATen as the dispatcher sees it (what aot_autograd hands a backend): no-op casts leave no node."""
    from torch.fx.experimental.proxy_tensor import make_fx

    scalars = {i: v for i, (p, v) in enumerate(zip(params, example_inputs)) if p.kind == "scalar"}
    tensors = tuple(v for p, v in zip(params, example_inputs) if p.kind == "tensor")
    call = _Call(fn, scalars, len(params))
    return make_fx(lambda *t: call(*t), decomposition_table=decompositions)(*tensors).graph


def _inductor_graph(fn, params, example_inputs) -> fx.Graph:
    """The IR inductor's post-grad passes see: that ATen under inductor's decompositions."""
    from torch._inductor.decomposition import select_decomp_table

    return _make_fx_graph(fn, params, example_inputs, select_decomp_table())


def _tensorrt_graph(fn, params, example_inputs) -> fx.Graph:
    """Torch-TensorRT's lowered IR, as ``torch_tensorrt.compile`` makes it: export, then its table."""
    return _export_graph(fn, params, example_inputs, decompose=True, table=_tensorrt_table())


def _tensorrt_table() -> Dict[Any, Callable[..., Any]]:
    from fxkern.tensorrt.decompositions import table

    return table()


def _tensorrt_aot_graph(fn, params, example_inputs) -> fx.Graph:
    """The same table as Torch-TensorRT's torch.compile backend applies it (aot tracing)."""
    from fxkern.tensorrt.decompositions import table

    return _make_fx_graph(fn, params, example_inputs, table())


TRACERS: Dict[str, Callable[..., fx.Graph]] = {
    "export": lambda fn, params, ex: _export_graph(fn, params, ex, decompose=False),
    "core_aten": _core_aten_graph,
    "aot": _make_fx_graph,
    "inductor": _inductor_graph,
    "tensorrt": _tensorrt_graph,
    "tensorrt_aot": _tensorrt_aot_graph,
}


def trace(fn: Callable[..., Any], ir: str, *, dtype: torch.dtype = torch.float32,
          example_inputs: Optional[Sequence[Any]] = None, graph: Optional[fx.Graph] = None) -> Pattern:
    """Trace ``fn`` in ``ir`` and describe it as a :class:`Pattern`; ``graph``: the trace, made
    already (by :func:`decompose_together`)."""
    if ir not in TRACERS:
        raise SpecError(f"unknown IR {ir!r}; known: {sorted(TRACERS)}")
    params = pattern_params(fn)
    if example_inputs is None:
        example_inputs = default_example_inputs(params, dtype)
    example_inputs = list(example_inputs)
    if len(example_inputs) != len(params):
        raise SpecError(f"pattern {fn.__name__}: example_inputs has {len(example_inputs)} values for {len(params)} parameters")
    sentinel_to_param, tensor_to_param = {}, {}
    for p, v in zip(params, example_inputs):
        if p.kind == "tensor" and not isinstance(v, torch.Tensor):
            raise SpecError(f"pattern {fn.__name__}: example_inputs gives {type(v).__name__} {v!r} for tensor parameter "
                            f"{p.name!r}; give a tensor, or annotate the parameter `{p.name}: float` (or int) to capture a scalar")
        if p.kind == "tensor":
            # traced once, a tensor passed twice is one input: the pattern would only match x op x
            if id(v) in tensor_to_param:
                raise SpecError(f"pattern {fn.__name__}: tensors {tensor_to_param[id(v)]!r} and {p.name!r} are traced "
                                f"with the same example tensor; give each parameter its own tensor")
            tensor_to_param[id(v)] = p.name
        if p.kind == "scalar":
            if p.py_type is bool:
                raise SpecError(f"pattern {fn.__name__}: bool scalar {p.name!r} cannot be captured yet; make it a constant")
            if (p.py_type, v) in sentinel_to_param:
                raise SpecError(f"pattern {fn.__name__}: scalars {sentinel_to_param[(p.py_type, v)]!r} and {p.name!r} "
                                f"are traced with the same value {v!r}; give them different example values")
            sentinel_to_param[(p.py_type, v)] = p.name
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    try:
        # unset_fake_temporarily: a rule first traced inside a backend's compile runs under that
        # compile's fake mode, where the real example tensors are refused (found by a review:
        # fxkern.backend(library.rules(), inner="aot_eager") failed on every model)
        with warnings.catch_warnings(), unset_fake_temporarily():
            # torch's own pytree deprecation, raised inside torch.export on every trace: not the user's to fix
            warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*", category=FutureWarning)
            if graph is None:
                graph = TRACERS[ir](fn, params, example_inputs)
    except Exception as exc:
        raise SpecError(f"pattern {fn.__name__} could not be traced in the {ir!r} IR: {exc} (it is traced with "
                        f"inputs of shape (4, 8) unless the rule gives example_inputs= of the shapes it needs)") from exc

    for node in list(graph.nodes):
        if is_inert(node):
            graph.erase_node(node)
    placeholders = tuple(n for n in graph.nodes if n.op == "placeholder")
    if len(placeholders) != sum(p.kind == "tensor" for p in params) or any(n.op == "get_attr" for n in graph.nodes):
        raise SpecError(f"pattern {fn.__name__} reads a tensor it does not take as a parameter (a global or closed-over "
                        f"tensor): make it a parameter of the pattern")
    out_node = next(n for n in graph.nodes if n.op == "output")
    outs = out_node.args[0]
    outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
    if not all(isinstance(o, fx.Node) and o.op == "call_function" for o in outs):
        raise SpecError(f"pattern {fn.__name__}: every output must be computed by an op (not an input or a constant)")

    captures: Dict[Tuple[str, int, Any], str] = {}
    found = set()
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        for path, value in _literal_sites(node):
            key = (type(value), value)
            if key in sentinel_to_param:
                captures[(node.name,) + path] = sentinel_to_param[key]
                found.add(sentinel_to_param[key])
    missing = set(sentinel_to_param.values()) - found
    if missing:
        raise SpecError(
            f"pattern {fn.__name__}: scalar parameter(s) {sorted(missing)} do not appear as a literal in the "
            f"traced graph (use them directly in an op, e.g. `x + eps`, not through Python arithmetic)"
        )
    return Pattern(graph, params, placeholders, outs, captures, ir=ir)


def _op_nodes(graph: fx.Graph) -> List[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and not is_inert(n)]


def sized_sites(pattern: Pattern, fn: Callable[..., Any], example_inputs: Sequence[Any]) -> Dict[Tuple[Any, ...], Any]:
    """The literal sites of ``pattern`` (traced from ``fn`` at ``example_inputs``) whose numbers
    change when ``fn`` is traced again at other sizes: numbers it computes from its inputs' sizes,
    as ``x.shape[-1]`` traces to the example's 8. Matched as literals, such a pattern matched a
    model dividing by a constant 8 at rows of 16 (found by a probe). The other sizes keep equal
    sizes equal and scale each distinct size by a factor of its own (so a ratio of two sizes changes
    too); where the pattern needs sizes in proportion (halves), every size is doubled instead; dims
    of 1 change too where broadcasting allows. Where none of those traces, an ``int`` example equal
    to a size is scaled with it as well (a captured width: ``x[..., :rotary_dim]`` against tables
    ``rotary_dim`` wide). None found when no trace succeeds or ops differ."""
    ops = _op_nodes(pattern.graph)
    literal = [(n.name, dict(_literal_sites(n))) for n in ops]
    if not any(sites for _, sites in literal):
        return {}
    sizes = sorted({d for v in example_inputs if isinstance(v, torch.Tensor) for d in v.shape})
    primes = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47]
    distinct = {d: d * primes[i % len(primes)] for i, d in enumerate(sizes)}

    def resize(v: Any, scale: Optional[Dict[int, int]], least: int, widths: bool) -> Any:
        if isinstance(v, torch.Tensor):
            return torch.empty([(scale[d] if scale else 2 * d) if d >= least else d for d in v.shape],
                               dtype=v.dtype, device="meta")
        if widths and type(v) is int and v >= least and v in distinct:
            return scale[v] if scale else 2 * v
        return v

    other = None
    for scale, least, widths in ((distinct, 1, False), (distinct, 2, False), (None, 1, False), (None, 2, False),
                                 (distinct, 1, True), (None, 2, True)):
        if scale is not None and len(sizes) > len(primes):
            continue
        resized = [resize(v, scale, least, widths) for v in example_inputs]
        other = _trace_quietly(fn, pattern.ir, pattern.params, resized)
        if other is not None and [n.target for n in other] == [n.target for n in ops]:
            break
        other = None
    if other is None:
        return {}
    return {(name,) + path: value for (name, sites), n in zip(literal, other)
            for path, value in sites.items() if dict(_literal_sites(n)).get(path) != value}


@contextlib.contextmanager
def quiet_fake_errors():
    """torch's fake tensors log each failing meta kernel as an error, traceback and all: where a
    failure is an answer fxkern asks for (a trial trace, a layout that a view refuses), not shown."""
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    was, fake_log.disabled = fake_log.disabled, True
    try:
        yield
    finally:
        fake_log.disabled = was


def _trace_quietly(fn: Callable[..., Any], ir: str, params: Sequence[Param],
                   example_inputs: List[Any]) -> Optional[List[fx.Node]]:
    """The op nodes of ``fn`` traced in ``ir`` at these inputs, or None where it fails."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    try:
        with quiet_fake_errors(), warnings.catch_warnings(), unset_fake_temporarily():
            warnings.filterwarnings("ignore", category=FutureWarning)
            return _op_nodes(TRACERS[ir](fn, params, example_inputs))
    except Exception:  # noqa: BLE001 - a pattern traced at its own sizes only (a literal view, say)
        return None


def _literal_sites(node: fx.Node):
    """(path, value) for each scalar literal in a node's args/kwargs; path is ('a', i[, j]) or ('k', name)."""
    for i, a in enumerate(node.args):
        if isinstance(a, (list, tuple)):
            for j, b in enumerate(a):
                if isinstance(b, (int, float)) and not isinstance(b, bool):
                    yield ("a", i, j), b
        elif isinstance(a, (int, float)) and not isinstance(a, bool):
            yield ("a", i), a
    for k, a in node.kwargs.items():
        if isinstance(a, (int, float)) and not isinstance(a, bool):
            yield ("k", k), a
