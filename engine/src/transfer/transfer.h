// The transfer layer: chunked, pipelined copies between device memory and pinned host memory.
//
// A submission (DeviceToHost / HostToDevice) is a list of copy regions. Their concatenation is cut into
// chunks of TransferOptions::chunk_bytes; the copies go chunk by chunk onto a dedicated stream (one for
// D2H, one for H2D, so both directions run at once) and an event is recorded after each chunk, so a
// consumer can start on chunk 0 while the later chunks are still in flight. Many small regions share
// a chunk, and neighbouring regions that are contiguous on both sides become one copy.
// After warm-up a submission creates no stream, event, device or pinned memory and registers
// nothing: events come from a pool that batches return to (the batch's own bookkeeping, its regions
// and chunk plan, is ordinary heap memory).
#ifndef FERRY_TRANSFER_TRANSFER_H_
#define FERRY_TRANSFER_TRANSFER_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "device/device.h"

namespace ferry {

// One copy: `bytes` from `src` to `dst`. Which side is device memory depends on the submission.
struct CopyRegion {
  void* dst = nullptr;
  const void* src = nullptr;
  size_t bytes = 0;
};

// One piece of a chunk: bytes [offset, offset + bytes) of region `region`.
struct ChunkPiece {
  size_t region = 0;
  size_t offset = 0;
  size_t bytes = 0;
};

// One chunk: bytes [begin, end) of the concatenation of all regions, as pieces of regions in order.
struct ChunkPlan {
  size_t begin = 0;
  size_t end = 0;
  std::vector<ChunkPiece> pieces;

  size_t bytes() const { return end - begin; }
};

// Splits the concatenation of `regions` into chunks of `chunk_bytes` (the last one ragged). Many small
// regions coalesce into one chunk; a region may straddle chunks; zero-byte regions are skipped (they
// appear in no piece). No regions, or only empty ones, give no chunks. Pure function.
// REQUIRES: chunk_bytes > 0.
std::vector<ChunkPlan> PlanChunks(absl::Span<const CopyRegion> regions, size_t chunk_bytes);

struct TransferOptions {
  // Bytes per chunk: one event each. Larger chunks cost fewer copies and events; smaller ones let a
  // consumer start sooner. `ferry bench transfer` measures the rate for a sweep of sizes (--sweep).
  // 32 MiB: measured on an H200 over PCIe Gen5 (ferry bench transfer), 97% of the pinned ceiling in
  // each direction and with both at once; 8 MiB chunks reach only 83% with both directions.
  size_t chunk_bytes = size_t{32} << 20;
};

// Counts since the Transfer was created.
struct TransferStats {
  uint64_t submissions = 0;  // DeviceToHost + HostToDevice calls that enqueued something
  uint64_t chunks = 0;
  uint64_t copies = 0;       // Device::CopyAsync calls (contiguous neighbours merged)
  uint64_t d2h_bytes = 0;
  uint64_t h2d_bytes = 0;
  uint64_t events_created = 0;  // flat once the pool is warm
};

namespace transfer_internal {
class EventPool;
}  // namespace transfer_internal

// The copies of one submission, with one event per chunk.
// Thread-safety: one thread at a time. Different batches may be used from different threads.
class TransferBatch final {
 public:
  // Returns the chunk events to their Transfer's pool. Does not wait: copies still in flight keep
  // running, and their memory must stay valid until they finish (Wait first when unsure).
  ~TransferBatch();
  TransferBatch(const TransferBatch&) = delete;
  TransferBatch& operator=(const TransferBatch&) = delete;

  CopyKind kind() const { return kind_; }
  // The submission's regions (copied; the memory they point to is the caller's).
  const std::vector<CopyRegion>& regions() const { return regions_; }
  size_t num_chunks() const { return chunks_.size(); }
  // REQUIRES: k < num_chunks().
  const ChunkPlan& chunk(size_t k) const;
  // Recorded on the transfer stream right after chunk k's copies (and after those of every earlier
  // chunk: one stream, so chunk events complete in order). Another stream may WaitFor it.
  // The reference is valid while this batch lives. REQUIRES: k < num_chunks().
  Event& chunk_event(size_t k);

  // Blocks the calling thread until chunk k has landed. OutOfRange for k >= num_chunks(); otherwise
  // the first asynchronous error of the stream, if any.
  absl::Status WaitChunk(size_t k);
  // Whether chunk k has landed, without blocking. OutOfRange for k >= num_chunks().
  absl::StatusOr<bool> ChunkDone(size_t k);
  // Blocks until every chunk has landed (OK at once for a batch without chunks).
  absl::Status Wait();
  // Makes work enqueued on `stream` after this call wait for the whole batch (nothing for an empty
  // batch). `stream` need not outlive the batch.
  absl::Status MakeStreamWait(Stream& stream);

  // Total bytes copied by the batch.
  uint64_t bytes() const { return bytes_; }

 private:
  friend class Transfer;
  TransferBatch(CopyKind kind, std::vector<CopyRegion> regions, std::vector<ChunkPlan> chunks,
                std::vector<std::unique_ptr<Event>> events,
                std::shared_ptr<transfer_internal::EventPool> pool);

  const CopyKind kind_;
  const std::vector<CopyRegion> regions_;
  const std::vector<ChunkPlan> chunks_;
  std::vector<std::unique_ptr<Event>> events_;  // one per chunk
  std::shared_ptr<transfer_internal::EventPool> pool_;
  uint64_t bytes_ = 0;
};

// Transfer owns the D2H and H2D streams and a pool of chunk events.
// Thread-safety: one thread at a time (submissions). Batches may outlive the Transfer; the device
// must outlive both.
class Transfer final {
 public:
  // Creates the two streams on `device`. InvalidArgument for a null device or chunk_bytes == 0.
  // REQUIRES: `device` outlives the Transfer and every batch it returns.
  static absl::StatusOr<std::unique_ptr<Transfer>> Create(Device* device,
                                                          const TransferOptions& options = {});
  // Waits for both streams to drain (logging their errors), then destroys them.
  ~Transfer();
  Transfer(const Transfer&) = delete;
  Transfer& operator=(const Transfer&) = delete;

  // Enqueues the copies (src: device memory, dst: host memory) chunk by chunk on the D2H stream and
  // records one event per chunk. If `after` is given, the stream first waits for it (for example
  // "grads are ready", recorded on the trainer's stream); `after` need not outlive the call. A
  // submission without bytes enqueues nothing and returns a batch without chunks. Returns
  // without waiting for the copies. REQUIRES: the regions' memory stays valid until the batch has
  // completed; host memory should come from a PinnedArena (pageable memory makes CUDA copies
  // synchronous). Errors: InvalidArgument for a region with bytes > 0 and a null pointer (nothing is
  // enqueued then); a device error while enqueueing, after which the stream has been drained so
  // nothing of the submission is in flight.
  absl::StatusOr<std::unique_ptr<TransferBatch>> DeviceToHost(absl::Span<const CopyRegion> regions,
                                                               Event* after = nullptr);
  // Same for host memory (src) to device memory (dst), on the H2D stream.
  absl::StatusOr<std::unique_ptr<TransferBatch>> HostToDevice(absl::Span<const CopyRegion> regions,
                                                              Event* after = nullptr);

  Stream& d2h_stream() { return *d2h_; }
  Stream& h2d_stream() { return *h2d_; }
  size_t chunk_bytes() const { return options_.chunk_bytes; }
  Device* device() const { return device_; }
  // Events created so far; stays flat once the pool is warm (batches return their events).
  uint64_t events_created() const;
  // Safe to call from any thread.
  TransferStats stats() const;

 private:
  Transfer(Device* device, const TransferOptions& options, std::unique_ptr<Stream> d2h,
           std::unique_ptr<Stream> h2d);
  absl::StatusOr<std::unique_ptr<TransferBatch>> Submit(CopyKind kind,
                                                        absl::Span<const CopyRegion> regions,
                                                        Event* after);

  Device* const device_;
  const TransferOptions options_;
  std::unique_ptr<Stream> d2h_;
  std::unique_ptr<Stream> h2d_;
  std::shared_ptr<transfer_internal::EventPool> pool_;
  std::atomic<uint64_t> submissions_{0};
  std::atomic<uint64_t> chunks_{0};
  std::atomic<uint64_t> copies_{0};
  std::atomic<uint64_t> d2h_bytes_{0};
  std::atomic<uint64_t> h2d_bytes_{0};
};

}  // namespace ferry

#endif  // FERRY_TRANSFER_TRANSFER_H_
