#include "ckpt/checkpoint.h"

#include <utility>
#include <vector>

#include "ferry/status.h"

namespace ferry {

absl::StatusOr<std::string> WriteShardedCheckpoint(const std::string& root, int64_t step,
                                                   absl::Span<const TensorRecord> tensors, int world_size,
                                                   absl::Span<const SkipRecord> skipped,
                                                   const std::map<std::string, std::string>& metadata,
                                                   const CheckpointWriteOptions& options) {
  // 1. plan (nothing on disk yet), then open the checkpoint.
  FERRY_ASSIGN_OR_RETURN(SavePlan plan, PlanSave(root, step, tensors, world_size, skipped, metadata, options));
  FERRY_ASSIGN_OR_RETURN(PendingCheckpoint pending, PendingCheckpoint::Begin(root, step, options));
  // 2. pieces: every rank file.
  std::vector<RankChunks> ranks;
  ranks.reserve(plan.files.size());
  for (const RankFilePlan& file : plan.files) {
    absl::StatusOr<RankChunks> chunks = WriteRankFile(pending.dir(), tensors, file, options);
    if (!chunks.ok()) return pending.Abort(chunks.status());
    ranks.push_back(*std::move(chunks));
  }
  // 3. commit.
  return pending.Commit(plan.skeleton, ranks, options);
}

absl::StatusOr<std::string> WriteCheckpoint(const std::string& root, int64_t step,
                                            absl::Span<const TensorRecord> tensors,
                                            absl::Span<const SkipRecord> skipped,
                                            const std::map<std::string, std::string>& metadata,
                                            const CheckpointWriteOptions& options) {
  return WriteShardedCheckpoint(root, step, tensors, 1, skipped, metadata, options);
}

}  // namespace ferry
