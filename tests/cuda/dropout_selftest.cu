// Self-test of the dropout mask on the GPU (src/flash_dropout.h): the device
// Philox4x32-10 against Random123's known answers, and DropoutMask::Keep16 on
// the device against the same function on the host (which the Python tests
// check against jax_flash2.reference), bit for bit. Prints the keep rate.
//
//   nvcc -std=c++17 -O3 -I. -arch=sm_80 tests/cuda/dropout_selftest.cu -o build/dropout_selftest
//   build/dropout_selftest
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "src/flash_dropout.h"
#include "tests/cuda/selftest_util.h"  // CHECK_CUDA

namespace {

using jax_flash2::DropoutMask;

// keep[i * groups + g] = Keep16(i, g): one thread per (row, group of 16 keys).
__global__ void Keep16Kernel(DropoutMask mask, int64_t rows, int64_t groups, uint16_t* keep) {
  const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index < rows * groups) keep[index] = mask.Keep16(index / groups, index % groups);
}

__global__ void PhiloxKernel(uint32_t* out) {
  const jax_flash2::Philox4 r = jax_flash2::Philox4x32(0x243F6A88u, 0x85A308D3u, 0x13198A2Eu,
                                                       0x03707344u, 0xA4093822u, 0x299F31D0u);
  for (int t = 0; t < 4; ++t) out[t] = r.x[t];
}

}  // namespace

int main() {
  int failures = 0;
  uint32_t* d_words;
  CHECK_CUDA(cudaMalloc(&d_words, 4 * sizeof(uint32_t)));
  PhiloxKernel<<<1, 1>>>(d_words);
  CHECK_CUDA(cudaGetLastError());
  uint32_t words[4];
  CHECK_CUDA(cudaMemcpy(words, d_words, sizeof(words), cudaMemcpyDeviceToHost));
  const uint32_t expected[4] = {0xD16CFE09u, 0x94FDCCEBu, 0x5001E420u, 0x24126EA1u};
  for (int t = 0; t < 4; ++t) failures += words[t] != expected[t];
  std::printf("philox known answer: %s\n", failures ? "FAIL" : "ok");

  const int64_t rows = 1000, groups = 129;  // S = 2064 keys
  uint16_t* d_keep;
  CHECK_CUDA(cudaMalloc(&d_keep, rows * groups * sizeof(uint16_t)));
  std::vector<uint16_t> keep(rows * groups);
  for (const float rate : {26 / 256.f, 0.5f, 230 / 256.f}) {
    const DropoutMask mask{0x12345678u, 0x9ABCDEF0u, jax_flash2::DropoutThreshold(rate)};
    const int threads = 256;
    Keep16Kernel<<<static_cast<unsigned>((rows * groups + threads - 1) / threads), threads>>>(
        mask, rows, groups, d_keep);
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaMemcpy(keep.data(), d_keep, keep.size() * sizeof(uint16_t),
                          cudaMemcpyDeviceToHost));
    int64_t mismatches = 0, kept = 0;
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t g = 0; g < groups; ++g) {
        const unsigned host = mask.Keep16(i, g);
        mismatches += keep[i * groups + g] != host;
        kept += __builtin_popcount(host);
      }
    }
    std::printf("rate %.2f: %lld mismatches, keep rate %.5f (expected %.5f)\n", rate,
                static_cast<long long>(mismatches),
                static_cast<double>(kept) / (16.0 * rows * groups), 1.0 - rate);
    failures += mismatches != 0;
  }
  CHECK_CUDA(cudaFree(d_keep));
  CHECK_CUDA(cudaFree(d_words));
  std::printf("%s\n", failures ? "FAILED" : "PASSED");
  return failures ? 1 : 0;
}
