// A rank's share of its host: the CPUs its CPU Adam workers run on, found from the launcher's local
// rank and the host's topology, without configuration.
//
// Several ranks on one host (torchrun --nproc-per-node, mpirun -np) each create an engine. Left alone,
// each engine's workers would take every CPU of the host (4 ranks on 64 CPUs: 252 threads), and their
// pinned arenas would all count the whole host's memory as theirs. Here each rank gets a disjoint
// slice of the CPUs this process may run on, whole physical cores, on the NUMA node of its GPU where
// the host has several; the pinned budget is split the same way (engine).
//
// Pure functions of their inputs (ReadHostTopology and DetectLocalRanks read the machine): the split
// is tested on made-up topologies.
#ifndef FERRY_BASE_HOST_SHARE_H_
#define FERRY_BASE_HOST_SHARE_H_

#include <algorithm>
#include <cstddef>
#include <map>
#include <string>
#include <vector>

namespace ferry {

// One CPU this process may run on.
struct HostCpu {
  int cpu = 0;    // the kernel's CPU number
  int core = 0;   // its physical core: CPUs with the same core are SMT siblings
  int node = -1;  // its NUMA node; -1 unknown
};

struct HostTopology {
  std::vector<HostCpu> cpus;  // the CPUs this process may run on (its affinity), by CPU number
  int online_cpus = 0;        // every CPU online on the host (> cpus.size(): a launcher bound the process)
};

// The calling process's CPUs (sched_getaffinity) with their cores and nodes from
// /sys/devices/system/cpu. Where sysfs says nothing, every CPU is its own core on node -1.
HostTopology ReadHostTopology();

// Where a rank sits among the ranks of its host.
struct LocalRanks {
  int local_rank = 0;
  int local_world_size = 1;
  std::string source = "none";  // "options", "torchrun", "Open MPI", "MPICH", "Slurm" or "none"
};

// The local rank and local world size: `rank`/`size` when both are >= 0 (an EngineOptions override),
// else the launcher's environment in `env` (the process's when null): torchrun's LOCAL_RANK and
// LOCAL_WORLD_SIZE, Open MPI's OMPI_COMM_WORLD_LOCAL_RANK and _LOCAL_SIZE, MPICH's (Hydra's)
// MPI_LOCALRANKID and MPI_LOCALNRANKS, Slurm's SLURM_LOCALID with SLURM_NTASKS_PER_NODE or the node's
// count in SLURM_STEP_TASKS_PER_NODE ("4(x2),3" form). Values out of range (a rank not below the size)
// are ignored. None found: rank 0 of 1.
LocalRanks DetectLocalRanks(int rank, int size, const std::map<std::string, std::string>* env = nullptr);

// The process's rank among all the launcher's processes, and their count, from `env` (the process's
// when null): torchrun's RANK and WORLD_SIZE, Open MPI's OMPI_COMM_WORLD_RANK and _SIZE, MPICH's
// PMI_RANK and PMI_SIZE, Slurm's SLURM_PROCID and SLURM_NTASKS; out-of-range values are ignored. None
// found: rank 0 of 1 (source "none"). For what an engine without a comm names by rank (its trace).
struct LauncherRank {
  int rank = 0;
  int world_size = 1;
  std::string source = "none";  // "torchrun", "Open MPI", "MPICH", "Slurm" or "none"
};
LauncherRank DetectLauncherRank(const std::map<std::string, std::string>* env = nullptr);

// What SplitHost gives a rank.
// Shares of at most this many CPUs give CPU Adam every CPU but the trainer's (measured on 16-CPU
// hosts: every one helped); larger ones keep headroom (HostShare::Workers) and stop at the host's
// bandwidth knee (optim/worker_knee.h).
inline constexpr size_t kSmallShareCpus = 16;
// By default (HostShare::RestrictedTo), each rank's workers are held to its own slice where more local
// ranks than this divide the CPUs.
inline constexpr size_t kFreeWorkersMaxRanks = 2;
// The smallest slice whose process is held to it by default (HostShare::HoldsTrainer).
inline constexpr size_t kMinHeldShareCpus = 4;

struct HostShare {
  std::vector<int> cpus;         // the rank's CPUs, one per physical core first, then their siblings
  size_t trainer_cpus = 0;       // the last ones of `cpus`, left to the trainer's own threads
  int node = -1;                 // the NUMA node of the share's CPUs when they are all on one; else -1
  bool split = false;            // the host's CPUs were divided among the local ranks
  size_t split_of = 0;           // split: how many CPUs the local ranks divided (the process's, or its GPU's node's)
  bool launcher_bound = false;   // the process was already restricted to fewer CPUs than are online
  size_t split_among = 1;        // split: how many local ranks divided those CPUs
  std::vector<int> node_cpus;    // split by NUMA node: every CPU of the process on the share's node
  std::string reason;            // how the share was chosen, for `ferry check` and the trace

  // The CPUs a worker may be pinned to: `cpus` less the trainer's (at least one).
  size_t worker_cpus() const { return cpus.size() > trainer_cpus ? cpus.size() - trainer_cpus : 1; }
  // The CPUs the workers may run on: the first worker_cpus() of `cpus` (empty when `cpus` is).
  std::vector<int> WorkerSet() const {
    return {cpus.begin(), cpus.begin() + static_cast<std::ptrdiff_t>(std::min(worker_cpus(), cpus.size()))};
  }
  // The CPUs CPU Adam's workers are restricted to (empty: not restricted), as `pin` says
  // (EngineOptions::pin_cpu_threads, resolved by PinCpuThreads): 1, the share's CPUs less the
  // trainer's (WorkerSet); 0, none; -1 (the default): WorkerSet where more than
  // kFreeWorkersMaxRanks local ranks divided the CPUs, else the CPUs of the share's NUMA node where
  // the host was split by node (the rank's arena is there), else none. Measured on hosts of one node
  // (tests/bench/README.md): 2 ranks ran the offloaded loop 2-13% faster with their workers free
  // (32 CPUs, FSDP2; `ferry bench step` on 64 CPUs): the trainer's threads, which no restriction
  // holds, land on a slice's CPUs, and a restricted worker cannot move away from them. 4 ranks on 64
  // CPUs ran the ZeRO-1 step 22% slower with free workers (246.3 against 192.7 ms, one lease): four
  // pools of workers free over the same CPUs.
  std::vector<int> RestrictedTo(int pin) const {
    if (pin > 0 || (pin < 0 && split && split_among > kFreeWorkersMaxRanks)) return WorkerSet();
    if (pin < 0) return node_cpus;
    return {};
  }
  // Whether the process's other threads are held to `cpus` (EngineOptions::pin_trainer_threads,
  // resolved by PinTrainerThreads as `pin`): 1, wherever the local ranks divided the CPUs; 0, never;
  // -1, where more than kFreeWorkersMaxRanks local ranks divided them into slices of at least
  // kMinHeldShareCpus CPUs (the rule that holds the workers to their slice; smaller slices, as on a
  // 2-CPU machine running 4 ranks, keep their threads free).
  bool HoldsTrainer(int pin) const {
    if (!split || cpus.empty() || pin == 0) return false;
    return pin > 0 || (split_among > kFreeWorkersMaxRanks && cpus.size() >= kMinHeldShareCpus);
  }
  // CPU Adam's workers in this share: `cpu_threads` when > 0 (EngineOptions::cpu_threads), else
  // worker_cpus(), less the pipeline thread's CPU on shares of at most kSmallShareCpus (MaxWorkers),
  // less 1/8 of the share's CPUs on shares of more than kSmallShareCpus, at most half
  // the share where the local ranks divided more than kSmallShareCpus CPUs, and no more than `cap`
  // (0: no cap); at least 1. The eighth is headroom for the pipeline's own threads, the driver's and
  // the trainer's: with every CPU but one busy with workers the offloaded step ran at 0.54-0.76 of its
  // slowest stage on 32- and 64-CPU shares of an H100 host (tests/bench/README.md, `ferry bench step`).
  // The half: the ranks share the host's memory bandwidth, whose knee one process measured at 24-32
  // workers of 64 CPUs, and with 15 workers in each 16-CPU share of 4 ranks on that host, the
  // trainers' own threads (the gradient check's all-reduce, autograd, the early step) waited for
  // CPUs: the check's all-reduce took 19-26 ms, with 8 workers 10 ms, CPU Adam as fast. Ranks joined
  // by a comm measure instead, together (optim/worker_knee.h, MeasureSharedKnee): the half is the rule
  // where they cannot.
  size_t Workers(size_t cpu_threads, size_t cap) const;
  // Whether the local ranks share a host of more than kSmallShareCpus CPUs (the half rule above).
  bool shares_bandwidth() const { return split && split_of > kSmallShareCpus; }
  // The most workers a measurement of this share tries: Workers() without the half rule. Besides the
  // trainer's CPUs, one is left for the thread that runs the pipeline (the early steps' thread, or
  // the trainer's in Step), which works beside the workers, on shares of at most kSmallShareCpus
  // CPUs and where local ranks share the host's bandwidth (larger shares keep it in their eighth).
  // Measured: the 1 x H100 host (16 CPUs), bench_train.py --groups decay, fp32 + overlap, one lease,
  // alternated: 14 workers 187.5 and 177.4 ms (the workers waiting 1-8 ms a step for CPUs, the
  // trainer 0.5-3.4), 13 workers 164.4 and 175.3 ms (none); 4 ranks on the 64-CPU 4 x H100 host,
  // 16-CPU slices of which 2 the trainer's: with 14 workers they ran on a CPU 79.6% of their time and
  // the ZeRO-1 iteration took 207.2 ms, with 11 98.4-98.7% and 185.9-186.4 ms, one lease.
  size_t MaxWorkers(size_t cap) const;
};

// The cap on CPU Adam's workers (EngineOptions::cpu_threads_max): `option` when > 0, else the
// FERRY_CPU_THREADS_MAX environment variable, else 0 (none).
size_t CpuThreadsCap(size_t option);

// The share of local rank `local.local_rank` of `topo`'s CPUs.
// - One local rank, or a process a launcher already bound to fewer CPUs than are online (taskset,
//   mpirun --bind-to, srun --cpu-bind): the share is every CPU of the process (not split again).
// - Several: the physical cores are divided into local_world_size contiguous slices, one per rank
//   (none shared). When `gpu_nodes` gives the NUMA node of every local rank's GPU and the host has
//   several nodes, each node's cores are divided among the ranks whose GPU sits there. Fewer cores
//   than ranks: the CPUs are divided instead; fewer CPUs than ranks: rank r gets CPU r mod n.
// `trainer_threads` CPUs of the share (at most all but one; the siblings of the last cores first) are
// left to the trainer.
HostShare SplitHost(const HostTopology& topo, const LocalRanks& local, const std::vector<int>& gpu_nodes,
                    size_t trainer_threads);

// Whether to restrict CPU Adam's workers (HostShare::RestrictedTo): `option` when 0 or 1, else the
// FERRY_PIN_CPU_THREADS environment variable when 0 or 1, else -1 (the default rule).
int PinCpuThreads(int option);

// Whether to hold the process's other threads to the share (HostShare::HoldsTrainer): `option` when 0
// or 1, else the FERRY_PIN_TRAINER_THREADS environment variable when 0 or 1, else -1 (the default rule).
int PinTrainerThreads(int option);

// "0-15,32-47": CPU numbers as ranges, in ascending order.
std::string FormatCpuList(std::vector<int> cpus);

}  // namespace ferry

#endif  // FERRY_BASE_HOST_SHARE_H_
