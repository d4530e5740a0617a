// bf16 optimizer state (base/adam_state.h) in CpuAdam: rounding to nearest equals ferry/dtype.h, the
// stochastic rounding is unbiased and reproducible, every CPU path equals the scalar one bit for bit
// for every state format (and any split of a tensor into ranges or threads), and the error of bf16
// moments against a float64 Adam over 1,000 steps stays within the stated bounds.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/adam_element.h"
#include "base/adam_state.h"
#include "base/thread_pool.h"
#include "gtest/gtest.h"
#include "optim/cpu_adam.h"

namespace ferry {
namespace {

// ---- rounding ----

std::vector<float> InterestingFloats(uint64_t seed, size_t n) {
  std::mt19937_64 rng(seed);
  std::vector<float> out = {0.0f, -0.0f, 1.0f, -1.0f, 1e-40f, -1e-40f, 3.4e38f, -3.4e38f, INFINITY, -INFINITY,
                            NAN, std::numeric_limits<float>::denorm_min(), 1.00390625f /* a bf16 tie */};
  while (out.size() < n) {
    uint32_t u = static_cast<uint32_t>(rng());
    float f;
    std::memcpy(&f, &u, 4);
    out.push_back(f);
  }
  return out;
}

TEST(StateRoundingTest, NearestIsDtypeConversion) {
  for (float f : InterestingFloats(1, 100000)) {
    uint16_t stored = 0;
    StoreState(&stored, DType::kBF16, 0, f, StateRounding::kNearest, 0x12345678u);
    ASSERT_EQ(stored, F32ToBF16(f)) << f;
    float f32 = 0;
    StoreState(&f32, DType::kF32, 0, f, StateRounding::kStochastic, 0x12345678u);
    ASSERT_EQ(std::memcmp(&f32, &f, 4), 0);
  }
}

TEST(StateRoundingTest, StochasticRoundsToANeighbourAndKeepsSpecials) {
  for (float f : InterestingFloats(2, 100000)) {
    const uint16_t h = F32ToBF16Stochastic(f, RoundingBits(0xabcdef01u, static_cast<uint32_t>(F32Bits(f))));
    if (std::isnan(f)) {
      ASSERT_EQ(h, F32ToBF16(f));
      continue;
    }
    const uint32_t u = F32Bits(f);
    const uint16_t down = static_cast<uint16_t>(u >> 16);
    if ((u & 0xffffu) == 0) {
      ASSERT_EQ(h, down) << f << " is a bf16: exact";
    } else {
      ASSERT_TRUE(h == down || h == static_cast<uint16_t>(down + 1)) << f;
    }
  }
}

// For values between two bf16 neighbours, the mean of 2^20 stochastic roundings (consecutive element
// counters under one key) is the value: |mean - x| <= 6 sigma, sigma = spacing * 0.5 / sqrt(N) (the
// largest standard deviation of a mean of N Bernoulli draws). The inputs and the generator are fixed,
// so the test cannot flake; 6 sigma leaves room for any decent generator, and a biased rounding (to
// nearest: |mean - x| up to spacing / 2, i.e. 1024 sigma) fails it.
TEST(StateRoundingTest, StochasticIsUnbiased) {
  constexpr int kN = 1 << 20;
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  for (int trial = 0; trial < 24; ++trial) {
    // A random bf16 pair, in binades from 2^-130 (subnormal) to 2^100, and a point between them.
    const int exponent = -130 + static_cast<int>(unit(rng) * 230);
    const float base = std::ldexp(static_cast<float>(1.0 + unit(rng)), exponent) * (trial % 2 == 0 ? 1.0f : -1.0f);
    const float lo_f = BF16ToF32(static_cast<uint16_t>(F32Bits(base) >> 16));
    const float hi_f = BF16ToF32(static_cast<uint16_t>((F32Bits(base) >> 16) + 1));
    const float x = F32FromBits((F32Bits(lo_f) & 0xffff0000u) | (1u + static_cast<uint32_t>(unit(rng) * 65534)));
    ASSERT_TRUE(std::abs(x) > std::abs(lo_f) && std::abs(x) < std::abs(hi_f)) << x;
    const uint64_t tensor_key = RoundingTensorKey(11, 22, trial + 1);
    const StateKindKeys keys = KindKeysFor(tensor_key, 0);
    double sum = 0.0;
    int ups = 0;
    for (int i = 0; i < kN; ++i) {
      // Even trials take the low 16 bits of the moments' word (as m does), odd ones the high 16 (v).
      const uint32_t word = RoundingBits(keys.moments, static_cast<uint32_t>(i));
      const uint16_t h = F32ToBF16Stochastic(x, trial % 4 < 2 ? word : word >> 16);
      sum += static_cast<double>(BF16ToF32(h));
      ups += BF16ToF32(h) == hi_f ? 1 : 0;
    }
    const double spacing = std::abs(static_cast<double>(hi_f) - static_cast<double>(lo_f));
    const double sigma = spacing * 0.5 / std::sqrt(static_cast<double>(kN));
    EXPECT_LE(std::abs(sum / kN - static_cast<double>(x)), 6 * sigma) << "x = " << x << ", trial " << trial;
    const double p = std::abs(static_cast<double>(x) - static_cast<double>(lo_f)) / spacing;
    EXPECT_NEAR(static_cast<double>(ups) / kN, p, 6 * 0.5 / std::sqrt(static_cast<double>(kN))) << x;
  }
}

TEST(StateRoundingTest, KeysDependOnEveryInput) {
  const uint64_t k = RoundingTensorKey(1, 2, 3);
  EXPECT_EQ(k, RoundingTensorKey(1, 2, 3));
  EXPECT_NE(k, RoundingTensorKey(0, 2, 3));
  EXPECT_NE(k, RoundingTensorKey(1, 3, 3));
  EXPECT_NE(k, RoundingTensorKey(1, 2, 4));
  const StateKindKeys a = KindKeysFor(k, 0), b = KindKeysFor(k, 1);
  EXPECT_NE(a.master, a.moments);
  EXPECT_NE(a.moments, b.moments);
  EXPECT_NE(RoundingParamId("w", 1), RoundingParamId("b", 1));
}

// ---- the CPU paths ----

// A tensor with typed state in host memory.
struct TypedTensor {
  StateFormat format;
  DType grad_dtype = DType::kF32, param_dtype = DType::kBF16;
  bool has_param = true;
  int64_t n = 0;
  int64_t index0 = 0;  // global index of element 0
  std::vector<uint8_t> master, m, v, grad, param;

  TypedTensor(const StateFormat& f, DType gd, DType pd, bool with_param, int64_t numel, int64_t first, uint64_t seed)
      : format(f), grad_dtype(gd), param_dtype(pd), has_param(with_param), n(numel), index0(first) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const size_t un = static_cast<size_t>(n);
    master.resize(un * DTypeSize(f.master));
    m.resize(un * DTypeSize(f.moments));
    v.resize(un * DTypeSize(f.moments));
    grad.resize(un * DTypeSize(gd));
    param.resize(un * DTypeSize(pd));
    for (size_t i = 0; i < un; ++i) {
      StoreFromF32(master.data(), f.master, i, normal(rng));
      StoreFromF32(m.data(), f.moments, i, 0.1f * normal(rng));
      StoreFromF32(v.data(), f.moments, i, 0.01f * std::abs(normal(rng)));
    }
    NewGrads(rng());
  }
  // Fresh random grads; with `specials`, a few NaN and Inf among them (their state turns NaN, and
  // every path must round NaN as F32ToBF16 does).
  void NewGrads(uint64_t seed, bool specials = false) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (size_t i = 0; i < static_cast<size_t>(n); ++i) StoreFromF32(grad.data(), grad_dtype, i, 0.3f * normal(rng));
    if (!specials) return;
    for (int k = 0; k < 3; ++k) {
      StoreFromF32(grad.data(), grad_dtype, rng() % static_cast<uint64_t>(n), k == 0 ? -INFINITY : NAN);
    }
  }
  // Elements [begin, end) as a CpuAdamTensor range (its own element 0 at `begin`).
  CpuAdamTensor Range(int64_t begin, int64_t end, const AdamScalars* s, uint64_t key) {
    CpuAdamTensor t;
    const size_t b = static_cast<size_t>(begin);
    t.master = master.data() + b * DTypeSize(format.master);
    t.exp_avg = m.data() + b * DTypeSize(format.moments);
    t.exp_avg_sq = v.data() + b * DTypeSize(format.moments);
    t.grad = grad.data() + b * DTypeSize(grad_dtype);
    t.param = has_param ? param.data() + b * DTypeSize(param_dtype) : nullptr;
    t.numel = end - begin;
    t.grad_dtype = grad_dtype;
    t.param_dtype = param_dtype;
    t.scalars = s;
    t.state = format;
    t.rounding = StateRoundingKey{key, index0 + begin};
    return t;
  }
  bool operator==(const TypedTensor& o) const {
    return master == o.master && m == o.m && v == o.v && (!has_param || param == o.param);
  }
};

const StateFormat kFormats[] = {
    {DType::kF32, DType::kBF16, StateRounding::kNearest},
    {DType::kF32, DType::kBF16, StateRounding::kStochastic},
    {DType::kBF16, DType::kF32, StateRounding::kNearest},
    {DType::kBF16, DType::kBF16, StateRounding::kNearest},
    {DType::kBF16, DType::kBF16, StateRounding::kStochastic},
};

std::string FormatName(const StateFormat& f) {
  return absl::StrCat(f.master == DType::kBF16 ? "bf16" : "fp32", "_", f.moments == DType::kBF16 ? "bf16" : "fp32",
                      f.rounding == StateRounding::kStochastic ? "_sr" : "_rne");
}

class CpuAdamBf16IsaTest : public ::testing::TestWithParam<CpuAdamIsa> {};

// Every format, grad dtype and param dtype (bf16 masters: bf16 params or none), tensors of odd sizes,
// ranges starting at odd offsets, global indices crossing a multiple of 2^32, and NaN and Inf grads at
// step 3 (so NaN state from then on): the path under test equals the scalar path bit for bit over 6
// steps.
TEST_P(CpuAdamBf16IsaTest, EqualsScalarBitForBit) {
  const CpuAdamIsa isa = GetParam();
  if (!CpuSupportsAdamIsa(isa)) GTEST_SKIP() << "this CPU lacks " << CpuAdamIsaName(isa);
  ThreadPool pool(3);
  CpuAdam simd(&pool, CpuAdamOptions{.isa = isa, .block_elements = 1000});
  CpuAdam scalar(&pool, CpuAdamOptions{.isa = CpuAdamIsa::kScalar});
  ASSERT_TRUE(simd.init_status().ok());
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  for (const StateFormat& f : kFormats) {
    for (DType gd : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (DType pd : {DType::kBF16, DType::kF32, DType::kF16}) {
        for (bool with_param : {true, false}) {
          if (f.master == DType::kBF16 && with_param && pd != DType::kBF16) continue;
          SCOPED_TRACE(absl::StrCat(FormatName(f), " grad ", static_cast<int>(gd), " param ", static_cast<int>(pd),
                                    with_param ? "" : " (none)"));
          const int64_t n = 3001 + static_cast<int64_t>(rng() % 64);
          // Half the runs put a multiple of 2^32 inside the tensor.
          const int64_t index0 = rng() % 2 == 0 ? static_cast<int64_t>(rng() % 100000)
                                                : (int64_t{1} << 32) - static_cast<int64_t>(rng() % 2000) - 1;
          const uint64_t tseed = rng();
          TypedTensor a(f, gd, pd, with_param, n, index0, tseed), b(f, gd, pd, with_param, n, index0, tseed);
          for (int step = 1; step <= 6; ++step) {
            a.NewGrads(tseed + static_cast<uint64_t>(step), /*specials=*/step == 3);
            b.NewGrads(tseed + static_cast<uint64_t>(step), /*specials=*/step == 3);
            AdamHyper h;
            h.weight_decay = 0.01f;
            h.mode = step % 2 == 0 ? AdamMode::kAdamW : AdamMode::kAdamL2;
            const AdamScalars s = MakeAdamScalars(h, step);
            const uint64_t key = RoundingTensorKey(5, 9, step);
            // Ranges at odd offsets: [0, 7), [7, 1500), [1500, n).
            std::vector<CpuAdamTensor> ta = {a.Range(0, 7, &s, key), a.Range(7, 1500, &s, key), a.Range(1500, n, &s, key)};
            const CpuAdamTensor tb = b.Range(0, n, &s, key);
            ASSERT_TRUE(simd.Step(ta).ok());
            ASSERT_TRUE(scalar.Step({&tb, 1}).ok());
            ASSERT_TRUE(a == b) << "step " << step << ", index0 " << index0;
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Isas, CpuAdamBf16IsaTest,
                         ::testing::Values(CpuAdamIsa::kScalar, CpuAdamIsa::kAvx2, CpuAdamIsa::kAvx512,
                                           CpuAdamIsa::kAvx512Bf16),
                         [](const ::testing::TestParamInfo<CpuAdamIsa>& param) {
                           return std::string(CpuAdamIsaName(param.param));
                         });

// The thread count and the split into ranges do not change a bit (the rounding counter is the global
// element index), and the stochastic rounding did round differently from nearest.
TEST(CpuAdamBf16Test, ThreadsAndSplitsDoNotChangeBits) {
  const StateFormat sr{DType::kF32, DType::kBF16, StateRounding::kStochastic};
  const StateFormat rne{DType::kF32, DType::kBF16, StateRounding::kNearest};
  ThreadPool one(0), four(4);
  CpuAdam a_adam(&one), b_adam(&four, CpuAdamOptions{.block_elements = 333});
  const int64_t n = 100003;
  TypedTensor a(sr, DType::kBF16, DType::kBF16, true, n, 17, 99), b(sr, DType::kBF16, DType::kBF16, true, n, 17, 99);
  TypedTensor c(rne, DType::kBF16, DType::kBF16, true, n, 17, 99);
  for (int step = 1; step <= 4; ++step) {
    for (TypedTensor* t : {&a, &b, &c}) t->NewGrads(1000 + static_cast<uint64_t>(step));
    const AdamScalars s = MakeAdamScalars(AdamHyper{}, step);
    const uint64_t key = RoundingTensorKey(0, 1, step);
    const CpuAdamTensor whole = a.Range(0, n, &s, key);
    std::vector<CpuAdamTensor> pieces;
    for (int64_t at = 0; at < n; at += 9001) pieces.push_back(b.Range(at, std::min(n, at + 9001), &s, key));
    const CpuAdamTensor cw = c.Range(0, n, &s, key);
    ASSERT_TRUE(a_adam.Step({&whole, 1}).ok());
    ASSERT_TRUE(b_adam.Step(pieces).ok());
    ASSERT_TRUE(a_adam.Step({&cw, 1}).ok());
  }
  EXPECT_TRUE(a == b);
  EXPECT_NE(a.v, c.v) << "stochastic rounding gave the bits of rounding to nearest";
}

// ---- the error against float64 over 1,000 steps ----

struct ErrorStats {
  double max_err = 0.0;   // max over elements of |p - p64| / (lr * steps)
  double mean_err = 0.0;  // mean of the same
};

// 1,000 Adam steps (lr 1e-3, betas 0.9 / 0.999, weight decay 0.01, AdamW) of 4,096 params with fresh
// random grads every step (a per-element mean in [-1, 1] plus unit noise, so the params drift), with
// state format `f` through CpuAdam and in float64; the error of the final params, relative to the
// largest displacement Adam allows (lr per step).
ErrorStats ErrorAgainstFloat64(const StateFormat& f) {
  constexpr int kSteps = 1000;
  constexpr int64_t kN = 4096;
  ThreadPool pool(2);
  CpuAdam adam(&pool);
  AdamHyper h;
  h.lr = 1e-3f;
  h.weight_decay = 0.01f;
  TypedTensor t(f, DType::kF32, DType::kBF16, true, kN, 0, 5);
  std::vector<double> p(kN), m(kN, 0.0), v(kN, 0.0), mu(kN);
  std::mt19937_64 rng(77);
  std::uniform_real_distribution<double> unit(-1.0, 1.0);
  for (size_t i = 0; i < static_cast<size_t>(kN); ++i) {
    const float p0 = static_cast<float>(unit(rng));
    StoreFromF32(t.master.data(), f.master, i, p0);
    p[i] = static_cast<double>(LoadAsF32(t.master.data(), f.master, i));
    StoreFromF32(t.m.data(), f.moments, i, 0.0f);
    StoreFromF32(t.v.data(), f.moments, i, 0.0f);
    mu[i] = unit(rng);
  }
  std::normal_distribution<double> normal(0.0, 1.0);
  for (int step = 1; step <= kSteps; ++step) {
    std::vector<float> g(kN);
    for (size_t i = 0; i < g.size(); ++i) g[i] = static_cast<float>(mu[i] + normal(rng));
    std::memcpy(t.grad.data(), g.data(), g.size() * 4);
    const AdamScalars s = MakeAdamScalars(h, step);
    const CpuAdamTensor ct = t.Range(0, kN, &s, RoundingTensorKey(3, 4, step));
    EXPECT_TRUE(adam.Step({&ct, 1}).ok());
    const double bc1 = 1.0 - std::pow(0.9, step), bc2 = 1.0 - std::pow(0.999, step);
    for (size_t i = 0; i < g.size(); ++i) {
      const double gi = static_cast<double>(g[i]);
      m[i] = 0.9 * m[i] + 0.1 * gi;
      v[i] = 0.999 * v[i] + 0.001 * gi * gi;
      const double update = (m[i] / bc1) / (std::sqrt(v[i] / bc2) + 1e-8) + 0.01 * p[i];
      p[i] -= 1e-3 * update;
    }
  }
  ErrorStats e;
  for (size_t i = 0; i < static_cast<size_t>(kN); ++i) {
    const double err = std::abs(static_cast<double>(LoadAsF32(t.master.data(), f.master, i)) - p[i]) / (1e-3 * kSteps);
    e.max_err = std::max(e.max_err, err);
    e.mean_err += err / kN;
  }
  return e;
}

// The bounds, relative to the largest displacement Adam allows (lr x 1,000 steps = 1); measured on
// this fixed data (x86-64, any path: the results are bit-identical) in brackets:
//  - fp32 state: float32 rounding only: max <= 1e-4 [2.8e-6].
//  - bf16 moments: each store rounds m and v by at most one bf16 step (2^-8 relative, nearest: half
//    of it), the EMAs average these errors over ~1 / (1 - beta) steps, so each update is off by
//    about 2^-8 of itself, mostly at random: its sum over 1,000 steps stays a few percent of the
//    displacement. Bounds: max <= 5%, mean <= 1% with stochastic rounding [1.7%, 0.27%]; max <= 5%,
//    mean <= 1.5% rounding to nearest [1.6%, 0.41%].
//  - bf16 master and moments, stochastic: the master itself now walks at random by up to one bf16
//    step (2^-7 for |p| < 2) per update with probability ~ update / step: a walk of standard
//    deviation <= 2^-7 x 0.5 x sqrt(1,000) = 0.12, so max <= 50% over 4,096 elements (4 sigma),
//    mean <= 6% [26%, 2.5%].
//  - bf16 master, rounding to nearest: every update below half a bf16 step (lr = 1e-3 against a half
//    step of 2e-3 for |p| in [0.5, 1)) is lost, every step: the error is systematic, mean >= 10%.
//    This is why a bf16 master wants stochastic rounding.
TEST(CpuAdamBf16Test, ErrorAgainstFloat64Over1000Steps) {
  const ErrorStats fp32 = ErrorAgainstFloat64(StateFormat{});
  const ErrorStats sr = ErrorAgainstFloat64({DType::kF32, DType::kBF16, StateRounding::kStochastic});
  const ErrorStats rne = ErrorAgainstFloat64({DType::kF32, DType::kBF16, StateRounding::kNearest});
  const ErrorStats all_sr = ErrorAgainstFloat64({DType::kBF16, DType::kBF16, StateRounding::kStochastic});
  const ErrorStats all_rne = ErrorAgainstFloat64({DType::kBF16, DType::kBF16, StateRounding::kNearest});
  std::printf("error / (lr x steps), max and mean: fp32 %.2e %.2e; bf16 moments sr %.2e %.2e, nearest %.2e %.2e; "
              "bf16 master+moments sr %.2e %.2e, nearest %.2e %.2e\n",
              fp32.max_err, fp32.mean_err, sr.max_err, sr.mean_err, rne.max_err, rne.mean_err, all_sr.max_err,
              all_sr.mean_err, all_rne.max_err, all_rne.mean_err);
  EXPECT_LE(fp32.max_err, 1e-4);
  EXPECT_LE(sr.max_err, 0.05);
  EXPECT_LE(sr.mean_err, 0.01);
  EXPECT_LE(rne.max_err, 0.05);
  EXPECT_LE(rne.mean_err, 0.015);
  EXPECT_LE(all_sr.max_err, 0.5);
  EXPECT_LE(all_sr.mean_err, 0.06);
  EXPECT_GE(all_rne.mean_err, 0.1) << "a bf16 master rounded to nearest should lose the small updates";
  // bf16 state is not fp32 state: the errors are real (and the test could fail).
  EXPECT_GT(sr.mean_err, 10 * fp32.mean_err);
}

}  // namespace
}  // namespace ferry
