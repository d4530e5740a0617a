#ifndef FERRY_TESTS_DEVICE_ADAM_REFERENCE_H_
#define FERRY_TESTS_DEVICE_ADAM_REFERENCE_H_
// Checks shared by the host-backend, CUDA and CPU Adam tests:
//   - RefGradStats: the gradient check's GradStats from the big-integer reference of
//     tests/base/exact_sum_reference.h, independently of the library's accumulators;
//   - CheckGradStatsAgainstExact: LaunchGradStats equals it bit for bit (the whole GradStats), and any
//     split of the tensors into pieces, merged through the exchange form, gives the same bits;
//   - CheckAdamRuntimeInputs: LaunchAdamWith's device-resident inputs give the same bits as LaunchAdam
//     with the scalars made on the host, and a NaN/Inf gradient skips the whole step;
//   - CheckLaunchAdamAgainstFloat64, described next.
//
// LaunchAdam against a float64 reference: every grad dtype x param dtype, AdamW and
// Adam-L2, bias correction on and off, tensors of lengths 1, 7, 333 and 1234 in one launch, fresh
// random gradients every step, 1,000 steps.
//
// Error bound. The reference runs the same formula in double from the same float inputs (hyper-
// parameters, initial masters, gradients decoded from their dtype); the kernel differs by rounding only:
// each fp32 step rounds p, m, v, the update and the per-step scalars (relative 2^-24 each).
//   - master: one rounding of p and a small relative error of the update lr * m_hat / denom per step,
//     partly systematic (the float scalars), so it grows linearly: we assert
//     |p - p_ref| <= 1e-4 |p_ref| + 1e-3 lr over 1,000 steps. Measured errors reach about a fifth of
//     that; a wrong bias correction, a missed weight decay or bf16-rounded state each miss by far more
//     (errors of order lr per step, or 4e-3 relative).
//   - moments: contractions (beta < 1), so a few ulps: |m - m_ref| <= 1e-5 |m_ref| + 1e-6 s, with s the
//     tensor's gradient scale (|v - v_ref| likewise with s^2); Adam-L2 feeds wd * p into the gradient,
//     so there the master's bound times wd is added (times 2 sqrt(v) for v).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/exact_sum_reference.h"
#include "device/device.h"
#include "gtest/gtest.h"

namespace ferry {

#ifndef FERRY_TEST_ASSERT_OK
#define FERRY_TEST_ASSERT_OK(expr)               \
  do {                                           \
    const absl::Status s_ = (expr);              \
    ASSERT_TRUE(s_.ok()) << #expr << ": " << s_; \
  } while (0)
#endif

struct RefState {
  std::vector<double> p, m, v;
};

struct TestTensor {
  DType grad_dtype;
  DType param_dtype;
  bool has_param;
  int64_t numel;
  uint32_t scalars_index;
  double grad_scale;
  DeviceBuffer master, m, v, grad, param;
  std::vector<float> init_master;
  RefState ref;
};

// One element of the reference in double, the same formula as base/adam_math.h.
inline void RefUpdate(const AdamHyper& h, double grad_multiplier, int64_t step, double& p, double& m, double& v,
               double g) {
  const double b1 = h.beta1, b2 = h.beta2, lr = h.lr, wd = h.weight_decay, eps = h.eps;
  g *= grad_multiplier;
  if (h.mode == AdamMode::kAdamL2) g += wd * p;
  m = b1 * m + (1.0 - b1) * g;
  v = b2 * v + (1.0 - b2) * g * g;
  double bc1 = 1.0, bc2 = 1.0;
  if (h.bias_correction) {
    bc1 = 1.0 - std::pow(b1, static_cast<double>(step));
    bc2 = 1.0 - std::pow(b2, static_cast<double>(step));
  }
  const double m_hat = m / bc1;
  const double denom = std::sqrt(v) / std::sqrt(bc2) + eps;
  if (h.mode == AdamMode::kAdamW) p *= 1.0 - lr * wd;
  p -= lr * m_hat / denom;
}

inline std::vector<uint8_t> Encode(const std::vector<float>& values, DType t) {
  std::vector<uint8_t> out(values.size() * DTypeSize(t));
  for (size_t i = 0; i < values.size(); ++i) StoreFromF32(out.data(), t, i, values[i]);
  return out;
}

// Runs 1,000 steps of LaunchAdam on `device` and checks every master, moment and param against
// the float64 reference with the bounds below. Shared by the host test and the CUDA (gpu) test.
inline void CheckLaunchAdamAgainstFloat64(Device& device) {
  absl::StatusOr<std::unique_ptr<Stream>> stream_or = device.CreateStream();
  ASSERT_TRUE(stream_or.ok());
  Stream& stream = **stream_or;

  // Four scalar sets: AdamW / L2, bias correction on / off, different lr, decay and multipliers.
  struct Group {
    AdamHyper hyper;
    double grad_multiplier;
  };
  std::vector<Group> groups(4);
  groups[0].hyper = {.lr = 1e-3f,
                     .beta1 = 0.9f,
                     .beta2 = 0.999f,
                     .eps = 1e-8f,
                     .weight_decay = 0.01f,
                     .mode = AdamMode::kAdamW,
                     .bias_correction = true};
  groups[0].grad_multiplier = 1.0;
  groups[1].hyper = {.lr = 3e-3f,
                     .beta1 = 0.8f,
                     .beta2 = 0.99f,
                     .eps = 1e-6f,
                     .weight_decay = 0.1f,
                     .mode = AdamMode::kAdamW,
                     .bias_correction = false};
  groups[1].grad_multiplier = 0.37;
  groups[2].hyper = {.lr = 2e-3f,
                     .beta1 = 0.9f,
                     .beta2 = 0.95f,
                     .eps = 1e-8f,
                     .weight_decay = 0.05f,
                     .mode = AdamMode::kAdamL2,
                     .bias_correction = true};
  groups[2].grad_multiplier = 0.5;
  groups[3].hyper = {.lr = 5e-4f,
                     .beta1 = 0.95f,
                     .beta2 = 0.999f,
                     .eps = 1e-7f,
                     .weight_decay = 0.0f,
                     .mode = AdamMode::kAdamL2,
                     .bias_correction = false};
  groups[3].grad_multiplier = 1.25;

  std::mt19937_64 rng(20240601);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const DType kTypes[] = {DType::kF32, DType::kBF16, DType::kF16};
  const int64_t kLengths[] = {1, 7, 333, 1234};
  const double kScales[] = {1e-3, 0.1, 1.0, 3.0};
  std::vector<TestTensor> tensors;
  for (DType gt : kTypes) {
    for (DType pt : kTypes) {
      for (int64_t n : kLengths) {
        TestTensor t{};
        t.grad_dtype = gt;
        t.param_dtype = pt;
        t.numel = n;
        t.scalars_index = static_cast<uint32_t>(tensors.size() % groups.size());
        t.grad_scale = kScales[(tensors.size() / 3) % 4];
        t.has_param = tensors.size() % 7 != 3;  // a few tensors without a param output
        tensors.push_back(std::move(t));
      }
    }
  }

  const size_t kSteps = 1000;
  for (TestTensor& t : tensors) {
    const size_t n = static_cast<size_t>(t.numel);
    auto alloc = [&device](size_t bytes) {
      absl::StatusOr<DeviceBuffer> b = device.Allocate(bytes);
      EXPECT_TRUE(b.ok()) << b.status();
      return b.ok() ? *std::move(b) : DeviceBuffer();
    };
    t.master = alloc(4 * n);
    t.m = alloc(4 * n);
    t.v = alloc(4 * n);
    t.grad = alloc(DTypeSize(t.grad_dtype) * n);
    if (t.has_param) t.param = alloc(DTypeSize(t.param_dtype) * n);
    t.init_master.resize(n);
    for (float& x : t.init_master) x = normal(rng);
    const std::vector<float> zeros(n, 0.0f);
    FERRY_TEST_ASSERT_OK(
        device.Copy(t.master.data(), t.init_master.data(), 4 * n, CopyKind::kHostToDevice));
    FERRY_TEST_ASSERT_OK(device.Copy(t.m.data(), zeros.data(), 4 * n, CopyKind::kHostToDevice));
    FERRY_TEST_ASSERT_OK(device.Copy(t.v.data(), zeros.data(), 4 * n, CopyKind::kHostToDevice));
    t.ref.p.assign(t.init_master.begin(), t.init_master.end());
    t.ref.m.assign(n, 0.0);
    t.ref.v.assign(n, 0.0);
  }

  std::vector<AdamTensorArgs> args;
  for (TestTensor& t : tensors) {
    AdamTensorArgs a;
    a.master = t.master.as<float>();
    a.exp_avg = t.m.as<float>();
    a.exp_avg_sq = t.v.as<float>();
    a.grad = t.grad.data();
    a.param = t.has_param ? t.param.data() : nullptr;
    a.numel = t.numel;
    a.grad_dtype = t.grad_dtype;
    a.param_dtype = t.param_dtype;
    a.scalars_index = t.scalars_index;
    args.push_back(a);
  }

  for (size_t step = 1; step <= kSteps; ++step) {
    std::vector<AdamScalars> scalars;
    for (const Group& g : groups) {
      scalars.push_back(MakeAdamScalars(g.hyper, static_cast<int64_t>(step), g.grad_multiplier));
    }
    for (TestTensor& t : tensors) {
      const size_t n = static_cast<size_t>(t.numel);
      std::vector<float> g(n);
      for (float& x : g) x = static_cast<float>(normal(rng) * t.grad_scale);
      const std::vector<uint8_t> encoded = Encode(g, t.grad_dtype);
      FERRY_TEST_ASSERT_OK(
          device.Copy(t.grad.data(), encoded.data(), encoded.size(), CopyKind::kHostToDevice));
      const Group& group = groups[t.scalars_index];
      for (size_t i = 0; i < n; ++i) {
        const double decoded = LoadAsF32(encoded.data(), t.grad_dtype, i);  // what the kernel reads
        RefUpdate(group.hyper, group.grad_multiplier, static_cast<int64_t>(step), t.ref.p[i], t.ref.m[i],
                  t.ref.v[i], decoded);
      }
    }
    FERRY_TEST_ASSERT_OK(device.LaunchAdam(args, scalars, stream));
    FERRY_TEST_ASSERT_OK(stream.Synchronize());
  }

  double worst_p = 0, worst_m = 0, worst_v = 0;  // error / bound, reported for the record
  for (size_t ti = 0; ti < tensors.size(); ++ti) {
    TestTensor& t = tensors[ti];
    const size_t n = static_cast<size_t>(t.numel);
    std::vector<float> p(n), m(n), v(n);
    std::vector<uint8_t> param(DTypeSize(t.param_dtype) * n);
    FERRY_TEST_ASSERT_OK(device.Copy(p.data(), t.master.data(), 4 * n, CopyKind::kDeviceToHost));
    FERRY_TEST_ASSERT_OK(device.Copy(m.data(), t.m.data(), 4 * n, CopyKind::kDeviceToHost));
    FERRY_TEST_ASSERT_OK(device.Copy(v.data(), t.v.data(), 4 * n, CopyKind::kDeviceToHost));
    if (t.has_param) {
      FERRY_TEST_ASSERT_OK(
          device.Copy(param.data(), t.param.data(), param.size(), CopyKind::kDeviceToHost));
    }
    const double lr = groups[t.scalars_index].hyper.lr;
    const double gs = t.grad_scale * groups[t.scalars_index].grad_multiplier;
    const bool l2 = groups[t.scalars_index].hyper.mode == AdamMode::kAdamL2;
    const double wd = groups[t.scalars_index].hyper.weight_decay;
    const std::string where =
        absl::StrCat("tensor ", ti, " (grad ", DTypeName(t.grad_dtype).data(), ", param ",
                     DTypeName(t.param_dtype).data(), ", n ", t.numel, ", group ", t.scalars_index, ")");
    bool moved = false;
    for (size_t i = 0; i < n; ++i) {
      const double bound_p = 1e-4 * std::abs(t.ref.p[i]) + 1e-3 * lr;
      // Adam-L2 feeds wd * p into the gradient, so the master's error reaches the moments too.
      const double fed_back = l2 ? wd * bound_p : 0.0;
      const double bound_m = 1e-5 * std::abs(t.ref.m[i]) + 1e-6 * gs + fed_back;
      const double bound_v =
          1e-5 * std::abs(t.ref.v[i]) + 1e-6 * gs * gs + 2.0 * std::sqrt(t.ref.v[i]) * fed_back;
      const double ep = std::abs(p[i] - t.ref.p[i]);
      const double em = std::abs(m[i] - t.ref.m[i]);
      const double ev = std::abs(v[i] - t.ref.v[i]);
      worst_p = std::max(worst_p, ep / bound_p);
      worst_m = std::max(worst_m, em / bound_m);
      worst_v = std::max(worst_v, ev / bound_v);
      ASSERT_LE(ep, bound_p) << where << " master[" << i << "] " << p[i] << " vs " << t.ref.p[i];
      ASSERT_LE(em, bound_m) << where << " exp_avg[" << i << "] " << m[i] << " vs " << t.ref.m[i];
      ASSERT_LE(ev, bound_v) << where << " exp_avg_sq[" << i << "] " << v[i] << " vs " << t.ref.v[i];
      if (p[i] != t.init_master[i]) moved = true;
      if (t.has_param) {
        // The param is the master rounded to nearest-even in its dtype, bit for bit.
        std::vector<uint8_t> want(DTypeSize(t.param_dtype));
        StoreFromF32(want.data(), t.param_dtype, 0, p[i]);
        ASSERT_EQ(0, std::memcmp(want.data(), param.data() + i * want.size(), want.size()))
            << where << " param[" << i << "]";
      }
    }
    EXPECT_TRUE(moved) << where;
  }
  std::printf("worst error / bound: master %.3g, exp_avg %.3g, exp_avg_sq %.3g\n", worst_p, worst_m,
              worst_v);
}

// ---- the gradient check ------------------------------------------------------------------------------

struct RefGrad {
  const void* grad;  // host memory
  int64_t numel;
  DType dtype;
};

// The GradStats of the reference over every element of `grads`.
inline GradStats RefGradStats(const std::vector<RefGrad>& grads) {
  RefBigSum sum;
  bool bad = false;
  for (const RefGrad& g : grads) bad = RefAddRange(sum, g.grad, g.dtype, 0, g.numel) || bad;
  return RefGradStatsOf(sum, bad);
}

inline bool SameBits(double a, double b) { return std::memcmp(&a, &b, sizeof(double)) == 0; }

// LaunchGradStats on `device` equals the reference bit for bit (the whole GradStats). Data sets: (0) many
// tensors (more than one kernel-parameter upload of the table on CUDA) of mixed dtypes, lengths (empty
// and one-element ones included) and alignments, random values over 40 binades; (1) every magnitude at
// once: subnormals, tiny, ordinary and huge values up to the dtype's largest, so the sum needs all its
// digits (and the GPU's per-thread expansion spills). Then: the tensors split into pieces (sub-ranges
// of each tensor, in several launches, as ranks would hold them) merged through the exchange form give
// the same bits; NaN and Inf anywhere set found_inf; an empty list gives zero.
inline void CheckGradStatsAgainstExact(Device& device) {
  absl::StatusOr<std::unique_ptr<Stream>> stream_or = device.CreateStream();
  ASSERT_TRUE(stream_or.ok());
  Stream& stream = **stream_or;
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  const DType kTypes[] = {DType::kF32, DType::kBF16, DType::kF16};
  const auto launch = [&](const std::vector<GradTensorArgs>& args, GradStats* got) {
    const size_t ws_bytes = GradStatsWorkspaceBytes(args.size());
    absl::StatusOr<DeviceBuffer> ws = device.Allocate(ws_bytes);
    ASSERT_TRUE(ws.ok()) << ws.status();
    FERRY_TEST_ASSERT_OK(device.LaunchGradStats(args, ws->data(), ws_bytes, stream));
    FERRY_TEST_ASSERT_OK(stream.Synchronize());
    FERRY_TEST_ASSERT_OK(device.Copy(got, ws->data(), sizeof(*got), CopyKind::kDeviceToHost));
  };
  for (int data_set = 0; data_set < 2; ++data_set) {
    std::vector<int64_t> lengths;
    if (data_set == 0) {
      for (int k = 0; k < 1900; ++k)
        lengths.push_back(k % 50 == 7 ? 0 : k % 50 == 8 ? 1 : 1 + static_cast<int64_t>(rng() % 300));
      for (int64_t n : {4096, 4097, 12288, 1 << 20, (1 << 21) + 3}) lengths.push_back(n);
    } else {
      lengths = {1, 0, 4096 * 300 + 5, 1, 777, 4096 * 200, 3};
    }
    std::vector<std::vector<uint8_t>> host(lengths.size());
    std::vector<DeviceBuffer> buffers;
    std::vector<GradTensorArgs> args;
    std::vector<RefGrad> ref;
    for (size_t k = 0; k < lengths.size(); ++k) {
      const DType dt = kTypes[k % 3];
      const size_t n = static_cast<size_t>(lengths[k]);
      const size_t skew = k % 4 == 1 ? 1 : 0;  // a few start off their vector alignment
      host[k].assign((n + skew) * DTypeSize(dt), 0);
      for (size_t i = 0; i < n; ++i) {
        float x = 0.0f;
        if (data_set == 0) {
          // 40 binades (30 for f16, whose range ends at 65504).
          const double binades = dt == DType::kF16 ? 30.0 : 40.0;
          x = static_cast<float>((unit(rng) - 0.5) * std::exp2(binades * unit(rng) - 20.0));
        } else {
          // Every finite exponent of the dtype, any mantissa (the largest value included).
          const double lo = dt == DType::kF16 ? -24.0 : -149.0, hi = dt == DType::kF16 ? 16.0 : 128.0;
          x = static_cast<float>(std::ldexp(unit(rng), static_cast<int>(lo + (hi - lo) * unit(rng))));
          if (rng() % 1000 == 0) x = dt == DType::kF16 ? 65504.0f : 3.4028234663852886e38f;
          if (dt == DType::kBF16 && x > 3.38e38f) x = 3.38e38f;  // rounding to bf16 must stay finite
          if (rng() % 2 == 0) x = -x;
        }
        StoreFromF32(host[k].data() + skew * DTypeSize(dt), dt, i, x);
      }
      absl::StatusOr<DeviceBuffer> b = device.Allocate(std::max<size_t>(host[k].size(), 1));
      ASSERT_TRUE(b.ok()) << b.status();
      if (!host[k].empty()) {
        FERRY_TEST_ASSERT_OK(device.Copy(b->data(), host[k].data(), host[k].size(), CopyKind::kHostToDevice));
      }
      const uint8_t* dev = b->as<uint8_t>() + skew * DTypeSize(dt);
      args.push_back(GradTensorArgs{dev, lengths[k], dt});
      ref.push_back(RefGrad{host[k].data() + skew * DTypeSize(dt), lengths[k], dt});
      buffers.push_back(*std::move(b));
    }
    const GradStats want = RefGradStats(ref);
    GradStats got{};
    launch(args, &got);
    EXPECT_TRUE(SameGradStats(got, want)) << "data set " << data_set << ": " << got.sum_sq << " vs " << want.sum_sq;
    EXPECT_EQ(got.found_inf, 0u);
    EXPECT_GT(want.sum_sq, 0.0);
    if (::testing::Test::HasFailure()) return;

    // Pieces: every tensor cut at random points; the pieces dealt to 1..4 "ranks" in a random order,
    // each rank one launch; the ranks' exchange forms summed as doubles.
    for (int trial = 0; trial < 2; ++trial) {
      std::vector<GradTensorArgs> pieces;
      for (const GradTensorArgs& a : args) {
        int64_t at = 0;
        while (at < a.numel) {
          const int64_t len = std::min<int64_t>(a.numel - at, 1 + static_cast<int64_t>(rng() % 5000));
          pieces.push_back(GradTensorArgs{static_cast<const uint8_t*>(a.grad) + at * static_cast<int64_t>(
                                                                                     DTypeSize(a.dtype)),
                                          len, a.dtype});
          at += len;
        }
      }
      std::shuffle(pieces.begin(), pieces.end(), rng);
      const size_t ranks = 1 + rng() % 4;
      std::vector<std::vector<GradTensorArgs>> by_rank(ranks);
      for (const GradTensorArgs& p : pieces) by_rank[rng() % ranks].push_back(p);
      std::vector<double> exchange(ExactSumSq::kExchangeDoubles, 0.0);
      bool any_inf = false;
      for (const std::vector<GradTensorArgs>& list : by_rank) {
        GradStats part{};
        launch(list, &part);
        double out[ExactSumSq::kExchangeDoubles];
        part.exact.ToExchange(out);
        for (int i = 0; i < ExactSumSq::kExchangeDoubles; ++i) exchange[static_cast<size_t>(i)] += out[i];
        any_inf = any_inf || part.found_inf != 0;
      }
      const GradStats merged = GradStatsFromExact(ExactSumSq::FromExchange(exchange.data()), any_inf);
      EXPECT_TRUE(SameGradStats(merged, want))
          << "data set " << data_set << ", " << ranks << " ranks: " << merged.sum_sq << " vs " << want.sum_sq;
    }

    if (data_set == 0) {
      const size_t ws_bytes = GradStatsWorkspaceBytes(args.size());
      absl::StatusOr<DeviceBuffer> ws = device.Allocate(ws_bytes);
      ASSERT_TRUE(ws.ok()) << ws.status();
      // NaN / Inf in a short tensor, a long one, and the last element of all.
      const size_t victims[] = {3, lengths.size() - 2, lengths.size() - 1};
      const float bad[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity()};
      for (int v = 0; v < 3; ++v) {
        const GradTensorArgs& a = args[victims[v]];
        const size_t at = static_cast<size_t>(v == 2 ? a.numel - 1 : a.numel / 2);
        uint8_t bytes[4];
        StoreFromF32(bytes, a.dtype, 0, bad[v]);
        uint8_t saved[4];
        void* where = const_cast<uint8_t*>(static_cast<const uint8_t*>(a.grad)) + at * DTypeSize(a.dtype);
        FERRY_TEST_ASSERT_OK(device.Copy(saved, where, DTypeSize(a.dtype), CopyKind::kDeviceToHost));
        FERRY_TEST_ASSERT_OK(device.Copy(where, bytes, DTypeSize(a.dtype), CopyKind::kHostToDevice));
        void* host_where = const_cast<void*>(ref[victims[v]].grad);
        std::vector<uint8_t> host_saved(4);
        std::memcpy(host_saved.data(), static_cast<uint8_t*>(host_where) + at * DTypeSize(a.dtype),
                    DTypeSize(a.dtype));
        std::memcpy(static_cast<uint8_t*>(host_where) + at * DTypeSize(a.dtype), bytes, DTypeSize(a.dtype));
        FERRY_TEST_ASSERT_OK(device.LaunchGradStats(args, ws->data(), ws_bytes, stream));
        FERRY_TEST_ASSERT_OK(stream.Synchronize());
        FERRY_TEST_ASSERT_OK(device.Copy(&got, ws->data(), sizeof(got), CopyKind::kDeviceToHost));
        EXPECT_EQ(got.found_inf, 1u) << "bad value " << bad[v] << " in tensor " << victims[v];
        EXPECT_TRUE(SameGradStats(got, RefGradStats(ref)))  // the finite elements' exact sum, +Inf
            << "bad value " << bad[v] << " in tensor " << victims[v];
        FERRY_TEST_ASSERT_OK(device.Copy(where, saved, DTypeSize(a.dtype), CopyKind::kHostToDevice));
        std::memcpy(static_cast<uint8_t*>(host_where) + at * DTypeSize(a.dtype), host_saved.data(),
                    DTypeSize(a.dtype));
      }
      FERRY_TEST_ASSERT_OK(device.LaunchGradStats({}, ws->data(), ws_bytes, stream));
      FERRY_TEST_ASSERT_OK(stream.Synchronize());
      FERRY_TEST_ASSERT_OK(device.Copy(&got, ws->data(), sizeof(got), CopyKind::kDeviceToHost));
      EXPECT_TRUE(SameGradStats(got, RefGradStats({})));
      EXPECT_EQ(got.sum_sq, 0.0);
      EXPECT_EQ(got.found_inf, 0u);
    }
  }
}

// ---- LaunchAdamWith's runtime inputs ---------------------------------------------------------------

// Two copies of the same tensors step side by side on `device` for 60 steps: copy A through
// LaunchAdamWith with every runtime input in device memory (scalars made once, at step 1 with another
// lr; per-group lr and step counts, the loss scale, the gradient check and clipping read when the
// kernel runs); copy B through LaunchAdam with scalars made on the host from the same values (the
// multiplier from the check read back). They must stay bit-identical. Steps 10 and 37 carry a NaN or
// Inf gradient: A must change nothing (state, params and step counts), and B is not stepped.
inline void CheckAdamRuntimeInputs(Device& device) {
  absl::StatusOr<std::unique_ptr<Stream>> stream_or = device.CreateStream();
  ASSERT_TRUE(stream_or.ok());
  Stream& stream = **stream_or;
  std::mt19937_64 rng(std::random_device{}());
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<AdamHyper> groups(3);
  groups[0] = {.lr = 1.0f,
               .beta1 = 0.9f,
               .beta2 = 0.999f,
               .eps = 1e-8f,
               .weight_decay = 0.01f,
               .mode = AdamMode::kAdamW,
               .bias_correction = true};
  groups[1] = {.lr = 1.0f,
               .beta1 = 0.8f,
               .beta2 = 0.99f,
               .eps = 1e-6f,
               .weight_decay = 0.1f,
               .mode = AdamMode::kAdamL2,
               .bias_correction = true};
  groups[2] = {.lr = 1.0f,
               .beta1 = 0.9f,
               .beta2 = 0.95f,
               .eps = 1e-8f,
               .weight_decay = 0.0f,
               .mode = AdamMode::kAdamW,
               .bias_correction = false};
  const DType kTypes[] = {DType::kF32, DType::kBF16, DType::kF16};
  struct Twin {
    int64_t n;
    DType gt, pt;
    size_t group;
    DeviceBuffer state[2], param[2], grad;  // state: master | m | v
  };
  std::vector<Twin> twins;
  auto alloc = [&device](size_t bytes) {
    absl::StatusOr<DeviceBuffer> b = device.Allocate(bytes);
    EXPECT_TRUE(b.ok()) << b.status();
    return b.ok() ? *std::move(b) : DeviceBuffer();
  };
  for (int k = 0; k < 9; ++k) {
    Twin t;
    t.n = k == 0 ? 1 : 1 + static_cast<int64_t>(rng() % 20000);
    t.gt = kTypes[k % 3];
    t.pt = kTypes[(k / 3) % 3];
    t.group = static_cast<size_t>(k) % groups.size();
    std::vector<float> init(3 * static_cast<size_t>(t.n), 0.0f);
    for (int64_t i = 0; i < t.n; ++i) init[static_cast<size_t>(i)] = normal(rng);
    for (int c = 0; c < 2; ++c) {
      t.state[c] = alloc(init.size() * 4);
      t.param[c] = alloc(static_cast<size_t>(t.n) * DTypeSize(t.pt));
      FERRY_TEST_ASSERT_OK(
          device.Copy(t.state[c].data(), init.data(), init.size() * 4, CopyKind::kHostToDevice));
    }
    t.grad = alloc(static_cast<size_t>(t.n) * DTypeSize(t.gt));
    twins.push_back(std::move(t));
  }
  std::vector<AdamTensorArgs> args[2];
  std::vector<GradTensorArgs> grads;
  for (Twin& t : twins) {
    for (int c = 0; c < 2; ++c) {
      AdamTensorArgs a;
      a.master = t.state[c].as<float>();
      a.exp_avg = static_cast<float*>(a.master) + t.n;
      a.exp_avg_sq = static_cast<float*>(a.master) + 2 * t.n;
      a.grad = t.grad.data();
      a.param = t.param[c].data();
      a.numel = t.n;
      a.grad_dtype = t.gt;
      a.param_dtype = t.pt;
      a.scalars_index = static_cast<uint32_t>(t.group);
      args[c].push_back(a);
    }
    grads.push_back(GradTensorArgs{t.grad.data(), t.n, t.gt});
  }
  // Runtime inputs in device memory: [lr x3 | scale | pad] floats, steps, the workspace.
  DeviceBuffer lr_scale = alloc(8 * 4);
  DeviceBuffer steps = alloc(3 * 8);
  const size_t ws_bytes = GradStatsWorkspaceBytes(grads.size());
  DeviceBuffer ws = alloc(ws_bytes);
  const std::vector<int64_t> zero_steps(3, 0);
  FERRY_TEST_ASSERT_OK(device.Copy(steps.data(), zero_steps.data(), 24, CopyKind::kHostToDevice));
  std::vector<AdamScalars> made_once;
  for (const AdamHyper& h : groups) made_once.push_back(MakeAdamScalars(h, 1, 7.0));
  AdamRuntimeArgs runtime;
  runtime.grad_stats = GradStatsResult(ws.data());
  runtime.max_grad_norm = 5.0f;
  runtime.lr = lr_scale.as<float>();
  runtime.grad_scale = lr_scale.as<float>() + 3;
  runtime.step = steps.as<int64_t>();

  const float kScale = 1000.0f;
  int64_t host_steps = 0;
  std::vector<uint8_t> before_skip;
  auto snapshot = [&](int c) {
    std::vector<uint8_t> out;
    for (Twin& t : twins) {
      std::vector<uint8_t> b(t.state[c].bytes() + t.param[c].bytes());
      EXPECT_TRUE(device.Copy(b.data(), t.state[c].data(), t.state[c].bytes(), CopyKind::kDeviceToHost).ok());
      EXPECT_TRUE(device
                      .Copy(b.data() + t.state[c].bytes(), t.param[c].data(), t.param[c].bytes(),
                            CopyKind::kDeviceToHost)
                      .ok());
      out.insert(out.end(), b.begin(), b.end());
    }
    return out;
  };
  bool clipped = false;
  for (int step = 1; step <= 60; ++step) {
    const bool bad = step == 10 || step == 37;
    for (size_t k = 0; k < twins.size(); ++k) {
      Twin& t = twins[k];
      std::vector<uint8_t> g(static_cast<size_t>(t.n) * DTypeSize(t.gt));
      // Large gradients early (clipping bites), small later.
      const float magnitude = (step < 20 ? 0.5f : 0.005f) * kScale;
      for (size_t i = 0; i < static_cast<size_t>(t.n); ++i)
        StoreFromF32(g.data(), t.gt, i, normal(rng) * magnitude);
      if (bad && k == 4)
        StoreFromF32(g.data(), t.gt, static_cast<size_t>(t.n) / 2, step == 10 ? NAN : INFINITY);
      FERRY_TEST_ASSERT_OK(device.Copy(t.grad.data(), g.data(), g.size(), CopyKind::kHostToDevice));
    }
    float lr_host[8] = {};
    for (int g = 0; g < 3; ++g)
      lr_host[g] = 1e-3f * static_cast<float>(g + 1) * (1.0f + 0.01f * static_cast<float>(step));
    lr_host[3] = kScale;
    FERRY_TEST_ASSERT_OK(device.Copy(lr_scale.data(), lr_host, sizeof(lr_host), CopyKind::kHostToDevice));
    if (bad) before_skip = snapshot(0);
    // A: everything on the device, nothing read back between the check and the update.
    FERRY_TEST_ASSERT_OK(device.LaunchGradStats(grads, ws.data(), ws_bytes, stream));
    FERRY_TEST_ASSERT_OK(device.LaunchAdamWith(args[0], made_once, runtime, stream));
    FERRY_TEST_ASSERT_OK(stream.Synchronize());
    // B: the host reads the check and makes the scalars.
    GradStats stats{};
    FERRY_TEST_ASSERT_OK(device.Copy(&stats, ws.data(), sizeof(stats), CopyKind::kDeviceToHost));
    ASSERT_EQ(stats.found_inf, bad ? 1u : 0u) << "step " << step;
    if (bad) {
      EXPECT_EQ(snapshot(0), before_skip) << "step " << step << " was not skipped";
    } else {
      ++host_steps;
      const float multiplier = AdamGradMultiplier(kScale, stats.sum_sq, runtime.max_grad_norm);
      if (multiplier < 1.0f / kScale) clipped = true;
      std::vector<AdamScalars> scalars;
      for (int g = 0; g < 3; ++g) {
        AdamHyper h = groups[static_cast<size_t>(g)];
        h.lr = lr_host[g];
        scalars.push_back(MakeAdamScalars(h, host_steps, multiplier));
      }
      FERRY_TEST_ASSERT_OK(device.LaunchAdam(args[1], scalars, stream));
      FERRY_TEST_ASSERT_OK(stream.Synchronize());
    }
    int64_t steps_now[3];
    FERRY_TEST_ASSERT_OK(device.Copy(steps_now, steps.data(), 24, CopyKind::kDeviceToHost));
    for (int g = 0; g < 3; ++g) ASSERT_EQ(steps_now[g], host_steps) << "step counter of group " << g;
  }
  EXPECT_TRUE(clipped) << "the clip never bit: the test does not cover it";
  const std::vector<uint8_t> a = snapshot(0), b = snapshot(1);
  ASSERT_EQ(a.size(), b.size());
  size_t first_diff = a.size();
  for (size_t i = 0; i < a.size() && first_diff == a.size(); ++i) {
    if (a[i] != b[i]) first_diff = i;
  }
  EXPECT_EQ(first_diff, a.size()) << "runtime-input launch differs from host-made scalars at byte "
                                  << first_diff;
}

}  // namespace ferry

#endif  // FERRY_TESTS_DEVICE_ADAM_REFERENCE_H_
