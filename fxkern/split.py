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
where the kernels on half the call ran at 66-100% (docs/benchmarks.md, ``past_int32``).
"""
from __future__ import annotations

import contextvars
import dataclasses
import math
from typing import Any, Callable, Optional, Sequence, Tuple

import torch

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
    """Where a call is cut: the outputs' ``axis``, and each piece's (start, length) along it."""

    axis: int
    pieces: Tuple[Tuple[int, int], ...]


def plan(inputs: Sequence[Optional[Sequence[int]]], outputs: Sequence[Sequence[int]],
         most: int = PIECE) -> Optional[Split]:
    """How to cut a call whose tensor inputs have the shapes ``inputs`` (None for a scalar argument)
    and whose outputs have ``outputs`` into pieces of at most ``most`` elements each (at least two
    pieces: the call was refused as it was). The axis is the outputs' first one longer than 1 that is
    not their last; every output must have the first output's rank and sizes up to it, and every
    input the same size on it or 1 (or no such axis). None where the call cannot be cut so: the caller
    runs it another way."""
    if not outputs:
        return None
    rank, first = len(outputs[0]), tuple(outputs[0])
    axis = next((a for a in range(rank - 1) if first[a] > 1), None)
    if axis is None:
        return None
    if any(len(o) != rank or tuple(o[:axis + 1]) != first[:axis + 1] for o in outputs):
        return None
    n = first[axis]
    for shape in inputs:
        if shape is None:
            continue
        if len(shape) > rank:
            return None
        at = axis - (rank - len(shape))
        if at >= 0 and shape[at] not in (1, n):
            return None
    biggest = max(math.prod(s) for s in list(inputs) + list(outputs) if s is not None)
    count = min(n, max(2, -(-biggest // most)))
    step = -(-n // count)
    return Split(axis, tuple((start, min(step, n - start)) for start in range(0, n, step)))


def run(call: Callable[..., Any], args: Tuple[Any, ...], cut: Split,
        expected: Tuple[torch.Tensor, ...], single: bool) -> Any:
    """``call`` on each piece of ``args`` that ``cut`` gives, its results in outputs laid out as
    ``expected`` (the fake impl's outputs for the whole call) says: written there by the piece's launch
    (``into``), else copied. A piece still past the limits is ``call``'s to handle (it cuts again, or
    runs the reference)."""
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    outs = [torch.empty_strided(e.shape, e.stride(), dtype=e.dtype, device=device) for e in expected]
    rank = len(expected[0].shape)
    for start, length in cut.pieces:
        piece = tuple(_narrow(a, rank, cut.axis, start, length) for a in args)
        parts = [out.narrow(cut.axis, start, length) for out in outs]
        token = _DESTINATION.set([parts])
        try:
            results = _as_tuple(call(*piece))
        finally:
            _DESTINATION.reset(token)
        for part, result in zip(parts, results):
            if not _same_memory(part, result):
                part.copy_(result)
    return outs[0] if single else tuple(outs)


def into(outs: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """The outputs a launch writes: inside a piece of a cut call (``run``), that piece's parts of the
    whole call's outputs, where they match ``outs`` (shapes, dtypes, devices, and layouts the kernel
    writes alike); else ``outs``. Taken once a piece: an eager_fn's later launches get their own. A
    launch that took them for an intermediate is still right: ``run`` copies the piece's result over."""
    held = _DESTINATION.get()
    if not held:
        return outs
    parts = held[0]
    if len(parts) != len(outs) or not all(_alike(p, o) for p, o in zip(parts, outs)):
        return outs
    held.clear()
    return list(parts)


def _alike(part: torch.Tensor, out: torch.Tensor) -> bool:
    return (part.shape == out.shape and part.dtype == out.dtype and part.device == out.device
            and ((part.is_contiguous() and out.is_contiguous()) or part.stride() == out.stride()))


def _same_memory(part: torch.Tensor, result: torch.Tensor) -> bool:
    return (result.data_ptr() == part.data_ptr() and result.shape == part.shape
            and (result.stride() == part.stride() or (result.is_contiguous() and part.is_contiguous())))


def _narrow(arg: Any, rank: int, axis: int, start: int, length: int) -> Any:
    """``arg``'s part for one piece: a tensor's slice on the axis aligned with the outputs' ``axis``
    where it has one longer than 1 (a broadcast axis is read whole by every piece); else ``arg``."""
    if not isinstance(arg, torch.Tensor):
        return arg
    at = axis - (rank - arg.dim())
    if at < 0 or arg.shape[at] == 1:
        return arg
    return arg.narrow(at, start, length)


def _as_tuple(result: Any) -> Tuple[Any, ...]:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)
