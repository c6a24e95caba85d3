// Kernel launches (host side).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

#include "../plan.h"  // DeviceInfo
#include "../test_switches.h"

namespace jax_flash2::cuda {

// Launches kernel(args...) on `stream`. With after_previous, as a
// programmatic dependent of the stream's previous grid: its blocks may start
// while that grid still runs (the launch and prologue under the other's
// tail, about 3 us a launch where a plain one waits for the grid to drain),
// so it must call WaitForPrimaryGrid (sm80/primitives.cuh) before it reads
// anything that grid wrote; the previous grid may let it be scheduled
// earlier still with AllowDependentLaunch.
template <typename... KernelArgs, typename... Args>
cudaError_t LaunchKernel(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem_bytes,
                         cudaStream_t stream, bool after_previous, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute early;
  early.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  early.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &early;
  config.numAttrs = after_previous ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

// Whether the decode kernel and the KV-cache append launch as programmatic
// dependents: on cc 9.0 unless JAX_FLASH2_DECODE_PDL=0. One rule for both
// (each waits for the grid before it), so that the switch turns off both.
inline bool LaunchesDecodeEarly(const DeviceInfo& dev) {
  return dev.cc_major >= 9 && GetTestSwitches().decode_pdl;
}

}  // namespace jax_flash2::cuda
