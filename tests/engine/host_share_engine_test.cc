// Engines of several local ranks in one process, as ranks sharing a host see them: each takes a
// disjoint share of the CPUs (its workers restricted to it when pinned or where more than 2 ranks
// divide the host; by default as many workers as the share gives, left free on a host not split by
// NUMA node for 2 ranks), the shares add up, stats() shows them, and the default pinned budget is
// divided among the local ranks. In its own binary: the budget is the process's.
#include <algorithm>
#include <functional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/host_share.h"
#include "base/thread_affinity.h"
#include "engine/engine_test_util.h"
#include "ferry/engine.h"
#include "ferry/status.h"
#include "gtest/gtest.h"
#include "memory/pinned_budget.h"

namespace ferry {
namespace {

// The CPUs of a cpu_list ("0-3,8").
std::set<int> Cpus(const std::string& list) {
  std::set<int> out;
  for (absl::string_view part : absl::StrSplit(list, ',', absl::SkipEmpty())) {
    std::vector<std::string> ends = absl::StrSplit(part, '-');
    int lo = 0, hi = 0;
    EXPECT_TRUE(absl::SimpleAtoi(ends[0], &lo)) << list;
    hi = lo;
    if (ends.size() == 2) {
      EXPECT_TRUE(absl::SimpleAtoi(ends[1], &hi)) << list;
    }
    for (int c = lo; c <= hi; ++c) out.insert(c);
  }
  return out;
}

// Why this process cannot be split among local ranks ("" when it can).
std::string WhyNotSplittable(const HostTopology& topo) {
  if (topo.cpus.size() >= 2 && static_cast<int>(topo.cpus.size()) >= topo.online_cpus) return "";
  return absl::StrCat("needs 2 or more CPUs and a process not bound by its launcher (", topo.cpus.size(), " of ",
                      topo.online_cpus, ")");
}

// The engine of local rank `r` of `ranks` on the host backend, its workers pinned as `pin` says,
// after one offloaded step of `param`.
absl::StatusOr<std::unique_ptr<Engine>> RankEngine(int r, int ranks, int pin, std::vector<float>& param,
                                                   std::vector<float>& grad, int pin_trainer = -1) {
  EngineOptions o;
  o.device = "host";  // no GPU node: the host is split flat, whatever its nodes
  o.policy_path = engine_test::Policies() + "offload_all.lua";
  o.local_rank = r;
  o.local_world_size = ranks;
  o.pin_cpu_threads = pin;
  o.pin_trainer_threads = pin_trainer;
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::Create(o));
  FERRY_RETURN_IF_ERROR(engine->AddParam({.name = "w", .shape = {static_cast<int64_t>(param.size())},
                                          .dtype = DType::kF32, .param = param.data(), .grad = grad.data()}));
  FERRY_RETURN_IF_ERROR(engine->Finalize());
  FERRY_RETURN_IF_ERROR(engine->Step());  // the workers run a step
  return engine;
}

TEST(HostShareEngineTest, LocalRanksTakeDisjointSharesAndTheBudgetSplits) {
  const HostTopology topo = ReadHostTopology();
  if (const std::string why = WhyNotSplittable(topo); !why.empty()) GTEST_SKIP() << why;
  const size_t full = PinnedBudget::DefaultProcessLimit();
  ASSERT_EQ(PinnedBudget::Process().limit(), full);
  const int ranks = 2;
  std::vector<std::unique_ptr<Engine>> engines;
  std::vector<float> param(64, 0.5f), grad(64, 0.25f);
  std::set<int> seen;
  size_t total = 0;
  for (int r = 0; r < ranks; ++r) {
    auto engine = RankEngine(r, ranks, /*pin=*/1, param, grad);
    ASSERT_TRUE(engine.ok()) << engine.status();
    const EngineStats s = (*engine)->Stats();
    EXPECT_EQ(s.local_rank, r);
    EXPECT_EQ(s.local_world_size, ranks);
    EXPECT_NE(s.host_share.find("local rank " + std::to_string(r) + " of 2 (options)"), std::string::npos)
        << s.host_share;
    const std::set<int> cpus = Cpus(s.cpu_list);
    ASSERT_FALSE(cpus.empty()) << "the workers of a split host are restricted: " << s.host_share;
    EXPECT_GE(s.cpu_threads, 1u);
    for (int c : cpus) EXPECT_TRUE(seen.insert(c).second) << "CPU " << c << " in two ranks' shares";
    // Each share: its workers' CPUs plus the trainer's (the share of a 1-CPU slice keeps it for the workers).
    const HostShare share = SplitHost(topo, LocalRanks{r, ranks, "test"}, {}, EngineOptions{}.trainer_threads);
    EXPECT_EQ(cpus.size() + share.trainer_cpus, share.cpus.size());
    total += share.cpus.size();
    EXPECT_EQ(s.pinned_limit_bytes, full / ranks);
    engines.push_back(std::move(*engine));
  }
  EXPECT_EQ(total, topo.cpus.size()) << "the shares add up to the process's CPUs";
  engines.clear();
  PinnedBudget::Process().set_limit(full);
}

// Each of `ranks` local ranks' engine with the default restriction, after one step: `expect` checks
// its stats beside the share SplitHost gives it.
void ForEachDefaultRank(const HostTopology& topo, int ranks,
                        const std::function<void(const EngineStats&, const HostShare&)>& expect) {
  const size_t full = PinnedBudget::DefaultProcessLimit();
  std::vector<float> param(64, 0.5f), grad(64, 0.25f);
  for (int r = 0; r < ranks; ++r) {
    auto engine = RankEngine(r, ranks, /*pin=*/-1, param, grad);
    ASSERT_TRUE(engine.ok()) << engine.status();
    const HostShare share = SplitHost(topo, LocalRanks{r, ranks, "test"}, {}, EngineOptions{}.trainer_threads);
    ASSERT_TRUE(share.split);
    expect((*engine)->Stats(), share);
  }
  PinnedBudget::Process().set_limit(full);
}

TEST(HostShareEngineTest, ByDefaultTheSharesWorkersAreNotRestrictedOnAHostNotSplitByNode) {
  const HostTopology topo = ReadHostTopology();
  if (const std::string why = WhyNotSplittable(topo); !why.empty()) GTEST_SKIP() << why;
  ForEachDefaultRank(topo, 2, [](const EngineStats& s, const HostShare& share) {
    EXPECT_EQ(s.cpu_list, "") << "not restricted: " << s.host_share;
    EXPECT_EQ(s.cpu_threads, share.Workers(0, CpuThreadsCap(0))) << "the share's count, restricted or not";
  });
}

TEST(HostShareEngineTest, ByDefaultTheWorkersOfMoreThanTwoRanksAreHeldToTheirSlices) {
  const HostTopology topo = ReadHostTopology();
  if (const std::string why = WhyNotSplittable(topo); !why.empty()) GTEST_SKIP() << why;
  ForEachDefaultRank(topo, 3, [](const EngineStats& s, const HostShare& share) {
    EXPECT_EQ(s.cpu_list, FormatCpuList(share.WorkerSet())) << "held to its slice: " << s.host_share;
  });
}

// pin_trainer_threads = 1: the first rank's engine holds the process's threads (this one included,
// and those started later) to its share; a second engine of the process leaves them there and says so.
// The default holds nothing for 2 ranks. Every thread is given back its CPUs at the end.
TEST(HostShareEngineTest, TheProcessThreadsAreHeldToTheFirstShareWhenAsked) {
  const HostTopology topo = ReadHostTopology();
  if (const std::string why = WhyNotSplittable(topo); !why.empty()) GTEST_SKIP() << why;
  const std::vector<int> all = ThreadCpus(CurrentThreadId());
  std::vector<float> param(64, 0.5f), grad(64, 0.25f);
  {
    auto free = RankEngine(0, 2, /*pin=*/1, param, grad);
    ASSERT_TRUE(free.ok()) << free.status();
    EXPECT_EQ((*free)->Stats().host_share.find("held to CPUs"), std::string::npos) << (*free)->Stats().host_share;
    EXPECT_EQ(ThreadCpus(CurrentThreadId()), all) << "2 ranks: the trainer's threads stay free by default";
  }
  const HostShare first = SplitHost(topo, LocalRanks{0, 2, "test"}, {}, EngineOptions{}.trainer_threads);
  auto a = RankEngine(0, 2, /*pin=*/1, param, grad, /*pin_trainer=*/1);
  ASSERT_TRUE(a.ok()) << a.status();
  const std::string reason = (*a)->Stats().host_share;
  EXPECT_NE(reason.find("held to CPUs " + FormatCpuList(first.cpus) + " (pin_trainer_threads)"), std::string::npos)
      << reason;
  EXPECT_EQ(ThreadCpus(CurrentThreadId()), first.cpus);
  std::vector<int> started;
  std::thread([&] { started = ThreadCpus(CurrentThreadId()); }).join();
  EXPECT_EQ(started, first.cpus) << "a thread the trainer starts later inherits the share";
  auto b = RankEngine(1, 2, /*pin=*/1, param, grad, /*pin_trainer=*/1);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_NE((*b)->Stats().host_share.find("stay held to CPUs " + FormatCpuList(first.cpus)), std::string::npos)
      << (*b)->Stats().host_share;
  EXPECT_EQ(ThreadCpus(CurrentThreadId()), first.cpus);
  a->reset();
  b->reset();
  ASSERT_TRUE(HoldProcessThreads(all).ok());
  PinnedBudget::Process().set_limit(PinnedBudget::DefaultProcessLimit());
}

// The offload pipeline's chunk: the host's (kHostChunkBytes) split among its local ranks unless set,
// and the pipeline's staging ring sized by it.
TEST(HostShareEngineTest, TheLocalRanksSplitTheHostsPipelineChunk) {
  std::vector<float> param(4096, 0.5f), grad(4096, 0.25f);
  auto engine = [&](int ranks, size_t chunk) -> absl::StatusOr<std::unique_ptr<Engine>> {
    EngineOptions o;
    o.device = "host";
    o.policy_path = engine_test::Policies() + "offload_all.lua";
    o.local_rank = 0;
    o.local_world_size = ranks;
    o.pin_cpu_threads = 0;
    o.transfer_chunk_bytes = chunk;
    FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Engine> e, Engine::Create(o));
    FERRY_RETURN_IF_ERROR(e->AddParam({.name = "w", .shape = {static_cast<int64_t>(param.size())},
                                       .dtype = DType::kF32, .param = param.data(), .grad = grad.data()}));
    FERRY_RETURN_IF_ERROR(e->Finalize());
    return e;
  };
  size_t pinned_split = 0, pinned_whole = 0;
  for (int ranks : {1, 2, 3, 4, 16}) {
    auto e = engine(ranks, 0);
    ASSERT_TRUE(e.ok()) << e.status();
    const size_t want = std::max<size_t>(size_t{1} << 20, kHostChunkBytes / static_cast<size_t>(ranks));
    EXPECT_EQ((*e)->Stats().transfer_chunk_bytes, want) << ranks << " local ranks";
    if (ranks == 4) pinned_split = (*e)->Stats().pinned_bytes;
  }
  for (int ranks : {1, 4}) {
    auto e = engine(ranks, size_t{3} << 20);
    ASSERT_TRUE(e.ok()) << e.status();
    EXPECT_EQ((*e)->Stats().transfer_chunk_bytes, size_t{3} << 20) << "set: kept, " << ranks << " local ranks";
  }
  auto whole = engine(4, kHostChunkBytes);
  ASSERT_TRUE(whole.ok()) << whole.status();
  pinned_whole = (*whole)->Stats().pinned_bytes;
  EXPECT_LT(pinned_split, pinned_whole) << "the staging ring holds chunks of the rank's size";
  PinnedBudget::Process().set_limit(PinnedBudget::DefaultProcessLimit());
}

}  // namespace
}  // namespace ferry
