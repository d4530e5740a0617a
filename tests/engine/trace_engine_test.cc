// The engine's trace (EngineOptions::trace_path) over real steps, a save and a load: on the host
// backend in CI, on CUDA where a GPU is present (the device layer picks it).
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "device/device.h"
#include "engine/engine_test_util.h"
#include "ferry/engine.h"
#include "gtest/gtest.h"
#include "trace/trace_file.h"

namespace ferry::engine_test {
namespace {

// The spans of one thread (not a lane) must nest: each one lies inside the one still open before it,
// or after it. The file rounds ts and dur to 1 ns each.
void ExpectProperNesting(const TraceFile& trace) {
  constexpr double kEps = 0.005;  // microseconds
  std::map<std::pair<int, int>, std::vector<const TraceFileEvent*>> rows;
  for (const TraceFileEvent& e : trace.events) {
    auto name = trace.threads.find({e.pid, e.tid});
    if (name != trace.threads.end() && name->second.find("(observed)") != std::string::npos) continue;  // a lane
    rows[{e.pid, e.tid}].push_back(&e);
  }
  for (auto& [row, events] : rows) {
    std::stable_sort(events.begin(), events.end(), [](const TraceFileEvent* a, const TraceFileEvent* b) {
      return a->ts_us != b->ts_us ? a->ts_us < b->ts_us : a->dur_us > b->dur_us;
    });
    std::vector<const TraceFileEvent*> open;
    for (const TraceFileEvent* e : events) {
      while (!open.empty() && e->ts_us >= open.back()->ts_us + open.back()->dur_us - kEps) open.pop_back();
      if (!open.empty()) {
        EXPECT_LE(e->ts_us + e->dur_us, open.back()->ts_us + open.back()->dur_us + kEps)
            << "'" << e->name << "' at " << e->ts_us << " overlaps the end of '" << open.back()->name
            << "' (thread " << row.second << ")";
      }
      open.push_back(e);
    }
  }
}

// The innermost span named `parent` on the same thread that contains `child`, or null.
const TraceFileEvent* Parent(const TraceFile& trace, const TraceFileEvent& child, const std::string& parent) {
  for (const TraceFileEvent& e : trace.events) {
    if (e.name == parent && e.pid == child.pid && e.tid == child.tid && e.ts_us <= child.ts_us + 0.005 &&
        child.ts_us + child.dur_us <= e.ts_us + e.dur_us + 0.005) {
      return &e;
    }
  }
  return nullptr;
}

// An engine without a comm in a process the launcher started as rank 1 of 2 (each DDP rank an engine
// of its own): its trace is that rank's file, with that rank's pid, so that the ranks' files neither
// overwrite each other nor read as one rank (ferry trace refuses a rank twice).
TEST(TraceEngineTest, AnEngineWithoutACommNamesItsTraceByTheLaunchersRank) {
  TempDir tmp("ferry-trace-rank");
  struct Restore {
    std::map<std::string, std::optional<std::string>> saved;
    ~Restore() {
      for (const auto& [k, v] : saved) v.has_value() ? setenv(k.c_str(), v->c_str(), 1) : unsetenv(k.c_str());
    }
  } restore;
  for (const char* k : {"RANK", "WORLD_SIZE"}) {
    const char* v = std::getenv(k);
    restore.saved[k] = v != nullptr ? std::optional<std::string>(v) : std::nullopt;
  }
  setenv("RANK", "1", 1);
  setenv("WORLD_SIZE", "2", 1);
  absl::StatusOr<std::unique_ptr<Device>> device = CreateDevice();
  ASSERT_TRUE(device.ok()) << device.status();
  Model model(device->get(), {1000}, 3);
  {
    EngineOptions o;
    o.policy_path = Policies() + "offload_all.lua";
    o.device = std::string(BackendName((*device)->backend()));
    o.cpu_threads = 1;
    o.trace_path = tmp.path() + "/t.json";
    absl::StatusOr<std::unique_ptr<Engine>> e = Engine::Create(o);
    ASSERT_TRUE(e.ok()) << e.status();
    ASSERT_OK(model.Register(**e));
    ASSERT_OK((*e)->Finalize());
    model.SetGrads(1);
    ASSERT_OK((*e)->Step());
  }
  EXPECT_FALSE(std::filesystem::exists(tmp.path() + "/t.json"));
  absl::StatusOr<TraceFile> trace = ReadTraceFile(tmp.path() + "/t.rank-1.json");
  ASSERT_TRUE(trace.ok()) << trace.status();
  ASSERT_FALSE(trace->events.empty());
  for (const TraceFileEvent& e : trace->events) EXPECT_EQ(e.pid, 1) << e.name;
}

TEST(TraceEngineTest, StepsSaveAndLoadAreTracedWithBytesAndNesting) {
  TempDir tmp("ferry-trace-engine");
  absl::StatusOr<std::unique_ptr<Device>> device = CreateDevice();
  ASSERT_TRUE(device.ok()) << device.status();
  const std::vector<int64_t> sizes = {300000, 200000, 123457};
  Model model(device->get(), sizes, 7);
  const std::string path = tmp.path() + "/trace.json";
  constexpr int kSteps = 3;
  std::vector<double> measured_step_ms;  // each Step call's wall time, measured here
  {
    EngineOptions o;
    o.policy_path = Policies() + "offload_all.lua";
    o.device = std::string(BackendName((*device)->backend()));
    o.transfer_chunk_bytes = 64 << 10;
    o.cpu_threads = 3;
    o.trace_path = path;
    absl::StatusOr<std::unique_ptr<Engine>> created = Engine::Create(o);
    ASSERT_TRUE(created.ok()) << created.status();
    Engine& e = **created;
    ASSERT_OK(model.Register(e));
    ASSERT_OK(e.Finalize());
    for (int s = 0; s < kSteps; ++s) {
      model.SetGrads(100 + s);
      const auto t0 = std::chrono::steady_clock::now();
      ASSERT_OK(e.Step());
      measured_step_ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      ASSERT_OK(e.Synchronize());
    }
    absl::StatusOr<std::string> dir = e.SaveCheckpoint(tmp.path() + "/ckpt", kSteps);
    ASSERT_TRUE(dir.ok()) << dir.status();
    ASSERT_OK(e.WaitCheckpoint());
    ASSERT_OK(e.LoadCheckpoint(tmp.path() + "/ckpt"));
    EXPECT_FALSE(std::filesystem::exists(path)) << "written at destruction, not before";
  }
  absl::StatusOr<TraceFile> trace = ReadTraceFile(path);  // valid trace-event JSON, or this fails
  ASSERT_TRUE(trace.ok()) << trace.status();

  std::map<std::string, std::vector<const TraceFileEvent*>> by_name;
  for (const TraceFileEvent& ev : trace->events) by_name[ev.name].push_back(&ev);
  for (const char* name : {"step", "grad_stats", "cpu_pipeline", "d2h.chunk", "h2d.chunk", "cpu_adam.round",
                           "cpu_adam.thread", "wait.copies", "ckpt.save", "ckpt.stage", "ckpt.write",
                           "ckpt.write.piece", "ckpt.fsync", "ckpt.commit", "ckpt.load", "ckpt.read",
                           "ckpt.read.segment", "ckpt.apply"}) {
    EXPECT_FALSE(by_name[name].empty()) << "no '" << name << "' span";
  }
  EXPECT_EQ(by_name["step"].size(), static_cast<size_t>(kSteps));
  // Bytes: every step moves every grad down and every param up (bf16: 2 bytes each).
  const double model_bytes = 2.0 * static_cast<double>(sizes[0] + sizes[1] + sizes[2]);
  std::vector<StageSummary> stages = Summarize(*trace, {});
  std::map<std::string, StageSummary> stage;
  for (const StageSummary& s : stages) stage[s.name] = s;
  EXPECT_DOUBLE_EQ(stage["d2h.chunk"].bytes, kSteps * model_bytes);
  EXPECT_DOUBLE_EQ(stage["h2d.chunk"].bytes, kSteps * model_bytes);
  EXPECT_EQ(stage["d2h.chunk"].count, kSteps * static_cast<int64_t>((model_bytes + (64 << 10) - 1) / (64 << 10)));
  EXPECT_DOUBLE_EQ(stage["grad_stats"].bytes, kSteps * model_bytes);
  // CPU Adam: 24 B of state + 2 B grad + 2 B param per element per step, the rounds' and the
  // threads' views agreeing.
  EXPECT_DOUBLE_EQ(stage["cpu_adam.round"].bytes, kSteps * model_bytes / 2 * 28);
  EXPECT_NEAR(stage["cpu_adam.thread"].bytes, kSteps * model_bytes / 2 * 28, 1.0);
  // The save writes the params, masters and moments (14 B per element) plus the file's header; the
  // load reads them back.
  EXPECT_GT(stage["ckpt.write"].bytes, model_bytes / 2 * 14);
  EXPECT_DOUBLE_EQ(stage["ckpt.stage"].bytes, model_bytes);  // the params (device-resident) are staged
  EXPECT_DOUBLE_EQ(stage["ckpt.read"].bytes, model_bytes / 2 * 14);
  for (const auto& [name, events] : by_name) {
    for (const TraceFileEvent* ev : events) {
      if (name == "d2h.chunk" || name == "h2d.chunk" || name == "ckpt.write" || name == "ckpt.read") {
        EXPECT_GT(ev->args.at("bytes"), 0.0) << name;
        EXPECT_GT(ev->args.at("GBps"), 0.0) << name;
      }
    }
  }
  // Nesting: children inside their parents on the same thread.
  ExpectProperNesting(*trace);
  for (const TraceFileEvent* round : by_name["cpu_adam.round"]) {
    const TraceFileEvent* pipeline = Parent(*trace, *round, "cpu_pipeline");
    ASSERT_NE(pipeline, nullptr);
    EXPECT_NE(Parent(*trace, *pipeline, "step"), nullptr);
  }
  for (const TraceFileEvent* g : by_name["grad_stats"]) EXPECT_NE(Parent(*trace, *g, "step"), nullptr);
  for (const TraceFileEvent* r : by_name["ckpt.read"]) EXPECT_NE(Parent(*trace, *r, "ckpt.load"), nullptr);
  for (const TraceFileEvent* a : by_name["ckpt.apply"]) EXPECT_NE(Parent(*trace, *a, "ckpt.load"), nullptr);
  for (const TraceFileEvent* f : by_name["ckpt.fsync"]) EXPECT_NE(Parent(*trace, *f, "ckpt.write"), nullptr);
  // Thread names: the trainer and the observed streams; every thread that ran CPU Adam tasks is the
  // trainer (ParallelFor's caller) or a named worker. Which threads take a round's tasks is up to the
  // scheduler (on a loaded machine the caller may take them all), so a worker's name is checked on the
  // workers that ran.
  std::set<std::string> names;
  for (const auto& [key, name] : trace->threads) names.insert(name);
  for (const char* name : {"trainer", "d2h stream (observed)", "h2d stream (observed)"}) {
    EXPECT_TRUE(names.contains(name)) << "no thread named '" << name << "'";
  }
  for (const TraceFileEvent* ran : by_name["cpu_adam.thread"]) {
    const auto named = trace->threads.find({ran->pid, ran->tid});
    ASSERT_NE(named, trace->threads.end()) << "an unnamed thread (tid " << ran->tid << ") ran CPU Adam";
    EXPECT_TRUE(named->second == "trainer" || named->second == "cpu adam worker")
        << "CPU Adam ran on a thread named '" << named->second << "'";
    // The thread's CPU time within its span: there, non-negative, and no more than the span (a
    // thread runs no longer than the wall clock; 0.1 ms for the two clocks' reads).
    const auto cpu = ran->args.find("cpu_us");
    ASSERT_NE(cpu, ran->args.end()) << "a cpu_adam.thread span without its CPU time";
    EXPECT_GE(cpu->second, 0.0);
    EXPECT_LE(cpu->second, ran->dur_us + 100.0);
  }
  // Each step's span agrees with the wall time of its call measured here: the span lies inside the
  // call, so it is at most the measured time, and misses only the call's entry and exit (tolerance:
  // 5% or 0.5 ms, whichever is larger). A thread descheduled between the clock read and the span's
  // start (a loaded CI machine) stretches one call, so the lower bound must hold for one step at
  // least; a span that missed most of every step fails it. The summary's total is the spans' sum.
  std::vector<const TraceFileEvent*> steps = by_name["step"];
  std::sort(steps.begin(), steps.end(), [](const TraceFileEvent* a, const TraceFileEvent* b) { return a->ts_us < b->ts_us; });
  ASSERT_EQ(steps.size(), measured_step_ms.size());
  double traced_sum = 0.0;
  int close = 0;
  std::string seen;
  for (size_t i = 0; i < steps.size(); ++i) {
    const double traced = steps[i]->dur_us / 1e3, measured = measured_step_ms[i];
    traced_sum += traced;
    EXPECT_LE(traced, measured + 0.01) << "step " << i;
    close += traced >= measured - std::max(0.05 * measured, 0.5) ? 1 : 0;
    absl::StrAppend(&seen, i ? "; " : "", "step ", i, ": traced ", traced, " ms, measured ", measured, " ms");
  }
  EXPECT_GE(close, 1) << seen;
  EXPECT_NEAR(stage["step"].total_ms, traced_sum, 1e-3 * kSteps);
}

// What EngineAliveAtExitWritesItsTrace's child never destroys (volatile: the stores stay, and
// LeakSanitizer finds the objects reachable).
Engine* volatile g_engine_kept_alive = nullptr;
Device* volatile g_device_kept_alive = nullptr;
Model* volatile g_model_kept_alive = nullptr;

// An engine that outlives main (never destroyed, as one a Python object cycle keeps alive until the
// interpreter exits) still writes its trace, at exit.
TEST(TraceEngineTest, EngineAliveAtExitWritesItsTrace) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  // The same path in the death test's child (a new process) as here.
  const std::string path =
      (std::filesystem::temp_directory_path() / ("ferry-leaked-engine-trace-uid" + std::to_string(::getuid()) + ".json")).string();
  std::filesystem::remove(path);
  EXPECT_EXIT(
      {
        absl::StatusOr<std::unique_ptr<Device>> device = CreateDevice();
        if (!device.ok()) std::exit(10);
        auto* model = new Model(device->get(), {1000, 2000}, 3);
        EngineOptions o;
        o.policy_path = Policies() + "offload_all.lua";
        o.device = std::string(BackendName((*device)->backend()));
        o.trace_path = path;
        absl::StatusOr<std::unique_ptr<Engine>> e = Engine::Create(o);
        if (!e.ok() || !model->Register(**e).ok() || !(*e)->Finalize().ok()) std::exit(11);
        model->SetGrads(1);
        if (!(*e)->Step().ok() || !(*e)->Synchronize().ok()) std::exit(12);
        // Never destroyed, and held by globals so that LeakSanitizer sees them reachable at exit.
        g_engine_kept_alive = e->release();
        g_device_kept_alive = device->release();
        g_model_kept_alive = model;
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "trace written at exit");
  absl::StatusOr<TraceFile> trace = ReadTraceFile(path);
  ASSERT_TRUE(trace.ok()) << trace.status();
  int steps = 0;
  for (const TraceFileEvent& e : trace->events) steps += e.name == "step" ? 1 : 0;
  EXPECT_EQ(steps, 1);
  std::filesystem::remove(path);
}

TEST(TraceEngineTest, OffWritesNothing) {
  TempDir tmp("ferry-trace-engine-off");
  absl::StatusOr<std::unique_ptr<Device>> device = CreateDevice();
  ASSERT_TRUE(device.ok());
  Model model(device->get(), {1000, 2000}, 3);
  {
    EngineOptions o;
    o.policy_path = Policies() + "offload_all.lua";
    o.device = std::string(BackendName((*device)->backend()));
    absl::StatusOr<std::unique_ptr<Engine>> e = Engine::Create(o);
    ASSERT_TRUE(e.ok());
    ASSERT_OK(model.Register(**e));
    ASSERT_OK((*e)->Finalize());
    model.SetGrads(1);
    ASSERT_OK((*e)->Step());
    ASSERT_OK((*e)->Synchronize());
  }
  EXPECT_TRUE(std::filesystem::is_empty(tmp.path()));
}

}  // namespace
}  // namespace ferry::engine_test
