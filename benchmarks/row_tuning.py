"""Sweep the row kernels' tuning knobs (RMSNorm; softmax with --softmax, add + LayerNorm with --layernorm)
shipped defaults were chosen.

Each variant is the library's own source with its tuning macros set (threads a block, 16-byte packs
a thread holds, blocks resident per SM) and its own grid (elements a block takes), registered as a
scratch op and checked against the pattern before it is timed; registers and spill bytes come from
the driver. Shapes: one that fills the GPU, a 7B model's width and the demo model's norm (softmax:
one that fills the GPU and attention scores at sequence lengths of 256 to 2048).

    python benchmarks/row_tuning.py [--softmax | --two-read | --layernorm] [--section-out FILE] [--variants A,B]
                                    [--rounds N] [--dump-inductor DIR]

Writes the "row_tuning" (or "softmax_tuning", "layernorm_tuning", or with --two-read "row_tuning_two_read") section of
docs/benchmarks.md (or FILE).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import torch
from torch._inductor.utils import run_and_get_code

SHAPES = [(16384, 8192), (8192, 4096), (4096, 2048)]
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}

def _variant(threads: int, chunk: int | tuple[int, int], packs: tuple[int, int], blocks: tuple[int, int],
             scalars: int = 4) -> tuple[dict, int | tuple[int, int], int]:
    """(macros, elements a block takes, threads a block): 16-byte packs a thread holds and blocks
    resident per SM are each given as (float32, 16-bit), and so may the elements a block takes;
    scalars: elements a thread holds on the scalar path (rows that are not whole packs), whose
    registers the vector path shares."""
    return ({"ROW_THREADS": threads, "FXK_ROW_PACKS_F32": packs[0], "FXK_ROW_PACKS_HALF": packs[1],
             "FXK_ROW_BLOCKS_F32": blocks[0], "FXK_ROW_BLOCKS_HALF": blocks[1], "FXK_ROW_SCALARS": scalars},
            chunk, threads)


# Measured on an H200 while choosing the defaults (2026-11-23); the first is the library's choice.
VARIANTS = {
    "t256 c8k p8/4 b4/6 (shipped)": _variant(256, 8192, (8, 4), (4, 6)),
    "t256 c8k p8/4 b3/6 (before)": _variant(256, 8192, (8, 4), (3, 6)),
    "t256 c8k p8/4 b3/6 16 scalars": _variant(256, 8192, (8, 4), (3, 6), scalars=16),
    "t256 c8k p8/4 b5/6": _variant(256, 8192, (8, 4), (5, 6)),
    "t256 c8k p8/4 b4/8": _variant(256, 8192, (8, 4), (4, 8)),
    "t256 c8k p8/4 b4/5": _variant(256, 8192, (8, 4), (4, 5)),
    "t256 c4k p8/4 b4/6": _variant(256, 4096, (8, 4), (4, 6)),
    "t256 c16k p8/8 b3/3": _variant(256, 16384, (8, 8), (3, 3)),
    "t256 c16k p4/4 b4/4 (two reads in float32)": _variant(256, 16384, (4, 4), (4, 4)),
    "t512 c8k p4/2 b3/4": _variant(512, 8192, (4, 2), (3, 4)),
    "t512 c16k p8/4 b2/3": _variant(512, 16384, (8, 4), (2, 3)),
    "t1024 c8k p2/1 b2/2": _variant(1024, 8192, (2, 1), (2, 2)),
}

# Softmax (fxkern.library.softmax, `--softmax`): the library's choices first (softmax.grid_for picks
# by row length and dtype). Blocks of 32 to 128 threads only hold short rows (longer ones take the
# second read): they are for attention's rows of 256 to 2048. Also measured (2026-11-24 17:17 UTC,
# H200): a grid capped at the blocks the GPU holds at once (SMs x b), each block looping over its
# larger slice so all end together: 8-19% slower wherever the rows fit in registers than the same
# kernel a block per register-full (131072x512 float32: 3566 GB/s against 4051 at t256, 3553 against
# 4103 at t32), the blocks of an SM moving through load, reduce and store in step, not overlapping;
# 16-bit short rows at 2 packs a thread (t32 c512, t64 c1k at 16 and 24 blocks an SM, t128 c2k at 8),
# which a warp then shares as float32 rows at 4 packs are (the float32 short-row choice): 13-33%
# slower than 8 packs in one-warp blocks at 512 and 1024 elements (17:36 UTC).
SOFTMAX_VARIANTS = {
    "t256 c8k/16k p8/8 b4/4 (shipped for longer rows)": _variant(256, (8192, 16384), (8, 8), (4, 4)),
    "t32 c1k/2k p8/8 b32/32 (shipped for 16-bit rows up to 2048)": _variant(32, (1024, 2048), (8, 8), (32, 32)),
    "t64 c1k/2k p4/4 b16/16 (shipped for float32 rows up to 1024)": _variant(64, (1024, 2048), (4, 4), (16, 16)),
    "t256 c8k/16k p8/8 b3/4 (before, for every row)": _variant(256, (8192, 16384), (8, 8), (3, 4)),
    "t256 c16k p8/8 b3/4": _variant(256, 16384, (8, 8), (3, 4)),
    "t256 c4k/16k p4/8 b6/4": _variant(256, (4096, 16384), (4, 8), (6, 4)),
    "t64 c2k/4k p8/8 b16/16": _variant(64, (2048, 4096), (8, 8), (16, 16)),
    "t32 c512/1k p4/4 b32/32": _variant(32, (512, 1024), (4, 4), (32, 32)),
    "t64 c1k/2k p4/4 b24/24": _variant(64, (1024, 2048), (4, 4), (24, 24)),
    "t128 c2k/4k p4/4 b12/12": _variant(128, (2048, 4096), (4, 4), (12, 12)),
    "t128 c4k/8k p8/8 b8/8": _variant(128, (4096, 8192), (8, 8), (8, 8)),
    "t256 c32k p8/8 b3/4": _variant(256, 32768, (8, 8), (3, 4)),
    "t256 c16k p4/4 b4/6": _variant(256, 16384, (4, 4), (4, 6)),
    "t256 c8k p4/4 b4/6": _variant(256, 8192, (4, 4), (4, 6)),
    "t512 c16k p4/4 b2/3": _variant(512, 16384, (4, 4), (2, 3)),
}
SOFTMAX_SHAPES = [(16384, 8192), (262144, 256), (131072, 512), (65536, 1024), (32768, 2048)]


# LayerNorm (fxkern.library.layernorm, `--layernorm`): the residual add + LayerNorm kernels in the
# RMSNorm kernel's row layout; the library's choice first. At 6 blocks an SM a 16-bit thread gets 40
# registers, and the kernel with a bias spills 16 bytes there (tools/kernel_resources.py), the
# bias-free one none.
LAYERNORM_VARIANTS = {
    "t256 c8k p8/4 b4/6 (shipped)": _variant(256, 8192, (8, 4), (4, 6)),
    "t256 c8k p8/4 b4/5": _variant(256, 8192, (8, 4), (4, 5)),
    "t256 c8k p8/4 b4/4": _variant(256, 8192, (8, 4), (4, 4)),
}


def _two_read(threads: int, packs: int, blocks: int, hints: bool = True) -> tuple[dict, int, int]:
    """A variant of the two-read RMSNorm kernel (fxkern.library.rmsnorm.TWO_READ: float32 rows of 4096+
    and 16-bit rows of 8192+ in the library): threads a block (one block a row), 16-byte packs a thread
    reads a step, blocks resident per SM, and whether its loads carry cache eviction priorities.
    (macros, 0, threads a block)."""
    return ({"FXK_TWO_READ_THREADS": threads, "FXK_TWO_READ_PACKS": packs, "FXK_TWO_READ_BLOCKS": blocks,
             "FXK_EVICT_HINTS": int(hints)}, 0, threads)


# `--two-read`: the register-resident kernel against the two-read kernel, in every dtype; the library's
# choices first. Also measured (2026-11-24, H200, against the tunings shipped then): 4 packs for rows of
# 8192+ and 2 below as a branch in one kernel at 3 blocks an SM (40 registers): 4240 GB/s at 16384x8192
# float32 but 3867 at 8192x4096 (2 packs alone: 4070); the second read issuing a step's loads before
# its stores (spills at 32-40 registers; 1.3% slower at 64 registers, where it did not); the row
# length as a compile-time constant (no faster).
TWO_READ_VARIANTS = {
    "two-read t512 p2 b4 (shipped for float32 rows of 4096-8191, 16-bit rows of 8192+)": _two_read(512, 2, 4),
    "two-read t512 p4 b3 (shipped for float32 rows of 8192+)": _two_read(512, 4, 3),
    "two-read t256 p4 b6": _two_read(256, 4, 6),
    "two-read t512 p2 b4 no eviction hints": _two_read(512, 2, 4, hints=False),
    "two-read t512 p2 b3": _two_read(512, 2, 3),
    "two-read t256 p4 b5": _two_read(256, 4, 5),
    "two-read t512 p1 b4": _two_read(512, 1, 4),
}


def variant_op(index: int, kernel: str, variant: tuple[dict, int | tuple[int, int], int], base):
    """The variant as a callable op: a scratch op (``fxkern_tune::<kernel>_<index>``), or two where the
    elements a block takes differ by dtype (the float32 one suffixed ``_32bit``), picked per call."""
    import fxkern

    macros, chunk, threads = variant
    prefix = "".join(f"#define {k} {v}\n" for k, v in macros.items())
    name = f"fxkern_tune::{kernel}_{index}"
    if "FXK_TWO_READ_THREADS" in macros:  # the two-read kernel
        from fxkern.library import rmsnorm

        spec = dataclasses.replace(rmsnorm.RMS_NORM, kernel_name="rms_norm_two_read",
                                   kernel_source=prefix + rmsnorm.SOURCE,
                                   geometry=fxkern.Reduction((-1,), block_size=threads))
        return fxkern.cuda_kernel_op(name, spec)

    def op_taking(elements: int, qualname: str):
        def geometry(inputs, outputs):
            return (fxkern.cdiv(inputs[0].numel(), elements),), (threads,)

        spec = dataclasses.replace(base, kernel_source=prefix + base.kernel_source, geometry=fxkern.Custom(geometry))
        return fxkern.cuda_kernel_op(qualname, spec)

    if isinstance(chunk, int):
        return op_taking(chunk, name)
    op_32bit, op_16bit = op_taking(chunk[0], name + "_32bit"), op_taking(chunk[1], name)
    return lambda x, *rest: (op_32bit if x.element_size() == 4 else op_16bit)(x, *rest)


def registers(qualname: str) -> str:
    """Registers a thread and local-memory (spill) bytes of each instantiation, as the driver loaded it."""
    import fxkern
    from cuda.bindings import driver

    impl = fxkern.kernel_op(qualname).cuda_impl
    fns = impl.functions.load(torch.cuda.current_device())
    out = []
    for dt in DTYPES:
        fn = fns[impl.lowered(dt)]
        _, regs = driver.cuFuncGetAttribute(driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS, fn)
        _, local = driver.cuFuncGetAttribute(driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, fn)
        out.append(f"{regs}" + (f" ({local} B local)" if local else ""))
    return "/".join(out)


def inductor_configs(seen: set) -> list[str]:
    """The configs inductor's autotuner chose (with registers a thread) for the Triton kernels compiled
    since ``seen`` was last updated (for --dump-inductor)."""
    import gc

    out = []
    for obj in gc.get_objects():
        if type(obj).__name__ != "CachingAutotuner" or id(obj) in seen:
            continue
        seen.add(id(obj))
        name = getattr(getattr(obj, "fn", None), "__name__", "?")
        out += [f"{name}: {launcher.config} n_regs={getattr(launcher, 'n_regs', None)}"
                for launcher in getattr(obj, "launchers", ())]
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--section-out", type=Path, default=None)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--rounds", type=int, default=3,
                        help="time every row this many times, the order rotated each round; the table holds medians")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--two-read", action="store_true",
                       help="the register-resident RMSNorm against the two-read kernel (TWO_READ_VARIANTS)")
    which.add_argument("--softmax", action="store_true", help="tune the softmax kernel instead (SOFTMAX_VARIANTS)")
    which.add_argument("--layernorm", action="store_true",
                       help="tune the residual add + LayerNorm kernels instead (LAYERNORM_VARIANTS)")
    parser.add_argument("--dump-inductor", type=Path, default=None,
                        help="write inductor's generated code, and the configs its autotuner chose, here")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if not torch.cuda.is_available():
        print("no GPU: nothing to tune")
        return
    from fxkern.library import layernorm, rmsnorm, softmax

    torch.manual_seed(0)
    variants, shapes_run = VARIANTS, SHAPES
    names = list(dict.fromkeys(args.variants.split(",")))  # each variant once
    if args.two_read:  # the register-resident kernel's first variant named, then the two-read ones named
        variants = {**VARIANTS, **TWO_READ_VARIANTS}
        names = ([n for n in names if n in VARIANTS][:1]
                 + ([n for n in names if n in TWO_READ_VARIANTS] or list(TWO_READ_VARIANTS)))
    # (kernel, spec, pattern, its arguments from a row x and a weight w, outputs)
    cases = [("rms_norm", rmsnorm.RMS_NORM, rmsnorm.llama_rmsnorm, lambda x, w: (x, w, 1e-6), 1),
             ("add_rms_norm", rmsnorm.ADD_RMS_NORM, rmsnorm.add_llama_rmsnorm,
              lambda x, w: (x, torch.randn_like(x), w, 1e-6), 2)]
    title, command, section = "RMSNorm tuning (`fxkern.library.rmsnorm`)", "python benchmarks/row_tuning.py", "row_tuning"
    legend = ""
    if args.two_read:
        cases = cases[:1]  # the two-read kernel is the plain norm's
        title, command, section = ("RMSNorm: the register-resident kernel against the two-read kernel",
                                   command + " --two-read", "row_tuning_two_read")
        legend = (" Two-read variants (the library runs the ones named so for float32 rows of 4096 elements and "
                  "more and for 16-bit rows of 8192 and more, the register-resident kernel otherwise): one block a row, threads a block (t), 16-byte packs a "
                  "thread reads a step (p), blocks resident per SM (b, both dtypes); the first read of a row asks "
                  "L1 and L2 to keep it (`ld.global.L1::evict_last.L2::cache_hint`, an evict-last policy) and the "
                  "second to drop it, as Triton emits for inductor's `eviction_policy`, unless named.")
    if args.softmax:
        variants, shapes_run = SOFTMAX_VARIANTS, SOFTMAX_SHAPES
        names = [n for n in names if n in variants] or list(variants)
        cases = [("softmax_last", softmax.SOFTMAX, softmax.softmax_float32, lambda x, w: (3.0 * x,), 1)]
        title, command, section = ("Softmax tuning (`fxkern.library.softmax`, HF's float32 form)",
                                   command + " --softmax", "softmax_tuning")
    if args.layernorm:
        variants = LAYERNORM_VARIANTS
        names = [n for n in names if n in variants] or list(variants)
        cases = [("add_layer_norm", layernorm.ADD_LAYER_NORM, layernorm.add_layer_norm,
                  lambda x, w: (x, torch.randn_like(x), w, torch.randn_like(w), x.shape[-1], 1e-5), 2),
                 ("add_layer_norm_no_bias", layernorm.ADD_LAYER_NORM_NO_BIAS, layernorm.add_layer_norm_no_bias,
                  lambda x, w: (x, torch.randn_like(x), w, x.shape[-1], 1e-5), 2)]
        title, command, section = ("Residual add + LayerNorm tuning (`fxkern.library.layernorm`)",
                                   command + " --layernorm", "layernorm_tuning")
    command += f" --rounds {args.rounds}"
    if args.variants != parser.get_default("variants"):
        command += f' --variants "{args.variants}"'
    lines = [f"## {title}", "",
             f"Machine: {common.machine()}. Date: {common.today()}. Command: `{command}`.", "",
             ("GB/s of useful bytes (each input read once, each output written once), CUDA events around 10 "
              "back-to-back calls, the GPU kept busy by an untimed call before each sample, 5 warm-ups, median of 20, "
              f"in {args.rounds} rounds (every row in turn, the order rotated each round; the median over rounds); inductor (`torch.compile(pattern, dynamic=False)`, default mode, which "
              "autotunes its reduction configs) in the same run. Variant: threads a block (t), elements a block "
              "takes (c), 16-byte packs a thread holds (p) and blocks resident per SM (b), float32/16-bit, and "
              "elements a thread holds on the scalar path (rows that are not whole packs: 4 unless named), with c "
              "given as float32/16-bit where it differs by dtype; "
              "registers a thread float32/bfloat16, with the driver's local-memory (spill) bytes.") + legend, ""]
    seen: set = set()  # inductor's kernels already dumped
    for kernel, base, pattern, arguments, n_out in cases:
        shapes = [(r, d, dt) for r, d in shapes_run for dt in DTYPES]
        inputs = {}
        for r, d, dt in shapes:
            x = torch.randn(r, d, device="cuda").to(dt)
            w = torch.randn(d, device="cuda").to(dt)
            inputs[r, d, dt] = arguments(x, w)
        header = "| variant | " + " | ".join(f"{r}x{d} {str(dt)[6:]}" for r, d, dt in shapes) + " | regs f32/bf16 |"
        lines += [f"### `{kernel}`", "", header, "| --- |" + " ---: |" * len(shapes) + " --- |"]
        nbytes = {k: sum(a.numel() * a.element_size() for a in v if isinstance(a, torch.Tensor))
                  + n_out * v[0].numel() * v[0].element_size() for k, v in inputs.items()}
        compiled = common.inductor(pattern)
        for key, a in inputs.items():
            _, code = run_and_get_code(compiled, *a)
            if args.dump_inductor:
                args.dump_inductor.mkdir(parents=True, exist_ok=True)
                stem = args.dump_inductor / f"{kernel}_{key[0]}x{key[1]}_{str(key[2])[6:]}"
                stem.with_suffix(".py").write_text("\n".join(code))
                stem.with_suffix(".config").write_text("\n".join(inductor_configs(seen)) + "\n")
        runs = {"inductor": compiled}
        for i, name in enumerate(names):
            op = runs[name] = variant_op(i, kernel, variants[name], base)
            for key, a in inputs.items():
                got, want = op(*a), pattern(*a)
                for g, w in zip(got if n_out > 1 else (got,), want if n_out > 1 else (want,)):
                    err = float((g.float() - w.float()).norm() / w.float().norm())
                    if not err <= TOL[key[2]]:
                        raise AssertionError(f"{name} {kernel} {key}: rel. err {err:.1e}")
        # Rounds with the order rotated each round by an equal share of the rows, so drift over the
        # run falls on every row alike.
        gbps = {name: {key: [] for key in inputs} for name in runs}
        order = list(runs)
        for r in range(args.rounds):
            shift = r * len(order) // args.rounds
            for name in order[shift:] + order[:shift]:
                for key, a in inputs.items():
                    ms = common.cuda_time_ms(lambda a=a, f=runs[name]: f(*a))
                    gbps[name][key].append(nbytes[key] / ms / 1e6)
        for i, name in enumerate(order):
            regs = "" if name == "inductor" else registers(f"fxkern_tune::{kernel}_{i - 1}")
            lines.append(f"| {name} | " + " | ".join(f"{statistics.median(v):.0f}" for v in gbps[name].values())
                         + f" | {regs} |")
            print(lines[-1], flush=True)
        lines.append("")
    common.emit(section, "\n".join(lines), args.section_out)


if __name__ == "__main__":
    main()
