// Helpers shared by the standalone CUDA self-tests (not part of the package).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "src/flash_params.h"

// A self-test stops at the first failed CUDA call: its output is the report.
#define CHECK_CUDA(x)                                                                   \
  do {                                                                                  \
    cudaError_t err_ = (x);                                                             \
    if (err_ != cudaSuccess) {                                                          \
      std::printf("CUDA error %s at %s:%d: %s\n", cudaGetErrorString(err_), __FILE__,   \
                  __LINE__, #x);                                                        \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

namespace jax_flash2::selftest {

// Values rounded to / stored as the 16-bit dtype under test.
inline float RoundTo(DType dt, float x) {
  if (dt == DType::kFloat16) return __half2float(__float2half_rn(x));
  return __bfloat162float(__float2bfloat16_rn(x));
}

inline uint16_t ToBits(DType dt, float x) {
  uint16_t bits;
  if (dt == DType::kFloat16) {
    __half h = __float2half_rn(x);
    std::memcpy(&bits, &h, 2);
  } else {
    __nv_bfloat16 h = __float2bfloat16_rn(x);
    std::memcpy(&bits, &h, 2);
  }
  return bits;
}

inline float FromBits(DType dt, uint16_t bits) {
  if (dt == DType::kFloat16) {
    __half h;
    std::memcpy(&h, &bits, 2);
    return __half2float(h);
  }
  __nv_bfloat16 h;
  std::memcpy(&h, &bits, 2);
  return __bfloat162float(h);
}

// f(i) for i in [0, n) on every hardware thread (the float64 references).
template <typename F>
void ParallelFor(int64_t n, F f) {
  const int workers = std::max(1u, std::thread::hardware_concurrency());
  std::atomic<int64_t> next{0};
  std::vector<std::thread> pool;
  for (int w = 0; w < workers; ++w) {
    pool.emplace_back([&] {
      for (int64_t i = next++; i < n; i = next++) f(i);
    });
  }
  for (auto& t : pool) t.join();
}

// Element offset of (b, t, h, d) under batch, row and head strides.
inline int64_t Off(int64_t bs, int64_t rs, int64_t hs, int64_t b, int64_t t, int64_t h, int64_t d) {
  return b * bs + t * rs + h * hs + d;
}

}  // namespace jax_flash2::selftest
