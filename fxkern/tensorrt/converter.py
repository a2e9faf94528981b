"""The Torch-TensorRT converter of an fxkern op: one plugin layer, or a logged refusal.

The capability validator runs when Torch-TensorRT partitions the graph. It
declines (so the node runs in PyTorch, and says why once) what the plugin
cannot take: a scalar that is not a constant of the graph, a dtype the
kernel is not built for, a rank TensorRT does not have, sizes past the
32-bit launch arguments. The converter adds the plugin layer with
``aot=True`` whenever the op has an AOT implementation, passing the
attributes in register order with their exact Python types.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from fxkern import symbolic as sym
from fxkern.derive import INT32_MAX
from fxkern.errors import FxkernError
from fxkern.tensorrt.plugin import MAX_DIMS, TRT_DTYPES, PluginPlan, meta_shapes, plugin_arguments, scalar_bits

log = logging.getLogger("fxkern")
_said: set = set()


def _say_once(key: Any, message: str, *args: Any) -> None:
    if key not in _said:
        _said.add(key)
        log.warning(message, *args)


def _concrete(value: Any) -> Optional[int]:
    """An int, or the upper bound of a SymInt's range when it has one."""
    if isinstance(value, int):
        return value
    if isinstance(value, torch.SymInt):
        node = value.node
        try:
            bound = node.shape_env.bound_sympy(node.expr).upper
        except Exception:
            return None
        return int(bound) if getattr(bound, "is_finite", False) or isinstance(bound, int) else None
    return None


def refusal(pp: PluginPlan, node: fx.Node, strict_aot: bool = False) -> str:
    """Why ``node`` cannot become this plugin's layer ("" when it can)."""
    if pp.why_not:
        return pp.why_not
    if not pp.aot and strict_aot:
        raise FxkernError(f"{pp.plugin_id} has no AOT implementation ({pp.why_jit}), and strict AOT is on "
                          f"(fxkern.tensorrt.enable(strict_aot=True)); fix the spec or turn strict AOT off")
    try:
        tensors, attrs = plugin_arguments(pp, node.args, dict(node.kwargs))
    except (FxkernError, TypeError, ValueError) as exc:
        return str(exc)
    for (name, value), py_type in zip(attrs.items(), pp.attr_types):
        if isinstance(value, fx.Node):
            return f"scalar {name!r} is computed in the graph; a plugin attribute must be a constant"
        if not isinstance(value, (int, float, bool)):
            return f"scalar {name!r} is {value!r}; a plugin attribute must be a float, int or bool"
        try:
            scalar_bits(value, py_type, name)  # what aot_impl will pass: fail here, not in the build
        except (FxkernError, OverflowError) as exc:
            return f"scalar {name!r} = {value!r} cannot be a 32-bit kernel argument ({exc})"
    vals = []
    for name, t in zip(pp.tensor_names, tensors):
        val = t.meta.get("val") if isinstance(t, fx.Node) else None
        if not isinstance(val, torch.Tensor):
            return f"input {name!r} has no tensor metadata"
        if val.dtype not in TRT_DTYPES:
            return f"input {name!r} is {val.dtype}, which TensorRT has no type for"
        if val.dim() > MAX_DIMS:
            return f"input {name!r} has rank {val.dim()}; TensorRT tensors have at most {MAX_DIMS} dimensions"
        if not pp.aot and val.dtype == torch.bfloat16:
            return (f"input {name!r} is bfloat16 and the op is a JIT plugin ({pp.why_jit}); tensorrt.plugin "
                    f"cannot hand a bfloat16 buffer to Python")
        vals.append(val)
    plan = pp.entry.plan
    if plan is not None:
        allowed = plan.dtypes or (torch.float32,)
        for decl, val in zip(plan.tensor_decls, vals):
            want = (decl.dtype,) if decl.dtype is not None else allowed
            if val.dtype not in want:
                return f"input {decl.name!r} is {val.dtype}; the kernel takes {', '.join(map(str, want))}"
        too_big = _past_int32(pp, vals, node)
        if too_big:
            return too_big
    return _outputs_differ(pp, node, vals, list(attrs.values()))


def _outputs_differ(pp: PluginPlan, node: fx.Node, vals: Sequence[torch.Tensor], scalars: Sequence[Any]) -> str:
    """The plugin's outputs (from the spec's OutputDecls, or meta_fn on symbolic sizes) against the node's
    (the op's fake impl: meta_fn where given): a dtype or rank apart would have the kernel write another
    buffer than TensorRT allocates (found by a review), and a meta_fn that branches on sizes is refused."""
    want = node.meta.get("val")
    want = tuple(want) if isinstance(want, (tuple, list)) else (want,)
    if not all(isinstance(w, torch.Tensor) for w in want):
        return ""
    if pp.output_shapes is not None:
        shapes = [sym.compile_shape(s)(([v.shape for v in vals], ())) for s in pp.output_shapes]
        have = [(len(s), vals[pp.output_dtype_from[k]].dtype) for k, s in enumerate(shapes)]
    else:
        try:
            dims, dtypes = meta_shapes(pp.entry, [v.dim() for v in vals], [v.dtype for v in vals], scalars)
        except Exception as exc:  # noqa: BLE001  (meta_fn is the user's: whatever it raises, no plugin)
            return f"meta_fn on symbolic sizes: {exc}"
        have = [(len(d.dims), t) for d, t in zip(dims, dtypes)]
    if len(have) != len(want):
        return f"the plugin has {len(have)} outputs, the op's fake impl {len(want)}"
    for k, ((rank, dtype), w) in enumerate(zip(have, want)):
        if dtype != w.dtype or rank != w.dim():
            return (f"output {k} would be a {dtype} tensor of rank {rank} in TensorRT, but the op gives "
                    f"{w.dtype} of rank {w.dim()} (its meta_fn disagrees with its OutputDecls)")
    return ""


GRID_LIMITS = (INT32_MAX, 65535, 65535)  # CUDA's blocks per grid axis; TensorRT launches what it is given


def _past_int32(pp: PluginPlan, vals: Sequence[torch.Tensor], node: fx.Node) -> str:
    """Evaluate extras and grid at the largest sizes the graph allows; TensorRT passes them as int32,
    and launches the grid as given (CUDA allows 65535 blocks on y and z)."""
    plan = pp.entry.plan
    shapes = []
    for v in vals:
        dims = [_concrete(d) for d in v.shape]
        if any(d is None for d in dims):
            return ""  # unbounded dynamic size: TensorRT's optimisation profile bounds it; not checkable here
        shapes.append(dims)
    if pp.output_shapes is not None:
        outs = [sym.compile_shape(s)((shapes, ())) for s in pp.output_shapes]
    else:  # meta_fn's outputs: the node's own (its fake impl ran meta_fn), at their largest sizes
        val = node.meta.get("val")
        outs = [[_concrete(d) for d in o.shape] for o in (val if isinstance(val, (tuple, list)) else (val,))
                if isinstance(o, torch.Tensor)]
        if not outs or any(d is None for o in outs for d in o):
            return ""
    env = (shapes, outs)
    checks = [(f"extra {i}", e, INT32_MAX) for i, e in enumerate(plan.extras)] + \
             [(f"grid {a}", g, limit) for a, g, limit in zip("xyz", plan.grid or (), GRID_LIMITS)]
    for label, expr, limit in checks:
        value = sym.compile_expr(expr)(env)
        if value > limit:
            what = "TensorRT passes it as a 32-bit int" if limit == INT32_MAX else "CUDA launches at most 65535 there"
            return f"{label} reaches {value} at the largest input sizes; {what}"
    for k, dims in enumerate(outs):  # an eager_fn's own checks (a repeat's output) do not run in TensorRT
        if math.prod(dims) > INT32_MAX:
            return (f"output {k} {tuple(dims)} has more than 2**31 - 1 elements at the largest input sizes, more "
                    f"than a kernel indexing in 32 bits takes")
    return ""


def make_validator(pp: PluginPlan, strict_aot: Callable[[], bool]) -> Callable[[fx.Node, Any], bool]:
    def validate(node: fx.Node, settings: Any = None) -> bool:
        why = refusal(pp, node, strict_aot())
        if why:
            _say_once((pp.plugin_id, why), "fxkern: %s stays in PyTorch, not TensorRT: %s", node.target, why)
        return not why

    return validate


def make_converter(pp: PluginPlan) -> Callable[..., Any]:
    """``converter(ctx, target, args, kwargs, name)``: add the plugin layer, return its output(s)."""

    def convert(ctx: Any, target: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], name: str) -> Any:
        import tensorrt.plugin as trtp
        from torch_tensorrt.dynamo.conversion.converter_utils import get_trt_tensor

        tensors, attrs = plugin_arguments(pp, args, kwargs)
        itensors: List[Any] = [get_trt_tensor(ctx, t, f"{name}_{n}") for t, n in zip(tensors, pp.tensor_names)]
        plugin = getattr(getattr(trtp.op, pp.namespace), pp.name)
        layer = ctx.net.add_plugin(plugin(*itensors, **attrs), aot=pp.aot)
        layer.name = f"[{target}]-[{name}]"
        outs = tuple(layer.get_output(i) for i in range(pp.n_outputs))
        return outs[0] if len(outs) == 1 else outs

    convert.__name__ = f"convert_{pp.namespace}_{pp.name}"
    return convert
