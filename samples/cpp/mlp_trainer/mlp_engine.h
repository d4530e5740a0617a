// A model and the Ferry engine that owns its optimizer state, as both modes of the trainer build them
// (mlp_trainer.cc: training with a checkpoint and resume; mlp_bench.cc: the overlap benchmark).
#ifndef FERRY_SAMPLES_MLP_TRAINER_MLP_ENGINE_H_
#define FERRY_SAMPLES_MLP_TRAINER_MLP_ENGINE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ferry/engine.h"
#include "ferry/status.h"
#include "mlp.h"

namespace mlp {

struct Run {
  std::unique_ptr<Model> model;
  std::unique_ptr<ferry::Engine> engine;
};

// The model on `device` ("host" or "cuda"); Unavailable when it cannot run there.
inline absl::StatusOr<std::unique_ptr<Model>> MakeModel(const std::string& device, const Shape& shape) {
  if (device == "host") return MakeHostModel(shape);
#ifdef FERRY_SAMPLE_CUDA
  std::string error;
  std::unique_ptr<Model> model = MakeCudaModel(shape, &error);
  if (model == nullptr) return absl::UnavailableError(error);
  return model;
#else
  return absl::UnavailableError("this trainer was built without CUDA (the Ferry package has no CUDA backend)");
#endif
}

// A model initialised from `init_seed` and an engine with `policy` (a file of Ferry's policy
// directory) that has registered its tensors, bf16 params with fp32 grads, and finalized. Each
// tensor is in its layer's group (Tensor::group), or, when `one_group` is not empty, every tensor is
// in that one group.
inline absl::StatusOr<Run> Build(const std::string& device, const Shape& shape, uint64_t init_seed,
                                 const std::string& policy_path, const std::map<std::string, std::string>& args,
                                 size_t cpu_threads = 0, const std::string& one_group = "") {
  Run run;
  FERRY_ASSIGN_OR_RETURN(run.model, MakeModel(device, shape));
  std::string error;
  if (!run.model->Init(init_seed, &error)) return absl::InternalError(error);

  ferry::EngineOptions options;
  options.policy_path = policy_path;
  options.policy_args = args;
  options.optimizer.lr = 1e-2f;
  options.optimizer.weight_decay = 0.0f;
  options.device = device;  // the engine works on the memory the model allocated
  options.cpu_threads = cpu_threads;
  FERRY_ASSIGN_OR_RETURN(run.engine, ferry::Engine::Create(options));
  for (const Tensor& t : run.model->Tensors()) {
    FERRY_RETURN_IF_ERROR(run.engine->AddParam({.name = t.name, .group = one_group.empty() ? t.group : one_group,
                                                .shape = t.shape, .dtype = ferry::DType::kBF16, .param = t.param,
                                                .grad = t.grad, .grad_dtype = ferry::DType::kF32}));
  }
  FERRY_RETURN_IF_ERROR(run.engine->Finalize());  // the policy's place() decides CPU or GPU per group
  return run;
}

}  // namespace mlp

#endif  // FERRY_SAMPLES_MLP_TRAINER_MLP_ENGINE_H_
