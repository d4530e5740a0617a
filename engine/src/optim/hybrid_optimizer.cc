#include "optim/hybrid_optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "base/logging.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "ferry/status.h"

namespace ferry {
namespace {

constexpr int64_t kAlignElements = 16;  // 64-byte alignment of every tensor's fp32 state
constexpr size_t kStageAlign = 256;

size_t AlignUp(size_t n, size_t a) { return (n + a - 1) / a * a; }

}  // namespace

float* HybridOptimizer::Group::state(StateKind kind) const {
  float* base = offloaded ? host_state.as<float>() : device_state.as<float>();
  if (base == nullptr) return nullptr;
  return base + static_cast<size_t>(layout.total_elements()) * static_cast<size_t>(kind);
}

HybridOptimizer::HybridOptimizer(Device* device, ThreadPool* pool, HybridOptions options)
    : device_(device), pool_(pool), options_(std::move(options)), cpu_adam_(pool) {
  if (options_.tracer != nullptr) {
    cpu_adam_.set_tracer(options_.tracer);
    d2h_trace_.lane = options_.tracer->Lane("d2h stream (observed)");
    h2d_trace_.lane = options_.tracer->Lane("h2d stream (observed)");
  }
}

void HybridOptimizer::TraceSubmitted(LaneTrace& lane, TransferBatch* batch) {
  if (options_.tracer == nullptr || batch == nullptr || batch->num_chunks() == 0) return;
  lane.queue.push_back(CopyTrace{batch, options_.tracer->NowNs()});
}

void HybridOptimizer::TraceObserve(LaneTrace& lane, bool block) {
  Tracer* const tracer = options_.tracer;
  if (tracer == nullptr) return;
  while (!lane.queue.empty()) {
    const CopyTrace& c = lane.queue.front();
    if (block) {
      (void)c.batch->Wait();  // its error, if any, is the caller's to report
    } else {
      absl::StatusOr<bool> done = c.batch->ChunkDone(c.batch->num_chunks() - 1);
      if (!done.ok() || !*done) return;
    }
    const int64_t now = tracer->NowNs();
    tracer->Complete(lane.name, "transfer", std::max(c.submit_ns, lane.last_end_ns), now,
                     {{"bytes", static_cast<double>(c.batch->bytes())}}, {}, lane.lane);
    lane.last_end_ns = now;
    lane.queue.pop_front();
  }
}

HybridOptimizer::~HybridOptimizer() {
  WaitForStateReaders();  // a checkpoint may still read the offloaded state in place
  absl::Status s = Synchronize();
  if (!s.ok()) FERRY_LOG(ERROR) << "HybridOptimizer: pending work failed at destruction: " << s;
  if (arena_ != nullptr) {
    for (Group& g : groups_) {
      if (!g.host_state.empty()) (void)arena_->Release(g.host_state);
    }
    for (const HostSpan& slot : grad_slots_) (void)arena_->Release(slot);
    for (const HostSpan& slot : param_slots_) (void)arena_->Release(slot);
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
  }
  for (size_t p = 0; p < params_.size(); ++p) {
    const OptimParam& op = params_[p];
    if (op.group >= groups_.size()) {
      return absl::InvalidArgumentError(absl::StrCat("param '", op.name, "' names group ", op.group,
                                                     " of ", groups_.size()));
    }
    groups_[op.group].params.push_back(p);
  }
  param_slot_.assign(params_.size(), 0);
  size_t arena_bytes = 0;
  for (Group& g : groups_) {
    std::vector<int64_t> numels;
    for (size_t p : g.params) numels.push_back(params_[p].numel);
    if (numels.empty()) continue;  // a group with no elements on this rank: no state, only a step count
    FERRY_ASSIGN_OR_RETURN(g.layout, Layout::Pack(numels, kAlignElements));
    for (size_t i = 0; i < g.params.size(); ++i) param_slot_[g.params[i]] = g.layout.slots()[i].offset;
    const size_t state_bytes = 3 * static_cast<size_t>(g.layout.total_elements()) * sizeof(float);
    if (g.offloaded) {
      arena_bytes += AlignUp(state_bytes, kStageAlign);
      for (size_t p : g.params) cpu_params_.push_back(p);
    } else {
      FERRY_ASSIGN_OR_RETURN(g.device_state, device_->Allocate(state_bytes));
    }
  }
  // Params with 4-byte grads come first: every region's size is a multiple of its element size, and
  // chunks are cut at multiples of 4 bytes of the concatenated regions, so with this order every chunk
  // piece starts and ends on an element boundary.
  std::stable_sort(cpu_params_.begin(), cpu_params_.end(), [&](size_t a, size_t b) {
    return DTypeSize(params_[a].grad_dtype) > DTypeSize(params_[b].grad_dtype);
  });
  FERRY_ASSIGN_OR_RETURN(work_stream_, device_->CreateStream());
  FERRY_ASSIGN_OR_RETURN(grads_ready_, device_->CreateEvent());
  FERRY_ASSIGN_OR_RETURN(step_done_, device_->CreateEvent());
  FERRY_ASSIGN_OR_RETURN(stats_ready_, device_->CreateEvent());
  FERRY_ASSIGN_OR_RETURN(snapshot_done_, device_->CreateEvent());
  for (const OptimParam& op : params_) grad_tensors_.push_back(GradTensorArgs{op.grad, op.numel, op.grad_dtype});
  FERRY_ASSIGN_OR_RETURN(grad_stats_workspace_, device_->Allocate(GradStatsWorkspaceBytes(grad_tensors_.size())));
  if (!cpu_params_.empty()) {
    const size_t chunk_bytes = options_.chunk_bytes / 4 * 4;  // whole elements of any dtype
    const size_t depth = std::max<size_t>(options_.pipeline_depth, 2);
    std::vector<CopyRegion> grads;
    for (size_t p : cpu_params_) {
      const OptimParam& op = params_[p];
      grads.push_back(CopyRegion{nullptr, op.grad, static_cast<size_t>(op.numel) * DTypeSize(op.grad_dtype)});
    }
    grad_chunks_ = PlanChunks(grads, chunk_bytes);
    size_t param_slot_bytes = 0;
    for (const ChunkPlan& c : grad_chunks_) {
      size_t bytes = 0;
      for (const ChunkPiece& piece : c.pieces) {
        const OptimParam& op = params_[cpu_params_[piece.region]];
        bytes += piece.bytes / DTypeSize(op.grad_dtype) * DTypeSize(op.dtype);
      }
      param_slot_bytes = std::max(param_slot_bytes, bytes);
    }
    const size_t slots = std::min(depth, grad_chunks_.size());
    arena_bytes += slots * (AlignUp(chunk_bytes, kStageAlign) + AlignUp(param_slot_bytes, kStageAlign)) +
                   4 * kStageAlign;
    PinnedArenaOptions arena_options;
    arena_options.capacity_bytes = arena_bytes;
    arena_options.numa = options_.numa;
    arena_options.numa_node = options_.numa_node;
    arena_options.name = "optimizer state";
    FERRY_ASSIGN_OR_RETURN(arena_, PinnedArena::Create(device_, arena_options));
    for (Group& g : groups_) {
      if (!g.offloaded || g.params.empty()) continue;
      FERRY_ASSIGN_OR_RETURN(g.host_state,
                             arena_->Allocate(3 * static_cast<size_t>(g.layout.total_elements()) * sizeof(float)));
    }
    for (size_t i = 0; i < slots; ++i) {
      FERRY_ASSIGN_OR_RETURN(HostSpan grad_slot, arena_->Allocate(chunk_bytes, kStageAlign));
      grad_slots_.push_back(grad_slot);
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

float* HybridOptimizer::StatePtr(size_t p, StateKind kind) const {
  const Group& g = groups_[params_[p].group];
  return g.state(kind) + param_slot_[p];
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
  return first;
}

absl::Status HybridOptimizer::Synchronize() {
  absl::Status s = WaitPending();
  if (step_done_ != nullptr) {
    absl::Status e = step_done_->Synchronize();
    if (s.ok()) s = e;
  }
  if (work_stream_ != nullptr) {
    absl::Status w = work_stream_->Synchronize();
    if (s.ok()) s = w;
  }
  return s;
}

absl::StatusOr<HybridStepResult> HybridOptimizer::Step(const HybridStepParams& params, Stream& trainer) {
  if (!(params.loss_scale > 0.0f) || !std::isfinite(params.loss_scale)) {
    return absl::InvalidArgumentError(absl::StrCat("Step: loss_scale must be positive and finite, got ", params.loss_scale));
  }
  if (!(params.max_grad_norm >= 0.0f) || !std::isfinite(params.max_grad_norm)) {
    return absl::InvalidArgumentError(absl::StrCat("Step: max_grad_norm must be >= 0 and finite, got ", params.max_grad_norm));
  }
  if (!params.check_finite && params.max_grad_norm > 0.0f) {
    return absl::InvalidArgumentError("Step: max_grad_norm needs check_finite (the norm comes from the gradient check)");
  }
  FERRY_RETURN_IF_ERROR(WaitPending());  // the previous step's staging is free again
  if (snapshot_pending_) {
    // A checkpoint's copies of the device-resident tensors go first (ordered on the device; the
    // host does not wait).
    FERRY_RETURN_IF_ERROR(trainer.WaitFor(*snapshot_done_));
    snapshot_pending_ = false;
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
    FERRY_RETURN_IF_ERROR(device_->CopyAsync(&grad_stats_, GradStatsResult(grad_stats_workspace_.data()),
                                             sizeof(GradStats), CopyKind::kDeviceToHost, trainer));
    FERRY_RETURN_IF_ERROR(trainer.Record(*stats_ready_));
    FERRY_RETURN_IF_ERROR(stats_ready_->Synchronize());
    span.End();
    if (params.reduce_grad_stats) {
      TraceSpan reduce(options_.tracer, "grad_stats.allreduce", "optim");
      FERRY_RETURN_IF_ERROR(params.reduce_grad_stats(grad_stats_));
    }
    if (grad_stats_.found_inf != 0) {
      result.skipped = true;
      return result;  // nothing enqueued that changes state; step counts unchanged
    }
    result.grad_norm = std::sqrt(grad_stats_.sum_sq) / static_cast<double>(params.loss_scale);
    multiplier = AdamGradMultiplier(params.loss_scale, grad_stats_.sum_sq, params.max_grad_norm);
  }
  FERRY_RETURN_IF_ERROR(trainer.Record(*grads_ready_));
  FERRY_RETURN_IF_ERROR(StepGpuGroups(params.lr, multiplier, trainer));
  {
    TraceSpan span(options_.tracer, "cpu_pipeline", "optim");
    FERRY_RETURN_IF_ERROR(StepCpuGroups(params.lr, multiplier, *grads_ready_));
  }
  if (!pending_.empty()) FERRY_RETURN_IF_ERROR(pending_.back()->MakeStreamWait(trainer));
  FERRY_RETURN_IF_ERROR(trainer.Record(*step_done_));
  for (Group& g : groups_) ++g.step;
  return result;
}

absl::Status HybridOptimizer::StepGpuGroups(float lr, double grad_multiplier, Stream& trainer) {
  std::vector<AdamScalars> scalars;
  std::vector<AdamTensorArgs> tensors;
  std::vector<uint32_t> group_scalars(groups_.size(), 0);
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    const Group& g = groups_[gi];
    if (g.offloaded) continue;
    AdamHyper h = g.hyper;  // per group: the kernel takes each tensor's scalars by scalars_index
    h.lr = GroupLr(lr, g.lr_scale);
    group_scalars[gi] = static_cast<uint32_t>(scalars.size());
    scalars.push_back(MakeAdamScalars(h, g.step + 1, grad_multiplier));
    for (size_t p : g.params) {
      const OptimParam& op = params_[p];
      AdamTensorArgs t;
      t.master = StatePtr(p, StateKind::kMaster);
      t.exp_avg = StatePtr(p, StateKind::kExpAvg);
      t.exp_avg_sq = StatePtr(p, StateKind::kExpAvgSq);
      t.grad = op.grad;
      t.param = op.param;
      t.numel = op.numel;
      t.grad_dtype = op.grad_dtype;
      t.param_dtype = op.dtype;
      t.scalars_index = group_scalars[gi];
      tensors.push_back(t);
    }
  }
  if (tensors.empty()) return absl::OkStatus();
  // The launch as the host sees it; the kernel runs on the trainer's stream after it.
  TraceSpan span(options_.tracer, "gpu_adam.launch", "optim");
  if (span.on()) {
    double bytes = 0.0;
    for (const AdamTensorArgs& t : tensors) {
      bytes += static_cast<double>(t.numel) * static_cast<double>(24 + DTypeSize(t.grad_dtype) + DTypeSize(t.param_dtype));
    }
    span.Arg("bytes", bytes);
    span.Arg("tensors", static_cast<double>(tensors.size()));
  }
  return device_->LaunchAdam(tensors, scalars, trainer);
}

absl::StatusOr<std::unique_ptr<TransferBatch>> HybridOptimizer::SubmitGradChunk(size_t k, Event& grads_ready) {
  std::vector<CopyRegion> regions;
  char* slot = grad_slots_[k % grad_slots_.size()].as<char>();
  size_t at = 0;
  for (const ChunkPiece& piece : grad_chunks_[k].pieces) {
    const OptimParam& op = params_[cpu_params_[piece.region]];
    regions.push_back(CopyRegion{slot + at, static_cast<const char*>(op.grad) + piece.offset, piece.bytes});
    at += piece.bytes;
  }
  return transfer_->DeviceToHost(regions, &grads_ready);
}

// The pipeline over grad chunks, `depth` = number of staging slots:
//   D2H of chunk k+depth-1 | CPU Adam on chunk k | H2D of chunk k-1, all in flight at once.
// Chunk k's grads land in grad slot k % depth; CPU Adam writes its new params into param slot k % depth,
// which the H2D of chunk k reads. A grad slot is refilled once CPU Adam has read it; a param slot is
// rewritten only after the H2D that read it completed.
absl::Status HybridOptimizer::StepCpuGroups(float lr, double grad_multiplier, Event& grads_ready) {
  if (cpu_params_.empty()) return absl::OkStatus();
  std::vector<AdamScalars> scalars(groups_.size());
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    AdamHyper h = groups_[gi].hyper;
    h.lr = GroupLr(lr, groups_[gi].lr_scale);
    scalars[gi] = MakeAdamScalars(h, groups_[gi].step + 1, grad_multiplier);
  }
  const size_t num_chunks = grad_chunks_.size();
  const size_t depth = grad_slots_.size();
  std::vector<std::unique_ptr<TransferBatch>> down(num_chunks), up(num_chunks);
  for (size_t k = 0; k < std::min(depth, num_chunks); ++k) {
    absl::StatusOr<std::unique_ptr<TransferBatch>> first = SubmitGradChunk(k, grads_ready);
    if (!first.ok()) {
      d2h_trace_.queue.clear();  // the batches it points to go away with `down`
      return first.status();
    }
    down[k] = *std::move(first);
    TraceSubmitted(d2h_trace_, down[k].get());
  }
  Tracer* const tracer = options_.tracer;
  // A batch done without blocking: its events complete in stream order, so its last chunk tells.
  auto done = [](TransferBatch* batch) {
    if (batch == nullptr) return false;
    if (batch->num_chunks() == 0) return true;
    absl::StatusOr<bool> d = batch->ChunkDone(batch->num_chunks() - 1);
    return d.ok() && *d;
  };
  std::vector<CpuAdamTensor> work;
  std::vector<std::vector<CopyRegion>> regions(depth);
  absl::Status status;
  size_t k = 0;
  while (k < num_chunks && status.ok()) {
    {
      TraceSpan wait(tracer, "wait.copies", "optim");
      status = down[k]->Wait();
      if (status.ok() && k >= depth) status = up[k - depth]->Wait();  // its param slot is rewritten now
    }
    if (!status.ok()) break;
    // Every further chunk that has already landed (and whose param slot is free) joins this round, so
    // CPU Adam runs as few parallel sections as the copies allow.
    size_t end = k + 1;
    while (end < num_chunks && end < k + depth && done(down[end].get()) &&
           (end < depth || done(up[end - depth].get()))) {
      ++end;
    }
    work.clear();
    for (size_t j = k; j < end; ++j) {
      const char* grad_slot = grad_slots_[j % depth].as<char>();
      char* param_slot = param_slots_[j % depth].as<char>();
      std::vector<CopyRegion>& up_regions = regions[j - k];
      up_regions.clear();
      size_t grad_at = 0, param_at = 0;
      for (const ChunkPiece& piece : grad_chunks_[j].pieces) {
        const size_t p = cpu_params_[piece.region];
        const OptimParam& op = params_[p];
        const size_t gsize = DTypeSize(op.grad_dtype), psize = DTypeSize(op.dtype);
        FERRY_CHECK(piece.offset % gsize == 0 && piece.bytes % gsize == 0) << "chunk piece off element boundary";
        const size_t e0 = piece.offset / gsize;
        const size_t n = piece.bytes / gsize;
        CpuAdamTensor t;
        t.master = StatePtr(p, StateKind::kMaster) + e0;
        t.exp_avg = StatePtr(p, StateKind::kExpAvg) + e0;
        t.exp_avg_sq = StatePtr(p, StateKind::kExpAvgSq) + e0;
        t.grad = grad_slot + grad_at;
        t.param = param_slot + param_at;
        t.numel = static_cast<int64_t>(n);
        t.grad_dtype = op.grad_dtype;
        t.param_dtype = op.dtype;
        t.scalars = &scalars[op.group];
        work.push_back(t);
        up_regions.push_back(CopyRegion{static_cast<char*>(op.param) + e0 * psize, param_slot + param_at, n * psize});
        grad_at += piece.bytes;
        param_at += n * psize;
      }
    }
    if (fence_ != nullptr && !fence_->all_released()) {
      // A checkpoint still reads some offloaded state in place: the state of these chunks' params is
      // copied aside for it first (or, being written right now, waited for).
      std::vector<size_t> touched;
      for (size_t j = k; j < end; ++j) {
        for (const ChunkPiece& piece : grad_chunks_[j].pieces) touched.push_back(cpu_params_[piece.region]);
      }
      TraceSpan acquire(tracer, "fence.acquire", "optim");
      fence_->Acquire(touched, pool_);
    }
    TraceObserve(d2h_trace_, /*block=*/false);
    TraceObserve(h2d_trace_, /*block=*/false);
    {
      TraceSpan round(tracer, "cpu_adam.round", "optim");
      if (round.on()) {
        double elements = 0.0, bytes = 0.0;
        for (const CpuAdamTensor& t : work) {
          elements += static_cast<double>(t.numel);
          bytes += static_cast<double>(t.numel) * static_cast<double>(24 + DTypeSize(t.grad_dtype) + DTypeSize(t.param_dtype));
        }
        round.Arg("chunks", static_cast<double>(end - k));
        round.Arg("elements", elements);
        round.Arg("bytes", bytes);
      }
      status = cpu_adam_.Step(work);
    }
    TraceObserve(d2h_trace_, /*block=*/false);
    TraceObserve(h2d_trace_, /*block=*/false);
    for (size_t j = k; j < end && status.ok(); ++j) {
      // The trainer's stream may still read the params until the grads are ready: the upload waits.
      absl::StatusOr<std::unique_ptr<TransferBatch>> upload = transfer_->HostToDevice(regions[j - k], &grads_ready);
      if (!upload.ok()) {
        status = upload.status();
        break;
      }
      up[j] = *std::move(upload);
      TraceSubmitted(h2d_trace_, up[j].get());
      if (j + depth < num_chunks) {
        absl::StatusOr<std::unique_ptr<TransferBatch>> next = SubmitGradChunk(j + depth, grads_ready);
        if (!next.ok()) {
          status = next.status();
          break;
        }
        down[j + depth] = *std::move(next);
        TraceSubmitted(d2h_trace_, down[j + depth].get());
      }
    }
    k = end;
  }
  // Everything submitted stays alive until it completed (WaitPending at the next call).
  for (auto& batch : down) {
    if (batch != nullptr) pending_.push_back(std::move(batch));
  }
  for (auto& batch : up) {
    if (batch != nullptr) pending_.push_back(std::move(batch));
  }
  return status;
}

absl::Status HybridOptimizer::SyncParamsFromModel(const std::vector<size_t>& params) {
  WaitForStateReaders();
  FERRY_RETURN_IF_ERROR(Synchronize());
  FERRY_RETURN_IF_ERROR(work_stream_->WaitFor(*step_done_));
  std::vector<size_t> host_params;
  std::vector<CopyRegion> host_regions;
  for (size_t p : params) {
    const OptimParam& op = params_[p];
    if (groups_[op.group].offloaded) {
      host_params.push_back(p);
      host_regions.push_back(CopyRegion{nullptr, op.param, static_cast<size_t>(op.numel) * DTypeSize(op.dtype)});
    } else {
      FERRY_RETURN_IF_ERROR(device_->LaunchConvert(StatePtr(p, StateKind::kMaster), DType::kF32, op.param,
                                                   op.dtype, op.numel, *work_stream_));
    }
  }
  FERRY_RETURN_IF_ERROR(work_stream_->Synchronize());
  if (host_params.empty()) return absl::OkStatus();
  // 4-byte params first, so every chunk piece is whole elements (chunks are cut at multiples of 4).
  std::vector<size_t> order(host_params.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return DTypeSize(params_[host_params[a]].dtype) > DTypeSize(params_[host_params[b]].dtype);
  });
  {
    std::vector<size_t> sorted_params;
    std::vector<CopyRegion> sorted_regions;
    for (size_t i : order) {
      sorted_params.push_back(host_params[i]);
      sorted_regions.push_back(host_regions[i]);
    }
    host_params = std::move(sorted_params);
    host_regions = std::move(sorted_regions);
  }
  // Offloaded params come down chunk by chunk through the grad slots (each holds chunk_bytes) and are
  // widened into their fp32 masters.
  const std::vector<ChunkPlan> chunks = PlanChunks(host_regions, grad_slots_[0].bytes / 4 * 4);
  for (size_t k = 0; k < chunks.size(); ++k) {
    char* slot = grad_slots_[0].as<char>();
    std::vector<CopyRegion> regions;
    size_t at = 0;
    for (const ChunkPiece& piece : chunks[k].pieces) {
      regions.push_back(CopyRegion{slot + at, static_cast<const char*>(host_regions[piece.region].src) + piece.offset,
                                   piece.bytes});
      at += piece.bytes;
    }
    FERRY_ASSIGN_OR_RETURN(std::unique_ptr<TransferBatch> batch, transfer_->DeviceToHost(regions, step_done_.get()));
    FERRY_RETURN_IF_ERROR(batch->Wait());
    at = 0;
    for (const ChunkPiece& piece : chunks[k].pieces) {
      const OptimParam& op = params_[host_params[piece.region]];
      const size_t esize = DTypeSize(op.dtype);
      float* master = StatePtr(host_params[piece.region], StateKind::kMaster) + piece.offset / esize;
      const char* src = slot + at;
      const size_t n = piece.bytes / esize;
      pool_->ParallelFor((n + 65535) / 65536, [&](size_t block) {
        const size_t end = std::min(n, (block + 1) * 65536);
        for (size_t e = block * 65536; e < end; ++e) master[e] = LoadAsF32(src, op.dtype, e);
      });
      at += piece.bytes;
    }
  }
  return absl::OkStatus();
}

absl::Status HybridOptimizer::SyncFromModel(const std::vector<size_t>& groups, bool reset_optimizer) {
  std::vector<size_t> params;
  for (size_t g : groups) {
    if (g >= groups_.size()) return absl::InvalidArgumentError(absl::StrCat("no group ", g));
    for (size_t p : groups_[g].params) params.push_back(p);
  }
  FERRY_RETURN_IF_ERROR(SyncParamsFromModel(params));
  if (!reset_optimizer) return absl::OkStatus();
  for (size_t g : groups) {
    Group& grp = groups_[g];
    const size_t bytes = 2 * static_cast<size_t>(grp.layout.total_elements()) * sizeof(float);
    if (bytes == 0) {
      // no state on this rank
    } else if (grp.offloaded) {
      std::memset(grp.state(StateKind::kExpAvg), 0, bytes);
    } else {
      FERRY_RETURN_IF_ERROR(device_->MemsetAsync(grp.state(StateKind::kExpAvg), 0, bytes, *work_stream_));
    }
    grp.step = 0;
  }
  return work_stream_->Synchronize();
}

absl::Status HybridOptimizer::ReadState(size_t param, StateKind kind, float* host) {
  FERRY_RETURN_IF_ERROR(Synchronize());
  const OptimParam& op = params_[param];
  const size_t bytes = static_cast<size_t>(op.numel) * sizeof(float);
  if (groups_[op.group].offloaded) {
    std::memcpy(host, StatePtr(param, kind), bytes);
    return absl::OkStatus();
  }
  FERRY_RETURN_IF_ERROR(device_->CopyAsync(host, StatePtr(param, kind), bytes, CopyKind::kDeviceToHost, *work_stream_));
  return work_stream_->Synchronize();
}

absl::Status HybridOptimizer::WriteState(size_t param, StateKind kind, const float* host) {
  WaitForStateReaders();
  FERRY_RETURN_IF_ERROR(Synchronize());
  const OptimParam& op = params_[param];
  const size_t bytes = static_cast<size_t>(op.numel) * sizeof(float);
  if (groups_[op.group].offloaded) {
    std::memcpy(StatePtr(param, kind), host, bytes);
    return absl::OkStatus();
  }
  FERRY_RETURN_IF_ERROR(device_->CopyAsync(StatePtr(param, kind), host, bytes, CopyKind::kHostToDevice, *work_stream_));
  return work_stream_->Synchronize();
}

absl::Status HybridOptimizer::CopyItems(absl::Span<const SnapshotItem> items, bool to_host) {
  if (!to_host) WaitForStateReaders();
  FERRY_RETURN_IF_ERROR(Synchronize());
  struct Piece {
    char* dst;
    const char* src;
    size_t bytes;
  };
  std::vector<Piece> host_pieces;
  constexpr size_t kPiece = size_t{16} << 20;
  for (const SnapshotItem& item : items) {
    if (item.param >= params_.size() || item.dst == nullptr) {
      FERRY_RETURN_IF_ERROR(work_stream_->Synchronize());  // nothing enqueued may outlive the caller's buffers
      return absl::InvalidArgumentError(absl::StrCat(to_host ? "Snapshot" : "Restore", ": bad item for param ", item.param));
    }
    const OptimParam& op = params_[item.param];
    if (item.is_param) {
      const size_t pbytes = static_cast<size_t>(op.numel) * DTypeSize(op.dtype);
      absl::Status st = to_host ? device_->CopyAsync(item.dst, op.param, pbytes, CopyKind::kDeviceToHost, *work_stream_)
                                : device_->CopyAsync(op.param, item.dst, pbytes, CopyKind::kHostToDevice, *work_stream_);
      if (!st.ok()) {
        (void)work_stream_->Synchronize();  // nothing enqueued may outlive the caller's buffers
        return st;
      }
      continue;
    }
    const size_t bytes = static_cast<size_t>(op.numel) * sizeof(float);
    char* state = reinterpret_cast<char*>(StatePtr(item.param, item.kind));
    char* host = static_cast<char*>(item.dst);
    if (!groups_[op.group].offloaded) {
      absl::Status st = to_host ? device_->CopyAsync(host, state, bytes, CopyKind::kDeviceToHost, *work_stream_)
                                : device_->CopyAsync(state, host, bytes, CopyKind::kHostToDevice, *work_stream_);
      if (!st.ok()) {
        (void)work_stream_->Synchronize();
        return st;
      }
      continue;
    }
    for (size_t at = 0; at < bytes; at += kPiece) {
      const size_t len = std::min(kPiece, bytes - at);
      host_pieces.push_back(to_host ? Piece{host + at, state + at, len} : Piece{state + at, host + at, len});
    }
  }
  pool_->ParallelFor(host_pieces.size(), [&](size_t k) {
    std::memcpy(host_pieces[k].dst, host_pieces[k].src, host_pieces[k].bytes);
  });
  return work_stream_->Synchronize();
}

absl::Status HybridOptimizer::Snapshot(absl::Span<const SnapshotItem> items) { return CopyItems(items, true); }

absl::Status HybridOptimizer::Restore(absl::Span<const SnapshotItem> items) { return CopyItems(items, false); }

absl::Status HybridOptimizer::SnapshotDeviceAsync(absl::Span<const SnapshotItem> items) {
  // Validate everything first: nothing is enqueued for a bad request.
  for (const SnapshotItem& item : items) {
    if (item.param >= params_.size() || item.dst == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("SnapshotDeviceAsync: bad item for param ", item.param));
    }
    if (!item.is_param && groups_[params_[item.param].group].offloaded) {
      return absl::InvalidArgumentError(absl::StrCat("SnapshotDeviceAsync: the state of param '",
                                                     params_[item.param].name,
                                                     "' is offloaded; it is read in place, not copied"));
    }
  }
  // After the last step's work on the trainer's stream (its kernels, and its uploads of the
  // offloaded groups' params, which the trainer's stream waited for).
  FERRY_RETURN_IF_ERROR(work_stream_->WaitFor(*step_done_));
  for (const SnapshotItem& item : items) {
    const OptimParam& op = params_[item.param];
    absl::Status st =
        item.is_param
            ? device_->CopyAsync(item.dst, op.param, static_cast<size_t>(op.numel) * DTypeSize(op.dtype),
                                 CopyKind::kDeviceToHost, *work_stream_)
            : device_->CopyAsync(item.dst, StatePtr(item.param, item.kind),
                                 static_cast<size_t>(op.numel) * sizeof(float), CopyKind::kDeviceToHost,
                                 *work_stream_);
    if (!st.ok()) {
      (void)work_stream_->Synchronize();  // nothing enqueued may outlive the caller's buffers
      return st;
    }
  }
  FERRY_RETURN_IF_ERROR(work_stream_->Record(*snapshot_done_));
  snapshot_pending_ = true;
  return absl::OkStatus();
}

absl::Status HybridOptimizer::WaitSnapshot() { return snapshot_done_->Synchronize(); }

absl::Status HybridOptimizer::ReadParam(size_t param, void* host) {
  FERRY_RETURN_IF_ERROR(Synchronize());
  const OptimParam& op = params_[param];
  FERRY_RETURN_IF_ERROR(device_->CopyAsync(host, op.param, static_cast<size_t>(op.numel) * DTypeSize(op.dtype),
                                           CopyKind::kDeviceToHost, *work_stream_));
  return work_stream_->Synchronize();
}

absl::Status HybridOptimizer::WriteParam(size_t param, const void* host) {
  FERRY_RETURN_IF_ERROR(Synchronize());
  const OptimParam& op = params_[param];
  FERRY_RETURN_IF_ERROR(device_->CopyAsync(op.param, host, static_cast<size_t>(op.numel) * DTypeSize(op.dtype),
                                           CopyKind::kHostToDevice, *work_stream_));
  return work_stream_->Synchronize();
}

absl::Status HybridOptimizer::VerifyMasters() {
  std::vector<char> param_bytes;
  std::vector<float> master;
  for (size_t p = 0; p < params_.size(); ++p) {
    const OptimParam& op = params_[p];
    const size_t esize = DTypeSize(op.dtype);
    param_bytes.resize(static_cast<size_t>(op.numel) * esize);
    master.resize(static_cast<size_t>(op.numel));
    FERRY_RETURN_IF_ERROR(ReadParam(p, param_bytes.data()));
    FERRY_RETURN_IF_ERROR(ReadState(p, StateKind::kMaster, master.data()));
    for (size_t e = 0; e < master.size(); ++e) {
      char rounded[4];
      StoreFromF32(rounded, op.dtype, 0, master[e]);
      if (std::memcmp(rounded, param_bytes.data() + e * esize, esize) != 0) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "stale master: group '%s', param '%s', element %d: the param is %g but its fp32 master is %g "
            "(%s); sync the masters from the model (SyncFromModel, or an after_load policy that syncs) "
            "before stepping",
            groups_[op.group].name, op.name, e, LoadAsF32(param_bytes.data(), op.dtype, e), master[e],
            groups_[op.group].offloaded ? "pinned host memory" : "GPU memory"));
      }
    }
  }
  return absl::OkStatus();
}

size_t HybridOptimizer::pinned_bytes() const { return arena_ == nullptr ? 0 : arena_->capacity(); }

size_t HybridOptimizer::gpu_state_bytes() const {
  size_t n = 0;
  for (const Group& g : groups_) n += g.device_state.bytes();
  return n;
}

}  // namespace ferry
