/* cuda_on_cpu.h -- ort_dynamo's generated CUDA kernels compiled for the host (C++20), so that a
 * machine without a GPU checks their arithmetic, rounding, broadcasting and block sums
 * (tests/test_pointwise.py). A launch (pw_launch) runs the blocks one after another, each as
 * blockDim.x std::threads meeting at __syncthreads() (a barrier); __shared__ memory is a static
 * the block's threads share. Math functions are the C library's, not CUDA's: the same within an
 * ulp or two. */
#ifndef ORT_DYNAMO_CUDA_ON_CPU_H
#define ORT_DYNAMO_CUDA_ON_CPU_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <barrier>
#include <thread>
#include <vector>

#define PW_CUDA_ON_CPU 1
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(threads)
#define __grid_constant__
#define __shared__ static

struct PwDim3 {
  unsigned x;
};
static thread_local PwDim3 threadIdx{0}, blockIdx{0};
static PwDim3 blockDim{1}, gridDim{1};
static std::barrier<>* pw_block_barrier;
static inline void __syncthreads() { pw_block_barrier->arrive_and_wait(); }

/* CUDA's bit casts. */
template <typename To, typename From>
static inline To pw_bit_cast(From from) {
  static_assert(sizeof(To) == sizeof(From));
  To to;
  memcpy(&to, &from, sizeof to);
  return to;
}
static inline float __uint_as_float(uint32_t u) { return pw_bit_cast<float>(u); }
static inline float __int_as_float(int32_t i) { return pw_bit_cast<float>(i); }
static inline uint32_t __float_as_uint(float f) { return pw_bit_cast<uint32_t>(f); }

#include "pointwise_cuda.h"

/* kernel<<<grid, block>>>(*a), and back when it is done. */
template <void (*Kernel)(PwCudaArgs)>
static void pw_launch(const PwCudaArgs* a, unsigned grid, unsigned block) {
  blockDim.x = block;
  gridDim.x = grid;
  std::barrier<> barrier(block);
  pw_block_barrier = &barrier;
  for (unsigned b = 0; b < grid; ++b) {
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < block; ++t)
      threads.emplace_back([a, b, t] {
        threadIdx.x = t;
        blockIdx.x = b;
        Kernel(*a);
      });
    for (auto& thread : threads) thread.join();
  }
  pw_block_barrier = nullptr;
}

#endif
