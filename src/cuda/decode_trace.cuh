// Timestamps (%globaltimer, ns) of the decode and split-combine kernels'
// blocks, for timing experiments only: compiled in with -DJF2_DECODE_TRACE,
// when `fwd_selftest --decode-time` prints them after each shape. Each block
// takes a ticket at its start; launches of one grid size run in stream order,
// so after a reset ticket / grid_blocks is the launch index, kept in a ring
// of the last kSlots launches.
#pragma once
#ifdef JF2_DECODE_TRACE
#include <cstdint>

namespace jax_flash2::cuda::trace {

constexpr int kSlots = 4;
constexpr int kMaxBlocks = 2048;
// Slots of a block's row (kSmId holds %smid, the others %globaltimer).
enum Stamp : int {
  kStart = 0,       // the block's first instruction
  kFirstChunk = 1,  // warp 0 done with its first key chunk
  kLoopDone = 2,    // every warp done with its chunks
  kEnd = 3,         // thread 0's last store issued
  kSmId = 4,
  kWaited = 5,      // released by griddepcontrol.wait
  kMerged = 6,      // the warps' states merged (decode kernel)
  kStored = 7,      // about to store O (decode kernel)
};
constexpr int kStamps = 8;

struct Ring {
  unsigned long long ticket;
  unsigned long long grid_blocks;
  unsigned long long stamp[kSlots][kMaxBlocks][kStamps];
};

__device__ __forceinline__ unsigned long long Now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ unsigned SmId() {
  unsigned id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}

// Thread 0 of a block: the slot row of this launch for this block.
__device__ __forceinline__ unsigned long long* BlockRow(Ring* ring) {
  const unsigned long long blocks = gridDim.x * gridDim.y * gridDim.z;
  const unsigned long long ticket = atomicAdd(&ring->ticket, 1ull);
  const unsigned long long linear =
      blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * static_cast<unsigned long long>(blockIdx.z));
  if (linear == 0) ring->grid_blocks = blocks;
  if (linear >= kMaxBlocks) return nullptr;
  unsigned long long* row = ring->stamp[(ticket / blocks) % kSlots][linear];
  row[kSmId] = SmId();
  return row;
}

}  // namespace jax_flash2::cuda::trace

namespace jax_flash2::cuda {
// Host: copy a ring out or zero it (decode_kernel.cu's, fwd_launch.cu's).
void ReadDecodeTrace(trace::Ring* out);
void ReadCombineTrace(trace::Ring* out);
void ResetDecodeTrace();
void ResetCombineTrace();
}  // namespace jax_flash2::cuda

// A ring of this translation unit (device symbols are per unit here) and its
// host accessors; inside namespace jax_flash2::cuda.
#define JF2_TRACE_RING(ring, read_fn, reset_fn)                                       \
  __device__ trace::Ring ring;                                                        \
  void read_fn(trace::Ring* out) { cudaMemcpyFromSymbol(out, ring, sizeof(*out)); } \
  void reset_fn() {                                                                   \
    static const trace::Ring zero{};                                                  \
    cudaMemcpyToSymbol(ring, &zero, sizeof(zero));                                    \
  }
// In a kernel: thread 0 takes its block's row of the ring, then stamps.
#define JF2_TRACE_BEGIN(ring) \
  unsigned long long* trace_row = threadIdx.x == 0 ? trace::BlockRow(&ring) : nullptr
#define JF2_STAMP(slot) \
  if (trace_row) trace_row[trace::slot] = trace::Now()
#else
#define JF2_TRACE_RING(ring, read_fn, reset_fn)
#define JF2_TRACE_BEGIN(ring)
#define JF2_STAMP(slot)
#endif
