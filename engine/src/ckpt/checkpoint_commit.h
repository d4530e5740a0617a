// The third stage of a save (checkpoint.h), and the directory it commits: a PendingCheckpoint is
// <root>/step-<N>.incomplete/, created and locked by the one process that begins the save (rank 0),
// filled with rank files by every rank (rank_file_writer.h), then committed from every rank's
// chunks: manifest.json written and fsynced, the directory fsynced and renamed to step-<N>, the root
// fsynced, `latest` replaced (tmp + fsync + rename), then old checkpoints beyond keep_last deleted.
// A PendingCheckpoint destroyed uncommitted removes its directory (the abort). Beginning a save
// first collects the leftovers of crashed saves of the root (checkpoint_gc.h).
#ifndef FERRY_CKPT_CHECKPOINT_COMMIT_H_
#define FERRY_CKPT_CHECKPOINT_COMMIT_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "ckpt/checkpoint_gc.h"
#include "ckpt/checkpoint_plan.h"
#include "ckpt/manifest.h"
#include "ckpt/rank_file_writer.h"

namespace ferry {

// One save between its beginning and its commit. Move-only; one thread at a time. Holds the
// directory's SaveLock from Begin until it is committed, aborted or destroyed.
class PendingCheckpoint final {
 public:
  // Checks root, step and options (InvalidArgument as for WriteCheckpoint), creates `root` if
  // missing, removes the root's leftovers of crashed saves (CollectStaleCheckpoints; logged, never
  // fatal), and creates and locks <root>/step-<N>.incomplete/. AlreadyExists if step-<N> is committed
  // already (never overwritten); FailedPrecondition if step-<N>.incomplete is held by a live save.
  static absl::StatusOr<PendingCheckpoint> Begin(const std::string& root, int64_t step,
                                                 const CheckpointWriteOptions& options);

  // The moved-from object is neither committed nor aborted by anyone: it owns nothing.
  PendingCheckpoint(PendingCheckpoint&& other) noexcept;
  PendingCheckpoint& operator=(PendingCheckpoint&& other) noexcept;
  // Aborts (removes the directory) unless committed; a failure is logged.
  ~PendingCheckpoint();

  // The .incomplete directory the rank files go into.
  const std::string& dir() const { return dir_; }

  // Commits with `ranks` (one entry per rank 0..world_size-1 of skeleton.world_size, any order):
  // their chunks complete `skeleton` (from the save's plan) into manifest.json, then the commit
  // runs as described at the top. Returns the committed directory. InvalidArgument if the chunks do
  // not tile every tensor exactly. On error the directory is removed and the root is as it was
  // (exception: if only the fsync of the root after `latest` was renamed fails, the new checkpoint
  // stays committed and the error says so). A failure to delete old checkpoints for keep_last is
  // logged as a warning. REQUIRES: not committed or aborted yet.
  absl::StatusOr<std::string> Commit(const Manifest& skeleton, absl::Span<const RankChunks> ranks,
                                     const CheckpointWriteOptions& options);

  // Removes the directory (idempotent); returns `failure` annotated if that fails too.
  absl::Status Abort(const absl::Status& failure = absl::OkStatus());

 private:
  PendingCheckpoint() = default;

  std::string root_;
  int64_t step_ = 0;
  std::string dir_;
  SaveLock lock_;
  bool open_ = false;  // neither committed nor aborted
};

}  // namespace ferry

#endif  // FERRY_CKPT_CHECKPOINT_COMMIT_H_
