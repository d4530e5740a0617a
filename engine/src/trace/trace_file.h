// Reading a trace file back: the per-stage summary of `ferry trace` and its SVG timeline.
#ifndef FERRY_TRACE_TRACE_FILE_H_
#define FERRY_TRACE_TRACE_FILE_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace ferry {

// One complete event of a trace file (times in microseconds, as in the file).
struct TraceFileEvent {
  std::string name;
  std::string cat;
  int pid = 0;
  int tid = 0;
  double ts_us = 0.0;
  double dur_us = 0.0;
  std::map<std::string, double> args;  // numeric args only
};

struct TraceFile {
  std::vector<TraceFileEvent> events;                  // "X" events, in file order
  std::map<std::pair<int, int>, std::string> threads;  // (pid, tid) -> thread_name
  // otherData's steady_epoch_us (where ts 0 lies on the writing host's steady clock; < 0: not given)
  // and host (empty: not given).
  double steady_epoch_us = -1.0;
  std::string host;
  // Written by torch.profiler (its schemaVersion; the older exporter's "CPU functions" pid), and its
  // distributedInfo's rank and world_size (-1 and 0: not said). Read by trace/rank_profiles.h.
  bool torch_profiler = false;
  int rank = -1;
  int world_size = 0;
};

// Parses trace-event JSON (an object with "traceEvents", or a bare array). Errors: NotFound for an
// unreadable file, InvalidArgument for malformed JSON or events (naming the file and what is wrong).
absl::StatusOr<TraceFile> ParseTrace(const std::string& json, const std::string& what = "trace");
absl::StatusOr<TraceFile> ReadTraceFile(const std::string& path);

// The traces of several ranks (one file each, as RankTracePath names them) as one: their events and
// threads together, each rank its own timeline (pid). Files of one host that say where their ts 0
// lies on its steady clock are put on one clock, that of the file that started first (a rank's spans
// then line up with the others'); files of other hosts, or without it, keep their own. The result's
// steady_epoch_us is that clock's where every file is on it, else -1. InvalidArgument, naming both
// files, when two hold spans of the same rank.
absl::StatusOr<TraceFile> MergeTraces(const std::vector<std::pair<std::string, TraceFile>>& named);

// One stage of the summary: the events of one name.
struct StageSummary {
  std::string name;
  int64_t count = 0;
  double total_ms = 0.0;    // sum of the events' durations (threads running at once add up)
  double wall_ms = 0.0;     // length of the union of their intervals (per rank)
  double bytes = 0.0;       // sum of their "bytes" args
  double gbps = 0.0;        // bytes / wall time (0 without bytes)
  std::string ceiling_key;  // "d2h", "h2d", "mem", "disk" or empty
  std::optional<double> ceiling_gbps;
  // Of the events that carry a "cpu_us" arg (the thread's CPU time within the span: cpu_adam.thread):
  // their CPU time and their durations. cpu_ms / cpu_span_ms is the share of its spans a thread ran;
  // the rest it waited for a CPU (or was blocked).
  double cpu_ms = 0.0;
  double cpu_span_ms = 0.0;
};

// The ceiling a stage is compared with: d2h.chunk -> "d2h", h2d.chunk -> "h2d", cpu_adam.* -> "mem"
// (host memory traffic of the update), ckpt.write / ckpt.read -> "disk", ckpt.stage -> "d2h"; else "".
std::string CeilingKeyOf(const std::string& stage);

// Every stage of `trace`, ordered by first appearance; `ceilings` (key -> GB/s) fills ceiling_gbps.
std::vector<StageSummary> Summarize(const TraceFile& trace, const std::map<std::string, double>& ceilings);

// The summary as a table (one line per stage, with the ratio to the ceiling where there is one), then
// a line per stage whose events carry their threads' CPU time: the share of the spans they ran.
std::string FormatSummary(const std::vector<StageSummary>& stages);

// One iteration of a rank's loop as its trace shows it: from the end of one `step` span to the end of
// the next (the trainer's host time), and how the offloaded update spent it.
struct IterationSummary {
  int pid = 0;          // the rank
  size_t step = 0;      // the index (0-based, per rank) of the step that ends it
  double iteration_ms = 0.0;
  // CPU Adam running: the union of the cpu_adam.thread spans within it (a worker on a task), or of
  // the cpu_adam.round spans where the rank's trace has no thread span. A round lasts until the
  // early thread finishes it, so it also covers the early thread's waits while its workers idle.
  double cpu_adam_ms = 0.0;
  double idle_ms = 0.0;         // iteration_ms - cpu_adam_ms: the CPU update not running
  double wait_grads_ms = 0.0;   // the union of wait.grads within it (the early pass waiting for grads)
  // The union of wait.copies within it: the early pass waiting for grads to land that it took as
  // final, or for a download queued behind a part not final yet.
  double wait_copies_ms = 0.0;
  double wait_upload_ms = 0.0;  // the union of wait.upload within it (the trainer waiting for new params)
  // The trainer issuing the forward: from the iteration's first wait.upload (the forward's first
  // pre-hook, with attach) to its first grads_ready after it (the backward's first announcement);
  // negative when the iteration has no such pair. Against the GPU's forward time: a forward paced by
  // the host's launches, not by the updates (wait.upload small beside it).
  double host_forward_ms = -1.0;
  // Of the cpu_adam.thread spans that start within it and carry their CPU time: the share of their
  // time the threads ran on a CPU; negative when none does.
  double on_cpu = -1.0;
};

// Every iteration of `trace`, rank by rank in order (a rank with fewer than two steps has none).
std::vector<IterationSummary> Iterations(const TraceFile& trace);

// The iterations as a table, one line each (the first `max_rows` of each rank, then its mean).
std::string FormatIterations(const std::vector<IterationSummary>& iterations, size_t max_rows = 30);

struct SvgOptions {
  // The time window drawn, microseconds; both unset: the whole trace.
  std::optional<double> from_us;
  std::optional<double> to_us;
  int width = 1600;    // pixels of the time axis area
  std::string title = "ferry trace";
};

// The window [from, to) of the `index`-th (0-based) event named `name`; NotFound when absent.
absl::StatusOr<std::pair<double, double>> EventWindow(const TraceFile& trace, const std::string& name, size_t index);

// The timeline as a standalone SVG: one row per thread and lane (nested spans stacked beneath their
// parents), a box per span (its name when it fits; hover for name, duration and args), a time axis.
std::string RenderSvg(const TraceFile& trace, const SvgOptions& options);

}  // namespace ferry

#endif  // FERRY_TRACE_TRACE_FILE_H_
