#include "ckpt/rank_file_writer.h"

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "base/thread_affinity.h"
#include "ckpt/ckpt_io.h"
#include "ckpt/posix_file.h"
#include "ferry/status.h"

namespace ferry {
namespace {

using ckpt_internal::Annotate;
using ckpt_internal::kIoChunkBytes;
using ckpt_internal::NewXxh3State;
using ckpt_internal::Xxh3State;

// Starts the writeback of ranges of one file as the writers finish them, on a thread of its own:
// sync_file_range blocks while the disk's queue is full, and the writers, which only copy into the
// page cache, must not wait for the disk (an asynchronous save releases the memory it reads as soon
// as its bytes are in the page cache). Advisory: durability comes from the final fsync.
class WritebackQueue final {
 public:
  explicit WritebackQueue(const WritableFile* file) : file_(file), thread_([this] {
    NameCurrentThread("ferry-writeback");
    Loop();
  }) {}
  ~WritebackQueue() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  WritebackQueue(const WritebackQueue&) = delete;
  WritebackQueue& operator=(const WritebackQueue&) = delete;

  void Add(uint64_t offset, uint64_t n) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ranges_.emplace_back(offset, n);
    }
    cv_.notify_one();
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [this] { return done_ || !ranges_.empty(); });
      if (ranges_.empty()) return;  // done, nothing left
      std::vector<std::pair<uint64_t, uint64_t>> batch;
      batch.swap(ranges_);
      lock.unlock();
      // A failure shows up in fsync.
      for (const auto& [offset, n] : batch) (void)file_->StartWriteback(offset, n);
      lock.lock();
    }
  }

  const WritableFile* file_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::pair<uint64_t, uint64_t>> ranges_ ABSL_GUARDED_BY(mu_);
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: starts after everything above is initialised
};

// Writes piece `p` of `t` (whose bytes are at `data`) at `file_offset` of `file` in bounded pieces,
// hashing each right after it is written (while it is still in cache), and returns its checksum. Each piece written is
// handed to `writeback` (if not null).
absl::StatusOr<uint64_t> WritePiece(const WritableFile& file, const TensorRecord& t,
                                    const char* data, const ShardPiece& p, uint64_t file_offset,
                                    WritebackQueue* writeback) {
  FERRY_ASSIGN_OR_RETURN(Xxh3State hash, NewXxh3State());
  const char* src = data + (p.global_offset - t.data_begin);
  for (uint64_t done = 0; done < p.length;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(kIoChunkBytes, p.length - done));
    absl::Status s = file.WriteAt(file_offset + done, src + done, n);
    if (!s.ok()) return Annotate(s, absl::StrCat(" (writing tensor '", t.name, "')"));
    XXH3_64bits_update(hash.get(), src + done, n);
    // Start the writeback of what was just written, so the final fsync has little left to do.
    if (writeback != nullptr) writeback->Add(file_offset + done, n);
    done += n;
  }
  return XXH3_64bits_digest(hash.get());
}

}  // namespace

absl::StatusOr<RankChunks> WriteRankFile(const std::string& dir, absl::Span<const TensorRecord> tensors,
                                         const RankFilePlan& plan, const CheckpointWriteOptions& options) {
  const int rank = plan.rank;
  Tracer* const tracer = options.tracer;
  TraceSpan file_span(tracer, "ckpt.write", "ckpt");
  if (file_span.on()) {
    tracer->NameThread("ckpt writer", /*if_unnamed=*/true);
    uint64_t bytes = plan.header.size();
    for (const ShardPiece& p : plan.pieces) bytes += p.length;
    file_span.Arg("bytes", static_cast<double>(bytes));
    file_span.Arg("rank", rank);
    file_span.Detail(plan.file_name);
  }
  // The plan checked each piece against the tensors it was made from (PlanRankFile).
  for (const ShardPiece& p : plan.pieces) {
    if (p.tensor >= tensors.size() || p.global_offset + p.length > tensors[p.tensor].bytes) {
      return absl::InvalidArgumentError(absl::StrCat("WriteRankFile: ", plan.file_name,
                                                     " was planned from other tensors (tensor index ", p.tensor, ")"));
    }
  }
  const std::string& file_name = plan.file_name;
  FERRY_ASSIGN_OR_RETURN(WritableFile file, WritableFile::Create(JoinPath(dir, file_name)));
  FERRY_RETURN_IF_ERROR(file.WriteAt(0, plan.header.data(), plan.header.size()));
  RankChunks out;
  out.rank = rank;
  out.chunks.resize(plan.pieces.size());
  std::vector<absl::Status> status(plan.pieces.size());
  // The pieces in the order their bytes are to be read (TensorRecord::write_order), each written at
  // its place in the file.
  std::vector<size_t> order(plan.pieces.size());
  for (size_t k = 0; k < order.size(); ++k) order[k] = k;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return tensors[plan.pieces[a].tensor].write_order < tensors[plan.pieces[b].tensor].write_order;
  });
  std::optional<WritebackQueue> writeback_queue;
  WritebackQueue* writeback = nullptr;
  if (options.fsync) writeback = &writeback_queue.emplace(&file);
  auto write_one = [&](size_t i) {
    const size_t k = order[i];
    const ShardPiece& p = plan.pieces[k];
    const uint64_t file_offset = plan.header.size() + plan.entries[k].begin;
    const char* data = static_cast<const char*>(tensors[p.tensor].data);
    TraceSpan piece_span(tracer, "ckpt.write.piece", "ckpt");
    if (piece_span.on()) {
      tracer->NameThread("ckpt io", /*if_unnamed=*/true);
      piece_span.Arg("bytes", static_cast<double>(p.length));
      piece_span.Detail(tensors[p.tensor].name);
    }
    if (options.before_write) {
      absl::StatusOr<const void*> ready = options.before_write(p.tensor);
      if (!ready.ok()) {
        status[k] = Annotate(ready.status(), absl::StrCat(" (before writing tensor '", tensors[p.tensor].name, "')"));
        return;
      }
      if (*ready != nullptr) data = static_cast<const char*>(*ready);
    }
    absl::StatusOr<uint64_t> checksum =
        WritePiece(file, tensors[p.tensor], data, p, file_offset, writeback);
    if (!checksum.ok()) {
      status[k] = checksum.status();
      return;
    }
    if (options.after_write) options.after_write(p.tensor, p.global_offset, p.length);
    out.chunks[k] = {p.tensor,
                     ManifestChunk{.rank = rank,
                                   .file = file_name,
                                   .global_offset = p.global_offset,
                                   .length = p.length,
                                   .file_offset = file_offset,
                                   .checksum = *checksum}};
  };
  if (options.pool != nullptr && plan.pieces.size() > 1) {
    options.pool->ParallelFor(plan.pieces.size(), write_one);
  } else {
    for (size_t k = 0; k < plan.pieces.size(); ++k) write_one(k);
  }
  writeback_queue.reset();  // joins its thread: nothing uses the file besides this one any more
  for (const absl::Status& s : status) FERRY_RETURN_IF_ERROR(s);
  if (options.fsync) {
    TraceSpan sync_span(tracer, "ckpt.fsync", "ckpt");
    sync_span.Detail(file_name);
    FERRY_RETURN_IF_ERROR(file.Sync());
  }
  FERRY_RETURN_IF_ERROR(file.Close());
  return out;
}

}  // namespace ferry
