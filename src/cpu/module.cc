// Python module _cpu_ext: the CPU FFI handlers as capsules for
// jax.ffi.register_ffi_target, plus the host heuristics and the scalar dropout
// mask (the CUDA kernels' path; the CPU kernels vectorize it) for unit tests.
#include <nanobind/nanobind.h>
#include <nanobind/stl/tuple.h>

#include "../flash_dropout.h"
#include "../heuristics.h"
#include "ffi_cpu.h"
#include "flash_cpu.h"

namespace nb = nanobind;

namespace {

nb::capsule Capsule(XLA_FFI_Error* (*handler)(XLA_FFI_CallFrame*)) {
  return nb::capsule(reinterpret_cast<void*>(handler));
}

}  // namespace

NB_MODULE(_cpu_ext, m) {
  m.def("registrations", [] {
    nb::dict targets;
    targets["jax_flash2_attention_fwd"] = Capsule(jax_flash2::cpu::JaxFlash2CpuForward);
    targets["jax_flash2_attention_bwd"] = Capsule(jax_flash2::cpu::JaxFlash2CpuBackward);
    return targets;
  });
  m.def("isa", [] { return jax_flash2::cpu::SelectedIsa(); },
        "Instruction set the CPU kernels were selected for on this machine.");
  m.def("choose_num_splits", &jax_flash2::ChooseNumSplits, nb::arg("batch_heads_mblocks"),
        nb::arg("num_n_blocks"), nb::arg("block_slots"), nb::arg("max_splits"),
        nb::arg("min_efficiency") = 0.85,
        "The CUDA forward's split-KV count (src/heuristics.h), for unit tests.");
  m.def("philox4x32",
        [](uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
          const jax_flash2::Philox4 r = jax_flash2::Philox4x32(c0, c1, c2, c3, k0, k1);
          return std::tuple(r.x[0], r.x[1], r.x[2], r.x[3]);
        },
        "Philox4x32-10 of src/flash_dropout.h, for unit tests.");
  m.def("dropout_keep4",
        [](uint32_t seed_lo, uint32_t seed_hi, float rate, int64_t i, int64_t j4) {
          const jax_flash2::DropoutMask mask{seed_lo, seed_hi, jax_flash2::DropoutThreshold(rate)};
          return mask.Keep4(i, j4);
        },
        "Keep bits of keys 4 j4 .. 4 j4 + 3 of query row i (src/flash_dropout.h), for unit tests.");
}
