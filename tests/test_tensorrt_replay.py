"""Replay the TensorRT plugin contract on a GPU, without TensorRT.

For every example (and library) kernel: take exactly what the AOT
implementation returns — kernel name, PTX, launch parameters, extra
arguments — with the launch evaluated at the inputs' sizes by the concrete
interpreter of the same expressions (``trt_standin``); load the PTX through
the CUDA driver and launch it with TensorRT's argument order (tensor inputs,
extra arguments as int32, outputs) on fresh random inputs, and compare with
the op's reference. Scalar inputs travel as extras (float32 bit patterns).

This checks fxkern's side of the contract on real hardware; it is not a
TensorRT run (tests/test_tensorrt.py has those, skipped where TensorRT is
missing).
"""

import ctypes

import pytest
import torch

import fxkern
import seven_cases
import trt_standin as standin
from helpers import example_cases, library_inputs, library_ops
from fxkern import launcher
from fxkern.tensorrt import plugin

pytestmark = pytest.mark.gpu
API = plugin.Api(plugin=standin.plugin, DataType=standin.DataType)
TORCH_OF = {v: k for k, v in standin.TORCH_TO_TRT.items()}
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def replay(entry, args):
    """Launch ``entry``'s AOT plugin contract on ``args`` as TensorRT would; returns the outputs."""
    pp = plugin.plan_plugin(entry)
    assert pp.aot, pp.why_jit
    tensors = [a.contiguous() for a in args if isinstance(a, torch.Tensor)]
    scalars = [a for a in args if not isinstance(a, torch.Tensor)]
    descs = [standin.desc(t) for t in tensors]
    out_descs = standin.run_descriptor(plugin.descriptor(pp, API), descs, dict(zip(pp.attr_names, scalars)), fake=False)
    contract = standin.run_aot_impl(plugin.aot_impl(pp, API), descs, scalars, out_descs)
    outs = [torch.empty([d.value for d in o.shape_expr], dtype=TORCH_OF[o.dtype], device=tensors[0].device)
            for o in out_descs]

    device = tensors[0].device.index or 0
    image = contract["ptx"].encode()
    fn = launcher.DeviceFunctions(lambda idx: image, [contract["name"]]).load(device)[contract["name"]]
    values = [ctypes.c_uint64(t.data_ptr()) for t in tensors]
    values += [ctypes.c_int32(v) for v in contract["extras"]]
    values += [ctypes.c_uint64(o.data_ptr()) for o in outs]
    params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    if all(contract["grid"]):
        from cuda.bindings import driver

        stream = driver.CUstream(torch.cuda.current_stream(device).cuda_stream)
        (err,) = driver.cuLaunchKernel(fn, *contract["grid"], *contract["block"], contract["shared_mem"], stream,
                                       ctypes.addressof(params), 0)
        assert err == driver.CUresult.CUDA_SUCCESS, err
    torch.cuda.synchronize(device)
    return tuple(outs)


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


@pytest.fixture(scope="module")
def example_ops():
    return seven_cases.register_all()


@pytest.mark.parametrize("case,dtype", example_cases())
def test_replay_example(example_ops, case, dtype):
    torch.manual_seed(0)
    entry = fxkern.kernel_op(f"{seven_cases.NS}::{case.name}")
    for shape in (case.shape, tuple(s + 3 for s in case.shape)):
        args = case.make_inputs(shape, dtype, "cuda")
        got = replay(entry, args)
        want = _as_tuple(seven_cases.reference_in_float64(case, args))
        rtol, atol = TOLERANCE[dtype]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol)
        eager = _as_tuple(example_ops[case.name](*args))  # and the eager launch agrees bit for bit
        for g, e in zip(got, eager):
            torch.testing.assert_close(g, e, rtol=0, atol=0)


def spec_launch(entry):
    """fxkern's eager launch of the op's own spec, the kernel the plugin carries: the op itself, unless
    its eager_fn may pick another kernel for some calls (the library's plain RMSNorms take a two-read
    kernel for long rows, rmsnorm.two_read_tuning). Its outputs are contiguous, as a plugin's are
    (TensorRT's tensors have no strides): the public op's meta_fn may lay them out as eager does
    (rotary.like_eager), which its eager kernels write and the spec's kernel does not."""
    if entry.eager_fn is None:
        return entry.op

    def contiguous_outputs(*args):
        outs = entry.meta_fn(*args)
        if isinstance(outs, tuple):
            return tuple(torch.empty_like(o, memory_format=torch.contiguous_format) for o in outs)
        return torch.empty_like(outs, memory_format=torch.contiguous_format)

    return fxkern.cuda_kernel_op("fxkern_replay::" + entry.qualname.replace("::", "__"), entry.spec,
                                 meta_fn=contiguous_outputs if entry.meta_fn else None,  # else the spec's: contiguous
                                 reference=entry.reference, schema=entry.schema)


LIBRARY = library_ops()
LIB_TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}


@pytest.mark.parametrize("name", sorted(LIBRARY))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("rows,cols", [(37, 1000), (5, 4099), (3, 20000)])
def test_replay_library_kernel(name, dtype, rows, cols):
    torch.manual_seed(0)
    op = LIBRARY[name]
    entry = fxkern.kernel_op(name)
    args = library_inputs(op, dtype, "cuda", rows=rows, cols=cols)
    got = replay(entry, args)
    eager = _as_tuple(spec_launch(entry)(*args))
    for g, e in zip(got, eager):  # the eager launch runs the same kernel with the same geometry
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    want = _as_tuple(entry.reference(*[a.double() if isinstance(a, torch.Tensor) else a for a in args]))
    rtol, atol = LIB_TOLERANCE[dtype]
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w.double(), rtol=rtol, atol=atol)
