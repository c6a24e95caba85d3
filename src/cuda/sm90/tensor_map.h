// Tensor maps for the Hopper kernels' TMA copies (forward and backward),
// encoded through the driver entry point the runtime hands out, so nothing
// links libcuda.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../../flash_params.h"
#include "../../sm90_options.h"

namespace jax_flash2::cuda::sm90 {

// What both Hopper kernels ask of a call, beside a tile for its head dim and
// their grid limits: fp16/bf16; only the score options src/sm90_options.h
// lists as served (the sm80 kernels run the others); a consistent GQA group;
// q, k, v, o strides the tensor maps can encode (multiples of 8 elements =
// 16 bytes, below 2^39) and 16-byte aligned bases; 32-bit row/key indices.
inline bool Sm90CommonSupports(const FlashParams& p) {
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16) return false;
  if (!Sm90ServesOptions(p)) return false;  // the served options: src/sm90_options.h
  if (p.num_heads_kv <= 0 || p.num_heads_q % p.num_heads_kv != 0 ||
      p.group_size != p.num_heads_q / p.num_heads_kv) {
    return false;
  }
  for (int64_t s : QkvoStrides(p)) {
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

// A 4-D map over one [B, rows, heads, D] tensor of elem_bytes-byte elements
// (element strides given), boxes of box_cols columns (box_cols * elem_bytes =
// 128 bytes, the swizzle width) x box_rows rows of one head, 128-byte
// swizzle, zero fill out of bounds. The middle dimensions go in increasing
// stride order; *heads_inner reports the order chosen.
inline cudaError_t EncodeRowsTensorMap(CUtensorMap* map, EncodeTiledFn encode,
                                       CUtensorMapDataType type, int elem_bytes, const void* ptr,
                                       int64_t batch, int64_t rows, int64_t heads,
                                       int64_t head_dim, int64_t batch_stride, int64_t row_stride,
                                       int64_t head_stride, int box_cols, int box_rows,
                                       bool* heads_inner) {
  *heads_inner = head_stride <= row_stride;
  cuuint64_t dims[4], strides[3];
  cuuint32_t box[4];
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  dims[0] = static_cast<cuuint64_t>(head_dim);
  box[0] = box_cols;
  if (*heads_inner) {
    dims[1] = heads;
    dims[2] = rows;
    strides[0] = head_stride * elem_bytes;
    strides[1] = row_stride * elem_bytes;
    box[1] = 1;
    box[2] = box_rows;
  } else {
    dims[1] = rows;
    dims[2] = heads;
    strides[0] = row_stride * elem_bytes;
    strides[1] = head_stride * elem_bytes;
    box[1] = box_rows;
    box[2] = 1;
  }
  dims[3] = batch;
  strides[2] = batch_stride * elem_bytes;
  box[3] = 1;
  const CUresult res = encode(map, type, 4, const_cast<void*>(ptr), dims, strides, box,
                              elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                              CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return res == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// The maps of q, k, v, o, dO (fp16/bf16): boxes of 64 columns.
inline cudaError_t EncodeTensorMap(CUtensorMap* map, EncodeTiledFn encode, DType dtype,
                                   const void* ptr, int64_t batch, int64_t rows, int64_t heads,
                                   int64_t head_dim, int64_t batch_stride, int64_t row_stride,
                                   int64_t head_stride, int box_rows, bool* heads_inner) {
  const CUtensorMapDataType type = dtype == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                             : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  return EncodeRowsTensorMap(map, encode, type, 2, ptr, batch, rows, heads, head_dim, batch_stride,
                             row_stride, head_stride, 64, box_rows, heads_inner);
}

// The backward's fp32 dQ accumulator [B, rows, heads, D] (contiguous), the
// target of the Hopper backward's bulk reductions: boxes of 32 columns.
inline cudaError_t EncodeDqAccTensorMap(CUtensorMap* map, EncodeTiledFn encode, float* ptr,
                                        int64_t batch, int64_t rows, int64_t heads,
                                        int64_t head_dim, int box_rows) {
  bool heads_inner;  // true: the head stride D is below the row stride H * D
  return EncodeRowsTensorMap(map, encode, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, ptr, batch, rows,
                             heads, head_dim, rows * heads * head_dim, heads * head_dim, head_dim,
                             32, box_rows, &heads_inner);
}

}  // namespace jax_flash2::cuda::sm90
