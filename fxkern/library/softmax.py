"""Softmax over the last axis, one read and one write of each row.

Forms matched: ``F.softmax(x, dim=-1)``, ``x.softmax(-1)``, ``torch.softmax(x, -1)``, ``nn.Softmax(-1)``
(all ``aten.softmax(x, -1)``), and transformers' eager attention
``F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)`` (Llama, Mistral, Qwen2, Gemma...).
Both compute in float32 and round once, so they share one kernel; a softmax over another axis
(``dim=0``, or a positive index of the last axis) is not matched.

Kernel: the row layout of :mod:`fxkern.library.rmsnorm` (a 256-thread block per 8192 elements,
1 to 256 threads a row, the row in registers); max, then sum of ``exp(x - max)``, then the
write. Rows too long for registers take an online max/sum pass and a second read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fxkern.library._rules import DTYPES, add_rule, has_rows, row_geometry
from fxkern.library.cuda_common import COMMON
from fxkern.spec import (
    Custom,
    DimSize,
    InputDecl,
    KernelSpec,
    Numel,
    OutputDecl,
    SameAs,
)

SOURCE = COMMON + r"""
#ifndef FXK_ROW_BLOCKS_F32
#define FXK_ROW_BLOCKS_F32 3
#define FXK_ROW_BLOCKS_HALF 4
#endif
namespace fxk {

__device__ __forceinline__ float exp_shifted(float v, float m) {  // exp(v - m)
    return exp2f((v - m) * 1.4426950408889634f);
}

template <typename T, int V, int NV>
__device__ __forceinline__ void softmax_rows(const T* __restrict__ x, int D, unsigned rows, T* __restrict__ y,
                                             float (*red)[8]) {
    unsigned begin, end;
    block_rows((unsigned)D, rows, begin, end);
    int G = 1;  // threads a row: the fewest that hold it in registers
    while (G < 256 && G * V * NV < D) G <<= 1;
    if (G * V * NV >= D) {
        const int groups = 256 / G, g = threadIdx.x / G, t = threadIdx.x % G;
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
#pragma unroll
                    for (int j = 0; j < V; ++j) m = fmaxf(m, to_f<T>(c[k].v[j]));
                }
            }
            m = group_max(m, G, red[0]);
            float s = 0.0f;
#pragma unroll
            for (int k = 0; k < NV; ++k) {
                const int col = (k * G + t) * V;
                if (live && col < D) {
#pragma unroll
                    for (int j = 0; j < V; ++j) s += exp_shifted(to_f<T>(c[k].v[j]), m);
                }
            }
            const float inv = 1.0f / group_sum(s, G, red[1]);
            T* yr = y + (size_t)row * D;
#pragma unroll
            for (int k = 0; k < NV; ++k) {
                const int col = (k * G + t) * V;
                if (live && col < D) {
                    Pack<T, V> o;
#pragma unroll
                    for (int j = 0; j < V; ++j) o.v[j] = from_f<T>(exp_shifted(to_f<T>(c[k].v[j]), m) * inv);
                    store<T, V>(yr + col, o);
                }
            }
        }
    } else {  // long rows: online max and sum, then a second read
        for (unsigned row = begin, p = 0; row < end; ++row, ++p) {
            const T* xr = x + (size_t)row * D;
            float m = neg_inf(), s = 0.0f;
#pragma unroll 2
            for (int col = threadIdx.x * V; col < D; col += 256 * V) {
                const Pack<T, V> c = load<T, V>(xr + col);
                float pm = m;
#pragma unroll
                for (int j = 0; j < V; ++j) pm = fmaxf(pm, to_f<T>(c.v[j]));
                if (pm != neg_inf()) {
                    s = m == neg_inf() ? 0.0f : s * exp_shifted(m, pm);
#pragma unroll
                    for (int j = 0; j < V; ++j) s += exp_shifted(to_f<T>(c.v[j]), pm);
                }
                m = pm;
            }
            const float gm = group_max(m, 256, red[0]);
            s = m == neg_inf() ? 0.0f : s * exp_shifted(m, gm);
            const float inv = 1.0f / group_sum(s, 256, red[1]);
            T* yr = y + (size_t)row * D;
#pragma unroll 4
            for (int col = threadIdx.x * V; col < D; col += 256 * V) {
                const Pack<T, V> c = load<T, V>(xr + col);
                Pack<T, V> o;
#pragma unroll
                for (int j = 0; j < V; ++j) o.v[j] = from_f<T>(exp_shifted(to_f<T>(c.v[j]), gm) * inv);
                store<T, V>(yr + col, o);
            }
        }
    }
}

}  // namespace fxk

template <typename T>
__global__ void __launch_bounds__(256, sizeof(T) == 4 ? FXK_ROW_BLOCKS_F32 : FXK_ROW_BLOCKS_HALF) softmax_last(const T* x, int D, int n, T* y) {
    __shared__ float red[2][8];
    if (D <= 0) return;
    const unsigned rows = (unsigned)n / (unsigned)D;
    constexpr int V = 16 / sizeof(T);
    if (D % V == 0 && fxk::aligned16(x) && fxk::aligned16(y))
        fxk::softmax_rows<T, V, 32 / V>(x, D, rows, y, red);
    else
        fxk::softmax_rows<T, 1, 16>(x, D, rows, y, red);
}
"""

SOFTMAX = KernelSpec(
    SOURCE, "softmax_last",
    inputs=[InputDecl("x")],
    outputs=[OutputDecl("y", SameAs("x"))],
    extras=[DimSize("x", -1), Numel("x")],
    geometry=Custom(row_geometry),
    dtypes=DTYPES,
)


def softmax(x):
    """``F.softmax(x, dim=-1)`` (``x.softmax(-1)``, ``torch.softmax(x, -1)``, ``nn.Softmax(-1)``)."""
    return F.softmax(x, dim=-1)


def softmax_float32(x):
    """transformers' eager attention: ``F.softmax(w, dim=-1, dtype=torch.float32).to(query.dtype)``."""
    return F.softmax(x, dim=-1, dtype=torch.float32).to(x.dtype)


def register(rules) -> None:
    op = add_rule(rules, softmax, SOFTMAX, "softmax", filter=has_rows("x")).op
    # Same numbers (float32 arithmetic, one rounding): another way of finding the same op.
    add_rule(rules, softmax_float32, op, "softmax_float32", filter=has_rows("x"))
