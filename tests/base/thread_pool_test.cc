// Tests of base/thread_pool.h: ParallelFor runs every index exactly once and its results are visible
// when it returns, whether the threads spin between calls or sleep at once; Schedule runs everything
// before the destructor returns; an idle pool's workers stop spinning and sleep.
#include "base/thread_pool.h"

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include <pthread.h>
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

// Post returns before its tasks have run; batches posted back to back (joined in either order, or by
// the handle's destructor) run every index exactly once, and each batch's plain writes are visible
// once it is joined.
TEST(ThreadPool, PostedBatchesRunEveryIndexOnceInAnyJoinOrder) {
  for (int64_t spin : kSpins) {
  for (size_t threads : kThreadCounts) {
    ThreadPool pool(threads, spin);
    for (int order = 0; order < 3; ++order) {
      SCOPED_TRACE(testing::Message() << threads << " threads, spin " << spin << ", join order " << order);
      constexpr size_t kBatches = 4;
      const size_t sizes[kBatches] = {1, 65, 1000, 7};
      std::vector<std::vector<uint64_t>> results(kBatches);
      std::vector<std::vector<std::atomic<int>>> runs(kBatches);
      std::vector<ThreadPool::Pending> pending;
      for (size_t b = 0; b < kBatches; ++b) {
        results[b].assign(sizes[b], 0);
        runs[b] = std::vector<std::atomic<int>>(sizes[b]);
        pending.push_back(pool.Post(sizes[b], [&results, &runs, b](size_t i) {
          runs[b][i].fetch_add(1, std::memory_order_relaxed);
          results[b][i] = (b + 1) * 1000003 + i;
        }));
        EXPECT_FALSE(pending.back().empty());
      }
      auto check = [&](size_t b) {
        size_t wrong = 0;
        for (size_t i = 0; i < sizes[b]; ++i) {
          wrong += runs[b][i].load() != 1 || results[b][i] != (b + 1) * 1000003 + i;
        }
        EXPECT_EQ(wrong, 0u) << "batch " << b;
      };
      if (order == 0) {
        for (size_t b = 0; b < kBatches; ++b) {
          pending[b].Join();
          check(b);
        }
      } else if (order == 1) {
        for (size_t b = kBatches; b-- > 0;) {
          pending[b].Join();
          check(b);
        }
      } else {
        pending.clear();  // the destructors join
        for (size_t b = 0; b < kBatches; ++b) check(b);
      }
      for (ThreadPool::Pending& p : pending) {
        p.Join();  // joined twice: a no-op
        EXPECT_TRUE(p.empty());
        EXPECT_FALSE(p.RunOne());
      }
    }
    EXPECT_TRUE(pool.Post(0, [](size_t) { ADD_FAILURE() << "a task of an empty batch ran"; }).empty());
  }
  }
}

// The caller's RunOne takes tasks of its own batch; Join, while the batch's last task still runs on a
// worker, runs the tasks of batches posted after it on the calling thread. Deterministic: the only
// worker holds batch A's one task until batch B's last task lets it go, and nobody else runs B.
TEST(ThreadPool, JoinRunsLaterBatchesWhileItsLastTaskRuns) {
  ThreadPool pool(1, /*spin_us=*/100);
  std::atomic<bool> started{false};
  std::atomic<bool> release{false};
  ThreadPool::Pending a = pool.Post(1, [&](size_t) {
    started.store(true);
    while (!release.load()) std::this_thread::yield();
  });
  while (!started.load()) std::this_thread::yield();  // the worker holds A's task
  constexpr size_t kTasks = 50;
  const std::thread::id caller = std::this_thread::get_id();
  std::atomic<size_t> by_caller{0};
  std::atomic<size_t> done{0};
  ThreadPool::Pending b = pool.Post(kTasks, [&](size_t) {
    if (std::this_thread::get_id() == caller) by_caller.fetch_add(1);
    if (done.fetch_add(1) + 1 == kTasks) release.store(true);
  });
  EXPECT_TRUE(b.RunOne());  // one of B's tasks, here
  EXPECT_EQ(by_caller.load(), 1u);
  a.Join();  // returns once A's task ends, which needs every task of B: the caller ran them
  EXPECT_EQ(by_caller.load(), kTasks);
  EXPECT_FALSE(b.RunOne());
  b.Join();
  EXPECT_EQ(done.load(), kTasks);
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

// The workers carry the pool's name (what top and /proc/<pid>/task/<tid>/comm show), cut to the 15
// bytes the kernel keeps; the calling thread's name is left alone.
TEST(ThreadPool, WorkersCarryThePoolsName) {
  auto name_of_this_thread = [] {
    char buf[64] = {};
    return pthread_getname_np(pthread_self(), buf, sizeof(buf)) == 0 ? std::string(buf) : std::string("?");
  };
  const std::string caller = name_of_this_thread();
  for (const auto& [given, expected] : std::vector<std::pair<const char*, std::string>>{
           {"ferry-adam", "ferry-adam"}, {"ferry-a-long-pool-name", "ferry-a-long-po"}}) {
    ThreadPool pool(2, 0, {}, given);
    std::promise<std::string> seen;
    pool.Schedule([&] { seen.set_value(name_of_this_thread()); });
    EXPECT_EQ(seen.get_future().get(), expected);
  }
  EXPECT_EQ(name_of_this_thread(), caller);
}

// Join returns when the batch's last task ended, not when Join was called: a caller that comes late
// (busy elsewhere) does not stretch the batch's time.
TEST(ThreadPool, JoinTellsWhenTheLastTaskEnded) {
  auto now_ns = [] {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  };
  ThreadPool pool(2, 0);
  const int64_t posted = now_ns();
  ThreadPool::Pending p = pool.Post(4, [](size_t i) {
    if (i == 3) std::this_thread::sleep_for(std::chrono::milliseconds(30));
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(150));  // the caller is late
  const int64_t joined = now_ns();
  const int64_t finished = p.Join();
  EXPECT_GE(finished, posted + 30'000'000) << "after the slowest task's 30 ms";
  EXPECT_LE(finished, joined - 50'000'000) << "long before the late Join";
  EXPECT_EQ(p.Join(), 0) << "joined already";
  EXPECT_EQ(ThreadPool::Pending().Join(), 0);
}

}  // namespace
}  // namespace ferry
