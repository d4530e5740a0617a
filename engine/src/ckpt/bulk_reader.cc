#include "ckpt/bulk_reader.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "base/absl_compat.h"
#include "base/errors.h"
#include "base/logging.h"
#include "ckpt/manifest.h"
#include "ckpt/posix_file.h"
#include "ferry/dtype.h"
#include "ferry/status.h"
#include "xxhash.h"

namespace ferry {
namespace {

// O_DIRECT wants file offsets, lengths and buffer addresses aligned to the logical block size of
// the device; 4 KiB covers every device in use (and the page size).
constexpr uint64_t kAlign = 4096;
// Chunks closer than this in a file are read by one system call where the segment allows it, the
// bytes between them discarded: a short gap costs less than another request.
constexpr uint64_t kMaxGapBytes = uint64_t{1} << 20;
// A piece copied by the thread that hashes it is copied and hashed in blocks of this size, so
// the hash reads bytes still in the core's cache.
constexpr size_t kFuseBlockBytes = size_t{256} << 10;
// Linux transfers at most 0x7ffff000 bytes per read; segments stay at or below this.
constexpr uint64_t kMaxSegmentBytes = uint64_t{1} << 30;

uint64_t AlignDown(uint64_t x) { return x & ~(kAlign - 1); }
uint64_t AlignUp(uint64_t x) { return AlignDown(x + (kAlign - 1)); }

absl::Status Annotate(const absl::Status& s, absl::string_view more) {
  return absl::Status(s.code(), absl::StrCat(s.message(), more));
}

std::string DescribeChunk(const TensorEntry& e, const ManifestChunk& c) {
  const uint64_t es = DTypeSize(e.dtype);
  return absl::StrCat("bytes [", c.file_offset, ", ", c.file_offset + c.length, ") of ", c.file,
                      ", elements [", c.global_offset / es, ", ", (c.global_offset + c.length) / es,
                      ") of the tensor");
}

struct Xxh3StateDeleter {
  void operator()(XXH3_state_t* s) const { XXH3_freeState(s); }
};
using Xxh3State = std::unique_ptr<XXH3_state_t, Xxh3StateDeleter>;

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

absl::Status OpenFile(FileState& f, bool direct_io) {
  if (direct_io) {
    const int fd = ::open(f.path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
    if (fd >= 0) {
      f.direct_fd = fd;
    } else if (errno != EINVAL) {  // EINVAL: no O_DIRECT here; read buffered
      return PosixError(absl::StrCat("open ", f.path, " with O_DIRECT"), errno);
    }
  }
  const int fd = ::open(f.path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return PosixError(absl::StrCat("open ", f.path), errno);
  f.buffered_fd = fd;
  // Advisory: a larger readahead window for the buffered path.
  (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  return absl::OkStatus();
}

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

BulkRead::ReadResult BulkRead::ReadFull(FileState& f, char* buf, uint64_t offset, uint64_t n) {
  bool direct = f.direct_fd >= 0 && !f.fell_back.load(std::memory_order_relaxed);
  ReadResult result;
  while (result.got < n) {
    const ssize_t r = ::pread(direct ? f.direct_fd : f.buffered_fd, buf + result.got,
                              static_cast<size_t>(n - result.got),
                              static_cast<off_t>(offset + result.got));
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno == EINVAL && direct) {  // O_DIRECT accepted at open, refused at read
        f.fell_back.store(true, std::memory_order_relaxed);
        direct = false;
        continue;
      }
      result.status = PosixError(absl::StrCat("read ", f.path, " at offset ", offset + result.got,
                                              direct ? " (O_DIRECT)" : ""),
                                 errno);
      break;
    }
    if (r == 0) break;  // end of file
    result.got += static_cast<uint64_t>(r);
    // A direct read stops inside a block only at the end of the file; asking again would fail
    // with EINVAL (unaligned offset) rather than return 0.
    if (direct && result.got % kAlign != 0) break;
  }
  bytes_read_.fetch_add(result.got, std::memory_order_relaxed);
  return result;
}

void BulkRead::RunSegment(const Segment& s) {
  const uint64_t start = AlignDown(s.begin);
  const uint64_t n = AlignUp(s.end) - start;
  char* buf = bounce_.Acquire();
  ReadResult r;
  if (buf == nullptr) {
    r.status = absl::ResourceExhaustedError(
        absl::StrCat("ReadTensors: out of memory for a bounce buffer of ", bounce_.bytes(),
                     " bytes (reading ", s.file->path, ")"));
  } else {
    r = ReadFull(*s.file, buf, start, n);
  }
  // A piece is good if the read succeeded and covered it (a read that stops at the end of the
  // file is fine as long as it did).
  auto good = [&](const Piece& p) { return r.status.ok() && p.end <= start + r.got; };
  // Copy every good piece; a piece that is the next one its chunk needs hashed is hashed as it is
  // copied, while the bytes are in cache. The rest is marked done (and hashed forward) after the
  // buffer is given back, since that may take a while.
  // The chunk whose hashing this thread still holds: only a chunk that goes on past this segment,
  // so at most one (its piece is the segment's last).
  ChunkJob* hash_forward = nullptr;
  for (size_t i = s.first_piece; i < s.end_piece; ++i) {
    const Piece& p = pieces_[i];
    if (!good(p)) continue;
    ChunkJob& job = *p.job;
    const size_t k = i - job.first_piece;
    char* out = job.dst + (p.begin - job.chunk->file_offset);
    const char* in = buf + (p.begin - start);
    const size_t len = static_cast<size_t>(p.end - p.begin);
    if (!ClaimNext(job, k)) {
      std::memcpy(out, in, len);
      continue;
    }
    if (CopyAndHash(job, k, out, in, len)) {
      if (hash_forward != nullptr) HashForward(*hash_forward);  // not for a valid manifest
      hash_forward = &job;
    }
  }
  if (buf != nullptr) bounce_.Release(buf);
  if (hash_forward != nullptr) HashForward(*hash_forward);
  for (size_t i = s.first_piece; i < s.end_piece; ++i) {
    const Piece& p = pieces_[i];
    ChunkJob& job = *p.job;
    const size_t k = i - job.first_piece;
    if (good(p)) {
      Complete(job, k);
    } else if (!r.status.ok()) {
      Fail(job, k, Annotate(r.status, absl::StrCat(" (reading tensor '", job.entry->name, "', ",
                                                   DescribeChunk(*job.entry, *job.chunk), ")")));
    } else {
      Fail(job, k,
           absl::DataLossError(absl::StrCat(
               "short read of ", s.file->path, " for tensor '", job.entry->name, "' (",
               DescribeChunk(*job.entry, *job.chunk), "): wanted file bytes [", p.begin, ", ",
               p.end, "), but the read of [", start, ", ", start + n, ") ended at offset ",
               start + r.got, " (the file is shorter than the manifest says)")));
    }
  }
}

bool BulkRead::ClaimNext(ChunkJob& job, size_t piece) {
  std::lock_guard<std::mutex> lock(job.mu);
  if (job.hashing || !job.status.ok() || job.cursor != piece) return false;
  job.hashing = true;
  return true;
}

bool BulkRead::CopyAndHash(ChunkJob& job, size_t piece, char* out, const char* in, size_t n) {
  const bool last = piece + 1 == job.num_pieces;
  absl::Status failure;
  uint64_t digest = 0;
  if (piece == 0 && last && n <= kFuseBlockBytes) {  // small and whole: no streaming state
    std::memcpy(out, in, n);
    failure = Feed(job, out, n, /*whole=*/true, /*last=*/true, &digest);
  } else {
    for (size_t off = 0; off < n;) {
      const size_t m = std::min(kFuseBlockBytes, n - off);
      std::memcpy(out + off, in + off, m);
      if (failure.ok()) {
        failure = Feed(job, out + off, m, /*whole=*/false, last && off + m == n, &digest);
      }
      off += m;
    }
  }
  {
    std::lock_guard<std::mutex> lock(job.mu);
    done_[job.first_piece + piece] = 1;
  }
  return Advance(job, piece + 1, std::move(failure), digest);
}

void BulkRead::Fail(ChunkJob& job, size_t piece, absl::Status s) {
  std::lock_guard<std::mutex> lock(job.mu);
  // Of several failures of one chunk, report the one about its earliest piece, whatever the timing.
  if (job.status.ok() || piece < job.failed_piece) {
    job.status = std::move(s);
    job.failed_piece = piece;
  }
}

void BulkRead::Complete(ChunkJob& job, size_t piece) {
  {
    std::lock_guard<std::mutex> lock(job.mu);
    if (job.cursor > piece) return;  // already copied and hashed by CopyAndHash
    done_[job.first_piece + piece] = 1;
    if (job.hashing || !job.status.ok()) return;  // the hashing thread will pick it up
    job.hashing = true;
  }
  HashForward(job);
}

absl::Status BulkRead::Feed(ChunkJob& job, const char* data, size_t n, bool whole, bool last,
                            uint64_t* digest) {
  if (whole) {
    *digest = XXH3_64bits(data, n);
    return absl::OkStatus();
  }
  if (job.state == nullptr) {
    job.state.reset(XXH3_createState());
    if (job.state == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "ReadTensors: out of memory for the hash state of tensor '", job.entry->name, "'"));
    }
    (void)XXH3_64bits_reset(job.state.get());  // fails only for a null state
  }
  (void)XXH3_64bits_update(job.state.get(), data, n);  // fails only for a null state
  if (last) *digest = XXH3_64bits_digest(job.state.get());
  return absl::OkStatus();
}

bool BulkRead::Advance(ChunkJob& job, size_t end, absl::Status failure, uint64_t digest) {
  const ManifestChunk& c = *job.chunk;
  const bool finished = end == job.num_pieces;
  if (failure.ok() && finished && digest != c.checksum) {
    failure = absl::DataLossError(absl::StrCat(
        "checksum mismatch in ", job.file->path, " for tensor '", job.entry->name, "' (",
        DescribeChunk(*job.entry, c), "): expected ", FormatChecksum(c.checksum), ", found ",
        FormatChecksum(digest)));
  }
  std::lock_guard<std::mutex> lock(job.mu);
  job.cursor = end;
  if (!failure.ok()) {
    if (job.status.ok() || job.failed_piece > end) {
      job.status = std::move(failure);
      job.failed_piece = end;
    }
    job.hashing = false;
    return false;
  }
  if (finished) {
    job.verified = true;
    job.hashing = false;
    return false;
  }
  return true;
}

void BulkRead::HashForward(ChunkJob& job) {
  while (true) {
    size_t begin, end;
    {
      std::lock_guard<std::mutex> lock(job.mu);
      begin = job.cursor;
      end = begin;
      while (end < job.num_pieces && done_[job.first_piece + end] != 0) ++end;
      if (begin == end || !job.status.ok()) {
        job.hashing = false;
        return;
      }
    }
    // Pieces [begin, end) are in dst (written by whoever completed them, published by the lock).
    const uint64_t from = PieceOffset(job, begin);
    uint64_t digest = 0;
    absl::Status failure =
        Feed(job, job.dst + from, static_cast<size_t>(PieceOffset(job, end) - from),
             begin == 0 && end == job.num_pieces, end == job.num_pieces, &digest);
    if (!Advance(job, end, std::move(failure), digest)) return;
  }
}

// Checks the request before any I/O: every name known, sizes right, no tensor twice.
absl::Status ValidateReads(const CheckpointReader& reader, absl::Span<const TensorRead> reads,
                           std::vector<const TensorEntry*>& entries) {
  absl::flat_hash_map<const TensorEntry*, size_t> seen;
  entries.reserve(reads.size());
  for (size_t i = 0; i < reads.size(); ++i) {
    const TensorRead& r = reads[i];
    const TensorEntry* e = reader.Find(r.name);
    if (e == nullptr) {
      return absl::NotFoundError(absl::StrCat("ReadTensors: reads[", i, "]: checkpoint ",
                                              reader.dir(), " has no tensor '", r.name, "'"));
    }
    const std::string where = absl::StrCat("ReadTensors: reads[", i, "] (tensor '", r.name, "')");
    if (!r.partial && (r.bytes != e->bytes || r.offset != 0)) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": destination has ", r.bytes,
                                                     " bytes, the tensor ", e->bytes));
    }
    if (r.partial && (r.offset > e->bytes || r.bytes > e->bytes - r.offset)) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": the range [", r.offset, ", ", r.offset + r.bytes,
                                                     ") passes the end of the tensor's ", e->bytes, " bytes"));
    }
    if (r.dst == nullptr && r.bytes > 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": destination is null but bytes is ", r.bytes));
    }
    auto [it, inserted] = seen.emplace(e, i);
    if (!inserted) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": the tensor is already requested by reads[", it->second, "]"));
    }
    entries.push_back(e);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ReadTensors(const CheckpointReader& reader, absl::Span<const TensorRead> reads,
                         const BulkReadOptions& options, BulkReadStats* stats) {
  if (stats != nullptr) *stats = BulkReadStats{};
  std::vector<const TensorEntry*> entries;
  FERRY_RETURN_IF_ERROR(ValidateReads(reader, reads, entries));
  // The whole verified read: every segment read and every chunk's checksum checked.
  TraceSpan read_span(options.tracer, "ckpt.read", "ckpt");
  if (read_span.on()) {
    double bytes = 0.0;
    for (const TensorRead& r : reads) bytes += static_cast<double>(r.bytes);
    read_span.Arg("bytes", bytes);
    read_span.Arg("tensors", static_cast<double>(reads.size()));
  }

  // ---- the chunks, in request order ----
  // The chunks each read needs: all of a whole read; those overlapping the range of a partial one.
  auto needed = [&](size_t i, const ManifestChunk& c) {
    const TensorRead& r = reads[i];
    if (!r.partial) return true;
    return c.length > 0 && r.bytes > 0 && c.global_offset < r.offset + r.bytes && r.offset < c.global_offset + c.length;
  };
  // A chunk that sticks out of its partial read lands in a buffer of its own and is copied after
  // it verified.
  struct Spill {
    size_t job;
    std::unique_ptr<char[]> buffer;
    char* dst;        // where the overlap goes
    uint64_t from;    // the overlap's first byte within the chunk
    uint64_t length;  // the overlap's bytes
  };
  std::vector<Spill> spills;
  size_t num_chunks = 0;
  for (size_t i = 0; i < reads.size(); ++i) {
    for (const ManifestChunk& c : entries[i]->chunks) num_chunks += needed(i, c) ? 1 : 0;
  }
  std::vector<ChunkJob> jobs(num_chunks);  // never resized: the jobs hold mutexes
  std::vector<std::unique_ptr<FileState>> files;
  absl::flat_hash_map<std::string, size_t> file_by_name;  // -> index into files
  std::vector<std::vector<ChunkJob*>> jobs_by_file;
  {
    size_t j = 0;
    for (size_t i = 0; i < reads.size(); ++i) {
      for (const ManifestChunk& c : entries[i]->chunks) {
        if (!needed(i, c)) continue;
        ChunkJob& job = jobs[j++];
        job.entry = entries[i];
        job.chunk = &c;
        const TensorRead& r = reads[i];
        if (r.partial && (c.global_offset < r.offset || c.global_offset + c.length > r.offset + r.bytes)) {
          const uint64_t begin = std::max(c.global_offset, r.offset);
          const uint64_t end = std::min(c.global_offset + c.length, r.offset + r.bytes);
          spills.push_back(Spill{j - 1, std::unique_ptr<char[]>(new (std::nothrow) char[c.length]),
                                 static_cast<char*>(r.dst) + (begin - r.offset), begin - c.global_offset, end - begin});
          if (spills.back().buffer == nullptr) {
            return absl::ResourceExhaustedError(absl::StrCat("ReadTensors: cannot allocate ", c.length,
                                                             " bytes for a chunk of tensor '", r.name, "'"));
          }
          job.dst = spills.back().buffer.get();
        } else {
          job.dst = static_cast<char*>(r.dst) + (c.global_offset - r.offset);
        }
        if (c.length == 0) {  // nothing to read; the empty input must still hash right
          const uint64_t found = XXH3_64bits(nullptr, 0);
          std::lock_guard<std::mutex> lock(job.mu);
          if (found == c.checksum) {
            job.verified = true;
          } else {
            job.status = absl::DataLossError(absl::StrCat(
                "checksum mismatch in ", JoinPath(reader.dir(), c.file), " for tensor '",
                job.entry->name, "' (", DescribeChunk(*job.entry, c), ", empty): expected ",
                FormatChecksum(c.checksum), ", found ", FormatChecksum(found)));
          }
          continue;
        }
        auto [it, inserted] = file_by_name.emplace(c.file, files.size());
        if (inserted) {
          files.push_back(std::make_unique<FileState>());
          files.back()->path = JoinPath(reader.dir(), c.file);
          jobs_by_file.emplace_back();
        }
        job.file = files[it->second].get();
        jobs_by_file[it->second].push_back(&job);
      }
    }
  }
  for (std::unique_ptr<FileState>& f : files) f->open_status = OpenFile(*f, options.direct_io);

  // ---- plan: per file, chunks by file offset, cut into segments ----
  const uint64_t segment_bytes =
      AlignUp(std::clamp<uint64_t>(options.segment_bytes, kAlign, kMaxSegmentBytes));
  std::vector<Piece> pieces;
  std::vector<Segment> segments;
  for (size_t f = 0; f < files.size(); ++f) {
    FileState* file = files[f].get();
    std::vector<ChunkJob*>& fj = jobs_by_file[f];
    if (!file->open_status.ok()) {
      for (ChunkJob* job : fj) {
        std::lock_guard<std::mutex> lock(job->mu);
        job->status = Annotate(file->open_status,
                               absl::StrCat(" (reading tensor '", job->entry->name, "')"));
      }
      continue;
    }
    std::stable_sort(fj.begin(), fj.end(), [](const ChunkJob* a, const ChunkJob* b) {
      return a->chunk->file_offset < b->chunk->file_offset;
    });
    Segment* seg = nullptr;  // the open segment of this file
    for (ChunkJob* job : fj) {
      const uint64_t chunk_end = job->chunk->file_offset + job->chunk->length;
      job->first_piece = pieces.size();
      for (uint64_t pos = job->chunk->file_offset; pos < chunk_end;) {
        // Join the open segment if the piece starts inside its reach and close enough to its end.
        const bool join = seg != nullptr && pos >= seg->begin && pos < seg->limit &&
                          pos <= seg->end + kMaxGapBytes;
        if (!join) {
          segments.push_back({.file = file,
                              .begin = pos,
                              .end = pos,
                              .limit = AlignDown(pos) + segment_bytes,
                              .first_piece = pieces.size(),
                              .end_piece = pieces.size()});
          seg = &segments.back();
        }
        const uint64_t piece_end = std::min(chunk_end, seg->limit);
        pieces.push_back({.job = job, .begin = pos, .end = piece_end});
        seg->end = std::max(seg->end, piece_end);
        seg->end_piece = pieces.size();
        pos = piece_end;
      }
      job->num_pieces = pieces.size() - job->first_piece;
    }
  }
  uint64_t bounce_bytes = 0;
  for (const Segment& s : segments) {
    bounce_bytes = std::max(bounce_bytes, AlignUp(s.end) - AlignDown(s.begin));
  }

  // ---- read: one task per segment ----
  {
    const size_t num_pieces = pieces.size();
    BulkRead bulk(std::move(pieces), std::vector<uint8_t>(num_pieces, 0),
                  static_cast<size_t>(bounce_bytes));
    Tracer* const tracer = options.tracer;
    auto task = [&](size_t i) {
      TraceSpan span(tracer, "ckpt.read.segment", "ckpt");
      if (span.on()) {
        tracer->NameThread("ckpt io", /*if_unnamed=*/true);
        span.Arg("bytes", static_cast<double>(segments[i].end - segments[i].begin));
      }
      bulk.RunSegment(segments[i]);
    };
    if (options.pool != nullptr) {
      options.pool->ParallelFor(segments.size(), task);
    } else {
      for (size_t i = 0; i < segments.size(); ++i) task(i);
    }
    if (stats != nullptr) {
      stats->bytes_read = bulk.bytes_read();
      stats->direct = options.direct_io;
      for (const std::unique_ptr<FileState>& f : files) {
        if (f->open_status.ok() &&
            (f->direct_fd < 0 || f->fell_back.load(std::memory_order_relaxed))) {
          stats->direct = false;
        }
      }
    }
  }
  files.clear();  // close the descriptors before returning

  // ---- verdict: the first failure in request order ----
  for (ChunkJob& job : jobs) {
    std::lock_guard<std::mutex> lock(job.mu);
    if (!job.status.ok()) return job.status;
    FERRY_CHECK(job.verified) << "ReadTensors: chunk of tensor '" << job.entry->name
                              << "' neither verified nor failed";
  }
  for (const Spill& sp : spills) std::memcpy(sp.dst, sp.buffer.get() + sp.from, static_cast<size_t>(sp.length));
  return absl::OkStatus();
}

}  // namespace ferry
