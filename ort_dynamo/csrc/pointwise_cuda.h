/* pointwise_cuda.h -- ort_dynamo's generated elementwise kernels for the GPU.
 *
 * One header for both sides: NVRTC compiles the generated kernels (_pointwise.py) with it
 * (__CUDACC_RTC__: the device helpers), and pointwise_cuda_runtime.c, the custom-op library
 * ONNX Runtime's CUDA provider runs them through, fills the same argument block on the host.
 * A kernel computes in float32, op by op in ONNX's order (built with --fmad=false); a
 * bfloat16 or float16 value is held as the float32 it is exactly, and rounded as torch rounds it.
 *
 * Part of ort_dynamo; MIT licensed.
 */
#ifndef ORT_DYNAMO_POINTWISE_CUDA_H
#define ORT_DYNAMO_POINTWISE_CUDA_H

#ifdef __CUDACC_RTC__
typedef long long int64_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef unsigned short uint16_t;
typedef unsigned char uint8_t;
#define PW_DEVICE_CODE 1
#else
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#ifdef PW_CUDA_ON_CPU /* the kernels compiled for the host by the tests (tests/csrc/cuda_on_cpu.h) */
#define PW_DEVICE_CODE 1
#endif
#endif

#define PW_MAX_RANK 8
#define PW_MAX_ARGS 32
#define PW_THREADS 256

/* How an input is read at output element e (chosen by the host from the run's shapes). */
enum { PWC_FULL, PWC_SCALAR, PWC_SUFFIX, PWC_COL, PWC_GENERAL };

/* Passed by value (kernel parameter space, about 3 KB of the 4 KB allowed). */
typedef struct PwCudaArgs {
  int64_t numel;
  int64_t rank;
  int64_t dims[PW_MAX_RANK];                     /* the output's, which is every output's */
  int64_t in_numel[PW_MAX_ARGS];
  int64_t strides[PW_MAX_ARGS][PW_MAX_RANK];    /* PWC_GENERAL: element strides, 0 = broadcast */
  const void* in[PW_MAX_ARGS];
  void* out[PW_MAX_ARGS];
  int32_t mode[PW_MAX_ARGS];
} PwCudaArgs;
/* The host's C compiler and NVRTC must agree on it to the byte. */
#ifdef __cplusplus
static_assert(sizeof(PwCudaArgs) == 3024, "PwCudaArgs layout");
#else
_Static_assert(sizeof(PwCudaArgs) == 3024, "PwCudaArgs layout");
#endif

#ifdef PW_DEVICE_CODE

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#define NAN __int_as_float(0x7fffffff)
#endif
#define pw_expf(x) expf(x)

static __device__ __forceinline__ float pw_bf16_to_float(uint16_t h) { return __uint_as_float((uint32_t)h << 16); }
/* To nearest, ties to even; a NaN stays a quiet NaN (as torch and the CPU kernels round). */
static __device__ __forceinline__ float pw_round_bf16(float x) {
  const uint32_t u = __float_as_uint(x);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  return __uint_as_float((u & 0x7FFFFFFFu) > 0x7F800000u ? (u | 0x00400000u) & 0xFFFF0000u : rounded);
}
static __device__ __forceinline__ uint16_t pw_bf16_bits(float rounded) {
  return (uint16_t)(__float_as_uint(rounded) >> 16);
}

/* float16 through the conversion instructions (no cuda_fp16.h needed): to nearest, ties to
 * even, as torch converts; a NaN stays NaN, overflow is inf. */
#ifdef __CUDACC_RTC__
static __device__ __forceinline__ float pw_f16_to_float(uint16_t h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
static __device__ __forceinline__ uint16_t pw_f16_bits(float x) {
  uint16_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
  return h;
}
#else /* on the host, the compiler's float16 (the same rounding) */
static inline float pw_f16_to_float(uint16_t h) {
  _Float16 f;
  memcpy(&f, &h, sizeof f);
  return (float)f;
}
static inline uint16_t pw_f16_bits(float x) {
  const _Float16 f = (_Float16)x;
  uint16_t h;
  memcpy(&h, &f, sizeof h);
  return h;
}
#endif
static __device__ __forceinline__ float pw_round_f16(float x) { return pw_f16_to_float(pw_f16_bits(x)); }

/* Where input i's element for output element e is. */
template <typename I>
static __device__ __forceinline__ I pw_index(const PwCudaArgs& a, int i, I e) {
  switch (a.mode[i]) {
    case PWC_FULL:
      return e;
    case PWC_SCALAR:
      return 0;
    case PWC_SUFFIX:
      return e % (I)a.in_numel[i];
    case PWC_COL:
      return e / (I)a.dims[a.rank - 1];
    default: {
      I offset = 0;
#pragma unroll
      for (int d = PW_MAX_RANK - 1; d >= 0; --d) {
        if (d < a.rank) {
          const I size = (I)a.dims[d];
          offset += (e % size) * (I)a.strides[i][d];
          e /= size;
        }
      }
      return offset;
    }
  }
}

/* The sum of every thread's v, in every thread of the block (blockDim.x a power of two, at
 * most PW_THREADS; buf: PW_THREADS floats of shared memory). */
static __device__ __forceinline__ float pw_block_sum(float v, float* buf) {
  buf[threadIdx.x] = v;
  __syncthreads();
  for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) buf[threadIdx.x] += buf[threadIdx.x + s];
    __syncthreads();
  }
  const float total = buf[0];
  __syncthreads();
  return total;
}

/* The two entry points of kernel `name` (its body: name##_body<I>(a, e)): 64-bit indices,
 * and 32-bit ones (the host picks these below 2^31 elements). A grid-stride loop each. */
#define PW_CUDA_ENTRY(name)                                                                              \
  extern "C" __global__ void __launch_bounds__(PW_THREADS) name(const __grid_constant__ PwCudaArgs a) { \
    const int64_t step = (int64_t)gridDim.x * blockDim.x;                                               \
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < a.numel; e += step)             \
      name##_body<int64_t>(a, e);                                                                        \
  }                                                                                                      \
  extern "C" __global__ void __launch_bounds__(PW_THREADS) name##_32(const __grid_constant__ PwCudaArgs a) { \
    const uint32_t n = (uint32_t)a.numel, step = gridDim.x * blockDim.x;                                 \
    for (uint32_t e = blockIdx.x * blockDim.x + threadIdx.x; e < n; e += step) name##_body<uint32_t>(a, e); \
  }

/* A row kernel's (its body: name##_row<I>(a, r, scratch) for the row r of the last axis): a
 * block per row, the rows strided over the grid. */
#define PW_CUDA_ROW_ENTRY(name)                                                                          \
  extern "C" __global__ void __launch_bounds__(PW_THREADS) name(const __grid_constant__ PwCudaArgs a) { \
    __shared__ float scratch[PW_THREADS];                                                                \
    const int64_t rows = a.numel / a.dims[a.rank - 1];                                                   \
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) name##_row<int64_t>(a, r, scratch);           \
  }                                                                                                      \
  extern "C" __global__ void __launch_bounds__(PW_THREADS) name##_32(const __grid_constant__ PwCudaArgs a) { \
    __shared__ float scratch[PW_THREADS];                                                                \
    const uint32_t rows = (uint32_t)(a.numel / a.dims[a.rank - 1]);                                      \
    for (uint32_t r = blockIdx.x; r < rows; r += gridDim.x) name##_row<uint32_t>(a, r, scratch);         \
  }

#endif /* PW_DEVICE_CODE */

#ifndef __CUDACC_RTC__ /* the host library's side */

/* Element types, as ONNX numbers them (the kernel definitions' type lists). */
typedef struct PwCudaKernelDef {
  const char* name;
  int n_in;
  const int* types;
  int n_out;
  const int* out_types;
  int rows;             /* a row kernel (PW_CUDA_ROW_ENTRY): a block per row */
  const int* out_kinds; /* a row kernel's, per output: 0 full, 1 a row sum (last axis 1) */
} PwCudaKernelDef;

/* Fills a's shape and each input's read pattern from the inputs' shapes (shapes[i], ranks[i]
 * axes each, at most PW_MAX_RANK), broadcasting as ONNX does: axes aligned at the end, a size
 * of 1 stretches. Returns 0, or -1 if the shapes do not broadcast. Pointers are the caller's. */
static inline int pw_cuda_prepare(PwCudaArgs* a, int n_in, const int64_t (*shapes)[PW_MAX_RANK],
                                  const size_t* ranks) {
  size_t rank = 0;
  for (int i = 0; i < n_in; ++i)
    if (ranks[i] > rank) rank = ranks[i];
  int64_t numel = 1;
  for (size_t d = 0; d < rank; ++d) {
    int64_t size = 1;
    for (int i = 0; i < n_in; ++i) {
      const size_t pad = rank - ranks[i];
      const int64_t s = d >= pad ? shapes[i][d - pad] : 1;
      if (s == 1) continue;
      if (size != 1 && size != s) return -1;
      size = s;
    }
    a->dims[d] = size;
    numel *= size;
  }
  a->rank = (int64_t)rank;
  a->numel = numel;
  for (int i = 0; i < n_in; ++i) {
    int64_t padded[PW_MAX_RANK], count = 1;
    const size_t pad = rank - ranks[i];
    for (size_t d = 0; d < rank; ++d) {
      padded[d] = d >= pad ? shapes[i][d - pad] : 1;
      count *= padded[d];
    }
    a->in_numel[i] = count;
    size_t lead = 0; /* leading axes of size 1 */
    while (lead < rank && padded[lead] == 1) ++lead;
    int same_tail = 1, same_head = rank > 0;
    for (size_t d = lead; d < rank; ++d) same_tail &= padded[d] == a->dims[d];
    for (size_t d = 0; d + 1 < rank; ++d) same_head &= padded[d] == a->dims[d];
    if (count == numel)
      a->mode[i] = PWC_FULL;
    else if (count == 1)
      a->mode[i] = PWC_SCALAR;
    else if (same_tail)
      a->mode[i] = PWC_SUFFIX;
    else if (same_head && padded[rank - 1] == 1)
      a->mode[i] = PWC_COL;
    else {
      a->mode[i] = PWC_GENERAL;
      int64_t stride = 1;
      for (size_t d = rank; d-- > 0;) {
        a->strides[i][d] = padded[d] == 1 ? 0 : stride;
        stride *= padded[d];
      }
    }
  }
  return 0;
}

#endif
#endif /* ORT_DYNAMO_POINTWISE_CUDA_H */
