// The read side of a checkpoint: CheckpointReader opens one checkpoint directory (or a root's
// `latest`), validates its manifest against every rank file's safetensors header, and reads any
// global range of any tensor from the chunks of whatever ranks wrote it, verifying each chunk's
// checksum. A read flows one way: resolve the directory (checkpoint_root.h), parse the manifest,
// open and check the files (Open), then read chunks (ReadRange, ReadTensor, VerifyAll).
#ifndef FERRY_CKPT_CHECKPOINT_READER_H_
#define FERRY_CKPT_CHECKPOINT_READER_H_

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
#include "ckpt/manifest.h"
#include "ferry/dtype.h"

namespace ferry {

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

}  // namespace ferry

#endif  // FERRY_CKPT_CHECKPOINT_READER_H_
