// PlanChunks: the edge cases by hand, then invariants over random region lists.
#include <cstdint>
#include <ostream>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "transfer/transfer.h"

namespace ferry {
namespace {

std::vector<CopyRegion> Regions(const std::vector<size_t>& sizes) {
  std::vector<CopyRegion> out;
  for (size_t s : sizes) out.push_back(CopyRegion{.dst = nullptr, .src = nullptr, .bytes = s});
  return out;
}

struct Piece {
  size_t region, offset, bytes;
  bool operator==(const Piece& o) const {
    return region == o.region && offset == o.offset && bytes == o.bytes;
  }
};

std::vector<Piece> Pieces(const ChunkPlan& c) {
  std::vector<Piece> out;
  for (const ChunkPiece& p : c.pieces) out.push_back({p.region, p.offset, p.bytes});
  return out;
}

void PrintTo(const Piece& p, std::ostream* os) {
  *os << "{region " << p.region << ", offset " << p.offset << ", bytes " << p.bytes << "}";
}

constexpr size_t kC = 10;

TEST(PlanChunksTest, OneByte) {
  const std::vector<ChunkPlan> plan = PlanChunks(Regions({1}), kC);
  ASSERT_EQ(plan.size(), 1u);
  EXPECT_EQ(plan[0].begin, 0u);
  EXPECT_EQ(plan[0].end, 1u);
  EXPECT_EQ(Pieces(plan[0]), (std::vector<Piece>{{0, 0, 1}}));
}

TEST(PlanChunksTest, ChunkMinusOneAndExactlyOneChunk) {
  for (size_t n : {kC - 1, kC}) {
    const std::vector<ChunkPlan> plan = PlanChunks(Regions({n}), kC);
    ASSERT_EQ(plan.size(), 1u) << n;
    EXPECT_EQ(plan[0].bytes(), n);
    EXPECT_EQ(Pieces(plan[0]), (std::vector<Piece>{{0, 0, n}}));
  }
}

TEST(PlanChunksTest, ChunkPlusOneIsTwoChunks) {
  const std::vector<ChunkPlan> plan = PlanChunks(Regions({kC + 1}), kC);
  ASSERT_EQ(plan.size(), 2u);
  EXPECT_EQ(plan[0].begin, 0u);
  EXPECT_EQ(plan[0].end, kC);
  EXPECT_EQ(plan[1].begin, kC);
  EXPECT_EQ(plan[1].end, kC + 1);
  EXPECT_EQ(Pieces(plan[0]), (std::vector<Piece>{{0, 0, kC}}));
  EXPECT_EQ(Pieces(plan[1]), (std::vector<Piece>{{0, kC, 1}}));
}

TEST(PlanChunksTest, ManyChunksLastRagged) {
  const std::vector<ChunkPlan> plan = PlanChunks(Regions({95}), kC);
  ASSERT_EQ(plan.size(), 10u);
  for (size_t k = 0; k < 9; ++k) {
    EXPECT_EQ(plan[k].begin, k * kC);
    EXPECT_EQ(Pieces(plan[k]), (std::vector<Piece>{{0, k * kC, kC}}));
  }
  EXPECT_EQ(plan[9].begin, 90u);
  EXPECT_EQ(plan[9].end, 95u);
}

TEST(PlanChunksTest, SmallRegionsCoalesce) {
  const std::vector<ChunkPlan> plan = PlanChunks(Regions({3, 3, 3, 3}), kC);
  ASSERT_EQ(plan.size(), 2u);
  EXPECT_EQ(Pieces(plan[0]), (std::vector<Piece>{{0, 0, 3}, {1, 0, 3}, {2, 0, 3}, {3, 0, 1}}));
  EXPECT_EQ(Pieces(plan[1]), (std::vector<Piece>{{3, 1, 2}}));
  EXPECT_EQ(plan[1].begin, 10u);
  EXPECT_EQ(plan[1].end, 12u);
}

TEST(PlanChunksTest, RegionStraddlesChunks) {
  const std::vector<ChunkPlan> plan = PlanChunks(Regions({5, 30, 5}), kC);
  ASSERT_EQ(plan.size(), 4u);
  EXPECT_EQ(Pieces(plan[0]), (std::vector<Piece>{{0, 0, 5}, {1, 0, 5}}));
  EXPECT_EQ(Pieces(plan[1]), (std::vector<Piece>{{1, 5, 10}}));
  EXPECT_EQ(Pieces(plan[2]), (std::vector<Piece>{{1, 15, 10}}));
  EXPECT_EQ(Pieces(plan[3]), (std::vector<Piece>{{1, 25, 5}, {2, 0, 5}}));
}

TEST(PlanChunksTest, ZeroSizeRegionsAreSkippedButKeepTheirIndex) {
  const std::vector<ChunkPlan> plan = PlanChunks(Regions({0, 4, 0, 0, 6, 0}), kC);
  ASSERT_EQ(plan.size(), 1u);
  EXPECT_EQ(Pieces(plan[0]), (std::vector<Piece>{{1, 0, 4}, {4, 0, 6}}));
}

TEST(PlanChunksTest, NothingToCopyGivesNoChunks) {
  EXPECT_TRUE(PlanChunks({}, kC).empty());
  EXPECT_TRUE(PlanChunks(Regions({0, 0, 0}), kC).empty());
}

TEST(PlanChunksTest, ChunkOfOneByte) {
  const std::vector<ChunkPlan> plan = PlanChunks(Regions({2, 1}), 1);
  ASSERT_EQ(plan.size(), 3u);
  EXPECT_EQ(Pieces(plan[0]), (std::vector<Piece>{{0, 0, 1}}));
  EXPECT_EQ(Pieces(plan[1]), (std::vector<Piece>{{0, 1, 1}}));
  EXPECT_EQ(Pieces(plan[2]), (std::vector<Piece>{{1, 0, 1}}));
}

// Over random inputs: chunks tile [0, total) in order, every chunk but the last is full, and the
// pieces, read in order, cover each non-empty region exactly once from offset 0 to its end.
TEST(PlanChunksTest, RandomPlansTileEveryRegionExactlyOnce) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  for (int iter = 0; iter < 2000; ++iter) {
    std::vector<size_t> sizes(rng() % 20);
    size_t total = 0;
    for (size_t& s : sizes) {
      s = rng() % 4 == 0 ? 0 : 1 + rng() % (rng() % 2 == 0 ? 50 : 5000);
      total += s;
    }
    const size_t chunk = 1 + rng() % 700;
    const std::vector<ChunkPlan> plan = PlanChunks(Regions(sizes), chunk);
    ASSERT_EQ(plan.size(), (total + chunk - 1) / chunk);
    std::vector<size_t> covered(sizes.size(), 0);
    size_t pos = 0;
    size_t last_region = 0;
    for (size_t k = 0; k < plan.size(); ++k) {
      const ChunkPlan& c = plan[k];
      ASSERT_EQ(c.begin, pos);
      ASSERT_EQ(c.end - c.begin, k + 1 < plan.size() ? chunk : total - pos);
      ASSERT_GT(c.end, c.begin);
      size_t sum = 0;
      for (const ChunkPiece& p : c.pieces) {
        ASSERT_LT(p.region, sizes.size());
        ASSERT_GE(p.region, last_region);  // regions in order
        ASSERT_GT(p.bytes, 0u);
        ASSERT_EQ(p.offset, covered[p.region]);  // contiguous, no gap, no overlap
        covered[p.region] += p.bytes;
        ASSERT_LE(covered[p.region], sizes[p.region]);
        last_region = p.region;
        sum += p.bytes;
      }
      ASSERT_EQ(sum, c.bytes());
      pos = c.end;
    }
    ASSERT_EQ(pos, total);
    ASSERT_EQ(covered, sizes);
  }
}

}  // namespace
}  // namespace ferry
