"""The seven cases of the torch_tensorrt.kernels walkthrough, as fxkern ops.

Each case is a KernelSpec (or spec plus overrides), its PyTorch reference
and a way to make inputs. ``python examples/seven_cases.py`` registers them,
runs each in eager and after ``torch.export`` (with a dynamic batch size)
and compares with the reference: on a GPU through the CUDA kernel, on a
machine without one through the reference (CPU) implementation.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Callable, Tuple

import torch

import fxkern
from fxkern import (
    Custom, DimSize, Elementwise, InputDecl, KernelSpec, Numel, OutputDecl, ReduceDims,
    Reduction, SameAs, ScalarInput, cdiv,
)

NS = "fxkern_examples"
FLOATS = (torch.float32, torch.float16, torch.bfloat16)

SIGMOID = r"""
template <typename T>
__global__ void sigmoid_kernel(const T* __restrict__ x, int n, T* __restrict__ y) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;  // 64-bit: no wrap near 2^31
    if (i < n) {
        float v = static_cast<float>(x[i]);
        y[i] = static_cast<T>(1.0f / (1.0f + expf(-v)));
    }
}
"""

ADD = r"""
template <typename T>
__global__ void add_kernel(const T* __restrict__ a, const T* __restrict__ b, int n, T* __restrict__ out) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;  // 64-bit: no wrap near 2^31
    if (i < n) out[i] = static_cast<T>(static_cast<float>(a[i]) + static_cast<float>(b[i]));
}
"""

SCALE = r"""
extern "C" __global__ void scale_kernel(const float* __restrict__ x, float alpha, int n, float* __restrict__ y) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;  // 64-bit: no wrap near 2^31
    if (i < n) y[i] = x[i] * alpha;
}
"""

RELU_2D = r"""
extern "C" __global__ void relu_2d(const float* __restrict__ x, int rows, int cols, float* __restrict__ y) {
    long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long r = (long long)blockIdx.y * blockDim.y + threadIdx.y;
    if (r < rows && c < cols) {
        long long i = ((long long)blockIdx.z * rows + r) * cols + c;
        y[i] = fmaxf(x[i], 0.0f);
    }
}
"""

ROW_SUM = r"""
template <typename T>
__global__ void row_sum(const T* __restrict__ x, int cols, T* __restrict__ y) {
    __shared__ float partial[32];
    const T* row = x + (long long)blockIdx.x * cols;
    float acc = 0.0f;
    for (long long c = threadIdx.x; c < cols; c += blockDim.x) acc += static_cast<float>(row[c]);
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) partial[warp] = acc;
    __syncthreads();
    if (warp == 0) {
        acc = lane < (int)((blockDim.x + 31) / 32) ? partial[lane] : 0.0f;
        for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
        if (lane == 0) y[blockIdx.x] = static_cast<T>(acc);
    }
}
"""

REPEAT2 = r"""
extern "C" __global__ void repeat2(const float* __restrict__ x, int n, float* __restrict__ y) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;  // 64-bit: no wrap near 2^31
    if (i < 2LL * n) y[i] = x[i % n];
}
"""

SIN_COS = r"""
extern "C" __global__ void sin_cos(const float* __restrict__ x, int n, float* __restrict__ s, float* __restrict__ c) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;  // 64-bit: no wrap near 2^31
    if (i < n) sincosf(x[i], &s[i], &c[i]);
}
"""


def sigmoid_ref(x):
    return torch.sigmoid(x)


def add_ref(a, b):
    return a + b


def scale_ref(x, alpha: float):
    return x * alpha


def relu_ref(x):
    return torch.relu(x)


def row_sum_ref(x):
    return x.sum(-1)


def repeat2_ref(x):
    return torch.cat([x, x], dim=0)


def sin_cos_ref(x):
    return torch.sin(x), torch.cos(x)


def repeat2_meta(x):
    return x.new_empty((2 * x.shape[0], *x.shape[1:]))


@dataclass
class Case:
    """One example: how to register it, make inputs for it, and what it computes."""

    name: str
    register: Callable[[], object]
    make_inputs: Callable[[Tuple[int, ...], torch.dtype, str], tuple]
    reference: Callable
    dtypes: Tuple[torch.dtype, ...] = (torch.float32,)
    shape: Tuple[int, ...] = (37, 1000)


def _randn(shape, dtype, device):
    return (torch.randn(shape, dtype=dtype, device=device),)


CASES = [
    Case(
        "sigmoid",
        lambda: fxkern.cuda_kernel_op(
            f"{NS}::sigmoid",
            KernelSpec(SIGMOID, "sigmoid_kernel", inputs=[InputDecl("x")], outputs=[OutputDecl("y", SameAs("x"))],
                       extras=[Numel("x")], geometry=Elementwise(block=(256,)), dtypes=FLOATS),
            reference=sigmoid_ref,
        ),
        _randn, sigmoid_ref, FLOATS,
    ),
    Case(
        "add",
        lambda: fxkern.cuda_kernel_op(
            f"{NS}::add",
            KernelSpec(ADD, "add_kernel", inputs=[InputDecl("a"), InputDecl("b")],
                       outputs=[OutputDecl("out", SameAs("a"))], extras=[Numel("a")],
                       geometry=Elementwise(block=(256,)), dtypes=FLOATS),
            reference=add_ref,
        ),
        lambda s, d, dev: (torch.randn(s, dtype=d, device=dev), torch.randn(s, dtype=d, device=dev)),
        add_ref, FLOATS,
    ),
    Case(
        "scale",
        lambda: fxkern.cuda_kernel_op(
            f"{NS}::scale",
            KernelSpec(SCALE, "scale_kernel", inputs=[InputDecl("x"), ScalarInput("alpha", float)],
                       outputs=[OutputDecl("y", SameAs("x"))], extras=[Numel("x")],
                       geometry=Elementwise(block=(256,))),
            reference=scale_ref,
        ),
        lambda s, d, dev: (torch.randn(s, dtype=d, device=dev), 0.37),
        scale_ref,
    ),
    Case(
        "relu_2d",
        lambda: fxkern.cuda_kernel_op(
            f"{NS}::relu_2d",
            KernelSpec(RELU_2D, "relu_2d", inputs=[InputDecl("x")], outputs=[OutputDecl("y", SameAs("x"))],
                       extras=[DimSize("x", -2), DimSize("x", -1)],
                       geometry=Elementwise(block=(32, 8), layout="nd")),
            reference=relu_ref,
        ),
        _randn, relu_ref, shape=(3, 37, 1000),
    ),
    Case(
        "row_sum",
        lambda: fxkern.cuda_kernel_op(
            f"{NS}::row_sum",
            KernelSpec(ROW_SUM, "row_sum", inputs=[InputDecl("x")], outputs=[OutputDecl("y", ReduceDims("x", (-1,)))],
                       extras=[DimSize("x", -1)], geometry=Reduction(reduce_dims=(-1,), block_size=256), dtypes=FLOATS),
            reference=row_sum_ref,
        ),
        _randn, row_sum_ref, FLOATS,
    ),
    Case(
        "repeat2",
        lambda: fxkern.cuda_kernel_op(
            f"{NS}::repeat2",
            KernelSpec(REPEAT2, "repeat2", inputs=[InputDecl("x")], extras=[Numel("x")],
                       geometry=Custom(lambda ins, outs: ((cdiv(outs[0].numel(), 256),), (256,)))),
            meta_fn=repeat2_meta, schema="(Tensor x) -> Tensor", reference=repeat2_ref,
        ),
        _randn, repeat2_ref,
    ),
    Case(
        "sin_cos",
        lambda: fxkern.cuda_kernel_op(
            f"{NS}::sin_cos",
            KernelSpec(SIN_COS, "sin_cos", inputs=[InputDecl("x")],
                       outputs=[OutputDecl("s", SameAs("x")), OutputDecl("c", SameAs("x"))],
                       extras=[Numel("x")], geometry=Elementwise(block=(256,))),
            reference=sin_cos_ref,
        ),
        _randn, sin_cos_ref,
    ),
]

BY_NAME = {c.name: c for c in CASES}


def register_all():
    return {c.name: c.register() for c in CASES}


class CallOp(torch.nn.Module):
    """A module whose forward is one call of the op: what torch.export sees."""

    def __init__(self, op):
        super().__init__()
        self.op = op

    def forward(self, *args):
        return self.op(*args)


def tolerance(dtype):
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]


def check(out, ref, dtype):
    outs = out if isinstance(out, tuple) else (out,)
    refs = ref if isinstance(ref, tuple) else (ref,)
    worst = 0.0
    for o, r in zip(outs, refs):
        assert o.shape == r.shape and o.dtype == r.dtype, (o.shape, r.shape, o.dtype, r.dtype)
        r64 = r.double()
        err = (o.double() - r64).norm() / r64.norm().clamp_min(1e-30)
        worst = max(worst, float(err))
    return worst


def reference_in_float64(case, args):
    """The reference computed in float64 on upcast inputs, cast back to the call's dtype for comparison."""
    up = [a.double() if isinstance(a, torch.Tensor) else a for a in args]
    ref = case.reference(*up)
    dtype = args[0].dtype
    return tuple(r.to(dtype) for r in ref) if isinstance(ref, tuple) else ref.to(dtype)


def export_dynamic(case, op, args):
    """Export one call of ``op`` with the leading axis of every tensor input dynamic."""
    # Dim.DYNAMIC: a named Dim hits a torch 2.11 bug in export's own error formatting (seen on the device)
    batch = torch.export.Dim.DYNAMIC
    dynamic = tuple({0: batch} if isinstance(a, torch.Tensor) else None for a in args)
    return torch.export.export(CallOp(op), args, dynamic_shapes=(dynamic,))


def run_case(case, op, device):
    rows = []
    for dtype in case.dtypes:
        args = case.make_inputs(case.shape, dtype, device)
        ref = reference_in_float64(case, args)
        eager_err = check(op(*args), ref, dtype)
        ep = export_dynamic(case, op, args)
        other = case.make_inputs((case.shape[0] * 2 + 1, *case.shape[1:]), dtype, device)
        export_err = check(ep.module()(*other), reference_in_float64(case, other), dtype)
        ok = eager_err <= tolerance(dtype) and export_err <= tolerance(dtype)
        rows.append((case.name, str(dtype).replace("torch.", ""), eager_err, export_err, ok))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    path = "CUDA kernel" if args.device.startswith("cuda") else "reference (CPU) implementation: no GPU here"
    print(f"fxkern seven cases on {args.device} ({path})")
    t0 = time.perf_counter()
    ops = register_all()
    print(f"registered {len(ops)} ops in {1e3 * (time.perf_counter() - t0):.1f} ms (NVRTC, cached on disk)")
    print(f"{'case':10} {'dtype':9} {'eager rel.err':>14} {'export rel.err':>15}  result")
    failed = 0
    for case in CASES:
        try:
            rows = run_case(case, ops[case.name], args.device)
        except Exception as exc:  # report every case, then fail at the end
            print(f"{case.name:10} {'-':9} {'-':>14} {'-':>15}  FAIL: {type(exc).__name__}: {exc}")
            failed += 1
            continue
        for name, dtype, e1, e2, ok in rows:
            print(f"{name:10} {dtype:9} {e1:14.2e} {e2:15.2e}  {'ok' if ok else 'FAIL'}")
            failed += not ok
    print("all cases ok" if not failed else f"{failed} case(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
