// A real trainer that embeds Ferry: a 2-layer MLP (32 -> 64 tanh -> 8, bf16 params, fp32 grads)
// fitted to a synthetic regression task, its forward and backward on the device, Ferry's Adam on
// the optimizer side with the shipped offload_fraction policy placing part of the model's state in
// pinned host memory. It prints the loss going down, saves a checkpoint halfway, resumes from it in
// a fresh engine and model, and checks that the resumed run is bit-identical to the uninterrupted one.
//
//   mlp_trainer [--device=auto|host|cuda] [--steps=N] [--policy_dir=DIR] [--checkpoint_root=DIR]
//
// The contract it checks (exit 1 otherwise): the mean loss of the last 10 steps is below
// kLossThreshold (0.02, from about 2 at step 1) after the default 400 steps, and the resumed run
// matches the uninterrupted one in every loss and every param bit. The learning rate follows a cosine
// schedule from 1e-2 to 1e-3, a function of the step, so a resumed run follows it too. Exit 77 when --device=cuda and no GPU can be
// used. --device=auto uses CUDA when this trainer was built with it (the Ferry package was built
// with CUDA) and a GPU is present, else Ferry's host backend, where device memory is host memory.
//
// Built from its own CMakeLists.txt, as a project that uses Ferry: find_package(ferry) of an installed
// package, or add_subdirectory of Ferry's source tree (-DFERRY_SOURCE=DIR).
#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <numbers>
#include <string>
#include <string_view>
#include <vector>

#include <unistd.h>

#include "absl/strings/str_format.h"
#include "ferry/engine.h"
#include "ferry/status.h"
#include "ferry/version.h"
#include "mlp.h"
#include "mlp_random.h"

namespace {

constexpr double kLossThreshold = 0.02;
constexpr int64_t kLossWindow = 10;  // the threshold applies to the mean loss of the last steps
constexpr int64_t kDefaultSteps = 400;
constexpr float kMaxLr = 1e-2f, kMinLr = 1e-3f;

// Cosine decay from kMaxLr at step 1 to kMinLr at the last step.
float LearningRate(int64_t step, int64_t steps) {
  const double t = static_cast<double>(step - 1) / static_cast<double>(steps - 1);
  return static_cast<float>(kMinLr + 0.5 * (kMaxLr - kMinLr) * (1.0 + std::cos(std::numbers::pi * t)));
}

struct Flags {
  std::string device = "auto";
  int64_t steps = kDefaultSteps;
  std::string policy_dir = FERRY_POLICY_DIR;
  std::string checkpoint_root;  // default: a fresh temporary directory, removed at the end
};

// A model and the engine that owns its optimizer state.
struct Run {
  std::unique_ptr<mlp::Model> model;
  std::unique_ptr<ferry::Engine> engine;
};

absl::StatusOr<std::unique_ptr<mlp::Model>> MakeModel(const std::string& device, const mlp::Shape& shape) {
  if (device == "host") return mlp::MakeHostModel(shape);
#ifdef FERRY_SAMPLE_CUDA
  std::string error;
  std::unique_ptr<mlp::Model> model = mlp::MakeCudaModel(shape, &error);
  if (model == nullptr) return absl::UnavailableError(error);
  return model;
#else
  return absl::UnavailableError("this trainer was built without CUDA (the Ferry package has no CUDA backend)");
#endif
}

absl::StatusOr<Run> Build(const Flags& flags, const std::string& device, const mlp::Shape& shape,
                          uint64_t init_seed) {
  Run run;
  FERRY_ASSIGN_OR_RETURN(run.model, MakeModel(device, shape));
  std::string error;
  if (!run.model->Init(init_seed, &error)) return absl::InternalError(error);

  ferry::EngineOptions options;
  options.policy_path = flags.policy_dir + "/offload_fraction.lua";
  options.policy_args = {{"fraction", "0.5"}};
  options.optimizer.lr = 1e-2f;
  options.optimizer.weight_decay = 0.0f;
  options.device = device;  // the engine works on the memory the model allocated
  FERRY_ASSIGN_OR_RETURN(run.engine, ferry::Engine::Create(options));
  for (const mlp::Tensor& t : run.model->Tensors()) {
    FERRY_RETURN_IF_ERROR(run.engine->AddParam({.name = t.name, .group = t.group, .shape = t.shape,
                                                .dtype = ferry::DType::kBF16, .param = t.param, .grad = t.grad,
                                                .grad_dtype = ferry::DType::kF32}));
  }
  FERRY_RETURN_IF_ERROR(run.engine->Finalize());  // the policy's place() decides CPU or GPU per group
  return run;
}

// Steps [first, last] of `run`, appending each step's loss (before its update) to *losses.
absl::Status Train(Run& run, const mlp::Teacher& teacher, int64_t first, int64_t last, int64_t steps,
                   bool print, std::vector<double>* losses) {
  std::vector<float> x, y;
  for (int64_t step = first; step <= last; ++step) {
    teacher.Batch(step, &x, &y);
    double loss = 0.0;
    std::string error;
    if (!run.model->ForwardBackward(x.data(), y.data(), &loss, &error)) return absl::InternalError(error);
    // Ordered on the model's stream: after this backward, before the next forward.
    FERRY_RETURN_IF_ERROR(run.engine->Step({.lr = LearningRate(step, steps)}, run.model->stream()));
    losses->push_back(loss);
    if (print && (step == first || step % 50 == 0 || step == last)) {
      std::printf("step %4" PRId64 "  loss %.6f\n", step, loss);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<uint16_t>> Params(Run& run) {
  std::vector<uint16_t> bits;
  std::string error;
  if (!run.model->ReadParams(&bits, &error)) return absl::InternalError(error);
  return bits;
}

absl::Status Main(const Flags& flags, const std::string& device, const std::string& root) {
  const mlp::Shape shape;
  const mlp::Teacher teacher(shape);
  const int64_t save_at = flags.steps / 2;

  // The uninterrupted run, with a checkpoint at save_at.
  FERRY_ASSIGN_OR_RETURN(Run run, Build(flags, device, shape, /*init_seed=*/1));
  std::printf("ferry %s, trainer on %s, engine on %s\n", FERRY_VERSION_STRING, device.c_str(),
              run.engine->DeviceName().c_str());
  std::printf("placement (offload_fraction.lua, fraction = 0.5):\n");
  int offloaded = 0;
  for (const ferry::GroupPlacement& g : run.engine->Placement()) {
    std::printf("  %-4s %-3s %6" PRId64 " elements\n", g.group.c_str(), g.offloaded ? "cpu" : "gpu", g.numel);
    offloaded += g.offloaded ? 1 : 0;
  }
  if (offloaded != 1) return absl::InternalError("expected exactly one of the two groups offloaded");
  std::vector<double> losses;
  FERRY_RETURN_IF_ERROR(Train(run, teacher, 1, save_at, flags.steps, /*print=*/true, &losses));
  FERRY_ASSIGN_OR_RETURN(std::string dir, run.engine->SaveCheckpoint(root, save_at));
  FERRY_RETURN_IF_ERROR(run.engine->WaitCheckpoint());
  std::printf("saved %s\n", dir.c_str());
  FERRY_RETURN_IF_ERROR(Train(run, teacher, save_at + 1, flags.steps, flags.steps, /*print=*/true, &losses));
  FERRY_RETURN_IF_ERROR(run.engine->VerifyMasters());
  FERRY_ASSIGN_OR_RETURN(const std::vector<uint16_t> uninterrupted, Params(run));

  const double first = losses.front();
  const int64_t window = std::min<int64_t>(kLossWindow, flags.steps);
  double last = 0.0;
  for (int64_t i = flags.steps - window; i < flags.steps; ++i) last += losses[i] / static_cast<double>(window);
  std::printf("loss %.6f at step 1 -> %.6f, the mean of steps %" PRId64 "..%" PRId64 " (threshold %.3f)\n", first,
              last, flags.steps - window + 1, flags.steps, kLossThreshold);
  if (!(last < kLossThreshold)) {
    return absl::InternalError(absl::StrFormat("the loss did not fall below %g in %d steps: %g -> %g",
                                               kLossThreshold, flags.steps, first, last));
  }

  // The resumed run: a fresh model (other initial values) and engine, loaded from the checkpoint.
  FERRY_ASSIGN_OR_RETURN(Run resumed, Build(flags, device, shape, /*init_seed=*/2));
  FERRY_RETURN_IF_ERROR(resumed.engine->LoadCheckpoint(dir));
  std::vector<double> resumed_losses;
  FERRY_RETURN_IF_ERROR(Train(resumed, teacher, save_at + 1, flags.steps, flags.steps, /*print=*/false, &resumed_losses));
  FERRY_ASSIGN_OR_RETURN(const std::vector<uint16_t> after_resume, Params(resumed));
  for (size_t i = 0; i < resumed_losses.size(); ++i) {
    const double want = losses[save_at + i];
    if (std::memcmp(&resumed_losses[i], &want, sizeof want) != 0) {
      return absl::InternalError(absl::StrFormat("resumed run differs at step %d: loss %.17g, uninterrupted %.17g",
                                                 save_at + 1 + static_cast<int64_t>(i), resumed_losses[i], want));
    }
  }
  if (after_resume != uninterrupted) {
    return absl::InternalError("resumed run differs from the uninterrupted one in its final params");
  }
  std::printf("resumed from step %" PRId64 ": steps %" PRId64 "..%" PRId64
              " and all %zu params bit-identical to the uninterrupted run\n",
              save_at, save_at + 1, flags.steps, after_resume.size());
  return absl::OkStatus();
}

bool ParseFlags(int argc, char** argv, Flags* flags) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    auto value = [&](std::string_view name, std::string* out) {
      if (a.substr(0, name.size()) != name) return false;
      *out = std::string(a.substr(name.size()));
      return true;
    };
    std::string steps;
    if (value("--device=", &flags->device) || value("--policy_dir=", &flags->policy_dir) ||
        value("--checkpoint_root=", &flags->checkpoint_root)) {
      continue;
    }
    if (value("--steps=", &steps)) {
      flags->steps = std::strtoll(steps.c_str(), nullptr, 10);
      if (flags->steps >= 2) continue;
    }
    std::fprintf(stderr,
                 "usage: mlp_trainer [--device=auto|host|cuda] [--steps=N (>= 2)] [--policy_dir=DIR] "
                 "[--checkpoint_root=DIR]\n");
    return false;
  }
  return flags->device == "auto" || flags->device == "host" || flags->device == "cuda";
}

}  // namespace

int main(int argc, char** argv) {
  Flags flags;
  if (!ParseFlags(argc, argv, &flags)) return 2;
  std::string device = flags.device;
  if (device == "auto") {
#ifdef FERRY_SAMPLE_CUDA
    std::string error;
    const char* forced = std::getenv("FERRY_DEVICE");
    device = (forced != nullptr && std::string_view(forced) == "host") ? "host" : "cuda";
    if (device == "cuda" && mlp::MakeCudaModel(mlp::Shape{}, &error) == nullptr) device = "host";
#else
    device = "host";
#endif
  }
  const bool own_root = flags.checkpoint_root.empty();
  const std::string root =
      own_root ? (std::filesystem::temp_directory_path() / ("ferry-mlp-trainer-" + std::to_string(getpid()))).string()
               : flags.checkpoint_root;
  absl::Status s = Main(flags, device, root);
  if (own_root) {
    std::error_code ec;
    std::filesystem::remove_all(root, ec);
  }
  if (!s.ok()) {
    std::fprintf(stderr, "mlp_trainer: %s\n", std::string(s.message()).c_str());
    return device == "cuda" && absl::IsUnavailable(s) ? 77 : 1;
  }
  return 0;
}
