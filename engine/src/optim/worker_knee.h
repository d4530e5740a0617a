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

// The knee of ranks that share a host (MeasureSharedKnee) takes the most workers within this fraction
// of the best rate (PickMostWithin), not the fewest: their loops do not stream at the same moments,
// so in a loop each rank's CPU Adam gets more than the share of the bandwidth the lockstep
// measurement gives it, and more workers helped there as long as they had CPUs of their own
// (HostShare::MaxWorkers leaves the trainer's and the pipeline thread's). 4 ranks on the 64-CPU
// 4 x H100 host, 735M ZeRO-1 loop, 2026-11-28: the measurement put 7, 10 and 13 workers per rank
// within 2-9% of each other, in an order that changed from run to run, while the loop ran 7 workers
// at 184.1-198.2 ms, 10 at 189.1, 11 at 180.0-195.2 and 13 at 183.5 ms (three leases), and 14 with
// a CPU short (17 busy threads on 16 CPUs) at 207.2 against 184.9-185.9 ms with 11. The fewest within
// 3% took 7 in one of six measurements; the most within 3% takes 13 in five and 10 in one (13
// measured 11% below 10 there). Two ranks (wider slices, more workers each) were not measured with
// this rule.
inline constexpr double kSharedKneeTolerance = 0.03;

struct WorkerKnee {
  size_t workers = 0;                              // the pick: PickKnee's (one rank), PickMostWithin's (shared)
  std::vector<std::pair<size_t, double>> rates;    // (workers, G params/s) for each count tried
  double seconds = 0;                              // how long the measurement took
  int ranks = 1;                                   // MeasureSharedKnee: the ranks measured together (rates of all)
  std::string Describe() const;                    // "24 of 63 workers (CPU Adam: 8: 3.1, 12: ... G params/s)"
};

// The counts tried for up to `max_workers`: 8, 12, 16, 24, 32, 48, 64, 96, ... below it, and it.
std::vector<size_t> KneeLadder(size_t max_workers);

// The fewest workers whose rate is within `tolerance` (a fraction) of the best of `rates`; 0 when empty.
size_t PickKnee(const std::vector<std::pair<size_t, double>>& rates, double tolerance);

// The most workers whose rate is within `tolerance` of the best of `rates`; 0 when empty.
size_t PickMostWithin(const std::vector<std::pair<size_t, double>>& rates, double tolerance);

// Measures CPU Adam (fp32 state, bf16 grads and params, in place) on `elements` of scratch memory
// (allocated and freed here) with each count of KneeLadder(max_workers), its workers allowed on
// `cpus` (empty: anywhere), and picks the knee with kKneeTolerance. The result is cached per
// (max_workers, cpus) for the process. max_workers <= kKneeProbeAbove: {max_workers} at once.
WorkerKnee MeasureWorkerKnee(size_t max_workers, const std::vector<int>& cpus, int64_t elements = int64_t{48} << 20);

// The counts ranks sharing a host try, up to `max_workers` each: half, three quarters and all of it.
std::vector<size_t> SharedKneeLadder(size_t max_workers);

// The knee of ranks that share a host's memory bandwidth (HostShare::shares_bandwidth), measured
// together: every rank of `comm` calls it, each with its own share, and they step through
// SharedKneeLadder in lockstep (a barrier before each count, another after its warm-up step), so that
// each count's rate is what the host gives when every rank runs that many workers: the elements all
// the ranks stepped over the time the slowest rank took from the common start. Every rank takes the
// same pick (PickMostWithin, kSharedKneeTolerance). One that could not allocate its scratch memory still
// keeps step; then the result has workers == 0 and no rates (keep the rule without a measurement).
// An error only when a collective fails (every rank gets one).
absl::StatusOr<WorkerKnee> MeasureSharedKnee(Comm& comm, size_t max_workers, const std::vector<int>& cpus,
                                             absl::Duration timeout, int64_t elements = int64_t{32} << 20);

}  // namespace ferry

#endif  // FERRY_OPTIM_WORKER_KNEE_H_
