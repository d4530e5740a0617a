// Helpers shared by the comm layer's implementations (not part of the public API).
#ifndef FERRY_COMM_COMM_INTERNAL_H_
#define FERRY_COMM_COMM_INTERNAL_H_

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
