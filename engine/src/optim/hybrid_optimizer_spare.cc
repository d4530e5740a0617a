// HybridOptimizer's spare state for early steps (see BeginGroups in hybrid_optimizer.h): the second
// set of state buffers a speculative update writes, allocated once, at the first announcement, and
// under a budget (EngineOptions::spare_state_fraction, a policy's spare_state) given to a centred run
// of consecutive groups (SpareGroups); the others update once Step knows the step.
#include <algorithm>
#include <cstdlib>
#include <string>
#include <utility>

#include "base/logging.h"
#include "ferry/status.h"
#include "optim/hybrid_optimizer.h"

namespace ferry {

std::vector<uint8_t> SpareGroups(const std::vector<size_t>& bytes, size_t budget) {
  // The groups in registration order, which is a model's forward order; a backward finishes their
  // grads last to first. The groups that speculate must finish within the backward, while the
  // others update after Step, the next forward waiting for each in turn: the forward is held up
  // least when it has speculated layers to run while the CPU updates the later ones. So the run is
  // centred: of the runs that fit with at least 90% of the most bytes any run fits, the one whose
  // groups before and after it are most even, on a tie the later one (its grads come earlier).
  const size_t n = bytes.size();
  size_t total = 0;
  for (size_t b : bytes) total += b;
  std::vector<size_t> end(n, 0), sum(n, 0);  // per start: the run's end (exclusive) and bytes
  size_t most = 0;
  for (size_t i = 0; i < n; ++i) {
    size_t j = i;
    while (j < n && sum[i] + bytes[j] <= budget) sum[i] += bytes[j++];
    end[i] = j;
    most = std::max(most, sum[i]);
  }
  std::vector<uint8_t> chosen(n, 0);
  if (most == 0) return chosen;
  size_t before = 0, best = n, best_skew = 0;
  for (size_t i = 0; i < n; before += bytes[i], ++i) {
    if (sum[i] == 0 || 10 * sum[i] < 9 * most) continue;
    const size_t after = total - before - sum[i];
    const size_t skew = before > after ? before - after : after - before;
    if (best == n || skew <= best_skew) {
      best = i;
      best_skew = skew;
    }
  }
  for (size_t g = best; g < end[best]; ++g) chosen[g] = bytes[g] != 0 ? 1 : 0;
  return chosen;
}

absl::Status HybridOptimizer::EnsureSpareState() {
  if (spare_arena_ != nullptr) return absl::OkStatus();
  // The groups that get spare buffers: all, or under a fraction below 1 a run of consecutive groups
  // that fits, chosen by SpareGroups.
  std::vector<size_t> pages(groups_.size(), 0);
  size_t total = 0;
  for (size_t g = 0; g < groups_.size(); ++g) {
    if (groups_[g].offloaded && !groups_[g].host_state.empty()) pages[g] = (groups_[g].host_state.bytes + 4095) / 4096 * 4096;
    total += pages[g];
  }
  const size_t budget = options_.spare_fraction >= 1.0
                            ? total
                            : static_cast<size_t>(options_.spare_fraction * static_cast<double>(total));
  std::vector<uint8_t> chosen = SpareGroups(pages, budget);
  if (const char* rule = std::getenv("FERRY_SPARE_RUN"); rule != nullptr && std::string(rule) == "last") {
    // A/B measurement only: the groups that fit, the last registered first.
    chosen.assign(groups_.size(), 0);
    size_t sum = 0;
    for (size_t g = groups_.size(); g-- > 0;) {
      if (pages[g] == 0 || sum + pages[g] > budget) continue;
      chosen[g] = 1;
      sum += pages[g];
    }
  }
  size_t bytes = 0;
  for (size_t g = 0; g < groups_.size(); ++g) bytes += chosen[g] != 0 ? pages[g] : 0;
  if (group_uploaded_.empty()) {
    group_uploaded_.resize(groups_.size());
    for (size_t g = 0; g < groups_.size(); ++g) {
      if (groups_[g].offloaded) {
        FERRY_ASSIGN_OR_RETURN(group_uploaded_[g], device_->CreateEvent());
      }
    }
  }
  PinnedArenaOptions arena_options;
  arena_options.capacity_bytes = std::max<size_t>(bytes, 4096);
  arena_options.numa = options_.numa;
  arena_options.numa_node = options_.numa_node;
  arena_options.name = "optimizer spare state (early steps)";
  FERRY_LOG(INFO) << "early steps: allocating " << bytes << " bytes of pinned host memory for the offloaded "
                  << "groups' spare state (once; the offloaded state is " << total << " bytes)";
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<PinnedArena> arena, PinnedArena::Create(device_, arena_options));
  std::vector<HostSpan> spans(groups_.size());
  absl::Status status;
  for (size_t g = 0; g < groups_.size() && status.ok(); ++g) {
    if (chosen[g] == 0) continue;
    absl::StatusOr<HostSpan> span = arena->Allocate(groups_[g].host_state.bytes);
    if (span.ok()) {
      spans[g] = *span;
    } else {
      status = span.status();
    }
  }
  if (!status.ok()) {
    for (const HostSpan& span : spans) {
      if (!span.empty()) (void)arena->Release(span);
    }
    return status;
  }
  for (size_t g = 0; g < groups_.size(); ++g) groups_[g].spare_state = spans[g];
  spare_arena_ = std::move(arena);
  return absl::OkStatus();
}

}  // namespace ferry
