"""The demo model (``python -m fxkern demo``'s Llama-style transformer) under every way of running it.

    python benchmarks/demo_model.py [--size base] [--dtype bfloat16] [--section-out FILE] [--profile]

Times, in one run on one GPU: eager; eager after ``fxkern.apply`` with the library rules;
``torch.compile`` (inductor, default mode); ``torch.compile(backend=fxkern.backend(rules))`` with
all library rules and with each rule that matched alone (which shows what each replacement costs
or gains inside inductor, where the alternative is inductor's own fusion rather than eager ops).
Writes the ``demo_model`` section of docs/benchmarks.md. ``--profile`` prints, for eager with and
without fxkern and for plain inductor and inductor with fxkern, the GPU time of each kernel over a
few forwards (torch.profiler), to see where each pair differs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cuda_time_ms, emit, kernel_profile, machine, today  # noqa: E402

import fxkern  # noqa: E402
import fxkern.library  # noqa: E402
from fxkern.demo import DTYPES, SIZES, build_model, compare, cuda_graph  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="base", choices=sorted(SIZES))
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--section-out", type=Path, default=None)
    p.add_argument("--profile", action="store_true", help="print per-kernel GPU time in eager and under inductor, each with and without fxkern")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    cfg, dtype, device = SIZES[args.size], DTYPES[args.dtype], torch.device("cuda")
    rules = fxkern.library.rules()
    model = build_model(cfg, device, dtype)
    ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), device=device)
    ep = torch.export.export(model, (ids,))
    report = fxkern.explain(ep, rules)
    rewritten = fxkern.apply(ep, rules).module()
    matched = sorted({m.rule for m in report.matches})
    with torch.no_grad():
        want = model(ids)

    def timed(name, fn):
        torch._dynamo.reset()
        with torch.no_grad():
            out = fn(ids)  # compiles, when it is compiled
            err = compare(out, want, dtype)
            ms = cuda_time_ms(lambda: fn(ids), warmup=3, reps=15, inner=3)
        print(f"{name:48s} {ms:8.3f} ms  rel err {err.rel:.1e}", flush=True)
        return name, ms, err

    kernel_us = {}
    if args.profile:
        for name, fn in (("eager", model), ("eager, fxkern.apply", rewritten), ("inductor", torch.compile(model)),
                         ("inductor + fxkern", torch.compile(model, backend=fxkern.backend(rules)))):
            torch._dynamo.reset()
            kernel_us[name] = kernel_profile(name, lambda fn=fn: fn(ids))

    rows = [timed("eager", model), timed("eager, fxkern.apply (library rules)", rewritten),
            timed("torch.compile (inductor)", torch.compile(model))]
    rows.append(timed("torch.compile + fxkern.backend (all library rules)",
                      torch.compile(model, backend=fxkern.backend(rules))))
    # The host's share gone: each eager forward captured in a CUDA graph and replayed.
    for name, fn in (("eager, CUDA graph", model), ("eager, fxkern.apply, CUDA graph", rewritten)):
        try:
            rows.append(timed(name, cuda_graph(fn, ids)))
        except Exception as exc:  # report, keep the other rows
            print(f"{name}: capture failed: {type(exc).__name__}: {exc}", flush=True)
    in_inductor = [n for n in matched if rules[n].irs is None or "inductor" in rules[n].irs]
    for name in in_inductor:
        one = fxkern.RuleSet(f"only {name}")
        one.add(rules[name])
        rows.append(timed(f"torch.compile + fxkern.backend (only {name})",
                          torch.compile(model, backend=fxkern.backend(one))))

    eager_ms, inductor_ms = rows[0][1], rows[2][1]
    body = [
        f"Machine: {machine()}. Date: {today()}. Command: `python benchmarks/demo_model.py --size {args.size} "
        f"--dtype {args.dtype}{' --profile' if args.profile else ''}`.",
        f"Model: the demo's Llama-style transformer, hidden {cfg.hidden}, {cfg.layers} layers, batch "
        f"{cfg.batch}x{cfg.seq}, {dtype}; matched rules: {', '.join(matched)} "
        f"({len(report.matches)} replacements). CUDA events, warm-up, median of 15. Library rules that run "
        f"inside inductor: {', '.join(in_inductor) or 'none'} (the others carry `irs=` without it: docs/library.md).",
        "",
        "| variant | ms / forward | vs eager | vs inductor | rel. err vs eager |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, ms, err in rows:
        body.append(f"| {name} | {ms:.3f} | {eager_ms / ms:.2f}x | {inductor_ms / ms:.2f}x | {err.rel:.1e} |")
    if kernel_us:
        body += ["", "GPU kernel time a forward (`--profile`, torch.profiler over 5 forwards): "
                 + ", ".join(f"{k} {v:.0f} us" for k, v in kernel_us.items()) + "."]
    emit("demo_model", "\n".join(body), args.section_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
