#include "base/thread_pool.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <utility>

#include "base/thread_affinity.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace ferry {
namespace {

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// Spins (CpuRelax) until done() or `spin_ns` passed; returns done()'s last value.
template <typename Done>
bool SpinUntil(int64_t spin_ns, Done done) {
  if (done()) return true;
  if (spin_ns <= 0) return false;
  const auto start = std::chrono::steady_clock::now();
  for (unsigned i = 1;; ++i) {
    CpuRelax();
    if (done()) return true;
    if ((i & 63) == 0) {
      if (std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count() > spin_ns) {
        return false;
      }
      sched_yield();  // a thread with work to do (more threads than CPUs) takes the CPU
    }
  }
}

}  // namespace

int64_t ThreadPool::DefaultSpinUs() {
  static const int64_t spin_us = [] {
    const char* env = std::getenv("FERRY_POOL_SPIN_US");
    if (env == nullptr || *env == '\0') return kDefaultSpinUs;
    char* end = nullptr;
    const long long v = std::strtoll(env, &end, 10);
    return (end != nullptr && *end == '\0' && v >= 0 && v <= 1000000) ? static_cast<int64_t>(v) : kDefaultSpinUs;
  }();
  return spin_us;
}

ThreadPool::ThreadPool(size_t num_threads, int64_t spin_us, std::vector<int> cpus, const char* name)
    : cpus_(std::move(cpus)), name_(name) {
  if (num_threads == 0) num_threads = 1;
  spin_ns_ = (spin_us < 0 ? DefaultSpinUs() : spin_us) * 1000;
  workers_.reserve(num_threads);
  for (size_t i = 0; i < num_threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    PostLocked();
  }
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::PostLocked() {
  posted_.fetch_add(1, std::memory_order_release);
  if (sleepers_ > 0) cv_.notify_all();
}

void ThreadPool::Schedule(std::function<void()> fn) {
  std::lock_guard<std::mutex> lock(mu_);
  queue_.push_back(std::move(fn));
  PostLocked();
}

bool ThreadPool::SpinFor(uint64_t seen) const {
  return SpinUntil(spin_ns_, [&] { return posted_.load(std::memory_order_acquire) != seen; });
}

void ThreadPool::Drain(Job& job) {
  while (RunOne(job)) {
  }
}

bool ThreadPool::RunOne(Job& job) {
  const size_t i = job.next.fetch_add(1, std::memory_order_relaxed);
  if (i >= job.num_tasks) return false;
  (*job.fn)(i);
  if (job.posted) {
    // Each task of a Post-ed batch stamps its end (the latest one wins) before it counts itself done,
    // so a joiner that sees every task done reads the last one's (Pending::Join returns it).
    const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                            std::chrono::steady_clock::now().time_since_epoch()).count();
    int64_t seen = job.finished_ns.load(std::memory_order_relaxed);
    while (seen < now && !job.finished_ns.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
    }
  }
  if (job.done.fetch_add(1, std::memory_order_acq_rel) + 1 == job.num_tasks) {
    std::lock_guard<std::mutex> lock(job.mu);
    job.finished = true;
    job.cv.notify_all();
  }
  return true;
}

void ThreadPool::WorkerLoop() {
  NameCurrentThread(name_);
  // A worker held to the share's CPUs is left alone by HoldProcessThreads (registered before it holds
  // itself, so that a hold running meanwhile cannot undo its own).
  const pid_t held = cpus_.empty() ? 0 : CurrentThreadId();
  struct Unregister {
    pid_t tid;
    ~Unregister() {
      if (tid != 0) UnregisterHeldThread(tid);
    }
  } unregister{held};
  if (held != 0) RegisterHeldThread(held);
  if (!cpus_.empty()) {
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int cpu : cpus_) {
      if (cpu >= 0 && cpu < CPU_SETSIZE) CPU_SET(cpu, &set);
    }
    (void)pthread_setaffinity_np(pthread_self(), sizeof(set), &set);  // refused: the worker stays unrestricted
  }
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    if (!queue_.empty()) {
      std::function<void()> fn = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      fn();
      lock.lock();
      continue;
    }
    std::shared_ptr<Job> job;
    for (const std::shared_ptr<Job>& j : jobs_) {
      if (j->next.load(std::memory_order_relaxed) < j->num_tasks) {
        job = j;
        break;
      }
    }
    if (job != nullptr) {
      lock.unlock();
      Drain(*job);
      job.reset();
      lock.lock();
      continue;
    }
    if (stopping_) return;  // and drained
    const uint64_t seen = posted_.load(std::memory_order_relaxed);
    lock.unlock();
    const bool changed = SpinFor(seen);
    lock.lock();
    if (changed || posted_.load(std::memory_order_relaxed) != seen) continue;
    ++sleepers_;
    cv_.wait(lock, [&] { return posted_.load(std::memory_order_relaxed) != seen; });
    --sleepers_;
  }
}

void ThreadPool::Enqueue(const std::shared_ptr<Job>& job) {
  std::lock_guard<std::mutex> lock(mu_);
  jobs_.push_back(job);
  PostLocked();
}

void ThreadPool::Wait(const std::shared_ptr<Job>& job, bool help) {
  Drain(*job);
  // Every task is claimed; until those still running on other threads finish, help with a batch
  // posted (Post) after this one when asked, then spin, then sleep. Only Post's batches: a
  // ParallelFor's caller may hold a lock that another caller's tasks take.
  const auto finished = [&] { return job->done.load(std::memory_order_acquire) == job->num_tasks; };
  while (!finished()) {
    std::shared_ptr<Job> other;
    if (help) {
      std::lock_guard<std::mutex> lock(mu_);
      bool after = false;
      for (const std::shared_ptr<Job>& j : jobs_) {
        if (j == job) {
          after = true;
        } else if (after && j->posted && j->next.load(std::memory_order_relaxed) < j->num_tasks) {
          other = j;
          break;
        }
      }
    }
    if (other != nullptr && RunOne(*other)) continue;
    if (!SpinUntil(spin_ns_, finished)) {
      std::unique_lock<std::mutex> lock(job->mu);
      job->cv.wait(lock, [&] { return job->finished; });
    }
    break;
  }
  std::lock_guard<std::mutex> lock(mu_);
  jobs_.erase(std::find(jobs_.begin(), jobs_.end(), job));
}

void ThreadPool::ParallelFor(size_t num_tasks, const std::function<void(size_t)>& fn,
                             const std::function<void()>* meanwhile) {
  if (num_tasks == 0 || (num_tasks == 1 && meanwhile == nullptr)) {
    if (meanwhile != nullptr) (*meanwhile)();
    if (num_tasks == 1) fn(0);
    return;
  }
  // Tasks are claimed dynamically, but each task index names fixed work, so the result is the same.
  auto job = std::make_shared<Job>();
  job->fn = &fn;
  job->num_tasks = num_tasks;
  Enqueue(job);
  if (meanwhile != nullptr) (*meanwhile)();
  Wait(job, /*help=*/false);
}

ThreadPool::Pending ThreadPool::Post(size_t num_tasks, std::function<void(size_t)> fn) {
  Pending pending;
  if (num_tasks == 0) return pending;
  auto job = std::make_shared<Job>();
  job->owned = std::move(fn);
  job->fn = &job->owned;
  job->num_tasks = num_tasks;
  job->posted = true;
  Enqueue(job);
  pending.pool_ = this;
  pending.job_ = std::move(job);
  return pending;
}

ThreadPool::Pending::Pending(Pending&& other) noexcept : pool_(other.pool_), job_(std::move(other.job_)) {}

ThreadPool::Pending& ThreadPool::Pending::operator=(Pending&& other) noexcept {
  if (this != &other) {
    (void)Join();
    pool_ = other.pool_;
    job_ = std::move(other.job_);
  }
  return *this;
}

bool ThreadPool::Pending::RunOne() { return job_ != nullptr && ThreadPool::RunOne(*job_); }

int64_t ThreadPool::Pending::Join() {
  if (job_ == nullptr) return 0;
  const std::shared_ptr<Job> job = std::move(job_);  // empty now: a second Join does nothing
  pool_->Wait(job, /*help=*/true);
  return job->finished_ns.load(std::memory_order_relaxed);
}

size_t ThreadPool::DefaultThreads() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n > 0) return static_cast<size_t>(n);
  }
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : n;
}

}  // namespace ferry
