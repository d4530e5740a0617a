// The early steps' bookkeeping (see BeginGroups in hybrid_optimizer.h): the parts of the update the
// early thread runs, what an announcement queues, and the trainer's record of the step announced so
// far. Plain data of HybridOptimizer; its early-step files (hybrid_optimizer_early*.cc) use them.
#ifndef FERRY_OPTIM_EARLY_STEP_H_
#define FERRY_OPTIM_EARLY_STEP_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "base/adam_math.h"
#include "device/device.h"

namespace ferry {

// A part of the update for the early thread: the offloaded params of one announcement (of any
// groups), or a bucket of one group's params that Step started.
struct EarlyPart {
  std::vector<size_t> groups;  // the distinct groups of `params`
  std::vector<size_t> params;  // indices into HybridOptimizer's params
  size_t id = 0;               // this step's part number (part_done_, part_events_)
  Event* uploaded = nullptr;   // recorded on the H2D stream after its last upload
  // The early thread downloads the final part of the highest priority first (on a tie the latest
  // queued): the index of the announcement that holds its params, so that a backward's latest
  // announcement, which the next forward needs first, goes first, whether the part speculates or
  // Step queued it; -1 for params no announcement held.
  int64_t priority = 0;
};

// An announcement's work, queued for the early thread.
struct EarlyItem {
  std::vector<EarlyPart> parts;
  Event* ready = nullptr;
  // The step is decided (Step queued it with the step's own scalars) and no part of these groups is
  // in the spare buffers: the update runs in place, as Step's own pipeline would.
  bool in_place = false;
  std::vector<AdamScalars> scalars;  // per group (set for every group of `parts`)
  std::vector<int64_t> steps;        // per group: the step it computes (its rounding keys')
};

// The step announced so far, on the trainer's thread (reset at its first announcement and once Step
// has settled it).
struct EarlyStep {
  std::vector<size_t> order;          // groups with a param announced this step, in order
  std::vector<bool> touched;          // per group: a param of it was announced
  std::vector<bool> announced;        // per group: every param of it was announced
  std::vector<size_t> left;           // per group: its params not announced yet
  std::vector<bool> param_announced;  // per param
  std::vector<AdamScalars> scalars;   // per group: the speculation's (of its first announcement)
  std::vector<uint8_t> mixed;         // per group: a later announcement of it used other scalars
  std::vector<uint8_t> queued;        // per group: a part of its update was started
  std::vector<size_t> unqueued;       // per group: its params no part holds yet
  std::vector<std::vector<size_t>> announcements;  // the offloaded params of each, in order
  size_t events_used = 0;             // of HybridOptimizer's blocking events for announcements
};

}  // namespace ferry

#endif  // FERRY_OPTIM_EARLY_STEP_H_
