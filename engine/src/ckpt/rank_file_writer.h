// The second stage of a save (checkpoint.h): one rank file written from its plan
// (checkpoint_plan.h) into the checkpoint's .incomplete directory, each piece hashed as it is
// written. Every rank runs it for its own file; nothing here knows about the commit.
#ifndef FERRY_CKPT_RANK_FILE_WRITER_H_
#define FERRY_CKPT_RANK_FILE_WRITER_H_

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "ckpt/checkpoint_plan.h"
#include "ckpt/manifest.h"

namespace ferry {

// What one rank wrote: its chunks, each with the index of its tensor.
struct RankChunks {
  int64_t rank = 0;
  std::vector<std::pair<size_t, ManifestChunk>> chunks;
};

// Writes the rank file that `plan` describes into `dir` (the .incomplete directory of
// PendingCheckpoint::dir(), or the path every rank derives with IncompleteDirPath), fsynced (with
// options.fsync) and closed, hashing each piece as it is written (XXH3-64). `tensors` must be the
// ones the plan was made from (each rank reads only its pieces' bytes); pieces are written in
// TensorRecord::write_order, in parallel on options.pool. On error the file may be left in `dir`
// (the pending checkpoint is then aborted, which removes the directory).
absl::StatusOr<RankChunks> WriteRankFile(const std::string& dir, absl::Span<const TensorRecord> tensors,
                                         const RankFilePlan& plan, const CheckpointWriteOptions& options);

}  // namespace ferry

#endif  // FERRY_CKPT_RANK_FILE_WRITER_H_
