// A real trainer that embeds Ferry: a 2-layer MLP (32 -> 64 tanh -> 8, bf16 params, fp32 grads)
// fitted to a synthetic regression task, its forward and backward on the device, Ferry's Adam on
// the optimizer side with the shipped offload_fraction policy placing part of the model's state in
// pinned host memory. It prints the loss going down, saves a checkpoint halfway, resumes from it in
// a fresh engine and model, and checks that the resumed run is bit-identical to the uninterrupted one.
//
//   mlp_trainer [--device=auto|host|cuda] [--steps=N] [--policy_dir=DIR] [--checkpoint_root=DIR]
//   mlp_trainer --bench [--device=...] [--batch=N --in=N --hidden=N --out=N --iters=N --warmup=N
//               --cpu_threads=N --groups=layer|one]
//
// --bench times the training loop of a host that never waits for the device, with and without
// Ferry's overlap (GradsReady during backward, WaitParams per layer in the next forward; with
// --groups=one every param is in one group, and the layers' params are announced as buckets with
// GradsReadyParams and waited for with WaitParamsOf): see mlp_bench.h.
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
#include <tuple>
#include <vector>

#include <unistd.h>

#include "absl/strings/str_format.h"
#include "ferry/engine.h"
#include "ferry/status.h"
#include "ferry/version.h"
#include "mlp.h"
#include "mlp_bench.h"
#include "mlp_engine.h"
#include "mlp_random.h"

namespace {

constexpr double kLossThreshold = 0.02;
constexpr int64_t kLossWindow = 10;  // the threshold applies to the mean loss of the last steps
constexpr int64_t kDefaultSteps = 400;
constexpr float kMaxLr = 1e-2f, kMinLr = 1e-3f;
constexpr char kUsage[] =
    "usage: mlp_trainer [--device=auto|host|cuda] [--steps=N (>= 2)] [--policy_dir=DIR] [--checkpoint_root=DIR]\n"
    "       mlp_trainer --bench [--device=...] [--policy_dir=DIR] [--batch=N] [--in=N] [--hidden=N] [--out=N]\n"
    "                   [--iters=N (>= 2)] [--warmup=N] [--cpu_threads=N (0: all CPUs)]\n"
    "                   [--groups=layer|one (a group per layer, the default; or every param in one group)]\n";

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
  bool bench = false;           // --bench: the overlap benchmark (mlp_bench.h) instead of training
  mlp::BenchOptions bench_options;
  bool bench_flags = false;     // a flag only --bench takes was given
};

using mlp::Run;

absl::StatusOr<Run> Build(const Flags& flags, const std::string& device, const mlp::Shape& shape,
                          uint64_t init_seed) {
  return mlp::Build(device, shape, init_seed, flags.policy_dir + "/offload_fraction.lua", {{"fraction", "0.5"}});
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

bool ParseInt(const std::string& text, int64_t min, int64_t* out) {
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || v < min) return false;
  *out = v;
  return true;
}

bool ParseFlags(int argc, char** argv, Flags* flags) {
  mlp::BenchOptions& bench = flags->bench_options;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    auto value = [&](std::string_view name, std::string* out) {
      if (a.substr(0, name.size()) != name) return false;
      *out = std::string(a.substr(name.size()));
      return true;
    };
    std::string v;
    if (value("--device=", &flags->device) || value("--policy_dir=", &flags->policy_dir) ||
        value("--checkpoint_root=", &flags->checkpoint_root)) {
      continue;
    }
    if (a == "--bench") {
      flags->bench = true;
      continue;
    }
    if (value("--groups=", &v)) {
      if (v == "layer" || v == "one") {
        bench.groups = v == "one" ? mlp::Groups::kOne : mlp::Groups::kLayer;
        flags->bench_flags = true;
        continue;
      }
      std::fprintf(stderr, "mlp_trainer: --groups is layer or one, not '%s'\n%s", v.c_str(), kUsage);
      return false;
    }
    if (value("--steps=", &v)) {
      if (ParseInt(v, 2, &flags->steps)) continue;
    } else {
      // The flags of --bench: name, minimum, destination.
      int64_t threads = -1;
      const std::tuple<std::string_view, int64_t, int64_t*> bench_ints[] = {
          {"--batch=", 1, &bench.shape.batch}, {"--in=", 1, &bench.shape.in},   {"--hidden=", 1, &bench.shape.hidden},
          {"--out=", 1, &bench.shape.out},     {"--iters=", 2, &bench.iters},   {"--warmup=", 0, &bench.warmup},
          {"--cpu_threads=", 0, &threads}};
      bool ok = false;
      for (const auto& [name, min, out] : bench_ints) {
        if (value(name, &v)) {
          ok = ParseInt(v, min, out);
          break;
        }
      }
      if (threads >= 0) bench.cpu_threads = static_cast<size_t>(threads);
      if (ok) {
        flags->bench_flags = true;
        continue;
      }
    }
    std::fprintf(stderr, "mlp_trainer: bad flag '%s'\n%s", argv[i], kUsage);
    return false;
  }
  if (flags->bench_flags && !flags->bench) {
    std::fprintf(stderr, "mlp_trainer: --batch, --in, --hidden, --out, --iters, --warmup, --cpu_threads and "
                         "--groups are flags of --bench\n%s", kUsage);
    return false;
  }
  if (flags->device != "auto" && flags->device != "host" && flags->device != "cuda") {
    std::fprintf(stderr, "mlp_trainer: --device is auto, host or cuda, not '%s'\n%s", flags->device.c_str(), kUsage);
    return false;
  }
  return true;
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
  if (flags.bench) {
    mlp::BenchOptions options = flags.bench_options;
    options.device = device;
    options.policy_dir = flags.policy_dir;
    const absl::Status s = mlp::RunBench(options);
    if (!s.ok()) {
      std::fflush(stdout);  // what it printed, before the error
      std::fprintf(stderr, "mlp_trainer --bench: %s\n", std::string(s.message()).c_str());
      return device == "cuda" && absl::IsUnavailable(s) ? 77 : 1;
    }
    return 0;
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
