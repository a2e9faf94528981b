"""Bias + GELU (+ residual): one pass over memory instead of two or three (eight when GELU is written out).

GELU comes in the forms libraries write it:

* ``erf`` — ``F.gelu(x)``, ``nn.GELU()``, transformers' ``GELUActivation`` (BERT), timm's ``GELU``;
* ``tanh`` — ``F.gelu(x, approximate="tanh")``, ``nn.GELU("tanh")``, transformers' ``GELUTanh``
  (``gelu_pytorch_tanh``), timm's ``GELUTanh``;
* ``new`` — transformers' ``NewGELUActivation`` (``gelu_new``: GPT-2, GPT-J, CodeGen...) written
  out in eight ops, also matched without a bias (GPT-2's ``Conv1D`` puts its bias inside ``addmm``);
* ``megatron`` — Megatron-LM's (and NeMo's) ``bias_gelu``, the classic fused bias + tanh-GELU, and
  the same without a bias: BLOOM's ``bloom_gelu_forward`` (its bias is inside the ``nn.Linear`` before it);
* ``quick`` — transformers' ``QuickGELUActivation`` (``quick_gelu``: ``x * torch.sigmoid(1.702 * x)``,
  OpenAI's CLIP and the models built on its towers: CLIP, OWL-ViT, X-CLIP, GIT, Qwen2-VL's vision
  encoder...), whose bias is inside the ``nn.Linear`` before it: the plain form only.

The tanh forms are evaluated as ``x / (1 + exp(-2u))`` (the same function as
``0.5 * x * (1 + tanh(u))``, cheaper and without its cancellation); erf GELU uses ``erff`` in float32
and a branch-free Abramowitz & Stegun erf (error under 1.5e-7) in float16/bfloat16.
Each kernel computes in float32 and rounds once, like inductor's code for the same pattern: in
float16/bfloat16 it is closer to exact than eager PyTorch, which rounds after every op (most of
all for the written-out forms). ``bias`` and ``residual`` may broadcast onto ``x`` along trailing
axes (a ``(D,)`` bias onto ``(..., D)``); the rules check that.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fxkern.library._rules import (
    COMPILE_FREE_IRS,
    DTYPES,
    add_rule,
    elementwise_geometry,
    suffix_broadcast,
)
from fxkern.library.cuda_common import COMMON, ELEMS_PER_THREAD, EW_BLOCK
from fxkern.spec import Custom, InputDecl, KernelSpec, Numel, OutputDecl, SameAs

# Elements and threads a block (the kernel's tile and the launch geometry must agree), and blocks
# resident per SM (launch bounds) per element size: float32's 12 of 128 threads leave erff 40 registers.
SOURCE = COMMON + "".join(f"#ifndef {k}\n#define {k} {v}\n#endif\n" for k, v in (
    ("FXK_EW_PER", ELEMS_PER_THREAD), ("FXK_EW_THREADS", EW_BLOCK), ("FXK_EW_BLOCKS_F32", 12),
    ("FXK_EW_BLOCKS_HALF", 16))) + r"""
namespace fxk {

enum { GELU_ERF = 0, GELU_TANH = 1, GELU_NEW = 2, GELU_MEGATRON = 3, GELU_QUICK = 4 };

// 0.5 * x * (1 + tanh(u)) == x * sigmoid(2u) == x / (1 + exp(-2u)), exactly. Evaluated that way it
// costs one exp2 and one reciprocal (MUFU) instead of tanhf's polynomial and branches, and has no
// cancellation where tanh(u) nears -1 (relative error about 1e-6 in float32 for any x; infinities
// and NaN come out as PyTorch's: gelu(-inf) = NaN there too, since 0.5 * -inf * 0 is NaN). The
// caller passes v = -2u * log2(e), its own constant factor of u folded into that one (a multiply
// fewer or two: float arithmetic is not associative, so the compiler cannot fold them itself).
__device__ __forceinline__ float x_sigmoid2(float x, float v) {
    return x * rcp_sfu(1.0f + exp2_sfu(v));
}
constexpr float NEG_2_LOG2E = -2.0f * 1.4426950408889634f;

// x * Phi(x) = x * 0.5 * (1 + erf(x / sqrt(2))) with Abramowitz & Stegun 7.1.26 for erf (absolute
// error under 1.5e-7 everywhere, so at most 0.5 * |x| * 1.5e-7 in the result): one exp2 and one
// reciprocal, no branches. Used for float16/bfloat16, whose rounding is 4 to 5 orders coarser;
// float32 keeps erff.
__device__ __forceinline__ float gelu_erf_fast(float x) {
    // z = |x| / sqrt(2) enters as its constant, folded: t = 1 / (1 + p z), e^(-z^2) = 2^(x * x * -log2(e) / 2)
    const float t = rcp_sfu(fmaf(0.3275911f * 0.70710678118654752f, fabsf(x), 1.0f));
    const float poly = t * fmaf(t, fmaf(t, fmaf(t, fmaf(t, 1.061405429f, -1.453152027f), 1.421413741f),
                                        -0.284496736f), 0.254829592f);
    const float tail = 0.5f * poly * exp2_sfu(x * (x * (-0.5f * 1.4426950408889634f)));  // Phi(-|x|) = erfc(|x| / sqrt(2)) / 2
    return x * (x < 0.0f ? tail : 1.0f - tail);
}

// GELU in float32 (the caller rounds the result once). FAST: float16/bfloat16 (see gelu_erf_fast);
// the tanh forms use x_sigmoid2 in every dtype, with each form's own constants and op order inside tanh.
template <int ACT, bool FAST>
__device__ __forceinline__ float gelu(float x) {
    if (ACT == GELU_ERF) {  // aten.gelu: x * 0.5 * (1 + erf(x / sqrt(2)))
        if (FAST) return gelu_erf_fast(x);
        return x * 0.5f * (1.0f + erff(x * 0.70710678118654752f));
    } else if (ACT == GELU_TANH) {  // aten.gelu(approximate="tanh"): 0.5 * x * (1 + tanh(inner))
        return x_sigmoid2(x, (0.7978845608028654f * NEG_2_LOG2E) * (x + 0.044715f * (x * x * x)));
    } else if (ACT == GELU_NEW) {  // 0.5 * x * (1.0 + tanh(sqrt(2/pi) * (x + 0.044715 * pow(x, 3.0))))
        return x_sigmoid2(x, (0.7978845608028654f * NEG_2_LOG2E) * (x + 0.044715f * (x * x * x)));
    } else if (ACT == GELU_MEGATRON) {  // x * 0.5 * (1.0 + tanh(0.79788456 * x * (1 + 0.044715 * x * x)))
        return x_sigmoid2(x, ((0.79788456f * NEG_2_LOG2E) * x) * (1.0f + (0.044715f * x) * x));
    } else {  // x * sigmoid(1.702 * x) = x / (1 + exp(-1.702 x)): x_sigmoid2 at u = 0.851 x
        return x_sigmoid2(x, (1.702f * -1.4426950408889634f) * x);
    }
}

// Where a broadcast operand's element i is: itself when it is as large as a (m == n), else
// i % m, a mask when m is a power of two (P2): the division is 14 instructions a pack, 8% of a
// 16-bit bias + erf GELU's.
template <bool P2>
__device__ __forceinline__ unsigned wrap(unsigned i, unsigned m, bool full) {
    return full ? i : P2 ? (i & (m - 1)) : i % m;
}

// The 16-byte path of map (below): every pointer aligned, every broadcast length a multiple of V.
template <typename T, int NIN, bool P2, typename Fn>
__device__ __forceinline__ void map_packs(const T* __restrict__ a, const T* __restrict__ b, const T* __restrict__ c,
                                          unsigned n, unsigned nb, unsigned nc, T* __restrict__ y, Fn f) {
    constexpr int V = 16 / sizeof(T);
    constexpr int PER = FXK_EW_PER;             // elements a thread
    constexpr int NVT = PER / V;                // 16-byte packs a thread, per tensor
    constexpr int NV = NVT < 4 ? NVT : 4;       // packs in flight at once, per tensor
    const unsigned base = blockIdx.x * (blockDim.x * PER);
    const bool full_b = nb == n, full_c = nc == n;
#pragma unroll
    for (int it = 0; it < NVT / NV; ++it) {
        Pack<T, V> pa[NV], pb[NV], pc[NV];
#pragma unroll
        for (int k = 0; k < NV; ++k) {
            const unsigned i = base + ((it * NV + k) * blockDim.x + threadIdx.x) * V;
            if (i + V <= n) {
                pa[k] = load<T, V>(a + i);
                if (NIN >= 2) pb[k] = load<T, V>(b + wrap<P2>(i, nb, full_b));
                if (NIN >= 3) pc[k] = load<T, V>(c + wrap<P2>(i, nc, full_c));
            }
        }
#pragma unroll
        for (int k = 0; k < NV; ++k) {
            const unsigned i = base + ((it * NV + k) * blockDim.x + threadIdx.x) * V;
            if (i + V <= n) {  // 16-bit values widened and rounded in pairs (to_floats, from_floats)
                float fa[V], fb[V], fc[V];
                to_floats(pa[k], fa);
                if (NIN >= 2) to_floats(pb[k], fb);
                if (NIN >= 3) to_floats(pc[k], fc);
#pragma unroll
                for (int j = 0; j < V; ++j) fa[j] = f(fa[j], NIN >= 2 ? fb[j] : 0.0f, NIN >= 3 ? fc[j] : 0.0f);
                store<T, V>(y + i, from_floats<T, V>(fa));
            } else {
                // The ragged end, when n % V != 0: under V elements a call, so a plain modulo. wrap's
                // mask here held registers the whole kernel pays for: the float32 residual kernels
                // spilled 16-40 bytes and bias + GELU(tanh) + residual ran 1.5% slower.
                for (unsigned e = i; e < n; ++e) {
                    const float bv = NIN >= 2 ? to_f<T>(b[e % nb]) : 0.0f;
                    const float cv = NIN >= 3 ? to_f<T>(c[e % nc]) : 0.0f;
                    y[e] = from_f<T>(f(to_f<T>(a[e]), bv, cv));
                }
            }
        }
    }
}

// y = f(a, b, c) over n elements; b and c (when NIN says they exist) broadcast onto a by
// suffix: element i reads b[i % nb]. Each thread handles PER elements, a warp's accesses are
// consecutive 16-byte packs when the pointers and lengths allow, else single elements.
template <typename T, int NIN, typename Fn>
__device__ __forceinline__ void map(const T* __restrict__ a, const T* __restrict__ b, const T* __restrict__ c,
                                    unsigned n, unsigned nb, unsigned nc, T* __restrict__ y, Fn f) {
    constexpr int V = 16 / sizeof(T);
    constexpr int PER = FXK_EW_PER;
    if ((NIN >= 2 && nb == 0) || (NIN >= 3 && nc == 0)) return;
    const bool full_b = nb == n, full_c = nc == n;
    bool vec = aligned16(a) && aligned16(y);
    if (NIN >= 2) vec = vec && aligned16(b) && nb % V == 0;
    if (NIN >= 3) vec = vec && aligned16(c) && nc % V == 0;
    if (vec) {
        const bool p2 = (NIN < 2 || full_b || (nb & (nb - 1)) == 0) && (NIN < 3 || full_c || (nc & (nc - 1)) == 0);
        if (p2)
            map_packs<T, NIN, true>(a, b, c, n, nb, nc, y, f);
        else
            map_packs<T, NIN, false>(a, b, c, n, nb, nc, y, f);
    } else {
        const unsigned base = blockIdx.x * (blockDim.x * PER);
#pragma unroll 4
        for (int k = 0; k < PER; ++k) {
            const unsigned e = base + k * blockDim.x + threadIdx.x;
            if (e < n) {
                const float bv = NIN >= 2 ? to_f<T>(b[wrap<false>(e, nb, full_b)]) : 0.0f;
                const float cv = NIN >= 3 ? to_f<T>(c[wrap<false>(e, nc, full_c)]) : 0.0f;
                y[e] = from_f<T>(f(to_f<T>(a[e]), bv, cv));
            }
        }
    }
}

template <int ACT, bool FAST> struct Act {
    __device__ __forceinline__ float operator()(float x, float, float) const { return gelu<ACT, FAST>(x); }
};
template <int ACT, bool FAST> struct BiasAct {
    __device__ __forceinline__ float operator()(float x, float b, float) const { return gelu<ACT, FAST>(x + b); }
};
template <int ACT, bool FAST> struct BiasActRes {
    // the residual added apart (__fadd_rn), as eager adds it to the rounded GELU: contracted into the
    // GELU's last product, float32 results were a unit in the last place off in a fifth of elements
    __device__ __forceinline__ float operator()(float x, float b, float r) const { return __fadd_rn(gelu<ACT, FAST>(x + b), r); }
};

}  // namespace fxk

#define FXK_EW_BOUNDS(T) __launch_bounds__(FXK_EW_THREADS, sizeof(T) == 4 ? FXK_EW_BLOCKS_F32 : FXK_EW_BLOCKS_HALF)
#define FXK_GELU(NAME, ACT)                                                                              \
template <typename T>                                                                                    \
__global__ void FXK_EW_BOUNDS(T) NAME(const T* x, int n, T* y) {                                   \
    fxk::map<T, 1>(x, x, x, (unsigned)n, 1u, 1u, y, fxk::Act<ACT, sizeof(T) == 2>());                                 \
}
#define FXK_BIAS_GELU(NAME, ACT)                                                                         \
template <typename T>                                                                                    \
__global__ void FXK_EW_BOUNDS(T) NAME(const T* x, const T* bias, int n, int nb, T* y) {            \
    fxk::map<T, 2>(x, bias, bias, (unsigned)n, (unsigned)nb, 1u, y, fxk::BiasAct<ACT, sizeof(T) == 2>());             \
}
#define FXK_BIAS_GELU_RES(NAME, ACT)                                                                     \
template <typename T>                                                                                    \
__global__ void FXK_EW_BOUNDS(T) NAME(const T* x, const T* bias, const T* residual,                \
                                            int n, int nb, int nr, T* y) {                               \
    fxk::map<T, 3>(x, bias, residual, (unsigned)n, (unsigned)nb, (unsigned)nr, y,                        \
                   fxk::BiasActRes<ACT, sizeof(T) == 2>());                                                           \
}

FXK_BIAS_GELU(bias_gelu, fxk::GELU_ERF)
FXK_BIAS_GELU_RES(bias_gelu_residual, fxk::GELU_ERF)
FXK_BIAS_GELU(bias_gelu_tanh, fxk::GELU_TANH)
FXK_BIAS_GELU_RES(bias_gelu_tanh_residual, fxk::GELU_TANH)
FXK_GELU(gelu_new, fxk::GELU_NEW)
FXK_BIAS_GELU(bias_gelu_new, fxk::GELU_NEW)
FXK_BIAS_GELU_RES(bias_gelu_new_residual, fxk::GELU_NEW)
FXK_BIAS_GELU(megatron_bias_gelu, fxk::GELU_MEGATRON)
FXK_GELU(megatron_gelu, fxk::GELU_MEGATRON)
FXK_GELU(quick_gelu, fxk::GELU_QUICK)
"""


def _spec(kernel: str, inputs) -> KernelSpec:
    return KernelSpec(
        SOURCE, kernel,
        inputs=[InputDecl(name, broadcast=name != "x") for name in inputs],
        outputs=[OutputDecl("y", SameAs("x"))],
        extras=[Numel(name) for name in inputs],
        geometry=Custom(elementwise_geometry),
        dtypes=DTYPES,
    )


BIAS_GELU = _spec("bias_gelu", ("x", "bias"))
BIAS_GELU_RESIDUAL = _spec("bias_gelu_residual", ("x", "bias", "residual"))
BIAS_GELU_TANH = _spec("bias_gelu_tanh", ("x", "bias"))
BIAS_GELU_TANH_RESIDUAL = _spec("bias_gelu_tanh_residual", ("x", "bias", "residual"))
GELU_NEW = _spec("gelu_new", ("x",))
BIAS_GELU_NEW = _spec("bias_gelu_new", ("x", "bias"))
BIAS_GELU_NEW_RESIDUAL = _spec("bias_gelu_new_residual", ("x", "bias", "residual"))
MEGATRON_BIAS_GELU = _spec("megatron_bias_gelu", ("x", "bias"))
MEGATRON_GELU = _spec("megatron_gelu", ("x",))
QUICK_GELU = _spec("quick_gelu", ("x",))

# ---- patterns: each is also its op's reference ----------------------------------------------------


def bias_gelu(x, bias):
    """``F.gelu(x + bias)``: erf GELU (``nn.GELU()``, ``GELUActivation``) after a bias."""
    return F.gelu(x + bias)


def bias_gelu_residual(x, bias, residual):
    return F.gelu(x + bias) + residual


def bias_gelu_tanh(x, bias):
    """``F.gelu(x + bias, approximate="tanh")`` (``nn.GELU("tanh")``, ``GELUTanh``)."""
    return F.gelu(x + bias, approximate="tanh")


def bias_gelu_tanh_residual(x, bias, residual):
    return F.gelu(x + bias, approximate="tanh") + residual


def gelu_new(x):
    """transformers' ``NewGELUActivation.forward``, as written there."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def bias_gelu_new(x, bias):
    return gelu_new(x + bias)


def bias_gelu_new_residual(x, bias, residual):
    return gelu_new(x + bias) + residual


def megatron_bias_gelu(x, bias):
    """Megatron-LM's ``bias_gelu(bias, y)``, as written there."""
    h = bias + x
    return h * 0.5 * (1.0 + torch.tanh(0.79788456 * h * (1 + 0.044715 * h * h)))


def megatron_gelu(x):
    """Megatron's GELU without the bias: transformers' ``bloom_gelu_forward`` (BLOOM, BLOOMZ), as
    written there, nine kernels in eager."""
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


def quick_gelu(x):
    """transformers' ``QuickGELUActivation.forward``, as written there (CLIP's ``quick_gelu``)."""
    return x * torch.sigmoid(1.702 * x)


# Larger patterns first: an overlap goes to the rule added first (a residual form contains a bias
# form, which contains the plain one).
RULES = (
    (bias_gelu_residual, BIAS_GELU_RESIDUAL, ("bias", "residual")),
    (bias_gelu_tanh_residual, BIAS_GELU_TANH_RESIDUAL, ("bias", "residual")),
    (bias_gelu_new_residual, BIAS_GELU_NEW_RESIDUAL, ("bias", "residual")),
    (bias_gelu, BIAS_GELU, ("bias",)),
    (bias_gelu_tanh, BIAS_GELU_TANH, ("bias",)),
    (bias_gelu_new, BIAS_GELU_NEW, ("bias",)),
    (megatron_bias_gelu, MEGATRON_BIAS_GELU, ("bias",)),
    (gelu_new, GELU_NEW, ()),
    (megatron_gelu, MEGATRON_GELU, ()),
    (quick_gelu, QUICK_GELU, ()),
)


def register(rules) -> None:
    # None of them runs inside inductor. In a transformer the GELU's output (plus the residual)
    # feeds the next norm, and inductor fuses the whole bias + GELU + add into that norm's kernel:
    # a separate GELU kernel adds a write and a read of the activations (the demo model lost 1%
    # with them, benchmarks/demo_model.py --profile). The forms without a residual would then
    # match inside the residual ones, with the same loss. In eager, export and TensorRT they pay.
    for pattern, spec, broadcast in RULES:
        add_rule(rules, pattern, spec, pattern.__name__, filter=suffix_broadcast("x", *broadcast) if broadcast else None,
                 irs=COMPILE_FREE_IRS)
