"""Whether each rotary_strided variant issues a rotated item's six 16-byte loads (two of x, two of
cos, two of sin) before it uses any of their data, read from the SASS this machine's NVRTC makes.

    python tools/rope_loads.py [--only TEXT]...

A kernel that uses the first loads' data before issuing the last ones waits for two trips to memory
an item instead of one (2026-11-26: the bfloat16 kernel at 50 registers did, 2-5% slower on an H200;
docs/benchmarks.md "rope_loads_h200"). Variants are benchmarks/rope_tuning.py's.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


def early_uses(code: list[str]) -> tuple[int, int]:
    """(span, uses): lines from the first to the last of the kernel's last six LDG.E.128 (the rotated
    item's; the pass columns' come first), and instructions among them reading a register those loads wrote."""
    loads = [k for k, c in enumerate(code) if "LDG.E.128" in c]
    six = loads[-6:]
    written: set[str] = set()
    uses = 0
    for line in code[six[0]:six[-1] + 1]:
        m = re.search(r"LDG\.E\.128 R(\d+)", line)
        if m:
            written |= {f"R{int(m.group(1)) + k}" for k in range(4)}
            continue
        operands = line.split(" ", 1)[1] if " " in line else ""
        sources = operands.split(",", 1)[1] if "," in operands else ""
        uses += any(re.search(rf"\b{r}\b", sources) for r in written)
    return six[-1] - six[0], uses


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", default=[])
    args = parser.parse_args(argv)
    import fxkern
    import fxkern.library
    import kernel_resources
    import rope_tuning
    import same_sass
    from fxkern import ops
    from fxkern.library import rotary

    fxkern.library.rules()
    tool = same_sass.nvdisasm()
    arch = ops.registration_arch(rotary.ROTARY_STRIDED)
    for i, (label, v) in enumerate(rope_tuning.VARIANTS.items()):
        if i and args.only and not any(t in label for t in args.only):
            continue
        rope_tuning.variant_op(label, v, 700 + i)
        entry = fxkern.kernel_op(f"fxkern_tune::rope_{700 + i}")
        registers = {u.kernel: u.registers for u in kernel_resources.usage(entry)}
        cubin = ops.compile_plan(entry.plan, entry.source, arch).cubin
        for name, code in same_sass.functions(cubin, tool).items():
            span, uses = early_uses(code)
            print(f"{same_sass.kernel_name(name):32s} {registers.get(name, '?'):>3} registers, six loads over "
                  f"{span:2d} instructions, {uses:2d} uses of their data before the last: {label[:60]}")


if __name__ == "__main__":
    main()
