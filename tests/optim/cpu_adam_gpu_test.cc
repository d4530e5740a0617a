// CpuAdam (every path this CPU has) against the CUDA kernels, bit for bit: 30 steps of every dtype pair
// and both modes, with unscaling, clipping and a skipped NaN step; the CPU's gradient check against
// LaunchGradStats. Skips when the build has no CUDA backend or no CUDA device is present.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "device/device.h"
#include "gtest/gtest.h"
#include "optim/cpu_adam.h"

namespace ferry {
namespace {

#define FERRY_TEST_ASSERT_OK(expr)               \
  do {                                           \
    const absl::Status s_ = (expr);              \
    ASSERT_TRUE(s_.ok()) << #expr << ": " << s_; \
  } while (0)

class CpuAdamGpuTest : public ::testing::Test {
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
  DeviceBuffer Alloc(size_t bytes) {
    absl::StatusOr<DeviceBuffer> b = cuda_->Allocate(bytes);
    EXPECT_TRUE(b.ok()) << b.status();
    return b.ok() ? *std::move(b) : DeviceBuffer();
  }
  std::unique_ptr<Device> cuda_;
};

struct Tensor {
  int64_t n;
  DType gt, pt;
  uint32_t group;
  std::vector<float> state;  // host copy: master | m | v
  std::vector<uint8_t> param;
  DeviceBuffer d_state, d_grad, d_param;
};

TEST_F(CpuAdamGpuTest, CpuPathsEqualCudaBitForBit) {
  const DType kTypes[] = {DType::kF32, DType::kBF16, DType::kF16};
  const CpuAdamIsa kIsas[] = {CpuAdamIsa::kScalar, CpuAdamIsa::kAvx2, CpuAdamIsa::kAvx512,
                              CpuAdamIsa::kAvx512Bf16};
  std::vector<AdamHyper> groups(4);
  for (int j = 0; j < 4; ++j) {
    groups[static_cast<size_t>(j)].weight_decay = 0.03f * static_cast<float>(j);
    groups[static_cast<size_t>(j)].mode = j % 2 == 0 ? AdamMode::kAdamW : AdamMode::kAdamL2;
    groups[static_cast<size_t>(j)].bias_correction = j != 3;
    groups[static_cast<size_t>(j)].beta2 = j == 2 ? 0.95f : 0.999f;
  }
  std::unique_ptr<Stream> stream = *cuda_->CreateStream();
  for (CpuAdamIsa isa : kIsas) {
    if (!CpuSupportsAdamIsa(isa)) {
      std::printf("skipping the %s path: this CPU lacks it\n", std::string(CpuAdamIsaName(isa)).c_str());
      continue;
    }
    SCOPED_TRACE(std::string(CpuAdamIsaName(isa)));
    const uint64_t seed = std::random_device{}();
    SCOPED_TRACE(absl::StrCat("seed ", seed));
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<Tensor> tensors;
    for (DType gt : kTypes) {
      for (DType pt : kTypes) {
        for (int64_t n :
             {int64_t{1}, int64_t{13}, int64_t{4099}, static_cast<int64_t>(50000 + rng() % 1000)}) {
          Tensor t;
          t.n = n;
          t.gt = gt;
          t.pt = pt;
          t.group = static_cast<uint32_t>(tensors.size() % groups.size());
          t.state.assign(3 * static_cast<size_t>(n), 0.0f);
          for (int64_t i = 0; i < n; ++i) t.state[static_cast<size_t>(i)] = normal(rng);
          t.param.assign(static_cast<size_t>(n) * DTypeSize(pt), 0);
          t.d_state = Alloc(t.state.size() * 4);
          t.d_grad = Alloc(static_cast<size_t>(n) * DTypeSize(gt));
          t.d_param = Alloc(t.param.size());
          FERRY_TEST_ASSERT_OK(
              cuda_->Copy(t.d_state.data(), t.state.data(), t.state.size() * 4, CopyKind::kHostToDevice));
          tensors.push_back(std::move(t));
        }
      }
    }
    std::vector<AdamTensorArgs> dargs;
    std::vector<GradTensorArgs> dgrads;
    for (Tensor& t : tensors) {
      AdamTensorArgs a;
      a.master = t.d_state.as<float>();
      a.exp_avg = static_cast<float*>(a.master) + t.n;
      a.exp_avg_sq = static_cast<float*>(a.master) + 2 * t.n;
      a.grad = t.d_grad.data();
      a.param = t.d_param.data();
      a.numel = t.n;
      a.grad_dtype = t.gt;
      a.param_dtype = t.pt;
      a.scalars_index = t.group;
      dargs.push_back(a);
      dgrads.push_back(GradTensorArgs{t.d_grad.data(), t.n, t.gt});
    }
    std::vector<AdamScalars> made_once;
    for (const AdamHyper& h : groups) made_once.push_back(MakeAdamScalars(h, 1));
    DeviceBuffer inputs = Alloc(32), steps = Alloc(8 * groups.size());
    const size_t ws_bytes = GradStatsWorkspaceBytes(dgrads.size());
    DeviceBuffer ws = Alloc(ws_bytes);
    const std::vector<int64_t> zeros(groups.size(), 0);
    FERRY_TEST_ASSERT_OK(cuda_->Copy(steps.data(), zeros.data(), 8 * zeros.size(), CopyKind::kHostToDevice));
    constexpr float kScale = 1024.0f * 3.0f;  // not a power of two: unscaling rounds
    constexpr float kMaxNorm = 30.0f;
    AdamRuntimeArgs runtime;
    runtime.grad_stats = GradStatsResult(ws.data());
    runtime.max_grad_norm = kMaxNorm;
    runtime.lr = inputs.as<float>();
    runtime.grad_scale = inputs.as<float>() + 4;
    runtime.step = steps.as<int64_t>();

    ThreadPool pool(3);
    CpuAdam adam(&pool, CpuAdamOptions{.isa = isa, .block_elements = 4096});
    ASSERT_TRUE(adam.init_status().ok()) << adam.init_status();
    std::vector<std::vector<uint8_t>> host_grads(tensors.size());
    int64_t completed = 0;
    bool clipped = false;
    for (int step = 1; step <= 30; ++step) {
      float values[8] = {};
      for (size_t g = 0; g < groups.size(); ++g)
        values[g] = 1e-3f / static_cast<float>(g + 1) + 1e-5f * static_cast<float>(step);
      values[4] = kScale;
      FERRY_TEST_ASSERT_OK(cuda_->Copy(inputs.data(), values, sizeof(values), CopyKind::kHostToDevice));
      for (size_t k = 0; k < tensors.size(); ++k) {
        Tensor& t = tensors[k];
        host_grads[k].resize(static_cast<size_t>(t.n) * DTypeSize(t.gt));
        // Every third step the unscaled norm (~700) is far above kMaxNorm: the clip bites.
        const float magnitude = (step % 3 == 0 ? 1.0f : 0.01f) * kScale;
        for (size_t i = 0; i < static_cast<size_t>(t.n); ++i)
          StoreFromF32(host_grads[k].data(), t.gt, i, normal(rng) * magnitude);
        if (step == 17 && k == tensors.size() / 2) StoreFromF32(host_grads[k].data(), t.gt, 0, NAN);
        FERRY_TEST_ASSERT_OK(cuda_->Copy(t.d_grad.data(), host_grads[k].data(), host_grads[k].size(),
                                         CopyKind::kHostToDevice));
      }
      // CUDA: check and update without the host in between.
      FERRY_TEST_ASSERT_OK(cuda_->LaunchGradStats(dgrads, ws.data(), ws_bytes, *stream));
      FERRY_TEST_ASSERT_OK(cuda_->LaunchAdamWith(dargs, made_once, runtime, *stream));
      // CPU: its own check over the same gradients, the scalars made on the host.
      std::vector<CpuGradTensor> cgrads;
      for (size_t k = 0; k < tensors.size(); ++k)
        cgrads.push_back({host_grads[k].data(), tensors[k].n, tensors[k].gt});
      absl::StatusOr<GradStats> cpu_stats = adam.ComputeGradStats(cgrads);
      ASSERT_TRUE(cpu_stats.ok()) << cpu_stats.status();
      std::vector<AdamScalars> scalars;
      for (size_t g = 0; g < groups.size(); ++g) {
        AdamHyper h = groups[g];
        h.lr = values[g];
        scalars.push_back(MakeAdamScalars(h, completed + 1));
      }
      std::vector<CpuAdamTensor> cargs;
      for (size_t k = 0; k < tensors.size(); ++k) {
        Tensor& t = tensors[k];
        cargs.push_back(CpuAdamTensor{t.state.data(), t.state.data() + t.n, t.state.data() + 2 * t.n,
                                      host_grads[k].data(), t.param.data(), t.n, t.gt, t.pt,
                                      &scalars[t.group]});
      }
      CpuAdamStepOptions options;
      options.grad_stats = &*cpu_stats;
      options.grad_scale = kScale;
      options.max_grad_norm = kMaxNorm;
      if (cpu_stats->found_inf == 0 &&
          AdamGradMultiplier(kScale, cpu_stats->sum_sq, kMaxNorm) < 1.0f / kScale) {
        clipped = true;
      }
      absl::StatusOr<CpuAdamStepResult> result = adam.Step(cargs, options);
      ASSERT_TRUE(result.ok()) << result.status();
      EXPECT_EQ(result->skipped, step == 17);
      if (!result->skipped) ++completed;
      FERRY_TEST_ASSERT_OK(stream->Synchronize());
      GradStats gpu_stats{};
      FERRY_TEST_ASSERT_OK(cuda_->Copy(&gpu_stats, ws.data(), sizeof(gpu_stats), CopyKind::kDeviceToHost));
      ASSERT_EQ(std::memcmp(&gpu_stats, &*cpu_stats, sizeof(GradStats)), 0)
          << "step " << step << ": gradient check " << gpu_stats.sum_sq << " (GPU) vs " << cpu_stats->sum_sq
          << " (CPU)";
    }
    EXPECT_TRUE(clipped) << "the clip never bit: the test does not cover it";
    std::vector<int64_t> gpu_steps(groups.size());
    FERRY_TEST_ASSERT_OK(
        cuda_->Copy(gpu_steps.data(), steps.data(), 8 * gpu_steps.size(), CopyKind::kDeviceToHost));
    for (int64_t s : gpu_steps) EXPECT_EQ(s, completed);
    for (size_t k = 0; k < tensors.size(); ++k) {
      Tensor& t = tensors[k];
      std::vector<float> state(t.state.size());
      std::vector<uint8_t> param(t.param.size());
      FERRY_TEST_ASSERT_OK(
          cuda_->Copy(state.data(), t.d_state.data(), state.size() * 4, CopyKind::kDeviceToHost));
      FERRY_TEST_ASSERT_OK(
          cuda_->Copy(param.data(), t.d_param.data(), param.size(), CopyKind::kDeviceToHost));
      EXPECT_EQ(std::memcmp(state.data(), t.state.data(), state.size() * 4), 0)
          << "tensor " << k << " (n " << t.n << ", grad " << DTypeName(t.gt) << ", param " << DTypeName(t.pt)
          << "): master / moments differ";
      EXPECT_EQ(param, t.param) << "tensor " << k << ": params differ";
    }
  }
}

}  // namespace
}  // namespace ferry
