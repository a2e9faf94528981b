"""Where the host time of one small fxkern op call goes (a diagnosis aid for the host-overhead goal).

    python benchmarks/host_profile.py
"""

from __future__ import annotations

import cProfile
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common import host_us  # noqa: E402

import fxkern  # noqa: E402
import seven_cases  # noqa: E402
from fxkern import launcher  # noqa: E402




def main():
    ops = seven_cases.register_all()
    op = ops["sigmoid"]
    entry = fxkern.kernel_op(f"{seven_cases.NS}::sigmoid")
    x = torch.randn(1024, device="cuda")
    op(x)
    impl = entry.cuda_impl
    kernel = impl.functions.load(0)[impl.lowered[torch.float32]]
    y = torch.empty_like(x)
    stream = launcher.current_stream_handle(0)
    values = [x.data_ptr(), x.numel(), y.data_ptr()]
    rows = {
        "ctypes launch only": lambda: impl.launch(kernel, (4, 1, 1), (256, 1, 1), 0, stream, values, "bench"),
        "torch.sigmoid(x)": lambda: torch.sigmoid(x),
        "torch.ops sigmoid(x)": lambda: op(x),
        "op.default(x)": lambda: op.default(x),
        "CUDA impl called directly": lambda: entry.cuda_impl(x),
        "torch.empty(1024, cuda)": lambda: torch.empty(1024, device=x.device),
        "current_stream_handle": lambda: launcher.current_stream_handle(0),
        "torch.cuda.current_device": lambda: torch.cuda.current_device(),
        "x.data_ptr()": lambda: x.data_ptr(),
    }
    for name, fn in rows.items():
        print(f"{name:32s} {host_us(fn):7.2f} us")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20000):
        op(x)
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
