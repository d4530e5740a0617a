// What `ferry trace` (and `python3 -m ferry trace`) prints for traces read with ReadTraceFile, one
// file per rank: torch.profiler's through trace/rank_profiles.h; Ferry's own as the stages beside
// their ceilings, the iterations and the ranks' arrivals (trace/trace_file.h).
#ifndef FERRY_TRACE_TRACE_REPORT_H_
#define FERRY_TRACE_TRACE_REPORT_H_

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "trace/trace_file.h"

namespace ferry {

// The ceilings in GB/s by key (d2h, h2d, mem, disk), and where each came from ("given", "measured
// here: ...") for the report's ceilings list.
struct TraceCeilings {
  std::map<std::string, double> gbps;
  std::map<std::string, std::string> source;
};

// `--ceiling`'s text, "d2h=55,mem=120": KEY=GBPS items with KEY one of d2h, h2d, mem, disk and GBPS
// > 0. InvalidArgument naming the item at fault.
absl::StatusOr<std::map<std::string, double>> ParseTraceCeilings(const std::string& text);

// How the report names the files: the one path, or "A and N more (one rank each)".
std::string TraceFilesName(const std::vector<std::pair<std::string, TraceFile>>& read);

// Whether any of the files is torch.profiler's (IsProfilerTrace): the report is rank_profiles' then.
bool AnyProfilerTrace(const std::vector<std::pair<std::string, TraceFile>>& read);

// The report of Ferry's traces, merged (MergeTraces) from `files` files named `what`.
std::string FormatTraceReport(const TraceFile& merged, size_t files, const std::string& what,
                              const TraceCeilings& ceilings);

// The whole report of traces read from files (path, parsed): torch.profiler's when any is (every one
// must be), else Ferry's, merged; `merged`, when given, gets Ferry's merged trace (for a picture).
// Errors: InvalidArgument for traces that cannot be read together (naming the files).
absl::StatusOr<std::string> TraceReport(const std::vector<std::pair<std::string, TraceFile>>& read,
                                        const TraceCeilings& ceilings, TraceFile* merged = nullptr);

}  // namespace ferry

#endif  // FERRY_TRACE_TRACE_REPORT_H_
