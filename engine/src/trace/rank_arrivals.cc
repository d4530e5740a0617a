#include "trace/rank_arrivals.h"

#include <algorithm>
#include <cstdint>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace ferry {
namespace {

// Per key every rank has (in key order): the spread of the ranks' times and the rank that came last.
// `times`: rank -> key -> its time (us).
std::vector<RankArrival> Spreads(const std::map<int, std::map<int64_t, double>>& times) {
  std::vector<RankArrival> out;
  if (times.size() < 2) return out;
  std::map<int64_t, size_t> ranks_with;
  for (const auto& [rank, by_key] : times) {
    for (const auto& [key, t] : by_key) ++ranks_with[key];
  }
  for (const auto& [key, n] : ranks_with) {
    if (n != times.size()) continue;
    double first = 0.0, last = 0.0;
    int last_rank = 0;
    bool any = false;
    for (const auto& [rank, by_key] : times) {
      const double t = by_key.at(key);
      if (!any || t < first) first = t;
      if (!any || t > last) last = t, last_rank = rank;
      any = true;
    }
    out.push_back(RankArrival{.step = static_cast<size_t>(key), .spread_ms = (last - first) / 1e3, .last = last_rank});
  }
  return out;
}

// "<what>: the last X ms after the first at the median of N steps, Y ms at most (step S, rank R
// last); last: rank a n times, ...\n".
std::string FormatSpreads(const std::string& what, const std::vector<RankArrival>& arrivals) {
  std::vector<double> spreads;
  std::map<int, int> last;
  const RankArrival* worst = &arrivals.front();
  for (const RankArrival& a : arrivals) {
    spreads.push_back(a.spread_ms);
    ++last[a.last];
    if (a.spread_ms > worst->spread_ms) worst = &a;
  }
  std::sort(spreads.begin(), spreads.end());
  std::string out = absl::StrFormat("%s: the last %.1f ms after the first at the median of %d steps, %.1f ms at most "
                                    "(step %d, rank %d last); last:",
                                    what, spreads[spreads.size() / 2], arrivals.size(), worst->spread_ms, worst->step,
                                    worst->last);
  for (const auto& [rank, n] : last) absl::StrAppendFormat(&out, " rank %d %d time%s,", rank, n, n == 1 ? "" : "s");
  out.back() = '\n';
  return out;
}

}  // namespace

std::vector<RankArrival> RankArrivals(const TraceFile& trace) {
  std::map<int, std::vector<double>> starts;  // rank -> its step spans' starts
  for (const TraceFileEvent& e : trace.events) {
    if (e.name == "step") starts[e.pid].push_back(e.ts_us);
  }
  std::map<int, std::map<int64_t, double>> by_index;  // rank -> step index -> start
  for (auto& [rank, ts] : starts) {
    std::sort(ts.begin(), ts.end());
    for (size_t k = 0; k < ts.size(); ++k) by_index[rank][static_cast<int64_t>(k)] = ts[k];
  }
  return Spreads(by_index);
}

std::vector<RankArrival> UpdateEnds(const TraceFile& trace) {
  std::map<int, std::map<int64_t, double>> ends;  // rank -> step -> its last part's end
  for (const TraceFileEvent& e : trace.events) {
    if (e.name != "early.part_done") continue;
    auto step = e.args.find("step");
    if (step == e.args.end() || step->second < 0) continue;
    auto [it, fresh] = ends[e.pid].try_emplace(static_cast<int64_t>(step->second), e.ts_us + e.dur_us);
    if (!fresh) it->second = std::max(it->second, e.ts_us + e.dur_us);
  }
  return Spreads(ends);
}

std::string FormatRankArrivals(const TraceFile& trace) {
  if (trace.steady_epoch_us < 0) return "";
  const std::vector<RankArrival> arrivals = RankArrivals(trace);
  const std::vector<RankArrival> updates = UpdateEnds(trace);
  std::string out;
  if (!arrivals.empty()) {
    absl::StrAppend(&out, FormatSpreads("ranks reaching their step (one clock)", arrivals),
                    "  (the hosts' arrival: a host far ahead of its GPU comes early; which rank each collective waited\n"
                    "  for on the GPUs: ferry trace of the ranks' torch.profiler traces)\n");
  }
  if (!updates.empty()) {
    absl::StrAppend(&out, FormatSpreads("ranks ending their update of a step (its last part's upload enqueued)", updates),
                    "  (under ZeRO-1 and FSDP2 the next forward needs every rank's part of a layer: it runs at the\n"
                    "  pace of the rank whose update ends last)\n");
  }
  return out;
}

}  // namespace ferry
