"""Finding a pattern's occurrences in a graph.

Matching is anchored: candidates are the graph nodes with the same op as
the pattern's (first) output, found through one index of the graph by
target, and each is matched by walking the pattern backwards from there,
so the cost is linear in the graph, not in its subsets. The walk

* tries both operand orders of commutative ops (``add``, ``mul``...), and
  when a walk fails further on, the orders it took at up to four of them
  without trying the other (``cos * x`` binds x to cos until ``sin *
  rotate_half(x)`` says otherwise);
* lets one graph node feed several pattern parameters;
* passes through "noise" ops that change neither values nor shapes
  (shape-preserving views, clones, and same-dtype casts when allowed),
  absorbing them into the match when they sit inside it;
* compares literals exactly, except the captured scalar parameters.

A failed candidate keeps the reason of the deepest point it reached, for
``explain``'s near-misses.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, Iterable, List, Optional, Sequence, Set, Tuple

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from fxkern.graphs import run_on_vals
from fxkern.patterns import Pattern

aten = torch.ops.aten

COMMUTATIVE = {
    aten.add.Tensor, aten.mul.Tensor, aten.add.Scalar, aten.mul.Scalar,
    aten.maximum.default, aten.minimum.default,
}
VIEW_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.alias.default,
            aten.detach.default, aten.expand.default,
            aten._reshape_copy.default}  # Torch-TensorRT lowers view to _reshape_copy
CLONE_OPS = {aten.clone.default, aten.contiguous.default, aten.lift_fresh_copy.default}
CAST_OPS = {aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout}

DEFAULT_NOISE = frozenset({"views", "clones"})
ALL_NOISE = frozenset({"views", "clones", "casts"})


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def value_preserving(node: fx.Node) -> bool:
    """True when ``node`` returns its first input's values in its shape and dtype."""
    args = node.args
    if node.op != "call_function" or not args or not isinstance(args[0], fx.Node):
        return False
    kind = _NOISE_KIND.get(node.target)  # one lookup: an op's hash is a Python call
    if kind is None:
        return False
    src, out = _val(args[0]), _val(node)
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    if kind == "casts" and (src.dtype != out.dtype or src.device != out.device):
        return False
    try:
        return src.dtype == out.dtype and tuple(src.shape) == tuple(out.shape)
    except Exception:  # symbolic sizes that cannot be compared without a guard
        return False


NOISE_OPS = {"views": VIEW_OPS, "clones": CLONE_OPS, "casts": CAST_OPS}
_NOISE_KIND = {op: kind for kind, ops in NOISE_OPS.items() for op in ops}

# literal types a pattern argument compares by equality alone (the walk's last case, tried first)
_LITERALS = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format})


def is_noise(node: fx.Node, policy: FrozenSet[str]) -> bool:
    return any(node.target in NOISE_OPS[kind] for kind in policy) and value_preserving(node)


def skip_noise(node: Any, policy: FrozenSet[str]) -> Tuple[Any, List[fx.Node]]:
    skipped = []
    while isinstance(node, fx.Node) and is_noise(node, policy):
        skipped.append(node)
        node = node.args[0]
    return node, skipped


def arguments(node: fx.Node, cache: Optional[Dict[fx.Node, tuple]] = None) -> tuple:
    """A call's arguments in schema order, keyword and default ones included."""
    if cache is not None:
        hit = cache.get(node)
        if hit is not None:
            return hit
    params = _schema_params(node.target)
    if params is None:
        out = tuple(node.args) + tuple(v for _, v in sorted(node.kwargs.items()))
    elif not node.kwargs and len(node.args) == len(params):
        out = node.args
    else:
        args, kwargs = node.args, node.kwargs
        out = tuple(args[i] if i < len(args) else kwargs.get(name, default) for i, (name, default) in enumerate(params))
    if cache is not None:
        cache[node] = out
    return out


_SCHEMA_PARAMS: Dict[Any, Optional[Tuple[Tuple[str, Any], ...]]] = {}


def _schema_params(target: Any) -> Optional[Tuple[Tuple[str, Any], ...]]:
    """(name, default) of each schema argument, read from the schema once per op (None: no schema)."""
    try:
        return _SCHEMA_PARAMS[target]
    except KeyError:
        pass
    except TypeError:  # an unhashable callable
        return None
    schema = getattr(target, "_schema", None)
    params = None if schema is None else tuple(
        (a.name, a.default_value if a.has_default_value() else None) for a in schema.arguments)
    _SCHEMA_PARAMS[target] = params
    return params


# ---- the compiled pattern -----------------------------------------------------


@dataclass(frozen=True)
class Ref:
    """An argument that is the output of pattern op ``index``."""

    index: int


@dataclass(frozen=True)
class Bind:
    """An argument that is tensor parameter ``name``."""

    name: str


@dataclass(frozen=True)
class Capture:
    """A literal that is scalar parameter ``name``."""

    name: str
    py_type: type


@dataclass(frozen=True)
class ShapeOf:
    """A size list that is tensor parameter ``name``'s shape where the pattern was traced (F.normalize's
    ``expand_as(x)``): in a graph it must be the shape of what ``name`` binds to, not the literal the
    example gave (which held such patterns to torch.export's IR; found by a usability test)."""

    name: str


@dataclass(frozen=True)
class Sized:
    """A number the pattern computed from its inputs' sizes (``x.shape[-1]``, traced as the example's
    8): any number of its type matches here, and the rewrite checks the match by tracing the pattern
    again at the bound inputs' own sizes (``Rule.compiled_at``)."""

    value: Any


@dataclass(frozen=True)
class SameDevice:
    """A device literal that is where the op's input already is (core ATen writes ``.to(dtype)`` and
    ``softmax(..., dtype=)`` as ``_to_copy(x, dtype, layout, device)``): it matches the graph's device
    where that is its input's too. The pattern's example ran on the CPU, and its ``cpu`` kept every
    CUDA graph's casts from matching (found by a probe)."""


# ops whose size argument a pattern may take from an input's shape
SIZE_OPS = {aten.expand.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default,
            aten.broadcast_to.default, aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default,
            aten.new_full.default, aten.zeros.default, aten.ones.default, aten.empty.memory_format, aten.full.default}


@dataclass
class PNode:
    target: Any
    args: tuple
    name: str
    commutative: bool


@dataclass
class CompiledPattern:
    nodes: List[PNode]  # topological order
    outputs: List[int]
    tensor_params: List[str]
    scalar_params: List[str]
    policy: FrozenSet[str]
    # ops that take only parameters and literals, not other pattern ops: where a value-preserving
    # op at the match's input edge may stay for its other users
    leaves: Tuple[int, ...] = ()
    ir: str = ""
    sized: Tuple[str, ...] = ()  # the Sized literals, described ("8 in div")

    @property
    def anchor(self) -> PNode:
        return self.nodes[self.outputs[0]]


def compile_pattern(pattern: Pattern, policy: FrozenSet[str]) -> CompiledPattern:
    """Pattern nodes with noise removed, arguments in schema order, references by index."""
    tensor_params = [p.name for p in pattern.params if p.kind == "tensor"]
    placeholder_param = {ph: name for ph, name in zip(pattern.placeholders, tensor_params)}
    index: Dict[fx.Node, int] = {}
    nodes: List[PNode] = []
    params = {p.name: p for p in pattern.params}
    shapes: Dict[Tuple[int, ...], str] = {}  # an input's traced shape -> the first parameter that has it
    sized: List[str] = []
    for ph, name in placeholder_param.items():
        val = ph.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() and all(isinstance(d, int) for d in val.shape):
            shapes.setdefault(tuple(val.shape), name)

    def resolve(node: fx.Node) -> Any:
        node, _ = skip_noise(node, policy)
        if node in placeholder_param:
            return Bind(placeholder_param[node])
        return Ref(index[node])

    def convert(value: Any, site: Tuple, pnode_name: str, target: Any = None) -> Any:
        if isinstance(value, fx.Node):
            return resolve(value)
        if (target in SIZE_OPS and isinstance(value, (list, tuple)) and tuple(value) in shapes
                and not any(_capture_for(pattern, pnode_name, site + (j,)) for j in range(len(value)))):
            return ShapeOf(shapes[tuple(value)])
        if isinstance(value, (list, tuple)):
            return type(value)(convert(v, site + (j,), pnode_name) for j, v in enumerate(value))
        captured = _capture_for(pattern, pnode_name, site)
        if captured is not None:
            return Capture(captured, params[captured].py_type)
        if (pnode_name,) + tuple(site) in pattern.sized:
            sized.append(f"{value!r} in {pnode_name}")
            return Sized(value)
        if isinstance(value, torch.device) and value == _input_device(current[0]):
            return SameDevice()
        return value

    current = [None]  # the node whose arguments convert() is reading
    for node in pattern.graph.nodes:
        if node.op != "call_function" or is_noise(node, policy):
            continue
        current[0] = node
        raw = arguments(node)
        schema = getattr(node.target, "_schema", None)
        args = []
        for i, value in enumerate(raw):
            in_args = i < len(node.args) or schema is None
            site = ("a", i) if in_args else ("k", schema.arguments[i].name)
            args.append(convert(value, site, node.name, node.target))
        comm = node.target in COMMUTATIVE and (node.target is not aten.add.Tensor or raw[2] in (1, None))
        index[node] = len(nodes)
        nodes.append(PNode(node.target, tuple(args), node.name, comm))
    outputs = []
    for o in pattern.outputs:
        r = resolve(o)
        if not isinstance(r, Ref):
            raise ValueError("a pattern output is an input")
        outputs.append(r.index)
    leaves = tuple(i for i, pn in enumerate(nodes) if i not in outputs and not any(isinstance(a, Ref) for a in _flat(pn.args)))
    return CompiledPattern(nodes, outputs, tensor_params, [p.name for p in pattern.params if p.kind == "scalar"], policy, leaves,
                           pattern.ir, tuple(sized))


def _input_device(node: Optional[fx.Node]) -> Optional[torch.device]:
    """The device of ``node``'s first tensor argument (None where it has none)."""
    for a in (node.all_input_nodes if node is not None else ()):
        val = a.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.device
    return None


def _capture_for(pattern: Pattern, node_name: str, site: Tuple) -> Optional[str]:
    return pattern.captures.get((node_name,) + tuple(site))


# ---- matching ------------------------------------------------------------------


@dataclass
class Match:
    """One occurrence: the graph nodes it replaces, its outputs, and what its parameters bound to."""

    anchor: fx.Node
    nodes: List[fx.Node]  # replaced: matched ops and the noise absorbed between them
    keep: Set[fx.Node]  # value-preserving edge ops that stay for their other users
    outputs: List[fx.Node]
    bindings: Dict[str, Any]
    # copies (clones, same-dtype casts) the bindings read through, and kept ones: the op reads their
    # sources where it runs, which is only the same while nothing writes in place in between
    copies: List[fx.Node] = field(default_factory=list)

    @functools.cached_property
    def node_set(self) -> Set[fx.Node]:
        return set(self.nodes)


@dataclass
class Failure:
    anchor: fx.Node
    depth: int
    why: Any  # the reason, or a function giving it: most failed walks are never reported
    nodes: List[fx.Node] = field(default_factory=list)
    literal: bool = False  # the walk stopped at a literal the graph has otherwise

    @property
    def reason(self) -> str:
        if callable(self.why):
            self.why = self.why()
        return self.why


class _State:
    __slots__ = ("p2g", "used", "bind", "absorbed", "copies", "shapes", "depth", "fail", "prefs", "choices", "open", "noise")

    def __init__(self, noise: Set[fx.Node], prefs: Sequence[int] = ()):
        self.noise = noise  # the graph's nodes the pattern's policy passes through
        self.prefs = prefs  # preferred operand order at each commutative op, in visiting order
        self.choices = 0
        # commutative choices (by visit number) whose first order held, so the other was never tried;
        # kept across backtracking: a failure further on may be the first order's fault
        self.open: List[int] = []
        self.p2g: Dict[int, fx.Node] = {}
        self.used: Set[fx.Node] = set()
        self.bind: Dict[str, Any] = {}
        self.absorbed: List[fx.Node] = []
        self.copies: List[fx.Node] = []
        self.shapes: List[Tuple[str, Tuple[int, ...], fx.Node]] = []  # ShapeOf checks, made once all is bound
        self.depth = 0
        self.fail: Tuple[int, Any, List[fx.Node], bool] = (-1, "", [], False)

    def snapshot(self):
        # p2g only grows, in insertion order, and used is its values: their sizes undo them (copies of
        # both were 4% of the walk); bind's values may be replaced by equal ones, so it is copied
        return len(self.p2g), dict(self.bind), len(self.absorbed), len(self.copies), len(self.shapes)

    def restore(self, snap):
        p2g, used = self.p2g, self.used
        while len(p2g) > snap[0]:
            used.discard(p2g.popitem()[1])
        self.bind = snap[1]
        del self.absorbed[snap[2]:]
        del self.copies[snap[3]:]
        del self.shapes[snap[4]:]

    def failed(self, reason: Any, literal: bool = False) -> bool:
        """Record why the walk stopped (a lambda: most candidates fail, few reasons are read)."""
        if len(self.p2g) >= self.fail[0]:
            self.fail = (len(self.p2g), reason, list(self.p2g.values()), literal)
        return False


class Matcher:
    """Matches one compiled pattern against one graph.

    The index by target, and the set of noise nodes for each noise policy, are built once per
    graph from that index: the walk then asks "is this node noise?" with one set lookup.
    """

    def __init__(self, graph: fx.Graph, index: Optional[Tuple[Dict[Any, List[fx.Node]], Dict[fx.Node, Any]]] = None):
        self.graph = graph
        self.args_cache: Dict[fx.Node, tuple] = {}
        self.by_target, self.twins = index_graph(graph) if index is None else index
        self._noise: Dict[FrozenSet[str], Set[fx.Node]] = {}
        self._candidates: Dict[int, Tuple[CompiledPattern, List[fx.Node]]] = {}
        self._signatures: Dict[Tuple[Any, FrozenSet[str]], List[Tuple[tuple, List[fx.Node]]]] = {}
        self._filtered: Dict[Any, List[fx.Node]] = {}
        self._read_cache: Dict[FrozenSet[str], Dict[fx.Node, List[Tuple[fx.Node, Any]]]] = {}

    def noise(self, policy: FrozenSet[str]) -> Set[fx.Node]:
        """The graph's nodes that ``policy`` lets a match pass through."""
        found = self._noise.get(policy)
        if found is None:
            found = self._noise[policy] = set().union(*(self._noise_of(kind) for kind in sorted(policy)))
        return found

    def _noise_of(self, kind: str) -> Set[fx.Node]:
        """The graph's value-preserving calls of one kind of noise (views, clones, casts), found once:
        the rules' policies are a few unions of them."""
        key = frozenset((kind,))
        found = self._noise.get(key)
        if found is None:
            found = self._noise[key] = {n for t in NOISE_OPS[kind] for n in self.by_target.get(t, ())
                                        if value_preserving(n)}
        return found

    def _skip(self, node: fx.Node, noise: Set[fx.Node]) -> Tuple[fx.Node, List[fx.Node]]:
        skipped = []
        while node in noise:
            skipped.append(node)
            node = node.args[0]
        return node, skipped

    def candidates(self, pattern: CompiledPattern) -> List[fx.Node]:
        """Graph nodes with the anchor's op whose arguments include, as ops, every op the anchor
        takes from inside the pattern, and whose arguments' arguments every op those take: a cheap
        test that rejects most nodes before a walk. Once a pattern: a rule whose walks must know its
        numbers from sizes is looked at twice."""
        known = self._candidates.get(id(pattern))
        if known is not None and known[0] is pattern:
            return known[1]
        found = self._find_candidates(pattern)
        self._candidates[id(pattern)] = (pattern, found)
        return found

    def _find_candidates(self, pattern: CompiledPattern) -> List[fx.Node]:
        nodes = self.by_target.get(pattern.anchor.target, [])
        refs = [pattern.nodes[a.index] for a in _flat(pattern.anchor.args) if isinstance(a, Ref)]
        needed = [_ops_read(refs)] + ([_ops_read(pattern.nodes[a.index] for r in refs for a in _flat(r.args) if isinstance(a, Ref))])
        needed = [need for need in needed if need]
        if not needed:
            return nodes
        key = (pattern.anchor.target, pattern.policy, tuple(tuple(sorted(need.items(), key=str)) for need in needed))
        found = self._filtered.get(key)  # a rule's dtype variants, and rules alike near their anchor, share it
        if found is None:
            found = self._filtered[key] = [
                n for sig, group in self._by_signature(pattern.anchor.target, pattern.policy)
                if all(have.get(t, 0) >= k for need, have in zip(needed, sig) for t, k in need.items()) for n in group]
        return found

    def _by_signature(self, target: Any, policy: FrozenSet[str]) -> List[Tuple[tuple, List[fx.Node]]]:
        """The nodes calling ``target`` grouped by :func:`_signature`: a model's layers repeat a few
        signatures, so each pattern tests those, not every node."""
        groups = self._signatures.get((target, policy))
        if groups is None:
            reads = self._reader(policy)
            by_key: Dict[tuple, List[fx.Node]] = {}
            for n in self.by_target.get(target, []):
                first = reads(n)
                key = (tuple([t for _, t in first]), tuple([u for h, _ in first for _, u in reads(h)]))
                group = by_key.get(key)
                if group is None:
                    by_key[key] = [n]
                else:
                    group.append(n)
            groups = self._signatures[(target, policy)] = [(_signature(key), group) for key, group in by_key.items()]
        return groups

    def _reader(self, policy: FrozenSet[str]) -> Callable[[fx.Node], List[Tuple[fx.Node, Any]]]:
        """A function giving (call, op) for each call a node takes as an argument past noise, an
        in-place call under its twin's op; once a node: the layers' signatures read each node from
        several readers. A closure over the policy's cache and noise set, called for every read
        (the signatures of a 29k-node Llama took 56 ms with a method and its lookups, 45 ms so)."""
        cache = self._read_cache.setdefault(policy, {})
        noise, twins = self.noise(policy), self.twins

        def reads(node: fx.Node) -> List[Tuple[fx.Node, Any]]:
            found = cache.get(node)
            if found is not None:
                return found
            found = cache[node] = []
            args = node.args if not node.kwargs else (*node.args, *node.kwargs.values())
            for arg in args:
                for a in (_flat(arg) if isinstance(arg, (list, tuple)) else (arg,)):  # cat's tensors (fx's immutable_list)
                    if isinstance(a, fx.Node):
                        while a in noise:
                            a = a.args[0]
                        if a.op == "call_function":
                            found.append((a, twins.get(a, a.target)))
            return found

        return reads

    def sites(self, pattern: CompiledPattern) -> List[fx.Node]:
        """Every node with the anchor's op (what the report counts as candidate sites), in graph order."""
        return self.by_target.get(pattern.anchor.target, [])

    def matches_at(self, pattern: CompiledPattern, anchor: fx.Node, limit: int = 4):
        """Every distinct match at ``anchor`` (or one Failure), trying other operand orders of the
        first ``limit`` commutative ops: ``x + b`` binds (x, b) one way or the other, and only the
        op's own check can tell which one it takes."""
        m, fail, decisions, open_choices = self._match(pattern, anchor, ())
        if m is None and open_choices:
            m, decisions = self._reopen(pattern, anchor, open_choices[:limit])
        if m is None:
            yield None, fail
            return
        yield m, None  # most callers take the first: the key is made when a second is asked for
        seen = {_binding_key(m)}
        for bits in range(1, 2 ** min(decisions, limit)):
            prefs = [(bits >> k) & 1 for k in range(min(decisions, limit))]
            other = self._match(pattern, anchor, prefs)[0]
            if other is not None and _binding_key(other) not in seen:
                seen.add(_binding_key(other))
                yield other, None

    def _match(self, pattern: CompiledPattern, anchor: fx.Node, prefs: Sequence[int]):
        """(match or None, failure or None, number of commutative choices met, the open ones) for one walk."""
        st = _State(self.noise(pattern.policy), prefs)
        m, fail = self._run(pattern, anchor, st)
        return m, fail, st.choices, st.open

    def _reopen(self, pattern: CompiledPattern, anchor: fx.Node, open_choices: Sequence[int]):
        """(match, choices) or (None, 0): a failed walk again, with the other operand order at each
        subset of the commutative ops where it kept its first order and so never backtracked into
        them. Only walks that failed after such a choice pay for this, at most 15 of them."""
        for bits in range(1, 2 ** len(open_choices)):
            prefs = [0] * (max(open_choices) + 1)
            for j, k in enumerate(open_choices):
                prefs[k] = (bits >> j) & 1
            m, _, decisions, _ = self._match(pattern, anchor, prefs)
            if m is not None:
                return m, decisions
        return None, 0

    def _run(self, pattern: CompiledPattern, anchor: fx.Node, st: "_State") -> Tuple[Optional[Match], Optional[Failure]]:
        if not self._node(pattern, pattern.outputs[0], anchor, st):
            return None, Failure(anchor, st.fail[0], st.fail[1], st.fail[2], st.fail[3])
        for out in pattern.outputs[1:]:
            if out in st.p2g:
                continue
            if not self._find_other_output(pattern, out, st):
                return None, Failure(anchor, st.fail[0], f"no node for pattern output {pattern.nodes[out].name!r}", list(st.p2g.values()))
        if len(st.p2g) != len(pattern.nodes):
            missing = [pattern.nodes[i].name for i in range(len(pattern.nodes)) if i not in st.p2g]
            return None, Failure(anchor, len(st.p2g), f"pattern ops {missing} are not reached from its outputs", list(st.p2g.values()))
        for name, sizes, where in st.shapes:
            bound = st.bind.get(name)
            val = bound.meta.get("val") if isinstance(bound, fx.Node) else None
            shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
            if shape is None or len(shape) != len(sizes) or not all(map(_same_size, sizes, shape)):
                return None, Failure(anchor, len(st.p2g), f"literal differs at {where.name!r}: the pattern has {name}'s shape, "
                                     f"the graph {[_describe(d) if isinstance(d, fx.Node) else d for d in sizes]}, where "
                                     f"{name} is {_describe(bound)} of shape {list(shape) if shape is not None else 'unknown'}",
                                     list(st.p2g.values()))
        preserving = self.noise(ALL_NOISE)
        keep = {st.p2g[i] for i in pattern.leaves if st.p2g[i] in preserving}
        nodes = [st.p2g[i] for i in range(len(pattern.nodes)) if st.p2g[i] not in keep] + st.absorbed
        copies = st.copies + [k for k in keep if k.target not in VIEW_OPS]
        return Match(anchor, nodes, keep, [st.p2g[i] for i in pattern.outputs], dict(st.bind), copies), None

    # -- the walk --

    def _node(self, pat: CompiledPattern, pi: int, g: Any, st: _State) -> bool:
        if pi in st.p2g:
            return st.p2g[pi] is g or st.failed(lambda: f"pattern node {pat.nodes[pi].name!r} would be two graph nodes")
        pnode = pat.nodes[pi]
        op = g.op if isinstance(g, fx.Node) else None
        if op == "placeholder":
            return st.failed(lambda: f"the pattern computes {pnode.name!r} ({_op(pnode.target)}) where the graph takes "
                                     f"input {g.name!r}: computed outside this graph (a model input, or in a "
                                     f"backward graph a value the forward saved)")
        if op != "call_function":
            return st.failed(lambda: f"{pnode.name!r} ({_op(pnode.target)}) meets {_describe(g)}")
        if g in st.used:
            return st.failed(lambda: f"graph node {g.name!r} would match two pattern nodes")
        target = g.target
        if target is not pnode.target and target != pnode.target and self.twins.get(g) != pnode.target:
            return st.failed(lambda: f"{g.name!r} is {_op(g.target)} where the pattern has {_op(pnode.target)}")
        gargs = self.args_cache.get(g)  # one lookup: fx's args and kwargs are properties (a tenth of the walk)
        if gargs is None:
            gargs = arguments(g, self.args_cache)
        # one operand order: a failure here is undone by the caller's snapshot (or the match is dropped)
        if not pnode.commutative or len(gargs) < 2:
            st.p2g[pi] = g
            st.used.add(g)
            return self._args(pat, pnode.args, gargs, st, g)
        swapped = (gargs[1], gargs[0]) + tuple(gargs[2:])
        k = st.choices
        st.choices += 1
        orders = [swapped, gargs] if k < len(st.prefs) and st.prefs[k] else [gargs, swapped]
        first_fail = None
        for i, gargs_order in enumerate(orders):
            snap = st.snapshot()
            st.p2g[pi] = g
            st.used.add(g)
            if self._args(pat, pnode.args, gargs_order, st, g):
                if i == 0:
                    st.open.append(k)
                return True
            st.restore(snap)
            first_fail = first_fail or st.fail
        if st.fail[0] <= first_fail[0]:  # as deep: the written order's reason reads better ("literal
            st.fail = first_fail         # differs: 1.702, 1.7", not "literal 1.7 where the pattern has 'x'")
        return False

    def _args(self, pat: CompiledPattern, pargs: tuple, gargs: tuple, st: _State, where: fx.Node) -> bool:
        noise = st.noise
        for pa, ga in zip(pargs, gargs):
            if type(pa) is Ref and type(ga) is fx.Node and ga not in noise:  # most arguments: an op's result
                if not self._node(pat, pa.index, ga, st):
                    return False
            elif type(pa) in _LITERALS and type(ga) is type(pa) and pa == ga:  # the next most: a literal as written
                continue
            elif not self._arg(pat, pa, ga, st, where):
                return False
        return True

    def _arg(self, pat: CompiledPattern, pa: Any, ga: Any, st: _State, where: fx.Node) -> bool:
        kind = type(pa)
        if kind is Ref:
            if not isinstance(ga, fx.Node):
                return st.failed(lambda: f"{where.name!r} has the literal {ga!r} where the pattern has op {pat.nodes[pa.index].name!r}")
            if ga not in st.noise:
                return self._node(pat, pa.index, ga, st)
            target, skipped = self._skip(ga, st.noise)
            n_before = len(st.absorbed)
            st.absorbed.extend(skipped)
            if self._node(pat, pa.index, target, st):
                return True
            del st.absorbed[n_before:]
            return False
        if kind is Bind:
            if not isinstance(ga, fx.Node):
                return st.failed(lambda: f"{where.name!r} has the literal {ga!r} where the pattern has tensor {pa.name!r}")
            target, skipped = self._skip(ga, st.noise)
            bound = st.bind.get(pa.name)
            if bound is not None and bound is not target:
                return st.failed(lambda: f"parameter {pa.name!r} would be both {bound.name!r} and {target.name!r}")
            st.bind[pa.name] = target
            if skipped:  # rarely: a generator made for nothing was 4% of the walk
                st.copies.extend(n for n in skipped if n.target not in VIEW_OPS)
            return True
        if kind is Capture:
            ok = isinstance(ga, (int, float)) and not isinstance(ga, bool) and (pa.py_type is float or isinstance(ga, int))
            if not ok:
                hint = (" (torch.compile makes a Python float a graph input unless torch._dynamo.config.specialize_float "
                        "is True)" if pa.py_type is float and isinstance(ga, fx.Node) else "")
                return st.failed(lambda: f"{where.name!r} has {_describe(ga)} where the pattern captures "
                                         f"{pa.py_type.__name__} {pa.name!r}{hint}")
            value = pa.py_type(ga)
            if pa.name in st.bind and st.bind[pa.name] != value:
                old = st.bind[pa.name]
                return st.failed(lambda: f"scalar {pa.name!r} would be both {old} and {value}")
            st.bind[pa.name] = value
            return True
        if kind is SameDevice:
            if ga is not None and not (isinstance(ga, torch.device) and ga == _input_device(where)):
                return st.failed(lambda: f"{where.name!r} moves its input to {ga!r} where the pattern keeps it where it is")
            return True
        if kind is Sized:
            if isinstance(ga, fx.Node) or type(ga) is not type(pa.value):
                return st.failed(lambda: f"{where.name!r} has {_describe(ga)} where the pattern has a number it computed "
                                         f"from its inputs' sizes ({pa.value!r} at its example's)")
            return True
        if kind is ShapeOf:
            if not isinstance(ga, (list, tuple)) or not all(type(d) is int or isinstance(d, fx.Node) for d in ga):
                return st.failed(lambda: f"{where.name!r} has {_describe(ga) if isinstance(ga, fx.Node) else ga!r} "
                                         f"where the pattern has {pa.name}'s shape")
            st.shapes.append((pa.name, tuple(ga), where))
            return True
        if isinstance(pa, (list, tuple)):
            if not isinstance(ga, (list, tuple)) or len(ga) != len(pa):
                return st.failed(lambda: f"{where.name!r} has {ga!r} where the pattern has {list(pa)!r}")
            return self._args(pat, pa, ga, st, where)
        number = isinstance(pa, (int, float)) and not isinstance(pa, bool)  # one a pattern may compute from sizes
        if isinstance(ga, fx.Node):
            return st.failed(lambda: f"{where.name!r} takes {ga.name!r} where the pattern has the literal {pa!r}", number)
        if type(pa) is not type(ga):  # 8 and 8.0 differ: arange(8) is int64, arange(8.0) float32
            return st.failed(lambda: f"literal differs at {where.name!r}: pattern {pa!r}, graph {ga!r}", number)
        if pa != ga:
            return st.failed(lambda: f"literal differs at {where.name!r}: pattern {pa!r}, graph {ga!r}", number)
        return True

    def _find_other_output(self, pat: CompiledPattern, out: int, st: _State) -> bool:
        """A second output of a multi-output pattern: search the users of what is matched or bound."""
        target = pat.nodes[out].target
        seen = set()
        roots = list(st.p2g.values()) + [v for v in st.bind.values() if isinstance(v, fx.Node)]
        for root in roots:
            for user in root.users:
                if user in seen or user.target != target or user in st.used:
                    continue
                seen.add(user)
                snap = st.snapshot()
                if self._node(pat, out, user, st):
                    return True
                st.restore(snap)
        return False


def _signature(key: Tuple[Tuple[Any, ...], Tuple[Any, ...]]) -> Tuple[Counter, Counter]:
    """({op: count} of the calls a node reads, {op: count} of the calls those read), past noise,
    lists of arguments (``cat``'s) included, from the ops in the order read: a match's pattern ops
    one and two steps from its anchor are among them (each graph argument slot holds at most one
    pattern argument), so a node that lacks them needs no walk."""
    return Counter(key[0]), Counter(key[1])


def _ops_read(pnodes: Iterable[PNode]) -> Dict[Any, int]:
    """{op: count} of the pattern ops ``pnodes`` take as direct arguments."""
    found: Dict[Any, int] = {}
    for pn in pnodes:
        found[pn.target] = found.get(pn.target, 0) + 1
    return found


def _binding_key(m: Match) -> tuple:
    return tuple(sorted((k, id(v) if isinstance(v, fx.Node) else v) for k, v in m.bindings.items()))


def index_graph(graph: fx.Graph) -> Tuple[Dict[Any, List[fx.Node]], Dict[fx.Node, Any]]:
    """The graph's calls by op, and its in-place calls that no one can tell from their out-of-place
    twins (:func:`in_place_twins`), each listed under its twin, which patterns hold."""
    by_target: Dict[Any, List[fx.Node]] = {}
    for n in graph.nodes:
        if n.op == "call_function":
            by_target.setdefault(n.target, []).append(n)
    twins = in_place_twins(by_target)
    if twins:  # again, in graph order: the few in-place calls join their twins' lists
        by_target = {}
        for n in graph.nodes:
            if n.op == "call_function":
                by_target.setdefault(twins.get(n, n.target), []).append(n)
    return by_target, twins


@functools.lru_cache(maxsize=None)
def _twin(target: Any) -> Any:
    """The out-of-place overload of an in-place op (``aten.add_.Tensor``: ``aten.add.Tensor``), with
    the same arguments, or None."""
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.arguments or not schema.name.endswith("_"):
        return None
    alias = schema.arguments[0].alias_info
    if alias is None or not alias.is_write:
        return None
    namespace, _, name = schema.name.partition("::")
    try:
        twin = getattr(getattr(getattr(torch.ops, namespace), name[:-1]), target._overloadname)
    except (AttributeError, RuntimeError):
        return None
    same = lambda args: [(a.name, str(a.type)) for a in args]  # noqa: E731 - pow_.Scalar is not pow.Scalar
    if any(a.alias_info is not None for a in twin._schema.arguments) or \
            same(twin._schema.arguments) != same(schema.arguments):
        return None
    return twin


def _storage(v: Any) -> Any:
    try:
        return StorageWeakRef(v.untyped_storage())
    except Exception:  # noqa: BLE001 - a tensor without storage (a subclass): no answer
        return None


def in_place_twins(by_target: Dict[Any, List[fx.Node]]) -> Dict[fx.Node, Any]:
    """{in-place call: the out-of-place op it computes} where nothing can tell the two apart.

    torch.export's default IR keeps ``s += b`` as ``aten.add_(s, b)``; patterns, traced functional,
    hold ``aten.add``. The two are one when the call writes a value that only it reads (later code
    reads the call's result, as export writes it), made by an op that returned memory of its own
    (by storage, against its inputs' metadata: a view, ``type_as`` to the same dtype or a graph input
    shares it) or by such a call, and the out-of-place op gives that value's dtype (``lt_`` keeps a
    float, ``lt`` gives bool; ``add_`` keeps bfloat16 where ``add`` would promote). A chain of calls
    (``acc += x`` in a loop) is walked once, from its first call."""
    found: Dict[fx.Node, Any] = {}
    for target, nodes in by_target.items():
        if _twin(target) is None:
            continue
        for node in nodes:
            chain, n = [], node
            while isinstance(n, fx.Node) and n not in found and n.op == "call_function" and _twin(n.target) is not None:
                chain.append(n)
                n = n.args[0] if n.args else None
            for n in reversed(chain):  # the chain's first call first: each link needs the one before
                found[n] = _same_as_twin(n, found)
    return {n: t for n, t in found.items() if t is not None}


def _same_as_twin(node: fx.Node, found: Dict[fx.Node, Any]) -> Any:
    """``node``'s twin when nothing can tell them apart (:func:`in_place_twins`), else None."""
    twin = _twin(node.target)
    written = node.args[0] if node.args else None
    if not isinstance(written, fx.Node) or written.op != "call_function" or len(written.users) != 1:
        return None
    val = _val(written)
    if not isinstance(val, torch.Tensor) or not isinstance(_val(node), torch.Tensor):
        return None
    if written in found:  # a call of the chain before: the memory is fresh if it wrote fresh memory
        if found[written] is None:
            return None
    else:
        own = _storage(val)
        if own is None or any(isinstance(v, torch.Tensor) and _storage(v) == own
                              for a in written.all_input_nodes for v in _flat((_val(a),))):
            return None
    try:
        out = run_on_vals(twin, node)
    except Exception:  # noqa: BLE001 - the twin cannot say what it gives: keep the call as written
        return None
    return twin if isinstance(out, torch.Tensor) and out.dtype == val.dtype else None


def _flat(args: Iterable[Any]):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _flat(a)
        else:
            yield a


def _op(target: Any) -> str:
    return str(target).replace("aten::", "aten.")


def _same_size(given: Any, dim: Any) -> bool:
    """Whether a size argument (an int, or a node computing a SymInt) is the size ``dim`` of a shape,
    comparing symbols, not values (no guard is added)."""
    if isinstance(given, fx.Node):
        given = given.meta.get("val")
    if isinstance(given, torch.SymInt) or isinstance(dim, torch.SymInt):
        return (isinstance(given, torch.SymInt) and isinstance(dim, torch.SymInt)
                and given.node.expr == dim.node.expr)
    return type(given) is int and type(dim) is int and given == dim


def _describe(v: Any) -> str:
    if isinstance(v, fx.Node):
        return f"{v.name!r} ({v.op})"
    return f"the literal {v!r}"
