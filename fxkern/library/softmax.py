"""Softmax over the last axis, one read and one write of each row.

Forms matched: ``F.softmax(x, dim=-1)``, ``x.softmax(-1)``, ``torch.softmax(x, -1)``, ``nn.Softmax(-1)``
(all ``aten.softmax(x, -1)``), and transformers' eager attention
``F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)`` (Llama, Mistral, Qwen2, Gemma...).
Both compute in float32 and round once, so they share one kernel; a softmax over another axis
(``dim=0``, or a positive index of the last axis) is not matched. Attention's scale and mask add
before it (``scores * scaling + mask`` or ``scores / math.sqrt(d) + mask``, transformers' eager
attention) run in the same kernel, read on the way in (``MaskedRows``), and so does Gemma 2's soft
cap of the scores (``cap * tanh(scores * scaling / cap) + mask``). T5 does not scale its scores: its
``scores + position_bias`` (the mask added into the bias) and its ``softmax(scores.float(),
dim=-1).type_as(scores)`` run in the scaled kernel at a scale of 1 (``masked_softmax``), and its
softmax alone, after the in-place ``scores += ...`` the export IR keeps, in the plain one
(``t5_softmax``). GPT-OSS concatenates one learned logit a head (its attention sinks) to the scaled,
masked scores, subtracts the row's max and drops the sinks' column after the softmax: the scaled
kernel with the sink in the row's max and sum (``sink_masked_softmax``).

Kernel: the row layout of :mod:`fxkern.library.rmsnorm` (a 256-thread block per register-full of
elements, 8192 in float32 and 16384 in 16-bit, 1 to 256 threads a row, the row in registers; short
rows in small blocks of one to four warps); one reduction of (max, sum of ``exp(x - max)``) pairs, or
(``FXK_TWO_REDUCTIONS``) the max and then the sums shifted to it, then the write. Rows too long for
registers take an online max/sum pass and a second read. Rows not in whole 16-byte packs (an odd
prompt length) run in each grid's ``EDGES`` kernel, read in the aligned packs around them, where the
row fits a block's registers and the scores start on a 16-byte boundary; others take a scalar path.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from collections.abc import Collection

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxkern.library._rules import (
    COMPILE_FREE_IRS,
    DTYPES,
    NAMESPACE,
    add_rule,
    aligned_at_launch,
    broadcasts_4d,
    check_broadcast_4d,
    has_rows,
    per_call,
    row_geometry_8k,
    row_geometry_16k,
)
from fxkern.errors import KernelInputError
from fxkern.library.cuda_common import COMMON, row_tuning
from fxkern.ops import cuda_kernel_op, kernel_op
from fxkern.patterns import SENTINELS
from fxkern.symbolic import cdiv
from fxkern.spec import (
    Custom,
    DimSize,
    InputDecl,
    KernelSpec,
    Numel,
    OutputDecl,
    SameAs,
    ScalarInput,
)

SOURCE = COMMON + row_tuning(blocks_f32=4, blocks_half=4) + r"""
namespace fxk {

// exp(v - m): 2^((v - m) * log2(e)) through MUFU.EX2 (ex2.approx.ftz: relative error about 2^-22,
// far under a half ulp of a 16-bit output, and holding float32 rows to 1e-5 against float64), results
// under 2^-126 flushed to zero. FAST (float16/bfloat16) always; float32 too with FXK_EXP_FTZ, else
// exp2f, whose fix-up for subnormal results (a compare, a halving, a squaring and their predicates)
// took about 8 instructions an exp: H200, 2026-11-26, float32 masked rows of 512 / 2048 keys +3.6% /
// +13%, soft-capped +4.4% / +8.1% (benchmarks/masked_tuning.py, softcap_tuning.py). The difference is
// taken first: v * log2(e) - m * log2(e) overflows to inf - inf = NaN for masked scores (finfo.min,
// as attention masks write them) when m is one too. -inf - -inf and inf - inf give NaN, as v - m
// does in PyTorch.
#ifndef FXK_EXP_FTZ
#define FXK_EXP_FTZ 1
#endif
template <bool FAST>
__device__ __forceinline__ float exp_shifted(float v, float m) {
    if (FAST || FXK_EXP_FTZ) {
        float r;
        asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"((v - m) * 1.4426950408889634f));
        return r;
    }
    return exp2f((v - m) * 1.4426950408889634f);
}

// (m, s): a running max and the sum of exp(x - m) over the elements seen. s == 0 adds nothing
// (also when m is -inf); a NaN s stays NaN, so a NaN anywhere in the row makes the row NaN.
template <typename T>
__device__ __forceinline__ float ms_term(float s, float m, float M) {
    return s == 0.0f ? 0.0f : s * exp_shifted<sizeof(T) == 2>(m, M);
}
template <typename T>
__device__ __forceinline__ void ms_combine(float& m, float& s, float m2, float s2) {
    const float M = fmaxf(m, m2);
    s = ms_term<T>(s, m, M) + ms_term<T>(s2, m2, M);
    m = M;
}
// The row's max and sum of exp(x - max) in one reduction over a group of G consecutive threads
// (G as for group_sum); slot holds 2 x ROW_WARPS floats of shared memory no other live reduction uses.
template <typename T>
__device__ __forceinline__ void group_max_sum(float& m, float& s, int G, float (*slot)[ROW_WARPS]) {
    const int w = G < 32 ? G : 32;
    for (int o = w >> 1; o > 0; o >>= 1)
        ms_combine<T>(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
    if (G <= 32) return;
    if ((threadIdx.x & 31) == 0) { slot[0][threadIdx.x >> 5] = m; slot[1][threadIdx.x >> 5] = s; }
    __syncthreads();
    const int first = (threadIdx.x >> log2_of(G)) * (G >> 5);
    m = slot[0][first];
    s = slot[1][first];
#pragma unroll
    for (int k = 1; k < ROW_WARPS; ++k)
        if (k < (G >> 5)) ms_combine<T>(m, s, slot[0][first + k], slot[1][first + k]);
}

// A row's elements as the softmax reads them: the tensor itself (Rows), or attention scores scaled
// and masked on the way in (MaskedRows). row(r) finds the r-th row the kernel visits, once: its
// input, and its offset o in the input and the output; pack<V>(row, col) reads V elements. With
// FETCH_FIRST, softmax_rows fetches all of a row's packs (fetch<V>: their loads, Raw<V>) before it
// makes their values (value<V>): the masked kernel makes each pack from two loads, and making it as
// they arrive sent a thread's loads out a pair at a time (benchmarks/masked_tuning.py).
// Rows not in whole 16-byte packs (a prompt of odd length: 1001 keys), or a mask that is not aligned, in
// packs all the same (EDGES in softmax_rows): a row starting p elements past a 16-byte boundary is read
// in the aligned packs around it, its k-th pack at column k * V - p, so the first and last packs hold
// elements of the rows beside it (never outside the tensor's 16-byte chunks: no other allocation), which
// count as -inf and are not written. The output has the scores' phase (the host allocates it, the kernel
// checks); the mask has its own, its packs shifted in registers into the scores' (funnel). Before
// 2026-11-28 such rows took the scalar path, 4 elements a thread: 4x32x1001x1001 scaled, masked rows ran
// at 0.46x inductor in float32 and 0.56x in bfloat16 on an H200 (benchmarks/library.py, "odd length").
// FXK_EDGES=1 builds a kernel for these rows only (a grid of its own, _grids' EDGES): in the aligned
// kernels the path took registers their own paths then lacked (spills, and fewer blocks an SM).
#ifndef FXK_EDGES
#define FXK_EDGES 0
#endif
template <typename T, int V>
__device__ __forceinline__ int phase(const T* p) {  // elements past the 16-byte boundary before p
    return (int)((reinterpret_cast<unsigned long long>(p) / sizeof(T)) & (V - 1));
}
__device__ __forceinline__ bool same_phase(const void* a, const void* b) {
    return ((reinterpret_cast<unsigned long long>(a) ^ reinterpret_cast<unsigned long long>(b)) & 15ull) == 0;
}
// The V elements starting d elements into a then b (0 <= d < V): a barrel shift of their 32-bit words by
// selects (rows of different d in one warp do not diverge), then a funnel shift by half a word for an
// odd d of a 16-bit T.
template <typename T, int V>
__device__ __forceinline__ Pack<T, V> funnel(const Pack<T, V>& a, const Pack<T, V>& b, int d) {
    static_assert(sizeof(T) * V == 16, "16-byte packs");
    const unsigned* wa = reinterpret_cast<const unsigned*>(a.v);
    const unsigned* wb = reinterpret_cast<const unsigned*>(b.v);
    const int bytes = d * (int)sizeof(T), words = bytes >> 2, bits = (bytes & 3) * 8;
    unsigned w[8], u[6], v[5];
#pragma unroll
    for (int i = 0; i < 4; ++i) { w[i] = wa[i]; w[i + 4] = wb[i]; }
#pragma unroll
    for (int i = 0; i < 6; ++i) u[i] = (words & 2) ? w[i + 2] : w[i];
#pragma unroll
    for (int i = 0; i < 5; ++i) v[i] = (words & 1) ? u[i + 1] : u[i];
    Pack<T, V> o;
    unsigned* wo = reinterpret_cast<unsigned*>(o.v);
#pragma unroll
    for (int i = 0; i < 4; ++i) wo[i] = __funnelshift_r(v[i], v[i + 1], bits);
    return o;
}
// A pack at column col of a row of D (EDGES): its elements outside the row made -inf.
template <typename T, int V>
__device__ __forceinline__ Pack<T, V> edges(Pack<T, V> c, int col, int D) {
    if (col < 0 || col + V > D) {
#pragma unroll
        for (int j = 0; j < V; ++j)
            if (col + j < 0 || col + j >= D) c.v[j] = from_f<T>(neg_inf());
    }
    return c;
}
// Stores the pack at column col of the row at yr, but for its elements outside the row (EDGES). The whole
// pack goes out as one st.global.v4: written as a store of the pack, nvcc merged it with the elements'
// stores of the other branch into 2- and 4-byte stores (bfloat16 rows of 1001 keys ran at 1267 GB/s
// so, at 1778 with every pack stored whole: H200, 2026-11-28, benchmarks/masked_tuning.py's diagnostics).
template <typename T, int V, bool EDGES>
__device__ __forceinline__ void store_row(T* __restrict__ yr, int col, int D, const Pack<T, V>& c) {
    if constexpr (EDGES) {
        if (col < 0 || col + V > D) {
#pragma unroll
            for (int j = 0; j < V; ++j)
                if (col + j >= 0 && col + j < D) yr[col + j] = c.v[j];
        } else {
            const unsigned* w = reinterpret_cast<const unsigned*>(c.v);
            asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(yr + col), "r"(w[0]), "r"(w[1]), "r"(w[2]),
                         "r"(w[3]));
        }
    } else {
        store<T, V>(yr + col, c);
    }
}

template <typename T>
struct Rows {
    const T* __restrict__ x;
    int D;
    struct Row { const T* x; size_t o; };
    __device__ __forceinline__ Row row(unsigned r) const { return {x + (size_t)r * D, (size_t)r * D}; }
    static constexpr bool FETCH_FIRST = false;
    static constexpr bool SINK_ROWS = false;
    template <int V>
    __device__ __forceinline__ Pack<T, V> pack(const Row& r, int col) const { return load<T, V>(r.x + col); }
    // EDGES: no mask to shift
    template <int V>
    __device__ __forceinline__ int mask_shift(const Row&, int) const { return 0; }
    template <int V>
    __device__ __forceinline__ Pack<T, V> pack_around(const Row& r, int col, int, int) const { return pack<V>(r, col); }
    static constexpr int PAD_APART = 1;  // see FXK_EDGES_PAD_APART
};

// T(T(x * scale) + mask): the scaled, masked scores as eager PyTorch rounds them (each op rounds to
// T), from scores viewed as (B, H, Q, D) rows and a (mB, mH, mQ, D) mask broadcast onto them (each
// of mB, mH, mQ is 1 or the scores' size). When the heads share the mask (mH = 1: transformers'
// causal and padding masks), rows are visited in (b, q, h) order, so the heads of one query row run
// together and read its mask row while it is in cache; in memory order a mask row came back only
// after Q other rows, from L2 or memory (at 2x16x2048x2048 in float32, 32 reads of a 16 MB mask
// among 512 MB of scores: 16% slower). When the batch shares a per-head mask (mB = 1, mH = H: T5's
// position bias, (1, H, Q, D)), rows are visited in (h, q, b) order, so a mask row is read from memory
// once for the whole batch; in memory order each batch read the whole mask again (32 MB in float32 at
// 32x512x512, past what L2 keeps among the streamed scores). Otherwise rows are visited in memory
// order. Two divisions a row. (Memory order for masks small enough to stay in L2 was 4% faster for a
// 0.5 MB bfloat16 one, but choosing at run time made the float32 kernels spill: masked_tuning.py.)
// FXK_MASK_PAIRS=0 keeps the 16-bit prologue on the float path (benchmarks/masked_tuning.py's baseline).
#ifndef FXK_MASK_PAIRS
#define FXK_MASK_PAIRS 1
#endif
// FXK_CAP_PAIRS=0 keeps the soft-capped bfloat16 prologue on the float path (benchmarks/softcap_tuning.py).
// float16 keeps it there: with tanhf its pairs path spilled in the 256-thread grid, and it is unmeasured.
#ifndef FXK_CAP_PAIRS
#define FXK_CAP_PAIRS 1
#endif
// FXK_MASK_FETCH_FIRST=1: MaskedRows fetches a row's scores and mask before it makes their values.
#ifndef FXK_MASK_FETCH_FIRST
#define FXK_MASK_FETCH_FIRST 0
#endif
// FXK_EDGES_PAD_APART: where an EDGES kernel that does not fetch first makes its packs' out-of-row
// elements -inf (edges): 1, in a loop of its own after all of a thread's packs are made; 0, beside each
// pack's load; 2, apart in blocks of more than 4 packs a thread, beside in the others. Beside each
// load, nvcc waited for a pack before loading the next: the plain softmax (Rows, always apart since)
// ran its bfloat16 rows of 1001 at 2540 GB/s so, 0.72x inductor, apart at 3917 (H200, 2026-11-28).
// MaskedRows, whose packs are made as their loads arrive anyway, keeps 2: bfloat16 4x32x1001 / 1x32x4001
// 2402 / 2418 GB/s, against 2234 / 2422 at 1 and 2370 / 2192 at 0 (benchmarks/masked_tuning.py).
#ifndef FXK_EDGES_PAD_APART
#define FXK_EDGES_PAD_APART 2
#endif
//
// CAP (Gemma 2's soft-capped scores): T(T(cap * T(tanh(T(T(x * scale) * (1 / cap))))) + mask), each
// op rounded to T as eager rounds it (its division by a Python number multiplies by the float32
// reciprocal). tanh is tanhf, except in bfloat16, where tanh.approx.f32 costs one instruction instead
// of tanhf's twenty or so, which left the kernel short of issue slots (benchmarks/softcap_tuning.py),
// and, rounded to bfloat16, is eager's tanhf rounded for every bfloat16 input (tools/tanh_bf16.py).
// (tanh.approx.bf16x2 is not: 2086 inputs a bfloat16 ulp off, which the cap multiplies.)
template <bool FAST>
__device__ __forceinline__ float tanh_(float v) {
    if (FAST) {
        float r;
        asm("tanh.approx.f32 %0, %1;" : "=f"(r) : "f"(v));
        return r;
    }
    return tanhf(v);
}
template <typename T> struct IsBf16 { static constexpr bool value = false; };
template <> struct IsBf16<__nv_bfloat16> { static constexpr bool value = true; };

//
// SINK (GPT-OSS's attention sinks): one more logit a row, sinks[h] of the row's head (Row::sink).
template <typename T, bool CAP = false, bool SINK = false>
struct MaskedRows {
    const T* __restrict__ x;
    const T* __restrict__ mask;
    const T* __restrict__ sinks;
    float scale, cap, inv_cap;
    int D;
    unsigned B, H, Q;           // the scores' batches, heads and queries
    unsigned sB, sH, sQ;        // the mask's row strides per batch, head and query (0: broadcast)
    bool scale_is_t;            // the scale is exactly a T (0.125 is; 1 / sqrt(96) is not)
    bool cap_is_t;              // and the cap (Gemma 2's 50.0 is)
    __device__ __forceinline__ MaskedRows(const T* x_, const T* mask_, float scale_, int D_, unsigned rows, int H_,
                                          int Q_, int mB, int mH, int mQ, float cap_ = 1.0f, const T* sinks_ = nullptr)
        : x(x_), mask(mask_), sinks(sinks_), scale(scale_), cap(cap_), inv_cap(__frcp_rn(cap_)), D(D_),
          B(H_ > 0 && Q_ > 0 ? rows / ((unsigned)H_ * (unsigned)Q_) : 0u), H((unsigned)H_), Q((unsigned)Q_),
          sB(mB > 1 ? (unsigned)(mH * mQ) : 0u), sH(mH > 1 ? (unsigned)mQ : 0u), sQ(mQ > 1 ? 1u : 0u),
          scale_is_t(to_f<T>(from_f<T>(scale_)) == scale_), cap_is_t(to_f<T>(from_f<T>(cap_)) == cap_) {}
    struct Row { const T* x; const T* m; size_t o; float sink; };
    __device__ __forceinline__ Row row(unsigned r) const {
        unsigned b, h, q;
        if (sH == 0) {  // the same for every thread: no divergence
            const unsigned bq = r / H;
            h = r - bq * H;
            b = bq / Q;
            q = bq - b * Q;
        } else if (sB == 0 && B > 1) {  // the batch shares a per-head mask: (h, q, b)
            const unsigned hq = r / B;
            b = r - hq * B;
            h = hq / Q;
            q = hq - h * Q;
        } else {
            const unsigned bh = r / Q;
            q = r - bh * Q;
            b = bh / H;
            h = bh - b * H;
        }
        const unsigned mrow = b * sB + h * sH + q * sQ;
        const size_t o = ((size_t)(b * H + h) * Q + q) * D;
        // (a block's rows past the last one find an h past H: no sink read there)
        return {x + o, mask + (size_t)mrow * D, o, SINK && h < H ? to_f<T>(sinks[h]) : 0.0f};
    }
    static constexpr bool FETCH_FIRST = FXK_MASK_FETCH_FIRST;
    static constexpr bool SINK_ROWS = SINK;
    // MAKE_ALL (with FETCH_FIRST): every pack's values made, unguarded, from packs zeroed before their
    // fetch. The float32 prologue's guarded block (4 FMUL, 4 FADD: eager's two roundings) stayed a
    // branch of its own in ptxas's code, its values held apart from the packs they came from (80-88
    // registers); made for every pack it is one straight block, 62-64 registers, as the one-fma block
    // was. H200, 2026-11-26 (benchmarks/masked_tuning.py): float32 rows of 512 +5.9% (4097 GB/s against
    // 3869), of 2048 +3.8%; soft-capped (softcap_tuning.py) +1% and +8.8% (3337 against 3067), its _32bit
    // grid's spill gone; in 16-bit level, so not there.
    static constexpr bool MAKE_ALL = sizeof(T) == 4;
    template <int V> struct Raw { Pack<T, V> x, m; };
    template <int V>
    __device__ __forceinline__ Raw<V> fetch(const Row& r, int col) const {
        return {load<T, V>(r.x + col), load<T, V>(r.m + col)};
    }
    template <int V>
    __device__ __forceinline__ Pack<T, V> pack(const Row& r, int col) const { return value<V>(fetch<V>(r, col)); }
    // EDGES: the mask's phase against the scores' (p), and the scores' pack at col (col = -p mod V) with the
    // mask's two aligned packs around its columns, each read only where it holds one of the row's elements.
    template <int V>
    __device__ __forceinline__ int mask_shift(const Row& r, int p) const { return (phase<T, V>(r.m) - p) & (V - 1); }
    template <int V> struct Around { Pack<T, V> x, m, m2; };
    template <int V>
    __device__ __forceinline__ Around<V> fetch_around(const Row& r, int col, int d, int D) const {
        Around<V> a{load<T, V>(r.x + col), {}, {}};
        const T* m = r.m + (col - d);  // 16-byte aligned
        if (col - d + V > 0) a.m = load<T, V>(m);
        if (d != 0 && col - d + V < D) a.m2 = load<T, V>(m + V);
        return a;
    }
    template <int V>
    __device__ __forceinline__ Pack<T, V> value_around(const Around<V>& a, int d) const {
        return value<V>(Raw<V>{a.x, funnel<T, V>(a.m, a.m2, d)});
    }
    template <int V>
    __device__ __forceinline__ Pack<T, V> pack_around(const Row& r, int col, int d, int D) const {
        return value_around<V>(fetch_around<V>(r, col, d, D), d);
    }
    static constexpr int PAD_APART = FXK_EDGES_PAD_APART;
    template <int V>
    __device__ __forceinline__ Pack<T, V> value(const Raw<V>& raw) const {
        const Pack<T, V>& a = raw.x;
        const Pack<T, V>& m = raw.m;
        if constexpr (CAP) {
            if constexpr (FXK_CAP_PAIRS && IsBf16<T>::value && V % 2 == 0) {
                // As the masked pairs below: x * scale, cap * tanh and + mask each a product or sum of
                // two bfloat16 values rounded once, when the scale and the cap are bfloat16; only the
                // division (times 1 / cap, not a bfloat16) and tanh go through float.
                if (scale_is_t && cap_is_t) {
                    using P = typename Pair<T>::P;
                    const P s2 = Pair<T>::t(scale, scale), c2 = Pair<T>::t(cap, cap);
                    const P *pa = reinterpret_cast<const P*>(a.v), *pm = reinterpret_cast<const P*>(m.v);
                    Pack<T, V> o;
                    P* po = reinterpret_cast<P*>(o.v);
#pragma unroll
                    for (int j = 0; j < V / 2; ++j) {
                        const float2 v = Pair<T>::f(__hmul2_rn(pa[j], s2));
                        const float2 u = Pair<T>::f(Pair<T>::t(__fmul_rn(v.x, inv_cap), __fmul_rn(v.y, inv_cap)));
                        const P t = Pair<T>::t(tanh_<IsBf16<T>::value>(u.x), tanh_<IsBf16<T>::value>(u.y));
                        po[j] = __hadd2_rn(__hmul2_rn(t, c2), pm[j]);
                    }
                    return o;
                }
            }
            // __fmul_rn/__fadd_rn: each op on its own, never contracted into an fma eager does not do
            float f[V], g[V];
            to_floats(a, f);
#pragma unroll
            for (int j = 0; j < V; ++j) f[j] = __fmul_rn(f[j], scale);
            to_floats(from_floats<T, V>(f), f);
#pragma unroll
            for (int j = 0; j < V; ++j) f[j] = __fmul_rn(f[j], inv_cap);
            to_floats(from_floats<T, V>(f), f);
#pragma unroll
            for (int j = 0; j < V; ++j) f[j] = tanh_<IsBf16<T>::value>(f[j]);
            to_floats(from_floats<T, V>(f), f);
#pragma unroll
            for (int j = 0; j < V; ++j) f[j] = __fmul_rn(f[j], cap);
            to_floats(from_floats<T, V>(f), f);
            to_floats(m, g);
#pragma unroll
            for (int j = 0; j < V; ++j) f[j] = __fadd_rn(f[j], g[j]);
            return from_floats<T, V>(f);
        }
        if constexpr (FXK_MASK_PAIRS && sizeof(T) == 2 && V % 2 == 0) {
            // 16-bit pairs through mul.rn/add.rn .x2 when the scale is a T: a product or sum of two
            // T values rounded once to T is eager's float32 product or sum rounded (exact in float32
            // before that rounding), in a fifth of the float path's instructions.
            if (scale_is_t) {
                using P = typename Pair<T>::P;
                const P s2 = Pair<T>::t(scale, scale);
                const P *pa = reinterpret_cast<const P*>(a.v), *pm = reinterpret_cast<const P*>(m.v);
                Pack<T, V> o;
                P* po = reinterpret_cast<P*>(o.v);
#pragma unroll
                for (int j = 0; j < V / 2; ++j) po[j] = __hadd2_rn(__hmul2_rn(pa[j], s2), pm[j]);
                return o;
            }
        }
        // __fmul_rn/__fadd_rn: in float32 the rounding to T is no op, and x * scale + mask would contract
        // into one fma, rounded once where eager rounds twice
        float f[V], g[V];
        to_floats(a, f);
#pragma unroll
        for (int j = 0; j < V; ++j) f[j] = __fmul_rn(f[j], scale);
        to_floats(from_floats<T, V>(f), f);  // rounded to T, as eager's multiplication stores it
        to_floats(m, g);
#pragma unroll
        for (int j = 0; j < V; ++j) f[j] = __fadd_rn(f[j], g[j]);
        return from_floats<T, V>(f);
    }
};

// FXK_PAIR_MAX: a 16-bit row's max taken in pairs (__hmax2: one HMNMX2 for two elements, no
// conversion to float), where it took a conversion and an FMNMX an element. The same max: __hmax2,
// like fmaxf, returns the other operand of a NaN. Nsight Compute put the 16-bit masked kernels at
// 73-76% of issue slots (H200, 2026-11-26); in pairs they ran 3-4% faster (benchmarks/masked_tuning.py).
// The soft-capped kernel sets it to 0: there it spilled 8 bytes and ran 1-2% slower.
#ifndef FXK_PAIR_MAX
#define FXK_PAIR_MAX 1
#endif

// FXK_TWO_REDUCTIONS: a row of at most FXK_TWO_REDUCTIONS_G threads (a warp: shuffles only) reduced
// twice, its max, then each thread's sum shifted to it (one exp a thread) and summed, where each of the
// log2(G) steps of the pairs' reduction (group_max_sum) took two exps; longer rows keep the one
// reduction (one barrier, not two). 1: in 16-bit rows; 2: every row (the soft-capped kernel's); 0: none.
// H200, 2026-11-26 (benchmarks/masked_tuning.py, softcap_tuning.py, two runs each): masked bfloat16
// rows of 512 +2%, soft-capped +3%, soft-capped float32 +6.6%; masked float32 ones 3.5% slower, so 1 there.
#ifndef FXK_TWO_REDUCTIONS
#define FXK_TWO_REDUCTIONS 1
#endif
#ifndef FXK_TWO_REDUCTIONS_G
#define FXK_TWO_REDUCTIONS_G 32
#endif

// exp(T(v - M)): GPT-OSS's eager attention subtracts the max of the row and its sink in T, rounding
// the difference, before its softmax (whose own max is then 0).
template <typename T>
__device__ __forceinline__ float exp_rounded(float v, float M) {
    return exp_shifted<sizeof(T) == 2>(to_f<T>(from_f<T>(v - M)), 0.0f);
}

// exp_rounded of a pack into e. 16-bit pairs take their difference from M (a T: one of the row's values
// or the sink) in one .x2 add of -M, which rounds the exact difference once: eager's float32 difference
// rounded to T (float32 has more than twice T's precision, so rounding twice changes nothing), with no
// conversion to float and back.
template <typename T, int V>
__device__ __forceinline__ void exps_rounded(const Pack<T, V>& c, float M, float (&e)[V]) {
    if constexpr (sizeof(T) == 2 && V % 2 == 0) {
        using P = typename Pair<T>::P;
        const P neg = Pair<T>::t(-M, -M);
        const P* pc = reinterpret_cast<const P*>(c.v);
#pragma unroll
        for (int j = 0; j < V / 2; ++j) {
            const float2 d = Pair<T>::f(__hadd2_rn(pc[j], neg));
            e[2 * j] = exp_shifted<true>(d.x, 0.0f);
            e[2 * j + 1] = exp_shifted<true>(d.y, 0.0f);
        }
    } else {
        float f[V];
        to_floats(c, f);
#pragma unroll
        for (int j = 0; j < V; ++j) e[j] = exp_rounded<T>(f[j], M);
    }
}

// The softmax of a row held in registers, written to yr: c holds this thread's packs of it (the k-th at
// column (k * G + t) * V - p: p is the row's phase with EDGES, else 0); slot is 2 x ROW_WARPS floats of
// shared memory no other live reduction uses.
// SINK: the row has one more logit, sink, which counts in its max and sum and is not written; the max
// taken first, the sum then of exp(T(x - max)) as eager computes it (exp_rounded).
template <typename T, int V, int NV, bool SINK = false, bool EDGES = false>
__device__ __forceinline__ void write_row(Pack<T, V> (&c)[NV], bool live, int D, int G, int t, T* __restrict__ yr,
                                          float (*slot)[ROW_WARPS], float sink = 0.0f, int p = 0) {
    float m = neg_inf();
    if constexpr (FXK_PAIR_MAX && sizeof(T) == 2 && V % 2 == 0) {
        using P = typename Pair<T>::P;
        P pm = Pair<T>::t(neg_inf(), neg_inf());
#pragma unroll
        for (int k = 0; k < NV; ++k) {
            const int col = (k * G + t) * V - p;
            if (live && col < D) {
                const P* pc = reinterpret_cast<const P*>(c[k].v);
#pragma unroll
                for (int j = 0; j < V / 2; ++j) pm = __hmax2(pm, pc[j]);
            }
        }
        const float2 mm = Pair<T>::f(pm);
        m = fmaxf(mm.x, mm.y);
    } else {
#pragma unroll
        for (int k = 0; k < NV; ++k) {
            const int col = (k * G + t) * V - p;
            if (live && col < D) {
                float f[V];
                to_floats(c[k], f);
#pragma unroll
                for (int j = 0; j < V; ++j) m = fmaxf(m, f[j]);
            }
        }
    }
    if constexpr (SINK) {
        const float M = group_max(fmaxf(m, sink), G, slot[0]);
        float s = t == 0 ? exp_rounded<T>(sink, M) : 0.0f;  // the sink's term, once a row
#pragma unroll
        for (int k = 0; k < NV; ++k) {
            const int col = (k * G + t) * V - p;
            if (live && col < D) {
                float e[V];
                exps_rounded(c[k], M, e);
#pragma unroll
                for (int j = 0; j < V; ++j) s += e[j];
            }
        }
        const float inv = __frcp_rn(group_sum(s, G, slot[1]));
#pragma unroll
        for (int k = 0; k < NV; ++k) {
            const int col = (k * G + t) * V - p;
            if (live && col < D) {
                float e[V];
                opaque(c[k]);
                exps_rounded(c[k], M, e);
#pragma unroll
                for (int j = 0; j < V; ++j) e[j] *= inv;
                store_row<T, V, EDGES>(yr, col, D, from_floats<T, V>(e));
            }
        }
        return;
    }
    // This thread's sum of exp(x - m) (shifted by 0 when its elements are all -inf or NaN: 0, or NaN),
    // then the row's: its max, then the sums shifted to it (FXK_TWO_REDUCTIONS), or one reduction of
    // (max, sum) pairs.
    const float sh = m == neg_inf() ? 0.0f : m;
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
        const int col = (k * G + t) * V - p;
        if (live && col < D) {
            float f[V];
            to_floats(c[k], f);
#pragma unroll
            for (int j = 0; j < V; ++j) s += exp_shifted<sizeof(T) == 2>(f[j], sh);
        }
    }
    if ((FXK_TWO_REDUCTIONS == 2 || (FXK_TWO_REDUCTIONS == 1 && sizeof(T) == 2)) && G <= FXK_TWO_REDUCTIONS_G) {
        const float M = group_max(m, G, slot[0]);
        s = group_sum(ms_term<T>(s, m, M), G, slot[1]);  // this thread's sum, shifted to the row's max
        m = M;
    } else {
        group_max_sum<T>(m, s, G, slot);
    }
    const float inv = __frcp_rn(s);  // 1.0f / s, without the division's slow path
#pragma unroll
    for (int k = 0; k < NV; ++k) {
        const int col = (k * G + t) * V - p;
        if (live && col < D) {
            float f[V];
            opaque(c[k]);
            to_floats(c[k], f);
#pragma unroll
            for (int j = 0; j < V; ++j) f[j] = exp_shifted<sizeof(T) == 2>(f[j], m) * inv;
            store_row<T, V, EDGES>(yr, col, D, from_floats<T, V>(f));
        }
    }
}

// EDGES: rows in the aligned packs around them (see phase); the caller checked that a row and V - 1
// elements more fit in a block's registers.
template <typename T, int V, int NV, bool EDGES = false, typename In>
__device__ __forceinline__ void softmax_rows(const In& in, int D, unsigned rows, T* __restrict__ y,
                                             float (*red)[ROW_WARPS]) {
    unsigned begin, end;
    block_rows((unsigned)D, rows, begin, end);
    const int G = row_group(EDGES ? D + V - 1 : D, V * NV);
    if (EDGES || G * V * NV >= D) {
        const int groups = ROW_THREADS >> log2_of(G), g = threadIdx.x >> log2_of(G), t = threadIdx.x & (G - 1);
        for (unsigned first = begin, p = 0; first < end; first += groups, ++p) {
            const unsigned row = first + g;
            const bool live = row < end;
            const auto xr = in.row(row);
            // EDGES: the row's phase, and its mask's against it (the same for all of the row's threads)
            const int at = EDGES ? phase<T, V>(xr.x) : 0;
            const int d = EDGES ? in.template mask_shift<V>(xr, at) : 0;
            Pack<T, V> c[NV];
            constexpr bool apart = In::PAD_APART == 1 || (In::PAD_APART == 2 && NV > 4);  // FXK_EDGES_PAD_APART
            if constexpr (EDGES && In::FETCH_FIRST) {
                // each pack holds its scores and two mask packs until made (a thread's packs fetched two
                // at a time cost the 16-bit small blocks 13%: benchmarks/masked_tuning.py)
                typename In::template Around<V> raw[NV];
#pragma unroll
                for (int k = 0; k < NV; ++k) {
                    const int col = (k * G + t) * V - at;
                    if constexpr (In::MAKE_ALL) raw[k] = {};
                    if (live && col < D) raw[k] = in.template fetch_around<V>(xr, col, d, D);
                }
#pragma unroll
                for (int k = 0; k < NV; ++k) {
                    const int col = (k * G + t) * V - at;
                    if (In::MAKE_ALL || (live && col < D))
                        c[k] = edges<T, V>(in.template value_around<V>(raw[k], d), col, D);
                }
            } else if constexpr (In::FETCH_FIRST) {
                typename In::template Raw<V> raw[NV];
#pragma unroll
                for (int k = 0; k < NV; ++k) {
                    const int col = (k * G + t) * V;
                    if constexpr (In::MAKE_ALL) raw[k] = {};  // a pack not read: zeros, whose values go unread
                    if (live && col < D) raw[k] = in.template fetch<V>(xr, col);
                }
#pragma unroll
                for (int k = 0; k < NV; ++k) {
                    const int col = (k * G + t) * V;
                    if (In::MAKE_ALL || (live && col < D)) c[k] = in.template value<V>(raw[k]);
                }
            } else {
#pragma unroll
                for (int k = 0; k < NV; ++k) {
                    const int col = (k * G + t) * V - at;
                    if (live && col < D) {
                        if constexpr (EDGES && apart)
                            c[k] = in.template pack_around<V>(xr, col, d, D);
                        else if constexpr (EDGES)
                            c[k] = edges<T, V>(in.template pack_around<V>(xr, col, d, D), col, D);
                        else
                            c[k] = in.template pack<V>(xr, col);
                    }
                }
                if constexpr (EDGES && apart) {
#pragma unroll
                    for (int k = 0; k < NV; ++k) {
                        const int col = (k * G + t) * V - at;
                        if (live && col < D) c[k] = edges<T, V>(c[k], col, D);
                    }
                }
            }
            float sink = 0.0f;
            if constexpr (In::SINK_ROWS) sink = xr.sink;
            write_row<T, V, NV, In::SINK_ROWS, EDGES>(c, live, D, G, t, y + xr.o, red + 2 * (p & 1), sink, at);
        }
    } else if constexpr (!EDGES) {  // long rows: online max and sum, then a second read
        // columns counted in 64 bits: a row may hold up to 2^31 - 1 elements, and an int column stepped
        // past it wrapped below zero
        for (unsigned row = begin, p = 0; row < end; ++row, ++p) {
            const auto xr = in.row(row);
            if constexpr (In::SINK_ROWS) {  // three reads: the max, the sum of exp(T(x - max)), the write
                float m = xr.sink;
#pragma unroll 2
                for (long long col = threadIdx.x * V; col < D; col += ROW_THREADS * V) {
                    const Pack<T, V> c = in.template pack<V>(xr, col);
#pragma unroll
                    for (int j = 0; j < V; ++j) m = fmaxf(m, to_f<T>(c.v[j]));
                }
                const float M = group_max(m, ROW_THREADS, red[0]);
                float s = threadIdx.x == 0 ? exp_rounded<T>(xr.sink, M) : 0.0f;
#pragma unroll 2
                for (long long col = threadIdx.x * V; col < D; col += ROW_THREADS * V) {
                    const Pack<T, V> c = in.template pack<V>(xr, col);
#pragma unroll
                    for (int j = 0; j < V; ++j) s += exp_rounded<T>(to_f<T>(c.v[j]), M);
                }
                const float inv = __frcp_rn(group_sum(s, ROW_THREADS, red[1]));
                T* yr = y + xr.o;
#pragma unroll 4
                for (long long col = threadIdx.x * V; col < D; col += ROW_THREADS * V) {
                    const Pack<T, V> c = in.template pack<V>(xr, col);
                    Pack<T, V> o;
#pragma unroll
                    for (int j = 0; j < V; ++j) o.v[j] = from_f<T>(exp_rounded<T>(to_f<T>(c.v[j]), M) * inv);
                    store<T, V>(yr + col, o);
                }
                continue;
            }
            // s: this thread's sum of exp(x - sh), sh its running max m, or 0 while every element it has
            // seen is -inf or NaN (fmaxf skips NaN: a NaN still reaches s, and makes the row NaN)
            float m = neg_inf(), s = 0.0f;
#pragma unroll 2
            for (long long col = threadIdx.x * V; col < D; col += ROW_THREADS * V) {
                const Pack<T, V> c = in.template pack<V>(xr, col);
                float pm = m;
#pragma unroll
                for (int j = 0; j < V; ++j) pm = fmaxf(pm, to_f<T>(c.v[j]));
                const float sh = m == neg_inf() ? 0.0f : m, psh = pm == neg_inf() ? 0.0f : pm;
                if (psh != sh) s = ms_term<T>(s, sh, psh);
#pragma unroll
                for (int j = 0; j < V; ++j) s += exp_shifted<sizeof(T) == 2>(to_f<T>(c.v[j]), psh);
                m = pm;
            }
            const float gm = group_max(m, ROW_THREADS, red[0]);
            s = ms_term<T>(s, m == neg_inf() ? 0.0f : m, gm);
            const float inv = __frcp_rn(group_sum(s, ROW_THREADS, red[1]));
            T* yr = y + xr.o;
#pragma unroll 4
            for (long long col = threadIdx.x * V; col < D; col += ROW_THREADS * V) {
                const Pack<T, V> c = in.template pack<V>(xr, col);
                Pack<T, V> o;
#pragma unroll
                for (int j = 0; j < V; ++j) o.v[j] = from_f<T>(exp_shifted<sizeof(T) == 2>(to_f<T>(c.v[j]), gm) * inv);
                store<T, V>(yr + col, o);
            }
        }
    }
}

}  // namespace fxk

template <typename T>
__global__ void __launch_bounds__(ROW_THREADS, sizeof(T) == 4 ? FXK_ROW_BLOCKS_F32 : FXK_ROW_BLOCKS_HALF) softmax_last(const T* x, int D, int n, T* y) {
    __shared__ float red[4][ROW_WARPS];
    if (D <= 0) return;
    const unsigned rows = (unsigned)n / (unsigned)D;
    constexpr int V = 16 / sizeof(T);
    const fxk::Rows<T> in{x, D};
    constexpr int NV = sizeof(T) == 4 ? FXK_ROW_PACKS_F32 : FXK_ROW_PACKS_HALF;
    if constexpr (FXK_EDGES) {
        if (fxk::same_phase(x, y) && D <= ROW_THREADS * V * NV - (V - 1)) {
            fxk::softmax_rows<T, V, NV, true>(in, D, rows, y, red);
            return;
        }
    } else if (D % V == 0 && fxk::aligned16(x) && fxk::aligned16(y)) {
        fxk::softmax_rows<T, V, NV>(in, D, rows, y, red);
        return;
    }
    fxk::softmax_rows<T, 1, FXK_ROW_SCALARS>(in, D, rows, y, red);
}

// softmax(T(T(x * scale) + mask)) over rows of x viewed as (B, H, Q, D), the mask (mB, mH, mQ, D).
// DIV: the scale is a divisor, applied as x * (1 / divisor), as PyTorch's CUDA division by a Python
// number does. CAP: the scores soft-capped before the mask is added (MaskedRows).
template <typename T, bool DIV, bool CAP = false, bool SINK = false>
__device__ __forceinline__ void masked_softmax(const T* x, const T* mask, float scale, int H, int Q, int D, int n,
                                               int mB, int mH, int mQ, T* y, float (*red)[ROW_WARPS],
                                               float cap = 1.0f, const T* sinks = nullptr) {
    if (D <= 0) return;
    const unsigned rows = (unsigned)n / (unsigned)D;
    constexpr int V = 16 / sizeof(T);
    const fxk::MaskedRows<T, CAP, SINK> in(x, mask, DIV ? __frcp_rn(scale) : scale, D, rows, H, Q, mB, mH, mQ, cap,
                                           sinks);
    constexpr int NV = sizeof(T) == 4 ? FXK_ROW_PACKS_F32 : FXK_ROW_PACKS_HALF;
    if constexpr (FXK_EDGES) {
        if (fxk::same_phase(x, y) && D <= ROW_THREADS * V * NV - (V - 1)) {
            fxk::softmax_rows<T, V, NV, true>(in, D, rows, y, red);
            return;
        }
    } else if (D % V == 0 && fxk::aligned16(x) && fxk::aligned16(mask) && fxk::aligned16(y)) {
        fxk::softmax_rows<T, V, NV>(in, D, rows, y, red);
        return;
    }
    fxk::softmax_rows<T, 1, FXK_ROW_SCALARS>(in, D, rows, y, red);
}

template <typename T>
__global__ void __launch_bounds__(ROW_THREADS, sizeof(T) == 4 ? FXK_ROW_BLOCKS_F32 : FXK_ROW_BLOCKS_HALF)
scaled_masked_softmax(const T* x, const T* mask, float scale, int H, int Q, int D, int n, int mB, int mH, int mQ, T* y) {
    __shared__ float red[4][ROW_WARPS];
    masked_softmax<T, false>(x, mask, scale, H, Q, D, n, mB, mH, mQ, y, red);
}

// softmax(T(x + mask)): T5's attention, whose scores are not scaled (the scaled kernel's code, at a scale of 1,
// which is exact: x * 1 is x, and the 16-bit prologue takes its pairs path).
template <typename T>
__global__ void __launch_bounds__(ROW_THREADS, sizeof(T) == 4 ? FXK_ROW_BLOCKS_F32 : FXK_ROW_BLOCKS_HALF)
unscaled_masked_softmax(const T* x, const T* mask, int H, int Q, int D, int n, int mB, int mH, int mQ, T* y) {
    __shared__ float red[4][ROW_WARPS];
    masked_softmax<T, false>(x, mask, 1.0f, H, Q, D, n, mB, mH, mQ, y, red);
}

template <typename T>
__global__ void __launch_bounds__(ROW_THREADS, sizeof(T) == 4 ? FXK_ROW_BLOCKS_F32 : FXK_ROW_BLOCKS_HALF)
divided_masked_softmax(const T* x, const T* mask, float divisor, int H, int Q, int D, int n, int mB, int mH, int mQ,
                       T* y) {
    __shared__ float red[4][ROW_WARPS];
    masked_softmax<T, true>(x, mask, divisor, H, Q, D, n, mB, mH, mQ, y, red);
}

template <typename T>
__global__ void __launch_bounds__(ROW_THREADS, sizeof(T) == 4 ? FXK_ROW_BLOCKS_F32 : FXK_ROW_BLOCKS_HALF)
softcapped_masked_softmax(const T* x, const T* mask, float scale, float cap, int H, int Q, int D, int n, int mB,
                          int mH, int mQ, T* y) {
    __shared__ float red[4][ROW_WARPS];
    masked_softmax<T, false, true>(x, mask, scale, H, Q, D, n, mB, mH, mQ, y, red, cap);
}

// GPT-OSS's attention: softmax over the row and its head's sink of T(T(x * scale) + mask), each less
// their max in T, the sink's column not written (batch and queries are the pattern's expand sizes, the
// scores' own: the op checks them).
template <typename T>
__global__ void __launch_bounds__(ROW_THREADS, sizeof(T) == 4 ? FXK_ROW_BLOCKS_F32 : FXK_ROW_BLOCKS_HALF)
sink_masked_softmax(const T* x, const T* mask, const T* sinks, float scale, int batch, int queries, int H, int Q,
                    int D, int n, int mB, int mH, int mQ, T* y) {
    __shared__ float red[4][ROW_WARPS];
    masked_softmax<T, false, false, true>(x, mask, scale, H, Q, D, n, mB, mH, mQ, y, red, 1.0f, sinks);
}
"""

SOFTMAX = KernelSpec(
    SOURCE, "softmax_last",
    inputs=[InputDecl("x")],
    outputs=[OutputDecl("y", SameAs("x"))],
    extras=[DimSize("x", -1), Numel("x")],
    geometry=Custom(row_geometry_16k),
    dtypes=DTYPES,
)
# Attention's scores (B, H, Q, D), scaled and masked on the way in: the mask is (mB, mH, mQ, D),
# each of mB, mH, mQ 1 or the scores' size (transformers builds (B, 1, Q, D) causal masks, BERT
# (B, 1, 1, D) padding masks).
SCALED_MASKED_SOFTMAX = KernelSpec(
    SOURCE, "scaled_masked_softmax",
    inputs=[InputDecl("x"), InputDecl("mask"), ScalarInput("scale", float)],
    outputs=[OutputDecl("y", SameAs("x"))],
    extras=[DimSize("x", -3), DimSize("x", -2), DimSize("x", -1), Numel("x"),
            DimSize("mask", -4), DimSize("mask", -3), DimSize("mask", -2)],
    geometry=Custom(row_geometry_16k),
    dtypes=DTYPES,
)
# The same with a divisor (``scores / math.sqrt(head_dim)``); eager runs it as the division by a
# Python number, the library's op as a multiplication by its reciprocal, as PyTorch's CUDA kernel does.
DIVIDED_MASKED_SOFTMAX = dataclasses.replace(
    SCALED_MASKED_SOFTMAX, kernel_name="divided_masked_softmax",
    inputs=[InputDecl("x"), InputDecl("mask"), ScalarInput("divisor", float)])
# T5's unscaled scores plus a mask (its position bias, the padding or causal mask added in): the scaled
# kernel at a scale of 1.
MASKED_SOFTMAX = dataclasses.replace(SCALED_MASKED_SOFTMAX, kernel_name="unscaled_masked_softmax",
                                     inputs=[InputDecl("x"), InputDecl("mask")])
# Gemma 2's soft-capped scores: ``cap * tanh(scores * scale / cap) + mask``; the row's max as floats
# (FXK_PAIR_MAX 0), rows of up to a warp reduced twice in float32 too (FXK_TWO_REDUCTIONS 2).
SOFTCAPPED_MASKED_SOFTMAX = dataclasses.replace(
    SCALED_MASKED_SOFTMAX, kernel_name="softcapped_masked_softmax",
    kernel_source="#ifndef FXK_PAIR_MAX\n#define FXK_PAIR_MAX 0\n#endif\n"
                  "#ifndef FXK_TWO_REDUCTIONS\n#define FXK_TWO_REDUCTIONS 2\n#endif\n" + SOURCE,
    inputs=[InputDecl("x"), InputDecl("mask"), ScalarInput("scale", float), ScalarInput("cap", float)])
# GPT-OSS's scores with their attention sinks (one logit a head, ``sinks`` (H,)); batch and queries are the
# sizes the pattern expands the sinks to, which the op checks against the scores'.
SINK_MASKED_SOFTMAX = dataclasses.replace(
    SCALED_MASKED_SOFTMAX, kernel_name="sink_masked_softmax",
    inputs=[InputDecl("x"), InputDecl("mask"), InputDecl("sinks"), ScalarInput("scale", float),
            ScalarInput("batch", int), ScalarInput("queries", int)])


# Short rows held in whole packs (attention's scores) run in small blocks, many an SM: float32 rows of
# up to 1024 elements in 64-thread blocks of 4 packs a thread, 16-bit rows of up to 2048 in one-warp
# blocks of 8 packs (the plain softmax's 16-bit rows; the masked ops' take NARROW_GRIDS). (threads,
# packs) by element size; a block's register-full is the longest row _grid sends it.
SHORT_BLOCKS = {4: (64, 4), 2: (32, 8)}
SHORT_ROWS = {size: threads * packs * 16 // size for size, (threads, packs) in SHORT_BLOCKS.items()}
# The longest rows the 256-thread grids hold in registers, by element size ("_32bit"'s and ""'s).
ROW_ELEMENTS = {4: 8192, 2: 16384}
# The masked kernels' rows of up to 2048 elements in small blocks of 4 packs a thread: suffix ->
# (element size, longest row, threads a block), each at 896 threads an SM (MASKED_TUNING's
# blocks_narrow one-warp blocks) and 72 registers. A thread fetches 8 packs of scores and mask instead
# of 16: 16-bit rows of up to 2048 had one-warp blocks of 8 packs at 128 registers, 16 an SM, and
# float32 rows past 1024 the 256-thread blocks, 2 an SM (whose soft-capped kernel spills 336 bytes).
# (The float32 one spills 12 bytes in the masked kernel and 16 in the soft-capped one, whose bfloat16 one
# spills 8, since the max and the sum are reduced apart there: tools/kernel_resources.py. They ran faster so.)
# H200, 2026-11-26, benchmarks/masked_tuning.py and softcap_tuning.py, GB/s against the grids before:
# - "_short_4packs": bfloat16 at 512 keys, masked 3473 against 3272, soft-capped 2870 against 2715; 24
#   blocks an SM level, 32 (48 bytes spilled) 15% slower.
# - "_4packs_2048": bfloat16 at 2048 keys, masked 3438 against 3396 (two runs, +1.2% each; +0.9% on an
#   H100), soft-capped 2942 against 2828.
# - "_4packs_2048_32bit": float32 at 2048 keys, masked 3419 against 3305 (+3.4%, +3.6% in a first run;
#   on an H100 0.4% slower), soft-capped 2809 against 2621 (8-16 bytes spilled; 6 an SM, no spill, 2682).
NARROW_PACKS = 4
LONG = "_long"  # the masked kernel's 16-bit rows past those, in whole packs (_grids' blocks_long)
EDGES = "_edges"  # appended to a grid's suffix: its kernel for rows not in whole packs (FXK_EDGES)
NARROW_GRIDS = {"_short_4packs": (2, 1024, 32), "_4packs_2048": (2, 2048, 64), "_4packs_2048_32bit": (4, 2048, 128)}
_SMALL_ROWS = max(*SHORT_ROWS.values(), *(longest for _, longest, _ in NARROW_GRIDS.values()))


def _small_blocks(spec: KernelSpec, element_size: int, blocks: int, packs: int | None = None,
                  threads: int | None = None, steps: int = 1) -> KernelSpec:
    """``spec`` for one element size in the small blocks (``SHORT_BLOCKS``; ``packs`` a thread and
    ``threads`` a block if given), ``blocks`` resident an SM (its launch bounds), a block per
    ``steps`` register-fulls of elements (softmax_rows takes them one after another)."""
    shipped_threads, shipped_packs = SHORT_BLOCKS[element_size]
    threads, packs = threads or shipped_threads, packs or shipped_packs
    elements = threads * packs * 16 // element_size * steps
    size = "F32" if element_size == 4 else "HALF"
    macros = "".join(f"#define {k} {v}\n" for k, v in
                     (("ROW_THREADS", threads), (f"FXK_ROW_PACKS_{size}", packs), (f"FXK_ROW_BLOCKS_{size}", blocks)))

    def geometry(inputs, outputs):
        return (cdiv(inputs[0].numel(), elements),), (threads,)

    return dataclasses.replace(spec, kernel_source=macros + spec.kernel_source, geometry=Custom(geometry))


def _grids(spec: KernelSpec, blocks_short_32bit: int = 16, blocks_short: int = 32, blocks_f32: int | None = None,
           fetch_first: tuple[str, ...] = (), blocks_narrow: int | None = None,
           narrow: Collection[str] = tuple(NARROW_GRIDS), steps: dict[str, int] | None = None,
           blocks_long: int | None = None, edges: bool = True,
           edges_fetch_first: Collection[str] | None = None) -> dict[str, KernelSpec]:
    """The grids a softmax kernel runs in, by the suffix of their private ops' names.

    ``""``: ``spec``'s own, a 256-thread block per 16384 elements (TensorRT plugins carry it; a
    16-bit block's register-full). ``blocks_long``: adds ``LONG``, that grid at ``blocks_long`` blocks
    an SM, for 16-bit rows past the small grids' in whole, aligned packs (``_grid``; rows that are
    not, such as prompts of an odd length, take ``""``'s EDGES kernel). ``"_32bit"``: a block per 8192,
    a float32 block's register-full,
    ``blocks_f32`` of them an SM (default: the source's), for float32 rows that fit (longer ones keep
    ``spec``'s grid, one block a row up to 16384 elements rather than blocks left without a row).
    ``"_short_32bit"`` and ``"_short"``: the small blocks (``SHORT_BLOCKS``) for float32 and 16-bit
    rows, ``blocks_short_32bit`` and ``blocks_short`` of them an SM; measured faster there than the
    256-thread blocks (benchmarks/row_tuning.py --softmax; docs/library.md, "Rows").
    ``fetch_first``: the grids whose masked kernels fetch a row's packs before they make their
    values (``FXK_MASK_FETCH_FIRST``), by suffix. ``blocks_narrow``: adds the ``NARROW_GRIDS`` named in
    ``narrow``, small blocks of ``NARROW_PACKS`` packs a thread, as many threads an SM as that many
    one-warp blocks; ``"_short"`` is left out when they hold every 16-bit row it would take (``_grid``
    never picks it then). ``steps``: register-fulls a block of those grids takes, one after another, by
    suffix (default 1). ``edges``: each grid but ``LONG`` also as ``suffix + EDGES``, its kernel built
    for rows not in whole packs (a prompt of odd length) read in the aligned packs around them
    (``FXK_EDGES``), which ``_grid`` picks for such rows that fit. ``edges_fetch_first``: the grids whose
    EDGES kernels fetch first, by the grid's suffix (default: ``fetch_first``'s)."""
    blocks = f"#define FXK_ROW_BLOCKS_F32 {blocks_f32}\n" if blocks_f32 else ""
    grids = {"": spec, "_32bit": dataclasses.replace(spec, geometry=Custom(row_geometry_8k),
                                                     kernel_source=blocks + spec.kernel_source),
             "_short_32bit": _small_blocks(spec, 4, blocks_short_32bit)}
    if blocks_long:
        grids[LONG] = dataclasses.replace(spec, kernel_source=f"#define FXK_ROW_BLOCKS_HALF {blocks_long}\n"
                                          + spec.kernel_source)
    built = [suffix for suffix in NARROW_GRIDS if suffix in narrow] if blocks_narrow else []
    if max((NARROW_GRIDS[s][1] for s in built if NARROW_GRIDS[s][0] == 2), default=0) < SHORT_ROWS[2]:
        grids["_short"] = _small_blocks(spec, 2, blocks_short)
    for suffix in built:
        size, _, threads = NARROW_GRIDS[suffix]
        if blocks_narrow * 32 % threads:
            raise ValueError(f"blocks_narrow = {blocks_narrow}: {suffix}'s {threads}-thread blocks cannot make "
                             f"{blocks_narrow * 32} threads an SM; give a multiple of {threads // 32}")
        grid = _small_blocks(spec, size, blocks_narrow * 32 // threads, NARROW_PACKS, threads,
                             (steps or {}).get(suffix, 1))
        # their rows of 2-4 warps reduce twice too, float32 ones included (FXK_TWO_REDUCTIONS 2 and _G),
        # at a barrier each: H200, 2026-11-26, 2048 keys: masked bfloat16 +2.9%, float32 +13.8%,
        # soft-capped float32 +11.7%, bfloat16 +4.4% (benchmarks/masked_tuning.py's "barriers too" and
        # "float32 rows too"; rows of up to a warp ran 1-5% slower with the barriers' code in their
        # kernels, and masked float32 ones 3.5% slower reduced twice, so only these grids take it)
        two = f"#define FXK_TWO_REDUCTIONS 2\n#define FXK_TWO_REDUCTIONS_G {threads}\n" if threads > 32 else ""
        grids[suffix] = dataclasses.replace(grid, kernel_source=two + grid.kernel_source)
    def fetched(g: KernelSpec, first: Collection[str], suffix: str) -> KernelSpec:
        return dataclasses.replace(g, kernel_source="#define FXK_MASK_FETCH_FIRST 1\n" + g.kernel_source) \
            if suffix in first else g

    out = {suffix: fetched(g, fetch_first, suffix) for suffix, g in grids.items()}
    if edges:
        first = fetch_first if edges_fetch_first is None else edges_fetch_first
        for suffix, g in grids.items():
            if suffix != LONG:
                g = fetched(g, first, suffix)
                out[suffix + EDGES] = dataclasses.replace(g, kernel_source="#define FXK_EDGES 1\n" + g.kernel_source)
    return out


# The masked kernel reads two tensors into registers: it runs half the blocks an SM, each thread with
# twice the registers, and in the small blocks fetches a row's scores and mask before it makes their
# values (benchmarks/masked_tuning.py: 5-19% more bandwidth at 512 and 2048 keys than the softmax's
# grids). Its 16-bit rows of up to 2048 all take NARROW_GRIDS, so blocks_short applies only where those
# are left out (benchmarks/masked_tuning.py's variants). The float32 small blocks fetch first since
# their scores are rounded as eager rounds them (x * scale, then + mask, not one fma): with the values
# made as loads arrived that cost 7.4% at 512 keys on an H100 and 18% on an H200, fetched first 0% and
# 12% (H100, 2026-11-26 16:01 UTC: 2868 GB/s against the fma's 2866; H200, 20:48-20:50 UTC: 3606 against
# 4091); 12 of those blocks an SM, not 8, won back half of that on the H200 (3835 GB/s), and MaskedRows'
# MAKE_ALL the rest (4097, 21:13 UTC). The 16-bit 2048-key blocks take two rows one after another
# (masked +3%, soft-capped +4.5% on the H200 at 20:46 UTC; +1-2.6% on an H100).
MASKED_TUNING = {"blocks_short_32bit": 12, "blocks_short": 16, "blocks_f32": 2,
                 "fetch_first": ("_short", *NARROW_GRIDS, "_short_32bit"), "blocks_narrow": 28,
                 "steps": {"_4packs_2048": 2}}
# Rows past 2048 keys fetched first too: 16-bit ones in whole packs in LONG, at 2 blocks an SM (128
# registers a thread and 40 bytes of local memory, where "" made values as loads arrived in 62-64 and
# none), float32 ones in "_32bit" (96 registers, against 71, at the 2 blocks an SM it had; its EDGES
# kernel, which takes float32 rows of up to 8189 not in whole packs, fetches first too). 16-bit rows not
# in whole packs (a prompt of odd length) take ""'s EDGES kernel at 4 blocks an SM: 2 was not timed
# there. H200, 2026-11-28, GB/s float32 / bfloat16 against the grids before (benchmarks/masked_tuning.py
# --shape ..., section masked_tuning_2x16x4096_1x16x8192_1x4x16384 of docs/benchmarks.md):
# 2x16x4096x4096 3666 / 3113 against 2712 / 2903; 1x16x8192x8192 (the pieces
# fxkern.split cuts a 1x32x8192x8192 call into) 3550 / 3089 against 2664 / 2885 (inductor 2942 / 1938);
# 1x4x16384x16384 bfloat16 3272 against 2968 (float32 rows that long are read twice: level). The sink
# kernel takes this tuning too (benchmarks/sink_tuning.py, H200, 2026-11-28 19:03 UTC, GB/s float32 /
# bfloat16: 1x16x8192x8192 3791 / 3353 against MASKED_TUNING's 2774 / 2873; 4x32x1001x1001 3359 / 2419
# against 3358 / 2111). The soft-capped one keeps its own: its 16-bit rows fetched first ran 2580 against
# 2816 at 8192 keys (softcap_tuning.py).
# The EDGES kernels' 16-bit small blocks make values as loads arrive: the mask's two packs around each of
# the scores' and their shift take registers that fetching a row first needs (H200, 2026-11-28 14:07 UTC,
# 4x32x1001x1001 bfloat16 2481 GB/s against 2151 fetched first; float32 and 4001 keys level).
LONG_FETCH_FIRST = (LONG, "_32bit")
MASKED_LONG_TUNING = {**MASKED_TUNING, "fetch_first": (*MASKED_TUNING["fetch_first"], *LONG_FETCH_FIRST),
                      "blocks_long": 2, "edges_fetch_first": ("_short_32bit", "_4packs_2048_32bit", "_32bit")}


SOFTMAX_GRIDS, SCALED_MASKED_GRIDS = _grids(SOFTMAX), _grids(SCALED_MASKED_SOFTMAX, **MASKED_LONG_TUNING)
# The soft-capped kernel's: float32 rows of up to 8192 fetched before their values are made too, since
# tanhf's branches otherwise kept a thread's loads apart, and float32 small blocks 16 an SM, where
# they keep 32 bytes in local memory and are still the fastest (benchmarks/softcap_tuning.py: float32
# +17% at 512 keys, +14% at 2048, against the masked softmax's tuning; bfloat16 level). Its EDGES
# kernels' 16-bit small blocks make values as loads arrive, as the masked softmax's do (softcap_tuning.py,
# H200, 2026-11-28 19:03 UTC: 4x16x1001x1001 bfloat16 2040 GB/s against 1780 fetched first; float32 level).
SOFTCAP_TUNING = {**MASKED_TUNING, "blocks_short_32bit": 16,
                  "fetch_first": ("_short", *NARROW_GRIDS, "_32bit", "_short_32bit"),
                  "edges_fetch_first": MASKED_LONG_TUNING["edges_fetch_first"]}
SOFTCAPPED_MASKED_GRIDS = _grids(SOFTCAPPED_MASKED_SOFTMAX, **SOFTCAP_TUNING)
SINK_MASKED_GRIDS = _grids(SINK_MASKED_SOFTMAX, **MASKED_LONG_TUNING)
SOFTMAX_32BIT, SOFTMAX_SHORT_32BIT, SOFTMAX_SHORT = (SOFTMAX_GRIDS[k] for k in ("_32bit", "_short_32bit", "_short"))
ROWS, ROWS_32BIT = f"{NAMESPACE}::_softmax_rows", f"{NAMESPACE}::_softmax_rows_32bit"
ROWS_SHORT, ROWS_SHORT_32BIT = f"{NAMESPACE}::_softmax_rows_short", f"{NAMESPACE}::_softmax_rows_short_32bit"
MASKED_ROWS = f"{NAMESPACE}::_scaled_masked_softmax_rows"
SOFTCAPPED_ROWS = f"{NAMESPACE}::_softcapped_masked_softmax_rows"
SINK_ROWS = f"{NAMESPACE}::_sink_masked_softmax_rows"


def _grid(x: torch.Tensor, *others: torch.Tensor, narrow: Collection[str] = ()) -> str:
    """The suffix of the grid a call on ``x`` runs in (``_grids``). Rows in whole, aligned 16-byte packs
    (``others``, read alongside ``x``, aligned too) by their length (``_packed_grid``). Other rows of an
    aligned ``x`` (a prompt of odd length; a mask not aligned) in the ``EDGES`` kernel of the grid for
    their span, a pack less one element longer, where ``narrow`` (the extra grids the op has,
    ``_extra_grids``) has it and the row fits its registers. Else the 8192-element grid for float32
    rows of up to 8192 elements, and 16384 for the rest (their scalar path)."""
    if x.dim() == 0 or not x.dtype.is_floating_point:
        return ""  # the op's own checks refuse these
    d, size = x.shape[-1], x.element_size()
    pack = 16 // size
    aligned = aligned_at_launch(x)
    if d % pack == 0 and aligned and all(aligned_at_launch(t) for t in others):
        return _packed_grid(d, size, narrow)
    if aligned:
        span = d + pack - 1
        suffix = _packed_grid(span, size, narrow, long_rows=False)
        if suffix + EDGES in narrow and (suffix not in ("", "_32bit") or span <= ROW_ELEMENTS.get(size, 0)):
            return suffix + EDGES
    return "_32bit" if size == 4 and d <= 8192 else ""


def _packed_grid(d: int, size: int, narrow: Collection[str] = (), long_rows: bool = True) -> str:
    """The grid for rows of ``d`` elements of ``size`` bytes in whole packs: float32 rows of up to 1024
    elements, the small blocks; then the first of ``NARROW_GRIDS`` in ``narrow`` that holds the row;
    16-bit rows of up to 2048, the small blocks; longer 16-bit ones ``LONG`` where ``narrow`` has it
    (and ``long_rows``). Else the 8192-element grid for float32 rows of up to 8192 elements, and 16384
    for the rest."""
    small = d <= _SMALL_ROWS
    if small and size == 4 and d <= SHORT_ROWS[4]:
        return "_short_32bit"
    if small:
        for suffix, (element_size, longest, _) in NARROW_GRIDS.items():
            if suffix in narrow and element_size == size and d <= longest:
                return suffix
    if small and d <= SHORT_ROWS.get(size, 0):
        return "_short"
    if long_rows and LONG in narrow and size == 2 and not small:
        return LONG
    return "_32bit" if size == 4 and d <= 8192 else ""


def _extra_grids(suffixes: Collection[str]) -> tuple[str, ...]:
    """Of an op's grids (``suffixes``), those ``_grid`` picks only when told the op has them."""
    return tuple(suffix for suffix in suffixes if suffix in NARROW_GRIDS or suffix == LONG or suffix.endswith(EDGES))


_SOFTMAX_EXTRA = _extra_grids(SOFTMAX_GRIDS)


def grid_for(x: torch.Tensor) -> str:
    """The private op a softmax call runs: ``ROWS`` with the suffix of its grid (``_grid``)."""
    return ROWS + _grid(x, narrow=_SOFTMAX_EXTRA)


# ---- scaled, masked scores ------------------------------------------------------------------------


def _check_masked(x: torch.Tensor, mask: torch.Tensor, op: str) -> None:
    """The shapes the masked kernels read: scores (B, H, Q, D), a mask (mB, mH, mQ, D) of their
    dtype, each of mB, mH, mQ 1 or the scores' size. ``op`` names the op in the errors."""
    if x.dim() != 4 or mask.dim() != 4:
        raise KernelInputError(
            f"{op}: scores {tuple(x.shape)} and mask {tuple(mask.shape)} must both be 4-d (batch, heads, queries, "
            f"keys), as attention writes them; view a 2-d mask as mask[None, None]")
    if mask.dtype != x.dtype:
        raise KernelInputError(f"{op}: mask is {mask.dtype} but the scores are {x.dtype}; give the mask the scores' dtype")
    check_broadcast_4d(op, "mask", mask, "scores", x)


def _masked_output(op: str):
    """A masked op's output (and its fake impl): checks the shapes, one contiguous tensor like x."""

    def output(x, mask, *scalars):
        _check_masked(x, mask, f"{NAMESPACE}::{op}")
        return x.new_empty(x.shape)

    return output


def _sink_output(x, mask, sinks, scale: float, batch: int, queries: int):
    """The sink op's output (and its fake impl): the masked op's checks, then one sink a head of the
    scores' dtype, and the pattern's expand sizes the scores' own."""
    op = f"{NAMESPACE}::sink_masked_softmax"
    _check_masked(x, mask, op)
    if sinks.dim() != 1 or not statically_known_true(sinks.shape[0] == x.shape[1]) or sinks.dtype != x.dtype:
        raise KernelInputError(f"{op}: sinks {tuple(sinks.shape)} {sinks.dtype} must hold one value a head, "
                               f"({x.shape[1]},) {x.dtype}, as GPT-OSS's module.sinks does")
    if not (statically_known_true(batch == x.shape[0]) and statically_known_true(queries == x.shape[2])):
        raise KernelInputError(f"{op}: batch={batch}, queries={queries} must be the scores' {tuple(x.shape)} first and "
                               f"third sizes: the sinks are expanded to the scores' rows")
    return x.new_empty(x.shape)


def _compact(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` with each broadcast (stride-0) axis narrowed to one, so an expanded mask reaches the
    kernel as the (mB, mH, mQ, D) tensor it broadcasts, not as a copy at the scores' size."""
    if mask.is_contiguous():
        return mask
    for axis in range(mask.dim() - 1):
        if mask.stride(axis) == 0 and mask.shape[axis] > 1:
            mask = mask.narrow(axis, 0, 1)
    return mask


def _masked_on_cuda(impls, op: str):
    """A masked op's CUDA implementation: the shapes checked (``op`` names it in the errors), the mask
    compacted, the grid picked per call (``_grid``)."""

    narrow = _extra_grids(impls)

    def on_cuda(x, mask, *scalars):
        _check_masked(x, mask, op)  # before _compact narrows a stride-0 axis that would not broadcast
        mask = _compact(mask)
        return impls[_grid(x, mask, narrow=narrow)](x, mask, *scalars)

    return on_cuda


def _divided_masked_on_cuda(scaled):
    def on_cuda(x, mask, divisor):
        # 1 / float32(divisor), rounded to float32 (a double's quotient rounds to the float32 one):
        # the reciprocal PyTorch's CUDA division by a Python number multiplies by (inf for a zero).
        d = _f32(divisor)
        return scaled(x, mask, 1.0 / d if d != 0 else math.copysign(math.inf, d))

    return on_cuda


def _unscaled_masked_on_cuda(scaled):
    """The unscaled op's CUDA implementation: the scaled op's grids at a scale of 1 (exact: x * 1 is x)."""

    def on_cuda(x, mask):
        return scaled(x, mask, 1.0)

    return on_cuda


def _f32(v: float) -> float:
    return struct.unpack("f", struct.pack("f", v))[0]


# ---- patterns (each also its op's CPU reference) --------------------------------------------------


def softmax(x):
    """``F.softmax(x, dim=-1)`` (``x.softmax(-1)``, ``torch.softmax(x, -1)``, ``nn.Softmax(-1)``)."""
    return F.softmax(x, dim=-1)


def softmax_float32(x):
    """transformers' eager attention: ``F.softmax(w, dim=-1, dtype=torch.float32).to(query.dtype)``."""
    return F.softmax(x, dim=-1, dtype=torch.float32).to(x.dtype)


def scaled_masked_softmax(x, mask, scale: float):
    """transformers' eager attention for BERT-style encoders: ``torch.matmul(q, k.transpose(2, 3)) *
    scaling``, ``+ attention_mask``, ``F.softmax(w, dim=-1)``."""
    return F.softmax(x * scale + mask, dim=-1)


def scaled_masked_softmax_float32(x, mask, scale: float):
    """transformers' ``eager_attention_forward`` (Llama, Mistral, Qwen2, Gemma...): scores times
    ``scaling``, plus the causal mask, a float32 softmax cast back."""
    return F.softmax(x * scale + mask, dim=-1, dtype=torch.float32).to(x.dtype)


def softcapped_masked_softmax(x, mask, scale: float, cap: float):
    """Soft-capped scores (Gemma 2's ``attn_logit_softcapping``) in a softmax of their dtype."""
    return F.softmax(torch.tanh(x * scale / cap) * cap + mask, dim=-1)


def softcapped_masked_softmax_float32(x, mask, scale: float, cap: float):
    """transformers' Gemma 2 ``eager_attention_forward``: scores times ``scaling``, divided by
    ``softcap``, ``tanh``, times ``softcap``, plus the mask, a float32 softmax cast back."""
    return F.softmax(torch.tanh(x * scale / cap) * cap + mask, dim=-1, dtype=torch.float32).to(x.dtype)


def divided_masked_softmax(x, mask, divisor: float):
    """The older BERT/RoBERTa/ViT attention: ``scores / math.sqrt(head_size) + attention_mask``, softmax."""
    return F.softmax(x / divisor + mask, dim=-1)


def divided_masked_softmax_float32(x, mask, divisor: float):
    """Attention that divides by ``sqrt(head_dim)`` and takes a float32 softmax cast back (GPT-NeoX-style)."""
    return F.softmax(x / divisor + mask, dim=-1, dtype=torch.float32).to(x.dtype)


def masked_softmax(x, mask):
    """Scores plus a mask, not scaled, in a softmax of their dtype: transformers 5.x's T5
    ``eager_attention_forward`` ends so (``attn_weights + attention_mask``, after ``* scaling`` (1.0)
    and ``+ position_bias``), and so does attention code that adds a mask to scores scaled before."""
    return F.softmax(x + mask, dim=-1)


def masked_softmax_float32(x, mask):
    """Scores plus a mask, not scaled, in a float32 softmax cast back: transformers' Bloom
    (``F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(input_dtype)`` after adding the
    causal mask to scores its ALiBi ``baddbmm`` scaled)."""
    return F.softmax(x + mask, dim=-1, dtype=torch.float32).to(x.dtype)


def t5_masked_softmax(x, mask):
    """transformers 4.x's ``T5Attention.forward`` (T5, mT5, LongT5, UMT5):
    ``scores += position_bias_masked`` (the relative position bias with the mask added in, unscaled
    scores) and ``softmax(scores.float(), dim=-1).type_as(scores)``, written out of place (what the
    IRs made by ``run_decompositions()`` hold; the export IR keeps the in-place ``add_``, which a
    match cannot take in: ``t5_softmax`` takes the softmax there)."""
    scores = x + mask
    return F.softmax(scores.float(), dim=-1).type_as(scores)


def t5_softmax(x):
    """T5's softmax of its scores alone: ``F.softmax(x.float(), dim=-1).type_as(x)``."""
    return F.softmax(x.float(), dim=-1).type_as(x)


def sink_masked_softmax(x, mask, sinks, scale: float, batch: int, queries: int):
    """transformers' GPT-OSS ``eager_attention_forward`` (its default attention: no SDPA takes sinks):
    scores times ``scaling``, plus the mask, then one more logit a head, ``module.sinks``, expanded to
    every row and concatenated, the row's max subtracted, a softmax in the scores' dtype, and the
    sinks' column dropped."""
    scores = x * scale + mask
    column = sinks.reshape(1, -1, 1, 1).expand(batch, -1, queries, -1)
    combined = torch.cat([scores, column], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]


def masked_scores(x: str, mask: str):
    """A filter: ``x`` is 4-d scores and ``mask`` a 4-d mask of their dtype that broadcasts onto them
    as the masked kernel reads it (``_check_masked``)."""

    def accept(match) -> bool:
        xv, mv = (match.bindings[n].meta.get("val") for n in (x, mask))
        if not isinstance(xv, torch.Tensor) or not isinstance(mv, torch.Tensor):
            return False
        return xv.dtype == mv.dtype and broadcasts_4d(mv, xv)

    accept.__name__ = f"{mask}_broadcasts_onto_{x}_as_attention_masks_do"
    return accept


_SCORES_AND_MASK = masked_scores("x", "mask")


def sink_operands(match) -> bool:
    """A filter: the masked scores' (``masked_scores``), one sink a head of their dtype, and the expand's
    sizes the scores' batch and queries."""
    if not _SCORES_AND_MASK(match):
        return False
    x, sinks = (match.bindings[n].meta.get("val") for n in ("x", "sinks"))
    batch, queries = (match.bindings.get(n) for n in ("batch", "queries"))
    return (isinstance(sinks, torch.Tensor) and sinks.dim() == 1 and sinks.dtype == x.dtype
            and statically_known_true(sinks.shape[0] == x.shape[1])
            and isinstance(batch, int) and isinstance(queries, int)
            and statically_known_true(batch == x.shape[0]) and statically_known_true(queries == x.shape[2]))


def _sink_example(dtype):
    """The sink pattern's example inputs in the matched graph's dtype (its softmax names the dtype as a
    literal), with sizes no other literal of the pattern holds: batch 13, 5 heads, queries 11, 17 keys."""
    return (torch.zeros(13, 5, 11, 17, dtype=dtype), torch.zeros(13, 1, 11, 17, dtype=dtype), torch.zeros(5, dtype=dtype),
            SENTINELS[float], 13, 11)


def register(rules) -> None:
    # No softmax rule runs inside inductor: there a softmax nearly always follows ops inductor
    # fuses into its own softmax kernel (attention's scale and mask add, and the float32 upcast,
    # where inductor's graph exposes the plain softmax inside the HF form). Replacing the softmax
    # alone then adds a write and a read of the scores: the demo model ran at 0.81x of plain
    # inductor with it (docs/benchmarks.md, "demo_model"). In eager, export and TensorRT it pays.
    #
    # Each op picks its grid per call (_grid); its spec, which TensorRT plugins carry, is the 16384-element one.
    # The masked forms come first: an overlap goes to the rule added first, and each has a plain
    # softmax inside.
    irs = COMPILE_FREE_IRS
    for suffix, spec in SCALED_MASKED_GRIDS.items():
        cuda_kernel_op(MASKED_ROWS + suffix, spec, reference=scaled_masked_softmax,
                       meta_fn=_masked_output("scaled_masked_softmax"))
    for suffix, spec in SOFTCAPPED_MASKED_GRIDS.items():
        cuda_kernel_op(SOFTCAPPED_ROWS + suffix, spec, reference=softcapped_masked_softmax,
                       meta_fn=_masked_output("softcapped_masked_softmax"))
    scaled_impls = {suffix: kernel_op(MASKED_ROWS + suffix).cuda_impl for suffix in SCALED_MASKED_GRIDS}
    softcapped = cuda_kernel_op(f"{NAMESPACE}::softcapped_masked_softmax", SOFTCAPPED_MASKED_SOFTMAX,
                                reference=softcapped_masked_softmax,
                                meta_fn=_masked_output("softcapped_masked_softmax"),
                                eager_fn=_masked_on_cuda({suffix: kernel_op(SOFTCAPPED_ROWS + suffix).cuda_impl
                                                          for suffix in SOFTCAPPED_MASKED_GRIDS},
                                                         f"{NAMESPACE}::softcapped_masked_softmax"),
                                past_limits="split")
    scaled = cuda_kernel_op(f"{NAMESPACE}::scaled_masked_softmax", SCALED_MASKED_SOFTMAX, reference=scaled_masked_softmax,
                            meta_fn=_masked_output("scaled_masked_softmax"),
                            eager_fn=_masked_on_cuda(scaled_impls, f"{NAMESPACE}::scaled_masked_softmax"),
                            past_limits="split")
    divided = cuda_kernel_op(f"{NAMESPACE}::divided_masked_softmax", DIVIDED_MASKED_SOFTMAX,
                             reference=divided_masked_softmax, meta_fn=_masked_output("divided_masked_softmax"),
                             eager_fn=_divided_masked_on_cuda(
                                 _masked_on_cuda(scaled_impls, f"{NAMESPACE}::divided_masked_softmax")),
                             past_limits="split")
    masked = cuda_kernel_op(f"{NAMESPACE}::masked_softmax", MASKED_SOFTMAX, reference=masked_softmax,
                            meta_fn=_masked_output("masked_softmax"),
                            eager_fn=_unscaled_masked_on_cuda(_masked_on_cuda(scaled_impls,
                                                                              f"{NAMESPACE}::masked_softmax")),
                            past_limits="split")
    # Each float32 form computes its plain form's numbers (float32 arithmetic, one rounding): the same op.
    # The soft-capped forms first: a scaled, masked softmax matches inside them, capping as its scale;
    # the unscaled forms last: they match inside each of the others, the scaled scores as their x.
    # GPT-OSS's sinks first: its scaled, masked scores are inside it.
    for suffix, spec in SINK_MASKED_GRIDS.items():
        cuda_kernel_op(SINK_ROWS + suffix, spec, reference=sink_masked_softmax, meta_fn=_sink_output)
    sink = cuda_kernel_op(f"{NAMESPACE}::sink_masked_softmax", SINK_MASKED_SOFTMAX, reference=sink_masked_softmax,
                          meta_fn=_sink_output,
                          eager_fn=_masked_on_cuda({suffix: kernel_op(SINK_ROWS + suffix).cuda_impl
                                                    for suffix in SINK_MASKED_GRIDS},
                                                   f"{NAMESPACE}::sink_masked_softmax"),
                          past_limits="reference")  # not "split": its batch and queries are the scores' sizes
    add_rule(rules, sink_masked_softmax, sink, "sink_masked_softmax", filter=sink_operands, irs=irs,
             example_inputs=_sink_example)
    for pattern, op in ((softcapped_masked_softmax, softcapped), (softcapped_masked_softmax_float32, softcapped),
                        (scaled_masked_softmax, scaled), (scaled_masked_softmax_float32, scaled),
                        (divided_masked_softmax, divided), (divided_masked_softmax_float32, divided),
                        (t5_masked_softmax, masked), (masked_softmax_float32, masked), (masked_softmax, masked)):
        add_rule(rules, pattern, op, pattern.__name__, filter=masked_scores("x", "mask"), irs=irs)

    for suffix, spec in SOFTMAX_GRIDS.items():
        cuda_kernel_op(ROWS + suffix, spec, reference=softmax)
    public = cuda_kernel_op(f"{NAMESPACE}::softmax", SOFTMAX, reference=softmax,
                            eager_fn=per_call(grid_for, tuple(ROWS + suffix for suffix in SOFTMAX_GRIDS)),
                            past_limits="split")
    # T5's form ahead of the plain one, which matches the float32 softmax inside it and leaves its casts
    # to PyTorch. It and HF's float32 form compute the plain form's numbers (float32 arithmetic, one
    # rounding): other ways of finding the same op.
    add_rule(rules, t5_softmax, public, "t5_softmax", filter=has_rows("x"), irs=irs)
    add_rule(rules, softmax, public, "softmax", filter=has_rows("x"), irs=irs)
    add_rule(rules, softmax_float32, public, "softmax_float32", filter=has_rows("x"), irs=irs)
