#include "ckpt/bulk_read_tasks.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/errors.h"
#include "ckpt/posix_file.h"
#include "ferry/dtype.h"
#include "xxhash.h"

namespace ferry::ckpt_internal {

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


}  // namespace ferry::ckpt_internal
