// How a group's optimizer state is stored (the dtype of its master and of its moments, and how values
// are rounded into bf16), and the deterministic rounding itself. Plain integer arithmetic with no
// dependencies, compiled for the host and by nvcc for the device, so every Adam path (scalar, AVX2,
// AVX-512, the host backend, the CUDA kernel) rounds to the same bits.
//
// Round to nearest even is ferry/dtype.h's F32ToBF16. Stochastic rounding adds 16 random bits below the
// bf16 mantissa and truncates: a value is rounded up with probability (its distance to the bf16 below)
// / (the bf16 spacing), so the rounding is unbiased and small updates are not lost on average. The
// random bits come from a counter-based hash of (seed, param identity, optimizer step, master or moments,
// GLOBAL element index): nothing of the thread split, the pipeline's chunks, the world size or the
// placement enters, so any split of the same tensors rounds identically.
#ifndef FERRY_BASE_ADAM_STATE_H_
#define FERRY_BASE_ADAM_STATE_H_

#include <cstddef>
#include <cstdint>

#include "ferry/dtype.h"

#if defined(__CUDACC__)
#define FERRY_STATE_HD __host__ __device__ __forceinline__
#else
#define FERRY_STATE_HD inline
#endif

namespace ferry {

// How fp32 values are rounded into bf16 state.
enum class StateRounding : uint8_t {
  kNearest = 0,     // round to nearest even (F32ToBF16)
  kStochastic = 1,  // unbiased, from the counter-based hash below
};

// The storage of one group's state. master: kF32, or kBF16 for bf16 params; moments: kF32 or kBF16.
struct StateFormat {
  DType master = DType::kF32;
  DType moments = DType::kF32;
  StateRounding rounding = StateRounding::kNearest;  // used only where a dtype is bf16

  FERRY_STATE_HD bool all_f32() const { return master == DType::kF32 && moments == DType::kF32; }
  FERRY_STATE_HD bool stochastic() const { return rounding == StateRounding::kStochastic && !all_f32(); }
  // Bytes of state per element: master + m + v (12 fp32, 8 with bf16 moments, 6 all bf16).
  FERRY_STATE_HD size_t bytes_per_element() const {
    return (master == DType::kF32 ? 4 : 2) + 2 * (moments == DType::kF32 ? 4 : 2);
  }
  friend bool operator==(const StateFormat& a, const StateFormat& b) {
    return a.master == b.master && a.moments == b.moments && a.rounding == b.rounding;
  }
  friend bool operator!=(const StateFormat& a, const StateFormat& b) { return !(a == b); }
};

// The streams of the rounding hash: one for the master, one for both moments (m rounds with the low
// 16 bits of an element's random word, v with the high 16 bits: one hash per element serves both).
inline constexpr int kRoundMaster = 0;
inline constexpr int kRoundMoments = 1;

// ---- the counter-based generator -------------------------------------------------------------------

// A 32-bit bijective mixer (lowbias32: two multiplications, three xor-shifts).
FERRY_STATE_HD uint32_t RoundingMix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// A 64-bit bijective mixer (splitmix64's finalizer).
FERRY_STATE_HD uint64_t RoundingMix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

// The identity of a param in the hash: FNV-1a of its name (the same on every rank and in every run).
inline uint64_t RoundingParamId(const char* name, size_t len) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < len; ++i) {
    h ^= static_cast<unsigned char>(name[i]);
    h *= 0x100000001b3ull;
  }
  return h;
}

// The key of one param's state at optimizer step `step` (1-based: the step being computed).
FERRY_STATE_HD uint64_t RoundingTensorKey(uint64_t seed, uint64_t param_id, int64_t step) {
  return RoundingMix64(RoundingMix64(seed ^ 0x9e3779b97f4a7c15ull) ^ RoundingMix64(param_id + 0x632be59bd9b4e019ull) ^
                       RoundingMix64(static_cast<uint64_t>(step) * 0xd1b54a32d192ed03ull));
}

// The 32-bit key of stream `kind` (kRoundMaster, kRoundMoments) for the global elements whose index
// has high word `hi` (index >> 32); kernels compute it once per stretch of 2^32 elements.
FERRY_STATE_HD uint32_t RoundingKindKey(uint64_t tensor_key, int kind, uint32_t hi) {
  return static_cast<uint32_t>(
      RoundingMix64(tensor_key ^ (((static_cast<uint64_t>(hi) << 2) | static_cast<uint64_t>(kind)) * 0x9e3779b97f4a7c15ull)) >>
      32);
}

// The random word of global element (hi << 32 | lo) under its stream's key: a master takes its low
// 16 bits; m the low and v the high 16 bits of the moments' word.
FERRY_STATE_HD uint32_t RoundingBits(uint32_t kind_key, uint32_t lo) { return RoundingMix32(lo ^ kind_key); }

// fp32 -> bf16, stochastically with the low 16 bits of `bits`: NaN as F32ToBF16 (quiet, sign and top
// payload kept); values exactly representable stay exact; otherwise the magnitude is rounded up with
// probability (dropped bits) / 2^16. Finite values above the largest bf16 may round to infinity.
FERRY_STATE_HD uint16_t F32ToBF16Stochastic(float f, uint32_t bits) {
  const uint32_t u = F32Bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  return static_cast<uint16_t>((u + (bits & 0xffffu)) >> 16);
}

// Stores `v` as element k of state `base` of dtype `t` (kF32 or kBF16) with `rounding`; `bits` are
// the element's random bits (ignored unless stochastic bf16).
FERRY_STATE_HD void StoreState(void* base, DType t, size_t k, float v, StateRounding rounding, uint32_t bits) {
  if (t == DType::kF32) {
    static_cast<float*>(base)[k] = v;
  } else if (rounding == StateRounding::kStochastic) {
    static_cast<uint16_t*>(base)[k] = F32ToBF16Stochastic(v, bits);
  } else {
    static_cast<uint16_t*>(base)[k] = F32ToBF16(v);
  }
}

// The per-step rounding inputs of one tensor range: the tensor key and the global index of the
// range's element 0 (shard_begin plus the range's offset within the local shard).
struct StateRoundingKey {
  uint64_t tensor_key = 0;
  int64_t index0 = 0;
};

// The stream keys of global elements with high word `hi`.
struct StateKindKeys {
  uint32_t master, moments;
};
FERRY_STATE_HD StateKindKeys KindKeysFor(uint64_t tensor_key, uint32_t hi) {
  return StateKindKeys{RoundingKindKey(tensor_key, kRoundMaster, hi), RoundingKindKey(tensor_key, kRoundMoments, hi)};
}

}  // namespace ferry

#endif  // FERRY_BASE_ADAM_STATE_H_
