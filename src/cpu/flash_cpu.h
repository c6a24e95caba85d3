// CPU attention entry points used by the FFI handlers: pick the kernels for
// this processor and spread the tasks over the workers.
#pragma once

#include "../flash_params.h"
#include "parallel.h"

namespace jax_flash2::cpu {

// Name of the instruction set the kernels were selected for ("avx512", ...).
const char* SelectedIsa();

// Writes p.o and p.lse.
void ForwardCpu(const FlashParams& p, ParallelRunner& runner);

// Writes p.dq, p.dk, p.dv from p.q, k, v, o, lse, d_o, d_lse.
void BackwardCpu(const FlashParams& p, ParallelRunner& runner);

}  // namespace jax_flash2::cpu
