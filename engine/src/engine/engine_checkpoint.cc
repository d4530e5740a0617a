// Engine: saving checkpoints (SaveCheckpoint, its metadata and plan, the pinned staging that loads share).
#include "engine/engine_impl.h"

namespace ferry {
namespace engine_internal {

absl::StatusOr<std::string> EngineImpl::SaveCheckpoint(const std::string& root, int64_t step) {
  FERRY_RETURN_IF_ERROR(RequireBetweenSteps("SaveCheckpoint"));
  if (step < 0) return absl::InvalidArgumentError(absl::StrCat("SaveCheckpoint: step must be >= 0, got ", step));
  TraceSpan save_span(tracer_.get(), "ckpt.save", "engine");
  save_span.Arg("step", static_cast<double>(step));
  // The previous asynchronous save must be done before its staging is reused; its error, if any, is
  // delivered here (several ranks: the same error on every rank, as the save agreed on it).
  if (ckpt_writer_ != nullptr) FERRY_RETURN_IF_ERROR(ckpt_writer_->Wait());
  // The policy's plan and the metadata: rank 0's, for every rank (one broadcast).
  absl::StatusOr<CheckpointPlan> planned = CheckpointPlan{};
  std::map<std::string, std::string> metadata;
  if (rank() == 0) {
    CheckpointInfo info;
    info.step = step;
    info.reason = "save";
    info.groups = group_names_;
    for (const ParamRecord& p : params_) {  // the whole checkpoint's bytes, over every rank
      const StateFormat& f = optimizer_->group_state(p.group);
      info.model_bytes += p.global_numel * static_cast<int64_t>(DTypeSize(p.spec.dtype));
      info.master_bytes += p.global_numel * static_cast<int64_t>(DTypeSize(f.master));
      info.optimizer_bytes += p.global_numel * 2 * static_cast<int64_t>(DTypeSize(f.moments));
    }
    for (size_t g = 0; g < group_names_.size(); ++g) {
      if (offloaded_[g]) info.offloaded.push_back(group_names_[g]);
    }
    if (policy_ != nullptr) {
      absl::StatusOr<PolicyContext> ctx = Context();
      planned = ctx.ok() ? policy_->Checkpoint(info, *ctx) : ctx.status();
    }
    metadata = CheckpointMetadata();
  }
  FERRY_RETURN_IF_ERROR(ShareCheckpointPlan(planned, metadata));
  CheckpointPlan plan = *std::move(planned);
  if (multi_rank() && ckpt_comm_ == nullptr) plan.async = false;  // no communicator for a writer thread
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
  // Several ranks: every rank lists the same global tensors (rank 0's param order, global shapes)
  // and writes its own range of each (its pieces); the bytes of a tensor it holds none of are not
  // touched.
  struct Source {
    size_t param;
    int kind;  // -1: the param itself, else an index into kStateKinds
  };
  std::vector<TensorRecord> tensors;
  std::vector<Source> sources;
  for (size_t i : canonical_) {
    const ParamRecord& p = params_[i];
    const std::string& group = group_names_[p.group];
    if (skip_groups.contains(group)) continue;
    tensors.push_back(TensorRecord{p.spec.name, p.spec.dtype, p.spec.shape, nullptr,
                                   static_cast<size_t>(p.global_numel) * DTypeSize(p.spec.dtype), kModelKind, group});
    sources.push_back({i, -1});
    for (int k = 0; k < 3; ++k) {
      const bool is_master = kStateKinds[k].first == StateKind::kMaster;
      if ((is_master && plan.skip_master) || (!is_master && plan.skip_optimizer)) continue;
      // An fp32 param is its master, bit for bit (the param is the master rounded to f32): written once.
      if (is_master && p.spec.dtype == DType::kF32) continue;
      // Each state tensor in the dtype it is stored in (the group's state format; the same on every
      // rank, as the policy places every rank's shards alike).
      const StateFormat& f = optimizer_->group_state(p.group);
      const DType dtype = is_master ? f.master : f.moments;
      tensors.push_back(TensorRecord{StateTensorName(p.spec.name, kStateKinds[k].second), dtype, p.spec.shape,
                                     nullptr, static_cast<size_t>(p.global_numel) * DTypeSize(dtype),
                                     kStateKinds[k].second, group});
      sources.push_back({i, k});
    }
  }
  // Where each tensor's bytes come from: staged (device-resident) or in place (offloaded state).
  // The staging holds the staged tensors and room for a copy of each in-place one, which is used
  // only if the next Step overtakes the writer (copy-on-write, see StateFence).
  auto ckpt = std::make_shared<SaveSources>();
  ckpt->staged.assign(tensors.size(), false);
  ckpt->region.assign(tensors.size(), 0);
  std::vector<size_t> staged_offset(tensors.size(), 0), local_bytes(tensors.size(), 0);
  std::vector<ShardPiece> pieces;
  size_t staged_bytes = 0;
  for (size_t k = 0; k < tensors.size(); ++k) {
    const Source& src = sources[k];
    const ParamRecord& p = params_[src.param];
    const bool in_place = src.kind >= 0 && offloaded_[p.group];
    const uint64_t es = DTypeSize(tensors[k].dtype);
    local_bytes[k] = static_cast<size_t>(p.numel) * es;
    tensors[k].data_begin = static_cast<uint64_t>(p.spec.shard_begin) * es;
    if (local_bytes[k] > 0) pieces.push_back({.tensor = k, .global_offset = tensors[k].data_begin, .length = local_bytes[k]});
    ckpt->staged[k] = !in_place;
    staged_offset[k] = staged_bytes;
    staged_bytes += (local_bytes[k] + 63) / 64 * 64;
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
    const int64_t opt = params_[src.param].opt;
    if (opt < 0) continue;  // this rank holds none of it
    if (!ckpt->staged[k]) {
      const char* state = static_cast<const char*>(
          optimizer_->offloaded_state(static_cast<size_t>(opt), kStateKinds[src.kind].first));
      tensors[k].data = state;
      ckpt->region[k] = regions.size();
      regions.push_back({.param = static_cast<size_t>(opt), .src = state, .copy = staging + staged_offset[k],
                         .bytes = local_bytes[k]});
      continue;
    }
    HybridOptimizer::SnapshotItem item;
    item.param = static_cast<size_t>(opt);
    item.is_param = src.kind < 0;
    if (src.kind >= 0) item.kind = kStateKinds[src.kind].first;
    item.dtype = tensors[k].dtype;  // state: as stored, no conversion
    item.dst = staging + staged_offset[k];
    tensors[k].data = item.dst;
    items.push_back(item);
  }
  CheckpointJob job;
  job.root = root;
  job.step = step;
  job.tensors = std::move(tensors);
  job.skipped = std::move(skipped);
  job.metadata = std::move(metadata);
  job.options.keep_last = plan.keep_last;
  job.options.tracer = tracer_.get();
  if (multi_rank()) {
    job.comm = ckpt_comm_ != nullptr ? ckpt_comm_.get() : comm_.get();
    job.comm_timeout = options_.checkpoint_timeout;
    job.pieces = std::move(pieces);
  }
  HybridOptimizer* optimizer = optimizer_.get();
  auto fence = std::make_shared<StateFence>(std::move(regions), optimizer_->params().size());
  const bool async = plan.async;
  // Tracing: the staging copies (device to pinned host memory) as the host observes them, from
  // their enqueueing to the first time a writer (or the trainer) sees them landed.
  struct StageTrace {
    Tracer* tracer = nullptr;
    int lane = 0;
    int64_t start_ns = 0;
    double bytes = 0.0;
    std::atomic<bool> recorded{false};
    void Landed() {
      if (tracer != nullptr && !recorded.exchange(true)) {
        tracer->Complete("ckpt.stage", "ckpt", start_ns, tracer->NowNs(), {{"bytes", bytes}}, {}, lane);
      }
    }
  };
  auto stage_trace = std::make_shared<StageTrace>();
  if (tracer_ != nullptr && !items.empty()) {
    stage_trace->tracer = tracer_.get();
    stage_trace->lane = tracer_->Lane("ckpt staging copies (observed)");
    for (size_t k = 0; k < local_bytes.size(); ++k) {
      if (ckpt->staged[k]) stage_trace->bytes += static_cast<double>(local_bytes[k]);
    }
    stage_trace->start_ns = tracer_->NowNs();
  }
  job.options.before_write = [ckpt, optimizer, fence, async, stage_trace](size_t tensor) -> absl::StatusOr<const void*> {
    if (ckpt->staged[tensor]) {
      FERRY_RETURN_IF_ERROR(optimizer->WaitSnapshot());
      stage_trace->Landed();
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
    if (landed.ok()) stage_trace->Landed();
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

std::map<std::string, std::string> EngineImpl::CheckpointMetadata() const {
  std::map<std::string, std::string> metadata;
  metadata["ferry.version"] = "1";
  metadata["ferry.world_size"] = absl::StrCat(world_size());
  const OptimizerOptions& o = options_.optimizer;
  metadata["ferry.optimizer"] = absl::StrCat(o.adamw ? "adamw" : "adam_l2", " lr=", o.lr, " beta1=", o.beta1,
                                             " beta2=", o.beta2, " eps=", o.eps, " weight_decay=", o.weight_decay,
                                             " bias_correction=", o.bias_correction ? 1 : 0);
  for (size_t g = 0; g < group_names_.size(); ++g) {
    metadata[absl::StrCat("ferry.group.", group_names_[g], ".step")] = absl::StrCat(optimizer_->group_step(g));
    // Several ranks: rank 0's placement (each rank places its own shards).
    metadata[absl::StrCat("ferry.group.", group_names_[g], ".placement")] = offloaded_[g] ? "cpu" : "gpu";
    metadata[absl::StrCat("ferry.group.", group_names_[g], ".optimizer")] =
        FormatGroupSettings(ResolvedGroupOptions(g), o.bias_correction);
    // The state's precision (informational: each state tensor's dtype is in its own record).
    metadata[absl::StrCat("ferry.group.", group_names_[g], ".state")] = DescribeStateFormat(optimizer_->group_state(g));
  }
  return metadata;
}

absl::Status EngineImpl::ShareCheckpointPlan(absl::StatusOr<CheckpointPlan>& plan,
                                             std::map<std::string, std::string>& metadata) {
  if (!multi_rank()) return plan.status();
  // Field by field: status code and message; then the plan; then the metadata.
  std::string blob;
  auto put = [&blob](std::string_view v) {
    blob += absl::StrCat(v.size(), ":");
    blob.append(v.data(), v.size());
  };
  if (rank() == 0) {
    put(absl::StrCat(static_cast<int>(plan.status().code())));
    put(std::string(plan.status().message()));
    if (plan.ok()) {
      put(absl::StrCat(plan->skip_optimizer ? 1 : 0, " ", plan->skip_master ? 1 : 0, " ", plan->async ? 1 : 0, " ",
                       plan->keep_last, " ", plan->skip_groups.size(), " ", metadata.size()));
      for (const std::string& g : plan->skip_groups) put(g);
      for (const auto& [k, v] : metadata) {
        put(k);
        put(v);
      }
    }
  }
  FERRY_RETURN_IF_ERROR(BroadcastFromRankZero(&blob, "SaveCheckpoint: rank 0's checkpoint plan"));
  if (rank() == 0) return plan.status();
  std::string_view in(blob);
  bool ok = true;
  auto get = [&in, &ok]() -> std::string {
    size_t colon = in.find(':');
    size_t n = 0;
    if (!ok || colon == std::string_view::npos || !absl::SimpleAtoi(absl::string_view(in.data(), colon), &n) || n > in.size() - colon - 1) {
      ok = false;
      return "";
    }
    std::string v(in.substr(colon + 1, n));
    in.remove_prefix(colon + 1 + n);
    return v;
  };
  int code = 0;
  ok = absl::SimpleAtoi(get(), &code);
  std::string message = get();
  if (ok && code != 0) {
    plan = absl::Status(static_cast<absl::StatusCode>(code), absl::StrCat("rank 0: ", message));
    return plan.status();
  }
  CheckpointPlan p;
  std::vector<std::string> head = absl::StrSplit(get(), ' ');
  int flags[6] = {0, 0, 0, 0, 0, 0};
  ok = ok && head.size() == 6;
  for (size_t i = 0; ok && i < 6; ++i) ok = absl::SimpleAtoi(head[i], &flags[i]);
  for (int i = 0; ok && i < flags[4]; ++i) p.skip_groups.push_back(get());
  metadata.clear();
  for (int i = 0; ok && i < flags[5]; ++i) {
    std::string k = get();
    metadata[k] = get();
  }
  if (!ok || !in.empty()) return absl::DataLossError("SaveCheckpoint: rank 0's checkpoint plan arrived malformed");
  p.skip_optimizer = flags[0] != 0;
  p.skip_master = flags[1] != 0;
  p.async = flags[2] != 0;
  p.keep_last = flags[3];
  plan = std::move(p);
  return absl::OkStatus();
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

}  // namespace engine_internal
}  // namespace ferry
