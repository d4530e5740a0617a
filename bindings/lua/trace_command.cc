// `ferry trace`: the per-stage summary of a trace written by EngineOptions::trace_path (FERRY_TRACE,
// `ferry run --trace`, `ferry bench ... --trace`), beside each stage's ceiling, and its timeline as SVG.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/thread_pool.h"
#include "device/device.h"
#include "ferry/status.h"
#include "lua/commands.h"
#include "lua/verb_flags.h"
#include "memory/pinned_arena.h"
#include "trace/rank_profiles.h"
#include "trace/trace_file.h"
#include "trace/trace_report.h"

ABSL_FLAG(std::string, ferry_trace_svg, "", "write the timeline as an SVG picture to this file");
ABSL_FLAG(std::string, ferry_trace_ceiling, "",
          "ceilings in GB/s, e.g. d2h=55,h2d=55,mem=120,disk=5 (keys: d2h, h2d, mem, disk); "
          "those not given are measured on the spot when --measure allows");
ABSL_FLAG(std::string, ferry_trace_measure, "auto",
          "measure the missing ceilings here: auto (the pinned copy rates when a GPU is present, and the "
          "host memory rate), on, off");
ABSL_FLAG(int, ferry_trace_step, -1,
          "the SVG shows the window of this step (0-based; -1: the last one); with --all the whole trace");
ABSL_FLAG(bool, ferry_trace_all, false, "the SVG shows the whole trace rather than one step");

namespace ferry::cli {
namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

const std::vector<VerbFlag>& TraceFlags() {
  static const auto* flags = new std::vector<VerbFlag>{
      {"svg", "ferry_trace_svg", "OUT.svg"},
      {"ceiling", "ferry_trace_ceiling", "KEY=GBPS,..."},
      {"measure", "ferry_trace_measure", "auto|on|off"},
      {"step", "ferry_trace_step", "N"},
      {"all", "ferry_trace_all"},
  };
  return *flags;
}

// The host memory rate with every CPU of this process copying its slice of 1 GiB at once (memcpy:
// read + write counted), best of three, in GB/s of traffic: what CPU Adam's threads can reach.
double MeasureHostMemory() {
  const size_t threads = ThreadPool::DefaultThreads();
  const size_t bytes = size_t{1} << 30;
  std::vector<char> a(bytes, 1), b(bytes, 2);
  ThreadPool pool(threads);
  const size_t slice = bytes / threads;
  double best = 0;
  for (int i = 0; i < 3; ++i) {
    const double t0 = Now();
    pool.ParallelFor(threads, [&](size_t k) { std::memcpy(b.data() + k * slice, a.data() + k * slice, slice); });
    const double t = Now() - t0;
    if (t > 0) best = std::max(best, 2.0 * static_cast<double>(slice * threads) / t / 1e9);
  }
  return best + static_cast<double>(b[bytes / 2] - 1) * 1e-12;  // keeps the copy observable
}

// Pinned copy rates between device memory and pinned host memory (256 MiB, best of three).
absl::Status MeasurePinned(Device& device, double* d2h, double* h2d) {
  const size_t bytes = size_t{256} << 20;
  PinnedArenaOptions options;
  options.capacity_bytes = bytes;
  options.name = "ferry trace ceiling";
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<PinnedArena> arena, PinnedArena::Create(&device, options));
  FERRY_ASSIGN_OR_RETURN(HostSpan host, arena->Allocate(bytes));
  FERRY_ASSIGN_OR_RETURN(DeviceBuffer dev, device.Allocate(bytes));
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream, device.CreateStream());
  for (CopyKind kind : {CopyKind::kDeviceToHost, CopyKind::kHostToDevice}) {
    double best = 0;
    for (int i = 0; i < 4; ++i) {  // the first is a warm-up
      const double t0 = Now();
      if (kind == CopyKind::kDeviceToHost) {
        FERRY_RETURN_IF_ERROR(device.CopyAsync(host.data, dev.data(), bytes, kind, *stream));
      } else {
        FERRY_RETURN_IF_ERROR(device.CopyAsync(dev.data(), host.data, bytes, kind, *stream));
      }
      FERRY_RETURN_IF_ERROR(stream->Synchronize());
      const double t = Now() - t0;
      if (i > 0 && t > 0) best = std::max(best, static_cast<double>(bytes) / t / 1e9);
    }
    (kind == CopyKind::kDeviceToHost ? *d2h : *h2d) = best;
  }
  return arena->Release(host);
}

}  // namespace

std::string TraceUsage() {
  return absl::StrCat(
      "usage: ferry trace FILE... [--svg OUT.svg] [--ceiling KEY=GBPS,...] [flags]\n"
      "\n"
      "Summarizes a trace written by the engine (EngineOptions::trace_path, FERRY_TRACE=FILE,\n"
      "`ferry run --trace FILE`, `ferry bench NAME --trace FILE`): per stage (span name) the count,\n"
      "the total time (threads running at once add up), the wall time (the union of the spans),\n"
      "the bytes, the rate (bytes / wall time) and its ratio to the stage's ceiling: d2h and h2d\n"
      "(pinned copies), mem (host memory traffic of CPU Adam) and disk (checkpoint writes and reads).\n"
      "Ceilings come from --ceiling (e.g. the figures of `ferry bench transfer` and `ferry bench adam`)\n"
      "or are measured on the spot (--measure); the report says which. With --svg, the timeline\n"
      "of one step (or, with --all, the whole trace) as an SVG picture: a row per thread and lane,\n"
      "a box per span (hover for its duration and arguments), a time axis. Where the trace has\n"
      "several steps, each iteration (step end to step end) with the time CPU Adam ran in it.\n"
      "Several FILEs (one per rank, as a multi-rank run writes them) are read as one: the stages\n"
      "of all ranks, each rank's iterations, every rank's threads in the picture; the ranks of\n"
      "one host on one clock, so that their spans line up.\n"
      "\n"
      "torch.profiler's traces of the ranks of one job (one file each, e.g. from\n"
      "`bench_train_dist.py --profile DIR`) are read instead for which rank each collective waited\n"
      "for: per kind, how far apart the ranks started its NCCL kernels, which rank came last and\n"
      "whether its host launched it late, and each rank's compute stream's idle time by cause.\n"
      "\n"
      "flags:\n",
      FlagsHelp(TraceFlags()));
}

int TraceCommand(const std::vector<std::string>& args, std::FILE* out, std::FILE* err) {
  if (WantsHelp(args)) {
    std::fputs(TraceUsage().c_str(), out);
    return 0;
  }
  auto usage_error = [&](absl::string_view message) {
    absl::FPrintF(err, "%s\n(ferry trace --help for usage)\n", message);
    return 2;
  };
  absl::StatusOr<std::vector<std::string>> positional = ParseVerbFlags("trace", args, TraceFlags());
  if (!positional.ok()) return usage_error(positional.status().message());
  if (positional->empty()) return usage_error("ferry trace: expected a FILE (or one per rank)");
  absl::StatusOr<std::map<std::string, double>> ceilings = ParseTraceCeilings(absl::GetFlag(FLAGS_ferry_trace_ceiling));
  if (!ceilings.ok()) return usage_error(absl::StrCat("ferry trace: ", ceilings.status().message()));
  const std::string measure = absl::GetFlag(FLAGS_ferry_trace_measure);
  if (measure != "auto" && measure != "on" && measure != "off") {
    return usage_error(absl::StrCat("ferry trace: --measure must be auto, on or off, got \"", measure, "\""));
  }
  std::vector<std::pair<std::string, TraceFile>> read;
  for (const std::string& path : *positional) {
    absl::StatusOr<TraceFile> one = ReadTraceFile(path);
    if (!one.ok()) {
      absl::FPrintF(err, "ferry trace: %s\n", one.status().message());
      return 1;
    }
    read.emplace_back(path, *std::move(one));
  }
  const bool profiles = AnyProfilerTrace(read);
  if (profiles && !absl::GetFlag(FLAGS_ferry_trace_svg).empty()) {
    return usage_error("ferry trace: --svg draws Ferry's traces; torch.profiler's open in Perfetto or chrome://tracing");
  }
  TraceCeilings limits;
  limits.gbps = *ceilings;
  for (const auto& [k, v] : *ceilings) limits.source[k] = "given";
  if (!profiles && measure != "off") {
    if (!limits.gbps.contains("mem")) {
      limits.gbps["mem"] = MeasureHostMemory();
      limits.source["mem"] = absl::StrCat("measured here: memcpy of 1 GiB on ", ThreadPool::DefaultThreads(), " threads");
    }
    if (!limits.gbps.contains("d2h") || !limits.gbps.contains("h2d")) {
      absl::StatusOr<std::unique_ptr<Device>> device = CreateDevice();
      if (device.ok() && ((*device)->backend() == Backend::kCuda || measure == "on")) {
        double d2h = 0, h2d = 0;
        absl::Status st = MeasurePinned(**device, &d2h, &h2d);
        if (st.ok()) {
          const std::string where = absl::StrCat("measured here: 256 MiB pinned copy on ", (*device)->name());
          if (!limits.gbps.contains("d2h")) limits.gbps["d2h"] = d2h, limits.source["d2h"] = where;
          if (!limits.gbps.contains("h2d")) limits.gbps["h2d"] = h2d, limits.source["h2d"] = where;
        } else {
          absl::FPrintF(err, "ferry trace: measuring the pinned copy rate: %s\n", st.message());
        }
      }
    }
  }
  TraceFile merged;
  absl::StatusOr<std::string> report = TraceReport(read, limits, &merged);
  if (!report.ok()) {
    absl::FPrintF(err, "ferry trace: %s\n", report.status().message());
    return 2;
  }
  absl::FPrintF(out, "%s", *report);
  if (profiles) return 0;
  const std::string what = TraceFilesName(read);
  const std::string svg_path = absl::GetFlag(FLAGS_ferry_trace_svg);
  if (!svg_path.empty()) {
    SvgOptions svg;
    svg.title = absl::StrCat("ferry trace ", what);
    if (!absl::GetFlag(FLAGS_ferry_trace_all)) {
      const int step = absl::GetFlag(FLAGS_ferry_trace_step);
      // The window of a step of the first file's rank, on the merged trace's clock.
      TraceFile first;
      std::set<int> first_pids;
      for (const TraceFileEvent& e : read.front().second.events) first_pids.insert(e.pid);
      for (const TraceFileEvent& e : merged.events) {
        if (first_pids.count(e.pid) != 0) first.events.push_back(e);
      }
      size_t count = 0;
      for (const TraceFileEvent& e : first.events) count += e.name == "step" ? 1 : 0;
      if (count > 0) {
        const size_t index = step < 0 ? count - 1 : static_cast<size_t>(step);
        absl::StatusOr<std::pair<double, double>> window = EventWindow(first, "step", index);
        if (!window.ok()) {
          absl::FPrintF(err, "ferry trace: --step: %s\n", window.status().message());
          return 2;
        }
        // A little margin either side, so the copies that finish after the step show.
        const double margin = 0.02 * (window->second - window->first);
        svg.from_us = window->first - margin;
        svg.to_us = window->second + margin;
        svg.title = absl::StrCat("ferry: step ", index, " of ", what);
      }
    }
    std::ofstream f(svg_path, std::ios::binary | std::ios::trunc);
    f << RenderSvg(merged, svg);
    f.close();
    if (!f) {
      absl::FPrintF(err, "ferry trace: cannot write %s\n", svg_path);
      return 1;
    }
    absl::FPrintF(out, "timeline written to %s\n", svg_path);
  }
  return 0;
}

}  // namespace ferry::cli
