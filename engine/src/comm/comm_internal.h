// Helpers shared by the comm layer's implementations (not part of the public API).
#ifndef FERRY_COMM_COMM_INTERNAL_H_
#define FERRY_COMM_COMM_INTERNAL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "ferry/comm.h"

namespace ferry::comm_internal {

// "rank 2 of 4".
std::string RankName(int rank, int world_size);

// "rank 2" or "ranks 2, 3" (empty input: "no rank").
std::string RankList(const std::vector<int>& ranks);

// The prefix of every error a comm returns: "<kind> comm, rank 1 of 4, AllReduce".
std::string Where(absl::string_view kind, int rank, int world_size, absl::string_view collective);

// `s` with the same code and "<prefix>: " before its message. REQUIRES: !s.ok().
absl::Status Prefixed(absl::string_view prefix, const absl::Status& s);

enum class Collective : uint8_t { kBarrier = 1, kAllReduce, kAllGather, kBroadcast, kDuplicate };
// "Barrier", "AllReduce", ...
absl::string_view CollectiveName(Collective c);

// What one rank asked for, as far as the ranks must agree on it.
struct CallShape {
  Collective collective = Collective::kBarrier;
  ReduceOp op = ReduceOp::kSum;  // AllReduce
  int64_t count = 0;             // AllReduce: values (AllGather, Broadcast: bytes, free to differ)
  int64_t root = 0;              // Broadcast
};

// "AllReduce of 3 values (sum)", "Broadcast from root 1", "AllGather".
std::string DescribeCall(const CallShape& call);

// OK when every rank's call (calls[r] is rank r's) agrees with rank 0's: the same collective, and the
// same count and op for AllReduce, the same root, in range, for Broadcast. Else InvalidArgument naming
// the first rank that differs ("rank 2 of 3 called AllReduce of 3 values (sum) but rank 0 of 3 called
// AllReduce of 2 values (sum)"): the same Status on every rank that checks the same calls.
absl::Status CheckCallsAgree(absl::Span<const CallShape> calls);

// acc[i] = op(acc[i], in[i]) for every i. REQUIRES: acc.size() == in.size().
void ReduceInto(ReduceOp op, absl::Span<const double> in, absl::Span<double> acc);

// The timeout in seconds for a callback or a polling loop: never negative.
double Seconds(absl::Duration d);

// Fixed-width little-endian encoding of a size, for length prefixes and size messages.
inline constexpr size_t kSizeBytes = 8;
void PutSize(uint64_t v, char* out);
uint64_t GetSize(const char* in);

}  // namespace ferry::comm_internal

#endif  // FERRY_COMM_COMM_INTERNAL_H_
