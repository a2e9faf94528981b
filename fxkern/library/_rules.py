"""Helpers the library's modules share: launch geometries, rule registration, match filters."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxkern.errors import KernelInputError
from fxkern.library.cuda_common import ELEMS_PER_THREAD, EW_BLOCK, ROW_BLOCK
from fxkern.ops import kernel_op
from fxkern.patterns import TRACERS
from fxkern.rules import Rule, RuleSet, replace
from fxkern.spec import KernelSpec
from fxkern.symbolic import cdiv

NAMESPACE = "fxkern_lib"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Every pattern IR but inductor's, for rules that inductor's own fusion beats (``replace(irs=...)``).
COMPILE_FREE_IRS = tuple(ir for ir in TRACERS if ir != "inductor")


def elementwise_geometry(inputs, outputs):
    """EW_BLOCK threads a block, ELEMS_PER_THREAD elements a thread, over output 0."""
    return (cdiv(outputs[0].numel(), EW_BLOCK * ELEMS_PER_THREAD),), (EW_BLOCK,)


def row_geometry_16k(inputs, outputs):
    """One 256-thread block per 16384 elements of input 0; it takes the rows that start there. 16384
    is a register-full of a 16-bit softmax block (256 threads, 8 packs of 8 elements each), so a
    block runs one pass of whole rows at the row lengths attention has."""
    return (cdiv(inputs[0].numel(), 16384),), (ROW_BLOCK,)


def row_geometry_8k(inputs, outputs):
    """One 256-thread block per 8192 elements of input 0: a register-full of the float32 row kernels
    (8 packs of 4 a thread) and of RMSNorm's 16-bit one (4 packs of 8). A float32 softmax block given
    two (16384) runs two passes, so the last wave of blocks is twice as long: 0-5% slower
    (benchmarks/row_tuning.py --softmax)."""
    return (cdiv(inputs[0].numel(), 8192),), (ROW_BLOCK,)


def aligned_at_launch(t: torch.Tensor) -> bool:
    """Whether the kernel will see ``t`` 16-byte aligned: a non-contiguous tensor is copied to a fresh
    (aligned) buffer before launch, a contiguous one is passed as it is."""
    return not t.is_contiguous() or t.data_ptr() % 16 == 0


def per_call(pick: Callable[..., str], names: Sequence[str]) -> Callable[..., Any]:
    """A public op's CUDA implementation that runs, each call, the private op ``pick(*args)`` names
    (one of ``names``, all registered), launched directly rather than through the dispatcher: the
    library's way of choosing a kernel or a grid by the call's dtype and sizes."""
    impls = {name: kernel_op(name).cuda_impl for name in names}

    def on_cuda(*args, **kwargs):
        return impls[pick(*args, **kwargs)](*args, **kwargs)

    return on_cuda


def permuted_rows(x: torch.Tensor) -> bool:
    """Whether x is not contiguous but its rows (last axis) lie whole in memory, each contiguous, in
    another order of the other axes: a permuted view of a contiguous tensor, such as attention's
    ``(B, H, S, D)`` view of the ``(B, S, H, D)`` projection. A row kernel reads and writes such an x
    as the ``(numel / D, D)`` matrix it is in memory; eager PyTorch's elementwise ops keep its layout."""
    if x.dim() < 2 or x.is_contiguous() or x.stride(-1) != 1:
        return False
    return torch.empty_like(x, device="meta").stride() == x.stride()  # dense, not overlapping


def keeps_row_layout(fake: Callable[..., Any]) -> Callable[..., Any]:
    """A row op's meta_fn: ``fake`` (the contiguous-output fake impl of the kernel it runs, which
    checks the call), its output laid out as x where x has ``permuted_rows``, as the eager pattern's
    elementwise ops lay it out. Pair it with ``rows_in_place``."""

    def meta(x, *args):
        out = fake(x, *args)
        return torch.empty_like(x) if permuted_rows(x) else out

    return meta


def rows_in_place(on_cuda: Callable[..., Any]) -> Callable[..., Any]:
    """A row op's CUDA implementation for x of any layout: ``on_cuda`` on the ``(numel / D, D)`` matrix
    an x with ``permuted_rows`` is in memory, its result given back in x's layout (no copy of x
    first, as a contiguous-input kernel would make); other layouts go to ``on_cuda`` as they are."""
    decided: dict = {}

    def on_cuda_any_layout(x, *args):
        if x.is_contiguous():
            return on_cuda(x, *args)
        key = (x.shape, x.stride())
        permuted = decided.get(key)
        if permuted is None:
            if len(decided) >= 1024:
                decided.clear()
            permuted = decided[key] = permuted_rows(x)
        if not permuted:
            return on_cuda(x, *args)
        d = x.shape[-1]
        y = on_cuda(x.as_strided((x.numel() // d, d), (d, 1)), *args)
        return y.as_strided(x.shape, x.stride())

    return on_cuda_any_layout


def add_rule(rules: RuleSet, pattern: Callable[..., Any], target: Any, name: str,
             filter: Callable[[Any], bool] | None = None, irs: Sequence[str] | None = None,
             example_inputs: Sequence[Any] | Callable[[torch.dtype], Sequence[Any]] | None = None,
             priority: int | None = None, dtypes: Sequence[torch.dtype] | None = None) -> Rule:
    """``fxkern.replace`` into the library's rule set, the op named ``fxkern_lib::<name>``. A kernel
    given as a spec is an elementwise or row kernel (GELU, the gates, the residual norms): calls past
    its 32-bit sizes run in pieces (``past_limits="split"``)."""
    return replace(pattern, target, name=f"{NAMESPACE}::{name}", rules=rules, filter=filter, irs=irs,
                   example_inputs=example_inputs, priority=priority, dtypes=dtypes,
                   past_limits="split" if isinstance(target, KernelSpec) else "reference")


# The anchor dtypes of a pattern that computes in float32 between 16-bit values: in float32 its casts
# vanish and it is another rule's pattern, which that rule takes.
SIXTEEN_BIT = (torch.float16, torch.bfloat16)


# ---- filters: what the pattern's structure cannot say about its inputs' shapes ----------------------


def _shape(node: Any) -> Sequence[Any] | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _is_one(d: Any) -> bool:
    return statically_known_true(d == 1)


def is_suffix_broadcast(small: Sequence[Any], full: Sequence[Any]) -> bool:
    """True when ``small`` (leading 1s dropped) equals the trailing axes of ``full``.

    Those are the shapes the kernels broadcast by indexing ``i % numel(small)``.
    """
    s = list(small)
    while s and _is_one(s[0]):
        s.pop(0)
    if len(s) > len(full):
        return False
    tail = list(full)[len(full) - len(s):]
    return all(statically_known_true(a == b) for a, b in zip(s, tail))


def suffix_broadcast(full: str, *others: str) -> Callable[[Any], bool]:
    """A filter: each of ``others`` broadcasts onto ``full`` as a suffix (a ``(D,)`` bias onto ``(..., D)``)."""

    def accept(match: Any) -> bool:
        f = _shape(match.bindings.get(full))
        if f is None:
            return False
        for name in others:
            s = _shape(match.bindings.get(name))
            if s is None or not is_suffix_broadcast(s, f):
                return False
        return True

    accept.__name__ = f"{'_'.join(others)}_broadcasts_onto_{full}"
    return accept


def row_param(x: str, weight: str, same_shape: str | None = None) -> Callable[[Any], bool]:
    """A filter for row kernels: ``x`` has at least one axis, ``weight`` is ``(D,)`` (leading 1s
    allowed), and ``same_shape`` (a residual added to ``x``), if named, has ``x``'s shape."""

    def accept(match: Any) -> bool:
        xs, ws = _shape(match.bindings.get(x)), _shape(match.bindings.get(weight))
        if xs is None or ws is None or len(xs) == 0:
            return False
        if same_shape is not None:
            rs = _shape(match.bindings.get(same_shape))
            if rs is None or len(rs) != len(xs) or not all(statically_known_true(a == b) for a, b in zip(rs, xs)):
                return False
        w = [d for d in ws]
        while len(w) > 1 and _is_one(w[0]):
            w.pop(0)
        return len(w) == 1 and statically_known_true(w[0] == xs[-1])

    accept.__name__ = f"{weight}_is_a_row_of_{x}"
    return accept


def is_contiguous(node: Any) -> bool:
    """Whether a graph value is laid out contiguously (decided without guarding on symbolic sizes)."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return False
    expected = 1
    for size, stride in reversed(list(zip(val.shape, val.stride()))):
        if _is_one(size):
            continue
        if not statically_known_true(stride == expected):
            return False
        expected = expected * size
    return True


def has_rows(x: str) -> Callable[[Any], bool]:
    """A filter: ``x`` has at least one axis (the row kernels reduce over the last)."""

    def accept(match: Any) -> bool:
        xs = _shape(match.bindings.get(x))
        return xs is not None and len(xs) > 0

    accept.__name__ = f"{x}_has_rows"
    return accept


# ---- attention's 4-d operands: a mask or a cos/sin table that broadcasts onto (B, H, S, D) --------------


def broadcasts_4d(t: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether 4-d ``t`` broadcasts onto 4-d ``x`` as the attention kernels read it: each of its first
    three axes 1 or ``x``'s size, its last ``x``'s last (decided without guarding on symbolic sizes)."""
    return (t.dim() == 4 and x.dim() == 4 and statically_known_true(t.shape[3] == x.shape[3])
            and all(statically_known_true(m == 1) or statically_known_true(m == s) for m, s in zip(t.shape[:3], x.shape[:3])))


def check_broadcast_4d(op: str, name: str, t: torch.Tensor, onto: str, x: torch.Tensor) -> None:
    """The op's check behind :func:`broadcasts_4d`: a clear error for concrete sizes, a runtime
    assertion (``torch._check``) for symbolic ones."""
    for axis in range(4):
        m, s = t.shape[axis], x.shape[axis]
        if axis < 3 and isinstance(m, int) and m == 1:
            continue
        if isinstance(m, int) and isinstance(s, int):
            if m != s:
                raise KernelInputError(
                    f"{op}: {name} {tuple(t.shape)} does not broadcast onto {onto} {tuple(x.shape)} as the kernel "
                    f"reads it: each of its first three axes must be 1 or match {onto}'s, its last {onto}'s last")
        else:
            torch._check(m == s, lambda: f"{op}: {name} {tuple(t.shape)} must broadcast onto {onto} {tuple(x.shape)}")
