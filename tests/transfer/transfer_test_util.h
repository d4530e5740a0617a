// Shared by transfer_test.cc (host backend) and transfer_gpu_test.cc (CUDA): the same checks run on
// both backends.
#ifndef FERRY_TESTS_TRANSFER_TRANSFER_TEST_UTIL_H_
#define FERRY_TESTS_TRANSFER_TRANSFER_TEST_UTIL_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "device/device.h"
#include "gtest/gtest.h"
#include "memory/pinned_arena.h"
#include "transfer/transfer.h"

namespace ferry::transfer_testing {

#define FERRY_TEST_ASSERT_OK(expr)                    \
  do {                                                \
    const absl::Status ferry_test_s_ = (expr);        \
    ASSERT_TRUE(ferry_test_s_.ok()) << ferry_test_s_; \
  } while (0)

constexpr uint8_t kHostSentinel = 0x5A;
constexpr uint8_t kDeviceSentinel = 0xA5;
constexpr size_t kGap = 64;  // untouched bytes between regions, to catch copies that overrun

// A gate that a stream can be made to wait on: Hold() enqueues a host function that blocks the
// stream until Open(). Opens itself on destruction so that a failing test never hangs a stream.
class Gate final {
 public:
  ~Gate() { Open(); }
  absl::Status Hold(Stream& stream) {
    return stream.EnqueueHost([this] {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return open_; });
    });
  }
  void Open() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }

 private:
  // std::mutex rather than absl::Notification: ThreadSanitizer cannot see Debian's Abseil.
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

// A Device that forwards everything to `inner`, except that the copy whose source is `gate_src`
// first holds its stream on `gate` (so one chunk of a batch can be held back while the earlier ones
// land). Safe for concurrent use, like the inner device.
class GatedDevice final : public Device {
 public:
  GatedDevice(Device* inner, const void* gate_src, Gate* gate)
      : inner_(inner), gate_src_(gate_src), gate_(gate) {}

  Backend backend() const override { return inner_->backend(); }
  std::string name() const override { return "gated " + inner_->name(); }
  absl::StatusOr<size_t> FreeMemory() override { return inner_->FreeMemory(); }
  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override { return inner_->Allocate(bytes); }
  void Free(void* data) override { inner_->Free(data); }
  absl::StatusOr<std::unique_ptr<Stream>> CreateStream() override { return inner_->CreateStream(); }
  absl::StatusOr<std::unique_ptr<Event>> CreateEvent() override { return inner_->CreateEvent(); }
  absl::StatusOr<std::unique_ptr<Stream>> WrapStream(void* native) override {
    return inner_->WrapStream(native);
  }
  absl::Status CopyAsync(void* dst, const void* src, size_t bytes, CopyKind kind,
                         Stream& stream) override {
    if (src == gate_src_) {
      absl::Status s = gate_->Hold(stream);
      if (!s.ok()) return s;
      gated_copies_.fetch_add(1);
    }
    return inner_->CopyAsync(dst, src, bytes, kind, stream);
  }
  absl::Status MemsetAsync(void* dst, uint8_t value, size_t bytes, Stream& stream) override {
    return inner_->MemsetAsync(dst, value, bytes, stream);
  }
  absl::Status RegisterHost(void* data, size_t bytes) override {
    return inner_->RegisterHost(data, bytes);
  }
  absl::Status UnregisterHost(void* data) override { return inner_->UnregisterHost(data); }
  uint64_t host_registrations() const override { return inner_->host_registrations(); }
  bool SameAllocation(const void* a, const void* b) override { return inner_->SameAllocation(a, b); }
  absl::Status LaunchAdam(absl::Span<const AdamTensorArgs> tensors,
                          absl::Span<const AdamScalars> scalars, Stream& stream) override {
    return inner_->LaunchAdam(tensors, scalars, stream);
  }
  absl::Status LaunchConvert(void* dst, DType dst_dtype, const void* src, DType src_dtype,
                             int64_t numel, Stream& stream) override {
    return inner_->LaunchConvert(dst, dst_dtype, src, src_dtype, numel, stream);
  }

  int gated_copies() const { return gated_copies_.load(); }

 private:
  Device* const inner_;
  const void* const gate_src_;
  Gate* const gate_;
  std::atomic<int> gated_copies_{0};
};

// A Device that forwards everything to `inner` and counts the calls that create or register
// something (memory, streams, events, registrations) and the copies. Safe for concurrent use.
class CountingDevice final : public Device {
 public:
  explicit CountingDevice(Device* inner) : inner_(inner) {}

  // The calls that allocate, free, create or register anything.
  uint64_t resource_calls() const { return resource_calls_.load(); }
  uint64_t copies() const { return copies_.load(); }

  Backend backend() const override { return inner_->backend(); }
  std::string name() const override { return "counting " + inner_->name(); }
  absl::StatusOr<size_t> FreeMemory() override { return inner_->FreeMemory(); }
  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override {
    ++resource_calls_;
    return inner_->Allocate(bytes);  // the buffer frees through `inner` (not counted: no hot path)
  }
  void Free(void* data) override {
    ++resource_calls_;
    inner_->Free(data);
  }
  absl::StatusOr<std::unique_ptr<Stream>> CreateStream() override {
    ++resource_calls_;
    return inner_->CreateStream();
  }
  absl::StatusOr<std::unique_ptr<Event>> CreateEvent() override {
    ++resource_calls_;
    return inner_->CreateEvent();
  }
  absl::StatusOr<std::unique_ptr<Stream>> WrapStream(void* native) override {
    ++resource_calls_;
    return inner_->WrapStream(native);
  }
  absl::Status CopyAsync(void* dst, const void* src, size_t bytes, CopyKind kind,
                         Stream& stream) override {
    ++copies_;
    return inner_->CopyAsync(dst, src, bytes, kind, stream);
  }
  absl::Status MemsetAsync(void* dst, uint8_t value, size_t bytes, Stream& stream) override {
    return inner_->MemsetAsync(dst, value, bytes, stream);
  }
  absl::Status RegisterHost(void* data, size_t bytes) override {
    ++resource_calls_;
    return inner_->RegisterHost(data, bytes);
  }
  absl::Status UnregisterHost(void* data) override {
    ++resource_calls_;
    return inner_->UnregisterHost(data);
  }
  uint64_t host_registrations() const override { return inner_->host_registrations(); }
  bool SameAllocation(const void* a, const void* b) override {
    // A boundary set by the test splits one real allocation into two as far as copies can tell.
    const char* cut = boundary_.load();
    const char *lo = static_cast<const char*>(std::min(a, b)), *hi = static_cast<const char*>(std::max(a, b));
    if (cut != nullptr && lo < cut && cut <= hi) return false;
    return inner_->SameAllocation(a, b);
  }
  void set_allocation_boundary(const char* cut) { boundary_.store(cut); }
  absl::Status LaunchAdam(absl::Span<const AdamTensorArgs> tensors,
                          absl::Span<const AdamScalars> scalars, Stream& stream) override {
    return inner_->LaunchAdam(tensors, scalars, stream);
  }
  absl::Status LaunchConvert(void* dst, DType dst_dtype, const void* src, DType src_dtype,
                             int64_t numel, Stream& stream) override {
    return inner_->LaunchConvert(dst, dst_dtype, src, src_dtype, numel, stream);
  }

 private:
  Device* const inner_;
  std::atomic<uint64_t> resource_calls_{0};
  std::atomic<uint64_t> copies_{0};
  std::atomic<const char*> boundary_{nullptr};
};

inline void FillRandom(void* data, size_t bytes, std::mt19937_64& rng) {
  auto* p = static_cast<uint8_t*>(data);
  for (size_t i = 0; i < bytes; ++i) p[i] = static_cast<uint8_t>(rng());
}

// Whether chunk k of `batch` completes within `patience`. Used only to catch a wait that is NOT
// honoured (it would complete at once); a correct implementation makes this return false whatever
// the machine's speed, so the check cannot fail spuriously.
inline bool CompletesWithin(TransferBatch& batch, size_t k, absl::Duration patience) {
  const absl::Time deadline = absl::Now() + patience;
  while (absl::Now() < deadline) {
    absl::StatusOr<bool> done = batch.ChunkDone(k);
    if (!done.ok() || *done) return true;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return false;
}

// Region layouts that hit every chunk-size edge for chunk size `c`.
inline std::vector<std::vector<size_t>> EdgeLayouts(size_t c, std::mt19937_64& rng) {
  std::vector<std::vector<size_t>> layouts = {
      {1}, {c - 1}, {c}, {c + 1}, {7 * c + 13},  // single regions
      {c, c},                                     // exact multiple over two regions
      {c / 2, c, c / 2 + 3},                      // the middle region straddles chunks
      {0, 5, 0, 0, c, 0},                         // zero-size regions are skipped
      {0, 0},                                     // nothing to copy
  };
  std::vector<size_t> many_small(300);
  for (size_t& s : many_small) s = 1 + rng() % (c / 16 + 1);  // coalesce into few chunks
  layouts.push_back(many_small);
  return layouts;
}

// Copies random bytes host -> device -> host through `transfer`, for the regions `sizes` laid out
// with gaps, and checks: bit-exact data, the chunk count, the byte count, and no byte written outside
// the regions (on the device or on the host).
inline void RoundTrip(Device& device, PinnedArena& arena, Transfer& transfer,
                      const std::vector<size_t>& sizes, std::mt19937_64& rng) {
  size_t total = 0;
  size_t span = kGap;
  std::vector<size_t> offsets;
  for (size_t s : sizes) {
    offsets.push_back(span);
    span += s + kGap;
    total += s;
  }
  const size_t c = transfer.chunk_bytes();
  absl::StatusOr<PinnedBlock> src = PinnedBlock::Allocate(arena, span);
  absl::StatusOr<PinnedBlock> dst = PinnedBlock::Allocate(arena, span);
  ASSERT_TRUE(src.ok()) << src.status();
  ASSERT_TRUE(dst.ok()) << dst.status();
  absl::StatusOr<DeviceBuffer> dev = device.Allocate(span);
  ASSERT_TRUE(dev.ok()) << dev.status();

  FillRandom(src->data(), span, rng);
  std::memset(dst->data(), kHostSentinel, span);
  std::vector<uint8_t> sentinel(span, kDeviceSentinel);
  FERRY_TEST_ASSERT_OK(device.Copy(dev->data(), sentinel.data(), span, CopyKind::kHostToDevice));

  std::vector<CopyRegion> up, down;
  for (size_t i = 0; i < sizes.size(); ++i) {
    up.push_back({dev->as<char>() + offsets[i], src->as<char>() + offsets[i], sizes[i]});
    down.push_back({dst->as<char>() + offsets[i], dev->as<char>() + offsets[i], sizes[i]});
  }
  absl::StatusOr<std::unique_ptr<TransferBatch>> h2d = transfer.HostToDevice(up);
  ASSERT_TRUE(h2d.ok()) << h2d.status();
  EXPECT_EQ((*h2d)->num_chunks(), (total + c - 1) / c);
  EXPECT_EQ((*h2d)->bytes(), total);
  EXPECT_EQ((*h2d)->kind(), CopyKind::kHostToDevice);
  FERRY_TEST_ASSERT_OK((*h2d)->Wait());

  // The download waits for the upload's last chunk on the device, not on the host.
  TransferBatch& upload = **h2d;
  Event* uploaded =
      upload.num_chunks() > 0 ? &upload.chunk_event(upload.num_chunks() - 1) : nullptr;
  absl::StatusOr<std::unique_ptr<TransferBatch>> d2h = transfer.DeviceToHost(down, uploaded);
  ASSERT_TRUE(d2h.ok()) << d2h.status();
  EXPECT_EQ((*d2h)->num_chunks(), (total + c - 1) / c);
  EXPECT_EQ((*d2h)->bytes(), total);
  // Chunk by chunk, as a consumer would.
  for (size_t k = 0; k < (*d2h)->num_chunks(); ++k) {
    FERRY_TEST_ASSERT_OK((*d2h)->WaitChunk(k));
    for (const ChunkPiece& p : (*d2h)->chunk(k).pieces) {
      ASSERT_EQ(std::memcmp(dst->as<char>() + offsets[p.region] + p.offset,
                            src->as<char>() + offsets[p.region] + p.offset, p.bytes),
                0)
          << "chunk " << k << " region " << p.region << " offset " << p.offset;
    }
  }
  FERRY_TEST_ASSERT_OK((*d2h)->Wait());

  // Bit-exact, and nothing outside the regions was touched (host side).
  size_t pos = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    for (; pos < offsets[i]; ++pos) {
      ASSERT_EQ(dst->as<uint8_t>()[pos], kHostSentinel) << "host gap byte " << pos;
    }
    ASSERT_EQ(std::memcmp(dst->as<char>() + offsets[i], src->as<char>() + offsets[i], sizes[i]), 0)
        << "region " << i << " of " << sizes[i] << " bytes";
    pos += sizes[i];
  }
  for (; pos < span; ++pos) ASSERT_EQ(dst->as<uint8_t>()[pos], kHostSentinel) << "host tail " << pos;

  // Device side: read the whole buffer back; the gaps still hold the device sentinel.
  std::vector<uint8_t> back(span);
  FERRY_TEST_ASSERT_OK(device.Copy(back.data(), dev->data(), span, CopyKind::kDeviceToHost));
  pos = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    for (; pos < offsets[i]; ++pos) ASSERT_EQ(back[pos], kDeviceSentinel) << "device gap " << pos;
    pos += sizes[i];
  }
  for (; pos < span; ++pos) ASSERT_EQ(back[pos], kDeviceSentinel) << "device tail " << pos;
}

// Chunk events complete in order and independently: with chunk 2 held back on the stream, a
// consumer waits for chunks 0 and 1 and reads their data while chunks 2 and 3 have not landed.
inline void ChunkEventsIndependent(Device& inner, size_t chunk_bytes, std::mt19937_64& rng) {
  const size_t total = 4 * chunk_bytes;
  absl::StatusOr<DeviceBuffer> dev = inner.Allocate(total);
  ASSERT_TRUE(dev.ok()) << dev.status();
  Gate gate;
  GatedDevice device(&inner, dev->as<char>() + 2 * chunk_bytes, &gate);
  PinnedArenaOptions options;
  options.capacity_bytes = 2 * total;
  options.numa = NumaPolicy::kLocal;
  options.name = "chunk events";
  absl::StatusOr<std::unique_ptr<PinnedArena>> arena = PinnedArena::Create(&device, options);
  ASSERT_TRUE(arena.ok()) << arena.status();
  absl::StatusOr<std::unique_ptr<Transfer>> transfer =
      Transfer::Create(&device, TransferOptions{.chunk_bytes = chunk_bytes});
  ASSERT_TRUE(transfer.ok()) << transfer.status();
  {
    // Opens the gate before anything that waits for the streams is destroyed, should an ASSERT fail.
    absl::Cleanup open_gate = [&gate] { gate.Open(); };
    absl::StatusOr<PinnedBlock> expected = PinnedBlock::Allocate(**arena, total);
    absl::StatusOr<PinnedBlock> got = PinnedBlock::Allocate(**arena, total);
    ASSERT_TRUE(expected.ok() && got.ok());
    FillRandom(expected->data(), total, rng);
    std::memset(got->data(), kHostSentinel, total);
    FERRY_TEST_ASSERT_OK(
        inner.Copy(dev->data(), expected->data(), total, CopyKind::kHostToDevice));

    // One region over four chunks; the copy of chunk 2 is held back by the gate.
    const CopyRegion region{got->data(), dev->data(), total};
    absl::StatusOr<std::unique_ptr<TransferBatch>> batch =
        (*transfer)->DeviceToHost(absl::MakeConstSpan(&region, 1));
    ASSERT_TRUE(batch.ok()) << batch.status();
    TransferBatch& b = **batch;
    ASSERT_EQ(b.num_chunks(), 4u);
    EXPECT_EQ(device.gated_copies(), 1);

    FERRY_TEST_ASSERT_OK(b.WaitChunk(0));
    FERRY_TEST_ASSERT_OK(b.WaitChunk(1));
    EXPECT_EQ(std::memcmp(got->data(), expected->data(), 2 * chunk_bytes), 0);
    // Held: chunk 2 and, behind it on the same stream, chunk 3 (in order).
    EXPECT_FALSE(*b.ChunkDone(2));
    EXPECT_FALSE(*b.ChunkDone(3));
    EXPECT_TRUE(*b.ChunkDone(0));
    EXPECT_TRUE(*b.ChunkDone(1));
    for (size_t i = 2 * chunk_bytes; i < total; ++i) {
      ASSERT_EQ(got->as<uint8_t>()[i], kHostSentinel) << "byte " << i << " landed early";
    }
    gate.Open();
    FERRY_TEST_ASSERT_OK(b.WaitChunk(3));
    EXPECT_TRUE(*b.ChunkDone(2));
    EXPECT_EQ(std::memcmp(got->data(), expected->data(), total), 0);
    EXPECT_EQ(b.WaitChunk(4).code(), absl::StatusCode::kOutOfRange);
  }
  transfer->reset();
}

// The `after` event is honoured: the copy does not start before the work it waits for. A producer
// stream, held by a gate, uploads new data to the source and records `after`; the download must
// deliver the new data, and none of it may land while the producer is held.
inline void AfterEventHonoured(Device& device, size_t chunk_bytes, std::mt19937_64& rng) {
  const size_t total = 3 * chunk_bytes + 17;
  PinnedArenaOptions options;
  options.capacity_bytes = 4 * total;
  options.numa = NumaPolicy::kLocal;
  options.name = "after";
  absl::StatusOr<std::unique_ptr<PinnedArena>> arena = PinnedArena::Create(&device, options);
  ASSERT_TRUE(arena.ok()) << arena.status();
  absl::StatusOr<std::unique_ptr<Transfer>> transfer =
      Transfer::Create(&device, TransferOptions{.chunk_bytes = chunk_bytes});
  ASSERT_TRUE(transfer.ok()) << transfer.status();
  absl::StatusOr<std::unique_ptr<Stream>> producer = device.CreateStream();
  ASSERT_TRUE(producer.ok()) << producer.status();
  absl::StatusOr<std::unique_ptr<Event>> ready = device.CreateEvent();
  ASSERT_TRUE(ready.ok()) << ready.status();
  absl::StatusOr<DeviceBuffer> dev = device.Allocate(total);
  ASSERT_TRUE(dev.ok()) << dev.status();
  {
    absl::StatusOr<PinnedBlock> old_data = PinnedBlock::Allocate(**arena, total);
    absl::StatusOr<PinnedBlock> new_data = PinnedBlock::Allocate(**arena, total);
    absl::StatusOr<PinnedBlock> got = PinnedBlock::Allocate(**arena, total);
    ASSERT_TRUE(old_data.ok() && new_data.ok() && got.ok());
    FillRandom(old_data->data(), total, rng);
    FillRandom(new_data->data(), total, rng);
    std::memset(got->data(), kHostSentinel, total);
    FERRY_TEST_ASSERT_OK(device.Copy(dev->data(), old_data->data(), total, CopyKind::kHostToDevice));

    Gate gate;
    FERRY_TEST_ASSERT_OK(gate.Hold(**producer));
    FERRY_TEST_ASSERT_OK(device.CopyAsync(dev->data(), new_data->data(), total,
                                          CopyKind::kHostToDevice, **producer));
    FERRY_TEST_ASSERT_OK((*producer)->Record(**ready));

    const CopyRegion region{got->data(), dev->data(), total};
    absl::StatusOr<std::unique_ptr<TransferBatch>> batch =
        (*transfer)->DeviceToHost(absl::MakeConstSpan(&region, 1), ready->get());
    ASSERT_TRUE(batch.ok()) << batch.status();
    EXPECT_FALSE(CompletesWithin(**batch, 0, absl::Milliseconds(200)))
        << "chunk 0 landed while the `after` event was still pending";
    for (size_t i = 0; i < total; ++i) {
      ASSERT_EQ(got->as<uint8_t>()[i], kHostSentinel) << "byte " << i << " landed early";
    }
    gate.Open();
    FERRY_TEST_ASSERT_OK((*batch)->Wait());
    EXPECT_EQ(std::memcmp(got->data(), new_data->data(), total), 0)
        << "the download did not see the upload it was told to wait for";

    // The same for an upload: it waits for the producer's download of what it overwrites.
    Gate gate2;
    std::memset(got->data(), kHostSentinel, total);
    FERRY_TEST_ASSERT_OK(gate2.Hold(**producer));
    FERRY_TEST_ASSERT_OK(device.CopyAsync(got->data(), dev->data(), total,
                                          CopyKind::kDeviceToHost, **producer));
    FERRY_TEST_ASSERT_OK((*producer)->Record(**ready));
    const CopyRegion up{dev->data(), old_data->data(), total};
    absl::StatusOr<std::unique_ptr<TransferBatch>> upload =
        (*transfer)->HostToDevice(absl::MakeConstSpan(&up, 1), ready->get());
    ASSERT_TRUE(upload.ok()) << upload.status();
    EXPECT_FALSE(CompletesWithin(**upload, 0, absl::Milliseconds(200)))
        << "the upload started before the `after` event";
    gate2.Open();
    FERRY_TEST_ASSERT_OK((*upload)->Wait());
    FERRY_TEST_ASSERT_OK((*producer)->Synchronize());
    // The producer read the device before the upload replaced it: it saw new_data.
    EXPECT_EQ(std::memcmp(got->data(), new_data->data(), total), 0);
    std::vector<uint8_t> back(total);
    FERRY_TEST_ASSERT_OK(device.Copy(back.data(), dev->data(), total, CopyKind::kDeviceToHost));
    EXPECT_EQ(std::memcmp(back.data(), old_data->data(), total), 0);
  }
  transfer->reset();
}

// Regions contiguous on both sides but in two device allocations (CUDA refuses one copy across them)
// stay separate copies, and the data round-trips. `split` allocates two pieces of device memory of
// `bytes` each that the device sees as two allocations, the second right after the first, or returns
// false (then the test is skipped by the caller).
inline void AdjacentAllocationsAreNotMerged(CountingDevice& device, char* first, char* second, size_t bytes,
                                            std::mt19937_64& rng) {
  ASSERT_EQ(first + bytes, second);
  PinnedArenaOptions options;
  options.capacity_bytes = 4 * bytes + 4096;
  options.numa = NumaPolicy::kLocal;
  options.name = "adjacent";
  absl::StatusOr<std::unique_ptr<PinnedArena>> arena = PinnedArena::Create(&device, options);
  ASSERT_TRUE(arena.ok()) << arena.status();
  absl::StatusOr<std::unique_ptr<Transfer>> transfer =
      Transfer::Create(&device, TransferOptions{.chunk_bytes = 4 * bytes});  // both regions in one chunk
  ASSERT_TRUE(transfer.ok()) << transfer.status();
  absl::StatusOr<PinnedBlock> src = PinnedBlock::Allocate(**arena, 2 * bytes);
  absl::StatusOr<PinnedBlock> dst = PinnedBlock::Allocate(**arena, 2 * bytes);
  ASSERT_TRUE(src.ok() && dst.ok());
  FillRandom(src->data(), 2 * bytes, rng);
  std::memset(dst->data(), kHostSentinel, 2 * bytes);
  const std::vector<CopyRegion> up = {{first, src->as<char>(), bytes}, {second, src->as<char>() + bytes, bytes}};
  const std::vector<CopyRegion> down = {{dst->as<char>(), first, bytes}, {dst->as<char>() + bytes, second, bytes}};
  const uint64_t copies0 = device.copies();
  absl::StatusOr<std::unique_ptr<TransferBatch>> h2d = (*transfer)->HostToDevice(up);
  ASSERT_TRUE(h2d.ok()) << h2d.status();
  FERRY_TEST_ASSERT_OK((*h2d)->Wait());
  absl::StatusOr<std::unique_ptr<TransferBatch>> d2h = (*transfer)->DeviceToHost(down);
  ASSERT_TRUE(d2h.ok()) << d2h.status();
  FERRY_TEST_ASSERT_OK((*d2h)->Wait());
  EXPECT_EQ(device.copies() - copies0, 4u) << "one copy per allocation, each way";
  EXPECT_EQ(std::memcmp(dst->data(), src->data(), 2 * bytes), 0);
}

// Neighbouring regions that are contiguous on both sides become one copy per chunk; regions that are
// not stay separate copies. Data round-trips bit-exactly either way.
inline void ContiguousRegionsMerge(Device& inner, size_t chunk_bytes, std::mt19937_64& rng) {
  CountingDevice device(&inner);
  const std::vector<size_t> sizes = {100, 1, chunk_bytes, 3 * chunk_bytes + 7, 50, chunk_bytes / 2};
  std::vector<size_t> offsets;
  size_t total = 0;
  for (size_t size : sizes) {
    offsets.push_back(total);
    total += size;
  }
  PinnedArenaOptions options;
  options.capacity_bytes = 3 * total + 4096;
  options.numa = NumaPolicy::kLocal;
  options.name = "merge";
  absl::StatusOr<std::unique_ptr<PinnedArena>> arena = PinnedArena::Create(&device, options);
  ASSERT_TRUE(arena.ok()) << arena.status();
  absl::StatusOr<std::unique_ptr<Transfer>> transfer =
      Transfer::Create(&device, TransferOptions{.chunk_bytes = chunk_bytes});
  ASSERT_TRUE(transfer.ok()) << transfer.status();
  absl::StatusOr<DeviceBuffer> dev = device.Allocate(total);
  ASSERT_TRUE(dev.ok()) << dev.status();
  {
    absl::StatusOr<PinnedBlock> src = PinnedBlock::Allocate(**arena, total);
    absl::StatusOr<PinnedBlock> dst = PinnedBlock::Allocate(**arena, total);
    ASSERT_TRUE(src.ok() && dst.ok());
    FillRandom(src->data(), total, rng);
    std::memset(dst->data(), kHostSentinel, total);

    std::vector<CopyRegion> up, down;
    for (size_t i = 0; i < sizes.size(); ++i) {
      up.push_back({dev->as<char>() + offsets[i], src->as<char>() + offsets[i], sizes[i]});
      down.push_back({dst->as<char>() + offsets[i], dev->as<char>() + offsets[i], sizes[i]});
    }
    const uint64_t copies0 = device.copies();
    absl::StatusOr<std::unique_ptr<TransferBatch>> h2d = (*transfer)->HostToDevice(up);
    ASSERT_TRUE(h2d.ok()) << h2d.status();
    FERRY_TEST_ASSERT_OK((*h2d)->Wait());
    const size_t chunks = (total + chunk_bytes - 1) / chunk_bytes;
    ASSERT_EQ((*h2d)->num_chunks(), chunks);
    EXPECT_EQ(device.copies() - copies0, chunks) << "contiguous regions: one copy per chunk";
    const uint64_t copies1 = device.copies();
    absl::StatusOr<std::unique_ptr<TransferBatch>> d2h = (*transfer)->DeviceToHost(down);
    ASSERT_TRUE(d2h.ok()) << d2h.status();
    FERRY_TEST_ASSERT_OK((*d2h)->Wait());
    EXPECT_EQ(device.copies() - copies1, chunks);
    EXPECT_EQ((*transfer)->stats().copies, 2 * chunks);
    EXPECT_EQ((*transfer)->stats().chunks, 2 * chunks);
    ASSERT_EQ(std::memcmp(dst->data(), src->data(), total), 0);

    // The same regions with the device side in reverse order: no two neighbours are contiguous
    // there, so every piece is its own copy.
    std::vector<CopyRegion> scattered;
    size_t dev_at = total;
    for (size_t i = 0; i < sizes.size(); ++i) {
      dev_at -= sizes[i];
      scattered.push_back({dev->as<char>() + dev_at, src->as<char>() + offsets[i], sizes[i]});
    }
    const uint64_t copies2 = device.copies();
    absl::StatusOr<std::unique_ptr<TransferBatch>> h2d2 = (*transfer)->HostToDevice(scattered);
    ASSERT_TRUE(h2d2.ok()) << h2d2.status();
    FERRY_TEST_ASSERT_OK((*h2d2)->Wait());
    size_t pieces = 0;
    for (size_t k = 0; k < (*h2d2)->num_chunks(); ++k) pieces += (*h2d2)->chunk(k).pieces.size();
    EXPECT_GT(pieces, chunks);
    EXPECT_EQ(device.copies() - copies2, pieces);
    std::vector<uint8_t> back(total);
    FERRY_TEST_ASSERT_OK(device.Copy(back.data(), dev->data(), total, CopyKind::kDeviceToHost));
    dev_at = total;
    for (size_t i = 0; i < sizes.size(); ++i) {
      dev_at -= sizes[i];
      ASSERT_EQ(std::memcmp(back.data() + dev_at, src->as<char>() + offsets[i], sizes[i]), 0)
          << "region " << i;
    }
  }
  transfer->reset();
}

// Both directions at once, each on its own stream: with the D2H stream held, an H2D submission still
// completes; the D2H completes once released. Both deliver their data.
inline void BothDirectionsAtOnce(Device& device, size_t chunk_bytes, std::mt19937_64& rng) {
  const size_t total = 5 * chunk_bytes + 3;
  PinnedArenaOptions options;
  options.capacity_bytes = 4 * total + 4096;
  options.numa = NumaPolicy::kLocal;
  options.name = "both";
  absl::StatusOr<std::unique_ptr<PinnedArena>> arena = PinnedArena::Create(&device, options);
  ASSERT_TRUE(arena.ok()) << arena.status();
  absl::StatusOr<std::unique_ptr<Transfer>> transfer =
      Transfer::Create(&device, TransferOptions{.chunk_bytes = chunk_bytes});
  ASSERT_TRUE(transfer.ok()) << transfer.status();
  absl::StatusOr<DeviceBuffer> dev_a = device.Allocate(total);
  absl::StatusOr<DeviceBuffer> dev_b = device.Allocate(total);
  ASSERT_TRUE(dev_a.ok() && dev_b.ok());
  {
    absl::StatusOr<PinnedBlock> a_expected = PinnedBlock::Allocate(**arena, total);
    absl::StatusOr<PinnedBlock> a_got = PinnedBlock::Allocate(**arena, total);
    absl::StatusOr<PinnedBlock> b_src = PinnedBlock::Allocate(**arena, total);
    ASSERT_TRUE(a_expected.ok() && a_got.ok() && b_src.ok());
    FillRandom(a_expected->data(), total, rng);
    FillRandom(b_src->data(), total, rng);
    std::memset(a_got->data(), kHostSentinel, total);
    FERRY_TEST_ASSERT_OK(
        device.Copy(dev_a->data(), a_expected->data(), total, CopyKind::kHostToDevice));

    Gate gate;
    absl::Cleanup open_gate = [&gate] { gate.Open(); };
    FERRY_TEST_ASSERT_OK(gate.Hold((*transfer)->d2h_stream()));
    const CopyRegion down{a_got->data(), dev_a->data(), total};
    const CopyRegion up{dev_b->data(), b_src->data(), total};
    absl::StatusOr<std::unique_ptr<TransferBatch>> d2h =
        (*transfer)->DeviceToHost(absl::MakeConstSpan(&down, 1));
    absl::StatusOr<std::unique_ptr<TransferBatch>> h2d =
        (*transfer)->HostToDevice(absl::MakeConstSpan(&up, 1));
    ASSERT_TRUE(d2h.ok() && h2d.ok());
    // The upload is not queued behind the held download (a generous bound, only to fail rather
    // than hang if it were).
    EXPECT_TRUE(CompletesWithin(**h2d, (*h2d)->num_chunks() - 1, absl::Seconds(60)))
        << "the H2D waited for the held D2H stream";
    EXPECT_FALSE(*(*d2h)->ChunkDone(0));
    gate.Open();
    FERRY_TEST_ASSERT_OK((*d2h)->Wait());
    FERRY_TEST_ASSERT_OK((*h2d)->Wait());
    EXPECT_EQ(std::memcmp(a_got->data(), a_expected->data(), total), 0);
    std::vector<uint8_t> back(total);
    FERRY_TEST_ASSERT_OK(device.Copy(back.data(), dev_b->data(), total, CopyKind::kDeviceToHost));
    EXPECT_EQ(std::memcmp(back.data(), b_src->data(), total), 0);
  }
  transfer->reset();
}

// After warm-up, cycles of arena allocations and releases and of D2H + H2D submissions at once (many
// small regions each) make no call that allocates, frees, creates or registers anything: not on the
// device (memory, streams, events, host registrations), not in the memory layer (mmap, RegisterHost),
// not in the Transfer's event pool. Every cycle's data is checked.
inline void NothingAllocatedAfterWarmUp(Device& inner, std::mt19937_64& rng) {
  constexpr size_t kChunk = 16 << 10;
  constexpr size_t kMax = 256 << 10;  // bytes per direction per cycle, at most
  constexpr int kCycles = 200;
  CountingDevice device(&inner);
  PinnedArenaOptions options;
  options.capacity_bytes = 4 * kMax;
  options.numa = NumaPolicy::kLocal;
  options.name = "steady state";
  absl::StatusOr<std::unique_ptr<PinnedArena>> arena = PinnedArena::Create(&device, options);
  ASSERT_TRUE(arena.ok()) << arena.status();
  absl::StatusOr<std::unique_ptr<Transfer>> transfer =
      Transfer::Create(&device, TransferOptions{.chunk_bytes = kChunk});
  ASSERT_TRUE(transfer.ok()) << transfer.status();
  absl::StatusOr<DeviceBuffer> dev_a = device.Allocate(kMax);
  absl::StatusOr<DeviceBuffer> dev_b = device.Allocate(kMax);
  ASSERT_TRUE(dev_a.ok() && dev_b.ok());
  std::vector<uint8_t> a_data(kMax);
  FillRandom(a_data.data(), kMax, rng);
  FERRY_TEST_ASSERT_OK(device.Copy(dev_a->data(), a_data.data(), kMax, CopyKind::kHostToDevice));

  uint64_t resource_calls = 0, pinned_calls = 0, registrations = 0, events = 0;
  std::vector<CopyRegion> down, up;
  std::vector<uint8_t> back(kMax);
  for (int cycle = 0; cycle < kCycles; ++cycle) {
    // The first cycle is the largest (it warms the event pool); later ones are random.
    const size_t bytes = cycle == 0 ? kMax : 1 + rng() % kMax;
    absl::StatusOr<PinnedBlock> host_a = PinnedBlock::Allocate(**arena, bytes);
    absl::StatusOr<PinnedBlock> host_b = PinnedBlock::Allocate(**arena, bytes, 4096);
    ASSERT_TRUE(host_a.ok() && host_b.ok()) << "cycle " << cycle;
    FillRandom(host_b->data(), bytes, rng);
    std::memset(host_a->data(), kHostSentinel, bytes);
    // Cut both directions into random small regions (contiguous: they also merge).
    down.clear();
    up.clear();
    for (size_t at = 0; at < bytes;) {
      const size_t n = std::min(bytes - at, 1 + static_cast<size_t>(rng() % 5000));
      down.push_back({host_a->as<char>() + at, dev_a->as<char>() + at, n});
      up.push_back({dev_b->as<char>() + at, host_b->as<char>() + at, n});
      at += n;
    }
    absl::StatusOr<std::unique_ptr<TransferBatch>> d2h = (*transfer)->DeviceToHost(down);
    absl::StatusOr<std::unique_ptr<TransferBatch>> h2d = (*transfer)->HostToDevice(up);
    ASSERT_TRUE(d2h.ok()) << d2h.status();
    ASSERT_TRUE(h2d.ok()) << h2d.status();
    FERRY_TEST_ASSERT_OK((*d2h)->Wait());
    FERRY_TEST_ASSERT_OK((*h2d)->Wait());
    ASSERT_EQ(std::memcmp(host_a->data(), a_data.data(), bytes), 0) << "cycle " << cycle;
    if (cycle == 0) {  // warm: from here on nothing may be created
      resource_calls = device.resource_calls();
      pinned_calls = GetPinnedHostCounters().calls();
      registrations = inner.host_registrations();
      events = (*transfer)->stats().events_created;
    }
    if (cycle % 50 == 49) {  // the uploads landed (read back outside the counted window's rules)
      const uint64_t before = device.resource_calls();
      FERRY_TEST_ASSERT_OK(device.Copy(back.data(), dev_b->data(), bytes, CopyKind::kDeviceToHost));
      ASSERT_EQ(std::memcmp(back.data(), host_b->data(), bytes), 0) << "cycle " << cycle;
      resource_calls += device.resource_calls() - before;  // Device::Copy wraps a stream: not ours
    }
  }
  EXPECT_EQ(device.resource_calls(), resource_calls)
      << "device memory, streams, events or registrations were created after warm-up";
  EXPECT_EQ(GetPinnedHostCounters().calls(), pinned_calls) << "mmap or RegisterHost after warm-up";
  EXPECT_EQ(inner.host_registrations(), registrations);
  EXPECT_EQ((*transfer)->stats().events_created, events) << "chunk events created after warm-up";
  EXPECT_EQ((*arena)->stats().host_calls, 2u);
  EXPECT_EQ((*transfer)->stats().submissions, 2u * kCycles);
  EXPECT_EQ((*arena)->stats().in_use_bytes, 0u);
  transfer->reset();
}

}  // namespace ferry::transfer_testing

#endif  // FERRY_TESTS_TRANSFER_TRANSFER_TEST_UTIL_H_
