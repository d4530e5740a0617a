// Tests of ferry/dtype.h: the bf16 and f16 conversions against a reference written here with double
// arithmetic (frexp / ldexp / floor, ties to even), exhaustively for 16 -> 32 bits and on edge cases
// plus tens of millions of random float32 patterns for 32 -> 16 bits; and the dtype names.
#include "ferry/dtype.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ferry {
namespace {

// A 16-bit IEEE-style binary format: sign, `exp_bits` exponent bits, `precision - 1` fraction bits.
struct Format16 {
  const char* name;
  int precision;  // significant bits, the implicit leading one included
  int exp_bits;
  int min_exp;    // exponent of the smallest normal number
  int max_exp;    // exponent of the largest finite number (also the exponent bias)
  uint16_t (*to16)(float);
  float (*from16)(uint16_t);
};

const Format16 kBF16 = {"bf16", 8, 8, -126, 127, &F32ToBF16, &BF16ToF32};
const Format16 kF16 = {"f16", 11, 5, -14, 15, &F32ToF16, &F16ToF32};

int FracBits(const Format16& f) { return f.precision - 1; }

double MaxFinite(const Format16& f) {
  return std::ldexp(2.0 - std::ldexp(1.0, 1 - f.precision), f.max_exp);
}

// The value a 16-bit pattern encodes, computed with double arithmetic (NaN for NaN patterns).
double RefDecode(const Format16& f, uint16_t bits) {
  const int frac_bits = FracBits(f);
  const uint32_t frac = bits & ((1u << frac_bits) - 1u);
  const uint32_t exp_field = (bits >> frac_bits) & ((1u << f.exp_bits) - 1u);
  double magnitude;
  if (exp_field == (1u << f.exp_bits) - 1u) {
    magnitude = frac == 0 ? std::numeric_limits<double>::infinity()
                          : std::numeric_limits<double>::quiet_NaN();
  } else if (exp_field == 0) {
    magnitude = std::ldexp(static_cast<double>(frac), f.min_exp - frac_bits);  // subnormal
  } else {
    magnitude = std::ldexp(static_cast<double>((1u << frac_bits) + frac),
                           static_cast<int>(exp_field) - f.max_exp - frac_bits);
  }
  return (bits & 0x8000u) ? -magnitude : magnitude;
}

// The number of format `f` nearest to `x` (not NaN), ties to the even significand. Rounding is done as
// if the exponent range were unbounded above: a result past the largest finite number is infinity
// (IEEE 754 overflow). Below the smallest normal, the quantum stays that of the smallest normal
// (gradual underflow).
double RefRound(const Format16& f, double x) {
  if (x == 0.0 || std::isinf(x)) return x;
  const double a = std::fabs(x);
  int e = 0;
  std::frexp(a, &e);  // a = m * 2^e with m in [0.5, 1): a's exponent is e - 1
  const int quantum_exp = std::max(e - 1, f.min_exp) - FracBits(f);
  const double scaled = std::ldexp(a, -quantum_exp);  // exact: x has 24 significant bits
  const double lower = std::floor(scaled);
  const double rest = scaled - lower;  // exact
  double n = lower;
  if (rest > 0.5 || (rest == 0.5 && std::fmod(lower, 2.0) == 1.0)) n = lower + 1.0;
  double r = std::ldexp(n, quantum_exp);
  if (r > MaxFinite(f)) r = std::numeric_limits<double>::infinity();
  return std::copysign(r, x);
}

bool SignBit(float x) { return (F32Bits(x) >> 31) != 0; }

// The quiet bit of a 16-bit NaN: the most significant fraction bit.
bool IsQuiet16(const Format16& f, uint16_t bits) { return (bits >> (FracBits(f) - 1)) & 1u; }

// True when f.to16(x) is what the header promises: the reference rounding for numbers; for NaN a
// quiet NaN of the same sign.
bool To16Matches(const Format16& f, float x, uint16_t got) {
  const double decoded = RefDecode(f, got);
  if (std::isnan(x)) {
    return std::isnan(decoded) && ((got & 0x8000u) != 0) == SignBit(x) && IsQuiet16(f, got);
  }
  const double want = RefRound(f, static_cast<double>(x));
  return !std::isnan(decoded) && decoded == want && std::signbit(decoded) == std::signbit(want);
}

std::string Describe(const Format16& f, float x, uint16_t got) {
  const double want = std::isnan(x) ? std::nan("") : RefRound(f, static_cast<double>(x));
  return absl::StrFormat("%s: x=%a (bits 0x%08x) got 0x%04x (= %a), reference %a", f.name, x,
                         F32Bits(x), got, RefDecode(f, got), want);
}

void PrintTo(const Format16& f, std::ostream* os) { *os << f.name; }

class DTypeConversion : public ::testing::TestWithParam<Format16> {};

// 16 -> 32 bits, exhaustively: every pattern reads as exactly the value it encodes, signed zeros and
// infinities included; NaN stays NaN with its sign and payload.
TEST_P(DTypeConversion, EveryPatternWidensExactly) {
  const Format16& f = GetParam();
  const int shift = 23 - FracBits(f);  // where the 16-bit fraction lands in the float32 fraction
  const uint32_t payload_mask = (1u << (FracBits(f) - 1)) - 1u;  // fraction bits below the quiet bit
  int failures = 0;
  for (uint32_t h = 0; h <= 0xffffu; ++h) {
    const uint16_t bits = static_cast<uint16_t>(h);
    const float got = f.from16(bits);
    const double want = RefDecode(f, bits);
    bool ok;
    if (std::isnan(want)) {
      ok = std::isnan(got) && SignBit(got) == ((bits & 0x8000u) != 0) &&
           ((F32Bits(got) >> shift) & payload_mask) == (bits & payload_mask);
    } else {
      ok = static_cast<double>(got) == want && SignBit(got) == std::signbit(want);
    }
    if (!ok && ++failures <= 10) {
      ADD_FAILURE() << absl::StrFormat("%s 0x%04x: got %a (bits 0x%08x), want %a", f.name, h, got,
                                       F32Bits(got), want);
    }
  }
  EXPECT_EQ(failures, 0);
}

// Narrowing a widened value gives the pattern back (NaN: a NaN of the same sign).
TEST_P(DTypeConversion, EveryPatternRoundTrips) {
  const Format16& f = GetParam();
  int failures = 0;
  for (uint32_t h = 0; h <= 0xffffu; ++h) {
    const uint16_t bits = static_cast<uint16_t>(h);
    const uint16_t back = f.to16(f.from16(bits));
    const bool ok = std::isnan(RefDecode(f, bits))
                        ? std::isnan(RefDecode(f, back)) && (back & 0x8000u) == (bits & 0x8000u)
                        : back == bits;
    if (!ok && ++failures <= 10) {
      ADD_FAILURE() << absl::StrFormat("%s 0x%04x came back as 0x%04x", f.name, h, back);
    }
  }
  EXPECT_EQ(failures, 0);
}

// The reference and the conversion agree on tens of millions of random float32 patterns: a third
// uniform over all patterns, a third with exponents in and around the target's range, a third within
// two ulps of a rounding tie of the target.
TEST_P(DTypeConversion, RandomFloatsNarrowLikeReference) {
  const Format16& f = GetParam();
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(absl::StrFormat("seed %u", seed));
  std::mt19937_64 rng(seed);
  const int drop = 23 - FracBits(f);  // float32 fraction bits that rounding drops
  const uint32_t tie = 1u << (drop - 1);
  // Biased float32 exponents from 12 below the smallest subnormal to 2 past the largest finite.
  const uint32_t exp_lo = static_cast<uint32_t>(std::max(1, 127 + f.min_exp - FracBits(f) - 12));
  const uint32_t exp_hi = static_cast<uint32_t>(std::min(254, 127 + f.max_exp + 2));
  std::uniform_int_distribution<uint32_t> exp_dist(exp_lo, exp_hi);
  constexpr int64_t kSamples = int64_t{15} << 20;  // per format; both formats: ~31 million
  int64_t failures = 0;
  for (int64_t i = 0; i < kSamples; ++i) {
    const uint64_t r = rng();
    uint32_t bits = static_cast<uint32_t>(r);
    const uint32_t sign = bits & 0x80000000u;
    switch (i % 3) {
      case 0: break;
      case 1: bits = sign | (exp_dist(rng) << 23) | (bits & 0x7fffffu); break;
      default: {
        uint32_t near_tie = sign | (exp_dist(rng) << 23) | (bits & 0x7fffffu & ~((tie << 1) - 1u)) | tie;
        near_tie += static_cast<uint32_t>(static_cast<int>((r >> 32) % 5) - 2);
        bits = near_tie;
        break;
      }
    }
    const float x = F32FromBits(bits);
    const uint16_t got = f.to16(x);
    if (!To16Matches(f, x, got) && ++failures <= 10) ADD_FAILURE() << Describe(f, x, got);
  }
  EXPECT_EQ(failures, 0) << "of " << kSamples;
}

INSTANTIATE_TEST_SUITE_P(Formats, DTypeConversion, ::testing::Values(kBF16, kF16),
                         [](const ::testing::TestParamInfo<Format16>& param_info) {
                           return std::string(param_info.param.name);
                         });

struct EdgeCase {
  uint32_t input_bits;  // float32
  uint16_t want;
  const char* what;
};

void CheckEdgeCases(const Format16& f, const std::vector<EdgeCase>& cases) {
  for (const EdgeCase& c : cases) {
    const float x = F32FromBits(c.input_bits);
    const uint16_t got = f.to16(x);
    EXPECT_EQ(got, c.want) << c.what << ": " << Describe(f, x, got);
    // The reference agrees with the hand-derived expectation, and so with the conversion.
    EXPECT_TRUE(To16Matches(f, x, c.want)) << c.what << " (reference disagrees)";
  }
}

void CheckNaNs(const Format16& f) {
  // Quiet and signalling NaNs, payloads in the high or only in the low bits (a low-only payload
  // must not be truncated into an infinity), both signs.
  for (uint32_t bits : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fa00000u, 0x7fbfffffu,
                        0xffffffffu, 0x7fc12345u, 0xff812345u, 0x7f801fffu}) {
    const float x = F32FromBits(bits);
    const uint16_t got = f.to16(x);
    EXPECT_TRUE(To16Matches(f, x, got)) << Describe(f, x, got);
    EXPECT_TRUE(std::isnan(f.from16(got))) << Describe(f, x, got);
  }
}

uint32_t Bits(float x) { return F32Bits(x); }

TEST(DTypeEdgeCases, F16) {
  const float kTie1 = 1.0f + std::ldexp(1.0f, -11);           // halfway between 1 and 1 + 2^-10
  const float kTie2 = 1.0f + 3.0f * std::ldexp(1.0f, -11);    // halfway between 1+2^-10 and 1+2^-9
  const float kSubTie = std::ldexp(1.0f, -25);                // halfway between 0 and 2^-24
  const float kTopSubTie = 1023.5f * std::ldexp(1.0f, -24);   // largest subnormal <-> smallest normal
  CheckEdgeCases(kF16, {
      {Bits(0.0f), 0x0000, "+0"},
      {Bits(-0.0f), 0x8000, "-0"},
      {Bits(INFINITY), 0x7c00, "+inf"},
      {Bits(-INFINITY), 0xfc00, "-inf"},
      {Bits(1.0f), 0x3c00, "1"},
      {Bits(0.1f), 0x2e66, "0.1"},
      {Bits(65504.0f), 0x7bff, "largest finite"},
      {Bits(-65504.0f), 0xfbff, "-largest finite"},
      {Bits(std::nextafter(65520.0f, 0.0f)), 0x7bff, "just below the overflow threshold"},
      {Bits(65520.0f), 0x7c00, "overflow threshold (a tie, rounds to even = 2^16 = inf)"},
      {Bits(-65520.0f), 0xfc00, "-overflow threshold"},
      {Bits(std::nextafter(65520.0f, INFINITY)), 0x7c00, "just above the overflow threshold"},
      {Bits(65536.0f), 0x7c00, "2^16"},
      {Bits(FLT_MAX), 0x7c00, "FLT_MAX"},
      {Bits(-FLT_MAX), 0xfc00, "-FLT_MAX"},
      {Bits(std::ldexp(1.0f, -14)), 0x0400, "smallest normal"},
      {Bits(std::nextafter(std::ldexp(1.0f, -14), 0.0f)), 0x0400, "just below the smallest normal"},
      {Bits(std::ldexp(1.0f, -24)), 0x0001, "smallest subnormal"},
      {Bits(-std::ldexp(1.0f, -24)), 0x8001, "-smallest subnormal"},
      {Bits(1023.0f * std::ldexp(1.0f, -24)), 0x03ff, "largest subnormal"},
      {Bits(kTopSubTie), 0x0400, "tie largest subnormal / smallest normal (to even: up)"},
      {Bits(std::nextafter(kTopSubTie, 0.0f)), 0x03ff, "just below that tie"},
      {Bits(kSubTie), 0x0000, "half the smallest subnormal (tie, to even: 0)"},
      {Bits(-kSubTie), 0x8000, "-half the smallest subnormal"},
      {Bits(std::nextafter(kSubTie, 1.0f)), 0x0001, "just above half the smallest subnormal"},
      {Bits(std::nextafter(kSubTie, 0.0f)), 0x0000, "just below half the smallest subnormal"},
      {Bits(3.0f * kSubTie), 0x0002, "tie 1 / 2 subnormal quanta (to even: up)"},
      {Bits(5.0f * kSubTie), 0x0002, "tie 2 / 3 subnormal quanta (to even: down)"},
      {Bits(std::nextafter(5.0f * kSubTie, 1.0f)), 0x0003, "just above the 2 / 3 tie"},
      {0x00000001u, 0x0000, "smallest float32 subnormal"},
      {0x80000001u, 0x8000, "-smallest float32 subnormal"},
      {Bits(kTie1), 0x3c00, "tie, to even: down"},
      {Bits(std::nextafter(kTie1, 2.0f)), 0x3c01, "just above a tie"},
      {Bits(kTie2), 0x3c02, "tie, to even: up"},
      {Bits(std::nextafter(kTie2, 0.0f)), 0x3c01, "just below a tie"},
      {Bits(-kTie2), 0xbc02, "negative tie, to even: away from zero"},
  });
  CheckNaNs(kF16);
}

TEST(DTypeEdgeCases, BF16) {
  CheckEdgeCases(kBF16, {
      {Bits(0.0f), 0x0000, "+0"},
      {Bits(-0.0f), 0x8000, "-0"},
      {Bits(INFINITY), 0x7f80, "+inf"},
      {Bits(-INFINITY), 0xff80, "-inf"},
      {Bits(1.0f), 0x3f80, "1"},
      {Bits(0.1f), 0x3dcd, "0.1"},
      {0x7f7f0000u, 0x7f7f, "largest finite"},
      {0x7f7f7fffu, 0x7f7f, "just below the overflow threshold"},
      {0x7f7f8000u, 0x7f80, "overflow threshold (a tie, rounds to even = 2^128 = inf)"},
      {0xff7f8000u, 0xff80, "-overflow threshold"},
      {0x7f7f8001u, 0x7f80, "just above the overflow threshold"},
      {Bits(FLT_MAX), 0x7f80, "FLT_MAX"},
      {0x7f7e8000u, 0x7f7e, "tie below the largest finite (to even: down)"},
      {0x00800000u, 0x0080, "smallest normal"},
      {0x007f8000u, 0x0080, "tie largest subnormal / smallest normal (to even: up)"},
      {0x007f7fffu, 0x007f, "just below that tie"},
      {0x00010000u, 0x0001, "smallest subnormal"},
      {0x80010000u, 0x8001, "-smallest subnormal"},
      {0x00008000u, 0x0000, "half the smallest subnormal (tie, to even: 0)"},
      {0x80008000u, 0x8000, "-half the smallest subnormal"},
      {0x00008001u, 0x0001, "just above half the smallest subnormal"},
      {0x00007fffu, 0x0000, "just below half the smallest subnormal"},
      {0x00018000u, 0x0002, "tie 1 / 2 subnormal quanta (to even: up)"},
      {0x00028000u, 0x0002, "tie 2 / 3 subnormal quanta (to even: down)"},
      {0x00000001u, 0x0000, "smallest float32 subnormal"},
      {0x3f808000u, 0x3f80, "tie, to even: down"},
      {0x3f808001u, 0x3f81, "just above a tie"},
      {0x3f807fffu, 0x3f80, "just below a tie"},
      {0x3f818000u, 0x3f82, "tie, to even: up"},
      {0x3f817fffu, 0x3f81, "just below a tie"},
      {0xbf818000u, 0xbf82, "negative tie, to even: away from zero"},
  });
  CheckNaNs(kBF16);
}

TEST(DType, SizesAndNames) {
  EXPECT_EQ(DTypeSize(DType::kF32), 4u);
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kF16), 2u);
  EXPECT_EQ(DTypeName(DType::kF32), "f32");
  EXPECT_EQ(DTypeName(DType::kBF16), "bf16");
  EXPECT_EQ(DTypeName(DType::kF16), "f16");
  EXPECT_EQ(DTypeSafetensorsName(DType::kF32), "F32");
  EXPECT_EQ(DTypeSafetensorsName(DType::kBF16), "BF16");
  EXPECT_EQ(DTypeSafetensorsName(DType::kF16), "F16");
}

TEST(DType, ParseAcceptsEverySpelling) {
  const std::vector<std::pair<std::string, DType>> cases = {
      {"f32", DType::kF32},     {"F32", DType::kF32},       {"float32", DType::kF32},
      {"Float32", DType::kF32}, {"fp32", DType::kF32},      {"bf16", DType::kBF16},
      {"BF16", DType::kBF16},   {"bfloat16", DType::kBF16}, {"BFloat16", DType::kBF16},
      {"f16", DType::kF16},     {"F16", DType::kF16},       {"float16", DType::kF16},
      {"FLOAT16", DType::kF16}, {"fp16", DType::kF16},      {"half", DType::kF16},
  };
  for (const auto& [name, want] : cases) {
    absl::StatusOr<DType> got = ParseDType(name);
    ASSERT_TRUE(got.ok()) << name << ": " << got.status();
    EXPECT_EQ(*got, want) << name;
  }
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    EXPECT_EQ(ParseDType(DTypeName(t)).value_or(DType::kF32), t);
    EXPECT_EQ(ParseDType(DTypeSafetensorsName(t)).value_or(DType::kF32), t);
  }
}

TEST(DType, ParseRejectsOthersAndSaysWhat) {
  for (const char* name : {"", "f64", "F64", "int8", "bf16 ", " f32", "bf-16", "float", "f 16"}) {
    absl::StatusOr<DType> got = ParseDType(name);
    ASSERT_FALSE(got.ok()) << "'" << name << "' parsed";
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_THAT(std::string(got.status().message()),
                ::testing::AllOf(::testing::HasSubstr(absl::StrFormat("'%s'", name)),
                                 ::testing::HasSubstr("bf16")))
        << name;
  }
}

// LoadAsF32 / StoreFromF32 dispatch on the dtype: f32 exactly, the 16-bit types through the
// conversions checked above.
TEST(DType, LoadAndStoreDispatchOnType) {
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> dist(0.0f, 100.0f);
  constexpr size_t kN = 257;
  std::vector<float> values(kN);
  for (float& v : values) v = dist(rng);
  std::vector<float> f32(kN);
  std::vector<uint16_t> bf16(kN, 0), f16(kN, 0);
  for (size_t i = 0; i < kN; ++i) {
    StoreFromF32(f32.data(), DType::kF32, i, values[i]);
    StoreFromF32(bf16.data(), DType::kBF16, i, values[i]);
    StoreFromF32(f16.data(), DType::kF16, i, values[i]);
  }
  for (size_t i = 0; i < kN; ++i) {
    EXPECT_EQ(F32Bits(LoadAsF32(f32.data(), DType::kF32, i)), F32Bits(values[i])) << i;
    EXPECT_EQ(bf16[i], F32ToBF16(values[i])) << i;
    EXPECT_EQ(f16[i], F32ToF16(values[i])) << i;
    EXPECT_EQ(F32Bits(LoadAsF32(bf16.data(), DType::kBF16, i)), F32Bits(BF16ToF32(bf16[i]))) << i;
    EXPECT_EQ(F32Bits(LoadAsF32(f16.data(), DType::kF16, i)), F32Bits(F16ToF32(f16[i]))) << i;
    // And the narrowed values are near the originals: at most half an ulp away (for f16, half the
    // subnormal quantum 2^-25 near zero).
    EXPECT_LE(std::fabs(BF16ToF32(bf16[i]) - values[i]), std::ldexp(std::fabs(values[i]), -8)) << i;
    EXPECT_LE(std::fabs(F16ToF32(f16[i]) - values[i]),
              std::max(std::ldexp(std::fabs(values[i]), -11), std::ldexp(1.0f, -25)))
        << i;
  }
}

}  // namespace
}  // namespace ferry
