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
#include "ckpt/bulk_read_tasks.h"
#include "ckpt/ckpt_io.h"
#include "ckpt/manifest.h"
#include "ckpt/posix_file.h"
#include "ferry/dtype.h"
#include "ferry/status.h"
#include "xxhash.h"

namespace ferry {
namespace {

using ckpt_internal::AlignDown;
using ckpt_internal::AlignUp;
using ckpt_internal::Annotate;
using ckpt_internal::BulkRead;
using ckpt_internal::ChunkJob;
using ckpt_internal::DescribeChunk;
using ckpt_internal::FileState;
using ckpt_internal::kAlign;
using ckpt_internal::OpenFile;
using ckpt_internal::Piece;
using ckpt_internal::Segment;

// Chunks closer than this in a file are read by one system call where the segment allows it, the
// bytes between them discarded: a short gap costs less than another request.
constexpr uint64_t kMaxGapBytes = uint64_t{1} << 20;
// Linux transfers at most 0x7ffff000 bytes per read; segments stay at or below this.
constexpr uint64_t kMaxSegmentBytes = uint64_t{1} << 30;

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