// Several ranks in several processes, under mpirun: each process is one rank with its own engine and
// an MPI comm, holding random uneven shards of the global model of tests/engine/sharded_model.h. Every
// check compares this rank's shard with the same global model trained by a one-rank engine in this
// process. Run by tests/engine/mpi/run_checks.sh (ctest); usage:
//   multirank_check train                 1..4 ranks: bit-identical params after 8 steps (clipping, loss
//                                          scale, an injected inf), every placement
//   multirank_check save ROOT STEPS       train STEPS steps, saving after each (sync, or async with
//                                          FERRY_CHECK_ASYNC=1); used with SIGKILL by the driver
//   multirank_check resume ROOT TOTAL     load ROOT's latest checkpoint (saved by any number of ranks),
//                                          train to TOTAL steps (0: two past the checkpoint's):
//                                          bit-identical to the uninterrupted run
// Exit status 0 when every rank passed; every rank prints what failed.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "ckpt/checkpoint.h"
#include "engine/sharded_model.h"
#include "ferry/comm.h"
#include "ferry/engine.h"
#include "ferry/status.h"

namespace ferry::engine_test {
namespace {

constexpr uint64_t kInitSeed = 7;
constexpr float kMaxGradNorm = 20.0f;
constexpr float kLossScale = 2.0f;
constexpr int kInfStep = 3;

std::string PolicyPath(const std::string& name) { return std::string(FERRY_SOURCE_DIR) + "/scripts/policies/" + name; }


absl::StatusOr<Rank> MakeRank(std::shared_ptr<Comm> comm, const std::string& policy, uint64_t range_seed) {
  Rank r;
  const int rank = comm == nullptr ? 0 : comm->rank();
  const int world = comm == nullptr ? 1 : comm->world_size();
  FERRY_ASSIGN_OR_RETURN(r.device, CreateDevice({}));
  r.model = std::make_unique<ShardedModel>(r.device.get(), MixedModel(), RangesOf(rank, world, range_seed), kInitSeed);
  EngineOptions o;
  o.policy_path = policy;
  o.optimizer.lr = 1e-2f;
  o.optimizer.weight_decay = 0.01f;
  o.cpu_threads = 1;
  o.transfer_chunk_bytes = 4096;
  o.rank = rank;
  o.world_size = world;
  o.comm = std::move(comm);
  o.collective_timeout = absl::Seconds(60);
  o.checkpoint_timeout = absl::Seconds(120);
  FERRY_ASSIGN_OR_RETURN(r.engine, Engine::Create(o));
  FERRY_RETURN_IF_ERROR(r.model->Register(*r.engine));
  FERRY_RETURN_IF_ERROR(r.engine->Finalize());
  return r;
}

absl::Status TrainStep(Rank& r, int step) {
  const float scale = step % 3 == 0 ? 50.0f : 0.5f;
  FERRY_RETURN_IF_ERROR(
      r.model->SetGrads(100 + static_cast<uint64_t>(step), scale * kLossScale, step == kInfStep ? 3 : -1, 1234));
  return r.engine->Step({.lr = 1e-2f / static_cast<float>(step), .loss_scale = kLossScale, .max_grad_norm = kMaxGradNorm});
}

// This rank's shard compared with the one-rank run of `steps` steps.
absl::Status CompareWithReference(Rank& r, const std::string& policy, int steps, int rank, int world, uint64_t seed) {
  FERRY_RETURN_IF_ERROR(r.engine->Synchronize());
  FERRY_ASSIGN_OR_RETURN(Rank ref, MakeRank(nullptr, policy, 1));
  for (int step = 1; step <= steps; ++step) FERRY_RETURN_IF_ERROR(TrainStep(ref, step));
  FERRY_RETURN_IF_ERROR(ref.engine->Synchronize());
  const std::vector<GlobalParam> model = MixedModel();
  const auto ranges = RangesOf(rank, world, seed);
  for (size_t i = 0; i < model.size(); ++i) {
    const size_t es = DTypeSize(model[i].dtype);
    const std::vector<char> mine = r.model->Param(i);
    const std::vector<char> all = ref.model->Param(i);
    if (mine.size() != static_cast<size_t>(ranges[i].second - ranges[i].first) * es ||
        (!mine.empty() &&  // a rank may hold none of a param (memcmp's pointers must not be null)
         std::memcmp(mine.data(), all.data() + static_cast<size_t>(ranges[i].first) * es, mine.size()) != 0)) {
      return absl::InternalError(absl::StrCat("param '", model[i].name, "' [", ranges[i].first, ", ", ranges[i].second,
                                              ") differs from the one-rank run after ", steps, " steps"));
    }
  }
  return absl::OkStatus();
}

absl::Status Run(int argc, char** argv, std::shared_ptr<Comm> comm) {
  const int rank = comm->rank();
  const int world = comm->world_size();
  const std::string mode = argc > 1 ? argv[1] : "";
  // FERRY_CHECK_POLICY: a shipped policy's file name or an absolute path.
  const char* env_policy = getenv("FERRY_CHECK_POLICY");
  const std::string policy = env_policy != nullptr && env_policy[0] == '/'
                                 ? std::string(env_policy)
                                 : PolicyPath(env_policy != nullptr ? env_policy : "offload_fraction.lua");
  if (mode == "train") {
    for (const char* p : {"all_gpu.lua", "offload_all.lua", "offload_fraction.lua"}) {
      for (uint64_t seed = 1; seed <= 2; ++seed) {
        FERRY_ASSIGN_OR_RETURN(Rank r, MakeRank(comm, PolicyPath(p), seed));
        for (int step = 1; step <= 8; ++step) FERRY_RETURN_IF_ERROR(TrainStep(r, step));
        if (r.engine->Stats().skipped_steps != 1) return absl::InternalError("the inf step was not skipped once");
        absl::Status s = CompareWithReference(r, PolicyPath(p), 8, rank, world, seed);
        if (!s.ok()) return absl::Status(s.code(), absl::StrCat(p, ", range seed ", seed, ": ", s.message()));
      }
    }
    return absl::OkStatus();
  }
  int steps = 0;
  const bool save_after = argc == 5 && std::string(argv[4]) == "save";
  if ((argc != 4 && !save_after) || !absl::SimpleAtoi(argv[3], &steps)) {
    return absl::InvalidArgumentError("usage: multirank_check train | save ROOT STEPS | resume ROOT TOTAL [save]");
  }
  const std::string root = argv[2];
  const uint64_t seed = 3 + static_cast<uint64_t>(world);
  FERRY_ASSIGN_OR_RETURN(Rank r, MakeRank(comm, policy, seed));
  if (mode == "save") {
    for (int step = 1; step <= steps; ++step) {
      FERRY_RETURN_IF_ERROR(TrainStep(r, step));
      FERRY_RETURN_IF_ERROR(r.engine->SaveCheckpoint(root, step).status());
      if (rank == 0) std::printf("saved %d\n", step), std::fflush(stdout);
    }
    return r.engine->WaitCheckpoint();
  }
  if (mode == "resume") {
    FERRY_RETURN_IF_ERROR(r.engine->LoadCheckpoint(root));
    FERRY_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader, CheckpointReader::Open(root));
    // The step rank 0 loaded (the engine resolved `latest` on rank 0 too).
    std::vector<double> loaded = {rank == 0 ? static_cast<double>(reader->step()) : 0.0};
    FERRY_RETURN_IF_ERROR(comm->AllReduce(absl::MakeSpan(loaded), ReduceOp::kMax, absl::Seconds(60)));
    const int saved = static_cast<int>(loaded[0]);
    if (steps <= saved) steps = saved + 2;  // TOTAL 0: two steps past whatever was saved
    for (int step = saved + 1; step <= steps; ++step) FERRY_RETURN_IF_ERROR(TrainStep(r, step));
    if (rank == 0) {
      std::printf("resumed from step %d (saved by %s ranks) with %d ranks\n", saved,
                  reader->metadata().at("ferry.world_size").c_str(), world);
    }
    FERRY_RETURN_IF_ERROR(CompareWithReference(r, policy, steps, rank, world, seed));
    if (!save_after) return absl::OkStatus();
    // `save`: then the run saves, as a resumed run does (which collects the crash leftovers).
    FERRY_RETURN_IF_ERROR(r.engine->SaveCheckpoint(root, steps).status());
    FERRY_RETURN_IF_ERROR(r.engine->WaitCheckpoint());
    if (rank == 0) std::printf("saved %d after resuming\n", steps);
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown mode '", mode, "'"));
}

}  // namespace
}  // namespace ferry::engine_test

int main(int argc, char** argv) {
  absl::StatusOr<std::unique_ptr<ferry::Comm>> comm = ferry::MakeMpiComm();
  if (!comm.ok()) {
    std::fprintf(stderr, "multirank_check: %s\n", std::string(comm.status().message()).c_str());
    return 2;
  }
  std::shared_ptr<ferry::Comm> shared(std::move(*comm));
  absl::Status s = ferry::engine_test::Run(argc, argv, shared);
  // Every rank reports every rank's outcome.
  absl::Status all = ferry::AgreeStatus(*shared, s, "multirank_check", absl::Seconds(60));
  if (!all.ok()) {
    std::fprintf(stderr, "multirank_check rank %d: FAILED: %s\n", shared->rank(), std::string(all.message()).c_str());
    return 1;
  }
  if (shared->rank() == 0) std::printf("multirank_check %s: %d ranks OK\n", argc > 1 ? argv[1] : "", shared->world_size());
  return 0;
}
