// How many CPU Adam workers help: the bandwidth knee of a host, measured.
//
// CPU Adam is memory-bound: past the point where the host's memory bandwidth is spent, more workers
// add nothing to its rate, and in the offload pipeline they take the CPUs that the copies, the driver
// and the trainer need (on a 64-CPU host the offloaded step ran at 0.75 of its slowest stage with 63
// workers, 0.96 with 24 to 48: tests/bench/README.md, `ferry bench step`). So an engine whose share has more than
// kKneeProbeAbove CPUs measures CPU Adam's rate on scratch memory with a ladder of worker counts, once
// per process, and takes the fewest workers within kKneeTolerance of the best rate.
#ifndef FERRY_OPTIM_WORKER_KNEE_H_
#define FERRY_OPTIM_WORKER_KNEE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "base/host_share.h"
#include "ferry/comm.h"

namespace ferry {

// Up to this many workers, all of them are taken without measuring (base/host_share.h).
inline constexpr size_t kKneeProbeAbove = kSmallShareCpus;

// The knee: the fewest workers within this fraction of the best rate on scratch memory. In the
// pipeline the copies and the trainer share the host's memory bandwidth with CPU Adam, which the
// measurement does not see: on the 64-CPU host, 48 workers measured 6-10% above 32 (7.25 against
// 6.82, 6.70 against 6.10 G params/s), and with them the 735M loop's CPU Adam ran at 73 GB/s
// instead of 141 (fp32 grads and params, `--amp fp16`: 368.1 against 195.2 ms). A 5% tolerance
// took 48 there.
inline constexpr double kKneeTolerance = 0.10;

struct WorkerKnee {
  size_t workers = 0;                              // the fewest workers within `tolerance` of the best
  std::vector<std::pair<size_t, double>> rates;    // (workers, G params/s) for each count tried
  double seconds = 0;                              // how long the measurement took
  int ranks = 1;                                   // MeasureSharedKnee: the ranks measured together (rates summed)
  std::string Describe() const;                    // "24 of 63 workers (CPU Adam: 8: 3.1, 12: ... G params/s)"
};

// The counts tried for up to `max_workers`: 8, 12, 16, 24, 32, 48, 64, 96, ... below it, and it.
std::vector<size_t> KneeLadder(size_t max_workers);

// The fewest workers whose rate is within `tolerance` (a fraction) of the best of `rates`; 0 when empty.
size_t PickKnee(const std::vector<std::pair<size_t, double>>& rates, double tolerance);

// Measures CPU Adam (fp32 state, bf16 grads and params, in place) on `elements` of scratch memory
// (allocated and freed here) with each count of KneeLadder(max_workers), its workers allowed on
// `cpus` (empty: anywhere), and picks the knee with kKneeTolerance. The result is cached per
// (max_workers, cpus) for the process. max_workers <= kKneeProbeAbove: {max_workers} at once.
WorkerKnee MeasureWorkerKnee(size_t max_workers, const std::vector<int>& cpus, int64_t elements = int64_t{48} << 20);

// The counts ranks sharing a host try, up to `max_workers` each: half, three quarters and all of it.
std::vector<size_t> SharedKneeLadder(size_t max_workers);

// The knee of ranks that share a host's memory bandwidth (HostShare::shares_bandwidth), measured
// together: every rank of `comm` calls it, each with its own share, and they step through
// SharedKneeLadder in lockstep (a barrier before each count), so that each count's rate is what the
// host gives when every rank runs that many workers. The rates are summed over the ranks and every
// rank takes the same pick (kKneeTolerance). One that could not allocate its scratch memory still
// keeps step; then the result has workers == 0 and no rates (keep the rule without a measurement).
// An error only when a collective fails (every rank gets one).
absl::StatusOr<WorkerKnee> MeasureSharedKnee(Comm& comm, size_t max_workers, const std::vector<int>& cpus,
                                             absl::Duration timeout, int64_t elements = int64_t{32} << 20);

}  // namespace ferry

#endif  // FERRY_OPTIM_WORKER_KNEE_H_
