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

Grouped-query attention (Llama 3, Mistral, Qwen, Gemma: fewer key/value heads than query heads)
then copies each key and value head once per query head of its group, transformers' ``repeat_kv``
(SDPA with a mask, and eager attention)::

    x[:, :, None, :, :].expand(batch, kv_heads, n_rep, seq, head_dim).reshape(batch, heads, seq, head_dim)

PyTorch makes that copy with a generic strided kernel (a fifth of copy bandwidth in bfloat16, two
fifths in float32, at 16x8x2048x128 repeated 4 times on an H200). Two ops replace it: ``repeat_kv``
for the values, and ``rotary_embedding_repeat_kv`` for the keys, which writes each rotated row
``n_rep`` times in the same pass. The pattern captures each size of the
expand and the reshape (``heads`` is ``kv_heads * n_rep``, which the graph holds as a literal); a
dynamic size is a symbol, not a literal, and leaves the copy to PyTorch.

Numbers: each of eager's four roundings is kept, ``T(T(x*cos) + T(-x2*sin))``, so the result equals
eager PyTorch's to the bit in every dtype; the repeats are copies.
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
from fxkern.derive import INT32_MAX

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

// y (B, H * R, S, D) contiguous from x's rows, D = 2 * half: each head's rotated rows written R times
// over (R = 1: plain RoPE; R > 1: the keys of grouped-query attention, repeated for every query head
// of their group, as transformers' repeat_kv copies them). x's rows are in (B, H, S) order, or in
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
                                            unsigned cB, unsigned cH, unsigned cS, unsigned R, T* __restrict__ y) {
    constexpr int K = FXK_ROPE_K;  // items a thread loads before it computes (1: 0-4% faster than 2 or 4)
    const unsigned D = 2 * half, P = half / V, items = n / D * P;
    const unsigned H = HEADS_INNER ? A2 : A1, S = HEADS_INNER ? A1 : A2;
    const size_t head = (size_t)S * D;  // one head's rows in y
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
                out[k] = (size_t)(b * H + h) * R * head + (size_t)s * D + col;
            }
        }
#pragma unroll
        for (int k = 0; k < K; ++k) {
            if (out[k] == ~(size_t)0) continue;
            Pack<T, V> ya, yb;
            rope_packs<T, V>(xa[k], xb[k], ca[k], cb[k], sa[k], sb[k], ya, yb);
            for (unsigned r = 0; r < R; ++r) {
                store<T, V>(y + out[k] + r * head, ya);
                store<T, V>(y + out[k] + r * head + half, yb);
            }
        }
    }
}

template <typename T, bool HEADS_INNER>
__device__ __forceinline__ void rotary(const T* x, const T* cs, const T* sn, int half, int n, int A1, int A2,
                                       int cB, int cH, int cS, int R, T* y) {
    constexpr int V = 16 / sizeof(T);
    if (half <= 0 || R <= 0) return;
    if (half % V == 0 && aligned16(x) && aligned16(cs) && aligned16(sn) && aligned16(y))
        rotary_rows<T, V, HEADS_INNER>(x, cs, sn, half, n, A1, A2, cB, cH, cS, R, y);
    else
        rotary_rows<T, 1, HEADS_INNER>(x, cs, sn, half, n, A1, A2, cB, cH, cS, R, y);
}

// y (B, H * R, S, D) contiguous: x's rows (laid out as rotary_rows reads them) each written R times,
// transformers' repeat_kv for the values of grouped-query attention. A thread moves one pack of x to
// its R places (a thread per pack of y, in y's order, reading each pack of x R times from L2: 2-4%
// slower at 16x8x2048x128 repeated 4 times, H200, 2026-11-25 03:18 and 03:27 UTC runs of
// benchmarks/library.py --only repeat_kv).
template <typename T, int V, bool HEADS_INNER>
__device__ __forceinline__ void repeat_rows(const T* __restrict__ x, unsigned D, unsigned n, unsigned A1,
                                            unsigned A2, unsigned R, T* __restrict__ y) {
    const unsigned P = D / V, items = n / V;
    const unsigned H = HEADS_INNER ? A2 : A1, S = HEADS_INNER ? A1 : A2;
    const size_t head = (size_t)S * D;
    const unsigned chunk = (items + gridDim.x - 1) / gridDim.x;
    const unsigned lo = min(blockIdx.x * chunk, items), hi = min(lo + chunk, items);
    for (unsigned i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const unsigned r = i / P, col = (i - r * P) * V;  // x's row r: (b, A1, A2)
        const unsigned outer = r / A2, a2 = r - outer * A2, b = outer / A1, a1 = outer - b * A1;
        const unsigned h = HEADS_INNER ? a2 : a1, s = HEADS_INNER ? a1 : a2;
        const Pack<T, V> v = load<T, V>(x + (size_t)r * D + col);
        const size_t o = (size_t)(b * H + h) * R * head + (size_t)s * D + col;
        for (unsigned k = 0; k < R; ++k) store<T, V>(y + o + k * head, v);
    }
}

template <typename T, bool HEADS_INNER>
__device__ __forceinline__ void repeat(const T* x, int D, int n, int A1, int A2, int R, T* y) {
    constexpr int V = 16 / sizeof(T);
    if (D <= 0 || R <= 0) return;
    if (D % V == 0 && aligned16(x) && aligned16(y))
        repeat_rows<T, V, HEADS_INNER>(x, D, n, A1, A2, R, y);
    else
        repeat_rows<T, 1, HEADS_INNER>(x, D, n, A1, A2, R, y);
}

}  // namespace fxk

template <typename T>
__global__ void __launch_bounds__(128) rotary(const T* x, const T* cs, const T* sn, int half, int n, int A1, int A2,
                                              int cB, int cH, int cS, T* y) {
    fxk::rotary<T, false>(x, cs, sn, half, n, A1, A2, cB, cH, cS, 1, y);
}

template <typename T>
__global__ void __launch_bounds__(128) rotary_heads_inner(const T* x, const T* cs, const T* sn, int half, int n,
                                                          int A1, int A2, int cB, int cH, int cS, T* y) {
    fxk::rotary<T, true>(x, cs, sn, half, n, A1, A2, cB, cH, cS, 1, y);
}

// The grouped-query keys: rotated and repeated for each query head of their group in one pass. The
// sizes are the ones the pattern captures (x is (batch, kv_heads, seq, head_dim), y has heads =
// kv_heads * n_rep); the op checks them against x. The _heads_inner kernels read x as (batch, seq,
// kv_heads, head_dim), the projection's layout.
template <typename T>
__global__ void __launch_bounds__(128) rotary_repeat_kv(const T* x, const T* cs, const T* sn, int half, int batch,
                                                        int kv_heads, int n_rep, int seq, int head_dim, int heads,
                                                        int n, int cB, int cH, int cS, T* y) {
    fxk::rotary<T, false>(x, cs, sn, half, n, kv_heads, seq, cB, cH, cS, n_rep, y);
}

template <typename T>
__global__ void __launch_bounds__(128) rotary_repeat_kv_heads_inner(const T* x, const T* cs, const T* sn, int half,
                                                                    int batch, int kv_heads, int n_rep, int seq,
                                                                    int head_dim, int heads, int n, int cB, int cH,
                                                                    int cS, T* y) {
    fxk::rotary<T, true>(x, cs, sn, half, n, seq, kv_heads, cB, cH, cS, n_rep, y);
}

// The grouped-query values: repeat_kv alone, a copy that writes each head n_rep times.
template <typename T>
__global__ void __launch_bounds__(128) repeat_kv(const T* x, int batch, int kv_heads, int n_rep, int seq,
                                                 int head_dim, int heads, int n, T* y) {
    fxk::repeat<T, false>(x, head_dim, n, kv_heads, seq, n_rep, y);
}

template <typename T>
__global__ void __launch_bounds__(128) repeat_kv_heads_inner(const T* x, int batch, int kv_heads, int n_rep, int seq,
                                                             int head_dim, int heads, int n, T* y) {
    fxk::repeat<T, true>(x, head_dim, n, seq, kv_heads, n_rep, y);
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


def read_geometry(inputs, outputs):
    """EW_BLOCK threads a block, a block per ELEMENTS_PER_BLOCK elements of x: the repeating kernels
    write each of them n_rep times."""
    return (cdiv(inputs[0].numel(), ELEMENTS_PER_BLOCK),), (EW_BLOCK,)


# Grouped-query attention's keys and values, repeated for every query head of their group. The sizes
# are the literals transformers' repeat_kv leaves in the graph (the pattern captures each); the
# output, (batch, heads, seq, head_dim), comes from the meta_fn, so these specs declare none.
SIZES = ("batch", "kv_heads", "n_rep", "seq", "head_dim", "heads")
_SIZE_INPUTS = [ScalarInput(n, int) for n in SIZES]
_SIZE_SCHEMA = ", ".join(f"int {n}" for n in SIZES)
# x (batch, kv_heads, seq, head_dim) contiguous, cos and sin as ROTARY reads them: rotated, then repeated.
ROTARY_REPEAT_KV = KernelSpec(
    SOURCE, "rotary_repeat_kv",
    inputs=[InputDecl("x"), InputDecl("cos"), InputDecl("sin"), ScalarInput("half", int), *_SIZE_INPUTS],
    extras=[Numel("x"), DimSize("cos", 0), DimSize("cos", 1), DimSize("cos", 2)],
    geometry=Custom(read_geometry),
    dtypes=DTYPES,
)
ROTARY_REPEAT_KV_SCHEMA = f"(Tensor x, Tensor cos, Tensor sin, int half, {_SIZE_SCHEMA}) -> Tensor"
# x (batch, kv_heads, seq, head_dim) contiguous: repeated.
REPEAT_KV = KernelSpec(
    SOURCE, "repeat_kv",
    inputs=[InputDecl("x"), *_SIZE_INPUTS],
    extras=[Numel("x")],
    geometry=Custom(read_geometry),
    dtypes=DTYPES,
)
REPEAT_KV_SCHEMA = f"(Tensor x, {_SIZE_SCHEMA}) -> Tensor"
ROTARY_REPEAT_ROWS = f"{NAMESPACE}::_rotary_repeat_kv_rows"
REPEAT_ROWS = f"{NAMESPACE}::_repeat_kv_rows"


# ---- the pattern (also the op's CPU reference) ----------------------------------------------------


def rotary_embedding(x, cos, sin, half: int):
    """transformers' ``apply_rotary_pos_emb`` for one of q, k: ``(q * cos) + (rotate_half(q) * sin)``
    with ``rotate_half(x) = torch.cat((-x[..., half:], x[..., :half]), dim=-1)``, ``half = D // 2``."""
    x1 = x[..., :half]
    x2 = x[..., half:]
    return (x * cos) + (torch.cat((-x2, x1), dim=-1) * sin)


def repeat_kv(x, batch: int, kv_heads: int, n_rep: int, seq: int, head_dim: int, heads: int):
    """transformers' ``repeat_kv`` (grouped-query attention's keys and values, one copy for each query
    head of the group): ``x[:, :, None, :, :].expand(batch, kv_heads, n_rep, seq, head_dim)`` reshaped to
    ``(batch, kv_heads * n_rep, seq, head_dim)``; ``heads`` is that product, the literal the graph holds."""
    return x[:, :, None, :, :].expand(batch, kv_heads, n_rep, seq, head_dim).reshape(batch, heads, seq, head_dim)


def rotary_embedding_repeat_kv(x, cos, sin, half: int, batch: int, kv_heads: int, n_rep: int, seq: int,
                               head_dim: int, heads: int):
    """The keys of grouped-query attention: rotated (``apply_rotary_pos_emb``), then repeated (``repeat_kv``)."""
    return repeat_kv(rotary_embedding(x, cos, sin, half), batch, kv_heads, n_rep, seq, head_dim, heads)


def _heads_inner_reference(xt, cos, sin, half: int, *sizes):
    if sizes:
        return rotary_embedding_repeat_kv(xt.transpose(1, 2), cos, sin, half, *sizes)
    return rotary_embedding(xt.transpose(1, 2), cos, sin, half)


def _repeat_heads_inner_reference(xt, *sizes):
    return repeat_kv(xt.transpose(1, 2), *sizes)


# ---- checks, output, layout -----------------------------------------------------------------------


def _check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: int,
           op: str = f"{NAMESPACE}::rotary_embedding") -> None:
    """What the kernel reads: 4-d x (B, H, S, D), cos and sin (cB, cH, cS, D) of x's dtype, each of
    cB, cH, cS 1 or x's size, and D = 2 * half."""
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


def _check_sizes(op: str, x: torch.Tensor, batch: int, kv_heads: int, n_rep: int, seq: int, head_dim: int,
                 heads: int) -> None:
    """The repeating ops' sizes: x is (batch, kv_heads, seq, head_dim), heads = kv_heads * n_rep."""
    if x.dim() != 4:
        raise KernelInputError(f"{op}: x {tuple(x.shape)} must be 4-d (batch, kv_heads, seq, head_dim), as "
                               f"attention writes keys and values")
    if n_rep < 1 or heads != kv_heads * n_rep:
        raise KernelInputError(f"{op}: heads = {heads} must be kv_heads * n_rep = {kv_heads} * {n_rep}, with n_rep >= 1")
    if batch * heads * seq * head_dim > INT32_MAX:
        raise KernelInputError(f"{op}: the output ({batch}, {heads}, {seq}, {head_dim}) has more than 2**31 - 1 "
                               f"elements, more than the kernel indexes; split the batch")
    want = (batch, kv_heads, seq, head_dim)
    # a symbolic axis is left to the check on CUDA, at run time: the rule only matches literal sizes,
    # and TensorRT's shape inference runs this with a free symbol for each of x's axes
    if any(isinstance(got, int) and got != size for got, size in zip(x.shape, want)):
        raise KernelInputError(
            f"{op}: x {tuple(x.shape)} is not (batch, kv_heads, seq, head_dim) = {want}; pass x's own sizes")


def _output(x, cos, sin, half):
    """The op's output (and its fake impl): checks the call, one contiguous tensor of x's shape."""
    _check(x, cos, sin, half)
    return x.new_empty(x.shape)


def _repeat_output(x, batch: int, kv_heads: int, n_rep: int, seq: int, head_dim: int, heads: int):
    """``repeat_kv``'s output (and its fake impl): checks the call, one (batch, heads, seq, head_dim) tensor."""
    _check_sizes(f"{NAMESPACE}::repeat_kv", x, batch, kv_heads, n_rep, seq, head_dim, heads)
    return x.new_empty((batch, heads, seq, head_dim))


def _rotary_repeat_output(x, cos, sin, half: int, batch: int, kv_heads: int, n_rep: int, seq: int, head_dim: int,
                          heads: int):
    """``rotary_embedding_repeat_kv``'s output (and its fake impl): checks the call as both ops do."""
    op = f"{NAMESPACE}::rotary_embedding_repeat_kv"
    if all(isinstance(d, int) for t in (x, cos, sin) for d in t.shape):  # as _check_sizes: symbolic at run time
        _check(x, cos, sin, half, op)
    _check_sizes(op, x, batch, kv_heads, n_rep, seq, head_dim, heads)
    return x.new_empty((batch, heads, seq, head_dim))


def _heads_inner_output(xt, cos, sin, half, *sizes):
    """A private heads-inner op's output: (B, H, S, D) from x given as (B, S, H, D), checked as the
    public op checks x (its spec's SameAs output is the public op's shape; this meta_fn decides)."""
    if sizes:
        return _rotary_repeat_output(xt.transpose(1, 2), cos, sin, half, *sizes)
    _check(xt.transpose(1, 2), cos, sin, half)
    b, s, h, d = xt.shape
    return xt.new_empty((b, h, s, d))


def _repeat_heads_inner_output(xt, *sizes):
    return _repeat_output(xt.transpose(1, 2), *sizes)


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


def _projected(x: torch.Tensor) -> bool:
    """Whether x (B, H, S, D) is a transposed projection output, (B, S, H, D) in memory: read in place."""
    return not x.is_contiguous() and x.transpose(1, 2).is_contiguous()


def _on_cuda(rows, heads_inner, check=_output):
    """A public rotary op on CUDA (``sizes``: the repeating one's): checks, narrows broadcast tables,
    and reads x in the projection's layout in place where it is that. All of it depends only on the
    call's signature, so it is decided once per signature (as the launches under it are, fxkern.ops)."""
    decided: dict = {}

    def on_cuda(x, cos, sin, half, *sizes):
        key = (x.shape, x.stride(), x.dtype, x.device, cos.shape, cos.stride(), cos.dtype, cos.device,
               sin.shape, sin.stride(), sin.dtype, sin.device, half, sizes)
        how = decided.get(key)
        if how is None:
            check(x, cos, sin, half, *sizes)
            how = (_broadcast_axes(cos, sin), _projected(x))
            if len(decided) >= MAX_SIGNATURES:
                decided.clear()
            decided[key] = how
        axes, projected = how
        cos, sin = _narrow(cos, sin, axes)
        if projected:  # the projection's layout: read in place
            return heads_inner(x.transpose(1, 2), cos, sin, half, *sizes)
        return rows(x, cos, sin, half, *sizes)

    return on_cuda


def _repeat_on_cuda(rows, heads_inner):
    """``repeat_kv`` on CUDA: checks, and reads x in the projection's layout in place where it is that
    (the values: ``v.view(B, S, H, D).transpose(1, 2)``), once per signature."""
    decided: dict = {}

    def on_cuda(x, *sizes):
        key = (x.shape, x.stride(), x.dtype, x.device, sizes)
        projected = decided.get(key)
        if projected is None:
            _repeat_output(x, *sizes)
            projected = _projected(x)
            if len(decided) >= MAX_SIGNATURES:
                decided.clear()
            decided[key] = projected
        return heads_inner(x.transpose(1, 2), *sizes) if projected else rows(x, *sizes)

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


def repeat_operands(match) -> bool:
    """A filter: x is a 4-d tensor of a library dtype whose sizes are the captured ones, and heads is
    kv_heads * n_rep."""
    x = match.bindings["x"].meta.get("val")
    sizes = [match.bindings.get(n) for n in SIZES]
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.dtype not in DTYPES:
        return False
    if not all(isinstance(v, int) for v in sizes):
        return False
    batch, kv_heads, n_rep, seq, head_dim, heads = sizes
    return (n_rep >= 1 and heads == kv_heads * n_rep
            and all(statically_known_true(a == b) for a, b in zip(x.shape, (batch, kv_heads, seq, head_dim))))


def rotary_repeat_operands(match) -> bool:
    """A filter: the rotary embedding's operands and the repeat's sizes both hold."""
    return rotary_operands(match) and repeat_operands(match)


# Traced at rank 4 (the slices' axis is a literal 3) with a head size whose half, 37, is no other literal.
_EXAMPLE = (torch.zeros(1, 2, 1, 74), torch.zeros(1, 1, 1, 74), torch.zeros(1, 1, 1, 74), 37)
# The repeat's sizes, each a literal nothing else in the traced pattern holds (the unsqueeze's axis is 2,
# the slices' 3): batch 13, kv_heads 5, n_rep 7, seq 11, head_dim 74, heads 35.
_SIZES_EXAMPLE = (13, 5, 7, 11, 74, 35)
_REPEAT_EXAMPLE = (torch.zeros(13, 5, 11, 74), *_SIZES_EXAMPLE)
_ROTARY_REPEAT_EXAMPLE = (torch.zeros(13, 5, 11, 74), torch.zeros(1, 1, 11, 74), torch.zeros(1, 1, 11, 74), 37,
                          *_SIZES_EXAMPLE)


def register(rules) -> None:
    # Not inside inductor, whose own pointwise kernels for these are one pass as well.
    # The keys of grouped-query attention first: rotated and repeated in one pass, where the two rules
    # after it would each take half.
    cuda_kernel_op(ROTARY_REPEAT_ROWS, ROTARY_REPEAT_KV, reference=rotary_embedding_repeat_kv,
                   meta_fn=_rotary_repeat_output, schema=ROTARY_REPEAT_KV_SCHEMA)
    cuda_kernel_op(ROTARY_REPEAT_ROWS + "_heads_inner", dataclasses.replace(
        ROTARY_REPEAT_KV, kernel_name="rotary_repeat_kv_heads_inner"), reference=_heads_inner_reference,
        meta_fn=_heads_inner_output, schema=ROTARY_REPEAT_KV_SCHEMA)
    on_cuda = _on_cuda(kernel_op(ROTARY_REPEAT_ROWS).cuda_impl, kernel_op(ROTARY_REPEAT_ROWS + "_heads_inner").cuda_impl,
                       check=_rotary_repeat_output)
    op = cuda_kernel_op(f"{NAMESPACE}::rotary_embedding_repeat_kv", ROTARY_REPEAT_KV,
                        reference=rotary_embedding_repeat_kv, meta_fn=_rotary_repeat_output, eager_fn=on_cuda,
                        schema=ROTARY_REPEAT_KV_SCHEMA)
    add_rule(rules, rotary_embedding_repeat_kv, op, "rotary_embedding_repeat_kv", filter=rotary_repeat_operands,
             irs=COMPILE_FREE_IRS, example_inputs=_ROTARY_REPEAT_EXAMPLE)

    cuda_kernel_op(ROWS, ROTARY, reference=rotary_embedding, meta_fn=_output)
    cuda_kernel_op(ROWS_HEADS_INNER, ROTARY_HEADS_INNER, reference=_heads_inner_reference, meta_fn=_heads_inner_output)
    on_cuda = _on_cuda(kernel_op(ROWS).cuda_impl, kernel_op(ROWS_HEADS_INNER).cuda_impl)
    op = cuda_kernel_op(f"{NAMESPACE}::rotary_embedding", ROTARY, reference=rotary_embedding, meta_fn=_output,
                        eager_fn=on_cuda)
    add_rule(rules, rotary_embedding, op, "rotary_embedding", filter=rotary_operands, irs=COMPILE_FREE_IRS,
             example_inputs=_EXAMPLE)

    cuda_kernel_op(REPEAT_ROWS, REPEAT_KV, reference=repeat_kv, meta_fn=_repeat_output, schema=REPEAT_KV_SCHEMA)
    cuda_kernel_op(REPEAT_ROWS + "_heads_inner", dataclasses.replace(REPEAT_KV, kernel_name="repeat_kv_heads_inner"),
                   reference=_repeat_heads_inner_reference, meta_fn=_repeat_heads_inner_output,
                   schema=REPEAT_KV_SCHEMA)
    on_cuda = _repeat_on_cuda(kernel_op(REPEAT_ROWS).cuda_impl, kernel_op(REPEAT_ROWS + "_heads_inner").cuda_impl)
    op = cuda_kernel_op(f"{NAMESPACE}::repeat_kv", REPEAT_KV, reference=repeat_kv, meta_fn=_repeat_output,
                        eager_fn=on_cuda, schema=REPEAT_KV_SCHEMA)
    add_rule(rules, repeat_kv, op, "repeat_kv", filter=repeat_operands, irs=COMPILE_FREE_IRS,
             example_inputs=_REPEAT_EXAMPLE)
