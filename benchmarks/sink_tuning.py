"""GPT-OSS's attention with sinks (``fxkern.library.softmax``) against variants of itself and inductor.

    python benchmarks/sink_tuning.py [--rounds 3] [--shape B,H,S ...] [--section-out FILE]

transformers' GPT-OSS eager attention (its default: no SDPA takes sinks): ``scores * 0.125`` plus the
(b, 1, q, k) causal mask, one sink logit a head concatenated to every row, the row's max subtracted, a
softmax in the scores' dtype, the sinks' column dropped. Each variant runs on the grids the library
picks (``softmax._grid``); the library's choice first. GB/s of useful bytes (scores, mask and output
once each), CUDA events around 10 back-to-back calls, the GPU kept busy by an untimed call before
each sample, median of 20, then the median over rounds (the order rotated each round); registers a
thread per grid, float32/bfloat16. Default shapes: rows of 8192 keys (the pieces ``fxkern.split`` cuts
a 32-head call into) and of 1001 (a prompt of odd length: the EDGES kernels).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from masked_tuning import compare_variants, shape_option  # noqa: E402

SCALE = 0.125
SHAPES = [(1, 16, 8192), (4, 32, 1001)]


def _variant(edits=(), **tuning) -> dict:
    """A variant: the grids of MASKED_TUNING (the sink kernel's until 2026-11-28) changed as ``tuning`` says,
    and ``edits`` to softmax.SOURCE."""
    from fxkern.library import softmax

    return {"tuning": {**softmax.MASKED_TUNING, **tuning}, "edits": edits}


def _as_masked(**changes) -> dict:
    """The scaled, masked kernel's tuning (softmax.MASKED_LONG_TUNING, the sink kernel's own) changed as
    ``changes`` says."""
    from fxkern.library import softmax

    return {"tuning": {**softmax.MASKED_LONG_TUNING, **changes}, "edits": ()}


# The sink kernel takes the scaled, masked kernel's tuning (softmax.MASKED_LONG_TUNING) since 2026-11-28
# 19:16 UTC. H200, 19:03 UTC, GB/s float32 / bfloat16, 1x16x8192x8192 and 4x32x1001x1001 (section
# sink_tuning_h200_1128 of docs/benchmarks.md): that tuning 3791 / 3353 and 3359 / 2419 against
# MASKED_TUNING's 2774 / 2873 and 3358 / 2111; long rows fetched first alone 3791 / 3352 and 3359 / 2111;
# the 16-bit EDGES small blocks made as loads arrive alone 2778 / 2870 and 3358 / 2418.
VARIANTS: dict[str, dict] = {
    "shipped": _as_masked(),
    "MASKED_TUNING (shipped until 2026-11-28 19:16 UTC)": _variant(),
    "long rows fetched first only": _as_masked(edges_fetch_first=None),
    "16-bit EDGES small blocks made as loads arrive only": _variant(
        edges_fetch_first=("_short_32bit", "_4packs_2048_32bit")),
}


def _sinks(b: int, h: int, s: int, dt: torch.dtype) -> tuple:
    """The call's arguments after the scores and the mask: one sink logit a head, the scale, batch, queries."""
    return torch.randn(h, device="cuda").to(dt), SCALE, b, s


def main(argv=None) -> None:
    args = common.tuning_args("sink_tuning", "Sink softmax tuning", __doc__, argv, extra=shape_option)
    if args is None:
        return
    from fxkern.library import softmax

    args.shape = args.shape or SHAPES
    compare_variants(VARIANTS, softmax.SINK_MASKED_SOFTMAX, softmax.sink_masked_softmax, _sinks, x_scale=3.0,
                     prefix="sink", section="sink_tuning", script="sink_tuning.py", args=args, doc=__doc__,
                     title="Sink softmax tuning (`fxkern.library.softmax`, GPT-OSS's eager attention)")


if __name__ == "__main__":
    main()
