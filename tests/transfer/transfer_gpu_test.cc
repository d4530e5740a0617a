// Transfer on the CUDA backend: the same round trips, chunk-event and `after` checks as on the host
// backend. Skips when this build has no CUDA backend or no CUDA device is present.
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "device/device.h"
#include "gtest/gtest.h"
#include "memory/pinned_arena.h"
#include "transfer/transfer.h"
#include "transfer/transfer_test_util.h"

namespace ferry {
namespace {

class CudaTransferTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!BuiltWithCuda()) GTEST_SKIP() << "this build has no CUDA backend";
    absl::StatusOr<std::unique_ptr<Device>> device = CreateDevice(DeviceOptions{.backend = "cuda"});
    if (!device.ok()) GTEST_SKIP() << "no CUDA device: " << device.status();
    device_ = *std::move(device);
    seed_ = std::random_device{}();
    rng_.seed(seed_);
  }

  std::unique_ptr<Device> device_;
  uint64_t seed_ = 0;
  std::mt19937_64 rng_;
};

TEST_F(CudaTransferTest, RoundTripThroughEveryChunkEdge) {
  SCOPED_TRACE(::testing::Message() << "seed " << seed_ << " on " << device_->name());
  PinnedArenaOptions options;
  options.capacity_bytes = 64 << 20;
  options.name = "gpu transfer test";
  absl::StatusOr<std::unique_ptr<PinnedArena>> arena = PinnedArena::Create(device_.get(), options);
  ASSERT_TRUE(arena.ok()) << arena.status();
  const uint64_t registrations = device_->host_registrations();
  for (size_t chunk : {size_t{1}, size_t{4093}, size_t{1} << 20}) {
    absl::StatusOr<std::unique_ptr<Transfer>> transfer =
        Transfer::Create(device_.get(), TransferOptions{.chunk_bytes = chunk});
    ASSERT_TRUE(transfer.ok()) << transfer.status();
    for (const std::vector<size_t>& layout : transfer_testing::EdgeLayouts(chunk, rng_)) {
      SCOPED_TRACE(::testing::Message() << "chunk " << chunk << ", " << layout.size()
                                        << " region(s), first " << (layout.empty() ? 0 : layout[0]));
      transfer_testing::RoundTrip(*device_, **arena, **transfer, layout, rng_);
      if (HasFatalFailure()) return;
    }
  }
  EXPECT_EQ(device_->host_registrations(), registrations);  // no pinning on the hot path
}

TEST_F(CudaTransferTest, ChunkEventsCompleteInOrderAndIndependently) {
  SCOPED_TRACE(::testing::Message() << "seed " << seed_);
  transfer_testing::ChunkEventsIndependent(*device_, 1 << 20, rng_);
}

TEST_F(CudaTransferTest, AfterEventIsHonoured) {
  SCOPED_TRACE(::testing::Message() << "seed " << seed_);
  transfer_testing::AfterEventHonoured(*device_, 1 << 20, rng_);
}

TEST_F(CudaTransferTest, ContiguousRegionsBecomeOneCopy) {
  SCOPED_TRACE(::testing::Message() << "seed " << seed_);
  transfer_testing::ContiguousRegionsMerge(*device_, 1 << 20, rng_);
}

// Separately cudaMalloc'd tensors that happen to be adjacent (small allocations often are): one copy
// across them is refused by CUDA, so the transfer must not merge them.
TEST_F(CudaTransferTest, AdjacentAllocationsAreNotMerged) {
  SCOPED_TRACE(::testing::Message() << "seed " << seed_);
  constexpr size_t kBytes = 4096;
  std::vector<DeviceBuffer> buffers;
  for (int i = 0; i < 64; ++i) {
    absl::StatusOr<DeviceBuffer> b = device_->Allocate(kBytes);
    ASSERT_TRUE(b.ok()) << b.status();
    buffers.push_back(*std::move(b));
  }
  for (size_t i = 0; i < buffers.size(); ++i) {
    for (size_t j = 0; j < buffers.size(); ++j) {
      if (buffers[i].as<char>() + kBytes != buffers[j].as<char>()) continue;
      EXPECT_FALSE(device_->SameAllocation(buffers[i].data(), buffers[j].data()));
      EXPECT_TRUE(device_->SameAllocation(buffers[i].data(), buffers[i].as<char>() + kBytes - 1));
      transfer_testing::CountingDevice device(device_.get());
      transfer_testing::AdjacentAllocationsAreNotMerged(device, buffers[i].as<char>(), buffers[j].as<char>(), kBytes,
                                                        rng_);
      return;
    }
  }
  GTEST_SKIP() << "no two of 64 allocations of " << kBytes << " bytes are adjacent on this device";
}

TEST_F(CudaTransferTest, BothDirectionsRunAtOnceOnTheirOwnStreams) {
  SCOPED_TRACE(::testing::Message() << "seed " << seed_);
  transfer_testing::BothDirectionsAtOnce(*device_, 1 << 20, rng_);
}

TEST_F(CudaTransferTest, NothingIsAllocatedOrRegisteredAfterWarmUp) {
  SCOPED_TRACE(::testing::Message() << "seed " << seed_);
  transfer_testing::NothingAllocatedAfterWarmUp(*device_, rng_);
}

}  // namespace
}  // namespace ferry
