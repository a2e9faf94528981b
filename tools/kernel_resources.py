"""Registers, spills and stack of each library kernel, on a machine with no GPU:

    python tools/kernel_resources.py [PATTERN] [--spills]

Compiles every op of fxkern.library whose name matches PATTERN (a regular expression; default:
all) as registration does, for sm_90 or $FXKERN_ARCH, with ptxas's report on (NVRTC's
``--ptxas-options=-v``), and prints one line per kernel instantiation: registers a thread, spill
stores and loads, stack frame and static shared memory. ptxas fixes these numbers, so they are the
ones the driver reports on the device (the tuning benchmarks' "registers" column): a variant whose
launch bounds leave it too few registers shows its spill here before any device time is spent.
``--spills``: only the kernels that spill. Exit status 0.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from same_sass import kernel_name  # noqa: E402

_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


@dataclass
class Usage:
    """ptxas's report for one kernel."""

    kernel: str  # mangled
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack: int = 0
    smem: int = 0

    @property
    def spills(self) -> bool:
        return bool(self.spill_stores or self.spill_loads)


def parse(log: str) -> list[Usage]:
    """Each kernel's usage from an NVRTC log compiled with ``--ptxas-options=-v``, in compile order."""
    out: list[Usage] = []
    for line in log.splitlines():
        m = _ENTRY.search(line)
        if m:
            out.append(Usage(m.group(1)))
            continue
        if not out:
            continue
        if m := _FRAME.search(line):
            out[-1].stack, out[-1].spill_stores, out[-1].spill_loads = map(int, m.groups())
        if m := _USED.search(line):
            out[-1].registers = int(m.group(1))
            smem = _SMEM.search(line)
            out[-1].smem = int(smem.group(1)) if smem else 0
    return out


def report_options() -> tuple[str, ...]:
    """NVRTC options that put ptxas's report in the log. NVRTC 12.9 and newer keep compiled code in
    a cache of their own across compiles in one process, and a kernel served from it gets no report:
    ``--no-cache`` makes ptxas run (and report) every time."""
    from fxkern import compiler

    return ("--ptxas-options=-v",) + (("--no-cache",) if compiler.nvrtc_version() >= (12, 9) else ())


def usage(entry) -> list[Usage]:
    """ptxas's report for each kernel of a registered op, compiled as its registration compiles it."""
    from fxkern import ops

    arch = ops.registration_arch(entry.spec)
    return parse(ops.compile_plan(entry.plan, entry.source, arch, extra_options=report_options()).log)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pattern", nargs="?", default="", help="regular expression on op names (default: all)")
    parser.add_argument("--spills", action="store_true", help="only the kernels that spill")
    args = parser.parse_args(argv)
    import fxkern.library
    from fxkern import ops

    fxkern.library.rules()
    entries = [e for e in ops.registered_ops()
               if e.qualname.startswith("fxkern_lib::") and re.search(args.pattern, e.qualname)]
    if not entries:
        raise SystemExit(f"no library op matches {args.pattern!r}")
    print(f"{'op':<52} {'kernel':<44} {'regs':>4} {'spill st/ld':>11} {'stack':>5} {'smem':>5}")
    for entry in sorted(entries, key=lambda e: e.qualname):
        for u in usage(entry):
            if args.spills and not u.spills:
                continue
            spill = f"{u.spill_stores}/{u.spill_loads}" if u.spills else "-"
            print(f"{entry.qualname:<52} {kernel_name(u.kernel):<44} {u.registers:>4} {spill:>11} {u.stack:>5} {u.smem:>5}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
