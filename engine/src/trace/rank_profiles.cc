#include "trace/rank_profiles.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <map>
#include <set>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace ferry {
namespace {

bool IsDeviceOp(const TraceFileEvent& e) { return e.cat == "kernel" || e.cat == "gpu_memcpy" || e.cat == "gpu_memset"; }
bool IsLaunch(const TraceFileEvent& e) { return e.cat == "cuda_runtime" || e.cat == "cuda_driver"; }

// The number after "rank-" (or "rank") in a path's file name; -1 when there is none.
int RankInName(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  const std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
  const size_t at = base.rfind("rank");
  if (at == std::string::npos) return -1;
  size_t i = at + 4;
  if (i < base.size() && (base[i] == '-' || base[i] == '_' || base[i] == '.')) ++i;
  if (i >= base.size() || !std::isdigit(static_cast<unsigned char>(base[i]))) return -1;
  int rank = 0;
  for (; i < base.size() && std::isdigit(static_cast<unsigned char>(base[i])) && rank < 1000000; ++i) rank = rank * 10 + (base[i] - '0');
  return rank;
}

double Quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size() - 1) + 0.5));
  return v[i];
}

// One rank's trace, indexed: its NCCL kernels by kind in start order, the host calls that launched
// kernels by correlation id, and the user annotations (record_function ranges) by thread.
struct RankTrace {
  int rank = 0;
  const TraceFile* trace = nullptr;
  std::map<std::string, std::vector<const TraceFileEvent*>> nccl;
  std::unordered_map<int64_t, const TraceFileEvent*> launches;  // by correlation id
  std::map<int, std::vector<const TraceFileEvent*>> annotations;  // user annotations by thread, by start

  const TraceFileEvent* LaunchOf(const TraceFileEvent& kernel) const {
    auto c = kernel.args.find("correlation");
    if (c == kernel.args.end()) return nullptr;
    auto it = launches.find(static_cast<int64_t>(c->second));
    return it == launches.end() ? nullptr : it->second;
  }
  double LaunchEnd(const TraceFileEvent& kernel) const {
    const TraceFileEvent* launch = LaunchOf(kernel);
    return launch == nullptr ? -1.0 : launch->ts_us + launch->dur_us;
  }
  // The innermost user annotation (FSDP::pre_forward (blocks.3), Optimizer.step, ...; not NCCL's own)
  // around the host call that launched `kernel`; empty when none.
  std::string WhereLaunched(const TraceFileEvent& kernel) const {
    const TraceFileEvent* launch = LaunchOf(kernel);
    if (launch == nullptr) return "";
    auto it = annotations.find(launch->tid);
    if (it == annotations.end()) return "";
    const TraceFileEvent* best = nullptr;
    for (const TraceFileEvent* a : it->second) {
      if (a->ts_us > launch->ts_us) break;
      if (a->ts_us + a->dur_us < launch->ts_us || a->name.rfind("nccl:", 0) == 0) continue;
      if (best == nullptr || a->dur_us <= best->dur_us) best = a;
    }
    return best == nullptr ? "" : best->name;
  }
  // Adds [begin, end) of thread `tid` to `by`, each part under the innermost user annotation (not
  // NCCL's own) covering it, kNoAnnotation where none does.
  void AddByAnnotation(int tid, double begin, double end, std::map<std::string, double>* by) const {
    std::vector<const TraceFileEvent*> over;
    std::vector<double> cuts = {begin, end};
    if (auto it = annotations.find(tid); it != annotations.end()) {
      for (const TraceFileEvent* a : it->second) {
        if (a->ts_us >= end) break;
        if (a->ts_us + a->dur_us <= begin || a->name.rfind("nccl:", 0) == 0) continue;
        over.push_back(a);
        cuts.push_back(std::max(begin, a->ts_us));
        cuts.push_back(std::min(end, a->ts_us + a->dur_us));
      }
    }
    std::sort(cuts.begin(), cuts.end());
    for (size_t i = 0; i + 1 < cuts.size(); ++i) {
      const double lo = cuts[i], hi = cuts[i + 1];
      if (hi <= lo) continue;
      const TraceFileEvent* inner = nullptr;
      for (const TraceFileEvent* a : over) {
        if (a->ts_us <= lo && a->ts_us + a->dur_us >= hi && (inner == nullptr || a->dur_us < inner->dur_us)) inner = a;
      }
      (*by)[inner == nullptr ? std::string(kNoAnnotation) : inner->name] += hi - lo;
    }
  }
};

// Whether the last rank's host launched the collective late (its kernel started within
// kLaunchedLateUs of the launch); false when the launch is not in the trace.
bool HostLate(const CollectiveStart& c) {
  return c.launch_to_start_ms >= 0 && c.launch_to_start_ms * 1e3 < kLaunchedLateUs;
}

StreamIdle IdleOf(const RankTrace& r) {
  StreamIdle out;
  out.rank = r.rank;
  // The compute stream: the one with the most kernel time outside NCCL's kernels.
  std::map<int, double> kernel_us;
  for (const TraceFileEvent& e : r.trace->events) {
    if (e.cat == "kernel" && NcclKind(e.name).empty()) kernel_us[e.tid] += e.dur_us;
  }
  if (kernel_us.empty()) return out;
  out.stream = std::max_element(kernel_us.begin(), kernel_us.end(),
                                [](const auto& a, const auto& b) { return a.second < b.second; })->first;
  std::vector<const TraceFileEvent*> ops;
  for (const TraceFileEvent& e : r.trace->events) {
    if (IsDeviceOp(e) && e.tid == out.stream) ops.push_back(&e);
  }
  std::sort(ops.begin(), ops.end(), [](const TraceFileEvent* a, const TraceFileEvent* b) { return a->ts_us < b->ts_us; });
  std::map<std::string, double> by_where;  // us
  double busy_start = ops.front()->ts_us, busy_end = ops.front()->ts_us + ops.front()->dur_us;
  for (size_t i = 1; i < ops.size(); ++i) {
    const TraceFileEvent& e = *ops[i];
    if (e.ts_us > busy_end + kMinGapUs) {
      const double gap = e.ts_us - busy_end;
      // Waiting for the host while its launch of this op had not returned; the rest, queued.
      const double launched = r.LaunchEnd(e);
      const double host = launched < 0 ? 0.0 : std::clamp(launched - busy_end, 0.0, gap);
      if (host > 0) r.AddByAnnotation(r.LaunchOf(e)->tid, busy_end, busy_end + host, &by_where);
      out.host_ms += host / 1e3;
      out.other_ms += (gap - host) / 1e3;
      ++out.gaps;
    }
    if (e.ts_us > busy_end) {
      out.busy_ms += (busy_end - busy_start) / 1e3;
      busy_start = e.ts_us;
    }
    busy_end = std::max(busy_end, e.ts_us + e.dur_us);
  }
  out.busy_ms += (busy_end - busy_start) / 1e3;
  out.window_ms = (busy_end - ops.front()->ts_us) / 1e3;
  for (const auto& [where, us] : by_where) out.host_by_where.emplace_back(where, us / 1e3);
  std::stable_sort(out.host_by_where.begin(), out.host_by_where.end(),
                   [](const auto& a, const auto& b) { return a.second > b.second; });
  return out;
}

}  // namespace

std::string NcclKind(const std::string& kernel_name) {
  if (kernel_name.rfind("nccl", 0) != 0) return "";
  static const char* kKinds[] = {"AllGather", "ReduceScatter", "AllReduce", "Broadcast", "SendRecv", "AllToAll", "Reduce"};
  const std::string head = kernel_name.substr(0, kernel_name.find('('));
  for (const char* kind : kKinds) {
    const std::string k(kind);
    for (size_t at = head.find(k); at != std::string::npos; at = head.find(k, at + 1)) {
      // A whole word between underscores: "Reduce" is not the start of "ReduceScatter".
      const size_t end = at + k.size();
      const bool left = at > 0 && head[at - 1] == '_';
      const bool right = end == head.size() || head[end] == '_';
      if (left && right) return k;
    }
  }
  return "NCCL";
}

absl::StatusOr<RankProfiles> AnalyzeRankProfiles(const std::vector<std::pair<std::string, TraceFile>>& named) {
  RankProfiles out;
  std::vector<RankTrace> ranks;
  std::map<int, std::string> seen;
  for (size_t i = 0; i < named.size(); ++i) {
    const auto& [path, trace] = named[i];
    if (!trace.torch_profiler) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": not a torch.profiler trace (no schemaVersion); ferry trace "
                                                     "reads either Ferry's traces or torch.profiler's, not both at once"));
    }
    RankTrace r;
    r.trace = &trace;
    r.rank = trace.rank >= 0 ? trace.rank : RankInName(path);
    if (r.rank < 0) r.rank = static_cast<int>(i);
    auto [it, fresh] = seen.emplace(r.rank, path);
    if (!fresh) {
      return absl::InvalidArgumentError(absl::StrCat(it->second, " and ", path, " are both the trace of rank ", r.rank,
                                                     ": give one file per rank, of the same steps"));
    }
    out.world_size = std::max(out.world_size, trace.world_size);
    for (const TraceFileEvent& e : trace.events) {
      if (IsLaunch(e)) {
        auto c = e.args.find("correlation");
        if (c != e.args.end()) r.launches[static_cast<int64_t>(c->second)] = &e;
      } else if (e.cat == "user_annotation") {
        r.annotations[e.tid].push_back(&e);
      } else if (e.cat == "kernel") {
        std::string kind = NcclKind(e.name);
        if (!kind.empty()) r.nccl[kind].push_back(&e);
      }
    }
    auto by_start = [](const TraceFileEvent* a, const TraceFileEvent* b) { return a->ts_us < b->ts_us; };
    for (auto& [kind, kernels] : r.nccl) std::sort(kernels.begin(), kernels.end(), by_start);
    for (auto& [tid, list] : r.annotations) std::sort(list.begin(), list.end(), by_start);
    ranks.push_back(std::move(r));
  }
  std::sort(ranks.begin(), ranks.end(), [](const RankTrace& a, const RankTrace& b) { return a.rank < b.rank; });
  for (const RankTrace& r : ranks) out.ranks.push_back(r.rank);
  for (const RankTrace& r : ranks) out.idle.push_back(IdleOf(r));
  if (ranks.size() < 2) return out;
  std::set<std::string> kinds;
  for (const RankTrace& r : ranks) {
    for (const auto& [kind, kernels] : r.nccl) kinds.insert(kind);
  }
  for (RankTrace& r : ranks) {
    for (const std::string& kind : kinds) r.nccl[kind];  // none of a kind: an empty list
  }
  for (const std::string& kind : kinds) {
    size_t n = SIZE_MAX, most = 0;
    for (const RankTrace& r : ranks) {
      n = std::min(n, r.nccl.at(kind).size());
      most = std::max(most, r.nccl.at(kind).size());
    }
    if (n == 0) continue;
    // The kernels of one collective end together on every rank (they finish when the exchange does).
    // A rank whose trace holds more (its window opened while its GPU still ran earlier ones) is
    // matched from the offset whose ends lie nearest the rank with the fewest.
    const RankTrace* ref = nullptr;
    for (const RankTrace& r : ranks) {
      if (ref == nullptr || r.nccl.at(kind).size() < ref->nccl.at(kind).size()) ref = &r;
    }
    const std::vector<const TraceFileEvent*>& base = ref->nccl.at(kind);
    auto end_of = [](const TraceFileEvent* e) { return e->ts_us + e->dur_us; };
    std::map<int, size_t> offset;
    for (const RankTrace& r : ranks) {
      const std::vector<const TraceFileEvent*>& mine = r.nccl.at(kind);
      double best = -1.0;
      for (size_t d = 0; d + n <= mine.size(); ++d) {
        std::vector<double> apart;
        for (size_t i = 0; i < n; ++i) apart.push_back(std::fabs(end_of(mine[i + d]) - end_of(base[i])));
        const double median = Quantile(std::move(apart), 0.5);
        if (best < 0 || median < best) best = median, offset[r.rank] = d;
      }
      if (best > kMatchedEndsUs) {
        out.notes.push_back(absl::StrFormat("%s: rank %d's kernels end %.2f ms from rank %d's at the median: not the "
                                            "same collectives, or not one clock",
                                            kind, r.rank, best / 1e3, ref->rank));
      }
    }
    if (n != most) {
      std::vector<std::string> counts;
      for (const RankTrace& r : ranks) {
        counts.push_back(absl::StrCat("rank ", r.rank, ": ", r.nccl.at(kind).size(), " from #", offset[r.rank]));
      }
      out.notes.push_back(absl::StrCat(kind, ": the ranks' traces hold different counts (", absl::StrJoin(counts, ", "),
                                       "); ", n, " matched by their ends"));
    }
    for (size_t i = 0; i < n; ++i) {
      CollectiveStart c;
      c.kind = kind;
      c.index = i;
      double first = 0, latest = 0;
      const RankTrace* last = nullptr;
      const TraceFileEvent* last_kernel = nullptr;
      for (const RankTrace& r : ranks) {
        const TraceFileEvent* k = r.nccl.at(kind)[i + offset[r.rank]];
        if (last == nullptr || k->ts_us < first) first = k->ts_us;
        if (last == nullptr || k->ts_us > latest) latest = k->ts_us, last = &r, last_kernel = k;
      }
      c.spread_ms = (latest - first) / 1e3;
      c.last = last->rank;
      const double launched = last->LaunchEnd(*last_kernel);
      c.launch_to_start_ms = launched < 0 ? -1.0 : std::max(0.0, latest - launched) / 1e3;
      c.where = last->WhereLaunched(*last_kernel);
      out.collectives.push_back(c);
    }
  }
  return out;
}

std::string FormatRankProfiles(const RankProfiles& p) {
  std::string out = absl::StrFormat("torch.profiler traces of %d rank%s (%s%s)\n", p.ranks.size(), p.ranks.size() == 1 ? "" : "s",
                                    absl::StrJoin(p.ranks, ", "), p.world_size > 0 ? absl::StrCat(" of ", p.world_size) : "");
  if (p.ranks.size() > 1 && p.collectives.empty()) {
    absl::StrAppend(&out, "\nno NCCL kernel in these traces: no collective to match across the ranks\n");
  } else if (p.ranks.size() > 1) {
    absl::StrAppend(&out,
                    "\ncollectives: each kind's NCCL kernels matched in order across the ranks; \"apart\" is how much\n"
                    "later the last rank started one than the first (the others wait in it that long); \"host late\"\n"
                    "counts those whose last rank's kernel started within ", kLaunchedLateUs, " us of its launch (its host\n"
                    "launched it late; else the kernel waited behind its own stream)\n");
    absl::StrAppend(&out, absl::StrFormat("%-14s %6s %10s %10s %10s %10s  %-28s %s\n", "kind", "count", "apart p50",
                                          "p90", "max", "sum", "last rank (times)", "host late"));
    std::map<std::string, std::vector<const CollectiveStart*>> by_kind;
    for (const CollectiveStart& c : p.collectives) by_kind[c.kind].push_back(&c);
    for (const auto& [kind, cs] : by_kind) {
      std::vector<double> spread;
      std::map<int, int> last;
      int late = 0, known = 0;
      double sum = 0;
      for (const CollectiveStart* c : cs) {
        spread.push_back(c->spread_ms);
        sum += c->spread_ms;
        ++last[c->last];
        if (c->launch_to_start_ms >= 0) {
          ++known;
          late += HostLate(*c) ? 1 : 0;
        }
      }
      std::vector<std::string> lasts;
      for (const auto& [rank, times] : last) lasts.push_back(absl::StrCat(rank, ": ", times));
      absl::StrAppend(&out, absl::StrFormat("%-14s %6d %7.2f ms %7.2f ms %7.2f ms %7.1f ms  %-28s %s\n", kind, cs.size(),
                                            Quantile(spread, 0.5), Quantile(spread, 0.9), Quantile(spread, 1.0), sum,
                                            absl::StrJoin(lasts, ", "),
                                            known > 0 ? absl::StrCat(late, " of ", known) : std::string("-")));
    }
    // Per rank, the waits it caused (the spreads of the collectives it came last to), and of them
    // those where its host launched late.
    std::map<int, std::pair<double, double>> caused;  // rank -> (all, host late), ms
    for (const CollectiveStart& c : p.collectives) {
      caused[c.last].first += c.spread_ms;
      if (HostLate(c)) caused[c.last].second += c.spread_ms;
    }
    absl::StrAppend(&out, "waits each rank caused (the sum over the collectives it came last to; its host late in):");
    for (const auto& [rank, ms] : caused) {
      absl::StrAppend(&out, absl::StrFormat(" rank %d %.1f ms (%.1f),", rank, ms.first, ms.second));
    }
    out.back() = '\n';
    // The collectives the others waited longest in.
    std::vector<const CollectiveStart*> worst;
    for (const CollectiveStart& c : p.collectives) worst.push_back(&c);
    std::sort(worst.begin(), worst.end(), [](const CollectiveStart* a, const CollectiveStart* b) { return a->spread_ms > b->spread_ms; });
    if (!worst.empty()) {
      absl::StrAppend(&out, "the longest waits:");
      for (size_t i = 0; i < std::min<size_t>(5, worst.size()); ++i) {
        const CollectiveStart& c = *worst[i];
        absl::StrAppend(&out, absl::StrFormat("\n  %s #%d, %.1f ms: rank %d last%s%s", c.kind, c.index, c.spread_ms, c.last,
                                              c.launch_to_start_ms < 0 ? ""
                                              : HostLate(c)            ? ", its host late"
                                                                       : ", queued behind its stream",
                                              c.where.empty() ? "" : absl::StrCat(", launched in ", c.where)));
      }
      absl::StrAppend(&out, "\n");
    }
  }
  bool kernels = false;
  for (const StreamIdle& s : p.idle) kernels = kernels || s.window_ms > 0;
  if (!kernels) {
    absl::StrAppend(&out, "no GPU kernel in these traces (profiled without CUDA activity, or on the CPU): no compute "
                          "stream to follow\n");
    for (const std::string& note : p.notes) absl::StrAppend(&out, "note: ", note, "\n");
    return out;
  }
  absl::StrAppend(&out,
                  "\neach rank's compute stream (its stream with the most kernel time outside NCCL): idle gaps over ",
                  kMinGapUs, " us, split into\nwaiting for the host's launch of the next op and waiting with it queued "
                  "(on another stream or an event:\ncopies, collectives, uploads)\n");
  absl::StrAppend(&out, absl::StrFormat("%-5s %7s %11s %11s %13s %13s %6s\n", "rank", "stream", "window", "busy",
                                        "idle: host", "queued", "gaps"));
  for (const StreamIdle& s : p.idle) {
    if (s.window_ms <= 0) {
      absl::StrAppend(&out, absl::StrFormat("%-5d  no GPU kernel in its trace\n", s.rank));
      continue;
    }
    absl::StrAppend(&out, absl::StrFormat("%-5d %7d %8.1f ms %8.1f ms %10.1f ms %10.1f ms %6d\n", s.rank, s.stream,
                                          s.window_ms, s.busy_ms, s.host_ms, s.other_ms, s.gaps));
  }
  bool where = false;
  for (const StreamIdle& s : p.idle) where = where || !s.host_by_where.empty();
  if (where) {
    absl::StrAppend(&out, "its idle waiting for the host, by what the launching thread was inside (its innermost\n"
                          "record_function range; ferry.torch names its hooks' waits and gathers ferry.* while a\n"
                          "profiler runs):\n");
    for (const StreamIdle& s : p.idle) {
      if (s.host_by_where.empty()) continue;
      std::vector<std::string> parts;
      for (size_t i = 0; i < std::min<size_t>(6, s.host_by_where.size()); ++i) {
        parts.push_back(absl::StrFormat("%s %.1f ms", s.host_by_where[i].first, s.host_by_where[i].second));
      }
      if (s.host_by_where.size() > 6) parts.push_back(absl::StrFormat("%d more", s.host_by_where.size() - 6));
      absl::StrAppend(&out, absl::StrFormat("%-5d %s\n", s.rank, absl::StrJoin(parts, ", ")));
    }
  }
  for (const std::string& note : p.notes) absl::StrAppend(&out, "note: ", note, "\n");
  return out;
}

}  // namespace ferry
