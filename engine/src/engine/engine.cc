// Engine: wires device, memory, transfer, optim, ckpt and policy together behind ferry/engine.h.
#include "ferry/engine.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <numeric>
#include <set>
#include <thread>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/strings/ascii.h"
#include "base/absl_compat.h"
#include "base/logging.h"
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

namespace ferry {
namespace {

constexpr char kModelKind[] = "model";
constexpr std::pair<StateKind, const char*> kStateKinds[] = {
    {StateKind::kMaster, "master"}, {StateKind::kExpAvg, "exp_avg"}, {StateKind::kExpAvgSq, "exp_avg_sq"}};

std::string StateTensorName(const std::string& param, const char* kind) { return absl::StrCat(param, ":", kind); }

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
      s->registrar_ = std::thread([raw = s.get()] { raw->register_status_ = raw->device_->RegisterHost(raw->data_, raw->bytes_); });
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
  ParamSpec spec;
  int64_t numel = 0;
  size_t group = 0;
};

class EngineImpl final : public Engine {
 public:
  EngineImpl(EngineOptions options, std::unique_ptr<Device> device, std::unique_ptr<Policy> policy)
      : options_(std::move(options)),
        device_(std::move(device)),
        policy_(std::move(policy)),
        pool_(options_.cpu_threads > 0 ? options_.cpu_threads : ThreadPool::DefaultThreads()) {}

  ~EngineImpl() override {
    if (ckpt_writer_ != nullptr) ckpt_writer_->WaitIdle();  // it may read the optimizer's state in place
    optimizer_.reset();  // releases its arena and device state before the device goes away
  }

  absl::Status AddParam(const ParamSpec& spec) override;
  absl::Status Finalize() override;
  absl::Status Step(const StepOptions& options, void* stream) override;
  absl::Status Synchronize() override {
    return optimizer_ == nullptr ? absl::OkStatus() : optimizer_->Synchronize();
  }
  absl::StatusOr<std::string> SaveCheckpoint(const std::string& root, int64_t step) override;
  absl::Status WaitCheckpoint() override;
  std::optional<absl::Status> PollCheckpoint() override;
  absl::Status LoadCheckpoint(const std::string& path) override { return LoadCheckpoint(path, LoadOptions{}); }
  absl::Status LoadCheckpoint(const std::string& path, const LoadOptions& options) override;
  absl::Status SyncFromModel(const std::vector<std::string>& groups, bool reset_optimizer) override;
  absl::Status ReloadPolicy(const std::string& path, const std::map<std::string, std::string>& args) override;
  // Moves every group whose placement differs from `placement` (which names every group) between pinned
  // host memory and the device, values and step counts unchanged. On error nothing changes.
  absl::Status MoveTo(const ferry::Placement& placement);
  // Calls the policy's on_step hook after a step and applies the moves it asks for.
  absl::Status RunOnStep(double step_seconds);
  absl::Status VerifyMasters() override;
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
  std::vector<GroupInfo> GroupInfos() const;
  // A new optimizer with `placement`; its masters come from the params (m = v = 0).
  absl::StatusOr<std::unique_ptr<HybridOptimizer>> BuildOptimizer(const ferry::Placement& placement,
                                                                  std::vector<bool>* offloaded_out);
  absl::StatusOr<PolicyContext> Context();
  absl::StatusOr<std::vector<size_t>> GroupIndices(const std::vector<std::string>& names) const;
  std::string PolicyName() const { return policy_ == nullptr ? "(default policy)" : policy_->path(); }
  // ckpt_staging_, grown to at least `bytes`. REQUIRES: no save in flight.
  absl::StatusOr<char*> EnsureStaging(size_t bytes);
  // LoadCheckpoint of one checkpoint: reads and verifies everything, then applies.
  absl::Status LoadCheckpointFrom(const std::string& path);

  EngineOptions options_;
  std::unique_ptr<Device> device_;
  std::unique_ptr<Policy> policy_;
  ThreadPool pool_;
  std::vector<ParamRecord> params_;
  absl::flat_hash_map<std::string, size_t> param_index_;
  std::vector<std::string> group_names_;  // in order of first appearance
  absl::flat_hash_map<std::string, size_t> group_index_;
  std::vector<DType> group_dtype_;
  std::vector<bool> offloaded_;
  std::unique_ptr<HybridOptimizer> optimizer_;
  int64_t skipped_steps_ = 0;
  bool last_step_skipped_ = false;
  double last_grad_norm_ = 0.0;
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

absl::Status EngineImpl::AddParam(const ParamSpec& spec) {
  const std::string where = absl::StrCat("AddParam('", spec.name, "')");
  if (optimizer_ != nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(where, ": the engine is finalized; add every param before Finalize()"));
  }
  if (spec.name.empty()) return absl::InvalidArgumentError("AddParam: the param name is empty");
  if (spec.name.find(':') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": names must not contain ':' (reserved for checkpoint tensor names)"));
  }
  if (param_index_.contains(spec.name)) {
    return absl::AlreadyExistsError(absl::StrCat(where, ": a param with this name was already added"));
  }
  if (spec.param == nullptr) return absl::InvalidArgumentError(absl::StrCat(where, ": param pointer is null"));
  if (spec.grad == nullptr) return absl::InvalidArgumentError(absl::StrCat(where, ": grad pointer is null"));
  if (spec.shape.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": shape is empty; a scalar param has shape {1}"));
  }
  int64_t numel = 1;
  for (size_t d = 0; d < spec.shape.size(); ++d) {
    if (spec.shape[d] <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": dimension ", d, " is ", spec.shape[d],
                                                     "; every dimension must be at least 1 (shape [",
                                                     absl::StrJoin(spec.shape, ", "), "])"));
    }
    if (numel > (int64_t{1} << 50) / spec.shape[d]) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": shape is too large"));
    }
    numel *= spec.shape[d];
  }
  const std::string group = spec.group.empty() ? spec.name : spec.group;
  auto it = group_index_.find(group);
  if (it != group_index_.end() && group_dtype_[it->second] != spec.dtype) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": dtype ", ToAbsl(DTypeName(spec.dtype)), " differs from group '",
                                                   group, "', whose params are ", ToAbsl(DTypeName(group_dtype_[it->second]))));
  }
  if (it == group_index_.end()) {
    it = group_index_.emplace(group, group_names_.size()).first;
    group_names_.push_back(group);
    group_dtype_.push_back(spec.dtype);
  }
  ParamRecord rec{spec, numel, it->second};
  rec.spec.group = group;
  param_index_.emplace(spec.name, params_.size());
  params_.push_back(std::move(rec));
  return absl::OkStatus();
}

std::vector<GroupInfo> EngineImpl::GroupInfos() const {
  std::vector<GroupInfo> infos(group_names_.size());
  for (size_t g = 0; g < infos.size(); ++g) {
    infos[g].name = group_names_[g];
    infos[g].dtype = group_dtype_[g];
  }
  for (const ParamRecord& p : params_) {
    GroupInfo& gi = infos[p.group];
    gi.numel += p.numel;
    gi.bytes += p.numel * static_cast<int64_t>(DTypeSize(p.spec.dtype));
    for (const std::string& tag : p.spec.tags) {
      if (std::find(gi.tags.begin(), gi.tags.end(), tag) == gi.tags.end()) gi.tags.push_back(tag);
    }
  }
  return infos;
}

absl::StatusOr<PolicyContext> EngineImpl::Context() {
  PolicyContext ctx;
  ctx.rank = 0;
  ctx.world_size = 1;
  FERRY_ASSIGN_OR_RETURN(size_t free_bytes, device_->FreeMemory());
  ctx.gpu_free_bytes = static_cast<int64_t>(free_bytes);
  ctx.pinned_budget_bytes = 0;  // no budget configured: limited by the host's memory
  ctx.numa_nodes = NumaNodeCount();
  ctx.args = options_.policy_args;
  return ctx;
}

absl::Status EngineImpl::Finalize() {
  if (optimizer_ != nullptr) return absl::FailedPreconditionError("Finalize: the engine is already finalized");
  if (params_.empty()) return absl::FailedPreconditionError("Finalize: no params were added");
  std::vector<GroupInfo> infos = GroupInfos();
  FERRY_ASSIGN_OR_RETURN(PolicyContext ctx, Context());
  ferry::Placement placement;
  if (policy_ != nullptr) {
    FERRY_ASSIGN_OR_RETURN(placement, policy_->Place(infos, ctx));
  } else {
    for (const GroupInfo& g : infos) placement.groups[g.name] = PlaceKind::kGpu;
  }
  FERRY_ASSIGN_OR_RETURN(optimizer_, BuildOptimizer(placement, &offloaded_));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<HybridOptimizer>> EngineImpl::BuildOptimizer(const ferry::Placement& placement,
                                                                             std::vector<bool>* offloaded_out) {
  HybridOptions hopt;
  hopt.hyper.lr = options_.optimizer.lr;
  hopt.hyper.beta1 = options_.optimizer.beta1;
  hopt.hyper.beta2 = options_.optimizer.beta2;
  hopt.hyper.eps = options_.optimizer.eps;
  hopt.hyper.weight_decay = options_.optimizer.weight_decay;
  hopt.hyper.mode = options_.optimizer.adamw ? AdamMode::kAdamW : AdamMode::kAdamL2;
  hopt.hyper.bias_correction = options_.optimizer.bias_correction;
  hopt.chunk_bytes = options_.transfer_chunk_bytes;
  std::string numa = placement.numa.value_or(options_.numa);
  if (!numa.empty()) {
    absl::StatusOr<NumaPolicy> np = ParseNumaPolicy(numa);
    if (!np.ok()) return absl::InvalidArgumentError(absl::StrCat("NUMA policy: ", np.status().message()));
    hopt.numa = *np;
  }
  std::vector<OptimGroup> groups(group_names_.size());
  std::vector<bool> offloaded(group_names_.size(), false);
  for (size_t g = 0; g < groups.size(); ++g) {
    auto it = placement.groups.find(group_names_[g]);
    if (it == placement.groups.end()) {
      return absl::InternalError(absl::StrCat("the policy placed no group '", group_names_[g], "'"));
    }
    groups[g].name = group_names_[g];
    groups[g].offloaded = offloaded[g] = it->second == PlaceKind::kCpu;
  }
  std::vector<OptimParam> params;
  params.reserve(params_.size());
  for (const ParamRecord& p : params_) {
    params.push_back(OptimParam{p.spec.name, p.group, p.numel, p.spec.dtype, p.spec.grad_dtype.value_or(p.spec.dtype),
                                p.spec.param, p.spec.grad});
  }
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<HybridOptimizer> optimizer,
                         HybridOptimizer::Create(device_.get(), &pool_, std::move(params), std::move(groups), hopt));
  *offloaded_out = std::move(offloaded);
  return optimizer;
}

absl::Status EngineImpl::Step(const StepOptions& options, void* stream) {
  FERRY_RETURN_IF_ERROR(RequireFinalized("Step"));
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Stream> trainer, device_->WrapStream(stream));
  const float lr = options.lr.value_or(options_.optimizer.lr);
  const double start = absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch());
  HybridStepParams params{.lr = lr, .loss_scale = options.loss_scale, .max_grad_norm = options.max_grad_norm,
                          .check_finite = options.check_finite};
  FERRY_ASSIGN_OR_RETURN(HybridStepResult result, optimizer_->Step(params, *trainer));
  last_step_skipped_ = result.skipped;
  last_grad_norm_ = result.grad_norm;
  if (result.skipped) ++skipped_steps_;
  if (policy_ == nullptr || !policy_->has_hook("on_step")) return absl::OkStatus();
  return RunOnStep(absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()) - start);
}

absl::Status EngineImpl::RunOnStep(double step_seconds) {
  StepStats stats;
  stats.step = optimizer_->num_groups() > 0 ? optimizer_->group_step(0) : 0;
  stats.step_seconds = step_seconds;
  stats.gpu_state_bytes = static_cast<int64_t>(optimizer_->gpu_state_bytes());
  stats.pinned_bytes = static_cast<int64_t>(optimizer_->pinned_bytes());
  for (const GroupInfo& g : GroupInfos()) {
    const size_t gi = group_index_.at(g.name);
    stats.groups.push_back(GroupStepInfo{g.name, offloaded_[gi] ? PlaceKind::kCpu : PlaceKind::kGpu, g.numel, g.bytes});
  }
  FERRY_ASSIGN_OR_RETURN(PolicyContext ctx, Context());
  absl::StatusOr<MoveRequest> request = policy_->OnStep(stats, ctx);
  absl::Status s = request.ok() ? absl::OkStatus() : request.status();
  if (s.ok() && !request->empty()) s = MoveTo(PlacementAfter(stats, *request));
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("the step was applied, but its on_step hook failed and the placement "
                                               "is unchanged: ", s.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<size_t>> EngineImpl::GroupIndices(const std::vector<std::string>& names) const {
  std::vector<size_t> out;
  if (names.empty()) {
    out.resize(group_names_.size());
    std::iota(out.begin(), out.end(), 0);
    return out;
  }
  for (const std::string& n : names) {
    auto it = group_index_.find(n);
    if (it == group_index_.end()) {
      return absl::NotFoundError(absl::StrCat("no parameter group '", n, "' (groups: ",
                                              absl::StrJoin(group_names_, ", "), ")"));
    }
    out.push_back(it->second);
  }
  return out;
}

absl::StatusOr<std::string> EngineImpl::SaveCheckpoint(const std::string& root, int64_t step) {
  FERRY_RETURN_IF_ERROR(RequireFinalized("SaveCheckpoint"));
  if (step < 0) return absl::InvalidArgumentError(absl::StrCat("SaveCheckpoint: step must be >= 0, got ", step));
  // The previous asynchronous save must be done before its staging is reused; its error, if any, is
  // delivered here.
  if (ckpt_writer_ != nullptr) FERRY_RETURN_IF_ERROR(ckpt_writer_->Wait());
  CheckpointInfo info;
  info.step = step;
  info.reason = "save";
  info.groups = group_names_;
  for (const ParamRecord& p : params_) {
    info.model_bytes += p.numel * static_cast<int64_t>(DTypeSize(p.spec.dtype));
    info.master_bytes += p.numel * 4;
    info.optimizer_bytes += p.numel * 8;
  }
  for (size_t g = 0; g < group_names_.size(); ++g) {
    if (offloaded_[g]) info.offloaded.push_back(group_names_[g]);
  }
  CheckpointPlan plan;
  if (policy_ != nullptr) {
    FERRY_ASSIGN_OR_RETURN(PolicyContext ctx, Context());
    FERRY_ASSIGN_OR_RETURN(plan, policy_->Checkpoint(info, ctx));
  }
  std::set<std::string> skip_groups(plan.skip_groups.begin(), plan.skip_groups.end());
  for (const std::string& g : skip_groups) {
    if (!group_index_.contains(g)) {
      return absl::InvalidArgumentError(absl::StrCat(PolicyName(), ": checkpoint(): skip names unknown group '", g, "'"));
    }
  }
  std::vector<SkipRecord> skipped;
  if (plan.skip_optimizer) skipped.push_back({"optimizer", absl::StrCat("policy ", PolicyName())});
  if (plan.skip_master) skipped.push_back({"master", absl::StrCat("policy ", PolicyName())});
  bool any_f32 = false;
  for (const ParamRecord& p : params_) any_f32 = any_f32 || p.spec.dtype == DType::kF32;
  if (any_f32 && !plan.skip_master) {
    skipped.push_back({"master of f32 params", "identical to the param (the param is stored once)"});
  }
  for (const std::string& g : skip_groups) skipped.push_back({absl::StrCat("group:", g), absl::StrCat("policy ", PolicyName())});

  // What to save. Device-resident tensors (every param, and the state of GPU groups) are copied
  // into the cached pinned staging on the device's work stream, ordered after the last step; the
  // trainer does not wait for the copies (the next Step is ordered after them on the device).
  // Offloaded state is not copied at all: it is written straight from the pinned arena, and until
  // the writer has written a param's state the next Step waits before updating that param
  // (StateFence), so the trainer waits only for the chunks it is about to modify.
  struct Source {
    size_t param;
    int kind;  // -1: the param itself, else an index into kStateKinds
  };
  std::vector<TensorRecord> tensors;
  std::vector<Source> sources;
  for (size_t i = 0; i < params_.size(); ++i) {
    const ParamRecord& p = params_[i];
    const std::string& group = group_names_[p.group];
    if (skip_groups.contains(group)) continue;
    tensors.push_back(TensorRecord{p.spec.name, p.spec.dtype, p.spec.shape, nullptr,
                                   static_cast<size_t>(p.numel) * DTypeSize(p.spec.dtype), kModelKind, group});
    sources.push_back({i, -1});
    for (int k = 0; k < 3; ++k) {
      const bool is_master = kStateKinds[k].first == StateKind::kMaster;
      if ((is_master && plan.skip_master) || (!is_master && plan.skip_optimizer)) continue;
      // An fp32 param is its master, bit for bit (the param is the master rounded to f32): written once.
      if (is_master && p.spec.dtype == DType::kF32) continue;
      tensors.push_back(TensorRecord{StateTensorName(p.spec.name, kStateKinds[k].second), DType::kF32, p.spec.shape,
                                     nullptr, static_cast<size_t>(p.numel) * sizeof(float), kStateKinds[k].second,
                                     group});
      sources.push_back({i, k});
    }
  }
  // Where each tensor's bytes come from: staged (device-resident) or in place (offloaded state).
  // The staging holds the staged tensors and room for a copy of each in-place one, which is used
  // only if the next Step overtakes the writer (copy-on-write, see StateFence).
  auto ckpt = std::make_shared<SaveSources>();
  ckpt->staged.assign(tensors.size(), false);
  ckpt->region.assign(tensors.size(), 0);
  std::vector<size_t> staged_offset(tensors.size(), 0);
  size_t staged_bytes = 0;
  for (size_t k = 0; k < tensors.size(); ++k) {
    const Source& src = sources[k];
    const bool in_place = src.kind >= 0 && offloaded_[params_[src.param].group];
    ckpt->staged[k] = !in_place;
    staged_offset[k] = staged_bytes;
    staged_bytes += (tensors[k].bytes + 63) / 64 * 64;
    // The offloaded state first, in the reverse of the order in which the next Step updates it: a
    // step that overtakes the writer copies aside what it meets untouched and meets the writer's
    // regions in flight only once, where the two fronts cross (in the same order it would trail the
    // writer, waiting at every chunk). The staged tensors after it, by when their copies have
    // long landed.
    tensors[k].write_order = static_cast<int64_t>(in_place ? params_.size() - src.param : params_.size() + 1 + src.param);
  }
  FERRY_ASSIGN_OR_RETURN(char* staging, EnsureStaging(staged_bytes));
  FERRY_RETURN_IF_ERROR(ckpt_staging_->Ready());
  std::vector<HybridOptimizer::SnapshotItem> items;
  std::vector<StateFence::Region> regions;
  for (size_t k = 0; k < tensors.size(); ++k) {
    const Source& src = sources[k];
    if (!ckpt->staged[k]) {
      const char* state = reinterpret_cast<const char*>(optimizer_->offloaded_state(src.param, kStateKinds[src.kind].first));
      tensors[k].data = state;
      ckpt->region[k] = regions.size();
      regions.push_back({.param = src.param, .src = state, .copy = staging + staged_offset[k], .bytes = tensors[k].bytes});
      continue;
    }
    HybridOptimizer::SnapshotItem item;
    item.param = src.param;
    item.is_param = src.kind < 0;
    if (src.kind >= 0) item.kind = kStateKinds[src.kind].first;
    item.dst = staging + staged_offset[k];
    tensors[k].data = item.dst;
    items.push_back(item);
  }
  std::map<std::string, std::string> metadata;
  metadata["ferry.version"] = "1";
  metadata["ferry.world_size"] = "1";
  const OptimizerOptions& o = options_.optimizer;
  metadata["ferry.optimizer"] = absl::StrCat(o.adamw ? "adamw" : "adam_l2", " lr=", o.lr, " beta1=", o.beta1,
                                             " beta2=", o.beta2, " eps=", o.eps, " weight_decay=", o.weight_decay,
                                             " bias_correction=", o.bias_correction ? 1 : 0);
  for (size_t g = 0; g < group_names_.size(); ++g) {
    metadata[absl::StrCat("ferry.group.", group_names_[g], ".step")] = absl::StrCat(optimizer_->group_step(g));
    metadata[absl::StrCat("ferry.group.", group_names_[g], ".placement")] = offloaded_[g] ? "cpu" : "gpu";
  }
  CheckpointJob job;
  job.root = root;
  job.step = step;
  job.tensors = std::move(tensors);
  job.skipped = std::move(skipped);
  job.metadata = std::move(metadata);
  job.options.keep_last = plan.keep_last;
  HybridOptimizer* optimizer = optimizer_.get();
  auto fence = std::make_shared<StateFence>(std::move(regions), params_.size());
  const bool async = plan.async;
  job.options.before_write = [ckpt, optimizer, fence, async](size_t tensor) -> absl::StatusOr<const void*> {
    if (ckpt->staged[tensor]) {
      FERRY_RETURN_IF_ERROR(optimizer->WaitSnapshot());
      return nullptr;
    }
    if (!async) return nullptr;  // the trainer is blocked in the save: the state stays as it is
    return fence->BeginRead(ckpt->region[tensor]);
  };
  // Enough writers that an asynchronous save copies the offloaded state into the page cache quickly
  // (the next Step waits for the params it updates until then).
  if (ckpt_writer_ == nullptr) ckpt_writer_ = std::make_unique<CheckpointWriter>(std::min<size_t>(8, ThreadPool::DefaultThreads()));
  FERRY_RETURN_IF_ERROR(optimizer_->SnapshotDeviceAsync(items));
  if (!plan.async) {
    // The trainer is blocked for the whole save: nothing changes the offloaded state meanwhile.
    absl::StatusOr<std::string> dir = ckpt_writer_->Write(job);
    absl::Status landed = optimizer_->WaitSnapshot();  // the staging is never left with copies in flight
    if (dir.ok() && !landed.ok()) return landed;
    return dir;
  }
  job.options.after_write = [ckpt, fence](size_t tensor, uint64_t, uint64_t length) {
    if (!ckpt->staged[tensor]) fence->Release(ckpt->region[tensor], length);
  };
  job.on_finished = [fence] { fence->ReleaseAll(); };
  if (ckpt_fence_ != nullptr) ckpt_copied_aside_ += ckpt_fence_->copied_bytes();
  ckpt_fence_ = fence;
  optimizer_->set_state_fence(fence);
  absl::Status started = ckpt_writer_->Start(std::move(job));
  if (!started.ok()) {
    fence->ReleaseAll();
    (void)optimizer_->WaitSnapshot();
    return started;
  }
  return JoinPath(root, CheckpointDirName(step));
}

absl::StatusOr<char*> EngineImpl::EnsureStaging(size_t bytes) {
  if (ckpt_staging_ != nullptr && ckpt_staging_->bytes() >= bytes) return ckpt_staging_->data();
  ckpt_staging_.reset();  // freed before the larger one is allocated
  FERRY_ASSIGN_OR_RETURN(ckpt_staging_, CheckpointStaging::Create(device_.get(), bytes));
  return ckpt_staging_->data();
}

absl::Status EngineImpl::WaitCheckpoint() {
  return ckpt_writer_ == nullptr ? absl::OkStatus() : ckpt_writer_->Wait();
}

std::optional<absl::Status> EngineImpl::PollCheckpoint() {
  if (ckpt_writer_ == nullptr) return absl::OkStatus();
  return ckpt_writer_->Poll();
}

absl::Status EngineImpl::LoadCheckpoint(const std::string& path, const LoadOptions& options) {
  FERRY_RETURN_IF_ERROR(RequireFinalized("LoadCheckpoint"));
  if (ckpt_writer_ != nullptr) ckpt_writer_->WaitIdle();  // a save in flight may be the one to load
  const absl::Status first = LoadCheckpointFrom(path);
  const bool corrupt = first.code() == absl::StatusCode::kDataLoss || first.code() == absl::StatusCode::kNotFound;
  if (first.ok() || !options.fall_back_to_previous || !corrupt) return first;
  // Which checkpoint failed, and under which root: `path` itself if it is a checkpoint directory,
  // else the one `latest` names (unknown when `latest` itself is unreadable: then every committed
  // checkpoint is a candidate).
  std::string root = path, failed_name;
  absl::StatusOr<bool> is_dir = PathExists(JoinPath(path, kManifestFileName));
  if (is_dir.ok() && *is_dir) {
    std::string p = path;
    while (p.size() > 1 && p.back() == '/') p.pop_back();
    const size_t slash = p.rfind('/');
    root = slash == std::string::npos ? "." : p.substr(0, slash);
    failed_name = slash == std::string::npos ? p : p.substr(slash + 1);
  } else {
    absl::StatusOr<std::string> latest = ReadFileToString(JoinPath(path, "latest"), 4096);
    if (latest.ok()) failed_name = std::string(absl::StripAsciiWhitespace(*latest));
  }
  absl::StatusOr<std::vector<std::string>> candidates = ListCheckpoints(root);
  if (!candidates.ok()) return first;
  const std::string failed_dir = failed_name.empty() ? "" : JoinPath(root, failed_name);
  bool older = failed_dir.empty() || std::find(candidates->begin(), candidates->end(), failed_dir) == candidates->end();
  for (auto it = candidates->rbegin(); it != candidates->rend(); ++it) {  // newest first
    if (!older) {
      older = *it == failed_dir;  // only checkpoints older than the one that failed
      continue;
    }
    absl::Status s = LoadCheckpointFrom(*it);
    if (s.ok()) {
      FERRY_LOG(WARNING) << "LoadCheckpoint(" << path << ") failed (" << first << "); loaded the previous complete checkpoint " << *it << " instead";
      return s;
    }
    if (s.code() != absl::StatusCode::kDataLoss && s.code() != absl::StatusCode::kNotFound) return s;
  }
  return absl::Status(first.code(), absl::StrCat(first.message(), " (and no older checkpoint under ", root, " loads)"));
}

absl::Status EngineImpl::LoadCheckpointFrom(const std::string& path) {
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader, CheckpointReader::Open(path));
  const std::string& dir = reader->dir();
  // Phase 1: check and read everything into host memory; nothing in the engine changes yet.
  std::set<std::string> known;
  for (const ParamRecord& p : params_) {
    known.insert(p.spec.name);
    for (const auto& [kind, kind_name] : kStateKinds) known.insert(StateTensorName(p.spec.name, kind_name));
  }
  for (const TensorEntry& t : reader->tensors()) {
    if (!known.contains(t.name)) {
      return absl::InvalidArgumentError(absl::StrCat(dir, ": tensor '", t.name,
                                                     "' matches no registered param; was it saved from another model?"));
    }
  }
  // Every tensor to load gets a place in the pinned staging: it is read there (all of it, in
  // parallel, each chunk verified by its checksum) before anything of the engine changes, and
  // applied from there in one pass.
  struct Loaded {
    bool has_param = false;
    bool has_state[3] = {false, false, false};
    bool master_from_param = false;  // the master of an fp32 param: the param's bytes
    size_t param_at = 0;             // offsets into the staging
    size_t state_at[3] = {0, 0, 0};
  };
  // Checkpoints store the master of an fp32 param only as the param itself (see SaveCheckpoint).
  bool masters_aliased = false;
  for (const SkipRecord& r : reader->skipped()) masters_aliased = masters_aliased || r.what == "master of f32 params";
  std::vector<Loaded> loaded(params_.size());
  std::vector<bool> group_loaded(group_names_.size(), false);
  std::vector<bool> group_masters(group_names_.size(), true), group_optimizer(group_names_.size(), true);
  struct ReadJob {
    std::string name;
    size_t at;
    size_t bytes;
  };
  std::vector<ReadJob> jobs;
  size_t staged_bytes = 0;
  auto place = [&](const std::string& name, size_t bytes) {
    jobs.push_back(ReadJob{name, staged_bytes, bytes});
    staged_bytes += (bytes + 63) / 64 * 64;
    return jobs.back().at;
  };
  for (size_t i = 0; i < params_.size(); ++i) {
    const ParamRecord& p = params_[i];
    const TensorEntry* e = reader->Find(p.spec.name);
    if (e == nullptr) {
      group_masters[p.group] = group_optimizer[p.group] = false;
      continue;
    }
    if (e->dtype != p.spec.dtype || e->shape != p.spec.shape) {
      return absl::InvalidArgumentError(absl::StrCat(
          dir, ": tensor '", p.spec.name, "' is ", ToAbsl(DTypeName(e->dtype)), "[", absl::StrJoin(e->shape, ","),
          "] but the registered param is ", ToAbsl(DTypeName(p.spec.dtype)), "[", absl::StrJoin(p.spec.shape, ","), "]"));
    }
    Loaded& l = loaded[i];
    l.param_at = place(p.spec.name, e->bytes);
    l.has_param = true;
    group_loaded[p.group] = true;
    for (int k = 0; k < 3; ++k) {
      const std::string name = StateTensorName(p.spec.name, kStateKinds[k].second);
      const TensorEntry* s = reader->Find(name);
      if (s == nullptr && k == 0 && p.spec.dtype == DType::kF32 && masters_aliased) {
        l.master_from_param = true;  // restored from the param's bytes
        l.has_state[0] = true;
        l.state_at[0] = l.param_at;
        continue;
      }
      if (s == nullptr) {
        if (k == 0) group_masters[p.group] = false;
        else group_optimizer[p.group] = false;
        continue;
      }
      if (s->dtype != DType::kF32 || s->shape != p.spec.shape) {
        return absl::InvalidArgumentError(absl::StrCat(dir, ": tensor '", name, "' is ", ToAbsl(DTypeName(s->dtype)), "[",
                                                       absl::StrJoin(s->shape, ","), "]; expected f32[",
                                                       absl::StrJoin(p.spec.shape, ","), "]"));
      }
      l.state_at[k] = place(name, static_cast<size_t>(p.numel) * sizeof(float));
      l.has_state[k] = true;
    }
  }
  FERRY_ASSIGN_OR_RETURN(char* staging, EnsureStaging(staged_bytes));
  {
    std::vector<TensorRead> reads;
    reads.reserve(jobs.size());
    for (const ReadJob& j : jobs) reads.push_back(TensorRead{j.name, staging + j.at, j.bytes});
    BulkReadOptions read_options;
    read_options.pool = &pool_;
    FERRY_RETURN_IF_ERROR(ReadTensors(*reader, reads, read_options));
  }
  std::vector<int64_t> steps(group_names_.size(), 0);
  LoadEvent event;
  event.optimizer_loaded = true;
  event.masters_loaded = true;
  for (size_t g = 0; g < group_names_.size(); ++g) {
    if (!group_loaded[g]) continue;
    event.groups.push_back(group_names_[g]);
    event.optimizer_loaded = event.optimizer_loaded && group_optimizer[g];
    event.masters_loaded = event.masters_loaded && group_masters[g];
    if (group_optimizer[g]) {
      auto it = reader->metadata().find(absl::StrCat("ferry.group.", group_names_[g], ".step"));
      if (it == reader->metadata().end() || !absl::SimpleAtoi(it->second, &steps[g]) || steps[g] < 0) {
        return absl::InvalidArgumentError(absl::StrCat(dir, ": metadata has no valid step count for group '",
                                                       group_names_[g], "'"));
      }
    }
  }
  if (event.groups.empty()) return absl::InvalidArgumentError(absl::StrCat(dir, ": no tensor of any registered param"));
  event.kind = event.optimizer_loaded ? LoadKind::kCheckpoint : LoadKind::kModelOnly;
  SyncPlan sync;
  if (policy_ != nullptr) {
    FERRY_ASSIGN_OR_RETURN(PolicyContext ctx, Context());
    FERRY_ASSIGN_OR_RETURN(sync, policy_->AfterLoad(event, GroupInfos(), ctx));
  } else {
    if (!event.masters_loaded) sync.sync_groups = event.groups;
    sync.reset_optimizer = !event.optimizer_loaded;
  }
  FERRY_ASSIGN_OR_RETURN(std::vector<size_t> sync_groups, GroupIndices(sync.sync_groups));
  if (sync.sync_groups.empty()) sync_groups.clear();  // empty list means "none" here, not "all"

  // Phase 2: apply, in one pass.
  std::vector<HybridOptimizer::SnapshotItem> restore;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Loaded& l = loaded[i];
    if (!l.has_param) continue;
    restore.push_back({.param = i, .is_param = true, .dst = staging + l.param_at});
    for (int k = 0; k < 3; ++k) {
      if (l.has_state[k]) restore.push_back({.param = i, .kind = kStateKinds[k].first, .dst = staging + l.state_at[k]});
    }
  }
  FERRY_RETURN_IF_ERROR(ckpt_staging_->Ready());  // registered: the device copies run at the pinned rate
  FERRY_RETURN_IF_ERROR(optimizer_->Restore(restore));
  std::vector<size_t> reset;
  for (size_t g = 0; g < group_names_.size(); ++g) {
    if (!group_loaded[g]) continue;
    if (group_optimizer[g]) {
      optimizer_->set_group_step(g, steps[g]);
    } else {
      reset.push_back(g);  // moments from before the load belong to other weights: never keep them
    }
  }
  if (!sync_groups.empty()) FERRY_RETURN_IF_ERROR(optimizer_->SyncFromModel(sync_groups, sync.reset_optimizer));
  if (!reset.empty()) {
    // Zero the moments only; the masters stay as loaded or as the sync left them.
    for (size_t g : reset) {
      for (size_t i = 0; i < params_.size(); ++i) {
        if (params_[i].group != g) continue;
        std::vector<float> zeros(static_cast<size_t>(params_[i].numel), 0.0f);
        FERRY_RETURN_IF_ERROR(optimizer_->WriteState(i, StateKind::kExpAvg, zeros.data()));
        FERRY_RETURN_IF_ERROR(optimizer_->WriteState(i, StateKind::kExpAvgSq, zeros.data()));
      }
      optimizer_->set_group_step(g, 0);
    }
  }
  return absl::OkStatus();
}

absl::Status EngineImpl::SyncFromModel(const std::vector<std::string>& groups, bool reset_optimizer) {
  FERRY_RETURN_IF_ERROR(RequireFinalized("SyncFromModel"));
  FERRY_ASSIGN_OR_RETURN(std::vector<size_t> idx, GroupIndices(groups));
  return optimizer_->SyncFromModel(idx, reset_optimizer);
}

absl::Status EngineImpl::MoveTo(const ferry::Placement& placement) {
  bool changed = false;
  for (size_t g = 0; g < group_names_.size(); ++g) {
    changed = changed || (placement.groups.at(group_names_[g]) == PlaceKind::kCpu) != offloaded_[g];
  }
  if (changed) {
    // Build the new placement beside the old one, copy every group's state and step count across
    // exactly, then swap: on any error the old optimizer stays in force. A save in flight may read
    // the old optimizer's state in place: it finishes first.
    if (ckpt_writer_ != nullptr) ckpt_writer_->WaitIdle();
    FERRY_RETURN_IF_ERROR(optimizer_->Synchronize());
    std::vector<bool> offloaded;
    FERRY_ASSIGN_OR_RETURN(std::unique_ptr<HybridOptimizer> moved, BuildOptimizer(placement, &offloaded));
    std::vector<float> buf;
    for (size_t i = 0; i < params_.size(); ++i) {
      buf.resize(static_cast<size_t>(params_[i].numel));
      for (const auto& [kind, kind_name] : kStateKinds) {
        FERRY_RETURN_IF_ERROR(optimizer_->ReadState(i, kind, buf.data()));
        FERRY_RETURN_IF_ERROR(moved->WriteState(i, kind, buf.data()));
      }
    }
    for (size_t g = 0; g < group_names_.size(); ++g) moved->set_group_step(g, optimizer_->group_step(g));
    optimizer_ = std::move(moved);
    offloaded_ = std::move(offloaded);
  }
  return absl::OkStatus();
}

absl::Status EngineImpl::ReloadPolicy(const std::string& path, const std::map<std::string, std::string>& args) {
  FERRY_RETURN_IF_ERROR(RequireFinalized("ReloadPolicy"));
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Policy> policy, Policy::LoadFile(path));
  FERRY_ASSIGN_OR_RETURN(PolicyContext ctx, Context());
  ctx.args = args;
  FERRY_ASSIGN_OR_RETURN(ferry::Placement placement, policy->Place(GroupInfos(), ctx));
  FERRY_RETURN_IF_ERROR(MoveTo(placement));
  policy_ = std::move(policy);
  options_.policy_args = args;
  return absl::OkStatus();
}

absl::Status EngineImpl::VerifyMasters() {
  FERRY_RETURN_IF_ERROR(RequireFinalized("VerifyMasters"));
  return optimizer_->VerifyMasters();
}

std::vector<GroupPlacement> EngineImpl::Placement() const {
  std::vector<GroupPlacement> out(group_names_.size());
  for (size_t g = 0; g < out.size(); ++g) {
    out[g].group = group_names_[g];
    out[g].offloaded = g < offloaded_.size() && offloaded_[g];
  }
  for (const ParamRecord& p : params_) {
    out[p.group].numel += p.numel;
    out[p.group].num_params += 1;
  }
  return out;
}

EngineStats EngineImpl::Stats() const {
  EngineStats s;
  s.host_registrations = device_->host_registrations();
  s.pinned_host_calls = GetPinnedHostCounters().calls();
  s.skipped_steps = skipped_steps_;
  s.last_step_skipped = last_step_skipped_;
  s.last_grad_norm = last_grad_norm_;
  if (optimizer_ != nullptr) {
    s.step = optimizer_->num_groups() > 0 ? optimizer_->group_step(0) : 0;
    s.pinned_bytes = optimizer_->pinned_bytes();
    s.gpu_state_bytes = optimizer_->gpu_state_bytes();
  }
  s.checkpoint_copied_aside_bytes = ckpt_copied_aside_ + (ckpt_fence_ != nullptr ? ckpt_fence_->copied_bytes() : 0);
  return s;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& options) {
  DeviceOptions dopt;
  dopt.backend = options.device;
  dopt.ordinal = options.device_ordinal;
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Device> device, CreateDevice(dopt));
  std::unique_ptr<Policy> policy;
  if (!options.policy_path.empty()) {
    FERRY_ASSIGN_OR_RETURN(policy, Policy::LoadFile(options.policy_path));
  }
  return std::unique_ptr<Engine>(new EngineImpl(options, std::move(device), std::move(policy)));
}

}  // namespace ferry
