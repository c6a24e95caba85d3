// float16 / bfloat16 <-> float32 on the CPU, portable (no F16C needed). The
// kernels compute in float32 and convert whole rows on load and store.
#pragma once

#include <cstdint>
#include <cmath>
#include <cstring>
#include <limits>

#include "../flash_params.h"

namespace jax_flash2::cpu {

inline float BFloat16ToFloat(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t FloatToBFloat16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  uint32_t u;
  if (exponent == 0x1f) {
    u = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    u = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    u = sign;
  } else {  // subnormal: renormalize
    exponent = 113;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    u = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t FloatToHalf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (abs < 0x38800000u) {                                               // subnormal or zero
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);
    const uint32_t exponent = abs >> 23;
    const uint32_t mantissa = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exponent;  // 14..24
    uint32_t h = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1);
    const uint32_t half_way = 1u << (shift - 1);
    if (rest > half_way || (rest == half_way && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  uint32_t h = ((abs >> 13) - (112u << 10));
  const uint32_t rest = abs & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

// dst[0..n) = float(src[offset + i]) for a tensor of the given dtype.
inline void LoadRow(const void* base, DType dtype, int64_t offset, int64_t n, float* dst) {
  switch (dtype) {
    case DType::kFloat32:
      std::memcpy(dst, static_cast<const float*>(base) + offset, n * sizeof(float));
      break;
    case DType::kFloat16: {
      const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = HalfToFloat(src[i]);
      break;
    }
    case DType::kBFloat16: {
      const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = BFloat16ToFloat(src[i]);
      break;
    }
  }
}

// float8_e4m3fn (1 sign, 4 exponent bits of bias 7, 3 mantissa bits; no
// infinities, S.1111.111 is NaN) to float32, exactly.
inline float Float8E4M3ToFloat(uint8_t bits) {
  const int exponent = (bits >> 3) & 0xf;
  const int mantissa = bits & 0x7;
  float magnitude;
  if (exponent == 0xf && mantissa == 0x7) {
    magnitude = std::numeric_limits<float>::quiet_NaN();
  } else if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -9);  // subnormal: m / 8 * 2^-6
  } else {
    magnitude = std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);
  }
  return (bits & 0x80) ? -magnitude : magnitude;
}

// dst[0..n) = scale * x for row `offset` of a KV-cache tensor: in the call's
// dtype, or quantized (int8, float8_e4m3fn) standing for x_q * scale.
inline void LoadKvRow(const void* base, DType dtype, KvQuant quant, int64_t offset, int64_t n,
                      float scale, float* dst) {
  switch (quant) {
    case KvQuant::kNone:
      LoadRow(base, dtype, offset, n, dst);
      if (scale != 1.0f)
        for (int64_t i = 0; i < n; ++i) dst[i] *= scale;
      break;
    case KvQuant::kInt8: {
      const int8_t* src = static_cast<const int8_t*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]) * scale;
      break;
    }
    case KvQuant::kFloat8E4M3: {
      const uint8_t* src = static_cast<const uint8_t*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = Float8E4M3ToFloat(src[i]) * scale;
      break;
    }
  }
}

inline void StoreRow(const float* src, int64_t n, void* base, DType dtype, int64_t offset) {
  switch (dtype) {
    case DType::kFloat32:
      std::memcpy(static_cast<float*>(base) + offset, src, n * sizeof(float));
      break;
    case DType::kFloat16: {
      uint16_t* dst = static_cast<uint16_t*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = FloatToHalf(src[i]);
      break;
    }
    case DType::kBFloat16: {
      uint16_t* dst = static_cast<uint16_t*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = FloatToBFloat16(src[i]);
      break;
    }
  }
}

}  // namespace jax_flash2::cpu
