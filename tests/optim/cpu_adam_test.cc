// CpuAdam: every implementation (scalar, AVX2, AVX-512, AVX-512 with BF16) against a float64 reference
// over 1,000 steps; all of them bit-identical to the scalar path, whatever the lengths, alignments and
// thread counts; dtype conversions equal to ferry/dtype.h; the gradient check (exact sum of squares against
// a big-integer reference, any split of the tensors, NaN/Inf detection) and the skip, unscaling and clipping it drives; errors.
//
// Paths this CPU lacks are skipped with a message.
#include "optim/cpu_adam.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "base/adam_element.h"
#include "device/adam_reference.h"
#include "gtest/gtest.h"
#include "optim/cpu_adam_kernels.h"
#include "trace/tracer.h"

namespace ferry {
namespace {

constexpr CpuAdamIsa kIsas[] = {CpuAdamIsa::kScalar, CpuAdamIsa::kAvx2, CpuAdamIsa::kAvx512,
                                CpuAdamIsa::kAvx512Bf16};
constexpr DType kTypes[] = {DType::kF32, DType::kBF16, DType::kF16};

uint64_t FreshSeed() { return std::random_device{}(); }

std::string IsaName(CpuAdamIsa isa) { return std::string(CpuAdamIsaName(isa)); }

#define FERRY_SKIP_UNLESS_SUPPORTED(isa)                                             \
  do {                                                                               \
    if (!CpuSupportsAdamIsa(isa)) GTEST_SKIP() << "this CPU lacks " << IsaName(isa); \
  } while (0)

CpuAdam MakeAdam(ThreadPool* pool, CpuAdamIsa isa, int64_t block = 1 << 16) {
  return CpuAdam(pool, CpuAdamOptions{.isa = isa, .block_elements = block});
}

// One tensor in host memory. Each buffer starts `offset` elements past a 64-byte boundary, so starts
// are unaligned for the vector loops.
struct HostTensor {
  int64_t numel = 0;
  DType grad_dtype = DType::kF32;
  DType param_dtype = DType::kF32;
  bool has_param = true;
  int offset = 0;
  size_t group = 0;
  std::vector<float> master_buf, m_buf, v_buf;
  std::vector<uint8_t> grad_buf, param_buf;

  HostTensor(int64_t n, DType gt, DType pt, bool param, int off, size_t grp)
      : numel(n), grad_dtype(gt), param_dtype(pt), has_param(param), offset(off), group(grp) {
    const size_t padded = static_cast<size_t>(n) + 32;
    master_buf.assign(padded, 0.0f);
    m_buf.assign(padded, 0.0f);
    v_buf.assign(padded, 0.0f);
    grad_buf.assign(padded * 4, 0);
    param_buf.assign(padded * 4, 0);
  }
  // A copy with its own buffers (the same skew relative to them).
  HostTensor(const HostTensor& o)
      : HostTensor(o.numel, o.grad_dtype, o.param_dtype, o.has_param, o.offset, o.group) {
    HostTensor& src = const_cast<HostTensor&>(o);
    const size_t n = static_cast<size_t>(numel);
    std::memcpy(master(), src.master(), 4 * n);
    std::memcpy(m(), src.m(), 4 * n);
    std::memcpy(v(), src.v(), 4 * n);
    std::memcpy(grad(), src.grad(), DTypeSize(grad_dtype) * n);
    if (has_param) std::memcpy(param(), src.param(), DTypeSize(param_dtype) * n);
  }
  HostTensor(HostTensor&&) = default;
  HostTensor& operator=(const HostTensor&) = delete;

  static size_t Skew(const void* p, size_t esize, int offset) {
    // Elements to skip so that element 0 sits `offset` elements past a 64-byte boundary.
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    return ((64 - a % 64) % 64) / esize + static_cast<size_t>(offset);
  }
  float* master() { return master_buf.data() + Skew(master_buf.data(), 4, offset); }
  float* m() { return m_buf.data() + Skew(m_buf.data(), 4, offset); }
  float* v() { return v_buf.data() + Skew(v_buf.data(), 4, offset); }
  void* grad() {
    const size_t e = DTypeSize(grad_dtype);
    return grad_buf.data() + Skew(grad_buf.data(), e, offset) * e;
  }
  void* param() {
    const size_t e = DTypeSize(param_dtype);
    return has_param ? param_buf.data() + Skew(param_buf.data(), e, offset) * e : nullptr;
  }
  CpuAdamTensor Args(const AdamScalars* scalars) {
    return CpuAdamTensor{master(), m(), v(), grad(), param(), numel, grad_dtype, param_dtype, scalars};
  }
  // Everything the step may write, as bytes.
  std::vector<uint8_t> Snapshot() {
    const size_t n = static_cast<size_t>(numel);
    std::vector<uint8_t> out(12 * n + (has_param ? DTypeSize(param_dtype) * n : 0));
    std::memcpy(out.data(), master(), 4 * n);
    std::memcpy(out.data() + 4 * n, m(), 4 * n);
    std::memcpy(out.data() + 8 * n, v(), 4 * n);
    if (has_param) std::memcpy(out.data() + 12 * n, param(), DTypeSize(param_dtype) * n);
    return out;
  }
};

// The four scalar sets of the reference tests: AdamW / L2, bias correction on / off.
std::vector<AdamHyper> Groups() {
  return {
      {.lr = 1e-3f,
       .beta1 = 0.9f,
       .beta2 = 0.999f,
       .eps = 1e-8f,
       .weight_decay = 0.01f,
       .mode = AdamMode::kAdamW,
       .bias_correction = true},
      {.lr = 3e-3f,
       .beta1 = 0.8f,
       .beta2 = 0.99f,
       .eps = 1e-6f,
       .weight_decay = 0.1f,
       .mode = AdamMode::kAdamW,
       .bias_correction = false},
      {.lr = 2e-3f,
       .beta1 = 0.9f,
       .beta2 = 0.95f,
       .eps = 1e-8f,
       .weight_decay = 0.05f,
       .mode = AdamMode::kAdamL2,
       .bias_correction = true},
      {.lr = 5e-4f,
       .beta1 = 0.95f,
       .beta2 = 0.999f,
       .eps = 1e-7f,
       .weight_decay = 0.0f,
       .mode = AdamMode::kAdamL2,
       .bias_correction = false},
  };
}

// RefUpdate (the textbook update in double) comes from tests/device/adam_reference.h.

void FillGrad(HostTensor& t, std::mt19937_64& rng, double scale) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t i = 0; i < t.numel; ++i) {
    StoreFromF32(t.grad(), t.grad_dtype, static_cast<size_t>(i), static_cast<float>(normal(rng) * scale));
  }
}

// ---- float64 reference, 1,000 steps -----------------------------------------------------------------

class CpuAdamIsaTest : public ::testing::TestWithParam<CpuAdamIsa> {};

// Error bound. The reference runs the same formula in double from the same float inputs (initial
// masters, gradients decoded from their dtype); each fp32 step differs by rounding only (relative 2^-24
// per operation and per scalar). The master's error grows linearly over the steps:
// |p - p_ref| <= 1e-4 |p_ref| + 1e-3 lr after 1,000 steps; the moments are contractions:
// |m - m_ref| <= 1e-5 |m_ref| + 1e-6 s (s the gradient scale), likewise v with s^2, plus the master's
// error fed back through wd * p under Adam-L2. (The same bounds as the device layer's reference test;
// a wrong bias correction, a missed decay or a bf16-rounded state miss them by orders of magnitude.)
TEST_P(CpuAdamIsaTest, MatchesFloat64ReferenceOver1000Steps) {
  const CpuAdamIsa isa = GetParam();
  FERRY_SKIP_UNLESS_SUPPORTED(isa);
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrFormat("seed %u", seed));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const std::vector<AdamHyper> groups = Groups();
  const int64_t kLengths[] = {1, 7, 17, 33, 257, 1234};
  const double kScales[] = {1e-3, 0.1, 1.0, 3.0};
  std::vector<HostTensor> tensors;
  std::vector<double> grad_scale;
  for (DType gt : kTypes) {
    for (DType pt : kTypes) {
      for (int64_t n : kLengths) {
        const size_t k = tensors.size();
        tensors.emplace_back(n, gt, pt, /*param=*/k % 7 != 3, /*offset=*/static_cast<int>(k % 5),
                             /*group=*/k % groups.size());
        grad_scale.push_back(kScales[(k / 3) % 4]);
      }
    }
  }
  std::vector<std::vector<double>> rp(tensors.size()), rm(tensors.size()), rv(tensors.size());
  std::vector<std::vector<float>> initial(tensors.size());
  for (size_t k = 0; k < tensors.size(); ++k) {
    HostTensor& t = tensors[k];
    for (int64_t i = 0; i < t.numel; ++i) t.master()[i] = normal(rng);
    initial[k].assign(t.master(), t.master() + t.numel);
    rp[k].assign(t.master(), t.master() + t.numel);
    rm[k].assign(static_cast<size_t>(t.numel), 0.0);
    rv[k].assign(static_cast<size_t>(t.numel), 0.0);
  }
  ThreadPool pool(3);
  CpuAdam adam = MakeAdam(&pool, isa, /*block=*/64);
  ASSERT_EQ(adam.isa(), isa);
  constexpr int64_t kSteps = 1000;
  for (int64_t step = 1; step <= kSteps; ++step) {
    std::vector<AdamScalars> scalars;
    for (const AdamHyper& h : groups) scalars.push_back(MakeAdamScalars(h, step));
    std::vector<CpuAdamTensor> args;
    for (size_t k = 0; k < tensors.size(); ++k) {
      HostTensor& t = tensors[k];
      FillGrad(t, rng, grad_scale[k]);
      for (int64_t i = 0; i < t.numel; ++i) {
        const size_t e = static_cast<size_t>(i);
        RefUpdate(groups[t.group], 1.0, step, rp[k][e], rm[k][e], rv[k][e],
                  LoadAsF32(t.grad(), t.grad_dtype, e));
      }
      args.push_back(t.Args(&scalars[t.group]));
    }
    ASSERT_TRUE(adam.Step(args).ok());
  }
  double worst_p = 0, worst_m = 0, worst_v = 0;
  for (size_t k = 0; k < tensors.size(); ++k) {
    HostTensor& t = tensors[k];
    const AdamHyper& h = groups[t.group];
    const double lr = h.lr, gs = grad_scale[k], wd = h.weight_decay;
    const bool l2 = h.mode == AdamMode::kAdamL2;
    bool moved = false;
    for (size_t i = 0; i < static_cast<size_t>(t.numel); ++i) {
      const double bound_p = 1e-4 * std::abs(rp[k][i]) + 1e-3 * lr;
      const double fed_back = l2 ? wd * bound_p : 0.0;
      const double bound_m = 1e-5 * std::abs(rm[k][i]) + 1e-6 * gs + fed_back;
      const double bound_v =
          1e-5 * std::abs(rv[k][i]) + 1e-6 * gs * gs + 2.0 * std::sqrt(rv[k][i]) * fed_back;
      const double ep = std::abs(t.master()[i] - rp[k][i]);
      const double em = std::abs(t.m()[i] - rm[k][i]);
      const double ev = std::abs(t.v()[i] - rv[k][i]);
      worst_p = std::max(worst_p, ep / bound_p);
      worst_m = std::max(worst_m, em / bound_m);
      worst_v = std::max(worst_v, ev / bound_v);
      ASSERT_LE(ep, bound_p) << "tensor " << k << " master[" << i << "]";
      ASSERT_LE(em, bound_m) << "tensor " << k << " exp_avg[" << i << "]";
      ASSERT_LE(ev, bound_v) << "tensor " << k << " exp_avg_sq[" << i << "]";
      if (t.master()[i] != initial[k][i]) moved = true;
      if (t.has_param) {
        uint8_t want[4];
        StoreFromF32(want, t.param_dtype, 0, t.master()[i]);
        const size_t es = DTypeSize(t.param_dtype);
        ASSERT_EQ(0, std::memcmp(want, static_cast<uint8_t*>(t.param()) + i * es, es))
            << "tensor " << k << " param[" << i << "] is not the master rounded";
      }
    }
    EXPECT_TRUE(moved) << "tensor " << k;
  }
  std::printf("%s: worst error / bound after %d steps: master %.3g, exp_avg %.3g, exp_avg_sq %.3g\n",
              IsaName(isa).c_str(), static_cast<int>(kSteps), worst_p, worst_m, worst_v);
}

// ---- bit identity -----------------------------------------------------------------------------------

// Random values with the awkward ones mixed in: zeros of both signs, subnormals, values near overflow
// of f16 and of f32, rounding ties of the 16-bit types.
float AwkwardFloat(std::mt19937_64& rng) {
  static const uint32_t kSpecial[] = {0x00000000u, 0x80000000u, 0x00000001u, 0x807fffffu, 0x00400000u,
                                      0x477fefffu, 0x477ff000u, 0x477fe000u, 0x33000000u, 0x33000001u,
                                      0x387fe000u, 0x38800000u, 0x3f808000u, 0x3f818000u, 0x7f7fffffu,
                                      0xff7fffffu, 0x3f800000u, 0x00008000u, 0x80018000u};
  const uint64_t r = rng();
  switch (r % 8) {
    case 0: return F32FromBits(kSpecial[(r >> 8) % (sizeof(kSpecial) / 4)]);
    case 1: return F32FromBits(static_cast<uint32_t>(r >> 32) & 0x807fffffu);  // subnormal
    case 2: {                                                                  // any exponent
      const uint32_t bits = static_cast<uint32_t>(r >> 32);
      return (bits & 0x7f800000u) == 0x7f800000u ? 1.5f : F32FromBits(bits);
    }
    default: return std::normal_distribution<float>(0.0f, 1.0f)(rng);
  }
}

// Runs `steps` steps on a fresh copy of `proto` tensors with `isa` and `threads` workers; returns the
// bytes of every output.
struct Scenario {
  std::vector<HostTensor> tensors;
  std::vector<std::vector<std::vector<uint8_t>>> grads;  // [step][tensor] bytes
  std::vector<AdamHyper> groups;
};

Scenario MakeScenario(uint64_t seed, int steps, bool nonfinite_grads) {
  Scenario s;
  std::mt19937_64 rng(seed);
  s.groups = Groups();
  s.groups[0].weight_decay = 0.0f;  // AdamW without decay: the fma with wd = 0 still runs
  std::vector<int64_t> lengths;
  for (int64_t n = 1; n <= 40; ++n) lengths.push_back(n);
  for (int64_t n : {63, 64, 65, 1000, 4097, 20011}) lengths.push_back(n);
  size_t k = 0;
  for (int64_t n : lengths) {
    for (DType gt : kTypes) {
      const DType pt = kTypes[(k / 3) % 3];
      s.tensors.emplace_back(n, gt, pt, /*param=*/k % 5 != 4, /*offset=*/static_cast<int>(k % 17),
                             /*group=*/k % s.groups.size());
      HostTensor& t = s.tensors.back();
      for (int64_t i = 0; i < n; ++i) {
        t.master()[i] = AwkwardFloat(rng);
        t.m()[i] = 0.01f * std::normal_distribution<float>(0.0f, 1.0f)(rng);
        t.v()[i] = 1e-4f * std::abs(std::normal_distribution<float>(0.0f, 1.0f)(rng));
      }
      ++k;
    }
  }
  s.grads.resize(static_cast<size_t>(steps));
  for (auto& per_step : s.grads) {
    for (HostTensor& t : s.tensors) {
      std::vector<uint8_t> g(DTypeSize(t.grad_dtype) * static_cast<size_t>(t.numel));
      for (size_t i = 0; i < static_cast<size_t>(t.numel); ++i) {
        float x = AwkwardFloat(rng);
        if (nonfinite_grads && rng() % 97 == 0) {
          x = rng() % 3 == 0 ? std::numeric_limits<float>::quiet_NaN()
                             : (rng() % 2 ? 1.0f : -1.0f) * std::numeric_limits<float>::infinity();
        }
        StoreFromF32(g.data(), t.grad_dtype, i, x);
      }
      per_step.push_back(std::move(g));
    }
  }
  return s;
}

// How RunScenario hands each step to CpuAdam: one Step, or (kStarted) the tensors in three rounds
// started back to back, the caller helping with the second, finished in the order started.
enum class Handing { kStep, kStarted };

std::vector<std::vector<uint8_t>> RunScenario(Scenario s, CpuAdamIsa isa, size_t threads, int64_t block,
                                              Handing handing = Handing::kStep) {
  ThreadPool pool(threads);
  CpuAdam adam = MakeAdam(&pool, isa, block);
  EXPECT_EQ(adam.isa(), isa);
  for (size_t step = 0; step < s.grads.size(); ++step) {
    std::vector<AdamScalars> scalars;
    for (const AdamHyper& h : s.groups) {
      scalars.push_back(MakeAdamScalars(h, static_cast<int64_t>(step) + 1, step % 2 ? 0.37 : 1.0));
    }
    std::vector<CpuAdamTensor> args;
    for (size_t k = 0; k < s.tensors.size(); ++k) {
      HostTensor& t = s.tensors[k];
      std::memcpy(t.grad(), s.grads[step][k].data(), s.grads[step][k].size());
      args.push_back(t.Args(&scalars[t.group]));
    }
    if (handing == Handing::kStep) {
      EXPECT_TRUE(adam.Step(args).ok());
      continue;
    }
    const size_t third = args.size() / 3;
    const absl::Span<const CpuAdamTensor> all(args);
    std::vector<CpuAdamPending> rounds;
    for (absl::Span<const CpuAdamTensor> part : {all.subspan(0, third), all.subspan(third, third), all.subspan(2 * third)}) {
      absl::StatusOr<CpuAdamPending> round = adam.Start(part, CpuAdamStepOptions{});
      EXPECT_TRUE(round.ok()) << round.status();
      if (round.ok()) rounds.push_back(*std::move(round));
    }
    if (rounds.size() == 3) {
      while (rounds[1].HelpOne()) {
      }
    }
    for (CpuAdamPending& round : rounds) EXPECT_FALSE(round.Finish().skipped);
  }
  std::vector<std::vector<uint8_t>> out;
  for (HostTensor& t : s.tensors) out.push_back(t.Snapshot());
  return out;
}

void ExpectSameBytes(const std::vector<std::vector<uint8_t>>& want,
                     const std::vector<std::vector<uint8_t>>& got, const Scenario& s,
                     const std::string& what) {
  ASSERT_EQ(want.size(), got.size());
  for (size_t k = 0; k < want.size(); ++k) {
    ASSERT_EQ(want[k].size(), got[k].size());
    if (want[k] == got[k]) continue;
    size_t b = 0;
    while (want[k][b] == got[k][b]) ++b;
    const size_t n = static_cast<size_t>(s.tensors[k].numel);
    const char* field = b < 4 * n ? "master" : b < 8 * n ? "exp_avg" : b < 12 * n ? "exp_avg_sq" : "param";
    ADD_FAILURE() << what << ": tensor " << k << " (n " << n << ", grad "
                  << DTypeName(s.tensors[k].grad_dtype) << ", param " << DTypeName(s.tensors[k].param_dtype)
                  << ", offset " << s.tensors[k].offset << ") differs first in " << field << " at byte " << b;
    return;
  }
}

// Every vector path equals the scalar path bit for bit: lengths 1..40 and around the vector widths,
// unaligned starts, every dtype pair, subnormal / huge / tie values, NaN and Inf gradients.
TEST_P(CpuAdamIsaTest, BitIdenticalToScalarPath) {
  const CpuAdamIsa isa = GetParam();
  FERRY_SKIP_UNLESS_SUPPORTED(isa);
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrFormat("seed %u", seed));
  for (bool nonfinite : {false, true}) {
    const Scenario s = MakeScenario(seed, 3, nonfinite);
    const auto want = RunScenario(s, CpuAdamIsa::kScalar, 2, 1000);
    const auto got = RunScenario(s, isa, 3, 1000);
    ExpectSameBytes(want, got, s, IsaName(isa) + (nonfinite ? " with NaN/Inf gradients" : ""));
  }
}

// 1, 2, 7 and all threads, and several work sizes, give the same bits.
TEST_P(CpuAdamIsaTest, ThreadCountsAreBitIdentical) {
  const CpuAdamIsa isa = GetParam();
  FERRY_SKIP_UNLESS_SUPPORTED(isa);
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrFormat("seed %u", seed));
  const Scenario s = MakeScenario(seed, 2, false);
  const auto want = RunScenario(s, isa, 1, 1 << 16);
  for (size_t threads : {size_t{1}, size_t{2}, size_t{7}, ThreadPool::DefaultThreads()}) {
    for (int64_t block : {17, 4096}) {
      ExpectSameBytes(want, RunScenario(s, isa, threads, block), s,
                      absl::StrFormat("%s, %d threads, block %d", IsaName(isa), threads, block));
    }
  }
}

// Rounds started back to back (Start, no barrier between them on the workers) give the same bits as
// one Step over the same tensors.
TEST_P(CpuAdamIsaTest, RoundsStartedBackToBackEqualOneStep) {
  const CpuAdamIsa isa = GetParam();
  FERRY_SKIP_UNLESS_SUPPORTED(isa);
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrFormat("seed %u", seed));
  const Scenario s = MakeScenario(seed, 3, /*nonfinite_grads=*/true);
  const auto want = RunScenario(s, isa, 1, 1 << 16);
  for (size_t threads : {size_t{1}, size_t{3}, ThreadPool::DefaultThreads()}) {
    for (int64_t block : {int64_t{17}, kDefaultBlockElements}) {
      ExpectSameBytes(want, RunScenario(s, isa, threads, block, Handing::kStarted), s,
                      absl::StrFormat("%s, started rounds, %d threads, block %d", IsaName(isa), threads, block));
    }
  }
}

// With lr = 0 the master keeps its value (NaN becomes quiet), so the param output is the conversion of
// arbitrary float bit patterns: it must equal ferry/dtype.h's StoreFromF32 for every pattern.
TEST_P(CpuAdamIsaTest, ParamConversionsEqualDtypeH) {
  const CpuAdamIsa isa = GetParam();
  FERRY_SKIP_UNLESS_SUPPORTED(isa);
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrFormat("seed %u", seed));
  std::mt19937_64 rng(seed);
  // Every exponent with random mantissas, both signs, plus the specials of AwkwardFloat and NaNs with
  // payloads.
  std::vector<uint32_t> bits;
  for (uint32_t e = 0; e < 256; ++e) {
    for (int r = 0; r < 256; ++r) {
      bits.push_back((static_cast<uint32_t>(rng()) & 0x807fffffu) | (e << 23));
    }
  }
  for (int r = 0; r < 4096; ++r) bits.push_back(F32Bits(AwkwardFloat(rng)));
  for (uint32_t b : {0x7fc00000u, 0xffc00001u, 0x7f800001u, 0x7fbfffffu, 0xff800000u, 0x7f800000u})
    bits.push_back(b);
  const int64_t n = static_cast<int64_t>(bits.size());
  AdamHyper h;
  h.lr = 0.0f;
  const AdamScalars scalars = MakeAdamScalars(h, 1);
  ThreadPool pool(2);
  CpuAdam adam = MakeAdam(&pool, isa, 4096);
  for (DType pt : kTypes) {
    HostTensor t(n, DType::kF32, pt, true, 3, 0);
    std::memcpy(t.master(), bits.data(), 4 * bits.size());
    ASSERT_TRUE(adam.Step({t.Args(&scalars)}).ok());
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t master = F32Bits(t.master()[i]);
      const bool was_nan = (bits[static_cast<size_t>(i)] & 0x7fffffffu) > 0x7f800000u;
      if (!was_nan && (bits[static_cast<size_t>(i)] & 0x7f800000u) != 0x7f800000u) {
        ASSERT_EQ(master, bits[static_cast<size_t>(i)]) << "finite master changed with lr = 0 at " << i;
      }
      uint8_t want[4];
      StoreFromF32(want, pt, 0, t.master()[i]);
      const size_t es = DTypeSize(pt);
      ASSERT_EQ(0, std::memcmp(want, static_cast<uint8_t*>(t.param()) + static_cast<size_t>(i) * es, es))
          << DTypeName(pt) << " conversion of 0x" << std::hex << master;
    }
  }
}

// ---- the gradient check -------------------------------------------------------------------------------

// The reference GradStats (tests/base/exact_sum_reference.h) over the tensors.
GradStats RefStats(const std::vector<CpuGradTensor>& grads) {
  std::vector<RefGrad> ref;
  for (const CpuGradTensor& g : grads) ref.push_back(RefGrad{g.grad, g.numel, g.dtype});
  return RefGradStats(ref);
}

struct GradSet {
  std::vector<std::vector<uint8_t>> storage;
  std::vector<CpuGradTensor> grads;
};

GradSet MakeGrads(std::mt19937_64& rng, const std::vector<int64_t>& lengths) {
  GradSet set;
  set.storage.reserve(lengths.size());
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (size_t k = 0; k < lengths.size(); ++k) {
    const DType dt = kTypes[k % 3];
    const int64_t n = lengths[k];
    const float scale = std::ldexp(1.0f, static_cast<int>(rng() % 20) - 10);
    set.storage.emplace_back(DTypeSize(dt) * static_cast<size_t>(n) + 8);
    const size_t skew = (k % 2) * DTypeSize(dt);  // every other tensor starts off its vector alignment
    for (int64_t i = 0; i < n; ++i) {
      StoreFromF32(set.storage.back().data() + skew, dt, static_cast<size_t>(i), normal(rng) * scale);
    }
    set.grads.push_back(CpuGradTensor{set.storage.back().data() + skew, n, dt});
  }
  return set;
}

// Overwrites every other element with a value of random exponent over the dtype's whole finite range
// (subnormals to the largest), so the sum needs all of its digits.
void WidenMagnitudes(std::mt19937_64& rng, GradSet& set) {
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  for (const CpuGradTensor& g : set.grads) {
    const double lo = g.dtype == DType::kF16 ? -24.0 : -149.0, hi = g.dtype == DType::kF16 ? 16.0 : 128.0;
    for (int64_t i = 0; i < g.numel; i += 2) {
      float x = static_cast<float>(std::ldexp(unit(rng), static_cast<int>(lo + (hi - lo) * unit(rng))));
      if (g.dtype == DType::kBF16 && x > 3.38e38f) x = 3.38e38f;  // stays finite in bf16
      StoreFromF32(const_cast<void*>(g.grad), g.dtype, static_cast<size_t>(i), x);
    }
  }
}

// Every path, thread count and task size computes the exact sum: the whole GradStats equals the
// big-integer reference's bit for bit, and sum_sq is within rounding of a long double sum.
TEST_P(CpuAdamIsaTest, GradStatsAreExact) {
  const CpuAdamIsa isa = GetParam();
  FERRY_SKIP_UNLESS_SUPPORTED(isa);
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrFormat("seed %u", seed));
  std::mt19937_64 rng(seed);
  const std::vector<std::vector<int64_t>> cases = {
      {},
      {0},
      {1},
      {4096},
      {5, 0, 4095, 4097, 12289, 3, 1},
      {1 << 20, 77, (1 << 19) + 1, 4096 * 3000 + 5},
  };
  for (int wide = 0; wide < 2; ++wide) {
    for (const auto& lengths : cases) {
      GradSet set = MakeGrads(rng, lengths);
      if (wide != 0) WidenMagnitudes(rng, set);
      const GradStats want = RefStats(set.grads);
      // sum_sq is the exact sum rounded once (2^-53 relative); a sequential long double sum of n
      // positive terms is within n * 2^-64 of it.
      long double naive = 0;
      int64_t n = 0;
      for (const CpuGradTensor& g : set.grads) {
        for (int64_t i = 0; i < g.numel; ++i, ++n) {
          const long double x = LoadAsF32(g.grad, g.dtype, static_cast<size_t>(i));
          naive += x * x;
        }
      }
      EXPECT_LE(std::abs(static_cast<long double>(want.sum_sq) - naive),
                (std::ldexp(1.0L, -53) + static_cast<long double>(n) * std::ldexp(1.0L, -64)) * naive)
          << "lengths " << lengths.size();
      for (size_t threads : {size_t{1}, size_t{7}, ThreadPool::DefaultThreads()}) {
        for (int64_t block : {int64_t{1000}, int64_t{1} << 16}) {
          ThreadPool pool(threads);
          CpuAdam adam = MakeAdam(&pool, isa, block);
          absl::StatusOr<GradStats> got = adam.ComputeGradStats(set.grads);
          ASSERT_TRUE(got.ok()) << got.status();
          EXPECT_TRUE(SameGradStats(*got, want))
              << IsaName(isa) << " " << threads << " threads, block " << block << ", wide " << wide << ": "
              << got->sum_sq << " vs " << want.sum_sq;
          EXPECT_EQ(got->found_inf, 0u);
        }
      }
    }
  }
}

// The tensors cut into pieces (as ranks hold ranges of the global tensors) in a shuffled list give the
// same GradStats; so do the pieces dealt to 1..4 "ranks", each rank's check merged through the exchange
// form (a sum of doubles, as an all-reduce computes it).
TEST_P(CpuAdamIsaTest, GradStatsOfAnySplitAreIdentical) {
  const CpuAdamIsa isa = GetParam();
  FERRY_SKIP_UNLESS_SUPPORTED(isa);
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrFormat("seed %u", seed));
  std::mt19937_64 rng(seed);
  ThreadPool pool(3);
  CpuAdam adam = MakeAdam(&pool, isa, 5000);
  for (int wide = 0; wide < 2; ++wide) {
    GradSet set = MakeGrads(rng, {100000, 1, 4097, 0, 33333, 7});
    if (wide != 0) WidenMagnitudes(rng, set);
    absl::StatusOr<GradStats> whole = adam.ComputeGradStats(set.grads);
    ASSERT_TRUE(whole.ok()) << whole.status();
    ASSERT_TRUE(SameGradStats(*whole, RefStats(set.grads)));
    for (int trial = 0; trial < 10; ++trial) {
      std::vector<CpuGradTensor> pieces;
      for (const CpuGradTensor& g : set.grads) {
        for (int64_t at = 0; at < g.numel;) {
          const int64_t len = std::min<int64_t>(g.numel - at, 1 + static_cast<int64_t>(rng() % 20000));
          pieces.push_back(CpuGradTensor{static_cast<const uint8_t*>(g.grad) + at * static_cast<int64_t>(
                                                                                   DTypeSize(g.dtype)),
                                         len, g.dtype});
          at += len;
        }
      }
      std::shuffle(pieces.begin(), pieces.end(), rng);
      absl::StatusOr<GradStats> got = adam.ComputeGradStats(pieces);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_TRUE(SameGradStats(*got, *whole)) << pieces.size() << " pieces";
      const size_t ranks = 1 + rng() % 4;
      std::vector<std::vector<CpuGradTensor>> by_rank(ranks);
      for (const CpuGradTensor& p : pieces) by_rank[rng() % ranks].push_back(p);
      std::vector<double> exchange(ExactSumSq::kExchangeDoubles, 0.0);
      bool any_inf = false;
      for (const std::vector<CpuGradTensor>& list : by_rank) {
        absl::StatusOr<GradStats> part = adam.ComputeGradStats(list);
        ASSERT_TRUE(part.ok()) << part.status();
        double out[ExactSumSq::kExchangeDoubles];
        part->exact.ToExchange(out);
        for (int i = 0; i < ExactSumSq::kExchangeDoubles; ++i) exchange[static_cast<size_t>(i)] += out[i];
        any_inf = any_inf || part->found_inf != 0;
      }
      const GradStats merged = GradStatsFromExact(ExactSumSq::FromExchange(exchange.data()), any_inf);
      EXPECT_TRUE(SameGradStats(merged, *whole)) << ranks << " ranks: " << merged.sum_sq << " vs " << whole->sum_sq;
    }
  }
}

TEST_P(CpuAdamIsaTest, GradStatsFindNaNAndInf) {
  const CpuAdamIsa isa = GetParam();
  FERRY_SKIP_UNLESS_SUPPORTED(isa);
  std::mt19937_64 rng(FreshSeed());
  ThreadPool pool(3);
  CpuAdam adam = MakeAdam(&pool, isa);
  const std::vector<int64_t> lengths = {5000, 4096, 77};
  for (int tensor = 0; tensor < 3; ++tensor) {
    for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                      -std::numeric_limits<float>::infinity()}) {
      GradSet set = MakeGrads(rng, lengths);
      const CpuGradTensor& g = set.grads[static_cast<size_t>(tensor)];
      const size_t at = static_cast<size_t>(rng() % static_cast<uint64_t>(g.numel));
      StoreFromF32(const_cast<void*>(g.grad), g.dtype, at, bad);
      absl::StatusOr<GradStats> got = adam.ComputeGradStats(set.grads);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(got->found_inf, 1u) << "tensor " << tensor << " element " << at << " = " << bad;
      EXPECT_FALSE(std::isfinite(got->sum_sq));
      EXPECT_TRUE(SameGradStats(*got, RefStats(set.grads)));  // the finite elements' exact sum
    }
  }
  // The largest finite values do not overflow the sum.
  std::vector<float> big(10000, 3.4028234e38f);
  absl::StatusOr<GradStats> got = adam.ComputeGradStats({CpuGradTensor{big.data(), 10000, DType::kF32}});
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->found_inf, 0u);
  EXPECT_EQ(got->sum_sq, 10000.0 * 3.4028234e38f * 3.4028234e38f);
}

// ---- the skip, unscaling and clipping -------------------------------------------------------------------

// A NaN or Inf gradient anywhere skips the whole step: nothing changes, and the result says so.
TEST_P(CpuAdamIsaTest, NonFiniteGradientSkipsTheWholeStep) {
  const CpuAdamIsa isa = GetParam();
  FERRY_SKIP_UNLESS_SUPPORTED(isa);
  std::mt19937_64 rng(FreshSeed());
  const std::vector<AdamHyper> groups = Groups();
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    for (bool precomputed : {false, true}) {
      std::vector<HostTensor> tensors;
      for (int k = 0; k < 6; ++k) {
        tensors.emplace_back(1000 + 37 * k, kTypes[k % 3], kTypes[(k / 3) % 3], true, k,
                             static_cast<size_t>(k) % 4);
        HostTensor& t = tensors.back();
        for (int64_t i = 0; i < t.numel; ++i)
          t.master()[i] = std::normal_distribution<float>(0.0f, 1.0f)(rng);
        FillGrad(t, rng, 0.1);
      }
      HostTensor& victim = tensors[4];
      StoreFromF32(victim.grad(), victim.grad_dtype, 123, bad);
      std::vector<AdamScalars> scalars;
      for (const AdamHyper& h : groups) scalars.push_back(MakeAdamScalars(h, 5));
      std::vector<CpuAdamTensor> args;
      std::vector<std::vector<uint8_t>> before;
      for (HostTensor& t : tensors) {
        args.push_back(t.Args(&scalars[t.group]));
        before.push_back(t.Snapshot());
      }
      ThreadPool pool(3);
      CpuAdam adam = MakeAdam(&pool, isa);
      CpuAdamStepOptions options;
      GradStats stats{};
      if (precomputed) {
        std::vector<CpuGradTensor> grads;
        for (const CpuAdamTensor& a : args) grads.push_back({a.grad, a.numel, a.grad_dtype});
        absl::StatusOr<GradStats> s = adam.ComputeGradStats(grads);
        ASSERT_TRUE(s.ok());
        stats = *s;
        options.grad_stats = &stats;
      } else {
        options.check_grads = true;
      }
      options.max_grad_norm = 1.0f;
      absl::StatusOr<CpuAdamStepResult> result = adam.Step(args, options);
      ASSERT_TRUE(result.ok()) << result.status();
      EXPECT_TRUE(result->skipped);
      EXPECT_EQ(result->grad_stats.found_inf, 1u);
      for (size_t k = 0; k < tensors.size(); ++k) {
        EXPECT_EQ(tensors[k].Snapshot(), before[k]) << "tensor " << k << " changed in a skipped step";
      }
      // With the bad value gone, the same step runs and changes everything.
      StoreFromF32(victim.grad(), victim.grad_dtype, 123, 0.5f);
      if (precomputed) {
        std::vector<CpuGradTensor> grads;
        for (const CpuAdamTensor& a : args) grads.push_back({a.grad, a.numel, a.grad_dtype});
        stats = *adam.ComputeGradStats(grads);
      }
      result = adam.Step(args, options);
      ASSERT_TRUE(result.ok()) << result.status();
      EXPECT_FALSE(result->skipped);
      for (size_t k = 0; k < tensors.size(); ++k) EXPECT_NE(tensors[k].Snapshot(), before[k]) << k;
    }
  }
}

// grad_scale and max_grad_norm give the multiplier AdamGradMultiplier computes, and the step equals a
// plain step with scalars carrying that multiplier, bit for bit. A power-of-two loss scale unscales
// exactly: the step equals the unscaled gradients' plain step.
TEST_P(CpuAdamIsaTest, UnscalingAndClippingSetTheMultiplier) {
  const CpuAdamIsa isa = GetParam();
  FERRY_SKIP_UNLESS_SUPPORTED(isa);
  std::mt19937_64 rng(FreshSeed());
  ThreadPool pool(2);
  CpuAdam adam = MakeAdam(&pool, isa);
  const AdamHyper h = Groups()[0];
  struct Case {
    float scale, max_norm;
  };
  for (const Case c :
       {Case{1024.0f, 0.0f}, Case{3000.0f, 0.0f}, Case{65536.0f, 0.5f}, Case{0.0f, 0.5f}, Case{0.0f, 1e9f}}) {
    HostTensor a(5000, DType::kF32, DType::kBF16, true, 1, 0);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int64_t i = 0; i < a.numel; ++i) {
      a.master()[i] = normal(rng);
      static_cast<float*>(a.grad())[i] = normal(rng) * 0.01f * (c.scale > 0 ? c.scale : 1.0f);
    }
    const HostTensor initial = a;
    HostTensor b = a;  // same contents, its own buffers
    const GradStats stats = *adam.ComputeGradStats({CpuGradTensor{a.grad(), a.numel, DType::kF32}});
    const AdamScalars plain = MakeAdamScalars(h, 3);
    CpuAdamStepOptions options;
    options.grad_scale = c.scale;
    options.max_grad_norm = c.max_norm;
    options.grad_stats = &stats;
    absl::StatusOr<CpuAdamStepResult> result = adam.Step({a.Args(&plain)}, options);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_FALSE(result->skipped);
    // The multiplier from its definition, in long double.
    const long double scale = c.scale > 0 ? c.scale : 1.0L;
    long double want = 1.0L / scale;
    if (c.max_norm > 0) {
      const long double clip =
          c.max_norm / (std::sqrt(static_cast<long double>(stats.sum_sq)) / scale + 1e-6L);
      if (clip < 1) want = clip / scale;
    }
    const float multiplier = AdamGradMultiplier(c.scale > 0 ? c.scale : 1.0f, stats.sum_sq, c.max_norm);
    EXPECT_LE(std::abs(multiplier - want), 0x1p-24L * want) << c.scale << " " << c.max_norm;
    if (c.max_norm == 0.5f) {
      EXPECT_LT(want * scale, 0.9L) << "the clip must bite in this case";
    }
    const AdamScalars with = MakeAdamScalars(h, 3, multiplier);
    ASSERT_TRUE(adam.Step({b.Args(&with)}).ok());
    EXPECT_EQ(a.Snapshot(), b.Snapshot()) << c.scale << " " << c.max_norm;
    if (c.scale == 1024.0f) {  // a power of two unscales exactly
      HostTensor u = initial;
      for (int64_t i = 0; i < u.numel; ++i) static_cast<float*>(u.grad())[i] /= 1024.0f;
      ASSERT_TRUE(adam.Step({u.Args(&plain)}).ok());
      EXPECT_EQ(a.Snapshot(), u.Snapshot());
    }
    EXPECT_NE(a.Snapshot(), HostTensor(initial).Snapshot()) << "the step must change the state";
  }
}

// ---- errors and configuration ---------------------------------------------------------------------------

TEST(CpuAdamErrors, BadArgumentsAreRefused) {
  ThreadPool pool(1);
  CpuAdam adam(&pool);
  ASSERT_TRUE(adam.init_status().ok()) << adam.init_status();
  AdamScalars s = MakeAdamScalars(AdamHyper{}, 1);
  std::vector<float> buf(64);
  CpuAdamTensor t{nullptr, nullptr, nullptr, nullptr, nullptr, 4, DType::kF32, DType::kF32, &s};
  EXPECT_EQ(adam.Step({&t, 1}).code(), absl::StatusCode::kInvalidArgument);
  t = CpuAdamTensor{
      buf.data(), buf.data() + 8, buf.data() + 16, buf.data() + 24, nullptr, 4, DType::kF32, DType::kF32, &s};
  EXPECT_TRUE(adam.Step({&t, 1}).ok());
  t.grad = reinterpret_cast<const char*>(buf.data() + 24) + 1;  // misaligned
  absl::Status st = adam.Step({&t, 1});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("not aligned"), absl::string_view::npos) << st;
  EXPECT_EQ(adam.Start({&t, 1}, CpuAdamStepOptions{}).status().code(), absl::StatusCode::kInvalidArgument);
  t.grad = buf.data() + 24;
  t.numel = -1;
  EXPECT_EQ(adam.Step({&t, 1}).code(), absl::StatusCode::kInvalidArgument);
  t.numel = 4;
  CpuAdamStepOptions o;
  o.grad_scale = -1.0f;
  EXPECT_EQ(adam.Step({&t, 1}, o).status().code(), absl::StatusCode::kInvalidArgument);
  o.grad_scale = std::numeric_limits<float>::infinity();
  EXPECT_EQ(adam.Step({&t, 1}, o).status().code(), absl::StatusCode::kInvalidArgument);
  o = {};
  o.max_grad_norm = 1.0f;  // clipping without a gradient check
  EXPECT_EQ(adam.Step({&t, 1}, o).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(adam.ComputeGradStats({CpuGradTensor{nullptr, 3, DType::kBF16}}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// A started round with the gradient check skips on a NaN gradient like Step: nothing changes, and
// Finish says so (once; a second Finish has nothing to report).
TEST(CpuAdamStart, GradientCheckSkipsTheRound) {
  ThreadPool pool(2);
  CpuAdam adam(&pool);
  ASSERT_TRUE(adam.init_status().ok()) << adam.init_status();
  std::mt19937_64 rng(FreshSeed());
  AdamScalars s = MakeAdamScalars(AdamHyper{}, 1);
  constexpr size_t kN = 1000;
  std::vector<float> master(kN), m(kN, 0.0f), v(kN, 0.0f), grad(kN);
  for (size_t i = 0; i < kN; ++i) {
    master[i] = std::normal_distribution<float>(0.0f, 1.0f)(rng);
    grad[i] = std::normal_distribution<float>(0.0f, 1.0f)(rng);
  }
  grad[rng() % kN] = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> before = master;
  CpuAdamTensor t{master.data(), m.data(), v.data(), grad.data(), nullptr, kN, DType::kF32, DType::kF32, &s};
  CpuAdamStepOptions o;
  o.check_grads = true;
  absl::StatusOr<CpuAdamPending> round = adam.Start({&t, 1}, o);
  ASSERT_TRUE(round.ok()) << round.status();
  EXPECT_FALSE(round->HelpOne());
  const CpuAdamStepResult result = round->Finish();
  EXPECT_TRUE(result.skipped);
  EXPECT_NE(result.grad_stats.found_inf, 0);
  EXPECT_EQ(master, before);
  EXPECT_FALSE(round->Finish().skipped);
}

// A round's result says when its last task ended: before a late Finish (the pipeline counts CPU
// Adam's busy time from it, not from when the early thread came back to finish the round).
TEST(CpuAdamStart, FinishTellsWhenTheRoundEnded) {
  ThreadPool pool(2, 0);
  CpuAdam adam(&pool);
  std::mt19937 rng(11);
  constexpr size_t kN = 4096;
  std::vector<float> master(kN), m(kN, 0.0f), v(kN, 0.0f), grad(kN);
  for (size_t i = 0; i < kN; ++i) {
    master[i] = std::normal_distribution<float>(0.0f, 1.0f)(rng);
    grad[i] = std::normal_distribution<float>(0.0f, 1.0f)(rng);
  }
  AdamScalars s = MakeAdamScalars(AdamHyper{}, 1);
  CpuAdamTensor t{master.data(), m.data(), v.data(), grad.data(), nullptr, kN, DType::kF32, DType::kF32, &s};
  const int64_t started = SteadyNs();
  absl::StatusOr<CpuAdamPending> round = adam.Start({&t, 1}, CpuAdamStepOptions{});
  ASSERT_TRUE(round.ok()) << round.status();
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the caller is late
  const int64_t late = SteadyNs();
  const CpuAdamStepResult result = round->Finish();
  EXPECT_GE(result.finished_ns, started);
  EXPECT_LT(result.finished_ns, late - 50'000'000) << "4096 elements take far less than 50 ms";
}

TEST(CpuAdamConfig, EnvironmentChoosesThePath) {
  ThreadPool pool(1);
  ASSERT_EQ(setenv("FERRY_CPU_ADAM", "scalar", 1), 0);
  EXPECT_EQ(CpuAdam(&pool).isa(), CpuAdamIsa::kScalar);
  // Options win over the environment.
  EXPECT_EQ(MakeAdam(&pool, BestCpuAdamIsa()).isa(), BestCpuAdamIsa());
  ASSERT_EQ(setenv("FERRY_CPU_ADAM", "avx9000", 1), 0);
  CpuAdam bad(&pool);
  EXPECT_EQ(bad.init_status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.init_status().message().find("FERRY_CPU_ADAM"), absl::string_view::npos);
  AdamScalars s = MakeAdamScalars(AdamHyper{}, 1);
  std::vector<float> buf(64);
  CpuAdamTensor t{
      buf.data(), buf.data() + 8, buf.data() + 16, buf.data() + 24, nullptr, 4, DType::kF32, DType::kF32, &s};
  EXPECT_EQ(bad.Step({&t, 1}).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_EQ(setenv("FERRY_CPU_ADAM", "auto", 1), 0);
  EXPECT_EQ(CpuAdam(&pool).isa(), BestCpuAdamIsa());
  ASSERT_EQ(unsetenv("FERRY_CPU_ADAM"), 0);
  EXPECT_EQ(CpuAdam(&pool).isa(), BestCpuAdamIsa());
  for (CpuAdamIsa isa : kIsas) {
    absl::StatusOr<CpuAdamIsa> parsed = ParseCpuAdamIsa(CpuAdamIsaName(isa));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, isa);
    if (!CpuSupportsAdamIsa(isa)) {
      CpuAdam forced = MakeAdam(&pool, isa);
      EXPECT_EQ(forced.init_status().code(), absl::StatusCode::kFailedPrecondition) << IsaName(isa);
    }
  }
  std::printf("best CPU Adam path here: %s\n", IsaName(BestCpuAdamIsa()).c_str());
}

INSTANTIATE_TEST_SUITE_P(Paths, CpuAdamIsaTest, ::testing::ValuesIn(kIsas),
                         [](const ::testing::TestParamInfo<CpuAdamIsa>& p) { return IsaName(p.param); });

}  // namespace
}  // namespace ferry
