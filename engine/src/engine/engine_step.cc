// The engine's step: Step, starting it early (GradsReady, WaitParams), the optimizer inputs of a step,
// and the policy's on_step hook after it. See engine_impl.h.
#include <cmath>

#include "engine/engine_impl.h"

namespace ferry {
namespace engine_internal {

absl::Status EngineImpl::Step(const StepOptions& options, void* stream) {
  FERRY_RETURN_IF_ERROR(RequireFinalized("Step"));
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Stream> trainer, device_->WrapStream(stream));
  const double start = absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch());
  TraceSpan span(tracer_.get(), "step", "engine");
  absl::StatusOr<HybridStepParams> step_params = StepParams(options);
  if (!step_params.ok()) {
    if (!multi_rank() || !options.check_finite) return step_params.status();
    GradStats none{};  // the other ranks wait in the step's all-reduce: they fail too, naming this rank
    return ReduceGradStats(none, step_params.status());
  }
  HybridStepParams params = *std::move(step_params);
  bool reduced = false;
  if (multi_rank()) {
    // One all-reduce makes the found-inf and clipping decisions global (every rank takes the same).
    params.reduce_grad_stats = [this, &reduced](GradStats& stats) {
      reduced = true;
      return ReduceGradStats(stats, absl::OkStatus());
    };
  }
  absl::StatusOr<HybridStepResult> stepped = optimizer_->Step(params, *trainer);
  if (!stepped.ok() && multi_rank() && options.check_finite && !reduced) {
    // This rank failed before the reduction: the others are waiting in it; every rank gets the
    // same error, naming this rank.
    GradStats none{};
    return ReduceGradStats(none, stepped.status());
  }
  FERRY_ASSIGN_OR_RETURN(HybridStepResult result, std::move(stepped));
  last_step_skipped_ = result.skipped;
  last_grad_norm_ = result.grad_norm;
  if (result.skipped) ++skipped_steps_;
  early_kept_ += static_cast<int64_t>(result.early_committed);
  early_recomputed_ += static_cast<int64_t>(result.early_recomputed);
  if (optimizer_->deferred()) ++deferred_steps_;
  if (policy_ == nullptr || !policy_->has_hook("on_step")) return absl::OkStatus();
  return RunOnStep(absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()) - start);
}

absl::Status EngineImpl::GradsReady(const std::vector<std::string>& groups, const StepOptions& options, void* stream) {
  FERRY_RETURN_IF_ERROR(RequireFinalized("GradsReady"));
  if (groups.empty()) return absl::InvalidArgumentError("GradsReady: name at least one group");
  FERRY_ASSIGN_OR_RETURN(std::vector<size_t> idx, GroupIndices(groups));
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Stream> trainer, device_->WrapStream(stream));
  TraceSpan span(tracer_.get(), "grads_ready", "engine");
  span.Arg("groups", static_cast<double>(idx.size()));
  FERRY_ASSIGN_OR_RETURN(HybridStepParams params, StepParams(options));
  absl::Status s = optimizer_->BeginGroups(idx, params, *trainer);
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat("GradsReady: ", s.message()));
  return absl::OkStatus();
}

absl::Status EngineImpl::WaitParams(const std::vector<std::string>& groups, void* stream) {
  FERRY_RETURN_IF_ERROR(RequireFinalized("WaitParams"));
  FERRY_ASSIGN_OR_RETURN(std::vector<size_t> idx, GroupIndices(groups));
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Stream> trainer, device_->WrapStream(stream));
  return optimizer_->WaitParams(idx, *trainer);
}

absl::Status EngineImpl::GradsReadyParams(const std::vector<std::string>& params, const StepOptions& options,
                                          void* stream) {
  FERRY_RETURN_IF_ERROR(RequireFinalized("GradsReadyParams"));
  if (params.empty()) return absl::InvalidArgumentError("GradsReadyParams: name at least one param");
  FERRY_ASSIGN_OR_RETURN(std::vector<size_t> idx, OptimParamIndices("GradsReadyParams", params));
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Stream> trainer, device_->WrapStream(stream));
  TraceSpan span(tracer_.get(), "grads_ready", "engine");
  span.Arg("params", static_cast<double>(idx.size()));
  FERRY_ASSIGN_OR_RETURN(HybridStepParams step, StepParams(options));
  if (idx.empty()) return absl::OkStatus();  // none has elements on this rank
  absl::Status s = optimizer_->BeginParams(idx, step, *trainer);
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat("GradsReadyParams: ", s.message()));
  return absl::OkStatus();
}

absl::Status EngineImpl::WaitParamsOf(const std::vector<std::string>& params, void* stream) {
  FERRY_RETURN_IF_ERROR(RequireFinalized("WaitParamsOf"));
  FERRY_ASSIGN_OR_RETURN(std::vector<size_t> idx, OptimParamIndices("WaitParamsOf", params));
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Stream> trainer, device_->WrapStream(stream));
  return optimizer_->WaitParamsOf(idx, *trainer);
}

absl::StatusOr<std::vector<size_t>> EngineImpl::OptimParamIndices(std::string_view what,
                                                                  const std::vector<std::string>& names) const {
  std::vector<size_t> out;
  out.reserve(names.size());
  for (const std::string& name : names) {
    auto it = param_index_.find(name);
    if (it == param_index_.end()) {
      return absl::NotFoundError(absl::StrCat(ToAbsl(what), ": no param '", name, "' is registered"));
    }
    const int64_t opt = params_[it->second].opt;
    if (opt >= 0) out.push_back(static_cast<size_t>(opt));
  }
  return out;
}

absl::Status EngineImpl::RequireBetweenSteps(std::string_view what) {
  FERRY_RETURN_IF_ERROR(RequireFinalized(what));
  if (!optimizer_->step_in_progress()) return optimizer_->Settle();
  std::vector<std::string> names;
  for (size_t g = 0; g < group_names_.size(); ++g) {
    if (optimizer_->announced(g)) names.push_back(absl::StrCat("'", group_names_[g], "'"));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      ToAbsl(what), " between GradsReady and Step: groups ", absl::StrJoin(names, ", "),
      " were announced for a step that has not run yet; call Step first"));
}

absl::StatusOr<HybridStepParams> EngineImpl::StepParams(const StepOptions& options) const {
  FERRY_ASSIGN_OR_RETURN(std::vector<std::optional<float>> group_lr, GroupLrs(options));
  FERRY_ASSIGN_OR_RETURN(auto group_betas, ByGroup(options.group_betas, "group_betas"));
  FERRY_ASSIGN_OR_RETURN(auto group_weight_decay, ByGroup(options.group_weight_decay, "group_weight_decay"));
  return HybridStepParams{.lr = options.lr.value_or(options_.optimizer.lr), .group_lr = std::move(group_lr),
                          .group_betas = std::move(group_betas), .group_weight_decay = std::move(group_weight_decay),
                          .loss_scale = options.loss_scale, .max_grad_norm = options.max_grad_norm,
                          .check_finite = options.check_finite, .wait_for_params = options.wait_for_params,
                          .discard_early = options.discard_early};
}

template <typename T>
absl::StatusOr<std::vector<std::optional<T>>> EngineImpl::ByGroup(const std::vector<std::pair<std::string, T>>& named,
                                                                  const char* field) const {
  std::vector<std::optional<T>> out;
  if (named.empty()) return out;
  out.resize(group_names_.size());
  for (const auto& [name, value] : named) {
    auto it = group_index_.find(name);
    if (it == group_index_.end()) {
      return absl::InvalidArgumentError(absl::StrCat("Step: ", field, " names no parameter group '", name,
                                                     "' (groups: ", absl::StrJoin(group_names_, ", "), ")"));
    }
    if (out[it->second].has_value()) {
      return absl::InvalidArgumentError(absl::StrCat("Step: ", field, " names group '", name, "' twice"));
    }
    out[it->second] = value;
  }
  return out;  // the values are checked by the optimizer (HybridOptimizer::CheckStepParams)
}

absl::StatusOr<std::vector<std::optional<float>>> EngineImpl::GroupLrs(const StepOptions& options) const {
  FERRY_ASSIGN_OR_RETURN(std::vector<std::optional<float>> out, ByGroup(options.group_lr, "group_lr"));
  for (const auto& [name, lr] : options.group_lr) {
    if (!(std::isfinite(lr) && lr >= 0.0f)) {
      return absl::InvalidArgumentError(absl::StrCat("Step: group_lr of group '", name, "' is ", lr,
                                                     "; it must be >= 0 and finite"));
    }
  }
  return out;
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
  if (s.ok() && !request->empty()) {
    ferry::Placement next = PlacementAfter(stats, *request);
    for (size_t g = 0; g < group_names_.size(); ++g) next.state[group_names_[g]] = optimizer_->group_state(g);  // moves keep it
    next.spare_state = policy_spare_state_;  // and the policy's bound on the spare state
    next.numa = policy_numa_;                // and its NUMA policy
    s = MoveTo(next);
  }
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("the step was applied, but its on_step hook failed and the placement "
                                               "is unchanged: ", s.message()));
  }
  return absl::OkStatus();
}

}  // namespace engine_internal
}  // namespace ferry
