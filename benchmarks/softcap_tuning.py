"""Gemma 2's soft-capped, masked softmax (``fxkern.library.softmax``) against variants of itself and inductor.

    python benchmarks/softcap_tuning.py [--rounds 3] [--section-out FILE]

transformers' Gemma 2 eager attention: ``scores * 0.0625``, ``/ 50``, ``tanh``, ``* 50``, plus the
(b, 1, q, k) causal mask, a float32 softmax cast back; scores drawn so the capped values spread over
tanh's curve. Each variant runs on the grids the library picks (``softmax._grid``); the library's
choice first. GB/s of useful bytes (scores, mask and output once each), CUDA events around 10
back-to-back calls, the GPU kept busy by an untimed call before each sample, median of 20, then the
median over rounds (the order rotated each round); registers a thread per grid, float32/bfloat16.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from masked_tuning import (BARRIERS_TOO, BULK_VARIANTS, EXP2F, EXP_ONCE, FMA_EXP, FUSED_WRITE, LONG_VARIANTS,  # noqa: E402
                           NARROW, compare_variants, shape_option, small_packs, staged)

SCALE, CAP = 0.0625, 50.0


def _variant(edits=(), **tuning) -> dict:
    """A variant: the soft-capped grids' tuning changed as ``tuning`` says, and ``edits`` to softmax.SOURCE."""
    from fxkern.library import softmax

    return {"tuning": {**softmax.SOFTCAP_TUNING, **tuning}, "edits": edits}


def _masked(**changes) -> dict:
    from fxkern.library import softmax

    return {**softmax.MASKED_TUNING, **changes}

# Measured 2026-11-25 (H200, --rounds 3; GB/s at 512 and 2048 keys), starting from the masked
# softmax's tuning (float32 2676 and 2291, bfloat16 2476 and 2568; inductor 2011 and 1977, 1026 and
# 1013). Shipped since 01:50 UTC: float32 small blocks at 16 an SM and every float32 grid up to 8192
# fetching first, 3157 and 2625 (its small blocks spill 32 bytes and are still the fastest; at 8 an
# SM without fetching first: 2823). Slower: every grid fetching first (the 256-thread grid for rows
# over 8192 spilled), 16-bit small blocks at 32 an SM (bfloat16 1117 and 1191: spilled).
# Diagnostics: tanh.approx in float32 too, 3243 and 2489 (3053 and 3116 fetching first), so tanhf
# costs float32 a tenth to a fifth; tanhf in bfloat16 too, 1783 and 1834; one rounding, the capped
# score in float32, bfloat16 2795 and 2910 (+13%): eager's roundings, kept, cost that much.
_FLOAT_PROLOGUE = ("#define FXK_CAP_PAIRS 1", "#define FXK_CAP_PAIRS 0")
_TANH_PAIRS = (
    "                        const float2 u = Pair<T>::f(Pair<T>::t(__fmul_rn(v.x, inv_cap), __fmul_rn(v.y, inv_cap)));\n"
    "                        const P t = Pair<T>::t(tanh_<IsBf16<T>::value>(u.x), tanh_<IsBf16<T>::value>(u.y));\n",
    "                        const P u2 = Pair<T>::t(__fmul_rn(v.x, inv_cap), __fmul_rn(v.y, inv_cap));\n"
    "                        P t;\n"
    "                        if constexpr (IsBf16<T>::value) {\n"
    "                            asm(\"tanh.approx.bf16x2 %0, %1;\" : \"=r\"(*reinterpret_cast<unsigned*>(&t))\n"
    "                                : \"r\"(*reinterpret_cast<const unsigned*>(&u2)));\n"
    "                        } else {\n"
    "                            const float2 u = Pair<T>::f(u2);\n"
    "                            t = Pair<T>::t(tanh_<false>(u.x), tanh_<false>(u.y));\n"
    "                        }\n")
VARIANTS: dict[str, dict] = {
    "shipped": _variant(),
    "float prologue (shipped before 2026-11-25 20:00 UTC)": _variant(edits=(_FLOAT_PROLOGUE,)),
    "16-bit write: one exp2 of (x - max) * log2(e) - log2(sum)": _variant(edits=FUSED_WRITE),
    "(tanh.approx.bf16x2: pairs, no conversions; 1 ulp off eager for 2086 inputs, tools/tanh_bf16.py)": _variant(
        edits=(_TANH_PAIRS,)),
    "the masked softmax's tuning (shipped before 01:50 UTC)": _variant(**_masked()),
    "float32 small blocks at 16 an SM": _variant(**_masked(blocks_short_32bit=16)),
    "float32 small blocks at 16 an SM, rows of up to 8192 fetched first": _variant(**_masked(
        blocks_short_32bit=16, fetch_first=("_short", "_32bit"))),
    "float32 small blocks at 8 an SM, fetched first": _variant(blocks_short_32bit=8),
    # masked_tuning.STAGED: rows staged through shared memory by cp.async (2026-11-26, H200: 1288-2253
    # GB/s against the shipped 2640-3156; not shipped)
    # masked_tuning.small_packs: 16-bit rows of up to 1024 in 4 packs a thread (the small blocks held 8 until
    # 2026-11-26; H200, bfloat16 at 512 keys: 2870 GB/s at 28 blocks against 2715, 2784 at 24; shipped at 28)
    "16-bit rows of up to 1024 in 8 packs a thread (shipped until 2026-11-26 10:49 UTC)": _variant(blocks_narrow=None),
    # masked_tuning.EXP_ONCE (2026-11-26 11:59 UTC, H200, bfloat16 at 512 keys): 2306 / 2583 / 2714 / 2549
    # GB/s at 28 / 24 / 20 / 16 blocks an SM (136 / 104 / 40 bytes spilled, then 123 registers) against
    # the shipped 2874; not shipped
    # (since 2026-11-26 12:05 UTC blocks_narrow also sets the 2048-row 4-pack grids' blocks: 24 gives 12 and 6 an SM)
    "16-bit exp once an element in the 4-pack blocks, 28 an SM": _variant(edits=EXP_ONCE),
    "16-bit exp once an element in the 4-pack blocks, 24 an SM": _variant(edits=EXP_ONCE, blocks_narrow=24),
    "16-bit exp once an element in the 4-pack blocks, 20 an SM": _variant(edits=EXP_ONCE, blocks_narrow=20),
    "16-bit exp once an element in the 4-pack blocks, 16 an SM": _variant(edits=EXP_ONCE, blocks_narrow=16),
    # 2026-11-26 12:01 UTC, H200, at 2048 keys: 16-bit 64-thread blocks 2942 GB/s against 2828, float32
    # 128-thread ones 2809 at 7 an SM (16 bytes spilled), 2682 at 6, against 2621; 256-thread 2591.
    # Shipped at 12:05 UTC (softmax.NARROW_GRIDS): since then "shipped" runs the first two
    "rows of 2048 in the 8-pack one-warp and 256-thread blocks (shipped until 2026-11-26 12:05 UTC)": {
        **_variant(narrow=("_short_4packs",))},
    "16-bit rows of 2048 in 64-thread blocks of 4 packs a thread, 14 an SM": {
        **_variant(), **small_packs(4, 14, threads=64, longer_than=1024)},
    "float32 rows of 2048 in 128-thread blocks of 4 packs a thread, 7 an SM": {
        **_variant(), **small_packs(4, 7, threads=128, size=4, longer_than=1024)},
    "float32 rows of 2048 in 128-thread blocks of 4 packs a thread, 6 an SM": {
        **_variant(), **small_packs(4, 6, threads=128, size=4, longer_than=1024)},
    "float32 rows of 2048 in 256-thread blocks of 4 packs a thread, 3 an SM": {
        **_variant(), **small_packs(4, 3, threads=256, size=4, longer_than=1024)},
    "16-bit rows of up to 1024 in 4 packs a thread, 24 blocks an SM": {**_variant(), **small_packs(4, 24)},
    "16-bit rows of up to 1024 in 4 packs a thread, 28 blocks an SM": {**_variant(), **small_packs(4, 28)},
    # 2026-11-26 13:46 UTC, H200, GB/s at bfloat16 512 / 2048 keys: the max in pairs (softmax's FXK_PAIR_MAX,
    # which the masked kernels take) 2876 / 2865 against 2895 / 2933, spilling 8 bytes; the FFMA exp
    # (masked_tuning.FMA_EXP) 2603 / 2756, both 2590 / 2827. Neither shipped for the soft-capped kernel
    "16-bit max in pairs": _variant(edits=(("#define FXK_PAIR_MAX 0\n", ""),)),
    "16-bit exp through one FFMA": _variant(edits=FMA_EXP),
    # 2026-11-26 13:54 and 13:56 UTC, H200, GB/s at float32 / bfloat16 512 keys, float32 / bfloat16 2048: rows of
    # up to a warp reduced twice (the max, then the shifted sums) in every dtype 3351 / 2979 / 2894 / 2971 and
    # 3347 / 2985 / 2841 / 2975, against one reduction 3144 / 2893 / 2813 / 2929 and 3138 / 2903 / 2811 / 2934;
    # in 16-bit rows only 3136 / 2985 / 2699 / 2983. Shipped at 14:05 UTC in every dtype (FXK_TWO_REDUCTIONS 2)
    # (the edits override the 2048-key grids' own FXK_TWO_REDUCTIONS, set before the source since 14:10 UTC)
    "one reduction of (max, sum) pairs (shipped until 2026-11-26 14:05 UTC)": _variant(edits=(
        ("#define FXK_TWO_REDUCTIONS 2\n", ""),
        ("#ifndef FXK_TWO_REDUCTIONS\n#define FXK_TWO_REDUCTIONS 1\n#endif",
         "#undef FXK_TWO_REDUCTIONS\n#define FXK_TWO_REDUCTIONS 0"),)),
    # 2026-11-26 14:12 UTC, H200, GB/s at float32 / bfloat16 512 keys, float32 / bfloat16 2048: float32's exp
    # through ex2.approx.ftz 3510 / 2994 / 3114 / 3058 against exp2f (MUFU.EX2 behind a fix-up for subnormal
    # results, about 8 instructions an exp) 3361 / 2990 / 2880 / 3106; shipped at 14:20 UTC (FXK_EXP_FTZ)
    "float32 exp through exp2f (shipped until 2026-11-26 14:20 UTC)": _variant(edits=EXP2F),
    # 2026-11-26 14:03 UTC, H200, GB/s as above: 3214 / 2971 / 2988 / 3111 against 3377 / 2994 / 2675 / 2980; the
    # 2048-key grids' rows (2-4 warps) take it since 14:10 UTC (softmax._grids), the others not (float32 512
    # keys 4.8% slower with the barriers' code in its kernel)
    "two reductions in every row, barriers too": _variant(edits=BARRIERS_TOO),
    # masked_tuning's "4-pack blocks of N register-fulls" (its numbers there)
    "4-pack blocks of 2 register-fulls": _variant(steps=dict.fromkeys(NARROW, 2)),
    "4-pack blocks of 4 register-fulls": _variant(steps=dict.fromkeys(NARROW, 4)),
    # shipped at 2026-11-26 20:53 UTC (H200, 20:47 UTC: bfloat16 2048 keys 3250 against 3110)
    "16-bit 2048-key blocks of 1 register-full (shipped until 2026-11-26 20:53 UTC)": _variant(steps={}),
    # masked_tuning's MAKE_ALL (every pack's values made unguarded from zeroed packs) in the soft-capped
    # float32 kernels too (shipped at 21:36 UTC): H200, 2026-11-26 21:27 UTC, 3575 / 3337 GB/s at float32 512 /
    # 2048 keys against 3539 / 3067
    "float32 values made in guarded blocks (shipped until 2026-11-26 21:36 UTC)": _variant(edits=((
        "static constexpr bool MAKE_ALL = sizeof(T) == 4;", "static constexpr bool MAKE_ALL = false;"),)),
    "staged through shared memory, 3 stages, 4 warps a block": staged(),
    # masked_tuning.BULK: rows brought into shared memory by bulk copies
    **BULK_VARIANTS,
    "staged through shared memory, 2 stages, 2 warps a block": staged(stages=2, threads=64),
    # masked_tuning.LONG_VARIANTS: 16-bit rows of 8192 keys (--shape 1,16,8192) in other blocks
    **{label: {**_variant(), **v} for label, v in LONG_VARIANTS.items()},
    # Rows of an odd length (--shape 4,16,1001) run the EDGES kernels; their 16-bit small blocks make values
    # as loads arrive since 2026-11-28 19:16 UTC (H200, 19:03 UTC: bfloat16 2040 GB/s against 1780 fetched
    # first, float32 level; section softcap_tuning_odd_rows_h200_1128 of docs/benchmarks.md)
    "rows not in whole packs: 16-bit EDGES values fetched first (shipped until 2026-11-28 19:16 UTC)": _variant(
        edges_fetch_first=None),
    # diagnostics: what tanhf would cost bfloat16, and what rounding each step to bfloat16, as eager does, costs
    "(tanhf in bfloat16 too)": _variant(edits=(("tanh_<IsBf16<T>::value>(", "tanh_<false>("),)),
    "(one rounding: the capped, masked score computed in float32)": _variant(edits=(_FLOAT_PROLOGUE,) + tuple(
        (f"            for (int j = 0; j < V; ++j) f[j] = {op};\n            to_floats(from_floats<T, V>(f), f);\n",
         f"            for (int j = 0; j < V; ++j) f[j] = {op};\n")
        for op in ("__fmul_rn(f[j], scale)", "__fmul_rn(f[j], inv_cap)", "tanh_<IsBf16<T>::value>(f[j])",
                   "__fmul_rn(f[j], cap)"))),
}


def main(argv=None) -> None:
    args = common.tuning_args("softcap_tuning", "Soft-capped masked softmax tuning", __doc__, argv, extra=shape_option)
    if args is None:
        return
    from fxkern.library import softmax

    compare_variants(VARIANTS, softmax.SOFTCAPPED_MASKED_SOFTMAX, softmax.softcapped_masked_softmax_float32,
                     (SCALE, CAP), x_scale=CAP / SCALE, prefix="softcap", section="softcap_tuning",
                     script="softcap_tuning.py", args=args, doc=__doc__,
                     title="Soft-capped masked softmax tuning (`fxkern.library.softmax`, Gemma 2's eager attention)")


if __name__ == "__main__":
    main()
