// Engines of several local ranks in one process, as ranks sharing a host see them: each takes a
// disjoint share of the CPUs (its workers restricted to it when pinned; by default as many workers
// as the share gives, left free on a host not split by NUMA node), the shares add up, stats() shows
// them, and the default pinned budget is divided among the local ranks. In its own binary: the budget
// is the process's.
#include <set>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "base/host_share.h"
#include "engine/engine_test_util.h"
#include "ferry/engine.h"
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

TEST(HostShareEngineTest, LocalRanksTakeDisjointSharesAndTheBudgetSplits) {
  const HostTopology topo = ReadHostTopology();
  if (topo.cpus.size() < 2 || static_cast<int>(topo.cpus.size()) < topo.online_cpus) {
    GTEST_SKIP() << "needs 2 or more CPUs and a process not bound by its launcher (" << topo.cpus.size() << " of "
                 << topo.online_cpus << ")";
  }
  const size_t full = PinnedBudget::DefaultProcessLimit();
  ASSERT_EQ(PinnedBudget::Process().limit(), full);
  const int ranks = 2;
  std::vector<std::unique_ptr<Engine>> engines;
  std::vector<float> param(64, 0.5f), grad(64, 0.25f);
  std::set<int> seen;
  size_t total = 0;
  for (int r = 0; r < ranks; ++r) {
    EngineOptions o;
    o.device = "host";
    o.policy_path = engine_test::Policies() + "offload_all.lua";
    o.local_rank = r;
    o.local_world_size = ranks;
    o.pin_cpu_threads = 1;
    auto engine = Engine::Create(o);
    ASSERT_TRUE(engine.ok()) << engine.status();
    ASSERT_OK((*engine)->AddParam({.name = "w", .shape = {64}, .dtype = DType::kF32, .param = param.data(),
                                   .grad = grad.data()}));
    ASSERT_OK((*engine)->Finalize());
    ASSERT_OK((*engine)->Step());  // the restricted workers run a step
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
    const HostShare share = SplitHost(topo, LocalRanks{r, ranks, "test"}, {}, o.trainer_threads);
    EXPECT_EQ(cpus.size() + share.trainer_cpus, share.cpus.size());
    total += share.cpus.size();
    EXPECT_EQ(s.pinned_limit_bytes, full / ranks);
    engines.push_back(std::move(*engine));
  }
  EXPECT_EQ(total, topo.cpus.size()) << "the shares add up to the process's CPUs";
  engines.clear();
  PinnedBudget::Process().set_limit(full);
}

TEST(HostShareEngineTest, ByDefaultTheSharesWorkersAreNotRestrictedOnAHostNotSplitByNode) {
  const HostTopology topo = ReadHostTopology();
  if (topo.cpus.size() < 2 || static_cast<int>(topo.cpus.size()) < topo.online_cpus) {
    GTEST_SKIP() << "needs 2 or more CPUs and a process not bound by its launcher (" << topo.cpus.size() << " of "
                 << topo.online_cpus << ")";
  }
  const size_t full = PinnedBudget::DefaultProcessLimit();
  std::vector<float> param(64, 0.5f), grad(64, 0.25f);
  for (int r = 0; r < 2; ++r) {
    EngineOptions o;
    o.device = "host";  // no GPU node: the host is split flat, whatever its nodes
    o.policy_path = engine_test::Policies() + "offload_all.lua";
    o.local_rank = r;
    o.local_world_size = 2;
    o.pin_cpu_threads = -1;
    o.cpu_threads_max = 0;
    auto engine = Engine::Create(o);
    ASSERT_TRUE(engine.ok()) << engine.status();
    ASSERT_OK((*engine)->AddParam({.name = "w", .shape = {64}, .dtype = DType::kF32, .param = param.data(),
                                   .grad = grad.data()}));
    ASSERT_OK((*engine)->Finalize());
    ASSERT_OK((*engine)->Step());
    const EngineStats s = (*engine)->Stats();
    EXPECT_EQ(s.cpu_list, "") << "not restricted: " << s.host_share;
    const HostShare share = SplitHost(topo, LocalRanks{r, 2, "test"}, {}, o.trainer_threads);
    EXPECT_TRUE(share.split);
    EXPECT_EQ(s.cpu_threads, share.Workers(0, CpuThreadsCap(0))) << "the share's count, restricted or not";
  }
  PinnedBudget::Process().set_limit(full);
}

}  // namespace
}  // namespace ferry
