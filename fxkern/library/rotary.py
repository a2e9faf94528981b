"""Rotary position embedding (RoPE): ``x * cos + rotate_half(x) * sin`` in one pass instead of seven ops.

Forms matched: transformers' ``apply_rotary_pos_emb`` (Llama, Mistral, Qwen2, Gemma) and litgpt's
``apply_rope``, which both write::

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

GPT-NeoX, Phi-3 (and Phi-4, StableLM, Persimmon) rotate only the first ``rotary_dim`` columns of
each head and concatenate the rest back, ``torch.cat([rope(x[..., :rotary_dim]), x[..., rotary_dim:]],
-1)``: one op, ``partial_rotary_embedding``, for the slices, the rotation and the ``cat``. With
``rotary_dim`` the whole head (Phi-3's default) export drops the first slice and keeps the empty
second one and the ``cat``, a form matched on its own.

Queries come out of their projection as ``q.view(B, S, H, D).transpose(1, 2)``: a ``(B, H, S, D)``
view of a ``(B, S, H, D)`` tensor; from a fused QKV projection (GPT-NeoX, Phi-3) a column block of
each row as well. In eager PyTorch every op here runs one kernel, ``rotary_strided`` (or, for rows
written more than once, ``rotary_strided_repeat``, which stores them evict-first), that reads x
where it lies, at any non-negative strides with a contiguous last axis (within int32; other layouts
are made contiguous first). Its result is laid out as eager PyTorch's: ``rotary_embedding`` of the
projection's view keeps x's order of heads and positions (``(B, S, H, D)`` memory, so the kernel
writes along memory as it reads, and attention gets the strides it got before); a ``cat`` (the
partial forms) and the repeats give contiguous ``(B, H, S, D)`` tensors, in eager and here.

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

OLMo (1 to 3, FlexOlmo) keeps ``cos`` and ``sin`` in float32 beside 16-bit queries and keys, so the
products promote to float32 and ``q_embed.to(q_type)`` rounds the sum once:
``rotary_embedding_float32_tables``, the same kernel reading float32 tables and computing in float32.

Numbers: each of eager's four roundings is kept, ``T(T(x*cos) + T(-x2*sin))``, so the result equals
eager PyTorch's to the bit in every dtype; the repeats are copies.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxkern.errors import KernelInputError, SizeLimitError
from fxkern.library._rules import (COMPILE_FREE_IRS, DTYPES, NAMESPACE, SIXTEEN_BIT, add_rule, broadcasts_4d,
                                   check_broadcast_4d)
from fxkern.library.cuda_common import COMMON, EW_BLOCK
from fxkern.ops import Signatures, cuda_kernel_op, kernel_op, tensor_signature
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
// C: the tables' type (T, or float beside 16-bit x: OLMo), M: the type each product and the sum are
// rounded to (T, or float where the model computes in float32).
template <typename T, int V, typename C = T, typename M = T>
__device__ __forceinline__ void rope_packs(const Pack<T, V>& a, const Pack<T, V>& b, const Pack<C, V>& c1,
                                           const Pack<C, V>& c2, const Pack<C, V>& s1, const Pack<C, V>& s2,
                                           Pack<T, V>& ya, Pack<T, V>& yb) {
    if constexpr (FXK_ROPE_PAIRS && sizeof(T) == 2 && sizeof(C) == 2 && sizeof(M) == 2 && V % 2 == 0) {
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
            oa[j] = rope_first<M>(fa[j], fb[j], f1[j], g1[j]);
            ob[j] = rope_second<M>(fa[j], fb[j], f2[j], g2[j]);
        }
        ya = from_floats<T, V>(oa);
        yb = from_floats<T, V>(ob);
    }
}

// Pass-column packs a thread copies in a row written once (benchmarks/rope_tuning.py: GPT-NeoX's partial
// rotary, 1 pack a thread, ran at 81-83% of inductor's speed; 2 and 4, 97-104%).
#ifndef FXK_PASS_PACKS
#define FXK_PASS_PACKS 4
#endif

// Where a thread's rows are. x is (B, H, S, D) with its last axis contiguous and the others at any
// strides: its rows are walked as (b, a1, a2), a2 the axis of the smaller stride (HEADS_INNER: a2 the
// heads, as attention's projection (B, S, H, D) lays them out; else a2 the positions), so a warp reads
// along memory, and with heads inner the rows of one position follow each other and read one cos and
// sin row, from L1. y is (B, H * R, S, D) contiguous: each head's rows written R times over (R = 1:
// plain RoPE; R > 1: grouped-query attention's keys or values, copied for each query head of their
// group, as transformers' repeat_kv copies them). Strides are in elements. With in_order (R = 1), y's
// rows follow x's walk instead, (b, a1, a2): eager PyTorch's layout for a rotation, which keeps its
// input's order of heads and positions (a (B, H, S, D) view of a (B, S, H, D) tensor when the heads
// are inner), and its writes one stream beside the reads.
struct Rows {
    unsigned A1, A2, s1, s2, H, S;
    unsigned long long sB;
    bool heads_inner, in_order;
    // where x's row r, (b, h, s), starts in y; head: S * D, a head's rows in y
    __device__ __forceinline__ size_t out(unsigned r, unsigned b, unsigned h, unsigned s, unsigned R, unsigned D,
                                          size_t head) const {
        return in_order ? (size_t)r * D : (size_t)(b * H + h) * R * head + (size_t)s * D;
    }
    // x's row r, and the row's (b, h, s)
    __device__ __forceinline__ size_t locate(unsigned r, unsigned& b, unsigned& h, unsigned& s) const {
        const unsigned outer = r / A2, a2 = r - outer * A2;
        b = outer / A1;
        const unsigned a1 = outer - b * A1;
        h = heads_inner ? a2 : a1;
        s = heads_inner ? a1 : a2;
        return b * sB + (size_t)a1 * s1 + (size_t)a2 * s2;
    }
};

// A block's share of n items (or rows): a contiguous range [lo, hi), ceil(n / blocks) long.
__device__ __forceinline__ void block_share(unsigned n, unsigned& lo, unsigned& hi) {
    const unsigned chunk = (n + gridDim.x - 1) / gridDim.x;
    lo = min(blockIdx.x * chunk, n);
    hi = min(lo + chunk, n);
}

// Which row of (cB, cH, cS) cos and sin x's row (b, h, s) reads: an axis of one is broadcast.
struct TableRows {
    unsigned sb, sh, ss;
    __device__ __forceinline__ TableRows(unsigned cB, unsigned cH, unsigned cS)
        : sb(cB > 1 ? cH * cS : 0u), sh(cH > 1 ? cS : 0u), ss(cS > 1 ? 1u : 0u) {}
    __device__ __forceinline__ unsigned operator()(unsigned b, unsigned h, unsigned s) const {
        return b * sb + h * sh + s * ss;
    }
};

__device__ __forceinline__ Rows rows_of(int A1, int A2, int sB, int s1, int s2, int heads_inner, int in_order = 0) {
    Rows w;
    w.A1 = A1; w.A2 = A2; w.s1 = s1; w.s2 = s2; w.sB = (unsigned)sB; w.heads_inner = heads_inner != 0;
    w.in_order = in_order != 0;
    w.H = heads_inner ? A2 : A1;
    w.S = heads_inner ? A1 : A2;
    return w;
}

// Rows of D = 2 * half + pass columns: the first 2 * half rotated, the pass columns after them copied
// (GPT-NeoX's and Phi-3's partial rotary: ``cat([rope(x[..., :rot]), x[..., rot:]], -1)``). cos and sin
// are (cB, cH, cS, 2 * half), contiguous, each of cB, cH, cS 1 or x's size. A thread takes one item:
// a pack of V columns from each half of a row with their cos and sin, or FXK_PASS_PACKS packs of pass
// columns, Q packs apart (a copy: more than one pack a thread keeps more loads in flight).
// With EVICT, rows are stored evict-first (st.global.cs: written once, read by no one here), so a row
// repeated R times passes R times x's bytes through L2 without pushing out what is still to be read:
// keys rotated and repeated +1.8-3.1%, float32 values +1.8% (benchmarks/rope_tuning.py, an H200 and
// an H100). Eager PyTorch runs a kernel of its own for R > 1 (rotary_strided_repeat); the TensorRT
// repeat kernels set EVICT whatever R (for R = 1, a hint: the same numbers). Behind a branch on R in
// the one kernel the hint made rows written once 2.6-6% slower on an H200 (float32 contiguous;
// 2026-11-26), and as a second instantiation beside the first, bfloat16 partial rotary 38% slower.
#ifndef FXK_ROPE_EVICT_REPEATS
#define FXK_ROPE_EVICT_REPEATS 1
#endif

template <typename T, int V>
__device__ __forceinline__ void store_evict_first(T* p, const Pack<T, V>& v) {
    if constexpr (sizeof(Pack<T, V>) == 16)
        __stcs(reinterpret_cast<float4*>(p), *reinterpret_cast<const float4*>(&v));
    else
        store<T, V>(p, v);
}

template <typename T, int V, bool EVICT>
__device__ __forceinline__ void store_out(T* p, const Pack<T, V>& v) {
    if constexpr (EVICT)
        store_evict_first<T, V>(p, v);
    else
        store<T, V>(p, v);
}

// N columns from p, V at a time (the scalar path, V = 1, reads a pair of columns as two), and back.
template <typename T, int V, int N>
__device__ __forceinline__ Pack<T, N> load_cols(const T* p) {
    Pack<T, N> r;
#pragma unroll
    for (int k = 0; k < N / V; ++k) {
        const Pack<T, V> q = load<T, V>(p + k * V);
#pragma unroll
        for (int j = 0; j < V; ++j) r.v[k * V + j] = q.v[j];
    }
    return r;
}
// V columns of a table: one load where they fit 16 bytes (tables of x's type), else 16-byte packs
// (float32 tables beside 16-bit x).
template <typename C, int V>
__device__ __forceinline__ Pack<C, V> load_table(const C* p) {
    if constexpr (V * sizeof(C) <= 16)
        return load<C, V>(p);
    else
        return load_cols<C, 16 / sizeof(C), V>(p);
}
template <typename T, int V, int N, bool EVICT>
__device__ __forceinline__ void store_cols(T* p, const Pack<T, N>& r) {
#pragma unroll
    for (int k = 0; k < N / V; ++k) {
        Pack<T, V> q;
#pragma unroll
        for (int j = 0; j < V; ++j) q.v[j] = r.v[k * V + j];
        store_out<T, V, EVICT>(p + k * V, q);
    }
}

// The interleaved rotation (GPT-J's rotate_every_two, GLM's and Cohere's rotate_half): columns 2i and
// 2i + 1 are a pair, y_2i = x_2i*c_2i - x_2i+1*s_2i and y_2i+1 = x_2i+1*c_2i+1 + x_2i*s_2i+1, each
// product and the sum rounded to M as eager's mul, mul, add store them (N even: whole pairs), and the
// result to T: M is T, or float where the model rotates a float32 copy of 16-bit x (Cohere's
// ``q.float()``, then ``.to(dtype)``). 16-bit pairs go through the packed instructions as rope_packs'
// do: eager's rotated operand, stack((-x_2i+1, x_2i)), is the pair's halves swapped and the new first
// one's sign flipped (eager's neg), exactly.
template <typename T, int N, typename M = T, typename C = T>
__device__ __forceinline__ Pack<T, N> rope_pairs(const Pack<T, N>& x, const Pack<C, N>& c, const Pack<C, N>& s) {
    static_assert(N % 2 == 0, "whole pairs of columns");
    Pack<T, N> y;
    if constexpr (FXK_ROPE_PAIRS && sizeof(T) == 2 && sizeof(M) == 2 && sizeof(C) == 2) {
        using P = typename Pair<T>::P;
        const P *px = reinterpret_cast<const P*>(x.v), *pc = reinterpret_cast<const P*>(c.v);
        const P* ps = reinterpret_cast<const P*>(s.v);
        P* py = reinterpret_cast<P*>(y.v);
#pragma unroll
        for (int j = 0; j < N / 2; ++j) {
            const unsigned u = __byte_perm(*reinterpret_cast<const unsigned*>(&px[j]), 0u, 0x1032) ^ 0x8000u;
            py[j] = __hadd2_rn(__hmul2_rn(px[j], pc[j]), __hmul2_rn(*reinterpret_cast<const P*>(&u), ps[j]));
        }
    } else {
        float fx[N], fc[N], fs[N], o[N];
        to_floats(x, fx);
        to_floats(c, fc);
        to_floats(s, fs);
#pragma unroll
        for (int j = 0; j < N; j += 2) {
            o[j] = rope_first<M>(fx[j], fx[j + 1], fc[j], fs[j]);
            o[j + 1] = rope_second<M>(fx[j], fx[j + 1], fc[j + 1], fs[j + 1]);
        }
        y = from_floats<T, N>(o);
    }
    return y;
}

template <typename T, int V, bool EVICT = false, unsigned PP_REPEAT = 1, bool PAIRS = false, typename M = T,
          typename C = T>
__device__ __forceinline__ void rotary_rows(const T* __restrict__ x, const C* __restrict__ cs, const C* __restrict__ sn,
                                            unsigned half, unsigned pass, unsigned B, const Rows& w,
                                            unsigned cB, unsigned cH, unsigned cS, unsigned R, T* __restrict__ y) {
    // a row written once: FXK_PASS_PACKS pass packs a thread, an item as large as a rotated one; written
    // R > 1 times, PP_REPEAT (one: its R stores are work enough, and the grid gives a block R times fewer
    // items). The kernel's registers are those of its largest path, and rotary_strided, which the eager
    // path launches only for R = 1, takes PP_REPEAT = 2 for it: at 56 registers a thread in every dtype
    // ptxas issues a rotated item's six loads before it uses any, where at one pack the bfloat16 kernel
    // took 50 and used the first four before issuing the last two, two trips to memory an item (H200,
    // 2026-11-26: bfloat16 queries 2.5% slower projected, 6% contiguous; tools/rope_loads.py reads it
    // from the SASS, and tests/test_tools.py checks it)
    constexpr unsigned PP = FXK_PASS_PACKS;
    const unsigned pp = R > 1 ? PP_REPEAT : PP;
    // PAIRS: an item rotates VP columns of pairs (2i, 2i + 1): two neighbouring packs, as many bytes as
    // an item of the halves (one pack an item had half the loads in flight: 83-85% of copy on an H200,
    // 2026-11-27), or one pair on the scalar path
    constexpr unsigned VP = !PAIRS ? V : V < 2 ? 2 : sizeof(C) > sizeof(T) ? V : 2 * V;
    // the tables' loads: V columns of C in 16-byte packs (two for float tables beside 16-bit x)
    constexpr int VC = 16 / (int)sizeof(C) < V ? 16 / (int)sizeof(C) : V;
    const unsigned rot = 2 * half, D = rot + pass, Prot = PAIRS ? rot / VP : half / V, Ppass = pass / V;
    const unsigned Q = (Ppass + pp - 1) / pp;
    const unsigned P = Prot + Q;
    const unsigned items = B * w.A1 * w.A2 * P;
    const size_t head = (size_t)w.S * D;  // one head's rows in y
    const TableRows table(cB, cH, cS);
    unsigned lo, hi;
    block_share(items, lo, hi);
    for (unsigned i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const unsigned r = i / P, j = i - r * P;
        unsigned b, h, s;
        const size_t xo = w.locate(r, b, h, s);
        const size_t out = w.out(r, b, h, s, R, D, head);
        if constexpr (PAIRS) {
            if (j < Prot) {
                const unsigned col = j * VP;
                const size_t co = (size_t)table(b, h, s) * rot + col;
                const Pack<T, VP> yv = rope_pairs<T, VP, M, C>(load_cols<T, V, VP>(x + xo + col),
                                                               load_cols<C, VC, VP>(cs + co),
                                                               load_cols<C, VC, VP>(sn + co));
                for (unsigned k = 0; k < R; ++k) store_cols<T, V, VP, EVICT>(y + out + k * head + col, yv);
                continue;
            }
        }
        if (j < Prot) {
            const unsigned col = j * V;
            const size_t co = (size_t)table(b, h, s) * rot + col;
            const Pack<T, V> xa = load<T, V>(x + xo + col), xb = load<T, V>(x + xo + col + half);
            const Pack<C, V> ca = load_table<C, V>(cs + co), cb = load_table<C, V>(cs + co + half);
            const Pack<C, V> sa = load_table<C, V>(sn + co), sb = load_table<C, V>(sn + co + half);
            Pack<T, V> ya, yb;
            rope_packs<T, V, C, M>(xa, xb, ca, cb, sa, sb, ya, yb);
            for (unsigned k = 0; k < R; ++k) {
                store_out<T, V, EVICT>(y + out + k * head + col, ya);
                store_out<T, V, EVICT>(y + out + k * head + col + half, yb);
            }
        } else {
            // pass packs j - Prot, + Q, + 2Q...: a warp's threads take neighbouring packs each access
            const unsigned col = rot + (j - Prot) * V, left = Ppass - (j - Prot);
            Pack<T, V> v[PP];
#pragma unroll
            for (unsigned p = 0; p < PP; ++p)
                if (p < pp && p * Q < left) v[p] = load<T, V>(x + xo + col + p * Q * V);
            for (unsigned k = 0; k < R; ++k) {
#pragma unroll
                for (unsigned p = 0; p < PP; ++p)
                    if (p < pp && p * Q < left) store_out<T, V, EVICT>(y + out + k * head + col + p * Q * V, v[p]);
            }
        }
    }
}

template <typename T, bool EVICT = false, unsigned PP_REPEAT = 1, bool PAIRS = false, typename M = T, typename C = T>
__device__ __forceinline__ void rotary(const T* x, const C* cs, const C* sn, int half, int pass, int B, const Rows& w,
                                       int cB, int cH, int cS, int R, T* y) {
    constexpr int V = 16 / sizeof(T);
    if (half < 0 || pass < 0 || R <= 0 || half + pass == 0) return;
    // an item takes a pack of V columns from each half, or with PAIRS two packs of pairs: either way
    // half a multiple of V
    const bool packs = half % V == 0 && pass % V == 0 && w.sB % V == 0 && w.s1 % V == 0 && w.s2 % V == 0;
    if (packs && aligned16(x) && aligned16(cs) && aligned16(sn) && aligned16(y))
        rotary_rows<T, V, EVICT, PP_REPEAT, PAIRS, M, C>(x, cs, sn, half, pass, B, w, cB, cH, cS, R, y);
    else
        rotary_rows<T, 1, false, 1, PAIRS, M, C>(x, cs, sn, half, pass, B, w, cB, cH, cS, R, y);
}

// x contiguous (B, A1, A2, D): its strides.
__device__ __forceinline__ Rows contiguous_rows(int A1, int A2, int D) {
    return rows_of(A1, A2, A1 * A2 * D, A2 * D, D, 0);
}

}  // namespace fxk

// The ops' own kernels (what a TensorRT plugin launches): x contiguous (B, H, S, D). n: x's numel.
template <typename T>
__global__ void __launch_bounds__(128) rotary(const T* x, const T* cs, const T* sn, int half, int n, int A1, int A2,
                                              int cB, int cH, int cS, T* y) {
    const int D = 2 * half;
    if (D <= 0) return;
    fxk::rotary<T>(x, cs, sn, half, 0, n / (A1 * A2 * D), fxk::contiguous_rows(A1, A2, D), cB, cH, cS, 1, y);
}

// GPT-NeoX's and Phi-3's partial rotary: the first rotary_dim columns rotated, the rest copied.
template <typename T>
__global__ void __launch_bounds__(128) partial_rotary(const T* x, const T* cs, const T* sn, int half, int rotary_dim,
                                                      int n, int A1, int A2, int D, int cB, int cH, int cS, T* y) {
    if (D <= 0) return;
    fxk::rotary<T>(x, cs, sn, half, D - 2 * half, n / (A1 * A2 * D), fxk::contiguous_rows(A1, A2, D), cB, cH, cS, 1, y);
}

// OLMo's 16-bit queries and keys: float32 cos and sin, each product and the sum in float32, rounded once.
template <typename T>
__global__ void __launch_bounds__(128) rotary_float32_tables(const T* x, const float* cs, const float* sn, int half,
                                                             int n, int A1, int A2, int cB, int cH, int cS, T* y) {
    const int D = 2 * half;
    if (D <= 0) return;
    fxk::rotary<T, false, 1, false, float, float>(x, cs, sn, half, 0, n / (A1 * A2 * D),
                                                  fxk::contiguous_rows(A1, A2, D), cB, cH, cS, 1, y);
}

// The grouped-query keys: rotated (partly, with pass columns) and repeated for each query head of their
// group in one pass. The sizes are the ones the pattern captures (x is (batch, kv_heads, seq, head_dim),
// y has heads = kv_heads * n_rep); the op checks them against x, and the kernels read no more rows
// than x's n elements hold (a plugin given a smaller x). Their rows are stored evict-first (EVICT), an
// n_rep of 1 included: a hint, the same numbers.
namespace fxk {
__device__ __forceinline__ int batches(int batch, int n, int kv_heads, int seq, int head_dim) {
    const long long row = (long long)kv_heads * seq * head_dim;
    return row > 0 ? (int)min((long long)batch, n / row) : 0;
}
}  // namespace fxk

template <typename T>
__global__ void __launch_bounds__(128) rotary_repeat_kv(const T* x, const T* cs, const T* sn, int half, int batch,
                                                        int kv_heads, int n_rep, int seq, int head_dim, int heads,
                                                        int n, int cB, int cH, int cS, T* y) {
    fxk::rotary<T, FXK_ROPE_EVICT_REPEATS != 0>(x, cs, sn, half, head_dim - 2 * half,
                                                fxk::batches(batch, n, kv_heads, seq, head_dim),
                                                fxk::contiguous_rows(kv_heads, seq, head_dim), cB, cH, cS, n_rep, y);
}

template <typename T>
__global__ void __launch_bounds__(128) partial_rotary_repeat_kv(const T* x, const T* cs, const T* sn, int half,
                                                                int rotary_dim, int batch, int kv_heads, int n_rep,
                                                                int seq, int head_dim, int heads, int n, int cB,
                                                                int cH, int cS, T* y) {
    fxk::rotary<T, FXK_ROPE_EVICT_REPEATS != 0>(x, cs, sn, half, head_dim - 2 * half,
                                                fxk::batches(batch, n, kv_heads, seq, head_dim),
                                                fxk::contiguous_rows(kv_heads, seq, head_dim), cB, cH, cS, n_rep, y);
}

// The grouped-query values: repeat_kv alone, a copy that writes each head n_rep times.
template <typename T>
__global__ void __launch_bounds__(128) repeat_kv(const T* x, int batch, int kv_heads, int n_rep, int seq,
                                                 int head_dim, int heads, int n, T* y) {
    fxk::rotary<T, FXK_ROPE_EVICT_REPEATS != 0>(x, x, x, 0, head_dim, fxk::batches(batch, n, kv_heads, seq, head_dim),
                                                fxk::contiguous_rows(kv_heads, seq, head_dim), 1, 1, 1, n_rep, y);
}

// What every op runs in eager PyTorch: x read where it lies (x_span: the storage x's elements span,
// from its first; strides sB, s1, s2 for the walk's axes), no copy made first. Rotates the first
// 2 * half columns of each row (none: repeat_kv), copies the pass columns, writes it all n_rep times,
// in the walk's order where in_order (Rows).
template <typename T>
__global__ void __launch_bounds__(128) rotary_strided(const T* x_span, const T* cs, const T* sn, int half, int pass,
                                                      int B, int A1, int A2, int sB, int s1, int s2, int heads_inner,
                                                      int n_rep, int in_order, int cB, int cH, int cS, T* y) {
    fxk::rotary<T, false, 2>(x_span, cs, sn, half, pass, B, fxk::rows_of(A1, A2, sB, s1, s2, heads_inner, in_order),
                             cB, cH, cS, n_rep, y);
}

// rotary_float32_tables in eager PyTorch: rotary_strided's walk, float32 tables.
template <typename T>
__global__ void __launch_bounds__(128) rotary_strided_float32_tables(const T* x_span, const float* cs, const float* sn,
                                                                     int half, int pass, int B, int A1, int A2, int sB,
                                                                     int s1, int s2, int heads_inner, int n_rep,
                                                                     int in_order, int cB, int cH, int cS, T* y) {
    fxk::rotary<T, false, 2, false, float, float>(x_span, cs, sn, half, pass, B,
                                                  fxk::rows_of(A1, A2, sB, s1, s2, heads_inner, in_order), cB, cH, cS,
                                                  n_rep, y);
}

// The same for n_rep > 1 (the eager path launches it only then): repeated rows stored evict-first.
template <typename T>
__global__ void __launch_bounds__(128) rotary_strided_repeat(const T* x_span, const T* cs, const T* sn, int half,
                                                             int pass, int B, int A1, int A2, int sB, int s1, int s2,
                                                             int heads_inner, int n_rep, int in_order, int cB, int cH,
                                                             int cS, T* y) {
    fxk::rotary<T, FXK_ROPE_EVICT_REPEATS != 0>(x_span, cs, sn, half, pass, B,
                                                fxk::rows_of(A1, A2, sB, s1, s2, heads_inner, in_order), cB, cH, cS,
                                                n_rep, y);
}
"""

# Output elements a block takes (benchmarks/rope_tuning.py): in plain RoPE 4 items a thread in
# float32, 2 in 16-bit; a repeating kernel's block reads 1/n_rep of that. On an H200, the GPU the
# library is tuned for, 4096 against 2048: 1.4-5% faster in three runs on 2026-11-26 (2048 was 1-2%
# faster on an H100: docs/benchmarks.md, rope_block_h100); 8192 level to 2% slower.
ELEMENTS_PER_BLOCK = 4096
assert EW_BLOCK == 128  # the kernels' launch bounds


def rotary_geometry(inputs, outputs):
    """EW_BLOCK threads a block, a block per ELEMENTS_PER_BLOCK elements of the output."""
    return (cdiv(outputs[0].numel(), ELEMENTS_PER_BLOCK),), (EW_BLOCK,)


_COS_DIMS = [DimSize("cos", 0), DimSize("cos", 1), DimSize("cos", 2)]
# The ops' own specs take x contiguous (B, H, S, D): what a TensorRT plugin launches, and the CPU/meta
# contract. In eager PyTorch every op runs ROTARY_STRIDED instead, which reads x where it lies.
# x (B, H, S, D); cos and sin (cB, cH, cS, D), each of cB, cH, cS 1 or x's size.
ROTARY = KernelSpec(
    SOURCE, "rotary",
    inputs=[InputDecl("x"), InputDecl("cos"), InputDecl("sin"), ScalarInput("half", int)],
    outputs=[OutputDecl("y", SameAs("x"))],
    extras=[Numel("x"), DimSize("x", 1), DimSize("x", 2), *_COS_DIMS],
    geometry=Custom(rotary_geometry),
    dtypes=DTYPES,
)
# The same rotating only the first rotary_dim = 2 * half columns, copying the rest (cos and sin
# (cB, cH, cS, rotary_dim)).
PARTIAL_ROTARY = KernelSpec(
    SOURCE, "partial_rotary",
    inputs=[InputDecl("x"), InputDecl("cos"), InputDecl("sin"), ScalarInput("half", int), ScalarInput("rotary_dim", int)],
    outputs=[OutputDecl("y", SameAs("x"))],
    extras=[Numel("x"), DimSize("x", 1), DimSize("x", 2), DimSize("x", 3), *_COS_DIMS],
    geometry=Custom(rotary_geometry),
    dtypes=DTYPES,
)

# OLMo's 16-bit x (B, H, S, D) with float32 cos and sin (cB, cH, cS, D); a float32 x is ROTARY's
# numbers (and the rule leaves it to that op, whose pattern it then is).
_FLOAT32_TABLES = [InputDecl("cos", dtype=torch.float32), InputDecl("sin", dtype=torch.float32)]
ROTARY_FLOAT32_TABLES = dataclasses.replace(
    ROTARY, kernel_name="rotary_float32_tables", inputs=[InputDecl("x"), *_FLOAT32_TABLES, ScalarInput("half", int)])

# Grouped-query attention's keys and values, repeated for every query head of their group. The sizes
# are the literals transformers' repeat_kv leaves in the graph (the pattern captures each); the
# output, (batch, heads, seq, head_dim), comes from the meta_fn, so these specs declare none.
SIZES = ("batch", "kv_heads", "n_rep", "seq", "head_dim", "heads")
_SIZE_INPUTS = [ScalarInput(n, int) for n in SIZES]
_SIZE_SCHEMA = ", ".join(f"int {n}" for n in SIZES)
# x (batch, kv_heads, seq, head_dim), cos and sin as ROTARY reads them: rotated, then repeated.
ROTARY_REPEAT_KV = KernelSpec(
    SOURCE, "rotary_repeat_kv",
    inputs=[InputDecl("x"), InputDecl("cos"), InputDecl("sin"), ScalarInput("half", int), *_SIZE_INPUTS],
    extras=[Numel("x"), *_COS_DIMS],
    geometry=Custom(rotary_geometry),
    dtypes=DTYPES,
)
ROTARY_REPEAT_KV_SCHEMA = f"(Tensor x, Tensor cos, Tensor sin, int half, {_SIZE_SCHEMA}) -> Tensor"
# The same as PARTIAL_ROTARY reads them: partly rotated, then repeated (Phi-3's grouped-query keys).
PARTIAL_ROTARY_REPEAT_KV = KernelSpec(
    SOURCE, "partial_rotary_repeat_kv",
    inputs=[InputDecl("x"), InputDecl("cos"), InputDecl("sin"), ScalarInput("half", int), ScalarInput("rotary_dim", int),
            *_SIZE_INPUTS],
    extras=[Numel("x"), *_COS_DIMS],
    geometry=Custom(rotary_geometry),
    dtypes=DTYPES,
)
PARTIAL_ROTARY_REPEAT_KV_SCHEMA = (f"(Tensor x, Tensor cos, Tensor sin, int half, int rotary_dim, {_SIZE_SCHEMA}) "
                                   f"-> Tensor")
# x (batch, kv_heads, seq, head_dim): repeated.
REPEAT_KV = KernelSpec(
    SOURCE, "repeat_kv",
    inputs=[InputDecl("x"), *_SIZE_INPUTS],
    extras=[Numel("x")],
    geometry=Custom(rotary_geometry),
    dtypes=DTYPES,
)
REPEAT_KV_SCHEMA = f"(Tensor x, {_SIZE_SCHEMA}) -> Tensor"

# Every op in eager PyTorch: x read in place from x_span (the storage its elements span) at strides sB,
# s1, s2, walked (b, a1, a2) with a2 the heads when heads_inner, else the positions; the first 2 * half
# columns of each row rotated, the pass columns after them copied, the rows written n_rep times into
# a contiguous (B, H * n_rep, S, 2 * half + pass), or with in_order (n_rep 1) once, in the walk's
# order: (B, S, H, D) memory where the heads are inner (_strided_output).
_STRIDED_ARGS = ("half", "pass_cols", "B", "A1", "A2", "sB", "s1", "s2", "heads_inner", "n_rep", "in_order", "cB", "cH",
                 "cS")
ROTARY_STRIDED = KernelSpec(
    SOURCE, "rotary_strided",
    inputs=[InputDecl("x_span"), InputDecl("cos"), InputDecl("sin"), *[ScalarInput(n, int) for n in _STRIDED_ARGS]],
    geometry=Custom(rotary_geometry),
    dtypes=DTYPES,
)
STRIDED = f"{NAMESPACE}::_rotary_strided"
# The same kernel for rows written n_rep > 1 times, stored evict-first.
ROTARY_STRIDED_REPEAT = dataclasses.replace(ROTARY_STRIDED, kernel_name="rotary_strided_repeat")
STRIDED_REPEAT = f"{NAMESPACE}::_rotary_strided_repeat"
# The same reading float32 tables beside 16-bit x (each row written once).
ROTARY_STRIDED_FLOAT32_TABLES = dataclasses.replace(
    ROTARY_STRIDED, kernel_name="rotary_strided_float32_tables",
    inputs=[InputDecl("x_span"), *_FLOAT32_TABLES, *[ScalarInput(n, int) for n in _STRIDED_ARGS]])
_STRIDED_SCHEMA = ("(Tensor x_span, Tensor cos, Tensor sin, " + ", ".join(f"int {n}" for n in _STRIDED_ARGS)
                   + ") -> Tensor")


# ---- the patterns (also the ops' CPU references) ---------------------------------------------------


def rotary_embedding(x, cos, sin, half: int):
    """transformers' ``apply_rotary_pos_emb`` for one of q, k: ``(q * cos) + (rotate_half(q) * sin)``
    with ``rotate_half(x) = torch.cat((-x[..., half:], x[..., :half]), dim=-1)``, ``half = D // 2``."""
    x1 = x[..., :half]
    x2 = x[..., half:]
    return (x * cos) + (torch.cat((-x2, x1), dim=-1) * sin)


def rotary_embedding_float32_tables(x, cos, sin, half: int):
    """OLMo's ``apply_rotary_pos_emb`` (OLMo 1-3, FlexOlmo) for 16-bit q or k: cos and sin stay float32,
    so the products and the sum are float32, and ``q_embed.to(q_type)`` rounds once."""
    return rotary_embedding(x, cos, sin, half).to(x.dtype)


def partial_rotary_embedding(x, cos, sin, half: int, rotary_dim: int):
    """transformers' ``apply_rotary_pos_emb`` of GPT-NeoX and Phi-3 (and Phi-4, StableLM, Persimmon):
    the first ``rotary_dim = cos.shape[-1]`` columns rotated, the rest concatenated back."""
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat([rotary_embedding(x_rot, cos, sin, half), x_pass], dim=-1)


def whole_rotary_embedding(x, cos, sin, half: int, rotary_dim: int):
    """The same code with ``rotary_dim`` the whole head: export drops the full slice ``x[..., :D]``
    and keeps the empty ``x[..., D:]`` and the ``cat`` (Phi-3 as transformers configures it)."""
    return torch.cat([rotary_embedding(x, cos, sin, half), x[..., rotary_dim:]], dim=-1)


def repeat_kv(x, batch: int, kv_heads: int, n_rep: int, seq: int, head_dim: int, heads: int):
    """transformers' ``repeat_kv`` (grouped-query attention's keys and values, one copy for each query
    head of the group): ``x[:, :, None, :, :].expand(batch, kv_heads, n_rep, seq, head_dim)`` reshaped to
    ``(batch, kv_heads * n_rep, seq, head_dim)``; ``heads`` is that product, the literal the graph holds."""
    return x[:, :, None, :, :].expand(batch, kv_heads, n_rep, seq, head_dim).reshape(batch, heads, seq, head_dim)


def rotary_embedding_repeat_kv(x, cos, sin, half: int, batch: int, kv_heads: int, n_rep: int, seq: int,
                               head_dim: int, heads: int):
    """The keys of grouped-query attention: rotated (``apply_rotary_pos_emb``), then repeated (``repeat_kv``)."""
    return repeat_kv(rotary_embedding(x, cos, sin, half), batch, kv_heads, n_rep, seq, head_dim, heads)


def partial_rotary_embedding_repeat_kv(x, cos, sin, half: int, rotary_dim: int, batch: int, kv_heads: int,
                                       n_rep: int, seq: int, head_dim: int, heads: int):
    """Partly rotated grouped-query keys, then repeated."""
    return repeat_kv(partial_rotary_embedding(x, cos, sin, half, rotary_dim), batch, kv_heads, n_rep, seq, head_dim,
                     heads)


def whole_rotary_embedding_repeat_kv(x, cos, sin, half: int, batch: int, kv_heads: int, n_rep: int, seq: int,
                                     head_dim: int, heads: int):
    """:func:`whole_rotary_embedding`'s keys, then repeated (Phi-3's grouped-query attention): the empty
    slice starts at head_dim, and the op is rotary_embedding_repeat_kv."""
    return repeat_kv(whole_rotary_embedding(x, cos, sin, half, head_dim), batch, kv_heads, n_rep, seq, head_dim, heads)


def strided_reference(rotate):
    """ROTARY_STRIDED in PyTorch (its CPU impl), or a variant's rotating with ``rotate(x, cos, sin)``:
    x rebuilt from the span, its first 2 * half columns rotated, repeated, laid out as the kernel writes it."""

    def reference(x_span, cos, sin, half, pass_cols, B, A1, A2, sB, s1, s2, heads_inner, n_rep, in_order, cB, cH, cS):
        x = x_span.as_strided((B, A1, A2, 2 * half + pass_cols), (sB, s1, s2, 1))
        x = x.transpose(1, 2) if heads_inner else x
        cos, sin = cos[..., :2 * half], sin[..., :2 * half]
        y = torch.cat([rotate(x[..., :2 * half], cos, sin), x[..., 2 * half:]], dim=-1) if half else x
        out = strided_output(x_span, 2 * half + pass_cols, B, A1, A2, heads_inner, n_rep, in_order)
        return out.copy_(y.repeat_interleave(n_rep, dim=1))

    return reference


_strided_reference = strided_reference(lambda x, cos, sin: rotary_embedding(x, cos, sin, x.shape[-1] // 2))


# ---- checks, outputs, layout ----------------------------------------------------------------------


def _check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: int,
           op: str = f"{NAMESPACE}::rotary_embedding", rotary_dim: int | None = None, x_name: str = "x",
           float32_tables: bool = False, half_tables: bool = False) -> None:
    """What the kernels read: 4-d x (B, H, S, D), cos and sin (cB, cH, cS, R) of x's dtype (with
    ``float32_tables``, float32 beside 16-bit x), each of cB, cH, cS 1 or x's size, R = 2 * half the
    columns rotated: x's last axis, or ``rotary_dim`` (at most it); with ``half_tables``, R = half
    (one angle for both halves: DeepSeek-V3's). ``x_name``: what the errors call x (an op that
    rotates a view of its input names the view)."""
    if x.dim() != 4:
        raise KernelInputError(f"{op}: x {tuple(x.shape)} must be 4-d (batch, heads, positions, head_dim), as "
                               f"attention writes queries and keys; view (batch * heads, ...) ones back to 4-d")
    if cos.dim() != 4 or sin.dim() != 4:
        raise KernelInputError(f"{op}: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be 4-d like x "
                               f"{tuple(x.shape)}; unsqueeze them over the heads (cos.unsqueeze(1)), as transformers does")
    if x.dtype not in DTYPES:
        raise KernelInputError(f"{op}: x is {x.dtype}; the kernels take {', '.join(str(d) for d in DTYPES)}: cast x, "
                               f"cos and sin to one of them")
    if float32_tables and (cos.dtype != torch.float32 or sin.dtype != torch.float32):
        raise KernelInputError(f"{op}: x is {x.dtype}, cos {cos.dtype}, sin {sin.dtype}; this op rotates x with float32 "
                               f"cos and sin (OLMo's): for tables of x's dtype use rotary_embedding")
    if not float32_tables and (cos.dtype != x.dtype or sin.dtype != x.dtype):
        raise KernelInputError(f"{op}: x is {x.dtype}, cos {cos.dtype}, sin {sin.dtype}; give cos and sin x's dtype "
                               f"(transformers casts them: cos.to(x.dtype))")
    if tuple(cos.shape) != tuple(sin.shape):
        raise KernelInputError(f"{op}: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have one shape")
    d = x.shape[-1]
    if rotary_dim is not None:
        if 2 * half != rotary_dim or not 0 < rotary_dim:
            raise KernelInputError(f"{op}: half = {half} rotates {2 * half} columns, but rotary_dim is {rotary_dim}; "
                                   f"pass half = rotary_dim // 2 with an even rotary_dim")
        if isinstance(d, int) and rotary_dim > d:
            raise KernelInputError(f"{op}: rotary_dim = {rotary_dim} is more than x's last axis, {d}")
        if not isinstance(d, int):
            torch._check(rotary_dim <= d, lambda: f"{op}: rotary_dim must be at most x's last axis")
        check_broadcast_4d(op, "cos (and sin)", cos, "x[..., :rotary_dim]", x[..., :rotary_dim])
        return
    if isinstance(d, int) and isinstance(half, int) and 2 * half != d:
        raise KernelInputError(f"{op}: half = {half} rotates a last axis of {2 * half}, but x's is {d}; "
                               f"pass half = x.shape[-1] // 2 with an even head_dim")
    if not isinstance(d, int):  # symbolic (export, dynamic shapes): a runtime assertion instead
        torch._check(2 * half == d, lambda: f"{op}: 2 * half must be x's last axis")
    if half_tables:
        check_broadcast_4d(op, "cos (and sin)", cos, f"{x_name}'s first half", x[..., :half])
        return
    check_broadcast_4d(op, "cos (and sin)", cos, x_name, x)


def _check_sizes(op: str, x: torch.Tensor, batch: int, kv_heads: int, n_rep: int, seq: int, head_dim: int,
                 heads: int) -> None:
    """The repeating ops' sizes: x is (batch, kv_heads, seq, head_dim), heads = kv_heads * n_rep."""
    if x.dim() != 4:
        raise KernelInputError(f"{op}: x {tuple(x.shape)} must be 4-d (batch, kv_heads, seq, head_dim), as "
                               f"attention writes keys and values")
    if n_rep < 1 or heads != kv_heads * n_rep:
        raise KernelInputError(f"{op}: heads = {heads} must be kv_heads * n_rep = {kv_heads} * {n_rep}, with n_rep >= 1")
    want = (batch, kv_heads, seq, head_dim)
    # a symbolic axis is left to the check on CUDA, at run time: the rule only matches literal sizes,
    # and TensorRT's shape inference runs this with a free symbol for each of x's axes
    if any(isinstance(got, int) and got != size for got, size in zip(x.shape, want)):
        raise KernelInputError(
            f"{op}: x {tuple(x.shape)} is not (batch, kv_heads, seq, head_dim) = {want}; pass x's own sizes")


def _concrete(*tensors: torch.Tensor) -> bool:
    return all(isinstance(d, int) for t in tensors for d in t.shape)


def keeps_layout(x: torch.Tensor) -> bool:
    """Whether a rotation of x (B, H, S, D) comes out in x's order of heads and positions, as eager
    PyTorch's does: where the kernel reads x in place with its heads inner (attention's projection
    (B, S, H, D) viewed (B, H, S, D)), and both axes have more than one element. Then its writes are
    one stream beside its reads (a contiguous result, its rows written 32 heads apart, was 0.6-1.5%
    slower on an H200: docs/benchmarks.md, "rope_layout_h200"), and attention gets the strides it got
    before."""
    # past 2^31 elements the op runs its reference (eager), whose result has x's order where x has a walk
    layout = walk(x, within_int32=not statically_known_true(x.numel() > INT32_MAX))
    h, s = x.shape[1], x.shape[2]
    return layout is not None and bool(layout[6]) and statically_known_true(h > 1) and statically_known_true(s > 1)


def like_eager(x: torch.Tensor) -> torch.Tensor:
    """A new tensor of x's (B, H, S, D) shape laid out as eager PyTorch lays out a rotation of x: in
    x's order of heads and positions where :func:`keeps_layout`, else contiguous."""
    b, h, s, d = x.shape
    if keeps_layout(x):
        return x.new_empty((b, s, h, d)).transpose(1, 2)
    return x.new_empty((b, h, s, d))


def _output(x, cos, sin, half):
    """rotary_embedding's output (and its fake impl): checks the call, a tensor of x's shape laid out
    as eager's (:func:`like_eager`)."""
    _check(x, cos, sin, half)
    return like_eager(x)


def _float32_tables_output(x, cos, sin, half):
    """rotary_embedding_float32_tables' output (and its fake impl): as rotary_embedding's."""
    _check(x, cos, sin, half, f"{NAMESPACE}::rotary_embedding_float32_tables", float32_tables=True)
    return like_eager(x)


def _partial_output(x, cos, sin, half, rotary_dim):
    """partial_rotary_embedding's output (and its fake impl): as rotary_embedding's."""
    _check(x, cos, sin, half, f"{NAMESPACE}::partial_rotary_embedding", rotary_dim)
    return x.new_empty(x.shape)


def _repeat_output(x, batch: int, kv_heads: int, n_rep: int, seq: int, head_dim: int, heads: int):
    """repeat_kv's output (and its fake impl): checks the call, one (batch, heads, seq, head_dim) tensor."""
    _check_sizes(f"{NAMESPACE}::repeat_kv", x, batch, kv_heads, n_rep, seq, head_dim, heads)
    return x.new_empty((batch, heads, seq, head_dim))


def _rotary_repeat_output(x, cos, sin, half: int, batch: int, kv_heads: int, n_rep: int, seq: int, head_dim: int,
                          heads: int):
    """rotary_embedding_repeat_kv's output (and its fake impl): checks the call as both ops do (the
    rotation's checks on concrete sizes only: TensorRT's shape inference gives each axis a free symbol)."""
    op = f"{NAMESPACE}::rotary_embedding_repeat_kv"
    if _concrete(x, cos, sin):
        _check(x, cos, sin, half, op)
    _check_sizes(op, x, batch, kv_heads, n_rep, seq, head_dim, heads)
    return x.new_empty((batch, heads, seq, head_dim))


def _partial_repeat_output(x, cos, sin, half: int, rotary_dim: int, batch: int, kv_heads: int, n_rep: int, seq: int,
                           head_dim: int, heads: int):
    """partial_rotary_embedding_repeat_kv's output (and its fake impl), checked as the others."""
    op = f"{NAMESPACE}::partial_rotary_embedding_repeat_kv"
    if _concrete(x, cos, sin):
        _check(x, cos, sin, half, op, rotary_dim)
    _check_sizes(op, x, batch, kv_heads, n_rep, seq, head_dim, heads)
    return x.new_empty((batch, heads, seq, head_dim))


def _strided_output(x_span, cos, sin, half, pass_cols, B, A1, A2, sB, s1, s2, heads_inner, n_rep, in_order, cB, cH,
                    cS):
    """ROTARY_STRIDED's output: (B, H * n_rep, S, 2 * half + pass_cols), contiguous, or with in_order
    (n_rep 1) a view of (B, A1, A2, D) in the walk's order. A private op: the public ops check their
    calls before they run it."""
    return strided_output(x_span, 2 * half + pass_cols, B, A1, A2, heads_inner, n_rep, in_order)


def strided_output(x_span: torch.Tensor, d: int, B: int, A1: int, A2: int, heads_inner: int, n_rep: int,
                   in_order: int) -> torch.Tensor:
    """The (B, H * n_rep, S, d) output of a kernel walking (B, A1, A2) rows: contiguous, or with
    in_order in the walk's order (Rows::out)."""
    if in_order:
        if n_rep != 1:
            raise KernelInputError(f"in_order writes each row once; n_rep is {n_rep}")
        y = x_span.new_empty((B, A1, A2, d))
        return y.transpose(1, 2) if heads_inner else y
    h, s = (A2, A1) if heads_inner else (A1, A2)
    return x_span.new_empty((B, h * n_rep, s, d))


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


def walk(x: torch.Tensor, within_int32: bool = True) -> tuple[int, int, int, int, int, int, int, int] | None:
    """How ROTARY_STRIDED reads x (B, H, S, D) in place: (B, A1, A2, sB, s1, s2, heads_inner, span), the
    walk's inner axis the one of the smaller stride; None where it cannot (the last axis not
    contiguous, a negative stride, a stride, span or element count past int32: x is then made
    contiguous first, and refused if that is still too large). ``within_int32=False``: the walk however
    large (the layout eager's result has)."""
    known = statically_known_true  # on a fake x of symbolic sizes (a meta_fn's), what holds for every size
    b, h, s, d = x.shape
    # an axis of one element has no stride that matters (0 keeps the kernel's 16-byte packs)
    sb, sh, ss, sd = (0 if known(n == 1) else st for n, st in zip(x.shape, x.stride()))
    heads_inner = known(s == 1) or (known(h > 1) and known(sh < ss))
    a1, a2, s1, s2 = (s, h, ss, sh) if heads_inner else (h, s, sh, ss)
    span = 1 + (b - 1) * sb + (a1 - 1) * s1 + (a2 - 1) * s2 + (d - 1) * sd
    if not (known(d == 1) or known(sd == 1)) or not all(known(v >= 0) for v in (sb, s1, s2)):
        return None
    if within_int32 and not all(known(v <= INT32_MAX) for v in (sb, s1, s2, span, x.numel())):
        return None
    return b, a1, a2, sb, s1, s2, int(heads_inner), span


def check_size(op: str, what: str, shape) -> None:
    """Refuses (SizeLimitError, so a library op runs its reference) a tensor of more than 2^31 - 1
    elements, more than the rotary kernels index. On CUDA calls only: the fake impls take any size,
    as the reference does."""
    if math.prod(shape) > INT32_MAX:
        limit = f"{what} {tuple(shape)} has more than 2**31 - 1 elements, more than the kernel indexes"
        raise SizeLimitError(f"{op}: {limit}; split the batch", limit)


def walked(op: str, x: torch.Tensor, layout):
    """x and the walk the kernel takes over it: ``layout`` (``walk(x)``) if x's own axes have one, else
    a contiguous copy's; an error naming ``op`` when even that is past int32."""
    if layout is not None:
        return x, layout
    check_size(op, "x", x.shape)  # before the copy: within int32, a contiguous x always has a walk
    x = x.contiguous()
    return x, walk(x)


def in_walk_order(out: torch.Tensor) -> int:
    """1 where a public op's meta_fn laid its output out in x's order (:func:`like_eager`: then x's walk
    has its heads inner), 0 where contiguous: the kernel's in_order."""
    return int(not out.is_contiguous())


def _eager(op: str, strided, check, rotated: bool):
    """A public op on CUDA: checks the call, narrows broadcast tables, and runs ROTARY_STRIDED on x
    where it lies (``strided``: its launcher and ROTARY_STRIDED_REPEAT's, for n_rep 1 and more, or a
    variant's). All of it but the launch depends only on the call's signature, so it is decided once
    per signature (as the launches under it are, fxkern.ops). ``rotated``: the op takes cos and sin
    after x and rotates cos's columns; its scalars are the rest ([half][, rotary_dim], sizes...)."""
    decided = Signatures()

    def on_cuda(x, *args):
        tables = args[:2] if rotated else ()
        scalars = args[2:] if rotated else args
        key = (tensor_signature(x, *tables), scalars)
        how = decided.get(key)
        if how is None:
            out = check(x, *args)  # the meta_fn: the call's checks, and its output (B, H * n_rep, S, D)
            check_size(op, "the output", out.shape)  # a repeat's is n_rep times x's
            half = tables[0].shape[-1] // 2 if rotated else 0  # cos's columns, which the check held half to
            how = decided.remember(key, (_broadcast_axes(*tables) if rotated else (), walk(x) if x.numel() else None,
                                         half, x.shape[-1] - 2 * half, out.shape[1] // x.shape[1] if x.shape[1] else 1,
                                         tuple(out.shape), in_walk_order(out)))
        axes, layout, half, pass_cols, n_rep, out_shape, in_order = how
        if not x.numel():
            return like_eager(x) if in_order else x.new_empty(out_shape)
        x, (b, a1, a2, sb, s1, s2, heads_inner, span) = walked(op, x, layout)
        x_span = x.as_strided((span,), (1,))
        if rotated:
            cos, sin = _narrow(*tables, axes)
            dims = cos.shape[:3]
        else:
            cos = sin = x_span
            dims = (1, 1, 1)
        return strided[n_rep > 1](x_span, cos, sin, half, pass_cols, b, a1, a2, sb, s1, s2, heads_inner, n_rep,
                                  in_order, *dims)

    on_cuda.__name__ = op.split("::")[1]
    return on_cuda


# ---- the rules ------------------------------------------------------------------------------------


def rotates(x, cos, sin, half, rotary_dim=None, tables=None, half_tables=False) -> bool:
    """Whether fake values x, cos and sin and a captured half (and rotary_dim) are what the rotary
    kernels read: 4-d tensors of one library dtype (``tables``: the tables' own), cos and sin of one
    shape that broadcasts onto x (its first rotary_dim columns, where given; with ``half_tables``, its
    first half: DeepSeek-V3's) as the kernel reads it, half half the columns rotated."""
    if not all(isinstance(v, torch.Tensor) and v.dim() == 4 for v in (x, cos, sin)) or not isinstance(half, int):
        return False
    if x.dtype not in DTYPES or cos.dtype != (tables or x.dtype) or sin.dtype != cos.dtype:
        return False
    if not all(statically_known_true(a == b) for a, b in zip(cos.shape, sin.shape)):
        return False
    if rotary_dim is None:
        return statically_known_true(x.shape[3] == 2 * half) and broadcasts_4d(cos, x[..., :half] if half_tables else x)
    return (isinstance(rotary_dim, int) and rotary_dim == 2 * half and statically_known_true(rotary_dim <= x.shape[3])
            and broadcasts_4d(cos, x[..., :rotary_dim]))


def rotary_operands(match) -> bool:
    """A filter: the matched x, cos, sin and half (and rotary_dim, where captured) pass :func:`rotates`."""
    x, cos, sin = (match.bindings[n].meta.get("val") for n in ("x", "cos", "sin"))
    return rotates(x, cos, sin, match.bindings.get("half"), match.bindings.get("rotary_dim"))


def float32_table_operands(match) -> bool:
    """A filter for OLMo's form: 16-bit x with float32 cos and sin that pass :func:`rotates`."""
    x, cos, sin = (match.bindings[n].meta.get("val") for n in ("x", "cos", "sin"))
    return (isinstance(x, torch.Tensor) and x.dtype != torch.float32
            and rotates(x, cos, sin, match.bindings.get("half"), tables=torch.float32))


def whole_operands(match) -> bool:
    """A filter for the whole-head form: as rotary_operands, with rotary_dim x's whole last axis."""
    x = match.bindings["x"].meta.get("val")
    rotary_dim = match.bindings.get("rotary_dim")
    return (rotary_operands(match) and isinstance(x, torch.Tensor)
            and statically_known_true(x.shape[3] == rotary_dim))


def repeats(x, sizes) -> bool:
    """Whether fake value x is a 4-d tensor of a library dtype whose sizes are the captured ``sizes``
    (``SIZES``: batch, kv_heads, n_rep, seq, head_dim, heads), and heads is kv_heads * n_rep."""
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.dtype not in DTYPES:
        return False
    if not all(isinstance(v, int) for v in sizes):
        return False
    batch, kv_heads, n_rep, seq, head_dim, heads = sizes
    return (n_rep >= 1 and heads == kv_heads * n_rep
            and all(statically_known_true(a == b) for a, b in zip(x.shape, (batch, kv_heads, seq, head_dim))))


def repeat_operands(match) -> bool:
    """A filter: the matched x and sizes pass :func:`repeats`."""
    return repeats(match.bindings["x"].meta.get("val"), [match.bindings.get(n) for n in SIZES])


def both(*filters):
    """A filter that holds when each of ``filters`` does."""

    def accept(match) -> bool:
        return all(f(match) for f in filters)

    accept.__name__ = "_and_".join(f.__name__ for f in filters)
    return accept


# Traced at rank 4 (the slices' axis is a literal 3) with a head size whose half, 37, is no other
# literal; the partial forms rotate 74 columns of 90.
_EXAMPLE = (torch.zeros(1, 2, 1, 74), torch.zeros(1, 1, 1, 74), torch.zeros(1, 1, 1, 74), 37)
_PARTIAL_EXAMPLE = (torch.zeros(1, 2, 1, 90), torch.zeros(1, 1, 1, 74), torch.zeros(1, 1, 1, 74), 37, 74)
_WHOLE_EXAMPLE = (*_EXAMPLE, 74)


def _float32_tables_example(dtype):
    """_EXAMPLE with x in the matched graph's dtype (the cast back is a literal of it), the tables float32."""
    return (_EXAMPLE[0].to(dtype), *_EXAMPLE[1:])
# The repeat's sizes, each a literal nothing else in the traced pattern holds (the unsqueeze's axis is 2,
# the slices' 3): batch 13, kv_heads 5, n_rep 7, seq 11, head_dim 74 (90 for the partial form), heads 35.
_KV_TABLES = (torch.zeros(1, 1, 11, 74), torch.zeros(1, 1, 11, 74))
_REPEAT_EXAMPLE = (torch.zeros(13, 5, 11, 74), 13, 5, 7, 11, 74, 35)
_ROTARY_REPEAT_EXAMPLE = (torch.zeros(13, 5, 11, 74), *_KV_TABLES, 37, 13, 5, 7, 11, 74, 35)
_PARTIAL_REPEAT_EXAMPLE = (torch.zeros(13, 5, 11, 90), *_KV_TABLES, 37, 74, 13, 5, 7, 11, 90, 35)


def launchers(ops, reference, meta_fn, schema):
    """Registers private ops ((qualname, spec) each) of one schema and CPU reference; returns their launchers."""
    for qualname, spec in ops:
        cuda_kernel_op(qualname, spec, reference=reference, meta_fn=meta_fn, schema=schema, strided_outputs=True)
    return tuple(kernel_op(qualname).cuda_impl for qualname, _ in ops)


def strided_launchers(plain, repeat):
    """The eager path's two private ops, (qualname, spec) each: ROTARY_STRIDED and its repeating kernel,
    or a variant's. Registers them; returns their launchers, for n_rep 1 and n_rep > 1."""
    return launchers((plain, repeat), _strided_reference, _strided_output, _STRIDED_SCHEMA)


def register(rules) -> None:
    # Not inside inductor, whose own pointwise kernels for these are one pass as well. Registration
    # order is priority: each form before the ones it contains (the keys' rotation and repeat before
    # either alone, the partial rotation before the plain one it holds).
    strided = strided_launchers((STRIDED, ROTARY_STRIDED), (STRIDED_REPEAT, ROTARY_STRIDED_REPEAT))

    def op(name, spec, reference, meta_fn, rotated=True, schema=None):
        qualname = f"{NAMESPACE}::{name}"
        return cuda_kernel_op(qualname, spec, reference=reference, meta_fn=meta_fn, schema=schema,
                              eager_fn=_eager(qualname, strided, meta_fn, rotated), past_limits="reference")

    partial_repeat = op("partial_rotary_embedding_repeat_kv", PARTIAL_ROTARY_REPEAT_KV,
                        partial_rotary_embedding_repeat_kv, _partial_repeat_output,
                        schema=PARTIAL_ROTARY_REPEAT_KV_SCHEMA)
    add_rule(rules, partial_rotary_embedding_repeat_kv, partial_repeat, "partial_rotary_embedding_repeat_kv",
             filter=both(rotary_operands, repeat_operands), irs=COMPILE_FREE_IRS, example_inputs=_PARTIAL_REPEAT_EXAMPLE)
    rotary_repeat = op("rotary_embedding_repeat_kv", ROTARY_REPEAT_KV, rotary_embedding_repeat_kv,
                       _rotary_repeat_output, schema=ROTARY_REPEAT_KV_SCHEMA)
    add_rule(rules, whole_rotary_embedding_repeat_kv, rotary_repeat, "whole_rotary_embedding_repeat_kv",
             filter=both(rotary_operands, repeat_operands), irs=COMPILE_FREE_IRS,
             example_inputs=_ROTARY_REPEAT_EXAMPLE)
    add_rule(rules, rotary_embedding_repeat_kv, rotary_repeat, "rotary_embedding_repeat_kv",
             filter=both(rotary_operands, repeat_operands), irs=COMPILE_FREE_IRS, example_inputs=_ROTARY_REPEAT_EXAMPLE)
    partial = op("partial_rotary_embedding", PARTIAL_ROTARY, partial_rotary_embedding, _partial_output)
    add_rule(rules, partial_rotary_embedding, partial, "partial_rotary_embedding", filter=rotary_operands,
             irs=COMPILE_FREE_IRS, example_inputs=_PARTIAL_EXAMPLE)
    add_rule(rules, whole_rotary_embedding, partial, "whole_rotary_embedding", filter=whole_operands,
             irs=COMPILE_FREE_IRS, example_inputs=_WHOLE_EXAMPLE)
    (float32_tables_strided,) = launchers(
        ((f"{NAMESPACE}::_rotary_strided_float32_tables", ROTARY_STRIDED_FLOAT32_TABLES),),
        strided_reference(lambda x, cos, sin: rotary_embedding_float32_tables(x, cos, sin, x.shape[-1] // 2)),
        _strided_output, _STRIDED_SCHEMA)
    qualname = f"{NAMESPACE}::rotary_embedding_float32_tables"
    float32_tables = cuda_kernel_op(
        qualname, ROTARY_FLOAT32_TABLES, reference=rotary_embedding_float32_tables, meta_fn=_float32_tables_output,
        eager_fn=_eager(qualname, (float32_tables_strided, float32_tables_strided), _float32_tables_output, True),
        past_limits="reference")
    add_rule(rules, rotary_embedding_float32_tables, float32_tables, "rotary_embedding_float32_tables",
             filter=float32_table_operands, irs=COMPILE_FREE_IRS, example_inputs=_float32_tables_example,
             dtypes=SIXTEEN_BIT)
    rotary = op("rotary_embedding", ROTARY, rotary_embedding, _output)
    add_rule(rules, rotary_embedding, rotary, "rotary_embedding", filter=rotary_operands, irs=COMPILE_FREE_IRS,
             example_inputs=_EXAMPLE)
    repeat = op("repeat_kv", REPEAT_KV, repeat_kv, _repeat_output, rotated=False, schema=REPEAT_KV_SCHEMA)
    add_rule(rules, repeat_kv, repeat, "repeat_kv", filter=repeat_operands, irs=COMPILE_FREE_IRS,
             example_inputs=_REPEAT_EXAMPLE)
