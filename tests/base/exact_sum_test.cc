// base/exact_sum.h and base/grad_squares.h: the exact sum of squares equals an independent big-integer
// reference (digits and correctly rounded double, ties included) on fresh random data of every dtype and
// magnitude; it is the same bytes under any permutation and any split into pieces merged by Add or by
// the exchange form (a sum of doubles); every accumulator (AddSquare, the buckets, the expansion) agrees;
// and it is within the rounding of a long double sum.
#include "base/exact_sum.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "base/exact_sum_reference.h"
#include "base/grad_squares.h"
#include "ferry/dtype.h"
#include "gtest/gtest.h"

namespace ferry {
namespace {

uint64_t FreshSeed() { return std::random_device{}(); }

ExactSumSq Normalized(ExactSumSq s) {
  s.Normalize();
  return s;
}

bool SameBytes(const ExactSumSq& a, const ExactSumSq& b) {
  const ExactSumSq na = Normalized(a), nb = Normalized(b);
  return std::memcmp(&na, &nb, sizeof(na)) == 0;
}

bool SameDouble(double a, double b) { return std::memcmp(&a, &b, 8) == 0; }

std::string Digits(const ExactSumSq& s) {
  const ExactSumSq n = Normalized(s);
  std::string out;
  for (int i = ExactSumSq::kDigits - 1; i >= 0; --i) out += absl::StrFormat("%08x ", n.digit[i]);
  return out;
}

enum class Magnitude { kDenormal, kTiny, kNormal, kHuge, kMixed };
constexpr Magnitude kMagnitudes[] = {Magnitude::kDenormal, Magnitude::kTiny, Magnitude::kNormal,
                                     Magnitude::kHuge, Magnitude::kMixed};
constexpr DType kTypes[] = {DType::kF32, DType::kBF16, DType::kF16};

const char* MagnitudeName(Magnitude m) {
  switch (m) {
    case Magnitude::kDenormal: return "denormal";
    case Magnitude::kTiny: return "tiny";
    case Magnitude::kNormal: return "normal";
    case Magnitude::kHuge: return "huge";
    case Magnitude::kMixed: return "mixed";
  }
  return "?";
}

// A random finite value of `dtype` (returned as the float it converts to, exactly) whose exponent field
// is drawn from the magnitude class: subnormals only; the lowest eighth of the normal exponents; around
// 1; the highest eighth (with the largest finite value now and then); or anything finite (and zeros).
float RandomValue(std::mt19937_64& rng, DType dtype, Magnitude mag) {
  const int exp_bits = dtype == DType::kF16 ? 5 : 8;
  const int man_bits = dtype == DType::kF32 ? 23 : dtype == DType::kBF16 ? 7 : 10;
  const int max_exp = (1 << exp_bits) - 2;  // largest finite exponent field
  const int bias = (1 << (exp_bits - 1)) - 1;
  const uint64_t r = rng();
  int e = 0;
  uint32_t man = static_cast<uint32_t>(r) & ((1u << man_bits) - 1);
  switch (mag) {
    case Magnitude::kDenormal: e = 0; break;
    case Magnitude::kTiny: e = 1 + static_cast<int>((r >> 32) % static_cast<uint64_t>(max_exp / 8)); break;
    case Magnitude::kNormal: e = bias - 10 + static_cast<int>((r >> 32) % 21); break;
    case Magnitude::kHuge:
      e = max_exp - static_cast<int>((r >> 32) % static_cast<uint64_t>(max_exp / 8));
      if ((r >> 40) % 16 == 0) {  // the largest finite value
        e = max_exp;
        man = (1u << man_bits) - 1;
      }
      break;
    case Magnitude::kMixed:
      e = static_cast<int>((r >> 32) % static_cast<uint64_t>(max_exp + 1));
      if ((r >> 40) % 64 == 0) e = man = 0;
      if ((r >> 40) % 64 == 1) {
        e = max_exp;
        man = (1u << man_bits) - 1;
      }
      break;
  }
  const uint32_t sign = (r >> 63) & 1u;
  const uint32_t bits = (sign << (exp_bits + man_bits)) | (static_cast<uint32_t>(e) << man_bits) | man;
  switch (dtype) {
    case DType::kF32: return F32FromBits(bits);
    case DType::kBF16: return BF16ToF32(static_cast<uint16_t>(bits));
    case DType::kF16: return F16ToF32(static_cast<uint16_t>(bits));
  }
  return 0.0f;
}

std::vector<float> RandomValues(std::mt19937_64& rng, DType dtype, Magnitude mag, size_t n) {
  std::vector<float> v(n);
  for (float& x : v) x = RandomValue(rng, dtype, mag);
  return v;
}

RefBigSum Reference(const std::vector<float>& xs) {
  RefBigSum r;
  for (float x : xs) r.AddSquare(x);
  return r;
}

enum class Method { kAddSquare, kBuckets, kExpansion };

ExactSumSq SumWith(Method method, const float* xs, size_t n) {
  ExactSumSq s{};
  switch (method) {
    case Method::kAddSquare:
      for (size_t i = 0; i < n; ++i) s.AddSquare(xs[i]);
      break;
    case Method::kBuckets: {
      GradSquareAccumulator acc;
      acc.Add(xs, DType::kF32, 0, static_cast<int64_t>(n));
      EXPECT_FALSE(acc.found_inf());
      s = acc.Sum();
      break;
    }
    case Method::kExpansion: {
      ExactSquareExpansion e;
      e.Clear();
      for (size_t i = 0; i < n; ++i) e.AddSquare(xs[i], s);
      e.FlushInto(s);
      break;
    }
  }
  return s;
}

// Every accumulator equals the reference digit for digit, ToDouble is the reference's correct rounding,
// and both are within rounding of a long double sum.
TEST(ExactSumTest, EqualsTheBigIntegerReferenceOnEveryDtypeAndMagnitude) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrFormat("seed %u", seed));
  std::mt19937_64 rng(seed);
  for (DType dt : kTypes) {
    for (Magnitude mag : kMagnitudes) {
      SCOPED_TRACE(absl::StrFormat("%s %s", DTypeName(dt), MagnitudeName(mag)));
      const std::vector<float> xs = RandomValues(rng, dt, mag, 20000);
      const RefBigSum ref = Reference(xs);
      const ExactSumSq want = ref.ToExact();
      const double want_double = ref.ToDouble();
      for (Method m : {Method::kAddSquare, Method::kBuckets, Method::kExpansion}) {
        const ExactSumSq got = SumWith(m, xs.data(), xs.size());
        EXPECT_TRUE(SameBytes(got, want)) << "method " << static_cast<int>(m) << "\n got " << Digits(got)
                                          << "\nwant " << Digits(want);
        EXPECT_TRUE(SameDouble(got.ToDouble(), want_double))
            << "method " << static_cast<int>(m) << ": " << got.ToDouble() << " vs " << want_double;
      }
      long double naive = 0;
      for (float x : xs) naive += static_cast<long double>(x) * x;
      EXPECT_GT(want_double, 0.0);
      EXPECT_LE(std::fabs(static_cast<long double>(want_double) - naive), 4e-15L * naive)
          << want_double << " vs long double " << static_cast<double>(naive);
    }
  }
}

// The raw dtype arrays through GradSquareAccumulator (its bf16 and f16 loaders), in ranges.
TEST(ExactSumTest, GradSquareAccumulatorReadsEveryDtype) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrFormat("seed %u", seed));
  std::mt19937_64 rng(seed);
  for (DType dt : kTypes) {
    for (Magnitude mag : kMagnitudes) {
      const std::vector<float> xs = RandomValues(rng, dt, mag, 5003);
      std::vector<uint8_t> raw(xs.size() * DTypeSize(dt));
      for (size_t i = 0; i < xs.size(); ++i) StoreFromF32(raw.data(), dt, i, xs[i]);
      GradSquareAccumulator acc;
      const int64_t n = static_cast<int64_t>(xs.size());
      acc.Add(raw.data(), dt, 0, 1);
      acc.Add(raw.data(), dt, 1, 1);  // empty
      acc.Add(raw.data(), dt, 1, n / 3);
      acc.Add(raw.data(), dt, n / 3, n);
      EXPECT_FALSE(acc.found_inf());
      EXPECT_TRUE(SameBytes(acc.Sum(), Reference(xs).ToExact())) << DTypeName(dt) << " " << MagnitudeName(mag);
    }
  }
}

// Any permutation and any split into 1..4 uneven pieces (some empty), each summed by a random method,
// merged by Add in a random order and by the exchange form (the element-wise sum of the pieces' doubles,
// as an all-reduce would compute it, in a random order), gives the same bytes and the same double.
TEST(ExactSumTest, PermutationsAndPartitionsGiveIdenticalBits) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrFormat("seed %u", seed));
  std::mt19937_64 rng(seed);
  for (DType dt : kTypes) {
    for (Magnitude mag : kMagnitudes) {
      SCOPED_TRACE(absl::StrFormat("%s %s", DTypeName(dt), MagnitudeName(mag)));
      std::vector<float> xs = RandomValues(rng, dt, mag, 3000 + rng() % 3000);
      const ExactSumSq want = Reference(xs).ToExact();
      const double want_double = want.ToDouble();
      for (int trial = 0; trial < 8; ++trial) {
        std::shuffle(xs.begin(), xs.end(), rng);
        const int pieces = 1 + static_cast<int>(rng() % 4);
        std::vector<size_t> cuts = {0, xs.size()};
        for (int p = 1; p < pieces; ++p) cuts.push_back(rng() % (xs.size() + 1));
        std::sort(cuts.begin(), cuts.end());
        std::vector<ExactSumSq> sums;
        for (size_t p = 0; p + 1 < cuts.size(); ++p) {
          const Method m = static_cast<Method>(rng() % 3);
          sums.push_back(SumWith(m, xs.data() + cuts[p], cuts[p + 1] - cuts[p]));
        }
        std::shuffle(sums.begin(), sums.end(), rng);
        ExactSumSq merged{};
        for (const ExactSumSq& s : sums) merged.Add(s);
        std::vector<double> exchange(ExactSumSq::kExchangeDoubles, 0.0);
        std::shuffle(sums.begin(), sums.end(), rng);
        for (const ExactSumSq& s : sums) {
          double out[ExactSumSq::kExchangeDoubles];
          s.ToExchange(out);
          for (int i = 0; i < ExactSumSq::kExchangeDoubles; ++i) {
            ASSERT_EQ(out[i], std::floor(out[i]));
            ASSERT_GE(out[i], 0.0);
            ASSERT_LT(out[i], 4294967296.0);
            exchange[static_cast<size_t>(i)] += out[i];
          }
        }
        const ExactSumSq exchanged = ExactSumSq::FromExchange(exchange.data());
        EXPECT_TRUE(SameBytes(merged, want)) << pieces << " pieces, merged by Add";
        EXPECT_TRUE(SameBytes(exchanged, want)) << pieces << " pieces, merged by exchange";
        const ExactSumSq normalized = Normalized(merged);
        EXPECT_EQ(std::memcmp(&exchanged, &normalized, sizeof(ExactSumSq)), 0);  // FromExchange normalises
        EXPECT_TRUE(SameDouble(merged.ToDouble(), want_double));
        EXPECT_TRUE(SameDouble(exchanged.ToDouble(), want_double));
      }
    }
  }
}

// Correct rounding: ties go to even, and anything past the tie (however far below) rounds up; a double
// sum in order gets the second case wrong.
TEST(ExactSumTest, ToDoubleRoundsToNearestEven) {
  const float two_m27 = std::ldexp(1.0f, -27);       // two squares: 2^-53, half an ulp of 1
  const float tiniest = std::ldexp(1.0f, -149);      // square 2^-298
  const float one_p = 1.0f + std::ldexp(1.0f, -23);  // square 1 + 2^-22 + 2^-46
  struct Case {
    std::vector<float> xs;
    double want;
  };
  const std::vector<Case> cases = {
      {{1.0f, two_m27, two_m27}, 1.0},                                  // tie, even: down
      {{1.0f, two_m27, two_m27, tiniest}, 1.0 + std::ldexp(1.0, -52)},  // past the tie: up
      {{tiniest, two_m27, 1.0f, two_m27}, 1.0 + std::ldexp(1.0, -52)},  // any order
      {{one_p, std::ldexp(1.0f, -26), two_m27, two_m27},                // odd mantissa, tie: up
       1.0 + std::ldexp(1.0, -22) + std::ldexp(1.0, -46) + std::ldexp(1.0, -51)},
      {{std::ldexp(1.0f, 100), std::ldexp(1.0f, 73), std::ldexp(1.0f, 73)},  // tie at 2^200: down
       std::ldexp(1.0, 200)},
      {{std::ldexp(1.0f, 100), std::ldexp(1.0f, 74)}, std::ldexp(1.0, 200) + std::ldexp(1.0, 148)},  // exact
      {{tiniest}, std::ldexp(1.0, -298)},
      {{FLT_MAX}, static_cast<double>(FLT_MAX) * FLT_MAX},
      {{3.0f, 4.0f, 12.0f}, 169.0},
      {{}, 0.0},
      {{0.0f, -0.0f}, 0.0},
  };
  for (size_t c = 0; c < cases.size(); ++c) {
    ExactSumSq s{};
    for (float x : cases[c].xs) s.AddSquare(x);
    EXPECT_TRUE(SameDouble(s.ToDouble(), cases[c].want))
        << "case " << c << ": " << s.ToDouble() << " vs " << cases[c].want;
    EXPECT_TRUE(SameDouble(Reference(cases[c].xs).ToDouble(), cases[c].want)) << "reference, case " << c;
  }
  // Many FLT_MAX squares (their sum passes 2^256): exact, no overflow.
  ExactSumSq s{};
  for (int i = 0; i < 1000; ++i) s.AddSquare(-FLT_MAX);
  EXPECT_EQ(s.ToDouble(), 1000.0 * FLT_MAX * FLT_MAX);
}

// Random sums whose exact values sit on or next to a rounding tie: a 53-bit head plus exactly half an
// ulp, plus a tail of 0 or of a random tiny square.
TEST(ExactSumTest, RandomTiesRoundToEven) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrFormat("seed %u", seed));
  std::mt19937_64 rng(seed);
  int ups = 0, downs = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    // head: squares of integers below 2^12 times 2^k sum to an integer < 2^53 times 2^(2k).
    const int k = static_cast<int>(rng() % 60) - 30;
    std::vector<float> xs;
    for (int i = 0; i < 30; ++i) {
      xs.push_back(std::ldexp(static_cast<float>(1 + rng() % 4095), k));
    }
    double head = 0;  // exact: < 2^30 * 2^(2k)
    for (float x : xs) head += static_cast<double>(x) * x;
    // Push the head to 53 significant bits: add a big square so the total's ulp is known.
    const float big = std::ldexp(1.0f, k + 26);  // square 2^(2k + 52)
    xs.push_back(big);
    const double total = head + static_cast<double>(big) * big;  // exact: head < 2^(2k + 30)
    const int ulp_exp = std::ilogb(total) - 52;
    // Half an ulp, 2^(ulp_exp - 1): one square of a power of two, or two when the exponent is odd.
    if ((ulp_exp - 1) % 2 == 0) {
      xs.push_back(std::ldexp(1.0f, (ulp_exp - 1) / 2));
    } else {
      xs.push_back(std::ldexp(1.0f, (ulp_exp - 2) / 2));
      xs.push_back(std::ldexp(1.0f, (ulp_exp - 2) / 2));
    }
    const bool tail = rng() % 2 == 0;
    if (tail) xs.push_back(std::ldexp(1.0f, ulp_exp / 2 - 20));
    const double ulp = std::ldexp(1.0, ulp_exp);
    const bool odd = std::fmod(total / ulp, 2.0) == 1.0;
    const double want = (odd || tail) ? total + ulp : total;
    (want == total ? downs : ups)++;
    std::shuffle(xs.begin(), xs.end(), rng);
    ExactSumSq s{};
    for (float x : xs) s.AddSquare(x);
    ASSERT_TRUE(SameDouble(s.ToDouble(), want)) << s.ToDouble() << " vs " << want;
    ASSERT_TRUE(SameDouble(Reference(xs).ToDouble(), want));
  }
  EXPECT_GT(ups, 100);
  EXPECT_GT(downs, 100);
}

// The exchange form summed over 2^20 ranks with the largest digits: still exact.
TEST(ExactSumTest, ExchangeSumOfManyRanksIsExact) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrFormat("seed %u", seed));
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 10; ++trial) {
    ExactSumSq x{};
    for (int i = 0; i < ExactSumSq::kDigits - 1; ++i) {
      x.digit[i] = trial == 0 ? 0xFFFFFFFFll : static_cast<int64_t>(rng() & 0xFFFFFFFFull);
    }
    x.digit[ExactSumSq::kDigits - 1] = static_cast<int64_t>(rng() % 4096);  // x < 2^300: 2^20 x < 2^320
    double ex[ExactSumSq::kExchangeDoubles];
    x.ToExchange(ex);
    for (double& d : ex) d *= 1 << 20;  // the sum over 2^20 ranks holding x: exact, < 2^52
    const ExactSumSq from = ExactSumSq::FromExchange(ex);
    ExactSumSq doubled = x;  // x * 2^20 by 20 doublings through Add
    for (int k = 0; k < 20; ++k) {
      const ExactSumSq copy = doubled;
      doubled.Add(copy);
    }
    EXPECT_TRUE(SameBytes(from, doubled)) << Digits(from) << "\n" << Digits(doubled);
    RefBigSum ref;
    for (int i = 0; i < ExactSumSq::kDigits; ++i) ref.AddAt(static_cast<uint64_t>(x.digit[i]) << 20, 32 * i);
    EXPECT_TRUE(SameBytes(from, ref.ToExact()));
    EXPECT_TRUE(SameDouble(from.ToDouble(), ref.ToDouble()));
  }
}

// Many more additions than a word or a bucket holds without normalising or folding.
TEST(ExactSumTest, LongSumsNormaliseAndFold) {
  // 2^20 squares of FLT_MAX: bucket 254 folds 16 times; the sum passes 2^276.
  std::vector<float> xs(size_t{1} << 20, FLT_MAX);
  xs[12345] = -FLT_MAX;
  // 2^20 copies of one square: the square shifted by 20 bits.
  RefBigSum direct;
  direct.AddAt(static_cast<RefU128>(0xFFFFFFull) * 0xFFFFFFull, 2 * 254 + 20 + 20);
  for (Method m : {Method::kAddSquare, Method::kBuckets, Method::kExpansion}) {
    const ExactSumSq got = SumWith(m, xs.data(), xs.size());
    EXPECT_TRUE(SameBytes(got, direct.ToExact())) << "method " << static_cast<int>(m);
    EXPECT_EQ(got.ToDouble(), std::ldexp(static_cast<double>(FLT_MAX) * FLT_MAX, 20));
  }
  // Doubling through Add 250 times: `pending` doubles each time and passes its limit.
  ExactSumSq s{};
  s.AddSquare(1.0f);
  for (int k = 0; k < 250; ++k) {
    const ExactSumSq copy = s;
    s.Add(copy);
  }
  EXPECT_EQ(s.ToDouble(), std::ldexp(1.0, 250));
}

// The bulk accumulator flags NaN and Inf and leaves them out of the sum.
TEST(ExactSumTest, NonFiniteElementsAreFlaggedAndLeftOut) {
  std::mt19937_64 rng(FreshSeed());
  for (DType dt : kTypes) {
    for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                      -std::numeric_limits<float>::infinity()}) {
      std::vector<float> xs = RandomValues(rng, dt, Magnitude::kNormal, 1000);
      const ExactSumSq want = Reference(xs).ToExact();
      const size_t at = rng() % xs.size();
      xs.insert(xs.begin() + static_cast<std::ptrdiff_t>(at), bad);
      std::vector<uint8_t> raw(xs.size() * DTypeSize(dt));
      for (size_t i = 0; i < xs.size(); ++i) StoreFromF32(raw.data(), dt, i, xs[i]);
      GradSquareAccumulator acc;
      acc.Add(raw.data(), dt, 0, static_cast<int64_t>(xs.size()));
      EXPECT_TRUE(acc.found_inf()) << DTypeName(dt) << " " << bad << " at " << at;
      EXPECT_TRUE(SameBytes(acc.Sum(), want));
      const GradStats stats = acc.Stats();
      EXPECT_EQ(stats.found_inf, 1u);
      EXPECT_TRUE(std::isinf(stats.sum_sq));
    }
  }
  GradSquareAccumulator empty;
  const GradStats stats = empty.Stats();
  EXPECT_EQ(stats.found_inf, 0u);
  EXPECT_EQ(stats.sum_sq, 0.0);
  EXPECT_TRUE(SameBytes(stats.exact, ExactSumSq{}));
}

}  // namespace
}  // namespace ferry
