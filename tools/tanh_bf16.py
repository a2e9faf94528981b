"""How far bfloat16 tanh through the SFU is from eager's, over every bfloat16 value (device only):

    python tools/tanh_bf16.py

Eager's ``torch.tanh`` on a bfloat16 CUDA tensor computes tanhf in float32 and rounds once. The
soft-capped softmax (fxkern.library.softmax) takes tanh.approx.f32 rounded to bfloat16 instead;
tanh.approx.bf16x2 would read and write bfloat16 directly (MUFU.TANH.BF16, no conversions). Prints,
for each, how many of the finite inputs differ from eager and by how many bfloat16 ulps at most.
"""

from __future__ import annotations

import torch

import fxkern
from fxkern import Elementwise, InputDecl, KernelSpec, Numel, OutputDecl, SameAs

SOURCE = r"""
#include <cuda_bf16.h>
extern "C" __global__ void tanh_two_ways(const __nv_bfloat16* x, int n, __nv_bfloat16* pair, __nv_bfloat16* f32) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned v = *reinterpret_cast<const unsigned short*>(x + i), r;
    asm("tanh.approx.bf16x2 %0, %1;" : "=r"(r) : "r"(v));
    *reinterpret_cast<unsigned short*>(pair + i) = (unsigned short)(r & 0xffffu);
    float t;
    asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(__bfloat162float(x[i])));
    f32[i] = __float2bfloat16_rn(t);
}
"""

SPEC = KernelSpec(SOURCE, "tanh_two_ways", inputs=[InputDecl("x", dtype=torch.bfloat16)],
                  outputs=[OutputDecl("pair", SameAs("x")), OutputDecl("f32", SameAs("x"))],
                  extras=[Numel("x")], geometry=Elementwise())


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in bfloat16 steps (both finite, same sign or zero: their bit patterns' distance)."""
    def key(t):
        bits = t.view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)
    return (key(a) - key(b)).abs()


def main() -> None:
    op = fxkern.cuda_kernel_op("fxkern_tools::tanh_two_ways", SPEC)
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).cuda()
    finite = torch.isfinite(x)
    pair, f32 = op(x)
    want = torch.tanh(x)
    exact = torch.tanh(x.double()).to(torch.bfloat16)
    print(f"{int(finite.sum())} finite bfloat16 inputs; eager vs correctly rounded: "
          f"{int((want != exact)[finite].sum())} differ")
    for name, got in (("tanh.approx.bf16x2", pair), ("tanh.approx.f32, rounded", f32)):
        d = ulps(got, want)[finite]
        print(f"{name}: {int((d > 0).sum())} differ from eager, at most {int(d.max())} ulp "
              f"({int((d > 1).sum())} by more than one)")


if __name__ == "__main__":
    main()
