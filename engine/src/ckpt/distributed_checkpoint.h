// The commit protocol of checkpoint.h run by real ranks (one process or thread each) over a Comm:
//
//   1. every rank plans its own file (PlanRankSave: the request, its pieces inside its data); rank 0
//      begins the checkpoint (PendingCheckpoint: crash leftovers collected, then
//      <root>/step-<N>.incomplete/ created and locked); one agreement (every rank learns every
//      failure).
//   2. every rank writes and fsyncs its own rank file (WriteRankFile) from its own ranges, then the
//      ranks exchange their outcomes and chunk tables (one all-gather, with the checkpoint timeout:
//      ranks write at different speeds).
//   3. if every rank succeeded, rank 0 commits (manifest.json from every rank's chunks, fsync,
//      rename, `latest`, keep_last); otherwise its PendingCheckpoint removes the .incomplete
//      directory. Rank 0's
//      outcome is broadcast, so every rank returns the same directory or the same error, naming
//      the ranks whose writes failed.
// A rank killed at any point leaves the previous checkpoint as `latest` (nothing is renamed before
// every file is durable); the others get an error (a peer gone, or the timeout).
#ifndef FERRY_CKPT_DISTRIBUTED_CHECKPOINT_H_
#define FERRY_CKPT_DISTRIBUTED_CHECKPOINT_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "ckpt/checkpoint.h"
#include "ferry/comm.h"

namespace ferry {

// Writes checkpoint `step` under `root` with the ranks of `comm`; collective.
//
// `tensors` are the global tensors, identical on every rank (names, kinds, groups, dtypes, global
// shapes and bytes, in the same order); each record's `data` points to this rank's bytes of it,
// starting at global byte `data_begin` (null where the rank holds nothing). `pieces` are the
// ranges this rank writes (inside its data); over all ranks they must tile every tensor (else
// the commit fails with InvalidArgument and nothing is committed). `skipped`, `metadata` and
// `options` as for WriteCheckpoint (only rank 0's keep_last and skipped are used; metadata is
// written into every rank file). `timeout` bounds each exchange. Returns the committed directory on
// every rank, or on every rank an error naming the failing ranks ("rank 2 of 4: ...").
absl::StatusOr<std::string> WriteDistributedCheckpoint(Comm& comm, absl::Duration timeout, const std::string& root,
                                                       int64_t step, absl::Span<const TensorRecord> tensors,
                                                       std::vector<ShardPiece> pieces,
                                                       absl::Span<const SkipRecord> skipped,
                                                       const std::map<std::string, std::string>& metadata,
                                                       const CheckpointWriteOptions& options);

}  // namespace ferry

#endif  // FERRY_CKPT_DISTRIBUTED_CHECKPOINT_H_
