// Holding a process's threads to a share of the host (base/thread_affinity.h): every thread but the
// pools' held workers, and the threads started afterwards.
#include "base/thread_affinity.h"

#include <sched.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "base/host_share.h"
#include "base/thread_pool.h"
#include "gtest/gtest.h"

namespace ferry {
namespace {

// A thread that reports its id, then waits until released.
class Parked {
 public:
  Parked() : thread_([this] {
      std::unique_lock<std::mutex> lock(mu_);
      tid_ = CurrentThreadId();
      cv_.notify_all();
      cv_.wait(lock, [this] { return release_; });
    }) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return tid_ != 0; });
  }
  ~Parked() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      release_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  pid_t tid() const { return tid_; }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  pid_t tid_ = 0;
  bool release_ = false;
  std::thread thread_;
};

// Every thread of the process back on `cpus` when the test ends (the test binary's other tests run in
// their own processes under ctest, but not when the binary runs alone).
class RestoreAll {
 public:
  explicit RestoreAll(std::vector<int> cpus) : cpus_(std::move(cpus)) {}
  ~RestoreAll() { (void)HoldProcessThreads(cpus_); }

 private:
  std::vector<int> cpus_;
};

TEST(ThreadAffinityTest, HoldsEveryThreadButThePoolsHeldWorkers) {
  const std::vector<int> all = ThreadCpus(CurrentThreadId());
  ASSERT_FALSE(all.empty());
  RestoreAll restore(all);
  const std::vector<int> share = {all.back()};
  const std::vector<int> workers = {all.front()};
  Parked before;  // a thread started before the hold (autograd's, NCCL's)
  std::atomic<pid_t> worker_tid{0};
  ThreadPool pool(1, 0, workers);  // a pool held to CPUs of its own
  pool.ParallelFor(8, [&](size_t) {
    if (ThreadCpus(CurrentThreadId()) == workers) worker_tid = CurrentThreadId();
  });
  absl::StatusOr<size_t> n = HoldProcessThreads(share);
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_GE(*n, 2u) << "the caller and the parked thread at least";
  EXPECT_EQ(ThreadCpus(CurrentThreadId()), share);
  EXPECT_EQ(ThreadCpus(before.tid()), share);
  if (all.size() > 1 && worker_tid != 0) {
    EXPECT_EQ(ThreadCpus(worker_tid), workers) << "a held worker keeps its own CPUs";
  }
  Parked after;  // a thread started after it (a data loader's) inherits the share
  EXPECT_EQ(ThreadCpus(after.tid()), share);
  // Back to every CPU: the held worker still keeps its own.
  ASSERT_TRUE(HoldProcessThreads(all).ok());
  EXPECT_EQ(ThreadCpus(before.tid()), all);
  if (all.size() > 1 && worker_tid != 0) {
    EXPECT_EQ(ThreadCpus(worker_tid), workers);
  }
}

TEST(ThreadAffinityTest, RefusesAnEmptyOrImpossibleShareAndChangesNothing) {
  const std::vector<int> all = ThreadCpus(CurrentThreadId());
  ASSERT_FALSE(all.empty());
  absl::StatusOr<size_t> empty = HoldProcessThreads({});
  EXPECT_FALSE(empty.ok());
  absl::StatusOr<size_t> out_of_range = HoldProcessThreads({-1, CPU_SETSIZE + 5});
  EXPECT_FALSE(out_of_range.ok());
  EXPECT_NE(std::string(out_of_range.status().message()).find("no CPU"), std::string::npos)
      << out_of_range.status();
  EXPECT_EQ(ThreadCpus(CurrentThreadId()), all);
}

}  // namespace
}  // namespace ferry
