// Transfer on the host backend: round trips through every chunk-size edge, chunk events that complete
// in order and independently, the `after` event, event pooling, empty batches and errors.
#include "transfer/transfer.h"

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "device/device.h"
#include "gtest/gtest.h"
#include "memory/pinned_arena.h"
#include "transfer/transfer_test_util.h"

namespace ferry {
namespace {

using transfer_testing::ChunkEventsIndependent;
using transfer_testing::EdgeLayouts;
using transfer_testing::FillRandom;
using transfer_testing::Gate;
using transfer_testing::GatedDevice;

class HostTransferTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Device>> device = CreateDevice(DeviceOptions{.backend = "host"});
    ASSERT_TRUE(device.ok()) << device.status();
    device_ = *std::move(device);
    arena_ = MakeArena(*device_, 8 << 20);
    ASSERT_NE(arena_, nullptr);
    seed_ = std::random_device{}();
    rng_.seed(seed_);
  }

  static std::unique_ptr<PinnedArena> MakeArena(Device& device, size_t bytes) {
    PinnedArenaOptions options;
    options.capacity_bytes = bytes;
    options.numa = NumaPolicy::kLocal;
    options.name = "transfer test";
    absl::StatusOr<std::unique_ptr<PinnedArena>> arena = PinnedArena::Create(&device, options);
    EXPECT_TRUE(arena.ok()) << arena.status();
    return arena.ok() ? *std::move(arena) : nullptr;
  }

  std::unique_ptr<Transfer> MakeTransfer(Device& device, size_t chunk_bytes) {
    absl::StatusOr<std::unique_ptr<Transfer>> t =
        Transfer::Create(&device, TransferOptions{.chunk_bytes = chunk_bytes});
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? *std::move(t) : nullptr;
  }

  std::unique_ptr<Device> device_;  // declared first: destroyed last
  std::unique_ptr<PinnedArena> arena_;
  uint64_t seed_ = 0;
  std::mt19937_64 rng_;
};

TEST_F(HostTransferTest, RoundTripThroughEveryChunkEdge) {
  SCOPED_TRACE(::testing::Message() << "seed " << seed_);
  for (size_t chunk : {size_t{1}, size_t{64}, size_t{4093}, size_t{65536}}) {
    std::unique_ptr<Transfer> transfer = MakeTransfer(*device_, chunk);
    ASSERT_NE(transfer, nullptr);
    for (const std::vector<size_t>& layout : EdgeLayouts(chunk, rng_)) {
      SCOPED_TRACE(::testing::Message() << "chunk " << chunk << ", " << layout.size()
                                        << " region(s), first " << (layout.empty() ? 0 : layout[0]));
      transfer_testing::RoundTrip(*device_, *arena_, *transfer, layout, rng_);
      if (HasFatalFailure()) return;
    }
  }
  EXPECT_EQ(device_->host_registrations(), 1u);  // the arena's, once
  EXPECT_EQ(arena_->stats().in_use_bytes, 0u);
}

TEST_F(HostTransferTest, ChunkEventsCompleteInOrderAndIndependently) {
  SCOPED_TRACE(::testing::Message() << "seed " << seed_);
  ChunkEventsIndependent(*device_, 4096, rng_);
}

TEST_F(HostTransferTest, AfterEventIsHonoured) {
  SCOPED_TRACE(::testing::Message() << "seed " << seed_);
  transfer_testing::AfterEventHonoured(*device_, 4096, rng_);
}

TEST_F(HostTransferTest, ContiguousRegionsBecomeOneCopy) {
  SCOPED_TRACE(::testing::Message() << "seed " << seed_);
  transfer_testing::ContiguousRegionsMerge(*device_, 4096, rng_);
}

TEST_F(HostTransferTest, AdjacentAllocationsAreNotMerged) {
  SCOPED_TRACE(::testing::Message() << "seed " << seed_);
  // One real allocation that the device reports as two, split in the middle.
  transfer_testing::CountingDevice device(device_.get());
  absl::StatusOr<DeviceBuffer> dev = device_->Allocate(2 * 1000);
  ASSERT_TRUE(dev.ok()) << dev.status();
  device.set_allocation_boundary(dev->as<char>() + 1000);
  transfer_testing::AdjacentAllocationsAreNotMerged(device, dev->as<char>(), dev->as<char>() + 1000, 1000, rng_);
  // And the host backend itself: memory of one allocation is one allocation, two are two.
  EXPECT_TRUE(device_->SameAllocation(dev->as<char>(), dev->as<char>() + 1999));
  absl::StatusOr<DeviceBuffer> other = device_->Allocate(64);
  ASSERT_TRUE(other.ok());
  EXPECT_FALSE(device_->SameAllocation(dev->as<char>(), other->as<char>()));
  std::vector<char> trainer(16);
  EXPECT_FALSE(device_->SameAllocation(trainer.data(), trainer.data() + 1));
}

TEST_F(HostTransferTest, BothDirectionsRunAtOnceOnTheirOwnStreams) {
  SCOPED_TRACE(::testing::Message() << "seed " << seed_);
  transfer_testing::BothDirectionsAtOnce(*device_, 4096, rng_);
}

TEST_F(HostTransferTest, NothingIsAllocatedOrRegisteredAfterWarmUp) {
  SCOPED_TRACE(::testing::Message() << "seed " << seed_);
  transfer_testing::NothingAllocatedAfterWarmUp(*device_, rng_);
}

TEST_F(HostTransferTest, StatsCountSubmissionsChunksAndBytes) {
  std::unique_ptr<Transfer> transfer = MakeTransfer(*device_, 1000);
  ASSERT_NE(transfer, nullptr);
  absl::StatusOr<DeviceBuffer> dev = device_->Allocate(2500);
  absl::StatusOr<PinnedBlock> host = PinnedBlock::Allocate(*arena_, 2500);
  ASSERT_TRUE(dev.ok() && host.ok());
  FillRandom(host->data(), 2500, rng_);
  const CopyRegion up{dev->data(), host->data(), 2500};
  const CopyRegion down{host->data(), dev->data(), 1200};
  ASSERT_TRUE((*transfer->HostToDevice(absl::MakeConstSpan(&up, 1)))->Wait().ok());
  ASSERT_TRUE((*transfer->DeviceToHost(absl::MakeConstSpan(&down, 1)))->Wait().ok());
  ASSERT_TRUE(transfer->DeviceToHost({}).ok());  // enqueues nothing: not a submission
  const TransferStats st = transfer->stats();
  EXPECT_EQ(st.submissions, 2u);
  EXPECT_EQ(st.chunks, 3u + 2u);
  EXPECT_EQ(st.copies, 5u);
  EXPECT_EQ(st.h2d_bytes, 2500u);
  EXPECT_EQ(st.d2h_bytes, 1200u);
  EXPECT_EQ(st.events_created, 3u);  // the first batch's events were reused by the second
}

TEST_F(HostTransferTest, ConsumerStreamWaitsForTheWholeBatch) {
  constexpr size_t kChunk = 1024;
  constexpr size_t kTotal = 3 * kChunk + 5;
  absl::StatusOr<DeviceBuffer> dev = device_->Allocate(kTotal);
  ASSERT_TRUE(dev.ok()) << dev.status();
  Gate gate;
  GatedDevice gated(device_.get(), dev->as<char>() + kChunk, &gate);  // holds chunk 1
  std::unique_ptr<Transfer> transfer = MakeTransfer(gated, kChunk);
  ASSERT_NE(transfer, nullptr);
  // Declared before the consumer stream, which finishes its queue (the lambda below) when destroyed.
  std::vector<uint8_t> snapshot;
  absl::Notification ran;
  absl::StatusOr<std::unique_ptr<Stream>> consumer = device_->CreateStream();
  ASSERT_TRUE(consumer.ok()) << consumer.status();
  absl::StatusOr<PinnedBlock> expected = PinnedBlock::Allocate(*arena_, kTotal);
  absl::StatusOr<PinnedBlock> got = PinnedBlock::Allocate(*arena_, kTotal);
  ASSERT_TRUE(expected.ok() && got.ok());
  {
    absl::Cleanup open_gate = [&gate] { gate.Open(); };
    FillRandom(expected->data(), kTotal, rng_);
    std::memset(got->data(), 0, kTotal);
    ASSERT_TRUE(device_->Copy(dev->data(), expected->data(), kTotal, CopyKind::kHostToDevice).ok());
    const CopyRegion region{got->data(), dev->data(), kTotal};
    absl::StatusOr<std::unique_ptr<TransferBatch>> batch =
        transfer->DeviceToHost(absl::MakeConstSpan(&region, 1));
    ASSERT_TRUE(batch.ok()) << batch.status();
    ASSERT_TRUE((*batch)->MakeStreamWait(**consumer).ok());
    ASSERT_TRUE((*consumer)
                    ->EnqueueHost([&] {
                      snapshot.assign(got->as<uint8_t>(), got->as<uint8_t>() + kTotal);
                      ran.Notify();
                    })
                    .ok());
    EXPECT_FALSE(ran.WaitForNotificationWithTimeout(absl::Milliseconds(200)))
        << "the consumer ran while chunk 1 was held";
    gate.Open();
    ASSERT_TRUE((*consumer)->Synchronize().ok());
    ASSERT_EQ(snapshot.size(), kTotal);
    EXPECT_EQ(std::memcmp(snapshot.data(), expected->data(), kTotal), 0);
  }
}

TEST_F(HostTransferTest, EventsArePooledAcrossBatches) {
  std::unique_ptr<Transfer> transfer = MakeTransfer(*device_, 1024);
  ASSERT_NE(transfer, nullptr);
  absl::StatusOr<DeviceBuffer> dev = device_->Allocate(3 * 1024);
  absl::StatusOr<PinnedBlock> host = PinnedBlock::Allocate(*arena_, 3 * 1024);
  ASSERT_TRUE(dev.ok() && host.ok());
  FillRandom(host->data(), 3 * 1024, rng_);
  const CopyRegion up{dev->data(), host->data(), 3 * 1024};
  for (int i = 0; i < 50; ++i) {
    absl::StatusOr<std::unique_ptr<TransferBatch>> b =
        transfer->HostToDevice(absl::MakeConstSpan(&up, 1));
    ASSERT_TRUE(b.ok()) << b.status();
    ASSERT_EQ((*b)->num_chunks(), 3u);
    ASSERT_TRUE((*b)->Wait().ok());
  }
  EXPECT_EQ(transfer->events_created(), 3u);
  // Two batches alive at once need their own events.
  auto b1 = transfer->HostToDevice(absl::MakeConstSpan(&up, 1));
  auto b2 = transfer->HostToDevice(absl::MakeConstSpan(&up, 1));
  ASSERT_TRUE(b1.ok() && b2.ok());
  EXPECT_NE(&(*b1)->chunk_event(0), &(*b2)->chunk_event(0));
  EXPECT_EQ(transfer->events_created(), 6u);
  ASSERT_TRUE((*b1)->Wait().ok());
  ASSERT_TRUE((*b2)->Wait().ok());
}

TEST_F(HostTransferTest, BatchMayOutliveItsTransfer) {
  std::unique_ptr<Transfer> transfer = MakeTransfer(*device_, 100);
  ASSERT_NE(transfer, nullptr);
  absl::StatusOr<DeviceBuffer> dev = device_->Allocate(250);
  absl::StatusOr<PinnedBlock> host = PinnedBlock::Allocate(*arena_, 250);
  ASSERT_TRUE(dev.ok() && host.ok());
  FillRandom(host->data(), 250, rng_);
  const CopyRegion up{dev->data(), host->data(), 250};
  absl::StatusOr<std::unique_ptr<TransferBatch>> b =
      transfer->HostToDevice(absl::MakeConstSpan(&up, 1));
  ASSERT_TRUE(b.ok()) << b.status();
  transfer.reset();  // drains the streams
  EXPECT_TRUE(*(*b)->ChunkDone(2));
  EXPECT_TRUE((*b)->Wait().ok());
  std::vector<uint8_t> back(250);
  ASSERT_TRUE(device_->Copy(back.data(), dev->data(), 250, CopyKind::kDeviceToHost).ok());
  EXPECT_EQ(std::memcmp(back.data(), host->data(), 250), 0);
}

TEST_F(HostTransferTest, EmptySubmissionHasNoChunks) {
  std::unique_ptr<Transfer> transfer = MakeTransfer(*device_, 1024);
  ASSERT_NE(transfer, nullptr);
  absl::StatusOr<std::unique_ptr<TransferBatch>> b = transfer->DeviceToHost({});
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ((*b)->num_chunks(), 0u);
  EXPECT_EQ((*b)->bytes(), 0u);
  EXPECT_TRUE((*b)->Wait().ok());
  EXPECT_EQ((*b)->WaitChunk(0).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ((*b)->ChunkDone(0).status().code(), absl::StatusCode::kOutOfRange);
  absl::StatusOr<std::unique_ptr<Stream>> s = device_->CreateStream();
  ASSERT_TRUE(s.ok());
  EXPECT_TRUE((*b)->MakeStreamWait(**s).ok());
  EXPECT_EQ(transfer->events_created(), 0u);
}

TEST_F(HostTransferTest, CreateRejectsBadOptions) {
  EXPECT_EQ(Transfer::Create(nullptr).status().code(), absl::StatusCode::kInvalidArgument);
  absl::Status s = Transfer::Create(device_.get(), TransferOptions{.chunk_bytes = 0}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "chunk_bytes")) << s;
  std::unique_ptr<Transfer> t = MakeTransfer(*device_, 4096);
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->chunk_bytes(), 4096u);
  EXPECT_EQ(t->device(), device_.get());
  EXPECT_NE(&t->d2h_stream(), &t->h2d_stream());
}

TEST_F(HostTransferTest, NullRegionIsRejectedBeforeAnythingIsEnqueued) {
  std::unique_ptr<Transfer> transfer = MakeTransfer(*device_, 1024);
  ASSERT_NE(transfer, nullptr);
  char host[16];
  const std::vector<CopyRegion> regions = {{host, host + 8, 8}, {nullptr, host, 4}};
  absl::Status s = transfer->HostToDevice(regions).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "region 1")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "null dst")) << s;
  EXPECT_EQ(transfer->events_created(), 0u);
  // A zero-byte region may have null pointers.
  const std::vector<CopyRegion> empty = {{nullptr, nullptr, 0}};
  EXPECT_TRUE(transfer->HostToDevice(empty).ok());
}

TEST_F(HostTransferTest, DeviceErrorNamesTheChunkAndLeavesTransferUsable) {
  std::unique_ptr<Transfer> transfer = MakeTransfer(*device_, 1000);
  ASSERT_NE(transfer, nullptr);
  absl::StatusOr<DeviceBuffer> dev = device_->Allocate(2500);
  absl::StatusOr<PinnedBlock> host = PinnedBlock::Allocate(*arena_, 4000);
  ASSERT_TRUE(dev.ok() && host.ok());
  // 4000 bytes into a 2500-byte device allocation: the host backend refuses the copy that overruns.
  const CopyRegion too_long{dev->data(), host->data(), 4000};
  absl::Status s = transfer->HostToDevice(absl::MakeConstSpan(&too_long, 1)).status();
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(absl::StrContains(s.message(), "H2D chunk 2 of 4")) << s;
  // Still usable.
  FillRandom(host->data(), 2500, rng_);
  const CopyRegion fits{dev->data(), host->data(), 2500};
  absl::StatusOr<std::unique_ptr<TransferBatch>> b =
      transfer->HostToDevice(absl::MakeConstSpan(&fits, 1));
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_TRUE((*b)->Wait().ok());
  std::vector<uint8_t> back(2500);
  ASSERT_TRUE(device_->Copy(back.data(), dev->data(), 2500, CopyKind::kDeviceToHost).ok());
  EXPECT_EQ(std::memcmp(back.data(), host->data(), 2500), 0);
}

}  // namespace
}  // namespace ferry
