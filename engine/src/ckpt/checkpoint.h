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
// Commit protocol, for W ranks (WriteShardedCheckpoint does all of it in one process):
//   1. one rank (rank 0) calls BeginCheckpoint: <root>/step-<N>.incomplete/ is created; barrier.
//   2. every rank calls WriteRankFile: its file is written and fsynced, its chunks and checksums
//      returned (XXH3-64, computed while the bytes are written); barrier + gather to rank 0.
//   3. rank 0 calls CommitCheckpoint with every rank's chunks: manifest.json is written and
//      fsynced, the directory fsynced and renamed to step-<N>, the root fsynced, `latest` replaced
//      (tmp + fsync + rename), then old checkpoints beyond keep_last deleted.
// A step directory without a suffix is therefore always complete; a reader trusts only what the
// manifest's checksums confirm, and assembles any global range from the chunks of any world size.
#ifndef FERRY_CKPT_CHECKPOINT_H_
#define FERRY_CKPT_CHECKPOINT_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "trace/tracer.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "base/thread_pool.h"
#include "ckpt/manifest.h"  // SkipRecord, ManifestChunk
#include "ferry/dtype.h"

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

// "step-00000100": the directory name of checkpoint `step` under its root.
std::string CheckpointDirName(int64_t step);

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
  friend absl::StatusOr<CheckpointShards> LocalShards(int, int, std::vector<ShardPiece>);
  // The pieces rank `rank` writes, by kind then layout order. REQUIRES: 0 <= rank < world_size().
  const std::vector<ShardPiece>& pieces(int rank) const {
    return pieces_[static_cast<size_t>(rank)];
  }

 private:
  std::vector<std::vector<ShardPiece>> pieces_;
};

// CheckpointShards of one rank of several: `pieces` are what rank `rank` writes (the others' lists
// are empty: each rank plans only its own file, from its own ranges). InvalidArgument for a rank
// outside [0, world_size).
absl::StatusOr<CheckpointShards> LocalShards(int world_size, int rank, std::vector<ShardPiece> pieces);

// What one rank wrote: its chunks, each with the index of its tensor.
struct RankChunks {
  int64_t rank = 0;
  std::vector<std::pair<size_t, ManifestChunk>> chunks;
};

// Step 1 of the protocol (one rank): validates the request like WriteCheckpoint, creates `root`
// if missing and a fresh <root>/step-<N>.incomplete/ (replacing one left by a crash), and returns
// its path. AlreadyExists if step-<N> is committed already (never overwritten).
absl::StatusOr<std::string> BeginCheckpoint(const std::string& root, int64_t step,
                                            const CheckpointWriteOptions& options);

// Step 2 (every rank): writes rank `rank`'s file of `shards` into `tmp_dir` (from BeginCheckpoint),
// fsynced and closed, hashing each piece as it is written. `tensors` must be the ones the plan was
// made from (each rank reads only its pieces' bytes). On error the file may be left in tmp_dir
// (CommitCheckpoint is not called; AbortCheckpoint removes the directory).
absl::StatusOr<RankChunks> WriteRankFile(const std::string& tmp_dir,
                                         absl::Span<const TensorRecord> tensors,
                                         const CheckpointShards& shards, int rank,
                                         const std::map<std::string, std::string>& metadata,
                                         const CheckpointWriteOptions& options);

// Step 3 (rank 0, after every rank's WriteRankFile has returned): merges `ranks` (one entry per
// rank 0..world_size-1, any order) into manifest.json, then commits as described at the top.
// InvalidArgument if the chunks do not tile every tensor exactly. On error the .incomplete
// directory is removed and the root is as it was (see WriteCheckpoint for the one exception).
absl::StatusOr<std::string> CommitCheckpoint(const std::string& root, int64_t step,
                                             absl::Span<const TensorRecord> tensors,
                                             absl::Span<const SkipRecord> skipped,
                                             const std::map<std::string, std::string>& metadata,
                                             int world_size, absl::Span<const RankChunks> ranks,
                                             const CheckpointWriteOptions& options);

// Removes <root>/step-<N>.incomplete/ if present (after a failed step 2).
absl::Status AbortCheckpoint(const std::string& root, int64_t step);

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
// crashed earlier write of the same step (step-<N>.incomplete) are removed first. REQUIRES: no
// other writer uses `root` at the same time.
absl::StatusOr<std::string> WriteCheckpoint(const std::string& root, int64_t step,
                                            absl::Span<const TensorRecord> tensors,
                                            absl::Span<const SkipRecord> skipped,
                                            const std::map<std::string, std::string>& metadata,
                                            const CheckpointWriteOptions& options = {});

// One saved tensor as the manifest describes it.
struct TensorEntry {
  std::string name, kind, group;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  size_t bytes = 0;
  // The first chunk's (for a tensor saved by one rank: the whole tensor's).
  uint64_t checksum = 0;   // XXH3-64 of the chunk's bytes
  std::string file;        // file name inside the checkpoint directory
  size_t file_offset = 0;  // absolute offset of the chunk's bytes inside `file`
  std::vector<ManifestChunk> chunks;  // all of them, tiling [0, bytes) in global_offset order
};

class ReadOnlyFile;

// Reads one checkpoint directory. Open() on one thread; afterwards the const readers (ReadTensor,
// ReadRange, VerifyAll) are safe for concurrent use (positional reads, no shared state). The files stay
// open while the reader lives.
class CheckpointReader final {
 public:
  // `path` is a checkpoint directory (holding manifest.json) or a root, in which case the directory
  // named by `latest` is opened. Reads and validates manifest.json (format and version, required
  // fields, each tensor's dtype, shape and bytes consistent), checks that every file exists and is
  // large enough (a truncated file is refused naming the file and the first tensor that does not
  // fit) and that its safetensors header agrees with the manifest (names, dtypes, shapes, offsets,
  // metadata). Any world size. Does not read tensor data (see VerifyAll).
  // Errors: NotFound (no such path, no manifest.json, a missing file), DataLoss (corrupt or
  // inconsistent content), FailedPrecondition (another format or version).
  static absl::StatusOr<std::unique_ptr<CheckpointReader>> Open(const std::string& path);

  ~CheckpointReader();
  CheckpointReader(const CheckpointReader&) = delete;
  CheckpointReader& operator=(const CheckpointReader&) = delete;

  // The checkpoint directory (for a root: <root>/<contents of latest>).
  const std::string& dir() const { return dir_; }
  int64_t step() const { return step_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // In manifest order.
  const std::vector<TensorEntry>& tensors() const { return tensors_; }
  const std::vector<SkipRecord>& skipped() const { return skipped_; }
  // The entry named `name`, owned by the reader; nullptr if absent.
  const TensorEntry* Find(std::string_view name) const;

  // Reads tensor `name` into `dst` (borrowed for the call) and verifies its checksum.
  // Errors: NotFound (no such tensor), InvalidArgument (dst_bytes differs from its size), DataLoss
  // naming the file and the tensor, with the expected and found checksums (or a short read). On
  // error `dst` holds unspecified bytes. REQUIRES: dst points to dst_bytes writable bytes (may be
  // null when dst_bytes == 0).
  absl::Status ReadTensor(std::string_view name, void* dst, size_t dst_bytes) const;

  // Reads bytes [offset, offset + n) of global tensor `name` into `dst` (borrowed for the call),
  // assembled from the chunks of whatever ranks hold them: how a rank of another world size loads
  // its shard. Every chunk touched is read and verified whole (its checksum covers all of it), in
  // bounded pieces. Errors: NotFound (no such tensor), OutOfRange (the range passes the end),
  // DataLoss as for ReadTensor. REQUIRES: dst points to n writable bytes.
  absl::Status ReadRange(std::string_view name, uint64_t offset, void* dst, size_t n) const;

  // Reads every tensor through a bounded buffer and verifies every checksum. Returns the first
  // failure (DataLoss naming file and tensor), with how many tensors failed in all.
  absl::Status VerifyAll() const;

 private:
  CheckpointReader() = default;

  // Reads chunk `c` of `entry` in bounded pieces, hashing each piece as it arrives, and copies
  // the part of it inside global bytes [offset, offset + n) to dst (dst[0] is global byte
  // `offset`; dst == nullptr only verifies).
  absl::Status ReadChunk(const TensorEntry& entry, const ManifestChunk& c, uint64_t offset,
                         char* dst, uint64_t n) const;

  std::string dir_;
  int64_t step_ = 0;
  std::map<std::string, std::string> metadata_;
  std::vector<TensorEntry> tensors_;
  std::vector<SkipRecord> skipped_;
  absl::flat_hash_map<std::string, size_t> index_;              // name -> position in tensors_
  std::map<std::string, std::unique_ptr<ReadOnlyFile>> files_;  // by file name
};

// The committed step directories under `root` (full paths), oldest (smallest step) first: entries
// named step-<digits> that are directories. *.incomplete, `latest` and anything else are ignored.
// Errors: NotFound if root does not exist; other I/O errors with the path.
absl::StatusOr<std::vector<std::string>> ListCheckpoints(const std::string& root);

}  // namespace ferry

#endif  // FERRY_CKPT_CHECKPOINT_H_
