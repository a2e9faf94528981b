"""CUDA C++ shared by the library's kernels: conversions, 16-byte packs, warp and group reductions.

Every kernel source is ``COMMON + its own code``; NVRTC compiles each spec's
source once (the fp16/bf16 headers come first, added by fxkern for the
declared dtypes).

Conventions the kernels follow:

* arithmetic in float32, rounded once to the output dtype, as inductor's
  kernels and PyTorch's own fused CUDA ops do; an explicit cast in the
  pattern (``.to(input_dtype)``) is kept by rounding through the dtype. Eager PyTorch
  also rounds every intermediate half-precision tensor, so results can
  differ from it by about a unit in the last place (closer to exact);
* 16-byte loads and stores when every pointer is 16-byte aligned and the
  sizes allow it, else a scalar path; both are exact, the fast one is faster;
* sizes come in as 32-bit ints (fxkern refuses larger ones before launch);
  indices are computed in unsigned or 64-bit arithmetic so they never wrap.
"""

COMMON = r"""
#ifndef ROW_THREADS
#define ROW_THREADS 256
#endif
#define ROW_WARPS (ROW_THREADS / 32)
namespace fxk {

template <typename T> struct Num;
template <> struct Num<float> {
    static __device__ __forceinline__ float f(float v) { return v; }
    static __device__ __forceinline__ float t(float v) { return v; }
};
template <> struct Num<__half> {
    static __device__ __forceinline__ float f(__half v) { return __half2float(v); }
    static __device__ __forceinline__ __half t(float v) { return __float2half_rn(v); }
};
template <> struct Num<__nv_bfloat16> {
    static __device__ __forceinline__ float f(__nv_bfloat16 v) { return __bfloat162float(v); }
    static __device__ __forceinline__ __nv_bfloat16 t(float v) { return __float2bfloat16_rn(v); }
};

template <typename T> __device__ __forceinline__ float to_f(T v) { return Num<T>::f(v); }
template <typename T> __device__ __forceinline__ T from_f(float v) { return Num<T>::t(v); }

// exp(x), 2^x and 1 / x on the special-function unit at its own precision (relative error about 2^-22),
// flushing subnormal inputs and results to zero (.ftz). Without --use_fast_math, __expf and
// __fdividef wrap the same two instructions in range checks and rescaling that keep subnormals:
// four more instructions each, a third of a 16-bit erf GELU's work an element. The kernels take
// reciprocals of values of at least 1 and add an exp to 1 or multiply it into a result below
// float's normal range (1e-38) where it flushes, so their outputs are those of __expf/__fdividef but
// for subnormal results. FXK_FTZ=0 (benchmarks/ew_tuning.py's baseline) keeps the wrapped forms.
#ifndef FXK_FTZ
#define FXK_FTZ 1
#endif
__device__ __forceinline__ float exp2_sfu(float x) {  // 2^x
#if FXK_FTZ
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#else
    return __expf(x * 0.69314718055994531f);  // ex2.approx of x * log2(e) * ln(2): x, give or take an ulp
#endif
}
__device__ __forceinline__ float exp_sfu(float x) { return exp2_sfu(x * 1.4426950408889634f); }
__device__ __forceinline__ float rcp_sfu(float x) {
#if FXK_FTZ
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#else
    return __fdividef(1.0f, x);
#endif
}
// Pairs of 16-bit values converted together: one packed cvt rounds two floats (cvt.rn.bf16x2.f32),
// where two single conversions take two instructions. T = float has no pairs.
template <typename T> struct Pair;
template <> struct Pair<__half> {
    using P = __half2;
    static __device__ __forceinline__ float2 f(P v) { return __half22float2(v); }
    static __device__ __forceinline__ P t(float a, float b) { return __floats2half2_rn(a, b); }
};
template <> struct Pair<__nv_bfloat16> {
    using P = __nv_bfloat162;
    static __device__ __forceinline__ float2 f(P v) {  // a bfloat16 is a float's high half: one op each
        const unsigned u = *reinterpret_cast<const unsigned*>(&v);
        return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u));
    }
    static __device__ __forceinline__ P t(float a, float b) { return __floats2bfloat162_rn(a, b); }
};

// N elements of T moved as one access (16 bytes for N = 16 / sizeof(T)).
template <typename T, int N> struct alignas(sizeof(T) * N) Pack { T v[N]; };

template <typename T, int N>
__device__ __forceinline__ Pack<T, N> load(const T* p) { return *reinterpret_cast<const Pack<T, N>*>(p); }
template <typename T, int N>
__device__ __forceinline__ void store(T* p, const Pack<T, N>& v) { *reinterpret_cast<Pack<T, N>*>(p) = v; }

// A pack's values as floats (16-bit ones unpacked in pairs).
template <typename T, int N>
__device__ __forceinline__ void to_floats(const Pack<T, N>& p, float (&f)[N]) {
    if constexpr (sizeof(T) == 2 && N % 2 == 0) {
#pragma unroll
        for (int j = 0; j < N / 2; ++j) {
            const float2 v = Pair<T>::f(reinterpret_cast<const typename Pair<T>::P*>(p.v)[j]);
            f[2 * j] = v.x;
            f[2 * j + 1] = v.y;
        }
    } else {
#pragma unroll
        for (int j = 0; j < N; ++j) f[j] = to_f<T>(p.v[j]);
    }
}

// Floats rounded into a pack (16-bit ones two at a time).
template <typename T, int N>
__device__ __forceinline__ Pack<T, N> from_floats(const float (&f)[N]) {
    Pack<T, N> p;
    if constexpr (sizeof(T) == 2 && N % 2 == 0) {
#pragma unroll
        for (int j = 0; j < N / 2; ++j)
            reinterpret_cast<typename Pair<T>::P*>(p.v)[j] = Pair<T>::t(f[2 * j], f[2 * j + 1]);
    } else {
#pragma unroll
        for (int j = 0; j < N; ++j) p.v[j] = from_f<T>(f[j]);
    }
    return p;
}

// a + b rounded to T: what `x + residual` holds in the model (the residual-add kernels).
template <typename T, int N>
__device__ __forceinline__ Pack<T, N> add_rounded(const Pack<T, N>& a, const Pack<T, N>& b) {
    float fa[N], fb[N];
    to_floats(a, fa);
    to_floats(b, fb);
#pragma unroll
    for (int j = 0; j < N; ++j) fa[j] += fb[j];
    return from_floats<T, N>(fa);
}

// Hides a pack's 16-bit values from the compiler just before they are converted a second time, so it
// keeps the packed registers live rather than every element already widened to float (which, for
// float16/bfloat16 rows held in registers, doubles their registers and spills).
template <typename T, int N>
__device__ __forceinline__ void opaque(Pack<T, N>& p) {
    if (sizeof(T) == 2 && N % 2 == 0) {
#pragma unroll
        for (int i = 0; i < N / 2; ++i) asm("" : "+r"(reinterpret_cast<unsigned*>(p.v)[i]));
    }
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ bool aligned16(const void* p) {
    return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// log2 of a power of two, in one instruction (a row kernel's few rows a block pay for every
// division and loop of its setup, which a block with one row pays once per row).
__device__ __forceinline__ int log2_of(int pow2) { return 31 - __clz(pow2); }

// Reductions over a group of G consecutive threads of a ROW_THREADS-thread block (G a power of two up
// to ROW_THREADS, the same for the whole block). Every thread of the block calls them; slot is ROW_WARPS floats of
// shared memory that no other live reduction uses.
__device__ __forceinline__ float group_sum(float v, int G, float* slot) {
    if (G <= 32) {
        for (int o = G >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        return v;
    }
    v = warp_sum(v);
    if ((threadIdx.x & 31) == 0) slot[threadIdx.x >> 5] = v;
    __syncthreads();
    const int first = (threadIdx.x >> log2_of(G)) * (G >> 5);
    float s = slot[first];
#pragma unroll
    for (int k = 1; k < ROW_WARPS; ++k)  // unrolled to the block's warps: straight-line loads
        if (k < (G >> 5)) s += slot[first + k];
    return s;
}
__device__ __forceinline__ float group_max(float v, int G, float* slot) {
    if (G <= 32) {
        for (int o = G >> 1; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
        return v;
    }
    v = warp_max(v);
    if ((threadIdx.x & 31) == 0) slot[threadIdx.x >> 5] = v;
    __syncthreads();
    const int first = (threadIdx.x >> log2_of(G)) * (G >> 5);
    float m = slot[first];
#pragma unroll
    for (int k = 1; k < ROW_WARPS; ++k)
        if (k < (G >> 5)) m = fmaxf(m, slot[first + k]);
    return m;
}

// Threads that share one row of D elements when each holds per_thread of them in registers: the
// fewest, a power of two, up to ROW_THREADS (a row needing more than that is read twice instead).
__device__ __forceinline__ int row_group(int D, int per_thread) {
    unsigned need = ((unsigned)D + per_thread - 1) / per_thread;  // per_thread: a constant
    need = need < ROW_THREADS ? need : ROW_THREADS;                  // so the shift stays small
    return need > 1 ? 1 << (32 - __clz(need - 1)) : 1;
}

// The rows a row-kernel block owns: those starting in its slice of the tensor, the grid's blocks
// splitting it into equal slices of whole elements (about slice / D rows; none or one when rows are
// longer than a slice). Work is spread by elements, so blocks are balanced whatever the row length,
// and the host picks the slice size by the grid it launches (row_geometry_8k/16k in Python). D * rows is
// below 2^31 (fxkern refuses larger sizes before launch), so 32-bit arithmetic cannot wrap here:
// 64-bit divisions are software routines, and with a row or two a block they cost more
// instructions than the row itself.
__device__ __forceinline__ void block_rows(unsigned D, unsigned rows, unsigned& begin, unsigned& end) {
    const unsigned n = D * rows;
    const unsigned chunk = (n + gridDim.x - 1) / gridDim.x;
    const unsigned lo = min(blockIdx.x * chunk, n), hi = min(lo + chunk, n);
    begin = (lo + D - 1) / D;
    end = (hi + D - 1) / D;
}

}  // namespace fxk
"""

# Row kernels: ROW_BLOCK threads a block (ROW_THREADS in CUDA); the grid sets the elements a block takes.
ROW_BLOCK = 256
# Elementwise kernels: EW_BLOCK threads a block, each handling ELEMS_PER_THREAD consecutive-by-warp
# elements. 128-thread blocks (the shape of inductor's pointwise kernels) at twice the blocks an SM
# moved the kernels that read one tensor 1-3% faster in float32 than 256-thread blocks did
# (benchmarks/ew_tuning.py, 2026-11-24).
EW_BLOCK = 128
ELEMS_PER_THREAD = 8


# Loads with cache eviction priorities, for kernels that read their input twice (the two-read row
# kernels: rmsnorm's plain norms, layernorm's Cohere norm); code for inside ``namespace fxk``.
EVICT_LOADS = r"""// A 16-byte load of data the kernel never writes, with cache eviction priorities: KEEP asks L1 and L2
// to keep the line (the first read of a row, the weight), else to drop it first (the second read).
// What Triton emits for inductor's eviction_policy; sm_80 and newer, a plain load before.
template <typename T, int V, bool KEEP>
__device__ __forceinline__ Pack<T, V> load_evict(const T* p, unsigned long long policy) {
#if __CUDA_ARCH__ >= 800 && FXK_EVICT_HINTS
    if constexpr (V * sizeof(T) == 16) {
        Pack<T, V> out;
        unsigned* r = reinterpret_cast<unsigned*>(out.v);
        if (KEEP)
            asm("ld.global.L1::evict_last.L2::cache_hint.v4.b32 {%0,%1,%2,%3}, [%4], %5;"
                : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "l"(p), "l"(policy));
        else
            asm("ld.global.L1::evict_first.L2::cache_hint.v4.b32 {%0,%1,%2,%3}, [%4], %5;"
                : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "l"(p), "l"(policy));
        return out;
    }
#endif
    return load<T, V>(p);
}

template <bool KEEP>
__device__ __forceinline__ unsigned long long l2_policy() {
    unsigned long long policy = 0;
#if __CUDA_ARCH__ >= 800 && FXK_EVICT_HINTS
    if (KEEP)
        asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
    else
        asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
#endif
    return policy;
}
"""


def row_tuning(blocks_f32: int, blocks_half: int, packs_f32: int = 8, packs_half: int = 8, scalars: int = 4) -> str:
    """A row kernel's tuning as overridable macros (``-DFXK_ROW_BLOCKS_F32=...`` wins): blocks
    resident per SM (its launch bounds) and 16-byte packs a thread holds, per element size, and the
    elements a thread holds on the scalar path (rows that are not whole packs; more spills registers
    that the vector path then lacks, measured in benchmarks/row_tuning.py)."""
    values = {"FXK_ROW_BLOCKS_F32": blocks_f32, "FXK_ROW_BLOCKS_HALF": blocks_half,
              "FXK_ROW_PACKS_F32": packs_f32, "FXK_ROW_PACKS_HALF": packs_half, "FXK_ROW_SCALARS": scalars}
    return "".join(f"#ifndef {k}\n#define {k} {v}\n#endif\n" for k, v in values.items())
