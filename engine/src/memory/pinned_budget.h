// A cap on how much pinned host memory arenas may reserve, apart from any one arena's capacity.
#ifndef FERRY_MEMORY_PINNED_BUDGET_H_
#define FERRY_MEMORY_PINNED_BUDGET_H_

#include <cstddef>
#include <cstdint>
#include <limits>
#include <mutex>
#include <string>
#include <string_view>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"

namespace ferry {

struct PinnedBudgetStats {
  size_t limit_bytes = 0;
  size_t reserved_bytes = 0;  // held by live reservations
  size_t peak_bytes = 0;      // highest reserved_bytes so far
  uint64_t live_reservations = 0;
  uint64_t refusals = 0;      // Reserve calls that the limit stopped
};

// PinnedBudget: every PinnedArena takes its whole region from a budget when it is created and gives it
// back when destroyed, so that the arenas of a process (optimizer state, checkpoint staging, ...)
// cannot pin more host memory together than the budget allows: pinned pages cannot be swapped or
// reclaimed, and pinning most of a host's memory ends in the OOM killer. An arena's capacity bounds
// its sub-allocations; the budget bounds the reservations.
// Thread-safety: safe for concurrent use.
class PinnedBudget final {
 public:
  static constexpr size_t kUnlimited = std::numeric_limits<size_t>::max();

  // A budget of `limit_bytes` (kUnlimited: no limit). `name` appears in every error message.
  explicit PinnedBudget(size_t limit_bytes, std::string name = "pinned budget");
  // REQUIRES: nothing reserved (every arena drawing from it was destroyed first).
  ~PinnedBudget();
  PinnedBudget(const PinnedBudget&) = delete;
  PinnedBudget& operator=(const PinnedBudget&) = delete;

  // The process-wide budget, used by arenas whose options name no budget. Its limit is 90% of the
  // host memory this process may use (the smaller of physical memory and the cgroup's memory.max),
  // until set_limit changes it. Never destroyed.
  static PinnedBudget& Process();
  // The limit Process() starts with: 90% of the host memory this process may use.
  static size_t DefaultProcessLimit();

  // Changes the limit. A limit below what is reserved is allowed: later reservations fail until
  // enough is given back.
  void set_limit(size_t limit_bytes);
  size_t limit() const;
  const std::string& name() const { return name_; }
  PinnedBudgetStats stats() const;

  // Takes `bytes` for `who` (named in the error). ResourceExhausted when the limit stops it, naming
  // the budget, its limit, what is reserved and by how many reservations, and how to raise it;
  // nothing changes then.
  absl::Status Reserve(size_t bytes, std::string_view who);
  // Gives back `bytes` taken by one Reserve. REQUIRES: a matching successful Reserve.
  void Release(size_t bytes);

 private:
  const std::string name_;
  mutable std::mutex mu_;  // std::mutex: TSan sees it (Debian's Abseil is not TSan-built)
  size_t limit_ ABSL_GUARDED_BY(mu_);
  size_t reserved_ ABSL_GUARDED_BY(mu_) = 0;
  size_t peak_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t live_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t refusals_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace ferry

#endif  // FERRY_MEMORY_PINNED_BUDGET_H_
