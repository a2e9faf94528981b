"""Host time of one kernel launch through each Python path fxkern could use.

    python benchmarks/launch_paths.py

Same kernel (the sigmoid example, 4 blocks), same stream, host time per call
in bursts from an idle GPU: ctypes -> cuLaunchKernel (fxkern's path),
cuda.bindings' cuLaunchKernel, cuda.core's launch, and torch.sigmoid for scale.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common import host_us  # noqa: E402

import fxkern  # noqa: E402
import seven_cases  # noqa: E402
from fxkern import launcher  # noqa: E402




def measure():
    """Host microseconds per launch for each path, by name."""
    ops = seven_cases.register_all()
    x = torch.randn(1024, device="cuda")
    y = torch.empty_like(x)
    ops["sigmoid"](x)
    entry = fxkern.kernel_op(f"{seven_cases.NS}::sigmoid")
    impl = entry.cuda_impl
    name = impl.lowered(torch.float32)
    handle = impl.functions.load(0)[name]
    stream = launcher.current_stream_handle(0)
    values = [x.data_ptr(), x.numel(), y.data_ptr()]
    results = {}

    results["fxkern KernelLauncher (struct.pack_into + cuda.bindings cuLaunchKernel)"] = host_us(
        lambda: impl.launch(handle, (4, 1, 1), (256, 1, 1), 0, stream, values, "b"))

    pack = impl.launch._local.pack
    lib = ctypes.CDLL("libcuda.so.1")
    raw = lib.cuLaunchKernel
    raw.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    raw.restype = ctypes.c_int
    handle_int = int(handle)
    results["bare ctypes cuLaunchKernel (args prepacked)"] = host_us(
        lambda: raw(handle_int, 4, 1, 1, 256, 1, 1, 0, stream, pack[1], None))

    try:
        from cuda.bindings import driver

        f = handle
        s = driver.CUstream(stream)
        addr = pack[1]
        results["cuda.bindings cuLaunchKernel (objects prebuilt)"] = host_us(
            lambda: driver.cuLaunchKernel(f, 4, 1, 1, 256, 1, 1, 0, s, addr, 0))
    except Exception as exc:  # report, keep measuring the others
        print("cuda.bindings path failed:", type(exc).__name__, exc)

    try:
        try:
            from cuda.core import Device, LaunchConfig, ObjectCode, launch
        except ImportError:
            from cuda.core.experimental import Device, LaunchConfig, ObjectCode, launch
        dev = Device(0)
        dev.set_current()
        cubin = entry.compiled.cubin
        kernel = ObjectCode.from_cubin(cubin).get_kernel(name)

        class TorchStream:
            def __cuda_stream__(self):
                return (0, stream)

        cstream = dev.create_stream(TorchStream())
        cfg = LaunchConfig(grid=(4, 1, 1), block=(256, 1, 1))
        import numpy as np

        px, py, n = x.data_ptr(), y.data_ptr(), np.int32(1024)
        results["cuda.core launch (stream, config prebuilt)"] = host_us(lambda: launch(cstream, cfg, kernel, px, n, py))
        results["cuda.core launch (config built per call)"] = host_us(
            lambda: launch(cstream, LaunchConfig(grid=(4, 1, 1), block=(256, 1, 1)), kernel, x.data_ptr(), np.int32(1024), y.data_ptr()))
    except Exception as exc:
        print("cuda.core path failed:", type(exc).__name__, exc)

    results["torch.sigmoid(x) (dispatch + alloc + launch)"] = host_us(lambda: torch.sigmoid(x))
    results["torch.empty_like(x)"] = host_us(lambda: torch.empty_like(x))
    results["fxkern op .default(x)"] = host_us(lambda: ops["sigmoid"].default(x))
    torch.testing.assert_close(torch.sigmoid(x), ops["sigmoid"](x))
    return results


def main():
    for k, v in measure().items():
        print(f"{k:58s} {v:6.2f} us")


if __name__ == "__main__":
    main()
