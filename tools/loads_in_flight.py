"""How many global loads each library kernel has in flight a thread, on a machine with no GPU:

    python tools/loads_in_flight.py [PATTERN] [--below N]

A memory-bound kernel keeps memory busy only with enough loads in flight; a thread that waits for
one load before it issues the next leaves the GPU mostly idle (the softmax's EDGES kernels padded
each pack beside its load, and nvcc waited for each pack before loading the next: bfloat16 rows of
1001 ran at 2540 GB/s so, at 3917 with the loads issued together; H200, 2026-11-28).

Compiles every op of fxkern.library whose name matches PATTERN (a regular expression; default: all)
as registration does, disassembles each kernel with nvdisasm (as ``tools/same_sass.py`` does) and
walks its instructions in order: each global load (``LDG``) is outstanding from its issue until an
instruction reads or overwrites one of its registers, the point where the thread waits for it.
Prints, per kernel instantiation, its 16-byte loads and the most of them outstanding at once
(``in flight``), and the same for all global loads. The walk is straight through the code, not along
its branches, so it reads the vectorised paths' unrolled blocks as the GPU runs them and a scalar
path's loops only roughly: a number to compare between kernels and variants, not a proof.
``--below N``: only the kernels whose 16-byte loads never reach N outstanding. Exit status 0.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from same_sass import ROOT, dump, functions, kernel_name, nvdisasm  # noqa: E402

_REG = re.compile(r"(?<![\w.])R(\d+)((?:\.\w+)*)")
_WIDTH = {"128": 4, "64": 2}
_NO_DEST = ("STG", "ST", "STS", "STL", "RED", "BRA", "EXIT", "BAR", "BSSY", "BSYNC", "CALL", "RET")


@dataclass
class Loads:
    """One kernel's global loads: how many, and the most outstanding at once."""

    wide: int = 0          # 16-byte loads
    wide_in_flight: int = 0
    all: int = 0
    all_in_flight: int = 0


def _registers(operand: str, width: int = 1) -> set[int]:
    """The registers an operand names: ``R16.64`` is R16 and R17; ``RZ`` none."""
    regs = set()
    for m in _REG.finditer(operand):
        n = int(m.group(1))
        w = 2 if ".64" in m.group(2) else width
        regs.update(range(n, n + w))
    return regs


def loads_in_flight(instructions: list[str]) -> Loads:
    """``instructions`` (``same_sass.functions``' text) walked in order: see the module docstring."""
    out = Loads()
    pending: list[tuple[set[int], bool]] = []  # each outstanding load's registers, and whether it is 16-byte
    for ins in instructions:
        text = re.sub(r"^@!?U?P[T\d]\s+", "", ins.rstrip(" ;"))
        opcode, _, rest = text.partition(" ")
        operands = [o.strip() for o in rest.split(",")] if rest else []
        base = opcode.split(".")[0]
        is_load = base == "LDG"
        dest: set[int] = set()
        sources = operands
        if operands and base not in _NO_DEST and _REG.match(operands[0]):
            width = next((w for k, w in _WIDTH.items() if f".{k}" in opcode), 1) if is_load else 1
            dest, sources = _registers(operands[0], width), operands[1:]
        read = set().union(*(_registers(o) for o in sources)) if sources else set()
        touched = read | dest
        waited = [p for p in pending if p[0] & touched]
        if waited:
            out.wide_in_flight = max(out.wide_in_flight, sum(1 for _, wide in pending if wide))
            out.all_in_flight = max(out.all_in_flight, len(pending))
            pending = [p for p in pending if not p[0] & touched]
        if is_load:
            wide = ".128" in opcode
            pending.append((dest, wide))
            out.all += 1
            out.wide += wide
    if pending:
        out.wide_in_flight = max(out.wide_in_flight, sum(1 for _, wide in pending if wide))
        out.all_in_flight = max(out.all_in_flight, len(pending))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pattern", nargs="?", default="", help="regular expression on the op's name")
    parser.add_argument("--below", type=int, default=0, metavar="N",
                        help="only kernels whose 16-byte loads never reach N outstanding")
    args = parser.parse_args(argv)
    tool = nvdisasm()
    with tempfile.TemporaryDirectory(prefix="fxkern-loads-") as tmp:
        dump(ROOT, Path(tmp))
        rows = []
        for cubin in sorted(Path(tmp).glob("*.cubin")):
            op = cubin.stem.replace("__", "::", 1)
            if not re.search(args.pattern, op):
                continue
            for mangled, instructions in sorted(functions(cubin.read_bytes(), tool).items()):
                loads = loads_in_flight(instructions)
                if args.below and (not loads.wide or loads.wide_in_flight >= args.below):
                    continue
                rows.append((op, kernel_name(mangled), loads))
    print(f"{'op':52} {'kernel':44} {'16-byte loads':>13} {'in flight':>9} {'all loads':>9} {'in flight':>9}")
    for op, kernel, n in rows:
        print(f"{op:52} {kernel:44} {n.wide:13} {n.wide_in_flight:9} {n.all:9} {n.all_in_flight:9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
