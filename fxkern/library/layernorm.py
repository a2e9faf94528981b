"""A residual add and the LayerNorm after it: one kernel, three passes over memory where eager takes five.

Forms matched (export IR): ``h = x + residual`` then ``F.layer_norm(h, (D,), weight, bias, eps)``
(``nn.LayerNorm``), returning the norm and the sum. Post-norm encoders write it as one line and use
only the norm: transformers' ``BertSelfOutput``/``BertOutput`` (BERT, RoBERTa, ELECTRA...:
``self.LayerNorm(hidden_states + input_tensor)``). Pre-norm blocks keep the sum as the next
residual: GPT-2 (``hidden_states = attn_output + residual; residual = hidden_states;
hidden_states = self.ln_2(hidden_states)``), ViT (``layernorm_after``), Whisper's and CLIP's
encoders. The op returns both; an unused sum costs one write. ``nn.LayerNorm(D, bias=False)``
exports with ``None`` for the bias, a form of its own (``add_layer_norm_no_bias``): transformers'
ModernBERT (``norm_bias=False`` by default), whose pre-norm layers add the attention output and
then ``mlp_norm`` it, and add the MLP's output before the next layer's ``attn_norm``.

PyTorch's own LayerNorm is already one kernel, so the plain norm is left to it: the win is the add.
Cohere (Command R) writes its LayerNorm out in float32 instead (``CohereLayerNorm``: mean, centred
variance, ``rsqrt``, the weight multiplied in float32, no bias), eight kernels in eager: the bias-free
kernel computes it, after the residual add (``add_cohere_layer_norm``) and alone (``cohere_layer_norm``,
the embeddings' norm, the same kernel without the add). OLMo 1's ``OlmoLayerNorm`` has neither weight
nor bias and runs in float32 (``F.layer_norm(h.float(), shape, None, None, eps)`` cast back): the same
kernel with the weight a template flag too, after the add (``add_olmo_layer_norm``) and, for 16-bit
rows, alone (``olmo_layer_norm``: in float32 its casts vanish and it is PyTorch's one kernel).

Kernel: the row layout of :mod:`fxkern.library.rmsnorm` (a 256-thread block per 8192 elements, the
rows that start there, a row held in registers by the fewest power-of-two threads that fit it):
the sum ``x + residual`` is rounded to the dtype (what the model holds) and written, then the mean
and the variance (two reductions over the registers: the centred sum of squares, not
``E[x^2] - E[x]^2``), then ``(h - mean) * rstd * weight + bias`` rounded once (the bias-free
kernel, the same code with the bias a template flag, adds none). Rows too long for registers are
read back twice from ``h`` (mostly from L2).

Cohere's plain norm, with one tensor to read, runs a two-read kernel on float32 rows of 4096+ and
16-bit rows of 8192+ (``COHERE_TWO_READ``), as the plain RMSNorms do: one block a row reads it
once for its moments (each thread's count, sum and centred squares, which the block sums exactly:
the within-thread squares plus each thread's count times its mean's squared distance from the
row's) and again, mostly from L1/L2, to write the output. There it runs at copy speed, level with
inductor; register-resident, it kept too few bytes in flight (79% of copy in bfloat16).

Matched in the export IR only: core ATen and the other IRs decompose ``aten.layer_norm`` into
``native_layer_norm`` and lose the ``[D]`` literal the pattern captures.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

from fxkern.errors import KernelInputError
from fxkern.library._rules import COMPILE_FREE_IRS, DTYPES, NAMESPACE, SIXTEEN_BIT, add_rule, row_geometry_8k, row_param
from fxkern.library.cuda_common import COMMON, EVICT_LOADS, row_tuning
from fxkern.library.rmsnorm import TWO_READ_DEFAULTS, TwoRead, pick_kernel, two_read_ops
from fxkern.ops import cuda_kernel_op
from fxkern.patterns import SENTINELS
from fxkern.spec import Custom, DimSize, InputDecl, KernelSpec, Numel, OutputDecl, SameAs, ScalarInput

SOURCE = COMMON + row_tuning(blocks_f32=4, blocks_half=6, packs_f32=8, packs_half=4) + r"""
namespace fxk {

template <typename T, int V>
__device__ __forceinline__ float pack_sum(const Pack<T, V>& p, float s) {
    float f[V];
    to_floats(p, f);
#pragma unroll
    for (int j = 0; j < V; ++j) s += f[j];
    return s;
}

template <typename T, int V>
__device__ __forceinline__ float pack_centred_squares(const Pack<T, V>& p, float mean, float s) {
    float f[V];
    to_floats(p, f);
#pragma unroll
    for (int j = 0; j < V; ++j) {
        const float d = f[j] - mean;
        s = fmaf(d, d, s);
    }
    return s;
}

// (h - mean) * rstd * weight + bias, in float32, rounded once (PyTorch's CUDA LayerNorm).
template <typename T, int V>
__device__ __forceinline__ Pack<T, V> ln_pack(const Pack<T, V>& h, const Pack<T, V>& w, const Pack<T, V>& b,
                                              float mean, float rstd) {
    float f[V], wf[V], bf[V];
    to_floats(h, f);
    to_floats(w, wf);
    to_floats(b, bf);
#pragma unroll
    for (int j = 0; j < V; ++j) f[j] = (f[j] - mean) * rstd * wf[j] + bf[j];
    return from_floats<T, V>(f);
}

// The same without a bias (nn.LayerNorm(..., bias=False): ModernBERT): nothing added, not even 0,
// which would turn PyTorch's -0 into +0.
template <typename T, int V>
__device__ __forceinline__ Pack<T, V> ln_pack(const Pack<T, V>& h, const Pack<T, V>& w, float mean, float rstd) {
    float f[V], wf[V];
    to_floats(h, f);
    to_floats(w, wf);
#pragma unroll
    for (int j = 0; j < V; ++j) f[j] = (f[j] - mean) * rstd * wf[j];
    return from_floats<T, V>(f);
}

// Neither weight nor bias (OLMo 1's F.layer_norm(h.float(), shape, None, None, eps)): nothing multiplied.
template <typename T, int V>
__device__ __forceinline__ Pack<T, V> ln_pack(const Pack<T, V>& h, float mean, float rstd) {
    float f[V];
    to_floats(h, f);
#pragma unroll
    for (int j = 0; j < V; ++j) f[j] = (f[j] - mean) * rstd;
    return from_floats<T, V>(f);
}

// The output pack at column col of a row: weight and (with BIAS) bias read there, b unread without,
// and w unread without WEIGHT.
template <bool BIAS, bool WEIGHT, typename T, int V, typename Col>
__device__ __forceinline__ Pack<T, V> ln_out(const Pack<T, V>& h, const T* __restrict__ w, const T* __restrict__ b,
                                             Col col, float mean, float rstd) {
    if constexpr (!WEIGHT) return ln_pack(h, mean, rstd);
    else if constexpr (BIAS) return ln_pack(h, load<T, V>(w + col), load<T, V>(b + col), mean, rstd);
    else return ln_pack(h, load<T, V>(w + col), mean, rstd);
}

// Rows of D elements, V elements an access (16 bytes, or 1), NV accesses a thread held in registers;
// w and b are (D,) (b unread without BIAS, w without WEIGHT). Writes h = x + res and y = layer_norm(h);
// without ADD, y = layer_norm(x) (res and h unread: Cohere's norm of the embeddings).
template <typename T, int V, int NV, bool BIAS, bool ADD = true, bool WEIGHT = true>
__device__ __forceinline__ void add_layernorm_rows(const T* __restrict__ x, const T* __restrict__ res,
                                                   const T* __restrict__ w, const T* __restrict__ b, float eps,
                                                   int D, unsigned rows, T* __restrict__ y, T* __restrict__ h,
                                                   float (*red)[ROW_WARPS]) {
    unsigned begin, end;
    block_rows((unsigned)D, rows, begin, end);
    const int G = row_group(D, V * NV);
    const float inv_d = __frcp_rn((float)D);
    if (G * V * NV >= D) {
        const int groups = ROW_THREADS >> log2_of(G), g = threadIdx.x >> log2_of(G), t = threadIdx.x & (G - 1);
        for (unsigned first = begin; first < end; first += groups) {
            const unsigned row = first + g;
            const bool live = row < end;
            const size_t off = (size_t)row * D;
            Pack<T, V> c[NV];
            float s = 0.0f;
#pragma unroll
            for (int k = 0; k < NV; ++k) {
                const int col = (k * G + t) * V;
                if (live && col < D) {
                    if constexpr (ADD) {
                        c[k] = add_rounded(load<T, V>(x + off + col), load<T, V>(res + off + col));
                        store<T, V>(h + off + col, c[k]);
                    } else {
                        c[k] = load<T, V>(x + off + col);
                    }
                    s = pack_sum(c[k], s);
                }
            }
            // Two reductions a row on the two shared slots: a slot is written again only after
            // every thread has passed the other slot's barrier, so after it read this one.
            const float mean = group_sum(s, G, red[0]) * inv_d;
            float q = 0.0f;
#pragma unroll
            for (int k = 0; k < NV; ++k) {
                const int col = (k * G + t) * V;
                if (live && col < D) q = pack_centred_squares(c[k], mean, q);
            }
            const float rstd = rsqrtf(group_sum(q, G, red[1]) * inv_d + eps);
#pragma unroll
            for (int k = 0; k < NV; ++k) {
                const int col = (k * G + t) * V;
                if (live && col < D) {
                    opaque(c[k]);
                    store<T, V>(y + off + col, ln_out<BIAS, WEIGHT>(c[k], w, b, col, mean, rstd));
                }
            }
        }
    } else {  // long rows: the whole block on one row, reading back what each thread wrote to h (or x)
        // columns counted in 64 bits: a row may hold up to 2^31 - 1 elements, and an int column stepped
        // past it wrapped below zero
        const T* __restrict__ hr = ADD ? h : x;
        for (unsigned row = begin; row < end; ++row) {
            const size_t off = (size_t)row * D;
            float s = 0.0f;
#pragma unroll 4
            for (long long col = threadIdx.x * V; col < D; col += ROW_THREADS * V) {
                Pack<T, V> c;
                if constexpr (ADD) {
                    c = add_rounded(load<T, V>(x + off + col), load<T, V>(res + off + col));
                    store<T, V>(h + off + col, c);
                } else {
                    c = load<T, V>(x + off + col);
                }
                s = pack_sum(c, s);
            }
            const float mean = group_sum(s, ROW_THREADS, red[0]) * inv_d;
            float q = 0.0f;
#pragma unroll 4
            for (long long col = threadIdx.x * V; col < D; col += ROW_THREADS * V)
                q = pack_centred_squares(load<T, V>(hr + off + col), mean, q);
            const float rstd = rsqrtf(group_sum(q, ROW_THREADS, red[1]) * inv_d + eps);
#pragma unroll 4
            for (long long col = threadIdx.x * V; col < D; col += ROW_THREADS * V)
                store<T, V>(y + off + col, ln_out<BIAS, WEIGHT>(load<T, V>(hr + off + col), w, b, col, mean, rstd));
        }
    }
}

}  // namespace fxk

namespace fxk {
template <typename T, bool BIAS, bool ADD = true, bool WEIGHT = true>
__device__ __forceinline__ void add_layernorm(const T* x, const T* res, const T* w, const T* b, float eps, int D,
                                              int n, T* y, T* h) {
    __shared__ float red[2][ROW_WARPS];
    if (D <= 0) return;
    const unsigned rows = (unsigned)n / (unsigned)D;
    constexpr int V = 16 / sizeof(T);
    if (D % V == 0 && aligned16(x) && (!ADD || aligned16(res)) && (!WEIGHT || aligned16(w)) &&
        (!BIAS || aligned16(b)) && aligned16(y) && (!ADD || aligned16(h)))
        add_layernorm_rows<T, V, (sizeof(T) == 4 ? FXK_ROW_PACKS_F32 : FXK_ROW_PACKS_HALF), BIAS, ADD, WEIGHT>(
            x, res, w, b, eps, D, rows, y, h, red);
    else
        add_layernorm_rows<T, 1, FXK_ROW_SCALARS, BIAS, ADD, WEIGHT>(x, res, w, b, eps, D, rows, y, h, red);
}
}  // namespace fxk

template <typename T>
__global__ void __launch_bounds__(ROW_THREADS, sizeof(T) == 4 ? FXK_ROW_BLOCKS_F32 : FXK_ROW_BLOCKS_HALF)
add_layer_norm(const T* x, const T* res, const T* w, const T* b, int normalized_size, float eps, int D, int n,
               T* y, T* h) {
    fxk::add_layernorm<T, true>(x, res, w, b, eps, D, n, y, h);
}

// nn.LayerNorm(..., bias=False) (ModernBERT): the same kernel, no bias read or added.
template <typename T>
__global__ void __launch_bounds__(ROW_THREADS, sizeof(T) == 4 ? FXK_ROW_BLOCKS_F32 : FXK_ROW_BLOCKS_HALF)
add_layer_norm_no_bias(const T* x, const T* res, const T* w, int normalized_size, float eps, int D, int n, T* y, T* h) {
    fxk::add_layernorm<T, false>(x, res, w, nullptr, eps, D, n, y, h);
}

// Cohere's LayerNorm written out in float32 (no bias: the bias-free kernel's arithmetic), with the
// residual add before it and without (the embeddings' norm).
template <typename T>
__global__ void __launch_bounds__(ROW_THREADS, sizeof(T) == 4 ? FXK_ROW_BLOCKS_F32 : FXK_ROW_BLOCKS_HALF)
add_cohere_layer_norm(const T* x, const T* res, const T* w, float eps, int D, int n, T* y, T* h) {
    fxk::add_layernorm<T, false>(x, res, w, nullptr, eps, D, n, y, h);
}

template <typename T>
__global__ void __launch_bounds__(ROW_THREADS, sizeof(T) == 4 ? FXK_ROW_BLOCKS_F32 : FXK_ROW_BLOCKS_HALF)
cohere_layer_norm(const T* x, const T* w, float eps, int D, int n, T* y) {
    fxk::add_layernorm<T, false, false>(x, nullptr, w, nullptr, eps, D, n, y, nullptr);
}

// OLMo 1's LayerNorm, neither weight nor bias, in float32 and cast back: with the residual add before
// it and without (the first layer's input norm).
template <typename T>
__global__ void __launch_bounds__(ROW_THREADS, sizeof(T) == 4 ? FXK_ROW_BLOCKS_F32 : FXK_ROW_BLOCKS_HALF)
add_olmo_layer_norm(const T* x, const T* res, int normalized_size, float eps, int D, int n, T* y, T* h) {
    fxk::add_layernorm<T, false, true, false>(x, res, nullptr, nullptr, eps, D, n, y, h);
}

template <typename T>
__global__ void __launch_bounds__(ROW_THREADS, sizeof(T) == 4 ? FXK_ROW_BLOCKS_F32 : FXK_ROW_BLOCKS_HALF)
olmo_layer_norm(const T* x, int normalized_size, float eps, int D, int n, T* y) {
    fxk::add_layernorm<T, false, false, false>(x, nullptr, nullptr, nullptr, eps, D, n, y, nullptr);
}
""" + TWO_READ_DEFAULTS + r"""
// ---- two reads: Cohere's plain norm on long rows (the op picks this kernel per call, as the plain
// RMSNorms pick theirs; its tunings are COHERE_TWO_READ) -------------------------------------------------
// One block a row. A first read gathers each thread's count, sum, mean and centred sum of squares (a
// step's packs summed, then squared about the step's mean, merged into the thread's running numbers);
// the block sums those, and a second read (mostly from L1/L2) writes the output. Nothing of the row is
// held through the block's reduction, so a thread needs few registers and an SM holds more of them,
// as in rmsnorm's two-read kernel: with one tensor to read, the register-resident kernel kept too few
// bytes in flight (79% of copy in bfloat16 at 16384x8192).
namespace fxk {
""" + EVICT_LOADS + r"""
// Chan et al.'s merge of the moments (count nb, mean mb, centred sum of squares qb) into (n, mean, q):
// exact in real numbers, and stable where E[x^2] - E[x]^2 cancels. A thread's steps, one at a time.
__device__ __forceinline__ void merge_moments(float& n, float& mean, float& q, float nb, float mb, float qb) {
    const float total = n + nb;
    if (nb == 0.0f) return;
    const float delta = mb - mean, share = nb / total;
    mean = fmaf(delta, share, mean);
    q += qb + delta * delta * n * share;
    n = total;
}

// Rows of D elements, one block each (any grid: blocks stride over rows); V elements an access (16
// bytes, or 1), U accesses a thread a step; w is (D,), unread without WEIGHT (OLMo 1's norm).
template <typename T, int V, int U, bool WEIGHT = true>
__device__ __forceinline__ void layernorm_two_read_rows(const T* __restrict__ x, const T* __restrict__ w, float eps,
                                                        int D, unsigned rows, T* __restrict__ y,
                                                        float (*red)[3][FXK_TWO_READ_THREADS / 32]) {
    constexpr unsigned STEP = FXK_TWO_READ_THREADS * V;
    const unsigned len = (unsigned)D;  // unsigned columns: col + STEP * U cannot wrap below 2^32
    const unsigned long long keep = l2_policy<true>(), drop = l2_policy<false>();
    const float inv_d = __frcp_rn((float)D);
#pragma unroll 1
    for (unsigned row = blockIdx.x, p = 0; row < rows; row += gridDim.x, ++p) {
        const size_t off = (size_t)row * D;
        const T* xr = x + off;
        float n = 0.0f, sum = 0.0f, mean = 0.0f, q = 0.0f;  // the thread's count, sum, mean, centred squares
#pragma unroll 1
        for (unsigned col = threadIdx.x * V; col < len; col += STEP * U) {
            Pack<T, V> c[U];
            float s = 0.0f, k = 0.0f;
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (col + u * STEP < len) c[u] = load_evict<T, V, true>(xr + col + u * STEP, keep);
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (col + u * STEP < len) {
                    s = pack_sum(c[u], s);
                    k += V;
                }
            const float m = s / k;  // k >= V: the step's first access is in the row
            float d2 = 0.0f;
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (col + u * STEP < len) d2 = pack_centred_squares(c[u], m, d2);
            sum += s;
            merge_moments(n, mean, q, k, m, d2);
        }
        // The row's sum of squares about its mean is the threads' own (about their means) plus each
        // thread's count times its mean's squared distance from the row's: two block sums, every term
        // non-negative. (Merging the threads' moments pairwise put divisions and a serial chain of merges
        // between the reads: 53% of copy in bfloat16.)
        float (*slot)[FXK_TWO_READ_THREADS / 32] = red[p & 1];
        const int warp = threadIdx.x >> 5;
        sum = warp_sum(sum);
        q = warp_sum(q);
        if ((threadIdx.x & 31) == 0) {
            slot[0][warp] = sum;
            slot[1][warp] = q;
        }
        __syncthreads();  // red alternates between two slots, so two barriers a row suffice
        sum = q = 0.0f;
#pragma unroll
        for (int k = 0; k < FXK_TWO_READ_THREADS / 32; ++k) {
            sum += slot[0][k];
            q += slot[1][k];
        }
        const float row_mean = sum * inv_d, away = mean - row_mean;
        float between = warp_sum(n * away * away);
        if ((threadIdx.x & 31) == 0) slot[2][warp] = between;
        __syncthreads();
        between = 0.0f;
#pragma unroll
        for (int k = 0; k < FXK_TWO_READ_THREADS / 32; ++k) between += slot[2][k];
        const float rstd = rsqrtf((q + between) * inv_d + eps);
        T* yr = y + off;
#pragma unroll 1
        for (unsigned col = threadIdx.x * V; col < len; col += STEP * U) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const unsigned at = col + u * STEP;
                if (at < len) {
                    if constexpr (WEIGHT)
                        store<T, V>(yr + at, ln_pack(load_evict<T, V, false>(xr + at, drop),
                                                     load_evict<T, V, true>(w + at, keep), row_mean, rstd));
                    else
                        store<T, V>(yr + at, ln_pack(load_evict<T, V, false>(xr + at, drop), row_mean, rstd));
                }
            }
        }
    }
}

template <typename T, bool WEIGHT = true>
__device__ __forceinline__ void layernorm_two_read(const T* x, const T* w, float eps, int D, int n, T* y) {
    __shared__ float red[2][3][FXK_TWO_READ_THREADS / 32];
    if (D <= 0) return;
    const unsigned rows = (unsigned)n / (unsigned)D;
    constexpr int V = 16 / sizeof(T);
    if (D % V == 0 && aligned16(x) && (!WEIGHT || aligned16(w)) && aligned16(y))
        layernorm_two_read_rows<T, V, FXK_TWO_READ_PACKS, WEIGHT>(x, w, eps, D, rows, y, red);
    else  // any other call is still right, only slower (the op sends only calls that fit the fast path)
        layernorm_two_read_rows<T, 1, 1, WEIGHT>(x, w, eps, D, rows, y, red);
}

}  // namespace fxk

template <typename T>
__global__ void __launch_bounds__(FXK_TWO_READ_THREADS, FXK_TWO_READ_BLOCKS)
cohere_layer_norm_two_read(const T* x, const T* w, float eps, int D, int n, T* y) {
    fxk::layernorm_two_read<T>(x, w, eps, D, n, y);
}

// OLMo 1's plain norm on long rows: the same, neither weight nor bias.
template <typename T>
__global__ void __launch_bounds__(FXK_TWO_READ_THREADS, FXK_TWO_READ_BLOCKS)
olmo_layer_norm_two_read(const T* x, int normalized_size, float eps, int D, int n, T* y) {
    fxk::layernorm_two_read<T, false>(x, nullptr, eps, D, n, y);
}
"""

def _spec(kernel: str, *inputs, outputs=("y", "h")) -> KernelSpec:
    """A spec of this source's row kernels: ``x`` first, then the other inputs; the outputs of x's shape
    (the norm, and the sum where there is an add); the row length and the element count as extras."""
    return KernelSpec(SOURCE, kernel, inputs=[InputDecl("x"), *inputs],
                      outputs=[OutputDecl(name, SameAs("x")) for name in outputs],
                      extras=[DimSize("x", -1), Numel("x")], geometry=Custom(row_geometry_8k), dtypes=DTYPES)


_RESIDUAL, _WEIGHT, _BIAS = InputDecl("residual"), InputDecl("weight", broadcast=True), InputDecl("bias", broadcast=True)
_EPS, _SIZE = ScalarInput("eps", float), ScalarInput("normalized_size", int)
ADD_LAYER_NORM = _spec("add_layer_norm", _RESIDUAL, _WEIGHT, _BIAS, _SIZE, _EPS)
# nn.LayerNorm(..., bias=False) (ModernBERT's norm_bias=False): the same kernel, no bias read.
ADD_LAYER_NORM_NO_BIAS = _spec("add_layer_norm_no_bias", _RESIDUAL, _WEIGHT, _SIZE, _EPS)
# Cohere's LayerNorm, written out in float32 (no bias), after a residual add and alone.
ADD_COHERE_LAYER_NORM = _spec("add_cohere_layer_norm", _RESIDUAL, _WEIGHT, _EPS)
COHERE_LAYER_NORM = _spec("cohere_layer_norm", _WEIGHT, _EPS, outputs=("y",))
# OLMo 1's LayerNorm, neither weight nor bias, in float32 and cast back: after a residual add and alone.
ADD_OLMO_LAYER_NORM = _spec("add_olmo_layer_norm", _RESIDUAL, _SIZE, _EPS)
OLMO_LAYER_NORM = _spec("olmo_layer_norm", _SIZE, _EPS, outputs=("y",))


def add_layer_norm(x, residual, weight, bias, normalized_size: int, eps: float):
    """A residual add and the next ``nn.LayerNorm`` (BERT's ``self.LayerNorm(hidden_states +
    input_tensor)``, GPT-2's ``attn_output + residual`` then ``ln_2``): the norm and the sum.

    The norm comes first: a match is found from a pattern's first output, and the sum is inside it."""
    h = x + residual
    return F.layer_norm(h, (normalized_size,), weight, bias, eps), h


def add_layer_norm_no_bias(x, residual, weight, normalized_size: int, eps: float):
    """A residual add and the next ``nn.LayerNorm(D, bias=False)``: transformers' ModernBERT
    (``ModernBertEncoderLayer``: ``hidden_states = hidden_states + attn_output``, then
    ``self.mlp_norm(hidden_states)``; the next layer's ``attn_norm`` and the ``final_norm`` after the
    MLP's add), whose ``norm_bias`` is False by default. The norm and the sum."""
    h = x + residual
    return F.layer_norm(h, (normalized_size,), weight, None, eps), h


def cohere_layer_norm(hidden_states, weight, eps: float):
    """transformers' ``CohereLayerNorm.forward`` (Cohere, Cohere 2: Command R), as written there: a
    LayerNorm without bias computed in float32 (centred variance), the weight multiplied in float32,
    one rounding at the end; the bias-free kernel's arithmetic. Cohere norms each layer's input once
    (attention and MLP run in parallel on it): after the first layer, that input is a residual sum."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    mean = hidden_states.mean(-1, keepdim=True)
    variance = (hidden_states - mean).pow(2).mean(-1, keepdim=True)
    hidden_states = (hidden_states - mean) * torch.rsqrt(variance + eps)
    hidden_states = weight.to(torch.float32) * hidden_states
    return hidden_states.to(input_dtype)


def add_cohere_layer_norm(x, residual, weight, eps: float):
    """Cohere's residual add (``residual + hidden_states_attention + hidden_states_mlp``: the last of its
    two adds) and the next layer's ``input_layernorm`` (or the final norm): the norm and the sum."""
    h = x + residual
    return cohere_layer_norm(h, weight, eps), h


def olmo_layer_norm(x, normalized_size: int, eps: float):
    """transformers' ``OlmoLayerNorm.forward`` (OLMo 1: OLMo-1B-hf, OLMo-7B-hf, OLMo-7B-0424-hf), as
    written there: a LayerNorm with neither weight nor bias, computed in float32 and cast back. For
    16-bit ``x`` that is three kernels in eager (the casts copy); in float32 it is PyTorch's one
    LayerNorm kernel, which the plain rule leaves to it."""
    orig_dtype = x.dtype
    return F.layer_norm(x.to(dtype=torch.float32), (normalized_size,), None, None, eps=eps).to(orig_dtype)


def add_olmo_layer_norm(x, residual, normalized_size: int, eps: float):
    """OLMo 1's residual add (``hidden_states = residual + hidden_states``) and the next layer norm
    (``post_attention_layernorm``, the next layer's ``input_layernorm``, the final ``norm``): the norm
    and the sum."""
    h = x + residual
    return olmo_layer_norm(h, normalized_size, eps), h


def _check(x, residual, weight, bias, normalized_size, op: str = "add_layer_norm") -> None:
    """What the kernel reads: x and residual of one shape, weight and bias (D,) (bias None for the
    bias-free op), D = normalized_size = x's last axis (LayerNorm over the last axis only)."""
    op = f"{NAMESPACE}::{op}"
    if x.dim() == 0 or normalized_size != x.shape[-1]:
        raise KernelInputError(
            f"{op}: normalized_size={normalized_size} must be the last axis of x {tuple(x.shape)}: the kernel "
            f"normalises over the last axis only (nn.LayerNorm(x.shape[-1]))")
    if tuple(residual.shape) != tuple(x.shape):
        raise KernelInputError(f"{op}: residual {tuple(residual.shape)} must have x's shape {tuple(x.shape)}; "
                               f"add a broadcast residual before the op")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and (p.dim() != 1 or p.shape[0] != x.shape[-1]):
            raise KernelInputError(f"{op}: {name} {tuple(p.shape)} must be ({x.shape[-1]},), one value per column "
                                   f"(nn.LayerNorm with elementwise_affine=True)")


def _outputs(x, residual, weight, bias, normalized_size, eps):
    """The op's outputs (and its fake impl): the norm and the sum, contiguous, of x's shape."""
    _check(x, residual, weight, bias, normalized_size)
    return x.new_empty(x.shape), x.new_empty(x.shape)


def _outputs_no_bias(x, residual, weight, normalized_size, eps):
    """The bias-free op's outputs (and its fake impl), as ``_outputs``."""
    _check(x, residual, weight, None, normalized_size, "add_layer_norm_no_bias")
    return x.new_empty(x.shape), x.new_empty(x.shape)


def _outputs_cohere(x, residual, weight, eps):
    """The Cohere add + norm op's outputs (and its fake impl), as ``_outputs``."""
    _check(x, residual, weight, None, x.shape[-1] if x.dim() else None, "add_cohere_layer_norm")
    return x.new_empty(x.shape), x.new_empty(x.shape)


def _outputs_olmo(x, residual, normalized_size, eps):
    """OLMo 1's add + norm op's outputs (and its fake impl), as ``_outputs``."""
    _check(x, residual, None, None, normalized_size, "add_olmo_layer_norm")
    return x.new_empty(x.shape), x.new_empty(x.shape)


def _output_olmo(x, normalized_size, eps):
    """OLMo 1's plain norm's output (and its fake impl)."""
    _check(x, x, None, None, normalized_size, "olmo_layer_norm")
    return x.new_empty(x.shape)


def _output_cohere(x, weight, eps):
    """The plain Cohere norm's output (and its fake impl)."""
    _check(x, x, weight, None, x.shape[-1] if x.dim() else None, "cohere_layer_norm")
    return x.new_empty(x.shape)


# Cohere's plain norm on long rows: its two-read kernel, tuned so that a thread's step (threads x packs x
# 16 bytes) covers the row, as inductor's kernel does. There the row's moments need no merging across
# steps, and it was faster than the RMSNorms' tunings, which take 16-bit rows of 8192 in 512 threads
# (3396 GB/s against 4160 at 16384x8192, benchmarks/cohere_tuning.py); float32 rows of 4096 too
# (3988 GB/s at 8192x4096, the register-resident kernel 3918). Shorter rows keep that kernel.
COHERE_TWO_READ = (TwoRead("32bit", 4, min_row=4096, threads=256, packs=4, blocks=6),
                   TwoRead("32bit_8k", 4, min_row=8192, threads=512, packs=4, blocks=3),
                   TwoRead("16bit", 2, min_row=8192, threads=256, packs=4, blocks=6),
                   TwoRead("16bit_16k", 2, min_row=16384, threads=512, packs=4, blocks=3))

_WEIGHT_ROW, _BIAS_ROW = row_param("x", "weight", same_shape="residual"), row_param("x", "bias")
_WEIGHT_OF_X = row_param("x", "weight")


def _layer_norm_operands(match) -> bool:
    """A filter: weight and bias (where the pattern has them) are rows of x, residual (where it has one)
    has x's shape, and the captured normalized_size is x's last axis."""
    bindings = match.bindings
    if ("weight" in bindings and not _WEIGHT_OF_X(match)) or ("bias" in bindings and not _BIAS_ROW(match)):
        return False
    x = bindings["x"].meta.get("val")
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return False
    if "residual" in bindings:
        r = bindings["residual"].meta.get("val")
        if not isinstance(r, torch.Tensor) or not statically_known_true(sym_eq(r.shape, x.shape)):
            return False
    return statically_known_true(x.shape[-1] == bindings.get("normalized_size"))


def register(rules) -> None:
    # In the export IR only (the others decompose aten.layer_norm and lose its [D]). The example
    # inputs make the row length an int literal the pattern captures: 37, no other literal there.
    op = cuda_kernel_op(f"{NAMESPACE}::add_layer_norm", ADD_LAYER_NORM, reference=add_layer_norm, meta_fn=_outputs,
                        past_limits="split")
    example = (torch.randn(4, 37), torch.randn(4, 37), torch.randn(37), torch.randn(37), 37, SENTINELS[float])
    add_rule(rules, add_layer_norm, op, "add_layer_norm", filter=_layer_norm_operands, example_inputs=example,
             irs=("export",))
    # nn.LayerNorm(bias=False) exports as layer_norm(h, [D], weight, None, eps): a form of its own.
    op = cuda_kernel_op(f"{NAMESPACE}::add_layer_norm_no_bias", ADD_LAYER_NORM_NO_BIAS, reference=add_layer_norm_no_bias,
                        meta_fn=_outputs_no_bias, past_limits="split")
    example = (torch.randn(4, 37), torch.randn(4, 37), torch.randn(37), 37, SENTINELS[float])
    add_rule(rules, add_layer_norm_no_bias, op, "add_layer_norm_no_bias", filter=_layer_norm_operands,
             example_inputs=example, irs=("export",))
    # OLMo 1's norms, neither weight nor bias, in float32: the example's dtype is the cast back's literal.
    # The residual form in every dtype (the add is the win); the plain one in 16 bits, where eager's
    # casts are copies (in float32 it is PyTorch's one LayerNorm kernel, left to it as above).
    op = cuda_kernel_op(f"{NAMESPACE}::add_olmo_layer_norm", ADD_OLMO_LAYER_NORM, reference=add_olmo_layer_norm,
                        meta_fn=_outputs_olmo, past_limits="split")
    add_rule(rules, add_olmo_layer_norm, op, "add_olmo_layer_norm", filter=_layer_norm_operands, irs=("export",),
             example_inputs=lambda dtype: (torch.randn(4, 37).to(dtype), torch.randn(4, 37).to(dtype), 37,
                                           SENTINELS[float]))
    # The plain norm picks its kernel per call, as Cohere's does: rows of 16 KB and more are read twice.
    rows = f"{NAMESPACE}::_olmo_layer_norm_rows"
    cuda_kernel_op(rows, OLMO_LAYER_NORM, reference=olmo_layer_norm, meta_fn=_output_olmo)
    two_read = two_read_ops(OLMO_LAYER_NORM, olmo_layer_norm, meta_fn=_output_olmo, table=COHERE_TWO_READ)
    op = cuda_kernel_op(f"{NAMESPACE}::olmo_layer_norm", OLMO_LAYER_NORM, reference=olmo_layer_norm,
                        meta_fn=_output_olmo, eager_fn=pick_kernel(rows, two_read), past_limits="split")
    add_rule(rules, olmo_layer_norm, op, "olmo_layer_norm", filter=_layer_norm_operands, irs=("export",),
             example_inputs=lambda dtype: (torch.randn(4, 37).to(dtype), 37, SENTINELS[float]), dtypes=SIXTEEN_BIT)
    # Cohere's norm is written out (no aten.layer_norm to lose), so its rules hold in every IR fxkern
    # runs its ops in; the residual form first (the plain one matches inside it).
    op = cuda_kernel_op(f"{NAMESPACE}::add_cohere_layer_norm", ADD_COHERE_LAYER_NORM, reference=add_cohere_layer_norm,
                        meta_fn=_outputs_cohere, past_limits="split")
    add_rule(rules, add_cohere_layer_norm, op, "add_cohere_layer_norm", filter=_WEIGHT_ROW, irs=COMPILE_FREE_IRS)
    # The plain norm runs one of its kernels per call, as the plain RMSNorms do: rows of 16 KB and more
    # are read twice (COHERE_TWO_READ). The public op's spec is the register-resident kernel's, which
    # TensorRT plugins carry.
    rows = f"{NAMESPACE}::_cohere_layer_norm_rows"
    cuda_kernel_op(rows, COHERE_LAYER_NORM, reference=cohere_layer_norm, meta_fn=_output_cohere)
    two_read = two_read_ops(COHERE_LAYER_NORM, cohere_layer_norm, meta_fn=_output_cohere, table=COHERE_TWO_READ)
    op = cuda_kernel_op(f"{NAMESPACE}::cohere_layer_norm", COHERE_LAYER_NORM, reference=cohere_layer_norm,
                        meta_fn=_output_cohere, eager_fn=pick_kernel(rows, two_read), past_limits="split")
    add_rule(rules, cohere_layer_norm, op, "cohere_layer_norm", filter=row_param("hidden_states", "weight"),
             irs=COMPILE_FREE_IRS)
