// The ranks of one host side by side, from their Ferry traces merged on one clock (MergeTraces): when
// each rank's trainer reached its step, and when each rank's early pass ended its update of a step.
// Which rank each collective waited for on the GPUs: torch.profiler's traces (trace/rank_profiles.h).
#ifndef FERRY_TRACE_RANK_ARRIVALS_H_
#define FERRY_TRACE_RANK_ARRIVALS_H_

#include <cstddef>
#include <string>
#include <vector>

#include "trace/trace_file.h"

namespace ferry {

// One step across the ranks: the latest rank's time less the earliest's, and the rank that came last.
struct RankArrival {
  size_t step = 0;
  double spread_ms = 0.0;
  int last = 0;
};

// When each rank's trainer reached its step: per step index that every rank has, the ranks' `step`
// span starts. A host that runs far ahead of its GPU arrives early, so a spread here need not be the
// GPUs': on the 4 x H100 host the hosts reached their step 62.6 ms apart at the median while the
// backward's reduce-scatters started 0.46 ms apart.
std::vector<RankArrival> RankArrivals(const TraceFile& trace);

// When each rank's early pass ended its update of a step: the end of the last `early.part_done` span
// whose `step` arg is that step (the step its part computes; `step` here is that number), per step
// that every rank has. Under ZeRO-1 and FSDP2 the next forward needs every rank's part of a layer, so
// it runs at the pace of the rank whose update ends last.
std::vector<RankArrival> UpdateEnds(const TraceFile& trace);

// Both in a few lines each: the median and largest spread and how often each rank came last; empty
// for one rank, or files not on one clock.
std::string FormatRankArrivals(const TraceFile& trace);

}  // namespace ferry

#endif  // FERRY_TRACE_RANK_ARRIVALS_H_
