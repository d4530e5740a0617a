// The engine's implementation class, shared by the files of engine/src/engine:
//   engine.cc             registration, Finalize, placement moves, state access, stats, Create
//   engine_step.cc        Step, GradsReady(Params), WaitParams(Of), the step's inputs, the on_step hook
//   engine_checkpoint.cc  SaveCheckpoint, LoadCheckpoint and their pinned staging
//   engine_ranks.cc       several ranks: the spec exchange at Finalize, the grad-stats reduction
#ifndef FERRY_ENGINE_ENGINE_IMPL_H_
#define FERRY_ENGINE_ENGINE_IMPL_H_


#include <sys/mman.h>

#include "ferry/engine.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <numeric>
#include <optional>
#include <set>
#include <thread>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/strings/ascii.h"
#include "base/absl_compat.h"
#include "base/logging.h"
#include "base/host_share.h"
#include "base/thread_affinity.h"
#include "base/thread_pool.h"
#include "ckpt/bulk_reader.h"
#include "ckpt/checkpoint.h"
#include "ckpt/checkpoint_writer.h"
#include "ckpt/posix_file.h"
#include "device/device.h"
#include "ferry/status.h"
#include "memory/pinned_arena.h"
#include "optim/hybrid_optimizer.h"
#include "optim/state_fence.h"
#include "policy/policy.h"
#include "trace/tracer.h"


namespace ferry {
namespace engine_internal {


inline constexpr char kModelKind[] = "model";
inline constexpr std::pair<StateKind, const char*> kStateKinds[] = {
    {StateKind::kMaster, "master"}, {StateKind::kExpAvg, "exp_avg"}, {StateKind::kExpAvgSq, "exp_avg_sq"}};

// This rank's share of its host and CPU Adam's workers in it (EngineOptions::cpu_threads,
// local_rank, pin_cpu_threads; base/host_share.h).
struct WorkerPlan {
  HostShare share;
  LocalRanks local;
  size_t threads = 1;
  std::vector<int> cpus;  // the CPUs the workers may run on; empty: any
  std::string knee;       // what TuneWorkers measured; empty: not measured
  size_t chunk_bytes = kHostChunkBytes;  // the offload pipeline's chunk (TransferChunkBytes)
};
WorkerPlan PlanWorkers(const EngineOptions& options, const Device& device);
// Holds the process's other threads to the plan's share where EngineOptions::pin_trainer_threads says
// (HostShare::HoldsTrainer; base/thread_affinity.h), once per process: a later plan leaves the first
// hold as it is. Returns whether the share's reason changed (it then says
// what was done).
bool HoldTrainerThreads(const EngineOptions& options, WorkerPlan& plan);

inline std::string StateTensorName(const std::string& param, const char* kind) { return absl::StrCat(param, ":", kind); }

// Every EngineOptions field in its range (Engine::Create); the error names the field and its value.
absl::Status ValidateEngineOptions(const EngineOptions& options);
// The range of each optimizer setting; `where` prefixes the message. Checks only the fields set.
absl::Status ValidateGroupOptions(const GroupOptions& o, std::string_view where);

// A group's optimizer settings as text, recorded per group in checkpoints (metadata key
// "ferry.group.<group>.optimizer") and compared across ranks at Finalize: "adamw=1 lr_scale=1
// weight_decay=0.01 beta1=0.9 beta2=0.999 eps=1e-08 bias_correction=1", each float as the shortest
// text that reads back as it (equal text iff equal values). `resolved` has every field set.
std::string FormatGroupSettings(const GroupOptions& resolved, bool bias_correction);
// Every field whose value differs between two FormatGroupSettings texts, as {field, a's value, b's
// value}; fields missing from either side are not compared.
std::vector<std::array<std::string, 3>> DiffGroupSettings(std::string_view a, std::string_view b);

// Pinned host memory for checkpoints: device-resident tensors are staged in it for saves, and every
// tensor of a load is read into it and verified before anything is applied. Kept (grown when
// needed) across saves and loads. On the CUDA backend it is registered with the device so copies
// run at the pinned rate; registering a fresh buffer (which faults in and pins every page) runs on
// a background thread, overlapping the reads of a load, and Ready() waits for it. One thread at a
// time (besides that internal thread).
class CheckpointStaging final {
 public:
  static absl::StatusOr<std::unique_ptr<CheckpointStaging>> Create(Device* device, size_t bytes) {
    constexpr size_t kAlign = size_t{2} << 20;  // whole huge pages
    const size_t rounded = std::max<size_t>(kAlign, (bytes + kAlign - 1) / kAlign * kAlign);
    void* data = ::mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (data == MAP_FAILED) {
      return absl::ResourceExhaustedError(absl::StrCat("checkpoint staging: cannot map ", rounded, " bytes: ",
                                                       std::strerror(errno)));
    }
    (void)::madvise(data, rounded, MADV_HUGEPAGE);  // fewer faults and TLB misses; advisory
    std::unique_ptr<CheckpointStaging> s(new CheckpointStaging(device, static_cast<char*>(data), rounded));
    if (device->backend() == Backend::kCuda) {
      s->registrar_ = std::thread([raw = s.get()] {
        NameCurrentThread("ferry-register");
        raw->register_status_ = raw->device_->RegisterHost(raw->data_, raw->bytes_);
      });
    }
    return s;
  }
  ~CheckpointStaging() {
    if (registrar_.joinable()) registrar_.join();
    if (device_->backend() == Backend::kCuda && register_status_.ok()) {
      absl::Status st = device_->UnregisterHost(data_);
      if (!st.ok()) FERRY_LOG(ERROR) << "checkpoint staging: " << st;
    }
    ::munmap(data_, bytes_);
  }
  CheckpointStaging(const CheckpointStaging&) = delete;
  CheckpointStaging& operator=(const CheckpointStaging&) = delete;
  char* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  // Blocks until the buffer is registered with the device; the registration's error, if any.
  absl::Status Ready() {
    if (registrar_.joinable()) registrar_.join();
    return register_status_;
  }

 private:
  CheckpointStaging(Device* device, char* data, size_t bytes) : device_(device), data_(data), bytes_(bytes) {}
  Device* device_;
  char* data_;
  size_t bytes_;
  absl::Status register_status_;  // written by registrar_ until it is joined
  std::thread registrar_;
};

// Where the bytes of each tensor of a save come from (shared with the writer's callbacks).
struct SaveSources {
  std::vector<bool> staged;    // copied into the staging (device-resident), else read in place
  std::vector<size_t> region;  // of an in-place tensor: its region of the StateFence
};

struct ParamRecord {
  ParamSpec spec;             // spec.shard_end resolved (never -1)
  int64_t numel = 0;          // local elements: spec.shard_end - spec.shard_begin
  int64_t global_numel = 0;   // of the global tensor
  size_t group = 0;
  int64_t opt = -1;           // index among the optimizer's params; -1 when the local range is empty
};

class EngineImpl final : public Engine {
 public:
  EngineImpl(EngineOptions options, std::unique_ptr<Device> device, std::unique_ptr<Policy> policy,
             WorkerPlan workers)
      : options_(std::move(options)),
        device_(std::move(device)),
        policy_(std::move(policy)),
        workers_(std::move(workers)),
        pool_(std::make_unique<ThreadPool>(workers_.threads, -1, workers_.cpus, "ferry-adam")) {
    comm_ = options_.comm != nullptr ? options_.comm : std::shared_ptr<Comm>(MakeSingleProcessComm());
    std::string trace_path = options_.trace_path;
    if (trace_path.empty()) {
      const char* env = std::getenv("FERRY_TRACE");
      if (env != nullptr) trace_path = env;
    }
    if (!trace_path.empty()) {
      // A rank's file, by its comm's rank; an engine without one (each DDP rank an engine of its own)
      // by the launcher's, so that the ranks' files do not overwrite each other.
      int rank = comm_->rank(), world = comm_->world_size();
      if (world == 1) {
        const LauncherRank launcher = DetectLauncherRank();
        rank = launcher.rank;
        world = launcher.world_size;
      }
      tracer_ = std::make_unique<Tracer>(TracerOptions{
          .path = RankTracePath(trace_path, rank, world),
          .pid = rank,
          .process_name = absl::StrCat("ferry rank ", rank, " (", device_->name(), ")")});
      tracer_->NameThread("trainer");
      TraceHostShare();
    }
  }

  ~EngineImpl() override {
    if (ckpt_writer_ != nullptr) ckpt_writer_->WaitIdle();  // it may read the optimizer's state in place
    optimizer_.reset();  // releases its arena and device state before the device goes away
    if (tracer_ != nullptr) {
      absl::Status s = tracer_->Flush();
      if (!s.ok()) FERRY_LOG(ERROR) << "writing the trace: " << s;
    }
  }

  absl::Status AddParam(const ParamSpec& spec) override;
  absl::Status AddGroup(const std::string& group, const GroupOptions& options) override;
  absl::Status Finalize() override;
  absl::Status Step(const StepOptions& options, void* stream) override;
  absl::Status GradsReady(const std::vector<std::string>& groups, const StepOptions& options, void* stream) override;
  absl::Status WaitParams(const std::vector<std::string>& groups, void* stream) override;
  absl::Status GradsReadyParams(const std::vector<std::string>& params, const StepOptions& options,
                                void* stream) override;
  absl::Status WaitParamsOf(const std::vector<std::string>& params, void* stream) override;
  absl::Status Synchronize() override {
    return optimizer_ == nullptr ? absl::OkStatus() : optimizer_->Synchronize();
  }
  absl::StatusOr<std::string> SaveCheckpoint(const std::string& root, int64_t step) override;
  absl::Status WaitCheckpoint() override;
  std::optional<absl::Status> PollCheckpoint() override;
  absl::Status LoadCheckpoint(const std::string& path) override { return LoadCheckpoint(path, LoadOptions{}); }
  absl::Status LoadCheckpoint(const std::string& path, const LoadOptions& options) override;
  LoadReport LastLoad() const override { return last_load_; }
  absl::Status SyncFromModel(const std::vector<std::string>& groups, bool reset_optimizer) override;
  absl::Status ReloadPolicy(const std::string& path, const std::map<std::string, std::string>& args) override;
  // Moves every group whose placement differs from `placement` (which names every group) between pinned
  // host memory and the device, values and step counts unchanged. On error nothing changes.
  absl::Status MoveTo(const ferry::Placement& placement);
  // Calls the policy's on_step hook after a step and applies the moves it asks for.
  absl::Status RunOnStep(double step_seconds);
  absl::Status VerifyMasters() override;
  absl::Status ReadState(const std::string& param, std::string_view kind, float* host) override;
  absl::Status WriteState(const std::string& param, std::string_view kind, const float* host) override;
  absl::StatusOr<int64_t> GroupStep(const std::string& group) const override;
  absl::Status SetGroupStep(const std::string& group, int64_t step) override;
  std::vector<GroupPlacement> Placement() const override;
  EngineStats Stats() const override;
  std::string DeviceName() const override { return device_->name(); }
  bool OnGpu() const override { return device_->backend() == Backend::kCuda; }

 private:
  absl::Status RequireFinalized(std::string_view what) const {
    if (optimizer_ == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(ToAbsl(what), " before Finalize()"));
    }
    return absl::OkStatus();
  }
  // RequireFinalized, and no step in progress (GradsReady without its Step yet).
  // Also completes a deferred step (HybridOptimizer::Settle): what follows sees its state.
  absl::Status RequireBetweenSteps(std::string_view what);
  // The optimizer's inputs of a step with `options` (without the several-ranks reduction).
  // InvalidArgument for a bad StepOptions::group_lr.
  absl::StatusOr<HybridStepParams> StepParams(const StepOptions& options) const;
  std::vector<GroupInfo> GroupInfos() const;
  // The optimizer's index of `param` (-1: an empty local range) and the state `kind` names, for
  // ReadState/WriteState.
  absl::StatusOr<std::pair<int64_t, StateKind>> StateOf(const std::string& param, std::string_view kind) const;
  // Each group's learning rate override of a step (HybridStepParams::group_lr) from StepOptions::group_lr.
  absl::StatusOr<std::vector<std::optional<float>>> GroupLrs(const StepOptions& options) const;
  // StepOptions' per-group list `named` (group_betas, group_weight_decay) as one entry per group;
  // InvalidArgument naming `field` for an unknown group or one named twice.
  template <typename T>
  absl::StatusOr<std::vector<std::optional<T>>> ByGroup(const std::vector<std::pair<std::string, T>>& named,
                                                        const char* field) const;
  // Group `g`'s optimizer settings, every field set: AddGroup's, else options_.optimizer's.
  GroupOptions ResolvedGroupOptions(size_t g) const;
  // At the first Finalize that offloads a group: the engine's own choice of workers (cpu_threads 0,
  // no cap) cut to the host's bandwidth knee when the share has more than kKneeProbeAbove CPUs
  // (optim/worker_knee.h). REQUIRES: no optimizer yet.
  void TuneWorkers();
  // At the first Finalize of several ranks (collective: every rank calls it, also after a local
  // error): where every rank shares a host of more than kSmallShareCpus CPUs with other local ranks,
  // offloads, and has the engine's own choice of workers, they measure CPU Adam's knee together
  // (optim/worker_knee.h, MeasureSharedKnee) and take it instead of half their share. An error only
  // when a collective fails. REQUIRES: no optimizer yet, the pool unused.
  absl::Status TuneSharedWorkers(const absl::Status& local, const ferry::Placement& placement);
  // At the first Finalize that offloads a group: HoldTrainerThreads (the process's other threads held
  // to the share where pin_trainer_threads says), before the workers are measured.
  void HoldThreads(const ferry::Placement& placement);
  // This rank's share of its host as a span of the trace (`ferry trace` prints it): at creation, and
  // again where HoldThreads changed it.
  void TraceHostShare();
  // The spare state's fraction for an optimizer of `placement`: EngineOptions::spare_state_fraction,
  // or the policy's Placement::spare_state when that is smaller (an option outside [0, 1] is passed
  // on as it is, for the optimizer to refuse).
  double SpareFraction(const ferry::Placement& placement) const;
  // A new optimizer with `placement`; its masters come from the params (m = v = 0). Its spare state
  // is bounded by SpareFraction(placement).
  absl::StatusOr<std::unique_ptr<HybridOptimizer>> BuildOptimizer(const ferry::Placement& placement,
                                                                  std::vector<bool>* offloaded_out);
  absl::StatusOr<PolicyContext> Context();
  absl::StatusOr<std::vector<size_t>> GroupIndices(const std::vector<std::string>& names) const;
  // The optimizer's indices of the named params (those with elements on this rank); `what` names the
  // call in errors (NotFound naming an unknown param).
  absl::StatusOr<std::vector<size_t>> OptimParamIndices(std::string_view what,
                                                        const std::vector<std::string>& names) const;
  std::string PolicyName() const { return policy_ == nullptr ? "(default policy)" : policy_->path(); }
  // The metadata a checkpoint records (format, world size, optimizer, each group's step and placement).
  std::map<std::string, std::string> CheckpointMetadata() const;
  // Several ranks: rank 0's `plan` (or its error) and `metadata` replace every other rank's (one
  // broadcast); returns the plan's status, the same on every rank. One rank: plan.status().
  absl::Status ShareCheckpointPlan(absl::StatusOr<CheckpointPlan>& plan, std::map<std::string, std::string>& metadata);
  // ckpt_staging_, grown to at least `bytes`. REQUIRES: no save in flight.
  absl::StatusOr<char*> EnsureStaging(size_t bytes);
  // LoadCheckpoint of one checkpoint: reads and verifies everything, then applies. Several ranks:
  // every rank returns the same status.
  absl::Status LoadCheckpointFrom(const std::string& path);
  // How far LoadCheckpointLocal got: failed while reading (before the ranks' agreement), refused by
  // the agreement (some rank failed to read), or past it (applied, or failed while applying).
  enum class LoadPhase { kReading, kRefused, kApplied };
  // LoadCheckpointFrom of one checkpoint directory, this rank's part: reads and verifies its ranges,
  // agrees with the other ranks, then applies.
  absl::Status LoadCheckpointLocal(const std::string& dir, LoadPhase* phase);

  // ---- several ranks (engine_ranks.cc) ----
  int rank() const { return comm_->rank(); }
  int world_size() const { return comm_->world_size(); }
  bool multi_rank() const { return comm_->world_size() > 1; }
  // Every rank's outcome of `what`: OK only when every rank was OK (see AgreeStatus). One rank: `mine`.
  absl::Status Agree(const absl::Status& mine, std::string_view what);
  // Exchanges the param specs and checks that the ranks registered the same params with ranges that
  // tile each global tensor; fills canonical_. Every rank returns the same verdict.
  absl::Status ExchangeSpecs();
  // Several ranks: every group's state precision (master, moments, rounding) as `optimizer` keeps it
  // must be rank 0's. Collective; the same verdict on every rank, naming the rank and the group.
  absl::Status CheckStatePrecisionAgrees(const HybridOptimizer& optimizer);
  // The all-reduce of a step's gradient check (found-inf and the exact sum of squares) across ranks,
  // with this rank's outcome so far: an error on any rank fails the step on every rank.
  absl::Status ReduceGradStats(GradStats& stats, const absl::Status& mine);
  // Rank 0's `*blob` on every rank (a decision taken there). One rank: unchanged.
  absl::Status BroadcastFromRankZero(std::string* blob, std::string_view what);

  EngineOptions options_;
  std::unique_ptr<Tracer> tracer_;  // null: tracing off. Outlives everything that borrows it.
  std::unique_ptr<Device> device_;
  std::unique_ptr<Policy> policy_;
  WorkerPlan workers_;
  bool threads_held_ = false;  // HoldThreads ran (at the first Finalize that offloads)
  // CPU Adam's workers; replaced once, by TuneWorkers, before any optimizer uses it.
  std::unique_ptr<ThreadPool> pool_;
  std::shared_ptr<Comm> comm_;           // never null (single process by default)
  std::unique_ptr<Comm> ckpt_comm_;      // Duplicate of comm_ for checkpoint exchanges; null: use comm_
  bool ckpt_comm_async_ = false;         // ckpt_comm_ may run on the writer thread (async saves)
  std::vector<size_t> canonical_;        // param indices in rank 0's registration order
  std::vector<ParamRecord> params_;
  absl::flat_hash_map<std::string, size_t> param_index_;
  std::vector<std::string> group_names_;  // in order of first appearance
  absl::flat_hash_map<std::string, size_t> group_index_;
  std::vector<DType> group_dtype_;
  std::map<std::string, GroupOptions> group_options_;  // given by AddGroup (maybe before any param joined)
  std::vector<bool> offloaded_;
  std::unique_ptr<HybridOptimizer> optimizer_;
  int64_t skipped_steps_ = 0;
  int64_t early_kept_ = 0;        // EngineStats::early_groups_kept
  int64_t early_recomputed_ = 0;  // EngineStats::early_groups_recomputed
  int64_t deferred_steps_ = 0;    // EngineStats::deferred_steps
  int numa_node_ = -1;            // EngineStats::numa_node
  // What the last place() call (Finalize, ReloadPolicy) chose beyond the groups' kinds: its bound on
  // the spare state (Placement::spare_state) and its NUMA policy (Placement::numa); on_step moves
  // keep both.
  std::optional<double> policy_spare_state_;
  std::optional<std::string> policy_numa_;
  std::string numa_policy_;  // EngineStats::numa_policy: the NUMA policy of the offloaded state in force
  bool last_step_skipped_ = false;
  double last_grad_norm_ = 0.0;
  LoadReport last_load_;
  // Checkpoints (SaveCheckpoint/LoadCheckpoint). Declared last, so destroyed first: the writer
  // waits for its save in flight and joins its threads before the staging it reads is freed.
  // Pinned host memory that device-resident tensors are staged in for saves and loads; kept (and
  // grown when needed) across them. Each save lays it out afresh and copies every staged tensor, so
  // a changed structure never writes stale bytes.
  std::unique_ptr<CheckpointStaging> ckpt_staging_;
  std::shared_ptr<StateFence> ckpt_fence_;  // of the last asynchronous save
  uint64_t ckpt_copied_aside_ = 0;          // copied aside under earlier fences
  std::unique_ptr<CheckpointWriter> ckpt_writer_;
};

}  // namespace engine_internal
}  // namespace ferry

#endif  // FERRY_ENGINE_ENGINE_IMPL_H_
