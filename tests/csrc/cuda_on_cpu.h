/* cuda_on_cpu.h -- ort_dynamo's generated CUDA kernels compiled for the host (C++17), so that a
 * machine without a GPU checks their arithmetic, rounding and broadcasting (tests/test_pointwise.py).
 * One "thread" walks every element: the kernels' grid-stride loops start at 0 with a step of 1.
 * Math functions are the C library's, not CUDA's: the same within an ulp or two. */
#ifndef ORT_DYNAMO_CUDA_ON_CPU_H
#define ORT_DYNAMO_CUDA_ON_CPU_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define PW_CUDA_ON_CPU 1
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(threads)
#define __grid_constant__

struct PwDim3 {
  unsigned x;
};
static const PwDim3 blockIdx{0}, threadIdx{0}, blockDim{1}, gridDim{1};

static inline float __uint_as_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
static inline float __int_as_float(int32_t i) {
  float f;
  memcpy(&f, &i, sizeof f);
  return f;
}
static inline uint32_t __float_as_uint(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

#include "pointwise_cuda.h"

#endif
