"""Rotary position embedding (RoPE): ``x * cos + rotate_half(x) * sin`` in one pass instead of seven ops.

Forms matched: transformers' ``apply_rotary_pos_emb`` (Llama, Mistral, Qwen2, Gemma, Phi-3, GPT-NeoX's
rotary part) and litgpt's ``apply_rope``, which both write::

    def rotate_half(x):
        x1 = x[..., : x.shape[-1] // 2]
        x2 = x[..., x.shape[-1] // 2 :]
        return torch.cat((-x2, x1), dim=-1)

    q_embed = (q * cos) + (rotate_half(q) * sin)

on 4-d queries or keys ``(B, H, S, D)`` and ``cos``/``sin`` of shape ``(cB, cH, cS, D)`` that broadcast
onto them (transformers' ``cos.unsqueeze(1)``: ``(B, 1, S, D)``), all of one dtype. The half-width
slice is a captured ``int`` (``half``), so one rule serves every head size; ``2 * half`` must be the
last axis. Not matched: the interleaved (GPT-J, torchtune) and complex-number (Meta's reference
Llama, torchtitan) forms, which are other computations.

Queries come out of their projection as ``q.view(B, S, H, D).transpose(1, 2)``: a ``(B, H, S, D)``
view of a ``(B, S, H, D)`` tensor. The kernel reads that layout in place (``rotary_heads_inner``) and
writes a contiguous ``(B, H, S, D)`` result, which the attention matmul after it would otherwise copy
out itself. Other layouts are made contiguous first.

Numbers: each of eager's four roundings is kept, ``T(T(x*cos) + T(-x2*sin))``, so the result equals
eager PyTorch's to the bit in every dtype.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxkern.errors import KernelInputError
from fxkern.library._rules import COMPILE_FREE_IRS, DTYPES, NAMESPACE, add_rule, broadcasts_4d, check_broadcast_4d
from fxkern.library.cuda_common import COMMON, EW_BLOCK
from fxkern.ops import MAX_SIGNATURES, cuda_kernel_op, kernel_op
from fxkern.spec import Custom, DimSize, InputDecl, KernelSpec, Numel, OutputDecl, SameAs, ScalarInput
from fxkern.symbolic import cdiv

SOURCE = COMMON + r"""
namespace fxk {

// v rounded to T and back: the value eager PyTorch stores between two ops.
template <typename T>
__device__ __forceinline__ float rounded(float v) { return to_f<T>(from_f<T>(v)); }

// One element pair of a rotated row: a from the first half, b from the second (same column).
// y_a = a*cos_a - b*sin_a, y_b = b*cos_b + a*sin_b, each product and the sum rounded to T as eager's
// mul, mul, add store them; __fmul_rn/__fadd_rn keep float32 from contracting them into an fma.
template <typename T>
__device__ __forceinline__ float rope_first(float a, float b, float c, float s) {
    return __fadd_rn(rounded<T>(__fmul_rn(a, c)), rounded<T>(__fmul_rn(-b, s)));
}
template <typename T>
__device__ __forceinline__ float rope_second(float a, float b, float c, float s) {
    return __fadd_rn(rounded<T>(__fmul_rn(b, c)), rounded<T>(__fmul_rn(a, s)));
}

// FXK_ROPE_PAIRS=0 keeps 16-bit packs on the float path (benchmarks/rope_tuning.py's baseline).
#ifndef FXK_ROPE_PAIRS
#define FXK_ROPE_PAIRS 1
#endif
// A pack of V columns from each half of a row (a, b) with its cos and sin packs (c1, c2, s1, s2).
// 16-bit values go two at a time through the packed instructions (mul.rn/add.rn .bf16x2 and
// .f16x2): a product of two 16-bit values is exact in float32, so the packed product rounded once
// is eager's float product rounded, and likewise the sum; about a quarter of the float path's
// instructions (conversions, roundings), which left a 16-bit kernel issue-bound. The _rn forms keep
// the compiler from contracting a multiply and an add into an fma.
template <typename T, int V>
__device__ __forceinline__ void rope_packs(const Pack<T, V>& a, const Pack<T, V>& b, const Pack<T, V>& c1,
                                           const Pack<T, V>& c2, const Pack<T, V>& s1, const Pack<T, V>& s2,
                                           Pack<T, V>& ya, Pack<T, V>& yb) {
    if constexpr (FXK_ROPE_PAIRS && sizeof(T) == 2 && V % 2 == 0) {
        using P = typename Pair<T>::P;
        const P *pa = reinterpret_cast<const P*>(a.v), *pb = reinterpret_cast<const P*>(b.v);
        const P *pc1 = reinterpret_cast<const P*>(c1.v), *pc2 = reinterpret_cast<const P*>(c2.v);
        const P *ps1 = reinterpret_cast<const P*>(s1.v), *ps2 = reinterpret_cast<const P*>(s2.v);
        P *qa = reinterpret_cast<P*>(ya.v), *qb = reinterpret_cast<P*>(yb.v);
#pragma unroll
        for (int j = 0; j < V / 2; ++j) {
            qa[j] = __hadd2_rn(__hmul2_rn(pa[j], pc1[j]), __hmul2_rn(__hneg2(pb[j]), ps1[j]));
            qb[j] = __hadd2_rn(__hmul2_rn(pb[j], pc2[j]), __hmul2_rn(pa[j], ps2[j]));
        }
    } else {
        float fa[V], fb[V], f1[V], f2[V], g1[V], g2[V], oa[V], ob[V];
        to_floats(a, fa);
        to_floats(b, fb);
        to_floats(c1, f1);
        to_floats(c2, f2);
        to_floats(s1, g1);
        to_floats(s2, g2);
#pragma unroll
        for (int j = 0; j < V; ++j) {
            oa[j] = rope_first<T>(fa[j], fb[j], f1[j], g1[j]);
            ob[j] = rope_second<T>(fa[j], fb[j], f2[j], g2[j]);
        }
        ya = from_floats<T, V>(oa);
        yb = from_floats<T, V>(ob);
    }
}

// y (B, H, S, D) contiguous from x's rows, D = 2 * half. x's rows are in (B, H, S) order, or in
// (B, S, H) order (HEADS_INNER: a transposed projection output, read in place). A1, A2 are x's axes 1
// and 2 as passed: (H, S), or (S, H) when HEADS_INNER. cos and sin are (cB, cH, cS, D), contiguous,
// each of cB, cH, cS 1 or x's size. Each thread takes a pack of V columns from both halves of a row;
// a block takes an equal slice of the (row, pack) items, in x's memory order: with heads inner, the
// rows of one position follow each other and read one cos and sin row, from L1.
#ifndef FXK_ROPE_K
#define FXK_ROPE_K 1
#endif
template <typename T, int V, bool HEADS_INNER>
__device__ __forceinline__ void rotary_rows(const T* __restrict__ x, const T* __restrict__ cs, const T* __restrict__ sn,
                                            unsigned half, unsigned n, unsigned A1, unsigned A2,
                                            unsigned cB, unsigned cH, unsigned cS, T* __restrict__ y) {
    constexpr int K = FXK_ROPE_K;  // items a thread loads before it computes (1: 0-4% faster than 2 or 4)
    const unsigned D = 2 * half, P = half / V, items = n / D * P;
    const unsigned H = HEADS_INNER ? A2 : A1, S = HEADS_INNER ? A1 : A2;
    const unsigned sB = cB > 1 ? cH * cS : 0u, sH = cH > 1 ? cS : 0u, sS = cS > 1 ? 1u : 0u;
    const unsigned chunk = (items + gridDim.x - 1) / gridDim.x;
    const unsigned lo = min(blockIdx.x * chunk, items), hi = min(lo + chunk, items);
    for (unsigned base = lo; base < hi; base += K * blockDim.x) {
        Pack<T, V> xa[K], xb[K], ca[K], cb[K], sa[K], sb[K];
        size_t out[K];
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const unsigned i = base + k * blockDim.x + threadIdx.x;
            out[k] = ~(size_t)0;
            if (i < hi) {
                const unsigned r = i / P, col = (i - r * P) * V;  // x's row r: (b, A1, A2)
                const unsigned outer = r / A2, a2 = r - outer * A2, b = outer / A1, a1 = outer - b * A1;
                const unsigned h = HEADS_INNER ? a2 : a1, s = HEADS_INNER ? a1 : a2;
                const size_t xo = (size_t)r * D + col, co = (size_t)(b * sB + h * sH + s * sS) * D + col;
                xa[k] = load<T, V>(x + xo);
                xb[k] = load<T, V>(x + xo + half);
                ca[k] = load<T, V>(cs + co);
                cb[k] = load<T, V>(cs + co + half);
                sa[k] = load<T, V>(sn + co);
                sb[k] = load<T, V>(sn + co + half);
                out[k] = (size_t)((b * H + h) * S + s) * D + col;
            }
        }
#pragma unroll
        for (int k = 0; k < K; ++k) {
            if (out[k] == ~(size_t)0) continue;
            Pack<T, V> ya, yb;
            rope_packs<T, V>(xa[k], xb[k], ca[k], cb[k], sa[k], sb[k], ya, yb);
            store<T, V>(y + out[k], ya);
            store<T, V>(y + out[k] + half, yb);
        }
    }
}

template <typename T, bool HEADS_INNER>
__device__ __forceinline__ void rotary(const T* x, const T* cs, const T* sn, int half, int n, int A1, int A2,
                                       int cB, int cH, int cS, T* y) {
    constexpr int V = 16 / sizeof(T);
    if (half <= 0) return;
    if (half % V == 0 && aligned16(x) && aligned16(cs) && aligned16(sn) && aligned16(y))
        rotary_rows<T, V, HEADS_INNER>(x, cs, sn, half, n, A1, A2, cB, cH, cS, y);
    else
        rotary_rows<T, 1, HEADS_INNER>(x, cs, sn, half, n, A1, A2, cB, cH, cS, y);
}

}  // namespace fxk

template <typename T>
__global__ void __launch_bounds__(128) rotary(const T* x, const T* cs, const T* sn, int half, int n, int A1, int A2,
                                              int cB, int cH, int cS, T* y) {
    fxk::rotary<T, false>(x, cs, sn, half, n, A1, A2, cB, cH, cS, y);
}

template <typename T>
__global__ void __launch_bounds__(128) rotary_heads_inner(const T* x, const T* cs, const T* sn, int half, int n,
                                                          int A1, int A2, int cB, int cH, int cS, T* y) {
    fxk::rotary<T, true>(x, cs, sn, half, n, A1, A2, cB, cH, cS, y);
}
"""

ELEMENTS_PER_BLOCK = 4096  # 4 items a thread in float32, 2 in 16-bit (benchmarks/rope_tuning.py)
assert EW_BLOCK == 128  # the kernels' launch bounds


def rotary_geometry(inputs, outputs):
    """EW_BLOCK threads a block, a block per ELEMENTS_PER_BLOCK elements of the output."""
    return (cdiv(outputs[0].numel(), ELEMENTS_PER_BLOCK),), (EW_BLOCK,)


# x (B, H, S, D) contiguous; cos and sin (cB, cH, cS, D), each of cB, cH, cS 1 or x's size.
ROTARY = KernelSpec(
    SOURCE, "rotary",
    inputs=[InputDecl("x"), InputDecl("cos"), InputDecl("sin"), ScalarInput("half", int)],
    outputs=[OutputDecl("y", SameAs("x"))],
    extras=[Numel("x"), DimSize("x", 1), DimSize("x", 2), DimSize("cos", 0), DimSize("cos", 1), DimSize("cos", 2)],
    geometry=Custom(rotary_geometry),
    dtypes=DTYPES,
)
# The same from x given as (B, S, H, D) (``q.transpose(1, 2)`` made contiguous: in place), y (B, H, S, D).
ROTARY_HEADS_INNER = dataclasses.replace(ROTARY, kernel_name="rotary_heads_inner")
ROWS, ROWS_HEADS_INNER = f"{NAMESPACE}::_rotary_rows", f"{NAMESPACE}::_rotary_rows_heads_inner"


# ---- the pattern (also the op's CPU reference) ----------------------------------------------------


def rotary_embedding(x, cos, sin, half: int):
    """transformers' ``apply_rotary_pos_emb`` for one of q, k: ``(q * cos) + (rotate_half(q) * sin)``
    with ``rotate_half(x) = torch.cat((-x[..., half:], x[..., :half]), dim=-1)``, ``half = D // 2``."""
    x1 = x[..., :half]
    x2 = x[..., half:]
    return (x * cos) + (torch.cat((-x2, x1), dim=-1) * sin)


def _heads_inner_reference(xt, cos, sin, half: int):
    return rotary_embedding(xt.transpose(1, 2), cos, sin, half)


# ---- checks, output, layout -----------------------------------------------------------------------


def _check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: int) -> None:
    """What the kernel reads: 4-d x (B, H, S, D), cos and sin (cB, cH, cS, D) of x's dtype, each of
    cB, cH, cS 1 or x's size, and D = 2 * half."""
    op = f"{NAMESPACE}::rotary_embedding"
    if x.dim() != 4:
        raise KernelInputError(f"{op}: x {tuple(x.shape)} must be 4-d (batch, heads, positions, head_dim), as "
                               f"attention writes queries and keys; view (batch * heads, ...) ones back to 4-d")
    if cos.dim() != 4 or sin.dim() != 4:
        raise KernelInputError(f"{op}: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be 4-d like x "
                               f"{tuple(x.shape)}; unsqueeze them over the heads (cos.unsqueeze(1)), as transformers does")
    if cos.dtype != x.dtype or sin.dtype != x.dtype:
        raise KernelInputError(f"{op}: x is {x.dtype}, cos {cos.dtype}, sin {sin.dtype}; give cos and sin x's dtype "
                               f"(transformers casts them: cos.to(x.dtype))")
    if tuple(cos.shape) != tuple(sin.shape):
        raise KernelInputError(f"{op}: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have one shape")
    d = x.shape[-1]
    if isinstance(d, int) and isinstance(half, int) and 2 * half != d:
        raise KernelInputError(f"{op}: half = {half} rotates a last axis of {2 * half}, but x's is {d}; "
                               f"pass half = x.shape[-1] // 2 with an even head_dim")
    if not isinstance(d, int):  # symbolic (export, dynamic shapes): a runtime assertion instead
        torch._check(2 * half == d, lambda: f"{op}: 2 * half must be x's last axis")
    check_broadcast_4d(op, "cos (and sin)", cos, "x", x)


def _output(x, cos, sin, half):
    """The op's output (and its fake impl): checks the call, one contiguous tensor of x's shape."""
    _check(x, cos, sin, half)
    return x.new_empty(x.shape)


def _heads_inner_output(xt, cos, sin, half):
    """The private heads-inner op's output: (B, H, S, D) from x given as (B, S, H, D), checked as the
    public op checks x (its spec's SameAs output is the public op's shape; this meta_fn decides)."""
    _check(xt.transpose(1, 2), cos, sin, half)
    b, s, h, d = xt.shape
    return xt.new_empty((b, h, s, d))


def _compact(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, contiguous, with each axis both broadcast (stride 0) narrowed to one: an
    expanded table reaches the kernel at its own size, not copied out to x's. The kernel reads both
    with cos's sizes, so an axis is narrowed only where both are broadcast."""
    return _narrow(cos, sin, _broadcast_axes(cos, sin))


def _broadcast_axes(cos: torch.Tensor, sin: torch.Tensor) -> tuple[int, ...]:
    return tuple(a for a in range(cos.dim() - 1) if cos.stride(a) == 0 and sin.stride(a) == 0 and cos.shape[a] > 1)


def _narrow(cos: torch.Tensor, sin: torch.Tensor, axes: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    for axis in axes:
        cos, sin = cos.narrow(axis, 0, 1), sin.narrow(axis, 0, 1)
    return cos.contiguous(), sin.contiguous()


def _on_cuda(rows, heads_inner):
    """The public op on CUDA: checks, narrows broadcast tables, and reads x in the projection's
    layout in place where it is that. All of it depends only on the call's signature, so it is
    decided once per signature (as the launches under it are, fxkern.ops)."""
    decided: dict = {}

    def on_cuda(x, cos, sin, half):
        key = (x.shape, x.stride(), x.dtype, x.device, cos.shape, cos.stride(), cos.dtype, cos.device,
               sin.shape, sin.stride(), sin.dtype, sin.device, half)
        how = decided.get(key)
        if how is None:
            _check(x, cos, sin, half)
            how = (_broadcast_axes(cos, sin), not x.is_contiguous() and x.transpose(1, 2).is_contiguous())
            if len(decided) >= MAX_SIGNATURES:
                decided.clear()
            decided[key] = how
        axes, projected = how
        cos, sin = _narrow(cos, sin, axes)
        if projected:  # the projection's layout: read in place
            return heads_inner(x.transpose(1, 2), cos, sin, half)
        return rows(x, cos, sin, half)

    return on_cuda


# ---- the rule -------------------------------------------------------------------------------------


def rotary_operands(match) -> bool:
    """A filter: x, cos and sin are 4-d tensors of one library dtype, cos and sin of one shape that
    broadcasts onto x as the kernel reads it, and the captured half is half x's last axis."""
    vals = [match.bindings[n].meta.get("val") for n in ("x", "cos", "sin")]
    half = match.bindings.get("half")
    if not all(isinstance(v, torch.Tensor) and v.dim() == 4 for v in vals) or not isinstance(half, int):
        return False
    x, cos, sin = vals
    if x.dtype not in DTYPES or cos.dtype != x.dtype or sin.dtype != x.dtype:
        return False
    return (all(statically_known_true(a == b) for a, b in zip(cos.shape, sin.shape))
            and statically_known_true(x.shape[3] == 2 * half) and broadcasts_4d(cos, x))


# Traced at rank 4 (the slices' axis is a literal 3) with a head size whose half, 37, is no other literal.
_EXAMPLE = (torch.zeros(1, 2, 1, 74), torch.zeros(1, 1, 1, 74), torch.zeros(1, 1, 1, 74), 37)


def register(rules) -> None:
    # Not inside inductor, whose own pointwise kernel for these seven ops is one pass as well.
    cuda_kernel_op(ROWS, ROTARY, reference=rotary_embedding, meta_fn=_output)
    cuda_kernel_op(ROWS_HEADS_INNER, ROTARY_HEADS_INNER, reference=_heads_inner_reference, meta_fn=_heads_inner_output)
    on_cuda = _on_cuda(kernel_op(ROWS).cuda_impl, kernel_op(ROWS_HEADS_INNER).cuda_impl)
    op = cuda_kernel_op(f"{NAMESPACE}::rotary_embedding", ROTARY, reference=rotary_embedding, meta_fn=_output,
                        eager_fn=on_cuda)
    add_rule(rules, rotary_embedding, op, "rotary_embedding", filter=rotary_operands, irs=COMPILE_FREE_IRS,
             example_inputs=_EXAMPLE)
