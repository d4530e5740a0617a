// A data-parallel trainer with a sharded optimizer (ZeRO-1 style), one process per rank:
//
//   mpirun -np 4 build/ferry_sharded_trainer [POLICY_DIR]     (as root: --allow-run-as-root; few cores: --oversubscribe)
//   build/ferry_sharded_trainer                               (one rank; also without MPI in the build)
//
// Every rank keeps a full replica of the weights of a linear regression with a known answer, computes
// the gradient of its own batch, and all-reduces it (the trainer's collective; here through Ferry's
// Comm, a real trainer uses NCCL). Ferry then steps only this rank's shard of the weights: uneven
// ranges, the fp32 master and Adam moments of the shard offloaded to pinned host memory by the
// offload_all policy. The ranks all-gather the updated shards into their replicas, and the loss falls.
// At the end the ranks save one checkpoint together (one file per rank, committed by rank 0) and load
// it back into fresh engines. Runs on the host backend (device memory is host memory), so plain
// vectors serve as tensors.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "ferry/comm.h"
#include "ferry/engine.h"
#include "ferry/status.h"

namespace {

constexpr int64_t kDim = 256;
constexpr int kBatch = 128;
constexpr int kSteps = 200;

float Target(int64_t i) { return std::sin(0.01f * static_cast<float>(i)); }

// A deterministic input of example `k` of rank `rank`'s batch at `step`.
float Input(int step, int rank, int k, int64_t i) {
  uint64_t x = (static_cast<uint64_t>(step) << 40) ^ (static_cast<uint64_t>(rank) << 32) ^
               (static_cast<uint64_t>(k) << 20) ^ static_cast<uint64_t>(i);
  x += 0x9E3779B97F4A7C15ull;  // SplitMix64's finaliser
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  return static_cast<float>(x >> 40) / static_cast<float>(1 << 24) - 0.5f;
}

absl::Status Run(const std::string& policy_dir) {
  // The comm: MPI when the build has it (one rank without mpirun), else a single process.
  std::shared_ptr<ferry::Comm> comm;
  if (ferry::BuiltWithMpi()) {
    FERRY_ASSIGN_OR_RETURN(std::unique_ptr<ferry::Comm> mpi, ferry::MakeMpiComm());
    comm = std::move(mpi);
  } else {
    comm = ferry::MakeSingleProcessComm();
  }
  const int rank = comm->rank(), world = comm->world_size();
  // This rank's shard of the weights: uneven on purpose (rank r holds a share proportional to r + 1).
  const int64_t total_share = static_cast<int64_t>(world) * (world + 1) / 2;
  const int64_t begin = kDim * (static_cast<int64_t>(rank) * (rank + 1) / 2) / total_share;
  const int64_t end = kDim * (static_cast<int64_t>(rank + 1) * (rank + 2) / 2) / total_share;

  ferry::EngineOptions options;
  options.policy_path = policy_dir + "/offload_all.lua";
  options.optimizer.lr = 0.02f;
  options.device = "host";
  options.rank = rank;
  options.world_size = world;
  options.comm = comm;
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<ferry::Engine> engine, ferry::Engine::Create(options));
  std::vector<float> w(kDim, 0.0f);                  // the replica
  std::vector<float> shard(static_cast<size_t>(end - begin), 0.0f), shard_grad(shard.size());
  FERRY_RETURN_IF_ERROR(engine->AddParam({.name = "w", .shape = {kDim}, .dtype = ferry::DType::kF32,
                                          .param = shard.empty() ? nullptr : shard.data(),
                                          .grad = shard.empty() ? nullptr : shard_grad.data(),
                                          .shard_begin = begin, .shard_end = end}));
  FERRY_RETURN_IF_ERROR(engine->Finalize());  // collective: every rank's range checked against the others
  if (rank == 0) std::printf("%d ranks; rank 0 holds elements [%lld, %lld) of %lld\n", world,
                             static_cast<long long>(begin), static_cast<long long>(end), static_cast<long long>(kDim));
  const absl::Duration timeout = absl::Minutes(1);
  double first_loss = 0, loss = 0;
  for (int step = 1; step <= kSteps; ++step) {
    // Forward and backward of this rank's batch: loss = mean 0.5 (x.w - x.w*)^2.
    std::vector<double> grad(kDim + 1, 0.0);  // [gradient..., loss]
    for (int k = 0; k < kBatch; ++k) {
      double err = 0;
      for (int64_t i = 0; i < kDim; ++i) err += Input(step, rank, k, i) * (w[i] - Target(i));
      for (int64_t i = 0; i < kDim; ++i) grad[i] += err * Input(step, rank, k, i) / kBatch;
      grad[kDim] += 0.5 * err * err / kBatch;
    }
    // The trainer's collective: average the gradients (and the loss) over the ranks.
    FERRY_RETURN_IF_ERROR(comm->AllReduce(absl::MakeSpan(grad), ferry::ReduceOp::kSum, timeout));
    for (int64_t i = begin; i < end; ++i) shard_grad[i - begin] = static_cast<float>(grad[i] / world);
    loss = grad[kDim] / world;
    if (step == 1) first_loss = loss;
    FERRY_RETURN_IF_ERROR(engine->Step({.lr = 0.02f * (1.0f - static_cast<float>(step - 1) / kSteps), .max_grad_norm = 10.0f}));  // this rank's shard only
    FERRY_RETURN_IF_ERROR(engine->Synchronize());
    // The trainer's collective: all-gather the updated shards into every replica.
    FERRY_ASSIGN_OR_RETURN(std::vector<std::string> shards,
                           comm->AllGather(std::string(reinterpret_cast<const char*>(shard.data()),
                                                       shard.size() * sizeof(float)), timeout));
    size_t at = 0;
    for (const std::string& s : shards) {
      std::memcpy(w.data() + at, s.data(), s.size());
      at += s.size() / sizeof(float);
    }
    if (rank == 0 && (step == 1 || step % 40 == 0)) std::printf("step %3d  loss %.6f\n", step, loss);
  }
  const std::string root = (std::filesystem::temp_directory_path() / "ferry-sharded-trainer").string();
  if (rank == 0) std::filesystem::remove_all(root);
  FERRY_RETURN_IF_ERROR(comm->Barrier(timeout));
  FERRY_ASSIGN_OR_RETURN(std::string dir, engine->SaveCheckpoint(root, kSteps));  // collective
  // A fresh engine over a zeroed shard loads it back: this rank reads only its range.
  std::vector<float> saved = shard;
  std::fill(shard.begin(), shard.end(), 0.0f);
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<ferry::Engine> fresh, ferry::Engine::Create(options));
  FERRY_RETURN_IF_ERROR(fresh->AddParam({.name = "w", .shape = {kDim}, .dtype = ferry::DType::kF32,
                                         .param = shard.empty() ? nullptr : shard.data(),
                                         .grad = shard.empty() ? nullptr : shard_grad.data(),
                                         .shard_begin = begin, .shard_end = end}));
  FERRY_RETURN_IF_ERROR(fresh->Finalize());
  FERRY_RETURN_IF_ERROR(fresh->LoadCheckpoint(root));
  const bool same = shard == saved;
  std::vector<double> all_same = {same ? 0.0 : 1.0};
  FERRY_RETURN_IF_ERROR(comm->AllReduce(absl::MakeSpan(all_same), ferry::ReduceOp::kSum, timeout));
  if (rank == 0) {
    std::printf("checkpoint %s (%d rank files) loaded back by every rank: %s\n", dir.c_str(), world,
                all_same[0] == 0 ? "identical" : "DIFFERENT");
    std::filesystem::remove_all(root);
  }
  if (all_same[0] != 0) return absl::InternalError("a rank loaded other weights than it saved");
  if (!(loss < first_loss / 50)) {
    return absl::InternalError(absl::StrCat("the loss fell only from ", first_loss, " to ", loss));
  }
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  const std::string policy_dir = argc > 1 ? argv[1] : std::string(FERRY_SOURCE_DIR) + "/scripts/policies";
  absl::Status s = Run(policy_dir);
  if (!s.ok()) {
    std::fprintf(stderr, "sharded_trainer: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}
