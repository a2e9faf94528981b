"""A head's RMSNorm and rotation in one kernel (``fxkern.library.norm_rotary``) against variants of
itself, the library's norm and rotary ops one after the other, and inductor.

    python benchmarks/norm_rope_tuning.py [--rounds 3] [--section-out FILE]

Qwen3's queries as its norm reads them (the ``(b, s, h, d)`` projection), Gemma 3's (the ``(b, h, s, d)``
view of it), and Qwen3's grouped-query keys, normalised, rotated and repeated (8 heads to 32); 16x2048
tokens, heads of 128, cos and sin ``(1, 1, s, d)``. GB/s of useful bytes (x, the weight, cos, sin and
the output once each), CUDA events around 10 back-to-back calls, the GPU kept busy by an untimed call
before each sample, median of 20, then the median over rounds (the order rotated each round).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16)

# Measured 2026-11-26 (H200) before the 16-byte kernels had their own (norm_rotary_packs), GB/s of q
# float32 Qwen3 / Gemma 3, q bfloat16 Qwen3 / Gemma 3, k float32 / bfloat16 (inductor 3982 / 4105,
# 3408 / 3237, 2782 / 2577), one kernel for every alignment at 80 registers: 3887 / 3884, 3672 / 3593,
# 3807 / 3796. Its 16-byte path alone (56-64 registers): 3865 / 3866, 3905 / 3856, 3791 / 3775; with
# the tables loaded with the row (94-95): 3840 / 3830, 3586 / 3483, 3835 / 3787; that at one row a
# group (56; shipped): 3956 / 3954, 3909 / 3865, 3783 / 3772. Loading the tables with the row in the
# kernel for every alignment: 3507 / 3488, 3292 / 3208 at two rows (126 registers), 3313 / 3310,
# 3153 / 3066 at one (72). Launch bounds of 8 blocks an SM (64 registers, float32 spilling): 3870 /
# 3872, 3907 / 3853, 3799 / 3797.
_ARGS = "(x, wt, cs, sn, eps, half, B, w, cB, cH, cS, R, y);"
_PACKS_CALL = "norm_rotary_rows<T, MODE, V, 1, FXK_NR_PACK_ROWS, true, EVICT>" + _ARGS
# (without its guard, which would let the compiler drop norm_rotary's element-wise paths)
_PACKS_GUARD = "    if (half <= 0 || R <= 0 || half > 128 || !packs_fit(x, wt, cs, sn, half, w, y)) return;\n    "

# norm_rotary's 16-byte path as the 16-byte kernels take it: the tables loaded with the row, a row a group.
_AHEAD_ANY = ("        norm_rotary_rows<T, MODE, V, 1, U, false, EVICT>(x, wt, cs, sn, eps, half, B, w, cB, cH, cS, R, y);\n"
              "    else if (half <= 32)",
              "        norm_rotary_rows<T, MODE, V, 1, FXK_NR_PACK_ROWS, true, EVICT>(x, wt, cs, sn, eps, half, B, w, cB, "
              "cH, cS, R, y);\n    else if (half <= 32)")

_PREFETCH_ROWS = """// The 16-byte kernels' rows (one pack from each half a thread, a row a thread group) in a software
// pipeline: a group loads its next row's packs before it reduces, normalises, rotates and stores the
// current one, so a row's trip to memory overlaps the row before it instead of following it; the
// current row's cos and sin are loaded with them.
template <typename T, int MODE, int V, bool EVICT>
__device__ __forceinline__ void norm_rotary_rows_prefetch(const T* __restrict__ x, const T* __restrict__ wt,
                                                          const T* __restrict__ cs, const T* __restrict__ sn,
                                                          float eps, unsigned half, unsigned B, const Rows& w,
                                                          unsigned cB, unsigned cH, unsigned cS, unsigned R,
                                                          T* __restrict__ y) {
    const unsigned D = 2 * half, packs = half / V;
    const unsigned G = packs > 1 ? 1u << (32 - __clz(packs - 1)) : 1u, lg = log2_of(G);
    const unsigned g = threadIdx.x >> lg, t = threadIdx.x & (G - 1), groups = blockDim.x >> lg;
    const unsigned rows = B * w.A1 * w.A2, chunk = (rows + gridDim.x - 1) / gridDim.x;
    const unsigned lo = min(blockIdx.x * chunk, rows), hi = min(lo + chunk, rows);
    const float inv_d = __frcp_rn((float)D);
    const size_t head = (size_t)w.S * D;
    const unsigned sb = cB > 1 ? cH * cS : 0u, sh = cH > 1 ? cS : 0u, ss = cS > 1 ? 1u : 0u;
    const unsigned col = t * V;
    const bool mine = col < half;
    unsigned b = 0, h = 0, s = 0;
    Pack<T, V> a, c;
    if (lo + g < hi) {
        const size_t xo = w.locate(lo + g, b, h, s);
        if (mine) {
            a = load<T, V>(x + xo + col);
            c = load<T, V>(x + xo + col + half);
        }
    }
    for (unsigned first = lo; first < hi; first += groups) {  // the same steps for every thread of the block
        const unsigned r = first + g, next = r + groups;
        const bool live = r < hi && mine;
        const size_t co = (size_t)(b * sb + h * sh + s * ss) * D + col;
        Pack<T, V> ca, cb, sa, sb2, an, cn;
        if (live) {
            ca = load<T, V>(cs + co);
            cb = load<T, V>(cs + co + half);
            sa = load<T, V>(sn + co);
            sb2 = load<T, V>(sn + co + half);
        }
        unsigned bn = 0, hn = 0, sn_ = 0;
        if (next < hi) {
            const size_t xo = w.locate(next, bn, hn, sn_);
            if (mine) {
                an = load<T, V>(x + xo + col);
                cn = load<T, V>(x + xo + col + half);
            }
        }
        float sq = live ? sum_squares(c, sum_squares(a, 0.0f)) : 0.0f;
        for (unsigned o = G >> 1; o > 0; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
        if (live) {
            const float rn = rsqrtf(sq * inv_d + eps);
            const size_t out = w.out(r, b, h, s, R, D, head);
            const Pack<T, V> na = rms_pack<T, MODE, V>(a, load<T, V>(wt + col), rn);
            const Pack<T, V> nb = rms_pack<T, MODE, V>(c, load<T, V>(wt + col + half), rn);
            Pack<T, V> ya, yb;
            rope_packs<T, V>(na, nb, ca, cb, sa, sb2, ya, yb);
            for (unsigned q = 0; q < R; ++q) {
                store_out<T, V, EVICT>(y + out + q * head + col, ya);
                store_out<T, V, EVICT>(y + out + q * head + col + half, yb);
            }
        }
        a = an;
        c = cn;
        b = bn;
        h = hn;
        s = sn_;
    }
}

"""
# norm_rotary_packs' rows in a software pipeline: norm_rotary_rows_prefetch, declared before packs_fit, and
# called instead of norm_rotary_rows.
_PIPELINE = (
    ("// Whether every pointer, stride and half allow 16-byte packs", _PREFETCH_ROWS
     + "// Whether every pointer, stride and half allow 16-byte packs"),
    (_PACKS_GUARD + _PACKS_CALL, _PACKS_GUARD + "norm_rotary_rows_prefetch<T, MODE, V, EVICT>" + _ARGS),
)

# The eager path's 16-byte entry points as norm_rotary.SOURCE declares them (FXK_NR_STRIDED_KERNEL).
_PACKS_KERNELS = {"norm_rotary_packs": "FXK_NR_STRIDED_KERNEL(norm_rotary_packs, true, false)",
                  "norm_rotary_packs_repeat": "FXK_NR_STRIDED_KERNEL(norm_rotary_packs_repeat, true, FXK_NR_EVICT_REPEATS != 0)"}


def _kernel(name: str, evict: str, bounds: str = "128", in_order: str = "in_order") -> tuple[str, str]:
    """An edit writing 16-byte entry point ``name`` out in full, with its launch bounds, EVICT and the
    in_order it passes changed as given."""
    return (_PACKS_KERNELS[name], f"""template <typename T>
__global__ void __launch_bounds__({bounds}) {name}(
    const T* x_span, const T* weight, const T* cs, const T* sn, float eps, int half, int gemma, int B,
    int A1, int A2, int sB, int s1, int s2, int heads_inner, int n_rep, int in_order, int cB, int cH, int cS, T* y) {{
    fxk::norm_rotary_strided<T, true, {evict}>(x_span, weight, cs, sn, eps, half, gemma, B, A1, A2, sB, s1, s2,
        heads_inner, n_rep, {in_order}, cB, cH, cS, y);
}}""")


def _bounds(blocks: int) -> tuple:
    """Edits asking the 16-byte kernels for ``blocks`` blocks of 128 threads an SM."""
    return (_kernel("norm_rotary_packs", "false", f"128, {blocks}"),
            _kernel("norm_rotary_packs_repeat", "FXK_NR_EVICT_REPEATS != 0", f"128, {blocks}"))


# A variant: source edits ((old, new) pairs), macros, and the output elements a 128-thread block takes
# (the 16-byte kernels in 32-bit types: per_block_32bit).
SHIPPED = {"edits": (), "macros": "", "per_block": 8192, "per_block_32bit": 4096}
VARIANTS: dict[str, dict] = {
    "shipped (eager's layout out, 16-byte kernels of their own, tables loaded with the row, 1 row a thread group, "
    "8192 a block, 4096 in float32, repeats evict-first)": SHIPPED,
    "8192 a block in float32 too (shipped until 2026-11-26 10:28 UTC)": {**SHIPPED, "per_block_32bit": 8192},
    # the queries' result contiguous (B, H, S, D), rows written 32 heads apart (before 2026-11-26 10:30 UTC)
    "contiguous results (shipped until 2026-11-26)": {**SHIPPED, "contiguous": True},
    "one kernel for every alignment (2 rows a group, tables after the sum of squares; shipped until 2026-11-26)": {
        **SHIPPED, "edits": ((_PACKS_GUARD + _PACKS_CALL, "    norm_rotary<T, MODE, EVICT>" + _ARGS),)},
    # norm_rotary (the kernel for every alignment: the TensorRT plugins', and eager's where 16-byte packs do not
    # fit) with the 16-byte kernels' path (tables loaded with the row, a row a group; 55-64 registers where it
    # takes 62-80), its element-wise paths at 1 or 2 rows a group. 2026-11-26 12:15 UTC, H200, on the 16-byte
    # rows: q float32 3320 / 3295 GB/s (Qwen3 / Gemma 3), bfloat16 3199 / 3109, against norm_rotary's 3866 /
    # 3862 and 3696 / 3613 in the same run; one element off alignment (its element-wise path) 1971 / 1003 at
    # 1 row and 2237 / 1106 at 2 (float32 / bfloat16) against 2490 / 1204. Not shipped: the TensorRT
    # plugins keep norm_rotary as it is
    "one kernel for every alignment with the 16-byte kernels' path, 1 row a group in the element-wise paths": {
        **SHIPPED, "macros": "#define FXK_NR_ROWS 1\n",
        "edits": ((_PACKS_GUARD + _PACKS_CALL, "    norm_rotary<T, MODE, EVICT>" + _ARGS), _AHEAD_ANY)},
    "one kernel for every alignment with the 16-byte kernels' path, 2 rows a group in the element-wise paths": {
        **SHIPPED, "edits": ((_PACKS_GUARD + _PACKS_CALL, "    norm_rotary<T, MODE, EVICT>" + _ARGS), _AHEAD_ANY)},
    # a group loads its next row before it reduces and writes the current one (_PIPELINE). 2026-11-26 12:59 UTC,
    # H200: 70 registers in float32, 64 in 16-bit types: q float32 3990 / 3989 GB/s (Qwen3 / Gemma 3) against
    # the shipped 4053 / 4045, bfloat16 3936 / 3858 against 3945 / 3887; at 8 blocks an SM (64
    # registers, no spill) float32 4071 / 4070 (+0.4-0.6%; inductor's Gemma 3: 4116), bfloat16 3909 / 3808
    # (1-2% slower); the keys level. Not shipped
    "rows in a software pipeline (the next row's loads before this row's reduction)": {
        **SHIPPED, "edits": _PIPELINE},
    "rows in a software pipeline, launch bounds of 8 blocks an SM": {**SHIPPED, "edits": _PIPELINE + _bounds(8)},
    "2 rows a thread group": {**SHIPPED, "macros": "#define FXK_NR_PACK_ROWS 2\n"},
    "tables loaded after the sum of squares": {
        **SHIPPED, "edits": ((_PACKS_CALL, _PACKS_CALL.replace("true, EVICT", "false, EVICT")),)},
    "tables loaded after the sum of squares, 2 rows a thread group": {
        **SHIPPED, "edits": ((_PACKS_CALL, _PACKS_CALL.replace("true, EVICT", "false, EVICT")),),
        "macros": "#define FXK_NR_PACK_ROWS 2\n"},
    # (a row's sum of squares in another order: within rounding of the shipped kernel's, not equal to the
    # bit). 2026-11-26 10:27 UTC, H200: float32 3% slower, bfloat16 queries 0.8-1.5% faster; with the
    # tables after the sum of squares 4-7% slower; not shipped
    "2 packs a half a thread (8 threads a float32 row of 128)": {
        **SHIPPED, "exact": False, "edits": ((_PACKS_CALL, _PACKS_CALL.replace("V, 1, FXK_NR_PACK_ROWS", "V, 2, FXK_NR_PACK_ROWS")),)},
    "2 packs a half a thread, tables loaded after the sum of squares": {
        **SHIPPED, "exact": False, "edits": ((_PACKS_CALL, _PACKS_CALL.replace("V, 1, FXK_NR_PACK_ROWS, true",
                                                               "V, 2, FXK_NR_PACK_ROWS, false")),)},
    # 2026-11-26, H200: float32 0.9-1.8% faster, bfloat16 queries 2.3-3.5% slower; since 10:28 UTC the
    # float32 kernels take 4096 (twin ops for 32-bit types), so this variant is the 16-bit grid's
    "4096 a block": {**SHIPPED, "per_block": 4096},
    "16384 a block": {**SHIPPED, "per_block": 16384},
    # 2026-11-26, H200: the hint behind a branch on R in the one kernel, q 3673/3665 GB/s against
    # 3907/3902 float32 and k 3871 against 3745; as a second instantiation in the one kernel (96
    # registers a thread; 80 with launch bounds asking 6 blocks an SM), k 3864 against 3746 and q
    # bfloat16 0.6-1.1% slower. Since, a kernel of its own for repeats.
    "repeated rows stored as any other": {**SHIPPED, "macros": "#define FXK_NR_EVICT_REPEATS 0\n"},
    # (the output is read by nothing here; attention reads it next in a model, so the hint may cost it there)
    # the 16-byte kernels held to fewer registers, for more blocks an SM (56 allow 9 of 128 threads).
    # 2026-11-26, H200, at 48 registers: bfloat16 queries 0.9-1.7% faster, the rest 0.3-0.5% slower;
    # at 12 blocks (40 registers) they spill. Not shipped
    # the repeating kernel built without in_order (eager launches it only for n_rep > 1, always contiguous)
    # (2026-11-26 10:23 UTC, H200: level with the shipped kernel in every repeated case, within 0.5%; not shipped)
    "repeating kernel without in_order": {**SHIPPED, "edits": (
        _kernel("norm_rotary_packs_repeat", "FXK_NR_EVICT_REPEATS != 0", in_order="0"),)},
    "launch bounds of 10 blocks an SM": {**SHIPPED, "edits": _bounds(10)},
    # (2026-11-26, H200: 0.2-0.4% slower on the queries, the keys level)
    "rows written once stored evict-first too": {
        **SHIPPED, "edits": (_kernel("norm_rotary_packs", "true"),)},
}


def variant_op(label: str, v: dict, index: int):
    """The variant's eager kernels as private ops (norm_rotary.NORM_ROTARY_STRIDED, NORM_ROTARY_PACKS and
    NORM_ROTARY_PACKS_REPEAT, with the variant's macros and grid); ``make(form)`` is a public op's eager
    path over them (with ``contiguous``, its meta_fn giving a contiguous output, which the kernel writes)."""
    import fxkern
    from fxkern.library import norm_rotary
    from fxkern.symbolic import cdiv

    def geometry(inputs, outputs, per=v["per_block"]):
        return (cdiv(outputs[0].numel(), per),), (128,)

    def geometry_32bit(inputs, outputs, per=v["per_block_32bit"]):
        return (cdiv(outputs[0].numel(), per),), (128,)

    source = common.apply_edits(norm_rotary.SOURCE, v["edits"], label, "norm_rotary.SOURCE")
    name = f"fxkern_tune::norm_rope_{index}"
    strided = norm_rotary.strided_launchers(
        *((name + suffix, dataclasses.replace(spec, kernel_source=v["macros"] + source, geometry=fxkern.Custom(geometry)))
          for suffix, spec in (("", norm_rotary.NORM_ROTARY_STRIDED), ("_packs", norm_rotary.NORM_ROTARY_PACKS),
                               ("_packs_repeat", norm_rotary.NORM_ROTARY_PACKS_REPEAT))),
        geometry_32bit=geometry_32bit)
    if v.get("contiguous"):
        class Contiguous(norm_rotary._Form):
            def output(self, *args):
                return super().output(*args).contiguous()

        return lambda form: norm_rotary._eager(Contiguous(form.name, form.gemma, form.repeat), strided)
    return lambda form: norm_rotary._eager(form, strided)


def cases():
    """(name, op name, args) in each dtype."""
    def heads(b, s, h, d, dt, heads_first):
        x = torch.randn(b, s, h * d, device="cuda").to(dt).view(b, s, h, d)
        pos = torch.arange(s, device="cuda", dtype=torch.float32)[:, None]
        emb = pos * (1.0 / 10000 ** (torch.arange(0, d, 2, device="cuda") / d))[None]
        emb = torch.cat((emb, emb), -1)[None, None]
        w = torch.randn(d, device="cuda").to(dt)
        return x.transpose(1, 2) if heads_first else x, w, emb.cos().to(dt), emb.sin().to(dt), 1e-6, d // 2

    out = []
    for dt in DTYPES:
        name = str(dt)[6:]
        out.append((f"Qwen3 q 16x2048x32x128 {name}", "rms_norm_rotary_embedding",
                    heads(16, 2048, 32, 128, dt, False)))
        out.append((f"Gemma 3 q 16x32x2048x128 {name}", "gemma_rms_norm_rotary_embedding",
                    heads(16, 2048, 32, 128, dt, True)))
        out.append((f"Qwen3 k 16x2048x8x128 to 32 heads {name}", "rms_norm_rotary_embedding_repeat_kv",
                    (*heads(16, 2048, 8, 128, dt, False), 16, 8, 4, 2048, 128, 32)))
        x, *rest = heads(16, 2048, 32, 128, dt, False)
        shifted = torch.empty(x.numel() + 1, device="cuda", dtype=dt)[1:].view(x.shape).copy_(x)
        out.append((f"Qwen3 q 16x2048x32x128 {name}, one element off 16-byte alignment", "rms_norm_rotary_embedding",
                    (shifted, *rest)))
    return out


def two_ops(name: str):
    """The library's norm op, then its rotary op (with the repeat): what the rules ran before the fused op."""
    import fxkern.library as lib

    gemma = name.startswith("gemma")
    norm = lib.op("gemma_rms_norm" if gemma else "rms_norm")
    rotate = lib.op("rotary_embedding_repeat_kv" if name.endswith("repeat_kv") else "rotary_embedding")

    def run(x, weight, cos, sin, eps, half, *sizes):
        n = norm(x, weight, eps)
        return rotate(n if gemma else n.transpose(1, 2), cos, sin, half, *sizes)

    return run


def main(argv=None) -> None:
    args = common.tuning_args("norm_rope_tuning", "q/k norm + rotary tuning", __doc__, argv)
    if args is None:
        return
    import fxkern.library
    from fxkern.library import norm_rotary

    fxkern.library.rules()
    torch.manual_seed(0)
    makers = {label: variant_op(label, v, i) for i, label, v in common.pick(VARIANTS, args)}
    labels = ("inductor", "norm op, then rotary op", *makers)
    table: dict[str, list[float]] = {label: [] for label in labels}
    all_cases = cases()
    for case, name, call in all_cases:
        form = norm_rotary._Form(name, name.startswith("gemma"), name.endswith("repeat_kv"))
        pattern = getattr(norm_rotary, name)
        runs = {"inductor": common.inductor(pattern), "norm op, then rotary op": two_ops(name),
                **{label: make(form) for label, make in makers.items()}}
        want = fxkern.library.op(name)(*call)
        for label, fn in runs.items():
            if label in VARIANTS:
                # the GPU tests' tolerance against eager (tests/test_library_gpu.py, EAGER_TOL)
                inexact = (1e-5, 1e-5) if call[0].dtype == torch.float32 else (5e-2, 3e-2)
                rtol, atol = (0, 0) if VARIANTS[label].get("exact", True) else inexact
                torch.testing.assert_close(fn(*call), want, rtol=rtol, atol=atol, msg=lambda m: f"{label}, {case}: {m}")
        tensors = [a for a in call if isinstance(a, torch.Tensor)]
        nbytes = sum(t.numel() * t.element_size() for t in tensors) + want.numel() * want.element_size()
        for label, gbs in common.bandwidth_rows(runs, [(call, nbytes)], args.rounds).items():
            table[label] += gbs
    body = common.variant_section("q/k norm + rotary tuning (`fxkern.library.norm_rotary`)", "norm_rope_tuning.py",
                                  args, __doc__, [case for case, _, _ in all_cases], table)
    common.emit("norm_rope_tuning", body, args.section_out)


if __name__ == "__main__":
    main()
