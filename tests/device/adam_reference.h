#ifndef FERRY_TESTS_DEVICE_ADAM_REFERENCE_H_
#define FERRY_TESTS_DEVICE_ADAM_REFERENCE_H_
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
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
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
void RefUpdate(const AdamHyper& h, double grad_multiplier, int64_t step, double& p, double& m, double& v,
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

}  // namespace ferry

#endif  // FERRY_TESTS_DEVICE_ADAM_REFERENCE_H_
