"""Kernel-op benchmarks (issue: kernel ops).

1. Registration: warm (cache hit) time per op, and that it does no GPU work;
   cold: NVRTC compiles for the seven examples from an empty cache.
2. Host time per call of a small elementwise fxkern op vs torch.sigmoid.
3. Kernel time of each example vs its eager PyTorch reference at a size that
   fills the GPU, as useful GB/s against a measured device-to-device copy.

    python benchmarks/kernel_ops.py [--section-out FILE]

Writes the "kernel_ops" section of docs/benchmarks.md (or FILE).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import common  # noqa: E402


def registration():
    """Cold compile count and warm registration time; run before any CUDA work."""
    from fxkern import compiler
    import fxkern
    import seven_cases

    cold_dir = tempfile.mkdtemp(prefix="fxkern-cold-")
    os.environ["FXKERN_CACHE_DIR"] = cold_dir
    compiler.stats.update(compiles=0, hits=0)
    t0 = time.perf_counter()
    seven_cases.register_all()
    cold_s = time.perf_counter() - t0
    cold_compiles = compiler.stats["compiles"]
    # Warm: new op names over cached kernels (the cache entry is what a fresh process would read).
    times = []
    for i in range(30):
        case = seven_cases.CASES[i % len(seven_cases.CASES)]
        spec_op = fxkern.kernel_op(f"{seven_cases.NS}::{case.name}")
        t0 = time.perf_counter()
        fxkern.cuda_kernel_op(f"fxkern_bench::warm{i}", spec_op.spec, meta_fn=spec_op.meta_fn,
                              schema=spec_op.schema if spec_op.meta_fn else None, reference=spec_op.reference)
        times.append(time.perf_counter() - t0)
    gpu_touched = torch.cuda.is_initialized()
    return cold_s, cold_compiles, statistics.median(times) * 1e3, gpu_touched




def host_overhead(ops):
    x = torch.randn(1024, device="cuda")
    fx = ops["sigmoid"]
    for fn in (fx, fx.default, torch.sigmoid):
        common.host_us(lambda: fn(x), rounds=10)  # warm up
    return (common.host_us(lambda: fx(x)), common.host_us(lambda: fx.default(x)),
            common.host_us(lambda: torch.sigmoid(x)))


def copy_bandwidth():
    x = torch.randn(1 << 28, device="cuda")  # 1 GiB
    y = torch.empty_like(x)
    ms = common.cuda_time_ms(lambda: y.copy_(x))
    return 2 * x.numel() * 4 / (ms * 1e-3) / 1e9


def kernel_bandwidth(ops, copy_gbs):
    import seven_cases

    rows = []
    shape = (16384, 8192)
    for case in seven_cases.CASES:
        for dtype in case.dtypes:
            args = case.make_inputs(shape, dtype, "cuda")
            out = ops[case.name](*args)
            outs = out if isinstance(out, tuple) else (out,)
            nbytes = sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))
            nbytes += sum(o.numel() * o.element_size() for o in outs)
            ours = common.cuda_time_ms(lambda: ops[case.name](*args))
            eager = common.cuda_time_ms(lambda: case.reference(*args))
            gbs = nbytes / (ours * 1e-3) / 1e9
            rows.append((case.name, str(dtype)[6:], ours, eager, gbs, nbytes / (eager * 1e-3) / 1e9, gbs / copy_gbs))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--section-out", type=Path, default=None)
    args = parser.parse_args(argv)
    cold_s, cold_compiles, warm_ms, touched = registration()
    lines = [
        "## Kernel ops",
        "",
        f"Machine: {common.machine()}. Date: {common.today()}. Command: `python benchmarks/kernel_ops.py`.",
        "",
        "### Registration",
        "",
        f"- Cold (empty cache): {cold_compiles} NVRTC compiles for the 7 examples (one per source and arch; "
        f"templated kernels compile all their dtypes at once), {cold_s:.2f} s.",
        f"- Warm (cache hit): {warm_ms:.2f} ms per op, median of 30 registrations (goal: at most 5 ms). "
        f"GPU touched by registration: {'yes' if touched else 'no'}.",
    ]
    if torch.cuda.is_available():
        import seven_cases

        ops = seven_cases.register_all()
        ours, ours_default, native = host_overhead(ops)
        import launch_paths

        paths = launch_paths.measure()
        copy_gbs = copy_bandwidth()
        rows = kernel_bandwidth(ops, copy_gbs)
        lines += [
            "",
            "### Host time per call (1024-element float32 tensor; best of 200 bursts of 200 calls, each burst from an idle GPU)",
            "",
            "| op | us per call | vs torch.sigmoid |",
            "| --- | ---: | ---: |",
            f"| torch.sigmoid | {native:.2f} | 1.00x |",
            f"| fxkern sigmoid, `torch.ops.fxkern_examples.sigmoid(x)` | {ours:.2f} | {ours / native:.2f}x (goal: at most 1.5x) |",
            f"| fxkern sigmoid, `.default(x)` (what a rewritten graph calls) | {ours_default:.2f} | {ours_default / native:.2f}x |",
            "",
            "Where the time goes (`benchmarks/launch_paths.py`, same kernel and stream, host us per call):",
            "",
            "| path | us |",
            "| --- | ---: |",
            *[f"| {k} | {v:.2f} |" for k, v in paths.items()],
            "",
            f"### Kernel time at 16384x8192 (CUDA events around 10 back-to-back calls, 5 warm-ups, median of 20); device-to-device copy {copy_gbs:.0f} GB/s",
            "",
            "Useful bytes: each input read once, each output written once.",
            "",
            "| case | dtype | fxkern ms | eager ms | fxkern GB/s | eager GB/s | fxkern / copy |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        lines += [f"| {n} | {d} | {a:.3f} | {b:.3f} | {g:.0f} | {ge:.0f} | {f:.0%} |" for n, d, a, b, g, ge, f in rows]
    else:
        lines += ["", "No GPU on this machine: host-overhead and kernel-time rows are measured on the device only."]
    body = "\n".join(lines)
    common.emit("kernel_ops", body, args.section_out)


if __name__ == "__main__":
    main()
