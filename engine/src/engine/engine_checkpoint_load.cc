// Engine: loading checkpoints (LoadCheckpoint: the fallback to an older checkpoint that verifies,
// rank 0 choosing the directory every rank reads, the agreement on the outcome, the local read).
#include "engine/engine_impl.h"

namespace ferry {
namespace engine_internal {

absl::Status EngineImpl::LoadCheckpoint(const std::string& path, const LoadOptions& options) {
  FERRY_RETURN_IF_ERROR(RequireBetweenSteps("LoadCheckpoint"));
  if (ckpt_writer_ != nullptr) ckpt_writer_->WaitIdle();  // a save in flight may be the one to load
  TraceSpan load_span(tracer_.get(), "ckpt.load", "engine");
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
  LoadPhase phase = LoadPhase::kReading;
  if (!multi_rank()) return LoadCheckpointLocal(path, &phase);
  const std::string what = absl::StrCat("LoadCheckpoint(", path, ")");
  // Rank 0 resolves `latest` once, so every rank reads the same checkpoint even if a save moves it.
  std::string dir;
  absl::Status opened;
  if (rank() == 0) {
    absl::StatusOr<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::Open(path);
    opened = reader.status();
    if (reader.ok()) dir = (*reader)->dir();
  }
  FERRY_RETURN_IF_ERROR(Agree(opened, what));
  FERRY_RETURN_IF_ERROR(BroadcastFromRankZero(&dir, "LoadCheckpoint: rank 0's checkpoint directory"));
  absl::Status s = LoadCheckpointLocal(dir, &phase);
  switch (phase) {
    case LoadPhase::kReading:  // failed before the agreement the others are waiting in
    case LoadPhase::kApplied:  // every rank's outcome of the apply
      return Agree(s, what);
    case LoadPhase::kRefused:  // the agreement failed: every rank returns it
      return s;
  }
  return s;
}

absl::Status EngineImpl::LoadCheckpointLocal(const std::string& path, LoadPhase* phase) {
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader, CheckpointReader::Open(path));
  const std::string& dir = reader->dir();
  // Phase 1: check and read everything (this rank's ranges) into host memory; nothing in the engine
  // changes yet. Several ranks: nothing is applied unless every rank read and verified its part.
  std::set<std::string> known;
  for (const ParamRecord& p : params_) {
    known.insert(p.spec.name);
    for (const auto& [kind, kind_name] : kStateKinds) known.insert(StateTensorName(p.spec.name, kind_name));
  }
  for (const TensorEntry& t : reader->tensors()) {
    if (!known.contains(t.name)) {
      return absl::InvalidArgumentError(absl::StrCat(dir, ": tensor '", t.name,
                                                     "' matches no registered param; was it saved from another model? (see "
                                                     "engine/TROUBLESHOOTING.md#a-refused-checkpoint-load)"));
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
    DType state_dtype[3] = {DType::kF32, DType::kF32, DType::kF32};  // as the checkpoint stores it
  };
  // Groups and kinds whose state the checkpoint stores in another dtype than this engine: converted
  // (explicitly, by Restore) and reported.
  std::map<std::pair<size_t, int>, std::pair<DType, DType>> conversions;
  // Checkpoints store the master of an fp32 param only as the param itself (see SaveCheckpoint).
  bool masters_aliased = false;
  for (const SkipRecord& r : reader->skipped()) masters_aliased = masters_aliased || r.what == "master of f32 params";
  std::vector<Loaded> loaded(params_.size());
  std::vector<bool> group_loaded(group_names_.size(), false);
  std::vector<bool> group_masters(group_names_.size(), true), group_optimizer(group_names_.size(), true);
  struct ReadJob {
    std::string name;
    size_t at;
    uint64_t offset;  // this rank's range of the tensor, in bytes
    size_t bytes;
  };
  std::vector<ReadJob> jobs;
  size_t staged_bytes = 0;
  auto place = [&](const std::string& name, uint64_t offset, size_t bytes) {
    const size_t at = staged_bytes;
    if (bytes > 0) jobs.push_back(ReadJob{name, at, offset, bytes});
    staged_bytes += (bytes + 63) / 64 * 64;
    return at;
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
          "] but the registered param is ", ToAbsl(DTypeName(p.spec.dtype)), "[", absl::StrJoin(p.spec.shape, ","),
          "] (see engine/TROUBLESHOOTING.md#a-refused-checkpoint-load)"));
    }
    Loaded& l = loaded[i];
    const uint64_t pes = DTypeSize(p.spec.dtype);
    l.param_at = place(p.spec.name, static_cast<uint64_t>(p.spec.shard_begin) * pes, static_cast<size_t>(p.numel) * pes);
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
      if ((s->dtype != DType::kF32 && s->dtype != DType::kBF16) || s->shape != p.spec.shape) {
        return absl::InvalidArgumentError(absl::StrCat(dir, ": tensor '", name, "' is ", ToAbsl(DTypeName(s->dtype)), "[",
                                                       absl::StrJoin(s->shape, ","), "]; expected f32 or bf16[",
                                                       absl::StrJoin(p.spec.shape, ","), "]"));
      }
      const uint64_t ses = DTypeSize(s->dtype);
      l.state_at[k] = place(name, static_cast<uint64_t>(p.spec.shard_begin) * ses, static_cast<size_t>(p.numel) * ses);
      l.state_dtype[k] = s->dtype;
      l.has_state[k] = true;
      const StateFormat& mine = optimizer_->group_state(p.group);
      const DType engine_dtype = kStateKinds[k].first == StateKind::kMaster ? mine.master : mine.moments;
      if (s->dtype != engine_dtype) conversions[{p.group, k}] = {s->dtype, engine_dtype};
    }
  }
  FERRY_ASSIGN_OR_RETURN(char* staging, EnsureStaging(staged_bytes));
  {
    std::vector<TensorRead> reads;
    reads.reserve(jobs.size());
    for (const ReadJob& j : jobs) reads.push_back(TensorRead{j.name, staging + j.at, j.bytes, j.offset, /*partial=*/true});
    BulkReadOptions read_options;
    read_options.pool = pool_.get();
    read_options.tracer = tracer_.get();
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
  // The optimizer settings the checkpoint records per group (none before that format) against this
  // engine's: reported, never applied (the trainer's settings hold).
  LoadReport report{.dir = dir};
  for (size_t g = 0; g < group_names_.size(); ++g) {
    auto it = reader->metadata().find(absl::StrCat("ferry.group.", group_names_[g], ".optimizer"));
    if (!group_loaded[g] || it == reader->metadata().end()) continue;
    const std::string mine = FormatGroupSettings(ResolvedGroupOptions(g), options_.optimizer.bias_correction);
    for (const auto& [field, saved, now] : DiffGroupSettings(it->second, mine)) {
      report.optimizer_differences.push_back(
          absl::StrCat("group '", group_names_[g], "': ", field, " ", saved, " in the checkpoint, ", now, " in this engine"));
    }
  }
  for (const auto& [where, dtypes] : conversions) {
    report.state_conversions.push_back(absl::StrCat("group '", group_names_[where.first], "': ", kStateKinds[where.second].second,
                                                    " ", ToAbsl(StateDTypeName(dtypes.first)), " in the checkpoint, ",
                                                    ToAbsl(StateDTypeName(dtypes.second)), " in this engine: converted"));
  }
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

  if (multi_rank()) {
    *phase = LoadPhase::kRefused;
    FERRY_RETURN_IF_ERROR(Agree(absl::OkStatus(), absl::StrCat("LoadCheckpoint(", dir, ")")));
  }
  *phase = LoadPhase::kApplied;

  // Phase 2: apply, in one pass.
  std::vector<HybridOptimizer::SnapshotItem> restore;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Loaded& l = loaded[i];
    if (!l.has_param || params_[i].opt < 0) continue;
    const size_t opt = static_cast<size_t>(params_[i].opt);
    restore.push_back({.param = opt, .is_param = true, .dst = staging + l.param_at});
    for (int k = 0; k < 3; ++k) {
      if (l.has_state[k]) {
        restore.push_back(
            {.param = opt, .kind = kStateKinds[k].first, .dst = staging + l.state_at[k], .dtype = l.state_dtype[k]});
      }
    }
  }
  FERRY_RETURN_IF_ERROR(ckpt_staging_->Ready());  // registered: the device copies run at the pinned rate
  {
    TraceSpan apply(tracer_.get(), "ckpt.apply", "engine");
    apply.Arg("tensors", static_cast<double>(restore.size()));
    FERRY_RETURN_IF_ERROR(optimizer_->Restore(restore));
  }
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
      for (const ParamRecord& p : params_) {
        if (p.group != g || p.opt < 0) continue;
        std::vector<float> zeros(static_cast<size_t>(p.numel), 0.0f);
        FERRY_RETURN_IF_ERROR(optimizer_->WriteState(static_cast<size_t>(p.opt), StateKind::kExpAvg, zeros.data()));
        FERRY_RETURN_IF_ERROR(optimizer_->WriteState(static_cast<size_t>(p.opt), StateKind::kExpAvgSq, zeros.data()));
      }
      optimizer_->set_group_step(g, 0);
    }
  }
  for (const std::string& d : report.optimizer_differences) {
    FERRY_LOG(WARNING) << "LoadCheckpoint(" << dir << "): the optimizer settings differ: " << d;
  }
  for (const std::string& c : report.state_conversions) {
    FERRY_LOG(WARNING) << "LoadCheckpoint(" << dir << "): the state precision differs: " << c;
  }
  last_load_ = std::move(report);
  return absl::OkStatus();
}

}  // namespace engine_internal
}  // namespace ferry
