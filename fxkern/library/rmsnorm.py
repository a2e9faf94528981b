"""RMSNorm over the last axis: one read and one write of the row instead of five or six passes.

Variants, as the libraries write them (transformers 5.x source):

* ``llama_rmsnorm`` — ``LlamaRMSNorm`` (also Mistral, Mixtral, Qwen2/3, Phi-3, OLMo 1...):
  float32 upcast, ``weight * hidden.to(input_dtype)``: the normalised row is rounded to the input
  dtype *before* the weight multiply;
* ``meta_rmsnorm`` — Meta's reference Llama and the code written after it (gpt-fast, torchtune,
  mistral-inference): ``self._norm(x.float()).type_as(x) * self.weight``, Llama's numbers;
* ``t5_layer_norm`` — ``T5LayerNorm`` (T5, mT5, UMT5, LongT5...): variance of the upcast input,
  ``x * rsqrt(...)`` in float32, cast to the weight's half dtype: the same numbers as Llama's
  when weight and input share a dtype, so the rule targets the same op;
* ``gemma_rmsnorm`` — ``GemmaRMSNorm`` (Gemma, Gemma 2/3, RecurrentGemma): ``(x * r) * (1 + weight)``
  in float32, rounded once;
* ``torch_rms_norm`` — ``torch.nn.RMSNorm`` / ``F.rms_norm``: one ``aten.rms_norm(x, [D], w, eps)``
  node in the export IR (the only IR that keeps it whole; the pattern captures ``D``);
* ``litgpt_rms_norm`` — litgpt's ``RMSNorm`` (Lightning-AI/litgpt ``litgpt/model.py``): float32
  upcast, the mean of ``x * x`` (not ``pow(2)``: export keeps the product as a ``mul``), and
  ``(x_normed * weight.float()).to(dtype)``: the weight multiplied in float32 and rounded once,
  ``F.rms_norm``'s numbers, on the same kernels;
* ``olmo2_rms_norm`` — ``Olmo2RMSNorm`` (OLMo 2 and 3, FlexOlmo, GPT-OSS...): Llama's upcast and
  variance, then ``(self.weight * hidden_states).to(input_dtype)``: the 16-bit weight times the
  float32 row promotes to float32, one rounding at the end, litgpt's numbers and op.

``x ** 2`` exports as ``pow(x, 2)``, as ``pow(2)`` does, so the forms above find it; ``torch.square``
stays ``aten.square`` in the export IR (core ATen and the IRs made from it turn it into ``pow``), and
no popular library writes a weighted RMSNorm with it (transformers' ``.square().mean(-1)`` norms,
DeepSeek V4's, HY V4's, GLM-5 Next's, have no weight), so no rule looks for it.

Each form is also matched with the residual add before it (``h = x + residual`` then the norm of
``h``, as every pre-norm decoder layer writes it): one kernel reads ``x`` and ``residual`` and writes
both the sum and its norm, 4 passes over memory where the add and the norm take 5.

Kernel: a 256-thread block per 8192 elements takes the rows that start there, so about one block
a row at 7B-model widths. A row stays in registers (32 elements a thread: eight 16-byte packs in
float32, four in 16-bit types) between the reduction and the write; the fewest power-of-two
threads that hold it share it (sub-warp and warp shuffles, one shared-memory step past a warp).
Longer rows are read twice (the second read mostly from L2). The block size, packs and blocks
resident per SM were chosen by ``benchmarks/row_tuning.py`` (results in docs/benchmarks.md).

The plain norms on float32 rows of 4096+ elements and 16-bit rows of 8192+ run a second kernel
instead (``two_read_tuning``): one block a row, reading it twice, with cache eviction hints, holding
nothing of the row through the reduction (so more threads an SM); it was measured faster there
(``row_tuning.py --two-read``). TensorRT
plugins carry the register-resident kernel, the public op's spec. None of these rules runs inside
inductor (see ``register``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxkern.errors import KernelInputError
from fxkern.library._rules import (
    COMPILE_FREE_IRS,
    DTYPES,
    NAMESPACE,
    add_rule,
    aligned_at_launch,
    keeps_row_layout,
    per_call,
    row_geometry_8k,
    row_param,
    rows_in_place,
)
from fxkern.library.cuda_common import COMMON, EVICT_LOADS, row_tuning
from fxkern.ops import cuda_kernel_op, kernel_op
from fxkern.patterns import SENTINELS
from fxkern.spec import (
    Custom,
    DimSize,
    InputDecl,
    KernelSpec,
    Numel,
    OutputDecl,
    Reduction,
    SameAs,
    ScalarInput,
)

FLOAT32_EPS = torch.finfo(torch.float32).eps  # F.rms_norm's eps=None, for every input dtype

@dataclasses.dataclass(frozen=True)
class TwoRead:
    """A tuning of the two-read kernel for one element size: the shortest row it takes, threads a
    block (one block a row), 16-byte packs a thread reads a step and blocks resident per SM
    (benchmarks/row_tuning.py --two-read measured each against the register-resident kernel and
    inductor). ``name`` ends its private op's name."""

    name: str
    element_size: int
    min_row: int
    threads: int
    packs: int
    blocks: int

    def macros(self, define: str = "#define {k} {v}\n") -> str:
        return "".join(define.format(k=k, v=v) for k, v in (
            ("FXK_TWO_READ_THREADS", self.threads), ("FXK_TWO_READ_PACKS", self.packs),
            ("FXK_TWO_READ_BLOCKS", self.blocks)))


# Float32 rows of 4096+ and 16-bit rows of 8192+ (16 KB and more) were faster read twice; shorter
# rows keep the register-resident kernel. Float32 rows of 8192+ read the whole row in one step (four
# packs a thread, inductor's own shape there): 1.4% faster at 16384x8192, and 8% slower at 8192x4096
# than two packs, also as a branch in one kernel, so it is a kernel of its own. 16-bit rows take
# inductor's shape too (two packs, the row of 8192 in one step): 1.1% faster than 256 threads of
# four packs once Llama's weight multiply was one packed instruction.
TWO_READ = (TwoRead("32bit", 4, min_row=4096, threads=512, packs=2, blocks=4),
            TwoRead("32bit_8k", 4, min_row=8192, threads=512, packs=4, blocks=3),
            TwoRead("16bit", 2, min_row=8192, threads=512, packs=2, blocks=4))


def by_element_size(table: tuple[TwoRead, ...]) -> dict[int, list[TwoRead]]:
    """A table of tunings as ``two_read_tuning`` reads it on every call: per element size, the longest
    rows' tuning first."""
    return {size: sorted((t for t in table if t.element_size == size), key=lambda t: -t.min_row)
            for size in {t.element_size for t in table}}


_TWO_READ_BY_SIZE = by_element_size(TWO_READ)
TWO_READ_DEFAULTS = TWO_READ[0].macros("#ifndef {k}\n#define {k} {v}\n#endif\n") + (
    "#ifndef FXK_EVICT_HINTS\n#define FXK_EVICT_HINTS 1\n#endif\n")

# The numbers of a normalised pack, shared with the kernels that normalise and then rotate a head
# (fxkern.library.norm_rotary).
NORM_MATH = r"""
namespace fxk {

enum { RMS_LLAMA = 0, RMS_GEMMA = 1, RMS_TORCH = 2 };

// A pack of outputs from a pack of the row and of the weight, r = rsqrt(mean(x^2) + eps); 16-bit
// values convert in pairs.
//   Llama: weight * (x * r).to(input_dtype)       Gemma: ((x * r) * (1 + weight)).type_as(x)
//   Torch (F.rms_norm): (x * r * weight) in float32, rounded to the dtype once
template <typename T, int MODE, int V>
__device__ __forceinline__ Pack<T, V> rms_pack(const Pack<T, V>& c, const Pack<T, V>& w, float r) {
    float x[V];
    to_floats(c, x);
    if constexpr (MODE == RMS_LLAMA && sizeof(T) == 2 && V % 2 == 0) {
        // Llama in float16/bfloat16: PyTorch's weight * h widens both to float, multiplies and rounds
        // to the dtype; a 16-bit product rounds to the same value in one packed multiply (__hmul2_rn:
        // mul.rn, never fused), which skips widening the weight and the rounded h: 24 instructions
        // a pack where it took 48.
#pragma unroll
        for (int j = 0; j < V; ++j) x[j] *= r;
        const Pack<T, V> h = from_floats<T, V>(x);
        Pack<T, V> out;
        using P = typename Pair<T>::P;
#pragma unroll
        for (int j = 0; j < V / 2; ++j)
            reinterpret_cast<P*>(out.v)[j] = __hmul2_rn(reinterpret_cast<const P*>(w.v)[j], reinterpret_cast<const P*>(h.v)[j]);
        return out;
    }
    float wf[V];
    to_floats(w, wf);
#pragma unroll
    for (int j = 0; j < V; ++j) x[j] *= r;
    if (MODE == RMS_LLAMA) to_floats(from_floats<T, V>(x), x);  // the cast to the input dtype
#pragma unroll
    for (int j = 0; j < V; ++j) x[j] = MODE == RMS_GEMMA ? x[j] * (1.0f + wf[j]) : wf[j] * x[j];
    return from_floats<T, V>(x);
}

// A pack's squares added to ss, in float32.
template <typename T, int V>
__device__ __forceinline__ float sum_squares(const Pack<T, V>& p, float ss) {
    float f[V];
    to_floats(p, f);
#pragma unroll
    for (int j = 0; j < V; ++j) ss = fmaf(f[j], f[j], ss);
    return ss;
}

}  // namespace fxk
"""


SOURCE = COMMON + row_tuning(blocks_f32=4, blocks_half=6, packs_f32=8, packs_half=4) + TWO_READ_DEFAULTS + NORM_MATH + r"""
namespace fxk {

// A pack of an operand that broadcasts onto x (the residual or the weight): at `at` when it lines up
// with x (always so with 16-byte packs, which the kernel takes only then), else the element at the
// flat index modulo its np elements.
template <typename T, int V>
__device__ __forceinline__ Pack<T, V> load_operand(const T* p, bool lined_up, size_t at, size_t flat, size_t np) {
    Pack<T, V> v;
    if (V > 1 || lined_up) v = load<T, V>(p + at);
    else v.v[0] = p[flat % np];
    return v;
}

// Thread t's share of one row (NV packs of V elements, G threads a row) into registers. ADD: the
// row is x + res rounded to T (what `x + residual` holds in the model), also written to h; res has
// nr elements, read at the flat index modulo nr (nr is x's size whenever V > 1).
template <typename T, bool ADD, int V, int NV>
__device__ __forceinline__ void load_row(Pack<T, V> (&c)[NV], const T* __restrict__ x, const T* __restrict__ res,
                                         unsigned nr, T* __restrict__ h, size_t off, int D, int G, int t, bool live) {
#pragma unroll
    for (int k = 0; k < NV; ++k) {
        const int col = (k * G + t) * V;
        if (live && col < D) c[k] = load<T, V>(x + off + col);
    }
    if (ADD) {
#pragma unroll
        for (int k = 0; k < NV; ++k) {
            const int col = (k * G + t) * V;
            if (live && col < D) {
                c[k] = add_rounded(c[k], load_operand<T, V>(res, false, off + col, off + col, nr));
                store<T, V>(h + off + col, c[k]);
            }
        }
    }
}

// Rows of D elements; V elements an access (16 bytes, or 1 when the data does not allow it),
// NV accesses a thread kept in registers. w has nw elements: D for a (D,) weight, or any trailing
// block of x's shape (the op checks that), read at the flat index modulo nw. ADD: normalise
// x + res (res broadcast like w) and write that sum to h as well.
template <typename T, int MODE, bool ADD, int V, int NV>
__device__ __forceinline__ void rmsnorm_rows(const T* __restrict__ x, const T* __restrict__ res, unsigned nr,
                                             const T* __restrict__ w, float eps, int D, unsigned rows, int nw,
                                             T* __restrict__ h, T* __restrict__ y, float (*red)[ROW_WARPS]) {
    unsigned begin, end;
    block_rows((unsigned)D, rows, begin, end);
    const int G = row_group(D, V * NV);
    const float inv_d = __frcp_rn((float)D);  // the mean as sum * (1 / D), as PyTorch's CUDA mean takes it
    if (G * V * NV >= D) {
        const int groups = ROW_THREADS >> log2_of(G), g = threadIdx.x >> log2_of(G), t = threadIdx.x & (G - 1);
        for (unsigned first = begin, p = 0; first < end; first += groups, ++p) {
            const unsigned row = first + g;
            const bool live = row < end;
            Pack<T, V> c[NV];
            load_row<T, ADD, V, NV>(c, x, res, nr, h, (size_t)row * D, D, G, t, live);
            float ss = 0.0f;
#pragma unroll
            for (int k = 0; k < NV; ++k) {
                const int col = (k * G + t) * V;
                if (live && col < D) ss = sum_squares(c[k], ss);
            }
            const float r = rsqrtf(group_sum(ss, G, red[p & 1]) * inv_d + eps);
            T* yr = y + (size_t)row * D;
#pragma unroll
            for (int k = 0; k < NV; ++k) {
                const int col = (k * G + t) * V;
                if (live && col < D) {
                    const Pack<T, V> wp = load_operand<T, V>(w, nw == D, col, (size_t)row * D + col, nw);
                    opaque(c[k]);
                    store<T, V>(yr + col, rms_pack<T, MODE, V>(c[k], wp, r));
                }
            }
        }
    } else {  // long rows: the whole block on one row at a time, reading it twice (h, with ADD)
        // columns counted in 64 bits: a row may hold up to 2^31 - 1 elements, and an int column stepped
        // past it wrapped below zero
        for (unsigned row = begin, p = 0; row < end; ++row, ++p) {
            const size_t off = (size_t)row * D;
            float ss = 0.0f;
#pragma unroll 4
            for (long long col = threadIdx.x * V; col < D; col += ROW_THREADS * V) {
                Pack<T, V> c = load<T, V>(x + off + col);
                if (ADD) {
                    c = add_rounded(c, load_operand<T, V>(res, false, off + col, off + col, nr));
                    store<T, V>(h + off + col, c);
                }
                ss = sum_squares(c, ss);
            }
            const float r = rsqrtf(group_sum(ss, ROW_THREADS, red[p & 1]) * inv_d + eps);
            const T* src = ADD ? h : x;  // each thread reads back only what it wrote itself
#pragma unroll 4
            for (long long col = threadIdx.x * V; col < D; col += ROW_THREADS * V) {
                const Pack<T, V> c = load<T, V>(src + off + col);
                const Pack<T, V> wp = load_operand<T, V>(w, nw == D, col, off + col, nw);
                store<T, V>(y + off + col, rms_pack<T, MODE, V>(c, wp, r));
            }
        }
    }
}

template <typename T, int MODE, bool ADD>
__device__ __forceinline__ void rmsnorm(const T* x, const T* res, int nr, const T* w, float eps, int D, int n, int nw,
                                        T* h, T* y) {
    __shared__ float red[2][ROW_WARPS];
    if (D <= 0 || nw <= 0 || (ADD && nr <= 0)) return;
    const unsigned rows = (unsigned)n / (unsigned)D;
    constexpr int V = 16 / sizeof(T);
    bool vec = D % V == 0 && nw == D && aligned16(x) && aligned16(w) && aligned16(y);
    if (ADD) vec = vec && nr == n && aligned16(res) && aligned16(h);
    if (vec)
        rmsnorm_rows<T, MODE, ADD, V, (sizeof(T) == 4 ? FXK_ROW_PACKS_F32 : FXK_ROW_PACKS_HALF)>(
            x, res, (unsigned)nr, w, eps, D, rows, nw, h, y, red);
    else
        rmsnorm_rows<T, MODE, ADD, 1, FXK_ROW_SCALARS>(x, res, (unsigned)nr, w, eps, D, rows, nw, h, y, red);
}

// ---- two reads: long rows (the op picks this kernel per call, see two_read_tuning) ---------------------
// One block a row, FXK_TWO_READ_THREADS threads, each reading a few packs a step: a first pass sums the
// squares, a second reads the row again (from L1/L2) to write the output. Nothing of the row is held
// across the reduction, so a thread needs few registers: an H100/H200 SM holds 1536-2048 threads where
// the register-resident kernel holds 1024 (float32) or 1536 (16-bit), and the second read comes from
// L1/L2 (with eviction hints) in place of the row kept in registers through the reduction. The
// shape of inductor's kernel, measured faster for float32 rows of 4096+ elements and 16-bit rows of
// 8192+ (benchmarks/row_tuning.py --two-read).

""" + EVICT_LOADS + r"""
// Rows of D elements, one block each (any grid: blocks stride over rows); V elements an access (16
// bytes, or 1 when the data does not allow it), U accesses a thread a step; w has nw elements, read
// at the flat index modulo nw.
template <typename T, int MODE, int V, int U>
__device__ __forceinline__ void rmsnorm_two_read_rows(const T* __restrict__ x, const T* __restrict__ w, float eps,
                                                      int D, unsigned rows, int nw, T* __restrict__ y,
                                                      float (*red)[FXK_TWO_READ_THREADS / 32]) {
    constexpr unsigned STEP = FXK_TWO_READ_THREADS * V;
    const unsigned len = (unsigned)D;  // unsigned columns: col + STEP * U cannot wrap below 2^32
    const unsigned long long keep = l2_policy<true>(), drop = l2_policy<false>();
    const float inv_d = __frcp_rn((float)D);
#pragma unroll 1
    for (unsigned row = blockIdx.x, p = 0; row < rows; row += gridDim.x, ++p) {
        const size_t off = (size_t)row * D;
        const T* xr = x + off;
        float ss = 0.0f;
#pragma unroll 1
        for (unsigned col = threadIdx.x * V; col < len; col += STEP * U) {
            Pack<T, V> c[U];
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (col + u * STEP < len) c[u] = load_evict<T, V, true>(xr + col + u * STEP, keep);
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (col + u * STEP < len) ss = sum_squares(c[u], ss);
        }
        ss = warp_sum(ss);
        if ((threadIdx.x & 31) == 0) red[p & 1][threadIdx.x >> 5] = ss;
        __syncthreads();  // red alternates between two slots, so one barrier a row suffices
        float total = 0.0f;
#pragma unroll
        for (int k = 0; k < FXK_TWO_READ_THREADS / 32; ++k) total += red[p & 1][k];
        const float r = rsqrtf(total * inv_d + eps);
        T* yr = y + off;
#pragma unroll 1
        for (unsigned col = threadIdx.x * V; col < len; col += STEP * U) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const unsigned at = col + u * STEP;
                if (at < len) {
                    const Pack<T, V> wp = V > 1 ? load_evict<T, V, true>(w + at, keep)
                                                : load_operand<T, V>(w, nw == D, at, off + at, nw);
                    store<T, V>(yr + at, rms_pack<T, MODE, V>(load_evict<T, V, false>(xr + at, drop), wp, r));
                }
            }
        }
    }
}

template <typename T, int MODE>
__device__ __forceinline__ void rmsnorm_two_read(const T* x, const T* w, float eps, int D, int n, int nw, T* y) {
    __shared__ float red[2][FXK_TWO_READ_THREADS / 32];
    if (D <= 0 || nw <= 0) return;
    const unsigned rows = (unsigned)n / (unsigned)D;
    constexpr int V = 16 / sizeof(T);
    if (D % V == 0 && nw == D && aligned16(x) && aligned16(w) && aligned16(y))
        rmsnorm_two_read_rows<T, MODE, V, FXK_TWO_READ_PACKS>(x, w, eps, D, rows, nw, y, red);
    else  // any other call is still right, only slower (the op sends only calls that fit the fast path)
        rmsnorm_two_read_rows<T, MODE, 1, 1>(x, w, eps, D, rows, nw, y, red);
}

}  // namespace fxk

#define FXK_TWO_READ_BOUNDS __launch_bounds__(FXK_TWO_READ_THREADS, FXK_TWO_READ_BLOCKS)
template <typename T>
__global__ void FXK_TWO_READ_BOUNDS rms_norm_two_read(const T* x, const T* weight, float eps, int D, int n, int nw,
                                                      T* y) {
    fxk::rmsnorm_two_read<T, fxk::RMS_LLAMA>(x, weight, eps, D, n, nw, y);
}
template <typename T>
__global__ void FXK_TWO_READ_BOUNDS rms_norm_torch_two_read(const T* x, const T* weight, float eps, int D, int n,
                                                            int nw, T* y) {
    fxk::rmsnorm_two_read<T, fxk::RMS_TORCH>(x, weight, eps, D, n, nw, y);
}
template <typename T>
__global__ void FXK_TWO_READ_BOUNDS gemma_rms_norm_two_read(const T* x, const T* weight, float eps, int D, int n,
                                                            int nw, T* y) {
    fxk::rmsnorm_two_read<T, fxk::RMS_GEMMA>(x, weight, eps, D, n, nw, y);
}

#define FXK_RMS_BOUNDS __launch_bounds__(ROW_THREADS, sizeof(T) == 4 ? FXK_ROW_BLOCKS_F32 : FXK_ROW_BLOCKS_HALF)
template <typename T>
__global__ void FXK_RMS_BOUNDS rms_norm(const T* x, const T* weight, float eps, int D, int n, int nw, T* y) {
    fxk::rmsnorm<T, fxk::RMS_LLAMA, false>(x, nullptr, 0, weight, eps, D, n, nw, nullptr, y);
}
template <typename T>
__global__ void FXK_RMS_BOUNDS gemma_rms_norm(const T* x, const T* weight, float eps, int D, int n, int nw, T* y) {
    fxk::rmsnorm<T, fxk::RMS_GEMMA, false>(x, nullptr, 0, weight, eps, D, n, nw, nullptr, y);
}
// F.rms_norm(x, [normalized_size], weight, eps): normalized_size is x's last axis D (the op checks
// that before launch; TensorRT gets only graphs that torch.export checked).
template <typename T>
__global__ void FXK_RMS_BOUNDS torch_rms_norm(const T* x, const T* weight, int normalized_size, float eps, int D,
                                              int n, int nw, T* y) {
    fxk::rmsnorm<T, fxk::RMS_TORCH, false>(x, nullptr, 0, weight, eps, D, n, nw, nullptr, y);
}
// eps=None: PyTorch takes float32's machine epsilon (its opmath type's) for every input dtype.
template <typename T>
__global__ void FXK_RMS_BOUNDS torch_rms_norm_default_eps(const T* x, const T* weight, int normalized_size, int D,
                                                          int n, int nw, T* y) {
    fxk::rmsnorm<T, fxk::RMS_TORCH, false>(x, nullptr, 0, weight, 1.1920928955078125e-07f, D, n, nw, nullptr, y);
}
// torch_rms_norm's numbers in rms_norm's call (x, weight, eps), for the eager path's private op
template <typename T>
__global__ void FXK_RMS_BOUNDS rms_norm_torch(const T* x, const T* weight, float eps, int D, int n, int nw, T* y) {
    fxk::rmsnorm<T, fxk::RMS_TORCH, false>(x, nullptr, 0, weight, eps, D, n, nw, nullptr, y);
}
template <typename T>
__global__ void FXK_RMS_BOUNDS add_rms_norm(const T* x, const T* residual, const T* weight, float eps, int D, int n,
                                            int nr, int nw, T* y, T* h) {
    fxk::rmsnorm<T, fxk::RMS_LLAMA, true>(x, residual, nr, weight, eps, D, n, nw, h, y);
}
// x + residual, then F.rms_norm(.., [normalized_size], ...) (the op checks normalized_size before
// launch, as for torch_rms_norm).
template <typename T>
__global__ void FXK_RMS_BOUNDS add_torch_rms_norm(const T* x, const T* residual, const T* weight, int normalized_size,
                                                  float eps, int D, int n, int nr, int nw, T* y, T* h) {
    fxk::rmsnorm<T, fxk::RMS_TORCH, true>(x, residual, nr, weight, eps, D, n, nw, h, y);
}
template <typename T>
__global__ void FXK_RMS_BOUNDS add_torch_rms_norm_default_eps(const T* x, const T* residual, const T* weight,
                                                              int normalized_size, int D, int n, int nr, int nw, T* y,
                                                              T* h) {
    fxk::rmsnorm<T, fxk::RMS_TORCH, true>(x, residual, nr, weight, 1.1920928955078125e-07f, D, n, nw, h, y);
}
// add_torch_rms_norm's numbers in add_rms_norm's call, for the eager path's private op
template <typename T>
__global__ void FXK_RMS_BOUNDS add_rms_norm_torch(const T* x, const T* residual, const T* weight, float eps, int D,
                                                  int n, int nr, int nw, T* y, T* h) {
    fxk::rmsnorm<T, fxk::RMS_TORCH, true>(x, residual, nr, weight, eps, D, n, nw, h, y);
}
template <typename T>
__global__ void FXK_RMS_BOUNDS add_gemma_rms_norm(const T* x, const T* residual, const T* weight, float eps, int D,
                                                  int n, int nr, int nw, T* y, T* h) {
    fxk::rmsnorm<T, fxk::RMS_GEMMA, true>(x, residual, nr, weight, eps, D, n, nw, h, y);
}
"""


def _spec(kernel: str, x: str) -> KernelSpec:
    return KernelSpec(
        SOURCE, kernel,
        inputs=[InputDecl(x), InputDecl("weight", broadcast=True), ScalarInput("eps", float)],
        outputs=[OutputDecl("y", SameAs(x))],
        extras=[DimSize(x, -1), Numel(x), Numel("weight")],
        geometry=Custom(row_geometry_8k),
        dtypes=DTYPES,
    )


def _add_spec(kernel: str, *scalars: ScalarInput) -> KernelSpec:
    # residual is declared broadcast so the op checks its shape against x's (the kernel reads it
    # at the flat index modulo its size); the rules only match an x + residual of one shape.
    return KernelSpec(
        SOURCE, kernel,
        inputs=[InputDecl("x"), InputDecl("residual", broadcast=True), InputDecl("weight", broadcast=True),
                *(scalars or (ScalarInput("eps", float),))],
        outputs=[OutputDecl("y", SameAs("x")), OutputDecl("h", SameAs("x"))],
        extras=[DimSize("x", -1), Numel("x"), Numel("residual"), Numel("weight")],
        geometry=Custom(row_geometry_8k),
        dtypes=DTYPES,
    )


RMS_NORM = _spec("rms_norm", "hidden_states")


def two_read_tuning(x: torch.Tensor, weight: torch.Tensor | None, by_size=_TWO_READ_BY_SIZE) -> TwoRead | None:
    """The two-read kernel's tuning a call runs (of its element size, the one for the longest rows it
    reaches in ``by_size``: ``by_element_size`` of a table, by default ``TWO_READ``, the plain RMSNorms'),
    or None for the register-resident kernel: rows at least a tuning's ``min_row`` long in
    whole 16-byte packs, one dtype for both, a (D,) weight (None for a norm without one), both 16-byte
    aligned (a non-contiguous one is copied to a fresh, aligned buffer before launch). There the two-read kernel was measured
    faster (within 2% of inductor at 16384x8192, level with it at 8192x4096 in float32); shorter rows
    are faster held in registers."""
    d = x.shape[-1] if x.dim() else 0
    tuning = next((t for t in by_size.get(x.element_size(), ()) if d >= t.min_row), None)
    if tuning is None or not x.dtype.is_floating_point or d % (16 // x.element_size()) or not aligned_at_launch(x):
        return None
    if weight is not None and (weight.dtype != x.dtype or weight.numel() != d or not aligned_at_launch(weight)):
        return None
    return tuning


def two_read_ops(spec: KernelSpec, reference, meta_fn=None, table: tuple[TwoRead, ...] = TWO_READ) -> dict[TwoRead, str]:
    """Registers ``spec``'s two-read kernel (``<kernel>_two_read`` in the same source, taking the same
    arguments) once per tuning of ``table``, a private op each (one block a row: a Reduction's grid);
    their names. Each is right in every dtype; the public op sends it the calls of its element size only."""
    ops = {}
    for tuning in table:
        ops[tuning] = f"{NAMESPACE}::_{spec.kernel_name}_two_read_{tuning.name}"
        two_read = dataclasses.replace(spec, kernel_name=f"{spec.kernel_name}_two_read",
                                       kernel_source=tuning.macros() + spec.kernel_source,
                                       geometry=Reduction((-1,), block_size=tuning.threads))
        cuda_kernel_op(ops[tuning], two_read, reference=reference, meta_fn=meta_fn)
    return ops


def _rms_norm_torch(x, weight, eps: float):
    """The torch forms' private ops in PyTorch (their CPU impl): F.rms_norm over the last axis."""
    return F.rms_norm(x, [x.shape[-1]], weight, eps)


def _add_rms_norm_torch(x, residual, weight, eps: float):
    h = x + residual
    return _rms_norm_torch(h, weight, eps), h


def pick_kernel(rows: str, two_read: dict[TwoRead, str]):
    """An op's CUDA implementation that runs the two-read kernel tuned for the call where
    ``two_read_tuning`` says so (of the tunings in ``two_read``: ``two_read_ops``' result), else
    ``rows``'s register-resident one (private ops). The op's argument after ``x`` is its weight; a norm
    without one (OLMo 1's) has a scalar there."""
    by_size = by_element_size(tuple(two_read))

    def pick(x, *rest, **kwargs):
        weight = rest[0] if rest else kwargs.get("weight")
        weight = weight if isinstance(weight, torch.Tensor) else None
        tuning = two_read_tuning(x, weight, by_size)
        return rows if tuning is None else two_read[tuning]

    return per_call(pick, (rows, *two_read.values()))


def _torch_spec(kernel: str, *scalars: ScalarInput) -> KernelSpec:
    return KernelSpec(
        SOURCE, kernel,
        inputs=[InputDecl("x"), InputDecl("weight", broadcast=True), *scalars],
        outputs=[OutputDecl("y", SameAs("x"))],
        extras=[DimSize("x", -1), Numel("x"), Numel("weight")],
        geometry=Custom(row_geometry_8k),
        dtypes=DTYPES,
    )


TORCH_RMS_NORM = _torch_spec("torch_rms_norm", ScalarInput("normalized_size", int), ScalarInput("eps", float))
TORCH_RMS_NORM_DEFAULT_EPS = _torch_spec("torch_rms_norm_default_eps", ScalarInput("normalized_size", int))
GEMMA_RMS_NORM = _spec("gemma_rms_norm", "x")
ADD_RMS_NORM = _add_spec("add_rms_norm")
ADD_GEMMA_RMS_NORM = _add_spec("add_gemma_rms_norm")
ADD_TORCH_RMS_NORM = _add_spec("add_torch_rms_norm", ScalarInput("normalized_size", int), ScalarInput("eps", float))
ADD_TORCH_RMS_NORM_DEFAULT_EPS = _add_spec("add_torch_rms_norm_default_eps", ScalarInput("normalized_size", int))
# litgpt's RMSNorm computes F.rms_norm's numbers: the torch forms' kernels in rms_norm's call (x, weight, eps).
LITGPT_RMS_NORM = _spec("rms_norm_torch", "x")
ADD_LITGPT_RMS_NORM = _add_spec("add_rms_norm_torch")


def llama_rmsnorm(hidden_states, weight, eps: float):
    """transformers' ``LlamaRMSNorm.forward``, as written there."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    return weight * hidden_states.to(input_dtype)


def meta_rmsnorm(x, weight, eps: float):
    """Meta's reference Llama ``RMSNorm.forward`` (``self._norm(x.float()).type_as(x) * self.weight``,
    its ``_norm`` inlined), as gpt-fast, torchtune and mistral-inference write it too: Llama's numbers,
    the normalised row rounded to x's dtype before the weight multiply. torch.export keeps ``type_as``
    and ``float()``, so Llama's pattern did not find it in any dtype (found by a probe)."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight


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


def torch_rms_norm(x, weight, normalized_size: int, eps: float):
    """``torch.nn.RMSNorm(D, eps=...)`` / ``F.rms_norm(x, [D], weight, eps)`` (torchtitan, timm's fast
    norm...). F.rms_norm rounds ``x * r * weight`` to the dtype once (its fused CUDA kernel and its CPU
    kernel alike), where Llama's form rounds the normalised row first: in float16/bfloat16 a quarter of
    the outputs differ by a unit in the last place. The op's kernels compute F.rms_norm's numbers
    (RMS_TORCH)."""
    return F.rms_norm(x, [normalized_size], weight, eps)


def torch_rms_norm_default_eps(x, weight, normalized_size: int):
    """``torch.nn.RMSNorm(D)`` / ``F.rms_norm(x, [D], weight)``: eps is float32's machine epsilon."""
    return F.rms_norm(x, [normalized_size], weight)


def litgpt_rmsnorm(x, weight, eps: float):
    """litgpt's ``RMSNorm.forward`` (``dim=-1``), as written there: the mean of ``x * x`` in float32,
    the weight multiplied in float32, one rounding at the end (``F.rms_norm``'s numbers: the kernels'
    RMS_TORCH). With ``add_unit_offset=True`` (its Gemma models) the weight it upcasts is ``1 +
    weight``, computed before in the weight's dtype: the pattern's ``weight`` is that sum."""
    dtype = x.dtype
    x = x.float()
    norm_x = torch.mean(x * x, dim=-1, keepdim=True)
    x_normed = x * torch.rsqrt(norm_x + eps)
    return (x_normed * weight.float()).to(dtype=dtype)


def olmo2_rmsnorm(hidden_states, weight, eps: float):
    """transformers' ``Olmo2RMSNorm.forward`` (also ``GptOssRMSNorm``), as written there: the weight
    multiplies the float32 row (type promotion upcasts it) and the product is rounded once. In float32
    it is Llama's form, which finds it first."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    return (weight * hidden_states).to(input_dtype)


def _check_row_length(op: str, x, normalized_size) -> None:
    """The check F.rms_norm makes, for a kernel that normalises over the last axis only."""
    if x.dim() == 0 or normalized_size != x.shape[-1]:
        raise KernelInputError(
            f"{NAMESPACE}::{op}: normalized_size={normalized_size} must be the last axis of x "
            f"{tuple(x.shape)}: the kernel normalises over the last axis only (F.rms_norm(x, [x.shape[-1]], ...))")


# Private ops of F.rms_norm's numbers, registered in register(): the register-resident kernel, the op that
# picks it or a two-read one by row length, and the add + norm kernel.
TORCH_ROWS = f"{NAMESPACE}::_torch_rms_norm_rows"
TORCH_NORM = f"{NAMESPACE}::_torch_rms_norm"
ADD_TORCH_ROWS = f"{NAMESPACE}::_add_torch_rms_norm_rows"


def _torch_rms_norm_on_cuda(x, weight, normalized_size, eps=FLOAT32_EPS):
    """The op on CUDA: F.rms_norm's check, then its kernels (register-resident or two-read, by row length).
    Already inside an op, it runs their launcher directly, not through the dispatcher; x contiguous, for
    aten.rms_norm's contiguous result."""
    _check_row_length("torch_rms_norm", x, normalized_size)
    return kernel_op(TORCH_NORM).cuda_impl(x.contiguous(), weight, eps)


def _add_torch_rms_norm_on_cuda(x, residual, weight, normalized_size, eps=FLOAT32_EPS):
    """The op on CUDA: F.rms_norm's check, then the add + RMSNorm kernel of F.rms_norm's numbers."""
    _check_row_length("add_torch_rms_norm", x, normalized_size)
    return kernel_op(ADD_TORCH_ROWS).cuda_impl(x, residual, weight, eps)



def add_llama_rmsnorm(x, residual, weight, eps: float):
    """A residual add and the next ``LlamaRMSNorm``, as every pre-norm decoder layer writes them
    (``hidden_states = residual + hidden_states; residual = hidden_states;
    hidden_states = self.post_attention_layernorm(hidden_states)``): the norm and the sum.

    The norm comes first: a match is found from a pattern's first output, and the sum is inside it."""
    h = x + residual
    return llama_rmsnorm(h, weight, eps), h


def add_t5_layer_norm(x, residual, weight, eps: float):
    """T5's residual add (``hidden_states + self.dropout(...)``, dropout gone in eval) and the next
    ``T5LayerNorm``."""
    h = x + residual
    return t5_layer_norm(h, weight, eps), h


def add_meta_rmsnorm(x, residual, weight, eps: float):
    """Meta's reference Llama's residual add (``h = x + self.attention(...)``) and the next norm."""
    h = x + residual
    return meta_rmsnorm(h, weight, eps), h


def add_litgpt_rmsnorm(x, residual, weight, eps: float):
    """litgpt's ``Block`` (sequential residual): ``x = attention_output + x``, then ``self.norm_2(x)``."""
    h = x + residual
    return litgpt_rmsnorm(h, weight, eps), h


def add_olmo2_rmsnorm(x, residual, weight, eps: float):
    """OLMo 2's and GPT-OSS's residual add and the next norm (GPT-OSS's pre-norm layers; OLMo 2 norms
    each sublayer's output before the add, so only its first layer's input norm follows an add)."""
    h = x + residual
    return olmo2_rmsnorm(h, weight, eps), h


def add_gemma_rmsnorm(x, residual, weight, eps: float):
    """Gemma's residual add and the next ``GemmaRMSNorm``."""
    h = x + residual
    return gemma_rmsnorm(h, weight, eps), h


def add_torch_rms_norm(x, residual, weight, normalized_size: int, eps: float):
    """A residual add and the next ``nn.RMSNorm`` (torchtitan's Llama: ``h = x + self.attention(...)``,
    then ``self.ffn_norm(h)``): the norm and the sum."""
    h = x + residual
    return F.rms_norm(h, [normalized_size], weight, eps), h


def add_torch_rms_norm_default_eps(x, residual, weight, normalized_size: int):
    """A residual add and the next ``nn.RMSNorm(D)`` (eps=None)."""
    h = x + residual
    return F.rms_norm(h, [normalized_size], weight), h


def _row_length(x: str, weight: str, size: str, same_shape: str | None = None):
    """A filter: ``weight`` is a row of ``x`` (and ``same_shape`` has ``x``'s shape) and the
    captured ``size`` is ``x``'s last axis."""
    row = row_param(x, weight, same_shape=same_shape)

    def accept(match) -> bool:
        val = match.bindings[x].meta.get("val") if row(match) else None
        return val is not None and statically_known_true(val.shape[-1] == match.bindings.get(size))

    accept.__name__ = f"{size}_is_the_last_axis_of_{x}"
    return accept


def register(rules) -> None:
    # An overlap goes to the rule added first. The residual forms come first: each plain pattern is
    # also inside them. Gemma's forms come before Llama's: Llama's pattern also matches inside
    # Gemma's (weight := 1 + weight, in float32).
    #
    # None of them runs inside inductor: there a norm sits between ops inductor fuses into its own
    # norm kernel (the residual add, the embedding gather, a GELU block's add), and at the demo
    # model's size inductor's fused kernels ran 15-17 us where the add+norm kernel ran 21 us
    # (benchmarks/demo_model.py --profile, docs/benchmarks.md). In eager, export and TensorRT they pay.
    irs = COMPILE_FREE_IRS
    add_rule(rules, add_gemma_rmsnorm, ADD_GEMMA_RMS_NORM, "add_gemma_rms_norm",
             filter=row_param("x", "weight", same_shape="residual"), irs=irs)
    add = add_rule(rules, add_llama_rmsnorm, ADD_RMS_NORM, "add_rms_norm",
                   filter=row_param("x", "weight", same_shape="residual"), irs=irs)
    add_rule(rules, add_t5_layer_norm, add.op, "add_t5_layer_norm", filter=row_param("x", "weight", same_shape="residual"),
             irs=irs)
    add_rule(rules, add_meta_rmsnorm, add.op, "add_meta_rms_norm", filter=row_param("x", "weight", same_shape="residual"),
             irs=irs)
    add_litgpt = cuda_kernel_op(f"{NAMESPACE}::add_litgpt_rms_norm", ADD_LITGPT_RMS_NORM, reference=add_litgpt_rmsnorm,
                                past_limits="split")
    add_rule(rules, add_litgpt_rmsnorm, add_litgpt, "add_litgpt_rms_norm",
             filter=row_param("x", "weight", same_shape="residual"), irs=irs)
    add_rule(rules, add_olmo2_rmsnorm, add_litgpt, "add_olmo2_rms_norm",
             filter=row_param("x", "weight", same_shape="residual"), irs=irs)
    # The plain norms run one of their kernels per call (two_read_tuning), each a private op; the public
    # op's spec is the register-resident kernel's, which TensorRT plugins carry.
    plain = {}
    for name, x, pattern, spec in (("gemma_rms_norm", "x", gemma_rmsnorm, GEMMA_RMS_NORM),
                                   ("rms_norm", "hidden_states", llama_rmsnorm, RMS_NORM)):
        rows = f"{NAMESPACE}::_{name}_rows"
        cuda_kernel_op(rows, spec, reference=pattern)
        # x laid out as eager's ops leave it, read in place (Gemma 3 norms the queries and keys of
        # attention's (B, H, S, D) view of the projection), the result in x's layout as eager's
        plain[name] = cuda_kernel_op(f"{NAMESPACE}::{name}", spec, reference=pattern,
                                     meta_fn=keeps_row_layout(kernel_op(rows).fake_impl),
                                     eager_fn=rows_in_place(pick_kernel(rows, two_read_ops(spec, pattern))),
                                     past_limits="split")
    # F.rms_norm's numbers for the torch forms' eager path: the same kernels in RMS_TORCH
    cuda_kernel_op(TORCH_ROWS, _spec("rms_norm_torch", "x"), reference=_rms_norm_torch)
    cuda_kernel_op(TORCH_NORM, _spec("rms_norm_torch", "x"), reference=_rms_norm_torch,
                   eager_fn=pick_kernel(TORCH_ROWS, two_read_ops(_spec("rms_norm_torch", "x"), _rms_norm_torch)))
    cuda_kernel_op(ADD_TORCH_ROWS, _add_spec("add_rms_norm_torch"), reference=_add_rms_norm_torch)
    add_rule(rules, gemma_rmsnorm, plain["gemma_rms_norm"], "gemma_rms_norm", filter=row_param("x", "weight"), irs=irs)
    llama = add_rule(rules, llama_rmsnorm, plain["rms_norm"], "rms_norm", filter=row_param("hidden_states", "weight"),
                     irs=irs)
    # T5's form computes Llama's numbers whenever weight and input share a dtype (the op's own
    # dtype check refuses the rest), so it is another way of finding the same op.
    add_rule(rules, t5_layer_norm, llama.op, "t5_layer_norm", filter=row_param("hidden_states", "weight"), irs=irs)
    add_rule(rules, meta_rmsnorm, llama.op, "meta_rms_norm", filter=row_param("x", "weight"), irs=irs)
    # litgpt's form: F.rms_norm's numbers (the torch forms' kernels, picked per call), laid out as x is,
    # as the plain norms above
    litgpt = cuda_kernel_op(f"{NAMESPACE}::litgpt_rms_norm", LITGPT_RMS_NORM, reference=litgpt_rmsnorm,
                            meta_fn=keeps_row_layout(kernel_op(TORCH_ROWS).fake_impl),
                            eager_fn=rows_in_place(kernel_op(TORCH_NORM).cuda_impl), past_limits="split")
    add_rule(rules, litgpt_rmsnorm, litgpt, "litgpt_rms_norm", filter=row_param("x", "weight"), irs=irs)
    add_rule(rules, olmo2_rmsnorm, litgpt, "olmo2_rms_norm", filter=row_param("hidden_states", "weight"), irs=irs)
    # torch.export keeps nn.RMSNorm one aten.rms_norm node; the other IRs decompose it into ops whose
    # reduction axis is a positive index (rank-dependent), so the rule runs in the export IR only. The
    # example inputs make the row length an int literal the pattern can capture.
    # The residual forms first, as above.
    x, r, w = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8)  # distinct tensors: one passed twice is one input
    forms = ((add_torch_rms_norm, ADD_TORCH_RMS_NORM, _add_torch_rms_norm_on_cuda, (x, r, w), "residual"),
             (add_torch_rms_norm_default_eps, ADD_TORCH_RMS_NORM_DEFAULT_EPS, _add_torch_rms_norm_on_cuda, (x, r, w),
              "residual"),
             (torch_rms_norm, TORCH_RMS_NORM, _torch_rms_norm_on_cuda, (x, w), None),
             (torch_rms_norm_default_eps, TORCH_RMS_NORM_DEFAULT_EPS, _torch_rms_norm_on_cuda, (x, w), None))
    for pattern, spec, eager_fn, tensors, residual in forms:
        name = pattern.__name__
        op = cuda_kernel_op(f"{NAMESPACE}::{name}", spec, reference=pattern, eager_fn=eager_fn, past_limits="split")
        example = (*tensors, 8, SENTINELS[float])[:len(spec.inputs)]
        add_rule(rules, pattern, op, name, filter=_row_length("x", "weight", "normalized_size", same_shape=residual),
                 example_inputs=example, irs=("export",))
