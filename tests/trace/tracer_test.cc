#include "trace/tracer.h"

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <stdexcept>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "trace/rank_arrivals.h"
#include "trace/trace_file.h"

namespace ferry {
namespace {

using Json = nlohmann::json;

void Spin(int64_t micros) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(micros);
  while (std::chrono::steady_clock::now() < until) {
  }
}

std::string TempPath(const std::string& name) {
  return (std::filesystem::temp_directory_path() / (name + "-" + std::to_string(::getpid()))).string();
}

// A path the same in a death test's child as in its parent (the "threadsafe" style re-runs the test
// in a new process: TempPath's pid would differ).
std::string SharedTempPath(const std::string& name) {
  return (std::filesystem::temp_directory_path() / (name + "-uid" + std::to_string(::getuid()))).string();
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A tracer its owner never destroys (outliving main, as one held by a leaked object or by a Python
// interpreter's shutdown) is written when the process exits.
TEST(TracerExitTest, LiveTracerIsWrittenWhenTheProcessExits) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const std::string path = SharedTempPath("ferry-exit-trace.json");
  std::filesystem::remove(path);
  EXPECT_EXIT(
      {
        auto* leaked = new Tracer(TracerOptions{.path = path});
        leaked->Complete("leaked.span", "test", 0, 1000);
        std::exit(3);
      },
      ::testing::ExitedWithCode(3), "trace written at exit: .*ferry-exit-trace");
  const std::string json = ReadAll(path);
  EXPECT_NE(json.find("leaked.span"), std::string::npos) << json;
  EXPECT_FALSE(Json::parse(json, nullptr, /*allow_exceptions=*/false).is_discarded());
  std::filesystem::remove(path);
}

// An uncaught exception (std::terminate) still writes the trace, then the handler installed before
// runs (the default one aborts).
TEST(TracerExitTest, LiveTracerIsWrittenWhenAnExceptionTerminatesTheProcess) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const std::string path = SharedTempPath("ferry-terminate-trace.json");
  std::filesystem::remove(path);
  EXPECT_DEATH(
      {
        auto* leaked = new Tracer(TracerOptions{.path = path});
        leaked->Complete("before.throw", "test", 0, 1000);
        std::thread([] { throw std::runtime_error("uncaught"); }).join();
      },
      "trace written at terminate: .*ferry-terminate-trace");
  const std::string json = ReadAll(path);
  EXPECT_NE(json.find("before.throw"), std::string::npos) << json;
  std::filesystem::remove(path);
}

// Destroyed tracers are not flushed at exit (their owner decided), and flush_at_exit = false opts out.
TEST(TracerExitTest, DestroyedOrOptedOutTracersAreNotWrittenAtExit) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const std::string destroyed = SharedTempPath("ferry-destroyed-trace.json");
  const std::string opted_out = SharedTempPath("ferry-opted-out-trace.json");
  std::filesystem::remove(destroyed);
  std::filesystem::remove(opted_out);
  EXPECT_EXIT(
      {
        {
          Tracer gone(TracerOptions{.path = destroyed});
          gone.Complete("x", "test", 0, 1);
        }
        auto* leaked = new Tracer(TracerOptions{.path = opted_out, .flush_at_exit = false});
        leaked->Complete("y", "test", 0, 1);
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "");
  EXPECT_FALSE(std::filesystem::exists(destroyed));
  EXPECT_FALSE(std::filesystem::exists(opted_out));
}

TEST(TracerTest, OffRecordsNothingAndCostsNoClock) {
  // A null tracer: the span is inert (no tracer to call; this must simply not crash).
  TraceSpan span(nullptr, "step", "engine");
  span.Arg("bytes", 1.0);
  span.Detail("x");
  EXPECT_FALSE(span.on());
  span.End();
}

TEST(TracerTest, SpansNestOnTheirThreadWithArgsAndNames) {
  Tracer tracer(TracerOptions{.path = "", .pid = 3, .process_name = "test"});
  tracer.NameThread("trainer");
  {
    TraceSpan outer(&tracer, "outer", "test");
    Spin(200);
    {
      TraceSpan inner(&tracer, "inner", "test");
      inner.Arg("bytes", 1e6);
      inner.Detail("file \"a\"\n");
      Spin(300);
    }
    Spin(100);
  }
  std::thread worker([&] {
    tracer.NameThread("worker");
    TraceSpan w(&tracer, "work", "test");
    Spin(100);
  });
  worker.join();
  const int lane = tracer.Lane("d2h stream (observed)");
  EXPECT_EQ(lane, tracer.Lane("d2h stream (observed)"));
  const int64_t t0 = tracer.NowNs();
  tracer.Complete("d2h.chunk", "transfer", t0, t0 + 5000, {{"bytes", 5000.0}}, {}, lane);
  EXPECT_EQ(tracer.num_events(), 4u);

  const std::string text = tracer.ToJson();
  const Json doc = Json::parse(text);  // throws (fails the test) on invalid JSON
  ASSERT_TRUE(doc.contains("traceEvents"));
  std::map<std::string, Json> by_name;
  std::map<int, std::string> thread_names;
  for (const Json& e : doc["traceEvents"]) {
    ASSERT_TRUE(e.contains("ph"));
    ASSERT_EQ(e["pid"].get<int>(), 3);
    if (e["ph"] == "M" && e["name"] == "thread_name") thread_names[e["tid"].get<int>()] = e["args"]["name"];
    if (e["ph"] == "X") {
      ASSERT_TRUE(e["ts"].is_number());
      ASSERT_TRUE(e["dur"].is_number());
      by_name[e["name"].get<std::string>()] = e;
    }
  }
  ASSERT_EQ(by_name.size(), 4u);
  const Json& outer = by_name["outer"];
  const Json& inner = by_name["inner"];
  EXPECT_EQ(outer["tid"], inner["tid"]);
  EXPECT_EQ(thread_names[outer["tid"].get<int>()], "trainer");
  EXPECT_EQ(thread_names[by_name["work"]["tid"].get<int>()], "worker");
  EXPECT_EQ(thread_names[by_name["d2h.chunk"]["tid"].get<int>()], "d2h stream (observed)");
  EXPECT_NE(by_name["work"]["tid"], outer["tid"]);
  // Nesting: the child lies inside its parent.
  const double ob = outer["ts"], oe = ob + outer["dur"].get<double>();
  const double ib = inner["ts"], ie = ib + inner["dur"].get<double>();
  EXPECT_LE(ob, ib);
  EXPECT_LE(ie, oe);
  EXPECT_GE(outer["dur"].get<double>(), 600.0);
  EXPECT_GE(inner["dur"].get<double>(), 300.0);
  // bytes get GB/s; the text argument survives escaping.
  EXPECT_DOUBLE_EQ(inner["args"]["bytes"].get<double>(), 1e6);
  EXPECT_NEAR(inner["args"]["GBps"].get<double>(), 1e6 / (inner["dur"].get<double>() * 1e3), 1e-6);
  EXPECT_EQ(inner["args"]["detail"], "file \"a\"\n");
  EXPECT_NEAR(by_name["d2h.chunk"]["args"]["GBps"].get<double>(), 1.0, 1e-9);  // 5000 B in 5 us
}

TEST(TracerTest, ManyThreadsMergeAndCapDrops) {
  Tracer tracer(TracerOptions{.path = "", .pid = 0, .process_name = "t", .max_events = 1000});
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 200; ++i) TraceSpan s(&tracer, "x", "test");
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(tracer.num_events(), 1000u);
  EXPECT_EQ(tracer.dropped(), 600u);
  std::set<int> tids;
  for (const TraceEvent& e : tracer.Events()) tids.insert(e.tid);
  EXPECT_GE(tids.size(), 5u);  // the threads that got in before the cap (1000 / 200)
  EXPECT_LE(tids.size(), 8u);
  const Json doc = Json::parse(tracer.ToJson());
  EXPECT_EQ(doc["otherData"]["dropped_events"].get<int>(), 600);
}

TEST(TracerTest, FlushWritesAtomicallyAndTheFileReadsBack) {
  const std::string path = TempPath("ferry-trace-test") + ".json";
  {
    Tracer tracer(TracerOptions{.path = path, .pid = 0});
    tracer.NameThread("trainer");
    {
      TraceSpan step(&tracer, "step", "engine");
      TraceSpan d(&tracer, "cpu_adam.round", "optim");
      d.Arg("bytes", 4e6);
      Spin(200);
    }
    ASSERT_TRUE(tracer.Flush().ok());
  }
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  absl::StatusOr<TraceFile> trace = ReadTraceFile(path);
  ASSERT_TRUE(trace.ok()) << trace.status();
  ASSERT_EQ(trace->events.size(), 2u);
  std::vector<StageSummary> stages = Summarize(*trace, {{"mem", 10.0}});
  ASSERT_EQ(stages.size(), 2u);
  EXPECT_EQ(stages[0].name, "step");
  EXPECT_EQ(stages[1].name, "cpu_adam.round");
  EXPECT_EQ(stages[1].ceiling_key, "mem");
  ASSERT_TRUE(stages[1].ceiling_gbps.has_value());
  EXPECT_NEAR(stages[1].gbps, 4e6 / (stages[1].wall_ms * 1e6), 1e-6);
  const std::string table = FormatSummary(stages);
  EXPECT_NE(table.find("cpu_adam.round"), std::string::npos);
  EXPECT_NE(table.find("(mem 10.0)"), std::string::npos);
  const std::string svg = RenderSvg(*trace, SvgOptions{});
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("trainer"), std::string::npos);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  std::filesystem::remove(path);
  // An unwritable path is an error naming it.
  Tracer bad(TracerOptions{.path = "/nonexistent-dir/x.json"});
  absl::Status s = bad.Flush();
  EXPECT_FALSE(s.ok());
  EXPECT_NE(std::string(s.message()).find("/nonexistent-dir/x.json"), std::string::npos);
}

TEST(TraceFileTest, SummaryWallTimeIsTheUnionAndMalformedInputIsRefused) {
  const std::string json = R"({"traceEvents":[
    {"ph":"M","name":"thread_name","pid":0,"tid":1,"args":{"name":"a"}},
    {"ph":"X","name":"cpu_adam.thread","pid":0,"tid":1,"ts":0,"dur":100,"args":{"bytes":1000}},
    {"ph":"X","name":"cpu_adam.thread","pid":0,"tid":2,"ts":50,"dur":100,"args":{"bytes":1000}},
    {"ph":"X","name":"cpu_adam.thread","pid":0,"tid":2,"ts":300,"dur":50}]})";
  absl::StatusOr<TraceFile> t = ParseTrace(json);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->threads.at({0, 1}), "a");
  std::vector<StageSummary> s = Summarize(*t, {});
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].count, 3);
  EXPECT_DOUBLE_EQ(s[0].total_ms, 0.25);
  EXPECT_DOUBLE_EQ(s[0].wall_ms, 0.2);  // [0,150) and [300,350)
  EXPECT_DOUBLE_EQ(s[0].gbps, 2000.0 / 200e3);
  EXPECT_DOUBLE_EQ(s[0].cpu_span_ms, 0.0);  // no event carries its CPU time
  EXPECT_EQ(FormatSummary(s).find("ran on a CPU"), std::string::npos);
  EXPECT_FALSE(ParseTrace("{").ok());
  EXPECT_FALSE(ParseTrace(R"({"traceEvents":[{"ph":"X","name":"a","ts":1}]})").ok());
  absl::StatusOr<std::pair<double, double>> w = EventWindow(*t, "cpu_adam.thread", 2);
  ASSERT_TRUE(w.ok());
  EXPECT_DOUBLE_EQ(w->first, 300.0);
  EXPECT_FALSE(EventWindow(*t, "step", 0).ok());
}

TEST(TraceFileTest, SummaryAddsTheThreadsCpuTimeOfTheEventsThatCarryIt) {
  // Two spans carry their thread's CPU time (60 of 100 us, 90 of 200 us), one does not (left out of
  // both sums): the threads ran 150 of their 300 us.
  const std::string json = R"({"traceEvents":[
    {"ph":"X","name":"cpu_adam.thread","pid":0,"tid":1,"ts":0,"dur":100,"args":{"bytes":10,"cpu_us":60}},
    {"ph":"X","name":"cpu_adam.thread","pid":1,"tid":1,"ts":0,"dur":200,"args":{"cpu_us":90}},
    {"ph":"X","name":"cpu_adam.thread","pid":0,"tid":2,"ts":0,"dur":400},
    {"ph":"X","name":"step","pid":0,"tid":1,"ts":0,"dur":500}]})";
  absl::StatusOr<TraceFile> t = ParseTrace(json);
  ASSERT_TRUE(t.ok()) << t.status();
  std::vector<StageSummary> s = Summarize(*t, {});
  ASSERT_EQ(s.size(), 2u);
  EXPECT_DOUBLE_EQ(s[0].cpu_ms, 0.15);
  EXPECT_DOUBLE_EQ(s[0].cpu_span_ms, 0.3);
  EXPECT_DOUBLE_EQ(s[1].cpu_span_ms, 0.0);
  const std::string table = FormatSummary(s);
  EXPECT_NE(table.find("cpu_adam.thread: its threads ran on a CPU 50.0% of their spans (0.150 of 0.300 ms"),
            std::string::npos)
      << table;
  EXPECT_EQ(table.find("step: its threads"), std::string::npos) << table;
}

TEST(TraceFileTest, IterationsRunFromStepEndToStepEndPerRank) {
  // Times in ms (the file's us / 1000). Rank 0: steps ending at 100, 300 and 600: two iterations,
  // [100, 300) and [300, 600). Its CPU Adam is its workers' spans: [110, 150) (30 ms on a CPU),
  // [140, 180) (no CPU time), [260, 340) (20 ms on a CPU: 40 in each iteration) and [450, 490) (10
  // ms), so 70 + 40 = 110 in the first and 40 + 40 = 80 in the second; its rounds ([50, 150),
  // [120, 200), [250, 400), [450, 500): 150 in each) last until the early thread finishes them and
  // are not counted where workers' spans exist. A wait for grads [200, 260), for copies [170, 200),
  // the trainer's waits for params [310, 330) and [320, 340). Announcements (grads_ready) at 150 (no
  // wait for params in that iteration: no host forward), 305 (before the second iteration's first
  // wait for params) and 400: the second iteration's host forward is [310, 400). Rank 1: one step,
  // so no iteration.
  // Rank 2: steps ending at 100 and 300 and rounds [50, 150) and [200, 250), no worker's span: its
  // CPU Adam is its rounds', 100 of 200.
  const std::string json = R"({"traceEvents":[
    {"ph":"X","name":"step","pid":0,"tid":1,"ts":0,"dur":100000},
    {"ph":"X","name":"step","pid":0,"tid":1,"ts":250000,"dur":50000},
    {"ph":"X","name":"step","pid":0,"tid":1,"ts":580000,"dur":20000},
    {"ph":"X","name":"cpu_adam.round","pid":0,"tid":2,"ts":50000,"dur":100000},
    {"ph":"X","name":"cpu_adam.round","pid":0,"tid":2,"ts":120000,"dur":80000},
    {"ph":"X","name":"cpu_adam.round","pid":0,"tid":2,"ts":250000,"dur":150000},
    {"ph":"X","name":"cpu_adam.round","pid":0,"tid":2,"ts":450000,"dur":50000},
    {"ph":"X","name":"wait.grads","pid":0,"tid":2,"ts":200000,"dur":60000},
    {"ph":"X","name":"wait.copies","pid":0,"tid":2,"ts":170000,"dur":30000},
    {"ph":"X","name":"wait.upload","pid":0,"tid":1,"ts":310000,"dur":20000},
    {"ph":"X","name":"wait.upload","pid":0,"tid":1,"ts":320000,"dur":20000},
    {"ph":"X","name":"grads_ready","pid":0,"tid":5,"ts":150000,"dur":100},
    {"ph":"X","name":"grads_ready","pid":0,"tid":5,"ts":305000,"dur":100},
    {"ph":"X","name":"grads_ready","pid":0,"tid":5,"ts":400000,"dur":100},
    {"ph":"X","name":"grads_ready","pid":0,"tid":5,"ts":450000,"dur":100},
    {"ph":"X","name":"cpu_adam.thread","pid":0,"tid":3,"ts":110000,"dur":40000,"args":{"cpu_us":30000}},
    {"ph":"X","name":"cpu_adam.thread","pid":0,"tid":4,"ts":140000,"dur":40000},
    {"ph":"X","name":"cpu_adam.thread","pid":0,"tid":3,"ts":260000,"dur":80000,"args":{"cpu_us":20000}},
    {"ph":"X","name":"cpu_adam.thread","pid":0,"tid":3,"ts":450000,"dur":40000,"args":{"cpu_us":10000}},
    {"ph":"X","name":"step","pid":1,"tid":1,"ts":0,"dur":100000},
    {"ph":"X","name":"cpu_adam.round","pid":1,"tid":2,"ts":0,"dur":100000},
    {"ph":"X","name":"step","pid":2,"tid":1,"ts":0,"dur":100000},
    {"ph":"X","name":"step","pid":2,"tid":1,"ts":280000,"dur":20000},
    {"ph":"X","name":"cpu_adam.round","pid":2,"tid":2,"ts":50000,"dur":100000},
    {"ph":"X","name":"cpu_adam.round","pid":2,"tid":2,"ts":200000,"dur":50000}]})";
  absl::StatusOr<TraceFile> t = ParseTrace(json);
  ASSERT_TRUE(t.ok()) << t.status();
  const std::vector<IterationSummary> its = Iterations(*t);
  ASSERT_EQ(its.size(), 3u);
  EXPECT_EQ(its[0].pid, 0);
  EXPECT_EQ(its[0].step, 1u);
  EXPECT_DOUBLE_EQ(its[0].iteration_ms, 200.0);
  EXPECT_DOUBLE_EQ(its[0].cpu_adam_ms, 110.0);  // the workers' [110, 180) and [260, 300)
  EXPECT_DOUBLE_EQ(its[0].idle_ms, 90.0);
  EXPECT_DOUBLE_EQ(its[0].wait_grads_ms, 60.0);
  EXPECT_DOUBLE_EQ(its[0].wait_copies_ms, 30.0);
  EXPECT_DOUBLE_EQ(its[0].wait_upload_ms, 0.0);
  EXPECT_DOUBLE_EQ(its[0].on_cpu, 50.0 / 120.0);  // the span without its CPU time is left out
  EXPECT_DOUBLE_EQ(its[0].host_forward_ms, -1.0);
  EXPECT_EQ(its[1].step, 2u);
  EXPECT_DOUBLE_EQ(its[1].iteration_ms, 300.0);
  EXPECT_DOUBLE_EQ(its[1].cpu_adam_ms, 80.0);  // [300, 340) and [450, 490)
  EXPECT_DOUBLE_EQ(its[1].idle_ms, 220.0);
  EXPECT_DOUBLE_EQ(its[1].wait_copies_ms, 0.0);
  EXPECT_DOUBLE_EQ(its[1].wait_upload_ms, 30.0);  // [310, 340)
  EXPECT_DOUBLE_EQ(its[1].on_cpu, 0.25);
  EXPECT_DOUBLE_EQ(its[1].host_forward_ms, 90.0);
  EXPECT_EQ(its[2].pid, 2);
  EXPECT_DOUBLE_EQ(its[2].iteration_ms, 200.0);
  EXPECT_DOUBLE_EQ(its[2].cpu_adam_ms, 100.0);  // no worker's span: the rounds' [100, 150) and [200, 250)
  EXPECT_DOUBLE_EQ(its[2].on_cpu, -1.0);
  const std::string table = FormatIterations(its);
  EXPECT_NE(table.find("wait.copies"), std::string::npos) << table;
  // Rank 0's means.
  EXPECT_NE(table.find("host forward"), std::string::npos) << table;
  EXPECT_NE(table.find("0        mean     250.0 ms      95.0 ms     155.0 ms      30.0 ms      15.0 ms      15.0 ms"
                       "       90.0 ms            33.3%"),
            std::string::npos)
      << table;
  EXPECT_NE(table.find("2        mean     200.0 ms     100.0 ms     100.0 ms       0.0 ms       0.0 ms       0.0 ms"
                       "             -                -"),
            std::string::npos)
      << table;
  EXPECT_EQ(FormatIterations({}), "");
  // More iterations than rows: the table says how many it left out, the mean covers them all.
  const std::string cut = FormatIterations(its, 1);
  EXPECT_NE(cut.find("(1 more)"), std::string::npos) << cut;
}

TEST(TraceFileTest, MergeTracesKeepsEachRanksTimelineAndRefusesARankTwice) {
  absl::StatusOr<TraceFile> r0 = ParseTrace(R"({"traceEvents":[
    {"ph":"M","name":"thread_name","pid":0,"tid":1,"args":{"name":"trainer"}},
    {"ph":"X","name":"step","pid":0,"tid":1,"ts":0,"dur":10}]})");
  absl::StatusOr<TraceFile> r1 = ParseTrace(R"({"traceEvents":[
    {"ph":"M","name":"thread_name","pid":1,"tid":1,"args":{"name":"trainer"}},
    {"ph":"X","name":"step","pid":1,"tid":1,"ts":5,"dur":10},
    {"ph":"X","name":"step","pid":1,"tid":1,"ts":20,"dur":10}]})");
  ASSERT_TRUE(r0.ok() && r1.ok());
  absl::StatusOr<TraceFile> both = MergeTraces({{"a.rank-0.json", *r0}, {"a.rank-1.json", *r1}});
  ASSERT_TRUE(both.ok()) << both.status();
  EXPECT_EQ(both->events.size(), 3u);
  EXPECT_EQ(both->threads.size(), 2u);
  EXPECT_EQ(both->threads.at({1, 1}), "trainer");
  // The step stage's wall time is the union per rank: 10 us of rank 0 and 20 of rank 1, not the
  // union of the overlapping spans of different ranks.
  const std::vector<StageSummary> stages = Summarize(*both, {});
  ASSERT_EQ(stages.size(), 1u);
  EXPECT_DOUBLE_EQ(stages[0].wall_ms, 0.03);
  EXPECT_EQ(Iterations(*both).size(), 1u);  // rank 1's one iteration; rank 0 has one step
  absl::StatusOr<TraceFile> twice = MergeTraces({{"a.rank-1.json", *r1}, {"b.rank-1.json", *r1}});
  ASSERT_FALSE(twice.ok());
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(twice.status().message()).find("a.rank-1.json and b.rank-1.json both hold spans of rank 1"),
            std::string::npos)
      << twice.status();
}

// Files of one host are put on one clock (the earliest file's origin); another host's, or a file that
// does not say where its ts 0 lies, keep their own.
TEST(TraceFileTest, MergeTracesPutsOneHostsFilesOnOneClock) {
  auto rank = [](int pid, const char* other) {
    absl::StatusOr<TraceFile> t = ParseTrace(absl::StrCat(R"({"otherData":)", other, R"(,"traceEvents":[
      {"ph":"X","name":"step","pid":)", pid, R"(,"tid":1,"ts":100,"dur":10}]})"));
    EXPECT_TRUE(t.ok()) << t.status();
    return *t;
  };
  const TraceFile r0 = rank(0, R"({"steady_epoch_us":5000.5,"host":"a"})");
  const TraceFile r1 = rank(1, R"({"steady_epoch_us":4000.25,"host":"a"})");
  const TraceFile r2 = rank(2, R"({"steady_epoch_us":10,"host":"b"})");
  const TraceFile r3 = rank(3, R"({"producer":"ferry"})");
  EXPECT_DOUBLE_EQ(r0.steady_epoch_us, 5000.5);
  EXPECT_EQ(r0.host, "a");
  EXPECT_LT(r3.steady_epoch_us, 0);
  absl::StatusOr<TraceFile> one = MergeTraces({{"t.rank-0.json", r0}, {"t.rank-1.json", r1}});
  ASSERT_TRUE(one.ok()) << one.status();
  std::map<int, double> ts;
  for (const TraceFileEvent& e : one->events) ts[e.pid] = e.ts_us;
  EXPECT_DOUBLE_EQ(ts[1], 100.0) << "the earliest file's clock";
  EXPECT_DOUBLE_EQ(ts[0], 100.0 + 1000.25) << "rank 0 started 1000.25 us later";
  EXPECT_DOUBLE_EQ(one->steady_epoch_us, 4000.25);
  absl::StatusOr<TraceFile> mixed =
      MergeTraces({{"t.rank-0.json", r0}, {"t.rank-1.json", r1}, {"t.rank-2.json", r2}, {"t.rank-3.json", r3}});
  ASSERT_TRUE(mixed.ok()) << mixed.status();
  ts.clear();
  for (const TraceFileEvent& e : mixed->events) ts[e.pid] = e.ts_us;
  EXPECT_DOUBLE_EQ(ts[0], 1100.25);
  EXPECT_DOUBLE_EQ(ts[2], 100.0) << "another host's clock is its own";
  EXPECT_DOUBLE_EQ(ts[3], 100.0) << "a file without its origin is left as it is";
  EXPECT_LT(mixed->steady_epoch_us, 0) << "not every file is on one clock";
}

void ExpectArrival(const RankArrival& a, size_t step, int last, double spread_ms) {
  EXPECT_EQ(a.step, step);
  EXPECT_EQ(a.last, last) << "step " << step;
  EXPECT_DOUBLE_EQ(a.spread_ms, spread_ms) << "step " << step;
}

// Per step index every rank has: the spread of the ranks' step starts and the rank that came last.
TEST(TraceFileTest, RankArrivalsNameTheLastRankOfEachStep) {
  TraceFile t;
  auto step = [&](int pid, double ts) { t.events.push_back(TraceFileEvent{.name = "step", .pid = pid, .ts_us = ts}); };
  step(0, 1000), step(1, 1500), step(2, 1200);  // step 0: rank 1 last, 0.5 ms
  step(0, 9000), step(1, 5000), step(2, 6000);  // step 1: rank 0 last, 4 ms (given out of order)
  step(2, 20000);                               // rank 2's third: no other rank has one
  const std::vector<RankArrival> a = RankArrivals(t);
  ASSERT_EQ(a.size(), 2u);
  ExpectArrival(a[0], 0, 1, 0.5);
  ExpectArrival(a[1], 1, 0, 4.0);
  EXPECT_EQ(FormatRankArrivals(t), "") << "not on one clock";
  t.steady_epoch_us = 0;
  EXPECT_EQ(FormatRankArrivals(t),
            "ranks reaching their step (one clock): the last 4.0 ms after the first at the median of 2 steps, 4.0 ms at "
            "most (step 1, rank 0 last); last: rank 0 1 time, rank 1 1 time\n"
            "  (the hosts' arrival: a host far ahead of its GPU comes early; which rank each collective waited\n"
            "  for on the GPUs: ferry trace of the ranks' torch.profiler traces)\n");
  TraceFile one;
  one.steady_epoch_us = 0;
  one.events.push_back(TraceFileEvent{.name = "step", .pid = 0, .ts_us = 0});
  EXPECT_TRUE(RankArrivals(one).empty()) << "one rank";
}

// Per step every rank has: the end of each rank's last early.part_done of that step (its `step` arg),
// the spread and the rank whose update ended last.
TEST(TraceFileTest, UpdateEndsNameTheRankWhoseUpdateEndsLast) {
  TraceFile t;
  auto part = [&](int pid, double ts, double dur, double step) {
    TraceFileEvent e{.name = "early.part_done", .pid = pid, .ts_us = ts, .dur_us = dur};
    e.args["part"] = 0;
    e.args["step"] = step;
    t.events.push_back(e);
  };
  part(0, 1000, 10, 4), part(0, 3000, 20, 4), part(1, 2000, 5, 4);  // step 4: rank 0 last (3020 against 2005 us)
  part(1, 9500, 0, 5), part(0, 7000, 0, 5);                         // step 5: rank 1 last by 2.5 ms
  part(0, 12000, 0, 6);                                              // step 6: rank 0's only, left out
  t.events.push_back(TraceFileEvent{.name = "early.part_done", .pid = 1, .ts_us = 50000});  // no step: left out
  const std::vector<RankArrival> u = UpdateEnds(t);
  ASSERT_EQ(u.size(), 2u);
  ExpectArrival(u[0], 4, 0, 1.015);
  ExpectArrival(u[1], 5, 1, 2.5);
  EXPECT_EQ(FormatRankArrivals(t), "") << "not on one clock";
  t.steady_epoch_us = 0;
  EXPECT_EQ(FormatRankArrivals(t),
            "ranks ending their update of a step (its last part's upload enqueued): the last 2.5 ms after the first at "
            "the median of 2 steps, 2.5 ms at most (step 5, rank 1 last); last: rank 0 1 time, rank 1 1 time\n"
            "  (under ZeRO-1 and FSDP2 the next forward needs every rank's part of a layer: it runs at the\n"
            "  pace of the rank whose update ends last)\n")
      << "no step spans: the update ends alone";
  TraceFile one;
  one.events.push_back(t.events.front());
  EXPECT_TRUE(UpdateEnds(one).empty()) << "one rank";
}

// Two tracers started apart (two ranks' engines) mark one moment: merged, the two spans line up.
TEST(TraceFileTest, TwoTracersLineUpOnTheHostsClock) {
  Tracer first(TracerOptions{.path = "", .pid = 0, .process_name = "rank 0"});
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  Tracer second(TracerOptions{.path = "", .pid = 1, .process_name = "rank 1"});
  const int64_t moment = SteadyNs();
  first.Complete("mark", "test", first.FromSteadyNs(moment), first.FromSteadyNs(moment) + 1000);
  second.Complete("mark", "test", second.FromSteadyNs(moment), second.FromSteadyNs(moment) + 1000);
  absl::StatusOr<TraceFile> a = ParseTrace(first.ToJson()), b = ParseTrace(second.ToJson());
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_GE(a->steady_epoch_us, 0);
  EXPECT_EQ(a->host, b->host);
  ASSERT_EQ(a->events.size(), 1u);
  ASSERT_EQ(b->events.size(), 1u);
  EXPECT_GT(a->events[0].ts_us - b->events[0].ts_us, 4000.0) << "each file counts from its own start";
  absl::StatusOr<TraceFile> both = MergeTraces({{"t.rank-0.json", *a}, {"t.rank-1.json", *b}});
  ASSERT_TRUE(both.ok()) << both.status();
  ASSERT_EQ(both->events.size(), 2u);
  EXPECT_NEAR(both->events[0].ts_us, both->events[1].ts_us, 0.01) << "one moment, one time";
}

TEST(TracerTest, ThreadCpuTimeCountsRunningNotSleeping) {
  const int64_t cpu0 = ThreadCpuNs(), wall0 = SteadyNs();
  Spin(20'000);  // 20 ms of running
  const int64_t spun_cpu = ThreadCpuNs() - cpu0, spun_wall = SteadyNs() - wall0;
  EXPECT_GT(spun_cpu, 0);
  EXPECT_LE(spun_cpu, spun_wall + 1'000'000);  // a thread runs no longer than the wall clock (1 ms of clock skew)
  const int64_t cpu1 = ThreadCpuNs();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_LT(ThreadCpuNs() - cpu1, 25'000'000);  // 50 ms asleep are not 25 ms of CPU
}

TEST(TracerTest, RankPaths) {
  EXPECT_EQ(RankTracePath("t.json", 0, 1), "t.json");
  EXPECT_EQ(RankTracePath("dir.x/t.json", 2, 4), "dir.x/t.rank-2.json");
  EXPECT_EQ(RankTracePath("dir.x/trace", 1, 2), "dir.x/trace.rank-1");
}

}  // namespace
}  // namespace ferry
