"""The rotary-family kernel (``fxkern.library.rotary``) against variants of itself and inductor.

    python benchmarks/rope_tuning.py [--rounds 3] [--section-out FILE]

transformers' ``apply_rotary_pos_emb`` on queries as attention projects them (``(b, s, h * d)`` viewed
``(b, h, s, d)``, read in place) and on contiguous ones, cos and sin ``(1, 1, s, d)``; GPT-NeoX's
partial rotary (a quarter of each head) of the queries' column block of the fused QKV projection; and
grouped-query attention's projected keys rotated and repeated, and values repeated (8 heads to 32).
Every op runs the one kernel (rows written more than once, its repeating twin). GB/s of useful
bytes (x, cos, sin and output once each), CUDA events around 10 back-to-back calls, the GPU kept
busy by an untimed call before each sample, median of 20, then the median over rounds (the order
rotated each round).
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
# transpose only (published then): the output's row order, 2 and 4 items in flight, divisions by
# multiply-high and shift, each 0-10% slower than the shipped kernel or level with it; 16384 a block
# 2-3% slower.
# Measured 2026-11-25 00:40 UTC (H200) and not shipped: a thread per (position, pack column, group of
# heads) that reads cos and sin once and rotates 2-8 heads' rows with them (2, 4 or 8 heads' loads
# in flight, 4096-16384 elements a block): 3959-3987 GB/s at 16x32x2048x128 projected float32,
# against the shipped kernel's 4039 and inductor's 4190 in the same run.

# The repeating kernels (EVICT) walk their output: B * H * R * S rows, each written once.
_OUTPUT_ORDER = (
    ("    const unsigned items = B * w.A1 * w.A2 * P;\n",
     "    constexpr bool OO = EVICT;\n"
     "    const unsigned items = B * w.A1 * w.A2 * P * (OO ? R : 1u), reps = OO ? 1u : R;\n"),
    ("""        const unsigned r = i / P, j = i - r * P;
        unsigned b, h, s;
        const size_t xo = w.locate(r, b, h, s);
        const size_t out = w.out(r, b, h, s, R, D, head);
""", """        const unsigned r = i / P, j = i - r * P;
        unsigned b, h, s;
        size_t xo, out;
        if constexpr (OO) {
            s = r % w.S;
            const unsigned bh = r / w.S, hr = bh % (w.H * R);
            b = bh / (w.H * R);
            h = hr / R;
            xo = b * w.sB + (size_t)(w.heads_inner ? s : h) * w.s1 + (size_t)(w.heads_inner ? h : s) * w.s2;
            out = (size_t)r * D;
        } else {
            xo = w.locate(r, b, h, s);
            out = w.out(r, b, h, s, R, D, head);
        }
"""),
    ("            for (unsigned k = 0; k < R; ++k) {\n                store_out<T, V, EVICT>(y + out + k * head + col, ya);",
     "            for (unsigned k = 0; k < reps; ++k) {\n                store_out<T, V, EVICT>(y + out + k * head + col, ya);"),
    ("            for (unsigned k = 0; k < R; ++k) {\n#pragma unroll",
     "            for (unsigned k = 0; k < reps; ++k) {\n#pragma unroll"),
)

# load_table's 16-byte branch through load_cols, as its float32-tables branch
_TABLES_THROUGH_COLS = (
    ("        return load<C, V>(p);\n    else\n        return load_cols<C, 16 / sizeof(C), V>(p);",
     "        return load_cols<C, V, V>(p);\n    else\n        return load_cols<C, 16 / sizeof(C), V>(p);"),)

# A variant: source edits ((old, new) pairs), macros, and the elements a 128-thread block takes.
SHIPPED = {"edits": (), "macros": "", "per_block": 4096}
VARIANTS: dict[str, dict] = {
    "shipped (x read in place, eager's layout out, 4096 a block, 16-bit pairs, 4 pass packs a thread in rows "
    "written once, six loads an item in flight together, repeats evict-first)": SHIPPED,
    # every result contiguous (B, H, S, D), the projection's rows written 32 heads apart (before 2026-11-26 10:30 UTC)
    "contiguous results (shipped until 2026-11-26)": {**SHIPPED, "contiguous": True},
    # on an H200 1.4-5% slower than 4096 at 16x32x2048x128 (2026-11-26, three runs); 1-2% faster on an H100
    "2048 a block (shipped 2026-11-25 20:30 UTC to 2026-11-26)": {**SHIPPED, "per_block": 2048},
    "16-bit on the float path": {**SHIPPED, "macros": "#define FXK_ROPE_PAIRS 0\n"},
    "1 pass pack a thread": {**SHIPPED, "macros": "#define FXK_PASS_PACKS 1\n"},
    "2 pass packs a thread": {**SHIPPED, "macros": "#define FXK_PASS_PACKS 2\n"},
    "8192 a block": {**SHIPPED, "per_block": 8192},
    # evict-first stores of repeated rows since 2026-11-25 20:20 UTC, behind a branch on R until
    # 2026-11-26 (H200: contiguous float32 rows written once 2.6-6% slower for it), since in an
    # instantiation of their own
    "repeated rows stored as any other": {**SHIPPED, "macros": "#define FXK_ROPE_EVICT_REPEATS 0\n"},
    # (2026-11-26, H200: values bfloat16 1.6% slower, float32 0.4% faster; 4 packs: values 2-3% slower)
    "2 pass packs a thread when repeating": {**SHIPPED, "edits": (
        ("const unsigned pp = R > 1 ? PP_REPEAT : PP;", "const unsigned pp = R > 1 ? 2u : PP;"),)},
    "4 pass packs a thread when repeating": {**SHIPPED, "edits": (
        ("const unsigned pp = R > 1 ? PP_REPEAT : PP;", "const unsigned pp = PP;"),)},
    # rotary_strided's (unlaunched) repeating path at 1 pass pack, as the repeating kernel's: 50 registers in
    # bfloat16, where ptxas splits a rotated item's six loads in two trips (shipped until 2026-11-26 10:12 UTC)
    "rows written once at 50 registers in bfloat16 (1 pass pack in their kernel's repeating path)": {
        **SHIPPED, "edits": (("fxk::rotary<T, false, 2>(x_span", "fxk::rotary<T, false, 1>(x_span"),)},
    # the element-wise path in a kernel of its own, as norm_rotary's since 2026-11-26 (its registers
    # no longer set the 16-byte path's occupancy; the benchmark's tensors are all aligned): 52 registers
    # where the shipped kernel takes 52-60, and no faster on an H200 (2026-11-26: contiguous float32
    # 3933 GB/s against 4111, every other case within 1.2%); not shipped
    # rows written once stored evict-first as well (the output is read by nothing here; attention reads
    # it next in a model, so the hint would cost it there). 2026-11-26, H200: up to 1.1% slower at
    # 16x32x2048x128, the demo's 8x32x512x64 bfloat16 queries 26%; not shipped
    "rows written once stored evict-first too": {**SHIPPED, "edits": (
        ("fxk::rotary<T, false, 2>(x_span", "fxk::rotary<T, true, 2>(x_span"),)},
    # held to fewer registers, for more blocks an SM (52-60 allow 8 of 128 threads). 2026-11-26, H200,
    # at 48 registers (float32 and float16 spilling): float32 up to 23% slower; not shipped
    "launch bounds of 10 blocks an SM": {**SHIPPED, "edits": (
        ("__launch_bounds__(128) rotary_strided(", "__launch_bounds__(128, 10) rotary_strided("),
        ("__launch_bounds__(128) rotary_strided_repeat(", "__launch_bounds__(128, 10) rotary_strided_repeat("))},
    # the rotated item's six 16-byte loads in flight together: whether ptxas issues them before any is
    # used depends on the kernel's register budget (tools/rope_loads.py reads it from the SASS). 2026-11-26,
    # H200: R a constant 1 in rotary_strided made float32 64 registers with 3 early uses (contiguous 5%
    # slower, partial bfloat16 40%); 8 blocks an SM (64 registers, no early use) level but bfloat16
    # contiguous +3%; both not shipped
    "rotary_strided for n_rep 1 only (R a constant)": {**SHIPPED, "edits": (
        ("""    fxk::rotary<T, false, 2>(x_span, cs, sn, half, pass, B, fxk::rows_of(A1, A2, sB, s1, s2, heads_inner, in_order),
                             cB, cH, cS, n_rep, y);""", """    if (n_rep != 1) return;
    fxk::rotary<T>(x_span, cs, sn, half, pass, B, fxk::rows_of(A1, A2, sB, s1, s2, heads_inner, in_order), cB, cH,
                   cS, 1, y);"""),)},
    "launch bounds of 8 blocks an SM": {**SHIPPED, "edits": (
        ("__launch_bounds__(128) rotary_strided(", "__launch_bounds__(128, 8) rotary_strided("),
        ("__launch_bounds__(128) rotary_strided_repeat(", "__launch_bounds__(128, 8) rotary_strided_repeat("))},
    # the repeating kernel built without in_order (eager launches it only for n_rep > 1, always contiguous)
    # (2026-11-26 10:23 UTC, H200: level with the shipped kernel in every repeated case, within 0.5%; not shipped)
    "repeating kernel without in_order": {**SHIPPED, "edits": (
        ("""                                                fxk::rows_of(A1, A2, sB, s1, s2, heads_inner, in_order), cB, cH, cS,
                                                n_rep, y);""", """                                                fxk::rows_of(A1, A2, sB, s1, s2, heads_inner), cB, cH, cS,
                                                n_rep, y);"""),)},
    # a block's chunk of items rounded up to a whole number a thread: GPT-NeoX's partial rows are 5 items
    # in bfloat16 (2 rotated, 3 of pass packs), 10 in float32, so a 4096-element block held 160 / 320
    # items, and its second (third) step ran one warp of four; plain rows' blocks already hold a
    # multiple of 128 and keep their chunks. The grid's last blocks take none. 2026-11-26 11:55 UTC, H200:
    # slower, not shipped: partial float32 / bfloat16 3674 / 3361 GB/s against 3728 / 3449 (2 pass packs:
    # 3427 / 3227), the repeated bfloat16 keys (64 items a block, rounded to 128) 3542 against 3845, and
    # bfloat16 queries 2-5% (ptxas schedules the edited kernel's loads differently)
    "whole items a thread (a block's chunk a multiple of its threads)": {**SHIPPED, "edits": (
        ("const unsigned chunk = (n + gridDim.x - 1) / gridDim.x;",
         "const unsigned chunk = ((n + gridDim.x - 1) / gridDim.x + blockDim.x - 1) / blockDim.x * blockDim.x;"),)},
    "whole items a thread, 2 pass packs a thread": {**SHIPPED, "macros": "#define FXK_PASS_PACKS 2\n", "edits": (
        ("const unsigned chunk = (n + gridDim.x - 1) / gridDim.x;",
         "const unsigned chunk = ((n + gridDim.x - 1) / gridDim.x + blockDim.x - 1) / blockDim.x * blockDim.x;"),)},
    # rows in groups of 32, a group's rotated items before its pass items, so a warp's threads take items
    # of one kind (GPT-NeoX's partial rows mixed 2 rotated and 3 pass items in every 5 threads, and a
    # warp ran both branches one after the other: two trips to memory an iteration). Rows with one kind
    # of item (plain RoPE, the repeats) keep their order. 2026-11-26 12:11 UTC, on an H100: partial float32 /
    # bfloat16 2741 / 2565 GB/s against 2746 / 2613, the rest level; not shipped (benchmarks/layout_copy.py:
    # the same walk as a copy, no rotated columns, reached 95-96% of copy there, the partial op 87-92%)
    "a warp's items of one kind (rows in groups of 32, rotated items first)": {**SHIPPED, "edits": (
        ("        const unsigned r = i / P, j = i - r * P;\n",
         "        const unsigned g = i / (32u * P), u = i - g * 32u * P, rows_g = min(32u, B * w.A1 * w.A2 - g * 32u);\n"
         "        unsigned r, j;\n"
         "        if (u < rows_g * Prot) {\n"
         "            r = g * 32u + u / Prot;\n"
         "            j = u - (r - g * 32u) * Prot;\n"
         "        } else {\n"
         "            const unsigned w2 = u - rows_g * Prot, k = w2 / Q;\n"
         "            r = g * 32u + k;\n"
         "            j = Prot + (w2 - k * Q);\n"
         "        }\n"),)},
    # the repeating kernel (rows written n_rep > 1 times) walking its output instead of its input, as
    # inductor's kernel does: an item is a pack of one output row, loaded from x's row for that head
    # (from L2 for all but the first of a group's heads) and stored once, so a warp's stores are one stream
    # where a thread stored its pack n_rep times, 32 heads' rows apart (float32 values 0.974x of
    # inductor's speed at 92% of copy, 2026-11-26 12:18 UTC). 12:27 UTC, H200: values float32 / bfloat16 2634 /
    # 2525 GB/s against 3958 / 4013, keys 3253 / 3073 against 3900 / 3843 (2048 a block: the same or
    # slower); rows written once level. Not shipped. (A first try with `--only "output's order"` failed in
    # inductor's generated module, "unterminated string literal"; `--only "in the output"` ran.)
    "repeats in the output's order": {**SHIPPED, "edits": _OUTPUT_ORDER},
    "repeats in the output's order, 2048 a block": {**SHIPPED, "edits": _OUTPUT_ORDER, "per_block": 2048},
    # the tables (and then x too) of rotary_rows' halves path loaded through load_cols<C, V, V> (one load,
    # its pack copied element by element into the result) where load_table returned the load's pack as is:
    # an earlier try's SASS of the bfloat16 rotary kernel went from 840 to 648 instructions. 2026-11-27 19:34 UTC,
    # H200, one run of 3 rounds: level with the shipped kernel (within 0.4%) at 16x32x2048x128 (tables / x and
    # tables: projected float32 4108 / 4109 GB/s against 4109, bfloat16 4120 / 4121 against 4122, contiguous
    # bfloat16 4082 / 4072 against 4065), GPT-NeoX partial and the repeats within 0.7%; only the demo's small
    # 8x32x512x64 float32 queries faster, 2770 / 2735 against 2646 (+4.7% / +3.4%; bfloat16 +1.2% / +0.4%),
    # unrepeated. Not shipped
    "tables through load_cols": {**SHIPPED, "edits": _TABLES_THROUGH_COLS},
    "x and tables through load_cols": {**SHIPPED, "edits": (*_TABLES_THROUGH_COLS, (
        "const Pack<T, V> xa = load<T, V>(x + xo + col), xb = load<T, V>(x + xo + col + half);",
        "const Pack<T, V> xa = load_cols<T, V, V>(x + xo + col), xb = load_cols<T, V, V>(x + xo + col + half);"))},
    "16-byte path only": {**SHIPPED, "edits": (
        ("    else\n        rotary_rows<T, 1, false, 1, PAIRS, M, C>(x, cs, sn, half, pass, B, w, cB, cH, cS, R, y);\n", ""),)},
}


def variant_op(label: str, v: dict, index: int):
    """The variant as ``make(check, rotated)``: a public op's eager path (checks, tables narrowed, x
    read in place; rotary._eager) over the variant's kernels (for n_rep 1 and n_rep > 1). With
    ``contiguous``, the op's meta_fn ``check`` gives a contiguous output, which the kernel then writes."""
    import fxkern
    from fxkern.library import rotary
    from fxkern.symbolic import cdiv

    source = common.apply_edits(rotary.SOURCE, v["edits"], label, "rotary.SOURCE")

    def geometry(inputs, outputs, per=v["per_block"]):
        return (cdiv(outputs[0].numel(), per),), (128,)

    name = f"fxkern_tune::rope_{index}"
    strided = rotary.strided_launchers(
        *((name + suffix, dataclasses.replace(spec, kernel_source=v["macros"] + source, geometry=fxkern.Custom(geometry)))
          for suffix, spec in (("", rotary.ROTARY_STRIDED), ("_repeat", rotary.ROTARY_STRIDED_REPEAT))))
    if v.get("contiguous"):
        return lambda check, rotated: rotary._eager(name, strided, lambda *a: check(*a).contiguous(), rotated)
    return lambda check, rotated: rotary._eager(name, strided, check, rotated)


def cases():
    """(name, op kind, args): plain RoPE at SHAPES, then GPT-NeoX's partial rotary and grouped-query
    keys and values, in each dtype."""
    def rope(b, s, h, d, dt, projected=True):
        x = torch.randn(b, s, h * d, device="cuda").to(dt).view(b, s, h, d).transpose(1, 2)
        pos = torch.arange(s, device="cuda", dtype=torch.float32)[:, None]
        emb = pos * (1.0 / 10000 ** (torch.arange(0, d, 2, device="cuda") / d))[None]
        emb = torch.cat((emb, emb), -1)[None, None]
        return (x if projected else x.contiguous()), emb.cos().to(dt), emb.sin().to(dt), d // 2

    out = []
    for b, s, h, d, projected in SHAPES:
        for dt in DTYPES:
            out.append((f"{b}x{h}x{s}x{d} {'projected' if projected else 'contiguous'} {str(dt)[6:]}", "rope",
                        rope(b, s, h, d, dt, projected)))
    for dt in DTYPES:
        qkv = torch.randn(16, 2048, 32 * 3 * 128, device="cuda").to(dt).view(16, 2048, 32, 3 * 128).transpose(1, 2)
        _, cos, sin, half = rope(1, 2048, 1, 32, dt)
        out.append((f"GPT-NeoX partial, 32 of 128, fused QKV {str(dt)[6:]}", "partial",
                    (qkv[..., :128], cos, sin, half, 32)))
        k = rope(16, 2048, 8, 128, dt)
        out.append((f"keys 16x8x2048x128 rotated, to 32 heads {str(dt)[6:]}", "rotary_repeat",
                    (*k, 16, 8, 4, 2048, 128, 32)))
        out.append((f"values 16x8x2048x128 to 32 heads {str(dt)[6:]}", "repeat", (k[0], 16, 8, 4, 2048, 128, 32)))
    return out


def main(argv=None) -> None:
    args = common.tuning_args("rope_tuning", "Rotary embedding tuning", __doc__, argv)
    if args is None:
        return
    import fxkern.library
    from fxkern.library import rotary

    fxkern.library.rules()
    torch.manual_seed(0)
    # each op kind: its pattern (the reference, and what inductor compiles), its checks, whether it rotates
    kinds = {"rope": (rotary.rotary_embedding, rotary._output, True),
             "partial": (rotary.partial_rotary_embedding, rotary._partial_output, True),
             "rotary_repeat": (rotary.rotary_embedding_repeat_kv, rotary._rotary_repeat_output, True),
             "repeat": (rotary.repeat_kv, rotary._repeat_output, False)}
    makers = {label: variant_op(label, v, i) for i, label, v in common.pick(VARIANTS, args)}
    runs = {kind: {"inductor": common.inductor(pattern),
                   **{label: make(check, rotated) for label, make in makers.items()}}
            for kind, (pattern, check, rotated) in kinds.items()}
    table: dict[str, list[float]] = {label: [] for label in ("inductor", *makers)}
    all_cases = cases()
    for name, kind, call in all_cases:
        want = kinds[kind][0](*call)
        for label, fn in runs[kind].items():
            got = fn(*call)
            if label != "inductor":
                torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"{label}, {name}: {m}")
        tensors = [a for a in call if isinstance(a, torch.Tensor)]
        nbytes = (sum(t.numel() * t.element_size() for t in tensors) + want.numel() * want.element_size())
        for label, gbs in common.bandwidth_rows(runs[kind], [(call, nbytes)], args.rounds).items():
            table[label] += gbs
    body = common.variant_section("Rotary embedding tuning (`fxkern.library.rotary`)", "rope_tuning.py",
                                  args, __doc__, [name for name, _, _ in all_cases], table)
    common.emit("rope_tuning", body, args.section_out)


if __name__ == "__main__":
    main()
