"""Calls past a kernel's 32-bit limits, run as several calls within them.

An op registered with ``past_limits="split"`` promises that its outputs are independent problems
along every axis but the last: output index i on axis a reads only index i of each tensor input's
axis aligned with a (PyTorch's broadcasting: shapes aligned from the right, a size-1 axis read by
every index), and its scalars mean the same for every piece. Row kernels (norms, softmaxes) and
elementwise ones are such ops. Attention's scores at batch 1, 32 heads and 8192 keys hold 2^31
elements, one past what a 32-bit index reaches: run in two calls of 16 heads, each is the kernel's
usual launch, where the alternative was PyTorch's own kernels at eager speed.

Each piece's launch writes its part of the whole call's outputs where it can (``into``): copying
each piece's result into place instead ran the cut calls at 40-60% of a copy's bandwidth on an H200,
where the kernels on half the call ran at 66-100% (docs/benchmarks.md, ``past_int32``). A launch
whose signature it has seen before takes the part before allocating anything (``take``); the first
launch of a signature works out its outputs, and so allocates a piece's outputs once, then drops them.
"""
from __future__ import annotations

import contextvars
import dataclasses
import itertools
import math
from typing import Any, Callable, Optional, Sequence, Tuple

import torch

from fxkern.errors import SpecError

# Elements a piece holds at most: half the 32-bit range, so the sizes a kernel computes from it
# (counts rounded up to whole blocks or packs) stay well inside it, and a piece is still big
# enough (2 GiB of bfloat16) to fill any GPU.
PIECE = 2**30

# The output slices the piece now running should write: set by ``run`` around each piece's call, taken
# (once) by the first launch whose outputs they match (``into``).
_DESTINATION: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar("fxkern_split_destination",
                                                                             default=None)


@dataclasses.dataclass(frozen=True)
class Split:
    """Where a call is cut: along the outputs' ``axis``, each piece ``(at, start, length)`` one index
    of every axis before it (``at``) and ``length`` indices of ``axis`` from ``start``."""

    axis: int
    pieces: Tuple[Tuple[Tuple[int, ...], int, int], ...]


def plan(inputs: Sequence[Optional[Sequence[int]]], outputs: Sequence[Sequence[int]],
         most: int = PIECE) -> Optional[Split]:
    """How to cut a call whose tensor inputs have the shapes ``inputs`` (None for a scalar argument)
    and whose outputs have ``outputs`` into pieces of at most ``most`` elements each (a broadcast input
    counts whole: every piece reads it), at least two. Axes before the last may be cut where every
    output has the first output's size and every input that size or 1; the cut is along the first such
    axis longer than 1 on which one index fits in ``most`` (attention's scores at batch 2: one batch
    index is 2^31 elements, so each piece is one batch index and half its heads), else the last such
    axis, one index a piece. None where the call cannot be cut: the caller runs it another way."""
    if not outputs or len(outputs[0]) < 2:
        return None
    rank, first = len(outputs[0]), tuple(outputs[0])
    tensors = [tuple(s) for s in inputs if s is not None]
    if any(len(o) != rank for o in outputs) or any(len(s) > rank for s in tensors):
        return None
    cuttable = 0
    for a in range(rank - 1):
        if any(o[a] != first[a] for o in outputs) or any(_size(s, rank, a) not in (1, first[a]) for s in tensors):
            break
        cuttable = a + 1
    longer = [a for a in range(cuttable) if first[a] > 1]
    if not longer:
        return None
    shapes = tensors + [tuple(o) for o in outputs]

    def per_index(a: int) -> int:  # the elements a piece holds for each index of axis a it takes
        return max(math.prod(s) // math.prod(_size(s, rank, b) for b in range(a + 1)) for s in shapes)

    axis = next((a for a in longer if per_index(a) <= most), longer[-1])
    n, before = first[axis], math.prod(first[:axis])
    fit = max(1, most // max(1, per_index(axis)))  # indices of the axis a piece may take (an empty call: all)
    count = min(n, max(1 if before > 1 else 2, -(-n // fit)))
    step = -(-n // count)  # balanced: no more than ``fit``
    return Split(axis, tuple((at, start, min(step, n - start)) for at in itertools.product(*map(range, first[:axis]))
                             for start in range(0, n, step)))


def run(call: Callable[..., Any], args: Tuple[Any, ...], cut: Split, expected: Tuple[torch.Tensor, ...],
        single: bool, op: str = "op") -> Any:
    """``call`` on each piece of ``args`` that ``cut`` gives, its results in outputs laid out as
    ``expected`` (the fake impl's outputs for the whole call) says: written there by the piece's launch
    (``into``), else copied. A piece still past the limits is ``call``'s to handle (it cuts again, or
    runs the reference). ``op`` names the op in errors."""
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    outs = [torch.empty_strided(e.shape, e.stride(), dtype=e.dtype, device=device) for e in expected]
    for at, start, length in cut.pieces:
        _run_piece(call, args, outs, cut.axis, at, start, length, op)  # a function: its results die with it
    return outs[0] if single else tuple(outs)


def _run_piece(call: Callable[..., Any], args: Tuple[Any, ...], outs: Sequence[torch.Tensor], axis: int,
               at: Tuple[int, ...], start: int, length: int, op: str) -> None:
    rank = outs[0].dim()
    piece = tuple(_narrow(a, rank, axis, at, start, length) for a in args)
    parts = [_narrow(o, rank, axis, at, start, length) for o in outs]
    token = _DESTINATION.set([parts])
    try:
        results = _as_tuple(call(*piece))
    finally:
        _DESTINATION.reset(token)
    if len(results) != len(parts) or any(not isinstance(r, torch.Tensor) or r.shape != p.shape or r.dtype != p.dtype
                                         for r, p in zip(results, parts)):
        got = [f"{r.dtype} {tuple(r.shape)}" if isinstance(r, torch.Tensor) else repr(r) for r in results]
        raise SpecError(f"{op}: a piece of a call cut past the kernel's limits returned {got}, where its part of the "
                        f"fake impl's outputs is {[f'{p.dtype} {tuple(p.shape)}' for p in parts]}: the op's CUDA impl "
                        f"and its fake impl (meta_fn) disagree")
    # a result in another output's part (outputs returned in another order than launched) is read
    # before any copy writes over it
    whole = {o.untyped_storage().data_ptr() for o in outs}
    pending = [(p, r.clone() if r.untyped_storage().data_ptr() in whole else r)
               for p, r in zip(parts, results) if not _same_memory(p, r)]
    for part, result in pending:
        part.copy_(result)


def into(outs: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """The outputs a launch writes: inside a piece of a cut call (``run``), that piece's parts of the
    whole call's outputs, where they match ``outs`` (shapes, dtypes, devices, and layouts the kernel
    writes alike); else ``outs``. Taken once a piece: an eager_fn's later launches get their own. A
    launch that took them for an intermediate is still right: ``run`` copies the piece's result over."""
    parts = take(describe(outs))
    return outs if parts is None else parts


def describe(outs: Sequence[torch.Tensor]) -> Tuple[Tuple[Any, ...], ...]:
    """What ``take`` compares of a launch's outputs: each one's shape, dtype, device and layout."""
    return tuple((o.shape, o.dtype, o.device, o.stride(), o.is_contiguous()) for o in outs)


def take(described: Tuple[Tuple[Any, ...], ...]) -> Optional[list]:
    """``into`` for a launch that knows its outputs (``describe``) before allocating them: the piece's
    parts, or None outside a piece or where they do not match (the launch allocates its own then)."""
    held = _DESTINATION.get()
    if not held:
        return None
    parts = held[0]
    if len(parts) != len(described) or not all(_alike(p, d) for p, d in zip(parts, described)):
        return None
    held.clear()
    return list(parts)


def _alike(part: torch.Tensor, described: Tuple[Any, ...]) -> bool:
    shape, dtype, device, stride, contiguous = described
    return (part.shape == shape and part.dtype == dtype and part.device == device
            and ((part.is_contiguous() and contiguous) or part.stride() == stride))


def _same_memory(part: torch.Tensor, result: torch.Tensor) -> bool:
    return (result.data_ptr() == part.data_ptr() and result.shape == part.shape
            and (result.stride() == part.stride() or (result.is_contiguous() and part.is_contiguous())))


def _size(shape: Sequence[int], rank: int, axis: int) -> int:
    """``shape``'s size on the axis aligned with the outputs' ``axis`` (1 where it has none)."""
    at = axis - (rank - len(shape))
    return shape[at] if at >= 0 else 1


def _narrow(arg: Any, rank: int, axis: int, at: Tuple[int, ...], start: int, length: int) -> Any:
    """``arg``'s part for one piece: a tensor sliced to index ``at[b]`` of each axis aligned with an
    axis b before the outputs' ``axis``, and to ``length`` from ``start`` on the one aligned with it,
    where it has those axes longer than 1 (a broadcast axis is read whole by every piece); else ``arg``."""
    if not isinstance(arg, torch.Tensor):
        return arg
    offset = rank - arg.dim()
    for b, (lo, n) in enumerate([(i, 1) for i in at] + [(start, length)]):
        if b - offset >= 0 and arg.shape[b - offset] > 1:
            arg = arg.narrow(b - offset, lo, n)
    return arg


def _as_tuple(result: Any) -> Tuple[Any, ...]:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)
