// The NCCL trainer's --bench report (nccl_trainer_bench.h).
//
// Bus bandwidth as nccl-tests reports it: for an all-gather or a reduce-scatter over n ranks of a
// buffer of S bytes (the all-gather's output, the reduce-scatter's input), algbw = S / time and
// busbw = algbw * (n - 1) / n, the rate each rank's links carry. With one rank nothing moves.
#include "nccl_trainer_bench.h"

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "ferry/status.h"

namespace nccl_trainer {
namespace {

constexpr int kWarmupSteps = 3;
constexpr int kReferenceWarmup = 5;
constexpr int kReferenceIterations = 30;

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double BusGBs(double bytes, double ms, int world) {
  if (ms <= 0 || world < 2) return 0;
  return bytes / (ms * 1e-3) * (world - 1) / world / 1e9;
}

absl::Status Cuda(cudaError_t e, int rank, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("rank ", rank, ": --bench: ", what, ": ", cudaGetErrorString(e)));
}

absl::Status Nccl(ncclResult_t e, int rank, const char* what) {
  if (e == ncclSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("rank ", rank, ": --bench: ", what, ": ", ncclGetErrorString(e)));
}

// The median time of an in-place ncclAllGather of `chunk` bf16 elements per rank, on a buffer and a
// stream of its own (every rank calls it).
absl::Status MeasureAllGather(ncclComm_t nccl, int rank, int64_t chunk, int world, double* median_ms) {
  struct Resources {
    void* buffer = nullptr;
    cudaStream_t stream = nullptr;
    std::vector<cudaEvent_t> events;
    ~Resources() {
      if (stream != nullptr) cudaStreamSynchronize(stream);
      for (cudaEvent_t e : events) cudaEventDestroy(e);
      if (stream != nullptr) cudaStreamDestroy(stream);
      if (buffer != nullptr) cudaFree(buffer);
    }
  } res;
  const size_t bytes = static_cast<size_t>(chunk) * world * sizeof(uint16_t);
  FERRY_RETURN_IF_ERROR(Cuda(cudaMalloc(&res.buffer, bytes), rank, "cudaMalloc (reference all-gather)"));
  FERRY_RETURN_IF_ERROR(Cuda(cudaMemset(res.buffer, 0, bytes), rank, "cudaMemset"));
  FERRY_RETURN_IF_ERROR(Cuda(cudaStreamCreateWithFlags(&res.stream, cudaStreamNonBlocking), rank, "cudaStreamCreate"));
  res.events.resize(kReferenceIterations + 1, nullptr);
  for (cudaEvent_t& e : res.events) FERRY_RETURN_IF_ERROR(Cuda(cudaEventCreate(&e), rank, "cudaEventCreate"));
  char* base = static_cast<char*>(res.buffer);
  auto gather = [&] {
    return ncclAllGather(base + static_cast<size_t>(rank) * chunk * sizeof(uint16_t), base,
                         static_cast<size_t>(chunk), ncclBfloat16, nccl, res.stream);
  };
  for (int i = 0; i < kReferenceWarmup; ++i) FERRY_RETURN_IF_ERROR(Nccl(gather(), rank, "ncclAllGather (warm-up)"));
  FERRY_RETURN_IF_ERROR(Cuda(cudaEventRecord(res.events[0], res.stream), rank, "cudaEventRecord"));
  for (int i = 0; i < kReferenceIterations; ++i) {
    FERRY_RETURN_IF_ERROR(Nccl(gather(), rank, "ncclAllGather (reference)"));
    FERRY_RETURN_IF_ERROR(Cuda(cudaEventRecord(res.events[i + 1], res.stream), rank, "cudaEventRecord"));
  }
  FERRY_RETURN_IF_ERROR(Cuda(cudaStreamSynchronize(res.stream), rank, "cudaStreamSynchronize (reference)"));
  std::vector<double> ms(kReferenceIterations);
  for (int i = 0; i < kReferenceIterations; ++i) {
    float t = 0;
    FERRY_RETURN_IF_ERROR(Cuda(cudaEventElapsedTime(&t, res.events[i], res.events[i + 1]), rank, "cudaEventElapsedTime"));
    ms[i] = t;
  }
  *median_ms = Median(ms);
  return absl::OkStatus();
}

}  // namespace

absl::Status ReportBench(ferry::Comm& comm, int rank, int world, const FlatLayout& layout, ncclComm_t nccl,
                         const std::vector<PhaseTimes>& times) {
  const absl::Duration timeout = absl::Minutes(5);
  const size_t skip = times.size() > 2 * kWarmupSteps ? kWarmupSteps : 0;
  std::vector<double> phase[5];
  for (size_t s = skip; s < times.size(); ++s) {
    phase[0].push_back(times[s].forward_backward_ms);
    phase[1].push_back(times[s].reduce_scatter_ms);
    phase[2].push_back(times[s].ferry_step_ms);
    phase[3].push_back(times[s].all_gather_ms);
    phase[4].push_back(times[s].wall_ms);
  }
  double reference_ms = 0;
  absl::Status measured = MeasureAllGather(nccl, rank, layout.chunk, world, &reference_ms);
  FERRY_RETURN_IF_ERROR(ferry::AgreeStatus(comm, measured, "--bench: the reference all-gather", timeout));
  // The slowest rank's median of each phase (a collective waits for its slowest rank).
  std::vector<double> slowest = {Median(phase[0]), Median(phase[1]), Median(phase[2]), Median(phase[3]),
                                 Median(phase[4]), reference_ms};
  FERRY_RETURN_IF_ERROR(comm.AllReduce(absl::MakeSpan(slowest), ferry::ReduceOp::kMax, timeout));
  // A rank's all-gather phase starts when its own Step's uploads have landed, so a rank that got there
  // first also waits for the last one. Per step, the rank that arrived last (the shortest phase) saw the
  // transfer alone; the longest minus the shortest is the wait for it (the ranks' Steps differing).
  std::vector<double> first_in = phase[3], last_in = phase[3];
  FERRY_RETURN_IF_ERROR(comm.AllReduce(absl::MakeSpan(first_in), ferry::ReduceOp::kMax, timeout));
  FERRY_RETURN_IF_ERROR(comm.AllReduce(absl::MakeSpan(last_in), ferry::ReduceOp::kMin, timeout));
  std::vector<double> waits(first_in.size());
  for (size_t s = 0; s < waits.size(); ++s) waits[s] = first_in[s] - last_in[s];
  const double transfer_ms = Median(last_in), wait_ms = Median(waits);
  if (rank != 0) return absl::OkStatus();

  const double gather_bytes = static_cast<double>(layout.total()) * sizeof(uint16_t);
  const double scatter_bytes = static_cast<double>(layout.total()) * sizeof(int64_t);
  std::printf("--bench: %d ranks, %lld params (a chunk of %lld per rank); median of %zu steps after %zu warm-up, "
              "the slowest rank's\n", world, static_cast<long long>(layout.used),
              static_cast<long long>(layout.chunk), phase[0].size(), skip);
  std::printf("  %-44s %9.3f ms\n", "forward/backward", slowest[0]);
  std::printf("  %-44s %9.3f ms   bus %7.1f GB/s\n",
              absl::StrCat("reduce-scatter (int64 grads, ", static_cast<int64_t>(scatter_bytes / 1e6), " MB)").c_str(),
              slowest[1], BusGBs(scatter_bytes, slowest[1], world));
  std::printf("  %-44s %9.3f ms\n", absl::StrCat("Ferry step (", layout.chunk, " params offloaded)").c_str(), slowest[2]);
  std::printf("  %-44s %9.3f ms   bus %7.1f GB/s\n",
              absl::StrCat("all-gather (bf16 params, ", static_cast<int64_t>(gather_bytes / 1e6), " MB)").c_str(),
              slowest[3], BusGBs(gather_bytes, slowest[3], world));
  std::printf("  %-44s %9.3f ms   bus %7.1f GB/s\n", "  of which the transfer (the last rank in)", transfer_ms,
              BusGBs(gather_bytes, transfer_ms, world));
  std::printf("  %-44s %9.3f ms\n", "  waiting for the last rank's Step (median)", wait_ms);
  std::printf("  %-44s %9.3f ms\n", "step (host wall time)", slowest[4]);
  std::printf("  %-44s %9.3f ms   bus %7.1f GB/s\n", "ncclAllGather alone, same size (reference)", slowest[5],
              BusGBs(gather_bytes, slowest[5], world));
  if (world < 2) {
    std::printf("all-gather vs NCCL's: n/a with 1 rank (no traffic)\n");
  } else {
    const double loop = BusGBs(gather_bytes, transfer_ms, world), alone = BusGBs(gather_bytes, slowest[5], world);
    const double with_wait = BusGBs(gather_bytes, slowest[3], world);
    std::printf("all-gather bus bandwidth: %.1f GB/s in the loop (the transfer), %.1f GB/s for ncclAllGather alone: "
                "%.1f%% (target >= 80%%); with the wait for the last rank %.1f GB/s, %.1f%%\n", loop, alone,
                alone > 0 ? 100.0 * loop / alone : 0.0, with_wait, alone > 0 ? 100.0 * with_wait / alone : 0.0);
  }
  return absl::OkStatus();
}

}  // namespace nccl_trainer
