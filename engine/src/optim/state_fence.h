// StateFence: offloaded optimizer state that a background checkpoint reads where it lies (in the
// pinned arena), so that a save takes no copy of it up front. Each region (one tensor of state) is
// either read by the checkpoint writer in place, or, when the optimizer is about to change it
// before the writer got to it, copied aside first (copy-on-write) and read from the copy. The
// trainer therefore never waits for the disk: the next step pays at most a memory copy of the
// regions it overtakes, and waits only for regions being written at that very moment.
#ifndef FERRY_OPTIM_STATE_FENCE_H_
#define FERRY_OPTIM_STATE_FENCE_H_

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/types/span.h"
#include "base/thread_pool.h"

namespace ferry {

// Safe for concurrent use: the writer's threads read and release while the optimizer acquires.
class StateFence final {
 public:
  struct Region {
    size_t param = 0;         // the param whose state this is
    const char* src = nullptr;  // the state in place
    char* copy = nullptr;     // room for a copy of it, `bytes` long (borrowed)
    uint64_t bytes = 0;
  };
  // `num_params` bounds Region::param. REQUIRES: regions do not overlap; every `copy` stays valid
  // until the fence is fully released.
  StateFence(std::vector<Region> regions, size_t num_params);
  StateFence(const StateFence&) = delete;
  StateFence& operator=(const StateFence&) = delete;

  // Reader side. Where to read region `r` from: its place, or the copy the optimizer made first
  // (blocks while that copy is being made). Call before reading any byte of it.
  const char* BeginRead(size_t r);
  // `bytes` more of region `r` are no longer read; once all of them are, the region is free.
  void Release(size_t r, uint64_t bytes);
  // The reader is finished (or failed): every region is free.
  void ReleaseAll();

  // Optimizer side: afterwards the state of `params` may change. Regions nobody has started to read
  // are copied aside (on `pool`, in parallel; null: this thread), regions being read are waited for.
  void Acquire(absl::Span<const size_t> params, ThreadPool* pool);
  // Blocks until every region is free (read, or copied aside).
  void WaitAll();
  // Whether every region is free: nothing left to acquire.
  bool all_released() const { return all_released_.load(std::memory_order_acquire); }
  // Bytes Acquire has copied aside so far.
  uint64_t copied_bytes() const { return copied_bytes_.load(std::memory_order_relaxed); }

 private:
  enum class State : uint8_t { kPending, kCopying, kCopied, kReading, kDone };
  bool Free(State s) const { return s == State::kCopied || s == State::kDone; }
  void MarkFree() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::vector<Region> regions_;
  std::vector<std::vector<size_t>> by_param_;  // param -> its regions
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<State> state_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> released_ ABSL_GUARDED_BY(mu_);  // bytes released per region
  size_t num_busy_ ABSL_GUARDED_BY(mu_) = 0;             // regions not free
  std::atomic<bool> all_released_{false};
  std::atomic<uint64_t> copied_bytes_{0};
};

}  // namespace ferry

#endif  // FERRY_OPTIM_STATE_FENCE_H_
