// Python module _cpu_ext: the CPU FFI handlers as capsules for
// jax.ffi.register_ffi_target, plus the host heuristics for unit tests.
#include <nanobind/nanobind.h>

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
        "The CUDA forward's split-KV count (src/heuristics.h), for unit tests.");
}
