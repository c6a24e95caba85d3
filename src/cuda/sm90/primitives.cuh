// Thin wrappers over the sm90 instructions the Hopper forward is made of:
// mbarriers (transaction-counted barriers in shared memory), TMA bulk tensor
// copies (cp.async.bulk.tensor) that complete on an mbarrier, wgmma shared
// memory descriptors, the wgmma fence/commit/wait protocol, and setmaxnreg.
// The wgmma instructions themselves are in wgmma.cuh.
//
// Everything here is sm_90a-only; build with
// -gencode=arch=compute_90a,code=sm_90a.
#pragma once

#include <cuda.h>  // CUtensorMap (the type only; no driver library is linked)
#include <cuda_runtime.h>

#include <cstdint>

#include "../sm80/primitives.cuh"  // PackFloat2

namespace jax_flash2::cuda::sm90 {

__device__ __forceinline__ uint32_t SmemAddr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// The kernel's dynamic shared memory rounded up to the 1024-byte swizzle
// atom: the runtime only guarantees 16-byte alignment, so the kernels'
// *SmemBytes reserve 1 KB of slack for this. The pointer is offset from the
// array, not rebuilt from an integer, so the compiler still knows it points
// into shared memory and emits STS/LDS for accesses through it (a pointer
// rounded as an integer made every such access a generic ST.E/LD.E, which
// waits on the long scoreboard).
__device__ __forceinline__ unsigned char* AlignedDynamicSmem() {
  extern __shared__ unsigned char smem_raw[];
  return smem_raw + ((1024 - (SmemAddr(smem_raw) & 1023)) & 1023);
}

// ---------------------------------------------------------------------------
// mbarrier. A phase completes when `count` arrivals have happened and the
// transaction count (bytes announced by expect_tx, decremented by the TMA
// engine as bytes land) is back at zero. Waiters name the phase by parity.

__device__ __forceinline__ void MbarInit(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(SmemAddr(bar)), "r"(count)
               : "memory");
}

// Makes the mbarrier initialisations visible to the other threads and to the
// async proxy (the TMA unit) before anyone arrives on or copies into them;
// follow with a block-wide barrier.
__device__ __forceinline__ void FenceBarrierInit() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// One arrival that also announces `bytes` more bytes the phase must receive.
__device__ __forceinline__ void MbarArriveExpectTx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(SmemAddr(bar)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void MbarArrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(SmemAddr(bar)) : "memory");
}

// Blocks until the phase with the given parity has completed. A freshly
// initialised barrier is in phase 0, so waiting for parity 1 returns at once
// (the "previous" phase counts as complete): producers start their
// empty-slot waits at parity 1 for that reason.
__device__ __forceinline__ void MbarWait(uint64_t* bar, uint32_t parity) {
  const uint32_t addr = SmemAddr(bar);
  uint32_t done = 0;
  do {
    // try_wait may itself suspend the thread for a while before returning
    // false, so this loop does not spin hot.
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
  } while (!done);
}

// ---------------------------------------------------------------------------
// TMA. The tensor map lives in the kernel's parameter space (a
// __grid_constant__ argument), so its generic address is valid for the
// copy engine. Coordinates are in elements, innermost first; boxes that
// reach past the tensor's extent are zero-filled and still count their full
// size toward the mbarrier's transaction bytes.

__device__ __forceinline__ void PrefetchTensorMap(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// The two middle coordinates {c1, c2} of a [B, rows, heads, D] tensor map,
// whose encoding (tensor_map.h, EncodeRowsTensorMap) puts the smaller of the
// row and head strides first: (head, row) when the heads are inner, else
// (row, head).
struct RowHeadCoords {
  int c1, c2;
  __device__ __forceinline__ RowHeadCoords(bool heads_inner, int row, int head)
      : c1(heads_inner ? head : row), c2(heads_inner ? row : head) {}
};

__device__ __forceinline__ void TmaLoad4d(void* smem_dst, const CUtensorMap* map, uint64_t* bar,
                                          int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(SmemAddr(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(SmemAddr(bar)), "r"(c0), "r"(c1), "r"(c2),
      "r"(c3)
      : "memory");
}

// TmaLoad4d of a box of rows starting at `row` of one head of a [B, rows,
// heads, D] tensor map, at column col.
__device__ __forceinline__ void TmaLoadRows(void* smem_dst, const CUtensorMap* map,
                                            bool heads_inner, uint64_t* bar, int col, int row,
                                            int head, int b) {
  const RowHeadCoords at(heads_inner, row, head);
  TmaLoad4d(smem_dst, map, bar, col, at.c1, at.c2, b);
}

// out[box at {c0, c1, c2, c3}] += the smem tile (the map's element type and
// swizzle), by the copy engine. Tracked per thread in bulk groups: commit with
// BulkCommitGroup, then BulkWaitGroupRead before reusing the tile and
// BulkWaitGroup before exiting. Box elements out of bounds are dropped.
__device__ __forceinline__ void TmaReduceAdd4d(const void* smem_src, const CUtensorMap* map, int c0,
                                               int c1, int c2, int c3) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group"
      " [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(reinterpret_cast<uint64_t>(map)),
      "r"(SmemAddr(smem_src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// out[box at {c0, c1, c2, c3}] = the smem tile, by the copy engine; tracked
// in bulk groups like TmaReduceAdd4d. Box elements out of bounds are dropped.
__device__ __forceinline__ void TmaStore4d(const void* smem_src, const CUtensorMap* map, int c0,
                                           int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group"
      " [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(reinterpret_cast<uint64_t>(map)),
      "r"(SmemAddr(smem_src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// Warp `warp`'s 16 rows of a warpgroup's fp32 accumulator tile (< 64 rows),
// row g times scale[0] and row g + 8 times scale[1], as Elem pairs into a
// tile staged for TMA stores. acc[4 j + 2 h], acc[4 j + 2 h + 1] hold columns
// 8 j + 2 t4, + 1 of row g + 8 h (the wgmma accumulator layout, wgmma.cuh).
// The tile is 64-column panels of 128-byte rows, `panel_bytes` apart, in the
// 128-byte swizzle the tensor maps use: 16-byte chunk c of row r at chunk
// c ^ (r % 8), so each 8-row block's stores hit 32 distinct banks. One
// stmatrix stores four 8 x 8 blocks (rows 0-7 and 8-15 of two 8-column
// groups) from the registers the accumulator layout already gives each lane,
// each lane naming one 16-byte row chunk (lanes 8 m .. 8 m + 7: block m):
// a quarter of the instructions of 4-byte stores, and no per-lane offsets.
template <typename Elem, int kAcc>
__device__ __forceinline__ void StageAccumulatorTile(unsigned char* tile, int panel_bytes, int warp,
                                                     int lane, const float (&acc)[kAcc],
                                                     const float (&scale)[2]) {
  static_assert(kAcc % 8 == 0, "pairs of 8-column groups");
  const int block = lane / 8;
  const int row = warp * 16 + (block % 2) * 8 + lane % 8;
  const uint32_t row_addr = SmemAddr(tile) + row * 128;
#pragma unroll
  for (int j = 0; j < kAcc / 4; j += 2) {
    // Groups j and j + 1 lie in one 64-column panel (j is even).
    const int chunk = (j % 8 + block / 2) ^ (row % 8);
    const uint32_t addr = row_addr + (j / 8) * panel_bytes + chunk * 16;
    const uint32_t r0 = PackFloat2<Elem>(acc[4 * j] * scale[0], acc[4 * j + 1] * scale[0]);
    const uint32_t r1 = PackFloat2<Elem>(acc[4 * j + 2] * scale[1], acc[4 * j + 3] * scale[1]);
    const uint32_t r2 = PackFloat2<Elem>(acc[4 * j + 4] * scale[0], acc[4 * j + 5] * scale[0]);
    const uint32_t r3 = PackFloat2<Elem>(acc[4 * j + 6] * scale[1], acc[4 * j + 7] * scale[1]);
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
                 "r"(r0), "r"(r1), "r"(r2), "r"(r3)
                 : "memory");
  }
}

// A warpgroup's 64 x 64 fp32 accumulator tile (the wgmma layout: dq[4 j + 2
// rh + e] at row 16 warp + g + 8 rh, column 8 j + 2 t4 + e) into two panels
// of 32 columns, panel_bytes apart, each in the 128-byte-swizzled layout of
// a TMA box of 64 rows x 32 fp32 (row r: 16-byte chunk c at c ^ (r % 8)),
// for the backward's dQ bulk reductions.
// An 8-byte store is served a half warp at a time (rows g < 4, then g >= 4).
// Lanes t4 < 2 and t4 >= 2 of a row write neighbouring chunks, which the
// swizzle by rows 0-3 keeps inside one 4-chunk half of the row: 2-way
// conflicts (ncu). So lanes t4 >= 2 store column block j ^ 2 when the
// others store j: their chunk moves to the other half, and each half warp
// covers all 32 banks once.
__device__ __forceinline__ void StageDqTile(unsigned char* tile, int panel_bytes, int warp, int g,
                                            int t4, const float (&dq)[32]) {
  const bool upper = t4 >= 2;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int jj = upper ? j ^ 2 : j;  // this lane's column block, 8 jj + 2 t4
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
      // Row r = 16 warp + g + 8 rh (r % 8 = g), columns 8 jj + 2 t4, + 1:
      // panel jj / 4, chunk 2 (jj % 4) + t4 / 2, byte 8 (t4 % 2) in it.
      const int r = 16 * warp + g + 8 * rh;
      const int chunk = (2 * (jj % 4) + t4 / 2) ^ g;
      const int lo = 4 * j + 2 * rh, hi = 4 * (j ^ 2) + 2 * rh;
      const float2 v = upper ? make_float2(dq[hi], dq[hi + 1]) : make_float2(dq[lo], dq[lo + 1]);
      *reinterpret_cast<float2*>(tile + (jj / 4) * panel_bytes + r * 128 + chunk * 16 +
                                 8 * (t4 % 2)) = v;
    }
  }
}

__device__ __forceinline__ void BulkCommitGroup() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}

// This thread's bulk groups, all but the newest N, have finished reading
// shared memory (their global writes may still be in flight).
template <int N>
__device__ __forceinline__ void BulkWaitGroupRead() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}

// ... and have completed.
template <int N>
__device__ __forceinline__ void BulkWaitGroup() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

// A position in a ring of kStages shared-memory stages whose full/empty
// mbarriers flip parity on every pass: the stage and the parity its barriers
// are on. The first pass waits on parity 0 for "full" and, with phase ^ 1, on
// "empty" slots that are free from the start.
template <int kStages>
struct RingPos {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void Advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

// Orders this thread's ordinary shared-memory stores before later reads of
// the same bytes by the async proxy (wgmma operands, TMA stores). Each writing
// thread executes it before the barrier that hands the tile to the readers.
__device__ __forceinline__ void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// The same between the generic and the async proxy's global-memory accesses
// (bulk reductions ordered against flag loads and stores).
__device__ __forceinline__ void FenceProxyAsyncGlobal() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

// ---------------------------------------------------------------------------
// wgmma protocol. Per warpgroup: WgmmaFence before the first wgmma of a batch
// (orders earlier register writes of the accumulators / A fragments against
// the async unit), the wgmmas, WgmmaCommit to close the batch into a group,
// WgmmaWait<N> until at most N groups are pending. Accumulators must not be
// touched between the issue and the wait.

__device__ __forceinline__ void WgmmaFence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

template <int kPending>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// A compiler-only fence: pins the registers in place across the asynchronous
// window (the compiler must assume they are read and written here), so no
// copy or reuse of an accumulator is scheduled between issue and wait.
template <int N>
__device__ __forceinline__ void WgmmaFenceOperands(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

template <int N>
__device__ __forceinline__ void WgmmaFenceOperands(uint32_t (&r)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
  }
}

// WgmmaWait<kPending> with the register arrays the pending groups use fenced
// on both sides: the common way to wait.
template <int kPending, typename... Arrays>
__device__ __forceinline__ void WgmmaWaitFenced(Arrays&... arrays) {
  (WgmmaFenceOperands(arrays), ...);
  WgmmaWait<kPending>();
  (WgmmaFenceOperands(arrays), ...);
}

// ---------------------------------------------------------------------------
// Shared-memory matrix descriptors for wgmma, 128-byte swizzle only: every
// operand tile is written by TMA with CU_TENSOR_MAP_SWIZZLE_128B, i.e. rows of
// 128 bytes (64 two-byte elements) in which the 16-byte chunk index is XORed
// with (row % 8); 8 such rows (1024 bytes, 1024-byte aligned) form one
// swizzle atom. Bit fields (PTX ISA, "matrix descriptor"):
//   [0, 14)  start address >> 4       [16, 30) leading byte offset >> 4
//   [32, 46) stride byte offset >> 4  [49, 52) base offset (0: atoms aligned)
//   [62, 64) swizzle: 1 = 128B
//
// K-major (Q as A and K as B of S = Q K^T; rows = M or N, 64-element rows of
// the reduction dim): the 8-row groups are 1024 bytes apart (stride byte
// offset); the k16 slice of one wgmma stays inside a 128-byte row, so the
// leading byte offset is unused (set to 1, as is customary). Stepping k by 16
// elements adds 32 bytes to the start address; the hardware applies the
// swizzle to the full address, which is why the atoms must be 1024-aligned.
//
// MN-major (V as B of O = P V; rows = keys (the reduction dim), 64 elements
// of D per 128-byte row): a k16 slice is two 8-key groups 1024 bytes apart
// (stride byte offset); the N extent past 64 columns continues in the next
// 64-column panel, `panel_bytes` further (leading byte offset). Stepping k by
// 16 keys adds 16 * 128 = 2048 bytes to the start address.

constexpr uint64_t kSwizzle128B = 1;

__device__ __forceinline__ uint64_t MakeDescK(uint32_t smem_addr) {
  uint64_t desc = 0;
  desc |= static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4);
  desc |= static_cast<uint64_t>(1) << 16;
  desc |= static_cast<uint64_t>(1024 >> 4) << 32;
  desc |= kSwizzle128B << 62;
  return desc;
}

__device__ __forceinline__ uint64_t MakeDescMN(uint32_t smem_addr, uint32_t panel_bytes) {
  uint64_t desc = 0;
  desc |= static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4);
  desc |= static_cast<uint64_t>((panel_bytes & 0x3FFFF) >> 4) << 16;
  desc |= static_cast<uint64_t>(1024 >> 4) << 32;
  desc |= kSwizzle128B << 62;
  return desc;
}

// Adds a byte offset to a descriptor's start address (bits [0, 14) in 16-byte
// units). Offsets used here keep the address inside the 18-bit shared window,
// so there is no carry into bit 14.
__device__ __forceinline__ uint64_t DescAdd(uint64_t desc, uint32_t bytes) {
  return desc + (bytes >> 4);
}

// ---------------------------------------------------------------------------
// Register reallocation between warpgroups (needs a register cap at kernel
// entry: __launch_bounds__(threads, 1)). Executed by all threads of a
// warpgroup; counts are multiples of 8 in [24, 256].

template <int kRegs>
__device__ __forceinline__ void SetMaxNRegDec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

template <int kRegs>
__device__ __forceinline__ void SetMaxNRegInc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// Named barriers over a subset of warps (id 0 is __syncthreads'): Sync
// waits until `threads` threads have arrived (its own warp included); Arrive
// counts its warp in without waiting.
__device__ __forceinline__ void NamedBarrierSync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void NamedBarrierArrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// A flag in global memory handed between blocks: the writer's earlier
// global writes are visible to a reader whose acquiring load sees the value.
__device__ __forceinline__ void StoreRelease(int* flag, int value) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(flag), "r"(value) : "memory");
}

__device__ __forceinline__ int LoadAcquire(const int* flag) {
  int value;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(value) : "l"(flag) : "memory");
  return value;
}

}  // namespace jax_flash2::cuda::sm90
