// The split of a host among the ranks that share it (base/host_share.h), on made-up topologies and
// launcher environments, and the worker pinning it leads to (ThreadPool's cpus).
#include "base/host_share.h"

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <thread>
#include <tuple>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "base/thread_pool.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ferry {
namespace {

// `nodes` NUMA nodes of `cores_per_node` cores with `smt` CPUs each, numbered as Linux does on most
// x86 hosts: the first CPU of every core first (0..C-1), then the second of each (C..2C-1).
HostTopology MakeHost(int nodes, int cores_per_node, int smt) {
  HostTopology t;
  const int cores = nodes * cores_per_node;
  for (int s = 0; s < smt; ++s) {
    for (int c = 0; c < cores; ++c) t.cpus.push_back({s * cores + c, c, c / cores_per_node});
  }
  std::sort(t.cpus.begin(), t.cpus.end(), [](const HostCpu& a, const HostCpu& b) { return a.cpu < b.cpu; });
  t.online_cpus = static_cast<int>(t.cpus.size());
  return t;
}

int CoreOf(const HostTopology& t, int cpu) {
  for (const HostCpu& c : t.cpus) {
    if (c.cpu == cpu) return c.core;
  }
  return -1000;
}

TEST(HostShareTest, OneRankTakesEveryCpuOneCoreFirst) {
  const HostTopology t = MakeHost(1, 8, 2);
  const HostShare s = SplitHost(t, LocalRanks{}, {}, 1);
  EXPECT_FALSE(s.split);
  ASSERT_EQ(s.cpus.size(), 16u);
  std::set<int> first_cores;
  for (size_t i = 0; i < 8; ++i) first_cores.insert(CoreOf(t, s.cpus[i]));
  EXPECT_EQ(first_cores.size(), 8u) << "the first 8 CPUs of the share are on 8 distinct cores";
  EXPECT_EQ(s.trainer_cpus, 1u);
  EXPECT_EQ(s.worker_cpus(), 15u);
  EXPECT_EQ(s.Workers(0, 0), 14u) << "one CPU for the thread that runs the pipeline";
  EXPECT_EQ(s.Workers(0, 6), 6u);
  EXPECT_EQ(s.Workers(40, 6), 40u) << "an explicit cpu_threads is taken as it is";
  EXPECT_THAT(s.reason, ::testing::HasSubstr("1 CPU of it left to the trainer's threads"));
  // A torch loop keeps two threads of its own busy (Python's and autograd's device thread).
  const HostShare torch_loop = SplitHost(t, LocalRanks{}, {}, 2);
  EXPECT_EQ(torch_loop.trainer_cpus, 2u);
  EXPECT_EQ(torch_loop.Workers(0, 0), 13u);
  EXPECT_THAT(torch_loop.reason, ::testing::HasSubstr("2 CPUs of it left to the trainer's threads"));
  EXPECT_EQ(SplitHost(t, LocalRanks{}, {}, 0).Workers(0, 0), 15u);
  // Larger shares keep an eighth of their CPUs as headroom.
  const HostShare big = SplitHost(MakeHost(1, 64, 1), LocalRanks{}, {}, 1);
  EXPECT_EQ(big.Workers(0, 0), 63u - 8u);
  EXPECT_EQ(big.Workers(0, 32), 32u);
  // Ranks that divide more than 16 CPUs take at most half their share: they share the host's memory
  // bandwidth, and their trainers' threads need CPUs. 2 ranks on 64 CPUs: 32 each, 31 - 4 = 27
  // capped at 16; 4 ranks: 16 each, 15 capped at 8; 2 ranks on a 16-CPU host: 8 each, 7 less the
  // pipeline thread's: 6 (not capped).
  const HostShare half = SplitHost(MakeHost(1, 64, 1), LocalRanks{1, 2, "test"}, {}, 1);
  EXPECT_EQ(half.split_of, 64u);
  EXPECT_EQ(half.Workers(0, 0), 16u);
  EXPECT_EQ(half.Workers(0, 10), 10u);
  EXPECT_EQ(half.Workers(20, 0), 20u) << "an explicit cpu_threads is taken as it is";
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(SplitHost(MakeHost(1, 64, 1), LocalRanks{r, 4, "test"}, {}, 1).Workers(0, 0), 8u) << "rank " << r;
  }
  EXPECT_EQ(SplitHost(MakeHost(1, 16, 1), LocalRanks{1, 2, "test"}, {}, 1).Workers(0, 0), 6u);
  // What ranks joined by a comm measure together instead (MeasureSharedKnee): up to their share less
  // the trainer's CPU, the eighth and the pipeline thread's CPU, and only where the half rule applies.
  EXPECT_TRUE(half.shares_bandwidth());
  EXPECT_EQ(half.MaxWorkers(0), 26u);
  EXPECT_EQ(half.MaxWorkers(20), 20u);
  const HostShare quarter = SplitHost(MakeHost(1, 64, 1), LocalRanks{3, 4, "test"}, {}, 1);
  EXPECT_TRUE(quarter.shares_bandwidth());
  EXPECT_EQ(quarter.MaxWorkers(0), 14u);
  EXPECT_EQ(SplitHost(MakeHost(1, 64, 1), LocalRanks{3, 4, "test"}, {}, 2).MaxWorkers(0), 13u)
      << "a torch loop's two trainer CPUs, and the pipeline's";
  EXPECT_EQ(big.MaxWorkers(0), 63u - 8u) << "one rank: its trainer's threads wait for the GPU, the pipeline's CPU is not kept";
  EXPECT_FALSE(SplitHost(MakeHost(1, 16, 1), LocalRanks{1, 2, "test"}, {}, 1).shares_bandwidth());
  EXPECT_FALSE(big.shares_bandwidth()) << "one rank: not split";
  // Split by NUMA node: the ranks divide their GPU node's 16 CPUs, not the host's 32.
  EXPECT_EQ(SplitHost(MakeHost(2, 16, 1), LocalRanks{0, 4, "test"}, {0, 0, 1, 1}, 1).split_of, 16u);
  EXPECT_EQ(s.node, 0);
}

// Several ranks on one node: disjoint shares of whole cores that add up to the host.
TEST(HostShareTest, RanksGetDisjointWholeCoresThatAddUp) {
  for (int smt : {1, 2}) {
    for (int ranks : {1, 2, 3, 4, 7, 8}) {
      const HostTopology t = MakeHost(1, 28, smt);
      std::multiset<int> all;
      std::map<int, int> core_owner;
      for (int r = 0; r < ranks; ++r) {
        const HostShare s = SplitHost(t, LocalRanks{r, ranks, "test"}, {}, 1);
        EXPECT_EQ(s.split, ranks > 1);
        EXPECT_GE(s.cpus.size(), static_cast<size_t>(smt * (28 / ranks))) << "rank " << r << " of " << ranks;
        EXPECT_LE(s.cpus.size(), static_cast<size_t>(smt * (28 / ranks + 1))) << "rank " << r << " of " << ranks;
        for (int cpu : s.cpus) {
          all.insert(cpu);
          const int core = CoreOf(t, cpu);
          auto [it, fresh] = core_owner.emplace(core, r);
          EXPECT_TRUE(fresh || it->second == r) << "core " << core << " shared by ranks " << it->second << " and " << r;
        }
      }
      EXPECT_EQ(all.size(), t.cpus.size()) << ranks << " ranks, smt " << smt;
      EXPECT_EQ(std::set<int>(all.begin(), all.end()).size(), t.cpus.size()) << "a CPU in two shares";
    }
  }
}

TEST(HostShareTest, RanksFollowTheirGpusNumaNode) {
  // 2 nodes of 16 cores x 2; GPUs 0,1 on node 0 and 2,3 on node 1.
  const HostTopology t = MakeHost(2, 16, 2);
  const std::vector<int> gpu_nodes = {0, 0, 1, 1};
  std::set<int> seen;
  for (int r = 0; r < 4; ++r) {
    const HostShare s = SplitHost(t, LocalRanks{r, 4, "test"}, gpu_nodes, 1);
    EXPECT_EQ(s.node, gpu_nodes[static_cast<size_t>(r)]) << "rank " << r << ": " << s.reason;
    EXPECT_EQ(s.cpus.size(), 16u) << "half of its node's 32 CPUs";
    for (int cpu : s.cpus) {
      EXPECT_TRUE(seen.insert(cpu).second) << "CPU " << cpu << " in two shares";
    }
  }
  EXPECT_EQ(seen.size(), 64u);
  // Every GPU on node 1: the ranks divide node 1 only.
  const HostShare s = SplitHost(t, LocalRanks{1, 2, "test"}, {1, 1}, 1);
  EXPECT_EQ(s.node, 1);
  EXPECT_EQ(s.cpus.size(), 16u);
  // Unknown nodes: divided flat, across both nodes.
  const HostShare flat = SplitHost(t, LocalRanks{0, 2, "test"}, {0, -1}, 1);
  EXPECT_EQ(flat.cpus.size(), 32u);
}

// Where the workers are restricted: by default to the CPUs of the rank's GPU's node on a host split
// by node (every rank of that node may use them all), on a one-node host nowhere; pin 1: the rank's
// own slice less the trainer's CPUs; pin 0: nowhere.
TEST(HostShareTest, WorkersAreRestrictedToTheirNodeByDefaultAndToTheirSliceWhenPinned) {
  const HostTopology t = MakeHost(2, 16, 2);
  const std::vector<int> gpu_nodes = {0, 0, 1, 1};
  for (int r = 0; r < 4; ++r) {
    const HostShare s = SplitHost(t, LocalRanks{r, 4, "test"}, gpu_nodes, 1);
    const int node = gpu_nodes[static_cast<size_t>(r)];
    std::vector<int> node_cpus;
    for (const HostCpu& c : t.cpus) {
      if (c.node == node) node_cpus.push_back(c.cpu);
    }
    EXPECT_EQ(s.RestrictedTo(-1), node_cpus) << "rank " << r;
    EXPECT_EQ(s.RestrictedTo(1), s.WorkerSet()) << "rank " << r;
    EXPECT_EQ(s.RestrictedTo(1).size(), 15u) << "its 16 CPUs less the trainer's";
    EXPECT_TRUE(s.RestrictedTo(0).empty());
  }
  // One node, split among 2 ranks: not restricted unless pinned; the count stays the share's.
  const HostTopology one = MakeHost(1, 32, 1);
  const HostShare s = SplitHost(one, LocalRanks{1, 2, "test"}, {0, 0}, 1);
  EXPECT_TRUE(s.split);
  EXPECT_TRUE(s.RestrictedTo(-1).empty());
  EXPECT_EQ(FormatCpuList(s.RestrictedTo(1)), "16-30");
  EXPECT_EQ(s.Workers(0, 0), 8u) << "half of the 16-CPU slice: 2 ranks share the 32 CPUs' bandwidth";
  // Unknown GPU nodes on a 2-node host: divided flat, not restricted by default.
  EXPECT_TRUE(SplitHost(t, LocalRanks{0, 2, "test"}, {0, -1}, 1).RestrictedTo(-1).empty());
}

// More than kFreeWorkersMaxRanks ranks dividing the same CPUs: by default each rank's workers are held
// to its own slice (less the trainer's CPUs), on a one-node host and within a node alike; 0 frees them.
TEST(HostShareTest, TheWorkersOfMoreThanTwoRanksAreHeldToTheirSlicesByDefault) {
  const HostTopology one = MakeHost(1, 64, 1);
  for (int ranks : {3, 4}) {
    std::set<int> seen;
    for (int r = 0; r < ranks; ++r) {
      const HostShare s = SplitHost(one, LocalRanks{r, ranks, "test"}, {}, 1);
      EXPECT_EQ(s.split_among, static_cast<size_t>(ranks));
      EXPECT_EQ(s.RestrictedTo(-1), s.WorkerSet()) << ranks << " ranks, rank " << r;
      EXPECT_EQ(s.RestrictedTo(-1).size(), s.cpus.size() - 1) << "the slice less the trainer's CPU";
      EXPECT_TRUE(s.RestrictedTo(0).empty());
      for (int c : s.RestrictedTo(-1)) EXPECT_TRUE(seen.insert(c).second) << "CPU " << c << " in two ranks' sets";
    }
  }
  EXPECT_EQ(SplitHost(one, LocalRanks{0, 2, "test"}, {}, 1).split_among, 2u);
  // A 2-node host, 3 ranks' GPUs on node 0 and one on node 1: node 0's ranks are held to their
  // slices, node 1's rank (alone on its node) to its node.
  const HostTopology two = MakeHost(2, 16, 1);
  const std::vector<int> gpu_nodes = {0, 0, 0, 1};
  for (int r = 0; r < 3; ++r) {
    const HostShare s = SplitHost(two, LocalRanks{r, 4, "test"}, gpu_nodes, 1);
    EXPECT_EQ(s.split_among, 3u);
    EXPECT_EQ(s.RestrictedTo(-1), s.WorkerSet()) << "rank " << r;
  }
  const HostShare last = SplitHost(two, LocalRanks{3, 4, "test"}, gpu_nodes, 1);
  EXPECT_EQ(last.split_among, 1u);
  EXPECT_EQ(last.RestrictedTo(-1), last.node_cpus);
  EXPECT_EQ(last.node_cpus.size(), 16u);
}

// `resolve` (PinCpuThreads, PinTrainerThreads) takes its option when 0 or 1, else the environment
// variable `name` when "0" or "1", else -1; `name` is as it was afterwards.
void ExpectOptionThenEnvironment(const char* name, int (*resolve)(int)) {
  const char* saved = std::getenv(name);
  const std::string keep = saved != nullptr ? saved : "";
  unsetenv(name);
  EXPECT_EQ(resolve(-1), -1) << name;
  EXPECT_EQ(resolve(1), 1) << name;
  EXPECT_EQ(resolve(0), 0) << name;
  setenv(name, "1", 1);
  EXPECT_EQ(resolve(-1), 1) << name;
  EXPECT_EQ(resolve(0), 0) << name << ": the option wins";
  setenv(name, "0", 1);
  EXPECT_EQ(resolve(-1), 0) << name;
  EXPECT_EQ(resolve(1), 1) << name << ": the option wins";
  for (const char* bad : {"yes", "2", ""}) {
    setenv(name, bad, 1);
    EXPECT_EQ(resolve(-1), -1) << name << "=" << bad << ": only 0 or 1";
  }
  if (saved != nullptr) {
    setenv(name, keep.c_str(), 1);
  } else {
    unsetenv(name);
  }
}

TEST(HostShareTest, PinCpuThreadsTakesTheOptionThenTheEnvironment) {
  ExpectOptionThenEnvironment("FERRY_PIN_CPU_THREADS", PinCpuThreads);
}

TEST(HostShareTest, PinTrainerThreadsTakesTheOptionThenTheEnvironment) {
  ExpectOptionThenEnvironment("FERRY_PIN_TRAINER_THREADS", PinTrainerThreads);
}

TEST(HostShareTest, TheThreadsOfRanksHeldToTheirSlicesAreHeldTooByDefault) {
  const HostTopology one = MakeHost(1, 64, 1);
  for (int ranks : {3, 4, 16}) {
    const HostShare s = SplitHost(one, LocalRanks{1, ranks, "test"}, {}, 2);
    EXPECT_TRUE(s.HoldsTrainer(-1)) << ranks << " ranks";
    EXPECT_FALSE(s.HoldsTrainer(0));
  }
  // Two ranks keep their workers free, and their other threads too, unless asked.
  const HostShare two = SplitHost(one, LocalRanks{0, 2, "test"}, {}, 2);
  EXPECT_FALSE(two.HoldsTrainer(-1));
  EXPECT_TRUE(two.HoldsTrainer(1));
  // Slices of fewer than kMinHeldShareCpus CPUs (4 ranks on a 2-core machine, or 32 on 64) stay free.
  EXPECT_FALSE(SplitHost(MakeHost(1, 2, 1), LocalRanks{1, 4, "test"}, {}, 1).HoldsTrainer(-1));
  EXPECT_FALSE(SplitHost(one, LocalRanks{1, 32, "test"}, {}, 1).HoldsTrainer(-1));
  EXPECT_TRUE(SplitHost(one, LocalRanks{1, 32, "test"}, {}, 1).HoldsTrainer(1));
  // One rank, or a process the launcher bound: never (nothing was split).
  EXPECT_FALSE(SplitHost(one, LocalRanks{0, 1, "test"}, {}, 2).HoldsTrainer(1));
  HostTopology bound = MakeHost(1, 16, 1);
  bound.cpus.resize(4);
  EXPECT_FALSE(SplitHost(bound, LocalRanks{2, 4, "test"}, {}, 1).HoldsTrainer(1));
}

TEST(HostShareTest, LauncherBoundProcessKeepsItsCpus) {
  HostTopology t = MakeHost(1, 16, 1);
  t.cpus.resize(4);  // taskset -c 0-3 on a 16-CPU host
  const HostShare s = SplitHost(t, LocalRanks{2, 4, "test"}, {}, 1);
  EXPECT_TRUE(s.launcher_bound);
  EXPECT_FALSE(s.split);
  EXPECT_EQ(s.cpus.size(), 4u);
  EXPECT_NE(s.reason.find("bound"), std::string::npos) << s.reason;
}

TEST(HostShareTest, FewerCoresThanRanks) {
  const HostTopology t = MakeHost(1, 2, 2);  // 2 cores, 4 CPUs
  std::set<int> seen;
  for (int r = 0; r < 4; ++r) {
    const HostShare s = SplitHost(t, LocalRanks{r, 4, "test"}, {}, 1);
    ASSERT_EQ(s.cpus.size(), 1u);
    EXPECT_EQ(s.trainer_cpus, 0u) << "a share of one CPU keeps it for its worker";
    EXPECT_EQ(s.worker_cpus(), 1u);
    seen.insert(s.cpus[0]);
  }
  EXPECT_EQ(seen.size(), 4u);
  // Fewer CPUs than ranks: shared round robin, and said so.
  const HostShare s = SplitHost(MakeHost(1, 2, 1), LocalRanks{3, 5, "test"}, {}, 1);
  ASSERT_EQ(s.cpus.size(), 1u);
  EXPECT_EQ(s.cpus[0], 1);
  EXPECT_NE(s.reason.find("shared"), std::string::npos) << s.reason;
}

TEST(HostShareTest, DetectsTheLaunchersRankAmongAllItsProcesses) {
  using Env = std::map<std::string, std::string>;
  auto detect = [](const Env& env) {
    const LauncherRank r = DetectLauncherRank(&env);
    return std::make_tuple(r.rank, r.world_size, r.source);
  };
  EXPECT_EQ(detect({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}}),
            std::make_tuple(5, 8, std::string("torchrun")));
  EXPECT_EQ(detect({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}}),
            std::make_tuple(1, 2, std::string("Open MPI")));
  EXPECT_EQ(detect({{"PMI_RANK", "3"}, {"PMI_SIZE", "4"}}), std::make_tuple(3, 4, std::string("MPICH")));
  EXPECT_EQ(detect({{"SLURM_PROCID", "9"}, {"SLURM_NTASKS", "16"}}), std::make_tuple(9, 16, std::string("Slurm")));
  EXPECT_EQ(detect({{"RANK", "8"}, {"WORLD_SIZE", "8"}, {"PMI_RANK", "2"}, {"PMI_SIZE", "4"}}),
            std::make_tuple(2, 4, std::string("MPICH")))
      << "a rank not below the size is ignored";
  EXPECT_EQ(detect({{"RANK", "x"}, {"WORLD_SIZE", "2"}}), std::make_tuple(0, 1, std::string("none")));
  EXPECT_EQ(detect({}), std::make_tuple(0, 1, std::string("none")));
}

TEST(HostShareTest, DetectsEachLauncher) {
  using Env = std::map<std::string, std::string>;
  const Env torchrun = {{"LOCAL_RANK", "3"}, {"LOCAL_WORLD_SIZE", "8"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                        {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}};
  LocalRanks l = DetectLocalRanks(-1, -1, &torchrun);
  EXPECT_EQ(l.local_rank, 3);
  EXPECT_EQ(l.local_world_size, 8);
  EXPECT_EQ(l.source, "torchrun");
  const Env ompi = {{"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}};
  l = DetectLocalRanks(-1, -1, &ompi);
  EXPECT_EQ(l.local_rank, 1);
  EXPECT_EQ(l.local_world_size, 2);
  EXPECT_EQ(l.source, "Open MPI");
  const Env mpich = {{"MPI_LOCALRANKID", "2"}, {"MPI_LOCALNRANKS", "4"}};
  l = DetectLocalRanks(-1, -1, &mpich);
  EXPECT_EQ(l.local_rank, 2);
  EXPECT_EQ(l.source, "MPICH");
  const Env slurm = {{"SLURM_LOCALID", "1"}, {"SLURM_NODEID", "2"}, {"SLURM_STEP_TASKS_PER_NODE", "4(x2),3"}};
  l = DetectLocalRanks(-1, -1, &slurm);
  EXPECT_EQ(l.local_rank, 1);
  EXPECT_EQ(l.local_world_size, 3) << "node 2 runs 3 tasks";
  EXPECT_EQ(l.source, "Slurm");
  const Env slurm_per_node = {{"SLURM_LOCALID", "5"}, {"SLURM_NTASKS_PER_NODE", "8"}};
  EXPECT_EQ(DetectLocalRanks(-1, -1, &slurm_per_node).local_world_size, 8);
  // The options win; a rank out of range or garbage is ignored.
  l = DetectLocalRanks(1, 2, &torchrun);
  EXPECT_EQ(l.local_rank, 1);
  EXPECT_EQ(l.source, "options");
  const Env bad = {{"LOCAL_RANK", "4"}, {"LOCAL_WORLD_SIZE", "4"}, {"MPI_LOCALRANKID", "x"}, {"MPI_LOCALNRANKS", "2"}};
  l = DetectLocalRanks(-1, -1, &bad);
  EXPECT_EQ(l.local_rank, 0);
  EXPECT_EQ(l.local_world_size, 1);
  EXPECT_EQ(l.source, "none");
}

TEST(HostShareTest, FormatsCpuLists) {
  EXPECT_EQ(FormatCpuList({}), "");
  EXPECT_EQ(FormatCpuList({3}), "3");
  EXPECT_EQ(FormatCpuList({5, 0, 1, 2, 7, 8, 6, 10}), "0-2,5-8,10");
}

// The machine's own topology is read, and holds the CPUs the process runs on.
TEST(HostShareTest, ReadsThisHost) {
  const HostTopology t = ReadHostTopology();
  ASSERT_FALSE(t.cpus.empty());
  EXPECT_GE(t.online_cpus, static_cast<int>(t.cpus.size()));
  EXPECT_EQ(t.cpus.size(), ThreadPool::DefaultThreads());
}

// Workers given CPUs run only there: each records the CPU it ran a task on.
TEST(HostShareTest, PoolWorkersRunOnTheirCpus) {
  const HostTopology t = ReadHostTopology();
  const int cpu = t.cpus.back().cpu;
  ThreadPool pool(3, 0, {cpu});
  EXPECT_EQ(pool.cpus(), std::vector<int>({cpu}));
  std::mutex mu;
  std::set<int> ran_on;
  size_t restricted = 0;
  pool.ParallelFor(64, [&](size_t) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));  // long enough for the workers to wake
    cpu_set_t set;
    CPU_ZERO(&set);
    ASSERT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
    if (CPU_COUNT(&set) == 1 && CPU_ISSET(cpu, &set)) {  // a worker (the caller is not restricted)
      std::lock_guard<std::mutex> lock(mu);
      ran_on.insert(sched_getcpu());
      ++restricted;
    }
  });
  for (int c : ran_on) EXPECT_EQ(c, cpu);
  if (t.cpus.size() > 1) {
    EXPECT_GT(restricted, 0u) << "no task ran on a restricted worker";
  }
  // The split on this host's own topology: 2 ranks, disjoint.
  const HostShare a = SplitHost(t, LocalRanks{0, 2, "test"}, {}, 0);
  const HostShare b = SplitHost(t, LocalRanks{1, 2, "test"}, {}, 0);
  if (!a.launcher_bound && t.cpus.size() >= 2) {
    for (int c : a.cpus) EXPECT_EQ(std::count(b.cpus.begin(), b.cpus.end(), c), 0) << "CPU " << c;
    EXPECT_EQ(a.cpus.size() + b.cpus.size(), t.cpus.size());
  }
}

}  // namespace
}  // namespace ferry
