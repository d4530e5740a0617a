// HybridOptimizer's spare state for early steps (see BeginGroups in hybrid_optimizer.h): the second
// side of the state that a speculative update writes, allocated once, at the first announcement, and
// under a budget (EngineOptions::spare_state_fraction, a policy's spare_state) given to a centred run
// of consecutive params (SpareRun); the others update once Step knows the step.
#include <algorithm>
#include <cstdlib>
#include <string>
#include <utility>

#include "base/logging.h"
#include "ferry/status.h"
#include "optim/hybrid_optimizer.h"

namespace ferry {

std::vector<uint8_t> SpareRun(const std::vector<size_t>& bytes, size_t budget) {
  // The items (params) in registration order, which is a model's forward order; a backward
  // finishes their grads last to first. Those that speculate must finish within the backward, while
  // the others update after Step, the next forward waiting for each in turn: the forward is held up
  // least when it has speculated layers to run while the CPU updates the later ones. So the run is
  // centred: of the runs that fit with at least 90% of the most bytes any run fits, the one whose
  // items before and after it are most even, on a tie the later one (its grads come earlier).
  const size_t n = bytes.size();
  size_t total = 0;
  for (size_t b : bytes) total += b;
  std::vector<size_t> end(n, 0), sum(n, 0);  // per start: the longest run that fits, its end and bytes
  size_t most = 0;
  for (size_t i = 0, j = 0, run = 0; i < n; ++i) {  // run: the bytes of [i, j)
    if (j < i) j = i, run = 0;
    while (j < n && run + bytes[j] <= budget) run += bytes[j++];
    end[i] = j;
    sum[i] = run;
    most = std::max(most, run);
    if (j > i) run -= bytes[i];
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
  // The params that get spare buffers: all, or under a fraction below 1 a run of consecutive params
  // (registration order) that fits, chosen by SpareRun: a param, not its group, is the unit, so that
  // a model in one or two groups speculates on part of itself too. Each param counts its slot in its
  // group's layout (padding to the next slot included), so a group's chosen params take one range
  // of its layout, [spare_lo, spare_lo + spare_n), and its spare buffers hold that range alone.
  std::vector<size_t> item(params_.size(), 0);
  std::vector<int64_t> extent(params_.size(), 0);  // elements from its slot to the next one
  size_t total = 0;
  for (Group& g : groups_) {
    if (!g.offloaded || g.host_state.empty()) continue;
    total += (g.host_state.bytes + 4095) / 4096 * 4096;
    for (size_t i = 0; i < g.params.size(); ++i) {
      const size_t p = g.params[i];
      const int64_t end = i + 1 < g.params.size() ? param_slot_[g.params[i + 1]] : g.layout.total_elements();
      extent[p] = end - param_slot_[p];
      item[p] = static_cast<size_t>(extent[p]) * g.format.bytes_per_element();
    }
  }
  const size_t budget = options_.spare_fraction >= 1.0
                            ? total
                            : static_cast<size_t>(options_.spare_fraction * static_cast<double>(total));
  std::vector<uint8_t> chosen = SpareRun(item, budget);
  if (const char* rule = std::getenv("FERRY_SPARE_RUN"); rule != nullptr && std::string(rule) == "last") {
    // A/B measurement only: the params that fit, the last registered first.
    chosen.assign(params_.size(), 0);
    size_t sum = 0;
    for (size_t p = params_.size(); p-- > 0;) {
      if (item[p] == 0 || sum + item[p] > budget) continue;
      chosen[p] = 1;
      sum += item[p];
    }
  }
  // Each group's range; its buffers in whole pages. Rounding may overshoot the budget by a page a
  // group: the run then gives up params at its end until it fits.
  auto ranges = [&]() {
    size_t bytes = 0;
    for (Group& g : groups_) {
      g.spare_lo = g.spare_n = 0;
      int64_t lo = -1, hi = 0;
      for (size_t p : g.params) {
        if (chosen[p] == 0) continue;
        if (lo < 0) lo = param_slot_[p];
        hi = param_slot_[p] + extent[p];
      }
      if (lo < 0) continue;
      g.spare_lo = lo;
      g.spare_n = hi - lo;
      bytes += (static_cast<size_t>(g.spare_n) * g.format.bytes_per_element() + 4095) / 4096 * 4096;
    }
    return bytes;
  };
  size_t bytes = ranges();
  for (size_t p = params_.size(); options_.spare_fraction < 1.0 && bytes > budget && p-- > 0;) {
    if (chosen[p] == 0) continue;
    chosen[p] = 0;
    bytes = ranges();
  }
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
    if (groups_[g].spare_n == 0) continue;
    absl::StatusOr<HostSpan> span =
        arena->Allocate(static_cast<size_t>(groups_[g].spare_n) * groups_[g].format.bytes_per_element());
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
    for (Group& g : groups_) g.spare_lo = g.spare_n = 0;
    return status;
  }
  for (size_t g = 0; g < groups_.size(); ++g) groups_[g].spare_state = spans[g];
  spare_arena_ = std::move(arena);
  return absl::OkStatus();
}

}  // namespace ferry
