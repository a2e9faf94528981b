"""Cohere's plain LayerNorm (``fxkern.library.layernorm.cohere_layer_norm``) against variants of itself and inductor.

    python benchmarks/cohere_tuning.py [--rounds 3] [--only TEXT] [--section-out FILE]

transformers' ``CohereLayerNorm`` (mean, centred variance, the weight multiplied in float32, no bias) on
rows of one tensor: the embeddings' norm. The op runs the two-read kernel on long rows (float32 rows
of 4096+, 16-bit rows of 8192+: ``layernorm.COHERE_TWO_READ``) and the register-resident kernel on the
others; the variants are the two-read kernel at other tunings and with other ways of reducing a row's
moments, and the register-resident kernel on every row. Each is checked against the pattern first.

GB/s of useful bytes (the row and the weight read once, the output written once), CUDA events around
10 back-to-back calls, the GPU kept busy by an untimed call before each sample, median of 20, then
the median over rounds (the order rotated each round); inductor (``torch.compile(pattern,
dynamic=False)``, default mode) in the same run. Two-read tunings: threads a block (t), 16-byte packs
a thread reads a step (p), blocks resident per SM (b), the same in every dtype.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402

SHAPES = [(16384, 8192), (8192, 4096), (4096, 16384)]
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}

# The block's moments in one barrier: each warp's exactly (its threads' sums and centred squares, plus
# each thread's count times its mean's squared distance from the warp's), then the block's from the
# warps' the same way.
_WARP_MOMENTS = (
    ("red[2][3][", "red[2][4]["),
    ("(*red)[3][", "(*red)[4]["),
    (
        "        sum = warp_sum(sum);\n"
        "        q = warp_sum(q);\n"
        "        if ((threadIdx.x & 31) == 0) {\n"
        "            slot[0][warp] = sum;\n"
        "            slot[1][warp] = q;\n"
        "        }\n",
        "        const float wn = warp_sum(n), wsum = warp_sum(sum);\n"
        "        const float wmean = wn > 0.0f ? wsum / wn : 0.0f, wa = mean - wmean;\n"
        "        q = warp_sum(fmaf(n * wa, wa, q));\n"
        "        if ((threadIdx.x & 31) == 0) {\n"
        "            slot[0][warp] = wsum;\n"
        "            slot[1][warp] = q;\n"
        "            slot[2][warp] = wn;\n"
        "            slot[3][warp] = wmean;\n"
        "        }\n",
    ),
    (
        "        sum = q = 0.0f;\n"
        "#pragma unroll\n"
        "        for (int k = 0; k < FXK_TWO_READ_THREADS / 32; ++k) {\n"
        "            sum += slot[0][k];\n"
        "            q += slot[1][k];\n"
        "        }\n",
        "        sum = 0.0f;\n"
        "#pragma unroll\n"
        "        for (int k = 0; k < FXK_TWO_READ_THREADS / 32; ++k) sum += slot[0][k];\n"
        "        const float rm = sum * inv_d;\n"
        "        q = 0.0f;\n"
        "#pragma unroll\n"
        "        for (int k = 0; k < FXK_TWO_READ_THREADS / 32; ++k) {\n"
        "            const float a = slot[3][k] - rm;\n"
        "            q += fmaf(slot[2][k] * a, a, slot[1][k]);\n"
        "        }\n",
    ),
    (
        "        float between = warp_sum(n * away * away);\n"
        "        if ((threadIdx.x & 31) == 0) slot[2][warp] = between;\n"
        "        __syncthreads();\n"
        "        between = 0.0f;\n"
        "#pragma unroll\n"
        "        for (int k = 0; k < FXK_TWO_READ_THREADS / 32; ++k) between += slot[2][k];\n",
        "        const float between = 0.0f;\n"
        "        (void)away;\n",
    ),
)


def _two_read(threads: int, packs: int, blocks: int, edits=()) -> dict:
    return {"macros": {"FXK_TWO_READ_THREADS": threads, "FXK_TWO_READ_PACKS": packs, "FXK_TWO_READ_BLOCKS": blocks},
            "edits": edits}


# The library's choice first ("shipped": the op, which picks its kernel per call: COHERE_TWO_READ).
# Measured 2026-11-27 22:10 UTC (H200, --rounds 3), GB/s at the shapes above, float32 / bfloat16 each;
# inductor 4253 / 4148, 4063 / 2923, 4133 / 3797:
#   the RMSNorms' tunings (t512 p2 b4, and t512 p4 b3 for float32 rows of 8192+; shipped for 40 minutes)
#       4251 / 3396, 3819 / 3142 (bfloat16: the register-resident kernel), 3914 / 3596;
#   the block's moments merged pairwise (Chan's formula, a division a merge, each thread merging the
#       16 warps' in turn; the first version, 2026-11-27 22:05 UTC, library.py): 53% of copy in
#       bfloat16 at 16384x8192, 0.547x inductor.
# A thread's step covering the row was the fastest two-read tuning at every shape: it is the table.
VARIANTS: dict[str, object] = {
    "shipped": "op",
    "register-resident kernel on every row (shipped until 2026-11-27)": "rows",
    "two-read t512 p2 b4": _two_read(512, 2, 4),
    "two-read t512 p4 b3": _two_read(512, 4, 3),
    "two-read t256 p4 b6": _two_read(256, 4, 6),
    "two-read t512 p1 b4": _two_read(512, 1, 4),
    "two-read t256 p4 b8": _two_read(256, 4, 8),
    "two-read t512 p4 b4": _two_read(512, 4, 4),
    "two-read t128 p8 b12": _two_read(128, 8, 12),
    "two-read t256 p8 b6": _two_read(256, 8, 6),
    "two-read t1024 p4 b2": _two_read(1024, 4, 2),
    "two-read t512 p2 b4, warp moments, one barrier": _two_read(512, 2, 4, _WARP_MOMENTS),
    "two-read t512 p4 b3, warp moments, one barrier": _two_read(512, 4, 3, _WARP_MOMENTS),
    "two-read t256 p4 b6, warp moments, one barrier": _two_read(256, 4, 6, _WARP_MOMENTS),
}

def variant_op(index: int, label: str, variant):
    """The variant as a callable ``(x, weight, eps)``: the library's op, its register-resident private op,
    or a scratch op of the two-read kernel with the variant's macros and edits."""
    import fxkern
    import fxkern.library as lib
    from fxkern.library import layernorm

    if variant == "op":
        return lib.op("cohere_layer_norm")
    if variant == "rows":
        return torch.ops.fxkern_lib._cohere_layer_norm_rows
    source = common.apply_edits(layernorm.SOURCE, variant["edits"], label, "layernorm.SOURCE")
    prefix = "".join(f"#define {k} {v}\n" for k, v in variant["macros"].items())
    spec = dataclasses.replace(layernorm.COHERE_LAYER_NORM, kernel_name="cohere_layer_norm_two_read",
                               kernel_source=prefix + source,
                               geometry=fxkern.Reduction((-1,), block_size=variant["macros"]["FXK_TWO_READ_THREADS"]))
    return fxkern.cuda_kernel_op(f"fxkern_tune::cohere_two_read_{index}", spec)


def main(argv=None) -> None:
    args = common.tuning_args("cohere_tuning", "Cohere LayerNorm tuning", __doc__, argv)
    if args is None:
        return
    import fxkern.library as lib
    from fxkern.library import layernorm

    lib.rules()  # registers the library's ops
    torch.manual_seed(0)

    def case(rows, d, dt):
        x = (torch.randn(rows, d, device="cuda") * 2 + 3).to(dt)
        w = torch.randn(d, device="cuda").to(dt)
        return (x, w, 1e-5), 2 * x.numel() * x.element_size() + w.numel() * w.element_size()

    cases, columns = common.shape_cases(SHAPES, DTYPES, case)
    table = common.checked_variants(layernorm.cohere_layer_norm, VARIANTS, variant_op, cases, columns, TOL, args)
    body = common.variant_section("Cohere's plain LayerNorm: kernels and tunings (`fxkern.library.layernorm`)",
                                  "cohere_tuning.py", args, __doc__, columns, table)
    common.emit("cohere_tuning", body, args.section_out)


if __name__ == "__main__":
    main()
