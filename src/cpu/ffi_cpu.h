#pragma once

#include "xla/ffi/api/c_api.h"

namespace jax_flash2::cpu {

// FFI handlers registered as jax_flash2_attention_{fwd,bwd} for platform "cpu".
extern "C" XLA_FFI_Error* JaxFlash2CpuForward(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxFlash2CpuBackward(XLA_FFI_CallFrame* call_frame);

}  // namespace jax_flash2::cpu
