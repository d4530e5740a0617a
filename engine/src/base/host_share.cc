#include "base/host_share.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <string_view>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/thread_affinity.h"

namespace ferry {
namespace {

// The first line of a sysfs file as an int; `fallback` when missing or not a number.
int ReadSysInt(const std::string& path, int fallback) {
  std::ifstream in(path);
  std::string line;
  int v = 0;
  if (!std::getline(in, line) || !absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &v)) return fallback;
  return v;
}

// The CPU numbers of a kernel list such as "0-3,8,10-11"; empty when malformed.
std::vector<int> ParseCpuList(const std::string& text) {
  std::vector<int> out;
  for (absl::string_view part : absl::StrSplit(absl::StripAsciiWhitespace(text), ',', absl::SkipEmpty())) {
    std::pair<absl::string_view, absl::string_view> range = absl::StrSplit(part, absl::MaxSplits('-', 1));
    int lo = 0, hi = 0;
    if (!absl::SimpleAtoi(range.first, &lo)) return {};
    hi = lo;
    if (!range.second.empty() && !absl::SimpleAtoi(range.second, &hi)) return {};
    if (lo < 0 || hi < lo) return {};
    for (int c = lo; c <= hi; ++c) out.push_back(c);
  }
  return out;
}

int CountOnlineCpus() {
  std::ifstream in("/sys/devices/system/cpu/online");
  std::string line;
  if (std::getline(in, line)) {
    const std::vector<int> cpus = ParseCpuList(line);
    if (!cpus.empty()) return static_cast<int>(cpus.size());
  }
  const long n = ::sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

// The value of `name` in `env`, or in the process's environment when `env` is null; empty when unset.
std::string Env(const std::map<std::string, std::string>* env, const char* name) {
  if (env != nullptr) {
    auto it = env->find(name);
    return it == env->end() ? std::string() : it->second;
  }
  const char* v = std::getenv(name);
  return v == nullptr ? std::string() : std::string(v);
}

// Slurm's tasks on node `node` from a SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE value such as
// "4(x2),3": nodes 0 and 1 run 4 tasks, node 2 runs 3. -1 when malformed or out of range.
int SlurmTasksOnNode(const std::string& text, int node) {
  int at = 0;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int tasks = 0, repeat = 1;
    const size_t paren = part.find("(x");
    if (!absl::SimpleAtoi(part.substr(0, paren), &tasks)) return -1;
    if (paren != absl::string_view::npos) {
      absl::string_view rep = part.substr(paren + 2);
      if (!absl::ConsumeSuffix(&rep, ")") || !absl::SimpleAtoi(rep, &repeat) || repeat < 1) return -1;
    }
    if (node < at + repeat) return tasks;
    at += repeat;
  }
  return -1;
}

bool ReadPair(const std::map<std::string, std::string>* env, const char* rank_name, const char* size_name,
              int* rank, int* size) {
  return absl::SimpleAtoi(Env(env, rank_name), rank) && absl::SimpleAtoi(Env(env, size_name), size);
}

}  // namespace

HostTopology ReadHostTopology() {
  HostTopology topo;
  topo.online_cpus = CountOnlineCpus();
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> mine = ProcessCpusBeforeHold();  // Ferry's own hold is no launcher's binding
  if (mine.empty() && sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &set)) mine.push_back(c);
    }
  }
  if (mine.empty()) {
    for (int c = 0; c < topo.online_cpus; ++c) mine.push_back(c);
  }
  for (int c : mine) {
    const std::string dir = absl::StrCat("/sys/devices/system/cpu/cpu", c);
    HostCpu cpu;
    cpu.cpu = c;
    // A core is named by its package and core id (core ids repeat across packages).
    const int package = ReadSysInt(dir + "/topology/physical_package_id", 0);
    const int core_id = ReadSysInt(dir + "/topology/core_id", -1);
    cpu.core = core_id < 0 ? -1 - c : package * 65536 + core_id;
    // The node: a link named node<N> in the CPU's directory.
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
      const std::string name = entry.path().filename().string();
      int node = -1;
      if (absl::StartsWith(name, "node") && absl::SimpleAtoi(name.substr(4), &node) && node >= 0) {
        cpu.node = node;
        break;
      }
    }
    topo.cpus.push_back(cpu);
  }
  topo.online_cpus = std::max(topo.online_cpus, static_cast<int>(topo.cpus.size()));
  return topo;
}

LocalRanks DetectLocalRanks(int rank, int size, const std::map<std::string, std::string>* env) {
  LocalRanks out;
  auto take = [&](int r, int s, const char* source) {
    if (s < 1 || r < 0 || r >= s) return false;
    out.local_rank = r;
    out.local_world_size = s;
    out.source = source;
    return true;
  };
  if (rank >= 0 && size >= 0 && take(rank, size, "options")) return out;
  int r = 0, s = 0;
  if (ReadPair(env, "LOCAL_RANK", "LOCAL_WORLD_SIZE", &r, &s) && take(r, s, "torchrun")) return out;
  if (ReadPair(env, "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", &r, &s) && take(r, s, "Open MPI")) {
    return out;
  }
  if (ReadPair(env, "MPI_LOCALRANKID", "MPI_LOCALNRANKS", &r, &s) && take(r, s, "MPICH")) return out;
  if (absl::SimpleAtoi(Env(env, "SLURM_LOCALID"), &r)) {
    int node = 0;
    (void)absl::SimpleAtoi(Env(env, "SLURM_NODEID"), &node);
    if (!absl::SimpleAtoi(Env(env, "SLURM_NTASKS_PER_NODE"), &s)) {
      std::string per_node = Env(env, "SLURM_STEP_TASKS_PER_NODE");
      if (per_node.empty()) per_node = Env(env, "SLURM_TASKS_PER_NODE");
      s = SlurmTasksOnNode(per_node, node);
    }
    if (take(r, s, "Slurm")) return out;
  }
  return out;
}

LauncherRank DetectLauncherRank(const std::map<std::string, std::string>* env) {
  LauncherRank out;
  constexpr std::pair<const char*, const char*> kPairs[] = {
      {"RANK", "WORLD_SIZE"}, {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"}, {"PMI_RANK", "PMI_SIZE"},
      {"SLURM_PROCID", "SLURM_NTASKS"}};
  constexpr const char* kSources[] = {"torchrun", "Open MPI", "MPICH", "Slurm"};
  for (size_t i = 0; i < std::size(kPairs); ++i) {
    int r = 0, s = 0;
    if (ReadPair(env, kPairs[i].first, kPairs[i].second, &r, &s) && s >= 1 && r >= 0 && r < s) {
      out.rank = r;
      out.world_size = s;
      out.source = kSources[i];
      return out;
    }
  }
  return out;
}

HostShare SplitHost(const HostTopology& topo, const LocalRanks& local, const std::vector<int>& gpu_nodes,
                    size_t trainer_threads) {
  HostShare share;
  share.launcher_bound = static_cast<int>(topo.cpus.size()) < topo.online_cpus;
  // The process's cores, each with its CPUs, in CPU order.
  std::vector<std::pair<int, std::vector<const HostCpu*>>> cores;  // core id -> its CPUs
  for (const HostCpu& c : topo.cpus) {
    auto it = std::find_if(cores.begin(), cores.end(), [&](const auto& e) { return e.first == c.core; });
    if (it == cores.end()) {
      cores.push_back({c.core, {&c}});
    } else {
      it->second.push_back(&c);
    }
  }
  const int ranks = std::max(1, local.local_world_size);
  const int me = std::clamp(local.local_rank, 0, ranks - 1);
  std::vector<std::vector<const HostCpu*>> mine;  // this rank's cores
  if (ranks == 1 || share.launcher_bound || cores.empty()) {
    for (auto& [id, cpus] : cores) mine.push_back(cpus);
    share.reason = ranks == 1 ? "one rank on this host: every CPU of the process"
                              : absl::StrCat("the launcher bound the process to ", topo.cpus.size(), " of ",
                                             topo.online_cpus, " CPUs: every one of them (not split again)");
  } else {
    // The cores to divide, and the ranks that divide them: the cores of my GPU's node and the ranks
    // whose GPU is there, when every rank's GPU node is known, the host has several nodes and mine has
    // cores of this process; else every core and every rank.
    std::set<int> nodes;
    for (const HostCpu& c : topo.cpus) nodes.insert(c.node);
    const bool by_node = static_cast<int>(gpu_nodes.size()) == ranks && nodes.size() > 1 &&
                         std::none_of(gpu_nodes.begin(), gpu_nodes.end(), [](int n) { return n < 0; }) &&
                         nodes.count(gpu_nodes[static_cast<size_t>(me)]) > 0;
    std::vector<std::vector<const HostCpu*>> pool;
    int slices = ranks, slice = me;
    if (by_node) {
      const int node = gpu_nodes[static_cast<size_t>(me)];
      for (auto& [id, cpus] : cores) {
        if (cpus.front()->node != node) continue;
        pool.push_back(cpus);
        for (const HostCpu* c : cpus) share.node_cpus.push_back(c->cpu);
      }
      std::sort(share.node_cpus.begin(), share.node_cpus.end());
      slices = static_cast<int>(std::count(gpu_nodes.begin(), gpu_nodes.end(), node));
      slice = static_cast<int>(std::count(gpu_nodes.begin(), gpu_nodes.begin() + me, node));
      share.reason = absl::StrCat("local rank ", me, " of ", ranks, " (", local.source, "): slice ", slice, " of ",
                                  slices, " of the cores of NUMA node ", node, " (its GPU's)");
    } else {
      for (auto& [id, cpus] : cores) pool.push_back(cpus);
      share.reason = absl::StrCat("local rank ", me, " of ", ranks, " (", local.source, "): slice ", me, " of ",
                                  ranks, " of the process's cores");
    }
    const size_t n = pool.size();
    for (const auto& cpus : pool) share.split_of += cpus.size();
    if (n >= static_cast<size_t>(slices)) {
      const size_t lo = n * static_cast<size_t>(slice) / static_cast<size_t>(slices);
      const size_t hi = n * static_cast<size_t>(slice + 1) / static_cast<size_t>(slices);
      mine.assign(pool.begin() + static_cast<std::ptrdiff_t>(lo), pool.begin() + static_cast<std::ptrdiff_t>(hi));
    } else {
      // Fewer cores than ranks: divide the CPUs, or share them round robin when even those are too few.
      std::vector<const HostCpu*> flat;
      for (auto& cpus : pool) flat.insert(flat.end(), cpus.begin(), cpus.end());
      const size_t m = flat.size();
      if (m >= static_cast<size_t>(slices)) {
        for (size_t i = m * static_cast<size_t>(slice) / static_cast<size_t>(slices);
             i < m * static_cast<size_t>(slice + 1) / static_cast<size_t>(slices); ++i) {
          mine.push_back({flat[i]});
        }
      } else {
        mine.push_back({flat[static_cast<size_t>(slice) % m]});
        absl::StrAppend(&share.reason, "; fewer CPUs than ranks: CPUs are shared");
      }
    }
    share.split = true;
    share.split_among = static_cast<size_t>(slices);
  }
  // One CPU per core first, then the second of each core, and so on.
  for (size_t level = 0;; ++level) {
    bool any = false;
    for (const auto& cpus : mine) {
      if (level < cpus.size()) {
        share.cpus.push_back(cpus[level]->cpu);
        any = true;
      }
    }
    if (!any) break;
  }
  share.trainer_cpus = share.cpus.empty() ? 0 : std::min(trainer_threads, share.cpus.size() - 1);
  if (share.trainer_cpus > 0) {
    absl::StrAppend(&share.reason, "; ", share.trainer_cpus, " CPU", share.trainer_cpus == 1 ? "" : "s",
                    " of it left to the trainer's threads");
  }
  std::set<int> share_nodes;
  for (const auto& cpus : mine) {
    for (const HostCpu* c : cpus) share_nodes.insert(c->node);
  }
  share.node = share_nodes.size() == 1 ? *share_nodes.begin() : -1;
  return share;
}

size_t HostShare::MaxWorkers(size_t cap) const {
  size_t n = worker_cpus();
  if (cpus.size() > kSmallShareCpus) n -= std::min(n - 1, cpus.size() / 8);
  // The CPU of the thread that runs the pipeline (see the header); larger shares keep it in their eighth.
  if (n > 1 && (cpus.size() <= kSmallShareCpus || shares_bandwidth())) --n;
  return std::max<size_t>(1, cap > 0 ? std::min(n, cap) : n);
}

size_t HostShare::Workers(size_t cpu_threads, size_t cap) const {
  if (cpu_threads > 0) return cpu_threads;
  size_t n = MaxWorkers(cap);
  if (shares_bandwidth()) n = std::min(n, std::max<size_t>(1, cpus.size() / 2));
  return n;
}

size_t CpuThreadsCap(size_t option) {
  if (option > 0) return option;
  size_t v = 0;
  const char* env = std::getenv("FERRY_CPU_THREADS_MAX");
  return env != nullptr && absl::SimpleAtoi(env, &v) ? v : 0;
}

namespace {

// `option` when 0 or 1, else the environment variable `name` when "0" or "1", else -1.
int OptionOrEnvironment(int option, const char* name) {
  if (option == 0 || option == 1) return option;
  const char* env = std::getenv(name);
  if (env != nullptr && (std::string_view(env) == "0" || std::string_view(env) == "1")) return *env - '0';
  return -1;
}

}  // namespace

int PinCpuThreads(int option) { return OptionOrEnvironment(option, "FERRY_PIN_CPU_THREADS"); }

int PinTrainerThreads(int option) { return OptionOrEnvironment(option, "FERRY_PIN_TRAINER_THREADS"); }

std::string FormatCpuList(std::vector<int> cpus) {
  std::sort(cpus.begin(), cpus.end());
  cpus.erase(std::unique(cpus.begin(), cpus.end()), cpus.end());
  std::string out;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    absl::StrAppend(&out, out.empty() ? "" : ",", cpus[i]);
    if (j > i) absl::StrAppend(&out, "-", cpus[j]);
    i = j + 1;
  }
  return out;
}

}  // namespace ferry
