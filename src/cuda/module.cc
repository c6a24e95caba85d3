// Python module _cuda_ext: the CUDA FFI handlers as capsules for
// jax.ffi.register_ffi_target. Importing it needs no GPU: the static CUDA
// runtime looks for the driver only when a kernel first runs.
#include <nanobind/nanobind.h>

#include "ffi_cuda.h"
#include "flash_cuda.h"

namespace nb = nanobind;

namespace {

nb::capsule Capsule(XLA_FFI_Error* (*handler)(XLA_FFI_CallFrame*)) {
  return nb::capsule(reinterpret_cast<void*>(handler));
}

// Bytes of workspace a call needs, for the lowering to allocate as an output.
size_t WorkspaceBytes(bool backward, int64_t batch, int64_t seqlen_q, int64_t seqlen_k,
                      int64_t heads_q, int64_t heads_kv, int64_t head_dim, int64_t window_left,
                      int64_t window_right, int sm_count, bool deterministic, int cc_major,
                      bool has_segment_ids, int64_t segment_keys) {
  jax_flash2::FlashParams p;
  p.batch = batch;
  p.seqlen_q = seqlen_q;
  p.seqlen_k = seqlen_k;
  p.num_heads_q = heads_q;
  p.num_heads_kv = heads_kv;
  p.group_size = heads_q / heads_kv;
  p.head_dim = head_dim;
  p.window_left = window_left;
  p.window_right = window_right;
  p.deterministic = deterministic;
  // The Hopper kernels' segment-id summaries take scratch; whether the ids
  // are there and the segments' key bound (the tile) set its size.
  alignas(16) static const int32_t ids_stand_in[4] = {};
  if (has_segment_ids) p.q_segment_ids = p.kv_segment_ids = ids_stand_in;
  p.max_segment_keys = segment_keys;  // picks the forward's tile, hence its scratch
  p.dtype = jax_flash2::DType::kBFloat16;
  jax_flash2::SetDenseStrides(p);
  jax_flash2::cuda::DeviceInfo dev;
  dev.sm_count = sm_count;
  // The kernels choose by cc (9: the Hopper kernels) and sm_count; the
  // largest opt-in shared memory of any supported GPU rejects no call that
  // the device accepts at run time.
  dev.cc_major = cc_major;
  dev.max_smem_per_block_optin = 227 * 1024;
  return backward ? jax_flash2::cuda::BackwardScratchBytes(p, dev)
                  : jax_flash2::cuda::ForwardScratchBytes(p, dev);
}

}  // namespace

NB_MODULE(_cuda_ext, m) {
  m.def("registrations", [] {
    nb::dict targets;
    targets["jax_flash2_attention_fwd"] = Capsule(jax_flash2::cuda::JaxFlash2CudaForward);
    targets["jax_flash2_attention_bwd"] = Capsule(jax_flash2::cuda::JaxFlash2CudaBackward);
    targets["jax_flash2_kv_append"] = Capsule(jax_flash2::cuda::JaxFlash2CudaKvAppend);
    return targets;
  });
  m.def("has_sm90", [] { return jax_flash2::cuda::kHaveSm90; });
  m.def("workspace_bytes", &WorkspaceBytes, nb::arg("backward"), nb::arg("batch"),
        nb::arg("seqlen_q"), nb::arg("seqlen_k"), nb::arg("heads_q"), nb::arg("heads_kv"),
        nb::arg("head_dim"), nb::arg("window_left"), nb::arg("window_right"),
        nb::arg("sm_count"), nb::arg("deterministic") = false, nb::arg("cc_major") = 9,
        nb::arg("has_segment_ids") = false, nb::arg("segment_keys") = 0);
}
