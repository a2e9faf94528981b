"""Sweep the GELU kernels' elementwise tuning (elements a thread, threads and blocks resident per SM,
how exp and reciprocals are evaluated) against inductor: how fxkern.library.gelu's launch bounds
and math were chosen.

Each variant is the library's own source with its tuning macros set and the grid to match,
registered as a scratch op and checked against the pattern before it is timed; registers and
spill bytes come from the driver. ``gelu_new`` and the bias forms read one tensor and write one,
the residual form reads two: with one stream in, fewer bytes are in flight a thread, so resident
threads matter more, and a 16-bit erf GELU has the most arithmetic a byte.

    python benchmarks/ew_tuning.py [--section-out FILE] [--variants A,B]

Writes the "ew_tuning" section of docs/benchmarks.md (or FILE).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import torch
from library import copy_bandwidth
import row_tuning
from row_tuning import registers

SHAPE = (16384, 8192)
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _variant(per: int, blocks: tuple[int, int], threads: int = 128, ftz: bool = True) -> tuple[dict, int]:
    """Elements a thread (both dtypes), blocks resident per SM (float32, 16-bit), threads a block,
    and whether exp and reciprocals flush subnormals (FXK_FTZ: cuda_common's exp_sfu/rcp_sfu)."""
    return {"FXK_EW_PER": per, "FXK_EW_THREADS": threads, "FXK_EW_BLOCKS_F32": blocks[0],
            "FXK_EW_BLOCKS_HALF": blocks[1], "FXK_FTZ": int(ftz)}, threads


# The library's choice first. Names hold no commas (--variants is a comma-separated list).
VARIANTS = {
    "t128 e8 b12/16 (shipped)": _variant(8, (12, 16)),
    "t128 e8 b12/16 no .ftz": _variant(8, (12, 16), ftz=False),
    "t256 e8 b6/8": _variant(8, (6, 8), threads=256),
    "t256 e8 b6/8 no .ftz": _variant(8, (6, 8), threads=256, ftz=False),
    "t128 e8 b10/16": _variant(8, (10, 16)),
    "t128 e8 b16/16": _variant(8, (16, 16)),
    "t128 e16 b8/8": _variant(16, (8, 8)),
}


def variant_op(index: int, kernel: str, variant: tuple[dict, int], base):
    """The variant as a scratch op (row_tuning's, with the elementwise grid to match its tile)."""
    macros, threads = variant
    return row_tuning.variant_op(index, kernel, (macros, threads * macros["FXK_EW_PER"], threads), base)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--section-out", type=Path, default=None)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no GPU: nothing to tune")
        return
    from fxkern.library import gelu

    torch.manual_seed(0)
    rows, d = SHAPE
    names = [n for n in args.variants.split(",") if n in VARIANTS] or list(VARIANTS)
    bias = lambda x: torch.randn(d, device="cuda").to(x.dtype)  # noqa: E731
    cases = [("gelu_new", gelu.GELU_NEW, gelu.gelu_new, lambda x: (x,)),
             ("bias_gelu", gelu.BIAS_GELU, gelu.bias_gelu, lambda x: (x, bias(x))),
             ("bias_gelu_tanh", gelu.BIAS_GELU_TANH, gelu.bias_gelu_tanh, lambda x: (x, bias(x))),
             ("bias_gelu_tanh_residual", gelu.BIAS_GELU_TANH_RESIDUAL, gelu.bias_gelu_tanh_residual,
              lambda x: (x, bias(x), torch.randn_like(x)))]
    copy = copy_bandwidth()
    lines = ["## Elementwise tuning (`fxkern.library.gelu`)", "",
             f"Machine: {common.machine()}. Date: {common.today()}. Command: `python benchmarks/ew_tuning.py"
             + (f' --variants "{args.variants}"' if args.variants != ",".join(VARIANTS) else "") + "`.", "",
             (f"GB/s of useful bytes at {rows}x{d} (each input read once, each output written once; the bias "
              "is a row), CUDA events around 10 back-to-back calls, 5 warm-ups, median of 20; inductor "
              f"(`torch.compile(pattern, dynamic=False)`, default mode) in the same run; device-to-device copy {copy:.0f} GB/s. "
              "Variant: threads a block (t), elements a thread (e) and blocks resident per SM (b, "
              "the launch bounds), float32/16-bit; \"no .ftz\": exp and reciprocals through __expf and "
              "__fdividef, which keep subnormals at four more instructions each; registers a thread float32/bfloat16 for each kernel in turn, with the "
              "driver's local-memory (spill) bytes."), "",
             "| variant | " + " | ".join(f"{k} {str(dt)[6:]}" for k, *_ in cases for dt in DTYPES) + " | regs f32/bf16 |",
             "| --- |" + " ---: |" * (len(cases) * len(DTYPES)) + " --- |"]
    inputs = {(k, dt): make(torch.randn(rows, d, device="cuda").to(dt)) for k, _, _, make in cases for dt in DTYPES}
    nbytes = {key: sum(a.numel() * a.element_size() for a in v) + v[0].numel() * v[0].element_size()
              for key, v in inputs.items()}
    row = []
    for kernel, _, pattern, _ in cases:
        compiled = common.inductor(pattern)
        for dt in DTYPES:
            a = inputs[kernel, dt]
            compiled(*a)
            row.append(nbytes[kernel, dt] / common.cuda_time_ms(lambda a=a: compiled(*a)) / 1e6)
    lines.append("| inductor | " + " | ".join(f"{v:.0f}" for v in row) + " | |")
    print(lines[-1], flush=True)
    for i, name in enumerate(names):
        row, regs = [], []
        for kernel, base, pattern, _ in cases:
            op = variant_op(i, kernel, VARIANTS[name], base)
            regs.append(registers(f"fxkern_tune::{kernel}_{i}"))
            for dt in DTYPES:
                a = inputs[kernel, dt]
                got, want = op(*a), pattern(*a)
                err = float((got.float() - want.float()).norm() / want.float().norm())
                if not err <= TOL[dt]:
                    raise AssertionError(f"{name} {kernel} {dt}: rel. err {err:.1e}")
                row.append(nbytes[kernel, dt] / common.cuda_time_ms(lambda a=a: op(*a)) / 1e6)
        lines.append(f"| {name} | " + " | ".join(f"{v:.0f}" for v in row) + f" | {', '.join(regs)} |")
        print(lines[-1], flush=True)
    common.emit("ew_tuning", "\n".join(lines) + "\n", args.section_out)


if __name__ == "__main__":
    main()
