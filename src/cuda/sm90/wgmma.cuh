// wgmma.mma_async wrappers for the shapes the sm90 kernels use (fp32
// accumulators, bf16/fp16 inputs). The operand lists are long but mechanical:
// the N/2 accumulators of m64nNk16 are %0..%(N/2-1), then the inputs. They are
// spelled once per N (the JF2_WGMMA_* macros) and instantiated for both input
// types, which differ only in the instruction's type suffix.
//
//   Wgmma<Elem, N>::SS: D(64xN) (+)= A(64x16, smem desc, K-major) * B(16xN, smem desc, K-major)
//   Wgmma<Elem, N>::RS: D(64xN) (+)= A(64x16, registers)          * B(16xN, smem desc, MN-major)
//   Wgmma<Elem, 64>::SSMN: D(64x64) (+)= A(64x16, smem desc, MN-major) * B(16x64, smem desc,
//                          MN-major): the backward's dQ = dS K, with dS read from the
//                          dS^T tile ([key][query], queries contiguous) and K from [key][D].
//
// scale_d == 0 overwrites D (D = A * B), else accumulates. The immediates are
// scale-a = scale-b = 1 (no negation); the SS form has both operands K-major
// (trans 0, 0); the RS form's B is MN-major (trans-b 1): V is stored [key][D]
// with D contiguous, and D is the N dimension of O = P V.
//
// Accumulator fragment (per warp w of the warpgroup, g = lane / 4, t = lane % 4):
//   d[4 * j + 0, 1] -> row 16 w + g,     cols 8 j + 2 t, +1
//   d[4 * j + 2, 3] -> row 16 w + g + 8, cols 8 j + 2 t, +1
// Register A fragment (4 x b32 of two elements, k16 wide): a[0] (g, 2t..), a[1]
// (g+8, 2t..), a[2] (g, 2t+8..), a[3] (g+8, 2t+8..): the mma.sync m16n8k16
// layout per warp, so two adjacent n8 tiles of S become one k16 slice of P.
//
// The accumulators are only valid after WgmmaWait; see primitives.cuh
// (WgmmaFenceOperands) for how they are kept in place meanwhile.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "primitives.cuh"  // DescAdd

namespace jax_flash2::cuda::sm90 {

template <typename Elem, int N>
struct Wgmma;

// The accumulators of m64n64k16 (32), m64n80k16 (40), m64n128k16 (64),
// m64n176k16 (88) and m64n256k16 (128): the register list of the
// instruction and its asm operands, built from runs so that the longer lists
// extend the shorter ones.
#define JF2_WGMMA_REGS_0_31                                                                    \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define JF2_WGMMA_REGS_32_39 "%32, %33, %34, %35, %36, %37, %38, %39"
#define JF2_WGMMA_REGS_40_63                                                                  \
  "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, " \
  "%58, %59, %60, %61, %62, %63"
#define JF2_WGMMA_REGS_64_87                                                                  \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, " \
  "%82, %83, %84, %85, %86, %87"
#define JF2_WGMMA_REGS_88_127                                                                  \
  "%88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, " \
  "%105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, " \
  "%120, %121, %122, %123, %124, %125, %126, %127"
#define JF2_WGMMA_REGS_0_39 JF2_WGMMA_REGS_0_31 ", " JF2_WGMMA_REGS_32_39
#define JF2_WGMMA_REGS_0_63 JF2_WGMMA_REGS_0_39 ", " JF2_WGMMA_REGS_40_63
#define JF2_WGMMA_REGS_0_87 JF2_WGMMA_REGS_0_63 ", " JF2_WGMMA_REGS_64_87
#define JF2_WGMMA_D32 "{" JF2_WGMMA_REGS_0_31 "}"
#define JF2_WGMMA_D40 "{" JF2_WGMMA_REGS_0_39 "}"
#define JF2_WGMMA_D64 "{" JF2_WGMMA_REGS_0_63 "}"
#define JF2_WGMMA_D88 "{" JF2_WGMMA_REGS_0_87 "}"
#define JF2_WGMMA_D128 "{" JF2_WGMMA_REGS_0_87 ", " JF2_WGMMA_REGS_88_127 "}"
// Eight read-write accumulator operands d[i] .. d[i + 7].
#define JF2_WGMMA_ACC8(i)                                                                   \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define JF2_WGMMA_D32_OPERANDS \
  JF2_WGMMA_ACC8(0), JF2_WGMMA_ACC8(8), JF2_WGMMA_ACC8(16), JF2_WGMMA_ACC8(24)
#define JF2_WGMMA_D40_OPERANDS JF2_WGMMA_D32_OPERANDS, JF2_WGMMA_ACC8(32)
#define JF2_WGMMA_D64_OPERANDS \
  JF2_WGMMA_D40_OPERANDS, JF2_WGMMA_ACC8(40), JF2_WGMMA_ACC8(48), JF2_WGMMA_ACC8(56)
#define JF2_WGMMA_D88_OPERANDS \
  JF2_WGMMA_D64_OPERANDS, JF2_WGMMA_ACC8(64), JF2_WGMMA_ACC8(72), JF2_WGMMA_ACC8(80)
#define JF2_WGMMA_D128_OPERANDS                                                          \
  JF2_WGMMA_D88_OPERANDS, JF2_WGMMA_ACC8(88), JF2_WGMMA_ACC8(96), JF2_WGMMA_ACC8(104), \
      JF2_WGMMA_ACC8(112), JF2_WGMMA_ACC8(120)

// One wgmma wrapper, a static member of Wgmma<ELEM, N>. SHAPE: "m64nNk16";
// PTX: the type suffix, "bf16.bf16" or "f16.f16"; ACC: the accumulator
// count N / 2, D / D_OPERANDS its register list and operands (above); then
// the numbers of the operands that follow them, as text. SS: both operands
// from shared memory, AB = "%desc_a, %desc_b", TRANS = the two transpose
// immediates (0: K-major). RS: A from registers, A = "{%a0, %a1, %a2, %a3}",
// B = "%desc_b", B MN-major.
#define JF2_WGMMA_SS_FN(NAME, SHAPE, PTX, ACC, D, D_OPERANDS, AB, SCALE, TRANS)                 \
  static __device__ __forceinline__ void NAME(float(&d)[ACC], uint64_t desc_a, uint64_t desc_b, \
                                              int scale_d) {                                    \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE ", 0;\n"                              \
                 "wgmma.mma_async.sync.aligned." SHAPE ".f32." PTX " " D ", " AB ", p, 1, 1, "    \
                 TRANS ";\n}\n"                                                                  \
                 : D_OPERANDS                                                                   \
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d));                                     \
  }
#define JF2_WGMMA_RS_FN(SHAPE, PTX, ACC, D, D_OPERANDS, A, B, SCALE)                            \
  static __device__ __forceinline__ void RS(float(&d)[ACC], const uint32_t(&a)[4],              \
                                            uint64_t desc_b, int scale_d) {                     \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE ", 0;\n"                              \
                 "wgmma.mma_async.sync.aligned." SHAPE ".f32." PTX " " D ", " A ", " B            \
                 ", p, 1, 1, 1;\n}\n"                                                            \
                 : D_OPERANDS                                                                   \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));      \
  }

// N = 64: operands after the 32 accumulators: SS / SSMN desc_a %32, desc_b
// %33, scale_d %34; RS a %32-%35, desc_b %36, scale_d %37.
#define JF2_WGMMA_N64(ELEM, PTX)                                                     \
  template <>                                                                        \
  struct Wgmma<ELEM, 64> {                                                           \
    JF2_WGMMA_SS_FN(SSMN, "m64n64k16", PTX, 32, JF2_WGMMA_D32, JF2_WGMMA_D32_OPERANDS, \
                    "%32, %33", "%34", "1, 1")                                       \
    JF2_WGMMA_SS_FN(SS, "m64n64k16", PTX, 32, JF2_WGMMA_D32, JF2_WGMMA_D32_OPERANDS,   \
                    "%32, %33", "%34", "0, 0")                                       \
    JF2_WGMMA_RS_FN("m64n64k16", PTX, 32, JF2_WGMMA_D32, JF2_WGMMA_D32_OPERANDS,       \
                    "{%32, %33, %34, %35}", "%36", "%37")                            \
  };

// N = 128: operands after the 64 accumulators: SS desc_a %64, desc_b %65,
// scale_d %66; RS a %64-%67, desc_b %68, scale_d %69.
#define JF2_WGMMA_N128(ELEM, PTX)                                                   \
  template <>                                                                       \
  struct Wgmma<ELEM, 128> {                                                         \
    JF2_WGMMA_SS_FN(SS, "m64n128k16", PTX, 64, JF2_WGMMA_D64, JF2_WGMMA_D64_OPERANDS, \
                    "%64, %65", "%66", "0, 0")                                      \
    JF2_WGMMA_RS_FN("m64n128k16", PTX, 64, JF2_WGMMA_D64, JF2_WGMMA_D64_OPERANDS,     \
                    "{%64, %65, %66, %67}", "%68", "%69")                           \
  };

// N = 176 (the forward's S = Q K^T at D = 128 without a mask; SS only):
// operands after the 88 accumulators: desc_a %88, desc_b %89, scale_d %90.
#define JF2_WGMMA_N176(ELEM, PTX)                                                   \
  template <>                                                                       \
  struct Wgmma<ELEM, 176> {                                                         \
    JF2_WGMMA_SS_FN(SS, "m64n176k16", PTX, 88, JF2_WGMMA_D88, JF2_WGMMA_D88_OPERANDS, \
                    "%88, %89", "%90", "0, 0")                                      \
  };

// N = 80 (the forward's S = Q K^T at D = 256; SS only): operands after the
// 40 accumulators: desc_a %40, desc_b %41, scale_d %42.
#define JF2_WGMMA_N80(ELEM, PTX)                                                   \
  template <>                                                                      \
  struct Wgmma<ELEM, 80> {                                                         \
    JF2_WGMMA_SS_FN(SS, "m64n80k16", PTX, 40, JF2_WGMMA_D40, JF2_WGMMA_D40_OPERANDS, \
                    "%40, %41", "%42", "0, 0")                                     \
  };

// N = 256 (the forward's O += P V at D = 256; RS only): operands after the
// 128 accumulators: a %128-%131, desc_b %132, scale_d %133.
#define JF2_WGMMA_N256(ELEM, PTX)                                                     \
  template <>                                                                         \
  struct Wgmma<ELEM, 256> {                                                           \
    JF2_WGMMA_RS_FN("m64n256k16", PTX, 128, JF2_WGMMA_D128, JF2_WGMMA_D128_OPERANDS,    \
                    "{%128, %129, %130, %131}", "%132", "%133")                       \
  };

JF2_WGMMA_N64(__nv_bfloat16, "bf16.bf16")
JF2_WGMMA_N64(__half, "f16.f16")
JF2_WGMMA_N128(__nv_bfloat16, "bf16.bf16")
JF2_WGMMA_N128(__half, "f16.f16")
JF2_WGMMA_N176(__nv_bfloat16, "bf16.bf16")
JF2_WGMMA_N176(__half, "f16.f16")
JF2_WGMMA_N80(__nv_bfloat16, "bf16.bf16")
JF2_WGMMA_N80(__half, "f16.f16")
JF2_WGMMA_N256(__nv_bfloat16, "bf16.bf16")
JF2_WGMMA_N256(__half, "f16.f16")

// acc (+)= A B^T over kDepth elements, both operands K-major in 128-byte
// swizzled panels of 64 elements, a_panel_bytes and b_panel_bytes apart:
// kDepth / 16 SS steps, the first overwriting acc; the caller commits. The
// forward's S = Q K^T and the backward's S^T = K Q^T and dP^T = V dO^T.
template <typename Elem, int N, int kDepth>
__device__ __forceinline__ void WgmmaSSOverPanels(float (&acc)[N / 2], uint64_t desc_a,
                                                  uint32_t a_panel_bytes, uint64_t desc_b,
                                                  uint32_t b_panel_bytes) {
#pragma unroll
  for (int ks = 0; ks < kDepth / 16; ++ks) {
    // k16 step ks: panel ks / 4, 32 bytes per step inside a 128-byte row.
    const uint32_t k_off = (ks % 4) * 32;
    Wgmma<Elem, N>::SS(acc, DescAdd(desc_a, (ks / 4) * a_panel_bytes + k_off),
                       DescAdd(desc_b, (ks / 4) * b_panel_bytes + k_off), ks > 0);
  }
}

#undef JF2_WGMMA_N64
#undef JF2_WGMMA_N80
#undef JF2_WGMMA_N128
#undef JF2_WGMMA_N176
#undef JF2_WGMMA_N256
#undef JF2_WGMMA_SS_FN
#undef JF2_WGMMA_RS_FN
#undef JF2_WGMMA_D32
#undef JF2_WGMMA_D32_OPERANDS
#undef JF2_WGMMA_D40
#undef JF2_WGMMA_D40_OPERANDS
#undef JF2_WGMMA_D64
#undef JF2_WGMMA_D64_OPERANDS
#undef JF2_WGMMA_D88
#undef JF2_WGMMA_D88_OPERANDS
#undef JF2_WGMMA_D128
#undef JF2_WGMMA_D128_OPERANDS
#undef JF2_WGMMA_REGS_0_31
#undef JF2_WGMMA_REGS_32_39
#undef JF2_WGMMA_REGS_40_63
#undef JF2_WGMMA_REGS_64_87
#undef JF2_WGMMA_REGS_88_127
#undef JF2_WGMMA_REGS_0_39
#undef JF2_WGMMA_REGS_0_63
#undef JF2_WGMMA_REGS_0_87
#undef JF2_WGMMA_ACC8

}  // namespace jax_flash2::cuda::sm90
