// CPU Adam vs a float64 reference, and independence from the thread count.
#include "optim/cpu_adam.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace ferry {
namespace {

struct Ref {
  std::vector<double> p, m, v;
};

// The textbook update in double precision (the same formula as adam_math.h, no FMAs).
void RefStep(Ref& r, const std::vector<float>& g, const AdamHyper& h, int64_t step) {
  const double b1 = h.beta1, b2 = h.beta2;
  const double bc1 = h.bias_correction ? 1.0 - std::pow(b1, static_cast<double>(step)) : 1.0;
  const double bc2 = h.bias_correction ? 1.0 - std::pow(b2, static_cast<double>(step)) : 1.0;
  for (size_t i = 0; i < r.p.size(); ++i) {
    double gi = g[i];
    if (h.mode == AdamMode::kAdamL2) gi += static_cast<double>(h.weight_decay) * r.p[i];
    r.m[i] = b1 * r.m[i] + (1 - b1) * gi;
    r.v[i] = b2 * r.v[i] + (1 - b2) * gi * gi;
    const double denom = std::sqrt(r.v[i]) / std::sqrt(bc2) + static_cast<double>(h.eps);
    if (h.mode == AdamMode::kAdamW) r.p[i] *= 1.0 - static_cast<double>(h.lr) * static_cast<double>(h.weight_decay);
    r.p[i] -= static_cast<double>(h.lr) * (r.m[i] / bc1) / denom;
  }
}

class CpuAdamTest : public ::testing::TestWithParam<std::tuple<AdamMode, bool>> {};

// 1,000 steps on a few thousand elements of fresh random data. Each fp32 step adds a relative rounding
// error of a few ulps (~1e-7) to an update of size ~lr; over 1,000 steps the master drifts at most by
// about 1e3 * lr * 1e-6 absolute. The bound asserted: |p - p_ref| <= 1e-4 * max(1, |p_ref|).
TEST_P(CpuAdamTest, MatchesFloat64Reference) {
  const auto [mode, bias_correction] = GetParam();
  AdamHyper h;
  h.lr = 1e-3f;
  h.weight_decay = 0.1f;
  h.mode = mode;
  h.bias_correction = bias_correction;
  std::mt19937_64 rng(static_cast<uint64_t>(mode) * 10 + bias_correction);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const size_t n = 3001;
  std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f), g(n);
  Ref ref{std::vector<double>(n), std::vector<double>(n, 0.0), std::vector<double>(n, 0.0)};
  for (size_t i = 0; i < n; ++i) ref.p[i] = p[i] = normal(rng);
  const std::vector<float> initial = p;
  ThreadPool pool(3);
  CpuAdam adam(&pool, 256);
  double worst = 0;
  for (int64_t step = 1; step <= 1000; ++step) {
    for (float& x : g) x = normal(rng) * 0.5f;
    AdamScalars s = MakeAdamScalars(h, step);
    CpuAdamTensor t{p.data(), m.data(), v.data(), g.data(), nullptr, static_cast<int64_t>(n), DType::kF32,
                    DType::kF32, &s};
    ASSERT_TRUE(adam.Step({&t, 1}).ok());
    RefStep(ref, g, h, step);
  }
  for (size_t i = 0; i < n; ++i) {
    const double err = std::fabs(static_cast<double>(p[i]) - ref.p[i]) / std::max(1.0, std::fabs(ref.p[i]));
    worst = std::max(worst, err);
    ASSERT_LE(err, 1e-4) << "element " << i << ": " << p[i] << " vs " << ref.p[i];
  }
  // The params moved far more than the bound, so the comparison is meaningful.
  double moved = 0;
  for (size_t i = 0; i < n; ++i) moved = std::max(moved, std::fabs(static_cast<double>(p[i] - initial[i])));
  EXPECT_GT(moved, 1e-2);
  std::printf("worst relative error after 1000 steps: %.3g (bound 1e-4); largest move %.3g\n", worst, moved);
}

INSTANTIATE_TEST_SUITE_P(Modes, CpuAdamTest,
                         ::testing::Combine(::testing::Values(AdamMode::kAdamW, AdamMode::kAdamL2),
                                            ::testing::Bool()));

// bf16 grads in, bf16 params out; 1, 2, 7 threads and odd block sizes give the same bits.
TEST(CpuAdamThreads, ResultsDoNotDependOnThreadCount) {
  std::mt19937_64 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const size_t n = 100003;
  std::vector<float> p0(n);
  std::vector<uint16_t> g(n);
  for (size_t i = 0; i < n; ++i) {
    p0[i] = normal(rng);
    g[i] = F32ToBF16(normal(rng));
  }
  AdamHyper h;
  AdamScalars s = MakeAdamScalars(h, 3);
  std::vector<std::vector<uint16_t>> outs;
  std::vector<std::vector<float>> masters;
  for (size_t threads : {1, 2, 7}) {
    for (int64_t block : {1 << 16, 1000, 17}) {
      ThreadPool pool(threads);
      CpuAdam adam(&pool, block);
      std::vector<float> p = p0, m(n, 0.01f), v(n, 0.02f);
      std::vector<uint16_t> out(n);
      CpuAdamTensor t{p.data(), m.data(), v.data(), g.data(), out.data(), static_cast<int64_t>(n), DType::kBF16,
                      DType::kBF16, &s};
      ASSERT_TRUE(adam.Step({&t, 1}).ok());
      outs.push_back(out);
      masters.push_back(p);
    }
  }
  for (size_t k = 1; k < outs.size(); ++k) {
    EXPECT_EQ(outs[k], outs[0]) << k;
    EXPECT_EQ(0, std::memcmp(masters[k].data(), masters[0].data(), n * 4)) << k;
  }
  for (size_t i = 0; i < n; i += 997) EXPECT_EQ(outs[0][i], F32ToBF16(masters[0][i]));
  EXPECT_NE(0, std::memcmp(masters[0].data(), p0.data(), n * 4));
}

TEST(CpuAdamErrors, NullPointersAreRefused) {
  ThreadPool pool(1);
  CpuAdam adam(&pool);
  AdamScalars s = MakeAdamScalars(AdamHyper{}, 1);
  CpuAdamTensor t{nullptr, nullptr, nullptr, nullptr, nullptr, 4, DType::kF32, DType::kF32, &s};
  EXPECT_EQ(adam.Step({&t, 1}).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ferry
