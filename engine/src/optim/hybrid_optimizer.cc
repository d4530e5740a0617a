#include "optim/hybrid_optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <utility>

#include "base/logging.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/absl_compat.h"
#include "ferry/status.h"

namespace ferry {
namespace {

constexpr int64_t kAlignElements = 16;  // 64-byte alignment of every tensor's fp32 state (32 for bf16)
constexpr size_t kStageAlign = 256;
constexpr size_t kStatsPage = 4096;  // the grad check's result page (one page, registered once)
static_assert(sizeof(GradStats) <= kStatsPage);


size_t AlignUp(size_t n, size_t a) { return (n + a - 1) / a * a; }

bool BetaInRange(float beta) { return beta >= 0.0f && beta < 1.0f; }  // NaN is not

bool InArena(const PinnedArena* arena, const HostSpan& span) {
  if (arena == nullptr) return false;
  const char* base = static_cast<const char*>(arena->base());
  const char* at = static_cast<const char*>(span.data);
  return at >= base && at < base + arena->capacity();
}

}  // namespace

char* HybridOptimizer::Group::state(StateKind kind, bool spare) const {
  char* base = spare ? spare_state.as<char>() : offloaded ? host_state.as<char>() : device_state.as<char>();
  if (base == nullptr) return nullptr;
  const size_t n = static_cast<size_t>(spare ? spare_n : layout.total_elements());
  switch (kind) {
    case StateKind::kMaster: return base;
    case StateKind::kExpAvg: return base + n * DTypeSize(format.master);
    case StateKind::kExpAvgSq: break;
  }
  return base + n * (DTypeSize(format.master) + DTypeSize(format.moments));
}

HybridOptimizer::HybridOptimizer(Device* device, ThreadPool* pool, HybridOptions options)
    : device_(device), pool_(pool), options_(std::move(options)), cpu_adam_(pool) {
  const char* speculate = std::getenv("FERRY_SPECULATE");
  speculate_always_ = speculate != nullptr && std::string_view(speculate) == "always";
  const char* kept = std::getenv("FERRY_KEPT_IN_PLACE");
  kept_in_place_on_ = kept == nullptr || std::string_view(kept) != "0";
  const char* param_first = std::getenv("FERRY_PARAM_FIRST");
  param_first_on_ = param_first == nullptr || std::string_view(param_first) != "0";
  later_ = StateLater(options_.state_later);
  if (options_.tracer != nullptr) {
    cpu_adam_.set_tracer(options_.tracer);
    d2h_trace_.lane = options_.tracer->Lane("d2h stream (observed)");
    h2d_trace_.lane = options_.tracer->Lane("h2d stream (observed)");
  }
}

HybridOptimizer::~HybridOptimizer() {
  // A deferred step completes: the trainer may go on using the params (an evaluation after training).
  if (absl::Status s = Settle(); !s.ok()) FERRY_LOG(ERROR) << "HybridOptimizer: the last step's work failed at destruction: " << s;
  StopEarlyThread();
  WaitForStateReaders();  // a checkpoint may still read the offloaded state in place
  absl::Status s = Synchronize();
  if (!s.ok()) FERRY_LOG(ERROR) << "HybridOptimizer: pending work failed at destruction: " << s;
  for (Group& g : groups_) {
    // Each buffer from its own arena (kept speculations flip params' sides, not the buffers).
    for (HostSpan* span : {&g.host_state, &g.spare_state}) {
      if (span->empty()) continue;
      if (InArena(arena_.get(), *span)) {
        (void)arena_->Release(*span);
      } else if (InArena(spare_arena_.get(), *span)) {
        (void)spare_arena_->Release(*span);
      }
    }
  }
  if (arena_ != nullptr) {
    for (const HostSpan& slot : grad_slots_) (void)arena_->Release(slot);
    for (const HostSpan& slot : param_slots_) (void)arena_->Release(slot);
  }
  if (grad_stats_page_ != nullptr) {
    if (absl::Status u = device_->UnregisterHost(grad_stats_page_); !u.ok()) {
      FERRY_LOG(ERROR) << "HybridOptimizer: unregistering the grad check's result page: " << u;
    }
    std::free(grad_stats_page_);
  }
}

absl::StatusOr<std::unique_ptr<HybridOptimizer>> HybridOptimizer::Create(
    Device* device, ThreadPool* pool, std::vector<OptimParam> params, std::vector<OptimGroup> groups,
    const HybridOptions& options) {
  std::unique_ptr<HybridOptimizer> opt(new HybridOptimizer(device, pool, options));
  FERRY_RETURN_IF_ERROR(opt->Init(std::move(params), std::move(groups)));
  return opt;
}

absl::Status HybridOptimizer::Init(std::vector<OptimParam> params, std::vector<OptimGroup> groups) {
  if (!(options_.spare_fraction >= 0.0 && options_.spare_fraction <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the spare state fraction must be in [0, 1], got ", options_.spare_fraction));
  }
  if (options_.chunk_bytes < 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("transfer chunk size must be at least 1024 bytes, got ", options_.chunk_bytes));
  }
  params_ = std::move(params);
  groups_.resize(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    groups_[g].name = groups[g].name;
    groups_[g].offloaded = groups[g].offloaded;
    groups_[g].hyper = groups[g].hyper.value_or(options_.hyper);
    groups_[g].lr_scale = groups[g].lr_scale;
    groups_[g].format = groups[g].state;
    const StateFormat& f = groups_[g].format;
    if ((f.master != DType::kF32 && f.master != DType::kBF16) || (f.moments != DType::kF32 && f.moments != DType::kBF16) ||
        (f.rounding != StateRounding::kNearest && f.rounding != StateRounding::kStochastic)) {
      return absl::InvalidArgumentError(absl::StrCat("group '", groups_[g].name, "': invalid state format"));
    }
  }
  for (size_t p = 0; p < params_.size(); ++p) {
    const OptimParam& op = params_[p];
    if (op.group >= groups_.size()) {
      return absl::InvalidArgumentError(absl::StrCat("param '", op.name, "' names group ", op.group,
                                                     " of ", groups_.size()));
    }
    if (groups_[op.group].format.master == DType::kBF16 && op.dtype != DType::kBF16) {
      return absl::InvalidArgumentError(absl::StrCat("group '", groups_[op.group].name, "': a bf16 master needs bf16 params, but '",
                                                     op.name, "' is ", ToAbsl(DTypeName(op.dtype))));
    }
    groups_[op.group].params.push_back(p);
    param_ids_.push_back(RoundingParamId(op.name.data(), op.name.size()));
  }
  param_slot_.assign(params_.size(), 0);
  state_side_.assign(params_.size(), 0);
  spare_slot_.assign(params_.size(), -1);
  size_t arena_bytes = 0;
  std::vector<size_t> offloaded_groups;
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    Group& g = groups_[gi];
    std::vector<int64_t> numels;
    for (size_t p : g.params) numels.push_back(params_[p].numel);
    if (numels.empty()) continue;  // a group with no elements on this rank: no state, only a step count
    FERRY_ASSIGN_OR_RETURN(g.layout, Layout::Pack(numels, kAlignElements));
    for (size_t i = 0; i < g.params.size(); ++i) param_slot_[g.params[i]] = g.layout.slots()[i].offset;
    const size_t state_bytes = static_cast<size_t>(g.layout.total_elements()) * g.format.bytes_per_element();
    if (g.offloaded) {
      arena_bytes += AlignUp(state_bytes, kStageAlign);
      offloaded_groups.push_back(gi);
    } else {
      FERRY_ASSIGN_OR_RETURN(g.device_state, device_->Allocate(state_bytes));
    }
  }
  full_plan_ = PlanFor(offloaded_groups);
  group_upload_.assign(groups_.size(), nullptr);
  FERRY_ASSIGN_OR_RETURN(work_stream_, device_->CreateStream());
  FERRY_ASSIGN_OR_RETURN(grads_ready_, device_->CreateEvent());
  FERRY_ASSIGN_OR_RETURN(step_done_, device_->CreateEvent());
  FERRY_ASSIGN_OR_RETURN(stats_ready_, device_->CreateBlockingEvent());
  FERRY_ASSIGN_OR_RETURN(snapshot_done_, device_->CreateEvent());
  FERRY_ASSIGN_OR_RETURN(trainer_point_, device_->CreateEvent());
  for (const OptimParam& op : params_) grad_tensors_.push_back(GradTensorArgs{op.grad, op.numel, op.grad_dtype});
  FERRY_ASSIGN_OR_RETURN(grad_stats_workspace_, device_->Allocate(GradStatsWorkspaceBytes(grad_tensors_.size())));
  if (grad_stats_page_ == nullptr) {
    grad_stats_page_ = std::aligned_alloc(kStatsPage, kStatsPage);
    if (grad_stats_page_ == nullptr) return absl::ResourceExhaustedError("allocating the grad check's result page");
    std::memset(grad_stats_page_, 0, kStatsPage);
    if (absl::Status s = device_->RegisterHost(grad_stats_page_, kStatsPage); !s.ok()) {
      std::free(grad_stats_page_);
      grad_stats_page_ = nullptr;
      return s;
    }
    grad_stats_ = static_cast<GradStats*>(grad_stats_page_);
  }
  if (!full_plan_.params.empty()) {
    const size_t chunk_bytes = options_.chunk_bytes / 4 * 4;  // whole elements of any dtype
    const size_t depth = std::max<size_t>(options_.pipeline_depth, 2);
    // A param slot holds the params of one chunk of grads, in any plan (the full one, or one over
    // some groups): chunk_bytes times the largest param-to-grad size ratio.
    size_t ratio = 1;
    for (size_t p : full_plan_.params) {
      ratio = std::max(ratio, (DTypeSize(params_[p].dtype) + DTypeSize(params_[p].grad_dtype) - 1) /
                                  DTypeSize(params_[p].grad_dtype));
    }
    const size_t param_slot_bytes = chunk_bytes * ratio;
    const size_t slots = std::min(depth, full_plan_.chunks.size());
    // Twice as many param slots as grad slots: a round (RunPipeline, RunEarlyPass) fills up to `slots`
    // of them, and the uploads of the round before still read the others.
    const size_t param_slots = 2 * slots;
    arena_bytes += slots * AlignUp(chunk_bytes, kStageAlign) + param_slots * AlignUp(param_slot_bytes, kStageAlign) +
                   4 * kStageAlign;
    PinnedArenaOptions arena_options;
    arena_options.capacity_bytes = arena_bytes;
    arena_options.numa = options_.numa;
    arena_options.numa_node = options_.numa_node;
    arena_options.name = "optimizer state";
    FERRY_ASSIGN_OR_RETURN(arena_, PinnedArena::Create(device_, arena_options));
    for (Group& g : groups_) {
      if (!g.offloaded || g.params.empty()) continue;
      FERRY_ASSIGN_OR_RETURN(g.host_state, arena_->Allocate(static_cast<size_t>(g.layout.total_elements()) *
                                                            g.format.bytes_per_element()));
    }
    for (size_t i = 0; i < slots; ++i) {
      FERRY_ASSIGN_OR_RETURN(HostSpan grad_slot, arena_->Allocate(chunk_bytes, kStageAlign));
      grad_slots_.push_back(grad_slot);
    }
    for (size_t i = 0; i < param_slots; ++i) {
      FERRY_ASSIGN_OR_RETURN(HostSpan param_slot, arena_->Allocate(param_slot_bytes, kStageAlign));
      param_slots_.push_back(param_slot);
    }
    TransferOptions transfer_options;
    transfer_options.chunk_bytes = chunk_bytes;
    FERRY_ASSIGN_OR_RETURN(transfer_, Transfer::Create(device_, transfer_options));
  }
  std::vector<size_t> all(groups_.size());
  for (size_t g = 0; g < all.size(); ++g) all[g] = g;
  return SyncFromModel(all, /*reset_optimizer=*/true);
}

StateRoundingKey HybridOptimizer::RoundingKey(size_t p, size_t e0, int64_t step) const {
  const Group& g = groups_[params_[p].group];
  StateRoundingKey key;
  key.index0 = params_[p].shard_begin + static_cast<int64_t>(e0);
  if (g.format.stochastic()) {
    key.tensor_key = RoundingTensorKey(options_.rounding_seed, param_ids_[p], step > 0 ? step : g.step + 1);
  }
  return key;
}

absl::Status HybridOptimizer::WaitPending() {
  TraceObserve(d2h_trace_, /*block=*/true);
  TraceObserve(h2d_trace_, /*block=*/true);
  absl::Status first;
  for (auto& batch : pending_) {
    absl::Status s = batch->Wait();
    if (first.ok() && !s.ok()) first = s;
  }
  pending_.clear();
  last_upload_ = nullptr;
  std::fill(group_upload_.begin(), group_upload_.end(), nullptr);
  return first;
}

absl::Status HybridOptimizer::Synchronize() {
  const absl::Status settled = Settle();  // a deferred step completes first
  absl::Status early = WaitEarlyIdle();  // the early thread's copies are in pending_ afterwards
  if (!early.ok() && !absl::IsCancelled(early)) {
    FERRY_LOG(WARNING) << "work started early failed (the step recomputes it): " << early;
  }
  absl::Status s = WaitPending();
  if (step_done_ != nullptr) {
    absl::Status e = step_done_->Synchronize();
    if (s.ok()) s = e;
  }
  if (work_stream_ != nullptr) {
    absl::Status w = work_stream_->Synchronize();
    if (s.ok()) s = w;
  }
  return settled.ok() ? s : settled;
}

absl::Status HybridOptimizer::CheckStepParams(const HybridStepParams& params) const {
  if (!(params.loss_scale > 0.0f) || !std::isfinite(params.loss_scale)) {
    return absl::InvalidArgumentError(absl::StrCat("Step: loss_scale must be positive and finite, got ", params.loss_scale));
  }
  if (!(params.max_grad_norm >= 0.0f) || !std::isfinite(params.max_grad_norm)) {
    return absl::InvalidArgumentError(absl::StrCat("Step: max_grad_norm must be >= 0 and finite, got ", params.max_grad_norm));
  }
  if (!params.check_finite && params.max_grad_norm > 0.0f) {
    return absl::InvalidArgumentError("Step: max_grad_norm needs check_finite (the norm comes from the gradient check)");
  }
  if (!std::isfinite(params.lr)) {
    return absl::InvalidArgumentError(absl::StrCat("Step: the learning rate must be finite, got ", params.lr));
  }
  if (params.group_lr.size() > groups_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("Step: ", params.group_lr.size(), " group learning rates for ",
                                                   groups_.size(), " groups"));
  }
  for (size_t gi = 0; gi < params.group_lr.size(); ++gi) {
    const std::optional<float>& lr = params.group_lr[gi];
    if (lr && !(std::isfinite(*lr) && *lr >= 0.0f)) {
      return absl::InvalidArgumentError(absl::StrCat("Step: the learning rate of group '", groups_[gi].name, "' is ",
                                                     *lr, "; it must be >= 0 and finite"));
    }
  }
  if (params.group_betas.size() > groups_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("Step: ", params.group_betas.size(), " group betas for ",
                                                   groups_.size(), " groups"));
  }
  for (size_t gi = 0; gi < params.group_betas.size(); ++gi) {
    const auto& betas = params.group_betas[gi];
    if (betas && !(BetaInRange(betas->first) && BetaInRange(betas->second))) {
      return absl::InvalidArgumentError(absl::StrCat("Step: the betas of group '", groups_[gi].name, "' are (",
                                                     betas->first, ", ", betas->second, "); each must be in [0, 1)"));
    }
  }
  if (params.group_weight_decay.size() > groups_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("Step: ", params.group_weight_decay.size(),
                                                   " group weight decays for ", groups_.size(), " groups"));
  }
  for (size_t gi = 0; gi < params.group_weight_decay.size(); ++gi) {
    const std::optional<float>& wd = params.group_weight_decay[gi];
    if (wd && !(std::isfinite(*wd) && *wd >= 0.0f)) {
      return absl::InvalidArgumentError(absl::StrCat("Step: the weight decay of group '", groups_[gi].name, "' is ",
                                                     *wd, "; it must be >= 0 and finite"));
    }
  }
  return absl::OkStatus();
}

AdamScalars HybridOptimizer::GroupScalars(size_t g, const HybridStepParams& params, double grad_multiplier) const {
  // Per group: the step's lr times the group's scale, or the group's own lr of this step.
  AdamHyper h = groups_[g].hyper;
  const bool own = g < params.group_lr.size() && params.group_lr[g].has_value();
  h.lr = own ? *params.group_lr[g] : GroupLr(params.lr, groups_[g].lr_scale);
  if (g < params.group_betas.size() && params.group_betas[g].has_value()) {
    h.beta1 = params.group_betas[g]->first;  // this step's (a scheduler cycling momentum)
    h.beta2 = params.group_betas[g]->second;
  }
  if (g < params.group_weight_decay.size() && params.group_weight_decay[g].has_value()) {
    h.weight_decay = *params.group_weight_decay[g];
  }
  return MakeAdamScalars(h, groups_[g].step + 1, grad_multiplier);
}
absl::StatusOr<HybridStepResult> HybridOptimizer::Step(const HybridStepParams& params, Stream& trainer) {
  // Bad inputs change nothing, an early step in progress included (Step may be called again).
  FERRY_RETURN_IF_ERROR(CheckStepParams(params));
  absl::StatusOr<HybridStepResult> result = StepChecked(params, trainer);
  if (!result.ok() && step_in_progress()) {
    // Failed before the announced groups were settled: their speculative work is dropped and their
    // params are restored from the (unchanged) masters, so nothing was updated.
    absl::Status undo = AbandonEarly(trainer);
    if (!undo.ok()) FERRY_LOG(ERROR) << "restoring the params of the groups started early: " << undo;
  }
  return result;
}

absl::StatusOr<HybridStepResult> HybridOptimizer::StepChecked(const HybridStepParams& params, Stream& trainer) {
  const bool early = step_in_progress();
  FERRY_RETURN_IF_ERROR(Settle());  // a step without announcements after a deferred one
  if (!early) {
    FERRY_RETURN_IF_ERROR(WaitPending());  // the previous step's staging is free again
    if (snapshot_pending_) {
      // A checkpoint's copies of the device-resident tensors go first (ordered on the device; the
      // host does not wait).
      FERRY_RETURN_IF_ERROR(trainer.WaitFor(*snapshot_done_));
      snapshot_pending_ = false;
    }
  }
  HybridStepResult result;
  double multiplier = 1.0 / static_cast<double>(params.loss_scale);
  if (params.check_finite) {
    // Every grad of every group is checked (and its norm taken) before any group is updated.
    TraceSpan span(options_.tracer, "grad_stats", "optim");
    if (span.on()) {
      double bytes = 0.0;
      for (const GradTensorArgs& g : grad_tensors_) bytes += static_cast<double>(g.numel) * static_cast<double>(DTypeSize(g.dtype));
      span.Arg("bytes", bytes);
    }
    FERRY_RETURN_IF_ERROR(device_->LaunchGradStats(grad_tensors_, grad_stats_workspace_.data(),
                                                   grad_stats_workspace_.bytes(), trainer));
    FERRY_RETURN_IF_ERROR(device_->CopyAsync(grad_stats_, GradStatsResult(grad_stats_workspace_.data()),
                                             sizeof(GradStats), CopyKind::kDeviceToHost, trainer));
    FERRY_RETURN_IF_ERROR(trainer.Record(*stats_ready_));
    FERRY_RETURN_IF_ERROR(stats_ready_->Synchronize());
    span.End();
    if (params.reduce_grad_stats) {
      TraceSpan reduce(options_.tracer, "grad_stats.allreduce", "optim");
      FERRY_RETURN_IF_ERROR(params.reduce_grad_stats(*grad_stats_));
    }
    if (grad_stats_->found_inf != 0) {
      result.skipped = true;
    } else {
      result.grad_norm = std::sqrt(grad_stats_->sum_sq) / static_cast<double>(params.loss_scale);
      multiplier = AdamGradMultiplier(params.loss_scale, grad_stats_->sum_sq, params.max_grad_norm);
    }
  }
  std::vector<AdamScalars> scalars(groups_.size());
  for (size_t g = 0; g < groups_.size(); ++g) scalars[g] = GroupScalars(g, params, multiplier);
  // The next step's announcements speculate only after a step that neither clipped nor skipped.
  speculate_ = !result.skipped && static_cast<float>(multiplier) == static_cast<float>(1.0 / static_cast<double>(params.loss_scale));
  std::vector<size_t> cpu_groups;  // offloaded groups updated in place below
  if (early) {
    FERRY_ASSIGN_OR_RETURN(cpu_groups, SettleEarly(result.skipped, params.discard_early, !params.wait_for_params,
                                                   scalars, trainer, result));
  } else if (!result.skipped) {
    for (size_t g = 0; g < groups_.size(); ++g) {
      if (groups_[g].offloaded) cpu_groups.push_back(g);
    }
  }
  if (result.skipped) return result;  // nothing changed state; step counts unchanged
  FERRY_RETURN_IF_ERROR(trainer.Record(*grads_ready_));
  FERRY_RETURN_IF_ERROR(StepGpuGroups(scalars, trainer));
  if (deferred_) {
    // The offloaded groups finish on the early thread (Settle commits them); the GPU groups are
    // done on the trainer's stream at step_done_ (WaitParams), trainer_point_ for Settle.
    FERRY_RETURN_IF_ERROR(trainer.Record(*trainer_point_));
    FERRY_RETURN_IF_ERROR(trainer.Record(*step_done_));
    for (Group& g : groups_) ++g.step;
    return result;
  }
  {
    // The state later of the step before, where no early pass of this step wrote it.
    FERRY_RETURN_IF_ERROR(FlushStateLater());
    TraceSpan span(options_.tracer, "cpu_pipeline", "optim");
    const PipelinePlan plan = PlanFor(cpu_groups);
    FERRY_RETURN_IF_ERROR(RunPipeline(PipelineRun{.plan = &plan, .scalars = &scalars, .ready = grads_ready_.get()}));
  }
  FERRY_RETURN_IF_ERROR(FinishUploads(params.wait_for_params, trainer));
  for (Group& g : groups_) ++g.step;
  return result;
}

absl::Status HybridOptimizer::FinishUploads(bool trainer_waits, Stream& trainer) {
  if (trainer_waits || last_upload_ == nullptr) {
    if (last_upload_ != nullptr) FERRY_RETURN_IF_ERROR(last_upload_->MakeStreamWait(trainer));
    return trainer.Record(*step_done_);
  }
  // The trainer goes on (WaitParams orders its uses); step_done_ still marks the end of everything,
  // for Synchronize, snapshots and syncs: recorded on the work stream after both.
  FERRY_RETURN_IF_ERROR(trainer.Record(*trainer_point_));
  FERRY_RETURN_IF_ERROR(work_stream_->WaitFor(*trainer_point_));
  FERRY_RETURN_IF_ERROR(last_upload_->MakeStreamWait(*work_stream_));
  return work_stream_->Record(*step_done_);
}

absl::Status HybridOptimizer::WaitParams(absl::Span<const size_t> groups, Stream& stream) {
  if (step_in_progress()) {
    return absl::FailedPreconditionError("WaitParams: groups were announced for a step that has not run yet; call Step first");
  }
  for (size_t g : groups) {
    if (g >= groups_.size()) return absl::InvalidArgumentError(absl::StrCat("WaitParams: no group ", g));
  }
  for (size_t g : groups) FERRY_RETURN_IF_ERROR(WaitGroup(g, stream));
  return absl::OkStatus();
}

absl::Status HybridOptimizer::WaitGroup(size_t g, Stream& stream) {
  if (deferred_ && groups_[g].offloaded && !groups_[g].params.empty()) {
    // The deferred step's CPU Adam may still run: wait until the group's upload is enqueued.
    bool done = false;
    {
      TraceSpan wait(options_.tracer, "wait.upload", "optim");
      if (wait.on()) wait.Arg("group", static_cast<double>(g));
      std::unique_lock<std::mutex> lock(early_mu_);
      early_cv_.wait(lock, [&] { return early_done_[g] != 0 || (!early_busy_ && early_queue_.empty()); });
      done = early_done_[g] != 0;
    }
    if (done) return stream.WaitFor(*group_uploaded_[g]);
    FERRY_RETURN_IF_ERROR(Settle());  // the work stopped: its error, with the group's params restored
  }
  if (group_upload_[g] != nullptr) return group_upload_[g]->MakeStreamWait(stream);
  return stream.WaitFor(*step_done_);  // GPU groups: updated before step_done_
}

absl::Status HybridOptimizer::WaitParamsOf(absl::Span<const size_t> params, Stream& stream) {
  if (step_in_progress()) {
    return absl::FailedPreconditionError("WaitParams: params were announced for a step that has not run yet; call Step first");
  }
  for (size_t p : params) {
    if (p >= params_.size()) return absl::InvalidArgumentError(absl::StrCat("WaitParams: no param ", p));
  }
  std::vector<uint8_t> waited_group(groups_.size(), 0);
  std::vector<size_t> waited_parts;
  for (size_t p : params) {
    const size_t g = params_[p].group;
    if (waited_group[g] != 0) continue;
    const int64_t part = deferred_ && p < part_of_param_.size() ? part_of_param_[p] : -1;
    if (part < 0) {
      waited_group[g] = 1;
      FERRY_RETURN_IF_ERROR(WaitGroup(g, stream));
      continue;
    }
    if (std::find(waited_parts.begin(), waited_parts.end(), static_cast<size_t>(part)) != waited_parts.end()) continue;
    waited_parts.push_back(static_cast<size_t>(part));
    // The deferred step's CPU Adam may still run: wait until the part's upload is enqueued.
    bool done = false;
    {
      TraceSpan wait(options_.tracer, "wait.upload", "optim");
      if (wait.on()) {
        wait.Arg("part", static_cast<double>(part));
        wait.Arg("param", static_cast<double>(p));
      }
      std::unique_lock<std::mutex> lock(early_mu_);
      early_cv_.wait(lock, [&] { return part_done_[part] != 0 || (!early_busy_ && early_queue_.empty()); });
      done = part_done_[part] != 0;
    }
    if (done) {
      FERRY_RETURN_IF_ERROR(stream.WaitFor(*part_events_[part]));
      continue;
    }
    FERRY_RETURN_IF_ERROR(Settle());  // the work stopped: its error, with the group's params restored
    waited_group[g] = 1;
    FERRY_RETURN_IF_ERROR(WaitGroup(g, stream));
  }
  return absl::OkStatus();
}

absl::Status HybridOptimizer::StepGpuGroups(const std::vector<AdamScalars>& group_scalars, Stream& trainer) {
  std::vector<AdamScalars> scalars;
  std::vector<AdamTensorArgs> tensors;
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    const Group& g = groups_[gi];
    if (g.offloaded || g.params.empty()) continue;
    const uint32_t index = static_cast<uint32_t>(scalars.size());  // the kernel takes scalars per tensor
    scalars.push_back(group_scalars[gi]);
    for (size_t p : g.params) {
      const OptimParam& op = params_[p];
      AdamTensorArgs t;
      t.master = StatePtr(p, StateKind::kMaster);
      t.exp_avg = StatePtr(p, StateKind::kExpAvg);
      t.exp_avg_sq = StatePtr(p, StateKind::kExpAvgSq);
      t.state = g.format;
      t.rounding = RoundingKey(p, 0);
      t.grad = op.grad;
      t.param = op.param;
      t.numel = op.numel;
      t.grad_dtype = op.grad_dtype;
      t.param_dtype = op.dtype;
      t.scalars_index = index;
      tensors.push_back(t);
    }
  }
  if (tensors.empty()) return absl::OkStatus();
  // The launch as the host sees it; the kernel runs on the trainer's stream after it.
  TraceSpan span(options_.tracer, "gpu_adam.launch", "optim");
  if (span.on()) {
    double bytes = 0.0;
    for (const AdamTensorArgs& t : tensors) {
      bytes += static_cast<double>(t.numel) * static_cast<double>(2 * t.state.bytes_per_element() + DTypeSize(t.grad_dtype) +
                                                                  DTypeSize(t.param_dtype));
    }
    span.Arg("bytes", bytes);
    span.Arg("tensors", static_cast<double>(tensors.size()));
  }
  return device_->LaunchAdam(tensors, scalars, trainer);
}

HybridOptimizer::PipelinePlan HybridOptimizer::PlanFor(const std::vector<size_t>& groups) const {
  std::vector<size_t> params;
  for (size_t g : groups) {
    if (!groups_[g].offloaded) continue;
    for (size_t p : groups_[g].params) params.push_back(p);
  }
  return PlanForParams(std::move(params));
}

HybridOptimizer::PipelinePlan HybridOptimizer::PlanForParams(std::vector<size_t> params) const {
  PipelinePlan plan;
  for (size_t p : params) {
    if (groups_[params_[p].group].offloaded) plan.params.push_back(p);
  }
  // Params with 4-byte grads come first: every region's size is a multiple of its element size, and
  // chunks are cut at multiples of 4 bytes of the concatenated regions, so with this order every chunk
  // piece starts and ends on an element boundary.
  std::stable_sort(plan.params.begin(), plan.params.end(), [&](size_t a, size_t b) {
    return DTypeSize(params_[a].grad_dtype) > DTypeSize(params_[b].grad_dtype);
  });
  std::vector<CopyRegion> grads;
  for (size_t p : plan.params) {
    const OptimParam& op = params_[p];
    grads.push_back(CopyRegion{nullptr, op.grad, static_cast<size_t>(op.numel) * DTypeSize(op.grad_dtype)});
  }
  if (!grads.empty()) plan.chunks = PlanChunks(grads, options_.chunk_bytes / 4 * 4);
  return plan;
}

size_t HybridOptimizer::pinned_bytes() const {
  return (arena_ == nullptr ? 0 : arena_->capacity()) + (spare_arena_ == nullptr ? 0 : spare_arena_->capacity());
}

size_t HybridOptimizer::pinned_huge_bytes() const {
  return (arena_ == nullptr ? 0 : arena_->setup().huge_bytes) +
         (spare_arena_ == nullptr ? 0 : spare_arena_->setup().huge_bytes);
}

size_t HybridOptimizer::gpu_state_bytes() const {
  size_t n = 0;
  for (const Group& g : groups_) n += g.device_state.bytes();
  return n;
}

}  // namespace ferry
