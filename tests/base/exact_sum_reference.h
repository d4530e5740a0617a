// An independent reference for base/exact_sum.h, shared by the base, device and CPU Adam tests: a plain
// big integer (32-bit limbs, the lowest weighing 2^-320) with carries propagated on every addition, its
// correct rounding to double written bit by bit with ldexp, and the GradStats it implies.
#ifndef FERRY_TESTS_BASE_EXACT_SUM_REFERENCE_H_
#define FERRY_TESTS_BASE_EXACT_SUM_REFERENCE_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "base/adam_math.h"
#include "base/exact_sum.h"
#include "ferry/dtype.h"

namespace ferry {

__extension__ typedef unsigned __int128 RefU128;  // GCC/Clang; the reference only

struct RefBigSum {
  static constexpr int kLimbs = 24;  // 768 bits: room above the 640 of ExactSumSq
  std::vector<uint32_t> limb = std::vector<uint32_t>(kLimbs, 0);

  // Adds v * 2^(bit - 320), carrying through.
  void AddAt(RefU128 v, int bit) {
    int i = bit / 32;
    v <<= bit % 32;  // v < 2^64 before, so < 2^95 here
    RefU128 carry = 0;
    while (v != 0 || carry != 0) {
      const RefU128 t = static_cast<RefU128>(limb[static_cast<size_t>(i)]) +
                                  static_cast<uint32_t>(v) + carry;
      limb[static_cast<size_t>(i)] = static_cast<uint32_t>(t);
      carry = t >> 32;
      v >>= 32;
      ++i;
    }
  }

  // x * x for finite x: the float is M * 2^(e - 150) with e = max(biased exponent, 1).
  void AddSquare(float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    const int biased = static_cast<int>((bits >> 23) & 0xFF);
    const uint64_t m = (bits & 0x7FFFFF) | (biased != 0 ? 0x800000u : 0u);
    const int e = biased != 0 ? biased : 1;
    // x^2 = m^2 * 2^(2e - 300), and bit 0 weighs 2^-320.
    AddAt(static_cast<RefU128>(m) * m, 2 * e - 300 + 320);
  }

  void Add(const RefBigSum& o) {
    uint64_t carry = 0;
    for (int i = 0; i < kLimbs; ++i) {
      const uint64_t t = uint64_t{limb[static_cast<size_t>(i)]} + o.limb[static_cast<size_t>(i)] + carry;
      limb[static_cast<size_t>(i)] = static_cast<uint32_t>(t);
      carry = t >> 32;
    }
  }

  bool Bit(int b) const { return (limb[static_cast<size_t>(b / 32)] >> (b % 32)) & 1u; }

  // Round to nearest, ties to even, from the bits.
  double ToDouble() const {
    int top = kLimbs * 32 - 1;
    while (top >= 0 && !Bit(top)) --top;
    if (top < 0) return 0.0;
    uint64_t mantissa = 0;
    const int low = top - 52;  // the mantissa's lowest bit
    for (int b = top; b >= low; --b) mantissa = (mantissa << 1) | (b >= 0 && Bit(b) ? 1u : 0u);
    bool round = false, sticky = false;
    if (low - 1 >= 0) round = Bit(low - 1);
    for (int b = low - 2; b >= 0; --b) sticky = sticky || Bit(b);
    if (round && (sticky || (mantissa & 1u))) ++mantissa;  // 2^53 is still exact in double
    return std::ldexp(static_cast<double>(mantissa), low - 320);
  }

  // The normalised ExactSumSq with this value (the base-2^32 digits). REQUIRES: value < 2^640.
  ExactSumSq ToExact() const {
    ExactSumSq s{};
    for (int i = 0; i < ExactSumSq::kDigits; ++i) s.digit[i] = limb[static_cast<size_t>(i)];
    return s;
  }
};

// The GradStats every path must produce: the exact sum of the finite elements' squares, its rounding,
// +Inf and found_inf = 1 when some element is NaN or Inf.
inline GradStats RefGradStatsOf(const RefBigSum& sum, bool found_inf) {
  GradStats g;
  std::memset(&g, 0, sizeof(g));
  g.exact = sum.ToExact();
  g.found_inf = found_inf ? 1u : 0u;
  g.reserved = 0;
  g.sum_sq = found_inf ? std::numeric_limits<double>::infinity() : sum.ToDouble();
  return g;
}

// Adds elements [begin, end) of a host array; returns whether one was NaN or Inf.
inline bool RefAddRange(RefBigSum& sum, const void* grad, DType dtype, int64_t begin, int64_t end) {
  bool bad = false;
  for (int64_t i = begin; i < end; ++i) {
    const float x = LoadAsF32(grad, dtype, static_cast<size_t>(i));
    if (std::isfinite(x)) {
      sum.AddSquare(x);
    } else {
      bad = true;
    }
  }
  return bad;
}

inline bool SameGradStats(const GradStats& a, const GradStats& b) { return std::memcmp(&a, &b, sizeof(a)) == 0; }

}  // namespace ferry

#endif  // FERRY_TESTS_BASE_EXACT_SUM_REFERENCE_H_
