#include "ckpt/checkpoint_commit.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/errors.h"
#include "base/logging.h"
#include "ckpt/checkpoint_root.h"
#include "ckpt/ckpt_io.h"
#include "ckpt/posix_file.h"
#include "ferry/status.h"

namespace ferry {
namespace {

using ckpt_internal::Annotate;

// The checkpoint <root>/<name> has just been renamed into place: fsyncs the root and replaces
// `latest`. If `latest` could not be replaced, renames the checkpoint back and removes it, so the
// root is exactly as it was (and the step can be retried). Only when the final fsync after the
// rename of `latest` fails does the new checkpoint stay (committed and named by `latest`): the
// error says so.
absl::Status AnnounceOrRollBack(const std::string& root, const std::string& name, bool sync) {
  const std::string dir = JoinPath(root, name);
  absl::Status s = sync ? SyncDir(root) : absl::OkStatus();
  bool renamed = false;
  if (s.ok()) {
    s = ReplaceFileAtomically(root, std::string(kCheckpointLatestFileName), absl::StrCat(name, "\n"), sync,
                              &renamed);
  }
  if (s.ok()) return s;
  if (renamed) {
    return Annotate(s, absl::StrCat(" (checkpoint ", dir,
                                    " is committed and `latest` names it, but its durability "
                                    "could not be confirmed)"));
  }
  const std::string tmp_dir = absl::StrCat(dir, kCheckpointIncompleteSuffix);
  absl::Status undo = Rename(dir, tmp_dir);
  if (undo.ok()) undo = RemoveLockedDir(tmp_dir);  // the save still holds its lock
  if (undo.ok() && sync) undo = SyncDir(root);
  if (!undo.ok()) {
    return Annotate(s, absl::StrCat("; rolling back ", dir, " also failed: ", undo.message()));
  }
  return s;
}

// Deletes a committed checkpoint: locked (so no collector takes it while it is deleted), then
// renamed (atomic), so a crash halfway through deleting leaves a *.deleting directory that no reader
// takes for a checkpoint and whose free lock tells the next collector it is garbage.
absl::Status DeleteCheckpoint(const std::string& root, const std::string& name, bool sync) {
  const std::string dir = JoinPath(root, name);
  const std::string doomed = absl::StrCat(dir, kCheckpointDeletingSuffix);
  FERRY_ASSIGN_OR_RETURN(bool stale, PathExists(doomed));
  // Where the file system has no flock() (Unimplemented) the deletion goes on unlocked.
  if (stale) {  // a crashed deletion of the same name, not collected (in use, or its removal failed)
    absl::StatusOr<SaveLock> stale_lock = SaveLock::LockDir(doomed, /*wait=*/false);
    if (!stale_lock.ok() && !absl::IsUnimplemented(stale_lock.status())) return stale_lock.status();
    FERRY_RETURN_IF_ERROR(RemoveLockedDir(doomed));
  }
  absl::StatusOr<SaveLock> lock = SaveLock::LockDir(dir, /*wait=*/true);
  if (!lock.ok() && !absl::IsUnimplemented(lock.status())) return lock.status();
  FERRY_RETURN_IF_ERROR(Rename(dir, doomed));
  if (sync) FERRY_RETURN_IF_ERROR(SyncDir(root));
  return RemoveLockedDir(doomed);
}

// keep_last: keeps `new_step` and the keep_last - 1 newest checkpoints with a smaller step; deletes
// the others with a smaller step, oldest first. Larger steps are not touched.
absl::Status ApplyRetention(const std::string& root, int64_t new_step, int keep_last, bool sync) {
  FERRY_ASSIGN_OR_RETURN(auto steps, CommittedSteps(root));
  std::vector<std::string> older;
  for (auto& [step, name] : steps) {
    if (step < new_step) older.push_back(name);
  }
  const size_t keep_older = static_cast<size_t>(keep_last) - 1;
  if (older.size() <= keep_older) return absl::OkStatus();
  const size_t to_delete = older.size() - keep_older;
  for (size_t i = 0; i < to_delete; ++i) {
    FERRY_RETURN_IF_ERROR(DeleteCheckpoint(root, older[i], sync));
  }
  return absl::OkStatus();
}

// manifest.json of a save: `skeleton` with every rank's chunks, checked to tile every tensor.
absl::StatusOr<std::string> AssembleManifest(const Manifest& skeleton, absl::Span<const RankChunks> ranks) {
  const int world_size = skeleton.world_size;
  if (world_size < 1 || ranks.size() != static_cast<size_t>(world_size)) {
    return absl::InvalidArgumentError(absl::StrCat("CommitCheckpoint: ", ranks.size(),
                                                   " ranks reported, world size ", world_size));
  }
  Manifest m = skeleton;
  std::vector<bool> seen(static_cast<size_t>(world_size), false);
  for (const RankChunks& r : ranks) {
    if (r.rank < 0 || r.rank >= world_size || seen[static_cast<size_t>(r.rank)]) {
      return absl::InvalidArgumentError(
          absl::StrCat("CommitCheckpoint: rank ", r.rank, " is out of range or reported twice"));
    }
    seen[static_cast<size_t>(r.rank)] = true;
    for (const auto& [tensor, chunk] : r.chunks) {
      if (tensor >= m.tensors.size()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "CommitCheckpoint: rank ", r.rank, " reports a chunk of tensor index ", tensor));
      }
      m.tensors[tensor].chunks.push_back(chunk);
    }
  }
  for (ManifestTensor& t : m.tensors) {
    std::sort(t.chunks.begin(), t.chunks.end(),
              [](const ManifestChunk& a, const ManifestChunk& b) {
                return a.global_offset < b.global_offset;
              });
    uint64_t covered = 0;
    for (const ManifestChunk& c : t.chunks) {
      if (c.global_offset != covered) break;
      covered += c.length;
    }
    if (t.chunks.empty() || covered != t.bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("CommitCheckpoint: the ranks' chunks of tensor '", t.name,
                       "' do not tile its ", t.bytes, " bytes"));
    }
  }
  return SerializeManifest(m);
}

}  // namespace

absl::StatusOr<PendingCheckpoint> PendingCheckpoint::Begin(const std::string& root, int64_t step,
                                                           const CheckpointWriteOptions& options) {
  FERRY_RETURN_IF_ERROR(ValidateWriteRequest(root, step, {}, {}, options, /*local_data=*/false));
  const std::string final_dir = JoinPath(root, CheckpointDirName(step));
  FERRY_RETURN_IF_ERROR(MakeDirs(root, options.fsync));
  FERRY_ASSIGN_OR_RETURN(bool exists, PathExists(final_dir));
  if (exists) {
    return absl::AlreadyExistsError(
        absl::StrCat("checkpoint ", final_dir, " already exists; checkpoints are never overwritten"));
  }
  // Before the new directory exists: the leftovers of crashed saves (of this step too).
  CollectStaleCheckpoints(root, options.fsync);
  PendingCheckpoint pending;
  pending.root_ = root;
  pending.step_ = step;
  pending.dir_ = IncompleteDirPath(root, step);
  absl::StatusOr<SaveLock> lock = SaveLock::CreateDir(pending.dir_);
  if (absl::IsAlreadyExists(lock.status())) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint ", final_dir, ": ", pending.dir_,
                     " is held by another save in flight (a live process writes it), or could not be removed"));
  }
  FERRY_RETURN_IF_ERROR(lock.status());
  pending.lock_ = *std::move(lock);
  pending.open_ = true;
  return pending;
}

PendingCheckpoint::PendingCheckpoint(PendingCheckpoint&& other) noexcept
    : root_(std::move(other.root_)),
      step_(other.step_),
      dir_(std::move(other.dir_)),
      lock_(std::move(other.lock_)),
      open_(std::exchange(other.open_, false)) {}

PendingCheckpoint& PendingCheckpoint::operator=(PendingCheckpoint&& other) noexcept {
  if (this != &other) {
    if (open_) {
      absl::Status s = Abort();
      if (!s.ok()) FERRY_LOG(WARNING) << "aborting checkpoint " << dir_ << ": " << s;
    }
    root_ = std::move(other.root_);
    step_ = other.step_;
    dir_ = std::move(other.dir_);
    lock_ = std::move(other.lock_);
    open_ = std::exchange(other.open_, false);
  }
  return *this;
}

PendingCheckpoint::~PendingCheckpoint() {
  if (!open_) return;
  absl::Status s = Abort();
  if (!s.ok()) FERRY_LOG(WARNING) << "aborting checkpoint " << dir_ << ": " << s;
}

absl::Status PendingCheckpoint::Abort(const absl::Status& failure) {
  if (!open_) return failure;
  open_ = false;
  absl::StatusOr<bool> exists = PathExists(dir_);
  absl::Status s = exists.status();
  if (s.ok() && *exists) s = RemoveLockedDir(dir_);
  if (s.ok() && exists.ok() && *exists && failure.ok()) {
    FERRY_LOG(INFO) << "checkpoint " << dir_ << " aborted: nothing committed";
  }
  lock_.Release();
  if (!s.ok()) {
    return failure.ok() ? s : Annotate(failure, absl::StrCat("; removing ", dir_, " also failed: ", s.message()));
  }
  return failure;
}

absl::StatusOr<std::string> PendingCheckpoint::Commit(const Manifest& skeleton, absl::Span<const RankChunks> ranks,
                                                      const CheckpointWriteOptions& options) {
  if (!open_) return absl::FailedPreconditionError(absl::StrCat("checkpoint ", dir_, " is no longer pending"));
  const std::string name = CheckpointDirName(step_);
  const std::string final_dir = JoinPath(root_, name);
  TraceSpan commit_span(options.tracer, "ckpt.commit", "ckpt");
  commit_span.Detail(name);
  // The manifest from every rank's chunks; nothing on disk changes until it is complete.
  absl::StatusOr<std::string> text = AssembleManifest(skeleton, ranks);
  absl::Status s = text.status();
  if (s.ok()) {
    absl::StatusOr<WritableFile> file = WritableFile::Create(JoinPath(dir_, kManifestFileName));
    s = file.status();
    if (s.ok()) s = file->Append(text->data(), text->size());
    if (s.ok() && options.fsync) s = file->Sync();
    if (s.ok()) s = file->Close();
  }
  if (s.ok() && options.fsync) s = SyncDir(dir_);
  if (s.ok()) s = RenameNoReplace(dir_, final_dir);
  if (!s.ok()) return Abort(s);
  open_ = false;  // renamed: from here on AnnounceOrRollBack owns the directory
  absl::Status announced = AnnounceOrRollBack(root_, name, options.fsync);
  // The lock file goes once the checkpoint is committed or rolled back (a crash before leaves an
  // empty file inside a checkpoint, which nothing reads); the lock is released with it.
  const std::string lock_path = JoinPath(final_dir, kSaveLockFileName);
  if (::unlink(lock_path.c_str()) != 0 && errno != ENOENT && errno != ENOTDIR) {
    FERRY_LOG(WARNING) << "checkpoint " << final_dir << " committed, but removing " << lock_path
                       << " failed: " << PosixError("unlink", errno);
  }
  lock_.Release();
  FERRY_RETURN_IF_ERROR(announced);
  if (options.keep_last > 0) {
    absl::Status r = ApplyRetention(root_, step_, options.keep_last, options.fsync);
    if (!r.ok()) {
      FERRY_LOG(WARNING) << "checkpoint " << final_dir << " committed, but deleting older checkpoints (keep_last "
                         << options.keep_last << ") failed: " << r;
    }
  }
  return final_dir;
}

}  // namespace ferry
