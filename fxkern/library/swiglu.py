"""SwiGLU ``silu(gate) * up``: one pass instead of two (three once core ATen splits silu).

Llama, Mistral, Qwen2 and most decoder MLPs write ``act_fn(gate_proj(x)) * up_proj(x)`` with
``act_fn = nn.SiLU()`` / ``F.silu`` (transformers' ``ACT2FN["silu"]``). The kernel keeps
``silu(gate)`` in float32 and rounds the product once (eager PyTorch also rounds ``silu(gate)``).
``up`` may broadcast onto ``gate`` along trailing axes.

Inputs that are strided views (``gate, up = x.chunk(2, -1)``) are left alone: making them
contiguous first would move more bytes than eager PyTorch does.
"""

from __future__ import annotations

import torch.nn.functional as F

from fxkern.library._rules import (
    COMPILE_FREE_IRS,
    DTYPES,
    _shape,
    add_rule,
    elementwise_geometry,
    is_contiguous,
    is_suffix_broadcast,
)
from fxkern.library.gelu import SOURCE as _GELU_SOURCE
from fxkern.spec import Custom, InputDecl, KernelSpec, Numel, OutputDecl, SameAs

# The elementwise engine (fxk::map) lives with the GELU kernels; SwiGLU adds its functor.
SOURCE = _GELU_SOURCE + r"""
namespace fxk {
struct SiluMul {
    __device__ __forceinline__ float operator()(float g, float u, float) const {
        return __fdividef(g, 1.0f + __expf(-g)) * u;   // silu(gate) * up, rounded once by the caller
    }
};
}  // namespace fxk

template <typename T>
__global__ void __launch_bounds__(256) swiglu(const T* gate, const T* up, int n, int nu, T* y) {
    fxk::map<T, 2>(gate, up, up, (unsigned)n, (unsigned)nu, 1u, y, fxk::SiluMul());
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


def swiglu(gate, up):
    """LlamaMLP's ``act_fn(gate_proj(x)) * up_proj(x)`` with ``act_fn`` SiLU."""
    return F.silu(gate) * up


def _contiguous_operands(match) -> bool:
    gate, up = match.bindings.get("gate"), match.bindings.get("up")
    g, u = _shape(gate), _shape(up)
    if g is None or u is None or not is_suffix_broadcast(u, g):
        return False
    return is_contiguous(gate) and is_contiguous(up)


def register(rules) -> None:
    # Not inside inductor: there its own silu * mul kernel ran 2% faster than this one in the demo
    # model (the matmul outputs it reads are still in L2), which left the compiled model 0.98-1.01x
    # of plain inductor (benchmarks/demo_model.py --profile). In eager, export and TensorRT it pays.
    add_rule(rules, swiglu, SWIGLU, "swiglu", filter=_contiguous_operands, irs=COMPILE_FREE_IRS)
