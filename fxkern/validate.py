"""Checks a call against its plan before anything is launched.

Shared by the CUDA impl, the CPU reference impl and the fake impl, so a bad
call fails the same way in eager, under ``torch.export`` and on CPU. Every
failure is a :class:`KernelInputError` that names the op and the argument.
"""

from __future__ import annotations

import warnings
from typing import Any, List, Optional, Sequence

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxkern.derive import INT32_MAX, KernelPlan
from fxkern.symbolic import ShapeOf
from fxkern.errors import KernelInputError, SizeLimitError


def fast_checker(plan: KernelPlan):
    """A check for the common, valid call: one pass, no messages.

    Returns ``fast(tensors) -> (ok, dtype)``; when ``ok`` is False the caller
    runs the full checks below, which raise with a precise message (or
    accept a call the fast path does not cover, such as broadcasting).
    """
    decl_dtypes = [d.dtype for d in plan.tensor_decls]
    allowed = frozenset(plan.dtypes or (torch.float32,))
    ranks = [0 if need is None else need[0] for need in plan.input_ranks]
    bcast = [d.broadcast for d in plan.tensor_decls]
    # the shape inputs are checked against, as check_shapes takes it: an Elementwise kernel's output
    # 0 (the input it has the shape of; without one, calls take the full checks), else the first
    # input that is not broadcast
    if plan.elementwise:
        out0 = plan.output_shapes[0] if plan.output_shapes else None
        ref_index = out0.index if isinstance(out0, ShapeOf) else -1
    else:
        ref_index = next((k for k, b in enumerate(bcast) if not b), None)
    min_rank = plan.min_out_rank

    def fast(tensors: Sequence[torch.Tensor]):
        first = tensors[0]
        device = first.device
        if device.type != "cuda":
            return False, None
        shape = first.shape
        if len(shape) < min_rank or ref_index == -1:
            return False, None
        ref = tensors[ref_index].shape if ref_index is not None else shape
        dtype = None
        for t, want, b, rank in zip(tensors, decl_dtypes, bcast, ranks):
            if t.device != device or len(t.shape) < rank:
                return False, None
            if b:  # the common broadcast: exactly the trailing axes (leading 1s go the slow path)
                k = len(t.shape)
                if k > len(ref) or t.shape != ref[len(ref) - k:]:
                    return False, None
            elif t.shape != ref:
                return False, None
            if want is None:
                if dtype is None:
                    dtype = t.dtype
                    if dtype not in allowed:
                        return False, None
                elif t.dtype != dtype:
                    return False, None
            elif t.dtype != want:
                return False, None
        return True, dtype

    return fast


def _is_concrete(x: Any) -> bool:
    return isinstance(x, int)


def call_dtype(op: str, plan: KernelPlan, tensors: Sequence[torch.Tensor]) -> Optional[torch.dtype]:
    """The dtype the kernel is instantiated for, after checking every tensor input's dtype."""
    chosen: Optional[torch.dtype] = None
    chosen_from = ""
    for decl, t in zip(plan.tensor_decls, tensors):
        if not isinstance(t, torch.Tensor):
            raise KernelInputError(f"{op}: input {decl.name!r} must be a tensor, got {type(t).__name__}")
        if decl.dtype is not None:
            if t.dtype != decl.dtype:
                raise KernelInputError(
                    f"{op}: input {decl.name!r} must be {decl.dtype}, got {t.dtype}; "
                    f"convert it with .to({decl.dtype})"
                )
            continue
        if chosen is None:
            allowed = plan.dtypes or (torch.float32,)
            if t.dtype not in allowed:
                raise KernelInputError(
                    f"{op}: input {decl.name!r} is {t.dtype}, but the kernel is built for "
                    f"{', '.join(map(str, allowed))}; convert the input, or add {t.dtype} to "
                    f"KernelSpec.dtypes (with a templated kernel)"
                )
            chosen, chosen_from = t.dtype, decl.name
        elif t.dtype != chosen:
            raise KernelInputError(
                f"{op}: input {decl.name!r} is {t.dtype} but {chosen_from!r} is {chosen}; "
                f"inputs without their own InputDecl.dtype must share one dtype"
            )
    return chosen


def output_dtypes(plan: KernelPlan, tensors: Sequence[torch.Tensor], dtype: Optional[torch.dtype]) -> List[torch.dtype]:
    result = []
    for src in plan.output_dtype_from:
        if src is not None:
            result.append(tensors[src].dtype)
        else:
            result.append(dtype if dtype is not None else tensors[0].dtype)
    return result


def check_devices(op: str, plan: KernelPlan, tensors: Sequence[torch.Tensor]) -> torch.device:
    device = tensors[0].device
    for decl, t in zip(plan.tensor_decls, tensors):
        if t.device.type != "cuda":
            raise KernelInputError(
                f"{op}: input {decl.name!r} is on {t.device}; every tensor input must be on the "
                f"same CUDA device (move it with .to({str(device) if device.type == 'cuda' else 'cuda'!r}))"
            )
        if t.device != device:
            raise KernelInputError(
                f"{op}: input {decl.name!r} is on {t.device} but {plan.tensor_decls[0].name!r} is on "
                f"{device}; move all tensor inputs to one device"
            )
    return device



def check_ranks(op: str, plan: KernelPlan, tensors: Sequence[torch.Tensor]) -> None:
    """Each tensor input has the axes the spec's extras, output shapes and geometry read."""
    for decl, t, need in zip(plan.tensor_decls, tensors, plan.input_ranks):
        if need is not None and t.dim() < need[0]:
            raise KernelInputError(
                f"{op}: input {decl.name!r} has {_axes(t.dim())} (shape {tuple(t.shape)}), but {need[1]} reads "
                f"{_axes(need[0])}; give it at least {_axes(need[0])} (a reshape adding leading 1s keeps its values)"
            )


def _axes(n: int) -> str:
    return f"{n} axis" if n == 1 else f"{n} axes"


def check_shapes(op: str, plan: KernelPlan, tensors: Sequence[torch.Tensor], out_shape0: Optional[Sequence[Any]]) -> None:
    """Elementwise inputs must have output 0's shape; Reduction and Custom inputs the shape of the first
    input that is not broadcast, as the kernel reads them alongside it (a kernel reading inputs of other
    shapes gets a ``meta_fn``, which owns the checks); a broadcast input (any geometry) must be the
    trailing axes of the shape it is read against, leading 1s allowed.

    That is the broadcast a kernel can index from its sizes alone (``b[i % numel(b)]``); a
    ``(N, 1)`` operand against ``(N, D)`` would need strides the calling convention does not pass,
    so it is refused rather than read wrongly. Broadcast inputs are read against output 0 for
    Elementwise kernels, else against the first input that is not broadcast.
    """
    if out_shape0 is not None and len(out_shape0) < plan.min_out_rank:
        raise KernelInputError(
            f"{op}: the 'nd' launch tiles the last {plan.min_out_rank} axes of the output, "
            f"which has rank {len(out_shape0)}"
        )
    if plan.elementwise:
        if out_shape0 is None:
            return
        out, against, ref_name = list(out_shape0), "the output shape", None
    else:
        ref = next((t for d, t in zip(plan.tensor_decls, tensors) if not d.broadcast), None)
        if ref is None:
            return
        ref_name = repr(next(d.name for d in plan.tensor_decls if not d.broadcast))
        out, against = list(ref.shape), f"the shape of {ref_name}"
    for decl, t in zip(plan.tensor_decls, tensors):
        shape = list(t.shape)
        if decl.broadcast:
            while shape and _is_concrete(shape[0]) and shape[0] == 1 and len(shape) > 0:
                shape.pop(0)
            ok = len(shape) <= len(out) and all(_eq(s, o) for s, o in zip(reversed(shape), reversed(out)))
            if not ok:
                raise KernelInputError(
                    f"{op}: input {decl.name!r} has shape {tuple(t.shape)}, which does not broadcast "
                    f"to {against} {tuple(out)} as the kernel reads it: a broadcast input must equal the "
                    f"trailing axes (leading 1s allowed); expand it with .expand({tuple(out)}).contiguous()"
                )
        elif len(shape) != len(out) or not all(_eq(s, o) for s, o in zip(shape, out)):
            if not plan.elementwise and out_shape0 is not None and _same(shape, list(out_shape0)):
                continue  # one value per row (labels, a per-row scale): output 0's shape, indexed as it is
            if plan.elementwise:
                raise KernelInputError(
                    f"{op}: input {decl.name!r} has shape {tuple(shape)} but the output has shape "
                    f"{tuple(out)}; an Elementwise kernel needs equal shapes (declare "
                    f"InputDecl({decl.name!r}, broadcast=True) for an input it broadcasts)"
                )
            trailing = len(shape) < len(out) and _same(shape, out[len(out) - len(shape):])
            fix = (f"declare InputDecl({decl.name!r}, broadcast=True) for an operand it indexes by trailing axes "
                   f"(a (D,) weight), or " if trailing else "")
            per_row = (f" or output 0's {tuple(out_shape0)} (one value per row)"
                       if out_shape0 is not None and not _same(list(out_shape0), out) else "")
            raise KernelInputError(
                f"{op}: input {decl.name!r} has shape {tuple(shape)} but {ref_name} has {tuple(out)}; the kernel "
                f"reads its inputs alongside {ref_name}, so an input needs its shape{per_row}: {fix}give the op "
                f"a meta_fn that checks the shapes its kernel reads"
            )


def _same(shape: Sequence[Any], other: Sequence[Any]) -> bool:
    """Equal shapes, without a runtime assert for symbolic sizes that may differ."""
    return len(shape) == len(other) and all(
        (a == b) if _is_concrete(a) and _is_concrete(b) else statically_known_true(a == b)
        for a, b in zip(shape, other))


def _eq(a: Any, b: Any) -> bool:
    """Size equality that works for SymInts: a runtime assert, not a specialisation."""
    if _is_concrete(a) and _is_concrete(b):
        return a == b
    torch._check(a == b, lambda: f"size {a} must equal {b}")
    return True


def check_int32(op: str, labels: Sequence[str], values: Sequence[int]) -> None:
    for label, v in zip(labels, values):
        if v > INT32_MAX:
            limit = f"{label} is {v}, past the 32-bit int the kernel takes (at most {INT32_MAX})"
            raise SizeLimitError(f"{op}: {limit}; split the tensor or use a kernel with 64-bit sizes", limit)


def check_grid(op: str, grid: Sequence[int]) -> None:
    limits = (INT32_MAX, 65535, 65535)
    for axis, (g, limit) in enumerate(zip(grid, limits)):
        if g > limit:
            past = f"grid {tuple(grid)} is past CUDA's limit of {limit} blocks on axis {'xyz'[axis]}"
            raise SizeLimitError(f"{op}: {past}; the input is too large for this launch geometry", past)


_WARNED_NO_BACKWARD = []


def warn_no_backward(op: str, tensors: Sequence[Any]) -> None:
    """A call whose inputs require grad in grad mode: fxkern ops have no backward, so on CUDA and
    under torch.compile no gradient reaches those inputs, and torch says so only at backward, in
    its own words (training a rewritten program left grad None; found by a probe). Once a process."""
    if (not _WARNED_NO_BACKWARD and torch.is_grad_enabled() and torch._C._any_requires_grad(*[t for t in tensors if isinstance(t, torch.Tensor)])
            and not torch.compiler.is_exporting()):  # an exported program has no backward to lose
        warnings.warn(
            f"{op}: called with inputs that require grad; fxkern ops have no backward, so no gradient reaches "
            f"those inputs through this call on CUDA or under torch.compile (on the CPU its reference runs and "
            f"passes them). For inference run under torch.inference_mode() or torch.no_grad(); to train, compile "
            f"the model with torch.compile(model, backend=fxkern.backend(rules)), which rewrites the graphs after "
            f"autograd split them (said once, for the first such op)", UserWarning, stacklevel=3)
        _WARNED_NO_BACKWARD.append(op)


def check_no_blocks(op: str, grid: Sequence[int], names: Sequence[str], outputs: Sequence[Any]) -> None:
    """A grid of no blocks launches nothing, which is right for empty outputs only: otherwise the
    outputs would be returned unwritten (``torch.empty``'s garbage)."""
    unwritten = next(((name, tuple(o.shape)) for name, o in zip(names, outputs) if o.numel()), None)
    if unwritten is None and min(grid) == 0:
        return
    left = f": output {unwritten[0]!r} {unwritten[1]} would be left unwritten" if unwritten else ""
    raise KernelInputError(
        f"{op}: the launch geometry gives grid {tuple(grid)} for these inputs, so no block runs{left}; "
        f"a grid that rounds down (n // 256) must round up (fxkern.cdiv(n, 256))"
    )


def check_scalars(op: str, slots: Sequence[Any], args: Sequence[Any]) -> None:
    """The fake impl's check of the scalars the launch coerces (``slots``: (position, name, type));
    symbolic ones are left to the launch. A 2**40 for a 32-bit int was accepted by a rewrite and
    refused at run time (found by a probe)."""
    for i, name, py_type in slots:
        if i < len(args) and not isinstance(args[i], (torch.SymInt, torch.SymFloat, torch.SymBool)):
            coerce_scalar(op, name, py_type, args[i])


def coerce_scalar(op: str, name: str, py_type: type, value: Any) -> Any:
    if py_type is bool:
        if not isinstance(value, (bool, int)):
            raise KernelInputError(f"{op}: scalar {name!r} must be a bool, got {value!r}")
        return bool(value)
    if py_type is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise KernelInputError(f"{op}: scalar {name!r} must be an int, got {value!r}")
        if not -(2**31) <= value <= INT32_MAX:
            raise KernelInputError(f"{op}: scalar {name!r} = {value} does not fit the kernel's 32-bit int")
        return value
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise KernelInputError(f"{op}: scalar {name!r} must be a float, got {value!r}")
    return float(value)
