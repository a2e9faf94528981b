"""DeepSeek-V3's rotary embedding: columns in pairs ``(2j, 2j + 1)``, rotated into halves ``(j, D/2 + j)``.

DeepSeek-V3 (and the families that reuse its attention: Kimi K2, GLM-4 MoE Lite, LongCat Flash,
Mistral 4, ...) stores each rotated pair side by side, but rotates as ``rotate_half`` does, so its
result has the pairs' first elements in the first half and their second in the other. transformers
5.24 writes it on the even and odd columns::

    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(1)
    q1, q2 = q[..., 0::2], q[..., 1::2]
    q_embed = torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1)

and before it (transformers 4.x to 5.17) de-interleaved a copy of q first, then rotated it whole::

    b, h, s, d = q.shape
    q = q.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    q_embed = (q * cos) + (rotate_half(q) * sin)

Both are one op here, ``deinterleaved_rotary_embedding``: an item loads 2V neighbouring columns
(V pairs), splits them into the pairs' first and second elements, rotates them with
:mod:`~fxkern.library.rotary`'s packed arithmetic and stores each half, one pass where eager ran
six or seven kernels (and the old form a copy before them). ``cos`` and ``sin`` are half the head
wide (the new form's slice, the same angle for both halves) or the whole head (the old form's
``cat(freqs, freqs)``, its second half read for the second half of the result). x is read where it
lies (the queries' ``split`` of MLA's projection); the result is contiguous, as eager's ``cat`` and
``reshape`` make it.

GPT-OSS rotates ``torch.chunk``'s halves as ``rotate_half`` does, but against tables half the head
wide (its rotary embedding returns ``freqs``' cos and sin, not ``cat(freqs, freqs)``), which no
``rotary_embedding`` kernel reads: ``chunked_rotary_embedding`` is the same kernels reading x's
halves where they read its pairs.

Numbers: eager's roundings are kept (each product, then the sum or difference), so results equal
eager's to the bit in every dtype.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxkern.errors import KernelInputError
from fxkern.library import rotary
from fxkern.library._rules import COMPILE_FREE_IRS, DTYPES, NAMESPACE, add_rule
from fxkern.ops import Signatures, cuda_kernel_op, tensor_signature
from fxkern.spec import Custom, DimSize, InputDecl, KernelSpec, Numel, OutputDecl, SameAs, ScalarInput

SOURCE = rotary.SOURCE + r"""
namespace fxk {
// Rows of D = 2 * half columns in pairs (2j, 2j + 1): an item takes V pairs (2V columns: two 16-byte
// packs), their first elements a and second b, and writes y_j = a*c_j - b*s_j to the first half and
// y_half+j = b*c'_j + a*s'_j to the second, (c', s') the tables' columns half + j where they are the
// whole head wide (tw = 2 * half), else their columns j again (tw = half); their rows ts elements apart
// (the new form's tables are a slice of whole ones, read in place). y is contiguous (B, H, S, D).
// PAIRS false: x's halves are a and b, as rotate_half reads them (GPT-OSS's chunked form, its tables
// half the head wide).
template <typename T, int V, bool PAIRS = true>
__device__ __forceinline__ void deinterleaved_rows(const T* __restrict__ x, const T* __restrict__ cs,
                                                   const T* __restrict__ sn, unsigned half, unsigned tw, unsigned ts,
                                                   unsigned B, const Rows& w, unsigned cB, unsigned cH, unsigned cS,
                                                   T* __restrict__ y) {
    const unsigned D = 2 * half, P = half / V, second = tw > half ? half : 0u;
    const unsigned items = B * w.A1 * w.A2 * P;
    const size_t head = (size_t)w.S * D;
    const TableRows table(cB, cH, cS);
    unsigned lo, hi;
    block_share(items, lo, hi);
    for (unsigned i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const unsigned r = i / P, j = i - r * P;
        unsigned b, h, s;
        const size_t xo = w.locate(r, b, h, s);
        const size_t out = w.out(r, b, h, s, 1, D, head);
        const unsigned col = j * V;  // in each half of y; x's columns 2 * col to 2 * col + 2V (PAIRS)
        // x's loads issued first, then the tables' (the de-interleaving kernel's order since it shipped)
        const Pack<T, 2 * V> xv = PAIRS ? load_cols<T, V, 2 * V>(x + xo + 2 * col) : Pack<T, 2 * V>{};
        const Pack<T, V> xh = PAIRS ? Pack<T, V>{} : load<T, V>(x + xo + col);
        const Pack<T, V> xg = PAIRS ? Pack<T, V>{} : load<T, V>(x + xo + half + col);
        const size_t co = (size_t)table(b, h, s) * ts + col;
        const Pack<T, V> ca = load<T, V>(cs + co), cb = load<T, V>(cs + co + second);
        const Pack<T, V> sa = load<T, V>(sn + co), sb = load<T, V>(sn + co + second);
        Pack<T, V> xa, xb, ya, yb;
        if constexpr (PAIRS) {
#pragma unroll
            for (int k = 0; k < V; ++k) {
                xa.v[k] = xv.v[2 * k];
                xb.v[k] = xv.v[2 * k + 1];
            }
        } else {
            xa = xh;
            xb = xg;
        }
        rope_packs<T, V>(xa, xb, ca, cb, sa, sb, ya, yb);
        store<T, V>(y + out + col, ya);
        store<T, V>(y + out + half + col, yb);
    }
}

template <typename T, bool PAIRS = true>
__device__ __forceinline__ void deinterleaved(const T* x, const T* cs, const T* sn, int half, int tw, int ts, int B,
                                              const Rows& w, int cB, int cH, int cS, T* y) {
    constexpr int V = 16 / sizeof(T);
    if (half <= 0 || (tw != half && tw != 2 * half) || ts < tw) return;
    const bool packs = half % V == 0 && ts % V == 0 && w.sB % V == 0 && w.s1 % V == 0 && w.s2 % V == 0;
    if (packs && aligned16(x) && aligned16(cs) && aligned16(sn) && aligned16(y))
        deinterleaved_rows<T, V, PAIRS>(x, cs, sn, half, tw, ts, B, w, cB, cH, cS, y);
    else
        deinterleaved_rows<T, 1, PAIRS>(x, cs, sn, half, tw, ts, B, w, cB, cH, cS, y);
}
}  // namespace fxk

// The op's own kernel (what a TensorRT plugin launches): x contiguous (B, A1, A2, D), n its numel;
// cos and sin (cB, cH, cS, tw), tw D / 2 or D.
template <typename T>
__global__ void __launch_bounds__(128) deinterleaved_rotary(const T* x, const T* cs, const T* sn, int n, int A1, int A2,
                                                            int D, int cB, int cH, int cS, int tw, T* y) {
    if (D <= 0 || A1 <= 0 || A2 <= 0) return;
    fxk::deinterleaved<T>(x, cs, sn, D / 2, tw, tw, n / (A1 * A2 * D), fxk::contiguous_rows(A1, A2, D), cB, cH, cS,
                          y);
}

// What the op runs in eager PyTorch: x read where it lies (rotary_strided's walk), the tables' rows ts
// elements apart, y contiguous.
template <typename T>
__global__ void __launch_bounds__(128) deinterleaved_rotary_strided(const T* x_span, const T* cs, const T* sn, int half,
                                                                    int tw, int ts, int B, int A1, int A2, int sB,
                                                                    int s1, int s2, int heads_inner, int cB, int cH,
                                                                    int cS, T* y) {
    fxk::deinterleaved<T>(x_span, cs, sn, half, tw, ts, B, fxk::rows_of(A1, A2, sB, s1, s2, heads_inner), cB, cH, cS,
                          y);
}

// GPT-OSS's chunked form: x's halves rotated (rotate_half's), tables half the head wide (or whole); the
// same two kernels.
template <typename T>
__global__ void __launch_bounds__(128) chunked_rotary(const T* x, const T* cs, const T* sn, int n, int A1, int A2, int D,
                                                      int cB, int cH, int cS, int tw, T* y) {
    if (D <= 0 || A1 <= 0 || A2 <= 0) return;
    fxk::deinterleaved<T, false>(x, cs, sn, D / 2, tw, tw, n / (A1 * A2 * D), fxk::contiguous_rows(A1, A2, D), cB, cH,
                                 cS, y);
}

template <typename T>
__global__ void __launch_bounds__(128) chunked_rotary_strided(const T* x_span, const T* cs, const T* sn, int half,
                                                              int tw, int ts, int B, int A1, int A2, int sB, int s1,
                                                              int s2, int heads_inner, int cB, int cH, int cS, T* y) {
    fxk::deinterleaved<T, false>(x_span, cs, sn, half, tw, ts, B, fxk::rows_of(A1, A2, sB, s1, s2, heads_inner), cB, cH,
                                 cS, y);
}
"""

# x (B, H, S, D) contiguous; cos and sin (cB, cH, cS, tw), each of cB, cH, cS 1 or x's size.
DEINTERLEAVED_ROTARY = KernelSpec(
    SOURCE, "deinterleaved_rotary",
    inputs=[InputDecl("x"), InputDecl("cos"), InputDecl("sin")],
    outputs=[OutputDecl("y", SameAs("x"))],
    extras=[Numel("x"), DimSize("x", 1), DimSize("x", 2), DimSize("x", 3),
            DimSize("cos", 0), DimSize("cos", 1), DimSize("cos", 2), DimSize("cos", 3)],
    geometry=Custom(rotary.rotary_geometry),
    dtypes=DTYPES,
)
# In eager PyTorch: x read in place from x_span at strides sB, s1, s2 (rotary.walk), y contiguous.
_STRIDED_ARGS = ("half", "tw", "ts", "B", "A1", "A2", "sB", "s1", "s2", "heads_inner", "cB", "cH", "cS")
DEINTERLEAVED_ROTARY_STRIDED = KernelSpec(
    SOURCE, "deinterleaved_rotary_strided",
    inputs=[InputDecl("x_span"), InputDecl("cos"), InputDecl("sin"), *[ScalarInput(n, int) for n in _STRIDED_ARGS]],
    geometry=Custom(rotary.rotary_geometry),
    dtypes=DTYPES,
)
_STRIDED_SCHEMA = ("(Tensor x_span, Tensor cos, Tensor sin, " + ", ".join(f"int {n}" for n in _STRIDED_ARGS)
                   + ") -> Tensor")
# GPT-OSS's chunked form: the same kernels reading x's halves.
CHUNKED_ROTARY = dataclasses.replace(DEINTERLEAVED_ROTARY, kernel_name="chunked_rotary")
CHUNKED_ROTARY_STRIDED = dataclasses.replace(DEINTERLEAVED_ROTARY_STRIDED, kernel_name="chunked_rotary_strided")


# ---- the patterns (the first also the op's CPU reference) -----------------------------------------


def deinterleaved_rotary_embedding(x, cos, sin):
    """DeepSeek-V3's ``apply_rotary_pos_emb_interleave`` for one of q, k (transformers 5.24): the even
    and odd columns rotated against half-width tables, ``cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)``.
    As the op's reference, whole-head tables rotate the second half with their second half."""
    half = x.shape[-1] // 2
    if cos.shape[-1] != half:  # the old form's tables (what the op also takes)
        x = x.unflatten(-1, (half, 2)).transpose(-1, -2).flatten(-2)
        return rotary.rotary_embedding(x, cos, sin, half)
    return deinterleaved_rotary_embedding_sliced(x, cos, sin)


def deinterleaved_rotary_embedding_sliced(x, cos, sin):
    """The new form's pattern: even and odd slices, half-width tables (the rule's, found first)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def chunked_rotary_embedding(x, cos, sin):
    """transformers' GPT-OSS ``_apply_rotary_emb`` for one of q, k: ``torch.chunk`` halves rotated
    against half-width tables (its rotary embedding returns ``freqs``' cos and sin, not ``cat(freqs,
    freqs)``), ``cat((first * cos - second * sin, second * cos + first * sin), -1)``. As the op's
    reference, whole-head tables rotate the second half with their second half (``rotate_half``'s form)."""
    if cos.shape[-1] != x.shape[-1] // 2:
        return rotary.rotary_embedding(x, cos, sin, x.shape[-1] // 2)
    return _chunked_pattern(x, cos, sin)


def _chunked_pattern(x, cos, sin):
    """The chunked form's pattern (the rule's): the reference's half-width branch."""
    first, second = torch.chunk(x, 2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def deinterleaved_rotary_embedding_copied(x, cos, sin):
    """The old form's pattern (transformers 4.x to 5.17): ``x.view(b, h, s, d // 2, 2).transpose(4, 3)
    .reshape(b, h, s, d)`` with ``b, h, s, d = x.shape``, then rotated as rotate_half does against
    whole-head tables."""
    b, h, s, d = x.shape
    x = x.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    return rotary.rotary_embedding(x, cos, sin, d // 2)


# ---- checks and output ----------------------------------------------------------------------------

_OP = f"{NAMESPACE}::deinterleaved_rotary_embedding"
_CHUNKED_OP = f"{NAMESPACE}::chunked_rotary_embedding"


def _check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, op: str = _OP) -> None:
    """What the kernels read: 4-d x (B, H, S, D), D even, cos and sin (cB, cH, cS, D / 2 or D) of x's
    dtype, each of cB, cH, cS 1 or x's size (rotary._check's). ``op`` names the op in the errors."""
    d = x.shape[-1] if x.dim() == 4 else None
    if isinstance(d, int) and d % 2:
        raise KernelInputError(f"{op}: x's last axis is {d}, odd; the rotation turns columns j and D/2 + j of its "
                               f"result as a pair, so it takes an even head size")
    half_tables = d is not None and cos.dim() == 4 and statically_known_true(cos.shape[-1] != d)
    w = cos.shape[-1] if cos.dim() else None
    if half_tables and isinstance(d, int) and isinstance(w, int) and w != d // 2:
        raise KernelInputError(f"{op}: cos and sin are {w} columns wide; give them half of x's last axis, {d // 2} "
                               f"(one angle a pair: DeepSeek-V3's cos[..., :d // 2], GPT-OSS's freqs.cos()), or all "
                               f"of it, {d} (cat(freqs, freqs), its second half read for the second half of the result)")
    rotary._check(x, cos, sin, x.shape[-1] // 2 if x.dim() == 4 else 0, op, half_tables=half_tables)


def _output_of(op: str):
    """An op's output (and its fake impl): checks the call, a contiguous tensor of x's shape (eager's
    ``cat`` and ``reshape`` give one)."""

    def output(x, cos, sin):
        _check(x, cos, sin, op)
        return x.new_empty(x.shape)

    return output


_output = _output_of(_OP)


def _strided_output(x_span, cos, sin, half, tw, ts, B, A1, A2, sB, s1, s2, heads_inner, cB, cH, cS):
    """DEINTERLEAVED_ROTARY_STRIDED's output: (B, H, S, 2 * half), contiguous. A private op: the public
    one checks its calls before it runs it."""
    return rotary.strided_output(x_span, 2 * half, B, A1, A2, heads_inner, 1, 0)


def _strided_reference_of(rotate):
    """A strided private op in PyTorch (its CPU impl): x rebuilt from the span and rotated by ``rotate``."""

    def reference(x_span, cos, sin, half, tw, ts, B, A1, A2, sB, s1, s2, heads_inner, cB, cH, cS):
        x = x_span.as_strided((B, A1, A2, 2 * half), (sB, s1, s2, 1))
        cos, sin = (t.as_strided((cB, cH, cS, tw), (cH * cS * ts, cS * ts, ts, 1)) for t in (cos, sin))
        x = x.transpose(1, 2) if heads_inner else x
        return rotate(x, cos, sin).contiguous()

    reference.__name__ = f"{rotate.__name__}_strided"
    return reference


def _eager(strided, op: str = _OP):
    """The op ``op`` on CUDA: checks the call, narrows broadcast tables, and runs the strided kernel on x
    where it lies (rotary.walk; a contiguous copy where it cannot). Decided once per signature."""
    decided = Signatures()

    def on_cuda(x, cos, sin):
        key = tensor_signature(x, cos, sin)
        how = decided.get(key)
        if how is None:
            _check(x, cos, sin, op)
            how = decided.remember(key, (rotary._broadcast_axes(cos, sin), rotary.walk(x) if x.numel() else None))
        axes, layout = how
        if not x.numel():
            return x.new_empty(x.shape)
        x, (b, a1, a2, sb, s1, s2, heads_inner, span) = rotary.walked(op, x, layout)
        cos, sin, dims, ts = _tables(cos, sin, axes)
        return strided(x.as_strided((span,), (1,)), cos, sin, x.shape[-1] // 2, dims[3], ts, b, a1, a2, sb, s1, s2,
                       heads_inner, *dims[:3])

    on_cuda.__name__ = op.split("::")[1]
    return on_cuda


def _tables(cos: torch.Tensor, sin: torch.Tensor,
            axes: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...], int]:
    """cos and sin as the kernel reads them, their broadcast axes narrowed: read in place where their rows
    are evenly spaced with contiguous columns (the new form's ``cos[..., :d // 2]`` of whole tables), as
    the storage span their elements cover (a launch takes contiguous tensors), else contiguous copies;
    with their (cB, cH, cS, width) and the elements between their rows."""
    for axis in axes:
        cos, sin = cos.narrow(axis, 0, 1), sin.narrow(axis, 0, 1)
    dims = tuple(cos.shape)
    pitch = _row_pitch(cos)
    if pitch is not None and pitch == _row_pitch(sin) and pitch != dims[3]:
        span = (dims[0] * dims[1] * dims[2] - 1) * pitch + dims[3]
        if span <= rotary.INT32_MAX:
            return cos.as_strided((span,), (1,)), sin.as_strided((span,), (1,)), dims, pitch
    return cos.contiguous(), sin.contiguous(), dims, dims[3]


def _row_pitch(t: torch.Tensor) -> int | None:
    """The elements between t's rows as the kernel steps them (row (b, h, s) at
    ``(b * cH * cS + h * cS + s) * pitch``, an axis of one element aside) where (cB, cH, cS, w) t has its
    columns contiguous and its rows so, else None."""
    cb, ch, cs, w = t.shape
    if w > 1 and t.stride(3) != 1:
        return None
    axes = [a for a in (2, 1, 0) if t.shape[a] > 1]
    pitch = t.stride(axes[0]) if axes else w
    steps = (ch * cs * pitch, cs * pitch, pitch)
    if pitch < w or any(t.stride(a) != steps[a] for a in axes):
        return None
    return pitch


# ---- the rules ------------------------------------------------------------------------------------


def _fakes(match):
    return tuple(match.bindings[n].meta.get("val") for n in ("x", "cos", "sin"))


def sliced_operands(match) -> bool:
    """A filter for the new form: x, cos and sin are what the kernel reads (rotary.rotates, tables half
    the head wide, broadcasting onto x's first half), x's last axis even."""
    x, cos, sin = _fakes(match)
    d = x.shape[3] if isinstance(x, torch.Tensor) and x.dim() == 4 else None
    return isinstance(d, int) and d % 2 == 0 and rotary.rotates(x, cos, sin, d // 2, half_tables=True)


def copied_operands(match) -> bool:
    """A filter for the old form: x, cos and sin are what the rotation reads (rotary.rotates, tables
    the whole head wide)."""
    x, cos, sin = _fakes(match)
    return (isinstance(x, torch.Tensor) and x.dim() == 4 and isinstance(x.shape[3], int) and x.shape[3] % 2 == 0
            and rotary.rotates(x, cos, sin, x.shape[3] // 2))


# Traced at rank 4 with a head of 74 (half 37, no other literal), tables half as wide; the old form's
# sizes, which it computes from x's, each a number nothing else in its trace holds.
_SLICED_EXAMPLE = (torch.zeros(1, 2, 1, 74), torch.zeros(1, 1, 1, 37), torch.zeros(1, 1, 1, 37))
_COPIED_EXAMPLE = (torch.zeros(3, 5, 7, 74), torch.zeros(1, 1, 7, 74), torch.zeros(1, 1, 7, 74))


def register(rules) -> None:
    # Not inside inductor (its pointwise kernel is one pass too). The old form before rotary_embedding,
    # which matches its rotation alone.
    (strided,) = rotary.launchers(((f"{NAMESPACE}::_deinterleaved_rotary_strided", DEINTERLEAVED_ROTARY_STRIDED),),
                                  _strided_reference_of(deinterleaved_rotary_embedding), _strided_output,
                                  _STRIDED_SCHEMA)
    op = cuda_kernel_op(_OP, DEINTERLEAVED_ROTARY, reference=deinterleaved_rotary_embedding, meta_fn=_output,
                        eager_fn=_eager(strided), past_limits="reference")
    add_rule(rules, deinterleaved_rotary_embedding_copied, op, "deinterleaved_rotary_embedding_copied",
             filter=copied_operands, irs=COMPILE_FREE_IRS, example_inputs=_COPIED_EXAMPLE)
    add_rule(rules, deinterleaved_rotary_embedding_sliced, op, "deinterleaved_rotary_embedding",
             filter=sliced_operands, irs=COMPILE_FREE_IRS, example_inputs=_SLICED_EXAMPLE)
    # GPT-OSS's chunked halves against half-width tables: the same kernels reading x's halves.
    (strided,) = rotary.launchers(((f"{NAMESPACE}::_chunked_rotary_strided", CHUNKED_ROTARY_STRIDED),),
                                  _strided_reference_of(chunked_rotary_embedding), _strided_output, _STRIDED_SCHEMA)
    op = cuda_kernel_op(_CHUNKED_OP, CHUNKED_ROTARY, reference=chunked_rotary_embedding,
                        meta_fn=_output_of(_CHUNKED_OP), eager_fn=_eager(strided, _CHUNKED_OP), past_limits="reference")
    add_rule(rules, _chunked_pattern, op, "chunked_rotary_embedding", filter=sliced_operands, irs=COMPILE_FREE_IRS,
             example_inputs=_SLICED_EXAMPLE)
