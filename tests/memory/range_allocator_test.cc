// RangeAllocator: best fit, alignment, coalescing, release errors, checked against a reference model.
#include "memory/range_allocator.h"

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <map>
#include <optional>
#include <random>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace ferry {
namespace {

constexpr size_t kGranule = 64;

size_t RoundUp(size_t x, size_t a) { return (x + a - 1) / a * a; }

TEST(RangeAllocatorTest, FreshAllocatorIsOneFreeBlock) {
  RangeAllocator r(4096, 1 << 16, kGranule);
  EXPECT_EQ(r.free_bytes(), size_t{1} << 16);
  EXPECT_EQ(r.largest_free_block(), size_t{1} << 16);
  ASSERT_EQ(r.FreeBlocks().size(), 1u);
  EXPECT_EQ(r.FreeBlocks()[0], (std::pair<size_t, size_t>{0, 1 << 16}));
}

TEST(RangeAllocatorTest, RoundsToGranuleAndAligns) {
  const uintptr_t base = 4096 * 3;
  RangeAllocator r(base, 1 << 16, kGranule);
  std::optional<size_t> a = r.Allocate(1, 1);
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(*a, 0u);
  EXPECT_EQ(r.in_use_bytes(), kGranule);
  // Next block must start at an address aligned to 4096: base is, so offset 4096.
  std::optional<size_t> b = r.Allocate(100, 4096);
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ((base + *b) % 4096, 0u);
  EXPECT_EQ(*b, 4096u);
  EXPECT_EQ(r.in_use_bytes(), kGranule + 128);
  // The padding before b stays free and is used by a later small request (best fit).
  std::optional<size_t> c = r.Allocate(64, 64);
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(*c, 64u);
}

TEST(RangeAllocatorTest, BestFitPicksSmallestHole) {
  RangeAllocator r(0, 64 * 100, kGranule);
  std::vector<size_t> offs;
  for (int i = 0; i < 10; ++i) offs.push_back(*r.Allocate(64 * 10, 64));  // fills everything
  EXPECT_EQ(r.free_bytes(), 0u);
  EXPECT_FALSE(r.Allocate(1, 1).has_value());
  ASSERT_TRUE(r.Release(offs[1], 640).ok());  // hole of 640 at 640
  ASSERT_TRUE(r.Release(offs[5], 640).ok());  // hole of 640 at 3200
  ASSERT_TRUE(r.Release(offs[6], 640).ok());  // merges: hole of 1280 at 3200
  EXPECT_EQ(r.num_free_blocks(), 2u);
  EXPECT_EQ(r.largest_free_block(), 1280u);
  std::optional<size_t> a = r.Allocate(600, 64);
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(*a, 640u);  // the 640 hole, not the 1280 one
}

TEST(RangeAllocatorTest, ReleaseErrorsChangeNothing) {
  RangeAllocator r(0, 1 << 12, kGranule);
  const size_t a = *r.Allocate(200, 64);
  const size_t b = *r.Allocate(300, 64);
  const auto before = r.FreeBlocks();
  absl::Status s = r.Release(a + 64, 100);  // inside a
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("inside the allocation"), absl::string_view::npos) << s;
  s = r.Release(a, 199);  // wrong size
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("200"), absl::string_view::npos) << s;
  s = r.Release(2048, 10);  // never allocated (free space)
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_EQ(r.FreeBlocks(), before);
  EXPECT_EQ(r.num_allocations(), 2u);
  ASSERT_TRUE(r.Release(b, 300).ok());
  s = r.Release(b, 300);  // double release
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("double release"), absl::string_view::npos) << s;
  ASSERT_TRUE(r.Release(a, 200).ok());
  EXPECT_EQ(r.FreeBlocks(), (std::vector<std::pair<size_t, size_t>>{{0, 1 << 12}}));
}

// Random allocate/release sequences against a model of the used ranges. After every step: no two
// live blocks overlap, the free list is exactly the complement of the live blocks (and coalesced), and
// a failed allocation really had no hole that fits.
TEST(RangeAllocatorTest, RandomSequencesMatchReferenceModel) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  const uintptr_t base = 4096 * 7;
  const size_t capacity = 1 << 18;
  RangeAllocator r(base, capacity, kGranule);
  std::map<size_t, std::pair<size_t, size_t>> live;  // offset -> (requested, reserved)
  int failures = 0;
  size_t peak_live = 0;

  auto check_model = [&] {
    std::vector<std::pair<size_t, size_t>> expected_free;
    size_t pos = 0;
    size_t used = 0;
    for (const auto& [off, sizes] : live) {
      ASSERT_GE(off, pos) << "overlap at offset " << off;
      if (off > pos) expected_free.emplace_back(pos, off - pos);
      pos = off + sizes.second;
      used += sizes.second;
    }
    ASSERT_LE(pos, capacity);
    if (pos < capacity) expected_free.emplace_back(pos, capacity - pos);
    ASSERT_EQ(r.FreeBlocks(), expected_free);
    ASSERT_EQ(r.in_use_bytes(), used);
  };

  for (int step = 0; step < 20000; ++step) {
    const bool allocate = live.empty() || rng() % 100 < 55;
    if (allocate) {
      const size_t bytes = 1 + rng() % (rng() % 8 == 0 ? 40000 : 2000);
      const size_t alignment = size_t{1} << (rng() % 13);  // 1 .. 4096
      std::optional<size_t> off = r.Allocate(bytes, alignment);
      if (off.has_value()) {
        ASSERT_EQ((base + *off) % alignment, 0u);
        ASSERT_EQ(*off % kGranule, 0u);
        ASSERT_LE(*off + bytes, capacity);
        ASSERT_EQ(live.count(*off), 0u);
        live[*off] = {bytes, RoundUp(bytes, kGranule)};
        peak_live = std::max(peak_live, live.size());
      } else {
        ++failures;
        // No hole can hold the request at that alignment.
        const size_t need = RoundUp(bytes, kGranule);
        for (const auto& [hole, size] : r.FreeBlocks()) {
          const size_t start = RoundUp(base + hole, alignment) - base;
          ASSERT_TRUE(start >= hole + size || hole + size - start < need)
              << "hole [" << hole << ", +" << size << ") fits " << bytes << " @" << alignment;
        }
      }
    } else {
      auto it = live.begin();
      std::advance(it, rng() % live.size());
      ASSERT_TRUE(r.Release(it->first, it->second.first).ok());
      live.erase(it);
    }
    if (step % 16 == 0) check_model();
  }
  check_model();
  // The sequence must have filled the range (failures) with many blocks live at once.
  EXPECT_GT(failures, 100);
  EXPECT_GT(peak_live, 50u);
  for (const auto& [off, sizes] : live) ASSERT_TRUE(r.Release(off, sizes.first).ok());
  live.clear();
  check_model();
  // Coalescing gives back the full capacity as one block.
  std::optional<size_t> all = r.Allocate(capacity, kGranule);
  ASSERT_TRUE(all.has_value());
  EXPECT_EQ(*all, 0u);
}

}  // namespace
}  // namespace ferry
