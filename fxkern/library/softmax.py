"""Softmax over the last axis, one read and one write of each row.

Forms matched: ``F.softmax(x, dim=-1)``, ``x.softmax(-1)``, ``torch.softmax(x, -1)``, ``nn.Softmax(-1)``
(all ``aten.softmax(x, -1)``), and transformers' eager attention
``F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)`` (Llama, Mistral, Qwen2, Gemma...).
Both compute in float32 and round once, so they share one kernel; a softmax over another axis
(``dim=0``, or a positive index of the last axis) is not matched.

Kernel: the row layout of :mod:`fxkern.library.rmsnorm` (a 256-thread block per register-full of
elements, 8192 in float32 and 16384 in 16-bit, 1 to 256 threads a row, the row in registers; short
rows in blocks of one or two warps); one reduction of (max, sum of ``exp(x - max)``) pairs, then
the write. Rows too long for registers take an online max/sum pass and a second read.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from fxkern.library._rules import (
    COMPILE_FREE_IRS,
    DTYPES,
    NAMESPACE,
    add_rule,
    aligned_at_launch,
    has_rows,
    per_call,
    row_geometry_8k,
    row_geometry_16k,
)
from fxkern.library.cuda_common import COMMON, row_tuning
from fxkern.ops import cuda_kernel_op
from fxkern.symbolic import cdiv
from fxkern.spec import (
    Custom,
    DimSize,
    InputDecl,
    KernelSpec,
    Numel,
    OutputDecl,
    SameAs,
)

SOURCE = COMMON + row_tuning(blocks_f32=4, blocks_half=4) + r"""
namespace fxk {

// exp(v - m). FAST (float16/bfloat16): 2^((v - m) * log2(e)) through MUFU.EX2 (ex2.approx.ftz,
// relative error about 2^-22: far under a half ulp of the output); float32 keeps exp2f, which holds
// 1e-5 against float64. The difference is taken first: v * log2(e) - m * log2(e) overflows to
// inf - inf = NaN for masked scores (finfo.min, as attention masks write them) when m is one too.
// -inf - -inf and inf - inf give NaN, as v - m does in PyTorch.
template <bool FAST>
__device__ __forceinline__ float exp_shifted(float v, float m) {
    if (FAST) {
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

template <typename T, int V, int NV>
__device__ __forceinline__ void softmax_rows(const T* __restrict__ x, int D, unsigned rows, T* __restrict__ y,
                                             float (*red)[ROW_WARPS]) {
    unsigned begin, end;
    block_rows((unsigned)D, rows, begin, end);
    const int G = row_group(D, V * NV);
    if (G * V * NV >= D) {
        const int groups = ROW_THREADS >> log2_of(G), g = threadIdx.x >> log2_of(G), t = threadIdx.x & (G - 1);
        for (unsigned first = begin, p = 0; first < end; first += groups, ++p) {
            const unsigned row = first + g;
            const bool live = row < end;
            const T* xr = x + (size_t)row * D;
            Pack<T, V> c[NV];
#pragma unroll
            for (int k = 0; k < NV; ++k) {
                const int col = (k * G + t) * V;
                if (live && col < D) c[k] = load<T, V>(xr + col);
            }
            float m = neg_inf();
#pragma unroll
            for (int k = 0; k < NV; ++k) {
                const int col = (k * G + t) * V;
                if (live && col < D) {
                    float f[V];
                    to_floats(c[k], f);
#pragma unroll
                    for (int j = 0; j < V; ++j) m = fmaxf(m, f[j]);
                }
            }
            // This thread's sum of exp(x - m) (shifted by 0 when its elements are all -inf or NaN:
            // 0, or NaN), then one reduction of (max, sum) pairs for the row.
            const float sh = m == neg_inf() ? 0.0f : m;
            float s = 0.0f;
#pragma unroll
            for (int k = 0; k < NV; ++k) {
                const int col = (k * G + t) * V;
                if (live && col < D) {
                    float f[V];
                    to_floats(c[k], f);
#pragma unroll
                    for (int j = 0; j < V; ++j) s += exp_shifted<sizeof(T) == 2>(f[j], sh);
                }
            }
            group_max_sum<T>(m, s, G, red + 2 * (p & 1));
            const float inv = __frcp_rn(s);  // 1.0f / s, without the division's slow path
            T* yr = y + (size_t)row * D;
#pragma unroll
            for (int k = 0; k < NV; ++k) {
                const int col = (k * G + t) * V;
                if (live && col < D) {
                    float f[V];
                    opaque(c[k]);
                    to_floats(c[k], f);
#pragma unroll
                    for (int j = 0; j < V; ++j) f[j] = exp_shifted<sizeof(T) == 2>(f[j], m) * inv;
                    store<T, V>(yr + col, from_floats<T, V>(f));
                }
            }
        }
    } else {  // long rows: online max and sum, then a second read
        for (unsigned row = begin, p = 0; row < end; ++row, ++p) {
            const T* xr = x + (size_t)row * D;
            float m = neg_inf(), s = 0.0f;
#pragma unroll 2
            for (int col = threadIdx.x * V; col < D; col += ROW_THREADS * V) {
                const Pack<T, V> c = load<T, V>(xr + col);
                float pm = m;
#pragma unroll
                for (int j = 0; j < V; ++j) pm = fmaxf(pm, to_f<T>(c.v[j]));
                if (pm != neg_inf()) {
                    s = m == neg_inf() ? 0.0f : s * exp_shifted<sizeof(T) == 2>(m, pm);
#pragma unroll
                    for (int j = 0; j < V; ++j) s += exp_shifted<sizeof(T) == 2>(to_f<T>(c.v[j]), pm);
                }
                m = pm;
            }
            const float gm = group_max(m, ROW_THREADS, red[0]);
            s = m == neg_inf() ? 0.0f : s * exp_shifted<sizeof(T) == 2>(m, gm);
            const float inv = __frcp_rn(group_sum(s, ROW_THREADS, red[1]));
            T* yr = y + (size_t)row * D;
#pragma unroll 4
            for (int col = threadIdx.x * V; col < D; col += ROW_THREADS * V) {
                const Pack<T, V> c = load<T, V>(xr + col);
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
    if (D % V == 0 && fxk::aligned16(x) && fxk::aligned16(y))
        fxk::softmax_rows<T, V, (sizeof(T) == 4 ? FXK_ROW_PACKS_F32 : FXK_ROW_PACKS_HALF)>(x, D, rows, y, red);
    else
        fxk::softmax_rows<T, 1, FXK_ROW_SCALARS>(x, D, rows, y, red);
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
# The same kernel, a block per 8192 elements: a float32 block's register-full (16384 is a 16-bit
# one's). The public op sends it float32 rows that fit in registers; longer ones keep SOFTMAX's
# grid, one block a row up to 16384 elements rather than blocks left without a row.
SOFTMAX_32BIT = dataclasses.replace(SOFTMAX, geometry=Custom(row_geometry_8k))


def _small_blocks(threads: int, packs: int, blocks: int, element_size: int) -> tuple[KernelSpec, int]:
    """SOFTMAX for one element size in blocks of ``threads`` threads holding ``packs`` 16-byte packs
    each, ``blocks`` resident an SM, a block per register-full of elements; returns the spec and that
    register-full, the longest row such a block holds (a longer one takes the second read)."""
    elements = threads * packs * 16 // element_size
    size = "F32" if element_size == 4 else "HALF"
    macros = "".join(f"#define {k} {v}\n" for k, v in
                     (("ROW_THREADS", threads), (f"FXK_ROW_PACKS_{size}", packs), (f"FXK_ROW_BLOCKS_{size}", blocks)))

    def geometry(inputs, outputs):
        return (cdiv(inputs[0].numel(), elements),), (threads,)

    return dataclasses.replace(SOFTMAX, kernel_source=macros + SOURCE, geometry=Custom(geometry)), elements


# Short rows held in whole packs (attention's scores) run in small blocks, many an SM: float32 rows
# of up to 1024 elements in 64-thread blocks of 4 packs a thread, 16 an SM; 16-bit rows of up to
# 2048 in one-warp blocks of 8 packs, 32 an SM. Measured faster there than the 256-thread blocks
# (benchmarks/row_tuning.py --softmax; docs/library.md, "Rows").
SOFTMAX_SHORT_32BIT, _SHORT_32BIT_ROW = _small_blocks(threads=64, packs=4, blocks=16, element_size=4)
SOFTMAX_SHORT, _SHORT_16BIT_ROW = _small_blocks(threads=32, packs=8, blocks=32, element_size=2)
ROWS, ROWS_32BIT = f"{NAMESPACE}::_softmax_rows", f"{NAMESPACE}::_softmax_rows_32bit"
ROWS_SHORT, ROWS_SHORT_32BIT = f"{NAMESPACE}::_softmax_rows_short", f"{NAMESPACE}::_softmax_rows_short_32bit"
# The longest rows (by element size) the small blocks take.
SHORT_ROWS = {4: _SHORT_32BIT_ROW, 2: _SHORT_16BIT_ROW}


def grid_for(x: torch.Tensor) -> str:
    """The private op a call runs: small blocks (``ROWS_SHORT_32BIT``, ``ROWS_SHORT``) for rows of up
    to ``SHORT_ROWS`` elements in whole, aligned 16-byte packs; ``ROWS_32BIT`` (a 256-thread block per
    8192 elements) for other float32 rows of up to 8192 elements, which a block holds in registers;
    else ``ROWS`` (a block per 16384)."""
    if x.dim() == 0 or not x.dtype.is_floating_point:
        return ROWS  # the op's own checks refuse these
    d, size = x.shape[-1], x.element_size()
    if d <= SHORT_ROWS.get(size, 0) and d % (16 // size) == 0 and aligned_at_launch(x):
        return ROWS_SHORT_32BIT if size == 4 else ROWS_SHORT
    return ROWS_32BIT if size == 4 and d <= 8192 else ROWS


def softmax(x):
    """``F.softmax(x, dim=-1)`` (``x.softmax(-1)``, ``torch.softmax(x, -1)``, ``nn.Softmax(-1)``)."""
    return F.softmax(x, dim=-1)


def softmax_float32(x):
    """transformers' eager attention: ``F.softmax(w, dim=-1, dtype=torch.float32).to(query.dtype)``."""
    return F.softmax(x, dim=-1, dtype=torch.float32).to(x.dtype)


def register(rules) -> None:
    # Neither softmax rule runs inside inductor: there a softmax nearly always follows ops inductor
    # fuses into its own softmax kernel (attention's scale and mask add, and the float32 upcast,
    # where inductor's graph exposes the plain softmax inside the HF form). Replacing the softmax
    # alone then adds a write and a read of the scores: the demo model ran at 0.81x of plain
    # inductor with it (docs/benchmarks.md, "demo_model"). In eager, export and TensorRT it pays.
    #
    # The op picks its grid per call (grid_for); its spec, which TensorRT plugins carry, is SOFTMAX's.
    grids = {ROWS: SOFTMAX, ROWS_32BIT: SOFTMAX_32BIT, ROWS_SHORT: SOFTMAX_SHORT, ROWS_SHORT_32BIT: SOFTMAX_SHORT_32BIT}
    for name, spec in grids.items():
        cuda_kernel_op(name, spec, reference=softmax)
    public = cuda_kernel_op(f"{NAMESPACE}::softmax", SOFTMAX, reference=softmax, eager_fn=per_call(grid_for, tuple(grids)))
    op = add_rule(rules, softmax, public, "softmax", filter=has_rows("x"), irs=COMPILE_FREE_IRS).op
    # Same numbers (float32 arithmetic, one rounding): another way of finding the same op.
    add_rule(rules, softmax_float32, op, "softmax_float32", filter=has_rows("x"), irs=COMPILE_FREE_IRS)
