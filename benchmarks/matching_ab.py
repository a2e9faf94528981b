"""The graph pass of benchmarks/matching.py timed for two checkouts of fxkern, alternated in one run.

A change to the pass (a new safety check, say) is measured against the commit before it on the
same machine at the same time: each round runs both checkouts, one process each, in turn, so a
VM's drift shows in both. The pass is what fxkern.backend runs inside torch.compile (match, checks,
rewrite), on the same graphs as matching.py's table, and with ``--llama-layers`` the library's rules
on matching.py's transformers Llama exports (exported once here, loaded by both checkouts).

    git worktree add /tmp/base <commit>
    python benchmarks/matching_ab.py /tmp/base [--rounds 2] [--sizes 10000 50000] [--llama-layers 100 400]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

HERE = Path(__file__).resolve().parents[1]

# run inside each checkout: its own fxkern, its own matching.py
_CHILD = r"""
import copy, json, statistics, sys, time
root = sys.argv[1]
sys.path[:0] = [root, root + "/benchmarks", root + "/tests"]
import torch, matching, fxkern
from fxkern import library, rewrite
rules = matching.fxkern_rules()
fxkern.apply(matching.build_graph(100), rules, ir="export")  # the patterns' traces, once a process
times = {arg: statistics.median(matching.run_fxkern_pass(matching.build_graph(int(arg)), rules) for _ in range(3))
         for arg in sys.argv[2:] if arg.isdigit()}
if any(not arg.isdigit() for arg in sys.argv[2:]):
    import transformers.modeling_outputs  # registers the output classes the saved programs name
programs = {arg: torch.export.load(arg) for arg in sys.argv[2:] if not arg.isdigit()}
lib = library.rules()
for i, (path, ep) in enumerate(programs.items()):
    if i == 0:
        fxkern.apply(ep, lib)
    runs = []
    for _ in range(3):
        gm = copy.deepcopy(ep.graph_module)
        t0 = time.perf_counter()
        rewrite.rewrite_graph(gm.graph, lib, rewrite.EXPORT_IRS)
        runs.append(time.perf_counter() - t0)
    times[path] = statistics.median(runs)
print(json.dumps(times))
"""


def _time(root: Path, args: list[str]) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", _CHILD, str(root), *args],
                         check=True, capture_output=True, text=True, cwd=root).stdout
    return json.loads(out.strip().splitlines()[-1])


def _rev(root: Path) -> str:
    return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip() or str(root)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path, help="a checkout of the commit to compare with")
    parser.add_argument("--sizes", type=int, nargs="+", default=[10000, 50000])
    parser.add_argument("--llama-layers", type=int, nargs="*", default=[])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--section-out", type=Path, default=None)
    args = parser.parse_args(argv)
    import matching
    import torch

    tmp = tempfile.TemporaryDirectory()
    rows = [(f"{size} nodes (three rules)", str(size)) for size in args.sizes]
    for layers in args.llama_layers:
        ep = matching.llama_program(layers)
        path = f"{tmp.name}/llama{layers}.pt2"
        torch.export.save(ep, path)
        rows.append((f"Llama, {layers} layers, {len(ep.graph.nodes)} nodes (library)", path))
    runs: dict[str, list[dict[str, float]]] = {"base": [], "this": []}
    for _ in range(args.rounds):
        runs["base"].append(_time(args.base.resolve(), [key for _, key in rows]))
        runs["this"].append(_time(HERE, [key for _, key in rows]))
    names = {"base": _rev(args.base.resolve()), "this": _rev(HERE)}
    lines = [
        "## Matching and rewriting: the pass against an earlier commit (`benchmarks/matching_ab.py`)",
        "",
        f"Machine: {common.machine()}. Date: {common.today()}. Command: `python benchmarks/matching_ab.py <checkout of "
        f"{names['base']}> --rounds {args.rounds}"
        + (f" --llama-layers {' '.join(map(str, args.llama_layers))}" if args.llama_layers else "")
        + f"`. The graph pass on matching.py's graphs (its three rules; the library's on its Llama exports, in the "
        f"IRs `apply(ep)` looks in), median of 3 a process; each round runs {names['base']} then {names['this']}; "
        f"seconds, each round's median and their range.",
        "",
        "| graph | " + " | ".join(f"{names[k]} s" for k in runs) + f" | {names['this']} / {names['base']} |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for label, key in rows:
        base = [r[key] for r in runs["base"]]
        this = [r[key] for r in runs["this"]]
        cell = lambda ts: f"{statistics.median(ts):.3f} ({min(ts):.3f}-{max(ts):.3f})"  # noqa: E731
        lines.append(f"| {label} | {cell(base)} | {cell(this)} | {statistics.median(this) / statistics.median(base):.2f}x |")
    common.emit("matching_ab", "\n".join(lines), args.section_out)


if __name__ == "__main__":
    main()
