// Tests of base/adam_math.h against float64 references on fresh random data:
//  - MakeAdamScalars: every field is the float nearest the double formula;
//  - AdamUpdate, one step: within a first-order rounding-error bound computed alongside;
//  - AdamUpdate, 1,000 steps: within a stated relative-error bound of the textbook Adam / AdamW
//    recursion run in double, for both modes, with and without bias correction;
//  - the values a kernel reads at run time (AdamApplyRuntime) give the same bits as MakeAdamScalars,
//    and AdamGradMultiplier is the correctly rounded unscale-and-clip factor.
#include "base/adam_math.h"

#include <cstring>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <ostream>
#include <random>
#include <vector>

#include "absl/strings/str_format.h"
#include "gtest/gtest.h"

namespace ferry {
namespace {

constexpr double kU = 0x1p-24;  // unit roundoff of float32 (round to nearest)

uint64_t FreshSeed() { return std::random_device{}(); }

double LogUniform(std::mt19937_64& rng, double lo, double hi) {
  return std::exp(std::uniform_real_distribution<double>(std::log(lo), std::log(hi))(rng));
}

// beta^step by repeated squaring: a different route from std::pow, so the reference is independent.
double PowBySquaring(double beta, int64_t step) {
  double result = 1.0, base = beta;
  for (int64_t e = step; e > 0; e >>= 1) {
    if (e & 1) result *= base;
    base *= base;
  }
  return result;
}

// `got` is the float nearest `want` (allowing for the reference's own error, ~1e-12 relative).
void ExpectCorrectlyRounded(float got, double want, const char* field) {
  EXPECT_LE(std::fabs(static_cast<double>(got) - want), (kU + 1e-12) * std::fabs(want))
      << field << ": got " << got << ", want " << want;
}

TEST(AdamScalars, MatchDoubleFormulas) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrFormat("seed %u", seed));
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  const int64_t steps[] = {1, 2, 3, 10, 100, 1000, 12345, 1000000, int64_t{1} << 40};
  for (int trial = 0; trial < 200; ++trial) {
    AdamHyper h;
    h.lr = static_cast<float>(LogUniform(rng, 1e-6, 1e-1));
    h.beta1 = static_cast<float>(0.5 + 0.49 * unit(rng));
    h.beta2 = static_cast<float>(0.9 + 0.0999 * unit(rng));
    h.eps = static_cast<float>(LogUniform(rng, 1e-12, 1e-3));
    h.weight_decay = static_cast<float>(0.3 * unit(rng));
    h.mode = trial % 2 ? AdamMode::kAdamL2 : AdamMode::kAdamW;
    h.bias_correction = trial % 4 < 2;
    const double grad_multiplier = LogUniform(rng, 1e-4, 1e2);
    for (int64_t step : steps) {
      SCOPED_TRACE(absl::StrFormat("trial %d step %d bias_correction %d", trial, step,
                                   h.bias_correction));
      const AdamScalars s = MakeAdamScalars(h, step, grad_multiplier);
      // Copied through unchanged.
      EXPECT_EQ(s.lr, h.lr);
      EXPECT_EQ(s.beta1, h.beta1);
      EXPECT_EQ(s.beta2, h.beta2);
      EXPECT_EQ(s.eps, h.eps);
      EXPECT_EQ(s.weight_decay, h.weight_decay);
      EXPECT_EQ(s.mode, h.mode);
      // Computed in double, rounded once.
      const double b1 = h.beta1, b2 = h.beta2;
      ExpectCorrectlyRounded(s.one_minus_beta1, 1.0 - b1, "one_minus_beta1");
      ExpectCorrectlyRounded(s.one_minus_beta2, 1.0 - b2, "one_minus_beta2");
      ExpectCorrectlyRounded(s.grad_multiplier, grad_multiplier, "grad_multiplier");
      if (h.bias_correction) {
        ExpectCorrectlyRounded(s.inv_bias_correction1, 1.0 / (1.0 - PowBySquaring(b1, step)),
                               "inv_bias_correction1");
        ExpectCorrectlyRounded(s.inv_sqrt_bias_correction2,
                               1.0 / std::sqrt(1.0 - PowBySquaring(b2, step)),
                               "inv_sqrt_bias_correction2");
      } else {
        EXPECT_EQ(s.inv_bias_correction1, 1.0f);
        EXPECT_EQ(s.inv_sqrt_bias_correction2, 1.0f);
      }
    }
  }
  // The default multiplier is 1.
  EXPECT_EQ(MakeAdamScalars(AdamHyper{}, 1).grad_multiplier, 1.0f);
}

// A kernel that reads lr and the completed step count from memory rebuilds the scalars made at enqueue
// time for another lr and step: the result must be MakeAdamScalars' bits for the new values.
TEST(AdamScalars, RuntimeValuesGiveTheSameBits) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrFormat("seed %u", seed));
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  for (int trial = 0; trial < 2000; ++trial) {
    AdamHyper h;
    h.lr = static_cast<float>(LogUniform(rng, 1e-6, 1e-1));
    h.beta1 = static_cast<float>(0.5 + 0.49 * unit(rng));
    h.beta2 = static_cast<float>(0.9 + 0.0999 * unit(rng));
    h.weight_decay = static_cast<float>(0.3 * unit(rng));
    h.mode = trial % 2 ? AdamMode::kAdamL2 : AdamMode::kAdamW;
    h.bias_correction = trial % 4 < 2;
    const int64_t step = 1 + static_cast<int64_t>(LogUniform(rng, 1.0, 1e7));
    const float lr = static_cast<float>(LogUniform(rng, 1e-6, 1e-1));
    const float multiplier = static_cast<float>(LogUniform(rng, 1e-4, 1e2));
    AdamScalars enqueued = MakeAdamScalars(h, 1 + static_cast<int64_t>(unit(rng) * 100));
    const int64_t completed = step - 1;
    AdamApplyRuntime(enqueued, &lr, &completed, &multiplier);
    AdamHyper at_run = h;
    at_run.lr = lr;
    const AdamScalars want = MakeAdamScalars(at_run, step, multiplier);
    ASSERT_EQ(std::memcmp(&enqueued, &want, sizeof(AdamScalars)), 0) << "trial " << trial;
  }
  // Null pointers keep the enqueued values.
  const AdamScalars made = MakeAdamScalars(AdamHyper{}, 7, 0.5);
  AdamScalars same = made;
  AdamApplyRuntime(same, nullptr, nullptr, nullptr);
  EXPECT_EQ(std::memcmp(&same, &made, sizeof(AdamScalars)), 0);
}

// AdamGradMultiplier: 1 / scale, times min(1, max_norm / (sqrt(sum_sq) / scale + 1e-6)) when
// max_norm > 0, correctly rounded to float (checked in long double: the double computation's own
// error, a few 2^-53, can move the float only at a rounding tie, which random inputs do not hit).
TEST(AdamGradMultiplier, UnscalesAndClips) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrFormat("seed %u", seed));
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 100000; ++trial) {
    const float scale = trial % 3 == 0 ? std::ldexp(1.0f, static_cast<int>(rng() % 32))
                                       : static_cast<float>(LogUniform(rng, 1e-3, 1e6));
    const double sum_sq = LogUniform(rng, 1e-20, 1e20);
    const float max_norm = trial % 5 == 0 ? 0.0f : static_cast<float>(LogUniform(rng, 1e-3, 1e3));
    long double want = 1.0L / scale;
    if (max_norm > 0) {
      const long double clip = max_norm / (std::sqrt(static_cast<long double>(sum_sq)) / scale + 1e-6L);
      if (clip < 1) want = clip / scale;
    }
    const float got = AdamGradMultiplier(scale, sum_sq, max_norm);
    ASSERT_LE(std::fabs(static_cast<long double>(got) - want), 0x1p-24L * want)
        << "scale " << scale << " sum_sq " << sum_sq << " max_norm " << max_norm;
  }
  // Exact cases: a power-of-two scale without clipping, and a clip that does not bite.
  EXPECT_EQ(AdamGradMultiplier(1024.0f, 123.0, 0.0f), 1.0f / 1024.0f);
  EXPECT_EQ(AdamGradMultiplier(1.0f, 4.0, 100.0f), 1.0f);
  EXPECT_EQ(AdamGradMultiplier(1.0f, 4.0, 1.0f), static_cast<float>(1.0 / (2.0 + 1e-6)));
}

// ---- one step ---------------------------------------------------------------------------------------

struct State {
  double p, m, v;
};

// One AdamUpdate done exactly (in double) on the same float inputs and the same float scalars, and a
// first-order bound on how far the float32 computation may be from it. The bound follows the float
// code operation by operation under the standard model fl(a op b) = (a op b)(1 + d), |d| <= u (one
// rounding per fmaf; sqrtf and division correctly rounded): each operation adds u * |its result|
// plus the propagated error of its operands.
void ExactStepWithBound(const AdamScalars& s, float p, float m, float v, float g, State* exact,
                        State* bound) {
  const double b1 = s.beta1, b2 = s.beta2, omb1 = s.one_minus_beta1, omb2 = s.one_minus_beta2;
  double gg = static_cast<double>(g) * s.grad_multiplier;
  double e_g = kU * std::fabs(gg);
  if (s.mode == AdamMode::kAdamL2) {
    gg = static_cast<double>(s.weight_decay) * p + gg;
    e_g += kU * std::fabs(gg);
  }
  const double a = omb1 * gg, e_a = kU * std::fabs(a) + omb1 * e_g;
  const double m1 = b1 * m + a, e_m = kU * std::fabs(m1) + e_a;
  const double b = omb2 * gg, e_b = kU * std::fabs(b) + omb2 * e_g;
  const double c = b * gg, e_c = kU * std::fabs(c) + std::fabs(b) * e_g + std::fabs(gg) * e_b;
  const double v1 = b2 * v + c, e_v = kU * v1 + e_c;
  const double mh = m1 * s.inv_bias_correction1,
               e_mh = kU * std::fabs(mh) + s.inv_bias_correction1 * e_m;
  const double sq = std::sqrt(v1), e_sq = kU * sq + e_v / (2.0 * sq);
  const double d = sq * s.inv_sqrt_bias_correction2 + s.eps,
               e_d = kU * d + s.inv_sqrt_bias_correction2 * e_sq;
  const double r = mh / d, e_r = kU * std::fabs(r) + e_mh / d + std::fabs(r) * e_d / d;
  double upd = r, e_upd = e_r;
  if (s.mode == AdamMode::kAdamW) {  // decoupled decay: p -= lr * (r + wd * p)
    upd = static_cast<double>(s.weight_decay) * p + r;
    e_upd = kU * std::fabs(upd) + e_r;
  }
  const double p2 = -static_cast<double>(s.lr) * upd + p;
  const double e_p = kU * std::fabs(p2) + s.lr * e_upd;
  *exact = {p2, m1, v1};
  *bound = {e_p, e_m, e_v};
}

TEST(AdamUpdate, OneStepWithinRoundingBound) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrFormat("seed %u", seed));
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::normal_distribution<double> normal(0.0, 1.0);
  int failures = 0;
  for (int i = 0; i < 200000; ++i) {
    AdamHyper h;
    h.lr = static_cast<float>(LogUniform(rng, 1e-5, 1e-1));
    h.beta1 = static_cast<float>(0.8 + 0.19 * unit(rng));
    h.beta2 = static_cast<float>(0.99 + 0.0099 * unit(rng));
    h.eps = static_cast<float>(LogUniform(rng, 1e-10, 1e-2));
    h.weight_decay = static_cast<float>(0.2 * unit(rng));
    h.mode = i % 2 ? AdamMode::kAdamL2 : AdamMode::kAdamW;
    h.bias_correction = i % 4 < 2;
    const int64_t step = 1 + static_cast<int64_t>(LogUniform(rng, 1.0, 1e5));
    const AdamScalars s = MakeAdamScalars(h, step, LogUniform(rng, 1e-2, 1e1));
    const double scale = LogUniform(rng, 1e-4, 1e2);  // gradient magnitude
    float p = static_cast<float>(normal(rng));
    float m = static_cast<float>(scale * normal(rng));
    float v = static_cast<float>(scale * scale * LogUniform(rng, 0.1, 10.0));
    const float g = static_cast<float>(scale * normal(rng));
    State exact, bound;
    ExactStepWithBound(s, p, m, v, g, &exact, &bound);
    AdamUpdate(s, p, m, v, g);
    // Twice the first-order bound: the factor covers the second-order terms (O(u^2) relative) and
    // the rounding of the double reference itself (O(2^-53)).
    const bool ok = std::fabs(p - exact.p) <= 2 * bound.p && std::fabs(m - exact.m) <= 2 * bound.m &&
                    std::fabs(v - exact.v) <= 2 * bound.v;
    if (!ok && ++failures <= 10) {
      ADD_FAILURE() << absl::StrFormat(
          "case %d (mode %d, bias %d): p %.9g vs %.9g (bound %.3g), m %.9g vs %.9g (bound %.3g), "
          "v %.9g vs %.9g (bound %.3g)",
          i, static_cast<int>(h.mode), h.bias_correction, p, exact.p, 2 * bound.p, m, exact.m,
          2 * bound.m, v, exact.v, 2 * bound.v);
    }
  }
  EXPECT_EQ(failures, 0);
}

// ---- 1,000 steps ------------------------------------------------------------------------------------

// The bounds for the 1,000-step comparison, from a worst-case (all roundings aligned) analysis for
// beta1 = 0.9, beta2 = 0.999, lr = 1e-3, T = 1000 steps, u = 2^-24:
//  - v: the recursion sums positive terms; a term k steps old carries at most k + 3 roundings, so the
//    relative error is at most u * (3 + beta2 / (1 - beta2)) ~= 1002u ~= 6.0e-5. Stated: 2e-4 of v.
//  - m: each step adds at most 3u * (|beta1 m| + (1 - beta1)|g|) and older errors decay by beta1, so
//    |error| <= 3u / (1 - beta1) * max(|m| + (1 - beta1)|g|) ~= 30u * 3 sigma_g ~= 100u sqrt(v)
//    (m can cancel to ~0, so its error is measured against sqrt(v), the scale of the gradients).
//    Stated: 2e-4 * sqrt(v).
//  - p: each step adds at most u|p| (the final fma) plus lr times the error of the update
//    m_hat / denom (+ wd * p for AdamW), which is at most |ratio| * (v's relative error) / 2 +
//    m's error / sqrt(v) + ~10u (|ratio| + wd|p|); with |ratio| <= (1 - beta1) / sqrt(1 - beta2) /
//    sqrt(1 - beta1^2 / beta2) ~= 7.3 that is <= 7.3 * 501u + 100u + 73u + 10u wd|p| ~= 3900u + u|p|.
//    Over T steps: |error| <= T * u * (2 max|p| + 3900 lr) <= 1000 * u * 5.9 * (max|p| + lr)
//    ~= 3.5e-4 * scale.
//    Stated: 4e-4 of scale = max over the run of |p| (double reference), plus lr.
// Observed errors are far smaller (roundings do not align); the bounds are what can be promised.
constexpr double kPBound = 4e-4;
constexpr double kMBound = 2e-4;
constexpr double kVBound = 2e-4;
constexpr int kSteps = 1000;

struct LongRunCase {
  AdamMode mode;
  bool bias_correction;
  float weight_decay;
  float eps;
  double grad_lo, grad_hi;  // per-element gradient scales, log-uniform in [grad_lo, grad_hi]
  double grad_multiplier;
};

void PrintTo(const LongRunCase& c, std::ostream* os) {
  *os << (c.mode == AdamMode::kAdamW ? "AdamW" : "AdamL2") << (c.bias_correction ? "+bias" : "")
      << " wd=" << c.weight_decay << " eps=" << c.eps;
}

class AdamLongRun : public ::testing::TestWithParam<LongRunCase> {};

TEST_P(AdamLongRun, MatchesFloat64Reference) {
  const LongRunCase& c = GetParam();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrFormat("seed %u", seed));
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> unit(-1.0, 1.0);
  std::normal_distribution<double> normal(0.0, 1.0);

  AdamHyper h;
  h.lr = 1e-3f;
  h.beta1 = 0.9f;
  h.beta2 = 0.999f;
  h.eps = c.eps;
  h.weight_decay = c.weight_decay;
  h.mode = c.mode;
  h.bias_correction = c.bias_correction;

  constexpr size_t kN = 2048;
  std::vector<float> p(kN), m(kN, 0.0f), v(kN, 0.0f);
  std::vector<double> p0(kN), rp(kN), rm(kN, 0.0), rv(kN, 0.0), max_abs_p(kN), sigma(kN), mean(kN);
  for (size_t i = 0; i < kN; ++i) {
    p[i] = static_cast<float>(2.0 * unit(rng));
    rp[i] = p0[i] = p[i];
    max_abs_p[i] = std::fabs(rp[i]);
    sigma[i] = LogUniform(rng, c.grad_lo, c.grad_hi);
    mean[i] = sigma[i] * unit(rng);  // a drift, so m does not just average to zero
  }
  const double lr = h.lr, b1 = h.beta1, b2 = h.beta2, eps = h.eps, wd = h.weight_decay;
  for (int64_t step = 1; step <= kSteps; ++step) {
    const AdamScalars s = MakeAdamScalars(h, step, c.grad_multiplier);
    const double bc1 = c.bias_correction ? 1.0 - std::pow(b1, static_cast<double>(step)) : 1.0;
    const double bc2 = c.bias_correction ? 1.0 - std::pow(b2, static_cast<double>(step)) : 1.0;
    for (size_t i = 0; i < kN; ++i) {
      const float g = static_cast<float>(mean[i] + sigma[i] * normal(rng));
      AdamUpdate(s, p[i], m[i], v[i], g);
      // The textbook recursion, in double.
      double gd = static_cast<double>(g) * c.grad_multiplier;
      if (c.mode == AdamMode::kAdamL2) gd += wd * rp[i];
      rm[i] = b1 * rm[i] + (1.0 - b1) * gd;
      rv[i] = b2 * rv[i] + (1.0 - b2) * gd * gd;
      if (c.mode == AdamMode::kAdamW) rp[i] -= lr * wd * rp[i];
      rp[i] -= lr * (rm[i] / bc1) / (std::sqrt(rv[i] / bc2) + eps);
      max_abs_p[i] = std::max(max_abs_p[i], std::fabs(rp[i]));
    }
  }
  double worst_p = 0, worst_m = 0, worst_v = 0;
  double moved = 0;  // how far the parameters travelled: the comparison must not be vacuous
  int failures = 0;
  for (size_t i = 0; i < kN; ++i) {
    const double ep = std::fabs(p[i] - rp[i]) / (max_abs_p[i] + lr);
    const double em = std::fabs(m[i] - rm[i]) / std::sqrt(rv[i]);
    const double ev = std::fabs(v[i] - rv[i]) / rv[i];
    worst_p = std::max(worst_p, ep);
    worst_m = std::max(worst_m, em);
    worst_v = std::max(worst_v, ev);
    if ((ep > kPBound || em > kMBound || ev > kVBound) && ++failures <= 10) {
      ADD_FAILURE() << absl::StrFormat(
          "element %d: p %.9g vs %.9g (rel %.3g), m %.9g vs %.9g (rel %.3g), v %.9g vs %.9g "
          "(rel %.3g)",
          i, p[i], rp[i], ep, m[i], rm[i], em, v[i], rv[i], ev);
    }
    moved += std::fabs(rp[i] - p0[i]) / kN;
  }
  EXPECT_EQ(failures, 0);
  EXPECT_GT(moved, 50 * lr) << "mean distance travelled by the parameters";
  std::printf("worst relative errors after %d steps: p %.3g (bound %.0e), m %.3g (bound %.0e), "
              "v %.3g (bound %.0e)\n",
              kSteps, worst_p, kPBound, worst_m, kMBound, worst_v, kVBound);
}

// AdamW's decay lr * wd * p must be applied without bias even when lr * wd is far below float32's
// resolution next to 1 (2^-24 ~= 6e-8): a float factor (1 - lr * wd) would apply a decay that is off
// by the same fraction every step (1.3% at lr * wd = 1e-6, 100% below 3e-8), shifting |p| after T
// steps by about that fraction times lr * wd * T relative (>= 1.4e-5 for every lr * wd here).
// Rounding to nearest is unbiased, so the mean over N = 2048 elements of (|p| - |p_ref|) / |p_ref| is
// only noise, measured at ~2e-8 standard deviation. Stated bound: 2e-7 (10 standard deviations, and
// 70 times below the smallest shift a float decay factor causes here).
TEST(AdamUpdate, AdamWDecayUnbiasedForTinyLrTimesWd) {
  constexpr double kBiasBound = 2e-7;
  constexpr size_t kN = 2048;
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrFormat("seed %u", seed));
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> unit(-1.0, 1.0);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (double lr_wd : {1e-8, 1e-7, 1e-6, 1e-5}) {
    AdamHyper h;
    h.lr = 1e-5f;
    h.weight_decay = static_cast<float>(lr_wd / 1e-5);
    h.mode = AdamMode::kAdamW;
    const double lr = h.lr, wd = h.weight_decay, b1 = h.beta1, b2 = h.beta2, eps = h.eps;
    std::vector<float> p(kN), m(kN, 0.0f), v(kN, 0.0f);
    std::vector<double> rp(kN), rm(kN, 0.0), rv(kN, 0.0), mean(kN);
    for (size_t i = 0; i < kN; ++i) {
      const double magnitude = 1.5 + 0.5 * unit(rng);  // |p| in [1, 2]: the decay never flips a sign
      p[i] = static_cast<float>(unit(rng) < 0 ? -magnitude : magnitude);
      rp[i] = p[i];
      mean[i] = unit(rng);
    }
    for (int64_t step = 1; step <= kSteps; ++step) {
      const AdamScalars s = MakeAdamScalars(h, step);
      const double bc1 = 1.0 - std::pow(b1, static_cast<double>(step));
      const double bc2 = 1.0 - std::pow(b2, static_cast<double>(step));
      for (size_t i = 0; i < kN; ++i) {
        const float g = static_cast<float>(mean[i] + normal(rng));
        AdamUpdate(s, p[i], m[i], v[i], g);
        rm[i] = b1 * rm[i] + (1.0 - b1) * g;
        rv[i] = b2 * rv[i] + (1.0 - b2) * static_cast<double>(g) * g;
        rp[i] -= lr * wd * rp[i];
        rp[i] -= lr * (rm[i] / bc1) / (std::sqrt(rv[i] / bc2) + eps);
      }
    }
    double bias = 0;
    for (size_t i = 0; i < kN; ++i) bias += (std::fabs(p[i]) - std::fabs(rp[i])) / std::fabs(rp[i]);
    bias /= kN;
    std::printf("lr * wd = %g: mean relative excess of |p| %.3g (bound %.0e)\n", lr_wd, bias,
                kBiasBound);
    EXPECT_LE(std::fabs(bias), kBiasBound)
        << "lr * wd = " << lr_wd << ": mean relative excess of |p| after " << kSteps
        << " steps (the decay over the run is " << lr_wd * kSteps << " relative)";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Modes, AdamLongRun,
    ::testing::Values(
        LongRunCase{AdamMode::kAdamW, true, 0.1f, 1e-8f, 1e-3, 1e1, 1.0},
        LongRunCase{AdamMode::kAdamW, false, 0.1f, 1e-8f, 1e-3, 1e1, 0.37},
        LongRunCase{AdamMode::kAdamL2, true, 0.01f, 1e-8f, 1e-3, 1e1, 1.0},
        LongRunCase{AdamMode::kAdamL2, false, 0.01f, 1e-8f, 1e-3, 1e1, 0.37},
        // eps comparable to sqrt(v) for some elements.
        LongRunCase{AdamMode::kAdamW, true, 0.05f, 1e-3f, 1e-5, 1e-1, 1.0},
        LongRunCase{AdamMode::kAdamL2, true, 0.05f, 1e-3f, 1e-5, 1e-1, 1.0}),
    [](const ::testing::TestParamInfo<LongRunCase>& param_info) {
      const LongRunCase& c = param_info.param;
      return absl::StrFormat("%s%s%s", c.mode == AdamMode::kAdamW ? "AdamW" : "AdamL2",
                             c.bias_correction ? "_BiasCorrection" : "_NoBiasCorrection",
                             c.eps > 1e-6f ? "_LargeEps" : "");
    });

}  // namespace
}  // namespace ferry
