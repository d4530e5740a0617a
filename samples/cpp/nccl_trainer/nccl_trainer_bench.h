// The NCCL trainer's --bench: each phase of a step timed with CUDA events on the trainer's stream, and
// the report that puts the loop's all-gather beside a plain ncclAllGather loop of the same size
// measured in the same run (nccl_trainer_bench.cc).
#ifndef FERRY_SAMPLES_NCCL_TRAINER_NCCL_TRAINER_BENCH_H_
#define FERRY_SAMPLES_NCCL_TRAINER_NCCL_TRAINER_BENCH_H_

#include <cuda_runtime.h>
#include <nccl.h>

#include <vector>

#include "absl/status/status.h"
#include "ferry/comm.h"
#include "flat_layout.h"

namespace nccl_trainer {

// One step's phases on the GPU's timeline (between events recorded on the trainer's stream), and the
// host's wall time of the whole step.
struct PhaseTimes {
  float forward_backward_ms = 0;
  float reduce_scatter_ms = 0;  // NCCL's reduce-scatter and the conversion of the chunk to fp32
  float ferry_step_ms = 0;      // from the grads' readiness to the last param upload of Ferry's Step
  float all_gather_ms = 0;
  double wall_ms = 0;
};

// Five events per step, recorded at the phases' boundaries (0: start ... 4: after the all-gather).
// One thread at a time.
class StepEvents {
 public:
  StepEvents() = default;
  StepEvents(const StepEvents&) = delete;
  StepEvents& operator=(const StepEvents&) = delete;
  ~StepEvents() {
    for (cudaEvent_t e : events_) {
      if (e != nullptr) cudaEventDestroy(e);
    }
  }
  cudaError_t Create() {
    for (cudaEvent_t& e : events_) {
      if (cudaError_t err = cudaEventCreate(&e); err != cudaSuccess) return err;
    }
    return cudaSuccess;
  }
  cudaError_t Record(int i, cudaStream_t stream) { return cudaEventRecord(events_[i], stream); }
  // Waits for the last event, then reads the four phases.
  cudaError_t Read(PhaseTimes* t) {
    if (cudaError_t err = cudaEventSynchronize(events_[4]); err != cudaSuccess) return err;
    float* out[4] = {&t->forward_backward_ms, &t->reduce_scatter_ms, &t->ferry_step_ms, &t->all_gather_ms};
    for (int i = 0; i < 4; ++i) {
      if (cudaError_t err = cudaEventElapsedTime(out[i], events_[i], events_[i + 1]); err != cudaSuccess) return err;
    }
    return cudaSuccess;
  }

 private:
  cudaEvent_t events_[5] = {};
};

// Collective (every rank, after training with the same `times.size()`): the median of each phase over
// the steps after the warm-up, the slowest rank's, printed by rank 0 with the reduce-scatter's and the
// all-gather's bus bandwidth; then a plain in-place ncclAllGather loop on a bf16 buffer of
// layout.total() elements (the loop's all-gather) on `nccl`, and the loop's all-gather bandwidth as a
// fraction of that one's: its transfer (per step the shortest phase of any rank, the last rank to
// arrive) and, beside it, with the wait of the first ranks for the last one. Uses the current CUDA
// device.
absl::Status ReportBench(ferry::Comm& comm, int rank, int world, const FlatLayout& layout, ncclComm_t nccl,
                         const std::vector<PhaseTimes>& times);

}  // namespace nccl_trainer

#endif  // FERRY_SAMPLES_NCCL_TRAINER_NCCL_TRAINER_BENCH_H_
