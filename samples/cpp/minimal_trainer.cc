// The smallest C++ trainer that embeds Ferry: two bf16 parameter groups, one placed on the CPU by
// the offload_fraction policy, stepped from synthetic gradients, checkpointed and verified.
//
//   build/ferry_minimal_trainer [POLICY_DIR]
//
// A real trainer passes cudaMalloc'd params and grads and its cudaStream_t to Step(). This sample runs
// on the host backend (EngineOptions::device = "host"), where device memory is host memory, so plain
// vectors serve as tensors and it runs on any machine.
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "ferry/dtype.h"
#include "ferry/engine.h"
#include "ferry/status.h"

namespace {

absl::Status Run(const std::string& policy_dir) {
  ferry::EngineOptions options;
  options.policy_path = policy_dir + "/offload_fraction.lua";
  options.policy_args = {{"fraction", "0.5"}};
  options.optimizer.lr = 1e-2f;
  options.device = "host";
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<ferry::Engine> engine, ferry::Engine::Create(options));

  // The trainer's tensors: a weight matrix and a bias, bf16, with bf16 grads.
  std::vector<uint16_t> weight(64 * 32, ferry::F32ToBF16(0.5f)), weight_grad(64 * 32);
  std::vector<uint16_t> bias(32, ferry::F32ToBF16(0.0f)), bias_grad(32);
  FERRY_RETURN_IF_ERROR(engine->AddParam({.name = "fc.weight", .group = "fc", .shape = {64, 32},
                                          .dtype = ferry::DType::kBF16, .param = weight.data(),
                                          .grad = weight_grad.data()}));
  FERRY_RETURN_IF_ERROR(engine->AddParam({.name = "fc.bias", .group = "bias", .shape = {32},
                                          .dtype = ferry::DType::kBF16, .param = bias.data(),
                                          .grad = bias_grad.data()}));
  FERRY_RETURN_IF_ERROR(engine->Finalize());
  for (const ferry::GroupPlacement& g : engine->Placement()) {
    std::printf("group %-5s %-3s %lld elements\n", g.group.c_str(), g.offloaded ? "cpu" : "gpu",
                static_cast<long long>(g.numel));
  }
  for (int step = 1; step <= 20; ++step) {
    // "Backward": the gradient of 0.5 * ||w - 1||^2 is w - 1 (and b - 2 for the bias).
    for (size_t i = 0; i < weight.size(); ++i)
      weight_grad[i] = ferry::F32ToBF16(ferry::BF16ToF32(weight[i]) - 1.0f);
    for (size_t i = 0; i < bias.size(); ++i) bias_grad[i] = ferry::F32ToBF16(ferry::BF16ToF32(bias[i]) - 2.0f);
    FERRY_RETURN_IF_ERROR(engine->Step({}, /*stream=*/nullptr));
  }
  FERRY_RETURN_IF_ERROR(engine->Synchronize());
  std::printf("after 20 steps: weight[0] = %.4f (moving from 0.5 to 1), bias[0] = %.4f (moving from 0 to 2)\n",
              ferry::BF16ToF32(weight[0]), ferry::BF16ToF32(bias[0]));
  const std::string root = (std::filesystem::temp_directory_path() / "ferry-minimal-trainer").string();
  std::filesystem::remove_all(root);
  FERRY_ASSIGN_OR_RETURN(std::string dir, engine->SaveCheckpoint(root, 20));
  std::printf("checkpoint: %s\n", dir.c_str());
  FERRY_RETURN_IF_ERROR(engine->VerifyMasters());
  std::filesystem::remove_all(root);
  if (!(ferry::BF16ToF32(weight[0]) > 0.6f && ferry::BF16ToF32(bias[0]) > 0.1f)) {
    return absl::InternalError("the params did not move toward their targets");
  }
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  const std::string policy_dir = argc > 1 ? argv[1] : std::string(FERRY_SOURCE_DIR) + "/scripts/policies";
  absl::Status s = Run(policy_dir);
  if (!s.ok()) {
    std::fprintf(stderr, "minimal_trainer: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}
