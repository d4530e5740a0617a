#include "trace/trace_file.h"

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <fstream>
#include <set>
#include <sstream>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"

namespace ferry {
namespace {

using Json = nlohmann::json;

std::string Escape(std::string_view s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

// A stable colour per span name.
std::string ColourOf(const std::string& name) {
  static const char* kPalette[] = {"#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948",
                                   "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac", "#86bcb6", "#d37295"};
  uint32_t h = 2166136261u;
  for (char c : name) h = (h ^ static_cast<uint8_t>(c)) * 16777619u;
  return kPalette[h % (sizeof(kPalette) / sizeof(kPalette[0]))];
}

// A pid or tid as an int: torch.profiler writes some thread ids past int's range (a pthread id's low
// bits); those wrap, so that distinct ids stay distinct within a file as far as 32 bits tell.
int IdOf(double v) {
  if (!std::isfinite(v) || std::fabs(v) >= 9.2e18) return 0;
  return static_cast<int>(static_cast<uint32_t>(static_cast<int64_t>(v)));
}

std::string FormatMicros(double us) {
  if (us >= 1e6) return absl::StrFormat("%.3g s", us / 1e6);
  if (us >= 1e3) return absl::StrFormat("%.3g ms", us / 1e3);
  return absl::StrFormat("%.3g us", us);
}

}  // namespace

absl::StatusOr<TraceFile> ParseTrace(const std::string& text, const std::string& what) {
  if (text.size() >= 2 && static_cast<uint8_t>(text[0]) == 0x1f && static_cast<uint8_t>(text[1]) == 0x8b) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": gzip-compressed (torch.profiler's use_gzip=True, a "
                                                   ".json.gz): gunzip it first"));
  }
  Json doc = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(what, ": not valid JSON"));
  const Json* events = &doc;
  if (doc.is_object()) {
    auto it = doc.find("traceEvents");
    if (it == doc.end()) return absl::InvalidArgumentError(absl::StrCat(what, ": no \"traceEvents\""));
    events = &*it;
  }
  if (!events->is_array()) return absl::InvalidArgumentError(absl::StrCat(what, ": \"traceEvents\" is not an array"));
  TraceFile out;
  if (doc.is_object()) {
    auto other = doc.find("otherData");
    if (other != doc.end() && other->is_object()) {
      auto epoch = other->find("steady_epoch_us");
      if (epoch != other->end() && epoch->is_number() && epoch->get<double>() >= 0) {
        out.steady_epoch_us = epoch->get<double>();
      }
      auto host = other->find("host");
      if (host != other->end() && host->is_string()) out.host = host->get<std::string>();
    }
    out.torch_profiler = doc.contains("schemaVersion");
    auto dist = doc.find("distributedInfo");
    if (dist != doc.end() && dist->is_object()) {
      auto rank = dist->find("rank");
      auto world = dist->find("world_size");
      if (rank != dist->end() && rank->is_number_integer()) out.rank = rank->get<int>();
      if (world != dist->end() && world->is_number_integer()) out.world_size = world->get<int>();
    }
  }
  size_t index = 0;
  for (const Json& e : *events) {
    const std::string at = absl::StrCat(what, ": event ", index++);
    if (!e.is_object()) return absl::InvalidArgumentError(absl::StrCat(at, " is not an object"));
    auto ph = e.find("ph");
    if (ph == e.end() || !ph->is_string()) return absl::InvalidArgumentError(absl::StrCat(at, " has no \"ph\""));
    auto num = [&](const char* key, double* v) -> bool {
      auto it = e.find(key);
      if (it == e.end() || !it->is_number()) return false;
      *v = it->get<double>();
      return true;
    };
    double pid = 0, tid = 0;
    (void)num("pid", &pid);
    (void)num("tid", &tid);
    const std::string phase = ph->get<std::string>();
    auto name_it = e.find("name");
    const std::string name = name_it != e.end() && name_it->is_string() ? name_it->get<std::string>() : "";
    if (phase == "M") {
      auto args = e.find("args");
      if (name == "thread_name" && args != e.end() && args->is_object() && args->contains("name") &&
          (*args)["name"].is_string()) {
        out.threads[{IdOf(pid), IdOf(tid)}] = (*args)["name"].get<std::string>();
      }
      continue;
    }
    if (phase != "X") continue;  // other phases are not produced by ferry; ignored
    // torch.profiler's older exporter writes a bare array, its CPU ops under pid "CPU functions".
    auto pid_it = e.find("pid");
    if (pid_it != e.end() && pid_it->is_string() && pid_it->get<std::string>() == "CPU functions") out.torch_profiler = true;
    TraceFileEvent ev;
    ev.name = name;
    if (ev.name.empty()) return absl::InvalidArgumentError(absl::StrCat(at, " has no name"));
    auto cat = e.find("cat");
    if (cat != e.end() && cat->is_string()) ev.cat = cat->get<std::string>();
    ev.pid = IdOf(pid);
    ev.tid = IdOf(tid);
    if (!num("ts", &ev.ts_us) || !num("dur", &ev.dur_us) || ev.dur_us < 0) {
      return absl::InvalidArgumentError(absl::StrCat(at, " ('", ev.name, "') needs numeric ts and dur >= 0"));
    }
    auto args = e.find("args");
    if (args != e.end() && args->is_object()) {
      for (auto it = args->begin(); it != args->end(); ++it) {
        if (it.value().is_number()) ev.args[it.key()] = it.value().get<double>();
      }
    }
    out.events.push_back(std::move(ev));
  }
  return out;
}

absl::StatusOr<TraceFile> ReadTraceFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read trace file ", path));
  std::stringstream buffer;
  buffer << in.rdbuf();
  return ParseTrace(buffer.str(), path);
}

absl::StatusOr<TraceFile> MergeTraces(const std::vector<std::pair<std::string, TraceFile>>& named) {
  TraceFile out;
  // Each host's earliest clock origin, from the files that give theirs.
  std::map<std::string, double> first;
  bool all_on_one = !named.empty();
  for (const auto& [name, trace] : named) {
    all_on_one = all_on_one && trace.steady_epoch_us >= 0 && trace.host == named.front().second.host;
    if (trace.steady_epoch_us < 0) continue;
    auto [it, fresh] = first.emplace(trace.host, trace.steady_epoch_us);
    if (!fresh) it->second = std::min(it->second, trace.steady_epoch_us);
  }
  if (all_on_one) {
    out.steady_epoch_us = first.begin()->second;
    out.host = named.front().second.host;
  }
  std::map<int, std::string> file_of;  // pid -> the file holding its spans
  for (const auto& [name, trace] : named) {
    std::set<int> pids;
    for (const TraceFileEvent& e : trace.events) pids.insert(e.pid);
    for (int pid : pids) {
      auto [it, fresh] = file_of.emplace(pid, name);
      if (!fresh) {
        return absl::InvalidArgumentError(absl::StrCat(it->second, " and ", name, " both hold spans of rank ", pid,
                                                       " (pid ", pid, "): give one file per rank"));
      }
    }
    const double shift = trace.steady_epoch_us >= 0 ? trace.steady_epoch_us - first[trace.host] : 0.0;
    for (TraceFileEvent e : trace.events) {
      e.ts_us += shift;
      out.events.push_back(std::move(e));
    }
    out.threads.insert(trace.threads.begin(), trace.threads.end());
  }
  return out;
}

std::string CeilingKeyOf(const std::string& stage) {
  if (stage == "d2h.chunk" || stage == "ckpt.stage") return "d2h";
  if (stage == "h2d.chunk") return "h2d";
  if (absl::StartsWith(stage, "cpu_adam")) return "mem";
  if (stage == "ckpt.write" || stage == "ckpt.read") return "disk";
  return "";
}

namespace {

// The length of the union of the intervals [first, second).
double UnionLength(std::vector<std::pair<double, double>> iv) {
  std::sort(iv.begin(), iv.end());
  double total = 0.0, cur_begin = 0.0, cur_end = -1.0;
  for (const auto& [b, e] : iv) {
    if (b > cur_end) {
      if (cur_end > cur_begin) total += cur_end - cur_begin;
      cur_begin = b;
      cur_end = e;
    } else {
      cur_end = std::max(cur_end, e);
    }
  }
  if (cur_end > cur_begin) total += cur_end - cur_begin;
  return total;
}

// The length (us) of the union of the intervals of `events` clipped to [from, to).
double UnionWithin(const std::vector<const TraceFileEvent*>& events, double from, double to) {
  std::vector<std::pair<double, double>> iv;
  for (const TraceFileEvent* e : events) {
    const double b = std::max(from, e->ts_us), en = std::min(to, e->ts_us + e->dur_us);
    if (en > b) iv.push_back({b, en});
  }
  return UnionLength(std::move(iv));
}

}  // namespace

std::vector<StageSummary> Summarize(const TraceFile& trace, const std::map<std::string, double>& ceilings) {
  std::vector<StageSummary> stages;
  std::map<std::string, size_t> index;
  std::map<std::string, std::vector<std::pair<double, double>>> intervals;  // per stage, with pid folded in
  for (const TraceFileEvent& e : trace.events) {
    auto [it, inserted] = index.emplace(e.name, stages.size());
    if (inserted) {
      stages.push_back(StageSummary{.name = e.name});
      stages.back().ceiling_key = CeilingKeyOf(e.name);
    }
    StageSummary& s = stages[it->second];
    ++s.count;
    s.total_ms += e.dur_us / 1e3;
    auto b = e.args.find("bytes");
    if (b != e.args.end()) s.bytes += b->second;
    auto cpu = e.args.find("cpu_us");
    if (cpu != e.args.end()) {
      s.cpu_ms += cpu->second / 1e3;
      s.cpu_span_ms += e.dur_us / 1e3;
    }
    // Ranks are separate timelines: offset each rank far apart so their intervals never merge.
    const double offset = static_cast<double>(e.pid) * 1e15;
    intervals[e.name].push_back({offset + e.ts_us, offset + e.ts_us + e.dur_us});
  }
  for (StageSummary& s : stages) {
    const double wall = UnionLength(std::move(intervals[s.name]));
    s.wall_ms = wall / 1e3;
    if (s.bytes > 0 && wall > 0) s.gbps = s.bytes / (wall * 1e3);  // bytes per ns
    auto c = ceilings.find(s.ceiling_key);
    if (!s.ceiling_key.empty() && c != ceilings.end() && c->second > 0) s.ceiling_gbps = c->second;
  }
  return stages;
}

std::string FormatSummary(const std::vector<StageSummary>& stages) {
  std::string out = absl::StrFormat("%-22s %7s %11s %11s %11s %9s %15s\n", "stage", "count", "total ms", "wall ms",
                                    "bytes", "GB/s", "of ceiling");
  for (const StageSummary& s : stages) {
    std::string bytes = s.bytes > 0 ? absl::StrFormat("%.4g", s.bytes) : "-";
    std::string gbps = s.bytes > 0 ? absl::StrFormat("%.2f", s.gbps) : "-";
    std::string ratio = "-";
    if (s.ceiling_gbps.has_value() && s.bytes > 0) {
      ratio = absl::StrFormat("%.2f (%s %.1f)", s.gbps / *s.ceiling_gbps, s.ceiling_key, *s.ceiling_gbps);
    } else if (!s.ceiling_key.empty() && s.bytes > 0) {
      ratio = absl::StrCat("(no ", s.ceiling_key, ")");
    }
    absl::StrAppendFormat(&out, "%-22s %7d %11.3f %11.3f %11s %9s %15s\n", s.name, s.count, s.total_ms, s.wall_ms, bytes,
                          gbps, ratio);
  }
  for (const StageSummary& s : stages) {
    if (s.cpu_span_ms <= 0.0) continue;
    absl::StrAppendFormat(&out,
                          "%s: its threads ran on a CPU %.1f%% of their spans (%.3f of %.3f ms; the rest they "
                          "waited for a CPU or were blocked)\n",
                          s.name, 100.0 * s.cpu_ms / s.cpu_span_ms, s.cpu_ms, s.cpu_span_ms);
  }
  return out;
}

namespace {

// The first start of `events` within [from, to); negative when none.
double FirstStart(const std::vector<const TraceFileEvent*>& events, double from, double to) {
  double first = -1.0;
  for (const TraceFileEvent* e : events) {
    if (e->ts_us < from || e->ts_us >= to) continue;
    if (first < 0.0 || e->ts_us < first) first = e->ts_us;
  }
  return first;
}

// IterationSummary::host_forward_ms.
double HostForwardMs(const std::vector<const TraceFileEvent*>& uploads,
                     const std::vector<const TraceFileEvent*>& announced, double from, double to) {
  const double forward = FirstStart(uploads, from, to);
  if (forward < 0.0) return -1.0;
  const double backward = FirstStart(announced, forward, to);
  return backward < 0.0 ? -1.0 : (backward - forward) / 1e3;
}

}  // namespace

std::vector<IterationSummary> Iterations(const TraceFile& trace) {
  // Per rank: its step spans, and the spans each column unites.
  struct Rank {
    std::vector<const TraceFileEvent*> steps, rounds, grads, copies, uploads, threads, announced;
  };
  std::map<int, Rank> ranks;
  for (const TraceFileEvent& e : trace.events) {
    Rank& r = ranks[e.pid];
    if (e.name == "step") r.steps.push_back(&e);
    if (e.name == "cpu_adam.round") r.rounds.push_back(&e);
    if (e.name == "wait.grads") r.grads.push_back(&e);
    if (e.name == "wait.copies") r.copies.push_back(&e);
    if (e.name == "wait.upload") r.uploads.push_back(&e);
    if (e.name == "cpu_adam.thread") r.threads.push_back(&e);
    if (e.name == "grads_ready") r.announced.push_back(&e);
  }
  std::vector<IterationSummary> out;
  for (auto& [pid, r] : ranks) {
    std::sort(r.steps.begin(), r.steps.end(), [](const TraceFileEvent* a, const TraceFileEvent* b) {
      return a->ts_us + a->dur_us < b->ts_us + b->dur_us;
    });
    for (size_t i = 1; i < r.steps.size(); ++i) {
      const double from = r.steps[i - 1]->ts_us + r.steps[i - 1]->dur_us;
      const double to = r.steps[i]->ts_us + r.steps[i]->dur_us;
      IterationSummary it{.pid = pid, .step = i};
      it.iteration_ms = (to - from) / 1e3;
      it.cpu_adam_ms = UnionWithin(r.threads.empty() ? r.rounds : r.threads, from, to) / 1e3;
      it.idle_ms = it.iteration_ms - it.cpu_adam_ms;
      it.wait_grads_ms = UnionWithin(r.grads, from, to) / 1e3;
      it.wait_copies_ms = UnionWithin(r.copies, from, to) / 1e3;
      it.wait_upload_ms = UnionWithin(r.uploads, from, to) / 1e3;
      it.host_forward_ms = HostForwardMs(r.uploads, r.announced, from, to);
      double cpu = 0.0, span = 0.0;
      for (const TraceFileEvent* t : r.threads) {
        auto c = t->args.find("cpu_us");
        if (t->ts_us < from || t->ts_us >= to || c == t->args.end()) continue;
        cpu += c->second;
        span += t->dur_us;
      }
      if (span > 0.0) it.on_cpu = cpu / span;
      out.push_back(it);
    }
  }
  return out;
}

std::string FormatIterations(const std::vector<IterationSummary>& iterations, size_t max_rows) {
  if (iterations.empty()) return "";
  std::string out = absl::StrFormat("%-6s %6s %12s %12s %12s %12s %12s %12s %13s %16s\n", "rank", "step",
                                    "iteration", "CPU Adam", "idle", "wait.grads", "wait.copies", "wait.upload",
                                    "host forward", "workers on CPU");
  auto row = [&](const std::string& rank, const std::string& step, const IterationSummary& it) {
    absl::StrAppendFormat(&out, "%-6s %6s %9.1f ms %9.1f ms %9.1f ms %9.1f ms %9.1f ms %9.1f ms %13s %16s\n", rank,
                          step, it.iteration_ms, it.cpu_adam_ms, it.idle_ms, it.wait_grads_ms, it.wait_copies_ms,
                          it.wait_upload_ms,
                          it.host_forward_ms < 0 ? std::string("-") : absl::StrFormat("%.1f ms", it.host_forward_ms),
                          it.on_cpu < 0 ? std::string("-") : absl::StrFormat("%.1f%%", 100.0 * it.on_cpu));
  };
  size_t begin = 0;
  while (begin < iterations.size()) {
    size_t end = begin;
    while (end < iterations.size() && iterations[end].pid == iterations[begin].pid) ++end;
    IterationSummary mean{.pid = iterations[begin].pid};
    double cpu_n = 0.0, forward_n = 0.0;
    for (size_t i = begin; i < end; ++i) {
      const IterationSummary& it = iterations[i];
      if (i - begin < max_rows) row(absl::StrCat(it.pid), absl::StrCat(it.step), it);
      mean.iteration_ms += it.iteration_ms;
      mean.cpu_adam_ms += it.cpu_adam_ms;
      mean.idle_ms += it.idle_ms;
      mean.wait_grads_ms += it.wait_grads_ms;
      mean.wait_copies_ms += it.wait_copies_ms;
      mean.wait_upload_ms += it.wait_upload_ms;
      if (it.on_cpu >= 0) {
        mean.on_cpu = (mean.on_cpu < 0 ? 0.0 : mean.on_cpu) + it.on_cpu;
        cpu_n += 1.0;
      }
      if (it.host_forward_ms >= 0) {
        mean.host_forward_ms = (mean.host_forward_ms < 0 ? 0.0 : mean.host_forward_ms) + it.host_forward_ms;
        forward_n += 1.0;
      }
    }
    const double n = static_cast<double>(end - begin);
    if (end - begin > max_rows) {
      absl::StrAppendFormat(&out, "%-6d %6s (%d more)\n", mean.pid, "...", end - begin - max_rows);
    }
    mean.iteration_ms /= n;
    mean.cpu_adam_ms /= n;
    mean.idle_ms /= n;
    mean.wait_grads_ms /= n;
    mean.wait_copies_ms /= n;
    mean.wait_upload_ms /= n;
    if (cpu_n > 0) mean.on_cpu /= cpu_n;
    if (forward_n > 0) mean.host_forward_ms /= forward_n;
    row(absl::StrCat(mean.pid), "mean", mean);
    begin = end;
  }
  return out;
}

absl::StatusOr<std::pair<double, double>> EventWindow(const TraceFile& trace, const std::string& name, size_t index) {
  std::vector<const TraceFileEvent*> found;
  for (const TraceFileEvent& e : trace.events) {
    if (e.name == name) found.push_back(&e);
  }
  std::stable_sort(found.begin(), found.end(),
                   [](const TraceFileEvent* a, const TraceFileEvent* b) { return a->ts_us < b->ts_us; });
  if (index >= found.size()) {
    return absl::NotFoundError(absl::StrCat("the trace has ", found.size(), " '", name, "' events; no index ", index));
  }
  return std::make_pair(found[index]->ts_us, found[index]->ts_us + found[index]->dur_us);
}

std::string RenderSvg(const TraceFile& trace, const SvgOptions& options) {
  double from = options.from_us.value_or(0.0), to = options.to_us.value_or(0.0);
  if (!options.from_us.has_value() || !options.to_us.has_value()) {
    double lo = 0.0, hi = 0.0;
    bool any = false;
    for (const TraceFileEvent& e : trace.events) {
      lo = any ? std::min(lo, e.ts_us) : e.ts_us;
      hi = any ? std::max(hi, e.ts_us + e.dur_us) : e.ts_us + e.dur_us;
      any = true;
    }
    if (!options.from_us.has_value()) from = lo;
    if (!options.to_us.has_value()) to = hi;
  }
  if (!(to > from)) to = from + 1.0;
  // The events in the window, per row (pid, tid), each at the depth of its nesting on its row.
  struct Box {
    const TraceFileEvent* e;
    int depth;
  };
  std::map<std::pair<int, int>, std::vector<Box>> rows;
  {
    std::map<std::pair<int, int>, std::vector<const TraceFileEvent*>> by_row;
    for (const TraceFileEvent& e : trace.events) {
      if (e.ts_us + e.dur_us < from || e.ts_us > to) continue;
      by_row[{e.pid, e.tid}].push_back(&e);
    }
    for (auto& [key, evs] : by_row) {
      std::stable_sort(evs.begin(), evs.end(), [](const TraceFileEvent* a, const TraceFileEvent* b) {
        if (a->ts_us != b->ts_us) return a->ts_us < b->ts_us;
        return a->dur_us > b->dur_us;
      });
      std::vector<double> open_ends;  // ends of the enclosing spans
      for (const TraceFileEvent* e : evs) {
        while (!open_ends.empty() && e->ts_us >= open_ends.back()) open_ends.pop_back();
        rows[key].push_back(Box{e, static_cast<int>(open_ends.size())});
        open_ends.push_back(e->ts_us + e->dur_us);
      }
    }
  }
  constexpr int kLabel = 170, kBoxH = 16, kRowGap = 8, kTop = 50, kAxis = 30;
  const double scale = options.width / (to - from);
  int y = kTop;
  std::string body;
  for (const auto& [key, boxes] : rows) {
    int max_depth = 0;
    for (const Box& b : boxes) max_depth = std::max(max_depth, b.depth);
    const int height = (max_depth + 1) * kBoxH;
    auto name_it = trace.threads.find(key);
    std::string label = name_it != trace.threads.end() ? name_it->second : absl::StrCat("tid ", key.second);
    if (key.first != 0 || rows.begin()->first.first != rows.rbegin()->first.first) {
      label = absl::StrCat("r", key.first, " ", label);
    }
    absl::StrAppendFormat(&body, "<rect x=\"0\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"#f4f4f4\"/>\n", y,
                          kLabel + options.width + 10, height);
    absl::StrAppendFormat(&body, "<text x=\"4\" y=\"%d\" class=\"row\">%s</text>\n", y + 12, Escape(label));
    for (const Box& b : boxes) {
      const double x0 = std::max(b.e->ts_us, from), x1 = std::min(b.e->ts_us + b.e->dur_us, to);
      const double px = kLabel + (x0 - from) * scale;
      const double pw = std::max(0.5, (x1 - x0) * scale);
      std::string tip = absl::StrCat(b.e->name, ": ", FormatMicros(b.e->dur_us));
      for (const auto& [k, v] : b.e->args) absl::StrAppendFormat(&tip, ", %s=%.4g", k, v);
      absl::StrAppendFormat(&body,
                            "<rect x=\"%.2f\" y=\"%d\" width=\"%.2f\" height=\"%d\" fill=\"%s\" stroke=\"#fff\" "
                            "stroke-width=\"0.3\"><title>%s</title></rect>\n",
                            px, y + b.depth * kBoxH, pw, kBoxH - 1, ColourOf(b.e->name), Escape(tip));
      if (pw > 6.5 * static_cast<double>(b.e->name.size())) {
        absl::StrAppendFormat(&body, "<text x=\"%.2f\" y=\"%d\" class=\"box\">%s</text>\n", px + 2,
                              y + b.depth * kBoxH + 12, Escape(b.e->name));
      }
    }
    y += height + kRowGap;
  }
  // The time axis: about ten ticks at a round step.
  const double span = to - from;
  double step = std::pow(10.0, std::floor(std::log10(span / 10.0)));
  if (span / step > 25) step *= 5;
  else if (span / step > 12) step *= 2;
  std::string axis;
  absl::StrAppendFormat(&axis, "<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"#333\"/>\n", kLabel, y + 4,
                        kLabel + options.width, y + 4);
  for (double t = 0.0; t <= span + 1e-9; t += step) {
    const double px = kLabel + t * scale;
    absl::StrAppendFormat(&axis,
                          "<line x1=\"%.2f\" y1=\"%d\" x2=\"%.2f\" y2=\"%d\" stroke=\"#ddd\"/>\n"
                          "<text x=\"%.2f\" y=\"%d\" class=\"tick\">%s</text>\n",
                          px, kTop - 4, px, y + 8, px, y + 20, FormatMicros(t));
  }
  const int total_h = y + kAxis;
  std::string svg = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\" "
      "font-family=\"sans-serif\">\n"
      "<style>.row{font-size:11px;fill:#222}.box{font-size:10px;fill:#fff;pointer-events:none}"
      ".tick{font-size:10px;fill:#444;text-anchor:middle}.title{font-size:14px;font-weight:bold}</style>\n"
      "<rect width=\"100%%\" height=\"100%%\" fill=\"#fff\"/>\n"
      "<text x=\"4\" y=\"20\" class=\"title\">%s</text>\n"
      "<text x=\"4\" y=\"38\" class=\"row\">window %s, from %s; hover a box for its duration and args</text>\n",
      kLabel + options.width + 10, total_h, kLabel + options.width + 10, total_h, Escape(options.title),
      FormatMicros(span), FormatMicros(from));
  svg += axis;
  svg += body;
  svg += "</svg>\n";
  return svg;
}

}  // namespace ferry
