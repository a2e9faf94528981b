"""Gated linear units: SwiGLU ``silu(gate) * up`` and GEGLU, one pass instead of two (three once
core ATen splits silu).

Llama, Mistral, Qwen2 and most decoder MLPs write ``act_fn(gate_proj(x)) * up_proj(x)`` with
``act_fn = nn.SiLU()`` / ``F.silu`` (transformers' ``ACT2FN["silu"]``): ``swiglu``, where ``up`` may
broadcast onto ``gate`` along trailing axes. Gemma's MLP writes the same with the tanh GELU
(``ACT2FN["gelu_pytorch_tanh"]``): ``geglu_tanh``; with the erf GELU it is ``geglu``, with T5's
``gelu_new`` (T5 v1.1, Flan-T5) ``geglu_new``. The kernels keep the activation in float32 and
round the product once (eager PyTorch also rounds the activation).

Models with one fused projection split its output in half instead, ``a, b = x.chunk(2, dim=-1)``:

* ``swiglu_chunked`` — transformers' ``Phi3MLP``: ``gate, up = x.chunk(2, -1); up * silu(gate)``;
* ``swiglu_chunked_gate_last`` — diffusers' ``SwiGLU``: ``h, gate = x.chunk(2, -1); h * silu(gate)``;
* ``geglu_chunked`` — diffusers' ``GEGLU`` (Stable Diffusion's transformer blocks): the same with
  ``F.gelu(gate)`` (erf);
* ``geglu_chunked_gate_first`` — transformers' ``ModernBertMLP``: ``input, gate = Wi(h).chunk(2, -1);
  act(input) * gate`` with ``act`` the erf GELU (``hidden_activation="gelu"``): the GELU on the first
  half, as ``swiglu_chunked`` has its SiLU (the kernels call the activated half the gate; ModernBERT
  calls the other one so).

Their kernels read both halves of ``x``'s rows in place and write the half-width output. ``swiglu``
itself leaves strided views alone: making ``chunk``'s halves contiguous first would move more bytes
than eager PyTorch does. The chunked forms are matched in the export IR, where ``aten.chunk(x, 2,
-1)`` stays one node; the other IRs split at a size-dependent literal.

GPT-OSS's experts interleave the two instead (``GptOssExperts._apply_gate``): ``gate, up =
gate_up[..., ::2], gate_up[..., 1::2]``, each clamped to ``swiglu_limit`` (the gate from above), then
``(up + 1) * gate * sigmoid(gate * alpha)``: ``clamped_swiglu``, one kernel where eager runs seven
(the slices are views), reading each row's pairs in 16-byte packs. It is matched on the 2-D
``(tokens, 2 * intermediate)`` projection transformers' expert loops and grouped/batched matmuls
hand it (the slices' axis is a literal of the rank), in every IR but inductor's (a pointwise kernel there too).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxkern.library._rules import (
    COMPILE_FREE_IRS,
    DTYPES,
    NAMESPACE,
    _shape,
    add_rule,
    elementwise_geometry,
    is_contiguous,
    is_suffix_broadcast,
)
from fxkern.errors import KernelInputError
from fxkern.library.gelu import SOURCE as _GELU_SOURCE
from fxkern.library.gelu import gelu_new as _gelu_new
from fxkern.ops import cuda_kernel_op
from fxkern.spec import Custom, DimSize, InputDecl, KernelSpec, Numel, OutputDecl, SameAs, ScalarInput

# The elementwise engine (fxk::map) lives with the GELU kernels; SwiGLU adds its functor.
SOURCE = _GELU_SOURCE + r"""
namespace fxk {
enum { GLU_SILU = 0, GLU_GELU = 1, GLU_GELU_TANH = 2, GLU_GELU_NEW = 3 };

// act(gate) * up in float32, rounded once by the caller.
template <int ACT, bool FAST>
__device__ __forceinline__ float glu(float g, float u) {
    if (ACT == GLU_SILU) return g * rcp_sfu(1.0f + exp_sfu(-g)) * u;
    if (ACT == GLU_GELU_TANH) return gelu<GELU_TANH, FAST>(g) * u;
    if (ACT == GLU_GELU_NEW) return gelu<GELU_NEW, FAST>(g) * u;
    return gelu<GELU_ERF, FAST>(g) * u;
}

template <int ACT, bool FAST>
struct GluMul {
    __device__ __forceinline__ float operator()(float g, float u, float) const { return glu<ACT, FAST>(g, u); }
};
}  // namespace fxk

// y = act(gate) * up, up broadcast along gate's leading axes (nu elements).
#define FXK_GLU(NAME, ACT)                                                                             \
template <typename T>                                                                                  \
__global__ void __launch_bounds__(256) NAME(const T* gate, const T* up, int n, int nu, T* y) {         \
    fxk::map<T, 2>(gate, up, up, (unsigned)n, (unsigned)nu, 1u, y, fxk::GluMul<ACT, sizeof(T) == 2>()); \
}
FXK_GLU(swiglu, fxk::GLU_SILU)
FXK_GLU(geglu, fxk::GLU_GELU)
FXK_GLU(geglu_tanh, fxk::GLU_GELU_TANH)
FXK_GLU(geglu_new, fxk::GLU_GELU_NEW)

namespace fxk {
// y = act(gate) * other over rows of x split in half (x.chunk(2, -1)): x has rows of D2 elements,
// y rows of H = D2 / 2; gate is the first half (GATE_FIRST) or the second. Each thread takes PER
// elements of y, in 16-byte packs when the halves allow it (a pack then never crosses a row).
template <typename T, int ACT, bool GATE_FIRST>
__device__ __forceinline__ void glu_halves(const T* __restrict__ x, unsigned nx, unsigned D2, T* __restrict__ y) {
    constexpr int V = 16 / sizeof(T), PER = FXK_EW_PER, NV = PER / V;
    constexpr bool FAST = sizeof(T) == 2;
    if (D2 < 2) return;
    const unsigned H = D2 / 2, n = nx / D2 * H;
    const unsigned g_off = GATE_FIRST ? 0 : H, o_off = GATE_FIRST ? H : 0;
    const unsigned base = blockIdx.x * (blockDim.x * PER);
    if (H % V == 0 && aligned16(x) && aligned16(y)) {
        Pack<T, V> pg[NV], po[NV];
#pragma unroll
        for (int k = 0; k < NV; ++k) {
            const unsigned i = base + (k * blockDim.x + threadIdx.x) * V;
            if (i < n) {
                const unsigned r = i / H;
                const T* xr = x + (size_t)r * D2 + (i - r * H);
                pg[k] = load<T, V>(xr + g_off);
                po[k] = load<T, V>(xr + o_off);
            }
        }
#pragma unroll
        for (int k = 0; k < NV; ++k) {
            const unsigned i = base + (k * blockDim.x + threadIdx.x) * V;
            if (i < n) {
                Pack<T, V> o;
#pragma unroll
                for (int j = 0; j < V; ++j) o.v[j] = from_f<T>(glu<ACT, FAST>(to_f<T>(pg[k].v[j]), to_f<T>(po[k].v[j])));
                store<T, V>(y + i, o);
            }
        }
    } else {
#pragma unroll 4
        for (int k = 0; k < PER; ++k) {
            const unsigned i = base + k * blockDim.x + threadIdx.x;
            if (i < n) {
                const unsigned r = i / H;
                const T* xr = x + (size_t)r * D2 + (i - r * H);
                y[i] = from_f<T>(glu<ACT, FAST>(to_f<T>(xr[g_off]), to_f<T>(xr[o_off])));
            }
        }
    }
}
}  // namespace fxk

#define FXK_GLU_HALVES(NAME, ACT, GATE_FIRST)                                                        \
template <typename T>                                                                                \
__global__ void __launch_bounds__(256) NAME(const T* x, int nx, int D2, T* y) {                      \
    fxk::glu_halves<T, ACT, GATE_FIRST>(x, (unsigned)nx, (unsigned)D2, y);                           \
}
FXK_GLU_HALVES(swiglu_chunked, fxk::GLU_SILU, true)
FXK_GLU_HALVES(swiglu_chunked_gate_last, fxk::GLU_SILU, false)
FXK_GLU_HALVES(geglu_chunked, fxk::GLU_GELU, false)
FXK_GLU_HALVES(geglu_chunked_gate_first, fxk::GLU_GELU, true)

namespace fxk {
// GPT-OSS's expert gate in float32, rounded once: g = min(gate, gate_max), u = clamp(up, up_min,
// up_max), (u + 1) * g * sigmoid(alpha * g). The clamps compare rather than call fminf/fmaxf, so a NaN
// passes through as torch.clamp passes it; alpha_l2e is -alpha * log2(e), folded once.
struct ClampedGlu {
    float alpha_l2e, gate_max, up_min, up_max;
    __device__ __forceinline__ float operator()(float g, float u) const {
        g = g > gate_max ? gate_max : g;
        u = u < up_min ? up_min : u;
        u = u > up_max ? up_max : u;
        return (u + 1.0f) * (g * rcp_sfu(1.0f + exp2_sfu(alpha_l2e * g)));
    }
};

// y[j] = f(x[2j], x[2j + 1]) over n outputs: a row of 2I interleaved (gate, up) columns is I pairs, and
// no pair crosses a row, so the rows need no indexing. Each thread writes PER outputs, a 16-byte pack
// of them from two 16-byte packs of x, when both pointers are aligned; the ragged end and unaligned
// views take single pairs.
template <typename T, typename Fn>
__device__ __forceinline__ void glu_pairs(const T* __restrict__ x, unsigned n, T* __restrict__ y, Fn f) {
    constexpr int V = 16 / sizeof(T), PER = FXK_EW_PER, NV = PER / V;
    static_assert(PER % V == 0 && PER >= V, "FXK_EW_PER: whole 16-byte packs of outputs a thread");
    const auto pair = [&](size_t e) { return from_f<T>(f(to_f<T>(x[2 * e]), to_f<T>(x[2 * e + 1]))); };
    const unsigned base = blockIdx.x * (blockDim.x * PER);
    if (aligned16(x) && aligned16(y)) {
        Pack<T, V> lo[NV], hi[NV];
#pragma unroll
        for (int k = 0; k < NV; ++k) {
            const unsigned i = base + (k * blockDim.x + threadIdx.x) * V;
            if (i + V <= n) {
                lo[k] = load<T, V>(x + 2 * (size_t)i);
                hi[k] = load<T, V>(x + 2 * (size_t)i + V);
            }
        }
#pragma unroll
        for (int k = 0; k < NV; ++k) {
            const unsigned i = base + (k * blockDim.x + threadIdx.x) * V;
            if (i + V <= n) {
                float a[V], b[V], o[V];
                to_floats(lo[k], a);
                to_floats(hi[k], b);
#pragma unroll
                for (int j = 0; j < V / 2; ++j) {
                    o[j] = f(a[2 * j], a[2 * j + 1]);
                    o[V / 2 + j] = f(b[2 * j], b[2 * j + 1]);
                }
                store<T, V>(y + i, from_floats<T, V>(o));
            } else {
                for (unsigned e = i; e < n; ++e) y[e] = pair(e);
            }
        }
    } else {
#pragma unroll 4
        for (int k = 0; k < PER; ++k) {
            const unsigned e = base + k * blockDim.x + threadIdx.x;
            if (e < n) y[e] = pair(e);
        }
    }
}
}  // namespace fxk

template <typename T>
__global__ void FXK_EW_BOUNDS(T) clamped_swiglu(const T* x, float alpha, float gate_max, float up_min, float up_max,
                                                int nx, T* y) {
    fxk::glu_pairs<T>(x, (unsigned)nx / 2, y, fxk::ClampedGlu{alpha * -1.4426950408889634f, gate_max, up_min, up_max});
}
"""

SWIGLU = KernelSpec(
    SOURCE, "swiglu",
    inputs=[InputDecl("gate"), InputDecl("up", broadcast=True)],
    outputs=[OutputDecl("y", SameAs("gate"))],
    extras=[Numel("gate"), Numel("up")],
    geometry=Custom(elementwise_geometry),
    dtypes=DTYPES,
)


# GEGLU with separate projections: the same kernel with GELU as the activation.
GEGLU = dataclasses.replace(SWIGLU, kernel_name="geglu")
GEGLU_TANH = dataclasses.replace(SWIGLU, kernel_name="geglu_tanh")
GEGLU_NEW = dataclasses.replace(SWIGLU, kernel_name="geglu_new")


def swiglu(gate, up):
    """LlamaMLP's ``act_fn(gate_proj(x)) * up_proj(x)`` with ``act_fn`` SiLU."""
    return F.silu(gate) * up


def geglu_tanh(gate, up):
    """GemmaMLP's ``act_fn(gate_proj(x)) * up_proj(x)`` with ``act_fn`` transformers'
    ``gelu_pytorch_tanh`` (Gemma, Gemma 2 and 3): ``F.gelu(gate, approximate="tanh") * up``."""
    return F.gelu(gate, approximate="tanh") * up


def geglu(gate, up):
    """The same with the erf GELU (``ACT2FN["gelu"]``, ``nn.GELU()``): ``F.gelu(gate) * up``."""
    return F.gelu(gate) * up


def geglu_new(gate, up):
    """T5's gated MLP (``T5DenseGatedActDense``: T5 v1.1, Flan-T5, mT5, UMT5, LongT5), ``act(wi_0(h)) *
    wi_1(h)`` with ``act`` transformers' ``gelu_new`` written out (``NewGELUActivation``)."""
    return _gelu_new(gate) * up


def _contiguous_operands(match) -> bool:
    gate, up = match.bindings.get("gate"), match.bindings.get("up")
    g, u = _shape(gate), _shape(up)
    if g is None or u is None or not is_suffix_broadcast(u, g):
        return False
    return is_contiguous(gate) and is_contiguous(up)


def swiglu_chunked(x):
    """transformers' ``Phi3MLP``: the fused ``gate_up_proj`` output split, gate first."""
    gate, up = x.chunk(2, dim=-1)
    return up * F.silu(gate)


def swiglu_chunked_gate_last(x):
    """diffusers' ``SwiGLU``: the projection split, gate second."""
    hidden, gate = x.chunk(2, dim=-1)
    return hidden * F.silu(gate)


def geglu_chunked(x):
    """diffusers' ``GEGLU``: the projection split, gate second, erf GELU."""
    hidden, gate = x.chunk(2, dim=-1)
    return hidden * F.gelu(gate)


def geglu_chunked_gate_first(x):
    """transformers' ``ModernBertMLP``: the ``Wi`` projection split, the erf GELU on the first half
    (``input, gate = self.Wi(hidden_states).chunk(2, dim=-1)``, ``self.act(input) * gate``)."""
    hidden, gate = x.chunk(2, dim=-1)
    return F.gelu(hidden) * gate


def _halves_meta(x):
    """Rows of half the width; an odd last axis has no two equal halves to multiply."""
    d = x.shape[-1] if x.dim() else None
    if x.dim() == 0 or (isinstance(d, int) and d % 2):
        raise KernelInputError(f"a chunked GLU splits x's last axis in two equal halves; x has shape {tuple(x.shape)}: "
                               f"give it an even last axis")
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def _halves_spec(kernel: str) -> KernelSpec:
    return KernelSpec(SOURCE, kernel, inputs=[InputDecl("x")], extras=[Numel("x"), DimSize("x", -1)],
                      geometry=Custom(elementwise_geometry), dtypes=DTYPES)


SWIGLU_CHUNKED = _halves_spec("swiglu_chunked")
SWIGLU_CHUNKED_GATE_LAST = _halves_spec("swiglu_chunked_gate_last")
GEGLU_CHUNKED = _halves_spec("geglu_chunked")
GEGLU_CHUNKED_GATE_FIRST = _halves_spec("geglu_chunked_gate_first")


def clamped_swiglu(gate_up, alpha: float, gate_max: float, up_min: float, up_max: float):
    """transformers' ``GptOssExperts._apply_gate`` (GPT-OSS), as written there: the fused projection's
    columns interleave gate and up (``gate_up[..., ::2]``, ``gate_up[..., 1::2]``), each clamped
    (``swiglu_limit``: the gate from above, up both ways), the gate's SiLU taken with a slope
    (``swiglu_alpha``: ``gate * sigmoid(gate * alpha)``), and up shifted by one. Seven kernels in eager."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=gate_max)
    up = up.clamp(min=up_min, max=up_max)
    glu = gate * torch.sigmoid(gate * alpha)
    return (up + 1) * glu


def _pairs_meta(gate_up, alpha, gate_max, up_min, up_max):
    """Rows of half the width: one output a (gate, up) pair; an odd last axis has no pairs to split."""
    d = gate_up.shape[-1] if gate_up.dim() else None
    if gate_up.dim() == 0 or (isinstance(d, int) and d % 2):
        raise KernelInputError(f"{NAMESPACE}::clamped_swiglu reads (gate, up) column pairs of gate_up's last axis; "
                               f"gate_up has shape {tuple(gate_up.shape)}: give it an even last axis")
    return gate_up.new_empty((*gate_up.shape[:-1], d // 2))


CLAMPED_SWIGLU = KernelSpec(
    SOURCE, "clamped_swiglu",
    inputs=[InputDecl("gate_up"), *(ScalarInput(name, float) for name in ("alpha", "gate_max", "up_min", "up_max"))],
    extras=[Numel("gate_up")], geometry=Custom(elementwise_geometry), dtypes=DTYPES)


def _even_contiguous(name: str):
    """A filter: the tensor bound to ``name`` is contiguous, its last axis even."""
    def accept(match) -> bool:
        x = match.bindings.get(name)
        shape = _shape(x)
        return bool(shape) and statically_known_true(shape[-1] % 2 == 0) and is_contiguous(x)
    return accept


def register(rules) -> None:
    # Not inside inductor: there its own silu * mul kernel ran 2% faster than this one in the demo
    # model (the matmul outputs it reads are still in L2), which left the compiled model 0.98-1.01x
    # of plain inductor (benchmarks/demo_model.py --profile). In eager, export and TensorRT it pays.
    for pattern, spec in ((swiglu, SWIGLU), (geglu_tanh, GEGLU_TANH), (geglu, GEGLU)):
        add_rule(rules, pattern, spec, pattern.__name__, filter=_contiguous_operands, irs=COMPILE_FREE_IRS)
    # Ahead of the gelu module's plain gelu_new rule, added earlier, which would take the activation
    # and leave the product to a second pass.
    add_rule(rules, geglu_new, GEGLU_NEW, "geglu_new", filter=_contiguous_operands, irs=COMPILE_FREE_IRS,
             priority=-1)
    for pattern, spec in ((swiglu_chunked, SWIGLU_CHUNKED), (swiglu_chunked_gate_last, SWIGLU_CHUNKED_GATE_LAST),
                          (geglu_chunked, GEGLU_CHUNKED), (geglu_chunked_gate_first, GEGLU_CHUNKED_GATE_FIRST)):
        name = pattern.__name__
        op = cuda_kernel_op(f"{NAMESPACE}::{name}", spec, meta_fn=_halves_meta, schema="(Tensor x) -> Tensor",
                            reference=pattern, past_limits="split")
        add_rule(rules, pattern, op, name, filter=_even_contiguous("x"), irs=("export",))
    # GPT-OSS's gate, ahead of the gelu module's quick_gelu rule (added earlier), which would take its
    # ``gate * sigmoid(gate * 1.702)`` and leave the clamps, the shift and the product to four more kernels.
    op = cuda_kernel_op(f"{NAMESPACE}::clamped_swiglu", CLAMPED_SWIGLU, meta_fn=_pairs_meta, reference=clamped_swiglu,
                        schema="(Tensor gate_up, float alpha, float gate_max, float up_min, float up_max) -> Tensor",
                        past_limits="split")
    add_rule(rules, clamped_swiglu, op, "clamped_swiglu", filter=_even_contiguous("gate_up"), irs=COMPILE_FREE_IRS,
             priority=-1)
