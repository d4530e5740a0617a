// A fixed pool of worker threads for data-parallel work.
#ifndef FERRY_BASE_THREAD_POOL_H_
#define FERRY_BASE_THREAD_POOL_H_

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"

namespace ferry {

// ThreadPool runs closures on `num_threads` workers. Safe for concurrent use. The destructor finishes
// all scheduled work, then joins the workers.
//
// Waking a sleeping thread costs tens to hundreds of microseconds (the futex, then the core's exit
// from its idle state): a CPU Adam round of ~2 ms on 16 threads lost ~8% of its time to it on the
// H200 machine. So a worker that runs out of work spins for `spin_us` before it sleeps, and so does
// ParallelFor's caller waiting for the last tasks: back-to-back ParallelFor calls find the workers
// awake. Spinning pauses and yields the CPU to any other runnable thread every few microseconds, and
// only follows work, so an idle pool costs nothing.
class ThreadPool final {
 public:
  // The default spin: kDefaultSpinUs, or the FERRY_POOL_SPIN_US environment variable (0 = sleep at
  // once), read once per process.
  static int64_t DefaultSpinUs();
  static constexpr int64_t kDefaultSpinUs = 1000;

  // REQUIRES: num_threads >= 1 (0 is taken as 1); spin_us >= 0 (< 0: DefaultSpinUs()).
  // `cpus` non-empty: the workers run only on these CPUs (a rank's share of its host), each free to
  // move among them (one CPU per worker measured no better, and far worse when a worker's CPU was
  // also wanted by the pipeline's own threads). Refused by the kernel: the workers stay unrestricted.
  // `name`: the workers' thread name (NameCurrentThread), e.g. ferry-adam for CPU Adam's.
  explicit ThreadPool(size_t num_threads, int64_t spin_us = -1, std::vector<int> cpus = {},
                      const char* name = "ferry-pool");
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  size_t num_threads() const { return workers_.size(); }
  // The CPUs the workers may run on (empty: any).
  const std::vector<int>& cpus() const { return cpus_; }
  int64_t spin_us() const { return spin_ns_ / 1000; }

  // Queues `fn` to run on some worker.
  void Schedule(std::function<void()> fn);

  // Runs fn(i) for i in [0, num_tasks) across the workers and the calling thread, and returns when all
  // have finished. Task i always covers the same work whatever the thread count (callers partition
  // statically by task index), so results do not depend on the number of threads.
  // `meanwhile`, when given, runs once on the calling thread after the workers were handed the tasks
  // and before it joins them (a pipeline submits its next copies while the workers compute).
  // REQUIRES: not called from inside a task of this pool.
  void ParallelFor(size_t num_tasks, const std::function<void(size_t)>& fn,
                   const std::function<void()>* meanwhile = nullptr);

  // The default number of workers: the CPUs this process may run on.
  static size_t DefaultThreads();

 private:
  struct Job;

 public:
  // Tasks handed to the workers by Post, running until Join. Move-only; destroying one that was not
  // joined joins it (its tasks may read what the caller is about to free).
  class Pending final {
   public:
    Pending() = default;
    Pending(Pending&& other) noexcept;
    Pending& operator=(Pending&& other) noexcept;
    Pending(const Pending&) = delete;
    Pending& operator=(const Pending&) = delete;
    ~Pending() { (void)Join(); }

    // Returns when every task has finished (their writes are visible after). While the last tasks
    // still run on other threads, the calling thread runs tasks of batches Post-ed after this one,
    // one at a time (so it returns within about one task of the last), rather than leave its core
    // idle: so Post's tasks must not take a lock that a joining thread may hold. No-op when empty or
    // joined. Returns when the last task ended (std::chrono::steady_clock, ns since its epoch: the
    // trace's SteadyNs), which may be well before the call when the caller came late; 0 when empty,
    // joined already or without tasks.
    int64_t Join();
    // Runs one task not yet claimed on the calling thread; false when none was left (or empty).
    bool RunOne();
    bool empty() const { return job_ == nullptr; }

   private:
    friend class ThreadPool;
    ThreadPool* pool_ = nullptr;
    std::shared_ptr<Job> job_;
  };

  // Hands fn(i) for i in [0, num_tasks) to the workers and returns at once: the asynchronous
  // ParallelFor. Workers take batches in the order they were posted, so a batch posted while another
  // runs starts on each worker as soon as that worker finds no task left in the earlier one (no
  // barrier between them). `fn` is owned by the batch. The same REQUIRES as ParallelFor.
  Pending Post(size_t num_tasks, std::function<void(size_t)> fn);

 private:
  // One ParallelFor or Post call: tasks are claimed through `next`; `done` counts finished ones.
  struct Job {
    const std::function<void(size_t)>* fn = nullptr;
    std::function<void(size_t)> owned;  // Post's fn (fn points to it)
    bool posted = false;                // by Post: a Join elsewhere may run its tasks
    size_t num_tasks = 0;
    std::atomic<size_t> next{0};
    std::atomic<size_t> done{0};
    std::atomic<int64_t> finished_ns{0};  // Post: when the last task ended (steady clock), set by that task
    std::mutex mu;
    std::condition_variable cv;
    bool finished ABSL_GUARDED_BY(mu) = false;
  };

  // A worker's loop (restricted to cpus_ first when set).
  void WorkerLoop();
  // Claims and runs `job`'s tasks until none is left.
  static void Drain(Job& job);
  // Claims and runs one task of `job`; false when none was left.
  static bool RunOne(Job& job);
  // Queues `job` for the workers (ParallelFor, Post).
  void Enqueue(const std::shared_ptr<Job>& job);
  // Waits until every task of `job` has finished, then forgets it. `help`: runs tasks of batches
  // Post-ed after it meanwhile (Pending::Join).
  void Wait(const std::shared_ptr<Job>& job, bool help);
  // Posts a change (a closure, a job, stopping) and wakes the sleeping workers. REQUIRES: mu_ held.
  void PostLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Spins until `posted_` differs from `seen` or spin_ns_ passed; true if it did.
  bool SpinFor(uint64_t seen) const;

  // std::mutex rather than absl::Mutex: Debian's Abseil is not built for ThreadSanitizer, which then
  // cannot see absl::Mutex and reports false races.
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  std::deque<std::shared_ptr<Job>> jobs_ ABSL_GUARDED_BY(mu_);  // ParallelFor calls in progress
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int sleepers_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<uint64_t> posted_{0};  // bumped (under mu_) by every change a worker may act on
  int64_t spin_ns_ = 0;
  std::vector<int> cpus_;
  const char* name_;  // a string literal of the caller's
  std::vector<std::thread> workers_;
};

}  // namespace ferry

#endif  // FERRY_BASE_THREAD_POOL_H_
