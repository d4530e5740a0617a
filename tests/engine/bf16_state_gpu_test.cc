// bf16 optimizer state on CUDA against the host backend, through the engine: the same model, grads and
// policy give bit-identical params for CPU (offloaded) and GPU placements, with bf16 moments and
// masters, rounded to nearest or stochastically; and the engine's state bytes shrink on the device.
// Skips when the build has no CUDA backend or no CUDA device is present.
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "device/device.h"
#include "engine/engine_test_util.h"
#include "ferry/engine.h"
#include "gtest/gtest.h"

namespace ferry::engine_test {
namespace {

class Bf16StateGpuEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!BuiltWithCuda()) GTEST_SKIP() << "this build has no CUDA backend";
    absl::StatusOr<std::unique_ptr<Device>> cuda = CreateDevice({.backend = "cuda"});
    if (!cuda.ok() && cuda.status().code() == absl::StatusCode::kUnavailable) {
      GTEST_SKIP() << "no CUDA device: " << cuda.status();
    }
    ASSERT_TRUE(cuda.ok()) << cuda.status();
  }
};

// `steps` steps on `backend` with offload_bf16_moments.lua and `args`; the params.
std::vector<std::vector<uint16_t>> Train(const std::string& backend, const std::map<std::string, std::string>& args,
                                         int steps, size_t* gpu_state_bytes = nullptr) {
  std::unique_ptr<Device> device = *CreateDevice({.backend = backend});
  Model model(device.get(), {5000, 77, 4096, 100003}, 3);
  EngineOptions o;
  o.device = backend;
  o.policy_path = Policies() + "offload_bf16_moments.lua";
  o.policy_args = args;
  o.optimizer.lr = 1e-2f;
  o.optimizer.weight_decay = 0.01f;
  o.transfer_chunk_bytes = 8192;
  absl::StatusOr<std::unique_ptr<Engine>> e = Engine::Create(o);
  EXPECT_TRUE(e.ok()) << e.status();
  if (!e.ok()) return {};
  EXPECT_TRUE(model.Register(**e).ok());
  EXPECT_TRUE((*e)->Finalize().ok());
  for (int step = 1; step <= steps; ++step) {
    model.SetGrads(70 + static_cast<uint64_t>(step));
    EXPECT_TRUE((*e)->Step({.lr = 1e-2f / static_cast<float>(step)}).ok());
  }
  EXPECT_TRUE((*e)->Synchronize().ok());
  EXPECT_TRUE((*e)->VerifyMasters().ok());
  if (gpu_state_bytes != nullptr) *gpu_state_bytes = (*e)->Stats().gpu_state_bytes;
  return model.Params();
}

TEST_F(Bf16StateGpuEngineTest, CudaEqualsHostBackendForEveryPlacementAndFormat) {
  for (const char* place : {"cpu", "gpu"}) {
    for (const char* master : {"fp32", "bf16"}) {
      for (const char* rounding : {"nearest", "stochastic"}) {
        SCOPED_TRACE(absl::StrCat(place, ", master ", master, ", ", rounding));
        const std::map<std::string, std::string> args = {{"device", place}, {"master", master}, {"rounding", rounding}};
        size_t bytes = 0;
        const auto cuda = Train("cuda", args, 6, &bytes);
        const auto host = Train("host", args, 6);
        EXPECT_TRUE(cuda == host);
        if (std::string(place) == "gpu") {
          // A group per tensor: no padding; 8 B per element with bf16 moments, 6 with a bf16 master.
          EXPECT_EQ(bytes, (std::string(master) == "bf16" ? 6u : 8u) * (5000 + 77 + 4096 + 100003));
        }
      }
    }
  }
  // And CPU and GPU placements agree on CUDA.
  EXPECT_TRUE(Train("cuda", {{"device", "cpu"}, {"rounding", "stochastic"}}, 6) ==
              Train("cuda", {{"device", "gpu"}, {"rounding", "stochastic"}}, 6));
}

}  // namespace
}  // namespace ferry::engine_test
