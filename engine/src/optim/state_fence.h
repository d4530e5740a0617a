// StateFence: offloaded optimizer state that a background checkpoint still reads where it lies (in
// the pinned arena), so that a save needs no copy of it. The reader releases each param's bytes as
// it writes them; the optimizer waits before it changes a param's state until that param is
// released, so the next step waits only for the chunks it is about to modify.
#ifndef FERRY_OPTIM_STATE_FENCE_H_
#define FERRY_OPTIM_STATE_FENCE_H_

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include "absl/base/thread_annotations.h"

namespace ferry {

// Safe for concurrent use: readers release from any thread while the optimizer waits.
class StateFence final {
 public:
  // Param p is held until `held_bytes[p]` bytes of it have been released (0: free from the start).
  explicit StateFence(std::vector<uint64_t> held_bytes);
  StateFence(const StateFence&) = delete;
  StateFence& operator=(const StateFence&) = delete;

  // `bytes` more of param `param` are no longer read. Releasing more than was held is a bug
  // (checked).
  void Release(size_t param, uint64_t bytes);
  // Everything is released (the reader finished, or failed).
  void ReleaseAll();

  // Blocks until param `param` is released. Returns at once when it is.
  void WaitReleased(size_t param);
  // Blocks until every param is released.
  void WaitAll();
  // Whether every param is released.
  bool all_released() const { return all_released_.load(std::memory_order_acquire); }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<uint64_t> held_ ABSL_GUARDED_BY(mu_);  // bytes still held per param
  size_t num_held_ ABSL_GUARDED_BY(mu_) = 0;         // params with held_ > 0
  std::atomic<bool> all_released_{false};
};

}  // namespace ferry

#endif  // FERRY_OPTIM_STATE_FENCE_H_
