// Throughput of the instructions a softmax score costs besides the tensor
// cores: MUFU.EX2, MUFU.TANH, F2FP (two floats to a bf16 pair) and an
// integer form of that packing, alone and interleaved, in thread-operations
// per clock per SM. Interleaved pairs that run at the rate of one of them
// share a unit; pairs at half of it do not overlap.
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a \
//     benchmarks/special_function_bench.cu -o build/special_function_bench
//   build/special_function_bench
#include <cuda_runtime.h>

#include <cstdio>

namespace {

constexpr int kIters = 2048;
constexpr int kChains = 8;  // independent chains per thread: throughput, not latency

__device__ __forceinline__ float Ex2(float x) {
  float y;
  asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float Tanh(float x) {
  float y;
  asm volatile("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float PackF2fp(float a, float b) {
  unsigned y;
  asm volatile("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(y) : "f"(a), "f"(b));
  return __uint_as_float(y);
}
// Round to nearest by adding half a bf16 unit, then keep the high halves.
__device__ __forceinline__ float PackInteger(float a, float b) {
  const unsigned lo = __float_as_uint(a) + 0x8000u, hi = __float_as_uint(b) + 0x8000u;
  unsigned y;
  asm volatile("prmt.b32 %0, %1, %2, 0x7632;" : "=r"(y) : "r"(lo), "r"(hi));
  return __uint_as_float(y);
}

enum Mode { kEx2, kTanh, kF2fp, kF2fpEx2, kInteger, kIntegerEx2, kEx2Tanh, kFfma };

template <Mode kMode>
__global__ void Chains(float* out, float seed) {
  float v[kChains];
  for (int c = 0; c < kChains; ++c) v[c] = seed * static_cast<float>(threadIdx.x + c);
  for (int i = 0; i < kIters; ++i) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) {
      const float w = v[(c + 1) % kChains];
      if constexpr (kMode == kEx2) v[c] = Ex2(v[c]);
      if constexpr (kMode == kTanh) v[c] = Tanh(v[c]);
      if constexpr (kMode == kF2fp) v[c] = PackF2fp(v[c], w);
      if constexpr (kMode == kF2fpEx2) v[c] = Ex2(PackF2fp(v[c], w));
      if constexpr (kMode == kInteger) v[c] = PackInteger(v[c], w);
      if constexpr (kMode == kIntegerEx2) v[c] = Ex2(PackInteger(v[c], w));
      if constexpr (kMode == kEx2Tanh) v[c] = Tanh(Ex2(v[c]));
      if constexpr (kMode == kFfma) v[c] = fmaf(v[c], 1.0001f, 0.5f);
    }
  }
  float sum = 0.f;
  for (int c = 0; c < kChains; ++c) sum += v[c];
  out[blockIdx.x * blockDim.x + threadIdx.x] = sum;
}

// Steps of one chain (an interleaved pair counts once) per clock per SM, at
// the device's nominal clock.
template <Mode kMode>
void Time(const char* name, float* out, int sms) {
  const int blocks = sms * 4, threads = 512;
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  Chains<kMode><<<blocks, threads>>>(out, 1e-3f);  // warm-up
  constexpr int kRuns = 5;
  cudaEventRecord(e0);
  for (int r = 0; r < kRuns; ++r) Chains<kMode><<<blocks, threads>>>(out, 1e-3f);
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float ms = 0.f;
  cudaEventElapsedTime(&ms, e0, e1);
  int khz = 0;
  cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0);
  const double steps = double(kRuns) * blocks * threads * kIters * kChains;
  std::printf("%-24s %8.3f ms  %6.2f per clock per SM (%d MHz)\n", name, ms,
              steps / (ms * 1e-3) / sms / (khz * 1e3), khz / 1000);
}

}  // namespace

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  float* out = nullptr;
  if (cudaMalloc(&out, sizeof(float) * sms * 4 * 512) != cudaSuccess) return 1;
  Time<kEx2>("ex2", out, sms);
  Time<kTanh>("tanh", out, sms);
  Time<kEx2Tanh>("ex2 + tanh", out, sms);
  Time<kF2fp>("f2fp pack", out, sms);
  Time<kF2fpEx2>("f2fp pack + ex2", out, sms);
  Time<kInteger>("integer pack", out, sms);
  Time<kIntegerEx2>("integer pack + ex2", out, sms);
  Time<kFfma>("ffma", out, sms);
  cudaFree(out);
  return cudaGetLastError() == cudaSuccess ? 0 : 1;
}
