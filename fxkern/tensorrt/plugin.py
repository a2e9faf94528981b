"""An fxkern op as a TensorRT Quick-Deploy plugin: descriptor, AOT implementation, JIT fallback.

Everything TensorRT needs is derived from what the op already has:

* the **descriptor** (``trtp.register``) gives output shapes and dtypes; the
  shapes are the spec's own expressions (:mod:`fxkern.symbolic`) evaluated by
  :class:`TensorRTArithmetic` on TensorRT's symbolic dimensions, or, for ops
  with a ``meta_fn``, expressions read off a run of ``meta_fn`` on symbolic
  sizes;
* the **AOT implementation** (``trtp.aot_impl``) returns the PTX entry for
  the call's dtype, compiled for the GPU TensorRT builds on, the launch
  geometry from the same expressions, and the extra arguments: the op's scalar
  inputs (known when the engine is built) as int32 bit patterns, then the
  spec's extras. TensorRT passes (inputs, extras, outputs), which is fxkern's
  calling convention exactly when every tensor input comes before every scalar;
* otherwise (scalars before a tensor, 64-bit scalars, ``ptx_op`` without
  ``aot_fn``) a **JIT implementation** runs the op through PyTorch on
  TensorRT's stream, and the engine needs Python at run time.

Every function here takes the plugin API as an argument (``tensorrt.plugin``
and ``tensorrt.DataType`` in :class:`Api`), so the derivation is testable
without TensorRT, against a stand-in that enforces the API's documented
restrictions.
"""

from __future__ import annotations

import functools
import inspect
import logging
import struct
import typing
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from fxkern import compiler, symbolic as sym
from fxkern.derive import INT32_MAX
from fxkern.errors import FxkernError
from fxkern.ops import KernelOp, compile_plan, registration_arch

log = logging.getLogger("fxkern")

# TensorRT's name for each dtype a plugin tensor may have.
TRT_DTYPES = {
    torch.float32: "FLOAT", torch.float16: "HALF", torch.bfloat16: "BF16", torch.int32: "INT32",
    torch.int64: "INT64", torch.int8: "INT8", torch.uint8: "UINT8", torch.bool: "BOOL",
}
TORCH_DTYPES = {v: k for k, v in TRT_DTYPES.items()}
SCALAR_TYPES = {"float": float, "int": int, "bool": bool}
# Plugin attribute names TensorRT reserves; a parameter with one of these names is renamed.
RESERVED = {"outputs", "stream", "tactic"}
MAX_DIMS = 8


@dataclass(frozen=True)
class Api:
    """The TensorRT names the plugin uses: ``tensorrt.plugin`` and ``tensorrt.DataType``."""

    plugin: Any
    DataType: Any


def real_api() -> Api:
    import tensorrt
    import tensorrt.plugin as trtp

    return Api(trtp, tensorrt.DataType)


class TensorRTArithmetic(sym.Arithmetic):
    """fxkern's expressions on TensorRT's symbolic integers.

    TensorRT's ``SymInt32`` has ``+ * //`` only with the symbolic operand on
    the left, no reflected operators and no truth value; constants exist only
    while TensorRT is building. Constants are therefore made as ``ShapeExpr``
    at evaluation time, so every operation has a symbolic left operand, and
    nothing here compares or branches on a value.
    """

    def __init__(self, plugin: Any):
        self.plugin = plugin

    def const(self, value: int) -> Any:
        if not -INT32_MAX - 1 <= value <= INT32_MAX:
            raise FxkernError(f"constant {value} does not fit TensorRT's 32-bit plugin integers")
        return self.plugin.ShapeExpr(value)

    # + * // are the base class's Python operators: both operands are symbolic by then.

    def cdiv(self, a: Any, b: Any) -> Any:
        return self.plugin.cdiv(a, b)


@dataclass(frozen=True, eq=False)
class PluginPlan:
    """How one fxkern op maps onto a TensorRT plugin (derived without TensorRT)."""

    entry: KernelOp
    plugin_id: str  # "ns::name"
    arg_names: Tuple[str, ...]  # schema argument names, declaration order
    arg_kinds: Tuple[str, ...]  # "tensor" or a scalar type name ("float", "int", "bool")
    tensor_args: Tuple[int, ...]  # positions of tensor arguments
    scalar_args: Tuple[int, ...]  # positions of scalar arguments
    arg_defaults: Tuple[Any, ...]  # the schema's default per argument, or MISSING
    tensor_names: Tuple[str, ...]  # descriptor parameter names
    attr_names: Tuple[str, ...]  # plugin attribute names, register order (= declaration order)
    attr_types: Tuple[type, ...]
    n_outputs: int
    output_shapes: Optional[Tuple[sym.ShapeExpr, ...]]  # None: read from meta_fn per call
    output_dtype_from: Tuple[int, ...]  # tensor input whose dtype each output takes
    call_dtype_from: int  # tensor input whose dtype picks the kernel instantiation
    aot: bool
    why_jit: str  # why the AOT implementation is not possible ("" when it is)
    why_not: str  # why no plugin can be made at all ("" when one can)

    @property
    def namespace(self) -> str:
        return self.plugin_id.split("::")[0]

    @property
    def name(self) -> str:
        return self.plugin_id.split("::")[1]


MISSING = object()  # an argument with no value and no default


def _schema_args(entry: KernelOp) -> Tuple[List[str], List[str], int, str]:
    """(names, kinds, number of outputs, why unsupported) from the op's schema."""
    schema = entry.op.default._schema
    names, kinds, why = [], [], ""
    for a in schema.arguments:
        t = str(a.type)
        names.append(a.name)
        if t == "Tensor":
            kinds.append("tensor")
        elif t in SCALAR_TYPES:
            kinds.append(t)
        else:
            kinds.append(t)
            why = why or f"argument {a.name!r} has type {t}; a TensorRT plugin takes Tensors and float/int/bool scalars"
    return names, kinds, len(schema.returns), why


def _unique(name: str, taken: set) -> str:
    while name in RESERVED or name in taken:
        name += "_"
    taken.add(name)
    return name


_PLANS: Dict[str, PluginPlan] = {}


def plan_plugin(entry: KernelOp) -> PluginPlan:
    """The plugin plan of a registered op (cached per registration)."""
    pp = _PLANS.get(entry.qualname)
    if pp is None or pp.entry is not entry:
        pp = _PLANS[entry.qualname] = _plan_for(entry)
    return pp


def _plan_for(entry: KernelOp) -> PluginPlan:
    names, kinds, n_out, why_not = _schema_args(entry)
    tensor_args = tuple(i for i, k in enumerate(kinds) if k == "tensor")
    scalar_args = tuple(i for i, k in enumerate(kinds) if k != "tensor")
    taken: set = set()
    tensor_names = tuple(_unique(names[i], taken) for i in tensor_args)
    attr_names = tuple(_unique(names[i], taken) for i in scalar_args)
    attr_types = tuple(SCALAR_TYPES.get(kinds[i], object) for i in scalar_args)
    if not tensor_args:
        why_not = why_not or "the op has no tensor argument"

    plan = entry.plan
    if plan is not None and plan.output_shapes is not None:
        shapes = plan.output_shapes
        call_from = next((k for k, d in enumerate(plan.tensor_decls) if d.dtype is None), 0)
        dtype_from = tuple(call_from if s is None else s for s in plan.output_dtype_from)
    else:
        shapes, call_from, dtype_from = None, 0, ()
        if plan is not None:
            call_from = next((k for k, d in enumerate(plan.tensor_decls) if d.dtype is None), 0)

    why_jit = ""
    if scalar_args and tensor_args and max(tensor_args) > min(scalar_args):
        why_jit = ("a scalar input comes before a tensor input; TensorRT passes (tensors, extras, outputs), "
                   "so declare every InputDecl before any ScalarInput")
    elif entry.strided_outputs:
        why_not = why_not or ("the kernel writes its outputs in meta_fn's strided layout (strided_outputs=True); "
                              "TensorRT's tensors are linear")
    elif plan is not None:
        if plan.grid is None and entry.aot_fn is None:
            why_jit = "the spec has no geometry (eager_fn launches it) and no aot_fn gives TensorRT a launch"
        elif any(p.kind not in ("pointer", "i32", "f32", "bool") for p in plan.params):
            why_jit = "a kernel parameter is wider than 32 bits"
    else:  # ptx_op
        if entry.aot_fn is None and entry.eager_fn is None:
            why_not = why_not or "ptx_op has neither aot_fn (a TensorRT launch) nor eager_fn (a PyTorch one)"
        elif entry.aot_fn is None:
            why_jit = "ptx_op has no aot_fn to give TensorRT a launch"
        else:
            params = compiler.ptx_entries(entry.ptx).get(entry.ptx_kernel, [])
            for i in scalar_args:
                if i < len(params) and params[i].size > 4:
                    why_jit = (f"scalar {names[i]!r} is a {params[i].size * 8}-bit kernel parameter; TensorRT's "
                               f"extra arguments are 32-bit")
                    break
    defaults = tuple(a.default_value if a.has_default_value() else MISSING
                     for a in entry.op.default._schema.arguments)
    return PluginPlan(
        entry=entry, plugin_id=entry.qualname, arg_names=tuple(names), arg_kinds=tuple(kinds),
        arg_defaults=defaults,
        tensor_args=tensor_args, scalar_args=scalar_args, tensor_names=tensor_names, attr_names=attr_names,
        attr_types=attr_types, n_outputs=n_out, output_shapes=shapes, output_dtype_from=dtype_from,
        call_dtype_from=call_from, aot=not why_not and not why_jit, why_jit=why_jit, why_not=why_not,
    )


# ---- scalars as extras ---------------------------------------------------------


def scalar_bits(value: Any, py_type: type, name: str) -> int:
    """A scalar input as the int32 TensorRT passes in its place (float32 bits for a float)."""
    if py_type is float:
        return struct.unpack("<i", struct.pack("<f", float(value)))[0]
    if py_type is bool:
        return int(bool(value))
    value = int(value)
    if not -INT32_MAX - 1 <= value <= INT32_MAX:
        raise FxkernError(f"scalar {name}={value} does not fit the kernel's 32-bit int")
    return value


# ---- output shapes from a meta_fn -------------------------------------------------


def _from_sympy(e: Any, symbols: Dict[Any, sym.Expr]) -> sym.Expr:
    import sympy
    from torch.utils._sympy.functions import FloorDiv

    if isinstance(e, int) or getattr(e, "is_Integer", False):
        return sym.Const(int(e))
    if e in symbols:
        return symbols[e]
    if isinstance(e, (sympy.Add, sympy.Mul)):
        # symbolic terms first: TensorRT wants a symbolic left operand
        terms = sorted(e.args, key=lambda a: bool(getattr(a, "is_number", False)))
        out = _from_sympy(terms[0], symbols)
        for t in terms[1:]:
            out = out + _from_sympy(t, symbols) if isinstance(e, sympy.Add) else out * _from_sympy(t, symbols)
        return out
    if isinstance(e, FloorDiv):
        return _from_sympy(e.args[0], symbols) // _from_sympy(e.args[1], symbols)
    raise FxkernError(f"output size {e} uses an operation TensorRT's shape expressions do not have")


def meta_shapes(entry: KernelOp, ranks: Sequence[int], dtypes: Sequence[torch.dtype],
                scalars: Sequence[Any]) -> Tuple[Tuple[sym.Dims, ...], Tuple[torch.dtype, ...]]:
    """Run ``meta_fn`` on inputs with a symbol per dimension; read each output size as an expression."""
    return _meta_shapes(entry.qualname, entry.meta_fn, tuple(ranks), tuple(dtypes), tuple(scalars))


@functools.lru_cache(maxsize=256)
def _meta_shapes(qualname: str, meta_fn: Callable[..., Any], ranks, dtypes, scalars):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    pp = plan_plugin(_entry(qualname))
    shape_env = ShapeEnv(duck_shape=False)
    symbols: Dict[Any, sym.Expr] = {}
    hint = 7
    fakes = []
    mode = FakeTensorMode(shape_env=shape_env)
    for k, (rank, dtype) in enumerate(zip(ranks, dtypes)):
        sizes = tuple(hint + 2 * i for i in range(rank))  # distinct sizes, none 0 or 1 (no specialisation)
        hint += 2 * rank
        ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * rank, constraint_sizes=[None] * rank)
        t = mode.from_tensor(torch.empty(sizes, dtype=dtype, device="meta"), symbolic_context=ctx)
        for axis, s in enumerate(t.shape):
            symbols[s.node.expr] = sym.Dim(sym.INPUT, k, axis)
        fakes.append(t)
    with mode:
        args: List[Any] = [None] * len(pp.arg_names)
        for k, i in enumerate(pp.tensor_args):
            args[i] = fakes[k]
        for v, i in zip(scalars, pp.scalar_args):
            args[i] = v
        outs = meta_fn(*args)
    if shape_env.guards:  # a branch on a size: the sizes it saw decided it, and a plugin has no other
        raise FxkernError(f"{qualname}: meta_fn branches on input sizes ({shape_env.guards[0].expr}); a plugin's "
                          f"output shapes must be arithmetic of the input sizes (+, *, //), with no branch")
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    shapes = tuple(
        sym.Dims(tuple(_from_sympy(d.node.expr if isinstance(d, torch.SymInt) else d, symbols) for d in o.shape))
        for o in outs
    )
    return shapes, tuple(o.dtype for o in outs)


def _entry(qualname: str) -> KernelOp:
    from fxkern.ops import kernel_op

    return kernel_op(qualname)


# ---- the plugin functions ------------------------------------------------------------


def _trt_dtype(api: Api, dtype: torch.dtype) -> Any:
    try:
        return getattr(api.DataType, TRT_DTYPES[dtype])
    except KeyError:
        raise FxkernError(f"dtype {dtype} has no TensorRT equivalent") from None


def _torch_dtype(trt_dtype: Any) -> torch.dtype:
    name = getattr(trt_dtype, "name", str(trt_dtype).rsplit(".", 1)[-1])
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise FxkernError(f"TensorRT dtype {name} has no torch equivalent fxkern kernels take") from None


def _output_dims(pp: PluginPlan, api: Api, arith: TensorRTArithmetic, descs: Sequence[Any],
                 attrs: Sequence[Any]) -> Tuple[List[List[Any]], List[Any]]:
    """(dims, TensorRT dtypes) of every output, from the input descriptors."""
    in_shapes = [d.shape_expr for d in descs]
    if pp.output_shapes is not None:
        shapes, dtypes = pp.output_shapes, [descs[k].dtype for k in pp.output_dtype_from]
    else:
        ranks = [len(s) for s in in_shapes]
        shapes, torch_dtypes = meta_shapes(pp.entry, ranks, [_torch_dtype(d.dtype) for d in descs], attrs)
        dtypes = [_trt_dtype(api, d) for d in torch_dtypes]
    env = (in_shapes, ())
    return [sym.compile_shape(s, arith)(env) for s in shapes], dtypes


def _signature(params: Sequence[Tuple[str, Any]], returns: Any) -> inspect.Signature:
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    return inspect.Signature([inspect.Parameter(n, kind, annotation=a) for n, a in params], return_annotation=returns)


def _outputs_annotation(api: Api, n: int) -> Any:
    desc = api.plugin.TensorDesc
    return desc if n == 1 else typing.Tuple[tuple([desc] * n)]


def descriptor(pp: PluginPlan, api: Api) -> Callable[..., Any]:
    """The ``trtp.register`` function: ``(t0: TensorDesc, ..., a0: float, ...) -> TensorDesc(s)``.

    TensorRT calls it twice per layer, first with fake shapes (only dtypes are
    read), then with real ones; the same code serves both, since it never
    reads a dimension's value.
    """
    arith = TensorRTArithmetic(api.plugin)
    sig = _signature([(n, api.plugin.TensorDesc) for n in pp.tensor_names]
                     + list(zip(pp.attr_names, pp.attr_types)), _outputs_annotation(api, pp.n_outputs))

    def describe(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(*args, **kwargs)
        descs = [bound.arguments[n] for n in pp.tensor_names]
        attrs = [bound.arguments[n] for n in pp.attr_names]
        dims, dtypes = _output_dims(pp, api, arith, descs, attrs)
        outs = tuple(api.plugin.from_shape_expr(tuple(d), t) for d, t in zip(dims, dtypes))
        return outs[0] if len(outs) == 1 else outs

    describe.__signature__ = sig  # what trtp.register validates
    describe.__name__ = describe.__qualname__ = f"describe_{pp.namespace}_{pp.name}"
    return describe


def build_arch(entry: KernelOp) -> str:
    """The arch TensorRT's PTX targets: ``arch_override``, else the current GPU, else fxkern's default."""
    if entry.spec is not None and entry.spec.arch_override:
        return registration_arch(entry.spec)
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"sm_{major}{minor}"
    return registration_arch(entry.spec)


@functools.lru_cache(maxsize=None)
def _compiled(entry_qualname: str, arch: str) -> compiler.CompiledKernel:
    entry = _entry(entry_qualname)
    if entry.compiled is not None and entry.compiled.arch == arch:
        return entry.compiled
    return compile_plan(entry.plan, entry.source, arch)


def kernel_for(pp: PluginPlan, dtype: Optional[torch.dtype], arch: str) -> Tuple[str, str]:
    """(PTX entry name, PTX text) of the instantiation for ``dtype``."""
    entry = pp.entry
    if entry.plan is None:
        return entry.ptx_kernel, entry.ptx
    plan = entry.plan
    if plan.dtypes is not None and dtype not in plan.dtypes:
        raise FxkernError(f"{entry.qualname}: the kernel is built for {plan.dtypes}, not {dtype}")
    compiled = _compiled(entry.qualname, arch)
    return compiled.entry(plan.name_expression(dtype if plan.dtypes else None)), compiled.ptx


def aot_impl(pp: PluginPlan, api: Api, *, arch: Optional[str] = None) -> Callable[..., Any]:
    """The ``trtp.aot_impl`` function: ``(tensors, every attribute in register order, outputs, tactic)``
    → ``(kernel name, PTX, launch params, extra args)``."""
    if not pp.aot:
        raise FxkernError(f"{pp.plugin_id}: no AOT implementation: {pp.why_jit or pp.why_not}")
    trtp = api.plugin
    arith = TensorRTArithmetic(trtp)
    entry, plan = pp.entry, pp.entry.plan
    grid_fns = [sym.compile_expr(g, arith) for g in plan.grid] if plan is not None and plan.grid else None
    extra_fns = [sym.compile_expr(e, arith) for e in plan.extras] if plan is not None else []
    smem_fn = sym.compile_expr(plan.shared_mem, arith) if plan is not None else None
    returns = typing.Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]
    sig = _signature([(n, trtp.TensorDesc) for n in pp.tensor_names] + list(zip(pp.attr_names, pp.attr_types))
                     + [("outputs", _outputs_tuple(api, pp.n_outputs)), ("tactic", int)], returns)
    n_t, n_a = len(pp.tensor_names), len(pp.attr_names)

    def aot(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(*args, **kwargs)
        values = list(bound.arguments.values())
        descs, attrs = values[:n_t], values[n_t:n_t + n_a]
        outputs, tactic = bound.arguments["outputs"], bound.arguments["tactic"]
        dtype = _torch_dtype(descs[pp.call_dtype_from].dtype) if plan is not None and plan.dtypes else None
        name, ptx = kernel_for(pp, dtype, arch or build_arch(entry))
        scalars = [scalar_bits(v, t, n) for v, t, n in zip(attrs, pp.attr_types, pp.attr_names)]
        if entry.aot_fn is not None:
            params, own = _user_launch(entry, descs, outputs, tactic)
        else:
            in_shapes = [d.shape_expr for d in descs]
            out_dims, _ = _output_dims(pp, api, arith, descs, attrs)
            env = (in_shapes, out_dims)
            params = trtp.KernelLaunchParams()
            params.grid_x, params.grid_y, params.grid_z = (f(env) for f in grid_fns)
            params.block_x, params.block_y, params.block_z = plan.block
            params.shared_mem = smem_fn(env)
            own = [f(env) for f in extra_fns]
        extras = trtp.SymExprs(len(scalars) + len(own))
        for i, v in enumerate(list(scalars) + list(own)):
            extras[i] = trtp.SymInt32(v)  # explicit: a plain int or expression is not accepted as an extra
        return name, ptx, params, extras

    aot.__signature__ = sig
    aot.__name__ = aot.__qualname__ = f"aot_{pp.namespace}_{pp.name}"
    return aot


def _outputs_tuple(api: Api, n: int) -> Any:
    return typing.Tuple[tuple([api.plugin.TensorDesc] * n)]


def _user_launch(entry: KernelOp, descs: Sequence[Any], outputs: Any, tactic: int) -> Tuple[Any, List[Any]]:
    """``aot_fn(inputs, outputs, tactic)`` → launch params, or (launch params, extras)."""
    result = entry.aot_fn(tuple(descs), outputs, tactic)
    if isinstance(result, tuple):
        params, extras = result
        return params, list(extras or ())
    return result, []


def jit_impl(pp: PluginPlan, api: Api) -> Callable[..., Any]:
    """The ``trtp.impl`` fallback: the op through PyTorch on TensorRT's stream (needs Python at run time)."""
    sig = _signature([(n, api.plugin.Tensor) for n in pp.tensor_names] + list(zip(pp.attr_names, pp.attr_types))
                     + [("outputs", typing.Tuple[tuple([api.plugin.Tensor] * pp.n_outputs)]), ("stream", int)], None)
    op = pp.entry.op.default

    def run(*args: Any, **kwargs: Any) -> None:
        bound = sig.bind(*args, **kwargs)
        call: List[Any] = [None] * len(pp.arg_names)
        for i, n in zip(pp.tensor_args, pp.tensor_names):
            call[i] = torch.as_tensor(bound.arguments[n], device="cuda")
        for i, n in zip(pp.scalar_args, pp.attr_names):
            call[i] = bound.arguments[n]
        stream = torch.cuda.ExternalStream(bound.arguments["stream"])
        with torch.cuda.stream(stream):
            result = op(*call)
            results = result if isinstance(result, (tuple, list)) else (result,)
            for dst, src in zip(bound.arguments["outputs"], results):
                torch.as_tensor(dst, device="cuda").copy_(src)

    run.__signature__ = sig
    run.__name__ = run.__qualname__ = f"jit_{pp.namespace}_{pp.name}"
    return run


def register(pp: PluginPlan, api: Api) -> None:
    """Register the descriptor and the AOT (or JIT) implementation with TensorRT."""
    trtp = api.plugin
    trtp.register(pp.plugin_id)(descriptor(pp, api))
    if pp.aot:
        trtp.aot_impl(pp.plugin_id)(aot_impl(pp, api))
    else:
        trtp.impl(pp.plugin_id)(jit_impl(pp, api))


def plugin_arguments(pp: PluginPlan, args: Sequence[Any], kwargs: Dict[str, Any]) -> Tuple[List[Any], Dict[str, Any]]:
    """An FX node's arguments as (tensor values, attributes keyed in register order, typed exactly).

    TensorRT's plugin call rejects attributes out of register order or of a
    different Python type (an ``int`` for a ``float``), so both are fixed here.
    """
    if len(args) > len(pp.arg_names):
        raise FxkernError(f"{pp.plugin_id}: {len(args)} arguments for a schema of {len(pp.arg_names)}")
    values: List[Any] = list(args) + [MISSING] * (len(pp.arg_names) - len(args))
    for k, v in kwargs.items():
        if k not in pp.arg_names:
            raise FxkernError(f"{pp.plugin_id}: unexpected argument {k!r}; the schema has {list(pp.arg_names)}")
        values[pp.arg_names.index(k)] = v
    for i, v in enumerate(values):  # torch.export leaves out arguments at their default
        if v is MISSING:
            values[i] = pp.arg_defaults[i]
        if values[i] is MISSING:
            raise FxkernError(f"{pp.plugin_id}: argument {pp.arg_names[i]!r} has no value and no default")
    tensors = [values[i] for i in pp.tensor_args]
    attrs = {n: t(values[i]) if isinstance(values[i], (int, float, bool)) else values[i]
             for n, t, i in zip(pp.attr_names, pp.attr_types, pp.scalar_args)}
    return tensors, attrs
