#include "trace/trace_report.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "trace/rank_arrivals.h"
#include "trace/rank_profiles.h"

namespace ferry {

absl::StatusOr<std::map<std::string, double>> ParseTraceCeilings(const std::string& text) {
  std::map<std::string, double> out;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    std::vector<std::string> kv = absl::StrSplit(item, absl::MaxSplits('=', 1));
    double v = 0;
    if (kv.size() != 2 || (kv[0] != "d2h" && kv[0] != "h2d" && kv[0] != "mem" && kv[0] != "disk") ||
        !absl::SimpleAtod(kv[1], &v) || !(v > 0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--ceiling: expected KEY=GBPS with KEY one of d2h, h2d, mem, disk and GBPS > 0, got \"", item, "\""));
    }
    out[kv[0]] = v;
  }
  return out;
}

std::string TraceFilesName(const std::vector<std::pair<std::string, TraceFile>>& read) {
  if (read.empty()) return "";
  return read.size() == 1 ? read[0].first : absl::StrCat(read[0].first, " and ", read.size() - 1, " more (one rank each)");
}

bool AnyProfilerTrace(const std::vector<std::pair<std::string, TraceFile>>& read) {
  for (const auto& [path, one] : read) {
    if (IsProfilerTrace(one)) return true;
  }
  return false;
}

std::string FormatTraceReport(const TraceFile& merged, size_t files, const std::string& what,
                              const TraceCeilings& ceilings) {
  std::string out = absl::StrFormat("trace %s: %d spans\n", what, merged.events.size());
  if (files > 1) {
    absl::StrAppend(&out, merged.steady_epoch_us >= 0
                              ? absl::StrCat("the files' spans on one clock (host ", merged.host.empty() ? "?" : merged.host,
                                             "'s steady clock, from the first to start)")
                              : "the files' spans each on its own clock (other hosts, or files that do not say where "
                                "their time 0 lies): their ranks do not line up",
                    "\n");
  }
  const std::vector<StageSummary> stages = Summarize(merged, ceilings.gbps);
  absl::StrAppend(&out, "\n", FormatSummary(stages), "\nceilings (GB/s):");
  if (ceilings.gbps.empty()) absl::StrAppend(&out, " none (give --ceiling, or --measure on)");
  absl::StrAppend(&out, "\n");
  for (const auto& [k, v] : ceilings.gbps) {
    auto source = ceilings.source.find(k);
    absl::StrAppend(&out, absl::StrFormat("  %-5s %8.2f  %s\n", k, v, source == ceilings.source.end() ? "" : source->second));
  }
  bool observed = false;
  for (const StageSummary& s : stages) observed = observed || s.name == "d2h.chunk" || s.name == "h2d.chunk";
  if (observed) {
    absl::StrAppend(&out,
                    "\nd2h.chunk and h2d.chunk are observed by the host: from when the stream could start a chunk\n"
                    "to when the pipeline saw its event complete, so their times are upper bounds and their\n"
                    "rates lower bounds while the pipeline is busy with CPU Adam (`ferry bench transfer` times\n"
                    "the copies alone).\n");
  }
  for (const StageSummary& s : stages) {
    if (s.name == "step" && s.count > 0) {
      absl::StrAppend(&out, absl::StrFormat("\nstep: %d steps, %.3f ms each on average\n", s.count,
                                            s.total_ms / static_cast<double>(s.count)));
    }
  }
  const std::vector<IterationSummary> iterations = Iterations(merged);
  if (!iterations.empty()) {
    absl::StrAppend(&out,
                    "\niterations (from the end of one step to the end of the next, per rank): CPU Adam is the\n"
                    "time its workers ran (its rounds' time in a trace without them), idle the rest (where the\n"
                    "loop is bound by the CPU update, the idle is what overlap did not hide); wait.grads, the\n"
                    "early pass waiting for grads; wait.copies, for their downloads (a long one: grads taken as\n"
                    "final that were not, or a download queued behind a part not final yet: an announcement's\n"
                    "stream running late); wait.upload, the trainer waiting for new params; host forward, the\n"
                    "trainer from the forward's first wait for params to the backward's first announcement (with\n"
                    "attach: far above the GPU's forward time and wait.upload small, the host's launches pace it)\n",
                    FormatIterations(iterations));
  }
  if (const std::string arrivals = FormatRankArrivals(merged); !arrivals.empty()) absl::StrAppend(&out, "\n", arrivals);
  return out;
}

absl::StatusOr<std::string> TraceReport(const std::vector<std::pair<std::string, TraceFile>>& read,
                                        const TraceCeilings& ceilings, TraceFile* merged) {
  if (read.empty()) return absl::InvalidArgumentError("no trace file given");
  if (AnyProfilerTrace(read)) {
    absl::StatusOr<RankProfiles> analysis = AnalyzeRankProfiles(read);
    if (!analysis.ok()) return analysis.status();
    return FormatRankProfiles(*analysis);
  }
  absl::StatusOr<TraceFile> trace = MergeTraces(read);
  if (!trace.ok()) return trace.status();
  std::string report = FormatTraceReport(*trace, read.size(), TraceFilesName(read), ceilings);
  if (merged != nullptr) *merged = *std::move(trace);
  return report;
}

}  // namespace ferry
