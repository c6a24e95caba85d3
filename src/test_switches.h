// Test-only environment switches: every one the library reads, in one place.
// Each is read once per process (the first call that plans a kernel); none is
// needed in normal use. They exist for side-by-side measurements and for
// running the small-shared-memory tiles of other GPUs on a larger one.
//
//   JAX_FLASH2_DECODE_KERNEL=0   decode shapes run the sm80 prefill kernel
//                                (split-KV) instead of the decode kernel
//   JAX_FLASH2_DECODE_PDL=0      the decode kernel and its split combine are
//                                launched as plain stream-ordered grids, not as
//                                programmatic dependents (cc 9.0)
//   JAX_FLASH2_SM90_BACKWARD=0   the backward runs the sm80 kernels on cc 9.0
//   JAX_FLASH2_DECODE_QUANT=0    int8 / fp8 KV caches reach the decode kernel
//                                as XLA's dequantized copy instead of being
//                                dequantized by the kernel itself
//   JAX_FLASH2_SOFTCAP_FIXED_MAX=0
//                                the Hopper forward tracks the running softmax
//                                max with softcap too (src/cuda/sm90/score_options.h)
//   JAX_FLASH2_SEGMENT_HEADS_INNER=0
//                                the Hopper forward's drawn segment tiles run
//                                head by head (fwd_sm90_kernel.cuh, Locate)
//   JAX_FLASH2_KV_SPLIT_KEYS=N   a KV-cache decode call splits its keys in
//                                shares of N (instead of the plan's rule)
//   JAX_FLASH2_MAX_SMEM_PER_BLOCK=N
//                                plan as if the GPU allowed at most N bytes of
//                                shared memory per block (e.g. 101376 on an
//                                H200 runs the tiles of cc 8.6 / 8.9 GPUs,
//                                and the sm80 kernels instead of the Hopper
//                                ones, which need 227 KB)
//
// Plain C++ (no CUDA): the CPU extension's plan() reads the same switches.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace jax_flash2 {

struct TestSwitches {
  bool decode_kernel = true;
  bool decode_pdl = true;
  bool decode_quant = true;
  bool sm90_backward = true;
  bool softcap_fixed_max = true;
  bool segment_heads_inner = true;
  int64_t max_smem_per_block = 0;  // 0: the device's own limit
  int64_t kv_split_keys = 0;       // 0: the plan's default
};

inline TestSwitches ReadTestSwitches() {
  auto off = [](const char* name) {
    const char* v = std::getenv(name);
    return v != nullptr && std::strcmp(v, "0") == 0;
  };
  TestSwitches s;
  s.decode_kernel = !off("JAX_FLASH2_DECODE_KERNEL");
  s.decode_pdl = !off("JAX_FLASH2_DECODE_PDL");
  s.decode_quant = !off("JAX_FLASH2_DECODE_QUANT");
  s.sm90_backward = !off("JAX_FLASH2_SM90_BACKWARD");
  s.softcap_fixed_max = !off("JAX_FLASH2_SOFTCAP_FIXED_MAX");
  s.segment_heads_inner = !off("JAX_FLASH2_SEGMENT_HEADS_INNER");
  if (const char* v = std::getenv("JAX_FLASH2_MAX_SMEM_PER_BLOCK")) {
    const long long n = std::strtoll(v, nullptr, 10);
    s.max_smem_per_block = n > 0 ? n : 0;
  }
  if (const char* v = std::getenv("JAX_FLASH2_KV_SPLIT_KEYS")) {
    const long long n = std::strtoll(v, nullptr, 10);
    s.kv_split_keys = n > 0 ? n : 0;
  }
  return s;
}

// The switches of this process (read once, thread-safe).
inline const TestSwitches& GetTestSwitches() {
  static const TestSwitches switches = ReadTestSwitches();
  return switches;
}

}  // namespace jax_flash2
