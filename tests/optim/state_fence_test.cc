// StateFence: params held by a reader until all their bytes are released; waits return exactly then.
#include "optim/state_fence.h"

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace ferry {
namespace {

TEST(StateFenceTest, ParamsWithNothingHeldAreFreeAtOnce) {
  StateFence none({0, 0});
  EXPECT_TRUE(none.all_released());
  none.WaitReleased(1);
  none.WaitAll();
  StateFence some({0, 8});
  EXPECT_FALSE(some.all_released());
  some.WaitReleased(0);  // returns: param 0 holds nothing
}

TEST(StateFenceTest, AParamIsReleasedWhenAllItsBytesAre) {
  StateFence fence({10, 4});
  std::atomic<bool> woke{false};
  std::thread waiter([&] {
    fence.WaitReleased(0);
    woke = true;
  });
  fence.Release(0, 6);
  fence.Release(1, 4);  // another param: does not release param 0
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(woke.load()) << "woke with 4 bytes of param 0 still held";
  EXPECT_FALSE(fence.all_released());
  fence.Release(0, 4);
  waiter.join();
  EXPECT_TRUE(woke.load());
  EXPECT_TRUE(fence.all_released());
}

TEST(StateFenceTest, ReleaseAllWakesEveryWaiter) {
  StateFence fence({1, 2, 3});
  std::vector<std::thread> waiters;
  std::atomic<int> woke{0};
  for (size_t p = 0; p < 3; ++p) {
    waiters.emplace_back([&, p] {
      fence.WaitReleased(p);
      ++woke;
    });
  }
  waiters.emplace_back([&] {
    fence.WaitAll();
    ++woke;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(woke.load(), 0);
  fence.ReleaseAll();
  for (std::thread& t : waiters) t.join();
  EXPECT_EQ(woke.load(), 4);
}

TEST(StateFenceDeathTest, ReleasingMoreThanHeldIsABug) {
  StateFence fence({4});
  EXPECT_DEATH(fence.Release(0, 5), "5 bytes of param 0 released, 4 held");
}

}  // namespace
}  // namespace ferry
