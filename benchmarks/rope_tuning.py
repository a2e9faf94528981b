"""The rotary embedding kernel (``fxkern.library.rotary``) against variants of itself and inductor.

    python benchmarks/rope_tuning.py [--rounds 3] [--section-out FILE]

transformers' ``apply_rotary_pos_emb`` on queries as attention projects them (``(b, s, h * d)`` viewed
``(b, h, s, d)``, read in place) and on contiguous ones, cos and sin ``(1, 1, s, d)``. GB/s of useful
bytes (queries, cos, sin and output once each), CUDA events around 10 back-to-back calls, the GPU
kept busy by an untimed call before each sample, median of 20, then the median over rounds (the
order rotated each round).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402

# (batch, sequence, heads, head size, projected): 16384x8192 elements, and the demo model's queries.
SHAPES = ((16, 2048, 32, 128, True), (16, 2048, 32, 128, False), (8, 512, 32, 64, True))
DTYPES = (torch.float32, torch.bfloat16)

# Measured before 2026-11-25 04:00 UTC, when the kernel read x contiguous or as the projection's
# transpose only (the published table's rows): the output's row order, 2 and 4 items in flight,
# divisions by multiply-high and shift, each 0-10% slower than the shipped kernel or level with it.
# Measured 2026-11-25 00:40 UTC (H200) and not shipped: a thread per (position, pack column, group of
# heads) that reads cos and sin once and rotates 2-8 heads' rows with them (2, 4 or 8 heads' loads
# in flight, 4096-16384 elements a block): 3959-3987 GB/s at 16x32x2048x128 projected float32,
# against the shipped kernel's 4039 and inductor's 4190 in the same run.

# A variant: source edits ((old, new) pairs), macros, and the elements a 128-thread block takes.
SHIPPED = {"edits": (), "macros": "", "per_block": 4096}
VARIANTS: dict[str, dict] = {
    "shipped (x read in place at its strides, 4096 a block, 16-bit pairs)": SHIPPED,
    "16-bit on the float path": {**SHIPPED, "macros": "#define FXK_ROPE_PAIRS 0\n"},
    "2048 a block": {**SHIPPED, "per_block": 2048},
    "8192 a block": {**SHIPPED, "per_block": 8192},
    "16384 a block": {**SHIPPED, "per_block": 16384},
}


def variant_op(label: str, v: dict, index: int):
    """The variant as a callable ``(x, cos, sin, half)``: the library's eager path (checks, tables
    narrowed, x read in place) over the variant's kernel."""
    import fxkern
    from fxkern.library import rotary
    from fxkern.symbolic import cdiv

    source = rotary.SOURCE
    for old, new in v["edits"]:
        if old not in source:
            raise SystemExit(f"variant {label!r}: {old!r} is not in rotary.SOURCE any more; update the variant")
        source = source.replace(old, new)

    def geometry(inputs, outputs, per=v["per_block"]):
        return (cdiv(outputs[0].numel(), per),), (128,)

    spec = dataclasses.replace(rotary.ROTARY_STRIDED, kernel_source=v["macros"] + source,
                               geometry=fxkern.Custom(geometry))
    name = f"fxkern_tune::rope_{index}"
    fxkern.cuda_kernel_op(name, spec, meta_fn=rotary._strided_output, schema=rotary._STRIDED_SCHEMA)
    return rotary._eager(name, fxkern.kernel_op(name).cuda_impl, rotary._output, True)


def main(argv=None) -> None:
    args = common.tuning_args("rope_tuning", "Rotary embedding tuning", __doc__, argv)
    if args is None:
        return
    import fxkern.library
    from fxkern.library import rotary

    fxkern.library.rules()
    torch.manual_seed(0)
    fns = {label: variant_op(label, v, i) for i, (label, v) in enumerate(VARIANTS.items())}
    compiled = common.inductor(rotary.rotary_embedding)
    cases = []
    for b, s, h, d, projected in SHAPES:
        for dt in DTYPES:
            x = torch.randn(b, s, h * d, device="cuda").to(dt).view(b, s, h, d).transpose(1, 2)
            if not projected:
                x = x.contiguous()
            pos = torch.arange(s, device="cuda", dtype=torch.float32)[:, None]
            emb = pos * (1.0 / 10000 ** (torch.arange(0, d, 2, device="cuda") / d))[None]
            emb = torch.cat((emb, emb), -1)[None, None]
            cos, sin = emb.cos().to(dt), emb.sin().to(dt)
            want = rotary.rotary_embedding(x, cos, sin, d // 2)
            for label, fn in fns.items():
                if not label.startswith("("):
                    torch.testing.assert_close(fn(x, cos, sin, d // 2), want, rtol=0, atol=0)
            compiled(x, cos, sin, d // 2)
            name = f"{b}x{h}x{s}x{d} {'projected' if projected else 'contiguous'} {str(dt)[6:]}"
            cases.append((name, (x, cos, sin, d // 2)))
    runners = {"inductor": compiled, **fns}
    table = common.bandwidth_rows(
        runners, [(call, 2 * call[0].numel() * call[0].element_size() + 2 * call[1].numel() * call[1].element_size())
                  for _, call in cases], args.rounds)
    lines = [
        "## Rotary embedding tuning (`fxkern.library.rotary`)",
        "",
        f"Machine: {common.machine()}. Date: {common.today()}. Command: `python benchmarks/rope_tuning.py "
        f"--rounds {args.rounds}`.",
        "",
        " ".join(__doc__.split("\n\n")[2].split()),
        "",
        "| variant | " + " | ".join(name for name, _ in cases) + " |",
        "| --- | " + " | ".join("---:" for _ in cases) + " |",
    ]
    for label, gbs in table.items():
        lines.append(f"| {label} | " + " | ".join(f"{g:.0f}" for g in gbs) + " |")
    common.emit("rope_tuning", "\n".join(lines), args.section_out)


if __name__ == "__main__":
    main()
