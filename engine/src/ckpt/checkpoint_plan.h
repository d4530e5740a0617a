// The plan of a checkpoint save: what is saved (TensorRecord), how (CheckpointWriteOptions), which
// rank writes which bytes (CheckpointShards), and what each rank file and the manifest will hold
// (SavePlan). Everything here is computed from the request alone, before anything touches the disk:
// a plan that builds is a request that is valid. The first of the three stages of a save
// (checkpoint.h): plan, then pieces (rank_file_writer.h), then commit (checkpoint_commit.h).
#ifndef FERRY_CKPT_CHECKPOINT_PLAN_H_
#define FERRY_CKPT_CHECKPOINT_PLAN_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "base/thread_pool.h"
#include "ckpt/manifest.h"  // Manifest, SkipRecord, ManifestChunk
#include "ckpt/safetensors.h"
#include "ferry/dtype.h"
#include "trace/tracer.h"

namespace ferry {

// One tensor to save. `data` is host memory holding the whole (global) tensor, `bytes` bytes,
// borrowed until the write that uses it returns (or, for CheckpointWriter::Start, finishes).
struct TensorRecord {
  std::string name;  // unique within the checkpoint; not "__metadata__"
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;  // [] is a scalar (1 element)
  const void* data = nullptr;
  size_t bytes = 0;  // must equal the product of shape times DTypeSize(dtype)
  std::string kind;  // "model", "master", "exp_avg", "exp_avg_sq": recorded in the manifest
  std::string group;
  // The order in which the tensors' bytes are read and written, lowest first (ties in file order):
  // only the order of the I/O, never the layout of the files.
  int64_t write_order = 0;
  // The global byte offset that data[0] holds: 0 for the whole tensor; a rank that holds only a
  // range of the tensor points `data` at its range and sets this to the range's first byte (the
  // pieces it writes lie inside the range).
  uint64_t data_begin = 0;
};

struct CheckpointWriteOptions {
  // Keep this many checkpoints: the new one and the newest keep_last - 1 with a smaller step. Older
  // ones are deleted only after the new one is committed and `latest` replaced; checkpoints with a
  // larger step than the new one (left by an abandoned run) are never touched. 0 keeps all.
  int keep_last = 0;
  // fsync files and directories. Turning it off is for tests and scratch runs only.
  bool fsync = true;
  // Chunks of a rank file are written in parallel on this pool (borrowed; null: the calling thread
  // only). REQUIRES: the write does not run inside a task of this pool.
  ThreadPool* pool = nullptr;
  // Called (on a writing thread) before the first byte of each piece of tensor `tensor` (an index
  // into the tensors written) is read; returns where the tensor's bytes are to be read from (its
  // whole, global bytes; nullptr: TensorRecord::data) or an error that fails the save. Lets the
  // caller hand over data still being produced (a copy in flight) or moved aside meanwhile. May be
  // called from several threads at once.
  std::function<absl::StatusOr<const void*>(size_t tensor)> before_write;
  // Called once bytes [offset, offset + length) of tensor `tensor` have been written and are never
  // read again by this save. May be called from several threads at once.
  std::function<void(size_t tensor, uint64_t offset, uint64_t length)> after_write;
  // Spans of the save (each file's write, its pieces, fsync, commit). Borrowed; null: off.
  Tracer* tracer = nullptr;
};

// The checks of a write request made before anything touches the disk (WriteCheckpoint's
// InvalidArgument cases). With `local_data` a tensor's data may be null (a rank of several that
// holds none of it).
absl::Status ValidateWriteRequest(const std::string& root, int64_t step, absl::Span<const TensorRecord> tensors,
                                  absl::Span<const SkipRecord> skipped, const CheckpointWriteOptions& options,
                                  bool local_data);

// "rank-00003.safetensors".
std::string RankFileName(int64_t rank);

// The name under which a chunk of `length` bytes at `global_offset` of tensor `tensor` (dtype,
// `tensor_bytes` in all) is stored in its rank file: `tensor` itself for the whole tensor, else
// "<tensor>[<first element>:<end element>]". REQUIRES: offsets are multiples of DTypeSize(dtype).
std::string ChunkEntryName(absl::string_view tensor, DType dtype, uint64_t tensor_bytes,
                           uint64_t global_offset, uint64_t length);

// A piece of one tensor that one rank writes.
struct ShardPiece {
  size_t tensor = 0;           // index into the tensors the plan was made from
  uint64_t global_offset = 0;  // bytes into the tensor
  uint64_t length = 0;         // bytes
};

// Which rank writes which bytes of which tensor. Computed from the tensors' names, kinds, dtypes
// and shapes and the world size only (no data, no collective), so every rank computes the same
// plan. Tensors of each kind (in order of first appearance) are packed in the given order into one
// Layout and partitioned with ShardPlan: the first ranks hold one element more. A tensor with no
// elements is written by rank 0 alone. Immutable; safe for concurrent use.
class CheckpointShards final {
 public:
  // InvalidArgument for world_size < 1 or a tensor whose bytes disagree with its dtype and shape.
  static absl::StatusOr<CheckpointShards> Plan(absl::Span<const TensorRecord> tensors,
                                               int world_size);

  int world_size() const { return static_cast<int>(pieces_.size()); }
  // The pieces rank `rank` writes, by kind then layout order. REQUIRES: 0 <= rank < world_size().
  const std::vector<ShardPiece>& pieces(int rank) const {
    return pieces_[static_cast<size_t>(rank)];
  }

 private:
  std::vector<std::vector<ShardPiece>> pieces_;
};


// What one rank file holds, computed from the request alone: the rank's pieces in file order, their
// safetensors entries and the encoded header. Building it checks every string (UTF-8) and name.
struct RankFilePlan {
  int rank = 0;
  std::string file_name;           // RankFileName(rank)
  std::vector<ShardPiece> pieces;  // in file order
  std::vector<SafetensorsEntry> entries;  // entries[k] places pieces[k]
  std::string header;              // length prefix + padded JSON
};

// A whole save, planned: the manifest without its chunks (each rank's chunks are known only once
// its file is written) and the rank files planned in this process.
struct SavePlan {
  Manifest skeleton;
  std::vector<RankFilePlan> files;
};

// The plan of a save whose every rank file is written in this process (`world_size` ranks
// simulated; 1 for a single-process trainer), from the global tensors. InvalidArgument as for
// WriteCheckpoint.
absl::StatusOr<SavePlan> PlanSave(const std::string& root, int64_t step, absl::Span<const TensorRecord> tensors,
                                  int world_size, absl::Span<const SkipRecord> skipped,
                                  const std::map<std::string, std::string>& metadata,
                                  const CheckpointWriteOptions& options);

// The plan of rank `rank` of `world_size` ranks in separate processes: `tensors` are the global
// tensors (identical on every rank) whose `data` holds this rank's bytes from `data_begin`, and
// `pieces` the ranges this rank writes (each inside its data). files[0] is this rank's file.
// InvalidArgument naming the tensor for a piece outside the tensors or the rank's data.
absl::StatusOr<SavePlan> PlanRankSave(const std::string& root, int64_t step, absl::Span<const TensorRecord> tensors,
                                      int world_size, int rank, std::vector<ShardPiece> pieces,
                                      absl::Span<const SkipRecord> skipped,
                                      const std::map<std::string, std::string>& metadata,
                                      const CheckpointWriteOptions& options);

}  // namespace ferry

#endif  // FERRY_CKPT_CHECKPOINT_PLAN_H_
