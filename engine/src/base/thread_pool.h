// A fixed pool of worker threads for data-parallel work.
#ifndef FERRY_BASE_THREAD_POOL_H_
#define FERRY_BASE_THREAD_POOL_H_

#include <cstddef>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include <condition_variable>
#include <mutex>

#include "absl/base/thread_annotations.h"

namespace ferry {

// ThreadPool runs closures on `num_threads` workers. Safe for concurrent use. The destructor finishes
// all scheduled work, then joins the workers.
class ThreadPool final {
 public:
  // REQUIRES: num_threads >= 1.
  explicit ThreadPool(size_t num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  size_t num_threads() const { return workers_.size(); }

  // Queues `fn` to run on some worker.
  void Schedule(std::function<void()> fn);

  // Runs fn(i) for i in [0, num_tasks) across the workers and the calling thread, and returns when all
  // have finished. Task i always covers the same work whatever the thread count (callers partition
  // statically by task index), so results do not depend on the number of threads.
  // REQUIRES: not called from inside a task of this pool.
  void ParallelFor(size_t num_tasks, const std::function<void(size_t)>& fn);

  // The default number of workers: the CPUs this process may run on.
  static size_t DefaultThreads();

 private:
  void WorkerLoop();

  // std::mutex rather than absl::Mutex: Debian's Abseil is not built for ThreadSanitizer, which then
  // cannot see absl::Mutex and reports false races.
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

}  // namespace ferry

#endif  // FERRY_BASE_THREAD_POOL_H_
