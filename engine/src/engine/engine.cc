// Engine: wires device, memory, transfer, optim, ckpt and policy together behind ferry/engine.h.
// The class is in engine_impl.h; checkpoints are in engine_checkpoint.cc, CPU Adam's workers in
// engine_workers.cc, the options' checks and the groups' settings text in engine_options.cc.
#include "engine/engine_impl.h"

namespace ferry {
namespace engine_internal {

absl::Status EngineImpl::AddGroup(const std::string& group, const GroupOptions& options) {
  const std::string where = absl::StrCat("AddGroup('", group, "')");
  if (optimizer_ != nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(where, ": the engine is finalized; add every group before Finalize()"));
  }
  if (group.empty()) return absl::InvalidArgumentError("AddGroup: the group name is empty");
  if (group_options_.contains(group)) {
    return absl::AlreadyExistsError(absl::StrCat(where, ": this group's options were already given"));
  }
  FERRY_RETURN_IF_ERROR(ValidateGroupOptions(options, where));
  group_options_.emplace(group, options);
  return absl::OkStatus();
}

GroupOptions EngineImpl::ResolvedGroupOptions(size_t g) const {
  const OptimizerOptions& d = options_.optimizer;
  GroupOptions r;
  auto it = group_options_.find(group_names_[g]);
  if (it != group_options_.end()) r = it->second;
  if (!r.lr_scale) r.lr_scale = 1.0f;
  if (!r.weight_decay) r.weight_decay = d.weight_decay;
  if (!r.beta1) r.beta1 = d.beta1;
  if (!r.beta2) r.beta2 = d.beta2;
  if (!r.eps) r.eps = d.eps;
  if (!r.adamw) r.adamw = d.adamw;
  return r;
}

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
  const int64_t end = spec.shard_end < 0 ? numel : spec.shard_end;
  if (spec.shard_begin < 0 || spec.shard_begin > end || end > numel || spec.shard_end < -1) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": shard range [", spec.shard_begin, ", ", spec.shard_end,
                                                   ") is not inside the ", numel, " elements of shape [",
                                                   absl::StrJoin(spec.shape, ", "), "]"));
  }
  if (end > spec.shard_begin) {  // an empty local range needs no memory
    if (spec.param == nullptr) return absl::InvalidArgumentError(absl::StrCat(where, ": param pointer is null"));
    if (spec.grad == nullptr) return absl::InvalidArgumentError(absl::StrCat(where, ": grad pointer is null"));
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
  ParamRecord rec{.spec = spec, .numel = end - spec.shard_begin, .global_numel = numel, .group = it->second};
  rec.spec.group = group;
  rec.spec.shard_end = end;
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
    gi.global_numel += p.global_numel;
    gi.global_bytes += p.global_numel * static_cast<int64_t>(DTypeSize(p.spec.dtype));
    for (const std::string& tag : p.spec.tags) {
      if (std::find(gi.tags.begin(), gi.tags.end(), tag) == gi.tags.end()) gi.tags.push_back(tag);
    }
  }
  return infos;
}

absl::StatusOr<PolicyContext> EngineImpl::Context() {
  PolicyContext ctx;
  ctx.rank = rank();
  ctx.world_size = world_size();
  FERRY_ASSIGN_OR_RETURN(size_t free_bytes, device_->FreeMemory());
  ctx.gpu_free_bytes = static_cast<int64_t>(free_bytes);
  // The process's pinned budget (this rank's share of the host; EngineStats::pinned_limit_bytes): what
  // memory_budget fits the offloaded state and its spare state into. 0: unlimited.
  const size_t pinned_limit = PinnedBudget::Process().limit();
  ctx.pinned_budget_bytes = pinned_limit == PinnedBudget::kUnlimited
                                ? 0
                                : static_cast<int64_t>(std::min<size_t>(pinned_limit, size_t{1} << 62));
  ctx.numa_nodes = NumaNodeCount();
  ctx.args = options_.policy_args;
  return ctx;
}

absl::Status EngineImpl::Finalize() {
  if (optimizer_ != nullptr) return absl::FailedPreconditionError("Finalize: the engine is already finalized");
  if (params_.empty() && !multi_rank()) return absl::FailedPreconditionError("Finalize: no params were added");
  // Several ranks: the same params everywhere, ranges tiling every tensor (same verdict on every rank).
  FERRY_RETURN_IF_ERROR(ExchangeSpecs());
  std::unique_ptr<HybridOptimizer> optimizer;
  std::vector<bool> offloaded;
  std::optional<double> spare_state;
  std::optional<std::string> numa;
  std::unique_ptr<Comm> ckpt_comm;
  ferry::Placement placement;
  absl::Status local = [&]() -> absl::Status {
    for (const auto& [name, unused] : group_options_) {
      if (!group_index_.contains(name)) {
        return absl::InvalidArgumentError(absl::StrCat("Finalize: AddGroup('", name, "') gave options to a group that "
                                                       "no param joined (groups: ", absl::StrJoin(group_names_, ", "), ")"));
      }
    }
    std::vector<GroupInfo> infos = GroupInfos();
    FERRY_ASSIGN_OR_RETURN(PolicyContext ctx, Context());
    if (policy_ != nullptr) {
      FERRY_ASSIGN_OR_RETURN(placement, policy_->Place(infos, ctx));
    } else {
      for (const GroupInfo& g : infos) placement.groups[g.name] = PlaceKind::kGpu;
    }
    return absl::OkStatus();
  }();
  if (local.ok()) HoldThreads(placement);
  FERRY_RETURN_IF_ERROR(TuneSharedWorkers(local, placement));  // collective: every rank, even after a local error
  if (local.ok()) {
    local = [&]() -> absl::Status {
      FERRY_ASSIGN_OR_RETURN(optimizer, BuildOptimizer(placement, &offloaded));
      spare_state = placement.spare_state;
      numa = placement.numa;
      return absl::OkStatus();
    }();
  }
  if (multi_rank()) {
    // Checkpoint exchanges get a communicator of their own, so a background save's exchange never
    // interleaves with the trainer's collectives. Collective, so every rank asks even after a local error.
    absl::StatusOr<std::unique_ptr<Comm>> dup = comm_->Duplicate(options_.collective_timeout);
    if (dup.ok()) {
      ckpt_comm = *std::move(dup);
    } else if (dup.status().code() != absl::StatusCode::kUnimplemented && local.ok()) {
      local = dup.status();
    }
  }
  FERRY_RETURN_IF_ERROR(Agree(local, "Finalize"));
  FERRY_RETURN_IF_ERROR(CheckStatePrecisionAgrees(*optimizer));
  if (multi_rank() && ckpt_comm == nullptr) {
    FERRY_LOG(INFO) << "Finalize: the " << comm_->kind() << " comm cannot be duplicated; asynchronous checkpoint "
                       "saves of this engine run synchronously";
  }
  optimizer_ = std::move(optimizer);
  offloaded_ = std::move(offloaded);
  policy_spare_state_ = spare_state;
  policy_numa_ = std::move(numa);
  ckpt_comm_ = std::move(ckpt_comm);
  return absl::OkStatus();
}

double EngineImpl::SpareFraction(const ferry::Placement& placement) const {
  const double option = options_.spare_state_fraction;
  if (!(option >= 0.0 && option <= 1.0) || !placement.spare_state.has_value()) return option;
  return std::min(option, *placement.spare_state);
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
  hopt.chunk_bytes = workers_.chunk_bytes;
  hopt.spare_fraction = SpareFraction(placement);
  FERRY_ASSIGN_OR_RETURN(hopt.state_later, StateLater::Resolve(options_.state_later));
  hopt.tracer = tracer_.get();
  std::string numa = placement.numa.value_or(options_.numa);
  std::string numa_policy = numa;
  if (!numa.empty()) {
    absl::StatusOr<NumaPolicy> np = ParseNumaPolicy(numa);
    if (!np.ok()) return absl::InvalidArgumentError(absl::StrCat("NUMA policy: ", np.status().message()));
    hopt.numa = *np;
  } else if (NumaNodeCount() > 1 && device_->numa_node() >= 0) {
    // Several nodes and nothing asked: the state's pages on the node of the GPU its copies cross to
    // (while it has memory), as are this rank's workers (host_share.h).
    hopt.numa = NumaPolicy::kPreferred;
    hopt.numa_node = device_->numa_node();
    numa_policy = "preferred";
  }
  numa_node_ = hopt.numa == NumaPolicy::kBind || hopt.numa == NumaPolicy::kPreferred ? hopt.numa_node : -1;
  numa_policy_ = numa_policy;
  std::vector<OptimGroup> groups(group_names_.size());
  std::vector<bool> offloaded(group_names_.size(), false);
  for (size_t g = 0; g < groups.size(); ++g) {
    auto it = placement.groups.find(group_names_[g]);
    if (it == placement.groups.end()) {
      return absl::InternalError(absl::StrCat("the policy placed no group '", group_names_[g], "'"));
    }
    groups[g].name = group_names_[g];
    groups[g].offloaded = offloaded[g] = it->second == PlaceKind::kCpu;
    auto state = placement.state.find(group_names_[g]);
    if (state != placement.state.end()) groups[g].state = state->second;
    const GroupOptions go = ResolvedGroupOptions(g);
    AdamHyper h = hopt.hyper;
    h.beta1 = *go.beta1;
    h.beta2 = *go.beta2;
    h.eps = *go.eps;
    h.weight_decay = *go.weight_decay;
    h.mode = *go.adamw ? AdamMode::kAdamW : AdamMode::kAdamL2;
    groups[g].hyper = h;
    groups[g].lr_scale = *go.lr_scale;
  }
  // Params whose local range is empty have no state on this rank (opt stays -1).
  std::vector<OptimParam> params;
  params.reserve(params_.size());
  for (ParamRecord& p : params_) {
    p.opt = -1;
    if (p.numel == 0) continue;
    p.opt = static_cast<int64_t>(params.size());
    params.push_back(OptimParam{p.spec.name, p.group, p.numel, p.spec.dtype, p.spec.grad_dtype.value_or(p.spec.dtype),
                                p.spec.param, p.spec.grad, p.spec.shard_begin});
  }
  if (optimizer_ == nullptr && std::find(offloaded.begin(), offloaded.end(), true) != offloaded.end()) {
    TuneWorkers();
  }
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<HybridOptimizer> optimizer,
                         HybridOptimizer::Create(device_.get(), pool_.get(), std::move(params), std::move(groups), hopt));
  *offloaded_out = std::move(offloaded);
  return optimizer;
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

absl::Status EngineImpl::SyncFromModel(const std::vector<std::string>& groups, bool reset_optimizer) {
  FERRY_RETURN_IF_ERROR(RequireBetweenSteps("SyncFromModel"));
  FERRY_ASSIGN_OR_RETURN(std::vector<size_t> idx, GroupIndices(groups));
  return optimizer_->SyncFromModel(idx, reset_optimizer);
}

absl::Status EngineImpl::MoveTo(const ferry::Placement& placement) {
  bool changed = false;
  for (size_t g = 0; g < group_names_.size(); ++g) {
    changed = changed || (placement.groups.at(group_names_[g]) == PlaceKind::kCpu) != offloaded_[g];
    auto state = placement.state.find(group_names_[g]);
    changed = changed || (state == placement.state.end() ? StateFormat{} : state->second) != optimizer_->group_state(g);
  }
  if (changed) {
    // Build the new placement beside the old one, copy every group's state and step count across
    // exactly, then swap: on any error the old optimizer stays in force. A save in flight may read
    // the old optimizer's state in place: it finishes first. A group whose state precision changes
    // is converted on the way (through fp32: exact from bf16, rounded to nearest even into bf16).
    if (ckpt_writer_ != nullptr) ckpt_writer_->WaitIdle();
    FERRY_RETURN_IF_ERROR(optimizer_->Synchronize());
    std::vector<bool> offloaded;
    FERRY_ASSIGN_OR_RETURN(std::unique_ptr<HybridOptimizer> moved, BuildOptimizer(placement, &offloaded));
    std::vector<float> buf;
    for (const ParamRecord& p : params_) {
      if (p.opt < 0) continue;
      const size_t i = static_cast<size_t>(p.opt);
      buf.resize(static_cast<size_t>(p.numel));
      for (const auto& [kind, kind_name] : kStateKinds) {
        FERRY_RETURN_IF_ERROR(optimizer_->ReadState(i, kind, buf.data()));
        FERRY_RETURN_IF_ERROR(moved->WriteState(i, kind, buf.data()));
      }
    }
    for (size_t g = 0; g < group_names_.size(); ++g) moved->set_group_step(g, optimizer_->group_step(g));
    optimizer_ = std::move(moved);
    offloaded_ = std::move(offloaded);
  } else {
    // Same placement: the optimizer stays, and with it a spare state already allocated; a new bound
    // sizes one allocated later (EngineOptions::spare_state_fraction).
    optimizer_->set_spare_fraction(SpareFraction(placement));
  }
  return absl::OkStatus();
}

absl::Status EngineImpl::ReloadPolicy(const std::string& path, const std::map<std::string, std::string>& args) {
  FERRY_RETURN_IF_ERROR(RequireBetweenSteps("ReloadPolicy"));
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Policy> policy, Policy::LoadFile(path));
  FERRY_ASSIGN_OR_RETURN(PolicyContext ctx, Context());
  ctx.args = args;
  FERRY_ASSIGN_OR_RETURN(ferry::Placement placement, policy->Place(GroupInfos(), ctx));
  FERRY_RETURN_IF_ERROR(MoveTo(placement));
  policy_ = std::move(policy);
  options_.policy_args = args;
  policy_spare_state_ = placement.spare_state;
  policy_numa_ = placement.numa;
  return absl::OkStatus();
}

absl::Status EngineImpl::VerifyMasters() {
  FERRY_RETURN_IF_ERROR(RequireBetweenSteps("VerifyMasters"));
  return optimizer_->VerifyMasters();
}

absl::StatusOr<std::pair<int64_t, StateKind>> EngineImpl::StateOf(const std::string& param, std::string_view kind) const {
  FERRY_RETURN_IF_ERROR(RequireFinalized("ReadState/WriteState"));
  auto it = param_index_.find(param);
  if (it == param_index_.end()) return absl::InvalidArgumentError(absl::StrCat("no param '", param, "'"));
  for (const auto& [k, name] : kStateKinds) {
    if (kind == name) return std::make_pair(params_[it->second].opt, k);
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown state kind '", ToAbsl(kind), "' of param '", param,
                                                 "' (known: master, exp_avg, exp_avg_sq)"));
}

absl::Status EngineImpl::ReadState(const std::string& param, std::string_view kind, float* host) {
  FERRY_ASSIGN_OR_RETURN(auto state, StateOf(param, kind));
  if (state.first < 0) return absl::OkStatus();
  return optimizer_->ReadState(static_cast<size_t>(state.first), state.second, host);
}

absl::Status EngineImpl::WriteState(const std::string& param, std::string_view kind, const float* host) {
  FERRY_RETURN_IF_ERROR(RequireBetweenSteps("WriteState"));
  FERRY_ASSIGN_OR_RETURN(auto state, StateOf(param, kind));
  if (state.first < 0) return absl::OkStatus();
  return optimizer_->WriteState(static_cast<size_t>(state.first), state.second, host);
}

absl::StatusOr<int64_t> EngineImpl::GroupStep(const std::string& group) const {
  FERRY_RETURN_IF_ERROR(RequireFinalized("GroupStep"));
  FERRY_ASSIGN_OR_RETURN(std::vector<size_t> idx, GroupIndices({group}));
  return optimizer_->group_step(idx[0]);
}

absl::Status EngineImpl::SetGroupStep(const std::string& group, int64_t step) {
  FERRY_RETURN_IF_ERROR(RequireBetweenSteps("SetGroupStep"));
  FERRY_ASSIGN_OR_RETURN(std::vector<size_t> idx, GroupIndices({group}));
  if (step < 0) {
    return absl::InvalidArgumentError(absl::StrCat("SetGroupStep('", group, "', ", step, "): the step must be >= 0"));
  }
  // The step is read when a Step enqueues its work: no work in flight needs it.
  optimizer_->set_group_step(idx[0], step);
  return absl::OkStatus();
}

std::vector<GroupPlacement> EngineImpl::Placement() const {
  std::vector<GroupPlacement> out(group_names_.size());
  for (size_t g = 0; g < out.size(); ++g) {
    out[g].group = group_names_[g];
    out[g].offloaded = g < offloaded_.size() && offloaded_[g];
    out[g].options = ResolvedGroupOptions(g);
    if (optimizer_ != nullptr) {
      const StateFormat& f = optimizer_->group_state(g);
      out[g].master_dtype = f.master;
      out[g].moments_dtype = f.moments;
      out[g].stochastic_rounding = f.stochastic();
      const int64_t bytes = static_cast<int64_t>(optimizer_->group_state_bytes(g));
      (out[g].offloaded ? out[g].host_state_bytes : out[g].device_state_bytes) = bytes;
    }
  }
  for (const ParamRecord& p : params_) {
    out[p.group].numel += p.numel;
    out[p.group].num_params += 1;
    out[p.group].global_numel += p.global_numel;
  }
  return out;
}

EngineStats EngineImpl::Stats() const {
  EngineStats s;
  s.local_rank = workers_.local.local_rank;
  s.local_world_size = workers_.local.local_world_size;
  s.transfer_chunk_bytes = workers_.chunk_bytes;
  s.cpu_threads = pool_->num_threads();
  s.cpu_list = FormatCpuList(pool_->cpus());
  s.host_share = workers_.share.reason;
  if (!workers_.knee.empty()) absl::StrAppend(&s.host_share, "; ", workers_.knee);
  s.numa_node = numa_node_;
  s.numa_policy = numa_policy_;
  s.pinned_limit_bytes = PinnedBudget::Process().limit();
  s.host_registrations = device_->host_registrations();
  s.pinned_host_calls = GetPinnedHostCounters().calls();
  s.skipped_steps = skipped_steps_;
  s.early_groups_kept = early_kept_;
  s.early_groups_recomputed = early_recomputed_;
  s.deferred_steps = deferred_steps_;
  s.last_step_skipped = last_step_skipped_;
  s.last_grad_norm = last_grad_norm_;
  if (optimizer_ != nullptr) {
    s.step = optimizer_->num_groups() > 0 ? optimizer_->group_step(0) : 0;
    s.pinned_bytes = optimizer_->pinned_bytes();
    s.pinned_huge_bytes = optimizer_->pinned_huge_bytes();
    s.gpu_state_bytes = optimizer_->gpu_state_bytes();
    s.spare_state_bytes = optimizer_->spare_bytes();
    s.cpu_adam_busy_seconds = optimizer_->cpu_adam_busy_seconds();
    s.cpu_adam_bytes = optimizer_->cpu_adam_bytes();
    s.cpu_adam_spare_bytes = optimizer_->cpu_adam_spare_bytes();
    s.cpu_adam_later_bytes = optimizer_->cpu_adam_later_bytes();
    s.state_later_kept_bytes = optimizer_->state_later_kept_bytes();
    s.state_later_limit_bytes = optimizer_->state_later_limit_bytes();
  }
  s.checkpoint_copied_aside_bytes = ckpt_copied_aside_ + (ckpt_fence_ != nullptr ? ckpt_fence_->copied_bytes() : 0);
  return s;
}

}  // namespace engine_internal

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& options) {
  FERRY_RETURN_IF_ERROR(engine_internal::ValidateEngineOptions(options));
  DeviceOptions dopt;
  dopt.backend = options.device;
  dopt.ordinal = options.device_ordinal;
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Device> device, CreateDevice(dopt));
  std::unique_ptr<Policy> policy;
  if (!options.policy_path.empty()) {
    FERRY_ASSIGN_OR_RETURN(policy, Policy::LoadFile(options.policy_path));
  }
  engine_internal::WorkerPlan workers = engine_internal::PlanWorkers(options, *device);
  // The default pinned budget is the host's: each local rank takes its share of it (a limit someone
  // set stays as it is).
  PinnedBudget& budget = PinnedBudget::Process();
  if (workers.local.local_world_size > 1 && budget.limit() == PinnedBudget::DefaultProcessLimit()) {
    budget.set_limit(PinnedBudget::DefaultProcessLimit() / static_cast<size_t>(workers.local.local_world_size));
  }
  return std::unique_ptr<Engine>(
      new engine_internal::EngineImpl(options, std::move(device), std::move(policy), std::move(workers)));
}

}  // namespace ferry
