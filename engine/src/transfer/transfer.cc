#include "transfer/transfer.h"

#include <algorithm>
#include <string>
#include <utility>

#include <mutex>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "ferry/status.h"

namespace ferry {
namespace transfer_internal {

// Chunk events, reused across batches so that steady-state submissions create none.
// Safe for concurrent use (a batch may be destroyed on another thread than the one submitting).
class EventPool final {
 public:
  explicit EventPool(Device* device) : device_(device) {}

  // `n` events, from the pool first. On error the events taken so far go back to the pool.
  absl::StatusOr<std::vector<std::unique_ptr<Event>>> Acquire(size_t n) {
    std::vector<std::unique_ptr<Event>> events;
    events.reserve(n);
    {
      std::lock_guard<std::mutex> lock(mu_);
      while (events.size() < n && !free_.empty()) {
        events.push_back(std::move(free_.back()));
        free_.pop_back();
      }
    }
    while (events.size() < n) {
      absl::StatusOr<std::unique_ptr<Event>> event = device_->CreateEvent();
      if (!event.ok()) {
        Return(std::move(events));
        return absl::Status(event.status().code(),
                            absl::StrCat("creating a chunk event: ", event.status().message()));
      }
      events.push_back(*std::move(event));
      std::lock_guard<std::mutex> lock(mu_);
      ++created_;
    }
    return events;
  }

  void Return(std::vector<std::unique_ptr<Event>> events) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& e : events) free_.push_back(std::move(e));
  }

  uint64_t created() const {
    std::lock_guard<std::mutex> lock(mu_);
    return created_;
  }

 private:
  Device* const device_;
  mutable std::mutex mu_;  // std::mutex: TSan sees it (Debian's Abseil is not TSan-built)
  std::vector<std::unique_ptr<Event>> free_ ABSL_GUARDED_BY(mu_);
  uint64_t created_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace transfer_internal

namespace {

const char* KindName(CopyKind kind) {
  switch (kind) {
    case CopyKind::kDeviceToHost: return "D2H";
    case CopyKind::kHostToDevice: return "H2D";
    case CopyKind::kDeviceToDevice: return "D2D";
    case CopyKind::kHostToHost: return "H2H";
  }
  return "copy";
}

}  // namespace

std::vector<ChunkPlan> PlanChunks(absl::Span<const CopyRegion> regions, size_t chunk_bytes) {
  FERRY_CHECK(chunk_bytes > 0) << "PlanChunks: chunk_bytes must be > 0";
  std::vector<ChunkPlan> chunks;
  ChunkPlan current;
  size_t pos = 0;  // global offset of the next byte
  for (size_t r = 0; r < regions.size(); ++r) {
    size_t offset = 0;
    while (offset < regions[r].bytes) {
      const size_t take = std::min(regions[r].bytes - offset, chunk_bytes - current.bytes());
      current.pieces.push_back(ChunkPiece{.region = r, .offset = offset, .bytes = take});
      offset += take;
      pos += take;
      current.end = pos;
      if (current.bytes() == chunk_bytes) {
        chunks.push_back(std::move(current));
        current = ChunkPlan{.begin = pos, .end = pos, .pieces = {}};
      }
    }
  }
  if (current.bytes() > 0) chunks.push_back(std::move(current));
  return chunks;
}

// ---- TransferBatch ---------------------------------------------------------------------------------

TransferBatch::TransferBatch(CopyKind kind, std::vector<CopyRegion> regions,
                             std::vector<ChunkPlan> chunks,
                             std::vector<std::unique_ptr<Event>> events,
                             std::shared_ptr<transfer_internal::EventPool> pool)
    : kind_(kind),
      regions_(std::move(regions)),
      chunks_(std::move(chunks)),
      events_(std::move(events)),
      pool_(std::move(pool)) {
  for (const ChunkPlan& c : chunks_) bytes_ += c.bytes();
}

TransferBatch::~TransferBatch() {
  if (pool_ != nullptr) pool_->Return(std::move(events_));
}

const ChunkPlan& TransferBatch::chunk(size_t k) const {
  FERRY_CHECK(k < chunks_.size()) << "TransferBatch::chunk(" << k << ") of " << chunks_.size();
  return chunks_[k];
}

Event& TransferBatch::chunk_event(size_t k) {
  FERRY_CHECK(k < events_.size())
      << "TransferBatch::chunk_event(" << k << ") of " << events_.size();
  return *events_[k];
}

absl::Status TransferBatch::WaitChunk(size_t k) {
  if (k >= events_.size()) {
    return absl::OutOfRangeError(
        absl::StrCat(KindName(kind_), " batch: chunk ", k, " of ", events_.size()));
  }
  absl::Status s = events_[k]->Synchronize();
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat(KindName(kind_), " batch: waiting for chunk ", k,
                                               " of ", events_.size(), ": ", s.message()));
  }
  return s;
}

absl::StatusOr<bool> TransferBatch::ChunkDone(size_t k) {
  if (k >= events_.size()) {
    return absl::OutOfRangeError(
        absl::StrCat(KindName(kind_), " batch: chunk ", k, " of ", events_.size()));
  }
  return events_[k]->Query();
}

absl::Status TransferBatch::Wait() {
  // The chunks complete in order (one stream), but waiting on each surfaces the first error.
  for (size_t k = 0; k < events_.size(); ++k) FERRY_RETURN_IF_ERROR(WaitChunk(k));
  return absl::OkStatus();
}

absl::Status TransferBatch::MakeStreamWait(Stream& stream) {
  if (events_.empty()) return absl::OkStatus();
  return stream.WaitFor(*events_.back());
}

// ---- Transfer --------------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<Transfer>> Transfer::Create(Device* device,
                                                           const TransferOptions& options) {
  if (device == nullptr) return absl::InvalidArgumentError("Transfer: device is null");
  if (options.chunk_bytes == 0) {
    return absl::InvalidArgumentError("Transfer: chunk_bytes is 0; expected > 0");
  }
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Stream> d2h, device->CreateStream());
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Stream> h2d, device->CreateStream());
  return std::unique_ptr<Transfer>(new Transfer(device, options, std::move(d2h), std::move(h2d)));
}

Transfer::Transfer(Device* device, const TransferOptions& options, std::unique_ptr<Stream> d2h,
                   std::unique_ptr<Stream> h2d)
    : device_(device),
      options_(options),
      d2h_(std::move(d2h)),
      h2d_(std::move(h2d)),
      pool_(std::make_shared<transfer_internal::EventPool>(device)) {}

Transfer::~Transfer() {
  for (Stream* s : {d2h_.get(), h2d_.get()}) {
    if (absl::Status status = s->Synchronize(); !status.ok()) {
      FERRY_LOG(ERROR) << "Transfer: draining a stream at destruction: " << status;
    }
  }
}

uint64_t Transfer::events_created() const { return pool_->created(); }

TransferStats Transfer::stats() const {
  return TransferStats{.submissions = submissions_.load(std::memory_order_relaxed),
                       .chunks = chunks_.load(std::memory_order_relaxed),
                       .copies = copies_.load(std::memory_order_relaxed),
                       .d2h_bytes = d2h_bytes_.load(std::memory_order_relaxed),
                       .h2d_bytes = h2d_bytes_.load(std::memory_order_relaxed),
                       .events_created = pool_->created()};
}

absl::StatusOr<std::unique_ptr<TransferBatch>> Transfer::DeviceToHost(
    absl::Span<const CopyRegion> regions, Event* after) {
  return Submit(CopyKind::kDeviceToHost, regions, after);
}

absl::StatusOr<std::unique_ptr<TransferBatch>> Transfer::HostToDevice(
    absl::Span<const CopyRegion> regions, Event* after) {
  return Submit(CopyKind::kHostToDevice, regions, after);
}

absl::StatusOr<std::unique_ptr<TransferBatch>> Transfer::Submit(
    CopyKind kind, absl::Span<const CopyRegion> regions, Event* after) {
  for (size_t r = 0; r < regions.size(); ++r) {
    if (regions[r].bytes > 0 && (regions[r].dst == nullptr || regions[r].src == nullptr)) {
      return absl::InvalidArgumentError(
          absl::StrCat(KindName(kind), " region ", r, " of ", regions.size(), ": ",
                       regions[r].bytes, " bytes with a null ",
                       regions[r].dst == nullptr ? "dst" : "src", " pointer"));
    }
  }
  std::vector<ChunkPlan> chunks = PlanChunks(regions, options_.chunk_bytes);
  // Take every event before enqueueing anything, so that running out of events enqueues nothing.
  FERRY_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Event>> events, pool_->Acquire(chunks.size()));
  auto batch = std::unique_ptr<TransferBatch>(
      new TransferBatch(kind, std::vector<CopyRegion>(regions.begin(), regions.end()),
                        std::move(chunks), std::move(events), pool_));
  if (batch->num_chunks() == 0) return batch;

  Stream& stream = kind == CopyKind::kDeviceToHost ? *d2h_ : *h2d_;
  // On an enqueue error, drain the stream so that nothing of this submission is left in flight
  // (the caller gets no batch to wait on), and say where it stopped.
  auto fail = [&](const absl::Status& s, const std::string& where) {
    if (absl::Status drained = stream.Synchronize(); !drained.ok()) {
      FERRY_LOG(ERROR) << "Transfer: draining the " << KindName(kind)
                       << " stream after an error: " << drained;
    }
    return absl::Status(s.code(), absl::StrCat(KindName(kind), " ", where, ": ", s.message()));
  };
  if (after != nullptr) {
    if (absl::Status s = stream.WaitFor(*after); !s.ok()) return fail(s, "waiting for `after`");
  }
  uint64_t copies = 0;
  for (size_t k = 0; k < batch->num_chunks(); ++k) {
    const std::vector<ChunkPiece>& pieces = batch->chunk(k).pieces;
    for (size_t i = 0; i < pieces.size();) {
      // One copy for a run of pieces that are contiguous in both source and destination.
      const ChunkPiece& first = pieces[i];
      char* dst = static_cast<char*>(regions[first.region].dst) + first.offset;
      const char* src = static_cast<const char*>(regions[first.region].src) + first.offset;
      size_t bytes = first.bytes;
      size_t j = i + 1;
      for (; j < pieces.size(); ++j) {
        const CopyRegion& next = regions[pieces[j].region];
        char* next_dst = static_cast<char*>(next.dst) + pieces[j].offset;
        const char* next_src = static_cast<const char*>(next.src) + pieces[j].offset;
        if (next_dst != dst + bytes || next_src != src + bytes) break;
        // Adjacent device memory may still be two allocations, which one copy must not span.
        const bool device_is_dst = kind == CopyKind::kHostToDevice;
        if (!device_->SameAllocation(device_is_dst ? dst : src, device_is_dst ? next_dst : next_src)) break;
        bytes += pieces[j].bytes;
      }
      if (absl::Status s = device_->CopyAsync(dst, src, bytes, kind, stream); !s.ok()) {
        return fail(s, absl::StrCat("chunk ", k, " of ", batch->num_chunks(), " (region ",
                                    first.region, ", bytes [", first.offset, ", ",
                                    first.offset + first.bytes, ")",
                                    j - i > 1 ? absl::StrCat(" and ", j - i - 1,
                                                             " contiguous region(s) after it")
                                              : "",
                                    ")"));
      }
      ++copies;
      i = j;
    }
    if (absl::Status s = stream.Record(batch->chunk_event(k)); !s.ok()) {
      return fail(s, absl::StrCat("recording the event of chunk ", k));
    }
  }
  submissions_.fetch_add(1, std::memory_order_relaxed);
  chunks_.fetch_add(batch->num_chunks(), std::memory_order_relaxed);
  copies_.fetch_add(copies, std::memory_order_relaxed);
  (kind == CopyKind::kDeviceToHost ? d2h_bytes_ : h2d_bytes_)
      .fetch_add(batch->bytes(), std::memory_order_relaxed);
  return batch;
}

}  // namespace ferry
