// XLA FFI handlers for the CUDA platform: typed implementations, then the
// bindings that read like their signatures. Kernel failures come back as
// ffi::Error; nothing here aborts the process.
#include <cuda_runtime.h>

#include <string>

#include "../ffi_params.h"
#include "ffi_cuda.h"
#include "flash_cuda.h"

namespace jax_flash2::cuda {
namespace {

ffi::Error CudaError(cudaError_t err, const char* what) {
  return ffi::Error::Internal(std::string("jax_flash2: ") + what + ": " + cudaGetErrorString(err));
}

// The device, the plan's verdict on p (the one support check of the
// direction: ForwardUnsupported or BackwardUnsupported, src/plan.h), and the
// workspace the kernels need. The workspace is an extra output that XLA
// allocates with the call's other buffers; the lowering sized it with the
// same function for `plan_sm_count` multiprocessors, which the plan uses here
// too so that both agree.
ffi::Error Prepare(const FlashParams& p, ffi::AnyBuffer& workspace, int64_t plan_sm_count,
                   std::string (*unsupported)(const FlashParams&, const DeviceInfo&),
                   size_t (*bytes_for)(const FlashParams&, const DeviceInfo&), DeviceInfo* dev) {
  if (cudaError_t err = GetCurrentDeviceInfo(dev); err != cudaSuccess) {
    return CudaError(err, "querying the device");
  }
  if (std::string why = unsupported(p, *dev); !why.empty()) {
    return ffi::Error::InvalidArgument("jax_flash2: " + why);
  }
  if (plan_sm_count > 0) dev->sm_count = static_cast<int>(plan_sm_count);
  const size_t bytes = bytes_for(p, *dev);
  if (workspace.size_bytes() < bytes) {
    return ffi::Error::InvalidArgument("jax_flash2: workspace of " +
                                       std::to_string(workspace.size_bytes()) + " bytes, need " +
                                       std::to_string(bytes));
  }
  return ffi::Error::Success();
}

ffi::Error ForwardImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::AnyBuffer alibi_slopes, ffi::AnyBuffer q_segment_ids,
                       ffi::AnyBuffer kv_segment_ids, ffi::AnyBuffer dropout_seeds,
                       ffi::AnyBuffer kv_seqlens, ffi::AnyBuffer block_table,
                       ffi::AnyBuffer kv_scales,
                       ffi::Result<ffi::AnyBuffer> out,
                       ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> workspace,
                       float softmax_scale, int64_t window_left, int64_t window_right,
                       float softcap, bool has_alibi, bool has_segment_ids, float dropout_rate,
                       bool has_kv_seqlens, int64_t page_size, int64_t sm_count,
                       int64_t segment_keys) {
  FlashParams p;
  JF2_RETURN_IF_ERROR(ForwardParams(
      q, k, v, {alibi_slopes, q_segment_ids, kv_segment_ids, dropout_seeds, kv_seqlens,
                block_table, kv_scales}, *out, *lse,
      {softmax_scale, window_left, window_right, softcap, has_alibi, has_segment_ids,
       dropout_rate, has_kv_seqlens, page_size}, &p));
  p.max_segment_keys = segment_keys;
  DeviceInfo dev;
  if (ffi::Error err =
          Prepare(p, *workspace, sm_count, &ForwardUnsupported, &ForwardScratchBytes, &dev);
      err.failure()) {
    return err;
  }
  if (cudaError_t err = RunForward(p, workspace->untyped_data(), dev, stream); err != cudaSuccess) {
    return CudaError(err, "forward kernel");
  }
  return ffi::Error::Success();
}

ffi::Error BackwardImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::AnyBuffer out, ffi::AnyBuffer lse, ffi::AnyBuffer d_out,
                        ffi::AnyBuffer d_lse, ffi::AnyBuffer alibi_slopes,
                        ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids,
                        ffi::AnyBuffer dropout_seeds, ffi::AnyBuffer kv_seqlens,
                        ffi::AnyBuffer block_table,
                        ffi::AnyBuffer kv_scales, ffi::Result<ffi::AnyBuffer> dq,
                        ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> workspace,
                        float softmax_scale, int64_t window_left, int64_t window_right,
                        float softcap, bool has_alibi, bool has_segment_ids, float dropout_rate,
                        bool has_kv_seqlens, int64_t page_size, int64_t sm_count,
                        bool deterministic) {
  FlashParams p;
  JF2_RETURN_IF_ERROR(BackwardParams(
      q, k, v, out, lse, d_out, d_lse,
      {alibi_slopes, q_segment_ids, kv_segment_ids, dropout_seeds, kv_seqlens, block_table,
       kv_scales},
      *dq, *dk, *dv,
      {softmax_scale, window_left, window_right, softcap, has_alibi, has_segment_ids,
       dropout_rate, has_kv_seqlens, page_size},
      &p));
  p.deterministic = deterministic;
  DeviceInfo dev;
  if (ffi::Error err =
          Prepare(p, *workspace, sm_count, &BackwardUnsupported, &BackwardScratchBytes, &dev);
      err.failure()) {
    return err;
  }
  if (cudaError_t err = RunBackward(p, workspace->untyped_data(), dev, stream); err != cudaSuccess) {
    return CudaError(err, "backward kernel");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlash2CudaForward, ForwardImpl,
    ScoreAttrs(ForwardOperands(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())
                   .Ret<ffi::AnyBuffer>())  // workspace: uint8, split-KV partial O and LSE
        .Attr<int64_t>("sm_count")          // multiprocessors the workspace was sized for
        .Attr<int64_t>("segment_keys"));    // a bound on any segment's keys; 0: unknown

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlash2CudaBackward, BackwardImpl,
    ScoreAttrs(BackwardOperands(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())
                   .Ret<ffi::AnyBuffer>())  // workspace: uint8, D and the fp32 dQ accumulator
        .Attr<int64_t>("sm_count")
        .Attr<bool>("deterministic"));  // dQ summed in a fixed order (more workspace)

}  // namespace jax_flash2::cuda
