"""CUDA C++ shared by the library's kernels: conversions, 16-byte packs, warp and group reductions.

Every kernel source is ``COMMON + its own code``; NVRTC compiles each spec's
source once (the fp16/bf16 headers come first, added by fxkern for the
declared dtypes).

Conventions the kernels follow:

* arithmetic in float32, rounded once to the output dtype, as inductor's
  kernels and PyTorch's own fused CUDA ops do; an explicit cast in the
  pattern (``.to(input_dtype)``) is kept with ``rnd<T>``. Eager PyTorch
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
// A PyTorch op on T tensors computes in float and rounds its result to T.
template <typename T> __device__ __forceinline__ float rnd(float v) { return to_f<T>(from_f<T>(v)); }

// N elements of T moved as one access (16 bytes for N = 16 / sizeof(T)).
template <typename T, int N> struct alignas(sizeof(T) * N) Pack { T v[N]; };

template <typename T, int N>
__device__ __forceinline__ Pack<T, N> load(const T* p) { return *reinterpret_cast<const Pack<T, N>*>(p); }
template <typename T, int N>
__device__ __forceinline__ void store(T* p, const Pack<T, N>& v) { *reinterpret_cast<Pack<T, N>*>(p) = v; }

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
    const int first = (threadIdx.x / G) * (G >> 5);
    float s = 0.0f;
    for (int k = 0; k < (G >> 5); ++k) s += slot[first + k];
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
    const int first = (threadIdx.x / G) * (G >> 5);
    float m = slot[first];
    for (int k = 1; k < (G >> 5); ++k) m = fmaxf(m, slot[first + k]);
    return m;
}

// Threads that share one row of D elements when each holds per_thread of them in registers: the
// fewest, a power of two, up to ROW_THREADS (a row needing more than that is read twice instead).
__device__ __forceinline__ int row_group(int D, int per_thread) {
    int G = 1;
    while (G < ROW_THREADS && G * per_thread < D) G <<= 1;
    return G;
}

// The rows a row-kernel block owns: those starting in its slice of the tensor, the grid's blocks
// splitting it into equal slices of whole elements (about slice / D rows; none or one when rows are
// longer than a slice). Work is spread by elements, so blocks are balanced whatever the row length,
// and the host picks the slice size by the grid it launches (row_geometry in Python).
__device__ __forceinline__ void block_rows(unsigned D, unsigned rows, unsigned& begin, unsigned& end) {
    const unsigned long long n = (unsigned long long)D * rows;
    const unsigned long long chunk = (n + gridDim.x - 1) / gridDim.x;
    const unsigned long long lo = (unsigned long long)blockIdx.x * chunk;
    const unsigned long long b = (lo + D - 1) / D, e = (lo + chunk + D - 1) / D;
    begin = (unsigned)(b < rows ? b : rows);
    end = (unsigned)(e < rows ? e : rows);
}

}  // namespace fxk
"""

# Row kernels: ROW_BLOCK threads a block (ROW_THREADS in CUDA); the grid sets the elements a block takes.
ROW_BLOCK = 256
# Elementwise kernels: each thread handles ELEMS_PER_THREAD consecutive-by-warp elements.
EW_BLOCK = 256
ELEMS_PER_THREAD = 8


def row_tuning(blocks_f32: int, blocks_half: int, packs_f32: int = 8, packs_half: int = 8, scalars: int = 4) -> str:
    """A row kernel's tuning as overridable macros (``-DFXK_ROW_BLOCKS_F32=...`` wins): blocks
    resident per SM (its launch bounds) and 16-byte packs a thread holds, per element size, and the
    elements a thread holds on the scalar path (rows that are not whole packs; more spills registers
    that the vector path then lacks, measured in benchmarks/row_tuning.py)."""
    values = {"FXK_ROW_BLOCKS_F32": blocks_f32, "FXK_ROW_BLOCKS_HALF": blocks_half,
              "FXK_ROW_PACKS_F32": packs_f32, "FXK_ROW_PACKS_HALF": packs_half, "FXK_ROW_SCALARS": scalars}
    return "".join(f"#ifndef {k}\n#define {k} {v}\n#endif\n" for k, v in values.items())
