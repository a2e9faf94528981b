"""RMSNorm over the last axis: one read and one write of the row instead of five or six passes.

Variants, as the libraries write them (transformers 5.x source):

* ``llama_rmsnorm`` — ``LlamaRMSNorm`` (also Mistral, Mixtral, Qwen2/3, Phi-3, OLMo...):
  float32 upcast, ``weight * hidden.to(input_dtype)``: the normalised row is rounded to the input
  dtype *before* the weight multiply;
* ``t5_layer_norm`` — ``T5LayerNorm`` (T5, mT5, UMT5, LongT5...): variance of the upcast input,
  ``x * rsqrt(...)`` in float32, cast to the weight's half dtype: the same numbers as Llama's
  when weight and input share a dtype, so the rule targets the same op;
* ``gemma_rmsnorm`` — ``GemmaRMSNorm`` (Gemma, Gemma 2/3, RecurrentGemma): ``(x * r) * (1 + weight)``
  in float32, rounded once.

``torch.nn.RMSNorm`` / ``F.rms_norm`` export as one ``aten.rms_norm(x, [D], w, eps)`` node whose
``[D]`` literal cannot be captured in every IR yet; they are not matched (docs/library.md).

Kernel: a 256-thread block per 16384 elements takes the rows that start there. A row stays in
registers (eight 16-byte packs a thread) between the reduction and the write; the fewest
power-of-two threads that hold it share it (sub-warp and warp shuffles, one shared-memory step
past a warp). Longer rows are read twice (the second read mostly from L2).
"""

from __future__ import annotations

import torch

from fxkern.library._rules import DTYPES, add_rule, row_geometry, row_param
from fxkern.library.cuda_common import COMMON, row_tuning
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

SOURCE = COMMON + row_tuning(blocks_f32=3, blocks_half=3) + r"""
namespace fxk {

enum { RMS_LLAMA = 0, RMS_GEMMA = 1 };

template <typename T, int MODE>
__device__ __forceinline__ float rms_out(float x, float r, float w) {
    if (MODE == RMS_LLAMA) return w * rnd<T>(x * r);   // weight * (x * r).to(input_dtype)
    return (x * r) * (1.0f + w);                        // ((x * r) * (1 + weight)).type_as(x)
}

// Rows of D elements; V elements an access (16 bytes, or 1 when the data does not allow it),
// NV accesses a thread kept in registers. w has nw elements: D for a (D,) weight, or any trailing
// block of x's shape (the op checks that), read at the flat index modulo nw.
template <typename T, int MODE, int V, int NV>
__device__ __forceinline__ void rmsnorm_rows(const T* __restrict__ x, const T* __restrict__ w, float eps,
                                             int D, unsigned rows, int nw, T* __restrict__ y, float (*red)[8]) {
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
            float ss = 0.0f;
#pragma unroll
            for (int k = 0; k < NV; ++k) {
                const int col = (k * G + t) * V;
                if (live && col < D) {
#pragma unroll
                    for (int j = 0; j < V; ++j) { const float f = to_f<T>(c[k].v[j]); ss = fmaf(f, f, ss); }
                }
            }
            const float r = rsqrtf(group_sum(ss, G, red[p & 1]) / (float)D + eps);
            T* yr = y + (size_t)row * D;
#pragma unroll
            for (int k = 0; k < NV; ++k) {
                const int col = (k * G + t) * V;
                if (live && col < D) {
                    Pack<T, V> wp, o;
                    if (V > 1) wp = load<T, V>(w + col);
                    else wp.v[0] = w[nw == D ? col : (int)(((size_t)row * D + col) % (size_t)nw)];
                    opaque(c[k]);
#pragma unroll
                    for (int j = 0; j < V; ++j)
                        o.v[j] = from_f<T>(rms_out<T, MODE>(to_f<T>(c[k].v[j]), r, to_f<T>(wp.v[j])));
                    store<T, V>(yr + col, o);
                }
            }
        }
    } else {  // long rows: the whole block on one row at a time, reading it twice
        for (unsigned row = begin, p = 0; row < end; ++row, ++p) {
            const T* xr = x + (size_t)row * D;
            float ss = 0.0f;
#pragma unroll 4
            for (int col = threadIdx.x * V; col < D; col += 256 * V) {
                const Pack<T, V> c = load<T, V>(xr + col);
#pragma unroll
                for (int j = 0; j < V; ++j) { const float f = to_f<T>(c.v[j]); ss = fmaf(f, f, ss); }
            }
            const float r = rsqrtf(group_sum(ss, 256, red[p & 1]) / (float)D + eps);
            T* yr = y + (size_t)row * D;
#pragma unroll 4
            for (int col = threadIdx.x * V; col < D; col += 256 * V) {
                const Pack<T, V> c = load<T, V>(xr + col);
                Pack<T, V> wp, o;
                if (V > 1) wp = load<T, V>(w + col);
                else wp.v[0] = w[nw == D ? col : (int)(((size_t)row * D + col) % (size_t)nw)];
#pragma unroll
                for (int j = 0; j < V; ++j)
                    o.v[j] = from_f<T>(rms_out<T, MODE>(to_f<T>(c.v[j]), r, to_f<T>(wp.v[j])));
                store<T, V>(yr + col, o);
            }
        }
    }
}

template <typename T, int MODE>
__device__ __forceinline__ void rmsnorm(const T* x, const T* w, float eps, int D, int n, int nw, T* y) {
    __shared__ float red[2][8];
    if (D <= 0 || nw <= 0) return;
    const unsigned rows = (unsigned)n / (unsigned)D;
    constexpr int V = 16 / sizeof(T);
    if (D % V == 0 && nw == D && aligned16(x) && aligned16(w) && aligned16(y))
        rmsnorm_rows<T, MODE, V, (sizeof(T) == 4 ? FXK_ROW_PACKS_F32 : FXK_ROW_PACKS_HALF)>(x, w, eps, D, rows, nw, y, red);
    else
        rmsnorm_rows<T, MODE, 1, 16>(x, w, eps, D, rows, nw, y, red);
}

}  // namespace fxk

template <typename T>
__global__ void __launch_bounds__(256, sizeof(T) == 4 ? FXK_ROW_BLOCKS_F32 : FXK_ROW_BLOCKS_HALF) rms_norm(const T* x, const T* weight, float eps, int D, int n, int nw, T* y) {
    fxk::rmsnorm<T, fxk::RMS_LLAMA>(x, weight, eps, D, n, nw, y);
}
template <typename T>
__global__ void __launch_bounds__(256, sizeof(T) == 4 ? FXK_ROW_BLOCKS_F32 : FXK_ROW_BLOCKS_HALF) gemma_rms_norm(const T* x, const T* weight, float eps, int D, int n, int nw, T* y) {
    fxk::rmsnorm<T, fxk::RMS_GEMMA>(x, weight, eps, D, n, nw, y);
}
"""


def _spec(kernel: str, x: str) -> KernelSpec:
    return KernelSpec(
        SOURCE, kernel,
        inputs=[InputDecl(x), InputDecl("weight", broadcast=True), ScalarInput("eps", float)],
        outputs=[OutputDecl("y", SameAs(x))],
        extras=[DimSize(x, -1), Numel(x), Numel("weight")],
        geometry=Custom(row_geometry),
        dtypes=DTYPES,
    )


RMS_NORM = _spec("rms_norm", "hidden_states")
GEMMA_RMS_NORM = _spec("gemma_rms_norm", "x")


def llama_rmsnorm(hidden_states, weight, eps: float):
    """transformers' ``LlamaRMSNorm.forward``, as written there."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    return weight * hidden_states.to(input_dtype)


def t5_layer_norm(hidden_states, weight, eps: float):
    """transformers' ``T5LayerNorm.forward``, as written there."""
    variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    if weight.dtype in [torch.float16, torch.bfloat16]:
        hidden_states = hidden_states.to(weight.dtype)
    return weight * hidden_states


def gemma_rmsnorm(x, weight, eps: float):
    """transformers' ``GemmaRMSNorm.forward`` (with its ``_norm``), as written there."""
    output = x.float()
    output = output * torch.rsqrt(output.pow(2).mean(-1, keepdim=True) + eps)
    output = output * (1.0 + weight.float())
    return output.type_as(x)


def register(rules) -> None:
    # Gemma's form first: Llama's pattern also matches inside it (weight := 1 + weight, in float32),
    # and an overlap goes to the rule added first.
    add_rule(rules, gemma_rmsnorm, GEMMA_RMS_NORM, "gemma_rms_norm", filter=row_param("x", "weight"))
    llama = add_rule(rules, llama_rmsnorm, RMS_NORM, "rms_norm", filter=row_param("hidden_states", "weight"))
    # T5's form computes Llama's numbers whenever weight and input share a dtype (the op's own
    # dtype check refuses the rest), so it is another way of finding the same op.
    add_rule(rules, t5_layer_norm, llama.op, "t5_layer_norm", filter=row_param("hidden_states", "weight"))
