"""The scaled, masked softmax (``fxkern.library.softmax``) against variants of itself and inductor.

    python benchmarks/masked_tuning.py [--rounds 3] [--section-out FILE]

transformers' eager attention at the demo model's scores and at long rows: ``scores * 0.125 +
mask`` with the (b, 1, q, k) causal mask transformers builds, a float32 softmax cast back. Each
variant runs on the grids the library picks (``softmax._grid``); the library's choice first. GB/s of
useful bytes (scores, mask and output once each), CUDA events around 10 back-to-back calls, the GPU
kept busy by an untimed call before each sample, median of 20, then the median over rounds (the
order rotated each round); registers a thread per grid, float32/bfloat16, with spill bytes.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402

SHAPES = ((8, 32, 512), (2, 16, 2048))  # (batch, heads, sequence)
DTYPES = (torch.float32, torch.bfloat16)

# A variant: the grids' tuning as ``softmax._grids`` takes it (blocks an SM for the float32 and the
# 16-bit small blocks and for the 256-thread float32 grid, the grids that fetch a row before making
# its values), and edits to the kernel's source, softmax.SOURCE ((old, new) pairs of text).
# softmax.NARROW_GRIDS's suffixes (the 4-pack blocks)
NARROW = ("_short_4packs", "_4packs_2048", "_4packs_2048_32bit")


def _variant(edits=(), long_rows=True, **tuning) -> dict:
    """The shipped grids with ``tuning``'s changes and ``edits`` to the source. ``long_rows``: rows past
    2048 keys as shipped (softmax.MASKED_LONG_TUNING, whatever ``fetch_first`` says of the shorter rows'
    grids), else as before 2026-11-28 (softmax.MASKED_TUNING: no LONG grid, nothing past 2048 fetched first)."""
    from fxkern.library import softmax

    merged = {**(softmax.MASKED_LONG_TUNING if long_rows else softmax.MASKED_TUNING), **tuning}
    if long_rows and "fetch_first" in tuning:  # a change to the shorter rows' grids keeps the long ones'
        merged["fetch_first"] = (*tuning["fetch_first"], *softmax.LONG_FETCH_FIRST)
    return {"tuning": merged, "edits": edits}


# Loads with cache eviction hints, as rmsnorm's two-read kernel makes them: the scores streamed
# (evict first), the mask, read again for every head, kept (evict last).
_HINTS = (
    ("template <typename T, bool CAP = false, bool SINK = false>\nstruct MaskedRows {",
     "#define FXK_EVICT_HINTS 1\n" + "{load_evict}\ntemplate <typename T, bool CAP = false, bool SINK = false>\n"
     "struct MaskedRows {{"),
    ("return {load<T, V>(r.x + col), load<T, V>(r.m + col)};",
     "return {load_evict<T, V, false>(r.x + col, l2_policy<false>()), "
     "load_evict<T, V, true>(r.m + col, l2_policy<true>())};"),
)
# Measured 2026-11-24 (H200) and not shipped: memory order for masks of at most 2 MB a batch, chosen
# at run time (bfloat16 at 512 +4%, but the float32 kernels spilled 72 bytes and lost 5% at 2048);
# the hints help rows of 2048 (float32 +10%, bfloat16 +4%) and cost float32 rows of 512 15%.
# 2026-11-25: fetching 2 or 4 of a row's 8 packs before making their values (at half the blocks an
# SM) was slower than fetching none or all (2x16x2048x2048 float32: 2406 and 2817 GB/s, against 3369
# and 3399); 16-bit blocks of 64 threads at 12 an SM, float32 small ones at 12 an SM, and 256-thread
# float32 blocks at 3 an SM were slower or level.
# 2026-11-25 18:20-18:40 UTC, on an H100 (no H200 was lent; the shipped kernel there: 2863, 2816-2830,
# 2845-2849 and 2792-2798 GB/s in this table's four columns, 93-95% of the H100's copy, where the
# H200 run above reached 77-80% of its copy in three of them). Nsight Compute (tools/masked_study.sh)
# put the shipped kernels at 25% occupancy (128 and 124 registers), issue slots 40-48% busy, no
# eligible warp half the time, DRAM 79-85% busy: bound by the loads a thread keeps in flight, not by
# instructions. Tried and not shipped: exp(x - max) once an element,
# kept in registers for the write (146-223 registers: 12 or 8 blocks an SM; bfloat16 1626-2381, float32
# at 2048 2435); the mask copied to shared memory by cp.async while the scores load into registers
# (level: 2825, 2791; at 24 or 32 blocks an SM the 16-bit kernel spilled 112-216 bytes, its 16 load
# addresses alone taking 32 registers); and on top of that, small blocks taking 4 or 8 register-fulls
# of rows, each fetching its next rows before reducing the current ones (108 registers, no spill,
# bfloat16 2430-2654: 5-14% slower; the next rows' loads add no bytes in flight an SM, and a load of a
# row that may be dead merged with the previous row's pack element by element until the dead rows
# loaded from the tensor's start instead: at first 1819). The last two are commit 4ccc0ce (its variants
# run there), reverted after it.
# 16-bit rows of up to 32 elements a thread (the 4-pack blocks) keep each exp(x - m_thread) of the sum
# pass in registers, and the write takes it times exp(m_thread - max) / sum: one MUFU.EX2 an element
# instead of two (the soft-capped kernel's XU pipe, tanh and two exp2 an element, ran 57% busy). A
# thread whose elements are all -inf writes 0 * (1 / sum): 0, or NaN for a row of -inf, as eager.
EXP_ONCE = (
    "    const float sh = m == neg_inf() ? 0.0f : m;\n    float s = 0.0f;\n",
    "    const float sh = m == neg_inf() ? 0.0f : m, own = m;\n    float s = 0.0f;\n"
    "    constexpr bool KEEP = sizeof(T) == 2 && NV * V <= 32;\n"
    "    float e[KEEP ? NV : 1][KEEP ? V : 1];\n"), (
    "            for (int j = 0; j < V; ++j) s += exp_shifted<sizeof(T) == 2>(f[j], sh);\n",
    "            for (int j = 0; j < V; ++j) {\n"
    "                const float v = exp_shifted<sizeof(T) == 2>(f[j], sh);\n"
    "                if constexpr (KEEP) e[KEEP ? k : 0][KEEP ? j : 0] = v;\n"
    "                s += v;\n"
    "            }\n"), (
    "    const float inv = __frcp_rn(s);  // 1.0f / s, without the division's slow path\n",
    "    const float inv = __frcp_rn(s);  // 1.0f / s, without the division's slow path\n"
    "    const float kept = own == neg_inf() ? 0.0f * inv : exp_shifted<true>(sh, m) * inv;\n"), (
    "            opaque(c[k]);\n            to_floats(c[k], f);\n#pragma unroll\n"
    "            for (int j = 0; j < V; ++j) f[j] = exp_shifted<sizeof(T) == 2>(f[j], m) * inv;\n",
    "            if constexpr (KEEP) {\n#pragma unroll\n"
    "                for (int j = 0; j < V; ++j) f[j] = e[KEEP ? k : 0][KEEP ? j : 0] * kept;\n"
    "            } else {\n"
    "                opaque(c[k]);\n                to_floats(c[k], f);\n#pragma unroll\n"
    "                for (int j = 0; j < V; ++j) f[j] = exp_shifted<sizeof(T) == 2>(f[j], m) * inv;\n"
    "            }\n")
# The 16-bit write pass's exp(x - max) / sum as one exp2 (an fma, no multiplication by 1 / sum).
FUSED_WRITE = (
    "    const float inv = __frcp_rn(s);  // 1.0f / s, without the division's slow path\n",
    "    const float inv = __frcp_rn(s);  // 1.0f / s, without the division's slow path\n"
    "    const float nl = -__log2f(s);\n"), (
    "            for (int j = 0; j < V; ++j) f[j] = exp_shifted<sizeof(T) == 2>(f[j], m) * inv;\n",
    "            for (int j = 0; j < V; ++j) {\n"
    "                if constexpr (sizeof(T) == 2) {\n"
    "                    float r;\n"
    "                    asm(\"ex2.approx.ftz.f32 %0, %1;\" : \"=f\"(r) : \"f\"(fmaf(f[j] - m, 1.4426950408889634f, nl)));\n"
    "                    f[j] = r;\n"
    "                } else {\n"
    "                    f[j] = exp_shifted<false>(f[j], m) * inv;\n"
    "                }\n"
    "            }\n")
# float32's exp back on exp2f (FXK_EXP_FTZ 0), and every row reduced twice, barriers too (rows of more
# than a warp; the 2048-key grids' rows since 2026-11-26 14:10 UTC): edits masked_tuning and
# softcap_tuning both time.
EXP2F = (("#define FXK_EXP_FTZ 1", "#define FXK_EXP_FTZ 0"),)
BARRIERS_TOO = (("#define FXK_TWO_REDUCTIONS_G 32", "#define FXK_TWO_REDUCTIONS_G 1024"),)
# 16-bit exp(x - m) as ex2(fma(x, log2(e), -m * log2(e))), one FFMA where it took an FADD and an FMUL,
# in the sum pass and the write (flash attention's form); a shift whose m * log2(e) is not finite
# (m +-inf or past 2.4e38, a row of finfo.min) keeps the subtraction first. The exponent then carries
# m * log2(e)'s rounding: a relative error of about |m| * 2^-24 in each exp (1e-4 at |m| = 1000, a
# tenth of a float16 ulp).
FMA_EXP = ((
    "            for (int j = 0; j < V; ++j) s += exp_shifted<sizeof(T) == 2>(f[j], sh);\n",
    "            if (sizeof(T) == 2 && fma_ok) {\n"
    "#pragma unroll\n                for (int j = 0; j < V; ++j) s += exp_fma(f[j], shl);\n"
    "            } else {\n"
    "#pragma unroll\n                for (int j = 0; j < V; ++j) s += exp_shifted<sizeof(T) == 2>(f[j], sh);\n"
    "            }\n"), (
    "    const float sh = m == neg_inf() ? 0.0f : m;\n",
    "    const float sh = m == neg_inf() ? 0.0f : m, shl = sh * 1.4426950408889634f;\n"
    "    const bool fma_ok = fabsf(shl) <= 3.0e38f;\n"), (
    "    const float inv = __frcp_rn(s);  // 1.0f / s, without the division's slow path\n",
    "    const float inv = __frcp_rn(s);  // 1.0f / s, without the division's slow path\n"
    "    const float ml = m * 1.4426950408889634f;\n"
    "    const bool fma_w = fabsf(ml) <= 3.0e38f;\n"), (
    "            for (int j = 0; j < V; ++j) f[j] = exp_shifted<sizeof(T) == 2>(f[j], m) * inv;\n",
    "            if (sizeof(T) == 2 && fma_w) {\n"
    "#pragma unroll\n                for (int j = 0; j < V; ++j) f[j] = exp_fma(f[j], ml) * inv;\n"
    "            } else {\n"
    "#pragma unroll\n                for (int j = 0; j < V; ++j) f[j] = exp_shifted<sizeof(T) == 2>(f[j], m) * inv;\n"
    "            }\n"), (
    "// The softmax of a row held in registers, written to yr:",
    "__device__ __forceinline__ float exp_fma(float v, float ml) {\n"
    "    float r;\n"
    "    asm(\"ex2.approx.ftz.f32 %0, %1;\" : \"=f\"(r) : \"f\"(fmaf(v, 1.4426950408889634f, -ml)));\n"
    "    return r;\n"
    "}\n"
    "// The softmax of a row held in registers, written to yr:"))
# Rows staged through shared memory (2026-11-26, H200: 30-86% of the shipped kernels' speed, 1880-1969
# GB/s at 512 keys in either dtype against 3275-3938, 1017-2910 at 2048 against 3339-3388; soft-capped
# 1288-2253 against 2640-3156; the `masked_staged_h200` section of docs/benchmarks.md; not shipped).
# The idea: on the H200, whose copy runs
# at 4.2 TB/s to the H100's 3.0 with the same 132 SMs, the shipped kernels reach 77-80% of copy at
# 16-bit 512 keys and at 2048 where the H100 reaches 93-95%: they are bound by the bytes a thread
# keeps in flight in registers (above). Here each warp takes a contiguous chunk of rows, one row at
# a time across its 32 lanes, and keeps the next FXK_STAGES - 1 rows' scores and mask rows on their
# way into shared memory (cp.async, 16 bytes a lane a copy) while it makes the current row's softmax
# from shared memory in registers (write_row): bytes in flight that hold no register. A block is
# FXK_STAGED_THREADS threads; its dynamic shared memory, a (scores row, mask row) slot per stage per
# warp; 32 rows a warp.
STAGED = r"""
namespace fxk {
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// Row r's scores and mask row into slot (2 * D elements), a warp's lanes 16 bytes a copy each.
template <typename T, bool CAP>
__device__ __forceinline__ void stage_row(const MaskedRows<T, CAP>& in, unsigned r, int D, int lane, T* slot) {
    constexpr int V = 16 / sizeof(T);
    const auto xr = in.row(r);
    for (int col = lane * V; col < D; col += 32 * V) {
        cp_async16(slot + col, xr.x + col);
        cp_async16(slot + D + col, xr.m + col);
    }
}

template <typename T, bool CAP>
__device__ __forceinline__ void staged_rows(const MaskedRows<T, CAP>& in, int D, unsigned rows, T* __restrict__ y,
                                            T* stage) {
    constexpr int V = 16 / sizeof(T), S = FXK_STAGES, NV = FXK_STAGED_MAX_D / (32 * V);
    const unsigned per_block = blockDim.x >> 5, warps = gridDim.x * per_block;
    const unsigned warp = blockIdx.x * per_block + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    const unsigned chunk = (rows + warps - 1) / warps;
    const unsigned begin = min(warp * chunk, rows), end = min(begin + chunk, rows);
    T* mine = stage + (size_t)(threadIdx.x >> 5) * S * 2 * D;
#pragma unroll
    for (int k = 0; k < S - 1; ++k) {
        if (begin + k < end) stage_row<T, CAP>(in, begin + k, D, lane, mine + (size_t)k * 2 * D);
        cp_async_commit();  // one group a row, empty past the end, so wait_group counts rows
    }
    for (unsigned r = begin, i = 0; r < end; ++r, ++i) {
        if (r + S - 1 < end) stage_row<T, CAP>(in, r + S - 1, D, lane, mine + (size_t)((i + S - 1) % S) * 2 * D);
        cp_async_commit();
        cp_async_wait<S - 1>();  // this lane's copies of row r have landed
        __syncwarp();            // and every lane's
        const T* slot = mine + (size_t)(i % S) * 2 * D;
        Pack<T, V> c[NV];
#pragma unroll
        for (int k = 0; k < NV; ++k) {
            const int col = (k * 32 + lane) * V;
            if (col < D) {
                typename MaskedRows<T, CAP>::template Raw<V> raw;
                raw.x = *reinterpret_cast<const Pack<T, V>*>(slot + col);
                raw.m = *reinterpret_cast<const Pack<T, V>*>(slot + D + col);
                c[k] = in.template value<V>(raw);
            }
        }
        write_row<T, V, NV>(c, true, D, 32, lane, y + in.row(r).o, nullptr);
        __syncwarp();  // every lane is done with the slot before it is staged again
    }
    cp_async_wait<0>();
}
}  // namespace fxk

template <typename T>
__global__ void __launch_bounds__(FXK_STAGED_THREADS)
staged_scaled_masked_softmax(const T* x, const T* mask, float scale, int H, int Q, int D, int n, int mB, int mH,
                             int mQ, T* y) {
    extern __shared__ __align__(16) unsigned char staged_smem[];
    constexpr int V = 16 / sizeof(T);
    if (D <= 0 || D % V || D > FXK_STAGED_MAX_D || !fxk::aligned16(x) || !fxk::aligned16(mask) || !fxk::aligned16(y))
        return;  // a variant for the benchmark's tensors only: whole aligned packs
    const fxk::MaskedRows<T> in(x, mask, scale, D, (unsigned)n / (unsigned)D, H, Q, mB, mH, mQ);
    fxk::staged_rows<T, false>(in, D, (unsigned)n / (unsigned)D, y, reinterpret_cast<T*>(staged_smem));
}

template <typename T>
__global__ void __launch_bounds__(FXK_STAGED_THREADS)
staged_softcapped_masked_softmax(const T* x, const T* mask, float scale, float cap, int H, int Q, int D, int n,
                                 int mB, int mH, int mQ, T* y) {
    extern __shared__ __align__(16) unsigned char staged_smem[];
    constexpr int V = 16 / sizeof(T);
    if (D <= 0 || D % V || D > FXK_STAGED_MAX_D || !fxk::aligned16(x) || !fxk::aligned16(mask) || !fxk::aligned16(y))
        return;
    const fxk::MaskedRows<T, true> in(x, mask, scale, D, (unsigned)n / (unsigned)D, H, Q, mB, mH, mQ, cap);
    fxk::staged_rows<T, true>(in, D, (unsigned)n / (unsigned)D, y, reinterpret_cast<T*>(staged_smem));
}
"""
ROWS_A_WARP = 32

# Rows brought into shared memory by the Hopper bulk copy (cp.async.bulk, the copy engine TMA also
# drives): the idea is the staged kernel's, bytes in flight that hold no register, without its cost
# in instructions and in warps (one thread's copy of a whole row instead of a 16-byte cp.async a lane,
# and a block of ROW_THREADS threads consuming a stage together, as the register kernels do). A block
# takes a contiguous chunk of rows in passes of ROW_THREADS / G rows (G threads a row, FXK_BULK_PACKS
# packs a thread, as softmax_rows lays them out); a pass's scores and mask rows land in one of
# FXK_BULK_STAGES stages, each with an mbarrier the copies complete. Warp 0 issues pass p + S once
# every thread has taken pass p's values into registers (the __syncthreads after the read), so S - 1
# passes are in flight while one is reduced and written. The grid is FXK_BULK_BLOCKS blocks an SM.
# Measured 2026-11-26 and not shipped (GB/s at float32 / bfloat16 512 keys, float32 / bfloat16 2048):
# - scores and mask copied, on an H100 (13:32 UTC): 1861-2717 against the shipped 2825-2922; the best,
#   4 stages of 128 threads x 4 packs, 3 blocks an SM, 2437 / 2392 / 2717 / 2536 against 2863 / 2922 /
#   2835 / 2825; soft-capped 1629-2605 against 2587-2769.
# - the scores copied, the mask loaded by the threads (MASK_DIRECT), on an H200 (13:35 UTC): the best, 3
#   stages of 256 x 4, 4 blocks an SM, 3535 / 3191 / 3326 / 3202 against 3958 / 3472 / 3418 / 3442;
#   soft-capped 2953 / 2644 / 2722 / 2646 against 3174 / 2916 / 2827 / 2949; 6 stages of 2 packs 2116-2570.
# - Nsight Compute (H200, 13:40 UTC, bfloat16 2x16x2048): DRAM 63.7% busy against the shipped kernel's 68.4%,
#   issue slots 68% against 76%, 41% occupancy. The bytes are in flight, but a block reduces and writes one
#   pass at a time between barriers, and fewer passes run at once than the register kernel's rows: more
#   stages of fewer packs (more, shorter passes) were slower still.
BULK = r"""
namespace fxk {
__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(unsigned long long* bar, unsigned parity) {
    unsigned done;
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
    return done != 0;
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}

template <typename T, bool CAP>
__device__ __forceinline__ void bulk_rows(const MaskedRows<T, CAP>& in, int D, unsigned rows, T* __restrict__ y,
                                          T* stages, unsigned long long* full, float (*red)[ROW_WARPS]) {
    constexpr int V = 16 / sizeof(T), NV = FXK_BULK_PACKS, S = FXK_BULK_STAGES;
    unsigned begin, end;
    block_rows((unsigned)D, rows, begin, end);
    const int G = row_group(D, V * NV);
    const int groups = ROW_THREADS >> log2_of(G), g = threadIdx.x >> log2_of(G), t = threadIdx.x & (G - 1);
    const unsigned passes = end > begin ? (end - begin + groups - 1) / groups : 0u;
    // a pass's score rows, then (unless FXK_BULK_MASK_DIRECT: the threads load them, from L2) its mask rows
    constexpr int COPIES = FXK_BULK_MASK_DIRECT ? 1 : 2;
    const size_t stage = (size_t)COPIES * groups * D;
    const unsigned bytes = (unsigned)D * sizeof(T);
    // warp 0: pass p's rows into stage p % S, lane k the rows k, k + 32... of the pass
    auto issue = [&](unsigned p) {
        const unsigned first = begin + p * groups, n = min((unsigned)groups, end - first);
        unsigned long long* bar = full + p % S;
        T* st = stages + (p % S) * stage;
        if (threadIdx.x == 0) mbar_expect_tx(bar, COPIES * n * bytes);
        __syncwarp();
        for (unsigned k = threadIdx.x; k < n; k += 32) {
            const auto r = in.row(first + k);
            bulk_load(st + (size_t)k * D, r.x, bytes, bar);
            if (!FXK_BULK_MASK_DIRECT) bulk_load(st + (size_t)(groups + k) * D, r.m, bytes, bar);
        }
    };
    if (threadIdx.x == 0) {
        for (int s = 0; s < S; ++s) mbar_init(full + s, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x < 32)
        for (unsigned p = 0; p < S && p < passes; ++p) issue(p);
    for (unsigned p = 0; p < passes; ++p) {
        const unsigned row = begin + p * groups + g;
        const bool live = row < end;
        const auto xr = in.row(live ? row : begin);
        Pack<T, V> m[FXK_BULK_MASK_DIRECT ? NV : 1];
        if constexpr (FXK_BULK_MASK_DIRECT) {
#pragma unroll
            for (int k = 0; k < NV; ++k) {
                const int col = (k * G + t) * V;
                if (live && col < D) m[k] = load<T, V>(xr.m + col);  // while the scores land
            }
        }
        while (!mbar_try_wait(full + p % S, (p / S) & 1)) {}
        const T* st = stages + (p % S) * stage;
        Pack<T, V> c[NV];
#pragma unroll
        for (int k = 0; k < NV; ++k) {
            const int col = (k * G + t) * V;
            if (live && col < D) {
                typename MaskedRows<T, CAP>::template Raw<V> raw;
                raw.x = *reinterpret_cast<const Pack<T, V>*>(st + (size_t)g * D + col);
                if constexpr (FXK_BULK_MASK_DIRECT)
                    raw.m = m[k];
                else
                    raw.m = *reinterpret_cast<const Pack<T, V>*>(st + (size_t)(groups + g) * D + col);
                c[k] = in.template value<V>(raw);
            }
        }
        __syncthreads();  // every thread has pass p's values: its stage may be refilled
        if (threadIdx.x < 32 && p + S < passes) issue(p + S);
        write_row<T, V, NV>(c, live, D, G, t, y + xr.o, red + 2 * (p & 1));
    }
}
}  // namespace fxk

namespace fxk {
// Both entry points: whole aligned packs only (a variant for the benchmark's tensors), a row a pass at most.
template <typename T, bool CAP>
__device__ __forceinline__ void bulk_masked(const T* x, const T* mask, float scale, float cap, int H, int Q, int D,
                                            int n, int mB, int mH, int mQ, T* y) {
    extern __shared__ __align__(128) unsigned char bulk_smem[];
    __shared__ float red[4][ROW_WARPS];
    __shared__ __align__(8) unsigned long long full[FXK_BULK_STAGES];
    constexpr int V = 16 / sizeof(T);
    if (D <= 0 || D % V || D > ROW_THREADS * FXK_BULK_PACKS * V || !aligned16(x) || !aligned16(mask) || !aligned16(y))
        return;
    const MaskedRows<T, CAP> in(x, mask, scale, D, (unsigned)n / (unsigned)D, H, Q, mB, mH, mQ, cap);
    bulk_rows<T, CAP>(in, D, (unsigned)n / (unsigned)D, y, reinterpret_cast<T*>(bulk_smem), full, red);
}
}  // namespace fxk

template <typename T>
__global__ void __launch_bounds__(ROW_THREADS, FXK_BULK_BLOCKS)
bulk_scaled_masked_softmax(const T* x, const T* mask, float scale, int H, int Q, int D, int n, int mB, int mH, int mQ,
                           T* y) {
    fxk::bulk_masked<T, false>(x, mask, scale, 1.0f, H, Q, D, n, mB, mH, mQ, y);
}

template <typename T>
__global__ void __launch_bounds__(ROW_THREADS, FXK_BULK_BLOCKS)
bulk_softcapped_masked_softmax(const T* x, const T* mask, float scale, float cap, int H, int Q, int D, int n, int mB,
                               int mH, int mQ, T* y) {
    fxk::bulk_masked<T, true>(x, mask, scale, cap, H, Q, D, n, mB, mH, mQ, y);
}
"""


def staged(stages: int = 3, threads: int = 128) -> dict:
    """A staged variant (STAGED): ``stages`` rows a warp in flight or in hand, ``threads`` a block."""
    return {"staged": {"stages": stages, "threads": threads}, "edits": ()}


def bulk(stages: int = 3, threads: int = 256, packs: int = 4, blocks: int = 2, mask_direct: bool = False) -> dict:
    """A bulk-copy variant (BULK): ``stages`` passes a block in flight or in hand, ``threads`` a block
    holding ``packs`` packs a thread of a pass, ``blocks`` blocks an SM (the grid: that many for each SM);
    ``mask_direct``: the threads load the mask rows themselves, only the scores are copied."""
    return {"bulk": {"stages": stages, "threads": threads, "packs": packs, "blocks": blocks,
                     "mask_direct": mask_direct}, "edits": ()}


# The bulk-copy variants masked_tuning and softcap_tuning both time (2026-11-26: all slower; BULK's comment).
BULK_VARIANTS = {
    "bulk copies, 3 stages of 256 threads x 4 packs, 2 blocks an SM": bulk(),
    "bulk copies, 4 stages of 256 threads x 2 packs, 3 blocks an SM": bulk(stages=4, packs=2, blocks=3),
    "bulk copies, 4 stages of 128 threads x 4 packs, 3 blocks an SM": bulk(stages=4, threads=128, blocks=3),
    "bulk copies, 6 stages of 256 threads x 2 packs, 2 blocks an SM": bulk(stages=6, packs=2, blocks=2),
    "bulk copies, 3 stages of 128 threads x 4 packs, 4 blocks an SM": bulk(stages=3, threads=128, blocks=4),
    "bulk copies of the scores, 3 stages of 256 threads x 4 packs, 4 blocks an SM": bulk(blocks=4, mask_direct=True),
    "bulk copies of the scores, 6 stages of 256 threads x 2 packs, 4 blocks an SM": bulk(stages=6, packs=2, blocks=4,
                                                                                        mask_direct=True),
    "bulk copies of the scores, 4 stages of 128 threads x 4 packs, 6 blocks an SM": bulk(stages=4, threads=128, blocks=6,
                                                                                        mask_direct=True),
}


SMALL_GRIDS = ("_short", "_32bit", "_short_32bit")


def small_packs(packs: int, blocks: int, fetch_first: bool = True, threads: int = 32, size: int = 2,
                longer_than: int = 0, grids: tuple[str, ...] = SMALL_GRIDS, steps: int = 1) -> dict:
    """Rows of ``size``-byte elements, longer than ``longer_than`` and of up to threads * packs * 16 / size
    elements, that the library runs in one of ``grids``, in blocks of ``threads`` holding ``packs`` packs
    a thread, ``blocks`` an SM, a block per ``steps`` register-fulls; other calls run the library's grids."""
    return {"small_packs": {"packs": packs, "blocks": blocks, "fetch_first": fetch_first, "threads": threads,
                            "size": size, "longer_than": longer_than, "grids": grids, "steps": steps}, "edits": ()}


# 16-bit rows of 8192 keys (the pieces fxkern.split cuts attention's scores past 2^31 elements into,
# timed with --shape 1,16,8192) run in the library's 16384-element grid: 128 threads a row of 8 packs,
# two rows a 256-thread block, 4 blocks an SM, values made as loads arrive. These hold a row in a
# block of 256 threads of 4 packs (one row a block), or fetch first.
LONG_VARIANTS = {
    "16-bit rows of 8192 in 256-thread blocks of 4 packs, 4 an SM": small_packs(
        4, 4, fetch_first=False, threads=256, longer_than=2048, grids=("",)),
    "16-bit rows of 8192 in 256-thread blocks of 4 packs, 5 an SM": small_packs(
        4, 5, fetch_first=False, threads=256, longer_than=2048, grids=("",)),
    "16-bit rows of 8192 in 256-thread blocks of 4 packs, 4 an SM, 2 rows a block": small_packs(
        4, 4, fetch_first=False, threads=256, longer_than=2048, grids=("",), steps=2),
    "16-bit rows of 8192 in 256-thread blocks of 4 packs, 4 an SM, fetched first": small_packs(
        4, 4, threads=256, longer_than=2048, grids=("",)),
    "16-bit rows of 8192 in 512-thread blocks of 2 packs, 3 an SM": small_packs(
        2, 3, fetch_first=False, threads=512, longer_than=2048, grids=("",)),
    "16-bit long rows, 3 blocks an SM": small_packs(8, 3, fetch_first=False, threads=256, longer_than=2048,
                                                    grids=("",)),
    "16-bit long rows fetched first, 2 blocks an SM": small_packs(8, 2, threads=256, longer_than=2048, grids=("",)),
    "16-bit long rows fetched first, 3 blocks an SM": small_packs(8, 3, threads=256, longer_than=2048, grids=("",)),
    # float32 rows of 2049-8192 run "_32bit": 256 threads a row of 8 packs, 2 blocks an SM (16 warps; the
    # soft-capped kernel at 53% of copy at 8192 keys, as far from memory's speed as inductor, its
    # exact tanhf's chains waiting on too few warps). These hold a row in twice the threads at half the
    # packs a thread. H200, 2026-11-28 19:42 UTC, 1x16x8192x8192 float32 GB/s (sections
    # softcap_tuning_f32_8192_h200_1128 and masked_tuning_f32_8192_h200_1128 of docs/benchmarks.md):
    # soft-capped: shipped 2235, 512-thread blocks fetched first 2740 (+23%), made as loads arrive 2342,
    # 1024-thread blocks 1313 (inductor 2186); masked: shipped 3559, 3241, 2359, 1392 (inductor 2942).
    # Not shipped yet: the soft-capped one's first is to run with the GPU tests (none ran on it), and its
    # EDGES kernel (odd rows of 2049-8189) with it.
    "float32 rows of 8192 in 512-thread blocks of 4 packs, 2 an SM, fetched first": small_packs(
        4, 2, threads=512, size=4, longer_than=2048, grids=("_32bit",)),
    "float32 rows of 8192 in 512-thread blocks of 4 packs, 2 an SM": small_packs(
        4, 2, fetch_first=False, threads=512, size=4, longer_than=2048, grids=("_32bit",)),
    "float32 rows of 8192 in 1024-thread blocks of 2 packs, 1 an SM, fetched first": small_packs(
        2, 1, threads=1024, size=4, longer_than=2048, grids=("_32bit",)),
}

# 2026-11-28 10:35 UTC, H200, 1x16x8192x8192, GB/s float32 / bfloat16: the grids then shipped 2664 / 2892
# (inductor 2913 / 1921); float32 long rows fetched first 3589 (312 B local), at 4 an SM 2924; 16-bit rows
# of 8192 in 256-thread blocks of 4 packs 2598 at 4 an SM, 2858 at 5, 2674 two rows a block, 2926 fetched
# first (40 B local), 512-thread blocks 2015 (spilling); 8 packs at 3 an SM 2876, fetched first at 2 an SM
# 3099. The two fetched-first ones shipped at 11:00 UTC (softmax.MASKED_LONG_TUNING).
# softcap_tuning.py, the same run: shipped 2268 / 2816, none faster (fetched first at 2 an SM 2580).

# Rows not in whole 16-byte packs (a prompt of odd length: --shape 4,32,1001 --shape 1,32,4001) took the
# kernel's scalar path until 2026-11-28, FXK_ROW_SCALARS elements a thread: 4, so a 256-thread block held
# rows of up to 1024 and longer ones were read twice (online max and sum, then the write). H200,
# 2026-11-28 13:21 UTC, GB/s 4x32x1001x1001 float32 / bfloat16, 1x32x4001x4001 float32 / bfloat16: the
# scalar path 1015 / 639, 1248 / 1057; 8 scalars a thread 1615 / 778, 1247 / 1061; 16 scalars 2139 / 804,
# 2060 / 856; inductor 2191 / 1128, 2068 / 1017. Since then they run the EDGES kernels (softmax.EDGES: the
# row read in the aligned packs around it).
def _scalars(n: int) -> tuple:
    return (("#ifndef FXK_ROW_SCALARS", f"#define FXK_ROW_SCALARS {n}\n#ifndef FXK_ROW_SCALARS"),)


# The EDGES kernels' first version, H200, 2026-11-28 14:02-14:20 UTC, GB/s as above: 3437 / 1267, 2487 / 1002.
# Diagnostics (wrong answers, for their cost): the mask read as one pack, unshifted, 3575 / 1262, 3169 / 1009;
# no -inf past a row's ends 3526 / 1234, 3079 / 1005; every pack stored whole 3312 / 1778, 2547 / 1682. nvcc
# had merged the whole pack's store with the edge elements' into 2- and 4-byte stores: store_row now
# writes it with one st.global.v4.
ODD_VARIANTS = {
    "rows not in whole packs: the scalar path, 4 scalars a thread (shipped until 2026-11-28)": _variant(edges=False),
    "rows not in whole packs: the scalar path, 16 scalars a thread": _variant(edges=False, edits=_scalars(16)),
    # H200, 2026-11-28 14:07 UTC, as a variant of every 16-bit small grid (these rows run only the EDGES
    # ones): 2481 GB/s against 2151 at 4x32x1001x1001 bfloat16, float32 and 4001 keys level; shipped
    # 2026-11-28 16:00 UTC (softmax.MASKED_LONG_TUNING's edges_fetch_first)
    "rows not in whole packs: 16-bit EDGES kernels fetched first (shipped until 2026-11-28 16:00 UTC)": _variant(
        edges_fetch_first=None),
    # H200, 2026-11-28 16:35 UTC, 4x32x1001 / 1x32x4001 bfloat16, GB/s: the EDGES kernels' -inf padding
    # apart from the loads in every grid (softmax.FXK_EDGES_PAD_APART 1) 2300 / 2421, where the 16:07 run
    # had it beside them at 2464 / 2164; the 16-bit small blocks loading all of a thread's score packs
    # first, then each pack's mask and values, 2290 / 2422 (deleted). 16:50 UTC, one run at bf1ad89: apart
    # in the 8-pack grid only (shipped) 2402 / 2418, apart everywhere 2234 / 2422, beside everywhere 2370 / 2192
    "rows not in whole packs: EDGES padding apart from the loads in every grid": _variant(
        edits=(("#define FXK_EDGES_PAD_APART 2", "#define FXK_EDGES_PAD_APART 1"),)),
    "rows not in whole packs: EDGES padding beside each load in every grid": _variant(
        edits=(("#define FXK_EDGES_PAD_APART 2", "#define FXK_EDGES_PAD_APART 0"),)),
    # The 16-bit small blocks fetching first hold three packs a pack until made: all 4 at once spilled 64
    # bytes (above). Fetched two packs at a time (72 registers, no spill) they ran 2152 GB/s against the
    # shipped 2477 at 4x32x1001 bfloat16 (H200, 2026-11-28 19:03 UTC; float32 and 4001 keys level); that
    # variant and its knob (FXK_EDGES_FETCH_GROUP) were then deleted.
    # float32 rows of up to 8189 not in whole packs: the _32bit EDGES kernel, fetched first, holds three packs
    # a pack (127 registers at its 2 blocks an SM, no spill). Made as loads arrive instead (76 registers) it
    # ran 2372 GB/s against 2542 at 1x32x4001 (H200, 2026-11-28 16:07 UTC); that variant was then deleted.
}


VARIANTS: dict[str, dict] = {
    "shipped": _variant(),
    "long rows made as loads arrive, 16-bit ones 4 an SM (shipped until 2026-11-28)": _variant(long_rows=False),
    "the softmax's grids, values made as loads arrive (shipped before 2026-11-25)": _variant(
        blocks_short_32bit=16, blocks_short=32, blocks_f32=None, fetch_first=()),
    "16-bit values made as loads arrive": _variant(fetch_first=()),
    "float32 long rows fetched first": _variant(fetch_first=("_short", "_32bit")),
    "float32 small blocks at 16 an SM": _variant(blocks_short_32bit=16),
    "float32 long rows at 4 an SM": _variant(blocks_f32=None),
    "16-bit write: one exp2 of (x - max) * log2(e) - log2(sum)": _variant(edits=FUSED_WRITE),
    "16-bit prologue on the float path": _variant(edits=(("#define FXK_MASK_PAIRS 1", "#define FXK_MASK_PAIRS 0"),)),
    "rows in memory order (b, h, q), as before 2026-11-24 21:00 UTC": _variant(edits=(
        ("if (sH == 0) {  // the same for every thread: no divergence", "if (false) {"),)),
    "hints (scores evict first, mask evict last)": _variant(edits=_HINTS),
    # 2026-11-26 10:45 UTC, H200 (bfloat16 at 512 keys, the only case they run): 4 packs at 28 blocks 3473
    # GB/s against the 8 packs' 3272, at 24 level (3284), at 32 (spilling 48 bytes) 2792; shipped at 28 since
    "16-bit rows of up to 1024 in 8 packs a thread (shipped until 2026-11-26 10:49 UTC)": _variant(blocks_narrow=None),
    "16-bit rows of up to 1024 in 4 packs a thread, 32 blocks an SM": small_packs(4, 32),
    # 2026-11-26 10:51 UTC, on an H100 (the shipped kernel 2845 / 2791 GB/s at 2048 keys float32 / bfloat16
    # there): 16-bit 64-thread blocks 2815 (+0.9%), float32 256-thread 2723, 128-thread 2834. On an H200 at
    # 11:55 and 12:01 UTC: 16-bit 64-thread 3439 / 3438 against 3397 / 3396, float32 128-thread 3418 / 3419
    # against 3298 / 3305, 256-thread 3145 / 3144; the 64- and 128-thread ones shipped at 12:05 UTC
    # (softmax.NARROW_GRIDS), so since then these run what "shipped" runs
    "rows of 2048 in the 8-pack one-warp and 256-thread blocks (shipped until 2026-11-26 12:05 UTC)": {
        **_variant(narrow=("_short_4packs",))},
    "16-bit rows of 2048 in 64-thread blocks of 4 packs a thread, 14 an SM": small_packs(4, 14, threads=64,
                                                                                          longer_than=1024),
    "float32 rows of 2048 in 256-thread blocks of 4 packs a thread, 3 an SM": small_packs(4, 3, threads=256, size=4,
                                                                                           longer_than=1024),
    "float32 rows of 2048 in 128-thread blocks of 4 packs a thread, 7 an SM": small_packs(4, 7, threads=128, size=4,
                                                                                           longer_than=1024),
    # 2026-11-26 11:58 UTC, H200, bfloat16 at 512 keys: 2285 / 2584 / 3153 / 2971 GB/s at 28 / 24 / 20 / 16
    # blocks an SM (136 / 104 / 32 bytes spilled, then 120 registers) against the shipped 3472: the
    # registers cost more than the second exp2; not shipped (softcap_tuning.py: the same)
    # (since 2026-11-26 12:05 UTC blocks_narrow also sets the 2048-row 4-pack grids' blocks: 24 gives 12 and 6 an SM)
    "16-bit exp once an element in the 4-pack blocks, 28 an SM": _variant(edits=EXP_ONCE),
    "16-bit exp once an element in the 4-pack blocks, 24 an SM": _variant(edits=EXP_ONCE, blocks_narrow=24),
    "16-bit exp once an element in the 4-pack blocks, 20 an SM": _variant(edits=EXP_ONCE, blocks_narrow=20),
    "16-bit exp once an element in the 4-pack blocks, 16 an SM": _variant(edits=EXP_ONCE, blocks_narrow=16),
    "16-bit rows of up to 1024 in 4 packs a thread, 24 blocks an SM": small_packs(4, 24),
    "16-bit rows of up to 1024 in 4 packs a thread, 28 blocks an SM": small_packs(4, 28),
    # 2026-11-26 13:45 UTC, H200, GB/s at bfloat16 512 / 2048 keys: the max in pairs 3599 / 3543 against
    # the max as floats 3464 / 3437 (the float32 columns, the same code, 3302-3401 between variants);
    # shipped at 14:00 UTC (softmax's FXK_PAIR_MAX). The FFMA exp with the max in pairs 3404 / 3446, alone
    # 3257 / 3326 (8 bytes spilled); not shipped
    "16-bit max as floats (shipped until 2026-11-26 14:00 UTC)": _variant(edits=(
        ("#define FXK_PAIR_MAX 1", "#define FXK_PAIR_MAX 0"),)),
    "16-bit exp through one FFMA": _variant(edits=FMA_EXP),
    # 2026-11-26 13:53 and 13:55 UTC, H200, GB/s at float32 / bfloat16 512 keys, float32 / bfloat16 2048: rows of
    # up to a warp reduced twice (the max, then the shifted sums) in every dtype 3802 / 3659 / 3500 / 3564 and
    # 3801 / 3656 / 3491 / 3593, against one reduction 3938 / 3592 / 3406 / 3524 and 3940 / 3591 / 3394 / 3527
    # (the 2048-key rows keep one reduction: G > 32); in 16-bit rows only 3941 / 3663 / 3394 / 3589. Shipped
    # at 14:05 UTC for 16-bit rows (softmax's FXK_TWO_REDUCTIONS 1)
    # (the edit overrides the 2048-key grids' own FXK_TWO_REDUCTIONS, set before the source since 14:10 UTC)
    "one reduction of (max, sum) pairs (shipped until 2026-11-26 14:05 UTC)": _variant(edits=(
        ("#ifndef FXK_TWO_REDUCTIONS\n#define FXK_TWO_REDUCTIONS 1\n#endif",
         "#undef FXK_TWO_REDUCTIONS\n#define FXK_TWO_REDUCTIONS 0"),)),
    # 2026-11-26 14:12 UTC, H200, GB/s at float32 / bfloat16 512 keys, float32 / bfloat16 2048: float32's exp
    # through ex2.approx.ftz 4088 / 3664 / 3665 / 3715 against exp2f (MUFU.EX2 behind a fix-up for subnormal
    # results, about 8 instructions an exp) 3946 / 3648 / 3244 / 3726; shipped at 14:20 UTC (FXK_EXP_FTZ)
    "float32 exp through exp2f (shipped until 2026-11-26 14:20 UTC)": _variant(edits=EXP2F),
    # 2026-11-26 14:02 UTC, H200, GB/s as above: 3939 / 3641 / 3330 / 3722 against 3936 / 3682 / 3306 / 3617 (the
    # float32 code unchanged here); the 2048-key grids' rows (2-4 warps) take it since 14:10 UTC (softmax._grids),
    # the others not: with the barriers' code in their kernels the rows of up to a warp ran 1% slower
    "two reductions in every row, barriers too": _variant(edits=BARRIERS_TOO),
    # 2026-11-26 14:12 UTC, in the run above: 3804 / 3668 / 3692 / 3670 (float32 512 keys 3.6% slower, 2048 +13.8%);
    # shipped for the 2048-key grids at 14:20 UTC (softmax._grids sets FXK_TWO_REDUCTIONS 2 there)
    "two reductions in float32 rows too": _variant(edits=(
        ("#define FXK_TWO_REDUCTIONS 1", "#define FXK_TWO_REDUCTIONS 2"),)),
    # x * scale + mask as one fma in float32, where eager rounds the product first (the float path before
    # 2026-11-26 16:03 UTC: the compiler contracted it; a review's probe found it up to 3.7e-5 off eager, H100)
    "float32 scores through one fma (shipped until 2026-11-26)": _variant(fetch_first=("_short", *NARROW), edits=(
        ("for (int j = 0; j < V; ++j) f[j] = __fmul_rn(f[j], scale);\n        to_floats(from_floats<T, V>(f), f);  // rounded",
         "for (int j = 0; j < V; ++j) f[j] *= scale;\n        to_floats(from_floats<T, V>(f), f);  // rounded"),
        ("for (int j = 0; j < V; ++j) f[j] = __fadd_rn(f[j], g[j]);\n        return from_floats<T, V>(f);\n    }\n};",
         "for (int j = 0; j < V; ++j) f[j] += g[j];\n        return from_floats<T, V>(f);\n    }\n};"))),
    # 2026-11-26 16:01 UTC, on an H100, GB/s at float32 512 keys, scale 0.125 / 1 / sqrt(128): the two roundings with
    # the float32 small blocks fetching first 2868 / 2867 (shipped at 16:03 UTC), making values as loads arrive
    # 2654 / 2653, one fma 2866 / 2865, one fma where the scale is a power of two 2826 / 2520; the other columns
    # level (the float32 2048-key blocks already fetched first: 2845 against the fma's 2858)
    "float32 small blocks making values as loads arrive (shipped until 2026-11-26 16:03 UTC)": _variant(
        fetch_first=("_short", *NARROW)),
    # the two roundings, but one fma where x * scale is exact (a scale that is a power of two, at most 1)
    "float32 scores through one fma where the scale is a power of two": _variant(edits=((
        "        float f[V], g[V];\n        to_floats(a, f);\n#pragma unroll\n        for (int j = 0; j < V; ++j) f[j] = __fmul_rn(",
        "        if constexpr (sizeof(T) == 4) {\n"
        "            if ((__float_as_uint(scale) << 9) == 0 && scale <= 1.0f && scale >= 0x1p-100f) {\n"
        "                float f[V], g[V];\n                to_floats(a, f);\n                to_floats(m, g);\n"
        "#pragma unroll\n                for (int j = 0; j < V; ++j) f[j] = fmaf(f[j], scale, g[j]);\n"
        "                return from_floats<T, V>(f);\n            }\n        }\n"
        "        float f[V], g[V];\n        to_floats(a, f);\n#pragma unroll\n        for (int j = 0; j < V; ++j) f[j] = __fmul_rn("),)),
    # (16:01 UTC, H100: level, 2868 / 2936 / 2845 / 2822 GB/s; its _32bit grid spills 336 bytes)
    "float32 rows fetched first": _variant(fetch_first=("_short", *NARROW, "_short_32bit", "_32bit")),
    # the 4-pack blocks (NARROW_GRIDS) each taking 2 or 4 register-fulls of rows one after another, for fewer,
    # longer-lived blocks: at 512 keys a block held two 16-bit rows, at 2048 keys one
    # 2026-11-26 15:35 UTC, on an H100 (no H200 that call), GB/s at float32 / bfloat16 512 keys, float32 /
    # bfloat16 2048: 2 register-fulls a block 2864 / 2864 / 2827 / 2866, 4: 2863 / 2803 / 2799 / 2839, against
    # one 2865 / 2929 / 2842 / 2834 (softcap_tuning.py: 2715 / 2788 / 2808 / 2833 and 2714 / 2726 / 2779 /
    # 2799 against 2714 / 2819 / 2822 / 2767): rows of 512 slower, 16-bit rows of 2048 1-2% faster
    "4-pack blocks of 2 register-fulls": _variant(steps=dict.fromkeys(NARROW, 2)),
    "4-pack blocks of 4 register-fulls": _variant(steps=dict.fromkeys(NARROW, 4)),
    # the 16-bit 2048-key blocks alone (64 threads, a row each) taking two rows: H100, 15:39-16:17 UTC, masked
    # bfloat16 2048 keys +0.8% to +1.7% in five runs (16:16: 2865 against 2816), soft-capped +2.2% to +2.6% in four
    # (2835 against 2764), the other columns level; on an H200 (2026-11-26 20:46 UTC) masked bfloat16 +3.1% (3842
    # against 3725), soft-capped +4.5% (3250 against 3110): shipped at 20:53 UTC (MASKED_TUNING's steps)
    "16-bit 2048-key blocks of 1 register-full (shipped until 2026-11-26 20:53 UTC)": _variant(steps={}),
    # 2026-11-26 20:48 UTC, H200: float32 rows of 512 at 3611 GB/s shipped (8 an SM), 4089 through one fma
    # made as loads arrive, 3359 two roundings made as loads arrive; 20:50 UTC: 12 an SM 3835 (shipped at 20:53
    # UTC), 16 an SM 3782, __fadd_rn or a plain add the same (3331 / 3571 against 3359 / 3606)
    "float32 small blocks at 16 an SM, fetched first": _variant(blocks_short_32bit=16),
    "float32 small blocks at 8 an SM, fetched first (shipped until 2026-11-26 20:53 UTC)": _variant(blocks_short_32bit=8),
    "float32 __fmul_rn then a plain add, made as loads arrive": _variant(fetch_first=("_short", *NARROW), edits=(
    ("for (int j = 0; j < V; ++j) f[j] = __fadd_rn(f[j], g[j]);\n        return from_floats<T, V>(f);\n    }\n};",
     "for (int j = 0; j < V; ++j) f[j] += g[j];  // after __fmul_rn: cannot contract\n        return from_floats<T, V>(f);\n    }\n};"),)),
    "float32 __fmul_rn then a plain add, fetched first": _variant(edits=(
    ("for (int j = 0; j < V; ++j) f[j] = __fadd_rn(f[j], g[j]);\n        return from_floats<T, V>(f);\n    }\n};",
     "for (int j = 0; j < V; ++j) f[j] += g[j];  // after __fmul_rn: cannot contract\n        return from_floats<T, V>(f);\n    }\n};"),)),
    "float32 __fmul_rn then a plain add, made as loads arrive, 16 an SM": _variant(
        fetch_first=("_short", *NARROW), blocks_short_32bit=16, edits=(
    ("for (int j = 0; j < V; ++j) f[j] = __fadd_rn(f[j], g[j]);\n        return from_floats<T, V>(f);\n    }\n};",
     "for (int j = 0; j < V; ++j) f[j] += g[j];  // after __fmul_rn: cannot contract\n        return from_floats<T, V>(f);\n    }\n};"),)),
    # ptxas kept each pack's guarded FMUL + FADD block (eager's two roundings) a branch of its own, its
    # values held apart from the packs they came from (80-88 registers); MAKE_ALL (shipped at 21:25 UTC)
    # makes every pack's values unguarded from zeroed packs: one straight block, 62-64 registers (sm_90
    # SASS, a helper's study). H200, 2026-11-26 21:13 UTC: float32 512 keys 4097 GB/s against 3869,
    # 2048 keys 3904 against 3760; at 16 an SM the same (4094, 3903); 16-bit too: 16-bit level
    "float32 values made in guarded blocks (shipped until 2026-11-26 21:25 UTC)": _variant(edits=((
        "static constexpr bool MAKE_ALL = sizeof(T) == 4;", "static constexpr bool MAKE_ALL = false;"),)),
    "values made for every pack in 16-bit too": _variant(edits=((
        "static constexpr bool MAKE_ALL = sizeof(T) == 4;", "static constexpr bool MAKE_ALL = !CAP;"),)),
    "staged through shared memory, 3 stages, 4 warps a block": staged(),
    "staged through shared memory, 4 stages, 2 warps a block": staged(stages=4, threads=64),
    "staged through shared memory, 2 stages, 2 warps a block": staged(stages=2, threads=64),
    **BULK_VARIANTS,
    **LONG_VARIANTS,
    **ODD_VARIANTS,
    # diagnostics, not candidates: what eager's second rounding and finding the mask row cost
    "(one rounding: x * scale + mask in float32)": _variant(edits=(
        ("        to_floats(from_floats<T, V>(f), f);  // rounded to T, as eager's multiplication stores it\n", ""),)),
    "(every row reads mask row 0: no index math)": _variant(edits=(("mask + (size_t)mrow * D", "mask"),)),
}


def _load_evict_source() -> str:
    """The library's load_evict and l2_policy helpers (the two-read row kernels'), inserted inside
    softmax's namespace fxk."""
    from fxkern.library.cuda_common import EVICT_LOADS

    return EVICT_LOADS


def variant_kernel_op(name: str, spec, base):
    """The op ``name`` for a variant ``spec`` of ``base``, with the library op's shape check and output
    (the (b, 1, q, k) mask has another shape than the scores, which only a meta_fn allows)."""
    import fxkern
    from fxkern.library import softmax

    op = "softcapped_masked_softmax" if base.kernel_name == softmax.SOFTCAPPED_MASKED_SOFTMAX.kernel_name \
        else "scaled_masked_softmax"
    return fxkern.cuda_kernel_op(name, spec, meta_fn=softmax._masked_output(op))


def variant_op(label: str, v: dict, index: int, base=None, prefix: str = "masked"):
    """The variant of ``base`` (default: the scaled, masked softmax's spec) as a callable ``(x, mask,
    *scalars)`` on the library's grid choice, and its ops' names."""
    from fxkern.library import softmax

    base = base or softmax.SCALED_MASKED_SOFTMAX
    # softmax.SOURCE, with the soft-capped kernel's macro before it
    source = common.apply_edits(base.kernel_source, v["edits"], label, "the kernel's source",
                                lambda new: new.replace("{load_evict}", _load_evict_source()).replace("{{", "{"))
    base = dataclasses.replace(base, kernel_source=source)
    grids = softmax._grids(base, **v["tuning"])
    names = {suffix: f"fxkern_tune::{prefix}_{index}{suffix}" for suffix in grids}
    ops = {suffix: variant_kernel_op(names[suffix], spec, base) for suffix, spec in grids.items()}
    narrow = softmax._extra_grids(ops)
    return lambda x, mask, *scalars: ops[softmax._grid(x, mask, narrow=narrow)](x, mask, *scalars), names


def staged_op(label: str, v: dict, index: int, base, prefix: str):
    """The staged kernel (STAGED) for ``base``'s arguments as a callable ``(x, mask, *scalars)``: an
    op for float32 and one for 16-bit types, whose shared memory is sized by the element."""
    import fxkern
    from fxkern.symbolic import cdiv

    stages, threads = v["staged"]["stages"], v["staged"]["threads"]
    macros = (f"#define FXK_STAGES {stages}\n#define FXK_STAGED_THREADS {threads}\n"
              f"#define FXK_STAGED_MAX_D 2048\n")
    ops, names = {}, {}
    for suffix, size in (("_32bit", 4), ("", 2)):  # each op compiles every dtype (SOURCE needs their headers)
        def geometry(inputs, outputs, size=size):
            rows_a_block = ROWS_A_WARP * (threads // 32)
            return ((cdiv(inputs[0].numel(), inputs[0][-1] * rows_a_block),), (threads,),
                    inputs[0][-1] * ((threads // 32) * stages * 2 * size))

        spec = dataclasses.replace(base, kernel_source=macros + base.kernel_source + STAGED,
                                   kernel_name=f"staged_{base.kernel_name}", geometry=fxkern.Custom(geometry))
        names[suffix] = f"fxkern_tune::{prefix}_{index}{suffix}"
        ops[suffix] = variant_kernel_op(names[suffix], spec, base)
    return lambda x, mask, *scalars: ops["_32bit" if x.dtype == torch.float32 else ""](x, mask, *scalars), names


def bulk_op(label: str, v: dict, index: int, base, prefix: str):
    """The bulk-copy kernel (BULK) for ``base``'s arguments as a callable ``(x, mask, *scalars)``: one op
    whose grid is ``blocks`` blocks for each SM of this GPU, each with its stages' shared memory."""
    import fxkern

    stages, threads, packs, blocks, direct = (v["bulk"][k] for k in ("stages", "threads", "packs", "blocks",
                                                                      "mask_direct"))
    macros = (f"#define ROW_THREADS {threads}\n#define FXK_BULK_STAGES {stages}\n#define FXK_BULK_PACKS {packs}\n"
              f"#define FXK_BULK_BLOCKS {blocks}\n#define FXK_BULK_MASK_DIRECT {int(direct)}\n")
    grid = blocks * torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    smem = stages * (1 if direct else 2) * threads * packs * 16  # a pass: at most a register-full of each tensor

    def geometry(inputs, outputs):
        return (grid,), (threads,), smem

    spec = dataclasses.replace(base, kernel_source=macros + base.kernel_source + BULK,
                               kernel_name=f"bulk_{base.kernel_name}", geometry=fxkern.Custom(geometry))
    name = f"fxkern_tune::{prefix}_{index}_bulk"
    op = variant_kernel_op(name, spec, base)
    return op, {"bulk": name}


def small_packs_op(label: str, v: dict, index: int, base, prefix: str):
    """The variant of ``small_packs`` as a callable ``(x, mask, *scalars)``, and its ops' names."""
    import fxkern
    from fxkern.library import softmax
    from fxkern.symbolic import cdiv

    packs, blocks, fetch, threads, size, longer, grids, steps = (v["small_packs"][k] for k in (
        "packs", "blocks", "fetch_first", "threads", "size", "longer_than", "grids", "steps"))
    elements = threads * packs * 16 // size
    kind = "F32" if size == 4 else "HALF"
    macros = (f"#define ROW_THREADS {threads}\n#define FXK_ROW_PACKS_{kind} {packs}\n#define FXK_ROW_BLOCKS_{kind} {blocks}\n"
              + ("#define FXK_MASK_FETCH_FIRST 1\n" if fetch else ""))

    def geometry(inputs, outputs):
        return (cdiv(inputs[0].numel(), elements * steps),), (threads,)

    spec = dataclasses.replace(base, kernel_source=macros + base.kernel_source, geometry=fxkern.Custom(geometry))
    name = f"fxkern_tune::{prefix}_{index}_small"
    small = variant_kernel_op(name, spec, base)
    shipped, _ = variant_op("shipped", {"tuning": v.get("tuning") or _variant()["tuning"], "edits": ()}, 900 + index,
                            base=base, prefix=prefix)

    def run(x, mask, *scalars):
        if (x.element_size() == size and longer < x.shape[-1] <= elements
                and softmax._grid(x, mask) in grids):
            return small(x, mask, *scalars)
        return shipped(x, mask, *scalars)

    return run, {"_short": name}


def make_op(label: str, v: dict, index: int, base, prefix: str):
    """Variant ``v`` of ``base`` as ``(callable (x, mask, *scalars), its ops' names)``, by its kind: staged,
    bulk copies, small packs, or edits and tuning of the library's grids."""
    make = (staged_op if "staged" in v else bulk_op if "bulk" in v else small_packs_op if "small_packs" in v
            else variant_op)
    return make(label, v, index, base, prefix)


def registers(names) -> str:
    """Registers a thread (and spill bytes) of each grid's kernels, as row_tuning reports them."""
    from row_tuning import registers as of

    return ", ".join(f"{suffix or 'rows'} {of(name)}" for suffix, name in names.items())


def shape_option(parser) -> None:
    """``--shape B,H,S`` (repeatable): time these scores' shapes instead of ``SHAPES`` (long rows:
    ``--shape 1,16,8192``, the pieces of a call past 2^31 elements that ``fxkern.split`` cuts)."""
    parser.add_argument("--shape", action="append", default=[], metavar="B,H,S",
                        type=lambda v: tuple(int(n) for n in v.split(",")),
                        help="scores (B, H, S, S) to time, repeatable (default: %s)" % (SHAPES,))


def main(argv=None) -> None:
    def extra(p):
        p.add_argument("--scale", type=float, default=0.125,
                       help="the scores' scale (default 0.125, 1 / sqrt(64); Llama's 1 / sqrt(128) is not a power of two)")
        shape_option(p)

    args = common.tuning_args("masked_tuning", "Masked softmax tuning", __doc__, argv, extra=extra)
    if args is None:
        return
    from fxkern.library import softmax

    compare_variants(VARIANTS, softmax.SCALED_MASKED_SOFTMAX, softmax.scaled_masked_softmax_float32, (args.scale,),
                     x_scale=3.0, prefix="masked", section="masked_tuning", script="masked_tuning.py", args=args,
                     title="Scaled, masked softmax tuning (`fxkern.library.softmax`, transformers' eager attention)",
                     doc=__doc__)


def compare_variants(variants: dict, base, pattern, scalars, x_scale: float, prefix: str, section: str,
                     script: str, args, title: str, doc: str) -> None:
    """Time each variant of the masked kernel ``base`` (its ops named ``fxkern_tune::<prefix>_<i>``)
    and inductor's ``pattern`` on ``SHAPES`` x ``DTYPES``: scores of randn times ``x_scale``, the
    causal mask, ``scalars`` after them (a tuple, or a callable ``(b, h, s, dtype)`` giving each
    case's: the sink kernel's sinks, batch and queries). Candidates are checked against ``pattern``
    first (labels in parentheses are diagnostics, not checked). Writes ``section``, titled ``title``,
    with ``doc``'s third paragraph as its description."""
    import fxkern.library

    fxkern.library.rules()
    torch.manual_seed(0)
    fns = {label: make_op(label, v, i, base, prefix) for i, label, v in common.pick(variants, args)}
    compiled = common.inductor(pattern)
    cases = []
    for b, h, s in getattr(args, "shape", None) or SHAPES:
        for dt in DTYPES:
            x = (torch.randn(b, h, s, s, device="cuda") * x_scale).to(dt)
            mask = torch.full((s, s), torch.finfo(dt).min, device="cuda", dtype=dt).triu(1).expand(b, 1, s, s).contiguous()
            extra = scalars(b, h, s, dt) if callable(scalars) else scalars
            want = pattern(x, mask, *extra)
            for label, (fn, _) in list(fns.items()):
                if not label.startswith("("):
                    try:
                        torch.testing.assert_close(fn(x, mask, *extra), want, rtol=1.6e-2, atol=1e-5)
                    except Exception as e:  # a wrong or unlaunchable variant is named and left out, never timed
                        print(f"variant {label!r} is wrong at {b}x{h}x{s}x{s} {dt}, left out: {e}", flush=True)
                        del fns[label]
            compiled(x, mask, *extra)
            cases.append((f"{b}x{h}x{s}x{s} {str(dt)[6:]}", x, mask, extra))
    runners = {"inductor": compiled, **{label: fn for label, (fn, _) in fns.items()}}
    table = common.bandwidth_rows(
        runners, [((x, mask, *extra), 2 * x.numel() * x.element_size() + mask.numel() * mask.element_size())
                  for _, x, mask, extra in cases], args.rounds)
    regs = {label: registers(names) for label, (_, names) in fns.items()}
    if getattr(args, "shape", None):  # other shapes: a section of their own, the default shapes' kept
        section += "".join(f"_{b}x{h}x{s}" for b, h, s in args.shape)
    body = common.variant_section(title, script, args, doc, [name for name, *_ in cases], table,
                                  extra=("registers", regs))
    common.emit(section, body, args.section_out)


if __name__ == "__main__":
    main()
