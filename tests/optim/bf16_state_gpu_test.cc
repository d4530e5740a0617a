// The CUDA Adam kernel with bf16 state against CpuAdam (the scalar path and the best this CPU has),
// bit for bit: every state format, grad and param dtype, tensors of odd sizes whose state starts at
// every alignment phase (vector and element-wise access), global indices crossing a multiple of 2^32
// inside a chunk, 5 steps with stochastic rounding keys changing per step. Skips when the build has no
// CUDA backend or no CUDA device is present.
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/adam_state.h"
#include "base/thread_pool.h"
#include "device/device.h"
#include "gtest/gtest.h"
#include "optim/cpu_adam.h"

namespace ferry {
namespace {

class Bf16StateGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!BuiltWithCuda()) GTEST_SKIP() << "this build has no CUDA backend";
    absl::StatusOr<std::unique_ptr<Device>> cuda = CreateDevice({.backend = "cuda"});
    if (!cuda.ok() && cuda.status().code() == absl::StatusCode::kUnavailable) {
      GTEST_SKIP() << "no CUDA device: " << cuda.status();
    }
    ASSERT_TRUE(cuda.ok()) << cuda.status();
    cuda_ = *std::move(cuda);
  }
  std::unique_ptr<Device> cuda_;
};

// One tensor's arrays, on the host and the device, each `phase` elements past an aligned start.
struct Arrays {
  StateFormat f;
  DType gd, pd;
  int64_t n, phase, index0;
  std::vector<uint8_t> master, m, v, grad, param;  // host (the CPU run's state)
  DeviceBuffer d_master, d_m, d_v, d_grad, d_param;
  size_t Off(DType t) const { return static_cast<size_t>(phase) * DTypeSize(t); }
};

TEST_F(Bf16StateGpuTest, KernelEqualsCpuBitForBit) {
  const StateFormat kFormats[] = {
      {DType::kF32, DType::kBF16, StateRounding::kNearest}, {DType::kF32, DType::kBF16, StateRounding::kStochastic},
      {DType::kBF16, DType::kF32, StateRounding::kStochastic}, {DType::kBF16, DType::kBF16, StateRounding::kNearest},
      {DType::kBF16, DType::kBF16, StateRounding::kStochastic}};
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<Arrays> ts;
  for (const StateFormat& f : kFormats) {
    for (DType gd : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (DType pd : {DType::kBF16, DType::kF32}) {
        if (f.master == DType::kBF16 && pd != DType::kBF16) continue;
        for (int64_t n : {int64_t{1}, int64_t{13}, int64_t{4099}, int64_t{50001}}) {
          Arrays a{f, gd, pd, n, static_cast<int64_t>(rng() % 4), 0, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}};
          a.index0 = rng() % 2 == 0 ? static_cast<int64_t>(rng() % 1000000) : (int64_t{1} << 32) - 1000 - static_cast<int64_t>(rng() % 3000);
          const size_t cap = static_cast<size_t>(n + 4);
          a.master.resize(cap * DTypeSize(f.master));
          a.m.resize(cap * DTypeSize(f.moments));
          a.v.resize(cap * DTypeSize(f.moments));
          a.grad.resize(cap * DTypeSize(gd));
          a.param.resize(cap * DTypeSize(pd));
          for (size_t i = 0; i < static_cast<size_t>(n); ++i) {
            const size_t k = i + static_cast<size_t>(a.phase);
            StoreFromF32(a.master.data(), f.master, k, normal(rng));
            StoreFromF32(a.m.data(), f.moments, k, 0.1f * normal(rng));
            StoreFromF32(a.v.data(), f.moments, k, 0.01f * std::abs(normal(rng)));
          }
          for (auto [buf, host] : {std::pair{&a.d_master, &a.master}, {&a.d_m, &a.m}, {&a.d_v, &a.v},
                                   {&a.d_grad, &a.grad}, {&a.d_param, &a.param}}) {
            *buf = *cuda_->Allocate(host->size());
            ASSERT_TRUE(cuda_->Copy(buf->data(), host->data(), host->size(), CopyKind::kHostToDevice).ok());
          }
          ts.push_back(std::move(a));
        }
      }
    }
  }
  ThreadPool pool(2);
  CpuAdam cpu(&pool);
  std::unique_ptr<Stream> stream = *cuda_->CreateStream();
  for (int step = 1; step <= 5; ++step) {
    AdamHyper h;
    h.weight_decay = 0.02f;
    h.mode = step % 2 == 0 ? AdamMode::kAdamW : AdamMode::kAdamL2;
    const AdamScalars s = MakeAdamScalars(h, step);
    std::vector<AdamTensorArgs> dargs;
    std::vector<CpuAdamTensor> cargs;
    for (size_t i = 0; i < ts.size(); ++i) {
      Arrays& a = ts[i];
      for (size_t e = 0; e < static_cast<size_t>(a.n); ++e) {
        StoreFromF32(a.grad.data(), a.gd, e + static_cast<size_t>(a.phase), 0.3f * normal(rng));
      }
      ASSERT_TRUE(cuda_->Copy(a.d_grad.data(), a.grad.data(), a.grad.size(), CopyKind::kHostToDevice).ok());
      const StateRoundingKey key{RoundingTensorKey(1, i, step), a.index0};
      AdamTensorArgs d;
      d.master = a.d_master.as<char>() + a.Off(a.f.master);
      d.exp_avg = a.d_m.as<char>() + a.Off(a.f.moments);
      d.exp_avg_sq = a.d_v.as<char>() + a.Off(a.f.moments);
      d.grad = a.d_grad.as<char>() + a.Off(a.gd);
      d.param = a.d_param.as<char>() + a.Off(a.pd);
      d.numel = a.n;
      d.grad_dtype = a.gd;
      d.param_dtype = a.pd;
      d.state = a.f;
      d.rounding = key;
      dargs.push_back(d);
      CpuAdamTensor c;
      c.master = a.master.data() + a.Off(a.f.master);
      c.exp_avg = a.m.data() + a.Off(a.f.moments);
      c.exp_avg_sq = a.v.data() + a.Off(a.f.moments);
      c.grad = a.grad.data() + a.Off(a.gd);
      c.param = a.param.data() + a.Off(a.pd);
      c.numel = a.n;
      c.grad_dtype = a.gd;
      c.param_dtype = a.pd;
      c.scalars = &s;
      c.state = a.f;
      c.rounding = key;
      cargs.push_back(c);
    }
    ASSERT_TRUE(cuda_->LaunchAdam(dargs, {&s, 1}, *stream).ok());
    ASSERT_TRUE(stream->Synchronize().ok());
    ASSERT_TRUE(cpu.Step(cargs).ok());
  }
  for (const Arrays& a : ts) {
    SCOPED_TRACE(absl::StrCat("n ", a.n, " phase ", a.phase, " index0 ", a.index0, " master ",
                              static_cast<int>(a.f.master), " moments ", static_cast<int>(a.f.moments), " sr ",
                              static_cast<int>(a.f.rounding), " grad ", static_cast<int>(a.gd), " param ",
                              static_cast<int>(a.pd)));
    for (auto [buf, host] : {std::pair{&a.d_master, &a.master}, {&a.d_m, &a.m}, {&a.d_v, &a.v}, {&a.d_param, &a.param}}) {
      std::vector<uint8_t> got(host->size());
      ASSERT_TRUE(cuda_->Copy(got.data(), buf->data(), got.size(), CopyKind::kDeviceToHost).ok());
      EXPECT_TRUE(got == *host);
    }
  }
}

}  // namespace
}  // namespace ferry
