"""Shared benchmark plumbing: CUDA-event timing with warm-up and medians, machine description,
and writing a named section of docs/benchmarks.md."""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import re
import time
from pathlib import Path
from typing import Callable

import torch

from fxkern.demo import cuda_time_ms as _cuda_time_ms

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


def cuda_time_ms(fn: Callable[[], object], *, warmup: int = 5, reps: int = 20, inner: int = 10,
                 lead: bool = True) -> float:
    """Median milliseconds per call of ``fn`` with CUDA events: fxkern.demo's timer, with more samples."""
    return _cuda_time_ms(fn, warmup=warmup, reps=reps, inner=inner, lead=lead)


def tuning_args(section: str, title: str, doc: str, argv=None,
                extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace | None:
    """A tuning benchmark's ``--rounds`` and ``--section-out`` (and what ``extra`` adds to the parser);
    None, after saying so, on a machine without a GPU (docs/benchmarks.md keeps the section measured on one)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    if extra:
        extra(parser)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--section-out", type=Path, default=None)
    parser.add_argument("--only", action="append", default=[], metavar="TEXT",
                        help="time only the variants whose label contains TEXT (repeatable); the first "
                             "variant, the shipped kernel, always runs")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{title}: no GPU on this machine, nothing measured (run it on the device: tools/gpu_suite.sh)")
        return None
    return args


def pick(variants: dict, args: argparse.Namespace) -> list[tuple[int, str, object]]:
    """``(index, label, variant)`` of the ``variants`` to time: the first (the shipped kernel) and every
    one whose label contains one of ``args.only``, all of them without ``--only``. The index is the
    variant's place in ``variants``, so its ops keep their names whichever are picked."""
    return [(i, label, v) for i, (label, v) in enumerate(variants.items())
            if not args.only or i == 0 or any(t in label for t in args.only)]


def command(script: str, args: argparse.Namespace) -> str:
    """The command line a tuning section names: ``script`` with its ``--rounds``, ``--only``, ``--scale`` and
    ``--shape``."""
    scale = f" --scale {args.scale!r}" if getattr(args, "scale", 0.125) != 0.125 else ""
    shapes = "".join(f" --shape {','.join(map(str, s))}" for s in getattr(args, "shape", None) or ())
    return (f"python benchmarks/{script} --rounds {args.rounds}" + "".join(f" --only {t!r}" for t in args.only)
            + scale + shapes)


def bandwidth_rows(runners: dict[str, Callable[..., object]], cases: list[tuple[tuple, int]],
                   rounds: int) -> dict[str, list[float]]:
    """Useful GB/s of each runner on each case (its arguments, its bytes moved): the median of
    ``rotated_rounds``, one list per runner in the cases' order."""
    table: dict[str, list[float]] = {label: [] for label in runners}
    for call, nbytes in cases:
        samples = rotated_rounds({label: (lambda fn=fn: fn(*call)) for label, fn in runners.items()}, rounds)
        for label in runners:
            table[label].append(nbytes / (statistics.median(samples[label]) * 1e-3) / 1e9)
    return table


def apply_edits(source: str, edits, label: str, where: str, fill: Callable[[str], str] = lambda new: new) -> str:
    """A tuning variant's kernel source: ``source`` with each ``(old, new)`` of ``edits`` made (``fill``
    applied to ``new`` first). An old text no longer there stops the run, naming the variant: the shipped
    kernel changed since the variant was written."""
    for old, new in edits:
        if old not in source:
            raise SystemExit(f"variant {label!r}: {old!r} is not in {where} any more; update the variant")
        source = source.replace(old, fill(new))
    return source


def shape_cases(shapes: list[tuple[int, int]], dtypes: list[torch.dtype],
                make: Callable[[int, int, torch.dtype], tuple[tuple, int]]) -> tuple[list[tuple[tuple, int]], list[str]]:
    """A tuning benchmark's cases (``make(rows, d, dtype)``: a call's arguments and the bytes it moves)
    for each shape in each dtype, and their columns' names (``"{rows}x{d} {dtype}"``)."""
    cases = [make(rows, d, dt) for rows, d in shapes for dt in dtypes]
    return cases, [f"{rows}x{d} {str(dt)[6:]}" for rows, d in shapes for dt in dtypes]


def checked_variants(pattern: Callable, variants: dict, variant_op: Callable, cases: list[tuple[tuple, int]],
                     columns: list[str], tol: dict, args: argparse.Namespace) -> dict[str, list[float]]:
    """A tuning benchmark's table: inductor's and each picked variant's (``pick``; ``variant_op(index,
    label, variant)`` makes it callable) useful GB/s on ``cases`` (``bandwidth_rows``), a row printed
    each. Every variant is checked against ``pattern`` on every case first: its relative norm error
    within ``tol`` of the first argument's dtype, or the run stops naming it."""
    runners = {"inductor": inductor(pattern)}
    for index, label, variant in pick(variants, args):
        op = runners[label] = variant_op(index, label, variant)
        for call, _ in cases:
            got, want = op(*call), pattern(*call)
            err = float((got.float() - want.float()).norm() / want.float().norm())
            if not err <= tol[call[0].dtype]:
                raise SystemExit(f"{label} at {tuple(call[0].shape)} {call[0].dtype}: rel. err {err:.1e} against the pattern")
    table = bandwidth_rows(runners, cases, args.rounds)
    for label, gbs in table.items():
        print(f"{label}: " + ", ".join(f"{c} {g:.0f}" for c, g in zip(columns, gbs)), flush=True)
    return table


def rotated_rounds(runners: dict[str, Callable[[], object]], rounds: int, **timer) -> dict[str, list[float]]:
    """Milliseconds per call of each runner (``cuda_time_ms`` with ``timer``'s options), one sample a
    round, the runners one after another in an order rotated each round: none always runs first or
    after the same neighbour."""
    samples: dict[str, list[float]] = {label: [] for label in runners}
    order = list(runners.items())
    for r in range(rounds):
        k = r % len(order)
        for label, fn in order[k:] + order[:k]:
            samples[label].append(cuda_time_ms(fn, **timer))
    return samples


def inductor(pattern: Callable) -> Callable:
    """``pattern`` under torch.compile (inductor, default mode) with a static kernel for every shape it
    meets. Dynamo caches per function, so without ``dynamic=False`` the second shape a benchmark runs
    the same pattern at is compiled once for any shape (automatic dynamic), a slower kernel than a
    model that only ever meets that shape would get: the comparison a user would make is the static one.
    Each shape and dtype is then a cache entry of its own, so past dynamo's recompile limit a call would
    quietly run eager: the limit is raised, and hitting it raises."""
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
    if hasattr(dynamo_config, "fail_on_recompile_limit_hit"):
        dynamo_config.fail_on_recompile_limit_hit = True
    return torch.compile(pattern, dynamic=False)


def host_us(fn: Callable[[], object], burst: int = 200, rounds: int = 200) -> float:
    """Host microseconds per call: bursts short enough that the GPU queue never pushes back, best of many."""
    best = float("inf")
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(burst):
            fn()
        best = min(best, (time.perf_counter() - t0) / burst * 1e6)
    torch.cuda.synchronize()
    return best


def kernel_profile(name: str, fn: Callable[[], object], steps: int = 5, top: int = 30, ops: int = 0) -> float:
    """Print the GPU time of each kernel (microseconds a call) over ``steps`` calls of ``fn`` after
    warm-up (torch.profiler), to see where two ways of running the same model differ; return the total.
    ``ops``: also the aten ops that launched the most GPU time, with their input shapes, to name the
    op behind an anonymous kernel (a copy: which reshape or contiguous made it)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if ops else [])
    with torch.no_grad():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=activities, record_shapes=bool(ops)) as prof:
            for _ in range(steps):
                fn()
            torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in events) / steps
    print(f"\n{name}: {total:.0f} us of kernels a call", flush=True)
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:top]:
        print(f"  {e.self_device_time_total / steps:8.1f} us  x{e.count // steps:<3d} {e.key[:110]}", flush=True)
    if ops:
        # device time of an aten op includes its children's: a reshape's copy shows under both
        launched = [e for e in prof.key_averages(group_by_input_shape=True)
                    if e.device_type == torch.autograd.DeviceType.CPU and e.key.startswith("aten::")
                    and e.device_time_total > 0]
        print(f"{name}: aten ops by the GPU time they launched (children included)", flush=True)
        for e in sorted(launched, key=lambda e: -e.device_time_total)[:ops]:
            print(f"  {e.device_time_total / steps:8.1f} us  x{e.count // steps:<3d} {e.key:<28} {e.input_shapes}"[:220],
                  flush=True)
    return total


def machine() -> str:
    parts = [f"{platform.node() or 'host'}", f"Python {platform.python_version()}", f"torch {torch.__version__}"]
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        parts.insert(0, f"{torch.cuda.device_count()}x {p.name} ({p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB)")
    else:
        parts.insert(0, f"CPU only ({platform.processor() or platform.machine()})")
    return ", ".join(parts)


def today() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def write_section(name: str, body: str, path: Path = DOC) -> None:
    """Replace (or append) the section between ``<!-- name:start -->`` and ``<!-- name:end -->``."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{body.strip()}\n{end}"
    text = path.read_text() if path.exists() else "# fxkern benchmarks\n"
    if start in text:
        text = re.sub(re.escape(start) + r".*?" + re.escape(end), lambda m: block, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def variant_section(title: str, script: str, args: argparse.Namespace, doc: str, columns: list[str],
                    table: dict[str, list[float]], extra: "tuple[str, dict[str, str]] | None" = None) -> str:
    """A tuning benchmark's section: ``title``, machine, date and command (``command(script, args)``),
    ``doc``'s third paragraph, then a row of GB/s a variant (``table``) over ``columns``; ``extra``
    adds a last column (its header, and a value a variant)."""
    head, values = extra or (None, {})
    lines = [
        f"## {title}",
        "",
        f"Machine: {machine()}. Date: {today()}. Command: `{command(script, args)}`.",
        "",
        " ".join(doc.split("\n\n")[2].split()),
        "",
        "| variant | " + " | ".join(columns) + (f" | {head}" if head else "") + " |",
        "| --- | " + " | ".join("---:" for _ in columns) + (" | ---" if head else "") + " |",
    ]
    for label, gbs in table.items():
        last = f" | {values.get(label, '')}" if head else ""
        lines.append(f"| {label} | " + " | ".join(f"{g:.0f}" for g in gbs) + last + " |")
    return "\n".join(lines)


def emit(name: str, body: str, section_out: "Path | None") -> None:
    """Print a benchmark's section, and write it to ``section_out`` or into docs/benchmarks.md."""
    print(body)
    if section_out:
        section_out.write_text(body + "\n")
    else:
        write_section(name, body)
