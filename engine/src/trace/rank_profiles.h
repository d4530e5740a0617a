// torch.profiler (Kineto) traces of the ranks of one job, read together by `ferry trace`: which rank
// each collective waited for and why, and where each rank's compute stream sat idle.
//
// A collective's NCCL kernel starts on each rank when that rank's stream reaches it, and runs until
// every rank has joined: the ranks that start first wait, inside the kernel, for the last. Matching
// the i-th kernel of a kind (AllGather, ReduceScatter, ...) across the ranks' traces gives, per
// collective, how far apart the ranks started it and which rank came last; the launch that queued
// the last rank's kernel (the runtime call of the same correlation id) tells whether that rank's host
// launched it late (the kernel started as soon as it was launched) or the kernel waited behind other
// work of its stream (copies, events, earlier kernels). On the 4 x H100 host this showed one rank's
// host launching its backward's reduce-scatters 6-18 ms late, every other rank waiting in them
// (tests/bench/README.md, `bench_train_dist.py`).
#ifndef FERRY_TRACE_RANK_PROFILES_H_
#define FERRY_TRACE_RANK_PROFILES_H_

#include <cstddef>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "trace/trace_file.h"

namespace ferry {

// Whether `trace` was written by torch.profiler (ParseTrace saw its schemaVersion), not by Ferry.
inline bool IsProfilerTrace(const TraceFile& trace) { return trace.torch_profiler; }

// "AllGather", "ReduceScatter", "AllReduce", "Broadcast", "Reduce", "SendRecv" or "AllToAll" for an
// NCCL kernel's name (ncclDevKernel_AllGather_RING_LL(...), ncclKernel_AllReduce_...), "NCCL" for
// another NCCL kernel, and "" for a kernel not NCCL's.
std::string NcclKind(const std::string& kernel_name);

// One collective: the same-index NCCL kernel of one kind on every rank.
struct CollectiveStart {
  std::string kind;
  size_t index = 0;          // among the collectives of its kind
  double spread_ms = 0.0;    // the last rank's kernel start less the first's
  int last = 0;              // the rank whose kernel started last
  // Of the last rank's kernel: the time from the end of the host call that launched it to its start
  // (negative when no launch of its correlation id is in the trace). Under a small threshold
  // (kLaunchedLateUs) the kernel started as soon as its host launched it: the host was late.
  double launch_to_start_ms = -1.0;
  // The innermost user annotation around the last rank's launch of it (torch.profiler's record_function
  // ranges: "FSDP::pre_forward (blocks.3)", "Optimizer.step"; NCCL's own left out); empty when none.
  std::string where;
};

// Where the compute stream of one rank sat idle: each gap between its work (over kMinGapUs) is split
// into the part before the next op's host launch returned (waiting for the host) and the rest (the op
// was queued already and waited for another stream or an event: a copy, a collective, Ferry's upload).
struct StreamIdle {
  int rank = 0;
  int stream = 0;            // the stream with the most kernel time that is not NCCL's
  double window_ms = 0.0;    // from its first op's start to its last op's end
  double busy_ms = 0.0;      // the union of its ops
  double host_ms = 0.0;      // idle waiting for the host's launches
  double other_ms = 0.0;     // idle with the next op queued, waiting on another stream or event
  size_t gaps = 0;
  // host_ms by what the launching thread was inside meanwhile: its innermost user annotation
  // (record_function: "ferry.wait_params", "DistributedDataParallel.forward", ...; NCCL's own left
  // out) over each part of each wait, kNoAnnotation where none; the largest first.
  std::vector<std::pair<std::string, double>> host_by_where;
};

// host_by_where's name for the parts of a wait that no annotation covers.
inline constexpr char kNoAnnotation[] = "(no annotation)";

struct RankProfiles {
  std::vector<int> ranks;           // the ranks read, ascending
  int world_size = 0;               // as the traces say (0: not said)
  std::vector<CollectiveStart> collectives;  // by kind, then index
  std::vector<StreamIdle> idle;     // one per rank
  std::vector<std::string> notes;   // what could not be matched (counts that differ per rank, ...)
};

// A kernel started within this long after its launch returned is taken as launched late.
inline constexpr double kLaunchedLateUs = 50.0;
// Gaps of a stream shorter than this are not counted as idle.
inline constexpr double kMinGapUs = 20.0;
// Matched kernels whose ends lie further apart than this at the median draw a note: one collective's
// kernels end together on every rank.
inline constexpr double kMatchedEndsUs = 1000.0;

// Reads the traces (path, parsed) of several ranks, or of one. Each file's rank is its
// distributedInfo's, else the number after "rank-" or "rank" in its name, else its position. Each
// kind's kernels are matched in order; where a rank's trace holds more of them (its window opened
// while its GPU still ran earlier ones), from the offset whose kernels end nearest those of the rank
// with the fewest, and a note says so.
// InvalidArgument when a file is not torch.profiler's, or two files are the same rank (naming both).
// Files on one host share torch.profiler's clock, so their kernels' starts compare directly.
absl::StatusOr<RankProfiles> AnalyzeRankProfiles(const std::vector<std::pair<std::string, TraceFile>>& named);

// The analysis as text: per kind of collective how far apart the ranks started it (median, 90th
// percentile, largest), which rank came last how often, and how often that rank's host launched it
// late; per rank, the waits it caused (the sum of the spreads of the collectives it came last to, and
// of those where its host launched late); the five longest waits, each with where its last rank
// launched it; then each rank's compute stream's idle time by cause.
std::string FormatRankProfiles(const RankProfiles& profiles);

}  // namespace ferry

#endif  // FERRY_TRACE_RANK_PROFILES_H_
