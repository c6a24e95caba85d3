// Which score options the Hopper (sm90/) kernels serve. The one place that
// says so: Sm90CommonSupports (sm90/tensor_map.h) calls it for the kernels
// and the plan (plan.h) for its choice and its reason, so both change
// together when a Hopper kernel learns an option. Plain C++ (no CUDA).
#pragma once

#include "flash_params.h"

namespace jax_flash2 {

// nullptr when the Hopper kernels serve every option p asks for, else the
// name of the first one they do not (the sm80 kernels run those calls).
inline const char* Sm90UnservedOption(const FlashParams& p) {
  // Softcap, ALiBi and dropout: served (sm90/score_options.h,
  // dropout_bits.cuh). Segment ids: served (sm90/segments.cuh), when given
  // in pairs.
  if ((p.q_segment_ids == nullptr) != (p.kv_segment_ids == nullptr)) return "segment_ids";
  return nullptr;
}

// Beside Sm90UnservedOption, what only the backward refuses: dropout at
// D > 128, where the D-split kernel (two consumers sharing one P^T tile in
// shared memory) has no keep mask.
inline const char* Sm90BackwardUnservedOption(const FlashParams& p) {
  if (p.dropout_seeds != nullptr && p.head_dim > 128) return "dropout at D > 128";
  return nullptr;
}

inline bool Sm90ServesOptions(const FlashParams& p) { return Sm90UnservedOption(p) == nullptr; }

}  // namespace jax_flash2
