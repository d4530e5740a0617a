#include "trace/rank_profiles.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "trace/trace_file.h"

namespace ferry {
namespace {

using Json = nlohmann::json;

// A torch.profiler-shaped trace of one rank: its kernels (on a stream) with the runtime calls that
// launched them, tied by correlation ids, as Kineto writes them.
struct ProfileBuilder {
  explicit ProfileBuilder(int r = -1) : rank(r) {}
  int rank = -1;  // < 0: no distributedInfo
  int world = 0;
  Json events = Json::array();
  int64_t correlation = 1;

  // A record_function range on the launching thread: [start, start + dur).
  void Annotation(const std::string& name, double start, double dur) {
    events.push_back({{"ph", "X"}, {"cat", "user_annotation"}, {"name", name}, {"pid", 4242},
                      {"tid", 3000000000.0}, {"ts", start}, {"dur", dur}, {"args", Json::object()}});
  }
  // A kernel on `stream` running [start, start + dur), launched by a runtime call ending at launch_end.
  void Kernel(const std::string& name, int stream, double start, double dur, double launch_end) {
    const int64_t c = correlation++;
    events.push_back({{"ph", "X"}, {"cat", "kernel"}, {"name", name}, {"pid", 0}, {"tid", stream},
                      {"ts", start}, {"dur", dur}, {"args", {{"correlation", c}, {"stream", stream}}}});
    events.push_back({{"ph", "X"}, {"cat", "cuda_runtime"}, {"name", "cudaLaunchKernel"}, {"pid", 4242},
                      {"tid", 3000000000.0}, {"ts", launch_end - 3.0}, {"dur", 3.0}, {"args", {{"correlation", c}}}});
  }
  TraceFile Parse(const std::string& what) const {
    Json doc = {{"schemaVersion", 1}, {"traceEvents", events}};
    if (rank >= 0) doc["distributedInfo"] = {{"backend", "nccl"}, {"rank", rank}, {"world_size", world}};
    absl::StatusOr<TraceFile> t = ParseTrace(doc.dump(), what);
    EXPECT_TRUE(t.ok()) << t.status();
    return *t;
  }
};

// The analysis of the builders' traces, each under its name.
absl::StatusOr<RankProfiles> Analyze(const std::vector<std::pair<std::string, const ProfileBuilder*>>& files) {
  std::vector<std::pair<std::string, TraceFile>> named;
  for (const auto& [name, b] : files) named.emplace_back(name, b->Parse(name));
  return AnalyzeRankProfiles(named);
}

TEST(RankProfilesTest, NcclKindReadsTheCollectiveFromTheKernelName) {
  EXPECT_EQ(NcclKind("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)"), "AllGather");
  EXPECT_EQ(NcclKind("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"), "ReduceScatter");
  EXPECT_EQ(NcclKind("ncclDevKernel_AllReduce_Sum_f64_RING_LL(ncclDevKernelArgsStorage<4096ul>)"), "AllReduce");
  EXPECT_EQ(NcclKind("ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)"), "AllReduce");
  EXPECT_EQ(NcclKind("ncclDevKernel_Reduce_Sum_f32_RING_LL(x)"), "Reduce");
  EXPECT_EQ(NcclKind("ncclDevKernel_SendRecv(x)"), "SendRecv");
  EXPECT_EQ(NcclKind("ncclDevKernel_Generic_4(x)"), "NCCL");
  EXPECT_EQ(NcclKind("void at::native::vectorized_elementwise_kernel<4>(int)"), "");
  EXPECT_EQ(NcclKind("my_ncclDevKernel_AllGather"), "");
}

TEST(RankProfilesTest, EachCollectiveNamesTheRankThatStartedLastAndWhetherItsHostLaunchedItLate) {
  std::mt19937_64 rng(std::random_device{}());
  std::uniform_real_distribution<double> offset(0.0, 5000.0), dur(50.0, 400.0);
  std::uniform_int_distribution<int> coin(0, 1);
  const int world = 3 + static_cast<int>(rng() % 3);
  const char* kKernels[] = {"ncclDevKernel_AllGather_RING_LL(a)", "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(b)"};
  const int per_kind = 7;
  std::vector<ProfileBuilder> builders(world);
  // The reference, from the numbers generated: per kind and index, each rank's start.
  std::map<std::string, std::vector<std::vector<double>>> starts;
  std::map<std::string, std::vector<bool>> host_late;
  for (int k = 0; k < 2; ++k) {
    const std::string kind = k == 0 ? "AllGather" : "ReduceScatter";
    for (int i = 0; i < per_kind; ++i) {
      const double base = 1.0e12 + 20000.0 * (2 * i + k);
      std::vector<double> s(world);
      for (int r = 0; r < world; ++r) s[r] = base + offset(rng);
      const bool late = coin(rng) == 1;
      const int last = static_cast<int>(std::max_element(s.begin(), s.end()) - s.begin());
      // Every rank's kernel ends when the exchange does, a while after the last one started.
      const double end = s[last] + dur(rng);
      for (int r = 0; r < world; ++r) {
        // The last rank's launch returns 10 us before its kernel starts (its host late) or 3 ms
        // before (queued); the other ranks' launches long before.
        const double launch_end = r == last ? s[r] - (late ? 10.0 : 3000.0) : s[r] - 4000.0;
        builders[r].Kernel(kKernels[k], 24 + k, s[r], end - s[r], launch_end);
        // The launch inside a module's range, itself inside a wider one, and NCCL's own (left out).
        builders[r].Annotation("FSDP::pre_forward (outer)", launch_end - 900.0, 1000.0);
        builders[r].Annotation(absl::StrCat("FSDP::all_gather (blocks.", i, ")"), launch_end - 100.0, 150.0);
        builders[r].Annotation("nccl:_all_gather_base", launch_end - 20.0, 30.0);
      }
      starts[kind].push_back(s);
      host_late[kind].push_back(late);
    }
  }
  std::vector<std::pair<std::string, TraceFile>> named;
  // Ranks from distributedInfo, the files given out of order.
  for (int r = world - 1; r >= 0; --r) {
    builders[r].rank = r;
    builders[r].world = world;
    named.emplace_back(absl::StrCat("prof/step.", r, ".json"), builders[r].Parse(absl::StrCat("rank ", r)));
  }
  absl::StatusOr<RankProfiles> p = AnalyzeRankProfiles(named);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->ranks.size(), static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) EXPECT_EQ(p->ranks[r], r);
  EXPECT_EQ(p->world_size, world);
  ASSERT_EQ(p->collectives.size(), static_cast<size_t>(2 * per_kind));
  for (const CollectiveStart& c : p->collectives) {
    const std::vector<double>& s = starts.at(c.kind).at(c.index);
    const double spread = *std::max_element(s.begin(), s.end()) - *std::min_element(s.begin(), s.end());
    EXPECT_NEAR(c.spread_ms, spread / 1e3, 1e-6) << c.kind << " #" << c.index;
    EXPECT_EQ(c.last, static_cast<int>(std::max_element(s.begin(), s.end()) - s.begin())) << c.kind << " #" << c.index;
    EXPECT_NEAR(c.launch_to_start_ms, host_late.at(c.kind).at(c.index) ? 0.010 : 3.0, 1e-6);
    EXPECT_EQ(c.where, absl::StrCat("FSDP::all_gather (blocks.", c.index, ")"));
  }
  EXPECT_TRUE(p->notes.empty());
  const std::string text = FormatRankProfiles(*p);
  // The waits each rank caused, from the generated starts: the spreads of the collectives it came
  // last to, and of those the ones its host launched late.
  std::map<int, std::pair<double, double>> caused;
  for (const auto& [kind, list] : starts) {
    for (size_t i = 0; i < list.size(); ++i) {
      const std::vector<double>& s = list[i];
      const int last = static_cast<int>(std::max_element(s.begin(), s.end()) - s.begin());
      const double spread = (*std::max_element(s.begin(), s.end()) - *std::min_element(s.begin(), s.end())) / 1e3;
      caused[last].first += spread;
      if (host_late.at(kind)[i]) caused[last].second += spread;
    }
  }
  std::string expected = "waits each rank caused (the sum over the collectives it came last to; its host late in):";
  for (const auto& [rank, ms] : caused) absl::StrAppend(&expected, absl::StrFormat(" rank %d %.1f ms (%.1f),", rank, ms.first, ms.second));
  expected.back() = '\n';
  EXPECT_NE(text.find(expected), std::string::npos) << expected << "\n" << text;
  EXPECT_NE(text.find("AllGather"), std::string::npos) << text;
  EXPECT_NE(text.find("ReduceScatter"), std::string::npos) << text;
  EXPECT_NE(text.find("the longest waits"), std::string::npos) << text;
}

TEST(RankProfilesTest, TheComputeStreamsIdleIsSplitIntoWaitingForTheHostAndQueued) {
  std::mt19937_64 rng(std::random_device{}());
  std::uniform_real_distribution<double> gap(100.0, 3000.0), frac(0.05, 0.95), len(30.0, 900.0);
  ProfileBuilder b;
  double t = 5.0e11, host = 0, queued = 0, busy = 0;
  size_t gaps = 0;
  const double first = t;
  for (int i = 0; i < 40; ++i) {
    const double d = len(rng);
    double launch_end;
    if (i == 0) {
      launch_end = t - 5.0;
    } else if (i % 5 == 0) {
      // A gap too short to count: launched before, starts 10 us after the last op ended.
      t += 10.0;
      launch_end = t - 500.0;
    } else {
      const double g = gap(rng);
      if (i % 2 == 0) {  // the host's launch returned part-way through the gap
        const double h = g * frac(rng);
        launch_end = t + h;
        host += h;
        queued += g - h;
      } else {  // launched before the gap began: all of it queued
        launch_end = t - 100.0;
        queued += g;
      }
      t += g;
      ++gaps;
    }
    b.Kernel("void gemm_kernel()", 7, t, d, launch_end);
    t += d;
  }
  busy = 0;  // the union of the ops: every op but the 10 us-apart ones starts a segment
  // Recomputed from the events, independently of the analysis: the union of intervals.
  std::vector<std::pair<double, double>> iv;
  for (const Json& e : b.events) {
    if (e["cat"] == "kernel") iv.emplace_back(e["ts"].get<double>(), e["ts"].get<double>() + e["dur"].get<double>());
  }
  std::sort(iv.begin(), iv.end());
  double cs = iv[0].first, ce = iv[0].second;
  for (size_t i = 1; i < iv.size(); ++i) {
    if (iv[i].first > ce) {
      busy += ce - cs;
      cs = iv[i].first;
    }
    ce = std::max(ce, iv[i].second);
  }
  busy += ce - cs;
  // An NCCL kernel on another stream, longer than any: not the compute stream.
  b.Kernel("ncclDevKernel_AllGather_RING_LL(x)", 24, first, 1.0e6, first - 1.0);
  absl::StatusOr<RankProfiles> p = AnalyzeRankProfiles({{"one.rank-5.json", b.Parse("one")}});
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->ranks, std::vector<int>{5});  // from the file's name
  ASSERT_EQ(p->idle.size(), 1u);
  const StreamIdle& s = p->idle[0];
  EXPECT_EQ(s.stream, 7);
  EXPECT_EQ(s.gaps, gaps);
  EXPECT_NEAR(s.host_ms, host / 1e3, 1e-6);
  EXPECT_NEAR(s.other_ms, queued / 1e3, 1e-6);
  EXPECT_NEAR(s.busy_ms, busy / 1e3, 1e-6);
  EXPECT_NEAR(s.window_ms, (t - first) / 1e3, 1e-6);
  EXPECT_TRUE(p->collectives.empty());  // one rank: nothing to match
}

TEST(RankProfilesTest, TheHostsWaitsAreSplitByTheLaunchingThreadsInnermostAnnotation) {
  // By hand: three gaps whose host parts lie under nested annotations, NCCL's own range left out.
  ProfileBuilder b;
  b.Annotation("DistributedDataParallel.forward", 1000, 4000);
  b.Annotation("ferry.wait_params", 1200, 200);
  b.Annotation("nccl:all_gather", 2100, 800);
  b.Annotation("ferry.gather", 2500, 700);
  b.Kernel("void a()", 7, 1000, 100, 900);
  b.Kernel("void b()", 7, 2000, 100, 1600);  // host [1100, 1600): DDP 300, ferry.wait_params 200
  b.Kernel("void c()", 7, 3000, 100, 2900);  // host [2100, 2900): DDP 400, ferry.gather 400
  b.Kernel("void d()", 7, 6000, 100, 5500);  // host [3100, 5500): ferry.gather 100, DDP 1800, none 500
  absl::StatusOr<RankProfiles> p = AnalyzeRankProfiles({{"r.rank-0.json", b.Parse("r")}});
  ASSERT_TRUE(p.ok()) << p.status();
  const StreamIdle& s = p->idle.at(0);
  EXPECT_NEAR(s.host_ms, 3.7, 1e-9);
  std::map<std::string, double> got(s.host_by_where.begin(), s.host_by_where.end());
  const std::map<std::string, double> want = {{"DistributedDataParallel.forward", 2.5}, {"ferry.wait_params", 0.2},
                                              {"ferry.gather", 0.5}, {kNoAnnotation, 0.5}};
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, ms] : want) EXPECT_NEAR(got[name], ms, 1e-9) << name;
  EXPECT_EQ(s.host_by_where.front().first, "DistributedDataParallel.forward");  // the largest first
  const std::string text = FormatRankProfiles(*p);
  for (const char* part : {"0     DistributedDataParallel.forward 2.5 ms, ", "ferry.gather 0.5 ms", "ferry.wait_params 0.2 ms",
                           "(no annotation) 0.5 ms"}) {
    EXPECT_NE(text.find(part), std::string::npos) << part << " in\n" << text;
  }

  // Random annotations and waits on whole microseconds, against a microsecond-by-microsecond count:
  // each microsecond of a host wait goes to the shortest annotation covering it (durations distinct).
  std::mt19937_64 rng(std::random_device{}());
  for (int round = 0; round < 20; ++round) {
    ProfileBuilder r;
    std::vector<std::tuple<std::string, int64_t, int64_t>> notes;  // name, start, end
    std::set<int64_t> durations;
    const int64_t t0 = 1000000;
    while (notes.size() < 12) {
      const int64_t start = t0 + static_cast<int64_t>(rng() % 20000), dur = 1 + static_cast<int64_t>(rng() % 8000);
      if (!durations.insert(dur).second) continue;
      const std::string name = absl::StrCat("range ", notes.size() % 5);  // names repeat: summed together
      notes.emplace_back(name, start, start + dur);
      r.Annotation(name, static_cast<double>(start), static_cast<double>(dur));
    }
    std::map<std::string, int64_t> expect;  // us
    int64_t t = t0 - 100, host = 0;
    r.Kernel("void k()", 7, static_cast<double>(t), 50, static_cast<double>(t - 10));
    t += 50;
    for (int k = 0; k < 15; ++k) {
      const int64_t gap = 30 + static_cast<int64_t>(rng() % 3000), h = static_cast<int64_t>(rng() % (gap + 1));
      for (int64_t u = t; u < t + h; ++u) {  // the host part [t, t + h)
        const std::tuple<std::string, int64_t, int64_t>* inner = nullptr;
        for (const auto& n : notes) {
          if (std::get<1>(n) <= u && u + 1 <= std::get<2>(n) &&
              (inner == nullptr || std::get<2>(n) - std::get<1>(n) < std::get<2>(*inner) - std::get<1>(*inner))) {
            inner = &n;
          }
        }
        ++expect[inner == nullptr ? std::string(kNoAnnotation) : std::get<0>(*inner)];
      }
      host += h;
      r.Kernel("void k()", 7, static_cast<double>(t + gap), 50, static_cast<double>(t + h));
      t += gap + 50;
    }
    absl::StatusOr<RankProfiles> q = AnalyzeRankProfiles({{"q.rank-1.json", r.Parse("q")}});
    ASSERT_TRUE(q.ok()) << q.status();
    const StreamIdle& idle = q->idle.at(0);
    EXPECT_NEAR(idle.host_ms, static_cast<double>(host) / 1e3, 1e-6);
    std::map<std::string, double> by(idle.host_by_where.begin(), idle.host_by_where.end());
    for (const auto& [name, us] : expect) EXPECT_NEAR(by[name], static_cast<double>(us) / 1e3, 1e-6) << name;
    double sum = 0;
    for (const auto& [name, ms] : idle.host_by_where) sum += ms;
    EXPECT_NEAR(sum, static_cast<double>(host) / 1e3, 1e-6);
  }
}

TEST(RankProfilesTest, RefusesFerrysTracesTwoFilesOfOneRankAndMatchesKernelsByTheirEnds) {
  ProfileBuilder a(0), b(0);
  a.Kernel("ncclDevKernel_AllGather_RING_LL(x)", 24, 1000, 10, 990);
  b.Kernel("ncclDevKernel_AllGather_RING_LL(x)", 24, 1200, 10, 1190);
  absl::StatusOr<RankProfiles> same = Analyze({{"a.json", &a}, {"b.json", &b}});
  ASSERT_FALSE(same.ok());
  EXPECT_NE(same.status().message().find("a.json and b.json are both the trace of rank 0"), std::string::npos)
      << same.status();

  absl::StatusOr<TraceFile> ferrys = ParseTrace(R"({"traceEvents":[{"ph":"X","name":"step","ts":0,"dur":5}]})", "f");
  ASSERT_TRUE(ferrys.ok());
  EXPECT_FALSE(IsProfilerTrace(*ferrys));
  absl::StatusOr<RankProfiles> mixed = AnalyzeRankProfiles({{"a.json", a.Parse("a")}, {"ferry.json", *ferrys}});
  ASSERT_FALSE(mixed.ok());
  EXPECT_NE(mixed.status().message().find("ferry.json: not a torch.profiler trace"), std::string::npos) << mixed.status();

  // Rank 1's window opened while its GPU still ran an earlier all-gather (ending at 600 us): the
  // collective both traces hold ends at 1300 us on both, rank 0's started at 1000, rank 1's at 1200.
  ProfileBuilder c(0), d(1);
  c.Kernel("ncclDevKernel_AllGather_RING_LL(x)", 24, 1000, 300, 990);
  d.Kernel("ncclDevKernel_AllGather_RING_LL(x)", 24, 500, 100, 490);
  d.Kernel("ncclDevKernel_AllGather_RING_LL(x)", 24, 1200, 100, 1195);
  absl::StatusOr<RankProfiles> p = Analyze({{"c.json", &c}, {"d.json", &d}});
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->collectives.size(), 1u);
  EXPECT_EQ(p->collectives[0].last, 1);
  EXPECT_NEAR(p->collectives[0].spread_ms, 0.2, 1e-9);
  EXPECT_NEAR(p->collectives[0].launch_to_start_ms, 0.005, 1e-9);
  ASSERT_EQ(p->notes.size(), 1u);
  EXPECT_NE(p->notes[0].find("rank 0: 1 from #0, rank 1: 2 from #1"), std::string::npos) << p->notes[0];
  EXPECT_NE(FormatRankProfiles(*p).find("note: AllGather"), std::string::npos);

  // Kernels that do not end together are not one collective (or the files are not on one clock).
  ProfileBuilder e(0), f(1);
  e.Kernel("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(x)", 28, 1000, 100, 990);
  f.Kernel("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(x)", 28, 6000, 100, 5990);
  absl::StatusOr<RankProfiles> apart = Analyze({{"e.json", &e}, {"f.json", &f}});
  ASSERT_TRUE(apart.ok()) << apart.status();
  ASSERT_EQ(apart->notes.size(), 1u);
  EXPECT_NE(apart->notes[0].find("ReduceScatter: rank 1's kernels end 5.00 ms from rank 0's at the median"),
            std::string::npos) << apart->notes[0];
}

// torch.profiler's older exporter (no Kineto: a bare array, CPU ops under pid "CPU functions"), as a
// CPU-only run writes it: read as torch.profiler's, with nothing on a GPU to analyze.
TEST(RankProfilesTest, TheOlderExportersCpuTracesSayThereIsNothingToMatch) {
  std::vector<std::pair<std::string, TraceFile>> named;
  for (int r = 0; r < 2; ++r) {
    absl::StatusOr<TraceFile> t = ParseTrace(
        R"([{"name": "aten::zeros", "ph": "X", "ts": 99, "dur": 16, "tid": 1, "pid": "CPU functions", "args": {}}])",
        "legacy");
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_TRUE(IsProfilerTrace(*t));
    named.emplace_back(absl::StrCat("run.rank-", r, ".json"), *t);
  }
  absl::StatusOr<RankProfiles> p = AnalyzeRankProfiles(named);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->ranks, (std::vector<int>{0, 1}));
  const std::string text = FormatRankProfiles(*p);
  EXPECT_NE(text.find("no NCCL kernel in these traces"), std::string::npos) << text;
  EXPECT_NE(text.find("no GPU kernel in these traces"), std::string::npos) << text;
}

TEST(RankProfilesTest, AGzippedTraceIsRefusedSayingSo) {
  const std::string gz("\x1f\x8b\x08\x00\x00\x00\x00\x00", 8);
  absl::StatusOr<TraceFile> t = ParseTrace(gz, "rank0.pt.trace.json.gz");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find("rank0.pt.trace.json.gz: gzip-compressed"), std::string::npos) << t.status();
}

TEST(RankProfilesTest, ThreadIdsPastIntsRangeAreReadWithoutOverflow) {
  ProfileBuilder b;  // its launches carry tid 3e9
  b.Kernel("void k()", 7, 100, 10, 95);
  const TraceFile t = b.Parse("big tids");
  ASSERT_EQ(t.events.size(), 2u);
  EXPECT_TRUE(t.torch_profiler);
  EXPECT_NE(t.events[1].tid, t.events[0].tid);
  EXPECT_EQ(t.events[1].tid, static_cast<int>(static_cast<uint32_t>(int64_t{3000000000})));
}

}  // namespace
}  // namespace ferry
