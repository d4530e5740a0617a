// The trace layer: spans recorded by the engine's layers, exported as Chrome/Perfetto trace-event
// JSON (open the file in ui.perfetto.dev or chrome://tracing; `ferry trace FILE` summarizes it).
//
// A layer holds a `Tracer*` that is null when tracing is off: every recording site is then one
// inline null check (TraceSpan's constructor and destructor), with no clock read, allocation or lock.
// When on, each span is a complete event ("ph":"X") of the calling thread (or of a named lane: see
// Lane), appended to that thread's own buffer; the buffers are merged when the trace is serialized.
//
//   TraceSpan span(tracer, "ckpt.write", "ckpt");
//   span.Arg("bytes", n);          // bytes args get a GB/s arg in the export
//   ...                            // the span ends at its destructor (or End())
//
// Spans of work the host does not run itself (copies and kernels on device streams) are timed on
// the host where it observes them (submitted, then seen complete) and recorded on a lane such as
// "d2h stream"; the trace layer knows nothing of the device.
#ifndef FERRY_TRACE_TRACER_H_
#define FERRY_TRACE_TRACER_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"

namespace ferry {

// The steady clock's time in nanoseconds: the clock every Tracer's NowNs counts from.
int64_t SteadyNs();

// The calling thread's CPU time in nanoseconds (CLOCK_THREAD_CPUTIME_ID): beside a span's wall time,
// how much of it the thread ran (the rest it was preempted, or blocked). 0 where the clock is missing.
int64_t ThreadCpuNs();

// One numeric argument of an event. `key` must be a string literal (it is not copied).
struct TraceArg {
  const char* key = nullptr;
  double value = 0.0;
};

// One recorded span, as the tracer keeps it (times in nanoseconds since the tracer was created).
struct TraceEvent {
  static constexpr size_t kMaxArgs = 4;
  std::string name;
  const char* cat = "";       // a string literal
  int tid = 0;
  int64_t start_ns = 0;
  int64_t dur_ns = 0;
  uint8_t num_args = 0;
  std::array<TraceArg, kMaxArgs> args{};
  std::string detail;         // optional text argument ("file", ...)
};

struct TracerOptions {
  // Where Flush writes the JSON (atomically: a temporary, then rename). Empty: Flush does nothing
  // (ToJson still works).
  std::string path;
  int pid = 0;                          // the rank: Chrome's process id
  std::string process_name = "ferry";
  // Events kept at most; later ones are counted as dropped (reported in the file's otherData), so a
  // long run cannot grow without bound. 4 Mi events are ~0.5 GB of JSON.
  size_t max_events = size_t{1} << 22;
  // With a path: Flush also runs when the process exits (std::atexit: a return from main, exit(), the
  // end of a Python interpreter) or terminates (std::terminate: an uncaught exception; the handler
  // installed before is called afterwards) while this tracer is alive, so a trace is written even
  // when its owner outlives main or the interpreter's shutdown. A SIGKILL or a crash by a signal
  // loses it.
  bool flush_at_exit = true;
};

// Tracer: safe for concurrent use (each thread records into its own buffer).
class Tracer final {
 public:
  static constexpr int kCurrentThread = -1;

  explicit Tracer(TracerOptions options);
  ~Tracer();  // does not flush: the owner decides (Flush); no longer flushed at exit
  Tracer(const Tracer&) = delete;
  Tracer& operator=(const Tracer&) = delete;

  // Nanoseconds since the tracer was created (steady clock).
  int64_t NowNs() const;
  // The tracer's time (NowNs's) of a SteadyNs() reading: for spans timed by code that times them
  // with or without a tracer.
  int64_t FromSteadyNs(int64_t steady_ns) const { return steady_ns - epoch_ns_; }

  // Records a complete span [start_ns, end_ns) of thread `tid` (kCurrentThread: the caller's, or a
  // Lane). At most TraceEvent::kMaxArgs args are kept. Safe from any thread.
  void Complete(std::string_view name, const char* cat, int64_t start_ns, int64_t end_ns,
                std::initializer_list<TraceArg> args = {}, std::string_view detail = {},
                int tid = kCurrentThread);
  // The same for an event built by the caller (its tid may be kCurrentThread).
  void Record(TraceEvent event);

  // The calling thread's id in this trace (registered on first use as "thread N").
  int ThreadId();
  // Names the calling thread ("M" thread_name event). `if_unnamed`: only when it has no name yet.
  void NameThread(std::string_view name, bool if_unnamed = false);
  // The id of the lane `name` (created on first use): a row of its own for spans that no host
  // thread runs, such as the copies of a device stream.
  int Lane(std::string_view name);

  // The whole trace as trace-event JSON: {"traceEvents": [...], "displayTimeUnit": "ms",
  // "otherData": {...}}; events sorted by start (parents before their children), thread and lane
  // names as metadata events, and for every event with a "bytes" arg a "GBps" arg.
  std::string ToJson() const;
  // Writes ToJson() to options.path: a temporary beside it, fsynced, then renamed over it. Calls are
  // serialized (the exit handler may flush while the owner does).
  // Errors: the file cannot be written (naming it). OK at once when the path is empty.
  absl::Status Flush() const;

  const std::string& path() const { return options_.path; }
  int pid() const { return options_.pid; }
  size_t num_events() const { return count_.load(std::memory_order_relaxed); }
  uint64_t dropped() const { return dropped_.load(std::memory_order_relaxed); }
  // Every recorded event (copies), sorted as in ToJson; for tests and the summary.
  std::vector<TraceEvent> Events() const;
  // tid -> name of every named thread and lane.
  std::map<int, std::string> ThreadNames() const;

 private:
  struct ThreadBuffer {
    int tid = 0;
    std::mutex mu;  // uncontended but for the merge (std::mutex: TSan sees it)
    std::vector<TraceEvent> events ABSL_GUARDED_BY(mu);
  };
  ThreadBuffer* CurrentBuffer();

  const TracerOptions options_;
  const uint64_t uid_;  // unique per tracer (never reused): the key of the thread-local cache
  const int64_t epoch_ns_;
  std::atomic<size_t> count_{0};
  std::atomic<uint64_t> dropped_{0};
  mutable std::mutex mu_;
  mutable std::mutex flush_mu_;  // one Flush at a time (they share the temporary file)
  std::vector<std::unique_ptr<ThreadBuffer>> buffers_ ABSL_GUARDED_BY(mu_);
  std::map<std::thread::id, ThreadBuffer*> by_thread_ ABSL_GUARDED_BY(mu_);
  std::map<int, std::string> names_ ABSL_GUARDED_BY(mu_);      // tid -> thread or lane name
  std::map<std::string, int> lanes_ ABSL_GUARDED_BY(mu_);      // lane name -> tid
  int next_tid_ ABSL_GUARDED_BY(mu_) = 1;
};

// A span from construction to destruction (or End) on the calling thread. With a null tracer it
// does nothing at all. One thread.
class TraceSpan final {
 public:
  TraceSpan(Tracer* tracer, const char* name, const char* cat) : tracer_(tracer), name_(name), cat_(cat) {
    if (tracer_ != nullptr) start_ns_ = tracer_->NowNs();
  }
  ~TraceSpan() { End(); }
  TraceSpan(const TraceSpan&) = delete;
  TraceSpan& operator=(const TraceSpan&) = delete;

  bool on() const { return tracer_ != nullptr; }
  // Adds a numeric arg (at most TraceEvent::kMaxArgs; `key` a string literal).
  void Arg(const char* key, double value) {
    if (tracer_ != nullptr && num_args_ < args_.size()) args_[num_args_++] = TraceArg{key, value};
  }
  void Detail(std::string_view detail) {
    if (tracer_ != nullptr) detail_ = detail;
  }
  // Records the span now (once).
  void End() {
    if (tracer_ == nullptr) return;
    TraceEvent e;
    e.name = name_;
    e.cat = cat_;
    e.tid = Tracer::kCurrentThread;
    e.start_ns = start_ns_;
    e.dur_ns = tracer_->NowNs() - start_ns_;
    e.num_args = static_cast<uint8_t>(num_args_);
    e.args = args_;
    e.detail = std::move(detail_);
    tracer_->Record(std::move(e));
    tracer_ = nullptr;
  }

 private:
  Tracer* tracer_;
  const char* name_;
  const char* cat_;
  int64_t start_ns_ = 0;
  size_t num_args_ = 0;
  std::array<TraceArg, TraceEvent::kMaxArgs> args_{};
  std::string detail_;
};

// The file a rank writes for `path`: `path` itself for one rank, else "<stem>.rank-<r><ext>"
// ("trace.json" -> "trace.rank-1.json").
std::string RankTracePath(const std::string& path, int rank, int world_size);

}  // namespace ferry

#endif  // FERRY_TRACE_TRACER_H_
