// Decode forward for sm80+: calls with few packed rows (T * group size
// queries of one K/V head, up to DecodeMaxRows), so the work is streaming K
// and V.
//
// The prefill kernel (fwd_kernel.cuh) splits a block's query rows over its
// warps; with at most 16 rows that leaves one warp doing all the math of a
// block while the others only copy, and the math, not the memory, set the
// time (1.6 TB/s at B1 S32k on the H200). Here every warp owns the same 16
// rows and a quarter of the block's keys instead: warp w takes key chunks w,
// w + 4, w + 8, ... (kBlockN keys each), streams them through its own
// cp.async ring (swizzled tiles, below; no block barrier in the loop), and
// keeps its own online softmax state. At the end the block merges the four
// states through shared memory, as the split-KV combine merges splits:
//   M = max_w m_w,  L = sum_w 2^((m_w - M) c) l_w,  O = sum_w 2^((m_w - M) c) O_w / L
// with c = scale * log2(e). A block holds all the rows in kMTiles m16 tiles
// (32 rows with two: T = 4 at a GQA group of 8). Grid (splits, B, K): each
// block is one K/V head's share of keys; splits > 1 write normalised
// partials that FwdCombineKernel merges (fwd_launch.cu).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>

#include "../smem_optin.h"
#include "fwd_kernel.cuh"
#include "fwd_launch.h"
#include "kernel_traits.h"
#include "primitives.cuh"

namespace jax_flash2::cuda {
namespace {

// The member names fwd_kernel.cuh's helpers (ComputeS, MaskScores,
// OnlineSoftmax, AccumulatePV, CopyMap) read: kMTiles m16 tiles per warp,
// kBlockN keys per warp step, and a copy map for one warp (each warp fills
// its own ring).
template <int kHeadDim_, int kMTiles_, bool kSmallSmem_>
struct DecodeTraits {
  static constexpr DecodeTileSizes kTile = DecodeTileOfRow(kHeadDim_, kSmallSmem_);
  static_assert(kTile.head_dim == kHeadDim_, "not a decode head-dim bucket");
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kTile.warp_keys;
  static constexpr int kStages = kTile.stages;
  static constexpr int kMTiles = kMTiles_;
  static constexpr int kRows = 16 * kMTiles_;
  static constexpr int kNTiles = kBlockN / 8;
  static constexpr int kDTiles = kHeadDim / 8;
  static constexpr int kQStride = kHeadDim + kSmemPad;  // Q rows, padded
  static constexpr int kChunksPerRow = kHeadDim / 8;
  static constexpr int kThreads = 32;
};

// K/V tiles: rows of kHeadDim elements, unpadded, so that every row starts
// on a 128-byte line of shared memory, with the 16-byte chunk c of row r
// stored at position c ^ (r % 8), so that the 8 rows an ldmatrix reads hit
// distinct banks. With the prefill kernel's padded rows (most starting off a
// line) the cp.asyncs moved 1.5x the K/V bytes from L2 into the SMs (ncu, B1
// S32k: 101 MB for 67 MB; unpadded rows: 67 MB), and B8 S128k streamed at 84%
// of the DRAM peak instead of 94%.
template <int kHeadDim>
__device__ __forceinline__ int SwizzledOffset(int row, int chunk) {
  return row * kHeadDim + ((chunk ^ (row % 8)) * 8);
}

// ldmatrix addresses in such a tile (fwd_kernel.cuh's PaddedTileAt for the
// swizzled layout): 16-row group i, 16-column step j. The lane reads row
// lane_row (lane_row % 8 == lane % 8), 16-byte chunk 2 j + half: at position
// (2 j + half) ^ (lane % 8) = 2 j ^ y with y = half ^ (lane % 8), i.e. byte
// (32 j) ^ (16 y), where the XOR touches only the low 7 bits.
template <int kHeadDim>
struct SwizzledTileAt {
  uint32_t base;  // the tile's address plus lane_row * kHeadDim * 2
  uint32_t y16;   // 16 * (half ^ (lane % 8))
  __device__ __forceinline__ uint32_t operator()(int i, int j) const {
    return base + i * 16 * kHeadDim * 2 + ((j * 32) & ~127) + (((j * 32) & 127) ^ y16);
  }
};

// cp.async of one warp's chunk of kRows (16 or 32) K or V rows into a
// swizzled tile, as fwd::LoadKvTile does into a padded one: rows [0, 16) of
// the chunk start at head_base + off[0], rows [16, 32) at head_base + off[1]
// (contiguous: off[1] = off[0] + 16 rows; paged: a 32-key chunk may span two
// pages of 16); rows >= num_rows, a half with off -1 (a page outside the
// pool) and columns >= head_dim are zero-filled, under the L2 policy.
template <class Tr, int kRows, typename Elem>
__device__ __forceinline__ void LoadSwizzledChunk(Elem* tile, const Elem* head_base,
                                                  const int64_t (&off)[2], int64_t row_stride,
                                                  int num_rows, int head_dim, int lane,
                                                  uint64_t l2_policy) {
  using Map = fwd::CopyMap<Tr>;
  // The XOR permutes chunks within each group of 8: a row must hold whole
  // groups. A thread's row group lies in one half, known at compile time.
  static_assert(kRows % Map::kRowsPerIter == 0 && 16 % Map::kRowsPerIter == 0 && kRows <= 32 &&
                Tr::kChunksPerRow % 8 == 0);
  const int tr = lane / Map::kThreadsPerRow;
  const int tc = lane % Map::kThreadsPerRow;  // first chunk
#pragma unroll
  for (int i = 0; i < kRows / Map::kRowsPerIter; ++i) {
    const int r = tr + i * Map::kRowsPerIter;
    const int half = i * Map::kRowsPerIter >= 16 ? 1 : 0;
    const bool row_ok = r < num_rows && off[half] >= 0;
    const Elem* src = head_base + off[half] + (r - 16 * half) * row_stride + tc * 8;
#pragma unroll
    for (int j = 0; j < Map::kChunksPerThread; ++j) {
      const int chunk = tc + j * Map::kThreadsPerRow;
      const bool valid = row_ok && chunk * 8 < head_dim;
      const Elem* from = valid ? src + j * Map::kThreadsPerRow * 8 : head_base;
      CpAsync16(tile + SwizzledOffset<Tr::kHeadDim>(r, chunk), from, valid, l2_policy);
    }
  }
}

// A quantized cache (int8 or float8_e4m3fn; Cache names the element type):
// a warp's chunks stay bytes in its ring, which then holds twice the 16-bit
// kernel's chunks in the same shared memory, and the mma fragments are read
// from them with ldmatrix and converted in registers. Both element types are
// exact in float16 (integers up to 127; every e4m3 value), so the scales
// stay out of the tiles: k's multiply S, v's multiply P (as a ratio to the
// block's first v scale, folded back in at the end). Q is float16 too, each
// row scaled by a power of two that puts its largest |q| in [2^14, 2^15):
// bfloat16's range fits, its 8-bit significands are exact. An int8 K tile
// skips the conversion: Q becomes integers split in two int8 halves and S
// comes from integer mmas on the K bytes as they landed (ComputeSInt8).
//
// Byte tiles: rows of kHeadDim bytes, 16-byte chunk c of row r stored at
// c ^ QuantSwizzle(r), so that the 8 rows an ldmatrix reads (8 consecutive
// keys, one chunk) hit distinct banks; D 64 packs two rows in a 128-byte line.
template <int kHeadDim>
__device__ __forceinline__ int QuantSwizzle(int row) {
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256);
  return kHeadDim >= 128 ? row % 8 : (row / 2) % 4;
}

// A lane's 16-byte pieces of a kRows-key chunk: 16 elements each (the plan
// asks head_dim % 16 == 0, so a piece is wholly inside a row or past its
// end), piece i at row r = (lane + 32 i) / kPerRow, column 16 c with c =
// (lane + 32 i) % kPerRow. Rows >= 16 exactly when 32 i >= 16 kPerRow (a
// multiple of 32, and lane < 32): a piece's 16-key half is known at compile
// time.
template <class Tr, int kRows>
struct StagedPieces {
  static constexpr int kPerRow = Tr::kHeadDim / 16;
  static constexpr int kCount = kRows * kPerRow / 32;
  static_assert(kRows * kPerRow % 32 == 0 && kRows <= 32);
  static constexpr int Half(int i) { return 32 * i >= 16 * kPerRow ? 1 : 0; }
  // Piece i's element offset from its half's first row (fewer than 16 rows
  // of at most 2^27 elements: int holds it), kept in registers (the 64-bit
  // row products cost ~10 instructions a piece when redone per chunk) unless
  // the kernel has none to spare (two m16 tiles: it spilled 264 bytes).
  static constexpr bool kKept = Tr::kMTiles == 1;
  int src_off[kKept ? kCount : 1];
  int64_t row_stride;
  int lane;
  __device__ StagedPieces(int64_t row_stride, int lane) : row_stride(row_stride), lane(lane) {
    if constexpr (kKept) {
#pragma unroll
      for (int i = 0; i < kCount; ++i) src_off[i] = Compute(i);
    }
  }
  __device__ __forceinline__ int Compute(int i) const {
    const int idx = lane + 32 * i;
    return static_cast<int>((idx / kPerRow - 16 * Half(i)) * row_stride) + 16 * (idx % kPerRow);
  }
  __device__ __forceinline__ int Offset(int i) const {
    if constexpr (kKept) {
      return src_off[i];
    } else {
      return Compute(i);
    }
  }
};

template <class Tr, int kRows, typename Cache>
__device__ __forceinline__ void LoadStagedChunk(uint8_t* stage, const Cache* head_base,
                                                const int64_t (&off)[2],
                                                const StagedPieces<Tr, kRows>& pieces,
                                                int num_rows, int head_dim, int lane,
                                                uint64_t l2_policy) {
  using Pieces = StagedPieces<Tr, kRows>;
#pragma unroll
  for (int i = 0; i < Pieces::kCount; ++i) {
    const int idx = lane + 32 * i;
    const int r = idx / Pieces::kPerRow, c = idx % Pieces::kPerRow;
    const int half = Pieces::Half(i);
    const bool valid = r < num_rows && off[half] >= 0 && c * 16 < head_dim;
    const Cache* src = valid ? head_base + off[half] + pieces.Offset(i) : head_base;
    CpAsync16(stage + r * Tr::kHeadDim + 16 * (c ^ QuantSwizzle<Tr::kHeadDim>(r)), src, valid,
              l2_policy);
  }
}

// n / d for n in [0, 2^31) and a divisor d >= 1 fixed per kernel, by a
// multiply-high: with L = ceil(log2 d), m = ceil(2^(31 + L) / d) fits 32 bits
// and n / d = umulhi(n, m) >> (L - 1) (d = 1: n). A paged cache's key
// arithmetic divides by the runtime page_size, ~25 instructions each way.
struct PageDivider {
  uint32_t d = 1, mul = 0, shift = 0;
  __device__ explicit PageDivider(int divisor) {
    d = static_cast<uint32_t>(max(divisor, 1));
    if (d > 1) {
      const int bits = 32 - __clz(static_cast<int>(d - 1));
      mul = static_cast<uint32_t>(((uint64_t{1} << (31 + bits)) + d - 1) / d);
      shift = static_cast<uint32_t>(bits - 1);
    }
  }
  __device__ int Div(int n) const {
    return d == 1 ? n : static_cast<int>(__umulhi(static_cast<uint32_t>(n), mul) >> shift);
  }
};

// Bytes kLo and kHi of a word of cache elements as a float16 pair, exactly.
inline constexpr uint32_t kExponentBytes = 0x64646464u;  // float16 1024's high byte, four times
template <typename Cache, int kLo, int kHi>
__device__ __forceinline__ uint32_t BytesToHalf2(uint32_t word) {
  if constexpr (std::is_same_v<Cache, int8_t>) {
    // x + 128 into the low byte of float16 1024 (0x64 high byte): 1024 + 128
    // + x, exact (the spacing there is 1); subtracting 1152 leaves x.
    // 0x64 bytes from a register ptxas cannot fold into the instruction, so
    // that the selector takes prmt's immediate: with the constant there,
    // ptxas copied the selectors into registers before every use.
    const uint32_t biased = __byte_perm(word ^ 0x80808080u, kExponentBytes | (threadIdx.x >> 31),
                                        kLo | 0x40 | (kHi << 8) | 0x4000);
    const __half2 x = __hsub2(*reinterpret_cast<const __half2*>(&biased),
                              __half2half2(__ushort_as_half(0x6480)));
    return *reinterpret_cast<const uint32_t*>(&x);
  } else {
    const uint32_t pair = __byte_perm(word, 0u, kLo | (kHi << 4));
    const __half2_raw x = __nv_cvt_fp8x2_to_halfraw2(
        static_cast<__nv_fp8x2_storage_t>(pair & 0xffffu), __NV_E4M3);
    return static_cast<uint32_t>(x.x) | (static_cast<uint32_t>(x.y) << 16);
  }
}

// A K word's bytes 0, 1 and 2, 3 as two float16 pairs (the B fragment of
// one m16n8k16). e4m3 on cc 8.9+ converts either half of the word in place
// (F2FP's .H1 operand), where BytesToHalf2 first moves the bytes with a PRMT.
template <typename Cache>
__device__ __forceinline__ void KWordToHalf2Pairs(uint32_t word, uint32_t (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if constexpr (!std::is_same_v<Cache, int8_t>) {
    asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n"
        " cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
        : "=r"(b[0]), "=r"(b[1])
        : "r"(word));
    return;
  }
#endif
  b[0] = BytesToHalf2<Cache, 0, 1>(word);
  b[1] = BytesToHalf2<Cache, 2, 3>(word);
}

// Where ScaleQRowToHalf stores Q's column d: within each 16 columns, column
// 4 t + e goes to 2 t + e % 2 + 8 (e / 2), the k index at which
// ComputeSQuantized's K fragments hold key column 4 t + e (a permutation of
// the summed dimension: S is unchanged).
__device__ __forceinline__ int QuantizedQColumn(int d) {
  const int c = d % 16;
  return d - c + 2 * (c / 4) + c % 2 + 8 * ((c / 2) % 2);
}

// Columns [64 sg, 64 sg + 64) of every n8 tile of a byte K tile: kf[nt][c]
// is 16-byte chunk c of them, lane (g, t4) holding key g's bytes 4 t4 ..
// 4 t4 + 3. k_lane: this lane's row (lane % 8) in the tile; k_y16: 16 *
// ((lane / 8) ^ QuantSwizzle(lane % 8)).
template <class Tr>
__device__ __forceinline__ void LoadKBytes64(uint32_t (&kf)[Tr::kNTiles][4], uint32_t k_lane,
                                             uint32_t k_y16, int sg) {
#pragma unroll
  for (int nt = 0; nt < Tr::kNTiles; ++nt) {
    fwd::LdMatrixX4At(kf[nt], k_lane + nt * 8 * Tr::kHeadDim + ((64 * sg) ^ k_y16));
  }
}

// S = Q K^T from a byte K tile. An ldmatrix of 8 keys x 16 bytes gives lane
// (g, t4) key g's bytes 4 t4 .. 4 t4 + 3, as two float16 pairs its B
// fragment at k indices 2 t4 + {0, 1} and 2 t4 + {8, 9} (QuantizedQColumn);
// one x4 covers four 16-column steps (LoadKBytes64).
template <class Tr, typename Cache>
__device__ __forceinline__ void ComputeSQuantized(float (&s)[Tr::kMTiles][Tr::kNTiles][4],
                                                  fwd::PaddedTileAt<Tr::kQStride> q_at,
                                                  uint32_t k_lane, uint32_t k_y16, int head_dim) {
  fwd::ZeroScores<Tr>(s);
#pragma unroll
  for (int sg = 0; sg < Tr::kHeadDim / 64; ++sg) {
    if (sg * 64 >= head_dim) break;  // zero padding columns contribute nothing
    uint32_t kf[Tr::kNTiles][4];  // [n8 tile][16-column step 4 sg + j]
    LoadKBytes64<Tr>(kf, k_lane, k_y16, sg);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t a[Tr::kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < Tr::kMTiles; ++mt) fwd::LdMatrixX4At(a[mt], q_at(mt, 4 * sg + j));
#pragma unroll
      for (int nt = 0; nt < Tr::kNTiles; ++nt) {
        uint32_t b[2];
        KWordToHalf2Pairs<Cache>(kf[nt][j], b);
#pragma unroll
        for (int mt = 0; mt < Tr::kMTiles; ++mt) Mma16816<__half>(s[mt][nt], a[mt], b);
      }
    }
  }
}

// O += P V from a byte V tile. ldmatrix.trans of 8 keys x 16 bytes gives lane
// (g, t4) bytes 2 g and 2 g + 1 of keys 2 t4 and 2 t4 + 1: the even bytes are
// the B fragment of column 2 g, the odd ones that of 2 g + 1. So each
// 16-column step c is two n8 mmas, over its even and its odd columns:
// o[2 c] holds columns 16 c + 4 t4 + {0, 2}, o[2 c + 1] columns
// 16 c + 4 t4 + {1, 3} (the merge writes them in order). v_lane: this lane's
// row (8 ((lane / 8) % 2) + lane % 8); v_y16: 16 * ((lane / 16) ^
// QuantSwizzle(lane % 8)).
template <class Tr, typename Cache>
__device__ __forceinline__ void AccumulatePVQuantized(
    const float (&s)[Tr::kMTiles][Tr::kNTiles][4], float (&o)[Tr::kMTiles][Tr::kDTiles][4],
    uint32_t v_lane, uint32_t v_y16, int head_dim) {
#pragma unroll
  for (int kk = 0; kk < Tr::kBlockN / 16; ++kk) {
    uint32_t a[Tr::kMTiles][4];
    fwd::PFragments<Tr, __half, Tr::kMTiles>(s, kk, a);
#pragma unroll
    for (int cp = 0; cp < Tr::kHeadDim / 32; ++cp) {
      if (cp * 32 >= head_dim) break;  // padding columns of O are never written
      uint32_t vf[4];  // (keys 0-7, step 2 cp), (8-15, 2 cp), (0-7, 2 cp + 1), (8-15, 2 cp + 1)
      fwd::LdMatrixX4TransAt(vf, v_lane + kk * 16 * Tr::kHeadDim + ((32 * cp) ^ v_y16));
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const uint32_t even[2] = {BytesToHalf2<Cache, 0, 2>(vf[2 * c]),
                                  BytesToHalf2<Cache, 0, 2>(vf[2 * c + 1])};
        const uint32_t odd[2] = {BytesToHalf2<Cache, 1, 3>(vf[2 * c]),
                                 BytesToHalf2<Cache, 1, 3>(vf[2 * c + 1])};
#pragma unroll
        for (int mt = 0; mt < Tr::kMTiles; ++mt) {
          Mma16816<__half>(o[mt][2 * (2 * cp + c)], a[mt], even);
          Mma16816<__half>(o[mt][2 * (2 * cp + c) + 1], a[mt], odd);
        }
      }
    }
  }
}

// d += a b on int8 fragments (m16n8k32, exact int32 sums).
__device__ __forceinline__ void MmaInt8(int (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// S = Q K^T from an int8 K tile with Q as integers q = 256 hi + lo, hi and
// lo int8 (SplitQRowToInt8; hi's bytes at Q step j, lo's at step j + kHeadDim /
// 32, in 32-byte steps): two integer mmas per 32 columns, exact, and no
// conversion of K. The ldmatrix of 8 keys x 16 bytes that gives lane (g, t4)
// key g's bytes 4 t4 .. 4 t4 + 3 is the m16n8k32 B fragment as it is (two
// such chunks per mma), and the same ldmatrix of Q's bytes its A fragment.
// Replacing ComputeSQuantized's 32 byte-to-float16 pairs per lane and 16
// keys, it takes the dequantization off the path from the landed tile to S.
template <class Tr>
__device__ __forceinline__ void ComputeSInt8(float (&s)[Tr::kMTiles][Tr::kNTiles][4],
                                             fwd::PaddedTileAt<Tr::kQStride> q_at,
                                             uint32_t k_lane, uint32_t k_y16, int head_dim) {
  int hi[Tr::kMTiles][Tr::kNTiles][4] = {}, lo[Tr::kMTiles][Tr::kNTiles][4] = {};
#pragma unroll
  for (int sg = 0; sg < Tr::kHeadDim / 64; ++sg) {
    if (sg * 64 >= head_dim) break;  // zero padding columns contribute nothing
    uint32_t kf[Tr::kNTiles][4];  // [n8 tile][16-byte chunk of the 64 columns]
    LoadKBytes64<Tr>(kf, k_lane, k_y16, sg);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int step = 2 * sg + half;
      uint32_t a_hi[Tr::kMTiles][4], a_lo[Tr::kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < Tr::kMTiles; ++mt) {
        fwd::LdMatrixX4At(a_hi[mt], q_at(mt, step));
        fwd::LdMatrixX4At(a_lo[mt], q_at(mt, step + Tr::kHeadDim / 32));
      }
#pragma unroll
      for (int nt = 0; nt < Tr::kNTiles; ++nt) {
#pragma unroll
        for (int mt = 0; mt < Tr::kMTiles; ++mt) {
          MmaInt8(hi[mt][nt], a_hi[mt], kf[nt][2 * half], kf[nt][2 * half + 1]);
          MmaInt8(lo[mt][nt], a_lo[mt], kf[nt][2 * half], kf[nt][2 * half + 1]);
        }
      }
    }
  }
  // |hi| <= 64, |lo| and |k| <= 128: 256 hi . k + lo . k stays within
  // 2^31 up to 256 columns.
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < Tr::kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mt][nt][e] = static_cast<float>(hi[mt][nt][e] * 256 + lo[mt][nt][e]);
}

// A warp's read of one Q row (bfloat16 when q_is_bf16, else float16):
// lane's columns lane + 32 j into x, and the row's largest |q| (a NaN
// dropped: fmaxf ignores it) to every lane.
template <int kHeadDim>
__device__ __forceinline__ float ReadQRow(const uint16_t* row, bool q_is_bf16, int lane,
                                          float (&x)[kHeadDim / 32]) {
  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < kHeadDim / 32; ++j) {
    const uint16_t bits = row[lane + 32 * j];
    x[j] = q_is_bf16 ? __bfloat162float(__ushort_as_bfloat16(bits))
                     : __half2float(__ushort_as_half(bits));
    amax = fmaxf(amax, fabsf(x[j]));
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  return amax;
}

// One Q row of the padded Q tile for an int8 K cache, in place, by a warp:
// the row times 2^e so that its largest |q| lies in [2^13, 2^14), rounded
// to an integer q = 256 hi + lo (hi in [-64, 64], lo in [-128, 127]: both
// int8), hi's bytes in columns [0, kHeadDim) of the row and lo's in
// [kHeadDim, 2 kHeadDim), in column order; 2^-e goes into the row's padding
// as ScaleQRowToHalf's does, NaN for a row with a NaN or an infinity (which
// integers cannot carry: S is NaN then, as in the float path). Rounding
// moves each q by at most 2^-14 of the row's largest.
template <int kHeadDim>
__device__ __forceinline__ void SplitQRowToInt8(uint16_t* row, bool q_is_bf16, int lane) {
  float x[kHeadDim / 32];
  const float amax = ReadQRow<kHeadDim>(row, q_is_bf16, lane, x);
  bool finite = true;
#pragma unroll
  for (int j = 0; j < kHeadDim / 32; ++j) finite = finite && isfinite(x[j]);
  finite = __all_sync(0xffffffffu, finite);
  const int e = amax > 0.f && finite ? 13 - ilogbf(amax) : 0;
  __syncwarp();  // every lane has read its elements before any is rewritten
  int8_t* bytes = reinterpret_cast<int8_t*>(row);
#pragma unroll
  for (int j = 0; j < kHeadDim / 32; ++j) {
    const int q = finite ? __float2int_rn(ldexpf(x[j], e)) : 0;
    const int hi = (q + 128) >> 8;
    bytes[lane + 32 * j] = static_cast<int8_t>(hi);
    bytes[kHeadDim + lane + 32 * j] = static_cast<int8_t>(q - 256 * hi);
  }
  if (lane == 0) *reinterpret_cast<float*>(row + kHeadDim) = finite ? ldexpf(1.f, -e) : NAN;
}

// One Q row of the padded Q tile, bfloat16 (q_is_bf16) or float16,
// rewritten in place by a warp as float16 times 2^e (max |q| in [2^14,
// 2^15); e = 0 for a row of zeros or with an infinity), its columns in
// QuantizedQColumn's order; 2^-e, the factor that takes S back, goes into the
// row's padding (kQStride - kHeadDim >= 2 elements).
template <int kHeadDim>
__device__ __forceinline__ void ScaleQRowToHalf(uint16_t* row, bool q_is_bf16, int lane) {
  float x[kHeadDim / 32];
  const float amax = ReadQRow<kHeadDim>(row, q_is_bf16, lane, x);  // a NaN stays NaN below
  const int e = amax > 0.f && amax < INFINITY ? 14 - ilogbf(amax) : 0;
  __syncwarp();  // every lane has read its elements before any is rewritten
#pragma unroll
  for (int j = 0; j < kHeadDim / 32; ++j) {
    row[QuantizedQColumn(lane + 32 * j)] = __half_as_ushort(__float2half_rn(ldexpf(x[j], e)));
  }
  if (lane == 0) *reinterpret_cast<float*>(row + kHeadDim) = ldexpf(1.f, -e);
}

template <typename Elem, int kHeadDim, int kMTiles, bool kSmallSmem, typename Cache = Elem>
__global__ void __launch_bounds__(kDecodeWarps * 32)
    DecodeKernel(const __grid_constant__ FwdArgs args) {
  using Tr = DecodeTraits<kHeadDim, kMTiles, kSmallSmem>;
  // Quantized: Elem is __half (the mma type), q and out are p.dtype.
  constexpr bool kQuantized = !std::is_same_v<Cache, Elem>;
  static_assert(!kQuantized || std::is_same_v<Elem, __half>);
  // int8 K by integer mmas (ComputeSInt8); not on two m16 tiles, whose
  // kernel it spilled (272 bytes against 68).
  constexpr bool kInt8Mma = std::is_same_v<Cache, int8_t> && kMTiles == 1;
  constexpr int kRows = Tr::kRows;
  constexpr int kKeys = Tr::kBlockN;
  constexpr int kStages = Tr::kStages;
  // Chunks a warp's ring holds: a quantized chunk is half the bytes. With the
  // 16-bit kernel's two the quantized step took as long as bfloat16's (one
  // chunk in flight, half the bytes; B16 paged 64: 378-390 us against 349).
  constexpr int kRing = kQuantized ? 2 * kStages : kStages;
  constexpr int kQStride = Tr::kQStride;
  constexpr int kNT = Tr::kNTiles;
  constexpr int kDT = Tr::kDTiles;
  constexpr int kTileElems = kKeys * kHeadDim;

  // The split combine (if any) may be scheduled now: it waits for this grid.
  AllowDependentLaunch();
  // A KV-cache call reads its lengths, block table and scales, which the
  // grid before it may write (the append writes the cache), only after it:
  // launched early, it gains the launch but not the prefetch below.
  if (args.p.kv_seqlens != nullptr) WaitForPrimaryGrid();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // Q (kRows rows), then per warp a ring of kRing x (K tile, V tile).
  Elem* s_q = reinterpret_cast<Elem*>(smem_raw);
  const FlashParams& p = args.p;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int g = lane / 4;
  const int t4 = lane % 4;
  // The rings start on a 128-byte line (kRows * kQStride * 2 is a multiple
  // of 128 for every head-dim bucket; dynamic shared memory starts aligned).
  static_assert(kRows * kQStride * 2 % 128 == 0);
  Elem* s_ring = s_q + kRows * kQStride + warp * kStages * 2 * kTileElems;

  const int split = blockIdx.x;
  const int b = blockIdx.y;
  const int kv_head = blockIdx.z;
  const int group = static_cast<int>(p.group_size);
  const int seqlen_q = static_cast<int>(p.seqlen_q);
  // A KV cache's sequence has its own key count (its keys past it are never
  // loaded) and its own diagonal; a split past its end loads nothing and
  // writes an empty partial (LSE -inf) for the combine.
  const int seqlen_k = static_cast<int>(KvLength(p, b));
  const int head_dim = static_cast<int>(p.head_dim);
  const int num_rows = seqlen_q * group;  // <= kRows (the host's choice)

  // Key chunks any row may see, within this block's split; every row sees
  // [full_begin, full_end), so only chunks crossing its edges are masked.
  const WindowMask mask = MakeWindowMask(p, b);
  int64_t lo, hi;
  mask.KeyRange(0, seqlen_q, &lo, &hi);
  int c_begin = static_cast<int>(lo / kKeys);
  int c_end = hi > lo ? static_cast<int>((hi + kKeys - 1) / kKeys) : c_begin;
  if (args.num_splits > 1) {
    c_begin = max(c_begin, split * args.n_blocks_per_split);
    c_end = min(c_end, (split + 1) * args.n_blocks_per_split);
  }
  mask.KeyRange(seqlen_q - 1, seqlen_q, &lo, &hi);
  const int full_begin = static_cast<int>(lo);
  mask.KeyRange(0, 1, &lo, &hi);
  const int full_end = static_cast<int>(hi);
  // This warp's chunks: c_begin + warp + i * kDecodeWarps, i < num_mine;
  // chunk i's first key:
  const int num_mine = max(0, (c_end - c_begin - warp + kDecodeWarps - 1) / kDecodeWarps);
  const auto chunk_key0 = [&](int i) { return (c_begin + warp + i * kDecodeWarps) * kKeys; };

  // A split that holds no visible key (past a KV-cache sequence's end, say)
  // writes only its empty LSE: the combine gives it weight 0 and reads none
  // of its O. Without the Q load and the merge such a block costs little;
  // a mixed-length batch launches many of them.
  if (args.num_splits > 1 && c_begin >= c_end) {
    WaitForPrimaryGrid();
    for (int r = tid; r < num_rows; r += kDecodeWarps * 32) {
      const int64_t lse_index =
          (b * p.num_heads_q + kv_head * group + r % group) * seqlen_q + r / group;
      args.lse_partial[split * p.batch * p.num_heads_q * seqlen_q + lse_index] = -INFINITY;
    }
    return;
  }

  // Paged: k, v are a page pool (k/v_batch_stride the page stride), read
  // through the block table (load_chunk); the heads' bases are unused.
  const bool paged = p.block_table != nullptr;
  const Cache* k_head = static_cast<const Cache*>(p.k) +
                        (paged ? 0 : b * p.k_batch_stride) + kv_head * p.k_head_stride;
  const Cache* v_head = static_cast<const Cache*>(p.v) +
                        (paged ? 0 : b * p.v_batch_stride) + kv_head * p.v_head_stride;
  // Packed row r (< num_rows) is query r / group of head kv_head * group + r % group.
  auto q_row = [&](int r) {
    return static_cast<const Elem*>(p.q) + b * p.q_batch_stride + (r / group) * p.q_row_stride +
           (kv_head * group + r % group) * p.q_head_stride;
  };

  // Launched early (args.programmatic_launch), the block may start while the
  // grid before it still runs (the previous call's split combine, say), and
  // must not read or write global memory until WaitForPrimaryGrid returns.
  // An L2 prefetch is neither: it returns nothing to the SM, and L2 is where
  // the GPU's writes meet, so a line the previous grid writes after the
  // prefetch is updated there. Prefetching this warp's first kStages chunks
  // (what it asks for first anyway) and Q meanwhile keeps the memory busy
  // during that grid's tail: B1 S32k 24.2-24.6 -> 22.1-22.6 us (one, three
  // or four chunks measured slower).
  {
    const int row_bytes = head_dim * static_cast<int>(sizeof(Cache));
#pragma unroll
    for (int i = 0; i < kStages; ++i) {
      const int key = chunk_key0(i) + lane;
      if (paged || i >= num_mine || lane >= kKeys || key >= seqlen_k) continue;
      PrefetchRowL2(k_head + key * p.k_row_stride, row_bytes);
      PrefetchRowL2(v_head + key * p.v_row_stride, row_bytes);
    }
    if (tid < num_rows) PrefetchRowL2(q_row(tid), head_dim * 2);
  }
  WaitForPrimaryGrid();

  // Q by the whole block; rows past num_rows are zero-filled (and never
  // written). (fwd::LoadQTile does the same for a block of Tr::kThreads; here
  // the traits' kThreads is one warp, for the per-warp K/V copies.)
  {
    constexpr int kChunks = kRows * Tr::kChunksPerRow;
    for (int idx = tid; idx < kChunks; idx += kDecodeWarps * 32) {
      const int r = idx / Tr::kChunksPerRow;
      const int c = (idx % Tr::kChunksPerRow) * 8;
      const bool valid = r < num_rows && c < head_dim;
      CpAsync16(s_q + r * kQStride + c, valid ? q_row(r) + c : static_cast<const Elem*>(p.q),
                valid);
    }
    CpAsyncCommit();
  }
  const uint64_t kv_policy = L2Policy(args.kv_read_once);
  // Paged: the page ids of chunk i's two 16-key halves (-1 past the
  // sequence's end), read one chunk before load_chunk needs them: read in
  // load_chunk itself, the table load stalled the warp before every copy.
  // A chunk holds kHalves 16-key halves.
  constexpr int kHalves = kKeys / 16;
  const int page_size = static_cast<int>(p.page_size);
  const PageDivider pages(page_size);
  auto page_ids = [&](int i, int (&page)[2]) {
    const int key0 = chunk_key0(i);
    page[1] = -1;
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      const int key = key0 + 16 * h;
      page[h] = paged && i < num_mine && key < seqlen_k
                    ? p.block_table[b * p.max_pages + pages.Div(key)]
                    : -1;
    }
  };
  // Offsets of a chunk's two 16-key halves from k_head / v_head (k and v
  // share strides: both come from one dense [B|pages, S|page, K, D] shape).
  // Paged: through the page ids, -1 for a half past the sequence's end or in
  // a page outside the pool; page_size is a multiple of 16.
  // Quantized: the ring's tiles are bytes (LoadStagedChunk).
  uint8_t* s_stage = reinterpret_cast<uint8_t*>(s_ring);
  const StagedPieces<Tr, kKeys> pieces(p.k_row_stride, lane);
  auto load_chunk = [&](int i, const int (&page)[2]) {
    Elem* k_dst = s_ring + (i % kRing) * 2 * kTileElems;
    const int key0 = chunk_key0(i);
    int64_t off[2] = {-1, -1};
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      const int key = key0 + 16 * h;
      if (!paged) {
        off[h] = key * p.k_row_stride;
        continue;
      }
      off[h] = page[h] >= 0 && page[h] < p.num_pages
                   ? page[h] * p.k_batch_stride +
                         (key - pages.Div(key) * page_size) * p.k_row_stride
                   : int64_t{-1};
    }
    if constexpr (kQuantized) {
      uint8_t* stage = s_stage + (i % kRing) * 2 * kTileElems;
      LoadStagedChunk<Tr, kKeys>(stage, k_head, off, pieces, seqlen_k - key0, head_dim, lane,
                                 kv_policy);
      LoadStagedChunk<Tr, kKeys>(stage + kTileElems, v_head, off, pieces, seqlen_k - key0,
                                 head_dim, lane, kv_policy);
    } else {
      LoadSwizzledChunk<Tr, kKeys>(k_dst, k_head, off, p.k_row_stride, seqlen_k - key0,
                                   head_dim, lane, kv_policy);
      LoadSwizzledChunk<Tr, kKeys>(k_dst + kTileElems, v_head, off, p.k_row_stride,
                                   seqlen_k - key0, head_dim, lane, kv_policy);
    }
  };
  // Quantized: the k and v scales of chunk i's 16-key halves (KvScale's),
  // read as its copy is issued and used when it is computed; v's as a ratio
  // to v_ref, the v scale of the block's first key, which the end multiplies
  // back (float16 P times a ratio near 1 neither overflows nor underflows).
  struct HalfScales {
    float k[kHalves], v[kHalves];
  };
  // k's and v's scales of this sequence and KV head, at page slot 0
  // (kv_scales: [B, 2, kv_scale_pages, K]; null for a 16-bit cache).
  const float* k_scales =
      kQuantized ? p.kv_scales + (b * 2 * p.kv_scale_pages) * p.num_heads_kv + kv_head : nullptr;
  const float* v_scales = kQuantized ? k_scales + p.kv_scale_pages * p.num_heads_kv : nullptr;
  auto scales_of = [&](int i) {
    HalfScales sc;
    const int key0 = chunk_key0(i);
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      const int key = min(key0 + 16 * h, max(seqlen_k - 1, 0));
      const int64_t slot = p.kv_scale_pages > 1 ? pages.Div(key) : 0;
      sc.k[h] = k_scales[slot * p.num_heads_kv];
      sc.v[h] = v_scales[slot * p.num_heads_kv];
    }
    return sc;
  };
  float v_ref = 1.f;
  if constexpr (kQuantized) {
    v_ref = KvScale(p, b, 1, min(c_begin * kKeys, max(seqlen_k - 1, 0)), kv_head);
    if (!(v_ref > 0.f && v_ref < INFINITY)) v_ref = 1.f;
  }
  const float inv_v_ref = 1.f / v_ref;
  HalfScales pending[kRing - 1] = {};  // quantized: chunks i .. i + kRing - 2
  int next_page[2];  // the page ids of the next chunk to load
#pragma unroll
  for (int i = 0; i < kRing - 1; ++i) {
    page_ids(i, next_page);
    if (i < num_mine) load_chunk(i, next_page);
    CpAsyncCommit();  // empty groups too: the wait counts below stay fixed
    if constexpr (kQuantized) pending[i] = scales_of(i);
  }
  page_ids(kRing - 1, next_page);
  CpAsyncWait<kRing - 1>();  // this thread's Q chunks (the oldest group)
  __syncthreads();             // everyone's
  // Quantized: S from the mma times row_scale (Q's power of two back) is q . k.
  float row_scale[kMTiles][2];
  if constexpr (kQuantized) {
    static_assert(kHeadDim % 32 == 0 && kQStride - kHeadDim >= 2);  // the row's factor fits
    for (int r = warp; r < num_rows; r += kDecodeWarps) {  // a warp per row
      uint16_t* row = reinterpret_cast<uint16_t*>(s_q) + r * kQStride;
      if constexpr (kInt8Mma) {
        SplitQRowToInt8<kHeadDim>(row, p.dtype == DType::kBFloat16, lane);
      } else {
        ScaleQRowToHalf<kHeadDim>(row, p.dtype == DType::kBFloat16, lane);
      }
    }
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = mt * 16 + g + 8 * h;
        row_scale[mt][h] =
            r < num_rows ? *reinterpret_cast<const float*>(s_q + r * kQStride + kHeadDim) : 1.f;
      }
    }
  }

  // ldmatrix lane addresses as in fwd_kernel.cuh (rows 0-15 of the first
  // tile for every warp; ComputeS steps to the others): Q padded, K and V
  // swizzled (K: row (lane / 16) * 8 + lane % 8, half (lane / 8) % 2; V,
  // transposed: row ((lane / 8) % 2) * 8 + lane % 8, half lane / 16), in
  // stage 0 of the ring. Quantized: ComputeSQuantized's and
  // AccumulatePVQuantized's.
  const uint32_t q_addr =
      SmemAddress(s_q) + ((lane % 8 + ((lane / 8) % 2) * 8) * kQStride + (lane / 16) * 8) * 2;
  uint32_t k_addr, k_y16, v_addr, v_y16;
  if constexpr (kQuantized) {
    const int swizzle = QuantSwizzle<kHeadDim>(lane % 8);
    k_addr = SmemAddress(s_stage) + (lane % 8) * kHeadDim;
    k_y16 = ((lane / 8) ^ swizzle) * 16;
    v_addr = SmemAddress(s_stage + kTileElems) + (((lane / 8) % 2) * 8 + lane % 8) * kHeadDim;
    v_y16 = ((lane / 16) ^ swizzle) * 16;
  } else {
    k_addr = SmemAddress(s_ring) + ((lane / 16) * 8 + lane % 8) * kHeadDim * 2;
    k_y16 = (((lane / 8) % 2) ^ (lane % 8)) * 16;
    v_addr = SmemAddress(s_ring + kTileElems) + (((lane / 8) % 2) * 8 + lane % 8) * kHeadDim * 2;
    v_y16 = ((lane / 16) ^ (lane % 8)) * 16;
  }
  const float scale_log2 = p.softmax_scale_log2;

  // Shaped [m16 tile][half] for fwd_kernel.cuh's helpers.
  float o[kMTiles][kDT][4];
  float row_max[kMTiles][2];
  float row_sum[kMTiles][2];  // this lane's columns; quad-reduced at the merge
  int key_lo[kMTiles][2], key_hi[kMTiles][2];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) o[mt][dt][i] = 0.f;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_max[mt][h] = -INFINITY;
      row_sum[mt][h] = 0.f;
      const int t = min((mt * 16 + g + 8 * h) / group, seqlen_q - 1);
      mask.KeyRange(t, t + 1, &lo, &hi);
      key_lo[mt][h] = static_cast<int>(lo);
      key_hi[mt][h] = static_cast<int>(hi);
    }
  }

  for (int i = 0; i < num_mine; ++i) {
    HalfScales incoming{};
    if (i + kRing - 1 < num_mine) {
      load_chunk(i + kRing - 1, next_page);
      page_ids(i + kRing, next_page);
      if constexpr (kQuantized) incoming = scales_of(i + kRing - 1);
    }
    CpAsyncCommit();
    CpAsyncWait<kRing - 1>();  // chunk i has landed (for this lane)
    __syncwarp();              // and for the warp
    // Chunk i's tiles: 2 kTileElems elements of Elem, or bytes when quantized.
    const uint32_t stage_bytes = (i % kRing) * 2 * kTileElems * (kQuantized ? 1 : 2);
    const int key0 = chunk_key0(i);
    float s[kMTiles][kNT][4];
    if constexpr (kQuantized) {
      if constexpr (kInt8Mma) {
        ComputeSInt8<Tr>(s, fwd::PaddedTileAt<kQStride>{q_addr}, k_addr + stage_bytes, k_y16,
                         head_dim);
      } else {
        ComputeSQuantized<Tr, Cache>(s, fwd::PaddedTileAt<kQStride>{q_addr},
                                     k_addr + stage_bytes, k_y16, head_dim);
      }
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)  // n8 tile nt lies in 16-key half nt / 2
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][nt][e] *= row_scale[mt][e / 2] * pending[0].k[nt / 2];
    } else {
      fwd::ComputeS<Tr, Elem, kMTiles>(s, fwd::PaddedTileAt<kQStride>{q_addr},
                                       SwizzledTileAt<kHeadDim>{k_addr + stage_bytes, k_y16},
                                       head_dim);
    }
    if (key0 < full_begin || key0 + kKeys > full_end) {
      fwd::MaskScores<Tr>(s, key0, key_lo, key_hi, t4);
    }
    fwd::OnlineSoftmax<Tr, true>(s, o, row_max, row_sum, scale_log2);
    if constexpr (kQuantized) {  // P's column sums are in; now P times v's scale ratio
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][nt][e] *= pending[0].v[nt / 2] * inv_v_ref;
#pragma unroll
      for (int j = 0; j + 1 < kRing - 1; ++j) pending[j] = pending[j + 1];
      pending[kRing - 2] = incoming;
      AccumulatePVQuantized<Tr, Cache>(s, o, v_addr + stage_bytes, v_y16, head_dim);
    } else {
      fwd::AccumulatePV<Tr, Elem, kMTiles>(
          s, o, SwizzledTileAt<kHeadDim>{v_addr + stage_bytes, v_y16}, head_dim);
    }
    __syncwarp();  // the warp is done reading this stage before it is refilled
  }

  // Merge the warps' states through the (now idle) rings.
  CpAsyncWait<0>();
  __syncthreads();
  // O rows padded by 8 floats: a half warp's 8-byte stores (8 rows x 4
  // lanes) then hit distinct banks.
  constexpr int kMergeStride = kHeadDim + 8;
  float* merge_max = reinterpret_cast<float*>(s_q + kRows * kQStride);  // [warp][row]
  float* merge_sum = merge_max + kDecodeWarps * kRows;                 // [warp][row]
  float* merge_o = merge_sum + kDecodeWarps * kRows;  // [warp][row][kMergeStride]
  static_assert((2 + kMergeStride) * kDecodeWarps * kRows * 4 <=
                kDecodeWarps * kStages * 2 * kTileElems * 2);
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float l = QuadSum(row_sum[mt][h]);
      if (mt * 16 + g + 8 * h >= num_rows) continue;  // padding rows are never written
      const int r = warp * kRows + mt * 16 + g + 8 * h;
      if (t4 == 0) {
        merge_max[r] = row_max[mt][h];
        merge_sum[r] = l;
      }
      if constexpr (kQuantized) {  // AccumulatePVQuantized's columns, in order
#pragma unroll
        for (int c = 0; c < kDT / 2; ++c) {
          *reinterpret_cast<float4*>(merge_o + r * kMergeStride + c * 16 + 4 * t4) =
              make_float4(o[mt][2 * c][2 * h], o[mt][2 * c + 1][2 * h], o[mt][2 * c][2 * h + 1],
                          o[mt][2 * c + 1][2 * h + 1]);
        }
      } else {
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt) {
          *reinterpret_cast<float2*>(merge_o + r * kMergeStride + dt * 8 + 2 * t4) =
              make_float2(o[mt][dt][2 * h], o[mt][dt][2 * h + 1]);
        }
      }
    }
  }
  __syncthreads();

  // Thread -> (row, 4 columns every 4 * threads_per_row): all threads share
  // the real rows (the merge is a chain of dependent steps; fewer per thread
  // is shorter).
  const int threads_per_row = num_rows > 16 ? 4 : num_rows > 8 ? 8 : num_rows > 4 ? 16 : 32;
  const int r = tid / threads_per_row;
  if (r >= num_rows) return;
  float mx = -INFINITY;
#pragma unroll
  for (int w = 0; w < kDecodeWarps; ++w) mx = fmaxf(mx, merge_max[w * kRows + r]);
  float weight[kDecodeWarps];
  float l = 0.f;
#pragma unroll
  for (int w = 0; w < kDecodeWarps; ++w) {
    // A row no warp saw a key of keeps max -inf: weights 0, O 0, LSE -inf.
    weight[w] = mx == -INFINITY ? 0.f : FastExp2((merge_max[w * kRows + r] - mx) * scale_log2);
    l += weight[w] * merge_sum[w * kRows + r];
  }
  // l == 0: no key (O 0, LSE -inf); a NaN score's NaN l passes.
  const RowEnd end = RowEndOf(l, 1.f, mx * p.softmax_scale, IeeeDivide{}, IeeeLog{});
  const float inv_l = kQuantized ? end.normalizer * v_ref : end.normalizer;
  const float lse = end.lse;
  const int t = r / group;
  const int head = kv_head * group + r % group;
  const int64_t lse_index = (b * p.num_heads_q + head) * seqlen_q + t;
  const bool write_partial = args.num_splits > 1;
  const int64_t part = split * p.batch * p.num_heads_q * seqlen_q + lse_index;
  Elem* o_row = static_cast<Elem*>(p.o) + b * p.o_batch_stride + t * p.o_row_stride +
                head * p.o_head_stride;
  // head_dim is a multiple of 8: a thread's 4 columns never straddle its end.
  for (int d = (tid % threads_per_row) * 4; d < head_dim; d += threads_per_row * 4) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) {
      const float4 x =
          *reinterpret_cast<const float4*>(merge_o + (w * kRows + r) * kMergeStride + d);
      acc.x += weight[w] * x.x;
      acc.y += weight[w] * x.y;
      acc.z += weight[w] * x.z;
      acc.w += weight[w] * x.w;
    }
    acc = make_float4(acc.x * inv_l, acc.y * inv_l, acc.z * inv_l, acc.w * inv_l);
    if (write_partial) {
      *reinterpret_cast<float4*>(args.o_partial + part * head_dim + d) = acc;
    } else if constexpr (kQuantized) {  // out is q's dtype, not the mma's
      *reinterpret_cast<uint2*>(o_row + d) =
          p.dtype == DType::kBFloat16
              ? make_uint2(PackFloat2<__nv_bfloat16>(acc.x, acc.y),
                           PackFloat2<__nv_bfloat16>(acc.z, acc.w))
              : make_uint2(PackFloat2<__half>(acc.x, acc.y), PackFloat2<__half>(acc.z, acc.w));
    } else {
      *reinterpret_cast<uint2*>(o_row + d) =
          make_uint2(PackFloat2<Elem>(acc.x, acc.y), PackFloat2<Elem>(acc.z, acc.w));
    }
  }
  if (tid % threads_per_row == 0) {
    if (write_partial) {
      args.lse_partial[part] = lse;
    } else {
      p.lse[lse_index] = lse;
    }
  }
}

template <typename Elem, int kHeadDim, int kMTiles, bool kSmallSmem = false,
          typename Cache = Elem>
cudaError_t LaunchDecodeFor(const FwdArgs& args, cudaStream_t stream) {
  using Tr = DecodeTraits<kHeadDim, kMTiles, kSmallSmem>;
  const auto kernel = &DecodeKernel<Elem, kHeadDim, kMTiles, kSmallSmem, Cache>;
  constexpr int kSmemBytes = DecodeSmemBytes(Tr::kTile, kMTiles);
  static std::atomic<uint64_t> opted_in{0};
  const cudaError_t err =
      OptInSharedMemoryOnce(reinterpret_cast<const void*>(kernel), opted_in, kSmemBytes);
  if (err != cudaSuccess) return err;
  const dim3 grid(args.num_splits, static_cast<unsigned>(args.p.batch),
                  static_cast<unsigned>(args.p.num_heads_kv));
  return LaunchWithFwdArgs(kernel, grid, dim3(kDecodeWarps * 32), kSmemBytes, stream, args);
}

// The kernel of a tile row (bucket, m_tiles, small_smem): Elem the mma type,
// Cache the K/V element (Elem, or int8 / e4m3 with Elem __half).
template <typename Elem, typename Cache>
cudaError_t LaunchDecodeRow(const FwdArgs& args, int bucket, int m_tiles, bool small_smem,
                            cudaStream_t stream) {
  if (small_smem) {
    switch (bucket * 10 + m_tiles) {
      case 1281: return LaunchDecodeFor<Elem, 128, 1, true, Cache>(args, stream);
      default: return cudaErrorInvalidValue;
    }
  }
  switch (bucket * 10 + m_tiles) {
    case 641: return LaunchDecodeFor<Elem, 64, 1, false, Cache>(args, stream);
    case 642: return LaunchDecodeFor<Elem, 64, 2, false, Cache>(args, stream);
    case 1281: return LaunchDecodeFor<Elem, 128, 1, false, Cache>(args, stream);
    case 1282: return LaunchDecodeFor<Elem, 128, 2, false, Cache>(args, stream);
    case 2561: return LaunchDecodeFor<Elem, 256, 1, false, Cache>(args, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

template <typename Elem>
cudaError_t LaunchDecodeKernel(const FwdArgs& args, int bucket, int m_tiles, bool small_smem,
                               cudaStream_t stream) {
  return LaunchDecodeRow<Elem, Elem>(args, bucket, m_tiles, small_smem, stream);
}

// Quantized caches: the float16 kernels for every q dtype (see DecodeKernel).
cudaError_t LaunchQuantizedDecodeKernel(const FwdArgs& args, int bucket, int m_tiles,
                                        bool small_smem, cudaStream_t stream) {
  switch (args.p.kv_quant) {
    case KvQuant::kInt8:
      return LaunchDecodeRow<__half, int8_t>(args, bucket, m_tiles, small_smem, stream);
    case KvQuant::kFloat8E4M3:
      return LaunchDecodeRow<__half, __nv_fp8_e4m3>(args, bucket, m_tiles, small_smem, stream);
    default: return cudaErrorInvalidValue;
  }
}

template cudaError_t LaunchDecodeKernel<__half>(const FwdArgs&, int, int, bool, cudaStream_t);
template cudaError_t LaunchDecodeKernel<__nv_bfloat16>(const FwdArgs&, int, int, bool,
                                                       cudaStream_t);

}  // namespace jax_flash2::cuda
