// Engine: checkpoints (SaveCheckpoint, LoadCheckpoint and the pinned staging they share).
#include "engine/engine_impl.h"

namespace ferry {
namespace engine_internal {

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

}  // namespace engine_internal
}  // namespace ferry
