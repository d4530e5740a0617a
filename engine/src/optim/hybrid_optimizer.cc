#include "optim/hybrid_optimizer.h"

#include <algorithm>
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
    : device_(device), pool_(pool), options_(std::move(options)), cpu_adam_(pool) {}

HybridOptimizer::~HybridOptimizer() {
  absl::Status s = Synchronize();
  if (!s.ok()) FERRY_LOG(ERROR) << "HybridOptimizer: pending work failed at destruction: " << s;
  if (arena_ != nullptr) {
    for (Group& g : groups_) {
      if (!g.host_state.empty()) (void)arena_->Release(g.host_state);
    }
    if (!grad_stage_.empty()) (void)arena_->Release(grad_stage_);
    if (!param_stage_.empty()) (void)arena_->Release(param_stage_);
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
    if (numels.empty()) return absl::InvalidArgumentError(absl::StrCat("group '", g.name, "' has no params"));
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
  // Offloaded params' staging: grads arrive here from the device, new params leave from here.
  // Params with 4-byte grads come first: every region's size is a multiple of its element size, and
  // chunks are cut at multiples of 4 bytes of the concatenated regions, so with this order every chunk
  // piece starts and ends on an element boundary.
  std::stable_sort(cpu_params_.begin(), cpu_params_.end(), [&](size_t a, size_t b) {
    return DTypeSize(params_[a].grad_dtype) > DTypeSize(params_[b].grad_dtype);
  });
  size_t grad_bytes = 0, param_bytes = 0;
  for (size_t p : cpu_params_) {
    grad_stage_offset_.push_back(grad_bytes);
    param_stage_offset_.push_back(param_bytes);
    grad_bytes += AlignUp(static_cast<size_t>(params_[p].numel) * DTypeSize(params_[p].grad_dtype), 64);
    param_bytes += AlignUp(static_cast<size_t>(params_[p].numel) * DTypeSize(params_[p].dtype), 64);
  }
  FERRY_ASSIGN_OR_RETURN(work_stream_, device_->CreateStream());
  FERRY_ASSIGN_OR_RETURN(grads_ready_, device_->CreateEvent());
  FERRY_ASSIGN_OR_RETURN(step_done_, device_->CreateEvent());
  if (!cpu_params_.empty()) {
    arena_bytes += AlignUp(grad_bytes, kStageAlign) + AlignUp(param_bytes, kStageAlign) + 4 * kStageAlign;
    PinnedArenaOptions arena_options;
    arena_options.capacity_bytes = arena_bytes;
    arena_options.numa = options_.numa;
    arena_options.numa_node = options_.numa_node;
    arena_options.name = "optimizer state";
    FERRY_ASSIGN_OR_RETURN(arena_, PinnedArena::Create(device_, arena_options));
    for (Group& g : groups_) {
      if (!g.offloaded) continue;
      FERRY_ASSIGN_OR_RETURN(g.host_state,
                             arena_->Allocate(3 * static_cast<size_t>(g.layout.total_elements()) * sizeof(float)));
    }
    FERRY_ASSIGN_OR_RETURN(grad_stage_, arena_->Allocate(grad_bytes));
    FERRY_ASSIGN_OR_RETURN(param_stage_, arena_->Allocate(param_bytes));
    for (size_t i = 0; i < cpu_params_.size(); ++i) {
      const OptimParam& op = params_[cpu_params_[i]];
      grad_regions_.push_back(CopyRegion{grad_stage_.as<char>() + grad_stage_offset_[i], op.grad,
                                         static_cast<size_t>(op.numel) * DTypeSize(op.grad_dtype)});
    }
    TransferOptions transfer_options;
    transfer_options.chunk_bytes = options_.chunk_bytes / 4 * 4;  // whole elements of any dtype
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

absl::Status HybridOptimizer::Step(float lr, Stream& trainer) {
  FERRY_RETURN_IF_ERROR(WaitPending());  // the previous step's staging is free again
  FERRY_RETURN_IF_ERROR(trainer.Record(*grads_ready_));
  FERRY_RETURN_IF_ERROR(StepGpuGroups(lr, trainer));
  FERRY_RETURN_IF_ERROR(StepCpuGroups(lr, *grads_ready_));
  if (!pending_.empty()) FERRY_RETURN_IF_ERROR(pending_.back()->MakeStreamWait(trainer));
  FERRY_RETURN_IF_ERROR(trainer.Record(*step_done_));
  for (Group& g : groups_) ++g.step;
  return absl::OkStatus();
}

absl::Status HybridOptimizer::StepGpuGroups(float lr, Stream& trainer) {
  std::vector<AdamScalars> scalars;
  std::vector<AdamTensorArgs> tensors;
  std::vector<uint32_t> group_scalars(groups_.size(), 0);
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    const Group& g = groups_[gi];
    if (g.offloaded) continue;
    AdamHyper h = options_.hyper;
    h.lr = lr;
    group_scalars[gi] = static_cast<uint32_t>(scalars.size());
    scalars.push_back(MakeAdamScalars(h, g.step + 1));
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
  return device_->LaunchAdam(tensors, scalars, trainer);
}

absl::Status HybridOptimizer::StepCpuGroups(float lr, Event& grads_ready) {
  if (cpu_params_.empty()) return absl::OkStatus();
  std::vector<AdamScalars> scalars(groups_.size());
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    AdamHyper h = options_.hyper;
    h.lr = lr;
    scalars[gi] = MakeAdamScalars(h, groups_[gi].step + 1);
  }
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<TransferBatch> down,
                         transfer_->DeviceToHost(grad_regions_, &grads_ready));
  TransferBatch* d2h = down.get();
  pending_.push_back(std::move(down));
  std::vector<CpuAdamTensor> work;
  std::vector<CopyRegion> up;
  for (size_t k = 0; k < d2h->num_chunks(); ++k) {
    FERRY_RETURN_IF_ERROR(d2h->WaitChunk(k));
    work.clear();
    up.clear();
    for (const ChunkPiece& piece : d2h->chunk(k).pieces) {
      const size_t p = cpu_params_[piece.region];
      const OptimParam& op = params_[p];
      const size_t gsize = DTypeSize(op.grad_dtype), psize = DTypeSize(op.dtype);
      FERRY_CHECK(piece.offset % gsize == 0 && piece.bytes % gsize == 0) << "chunk piece off element boundary";
      const size_t e0 = piece.offset / gsize;
      const size_t n = piece.bytes / gsize;
      char* param_stage = param_stage_.as<char>() + param_stage_offset_[piece.region];
      CpuAdamTensor t;
      t.master = StatePtr(p, StateKind::kMaster) + e0;
      t.exp_avg = StatePtr(p, StateKind::kExpAvg) + e0;
      t.exp_avg_sq = StatePtr(p, StateKind::kExpAvgSq) + e0;
      t.grad = grad_stage_.as<char>() + grad_stage_offset_[piece.region] + e0 * gsize;
      t.param = param_stage + e0 * psize;
      t.numel = static_cast<int64_t>(n);
      t.grad_dtype = op.grad_dtype;
      t.param_dtype = op.dtype;
      t.scalars = &scalars[op.group];
      work.push_back(t);
      up.push_back(CopyRegion{static_cast<char*>(op.param) + e0 * psize, param_stage + e0 * psize, n * psize});
    }
    FERRY_RETURN_IF_ERROR(cpu_adam_.Step(work));
    // The trainer's stream may still read the params until the grads are ready: the upload waits.
    FERRY_ASSIGN_OR_RETURN(std::unique_ptr<TransferBatch> upload, transfer_->HostToDevice(up, &grads_ready));
    pending_.push_back(std::move(upload));
  }
  return absl::OkStatus();
}

absl::Status HybridOptimizer::SyncParamsFromModel(const std::vector<size_t>& params) {
  FERRY_RETURN_IF_ERROR(Synchronize());
  FERRY_RETURN_IF_ERROR(work_stream_->WaitFor(*step_done_));
  std::vector<size_t> host_params;
  for (size_t p : params) {
    const OptimParam& op = params_[p];
    if (groups_[op.group].offloaded) {
      size_t i = 0;
      while (cpu_params_[i] != p) ++i;
      host_params.push_back(i);
      FERRY_RETURN_IF_ERROR(device_->CopyAsync(param_stage_.as<char>() + param_stage_offset_[i], op.param,
                                               static_cast<size_t>(op.numel) * DTypeSize(op.dtype),
                                               CopyKind::kDeviceToHost, *work_stream_));
    } else {
      FERRY_RETURN_IF_ERROR(device_->LaunchConvert(StatePtr(p, StateKind::kMaster), DType::kF32, op.param,
                                                   op.dtype, op.numel, *work_stream_));
    }
  }
  FERRY_RETURN_IF_ERROR(work_stream_->Synchronize());
  pool_->ParallelFor(host_params.size(), [&](size_t k) {
    const size_t i = host_params[k];
    const OptimParam& op = params_[cpu_params_[i]];
    const char* src = param_stage_.as<char>() + param_stage_offset_[i];
    float* master = StatePtr(cpu_params_[i], StateKind::kMaster);
    for (int64_t e = 0; e < op.numel; ++e) master[e] = LoadAsF32(src, op.dtype, static_cast<size_t>(e));
  });
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
    if (grp.offloaded) {
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
