#include "optim/state_fence.h"

#include <utility>

#include "base/logging.h"

namespace ferry {

StateFence::StateFence(std::vector<uint64_t> held_bytes) : held_(std::move(held_bytes)) {
  for (uint64_t h : held_) num_held_ += h > 0 ? 1 : 0;
  all_released_.store(num_held_ == 0, std::memory_order_release);
}

void StateFence::Release(size_t param, uint64_t bytes) {
  if (bytes == 0) return;
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    FERRY_CHECK(param < held_.size()) << "StateFence::Release: param " << param << " of " << held_.size();
    FERRY_CHECK(bytes <= held_[param]) << "StateFence::Release: " << bytes << " bytes of param " << param
                                       << " released, " << held_[param] << " held";
    held_[param] -= bytes;
    if (held_[param] == 0) {
      wake = true;
      if (--num_held_ == 0) all_released_.store(true, std::memory_order_release);
    }
  }
  if (wake) cv_.notify_all();
}

void StateFence::ReleaseAll() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (uint64_t& h : held_) h = 0;
    num_held_ = 0;
    all_released_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

void StateFence::WaitReleased(size_t param) {
  if (all_released()) return;
  std::unique_lock<std::mutex> lock(mu_);
  FERRY_CHECK(param < held_.size()) << "StateFence::WaitReleased: param " << param << " of " << held_.size();
  cv_.wait(lock, [&] { return held_[param] == 0; });
}

void StateFence::WaitAll() {
  if (all_released()) return;
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return num_held_ == 0; });
}

}  // namespace ferry
