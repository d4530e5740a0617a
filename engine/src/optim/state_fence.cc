#include "optim/state_fence.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "base/logging.h"

namespace ferry {

StateFence::StateFence(std::vector<Region> regions, size_t num_params)
    : regions_(std::move(regions)),
      by_param_(num_params),
      state_(regions_.size(), State::kPending),
      released_(regions_.size(), 0) {
  for (size_t r = 0; r < regions_.size(); ++r) {
    FERRY_CHECK(regions_[r].param < num_params) << "StateFence: region " << r << " names param " << regions_[r].param;
    by_param_[regions_[r].param].push_back(r);
    if (regions_[r].bytes == 0) {
      state_[r] = State::kDone;
    } else {
      ++num_busy_;
    }
  }
  all_released_.store(num_busy_ == 0, std::memory_order_release);
}

void StateFence::MarkFree() {
  if (--num_busy_ == 0) all_released_.store(true, std::memory_order_release);
}

const char* StateFence::BeginRead(size_t r) {
  std::unique_lock<std::mutex> lock(mu_);
  FERRY_CHECK(r < regions_.size()) << "StateFence::BeginRead: region " << r << " of " << regions_.size();
  cv_.wait(lock, [&] { return state_[r] != State::kCopying; });
  if (state_[r] == State::kCopied) return regions_[r].copy;
  if (state_[r] == State::kPending) state_[r] = State::kReading;
  return regions_[r].src;
}

void StateFence::Release(size_t r, uint64_t bytes) {
  if (bytes == 0) return;
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    FERRY_CHECK(r < regions_.size()) << "StateFence::Release: region " << r << " of " << regions_.size();
    released_[r] += bytes;
    FERRY_CHECK(released_[r] <= regions_[r].bytes)
        << "StateFence::Release: " << released_[r] << " bytes of region " << r << " released, "
        << regions_[r].bytes << " held";
    if (released_[r] == regions_[r].bytes && state_[r] == State::kReading) {
      state_[r] = State::kDone;
      MarkFree();
      wake = true;
    }
  }
  if (wake) cv_.notify_all();
}

void StateFence::ReleaseAll() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t r = 0; r < regions_.size(); ++r) {
      // A copy in progress finishes on its own (Acquire marks it copied).
      if (state_[r] == State::kPending || state_[r] == State::kReading) {
        state_[r] = State::kDone;
        MarkFree();
      }
    }
  }
  cv_.notify_all();
}

void StateFence::Acquire(absl::Span<const size_t> params, ThreadPool* pool) {
  if (all_released()) return;
  std::vector<size_t> to_copy;
  {
    std::unique_lock<std::mutex> lock(mu_);
    for (size_t p : params) {
      FERRY_CHECK(p < by_param_.size()) << "StateFence::Acquire: param " << p << " of " << by_param_.size();
      for (size_t r : by_param_[p]) {
        if (state_[r] == State::kPending) {
          state_[r] = State::kCopying;  // the reader waits for the copy and then reads it
          to_copy.push_back(r);
        }
      }
    }
    // Regions being read right now: their bytes reach the page cache shortly.
    for (size_t p : params) {
      for (size_t r : by_param_[p]) {
        cv_.wait(lock, [&] { return state_[r] != State::kReading; });
      }
    }
  }
  if (to_copy.empty()) return;
  // Copy aside in pieces, so a few large regions still use every thread.
  constexpr uint64_t kPiece = uint64_t{8} << 20;
  std::vector<std::pair<size_t, uint64_t>> pieces;  // (region, offset)
  for (size_t r : to_copy) {
    for (uint64_t at = 0; at < regions_[r].bytes; at += kPiece) pieces.emplace_back(r, at);
  }
  auto copy_one = [&](size_t i) {
    const Region& region = regions_[pieces[i].first];
    const uint64_t at = pieces[i].second;
    std::memcpy(region.copy + at, region.src + at, std::min(kPiece, region.bytes - at));
  };
  if (pool != nullptr && pieces.size() > 1) {
    pool->ParallelFor(pieces.size(), copy_one);
  } else {
    for (size_t i = 0; i < pieces.size(); ++i) copy_one(i);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t r : to_copy) {
      copied_bytes_.fetch_add(regions_[r].bytes, std::memory_order_relaxed);
      state_[r] = State::kCopied;
      MarkFree();
    }
  }
  cv_.notify_all();
}

void StateFence::WaitAll() {
  if (all_released()) return;
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return num_busy_ == 0; });
}

}  // namespace ferry
