// The hybrid optimizer: GPU groups step through the device's fused multi-tensor Adam on the trainer's
// stream; offloaded (CPU) groups step through the pipeline D2H of grads -> CPU Adam -> H2D of params,
// chunk by chunk, so the three stages of different chunks overlap.
#ifndef FERRY_OPTIM_HYBRID_OPTIMIZER_H_
#define FERRY_OPTIM_HYBRID_OPTIMIZER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
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
#include "optim/state_fence.h"
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
};

// The inputs of one step besides the grads.
struct HybridStepParams {
  float lr = 1e-3f;
  float loss_scale = 1.0f;    // grads are divided by it
  float max_grad_norm = 0.0f; // > 0: global-norm clipping across every group
  bool check_finite = true;   // NaN/Inf in any grad skips the whole step
  // With check_finite: called with this step's gradient check (on the host) before anything is
  // decided, to replace it with the check over every rank's grads (an all-reduce); an error fails
  // the step with nothing updated. Null: the local check decides.
  std::function<absl::Status(GradStats&)> reduce_grad_stats;
};

struct HybridStepResult {
  bool skipped = false;      // a grad was NaN/Inf: nothing was updated
  double grad_norm = 0.0;    // global L2 norm of the unscaled grads (when checked)
};

// Which per-parameter tensor of the optimizer state.
enum class StateKind : uint8_t { kMaster, kExpAvg, kExpAvgSq };

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
  size_t gpu_state_bytes() const;

 private:
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
    DeviceBuffer device_state;   // on GPU: the same on the device
    char* state(StateKind kind) const;
  };

  HybridOptimizer(Device* device, ThreadPool* pool, HybridOptions options);
  absl::Status Init(std::vector<OptimParam> params, std::vector<OptimGroup> groups);
  absl::Status StepGpuGroups(float lr, double grad_multiplier, Stream& trainer);
  absl::Status StepCpuGroups(float lr, double grad_multiplier, Event& grads_ready);
  absl::Status WaitPending();
  // Blocks until the state fence (if any) released everything.
  void WaitForStateReaders() {
    if (fence_ != nullptr) fence_->WaitAll();
  }
  // Pointer of param `p`'s `kind` state (host memory for offloaded groups, device memory otherwise),
  // at element `e`.
  char* StatePtr(size_t p, StateKind kind, size_t e = 0) const;
  // Stochastic rounding: param `p`'s key at the step its group computes next, for local elements
  // from `e0` on.
  StateRoundingKey RoundingKey(size_t p, size_t e0) const;
  absl::Status SyncParamsFromModel(const std::vector<size_t>& params);
  // Snapshot (to_host) or Restore: device copies on work_stream_, offloaded state by the pool.
  absl::Status CopyItems(absl::Span<const SnapshotItem> items, bool to_host);
  // Enqueues the D2H copy of grad chunk k into its ring slot.
  absl::StatusOr<std::unique_ptr<TransferBatch>> SubmitGradChunk(size_t k, Event& grads_ready);

  Device* device_;
  ThreadPool* pool_;
  HybridOptions options_;
  CpuAdam cpu_adam_;
  std::vector<OptimParam> params_;
  std::vector<Group> groups_;
  std::vector<int64_t> param_slot_;  // param -> element offset within its group's layout
  std::vector<uint64_t> param_ids_;  // param -> RoundingParamId of its name

  // Offloaded params in pipeline order, the chunks of their grads (a plan over the concatenation of
  // their grad tensors), and the pinned staging ring: `pipeline_depth` grad slots of chunk_bytes and
  // as many param slots. Host memory per offloaded param is its state (12 bytes of fp32 state, 8 with
  // bf16 moments, 6 all bf16); the staging is a constant.
  std::vector<size_t> cpu_params_;
  std::vector<ChunkPlan> grad_chunks_;
  std::vector<HostSpan> grad_slots_;
  std::vector<HostSpan> param_slots_;
  std::unique_ptr<PinnedArena> arena_;
  std::unique_ptr<Transfer> transfer_;
  std::unique_ptr<Stream> work_stream_;  // state init/copies of GPU groups
  std::unique_ptr<Event> grads_ready_;
  std::unique_ptr<Event> step_done_;
  std::unique_ptr<Event> stats_ready_;       // the gradient check's result has reached grad_stats_
  DeviceBuffer grad_stats_workspace_;        // LaunchGradStats' device workspace
  std::vector<GradTensorArgs> grad_tensors_; // every param's grad, in param order
  GradStats grad_stats_{};                   // host copy of the last check     // recorded on the trainer stream at the end of each Step
  std::vector<std::unique_ptr<TransferBatch>> pending_;  // the last step's copies, until finished
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
