#include "trace/tracer.h"

#include <fcntl.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace ferry {

int64_t SteadyNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int64_t ThreadCpuNs() {
  timespec ts{};
  if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) != 0) return 0;
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

namespace {

std::atomic<uint64_t> next_uid{1};

// The calling thread's buffer of the tracer it used last (one entry: a thread records into one
// tracer at a time in practice; a miss costs one lookup under the tracer's lock).
struct ThreadCache {
  uint64_t uid = 0;
  void* buffer = nullptr;
};
thread_local ThreadCache tls_cache;

void AppendJsonString(std::string& out, std::string_view s) {
  out += '"';
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          absl::StrAppendFormat(&out, "\\u%04x", static_cast<int>(static_cast<unsigned char>(c)));
        } else {
          out += c;
        }
    }
  }
  out += '"';
}

void AppendNumber(std::string& out, double v) {
  if (!(v == v) || v > 1e300 || v < -1e300) {
    out += "0";  // JSON has no NaN or infinity
    return;
  }
  absl::StrAppendFormat(&out, "%.17g", v);
}

absl::Status PosixStatus(const std::string& what, int err) {
  return absl::UnavailableError(absl::StrCat("trace: ", what, ": ", std::strerror(err)));
}

// The live tracers that flush when the process exits or terminates (TracerOptions::flush_at_exit).
// Created on first use together with its handlers, and never destroyed: the handlers may run after
// static destructors.
class ExitFlushRegistry {
 public:
  void Add(const Tracer* tracer) {
    std::lock_guard<std::mutex> lock(mu_);
    live_.insert(tracer);
  }
  void Remove(const Tracer* tracer) {
    std::lock_guard<std::mutex> lock(mu_);
    live_.erase(tracer);
  }
  // Flushes every live tracer; errors go to stderr (nobody is left to return them to). `wait`: block
  // for the lock; otherwise (std::terminate, which may run on a thread that holds it) skip if taken.
  void FlushAll(const char* when, bool wait) {
    std::unique_lock<std::mutex> lock(mu_, std::defer_lock);
    if (wait) {
      lock.lock();
    } else if (!lock.try_lock()) {
      return;
    }
    for (const Tracer* t : live_) {
      const absl::Status s = t->Flush();
      if (s.ok()) {
        std::fprintf(stderr, "ferry: trace written at %s: %s\n", when, t->path().c_str());
      } else {
        std::fprintf(stderr, "ferry: writing the trace at %s: %s\n", when, std::string(s.message()).c_str());
      }
    }
  }
  std::terminate_handler previous_terminate = nullptr;

 private:
  std::mutex mu_;
  std::set<const Tracer*> live_;
};

ExitFlushRegistry* exit_registry = nullptr;

void FlushAtExit() { exit_registry->FlushAll("exit", /*wait=*/true); }

[[noreturn]] void FlushAtTerminate() {
  exit_registry->FlushAll("terminate", /*wait=*/false);
  if (exit_registry->previous_terminate != nullptr) exit_registry->previous_terminate();
  std::abort();
}

ExitFlushRegistry& ExitFlushes() {
  static ExitFlushRegistry* const registry = [] {
    exit_registry = new ExitFlushRegistry;  // never deleted (see the class comment)
    std::atexit(FlushAtExit);
    exit_registry->previous_terminate = std::set_terminate(FlushAtTerminate);
    return exit_registry;
  }();
  return *registry;
}

}  // namespace

Tracer::Tracer(TracerOptions options)
    : options_(std::move(options)), uid_(next_uid.fetch_add(1)), epoch_ns_(SteadyNs()) {
  if (!options_.path.empty() && options_.flush_at_exit) ExitFlushes().Add(this);
}

Tracer::~Tracer() {
  if (!options_.path.empty() && options_.flush_at_exit) ExitFlushes().Remove(this);
}

int64_t Tracer::NowNs() const { return SteadyNs() - epoch_ns_; }

Tracer::ThreadBuffer* Tracer::CurrentBuffer() {
  if (tls_cache.uid == uid_) return static_cast<ThreadBuffer*>(tls_cache.buffer);
  std::lock_guard<std::mutex> lock(mu_);
  auto [it, inserted] = by_thread_.emplace(std::this_thread::get_id(), nullptr);
  if (inserted) {
    buffers_.push_back(std::make_unique<ThreadBuffer>());
    buffers_.back()->tid = next_tid_++;
    it->second = buffers_.back().get();
  }
  tls_cache = ThreadCache{uid_, it->second};
  return it->second;
}

int Tracer::ThreadId() { return CurrentBuffer()->tid; }

void Tracer::NameThread(std::string_view name, bool if_unnamed) {
  const int tid = ThreadId();
  std::lock_guard<std::mutex> lock(mu_);
  auto [it, inserted] = names_.emplace(tid, std::string(name));
  if (!inserted && !if_unnamed) it->second = std::string(name);
}

int Tracer::Lane(std::string_view name) {
  std::lock_guard<std::mutex> lock(mu_);
  auto [it, inserted] = lanes_.emplace(std::string(name), 0);
  if (inserted) {
    it->second = next_tid_++;
    names_[it->second] = std::string(name);
  }
  return it->second;
}

void Tracer::Complete(std::string_view name, const char* cat, int64_t start_ns, int64_t end_ns,
                      std::initializer_list<TraceArg> args, std::string_view detail, int tid) {
  TraceEvent e;
  e.name = std::string(name);
  e.cat = cat;
  e.tid = tid;
  e.start_ns = start_ns;
  e.dur_ns = std::max<int64_t>(0, end_ns - start_ns);
  for (const TraceArg& a : args) {
    if (e.num_args == TraceEvent::kMaxArgs) break;
    e.args[e.num_args++] = a;
  }
  e.detail = std::string(detail);
  Record(std::move(e));
}

void Tracer::Record(TraceEvent event) {
  if (count_.fetch_add(1, std::memory_order_relaxed) >= options_.max_events) {
    count_.fetch_sub(1, std::memory_order_relaxed);
    dropped_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  ThreadBuffer* buffer = CurrentBuffer();
  if (event.tid == kCurrentThread) event.tid = buffer->tid;
  std::lock_guard<std::mutex> lock(buffer->mu);
  buffer->events.push_back(std::move(event));
}

std::vector<TraceEvent> Tracer::Events() const {
  std::vector<TraceEvent> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& b : buffers_) {
      std::lock_guard<std::mutex> block(b->mu);
      all.insert(all.end(), b->events.begin(), b->events.end());
    }
  }
  // By start; of two spans starting together the longer (the parent) first.
  std::stable_sort(all.begin(), all.end(), [](const TraceEvent& a, const TraceEvent& b) {
    if (a.start_ns != b.start_ns) return a.start_ns < b.start_ns;
    return a.dur_ns > b.dur_ns;
  });
  return all;
}

std::map<int, std::string> Tracer::ThreadNames() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::map<int, std::string> names = names_;
  for (const auto& b : buffers_) names.emplace(b->tid, absl::StrCat("thread ", b->tid));
  return names;
}

std::string Tracer::ToJson() const {
  const std::vector<TraceEvent> events = Events();
  const std::map<int, std::string> names = ThreadNames();
  std::string out;
  out.reserve(events.size() * 160 + 4096);
  out += "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"producer\":\"ferry\",\"dropped_events\":";
  // Where ts 0 lies on the host's steady clock, and the host: `ferry trace` puts the files of one host
  // on one clock (MergeTraces).
  char host[256] = {0};
  if (gethostname(host, sizeof(host) - 1) != 0) host[0] = '\0';
  absl::StrAppend(&out, dropped(), ",\"steady_epoch_us\":", absl::StrFormat("%.3f", static_cast<double>(epoch_ns_) / 1e3),
                  ",\"host\":");
  AppendJsonString(out, host);
  out += "},\n\"traceEvents\":[\n";
  absl::StrAppend(&out, "{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":", options_.pid, ",\"tid\":0,\"args\":{\"name\":");
  AppendJsonString(out, options_.process_name);
  out += "}}";
  for (const auto& [tid, name] : names) {
    absl::StrAppend(&out, ",\n{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":", options_.pid, ",\"tid\":", tid,
                    ",\"args\":{\"name\":");
    AppendJsonString(out, name);
    absl::StrAppend(&out, "}},\n{\"ph\":\"M\",\"name\":\"thread_sort_index\",\"pid\":", options_.pid,
                    ",\"tid\":", tid, ",\"args\":{\"sort_index\":", tid, "}}");
  }
  for (const TraceEvent& e : events) {
    out += ",\n{\"ph\":\"X\",\"name\":";
    AppendJsonString(out, e.name);
    out += ",\"cat\":";
    AppendJsonString(out, e.cat);
    absl::StrAppend(&out, ",\"pid\":", options_.pid, ",\"tid\":", e.tid, ",\"ts\":");
    absl::StrAppendFormat(&out, "%.3f,\"dur\":%.3f,\"args\":{", static_cast<double>(e.start_ns) / 1e3,
                          static_cast<double>(e.dur_ns) / 1e3);
    bool first = true;
    double bytes = -1.0;
    for (size_t i = 0; i < e.num_args; ++i) {
      if (!first) out += ',';
      first = false;
      AppendJsonString(out, e.args[i].key);
      out += ':';
      AppendNumber(out, e.args[i].value);
      if (std::strcmp(e.args[i].key, "bytes") == 0) bytes = e.args[i].value;
    }
    if (bytes >= 0.0 && e.dur_ns > 0) {
      if (!first) out += ',';
      first = false;
      out += "\"GBps\":";
      AppendNumber(out, bytes / static_cast<double>(e.dur_ns));  // bytes per ns = GB/s
    }
    if (!e.detail.empty()) {
      if (!first) out += ',';
      out += "\"detail\":";
      AppendJsonString(out, e.detail);
    }
    out += "}}";
  }
  out += "\n]}\n";
  return out;
}

absl::Status Tracer::Flush() const {
  if (options_.path.empty()) return absl::OkStatus();
  std::lock_guard<std::mutex> flushing(flush_mu_);
  const std::string json = ToJson();
  const std::string tmp = absl::StrCat(options_.path, ".tmp");
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return PosixStatus(absl::StrCat("cannot create ", tmp), errno);
  size_t at = 0;
  while (at < json.size()) {
    const ssize_t n = ::write(fd, json.data() + at, json.size() - at);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      return PosixStatus(absl::StrCat("writing ", tmp), err);
    }
    at += static_cast<size_t>(n);
  }
  const int synced = ::fsync(fd) == 0 ? 0 : errno;
  const int closed = ::close(fd) == 0 ? 0 : errno;
  if (synced != 0 || closed != 0) {
    ::unlink(tmp.c_str());
    return PosixStatus(absl::StrCat("syncing ", tmp), synced != 0 ? synced : closed);
  }
  if (::rename(tmp.c_str(), options_.path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return PosixStatus(absl::StrCat("renaming ", tmp, " to ", options_.path), err);
  }
  return absl::OkStatus();
}

std::string RankTracePath(const std::string& path, int rank, int world_size) {
  if (world_size <= 1) return path;
  const size_t slash = path.find_last_of('/');
  const size_t dot = path.find_last_of('.');
  if (dot == std::string::npos || (slash != std::string::npos && dot < slash) || dot == slash + 1) {
    return absl::StrCat(path, ".rank-", rank);
  }
  return absl::StrCat(path.substr(0, dot), ".rank-", rank, path.substr(dot));
}

}  // namespace ferry
