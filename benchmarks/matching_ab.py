"""The graph pass of benchmarks/matching.py timed for two checkouts of fxkern, alternated in one run.

A change to the pass (a new safety check, say) is measured against the commit before it on the
same machine at the same time: each round runs both checkouts, one process each, in turn, so a
VM's drift shows in both. The pass is what fxkern.backend runs inside torch.compile (match, checks,
rewrite), on the same graphs as matching.py's table.

    git worktree add /tmp/base <commit>
    python benchmarks/matching_ab.py /tmp/base [--rounds 2] [--sizes 10000 50000] [--section-out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

HERE = Path(__file__).resolve().parents[1]

# run inside each checkout: its own fxkern, its own matching.py
_CHILD = r"""
import json, statistics, sys
root = sys.argv[1]
sys.path[:0] = [root, root + "/benchmarks", root + "/tests"]
import matching, fxkern
rules = matching.fxkern_rules()
fxkern.apply(matching.build_graph(100), rules, ir="export")  # the patterns' traces, once a process
print(json.dumps({size: statistics.median(matching.run_fxkern_pass(matching.build_graph(size), rules)
                                          for _ in range(3)) for size in map(int, sys.argv[2:])}))
"""


def _time(root: Path, sizes: list[int]) -> dict[int, float]:
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", _CHILD, str(root), *map(str, sizes)],
                         check=True, capture_output=True, text=True, cwd=root).stdout
    return {int(k): v for k, v in json.loads(out.strip().splitlines()[-1]).items()}


def _rev(root: Path) -> str:
    return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip() or str(root)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path, help="a checkout of the commit to compare with")
    parser.add_argument("--sizes", type=int, nargs="+", default=[10000, 50000])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--section-out", type=Path, default=None)
    args = parser.parse_args(argv)
    runs: dict[str, list[dict[int, float]]] = {"base": [], "this": []}
    for _ in range(args.rounds):
        runs["base"].append(_time(args.base.resolve(), args.sizes))
        runs["this"].append(_time(HERE, args.sizes))
    names = {"base": _rev(args.base.resolve()), "this": _rev(HERE)}
    lines = [
        "## Matching and rewriting: the pass against an earlier commit (`benchmarks/matching_ab.py`)",
        "",
        f"Machine: {common.machine()}. Date: {common.today()}. Command: `python benchmarks/matching_ab.py <checkout of "
        f"{names['base']}> --rounds {args.rounds}`. The graph pass on matching.py's graphs (three rules), median of 3 "
        f"a process; each round runs {names['base']} then {names['this']}; seconds, each round's median and their range.",
        "",
        "| nodes | " + " | ".join(f"{names[k]} s" for k in runs) + f" | {names['this']} / {names['base']} |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for size in args.sizes:
        base = [r[size] for r in runs["base"]]
        this = [r[size] for r in runs["this"]]
        cell = lambda ts: f"{statistics.median(ts):.3f} ({min(ts):.3f}-{max(ts):.3f})"  # noqa: E731
        lines.append(f"| {size} | {cell(base)} | {cell(this)} | {statistics.median(this) / statistics.median(base):.2f}x |")
    common.emit("matching_ab", "\n".join(lines), args.section_out)


if __name__ == "__main__":
    main()
