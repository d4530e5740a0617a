// Bulk, parallel, verified loading of whole tensors from a checkpoint: the fast path for restoring
// many tensors at once, at close to the disk's sequential bandwidth.
//
// CheckpointReader::ReadTensor reads one tensor at a time through buffered pread. ReadTensors
// plans instead: every chunk of every requested tensor, grouped by rank file and sorted by file
// offset, is merged into extents (small gaps between chunks are read and discarded), each extent is
// split into segments of at most BulkReadOptions::segment_bytes at 4 KiB boundaries, and every
// segment is one read system call, O_DIRECT into an aligned bounce buffer, run as one task of a
// thread pool (queue depth = threads). Each task copies its segment into the destinations of the
// chunks it overlaps; the chunks are hashed (XXH3-64) in byte order as their pieces arrive, by
// whichever task completes the next missing piece, and every chunk is checked against the
// manifest's checksum.
#ifndef FERRY_CKPT_BULK_READER_H_
#define FERRY_CKPT_BULK_READER_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "trace/tracer.h"
#include "absl/status/status.h"
#include "absl/types/span.h"
#include "base/thread_pool.h"
#include "ckpt/checkpoint.h"

namespace ferry {

// One whole (global) tensor to read: `bytes` bytes into `dst`, borrowed for the call.
struct TensorRead {
  std::string name;
  void* dst = nullptr;  // any alignment; may be null when bytes == 0
  size_t bytes = 0;     // must equal the tensor's size, unless `partial`
  // A range of the tensor (a rank of several reading its shard): bytes [offset, offset + bytes).
  // Only the chunks that overlap it are read; each is still verified whole (its checksum covers
  // all of it), so a chunk that sticks out of the range is read into a buffer of its own first.
  uint64_t offset = 0;
  bool partial = false;
};

struct BulkReadOptions {
  // Segments are read on this pool and the calling thread (borrowed; null: the calling thread
  // only). REQUIRES: ReadTensors is not called from a task of this pool.
  ThreadPool* pool = nullptr;
  // The size of one read system call, rounded up to a multiple of 4 KiB (at least 4 KiB, at most
  // 1 GiB). One bounce buffer of this size exists per concurrently running task.
  size_t segment_bytes = size_t{8} << 20;
  // Read with O_DIRECT (bypassing the page cache) where the file system allows it; files that
  // refuse it (open or the first read fails with EINVAL, e.g. some tmpfs) are read through
  // buffered pread instead. False: buffered pread everywhere.
  bool direct_io = true;
  // Spans of the read (the whole read and verification, and each segment). Borrowed; null: off.
  Tracer* tracer = nullptr;
};

struct BulkReadStats {
  // Bytes actually read from the files, including the alignment slack around segments and the
  // gaps read between requested chunks.
  uint64_t bytes_read = 0;
  // Whether every file read was read with O_DIRECT (true when direct_io was asked for and no file
  // fell back; also true when direct_io was asked for and no file needed reading).
  bool direct = false;
};

// Reads every tensor of `reads` whole into its dst, assembled from whatever chunks and rank files
// hold it (checkpoints of any world size), and verifies the XXH3-64 of every chunk read against the
// manifest (a zero-length chunk must carry the checksum of empty input). Uses only the public API
// of `reader` and descriptors of its own (opened here, closed before returning), so it is safe to
// call concurrently with itself and with the other const methods of `reader`.
//
// Errors, detected before any I/O, naming the tensor (and its position in `reads`):
// NotFound for a name the checkpoint does not have; InvalidArgument for bytes that differ from the
// tensor's size, a null dst with bytes > 0, or a tensor requested twice.
// Errors found while reading (every segment is read regardless; the first failure in request
// order, tensor by tensor and each tensor's chunks in order, is returned): DataLoss naming the
// file and the tensor with the expected and found checksums, or for a short read (a file truncated
// after Open) the wanted and available offsets; I/O errors from PosixError with the path and
// tensor; ResourceExhausted if a bounce buffer or hash state cannot be allocated. On error the
// contents of every dst are unspecified.
//
// `stats` (may be null) is filled on success and on errors found while reading (zeroed on errors
// found before I/O). REQUIRES: each dst points to `bytes` writable bytes, the dsts do not overlap,
// and the caller does not touch them until ReadTensors returns; options.pool is not running the
// caller.
absl::Status ReadTensors(const CheckpointReader& reader, absl::Span<const TensorRead> reads,
                         const BulkReadOptions& options, BulkReadStats* stats = nullptr);

}  // namespace ferry

#endif  // FERRY_CKPT_BULK_READER_H_
