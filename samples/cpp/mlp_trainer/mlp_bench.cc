// `mlp_trainer --bench` (mlp_bench.h): the same loop timed three ways on fresh models and engines.
#include "mlp_bench.h"

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "ferry/engine.h"
#include "ferry/status.h"
#include "ferry/version.h"
#include "mlp.h"
#include "mlp_engine.h"
#include "mlp_random.h"

namespace mlp {
namespace {

using Clock = std::chrono::steady_clock;

enum class Mode { kAllGpu, kPlain, kOverlap };

constexpr const char* kModeNames[] = {"all_gpu", "plain", "overlap"};
constexpr int64_t kBatches = 4;  // distinct batches, used in turn
constexpr char kOneGroup[] = "mlp";  // --groups=one: every param's group

// What each run does, for the table.
std::string ModeLabel(Mode mode, Groups groups) {
  switch (mode) {
    case Mode::kAllGpu:
      return "all_gpu.lua, Step";
    case Mode::kPlain:
      return "offload_all.lua, Step";
    case Mode::kOverlap:
      break;
  }
  return groups == Groups::kOne ? "offload_all.lua, GradsReadyParams + WaitParamsOf"
                                : "offload_all.lua, GradsReady + WaitParams";
}

// The batches: x and y uniform in [-1, 1). The bench times the loop and fits nothing; the Teacher's
// targets would cost the host more than a step at the large shapes.
struct Batch {
  std::vector<float> x, y;
};
std::vector<Batch> MakeBatches(const Shape& s) {
  std::vector<Batch> batches(kBatches);
  for (int64_t k = 0; k < kBatches; ++k) {
    Random r(0xbe4c0000ull + static_cast<uint64_t>(k));
    batches[k].x.resize(s.batch * s.in);
    batches[k].y.resize(s.batch * s.out);
    for (float& v : batches[k].x) v = r.Uniform();
    for (float& v : batches[k].y) v = r.Uniform();
  }
  return batches;
}

// A learning rate that changes at every step (from 1e-3 down to 5e-4), so the step's options must
// reach GradsReady too for the early updates to be kept.
float BenchLr(int64_t step, int64_t steps) {
  return 1e-3f * (1.0f - 0.5f * static_cast<float>(step - 1) / static_cast<float>(steps));
}

struct Result {
  double median_ms = 0.0;
  double mean_ms = 0.0;  // the timed iterations' wall time over their number, the drain included
  double loss = 0.0;     // of the last batch
  std::vector<uint16_t> params;
  ferry::EngineStats stats;
};

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

// A model hook that runs an engine call on `names` (groups or params); its error stops the pass.
bool Hooked(const absl::Status& s, const char* call, const std::vector<std::string>& names, std::string* error) {
  if (s.ok()) return true;
  *error = absl::StrCat(call, "({\"", absl::StrJoin(names, "\", \""), "\"}): ", s.ToString());
  return false;
}

absl::StatusOr<Result> Time(const BenchOptions& o, Mode mode, const std::vector<Batch>& batches) {
  const std::string policy = o.policy_dir + (mode == Mode::kAllGpu ? "/all_gpu.lua" : "/offload_all.lua");
  const bool one_group = o.groups == Groups::kOne;
  FERRY_ASSIGN_OR_RETURN(Run run, Build(o.device, o.shape, /*init_seed=*/1, policy, {}, o.cpu_threads,
                                        one_group ? kOneGroup : ""));
  for (const ferry::GroupPlacement& g : run.engine->Placement()) {
    if (g.offloaded != (mode != Mode::kAllGpu)) {
      return absl::InternalError(absl::StrCat(policy, " placed group '", g.group, "' on the ",
                                              g.offloaded ? "CPU" : "GPU"));
    }
  }
  ferry::Engine& engine = *run.engine;
  Model& model = *run.model;
  void* const stream = model.stream();
  const bool overlap = mode == Mode::kOverlap;
  const int64_t total = o.warmup + o.iters;

  ferry::StepOptions options;  // this step's, for GradsReady and Step alike
  options.wait_for_params = !overlap;
  // Each layer's params (the model's hooks name the layer: "fc1", "fc2").
  std::map<std::string, std::vector<std::string>> layer_params;
  for (const Tensor& t : model.Tensors()) layer_params[t.group].push_back(t.name);
  const LayerHook none;
  LayerHook wait_params = none, grads_ready = none;
  if (overlap && !one_group) {  // a group per layer: announce and wait per group
    wait_params = [&](const std::string& layer, std::string* error) {
      return Hooked(engine.WaitParams({layer}, stream), "WaitParams", {layer}, error);
    };
    grads_ready = [&](const std::string& layer, std::string* error) {
      return Hooked(engine.GradsReady({layer}, options, stream), "GradsReady", {layer}, error);
    };
  } else if (overlap) {  // one group: the layer's params are a bucket, announced and waited for alone
    wait_params = [&](const std::string& layer, std::string* error) {
      const std::vector<std::string>& params = layer_params[layer];
      return Hooked(engine.WaitParamsOf(params, stream), "WaitParamsOf", params, error);
    };
    grads_ready = [&](const std::string& layer, std::string* error) {
      const std::vector<std::string>& params = layer_params[layer];
      return Hooked(engine.GradsReadyParams(params, options, stream), "GradsReadyParams", params, error);
    };
  }

  // The host never waits for the device in this loop: Forward and Backward only enqueue, and Step
  // waits only for what CPU Adam needs (the grads of the offloaded groups).
  std::vector<Clock::time_point> starts;
  std::string error;
  for (int64_t step = 1; step <= total; ++step) {
    if (step > o.warmup) starts.push_back(Clock::now());
    const Batch& batch = batches[(step - 1) % kBatches];
    options.lr = BenchLr(step, total);
    // Before the first Step there are no new params to wait for.
    if (!model.Forward(batch.x.data(), batch.y.data(), step > 1 ? wait_params : none, &error) ||
        !model.Backward(grads_ready, &error)) {
      return absl::InternalError(absl::StrFormat("%s, step %d: %s", kModeNames[static_cast<int>(mode)], step, error));
    }
    FERRY_RETURN_IF_ERROR(engine.Step(options, stream));
  }
  // The last iteration ends once its new params are on the device (the loss is read after them).
  if (overlap) FERRY_RETURN_IF_ERROR(engine.WaitParams({}, stream));
  Result r;
  if (!model.ReadLoss(&r.loss, &error)) return absl::InternalError(error);
  const Clock::time_point end = Clock::now();

  std::vector<double> ms;
  for (size_t i = 0; i < starts.size(); ++i) {
    ms.push_back(Ms((i + 1 < starts.size() ? starts[i + 1] : end) - starts[i]));  // to the next start, or the end
  }
  std::sort(ms.begin(), ms.end());
  r.median_ms = ms.size() % 2 == 1 ? ms[ms.size() / 2] : 0.5 * (ms[ms.size() / 2 - 1] + ms[ms.size() / 2]);
  r.mean_ms = Ms(end - starts.front()) / static_cast<double>(o.iters);
  FERRY_RETURN_IF_ERROR(engine.Synchronize());
  if (!model.ReadParams(&r.params, &error)) return absl::InternalError(error);
  r.stats = engine.Stats();
  return r;
}

}  // namespace

absl::Status RunBench(const BenchOptions& o) {
  const Shape& s = o.shape;
  if (o.iters < 2 || o.warmup < 0) return absl::InvalidArgumentError("--iters must be >= 2 and --warmup >= 0");
  const int64_t fc1 = s.hidden * s.in + s.hidden, fc2 = s.out * s.hidden + s.out;
  std::printf("ferry %s, mlp_trainer --bench on %s: batch %" PRId64 ", in %" PRId64 " -> hidden %" PRId64
              " -> out %" PRId64 "; %" PRId64 " params (fc1 %" PRId64 ", fc2 %" PRId64 "), bf16 params, fp32 grads\n",
              FERRY_VERSION_STRING, o.device.c_str(), s.batch, s.in, s.hidden, s.out, fc1 + fc2, fc1, fc2);
  std::printf("%" PRId64 " warm-up + %" PRId64 " timed iterations each; the host never waits for the device "
              "inside the loop\n", o.warmup, o.iters);
  const bool one_group = o.groups == Groups::kOne;
  if (one_group) {
    std::printf("groups: one (every param in group '%s'; overlap announces each layer's params as a bucket "
                "with GradsReadyParams and waits with WaitParamsOf)\n", kOneGroup);
  } else {
    std::printf("groups: layer (a group per layer, fc1 and fc2; overlap announces with GradsReady and waits with "
                "WaitParams per group)\n");
  }
  const std::vector<Batch> batches = MakeBatches(s);

  Result results[3];
  for (Mode mode : {Mode::kAllGpu, Mode::kPlain, Mode::kOverlap}) {
    FERRY_ASSIGN_OR_RETURN(results[static_cast<int>(mode)], Time(o, mode, batches));
  }
  const Result& all_gpu = results[0];
  std::printf("  %-8s %-50s %10s %10s %10s\n", "run", "", "median ms", "mean ms", "/ all_gpu");
  for (Mode mode : {Mode::kAllGpu, Mode::kPlain, Mode::kOverlap}) {
    const int m = static_cast<int>(mode);
    std::printf("  %-8s %-50s %10.3f %10.3f %10.3f\n", kModeNames[m], ModeLabel(mode, o.groups).c_str(),
                results[m].median_ms, results[m].mean_ms, results[m].median_ms / all_gpu.median_ms);
  }
  const Result& plain = results[static_cast<int>(Mode::kPlain)];
  const Result& overlap = results[static_cast<int>(Mode::kOverlap)];
  std::printf("overlap / plain: %.3f (median), %.3f (mean)\n", overlap.median_ms / plain.median_ms,
              overlap.mean_ms / plain.mean_ms);

  // Ferry's overlap is exact: the same bits as Step alone.
  const int64_t total = o.warmup + o.iters;
  const int64_t groups_per_step = one_group ? 1 : 2;  // every group of the model, each step
  if (overlap.params != plain.params) {
    size_t first = 0;
    while (first < plain.params.size() && overlap.params[first] == plain.params[first]) ++first;
    return absl::InternalError(absl::StrFormat(
        "the params after %d iterations differ with and without overlap (first at element %d of %d)", total, first,
        plain.params.size()));
  }
  if (std::memcmp(&overlap.loss, &plain.loss, sizeof plain.loss) != 0) {
    return absl::InternalError(absl::StrFormat("the last loss differs with and without overlap: %.17g vs %.17g",
                                               overlap.loss, plain.loss));
  }
  if (overlap.stats.early_groups_kept != groups_per_step * total || overlap.stats.early_groups_recomputed != 0) {
    return absl::InternalError(absl::StrFormat(
        "overlap kept %d early group updates and recomputed %d; expected %d kept, none recomputed",
        overlap.stats.early_groups_kept, overlap.stats.early_groups_recomputed, groups_per_step * total));
  }
  // Every step returned before its offloaded update ended (the per-layer waits of the next forward
  // waited for it).
  if (overlap.stats.deferred_steps != total) {
    return absl::InternalError(absl::StrFormat("overlap deferred %d of %d steps; expected all",
                                               overlap.stats.deferred_steps, total));
  }
  std::printf("plain and overlap (groups %s): all %zu params and the last loss (%.6f) bit-identical after %" PRId64
              " iterations; early group updates kept %" PRId64 ", recomputed 0; steps deferred %" PRId64 "\n",
              one_group ? "one" : "layer", plain.params.size(), plain.loss, total, overlap.stats.early_groups_kept,
              overlap.stats.deferred_steps);
  return absl::OkStatus();
}

}  // namespace mlp
