// StateFence: a checkpoint reads offloaded state in place while the optimizer goes on; whatever the
// interleaving, the reader sees the state as it was when the fence was made, and the optimizer
// never waits for a region nobody has started to read (it copies it aside instead).
#include "optim/state_fence.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "base/thread_pool.h"
#include "gtest/gtest.h"

namespace ferry {
namespace {

// `n` regions of random bytes (sizes vary), one per param, each with room for a copy.
struct Regions {
  Regions(size_t n, size_t max_bytes, uint64_t seed) {
    std::mt19937_64 rng(seed);
    for (size_t r = 0; r < n; ++r) {
      const size_t bytes = 1 + rng() % max_bytes;
      src.emplace_back(bytes);
      for (char& c : src.back()) c = static_cast<char>(rng());
      original.push_back(src.back());
      copy.emplace_back(bytes, '\0');
    }
  }
  std::vector<StateFence::Region> Make() {
    std::vector<StateFence::Region> out;
    for (size_t r = 0; r < src.size(); ++r) out.push_back({r, src[r].data(), copy[r].data(), src[r].size()});
    return out;
  }
  std::vector<std::vector<char>> src, original, copy;
};

TEST(StateFenceTest, RegionsNotYetReadAreCopiedAsideAndReadFromTheCopy) {
  Regions regions(3, 1000, 1);
  StateFence fence(regions.Make(), 3);
  EXPECT_FALSE(fence.all_released());
  const size_t one[] = {1};
  fence.Acquire(one, nullptr);  // nobody reads region 1 yet: copied, no wait
  std::memset(regions.src[1].data(), 0x77, regions.src[1].size());  // the optimizer changes it
  const char* at = fence.BeginRead(1);
  EXPECT_EQ(at, regions.copy[1].data());
  EXPECT_EQ(std::memcmp(at, regions.original[1].data(), regions.original[1].size()), 0);
  EXPECT_EQ(fence.BeginRead(0), regions.src[0].data());  // untouched: read in place
  fence.Release(0, regions.src[0].size());
  fence.Release(1, regions.src[1].size());
  EXPECT_FALSE(fence.all_released());  // region 2 is neither read nor acquired
  fence.ReleaseAll();
  EXPECT_TRUE(fence.all_released());
  fence.WaitAll();
}

TEST(StateFenceTest, ARegionBeingReadIsWaitedForNotCopied) {
  Regions regions(2, 100, 2);
  StateFence fence(regions.Make(), 2);
  EXPECT_EQ(fence.BeginRead(0), regions.src[0].data());
  std::atomic<bool> acquired{false};
  std::thread optimizer([&] {
    const size_t zero[] = {0};
    fence.Acquire(zero, nullptr);
    acquired = true;
  });
  fence.Release(0, 1);  // partly read
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT_FALSE(acquired.load()) << "acquired while the reader still reads the region";
  fence.Release(0, regions.src[0].size() - 1);
  optimizer.join();
  EXPECT_TRUE(acquired.load());
  EXPECT_EQ(regions.copy[0], std::vector<char>(regions.copy[0].size(), '\0')) << "copied although being read";
}

TEST(StateFenceTest, EmptyRegionsAreFreeFromTheStart) {
  char c = 0;
  StateFence fence({{0, &c, &c, 0}}, 1);
  EXPECT_TRUE(fence.all_released());
  fence.WaitAll();
}

// A reader (several threads, like the checkpoint writer) and the optimizer race over many regions
// in random orders; the optimizer overwrites each region right after acquiring it. Every byte the
// reader sees is the original.
TEST(StateFenceTest, ReaderAlwaysSeesTheOriginalWhateverTheInterleaving) {
  ThreadPool pool(3);
  for (uint64_t round = 0; round < 20; ++round) {
    Regions regions(40, round % 2 == 0 ? 5000 : (size_t{9} << 20) / 8, 100 + round);
    StateFence fence(regions.Make(), regions.src.size());
    std::vector<size_t> read_order(regions.src.size()), step_order(regions.src.size());
    for (size_t r = 0; r < read_order.size(); ++r) read_order[r] = step_order[r] = r;
    std::mt19937_64 rng(round);
    std::shuffle(read_order.begin(), read_order.end(), rng);
    std::shuffle(step_order.begin(), step_order.end(), rng);
    std::vector<std::vector<char>> seen(regions.src.size());
    std::atomic<size_t> next{0};
    std::vector<std::thread> readers;
    for (int t = 0; t < 3; ++t) {
      readers.emplace_back([&] {
        for (size_t i; (i = next.fetch_add(1)) < read_order.size();) {
          const size_t r = read_order[i];
          const char* at = fence.BeginRead(r);
          seen[r].assign(at, at + regions.src[r].size());
          fence.Release(r, regions.src[r].size());
        }
      });
    }
    for (size_t i = 0; i < step_order.size(); i += 3) {
      std::vector<size_t> params;
      for (size_t j = i; j < std::min(i + 3, step_order.size()); ++j) params.push_back(step_order[j]);
      fence.Acquire(params, &pool);
      for (size_t p : params) std::memset(regions.src[p].data(), static_cast<int>(round), regions.src[p].size());
    }
    for (std::thread& t : readers) t.join();
    fence.WaitAll();
    for (size_t r = 0; r < regions.src.size(); ++r) {
      ASSERT_EQ(seen[r], regions.original[r]) << "round " << round << ", region " << r;
    }
  }
}

TEST(StateFenceDeathTest, ReleasingMoreThanHeldIsABug) {
  char buf[4] = {1, 2, 3, 4}, copy[4];
  StateFence fence({{0, buf, copy, 4}}, 1);
  (void)fence.BeginRead(0);
  EXPECT_DEATH(fence.Release(0, 5), "5 bytes of region 0 released, 4 held");
}

}  // namespace
}  // namespace ferry
