// Thin wrappers over the sm80 instructions the kernels are made of: cp.async
// (global -> shared, bypassing registers), ldmatrix (shared -> mma fragments)
// and mma.sync m16n8k16 with fp32 accumulators.
//
// Fragment layouts of mma.m16n8k16 (lane = 32 threads; g = lane / 4, t = lane % 4):
//   C/D (fp32, 16x8):   c[0], c[1] -> row g,     cols 2t, 2t+1
//                       c[2], c[3] -> row g + 8, cols 2t, 2t+1
//   A (16x16, row):     a[0] -> (g, 2t..2t+1)   a[1] -> (g+8, 2t..2t+1)
//                       a[2] -> (g, 2t+8..+9)   a[3] -> (g+8, 2t+8..+9)
//   B (16x8, col):      b[0] -> (k 2t..2t+1, n g)  b[1] -> (k 2t+8..+9, n g)
// So the accumulators of two adjacent 16x8 tiles of S = QK^T become the A
// operand of P V without shuffles: a = {pack(c0[0],c0[1]), pack(c0[2],c0[3]),
// pack(c1[0],c1[1]), pack(c1[2],c1[3])}.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace jax_flash2::cuda {

__device__ __forceinline__ uint32_t SmemAddress(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// 16-byte asynchronous copy. With valid == false nothing is read and the 16
// shared bytes are zero-filled: ragged tails become zeros, never garbage (gmem
// must still be a mapped address; pass the tensor's base).
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SmemAddress(smem)),
               "l"(gmem), "r"(src_bytes));
}

// The same under an L2 cache policy (from L2Policy).
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem, bool valid,
                                          uint64_t l2_policy) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(
                   SmemAddress(smem)),
               "l"(gmem), "r"(src_bytes), "l"(l2_policy));
}

// L2 policies for cp.async: evict-first for data read once (the decode
// kernel's long K/V streams), so that a stream larger than L2 does not push
// the kernels' code and the split partials out of it; evict-normal otherwise.
__device__ __forceinline__ uint64_t L2Policy(bool evict_first) {
  uint64_t policy;
  if (evict_first) {
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  } else {
    asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;\n" : "=l"(policy));
  }
  return policy;
}

__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most kPending committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddress(smem)));
}

__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddress(smem)));
}

__device__ __forceinline__ void LdMatrixX2(uint32_t (&r)[2], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(SmemAddress(smem)));
}

__device__ __forceinline__ void LdMatrixX2Trans(uint32_t (&r)[2], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(SmemAddress(smem)));
}

// d += a * b on the tensor cores, fp32 accumulate. Elem: __half or __nv_bfloat16.
template <typename Elem>
__device__ __forceinline__ void Mma16816(float (&d)[4], const uint32_t (&a)[4],
                                         const uint32_t (&b)[2]) {
  if constexpr (sizeof(Elem) == 2 && std::is_same_v<Elem, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

// Two floats -> one 32-bit register of two Elems (lo in the low half).
template <typename Elem>
__device__ __forceinline__ uint32_t PackFloat2(float lo, float hi) {
  if constexpr (std::is_same_v<Elem, __half>) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  } else {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
}

// One 32-bit register of two Elems -> two floats (PackFloat2's inverse).
template <typename Elem>
__device__ __forceinline__ float2 UnpackFloat2(uint32_t bits) {
  if constexpr (std::is_same_v<Elem, __half>) {
    return __half22float2(*reinterpret_cast<const __half2*>(&bits));
  } else {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits));
  }
}

template <typename Elem>
__device__ __forceinline__ float ToFloat(Elem x) {
  if constexpr (std::is_same_v<Elem, float>) {
    return x;
  } else if constexpr (std::is_same_v<Elem, __half>) {
    return __half2float(x);
  } else {
    return __bfloat162float(x);
  }
}

template <typename Elem>
__device__ __forceinline__ Elem FromFloat(float x) {
  if constexpr (std::is_same_v<Elem, __half>) {
    return __float2half_rn(x);
  } else {
    return __float2bfloat16_rn(x);
  }
}

// A row of an mma / wgmma accumulator tile lives in the 4 lanes of a quad
// (lane / 4 equal): its max and sum over those lanes.
__device__ __forceinline__ float QuadMax(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float QuadSum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

__device__ __forceinline__ float FastExp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Asks L2 to fetch [row, row + bytes) (16-byte aligned, bytes a multiple of
// 16); no data comes back to the SM and nothing waits for it. The bulk copy
// engine's prefetch on sm90 (B1 S32k decode 22.2 us against 22.8 with one
// prefetch per 128-byte line), the line prefetch before it.
__device__ __forceinline__ void PrefetchRowL2(const void* row, int bytes) {
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(row), "r"(bytes) : "memory");
#else
  const char* ptr = static_cast<const char*>(row);
  for (int offset = 0; offset < bytes; offset += 128) {
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(ptr + offset));
  }
#endif
}

// Programmatic dependent launch (sm90+; no-ops before; the launch is
// LaunchKernel's, ../launch.h): a primary kernel lets its dependent grid be
// scheduled early, and the dependent waits here until the primary grid has
// completed and its writes are visible. In a plainly launched kernel the
// wait returns at once.
__device__ __forceinline__ void AllowDependentLaunch() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::);
#endif
}

__device__ __forceinline__ void WaitForPrimaryGrid() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// x, opaque to the optimiser: code that uses it cannot move above this point.
// The runtime-option branches (softcap, ALiBi, segments) pass their indices
// through it so that their address arithmetic is not hoisted out of the main
// loops, where it would hold registers (and spill) for calls that never take
// the branch.
__device__ __forceinline__ int Opaque(int x) {
  asm volatile("mov.b32 %0, %0;" : "+r"(x));
  return x;
}

// tanh(x) = 1 - 2 / (e^(2x) + 1), branch-free: absolute error ~1e-7 (tanhf is
// a long branchy routine, and MUFU.TANH's 2^-11 relative error is fp16's own
// rounding). e^(2x) = inf gives 1, e^(2x) = 0 gives -1; never NaN.
__device__ __forceinline__ float FastTanh(float x) {
  return 1.f - __fdividef(2.f, FastExp2(x * 2.8853900817779268f) + 1.f);
}

// Packed sequences (segment ids). WarpIdRange: [*lo, *hi] of ids[begin,
// end). WarpMatchingSpan: the span of positions [begin, end) whose ids lie in
// [lo, hi], as [*first, *last] (*first > *last when none does). Positions
// outside it cannot match any id in [lo, hi], so the kernels skip the blocks
// outside it; for sorted ids (packed documents) that leaves only the blocks a
// document touches. Every lane of the calling warp scans a strided share and
// gets the warp's result; call them from whole warps.
__device__ __forceinline__ void WarpIdRange(const int32_t* ids, int begin, int end, int32_t* lo,
                                            int32_t* hi) {
  int32_t a = INT32_MAX, b = INT32_MIN;
  for (int x = begin + static_cast<int>(threadIdx.x % 32); x < end; x += 32) {
    a = min(a, ids[x]);
    b = max(b, ids[x]);
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
    a = min(a, __shfl_xor_sync(0xffffffffu, a, off));
    b = max(b, __shfl_xor_sync(0xffffffffu, b, off));
  }
  *lo = a;
  *hi = b;
}

__device__ __forceinline__ void WarpMatchingSpan(const int32_t* ids, int begin, int end,
                                                 int32_t lo, int32_t hi, int* first, int* last) {
  int f = INT32_MAX, l = INT32_MIN;
  for (int x = begin + static_cast<int>(threadIdx.x % 32); x < end; x += 32) {
    if (ids[x] >= lo && ids[x] <= hi) {
      f = min(f, x);
      l = max(l, x);
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
    f = min(f, __shfl_xor_sync(0xffffffffu, f, off));
    l = max(l, __shfl_xor_sync(0xffffffffu, l, off));
  }
  *first = f;
  *last = l;
}

// Narrows [*begin, *end) of the other side (ids `other`) to the span whose
// ids lie within the ids of this block's [block_begin, block_end) (`own`);
// empty when none does. Not inlined: that keeps the kernels' main loops
// closer to their register allocation without segment ids (inlined, the
// sm_90a large-tile d128 backward spilled 576 bytes of loads; not inlined,
// 488; the sm_80 d128 forward 48 either way, against 72 and 0 before).
static __device__ __noinline__ void NarrowToSegments(const int32_t* own, int block_begin,
                                                     int block_end, const int32_t* other,
                                                     int64_t* begin, int64_t* end) {
  int32_t lo, hi;
  WarpIdRange(own, block_begin, block_end, &lo, &hi);
  int first, last;
  WarpMatchingSpan(other, static_cast<int>(*begin), static_cast<int>(*end), lo, hi, &first,
                   &last);
  if (first > last) {
    *end = *begin;
  } else {
    *begin = *begin > first ? *begin : first;
    *end = *end < last + 1 ? *end : last + 1;
  }
}

}  // namespace jax_flash2::cuda
