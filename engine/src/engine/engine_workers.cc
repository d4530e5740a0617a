// The rank's share of its host: CPU Adam's workers planned at Create (PlanWorkers: the local rank, the
// share's CPUs, the rule without a measurement) and measured at the first Finalize that offloads
// (TuneWorkers: one process's bandwidth knee; TuneSharedWorkers: the knee of the local ranks that
// share a host, measured together), the process's other threads held to the share there too
// (HoldThreads); the pipeline chunk of a rank's share (TransferChunkBytes). See engine_impl.h.
#include "engine/engine_impl.h"

#include <algorithm>
#include <mutex>

#include "base/thread_affinity.h"
#include "optim/worker_knee.h"

namespace ferry {

size_t TransferChunkBytes(size_t option, int local_world_size) {
  if (option > 0) return option;
  return std::max<size_t>(size_t{1} << 20, kHostChunkBytes / static_cast<size_t>(std::max(1, local_world_size)));
}

namespace engine_internal {

WorkerPlan PlanWorkers(const EngineOptions& options, const Device& device) {
  WorkerPlan plan;
  plan.local = DetectLocalRanks(options.local_rank, options.local_world_size);
  plan.chunk_bytes = TransferChunkBytes(options.transfer_chunk_bytes, plan.local.local_world_size);
  // The GPU of each local rank, when this one drives GPU `local rank` (torchrun's convention): their
  // NUMA nodes let a host of several nodes be split by node.
  std::vector<int> gpu_nodes;
  if (device.backend() == Backend::kCuda && device.numa_node() >= 0) {
    const std::vector<int> nodes = CudaNumaNodes();
    const int n = static_cast<int>(nodes.size());
    if (n > 0 && nodes[static_cast<size_t>(plan.local.local_rank % n)] == device.numa_node()) {
      for (int r = 0; r < plan.local.local_world_size; ++r) gpu_nodes.push_back(nodes[static_cast<size_t>(r % n)]);
    }
  }
  plan.share = SplitHost(ReadHostTopology(), plan.local, gpu_nodes, options.trainer_threads);
  plan.threads = plan.share.Workers(options.cpu_threads, CpuThreadsCap(options.cpu_threads_max));
  plan.cpus = plan.share.RestrictedTo(PinCpuThreads(options.pin_cpu_threads));
  return plan;
}

bool HoldTrainerThreads(const EngineOptions& options, WorkerPlan& plan) {
  if (!plan.share.HoldsTrainer(PinTrainerThreads(options.pin_trainer_threads))) return false;
  static std::mutex mu;
  static std::vector<int>* held = nullptr;  // the CPUs the process was held to; null: not yet
  std::lock_guard<std::mutex> lock(mu);
  if (held != nullptr) {
    absl::StrAppend(&plan.share.reason, "; the process's other threads stay held to CPUs ", FormatCpuList(*held),
                    " (an engine before this one held them there)");
    return true;
  }
  absl::StatusOr<size_t> n = HoldProcessThreads(plan.share.cpus);
  if (!n.ok()) {
    FERRY_LOG(WARNING) << "the trainer's threads were left free: " << n.status().message();
    absl::StrAppend(&plan.share.reason, "; the process's other threads left free (", n.status().message(), ")");
    return true;
  }
  held = new std::vector<int>(plan.share.cpus);
  absl::StrAppend(&plan.share.reason, "; the process's other threads (", *n, " now, and those they start) held to CPUs ",
                  FormatCpuList(plan.share.cpus), " (pin_trainer_threads)");
  return true;
}

void EngineImpl::HoldThreads(const ferry::Placement& placement) {
  if (optimizer_ != nullptr || threads_held_) return;
  bool offloads = false;
  for (const auto& [name, kind] : placement.groups) offloads = offloads || kind == PlaceKind::kCpu;
  if (!offloads) return;
  threads_held_ = true;
  if (HoldTrainerThreads(options_, workers_)) TraceHostShare();
}

void EngineImpl::TraceHostShare() {
  if (tracer_ == nullptr) return;
  const int64_t now = tracer_->NowNs();
  tracer_->Complete("host_share", "engine", now, now,
                    {{"local_rank", static_cast<double>(workers_.local.local_rank)},
                     {"local_world_size", static_cast<double>(workers_.local.local_world_size)},
                     {"cpu_threads", static_cast<double>(pool_->num_threads())},
                     {"transfer_chunk_bytes", static_cast<double>(workers_.chunk_bytes)}},
                    absl::StrCat("workers on CPUs ", pool_->cpus().empty() ? "(any)" : FormatCpuList(pool_->cpus()),
                                 "; ", workers_.share.reason));
}

void EngineImpl::TuneWorkers() {
  // Only the engine's own choice is tuned, once, before any optimizer uses the pool (nothing runs on
  // it yet). Not on a host split among local ranks: alone, their measurements would disturb each
  // other (they measure together, TuneSharedWorkers, where a comm joins them).
  if (options_.cpu_threads > 0 || CpuThreadsCap(options_.cpu_threads_max) > 0 || !workers_.knee.empty() ||
      pool_->num_threads() <= kKneeProbeAbove || workers_.share.split) {
    return;
  }
  const int64_t start = tracer_ != nullptr ? tracer_->NowNs() : 0;
  const WorkerKnee knee = MeasureWorkerKnee(pool_->num_threads(), workers_.cpus);
  workers_.knee = absl::StrCat("workers: ", knee.Describe());
  FERRY_LOG(INFO) << "CPU Adam " << workers_.knee;
  if (tracer_ != nullptr) {
    tracer_->Complete("worker_knee", "engine", start, tracer_->NowNs(),
                      {{"cpu_threads", static_cast<double>(knee.workers)}}, workers_.knee);
  }
  if (knee.workers < pool_->num_threads()) {
    pool_ = std::make_unique<ThreadPool>(knee.workers, -1, workers_.cpus, "ferry-adam");
    workers_.threads = knee.workers;
  }
}

absl::Status EngineImpl::TuneSharedWorkers(const absl::Status& local, const ferry::Placement& placement) {
  if (!multi_rank() || optimizer_ != nullptr) return absl::OkStatus();
  bool offloads = false;
  for (const auto& [name, kind] : placement.groups) offloads = offloads || kind == PlaceKind::kCpu;
  // Only the engine's own choice is measured, and only where every rank shares a host with others
  // and offloads (the measurement is collective: each rank says whether it takes part).
  const bool wants = local.ok() && offloads && workers_.share.shares_bandwidth() && options_.cpu_threads == 0 &&
                     workers_.knee.empty();
  std::vector<double> votes = {wants ? 1.0 : 0.0};
  absl::Status s = comm_->AllReduce(absl::MakeSpan(votes), ReduceOp::kSum, options_.collective_timeout);
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat("Finalize: choosing CPU Adam's workers: ", s.message()));
  if (votes[0] < static_cast<double>(comm_->world_size())) return absl::OkStatus();  // the half rule stays
  const int64_t start = tracer_ != nullptr ? tracer_->NowNs() : 0;
  absl::StatusOr<WorkerKnee> knee =
      MeasureSharedKnee(*comm_, workers_.share.MaxWorkers(CpuThreadsCap(options_.cpu_threads_max)), workers_.cpus,
                        options_.collective_timeout);
  if (!knee.ok()) {
    return absl::Status(knee.status().code(),
                        absl::StrCat("Finalize: measuring CPU Adam's workers with the other ranks: ", knee.status().message()));
  }
  if (knee->workers == 0) {
    FERRY_LOG(INFO) << "CPU Adam workers: a rank could not measure (no scratch memory); " << pool_->num_threads()
                    << " per rank (half the share)";
    return absl::OkStatus();
  }
  workers_.knee = absl::StrCat("workers: ", knee->Describe());
  FERRY_LOG(INFO) << "CPU Adam " << workers_.knee;
  if (tracer_ != nullptr) {
    tracer_->Complete("worker_knee", "engine", start, tracer_->NowNs(),
                      {{"cpu_threads", static_cast<double>(knee->workers)}}, workers_.knee);
  }
  if (knee->workers != pool_->num_threads()) {
    pool_ = std::make_unique<ThreadPool>(knee->workers, -1, workers_.cpus, "ferry-adam");
    workers_.threads = knee->workers;
  }
  return absl::OkStatus();
}

}  // namespace engine_internal
}  // namespace ferry
