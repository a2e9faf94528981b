"""A head's RMSNorm and its rotary embedding in one pass: Qwen3's and Gemma 3's queries and keys.

Qwen3 (and Qwen3-MoE) normalise each head of the queries and keys, then rotate them
(transformers 5.x ``Qwen3Attention.forward``)::

    query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    ...
    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

with ``LlamaRMSNorm``'s numbers; Gemma 3 transposes first and normalises the ``(B, H, S, D)`` view with
``GemmaRMSNorm``'s (``query_states = self.q_norm(query_states)``). The library's norm and rotary rules
would replace each with two ops: the norm writes every head, the rotation reads it back. These rules
replace the norm, the transpose and the rotation (and for grouped-query keys, ``repeat_kv`` after
them) with one op, whose kernel reads a head's row once, normalises and rotates it in registers and
writes it where attention reads it: two passes over the queries where there were four.

Ops (``x`` is what the norm reads; the result is ``(B, H, S, D)``, laid out as eager's: the
projection's ``(B, S, H, D)`` memory, or contiguous where x is, and for the repeats):

* ``rms_norm_rotary_embedding(x, weight, cos, sin, eps, half)``: Qwen3's form, ``x`` ``(B, S, H, D)``;
* ``gemma_rms_norm_rotary_embedding(x, weight, cos, sin, eps, half)``: Gemma 3's, ``x`` ``(B, H, S, D)``;
* ``..._repeat_kv(..., batch, kv_heads, n_rep, seq, head_dim, heads)``: the same, each head then
  written ``n_rep`` times (transformers' ``repeat_kv`` of the keys, as ``rotary_embedding_repeat_kv``).

The kernel keeps a row in one warp's registers, so head_dim is at most ``MAX_HEAD_DIM`` (256: every
model's); the rules leave longer heads to the norm and rotary ops apart. Numbers: the norm's as the
RMSNorm kernels compute them (a float32 sum of squares; the normalised row rounded as the model
rounds it), then the rotation's, each of eager's roundings kept. The other combinations (Llama's
norm after the transpose, Gemma's before it) match the norm and rotary rules apart.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxkern.errors import KernelInputError
from fxkern.library import rotary
from fxkern.library._rules import COMPILE_FREE_IRS, NAMESPACE, add_rule
from fxkern.library.rmsnorm import NORM_MATH, gemma_rmsnorm, llama_rmsnorm
from fxkern.library.rotary import SIZES, repeat_kv, rotary_embedding
from fxkern.ops import Signatures, cuda_kernel_op, tensor_signature
from fxkern.patterns import SENTINELS
from fxkern.spec import Custom, DimSize, InputDecl, KernelSpec, Numel, ScalarInput
from fxkern.symbolic import cdiv

MAX_HEAD_DIM = 256
_DTYPES = rotary.DTYPES

SOURCE = rotary.SOURCE + NORM_MATH + r"""
namespace fxk {

// Rows a thread group holds at once in the kernels that take any alignment (benchmarks/norm_rope_tuning.py,
// H100: one row a group ran 5-11% slower in 16-bit types, 4% in float32; four rows, 6-18% slower at
// 80+ registers a thread).
#ifndef FXK_NR_ROWS
#define FXK_NR_ROWS 2
#endif

// Rows a thread group holds in eager PyTorch's 16-byte kernels (norm_rotary_packs), which load a row's
// cos and sin with the row (AHEAD). H200, 2026-11-26, Qwen3's q float32 / bfloat16: 3966 / 3934 GB/s,
// against 3866 / 3606 at two rows (94 registers a thread) and 3888 / 3924 at two rows with the tables
// loaded after the sum of squares (benchmarks/norm_rope_tuning.py).
#ifndef FXK_NR_PACK_ROWS
#define FXK_NR_PACK_ROWS 1
#endif

// With EVICT, rows are stored evict-first, as rotary's (rotary.store_out). Eager PyTorch runs a kernel
// of its own for rows written R > 1 times (norm_rotary_packs_repeat), which sets it; the TensorRT
// repeat kernels store plainly (not yet measured with the hint). Behind a branch on R in the one
// kernel the hint made rows written once 6% slower on an H200, and as a second instantiation beside
// the first the kernel took 96 registers a thread (benchmarks/norm_rope_tuning.py, 2026-11-26).
#ifndef FXK_NR_EVICT_REPEATS
#define FXK_NR_EVICT_REPEATS 1
#endif

// Rows of D = 2 * half columns, walked as w says: each normalised (MODE: Llama's or Gemma's numbers)
// and rotated, then written R times into y (B, H * R, S, D), contiguous, or once in the walk's order
// (w.in_order: eager's layout, rotary's Rows). G threads take a row (a power
// of two up to 32: the sum of squares is a sub-warp shuffle), each holding NP packs of V columns from
// each half with their pairs (column c with c + half, as the rotation pairs them); a group holds U rows
// at once. With AHEAD a row's cos and sin are loaded with the row, so their trip to L2 overlaps the
// row's instead of following the sum of squares (a row's tables are as many bytes as the row); it
// costs registers, which only the 16-byte kernels of eager PyTorch can spare. A block takes a
// contiguous chunk of the rows.
template <typename T, int MODE, int V, int NP, int U, bool AHEAD, bool EVICT>
__device__ __forceinline__ void norm_rotary_rows(const T* __restrict__ x, const T* __restrict__ wt,
                                                 const T* __restrict__ cs, const T* __restrict__ sn, float eps,
                                                 unsigned half, unsigned B, const Rows& w, unsigned cB, unsigned cH,
                                                 unsigned cS, unsigned R, T* __restrict__ y) {
    const unsigned D = 2 * half, packs = half / V, need = (packs + NP - 1) / NP;
    const unsigned G = need > 1 ? 1u << (32 - __clz(need - 1)) : 1u, lg = log2_of(G);
    const unsigned g = threadIdx.x >> lg, t = threadIdx.x & (G - 1), groups = blockDim.x >> lg;
    const unsigned rows = B * w.A1 * w.A2;
    unsigned lo, hi;
    block_share(rows, lo, hi);
    const float inv_d = __frcp_rn((float)D);  // the mean as sum * (1 / D), as the RMSNorm kernels take it
    const size_t head = (size_t)w.S * D;
    const TableRows table(cB, cH, cS);
    for (unsigned first = lo; first < hi; first += groups * U) {  // the same steps for every thread of the block
        unsigned b[U], h[U], s[U];
        size_t xo[U];
        Pack<T, V> a[U][NP], c[U][NP], cos_a[U][NP], cos_b[U][NP], sin_a[U][NP], sin_b[U][NP];
        float sq[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const unsigned r = first + u * groups + g;
            b[u] = h[u] = s[u] = 0;
            xo[u] = r < hi ? w.locate(r, b[u], h[u], s[u]) : 0;
            sq[u] = 0.0f;
#pragma unroll
            for (int k = 0; k < NP; ++k) {
                const unsigned col = (k * G + t) * V;
                if (r < hi && col < half) {
                    a[u][k] = load<T, V>(x + xo[u] + col);
                    c[u][k] = load<T, V>(x + xo[u] + col + half);
                    if constexpr (AHEAD) {
                        const size_t co = (size_t)table(b[u], h[u], s[u]) * D;
                        cos_a[u][k] = load<T, V>(cs + co + col);
                        cos_b[u][k] = load<T, V>(cs + co + col + half);
                        sin_a[u][k] = load<T, V>(sn + co + col);
                        sin_b[u][k] = load<T, V>(sn + co + col + half);
                    }
                }
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
#pragma unroll
            for (int k = 0; k < NP; ++k)
                if (first + u * groups + g < hi && (k * G + t) * V < half)
                    sq[u] = sum_squares(c[u][k], sum_squares(a[u][k], sq[u]));
            for (unsigned o = G >> 1; o > 0; o >>= 1) sq[u] += __shfl_xor_sync(0xffffffffu, sq[u], o);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (first + u * groups + g >= hi) continue;
            const float rn = rsqrtf(sq[u] * inv_d + eps);
            const size_t co = (size_t)table(b[u], h[u], s[u]) * D;
            const size_t out = w.out(first + u * groups + g, b[u], h[u], s[u], R, D, head);
#pragma unroll
            for (int k = 0; k < NP; ++k) {
                const unsigned col = (k * G + t) * V;
                if (col < half) {
                    const Pack<T, V> na = rms_pack<T, MODE, V>(a[u][k], load<T, V>(wt + col), rn);
                    const Pack<T, V> nb = rms_pack<T, MODE, V>(c[u][k], load<T, V>(wt + col + half), rn);
                    Pack<T, V> ya, yb;
                    if constexpr (AHEAD)
                        rope_packs<T, V>(na, nb, cos_a[u][k], cos_b[u][k], sin_a[u][k], sin_b[u][k], ya, yb);
                    else
                        rope_packs<T, V>(na, nb, load<T, V>(cs + co + col), load<T, V>(cs + co + col + half),
                                         load<T, V>(sn + co + col), load<T, V>(sn + co + col + half), ya, yb);
                    for (unsigned q = 0; q < R; ++q) {
                        store_out<T, V, EVICT>(y + out + q * head + col, ya);
                        store_out<T, V, EVICT>(y + out + q * head + col + half, yb);
                    }
                }
            }
        }
    }
}

// Whether every pointer, stride and half allow 16-byte packs (the launcher's packs_fit, in Python).
template <typename T>
__device__ __forceinline__ bool packs_fit(const T* x, const T* wt, const T* cs, const T* sn, int half, const Rows& w,
                                          const T* y) {
    constexpr unsigned V = 16 / sizeof(T);
    return half % V == 0 && w.sB % V == 0 && w.s1 % V == 0 && w.s2 % V == 0 && aligned16(x) && aligned16(wt) &&
           aligned16(cs) && aligned16(sn) && aligned16(y);
}

// Any alignment: 16-byte packs where packs_fit, a row of up to 256 columns at most 32 packs a half, one
// a thread. Else single elements, up to 4 a half a thread (half <= 128: the ops refuse head_dim past
// 256). The row count a thread holds sets the kernel's registers (each instantiation is in every
// launch's budget), so the 16-byte path holds one pack from each half and no more.
template <typename T, int MODE, bool EVICT = false>
__device__ __forceinline__ void norm_rotary(const T* x, const T* wt, const T* cs, const T* sn, float eps, int half,
                                            int B, const Rows& w, int cB, int cH, int cS, int R, T* y) {
    constexpr int V = 16 / sizeof(T), U = FXK_NR_ROWS;
    if (half <= 0 || R <= 0 || half > 128) return;
    if (packs_fit(x, wt, cs, sn, half, w, y))
        norm_rotary_rows<T, MODE, V, 1, U, false, EVICT>(x, wt, cs, sn, eps, half, B, w, cB, cH, cS, R, y);
    else if (half <= 32)
        norm_rotary_rows<T, MODE, 1, 1, U, false, false>(x, wt, cs, sn, eps, half, B, w, cB, cH, cS, R, y);
    else if (half <= 64)
        norm_rotary_rows<T, MODE, 1, 2, U, false, false>(x, wt, cs, sn, eps, half, B, w, cB, cH, cS, R, y);
    else
        norm_rotary_rows<T, MODE, 1, 4, U, false, false>(x, wt, cs, sn, eps, half, B, w, cB, cH, cS, R, y);
}

// 16-byte packs only, with a row's cos and sin loaded AHEAD: eager PyTorch's kernel where its launcher
// found that packs fit. Without the element-wise paths in its budget it takes 56 registers a thread
// where norm_rotary takes 80 (H200, 2026-11-26, norm_rope_tuning.py in one run, Qwen3 / Gemma 3: q
// float32 3967 / 3964 GB/s against norm_rotary's 3908 / 3902, bfloat16 3934 / 3894 against 3708 /
// 3611; the keys repeated 0.6% slower, 3839 / 3828 against 3863 / 3852 float32 / bfloat16).
// A call packs do not fit (never from the launcher) writes nothing.
template <typename T, int MODE, bool EVICT>
__device__ __forceinline__ void norm_rotary_packs(const T* x, const T* wt, const T* cs, const T* sn, float eps,
                                                  int half, int B, const Rows& w, int cB, int cH, int cS, int R, T* y) {
    constexpr int V = 16 / sizeof(T);
    if (half <= 0 || R <= 0 || half > 128 || !packs_fit(x, wt, cs, sn, half, w, y)) return;
    norm_rotary_rows<T, MODE, V, 1, FXK_NR_PACK_ROWS, true, EVICT>(x, wt, cs, sn, eps, half, B, w, cB, cH, cS, R, y);
}

// x contiguous (B, S, H, D), the (B, H, S, D) rows walked heads inner: Qwen3's form.
__device__ __forceinline__ Rows heads_last(int S, int H, int D) { return rows_of(S, H, S * H * D, H * D, D, 1); }

}  // namespace fxk

// The ops' own kernels (what a TensorRT plugin launches), x contiguous as the norm reads it. n: x's numel.
template <typename T>
__global__ void __launch_bounds__(128) rms_norm_rotary(const T* x, const T* weight, const T* cs, const T* sn,
                                                       float eps, int half, int n, int S, int H, int cB, int cH,
                                                       int cS, T* y) {
    const int D = 2 * half;
    if (D <= 0 || S <= 0 || H <= 0) return;
    fxk::norm_rotary<T, fxk::RMS_LLAMA>(x, weight, cs, sn, eps, half, n / (S * H * D), fxk::heads_last(S, H, D),
                                        cB, cH, cS, 1, y);
}

template <typename T>
__global__ void __launch_bounds__(128) gemma_rms_norm_rotary(const T* x, const T* weight, const T* cs, const T* sn,
                                                             float eps, int half, int n, int H, int S, int cB, int cH,
                                                             int cS, T* y) {
    const int D = 2 * half;
    if (D <= 0 || S <= 0 || H <= 0) return;
    fxk::norm_rotary<T, fxk::RMS_GEMMA>(x, weight, cs, sn, eps, half, n / (S * H * D), fxk::contiguous_rows(H, S, D),
                                        cB, cH, cS, 1, y);
}

template <typename T>
__global__ void __launch_bounds__(128) rms_norm_rotary_repeat_kv(const T* x, const T* weight, const T* cs,
                                                                 const T* sn, float eps, int half, int batch,
                                                                 int kv_heads, int n_rep, int seq, int head_dim,
                                                                 int heads, int n, int cB, int cH, int cS, T* y) {
    if (head_dim != 2 * half) return;
    fxk::norm_rotary<T, fxk::RMS_LLAMA>(x, weight, cs, sn, eps, half, fxk::batches(batch, n, kv_heads, seq, head_dim),
                                        fxk::heads_last(seq, kv_heads, head_dim), cB, cH, cS, n_rep, y);
}

template <typename T>
__global__ void __launch_bounds__(128) gemma_rms_norm_rotary_repeat_kv(const T* x, const T* weight, const T* cs,
                                                                       const T* sn, float eps, int half, int batch,
                                                                       int kv_heads, int n_rep, int seq,
                                                                       int head_dim, int heads, int n, int cB, int cH,
                                                                       int cS, T* y) {
    if (head_dim != 2 * half) return;
    fxk::norm_rotary<T, fxk::RMS_GEMMA>(x, weight, cs, sn, eps, half, fxk::batches(batch, n, kv_heads, seq, head_dim),
                                        fxk::contiguous_rows(kv_heads, seq, head_dim), cB, cH, cS, n_rep, y);
}

// What every op runs in eager PyTorch: the (B, H, S, D) view of x read in place from x_span at strides
// sB, s1, s2 (walked (b, a1, a2), a2 the heads when heads_inner), gemma: Gemma's numbers, else Llama's.
// The launcher picks the kernel: norm_rotary_packs where 16-byte packs fit (norm_rotary_packs_repeat,
// storing evict-first, for n_rep > 1), else norm_rotary_strided, which takes any alignment.
namespace fxk {
template <typename T, bool PACKS, bool EVICT>
__device__ __forceinline__ void norm_rotary_strided(const T* x_span, const T* weight, const T* cs, const T* sn,
                                                    float eps, int half, int gemma, int B, int A1, int A2, int sB,
                                                    int s1, int s2, int heads_inner, int n_rep, int in_order, int cB,
                                                    int cH, int cS, T* y) {
    const Rows w = rows_of(A1, A2, sB, s1, s2, heads_inner, in_order);
    if constexpr (PACKS) {
        if (gemma)
            norm_rotary_packs<T, RMS_GEMMA, EVICT>(x_span, weight, cs, sn, eps, half, B, w, cB, cH, cS, n_rep, y);
        else
            norm_rotary_packs<T, RMS_LLAMA, EVICT>(x_span, weight, cs, sn, eps, half, B, w, cB, cH, cS, n_rep, y);
    } else {
        if (gemma)
            norm_rotary<T, RMS_GEMMA>(x_span, weight, cs, sn, eps, half, B, w, cB, cH, cS, n_rep, y);
        else
            norm_rotary<T, RMS_LLAMA>(x_span, weight, cs, sn, eps, half, B, w, cB, cH, cS, n_rep, y);
    }
}
}  // namespace fxk

// The three entry points share NORM_ROTARY_STRIDED's parameters (one schema); each is fxk::norm_rotary_strided
// with its PACKS and EVICT.
#define FXK_NR_STRIDED_KERNEL(name, PACKS, EVICT)                                                              \
    template <typename T>                                                                                     \
    __global__ void __launch_bounds__(128) name(                                                              \
        const T* x_span, const T* weight, const T* cs, const T* sn, float eps, int half, int gemma, int B,    \
        int A1, int A2, int sB, int s1, int s2, int heads_inner, int n_rep, int in_order, int cB, int cH,     \
        int cS, T* y) {                                                                                       \
        fxk::norm_rotary_strided<T, PACKS, EVICT>(x_span, weight, cs, sn, eps, half, gemma, B, A1, A2, sB,   \
                                                  s1, s2, heads_inner, n_rep, in_order, cB, cH, cS, y);       \
    }
FXK_NR_STRIDED_KERNEL(norm_rotary_strided, false, false)
FXK_NR_STRIDED_KERNEL(norm_rotary_packs, true, false)
FXK_NR_STRIDED_KERNEL(norm_rotary_packs_repeat, true, FXK_NR_EVICT_REPEATS != 0)
"""

# Output elements a 128-thread block takes (benchmarks/norm_rope_tuning.py, H100: 16-bit rows ran 3%
# faster than at 4096, float32 ones level; 2048 and 16384 slower; on an H200 too, 2026-11-26): at
# heads of 128, four steps of a block's thread groups at a row each in 16-bit types, eight in float32
# (norm_rotary_packs; half as many at two rows in the kernels that take any alignment).
ELEMENTS_PER_BLOCK = 8192
# The 16-byte kernels in float32 take half that, the same bytes a block as in 16-bit types (H200,
# 2026-11-26, benchmarks/norm_rope_tuning.py "4096 a block": float32 queries 1.4-1.5% faster, keys
# 1.8%; bfloat16 queries 2.3-3.3% slower, hence a twin of each op for 32-bit types, as softmax's grids).
ELEMENTS_PER_BLOCK_32BIT = 4096


def norm_rotary_geometry(inputs, outputs):
    """128 threads a block, a block per ELEMENTS_PER_BLOCK elements of the output."""
    return (cdiv(outputs[0].numel(), ELEMENTS_PER_BLOCK),), (128,)


def norm_rotary_geometry_32bit(inputs, outputs):
    """128 threads a block, a block per ELEMENTS_PER_BLOCK_32BIT elements of the output (float32)."""
    return (cdiv(outputs[0].numel(), ELEMENTS_PER_BLOCK_32BIT),), (128,)


_TENSORS = [InputDecl("x"), InputDecl("weight"), InputDecl("cos"), InputDecl("sin")]
_NORM_ROTARY_SCALARS = [ScalarInput("eps", float), ScalarInput("half", int)]
_COS_DIMS = [DimSize("cos", 0), DimSize("cos", 1), DimSize("cos", 2)]
_SIZE_INPUTS = [ScalarInput(n, int) for n in SIZES]


def _spec(kernel: str, repeat: bool) -> KernelSpec:
    """A public op's kernel: x contiguous as the norm reads it. Outputs come from the meta_fn (the
    result is (B, H, S, D) whatever x's order)."""
    if repeat:
        scalars, extras = [*_NORM_ROTARY_SCALARS, *_SIZE_INPUTS], [Numel("x"), *_COS_DIMS]
    else:  # x's axes 1 and 2: (S, H) in Qwen3's form, (H, S) in Gemma 3's
        scalars, extras = _NORM_ROTARY_SCALARS, [Numel("x"), DimSize("x", 1), DimSize("x", 2), *_COS_DIMS]
    return KernelSpec(SOURCE, kernel, inputs=[*_TENSORS, *scalars], extras=extras,
                      geometry=Custom(norm_rotary_geometry), dtypes=_DTYPES)


RMS_NORM_ROTARY = _spec("rms_norm_rotary", repeat=False)
GEMMA_RMS_NORM_ROTARY = _spec("gemma_rms_norm_rotary", repeat=False)
RMS_NORM_ROTARY_REPEAT_KV = _spec("rms_norm_rotary_repeat_kv", repeat=True)
GEMMA_RMS_NORM_ROTARY_REPEAT_KV = _spec("gemma_rms_norm_rotary_repeat_kv", repeat=True)
_SCHEMA = "(Tensor x, Tensor weight, Tensor cos, Tensor sin, float eps, int half) -> Tensor"
_REPEAT_SCHEMA = ("(Tensor x, Tensor weight, Tensor cos, Tensor sin, float eps, int half, "
                  + ", ".join(f"int {n}" for n in SIZES) + ") -> Tensor")

_STRIDED_ARGS = ("half", "gemma", "B", "A1", "A2", "sB", "s1", "s2", "heads_inner", "n_rep", "in_order", "cB", "cH",
                 "cS")
NORM_ROTARY_STRIDED = KernelSpec(
    SOURCE, "norm_rotary_strided",
    inputs=[InputDecl("x_span"), InputDecl("weight"), InputDecl("cos"), InputDecl("sin"), ScalarInput("eps", float),
            *[ScalarInput(n, int) for n in _STRIDED_ARGS]],
    geometry=Custom(norm_rotary_geometry),
    dtypes=_DTYPES,
)
STRIDED = f"{NAMESPACE}::_norm_rotary_strided"
NORM_ROTARY_PACKS = dataclasses.replace(NORM_ROTARY_STRIDED, kernel_name="norm_rotary_packs")
PACKS = f"{NAMESPACE}::_norm_rotary_packs"
NORM_ROTARY_PACKS_REPEAT = dataclasses.replace(NORM_ROTARY_STRIDED, kernel_name="norm_rotary_packs_repeat")
PACKS_REPEAT = f"{NAMESPACE}::_norm_rotary_packs_repeat"
_STRIDED_SCHEMA = ("(Tensor x_span, Tensor weight, Tensor cos, Tensor sin, float eps, "
                   + ", ".join(f"int {n}" for n in _STRIDED_ARGS) + ") -> Tensor")


# ---- the patterns (also the ops' CPU references) ---------------------------------------------------


def rms_norm_rotary_embedding(x, weight, cos, sin, eps: float, half: int):
    """Qwen3's queries: ``q_norm(q.view(B, S, H, D)).transpose(1, 2)`` (``LlamaRMSNorm``), then
    ``apply_rotary_pos_emb``."""
    return rotary_embedding(llama_rmsnorm(x, weight, eps).transpose(1, 2), cos, sin, half)


def gemma_rms_norm_rotary_embedding(x, weight, cos, sin, eps: float, half: int):
    """Gemma 3's queries: ``q_norm(q)`` (``GemmaRMSNorm``) of the ``(B, H, S, D)`` view, then
    ``apply_rotary_pos_emb``."""
    return rotary_embedding(gemma_rmsnorm(x, weight, eps), cos, sin, half)


def rms_norm_rotary_embedding_repeat_kv(x, weight, cos, sin, eps: float, half: int, batch: int, kv_heads: int,
                                        n_rep: int, seq: int, head_dim: int, heads: int):
    """Qwen3's grouped-query keys: normalised, rotated, then repeated (``repeat_kv``)."""
    return repeat_kv(rms_norm_rotary_embedding(x, weight, cos, sin, eps, half), batch, kv_heads, n_rep, seq, head_dim,
                     heads)


def gemma_rms_norm_rotary_embedding_repeat_kv(x, weight, cos, sin, eps: float, half: int, batch: int, kv_heads: int,
                                              n_rep: int, seq: int, head_dim: int, heads: int):
    """Gemma 3's grouped-query keys: normalised, rotated, then repeated."""
    return repeat_kv(gemma_rms_norm_rotary_embedding(x, weight, cos, sin, eps, half), batch, kv_heads, n_rep, seq,
                     head_dim, heads)


def _strided_reference(x_span, weight, cos, sin, eps, half, gemma, B, A1, A2, sB, s1, s2, heads_inner, n_rep, in_order,
                       cB, cH, cS):
    """NORM_ROTARY_STRIDED in PyTorch (its CPU impl): x rebuilt from the span, normalised, rotated, repeated,
    laid out as the kernel writes it."""
    x = x_span.as_strided((B, A1, A2, 2 * half), (sB, s1, s2, 1))
    x = x.transpose(1, 2) if heads_inner else x
    y = rotary_embedding((gemma_rmsnorm if gemma else llama_rmsnorm)(x, weight, eps), cos, sin, half)
    out = rotary.strided_output(x_span, 2 * half, B, A1, A2, heads_inner, n_rep, in_order)
    return out.copy_(y.repeat_interleave(n_rep, dim=1))


def _strided_output(x_span, weight, cos, sin, eps, half, gemma, B, A1, A2, sB, s1, s2, heads_inner, n_rep, in_order,
                    cB, cH, cS):
    """NORM_ROTARY_STRIDED's output: (B, H * n_rep, S, 2 * half), contiguous or in the walk's order
    (rotary.strided_output). A private op: the public ops check their calls before they run it."""
    return rotary.strided_output(x_span, 2 * half, B, A1, A2, heads_inner, n_rep, in_order)


# ---- checks and outputs ---------------------------------------------------------------------------


class _Form:
    """One public op: its name, the norm's numbers, and whether x comes before the transpose (Qwen3:
    (B, S, H, D)) or after it (Gemma 3: (B, H, S, D)) and whether the result is repeated."""

    def __init__(self, name: str, gemma: bool, repeat: bool):
        self.name, self.gemma, self.repeat = name, gemma, repeat
        self.qualname = f"{NAMESPACE}::{name}"

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """x as the rotation reads it, (B, H, S, D)."""
        return x if self.gemma else x.transpose(1, 2)

    def output(self, x, weight, cos, sin, eps, half, *sizes):
        """The op's meta_fn: checks the call, returns one (B, H[ * n_rep], S, D) tensor laid out as eager
        lays it out: repeated rows contiguous, the others as rotary's (rotary.like_eager)."""
        op = self.qualname
        if x.dim() != 4:
            layout = "(batch, heads, positions, head_dim)" if self.gemma else "(batch, positions, heads, head_dim)"
            raise KernelInputError(f"{op}: x {tuple(x.shape)} must be 4-d {layout}, as the norm reads it")
        heads = self.heads(x)
        d = x.shape[-1]
        if weight.dtype != x.dtype or weight.dim() != 1:
            raise KernelInputError(f"{op}: weight {weight.dtype} {tuple(weight.shape)} must be x's dtype ({x.dtype}) "
                                   f"and 1-d, (head_dim,)")
        if 2 * half > MAX_HEAD_DIM:  # half is always a concrete int: checked under TensorRT's symbols too
            raise KernelInputError(f"{op}: head_dim {2 * half} is more than {MAX_HEAD_DIM}, the most the kernel holds "
                                   f"in one warp; run {NAMESPACE}::rms_norm and rotary_embedding apart")
        # the checks of sizes on concrete ones only: TensorRT's shape inference gives each axis a free
        # symbol (the rules matched only calls whose sizes passed them)
        if rotary._concrete(x, weight, cos, sin):
            rotary._check(heads, cos, sin, half, op, x_name="x" if self.gemma else "x.transpose(1, 2)")
            if weight.shape[0] != d:
                raise KernelInputError(f"{op}: weight {tuple(weight.shape)} must be (head_dim,) = ({d},)")
        if self.repeat:
            rotary._check_sizes(op, heads, *sizes)
            batch, _, _, seq, head_dim, n_heads = sizes
            return x.new_empty((batch, n_heads, seq, head_dim))
        return rotary.like_eager(heads)


def packs_fit(x_span, weight, cos, sin, half, sB, s1, s2) -> bool:
    """Whether the kernel's 16-byte packs fit these operands (its own packs_fit; the output is a fresh
    allocation): half and the walk's strides whole packs, every pointer 16-byte aligned."""
    v = 16 // x_span.element_size()
    return (half % v == 0 and sB % v == 0 and s1 % v == 0 and s2 % v == 0
            and all(t.data_ptr() % 16 == 0 for t in (x_span, weight, cos, sin)))


def _eager(form: _Form, launchers):
    """A public op on CUDA: checks the call, narrows broadcast tables, and runs a strided kernel on x
    where it lies, decided once per signature as rotary's ops do. ``launchers``: NORM_ROTARY_STRIDED's
    (any alignment), then NORM_ROTARY_PACKS's and NORM_ROTARY_PACKS_REPEAT's (n_rep > 1) by element
    size (their grid for 32-bit types and for 16-bit ones), as strided_launchers returns them."""
    strided, packs, packs_repeat = launchers
    decided = Signatures()

    def on_cuda(x, weight, cos, sin, eps, half, *sizes):
        key = (tensor_signature(x, weight, cos, sin), half, sizes)
        how = decided.get(key)
        if how is None:
            out = form.output(x, weight, cos, sin, eps, half, *sizes)
            rotary.check_size(form.qualname, "the output", out.shape)  # a repeat's is n_rep times x's
            heads = form.heads(x)
            n_rep = out.shape[1] // heads.shape[1] if heads.shape[1] else 1
            how = decided.remember(key, (rotary._broadcast_axes(cos, sin), rotary.walk(heads) if x.numel() else None,
                                         n_rep, tuple(out.shape), rotary.in_walk_order(out)))
        axes, layout, n_rep, out_shape, in_order = how
        if not x.numel():
            return rotary.like_eager(form.heads(x)) if in_order else x.new_empty(out_shape)
        heads, (b, a1, a2, sb, s1, s2, heads_inner, span) = rotary.walked(form.qualname, form.heads(x), layout)
        cos, sin = rotary._narrow(cos, sin, axes)
        x_span, weight = heads.as_strided((span,), (1,)), weight.contiguous()
        if packs_fit(x_span, weight, cos, sin, half, sb, s1, s2):
            launch = (packs_repeat if n_rep > 1 else packs)[x_span.element_size()]
        else:
            launch = strided
        return launch(x_span, weight, cos, sin, eps, half, int(form.gemma), b, a1, a2, sb, s1, s2, heads_inner, n_rep,
                      in_order, *cos.shape[:3])

    on_cuda.__name__ = form.name
    return on_cuda


# ---- the rules ------------------------------------------------------------------------------------


def _operands(form: _Form):
    """A filter: weight is x's (head_dim,) row of x's dtype, head_dim at most MAX_HEAD_DIM, and x as
    the rotation reads it, cos, sin and half pass rotary's checks (and the repeat's sizes, where captured)."""

    def accept(match) -> bool:
        x, weight, cos, sin = (match.bindings[n].meta.get("val") for n in ("x", "weight", "cos", "sin"))
        half = match.bindings.get("half")
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or not isinstance(weight, torch.Tensor):
            return False
        if weight.dtype != x.dtype or weight.dim() != 1 or not statically_known_true(weight.shape[0] == x.shape[3]):
            return False
        heads = form.heads(x)
        if not rotary.rotates(heads, cos, sin, half) or 2 * half > MAX_HEAD_DIM:
            return False
        return not form.repeat or rotary.repeats(heads, [match.bindings.get(n) for n in SIZES])

    accept.__name__ = f"{form.name}_operands"
    return accept


# Traced with literals nothing else in the pattern holds: head_dim 74 (half 37), and for the repeats
# batch 13, kv_heads 5, n_rep 7, seq 11, heads 35 (the transpose's axes are 1 and 2, the slices' 3); in
# each dtype the graph has (the norm casts back to x's dtype, a literal of the traced graph).
_SIZES = (13, 5, 7, 11, 74, 35)


def _examples(gemma: bool, repeat: bool):
    def examples(dtype: torch.dtype):
        x = torch.zeros((13, 5, 11, 74) if gemma else (13, 11, 5, 74), dtype=dtype)
        tables = [torch.zeros(1, 1, 11, 74, dtype=dtype) for _ in range(2)]
        return (x, torch.zeros(74, dtype=dtype), *tables, SENTINELS[float], 37, *(_SIZES if repeat else ()))

    return examples


def strided_launchers(strided, packs, packs_repeat, geometry_32bit=norm_rotary_geometry_32bit):
    """The eager path's private ops, (qualname, spec) each: NORM_ROTARY_STRIDED, NORM_ROTARY_PACKS and
    NORM_ROTARY_PACKS_REPEAT, or a variant's, and a twin of each packs op for 32-bit types
    (``<qualname>_32bit``, in ``geometry_32bit``). Registers them; returns the strided launcher, then the
    packs and repeating packs launchers by element size ({4: twin, 2: op})."""
    twins = [(name + "_32bit", dataclasses.replace(spec, geometry=Custom(geometry_32bit))) for name, spec in
             (packs, packs_repeat)]
    any_alignment, packs16, repeat16, packs32, repeat32 = rotary.launchers(
        (strided, packs, packs_repeat, *twins), _strided_reference, _strided_output, _STRIDED_SCHEMA)
    return any_alignment, {4: packs32, 2: packs16}, {4: repeat32, 2: repeat16}


def register(rules) -> None:
    # Ahead of the norm and rotary rules, each of which matches inside these (library/__init__.py), and
    # the repeating forms ahead of the plain ones they hold. Not inside inductor, which fuses the norm
    # and the rotation into one reduction kernel itself.
    strided = strided_launchers((STRIDED, NORM_ROTARY_STRIDED), (PACKS, NORM_ROTARY_PACKS),
                                (PACKS_REPEAT, NORM_ROTARY_PACKS_REPEAT))
    for pattern, spec, gemma, repeat in (
            (rms_norm_rotary_embedding_repeat_kv, RMS_NORM_ROTARY_REPEAT_KV, False, True),
            (gemma_rms_norm_rotary_embedding_repeat_kv, GEMMA_RMS_NORM_ROTARY_REPEAT_KV, True, True),
            (rms_norm_rotary_embedding, RMS_NORM_ROTARY, False, False),
            (gemma_rms_norm_rotary_embedding, GEMMA_RMS_NORM_ROTARY, True, False)):
        form = _Form(pattern.__name__, gemma, repeat)
        op = cuda_kernel_op(form.qualname, spec, reference=pattern, meta_fn=form.output,
                            schema=_REPEAT_SCHEMA if repeat else _SCHEMA, eager_fn=_eager(form, strided),
                            past_limits="reference")
        add_rule(rules, pattern, op, form.name, filter=_operands(form), irs=COMPILE_FREE_IRS,
                 example_inputs=_examples(gemma, repeat))
