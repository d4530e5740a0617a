// The tasks of one ReadTensors call (bulk_reader.h), internal to ckpt/: the rank files opened for
// it, one ChunkJob per chunk read, the pieces and segments the plan cut them into, the aligned
// bounce buffers, and BulkRead, which runs one segment per task (read, copy, hash in byte order,
// verify). bulk_reader.cc plans the segments; this file executes them.
#ifndef FERRY_CKPT_BULK_READ_TASKS_H_
#define FERRY_CKPT_BULK_READ_TASKS_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "ckpt/checkpoint_reader.h"
#include "ckpt/ckpt_io.h"
#include "ckpt/manifest.h"

namespace ferry::ckpt_internal {

// O_DIRECT wants file offsets, lengths and buffer addresses aligned to the logical block size of
// the device; 4 KiB covers every device in use (and the page size).
inline constexpr uint64_t kAlign = 4096;
// A piece copied by the thread that hashes it is copied and hashed in blocks of this size, so
// the hash reads bytes still in the core's cache.
inline constexpr size_t kFuseBlockBytes = size_t{256} << 10;

inline uint64_t AlignDown(uint64_t x) { return x & ~(kAlign - 1); }
inline uint64_t AlignUp(uint64_t x) { return AlignDown(x + (kAlign - 1)); }

// The descriptors of one rank file, opened for this call. After OpenFile only `fell_back` changes.
struct FileState {
  FileState() = default;
  FileState(const FileState&) = delete;
  FileState& operator=(const FileState&) = delete;
  ~FileState() {
    if (direct_fd >= 0) ::close(direct_fd);  // read-only: nothing to lose
    if (buffered_fd >= 0) ::close(buffered_fd);
  }

  std::string path;
  int direct_fd = -1;    // O_DIRECT; -1 when not asked for or refused at open
  int buffered_fd = -1;  // always open (the fallback when a direct read fails with EINVAL)
  absl::Status open_status;
  // Set once a read on direct_fd failed with EINVAL: the file system takes O_DIRECT at open but not
  // at read time; every later read of this file goes through buffered_fd.
  std::atomic<bool> fell_back{false};
};

// Opens f.path: with `direct_io` also an O_DIRECT descriptor where the file system takes one.
absl::Status OpenFile(FileState& f, bool direct_io);

// One chunk of a requested tensor, read as `num_pieces` pieces (one per segment it overlaps) that
// complete in any order and are hashed in byte order.
struct ChunkJob {
  const TensorEntry* entry = nullptr;
  const ManifestChunk* chunk = nullptr;
  char* dst = nullptr;  // where byte 0 of the chunk goes
  FileState* file = nullptr;
  size_t first_piece = 0;  // its pieces are pieces[first_piece, first_piece + num_pieces)
  size_t num_pieces = 0;

  std::mutex mu;
  size_t cursor ABSL_GUARDED_BY(mu) = 0;  // pieces [0, cursor) are hashed
  bool hashing ABSL_GUARDED_BY(mu) = false;  // a thread is hashing (and owns `state`)
  bool verified ABSL_GUARDED_BY(mu) = false;
  absl::Status status ABSL_GUARDED_BY(mu);
  size_t failed_piece ABSL_GUARDED_BY(mu) = 0;  // the piece `status` is about, when not OK
  // Used only by the thread that set `hashing`, between setting and clearing it.
  Xxh3State state;
};

// Bytes [begin, end) of a file that belong to one chunk and one segment.
struct Piece {
  ChunkJob* job = nullptr;
  uint64_t begin = 0, end = 0;
};

// One read system call: file bytes [AlignDown(begin), AlignUp(end)), holding pieces
// [first_piece, end_piece).
struct Segment {
  FileState* file = nullptr;
  uint64_t begin = 0, end = 0;  // the first piece's begin, the furthest piece end
  uint64_t limit = 0;           // pieces may extend the segment up to here (aligned)
  size_t first_piece = 0, end_piece = 0;
};

// Aligned bounce buffers, recycled: at most one per concurrently running task is ever allocated.
class BouncePool final {
 public:
  explicit BouncePool(size_t bytes) : bytes_(bytes) {}
  ~BouncePool() {
    for (char* p : all_) std::free(p);
  }
  BouncePool(const BouncePool&) = delete;
  BouncePool& operator=(const BouncePool&) = delete;

  // A buffer of bytes() bytes aligned to kAlign, or null when out of memory. Give it back with
  // Release.
  char* Acquire() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!free_.empty()) {
        char* p = free_.back();
        free_.pop_back();
        return p;
      }
    }
    char* p = static_cast<char*>(std::aligned_alloc(kAlign, bytes_));
    if (p == nullptr) return nullptr;
    std::lock_guard<std::mutex> lock(mu_);
    all_.push_back(p);
    free_.reserve(all_.size());  // so that Release never allocates
    return p;
  }
  void Release(char* p) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(p);
  }
  size_t bytes() const { return bytes_; }

 private:
  const size_t bytes_;
  std::mutex mu_;
  std::vector<char*> all_ ABSL_GUARDED_BY(mu_);
  std::vector<char*> free_ ABSL_GUARDED_BY(mu_);
};

// The state of one ReadTensors call shared by its tasks.
class BulkRead final {
 public:
  BulkRead(std::vector<Piece> pieces, std::vector<uint8_t> done, size_t bounce_bytes)
      : pieces_(std::move(pieces)), done_(std::move(done)), bounce_(bounce_bytes) {}

  // Reads segment `s`, copies its pieces to their destinations and hashes what became contiguous.
  void RunSegment(const Segment& s);

  uint64_t bytes_read() const { return bytes_read_.load(std::memory_order_relaxed); }

 private:
  struct ReadResult {
    absl::Status status;
    uint64_t got = 0;  // bytes read from the start of the request
  };
  ReadResult ReadFull(FileState& f, char* buf, uint64_t offset, uint64_t n);

  // Records a failure of piece `piece` of `job`.
  void Fail(ChunkJob& job, size_t piece, absl::Status s);
  // Piece `piece` of `job` is in its destination: marks it done and, unless another thread is
  // hashing the chunk, hashes forward over every contiguous done piece.
  void Complete(ChunkJob& job, size_t piece);
  // Takes the chunk's hashing if `piece` is the next piece it needs and nobody is hashing it.
  bool ClaimNext(ChunkJob& job, size_t piece);
  // Copies piece `piece` (n bytes) from `in` to `out`, hashing it block by block while in cache.
  // Returns whether the caller still holds the hashing (and must call HashForward).
  // REQUIRES: ClaimNext(job, piece) returned true.
  bool CopyAndHash(ChunkJob& job, size_t piece, char* out, const char* in, size_t n);
  // Feeds n bytes to the chunk's hash; `whole`: they are all of the chunk's bytes (no streaming
  // state needed). Sets *digest when `last`. REQUIRES: the caller holds the chunk's hashing.
  absl::Status Feed(ChunkJob& job, const char* data, size_t n, bool whole, bool last,
                    uint64_t* digest);
  // Records that pieces [0, end) are hashed, with `failure` (or the digest, compared with the
  // manifest's, once end is the last piece). Returns whether the caller still holds the hashing:
  // false once the chunk is verified or failed. REQUIRES: the caller holds the chunk's hashing.
  bool Advance(ChunkJob& job, size_t end, absl::Status failure, uint64_t digest);
  // Hashes forward from the cursor over every contiguous done piece; gives up the hashing when
  // none is left. REQUIRES: the caller holds the chunk's hashing.
  void HashForward(ChunkJob& job);
  uint64_t PieceOffset(const ChunkJob& job, size_t k) const {
    return k == job.num_pieces ? job.chunk->length
                               : pieces_[job.first_piece + k].begin - job.chunk->file_offset;
  }

  const std::vector<Piece> pieces_;
  // done_[i]: piece i is in its destination. Each element is guarded by its chunk's mutex.
  std::vector<uint8_t> done_;
  BouncePool bounce_;
  std::atomic<uint64_t> bytes_read_{0};
};

}  // namespace ferry::ckpt_internal

#endif  // FERRY_CKPT_BULK_READ_TASKS_H_
