// Tensor maps for the Hopper kernels' TMA copies (forward and backward),
// encoded through the driver entry point the runtime hands out, so nothing
// links libcuda.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>

#include "../../flash_params.h"

namespace jax_flash2::cuda::sm90 {

// True when every pointer is 16-byte aligned (TMA bases, vector stores).
inline bool Aligned16(std::initializer_list<const void*> ptrs) {
  for (const void* ptr : ptrs) {
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return false;
  }
  return true;
}

// What both Hopper kernels ask of a call, beside a tile for its head dim and
// their grid limits: fp16/bf16; none of the score options (softcap, ALiBi,
// segment ids, dropout: the sm80 kernels run those); a consistent GQA group;
// q, k, v, o strides the tensor maps can encode (multiples of 8 elements =
// 16 bytes, below 2^39) and 16-byte aligned bases; 32-bit row/key indices.
inline bool Sm90CommonSupports(const FlashParams& p) {
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16) return false;
  if (p.softcap != 0.f || p.alibi_slopes != nullptr || p.q_segment_ids != nullptr ||
      p.kv_segment_ids != nullptr || p.dropout_seeds != nullptr) {
    return false;
  }
  if (p.num_heads_kv <= 0 || p.num_heads_q % p.num_heads_kv != 0 ||
      p.group_size != p.num_heads_q / p.num_heads_kv) {
    return false;
  }
  const int64_t strides[] = {p.q_batch_stride, p.q_row_stride, p.q_head_stride,
                             p.k_batch_stride, p.k_row_stride, p.k_head_stride,
                             p.v_batch_stride, p.v_row_stride, p.v_head_stride,
                             p.o_batch_stride, p.o_row_stride, p.o_head_stride};
  for (int64_t s : strides) {
    if (s % 8 != 0 || s < 0 || s >= (int64_t{1} << 39)) return false;
  }
  return Aligned16({p.q, p.k, p.v, p.o}) && p.seqlen_q < (int64_t{1} << 31) - 256 &&
         p.seqlen_k < (int64_t{1} << 31) - 256;
}

// cuTensorMapEncodeTiled's signature (cudaTypedefs.h would give the same).
using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                   const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                   const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                   CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// Looked up once per process; nullptr when the driver does not have it.
inline EncodeTiledFn GetEncodeTiled() {
  static EncodeTiledFn fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status;
    // The 12.0 ABI of the function (it has not changed since).
    const cudaError_t err = cudaGetDriverEntryPointByVersion(
        "cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &status);
    if (err != cudaSuccess || status != cudaDriverEntryPointSuccess) return EncodeTiledFn{nullptr};
    return reinterpret_cast<EncodeTiledFn>(ptr);
  }();
  return fn;
}

// A 4-D map over one [B, rows, heads, D] tensor (element strides given),
// boxes of 64 columns (128 bytes, the swizzle width) x box_rows rows of one
// head, 128-byte swizzle, zero fill out of bounds. The middle dimensions go
// in increasing stride order; *heads_inner reports the order chosen.
inline cudaError_t EncodeTensorMap(CUtensorMap* map, EncodeTiledFn encode, DType dtype, const void* ptr,
                            int64_t batch, int64_t rows, int64_t heads, int64_t head_dim,
                            int64_t batch_stride, int64_t row_stride, int64_t head_stride,
                            int box_rows, bool* heads_inner) {
  *heads_inner = head_stride <= row_stride;
  const CUtensorMapDataType type = dtype == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                             : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  cuuint64_t dims[4], strides[3];
  cuuint32_t box[4];
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  dims[0] = static_cast<cuuint64_t>(head_dim);
  box[0] = 64;
  if (*heads_inner) {
    dims[1] = heads;
    dims[2] = rows;
    strides[0] = head_stride * 2;
    strides[1] = row_stride * 2;
    box[1] = 1;
    box[2] = box_rows;
  } else {
    dims[1] = rows;
    dims[2] = heads;
    strides[0] = row_stride * 2;
    strides[1] = head_stride * 2;
    box[1] = box_rows;
    box[2] = 1;
  }
  dims[3] = batch;
  strides[2] = batch_stride * 2;
  box[3] = 1;
  const CUresult res = encode(map, type, 4, const_cast<void*>(ptr), dims, strides, box,
                              elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                              CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return res == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// A 4-D map over the backward's fp32 dQ accumulator [B, rows, heads, D]
// (contiguous), boxes of 32 columns (128 bytes) x box_rows rows of one head,
// 128-byte swizzle: the target of the Hopper backward's bulk reductions.
inline cudaError_t EncodeDqAccTensorMap(CUtensorMap* map, EncodeTiledFn encode, float* ptr,
                                        int64_t batch, int64_t rows, int64_t heads,
                                        int64_t head_dim, int box_rows) {
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(rows), static_cast<cuuint64_t>(batch)};
  const cuuint64_t row_bytes = static_cast<cuuint64_t>(heads * head_dim) * 4;
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(head_dim) * 4, row_bytes,
                                 row_bytes * static_cast<cuuint64_t>(rows)};
  const cuuint32_t box[4] = {32, 1, static_cast<cuuint32_t>(box_rows), 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  const CUresult res = encode(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, ptr, dims, strides, box,
                              elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                              CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return res == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

}  // namespace jax_flash2::cuda::sm90
