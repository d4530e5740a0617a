// Checkpoints on disk (ARCHITECTURE.md, "Checkpoint layout"): several ranks, resharding load.
//
//   <root>/step-00000100/manifest.json            see ckpt/manifest.h: every tensor's global shape,
//                                                 dtype and chunks (rank, file, offsets, checksum)
//   <root>/step-00000100/rank-00000.safetensors   rank r's shards (rank-<%05d r>.safetensors); see
//   <root>/step-00000100/rank-00001.safetensors   ckpt/safetensors.h; readable by Python's
//                                                 `safetensors`
//   <root>/latest                                 "step-00000100\n": the checkpoint written last
//
// Sharding (CheckpointShards): the tensors of each kind are packed into one Layout and split by
// ShardPlan across the world size, so each rank writes about 1/W of every kind (uneven shards). A
// chunk that is a whole tensor is stored under the tensor's name with its global shape; a piece of
// a tensor is stored 1-D as "<name>[<first element>:<end element>]" (ChunkEntryName).
//
// A save flows one way, through three stages, each in its own file:
//   1. plan     (checkpoint_plan.h)     the request validated and turned into a SavePlan: each rank
//                                       file's pieces, entries and header, and the manifest skeleton.
//                                       Nothing touches the disk.
//   2. pieces   (rank_file_writer.h)    every rank writes and fsyncs its own file from its plan into
//                                       <root>/step-<N>.incomplete/ (created and locked by
//                                       PendingCheckpoint::Begin on rank 0, which first collects the
//                                       root's crash leftovers: checkpoint_gc.h), returning its chunks
//                                       and their XXH3-64 checksums, computed while writing.
//   3. commit   (checkpoint_commit.h)   rank 0's PendingCheckpoint::Commit completes the skeleton with
//                                       every rank's chunks into manifest.json, fsyncs, renames to
//                                       step-<N>, replaces `latest`, applies keep_last.
// WriteShardedCheckpoint below runs the three stages in one process; WriteDistributedCheckpoint
// (distributed_checkpoint.h) runs them on real ranks, with one agreement after stage 1's Begin, one
// exchange of chunks after stage 2 and one broadcast of the commit's outcome. A step directory
// without a suffix is therefore always complete.
// A read flows one way too (checkpoint_reader.h): resolve the directory (checkpoint_root.h), parse
// and check the manifest and the files' headers, then read and verify chunks; a reader trusts only
// what the manifest's checksums confirm, and assembles any global range from the chunks of any
// world size.
#ifndef FERRY_CKPT_CHECKPOINT_H_
#define FERRY_CKPT_CHECKPOINT_H_

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "ckpt/checkpoint_commit.h"
#include "ckpt/checkpoint_gc.h"
#include "ckpt/checkpoint_plan.h"
#include "ckpt/checkpoint_reader.h"
#include "ckpt/checkpoint_root.h"
#include "ckpt/manifest.h"
#include "ckpt/rank_file_writer.h"

namespace ferry {

// The whole protocol for `world_size` ranks simulated in this process (each rank's file written
// from the global tensors). Same contract and errors as WriteCheckpoint, which is the world size 1
// case.
absl::StatusOr<std::string> WriteShardedCheckpoint(
    const std::string& root, int64_t step, absl::Span<const TensorRecord> tensors, int world_size,
    absl::Span<const SkipRecord> skipped, const std::map<std::string, std::string>& metadata,
    const CheckpointWriteOptions& options = {});

// Writes checkpoint `step` of `tensors` under `root` (created if missing) and returns the committed
// directory (<root>/step-<%08d step>). `metadata` (strings) goes into the manifest's "metadata" and
// the safetensors "__metadata__"; `skipped` records what was left out and why.
//
// Errors: InvalidArgument for a bad request (negative step or keep_last, empty or duplicate tensor
// names, bytes that disagree with dtype and shape, null data with bytes > 0, empty kind, strings
// that are not valid UTF-8), detected before anything is written; AlreadyExists if step-<N> exists
// (never overwritten); I/O errors from PosixError with the path. On any error the
// step-<N>.incomplete directory is removed, no step-<N> directory is left, and earlier checkpoints
// and `latest` are as they were. (Exception: if only the fsync of the root after `latest` was
// renamed fails, the new checkpoint stays committed and the error says so.) A failure to delete old
// checkpoints for keep_last does not fail the call: it is logged as a warning. Files left over by a
// crashed earlier save (step-<N>.incomplete, step-<N>.deleting) are removed first, unless a live save holds them
// (checkpoint_gc.h). REQUIRES: no
// other writer uses `root` at the same time.
absl::StatusOr<std::string> WriteCheckpoint(const std::string& root, int64_t step,
                                            absl::Span<const TensorRecord> tensors,
                                            absl::Span<const SkipRecord> skipped,
                                            const std::map<std::string, std::string>& metadata,
                                            const CheckpointWriteOptions& options = {});

}  // namespace ferry

#endif  // FERRY_CKPT_CHECKPOINT_H_
