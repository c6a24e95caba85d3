#pragma once

#include "xla/ffi/api/c_api.h"

namespace jax_flash2::cuda {

// FFI handlers registered as jax_flash2_attention_{fwd,bwd} for platform "CUDA".
extern "C" XLA_FFI_Error* JaxFlash2CudaForward(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxFlash2CudaBackward(XLA_FFI_CallFrame* call_frame);

// FFI handler registered as jax_flash2_kv_append for platform "CUDA"
// (kv_append.cu): appends k, v to a KV cache in place.
extern "C" XLA_FFI_Error* JaxFlash2CudaKvAppend(XLA_FFI_CallFrame* call_frame);

}  // namespace jax_flash2::cuda
