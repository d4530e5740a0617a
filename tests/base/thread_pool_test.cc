// Tests of base/thread_pool.h: ParallelFor runs every index exactly once and its results are visible
// when it returns, whether the threads spin between calls or sleep at once; Schedule runs everything
// before the destructor returns; an idle pool's workers stop spinning and sleep.
#include "base/thread_pool.h"

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include <time.h>

#include "gtest/gtest.h"

namespace ferry {
namespace {

constexpr size_t kThreadCounts[] = {1, 2, 7};
constexpr size_t kTaskCounts[] = {0, 1, 2, 3, 6, 7, 8, 9, 63, 64, 65, 1000, 4097};
// Sleep at once (every wait goes through the condition variables), the default, a long spin.
constexpr int64_t kSpins[] = {0, 100, 20000};

// Every index runs exactly once; the plain (non-atomic) writes each task makes are visible to the
// caller after ParallelFor returns (under TSan this checks the happens-before edge too).
TEST(ThreadPool, ParallelForCoversEveryIndexExactlyOnce) {
  for (int64_t spin : kSpins) {
  for (size_t threads : kThreadCounts) {
    ThreadPool pool(threads, spin);
    ASSERT_EQ(pool.spin_us(), spin);
    ASSERT_EQ(pool.num_threads(), threads);
    for (size_t tasks : kTaskCounts) {
      SCOPED_TRACE(testing::Message() << threads << " threads, " << tasks << " tasks, spin " << spin);
      std::vector<std::atomic<int>> runs(tasks);
      std::vector<uint64_t> results(tasks, 0);
      pool.ParallelFor(tasks, [&](size_t i) {
        runs[i].fetch_add(1, std::memory_order_relaxed);
        results[i] = static_cast<uint64_t>(i) * i + 1;
      });
      size_t wrong = 0;
      for (size_t i = 0; i < tasks; ++i) {
        if (runs[i].load() != 1 || results[i] != static_cast<uint64_t>(i) * i + 1) ++wrong;
      }
      EXPECT_EQ(wrong, 0u);
    }
  }
  }
}

// The same pool serves many ParallelFor calls in a row (no lost wake-ups, no stale tasks).
TEST(ThreadPool, ParallelForRepeatedOnOnePool) {
  for (int64_t spin : kSpins) {
  for (size_t threads : kThreadCounts) {
    ThreadPool pool(threads, spin);
    std::atomic<uint64_t> sum{0};
    uint64_t want = 0;
    for (size_t round = 0; round < 300; ++round) {
      const size_t tasks = 1 + round % 37;
      pool.ParallelFor(tasks, [&](size_t i) { sum.fetch_add(i + 1, std::memory_order_relaxed); });
      want += tasks * (tasks + 1) / 2;
      ASSERT_EQ(sum.load(), want) << threads << " threads, round " << round << ", spin " << spin;
      if (round % 50 == 49) std::this_thread::sleep_for(std::chrono::microseconds(300));  // past the spin
    }
  }
  }
}

// Two outside threads may call ParallelFor on one pool at the same time (the pool is safe for
// concurrent use); each call sees only its own tasks.
TEST(ThreadPool, ParallelForFromTwoThreadsAtOnce) {
  for (int64_t spin : kSpins) {
  for (size_t threads : kThreadCounts) {
    ThreadPool pool(threads, spin);
    constexpr size_t kTasks = 500;
    std::vector<std::atomic<int>> a(kTasks), b(kTasks);
    auto run = [&pool](std::vector<std::atomic<int>>* runs) {
      for (int round = 0; round < 20; ++round) {
        pool.ParallelFor(kTasks, [runs](size_t i) { (*runs)[i].fetch_add(1); });
      }
    };
    std::thread t1(run, &a), t2(run, &b);
    t1.join();
    t2.join();
    for (size_t i = 0; i < kTasks; ++i) {
      ASSERT_EQ(a[i].load(), 20) << threads << " threads, index " << i;
      ASSERT_EQ(b[i].load(), 20) << threads << " threads, index " << i;
    }
  }
  }
}

// CPU time of this process, in seconds.
double ProcessCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// Workers spin only briefly after work: a pool left idle sleeps. 7 workers spinning through 400 ms
// would take 2.8 s of CPU; sleeping ones take next to none (the bound leaves room for a loaded machine).
TEST(ThreadPool, IdleWorkersSleepAfterTheirSpin) {
  ThreadPool pool(7, /*spin_us=*/1000);
  std::atomic<int> ran{0};
  pool.ParallelFor(64, [&](size_t) { ran.fetch_add(1); });
  ASSERT_EQ(ran.load(), 64);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // past every worker's spin
  const double before = ProcessCpuSeconds();
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  EXPECT_LT(ProcessCpuSeconds() - before, 0.3);
  pool.ParallelFor(64, [&](size_t) { ran.fetch_add(1); });  // and wake up for the next call
  EXPECT_EQ(ran.load(), 128);
}

// Everything scheduled has run when the destructor returns, including work that scheduled tasks
// schedule themselves while the pool is shutting down.
TEST(ThreadPool, DestructorRunsEverythingScheduled) {
  for (size_t threads : kThreadCounts) {
    constexpr int kTasks = 10000;
    constexpr int kChain = 100;
    std::atomic<int> ran{0};
    std::atomic<int> chained{0};
    std::vector<int> written(kTasks, 0);  // plain writes: visible once the destructor has returned
    std::function<void(int)> link;        // a chain: each link schedules the next; outlives the pool
    {
      ThreadPool pool(threads);
      for (int i = 0; i < kTasks; ++i) {
        pool.Schedule([&ran, &written, i] {
          written[static_cast<size_t>(i)] = i + 1;
          ran.fetch_add(1, std::memory_order_relaxed);
        });
      }
      link = [&pool, &chained, &link](int depth) {
        chained.fetch_add(1, std::memory_order_relaxed);
        if (depth + 1 < kChain) pool.Schedule([&link, depth] { link(depth + 1); });
      };
      pool.Schedule([&link] { link(0); });
    }
    EXPECT_EQ(ran.load(), kTasks) << threads << " threads";
    EXPECT_EQ(chained.load(), kChain) << threads << " threads";
    int wrong = 0;
    for (int i = 0; i < kTasks; ++i) wrong += written[static_cast<size_t>(i)] != i + 1;
    EXPECT_EQ(wrong, 0) << threads << " threads";
  }
}

TEST(ThreadPool, DefaultThreadsIsUsable) {
  const size_t n = ThreadPool::DefaultThreads();
  EXPECT_GE(n, 1u);
  EXPECT_LE(n, 1u << 16);
  ThreadPool pool(n);
  EXPECT_EQ(pool.num_threads(), n);
  std::atomic<int> ran{0};
  pool.ParallelFor(3 * n + 1, [&](size_t) { ran.fetch_add(1); });
  EXPECT_EQ(ran.load(), static_cast<int>(3 * n + 1));
}

}  // namespace
}  // namespace ferry
