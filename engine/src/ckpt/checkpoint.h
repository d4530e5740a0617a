// Checkpoints on disk (ARCHITECTURE.md, "Checkpoint layout"), first version: one rank, synchronous.
//
//   <root>/step-00000100/manifest.json            see ckpt/manifest.h
//   <root>/step-00000100/rank-00000.safetensors   see ckpt/safetensors.h; readable by Python's
//                                                 `safetensors`
//   <root>/latest                                 "step-00000100\n": the checkpoint written last
//
// A checkpoint is written under <root>/step-<N>.incomplete/, every file and the directory are
// fsynced, then it is renamed to step-<N>, the root fsynced, and `latest` replaced (tmp + fsync +
// rename). A step directory without a suffix is therefore always complete; a reader trusts only
// what the manifest's checksums (XXH3-64 per tensor) confirm.
#ifndef FERRY_CKPT_CHECKPOINT_H_
#define FERRY_CKPT_CHECKPOINT_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "ckpt/manifest.h"  // SkipRecord
#include "ferry/dtype.h"

namespace ferry {

// One tensor to save. `data` is host memory of `bytes` bytes, borrowed until WriteCheckpoint
// returns.
struct TensorRecord {
  std::string name;  // unique within the checkpoint; not "__metadata__"
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;  // [] is a scalar (1 element)
  const void* data = nullptr;
  size_t bytes = 0;  // must equal the product of shape times DTypeSize(dtype)
  std::string kind;  // "model", "master", "exp_avg", "exp_avg_sq": recorded in the manifest
  std::string group;
};

struct CheckpointWriteOptions {
  // Keep this many checkpoints: the new one and the newest keep_last - 1 with a smaller step. Older
  // ones are deleted only after the new one is committed and `latest` replaced; checkpoints with a
  // larger step than the new one (left by an abandoned run) are never touched. 0 keeps all.
  int keep_last = 0;
  // fsync files and directories. Turning it off is for tests and scratch runs only.
  bool fsync = true;
};

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
  uint64_t checksum = 0;   // XXH3-64 of the bytes
  std::string file;        // file name inside the checkpoint directory
  size_t file_offset = 0;  // absolute offset of the bytes inside `file`
};

class ReadOnlyFile;

// Reads one checkpoint directory. One thread at a time. The files stay open while the reader lives.
class CheckpointReader final {
 public:
  // `path` is a checkpoint directory (holding manifest.json) or a root, in which case the directory
  // named by `latest` is opened. Reads and validates manifest.json (format and version, required
  // fields, each tensor's dtype, shape and bytes consistent), checks that every file exists and is
  // large enough (a truncated file is refused naming the file and the first tensor that does not
  // fit) and that its safetensors header agrees with the manifest (names, dtypes, shapes, offsets,
  // metadata). Does not read tensor data (see VerifyAll).
  // Errors: NotFound (no such path, no manifest.json, a missing file), DataLoss (corrupt or
  // inconsistent content), FailedPrecondition (another format or version), Unimplemented (a
  // manifest of several ranks or chunks: resharding load comes later).
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

  // Reads every tensor through a bounded buffer and verifies every checksum. Returns the first
  // failure (DataLoss naming file and tensor), with how many tensors failed in all.
  absl::Status VerifyAll() const;

 private:
  CheckpointReader() = default;

  // Reads entry's bytes into dst in bounded pieces, hashing each piece as it arrives.
  absl::Status ReadAndVerify(const TensorEntry& entry, void* dst) const;

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
