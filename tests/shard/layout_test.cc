#include "shard/layout.h"

#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace ferry {
namespace {

TEST(LayoutTest, PacksWithAlignment) {
  std::vector<int64_t> numels = {1, 7, 64, 65};
  absl::StatusOr<Layout> layout = Layout::Pack(numels, 64);
  ASSERT_TRUE(layout.ok()) << layout.status();
  ASSERT_EQ(layout->slots().size(), 4u);
  EXPECT_EQ(layout->slots()[0].offset, 0);
  EXPECT_EQ(layout->slots()[1].offset, 64);
  EXPECT_EQ(layout->slots()[2].offset, 128);
  EXPECT_EQ(layout->slots()[3].offset, 192);
  EXPECT_EQ(layout->total_elements(), 192 + 65);
  EXPECT_EQ(layout->payload_elements(), 1 + 7 + 64 + 65);
}

TEST(LayoutTest, RejectsBadInput) {
  std::vector<int64_t> zero = {3, 0};
  absl::StatusOr<Layout> a = Layout::Pack(zero, 4);
  ASSERT_FALSE(a.ok());
  EXPECT_NE(a.status().message().find("tensor 1"), std::string_view::npos) << a.status();
  std::vector<int64_t> one = {3};
  EXPECT_FALSE(Layout::Pack(one, 0).ok());
  EXPECT_FALSE(ShardPlan::Partition(*Layout::Pack(one, 1), 0).ok());
}

// Every payload element is owned by exactly one rank, shards differ by at most one element, chunks are
// in flat order and consistent with their tensor's slot.
TEST(ShardPlanTest, PartitionCoversPayloadExactlyOnce) {
  std::mt19937_64 rng(1234);
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<int64_t> numels(1 + rng() % 12);
    for (int64_t& n : numels) n = 1 + static_cast<int64_t>(rng() % 300);
    const int64_t alignment = 1 + static_cast<int64_t>(rng() % 16);
    absl::StatusOr<Layout> layout = Layout::Pack(numels, alignment);
    ASSERT_TRUE(layout.ok());
    const int world = 1 + static_cast<int>(rng() % 9);
    absl::StatusOr<ShardPlan> plan = ShardPlan::Partition(*layout, world);
    ASSERT_TRUE(plan.ok());
    std::vector<int> owner(static_cast<size_t>(layout->total_elements()), -1);
    int64_t min_shard = INT64_MAX, max_shard = 0;
    for (int r = 0; r < world; ++r) {
      int64_t last = -1;
      for (const Chunk& c : plan->chunks(r)) {
        EXPECT_EQ(c.rank, r);
        EXPECT_GT(c.global_offset, last);
        last = c.global_offset;
        const Slot& slot = layout->slots()[c.tensor];
        EXPECT_EQ(c.global_offset, slot.offset + c.tensor_offset);
        EXPECT_LE(c.tensor_offset + c.numel, slot.numel);
        for (int64_t i = 0; i < c.numel; ++i) {
          int& o = owner[static_cast<size_t>(c.global_offset + i)];
          EXPECT_EQ(o, -1);
          o = r;
        }
      }
      min_shard = std::min(min_shard, plan->shard_elements(r));
      max_shard = std::max(max_shard, plan->shard_elements(r));
    }
    EXPECT_LE(max_shard - min_shard, 1);
    int64_t owned = 0;
    for (const Slot& s : layout->slots())
      for (int64_t i = 0; i < s.numel; ++i) owned += owner[static_cast<size_t>(s.offset + i)] >= 0;
    EXPECT_EQ(owned, layout->payload_elements());
  }
}

TEST(ShardPlanTest, Deterministic) {
  std::vector<int64_t> numels = {10, 3, 99, 1};
  Layout layout = *Layout::Pack(numels, 8);
  ShardPlan a = *ShardPlan::Partition(layout, 4);
  ShardPlan b = *ShardPlan::Partition(layout, 4);
  for (int r = 0; r < 4; ++r) {
    ASSERT_EQ(a.chunks(r).size(), b.chunks(r).size());
    for (size_t i = 0; i < a.chunks(r).size(); ++i) {
      EXPECT_EQ(a.chunks(r)[i].global_offset, b.chunks(r)[i].global_offset);
      EXPECT_EQ(a.chunks(r)[i].numel, b.chunks(r)[i].numel);
    }
  }
}

}  // namespace
}  // namespace ferry
