// `ferry trace`: the summary of Ferry's traces (stages, iterations, ranks on one clock, the SVG) and of
// torch.profiler's traces of the ranks, their exit statuses and errors (the verb called as a function
// with memory streams).
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bindings/command_capture.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "lua/commands.h"

namespace ferry::cli {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

Result Trace(const std::vector<std::string>& args) { return RunVerb(TraceCommand, args); }

// Two steps of a trainer thread, with a copy lane: what an engine writes, by hand.
constexpr char kTrace[] = R"json({"traceEvents":[
{"ph":"M","name":"thread_name","pid":0,"tid":1,"args":{"name":"trainer"}},
{"ph":"M","name":"thread_name","pid":0,"tid":2,"args":{"name":"d2h stream (observed)"}},
{"ph":"X","name":"step","cat":"engine","pid":0,"tid":1,"ts":1000,"dur":2000,"args":{}},
{"ph":"X","name":"cpu_adam.round","cat":"optim","pid":0,"tid":1,"ts":1500,"dur":1000,"args":{"bytes":28000000}},
{"ph":"X","name":"d2h.chunk","cat":"transfer","pid":0,"tid":2,"ts":1100,"dur":400,"args":{"bytes":8000000}},
{"ph":"X","name":"step","cat":"engine","pid":0,"tid":1,"ts":5000,"dur":3000,"args":{}},
{"ph":"X","name":"d2h.chunk","cat":"transfer","pid":0,"tid":2,"ts":5100,"dur":400,"args":{"bytes":8000000}}
]})json";

TEST(TraceCommandTest, SummaryPerStageBesideGivenCeilingsAndTheSvgOfOneStep) {
  TempDir tmp;
  const std::string file = tmp.Write("t.json", kTrace);
  const std::string svg = tmp.path() + "/step.svg";
  Result r = Trace({file, "--ceiling", "d2h=40,mem=56", "--measure=off", "--svg", svg, "--step", "0"});
  ASSERT_EQ(r.status, 0) << r.err;
  // step: 2 events, 5 ms in all; d2h: 16 MB in 0.8 ms = 20 GB/s, half of 40.
  EXPECT_THAT(Row(r.out, "step "), ElementsAre("step", "2", "5.000", "5.000", "-", "-", "-"));
  EXPECT_THAT(Row(r.out, "d2h.chunk"), ElementsAre("d2h.chunk", "2", "0.800", "0.800", "1.6e+07", "20.00", "0.50",
                                                   "(d2h", "40.0)"));
  EXPECT_THAT(Row(r.out, "cpu_adam.round"), ElementsAre("cpu_adam.round", "1", "1.000", "1.000", "2.8e+07", "28.00",
                                                        "0.50", "(mem", "56.0)"));
  EXPECT_THAT(r.out, HasSubstr("  d2h      40.00  given"));
  EXPECT_THAT(r.out, HasSubstr("step: 2 steps, 2.500 ms each on average"));
  // One iteration, from the end of step 0 (3 ms) to the end of step 1 (8 ms); the only round ran
  // before it, so CPU Adam ran none of it.
  EXPECT_THAT(r.out, HasSubstr("iterations (from the end of one step to the end of the next, per rank)"));
  EXPECT_THAT(r.out, HasSubstr("0           1       5.0 ms       0.0 ms       5.0 ms       0.0 ms       0.0 ms"));
  std::ifstream in(svg);
  std::stringstream text;
  text << in.rdbuf();
  const std::string picture = text.str();
  EXPECT_EQ(picture.rfind("<svg", 0), 0u);
  EXPECT_THAT(picture, HasSubstr("</svg>"));
  EXPECT_THAT(picture, HasSubstr("trainer"));
  EXPECT_THAT(picture, HasSubstr("d2h stream (observed)"));
  EXPECT_THAT(picture, HasSubstr("step 0 of"));
  EXPECT_THAT(picture, HasSubstr("<title>cpu_adam.round: 1 ms"));
  // Step 0's window: the second step's chunk (at 5.1 ms) is not drawn.
  EXPECT_THAT(picture, Not(HasSubstr("ts=5100")));
  size_t boxes = 0;
  for (size_t at = picture.find("<title>"); at != std::string::npos; at = picture.find("<title>", at + 1)) ++boxes;
  EXPECT_EQ(boxes, 3u);  // step 0, its round, its chunk
}

TEST(TraceCommandTest, SeveralFilesAreOneRankEach) {
  TempDir tmp;
  // kTrace as rank 0, and a rank 1 whose iteration is 6 ms, CPU Adam running 4 of them.
  const std::string rank1 = R"json({"traceEvents":[
{"ph":"X","name":"step","cat":"engine","pid":1,"tid":1,"ts":1000,"dur":1000,"args":{}},
{"ph":"X","name":"cpu_adam.round","cat":"optim","pid":1,"tid":1,"ts":3000,"dur":4000,"args":{"bytes":1000}},
{"ph":"X","name":"step","cat":"engine","pid":1,"tid":1,"ts":7000,"dur":1000,"args":{}}
]})json";
  const std::string a = tmp.Write("t.rank-0.json", kTrace), b = tmp.Write("t.rank-1.json", rank1);
  Result r = Trace({a, b, "--measure=off"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("and 1 more (one rank each)"));
  EXPECT_THAT(Row(r.out, "step "), ElementsAre("step", "4", "7.000", "7.000", "-", "-", "-"));
  EXPECT_THAT(r.out, HasSubstr("0           1       5.0 ms       0.0 ms       5.0 ms"));
  EXPECT_THAT(r.out, HasSubstr("1           1       6.0 ms       4.0 ms       2.0 ms"));
  // The same rank twice is refused, naming both files.
  Result twice = Trace({a, tmp.Write("u.json", kTrace), "--measure=off"});
  EXPECT_EQ(twice.status, 2);
  EXPECT_THAT(twice.err, HasSubstr("both hold spans of rank 0"));
  EXPECT_THAT(twice.err, HasSubstr("u.json"));
}

// Files of one host that say where their time 0 lies are put on one clock: rank 0 started 2 ms after
// rank 1, so its steps move 2 ms later, and --step's window is its step on that clock.
TEST(TraceCommandTest, OneHostsRanksAreOnOneClock) {
  TempDir tmp;
  std::string rank0 = kTrace;
  rank0.replace(rank0.find("{\"traceEvents\""), 1, R"({"otherData":{"steady_epoch_us":12000,"host":"h"},)");
  const std::string rank1 = R"json({"otherData":{"steady_epoch_us":10000,"host":"h"},"traceEvents":[
{"ph":"X","name":"step","cat":"engine","pid":1,"tid":1,"ts":3000,"dur":1000,"args":{}},
{"ph":"X","name":"step","cat":"engine","pid":1,"tid":1,"ts":9000,"dur":1000,"args":{}}
]})json";
  const std::string a = tmp.Write("t.rank-0.json", rank0), b = tmp.Write("t.rank-1.json", rank1);
  const std::string svg = tmp.path() + "/step.svg";
  Result r = Trace({a, b, "--measure=off", "--svg", svg, "--step", "0"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("the files' spans on one clock (host h's steady clock, from the first to start)"));
  // Step 0: both at 3 ms; step 1: rank 0 at 7 ms, rank 1 at 9 ms.
  EXPECT_THAT(r.out, HasSubstr("ranks reaching their step (one clock): the last 2.0 ms after the first at the median "
                               "of 2 steps, 2.0 ms at most (step 1, rank 1 last); last: rank 0 1 time, rank 1 1 time\n"));
  std::ifstream in(svg);
  std::stringstream text;
  text << in.rdbuf();
  // Rank 0's step 0 ran from 1 to 3 ms of its own clock: 3 to 5 ms on rank 1's (the window, less its
  // 2% margin), where rank 1's first step (3 to 4 ms) starts with it and its second (9 ms) is not drawn.
  const std::string picture = text.str();
  EXPECT_THAT(picture, HasSubstr("window 2.08 ms, from 2.96 ms"));
  size_t steps = 0;
  std::set<std::string> starts;
  for (size_t at = picture.find("<title>step: "); at != std::string::npos; at = picture.find("<title>step: ", at + 1)) {
    ++steps;
    const size_t x = picture.rfind("<rect x=\"", at);
    starts.insert(picture.substr(x, picture.find('"', x + 9) - x));
  }
  EXPECT_EQ(steps, 2u) << picture;
  EXPECT_EQ(starts.size(), 1u) << "both ranks' steps start at the same x: " << picture;
  Result apart = Trace({tmp.Write("u.rank-0.json", kTrace), b, "--measure=off"});
  ASSERT_EQ(apart.status, 0) << apart.err;
  EXPECT_THAT(apart.out, HasSubstr("each on its own clock"));
  EXPECT_THAT(apart.out, Not(HasSubstr("ranks reaching their step"))) << "clocks apart: no arrivals";
}

// torch.profiler's traces of two ranks: rank 1 starts the all-gather 3 ms after rank 0, its kernel
// launched 5 us before it started (its host late); its compute stream idles 1 ms waiting for the host.
TEST(TraceCommandTest, TorchProfilerTracesOfTheRanksSayWhichRankEachCollectiveWaitedFor) {
  TempDir tmp;
  auto profile = [](int rank, double ag_start, double ag_launch_end) {
    return absl::StrCat(R"json({"schemaVersion":1,"distributedInfo":{"rank":)json", rank, R"json(,"world_size":2},
"traceEvents":[
{"ph":"X","cat":"kernel","name":"ncclDevKernel_AllGather_RING_LL(x)","pid":0,"tid":24,"ts":)json", ag_start,
                        R"json(,"dur":100,"args":{"correlation":1}},
{"ph":"X","cat":"cuda_runtime","name":"cudaLaunchKernel","pid":9,"tid":9,"ts":)json", ag_launch_end - 4,
                        R"json(,"dur":4,"args":{"correlation":1}},
{"ph":"X","cat":"user_annotation","name":"FSDP::pre_forward (blocks.0)","pid":9,"tid":9,"ts":)json",
                        ag_launch_end - 50, R"json(,"dur":100,"args":{}},
{"ph":"X","cat":"kernel","name":"gemm","pid":0,"tid":7,"ts":1000,"dur":500,"args":{"correlation":2}},
{"ph":"X","cat":"kernel","name":"gemm","pid":0,"tid":7,"ts":2500,"dur":500,"args":{"correlation":3}},
{"ph":"X","cat":"cuda_runtime","name":"cudaLaunchKernel","pid":9,"tid":9,"ts":2496,"dur":4,"args":{"correlation":3}}
]})json");
  };
  const std::string a = tmp.Write("p.rank-0.json", profile(0, 10000, 2000));
  const std::string b = tmp.Write("p.rank-1.json", profile(1, 13000, 12995));
  Result r = Trace({b, a});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("torch.profiler traces of 2 ranks (0, 1 of 2)"));
  EXPECT_THAT(Row(r.out, "AllGather "), ElementsAre("AllGather", "1", "3.00", "ms", "3.00", "ms", "3.00", "ms", "3.0",
                                                    "ms", "1:", "1", "1", "of", "1"));
  EXPECT_THAT(r.out, HasSubstr("waits each rank caused (the sum over the collectives it came last to; its host late "
                               "in): rank 1 3.0 ms (3.0)\n"));
  EXPECT_THAT(r.out, HasSubstr("the longest waits:\n  AllGather #0, 3.0 ms: rank 1 last, its host late, launched in "
                               "FSDP::pre_forward (blocks.0)\n"));
  // Stream 7 of each rank: 1 ms of idle between its two gemms, all of it waiting for the host.
  EXPECT_THAT(r.out, HasSubstr("0           7      2.0 ms      1.0 ms        1.0 ms        0.0 ms      1\n"));
  Result mixed = Trace({a, tmp.Write("t.json", kTrace)});
  EXPECT_EQ(mixed.status, 2);
  EXPECT_THAT(mixed.err, HasSubstr("t.json: not a torch.profiler trace"));
  Result svg = Trace({a, b, "--svg", tmp.path() + "/x.svg"});
  EXPECT_EQ(svg.status, 2);
  EXPECT_THAT(svg.err, HasSubstr("--svg draws Ferry's traces"));
}

TEST(TraceCommandTest, ErrorsAndHelp) {
  TempDir tmp;
  EXPECT_EQ(Trace({"--help"}).status, 0);
  EXPECT_THAT(Trace({"--help"}).out, HasSubstr("usage: ferry trace FILE"));
  EXPECT_EQ(Trace({}).status, 2);
  Result bad_ceiling = Trace({tmp.Write("t.json", kTrace), "--ceiling", "pcie=3"});
  EXPECT_EQ(bad_ceiling.status, 2);
  EXPECT_THAT(bad_ceiling.err, HasSubstr("pcie=3"));
  Result missing = Trace({tmp.path() + "/none.json", "--measure=off"});
  EXPECT_EQ(missing.status, 1);
  EXPECT_THAT(missing.err, HasSubstr("none.json"));
  Result malformed = Trace({tmp.Write("bad.json", "{\"traceEvents\": [1"), "--measure=off"});
  EXPECT_EQ(malformed.status, 1);
  EXPECT_THAT(malformed.err, HasSubstr("not valid JSON"));
  Result no_step = Trace({tmp.Write("t2.json", kTrace), "--measure=off", "--svg", tmp.path() + "/x.svg", "--step=7"});
  EXPECT_EQ(no_step.status, 2);
  EXPECT_THAT(no_step.err, HasSubstr("no index 7"));
}

}  // namespace
}  // namespace ferry::cli
