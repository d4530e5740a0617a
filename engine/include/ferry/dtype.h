// Element types of parameters, gradients and optimizer state, and exact conversions between them.
//
// Conversions to the 16-bit types round to nearest, ties to even; NaN stays NaN (quiet, sign kept),
// infinities and signed zeros are kept, values past the largest finite number become infinity, and
// subnormals of the target type are produced and read exactly. All functions are pure and
// thread-safe; they are also usable from CUDA device code.
#ifndef FERRY_DTYPE_H_
#define FERRY_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "absl/status/statusor.h"

#if defined(__CUDACC__)
#define FERRY_HD __host__ __device__ __forceinline__
#else
#define FERRY_HD inline
#endif

namespace ferry {

enum class DType : uint8_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

// Bytes per element: 4 for kF32, 2 for kBF16 and kF16.
constexpr size_t DTypeSize(DType t) { return t == DType::kF32 ? 4 : 2; }

// "f32", "bf16", "f16".
std::string_view DTypeName(DType t);
// The safetensors spelling: "F32", "BF16", "F16".
std::string_view DTypeSafetensorsName(DType t);
// Parses either spelling (case-insensitive, also "float32", "bfloat16", "float16").
absl::StatusOr<DType> ParseDType(std::string_view name);

FERRY_HD uint32_t F32Bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
FERRY_HD float F32FromBits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// bfloat16: the top 16 bits of an IEEE float32.
FERRY_HD uint16_t F32ToBF16(float f) {
  uint32_t u = F32Bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;  // round to nearest even; overflow carries into the exponent -> inf
  return static_cast<uint16_t>(u >> 16);
}
FERRY_HD float BF16ToF32(uint16_t h) { return F32FromBits(static_cast<uint32_t>(h) << 16); }

// IEEE binary16.
FERRY_HD uint16_t F32ToF16(float f) {
  uint32_t u = F32Bits(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // NaN
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds past 65504 -> inf
  if (a < 0x38800000u) {
    // Result is subnormal (or zero) in f16: value = a_float / 2^-24 rounded to an integer.
    if (a < 0x33000000u) return static_cast<uint16_t>(sign);  // below half the smallest subnormal
    uint32_t exp = a >> 23;
    uint32_t mant = (a & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - exp;  // 14..24 bits dropped (exp in [102, 112])
    uint32_t kept = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (kept & 1u))) ++kept;
    return static_cast<uint16_t>(sign | kept);
  }
  // Normal: rebias exponent (127 -> 15) and round the mantissa from 23 to 10 bits.
  uint32_t r = a - 0x38000000u;  // exponent rebias by 112
  uint32_t lsb = (r >> 13) & 1u;
  r += 0xfffu + lsb;
  return static_cast<uint16_t>(sign | (r >> 13));
}
FERRY_HD float F16ToF32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return F32FromBits(sign | 0x7f800000u | (mant << 13));  // inf / NaN
  if (exp == 0) {
    if (mant == 0) return F32FromBits(sign);
    // Subnormal: normalise.
    uint32_t e = 113;  // 127 - 15 + 1
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --e;
    }
    mant &= 0x3ffu;
    return F32FromBits(sign | (e << 23) | (mant << 13));
  }
  return F32FromBits(sign | ((exp + 112u) << 23) | (mant << 13));
}

// Reads element i of a buffer of type `t` as float32 (exact for every type).
FERRY_HD float LoadAsF32(const void* base, DType t, size_t i) {
  switch (t) {
    case DType::kF32: return static_cast<const float*>(base)[i];
    case DType::kBF16: return BF16ToF32(static_cast<const uint16_t*>(base)[i]);
    default: return F16ToF32(static_cast<const uint16_t*>(base)[i]);
  }
}
// Writes `v` rounded to nearest-even into element i of a buffer of type `t`.
FERRY_HD void StoreFromF32(void* base, DType t, size_t i, float v) {
  switch (t) {
    case DType::kF32: static_cast<float*>(base)[i] = v; break;
    case DType::kBF16: static_cast<uint16_t*>(base)[i] = F32ToBF16(v); break;
    default: static_cast<uint16_t*>(base)[i] = F32ToF16(v); break;
  }
}

}  // namespace ferry

#endif  // FERRY_DTYPE_H_
