// The hybrid optimizer: GPU groups step through the device's fused multi-tensor Adam on the trainer's
// stream; offloaded (CPU) groups step through the pipeline D2H of grads -> CPU Adam -> H2D of params,
// chunk by chunk, so the three stages of different chunks overlap.
#ifndef FERRY_OPTIM_HYBRID_OPTIMIZER_H_
#define FERRY_OPTIM_HYBRID_OPTIMIZER_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/adam_math.h"
#include "base/adam_state.h"
#include "base/thread_pool.h"
#include "device/device.h"
#include "ferry/dtype.h"
#include "memory/pinned_arena.h"
#include "optim/cpu_adam.h"
#include "optim/early_step.h"
#include "optim/state_fence.h"
#include "optim/state_later.h"
#include "shard/layout.h"
#include "trace/tracer.h"
#include "transfer/transfer.h"

namespace ferry {

// A parameter the optimizer updates. `param` and `grad` are device memory owned by the trainer.
struct OptimParam {
  std::string name;
  size_t group = 0;  // index into the groups given to Create
  int64_t numel = 0;
  DType dtype = DType::kBF16;
  DType grad_dtype = DType::kBF16;
  void* param = nullptr;
  void* grad = nullptr;
  // The global index of the local element 0 (ParamSpec::shard_begin): the stochastic rounding counter
  // counts global elements, so any world size rounds the same.
  int64_t shard_begin = 0;
};

struct OptimGroup {
  std::string name;
  bool offloaded = false;
  std::optional<AdamHyper> hyper;  // this group's hyper-parameters; null: HybridOptions::hyper (hyper.lr unused)
  float lr_scale = 1.0f;           // the group steps with the step's lr times this (see GroupLr)
  // How the group's master and moments are stored (fp32 by default; bf16 moments, and a bf16 master
  // for bf16 params, as the policy asks) and how values are rounded into bf16. A bf16 master is a
  // copy of its own in the state (host or device), never the param itself: an offloaded group needs
  // one anyway, and the layout stays the same for both placements; the param is written from it.
  StateFormat state;
};

// The learning rate of a group with `lr_scale` at a step with learning rate `lr`: the product in
// double, rounded once (exactly `lr` for a scale of 1). The same for CPU and GPU groups.
inline float GroupLr(float lr, float lr_scale) {
  return static_cast<float>(static_cast<double>(lr) * static_cast<double>(lr_scale));
}

struct HybridOptions {
  AdamHyper hyper;
  size_t chunk_bytes = size_t{8} << 20;  // bytes of grads per pipeline chunk (see EngineOptions)
  size_t pipeline_depth = 4;     // staging slots: chunks in flight between D2H, CPU Adam and H2D
  NumaPolicy numa = NumaPolicy::kInterleave;
  int numa_node = -1;
  Tracer* tracer = nullptr;      // borrowed; null: no tracing (see trace/tracer.h)
  uint64_t rounding_seed = 0;    // seed of the stochastic rounding of bf16 state (base/adam_state.h)
  double spare_fraction = 1.0;   // the spare state's bytes, a fraction of the offloaded state's (EngineOptions)
  StateLater::Setting state_later;  // the state later (EngineOptions::state_later): off by default
};

// The inputs of one step besides the grads.
struct HybridStepParams {
  float lr = 1e-3f;
  // Each empty, or one entry per group: a set entry is that group's value at this step (a scheduler's),
  // replacing GroupLr(lr, lr_scale) (group_lr: torch-style absolute rates) or the group's own setting.
  std::vector<std::optional<float>> group_lr;
  std::vector<std::optional<std::pair<float, float>>> group_betas;  // (beta1, beta2)
  std::vector<std::optional<float>> group_weight_decay;
  float loss_scale = 1.0f;    // grads are divided by it
  float max_grad_norm = 0.0f; // > 0: global-norm clipping across every group
  bool check_finite = true;   // NaN/Inf in any grad skips the whole step
  // With check_finite: called with this step's gradient check (on the host) before anything is
  // decided, to replace it with the check over every rank's grads (an all-reduce); an error fails
  // the step with nothing updated. Null: the local check decides.
  std::function<absl::Status(GradStats&)> reduce_grad_stats;
  // Whether the trainer's stream waits in Step for every new param (else it calls WaitParams).
  bool wait_for_params = true;
  // Discard every early update of this step (StepOptions::discard_early): recompute those groups.
  bool discard_early = false;
};

struct HybridStepResult {
  bool skipped = false;      // a grad was NaN/Inf: nothing was updated
  double grad_norm = 0.0;    // global L2 norm of the unscaled grads (when checked)
  // Offloaded groups started early (BeginGroups) whose speculative update this step kept, and those
  // it discarded and recomputed (clipping triggered, other step inputs, or the early work failed).
  // A skipped step counts its early groups as neither.
  size_t early_committed = 0;
  size_t early_recomputed = 0;
};

// Which per-parameter tensor of the optimizer state.
enum class StateKind : uint8_t { kMaster, kExpAvg, kExpAvgSq };

// The params that get spare state under `budget` bytes (EngineOptions::spare_state_fraction), given
// each param's spare bytes in registration order, a model's forward order (0: not offloaded); 1 for
// a chosen param: spread evenly over the model, walking from its end (the order in which a backward
// makes the grads final), each param taken when that brings the bytes taken nearer to the budget's
// share of the bytes walked, and never over the budget (then, from the end again, any other that
// still fits).
std::vector<uint8_t> SpareSpread(const std::vector<size_t>& bytes, size_t budget);

// HybridOptimizer: one thread at a time.
class HybridOptimizer final {
 public:
  // Allocates every group's fp32 master, m and v (pinned host memory for offloaded groups, device
  // memory for the others) and the pinned staging of offloaded params, then initialises the masters
  // from the params (m = v = 0, step 0). REQUIRES: device and pool outlive the optimizer; every
  // param's pointers valid for its lifetime.
  static absl::StatusOr<std::unique_ptr<HybridOptimizer>> Create(Device* device, ThreadPool* pool,
                                                                 std::vector<OptimParam> params,
                                                                 std::vector<OptimGroup> groups,
                                                                 const HybridOptions& options);
  ~HybridOptimizer();

  // One step of every group, ordered after the work already on `trainer` (the grads), with `trainer`
  // made to wait for the new params. `lr` overrides the configured learning rate for this step.
  absl::StatusOr<HybridStepResult> Step(const HybridStepParams& params, Stream& trainer);
  absl::Status Step(float lr, Stream& trainer) { return Step(HybridStepParams{.lr = lr}, trainer).status(); }

  // Waits for every copy and kernel the optimizer has enqueued.
  absl::Status Synchronize();

  // ---- early steps (Engine::GradsReady) -------------------------------------------------------
  // Starts this step's work for `groups` (indices) whose grads are final on `trainer` now, while the
  // trainer goes on (typically with the rest of its backward): for offloaded groups a background
  // thread copies their grads down, runs CPU Adam into the groups' spare state buffers and uploads
  // the new params, each copy ordered after this point of `trainer`. The update assumes `params`
  // and no clipping and no NaN/Inf (a speculation). The next Step validates it: the update is kept
  // when the step's AdamScalars of each such group (learning rate, step, gradient multiplier) are
  // the same bits; otherwise it is discarded and the group is recomputed from its unchanged state,
  // and a skipped step restores the params from the masters. The result is the same bits as a Step
  // without BeginGroups in every case. GPU groups are only recorded: they update in Step.
  // The spare state buffers (as much pinned memory as the offloaded groups' state) are allocated at
  // the first call. Errors (nothing started): an index out of range, a group announced twice in
  // one step, invalid params. REQUIRES: the trainer does not change these grads, and its stream
  // no longer reads these params, until Step.
  absl::Status BeginGroups(absl::Span<const size_t> groups, const HybridStepParams& params, Stream& trainer);
  // BeginGroups for parts of groups (Engine::GradsReadyParams): the grads of `params` (indices into
  // params()) are final on `trainer` now. Each group's announced params become one part of its
  // update, which the early thread runs as it would a group's; a group is announced once all its
  // params are. At Step, the rest of a group announced in part is started too when the speculation
  // holds (its grads are final then), so that the group commits whole (CommitSpare). Errors (nothing
  // started): an index out of range, a param named twice or announced already in this step, invalid
  // params.
  absl::Status BeginParams(absl::Span<const size_t> params, const HybridStepParams& step, Stream& trainer);
  // True between the first BeginGroups of a step and its Step.
  bool step_in_progress() const { return !early_.order.empty(); }
  // Whether a param of group `g` was announced in the step in progress.
  bool announced(size_t g) const { return g < early_.touched.size() && early_.touched[g]; }
  // Makes `stream` wait until the params of `groups` hold the values of the last Step (their
  // uploads, or their GPU update, are done), so a trainer can start its next forward before the
  // last groups' params arrived. Step's StepOptions decide whether Step itself waits for all.
  // After a deferred Step (below) it blocks the calling thread until each group's upload has been
  // enqueued (its CPU Adam is done), then orders `stream` after it.
  absl::Status WaitParams(absl::Span<const size_t> groups, Stream& stream);
  // WaitParams for single params (indices into params()): after a deferred Step it waits only for
  // the part of the update that holds each param (its announcement's, or the bucket Step started),
  // not its whole group; otherwise as WaitParams of the param's group.
  absl::Status WaitParamsOf(absl::Span<const size_t> params, Stream& stream);

  // A deferred Step: with wait_for_params = false, a Step whose every offloaded group was started
  // early (BeginGroups) and whose speculation holds returns at once, while the early thread still
  // downloads grads, runs CPU Adam and uploads params (the work left when the backward ended runs
  // in forward order: see hybrid_optimizer_early_pass.cc). The trainer's next forward waits per
  // group (WaitParams). REQUIRES: the trainer leaves each offloaded group's grads unchanged until
  // its WaitParams (work its stream enqueues after that call may change them): its next backward
  // comes after its forward anyway; grads zeroed right after Step must wait. The update is
  // committed by Settle, which every other call runs first (the next announcement, Step,
  // Synchronize, state reads and writes, snapshots, the destructor): it waits for the rest of the
  // work and swaps in the new state. Whether a deferred step is in progress:
  bool deferred() const { return deferred_; }
  // Completes a deferred step (nothing otherwise). When its work failed, the groups it did not
  // finish keep their state of the step before (their params are rewritten from it and their step
  // count goes back) and the error names them.
  // `flush_state_later` false: the state later is left to the next early pass or Step (the next
  // step's first announcement).
  absl::Status Settle(bool flush_state_later = true);

  // Re-reads the fp32 masters of `groups` (indices) from the params; with `reset_optimizer` zeroes
  // their m, v and step count.
  absl::Status SyncFromModel(const std::vector<size_t>& groups, bool reset_optimizer);

  // FailedPrecondition naming the group, param and element where a param differs from its master
  // rounded to the param's dtype.
  absl::Status VerifyMasters();

  // Copies of one param's state to/from host memory `host` (numel floats for state, numel elements of
  // the param's dtype for the param). Synchronous. State stored as bf16 is widened exactly on reads
  // and rounded to nearest even on writes.
  absl::Status ReadState(size_t param, StateKind kind, float* host);
  absl::Status WriteState(size_t param, StateKind kind, const float* host);
  // The same in the state's stored dtype (state_dtype): numel elements of it, copied as they are.
  absl::Status ReadStateRaw(size_t param, StateKind kind, void* host);
  absl::Status ReadParam(size_t param, void* host);

  // One tensor of a snapshot: param `param`'s state `kind`, or (with `is_param`) the param itself.
  struct SnapshotItem {
    size_t param = 0;
    bool is_param = false;
    StateKind kind = StateKind::kMaster;
    void* dst = nullptr;  // host memory (pinned for full speed) of the tensor's size
    // The dtype of a state item's `dst` (kF32 or kBF16). When it differs from the state's stored
    // dtype (state_dtype) the copy converts: widening exactly, narrowing to nearest even. Ignored
    // for params.
    DType dtype = DType::kF32;
  };
  // Copies every item at once: device-resident tensors through one stream of D2H copies while the
  // host-resident (offloaded) state is copied by the thread pool, then waits for both. Equivalent to
  // ReadParam/ReadState per item, without a synchronization per tensor.
  absl::Status Snapshot(absl::Span<const SnapshotItem> items);
  // The inverse: writes every item's host data (`dst` is read) into the param or state, device copies
  // on one stream while the pool writes the offloaded state. Equivalent to WriteParam/WriteState per
  // item, without a synchronization per tensor.
  absl::Status Restore(absl::Span<const SnapshotItem> items);
  absl::Status WriteParam(size_t param, const void* host);

  // The snapshot of a background checkpoint, without blocking: enqueues the D2H copies of the
  // device-resident `items` (params, and the state of GPU groups) on the optimizer's work stream,
  // after the last Step's work, and returns. Every later change of those tensors is ordered after
  // the copies on the device (the next Step makes the trainer's stream wait for them; the other
  // writers use the work stream), so the trainer never waits for them on the host. Offloaded state
  // is refused (InvalidArgument): a checkpoint reads it in place under a StateFence instead; so is a
  // state item whose dtype is not the stored one (no conversion here).
  // REQUIRES: each `dst` stays valid until WaitSnapshot returned.
  absl::Status SnapshotDeviceAsync(absl::Span<const SnapshotItem> items);
  // Blocks until the copies of the last SnapshotDeviceAsync have landed. Safe to call from any
  // thread, concurrently with the trainer's calls (but not with SnapshotDeviceAsync itself).
  absl::Status WaitSnapshot();
  // Offloaded state a checkpoint reads in place: before Step updates a chunk it acquires the
  // chunk's params from `fence` (state not yet read is copied aside for the checkpoint; state being
  // read is waited for); every other call that writes offloaded state, and the destructor, wait for
  // the whole fence. Replaces an earlier fence; null removes it.
  void set_state_fence(std::shared_ptr<StateFence> fence) { fence_ = std::move(fence); }

  // Host memory of param `param`'s `kind` state (numel elements of state_dtype) when its group is
  // offloaded (valid while this optimizer lives), else nullptr. Read it only while no Step or write
  // of the state runs (or under a StateFence).
  const void* offloaded_state(size_t param, StateKind kind) const {
    return groups_[params_[param].group].offloaded ? StatePtr(param, kind) : nullptr;
  }
  // The dtype param `param`'s `kind` state is stored in.
  DType state_dtype(size_t param, StateKind kind) const {
    const StateFormat& f = groups_[params_[param].group].format;
    return kind == StateKind::kMaster ? f.master : f.moments;
  }
  const StateFormat& group_state(size_t g) const { return groups_[g].format; }
  // Bytes of group g's state (host memory when offloaded, device memory otherwise), 0 with no elements.
  size_t group_state_bytes(size_t g) const {
    return static_cast<size_t>(groups_[g].layout.total_elements()) * groups_[g].format.bytes_per_element();
  }
  int64_t group_step(size_t group) const { return groups_[group].step; }
  void set_group_step(size_t group, int64_t step) { groups_[group].step = step; }
  const std::vector<OptimParam>& params() const { return params_; }
  size_t num_groups() const { return groups_.size(); }
  const std::string& group_name(size_t g) const { return groups_[g].name; }
  bool offloaded(size_t g) const { return groups_[g].offloaded; }
  const AdamHyper& hyper() const { return options_.hyper; }
  size_t pinned_bytes() const;
  // Of pinned_bytes(), those huge pages back (ArenaSetup::huge_bytes of each arena).
  size_t pinned_huge_bytes() const;
  size_t spare_bytes() const { return spare_arena_ == nullptr ? 0 : spare_arena_->capacity(); }
  // The wall time CPU Adam rounds were running (rounds back to back counted once), and the bytes they
  // moved (CpuAdamTrafficBytes), summed over every step since creation: early passes, deferred
  // updates and Step's own pipeline alike.
  double cpu_adam_busy_seconds() const { return 1e-9 * static_cast<double>(cpu_busy_ns_.load(std::memory_order_relaxed)); }
  uint64_t cpu_adam_bytes() const { return cpu_bytes_.load(std::memory_order_relaxed); }
  // Of cpu_adam_bytes(), those of updates that wrote the spare state (speculation, out of place).
  uint64_t cpu_adam_spare_bytes() const { return cpu_spare_bytes_.load(std::memory_order_relaxed); }
  // Of cpu_adam_bytes(), those of the rounds that wrote the state after its params (the state later).
  uint64_t cpu_adam_later_bytes() const { return cpu_later_bytes_.load(std::memory_order_relaxed); }
  // The state later's kept grads' buffer and the bytes of it a cycle may stage now (0: off or not
  // allocated yet).
  size_t state_later_kept_bytes() const { return later_kept_bytes_.load(std::memory_order_relaxed); }
  size_t state_later_limit_bytes() const { return later_limit_bytes_.load(std::memory_order_relaxed); }
  // Replaces HybridOptions::spare_fraction. It sizes the spare state when it is allocated (the
  // first early step): a spare state already allocated keeps its size. REQUIRES: between steps (no
  // early work queued), `fraction` in [0, 1].
  void set_spare_fraction(double fraction) { options_.spare_fraction = fraction; }
  size_t gpu_state_bytes() const;

 private:
  // A pipeline pass over offloaded params: their grads down chunk by chunk, then per chunk CPU Adam
  // (or only the params' refresh from the masters) and the params up.
  struct PipelinePlan {
    std::vector<size_t> params;       // offloaded params, in pipeline order (4-byte grads first)
    std::vector<ChunkPlan> chunks;    // over the concatenation of their grads
  };
  enum class PipelineMode : uint8_t {
    kInPlace,       // CPU Adam updates the state in place
    kToSpare,       // CPU Adam reads the state and writes the groups' spare buffers (speculation)
    kRestoreParams  // no grads, no update: the params are rewritten from the masters
  };
  struct PipelineRun {
    const PipelinePlan* plan = nullptr;
    const std::vector<AdamScalars>* scalars = nullptr;  // per group (unused by kRestoreParams)
    Event* ready = nullptr;           // every copy waits for it on the device
    PipelineMode mode = PipelineMode::kInPlace;  // kInPlace or kRestoreParams (kToSpare: RunEarlyPass)
  };
  struct Group {
    std::string name;
    bool offloaded = false;
    AdamHyper hyper;         // lr unused: the step's lr times lr_scale
    float lr_scale = 1.0f;
    StateFormat format;
    int64_t step = 0;
    std::vector<size_t> params;  // indices into params_
    Layout layout;               // of this group's params, in elements
    HostSpan host_state;         // offloaded: [master | m | v], each layout.total_elements() elements
                                 // of its stored dtype (format.master, format.moments)
    HostSpan spare_state;        // offloaded, once an early step ran, for the params with a spare slot
                                 // (spare_slot_; all of them without a budget): [master | m | v] of
                                 // spare_n elements each. Each such param's state lives on one side
                                 // (state_side_); a speculative update writes the other, and a kept
                                 // one makes that the param's side (CommitSpare)
    int64_t spare_n = 0;
    DeviceBuffer device_state;   // on GPU: the same on the device
    char* state(StateKind kind, bool spare = false) const;  // spare: in spare_state
  };

  HybridOptimizer(Device* device, ThreadPool* pool, HybridOptions options);
  absl::Status Init(std::vector<OptimParam> params, std::vector<OptimGroup> groups);
  absl::Status CheckStepParams(const HybridStepParams& params) const;
  absl::StatusOr<HybridStepResult> StepChecked(const HybridStepParams& params, Stream& trainer);
  absl::Status StepGpuGroups(const std::vector<AdamScalars>& scalars, Stream& trainer);
  // The end of a step: the trainer's stream waits for the last upload (or, when it does not,
  // step_done_ is recorded after both on the work stream).
  absl::Status FinishUploads(bool trainer_waits, Stream& trainer);
  // Group g's scalars for the step in progress with gradient multiplier `grad_multiplier`.
  AdamScalars GroupScalars(size_t g, const HybridStepParams& params, double grad_multiplier) const;
  // The plan over the offloaded params of `groups` (every offloaded group: the cached full plan).
  PipelinePlan PlanFor(const std::vector<size_t>& groups) const;
  // The plan over `params` (offloaded ones).
  PipelinePlan PlanForParams(std::vector<size_t> params) const;
  // WaitParams of one group.
  absl::Status WaitGroup(size_t g, Stream& stream);
  // Runs one pass; every batch it submitted goes to pending_ (its last upload: last_upload_).
  absl::Status RunPipeline(const PipelineRun& run);
  // The early thread's loop, and its wait: blocks until the queue is empty and nothing runs;
  // returns the first error of the work since the last call.
  void EarlyLoop();
  absl::Status WaitEarlyIdle();
  // The same wait under `lock` (on early_mu_), leaving the status for WaitEarlyIdle.
  void WaitEarlyQuiet(std::unique_lock<std::mutex>& lock);
  absl::Status EnsureSpareState();
  // The first announcement of a step: settles the last one, resets the step's bookkeeping.
  absl::Status StartEarlyStep(Stream& trainer);
  // Marks `params` (validated, not announced yet) announced, and `whole` (groups) announced whole,
  // and queues the offloaded ones as one part when speculating.
  absl::Status Announce(const std::vector<size_t>& params, const std::vector<size_t>& whole,
                        const HybridStepParams& step, Stream& trainer);
  // Queues `parts` (ids and events not set yet) for the early thread, after an event recorded on
  // `trainer` now, with `scalars` per group.
  absl::Status QueueParts(std::vector<EarlyPart> parts, const std::vector<AdamScalars>& scalars, Stream& trainer,
                          bool in_place = false);
  // Step's own parts: the params of `groups` that no part holds yet, in buckets of about two
  // chunks, queued so that the early thread takes them in forward order: the announcements of this
  // step's backward last-to-first (a bucket may span groups: a layer's weights with its biases;
  // first-to-last when they came in registration order), then the params no announcement named, in
  // registration order.
  // `in_place`: the groups have no part in the spare buffers and the step is decided.
  absl::Status QueueRest(const std::vector<size_t>& groups, const std::vector<AdamScalars>& scalars, Stream& trainer,
                         bool in_place = false);
  // Forgets every part of the step (the early thread is idle): a failed speculation starts over.
  void ResetParts();
  // The early thread's work from `first` on: every announcement queued meanwhile joins it, and the
  // ring downloads the chunks of the latest announced group whose grads are final first
  // (hybrid_optimizer_early_pass.cc).
  absl::Status RunEarlyPass(EarlyItem first);
  // Step's deferred end (see deferred()) for the offloaded groups `started` (`in_place`: those whose
  // update runs in place, not swapped in): true when deferred, false when the early work has failed
  // already (Step then settles it as usual).
  absl::StatusOr<bool> DeferSettle(const std::vector<size_t>& started, const std::vector<size_t>& in_place = {});
  // Step's part for the announced groups once the step's decision is known (see BeginGroups).
  // Returns the offloaded groups Step must still update in place.
  // `discard`: recompute every announced group (HybridStepParams::discard_early).
  // `may_defer`: the trainer waits per group (wait_for_params = false), so the step may be deferred.
  absl::StatusOr<std::vector<size_t>> SettleEarly(bool skipped, bool discard, bool may_defer,
                                                  const std::vector<AdamScalars>& scalars,
                                                  Stream& trainer, HybridStepResult& result);
  // Drops the step in progress: stops the early work and rewrites the announced offloaded groups'
  // params from their masters (trainer waits for them). Nothing of the state changed.
  absl::Status AbandonEarly(Stream& trainer);
  // Rewrites the params of offloaded `groups` from their masters (after grads_ready_ is recorded).
  absl::Status RestoreParams(const std::vector<size_t>& groups, Stream& trainer);
  void StopEarlyThread();
  absl::Status WaitPending();
  // Blocks until the state fence (if any) released everything.
  void WaitForStateReaders() {
    if (fence_ != nullptr) fence_->WaitAll();
  }
  // Pointer of param `p`'s `kind` state (host memory for offloaded groups, device memory otherwise),
  // at element `e`.
  char* StatePtr(size_t p, StateKind kind, size_t e = 0) const;
  // Whether param `p` has a slot in its group's spare state (it may speculate), and whether every
  // param of group g has one.
  bool HasSpare(size_t p) const;
  bool AllSpare(size_t g) const;
  // The early pass is about to download chunk k of `plan` (a part of `groups` in `mode`): marks the
  // params it begins in place once Step has kept the speculation (kept_in_place_) and the groups
  // whose state it writes in place (early_in_place_). Whether Step has kept the speculation.
  bool BeginChunk(const PipelinePlan& plan, size_t k, const std::vector<size_t>& groups, PipelineMode mode);
  // A kept speculation of group g: each of its params updated out of place takes the side its update
  // wrote (those with spare state, less those begun after the keep, updated in place:
  // kept_in_place_).
  void CommitSpare(size_t g);
  // Stochastic rounding: param `p`'s key at step `step` (<= 0: the step its group computes next), for
  // local elements from `e0` on.
  StateRoundingKey RoundingKey(size_t p, size_t e0, int64_t step = 0) const;
  // Chunk `chunk` of a plan over `params`: appends its CPU Adam work (grads at `grad`, new params
  // into `param_out`; kToSpare: the new state into the spare buffers, at step `steps[group]`) and
  // the uploads of its params. kRestoreParams: work without grads or scalars.
  struct AdamWork {
    std::vector<CpuAdamTensor> tensors;
    std::vector<size_t> params;  // the param of each tensor
  };
  void ChunkWork(const std::vector<size_t>& params, const ChunkPlan& chunk, const char* grad, char* param_out,
                 PipelineMode mode, const std::vector<AdamScalars>* scalars, const std::vector<int64_t>* steps,
                 AdamWork& work, std::vector<CopyRegion>& uploads) const;
  // One round of CPU Adam over `work` (of `chunks` chunks), after the state fence let go of its params.
  // `meanwhile` (optional): the calling thread's work while the workers start on the round (the
  // pipeline's submissions); it runs once unless the round fails before it starts.
  absl::Status AdamRound(const AdamWork& work, size_t chunks, const std::function<void()>* meanwhile = nullptr);
  // AdamRound in two halves: StartAdamRound hands the round to the workers and returns, and
  // FinishAdamRound waits for it. A round started before the previous one finished follows it on the
  // workers without a barrier (RunEarlyPass). `work`'s buffers stay untouched until the finish.
  struct RoundInFlight {
    CpuAdamPending pending;
    int64_t start_ns = 0;  // when it started (SteadyNs)
    double chunks = 0.0, elements = 0.0, bytes = 0.0, spare_bytes = 0.0;
  };
  absl::StatusOr<RoundInFlight> StartAdamRound(const AdamWork& work, size_t chunks);
  void FinishAdamRound(RoundInFlight& round);
  // The state later (optim/state_later.h, hybrid_optimizer_later.cc). StageStateLater: the in-place
  // tensors of an early-pass round that fit become param only. RunStateLater: writes the staged
  // pieces' state in rounds; `yield` (the early thread's idle time) stops between rounds once a
  // caller waits for the early thread or work is queued. FlushStateLater: RunStateLater on the
  // trainer's thread between steps, the early thread quiet. DropStateLater: forgets `groups`' pieces.
  void StageStateLater(AdamWork& work);
  absl::Status RunStateLater(bool yield);
  absl::Status FlushStateLater();
  void DropStateLater(const std::vector<size_t>& groups);
  StateLater later_;
  std::atomic<int> early_waiters_{0};  // callers in WaitEarlyIdle, which RunStateLater yields to
  // The last FinishAdamRound's end (SteadyNs), and the sums of cpu_adam_busy_seconds() and
  // cpu_adam_bytes(): rounds run on one thread at a time (the early thread, or Step's after
  // WaitEarlyIdle); Stats() reads the sums from the trainer's thread.
  int64_t last_round_end_ns_ = 0;
  std::atomic<int64_t> cpu_busy_ns_{0};
  std::atomic<uint64_t> cpu_bytes_{0};
  std::atomic<uint64_t> cpu_spare_bytes_{0};  // of cpu_bytes_, those of updates into the spare state
  std::atomic<uint64_t> cpu_later_bytes_{0};  // of cpu_bytes_, those of the state later's rounds
  // later_'s buffer and limit as Stats() reads them (later_ itself is the early thread's).
  std::atomic<size_t> later_kept_bytes_{0}, later_limit_bytes_{0};
  // The same on the param's other side, where a speculative update writes. REQUIRES: HasSpare(p).
  char* SpareStatePtr(size_t p, StateKind kind, size_t e = 0) const;
  absl::Status SyncParamsFromModel(const std::vector<size_t>& params);
  // Snapshot (to_host) or Restore: device copies on work_stream_, offloaded state by the pool.
  absl::Status CopyItems(absl::Span<const SnapshotItem> items, bool to_host);
  // Enqueues the D2H copy of grad chunk k into grad slot `slot`.
  absl::StatusOr<std::unique_ptr<TransferBatch>> SubmitGradChunk(const PipelinePlan& plan, size_t k, size_t slot,
                                                                  Event& grads_ready);

  Device* device_;
  ThreadPool* pool_;
  HybridOptions options_;
  CpuAdam cpu_adam_;
  std::vector<OptimParam> params_;
  std::vector<Group> groups_;
  std::vector<int64_t> param_slot_;  // param -> element offset within its group's layout
  // param -> 1 when its state is in its group's spare_state, 0 in host_state. Changed only by
  // CommitSpare, between steps or in Settle / SettleEarly with the early thread idle.
  std::vector<uint8_t> state_side_;
  // param -> element offset within its group's spare_state (-1: none; EnsureSpareState).
  std::vector<int64_t> spare_slot_;
  std::vector<uint64_t> param_ids_;  // param -> RoundingParamId of its name

  // Offloaded params in pipeline order, the chunks of their grads (a plan over the concatenation of
  // their grad tensors), and the pinned staging ring: `pipeline_depth` grad slots of chunk_bytes and
  // twice as many param slots (both pipelines take them in turn, so two rounds in a row never share
  // one). Host memory per offloaded param is its state (12 bytes of fp32 state, 8 with bf16 moments,
  // 6 all bf16); the staging is a constant.
  PipelinePlan full_plan_;             // every offloaded param
  std::vector<HostSpan> grad_slots_;
  std::vector<HostSpan> param_slots_;
  std::unique_ptr<PinnedArena> arena_;
  std::unique_ptr<PinnedArena> spare_arena_;  // the spare state buffers (EnsureSpareState)
  std::unique_ptr<Transfer> transfer_;
  std::unique_ptr<Stream> work_stream_;  // state init/copies of GPU groups
  std::unique_ptr<Event> grads_ready_;
  std::unique_ptr<Event> step_done_;
  // The gradient check's result has reached grad_stats_ (a blocking event: Step waits on it for the
  // rest of the trainer's backward when the host runs ahead, and leaves that core to CPU Adam).
  std::unique_ptr<Event> stats_ready_;
  DeviceBuffer grad_stats_workspace_;        // LaunchGradStats' device workspace
  std::vector<GradTensorArgs> grad_tensors_; // every param's grad, in param order
  // Host copy of the last check, in one page registered with the device at Finalize. Pinned, not
  // pageable: a copy into pageable memory on the trainer's stream waits for that stream inside the
  // copy call, and when that stream is CUDA's legacy default stream (PyTorch's default) every other
  // thread's CUDA calls wait with it: the early steps' copies then stalled for the whole backward.
  GradStats* grad_stats_ = nullptr;
  void* grad_stats_page_ = nullptr;  // aligned_alloc'ed and registered (both or neither)
  std::vector<std::unique_ptr<TransferBatch>> pending_;  // the last step's copies, until finished
  // Per group: the upload batch holding its params' last chunk in the last step (in pending_), for
  // WaitParams; null when its params were not uploaded (GPU groups, skipped steps).
  std::vector<TransferBatch*> group_upload_;
  TransferBatch* last_upload_ = nullptr;  // the last upload batch submitted (in pending_), or null

  // Early steps. The trainer's thread owns early_ and the events; the queue is shared with the early
  // thread under early_mu_. While that thread works (early_busy_), it alone uses transfer_,
  // cpu_adam_, the pool and the staging slots: every other user first calls WaitEarlyIdle.
  EarlyStep early_;
  std::vector<std::unique_ptr<Event>> early_events_;
  std::thread early_thread_;
  std::mutex early_mu_;
  std::condition_variable early_cv_;
  std::deque<EarlyItem> early_queue_;   // guarded by early_mu_
  bool early_busy_ = false;             // guarded by early_mu_
  bool early_exit_ = false;             // guarded by early_mu_
  absl::Status early_status_;           // guarded by early_mu_: first error since WaitEarlyIdle
  std::atomic<bool> early_cancel_{false};
  // Guarded by early_mu_, reset at a step's first announcement: per group, its speculative update
  // is complete (CPU Adam done, upload enqueued and group_uploaded_ recorded after it).
  std::vector<uint8_t> early_done_;
  std::vector<uint8_t> part_done_;          // guarded by early_mu_: per part of the step, uploads enqueued
  std::vector<size_t> group_parts_left_;    // guarded by early_mu_: per group, its queued parts not done
  std::vector<uint8_t> group_all_queued_;   // guarded by early_mu_: per group, every param in a part
  // Guarded by early_mu_, reset at a step's first announcement. Step has kept the speculation: the
  // params the early pass has not begun yet run in place (their scalars are the step's own, and in
  // place is faster than into the spare buffers). Per param, begun after the keep and so updated in
  // place (its side stays; read by ChunkWork on the early thread); per group, some of its state was
  // written in place by this step's early work (a failure then leaves it partly updated).
  bool early_kept_ = false;
  std::vector<uint8_t> kept_in_place_;
  std::vector<uint8_t> early_in_place_;
  bool kept_in_place_on_ = true;  // FERRY_KEPT_IN_PLACE=0: such params speculate on (A/B)
  bool param_first_on_ = true;    // FERRY_PARAM_FIRST=0: the pass begins params chunk by chunk (A/B)
  std::vector<int64_t> part_of_param_;      // trainer's thread: per param, its part this step (-1: none)
  size_t parts_used_ = 0;                   // trainer's thread: parts of this step (of part_events_)
  std::vector<std::unique_ptr<Event>> part_events_;      // per part: its uploads (EarlyPart::uploaded)
  std::vector<std::unique_ptr<Event>> group_uploaded_;    // per offloaded group, on the H2D stream
  // A deferred step (see deferred()): owned by the trainer's thread.
  bool deferred_ = false;
  std::vector<size_t> deferred_groups_;  // its offloaded groups, all started early
  std::vector<uint8_t> deferred_in_place_;  // per group: its deferred update runs in place (no swap)
  // Whether announcements start the speculative work: false after a step whose clipping triggered or
  // that was skipped (the next one likely does too, and its speculation would be wasted work that
  // competes with the recomputation); true again after a step that neither clipped nor skipped.
  bool speculate_ = true;
  // FERRY_SPECULATE=always: announcements speculate after a clipped or skipped step too.
  bool speculate_always_ = false;
  std::unique_ptr<Event> trainer_point_;     // FinishUploads: the trainer's end of a step
  std::unique_ptr<Event> snapshot_done_;     // recorded on work_stream_ after SnapshotDeviceAsync's copies
  bool snapshot_pending_ = false;            // the next Step must order the trainer after snapshot_done_
  std::shared_ptr<StateFence> fence_;        // see set_state_fence

  // Tracing (options_.tracer set): the pipeline's copies as host-observed spans on a lane per
  // direction, from when the stream could start a chunk (its submission, or the end of the chunk
  // before it) to when the host saw its event complete.
  struct CopyTrace {
    TransferBatch* batch;  // owned by the step's vectors, then by pending_
    int64_t submit_ns;
  };
  struct LaneTrace {
    const char* name = "";
    int lane = 0;
    int64_t last_end_ns = 0;
    std::deque<CopyTrace> queue;
  };
  void TraceSubmitted(LaneTrace& lane, TransferBatch* batch);
  // Records every queued chunk seen complete (in order); with `block`, waits for each.
  void TraceObserve(LaneTrace& lane, bool block);
  LaneTrace d2h_trace_{.name = "d2h.chunk"};
  LaneTrace h2d_trace_{.name = "h2d.chunk"};
};

}  // namespace ferry

#endif  // FERRY_OPTIM_HYBRID_OPTIMIZER_H_
