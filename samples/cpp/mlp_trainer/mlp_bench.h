// `mlp_trainer --bench`: the training loop of a trainer whose host never waits for the device, timed
// with and without Ferry's overlap, every group offloaded (offload_all.lua).
//
// Each iteration enqueues the forward and the backward (Model::Forward, Model::Backward) and calls
// Engine::Step on the model's stream; the loss is read once, at the end. Three runs, each on a fresh
// model and engine from the same seed and the same batches:
//   all_gpu   the state on the device (all_gpu.lua): the iteration Ferry aims for;
//   plain     offload_all.lua, Step only (wait_for_params = true);
//   overlap   offload_all.lua, each layer's grads announced once its backward is enqueued (fc2's, then
//             fc1's), Step with wait_for_params = false, and a wait for each layer's params before
//             the layer in the next forward.
// How the params are grouped (--groups, BenchOptions::groups), the same in all three runs:
//   layer     a group per layer ("fc1", "fc2"): overlap announces with GradsReady({"fc2"}) and waits
//             with WaitParams({"fc1"}), per group;
//   one       every param in one group ("mlp"): overlap announces each layer's params as a bucket with
//             GradsReadyParams({"fc2.weight", "fc2.bias"}) and waits with WaitParamsOf of the layer's
//             params, so one group still overlaps its update with the backward and the next forward.
// It prints which grouping ran, each run's median and mean iteration time and overlap / plain, and
// fails (error) unless plain and overlap end with every param and the last loss bit-identical and
// overlap kept every early update (EngineStats::early_groups_kept = 2 per iteration with a group per
// layer, 1 with one group) and deferred every step (EngineStats::deferred_steps).
#ifndef FERRY_SAMPLES_MLP_TRAINER_MLP_BENCH_H_
#define FERRY_SAMPLES_MLP_TRAINER_MLP_BENCH_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "mlp.h"

namespace mlp {

// How the bench groups the model's params (--groups=layer|one).
enum class Groups { kLayer, kOne };

struct BenchOptions {
  std::string device = "host";  // "host" or "cuda"
  std::string policy_dir;       // Ferry's shipped policies (all_gpu.lua, offload_all.lua)
  Shape shape;                  // the default: the trainer's small MLP, quick on the host backend
  int64_t iters = 20;           // timed iterations (>= 2)
  int64_t warmup = 3;           // untimed iterations before them
  size_t cpu_threads = 0;       // EngineOptions::cpu_threads (0: all CPUs)
  Groups groups = Groups::kLayer;
};

absl::Status RunBench(const BenchOptions& options);

}  // namespace mlp

#endif  // FERRY_SAMPLES_MLP_TRAINER_MLP_BENCH_H_
