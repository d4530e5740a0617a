// HybridOptimizer's spare state for early steps (see BeginGroups in hybrid_optimizer.h): the second
// side of the state that a speculative update writes, allocated once, at the first announcement, and
// under a budget (EngineOptions::spare_state_fraction, a policy's spare_state) given to params spread
// over the model (SpareSpread); the others update once Step knows the step. And each param's side:
// where its state lives now (StatePtr), its other side (SpareStatePtr), the swap of a kept group's
// (CommitSpare).
#include <algorithm>
#include <utility>

#include "base/logging.h"
#include "ferry/status.h"
#include "optim/hybrid_optimizer.h"

namespace ferry {

std::vector<uint8_t> SpareSpread(const std::vector<size_t>& bytes, size_t budget) {
  // Why spread: the speculated params must be updated within the backward, the others after Step,
  // the next forward waiting for each in turn. Spread evenly, the speculation has work from the
  // first grads of the backward on (the head's, with half the budget), and what the forward waits
  // for after Step is spread through it: the last of it is near the forward's end, so that little of
  // the forward, loss and backward runs while the CPU has nothing to update. A centred run of params
  // (the rule before) left the CPU idle through the backward of the last layers: 31-33 ms of each
  // 735M iteration at half the budget against 16-17 ms spread, as with the whole spare state (1 x
  // H200 host, 2026-11-28); a run of the last ones left the forward waiting for all the rest at its
  // start.
  std::vector<uint8_t> chosen(bytes.size(), 0);
  size_t total = 0;
  for (size_t b : bytes) total += b;
  if (total == 0) return chosen;
  const double share = std::min(1.0, static_cast<double>(budget) / static_cast<double>(total));
  double seen = 0.0;
  size_t taken = 0;
  for (size_t p = bytes.size(); p-- > 0;) {
    if (bytes[p] == 0) continue;
    seen += static_cast<double>(bytes[p]);
    if (taken + bytes[p] <= budget && static_cast<double>(taken) + 0.5 * static_cast<double>(bytes[p]) <= share * seen) {
      chosen[p] = 1;
      taken += bytes[p];
    }
  }
  // What large params left of the budget (each too large when its turn came): the others that still
  // fit, from the end.
  for (size_t p = bytes.size(); p-- > 0;) {
    if (chosen[p] != 0 || bytes[p] == 0 || taken + bytes[p] > budget) continue;
    chosen[p] = 1;
    taken += bytes[p];
  }
  return chosen;
}

absl::Status HybridOptimizer::EnsureSpareState() {
  if (spare_arena_ != nullptr) return absl::OkStatus();
  // The params that get spare buffers: all, or under a fraction below 1 those SpareSpread picks (a
  // param, not its group, is the unit, so that a model in one or two groups speculates on part of
  // itself too). Each param counts its slot in its group's layout (padding to the next slot
  // included); a group's spare buffers hold its chosen params' slots packed (spare_slot_).
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
  std::vector<uint8_t> chosen = SpareSpread(item, budget);
  // Each group's slots; its buffers in whole pages. Rounding may overshoot the budget by a page a
  // group: the first registered chosen params (the last a backward finishes) are then given up
  // until it fits. Kept here until the buffers exist (HasSpare reads spare_slot_).
  std::vector<int64_t> slot(params_.size(), -1), group_n(groups_.size(), 0);
  auto slots = [&]() {
    size_t bytes = 0;
    for (size_t g = 0; g < groups_.size(); ++g) {
      group_n[g] = 0;
      for (size_t p : groups_[g].params) {
        slot[p] = -1;
        if (chosen[p] == 0) continue;
        slot[p] = group_n[g];
        group_n[g] += extent[p];
      }
      bytes += (static_cast<size_t>(group_n[g]) * groups_[g].format.bytes_per_element() + 4095) / 4096 * 4096;
    }
    return bytes;
  };
  size_t bytes = slots();
  for (size_t p = 0; options_.spare_fraction < 1.0 && bytes > budget && p < params_.size(); ++p) {
    if (chosen[p] == 0) continue;
    chosen[p] = 0;
    bytes = slots();
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
    if (group_n[g] == 0) continue;
    absl::StatusOr<HostSpan> span =
        arena->Allocate(static_cast<size_t>(group_n[g]) * groups_[g].format.bytes_per_element());
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
  for (size_t g = 0; g < groups_.size(); ++g) {
    groups_[g].spare_state = spans[g];
    groups_[g].spare_n = group_n[g];
  }
  spare_slot_ = std::move(slot);
  spare_arena_ = std::move(arena);
  return absl::OkStatus();
}

// ---- each param's side of its state (state_side_) ----

char* HybridOptimizer::StatePtr(size_t p, StateKind kind, size_t e) const {
  const Group& g = groups_[params_[p].group];
  const size_t es = DTypeSize(kind == StateKind::kMaster ? g.format.master : g.format.moments);
  if (state_side_[p] != 0) return g.state(kind, /*spare=*/true) + (static_cast<size_t>(spare_slot_[p]) + e) * es;
  return g.state(kind) + (static_cast<size_t>(param_slot_[p]) + e) * es;
}

bool HybridOptimizer::HasSpare(size_t p) const { return spare_slot_[p] >= 0; }

bool HybridOptimizer::AllSpare(size_t g) const {
  for (size_t p : groups_[g].params) {
    if (!HasSpare(p)) return false;
  }
  return true;
}

void HybridOptimizer::CommitSpare(size_t g) {
  for (size_t p : groups_[g].params) {
    if (HasSpare(p) && (kept_in_place_.empty() || kept_in_place_[p] == 0)) state_side_[p] ^= 1;
    if (!kept_in_place_.empty()) kept_in_place_[p] = 0;
  }
}

char* HybridOptimizer::SpareStatePtr(size_t p, StateKind kind, size_t e) const {
  const Group& g = groups_[params_[p].group];
  const size_t es = DTypeSize(kind == StateKind::kMaster ? g.format.master : g.format.moments);
  if (state_side_[p] != 0) return g.state(kind) + (static_cast<size_t>(param_slot_[p]) + e) * es;
  return g.state(kind, /*spare=*/true) + (static_cast<size_t>(spare_slot_[p]) + e) * es;
}

}  // namespace ferry
