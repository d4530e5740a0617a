// The parts of ferry/comm.h every implementation shares: ReduceOpName, AgreeStatus, the single-process
// comm, and the helpers of comm_internal.h.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/absl_compat.h"
#include "comm/comm_internal.h"
#include "ferry/comm.h"

namespace ferry {

namespace comm_internal {

std::string RankName(int rank, int world_size) {
  return absl::StrCat("rank ", rank, " of ", world_size);
}

std::string RankList(const std::vector<int>& ranks) {
  if (ranks.empty()) return "no rank";
  return absl::StrCat(ranks.size() == 1 ? "rank " : "ranks ", absl::StrJoin(ranks, ", "));
}

std::string Where(absl::string_view kind, int rank, int world_size, absl::string_view collective) {
  return absl::StrCat(kind, " comm, ", RankName(rank, world_size), ", ", collective);
}

absl::Status Prefixed(absl::string_view prefix, const absl::Status& s) {
  return absl::Status(s.code(), absl::StrCat(prefix, ": ", s.message()));
}

void ReduceInto(ReduceOp op, absl::Span<const double> in, absl::Span<double> acc) {
  for (size_t i = 0; i < acc.size(); ++i) {
    switch (op) {
      case ReduceOp::kSum: acc[i] += in[i]; break;
      case ReduceOp::kMax: acc[i] = std::max(acc[i], in[i]); break;
      case ReduceOp::kMin: acc[i] = std::min(acc[i], in[i]); break;
    }
  }
}

absl::string_view CollectiveName(Collective c) {
  switch (c) {
    case Collective::kBarrier: return "Barrier";
    case Collective::kAllReduce: return "AllReduce";
    case Collective::kAllGather: return "AllGather";
    case Collective::kBroadcast: return "Broadcast";
    case Collective::kDuplicate: return "Duplicate";
  }
  return "an unknown collective";
}

std::string DescribeCall(const CallShape& call) {
  switch (call.collective) {
    case Collective::kAllReduce:
      return absl::StrCat("AllReduce of ", call.count, " values (", ToAbsl(ReduceOpName(call.op)), ")");
    case Collective::kBroadcast: return absl::StrCat("Broadcast from root ", call.root);
    default: return std::string(CollectiveName(call.collective));
  }
}

absl::Status CheckCallsAgree(absl::Span<const CallShape> calls) {
  const int world = static_cast<int>(calls.size());
  const CallShape& first = calls[0];
  for (int r = 1; r < world; ++r) {
    const CallShape& c = calls[r];
    bool agree = c.collective == first.collective;
    if (agree && c.collective == Collective::kAllReduce) agree = c.count == first.count && c.op == first.op;
    if (agree && c.collective == Collective::kBroadcast) agree = c.root == first.root;
    if (!agree) {
      return absl::InvalidArgumentError(absl::StrCat(RankName(r, world), " called ", DescribeCall(c), " but ",
                                                     RankName(0, world), " called ", DescribeCall(first)));
    }
  }
  if (first.collective == Collective::kBroadcast && (first.root < 0 || first.root >= world)) {
    return absl::InvalidArgumentError(
        absl::StrCat("every rank called Broadcast from root ", first.root, ", outside [0, ", world, ")"));
  }
  return absl::OkStatus();
}

double Seconds(absl::Duration d) { return std::max(0.0, absl::ToDoubleSeconds(d)); }

void PutSize(uint64_t v, char* out) {
  for (size_t i = 0; i < kSizeBytes; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}

uint64_t GetSize(const char* in) {
  uint64_t v = 0;
  for (size_t i = 0; i < kSizeBytes; ++i) v |= uint64_t{static_cast<unsigned char>(in[i])} << (8 * i);
  return v;
}

}  // namespace comm_internal

using comm_internal::RankName;

std::string_view ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "unknown";
}

namespace {

// AgreeStatus's wire form of one rank's status: "" for OK, else "<code>:<message>".
std::string EncodeStatus(const absl::Status& s) {
  if (s.ok()) return std::string();
  return absl::StrCat(static_cast<int>(s.code()), ":", s.message());
}

// The inverse of EncodeStatus; a blob that is not one (a peer of another version, corruption) becomes
// an Internal error saying so, so that it still counts as a failure of that rank.
absl::Status DecodeStatus(absl::string_view blob) {
  if (blob.empty()) return absl::OkStatus();
  size_t colon = blob.find(':');
  int code = 0;
  if (colon == absl::string_view::npos || !absl::SimpleAtoi(blob.substr(0, colon), &code) || code <= 0 ||
      code > static_cast<int>(absl::StatusCode::kUnauthenticated)) {
    return absl::InternalError(absl::StrCat("malformed status blob of ", blob.size(), " bytes"));
  }
  return absl::Status(static_cast<absl::StatusCode>(code), blob.substr(colon + 1));
}

}  // namespace

absl::Status AgreeStatus(Comm& comm, const absl::Status& mine, std::string_view what,
                         absl::Duration timeout) {
  absl::StatusOr<std::vector<std::string>> all = comm.AllGather(EncodeStatus(mine), timeout);
  if (!all.ok()) {
    std::string own = mine.ok() ? std::string() : absl::StrCat(" (this rank's own status: ", mine.ToString(), ")");
    return absl::Status(all.status().code(), absl::StrCat(ToAbsl(what), ": exchanging statuses failed: ",
                                                          all.status().message(), own));
  }
  const int world = comm.world_size();
  if (static_cast<int>(all->size()) != world) {
    return absl::InternalError(absl::StrCat(ToAbsl(what), ": exchanging statuses returned ", all->size(),
                                            " blobs, expected one per rank (", world, ")"));
  }
  absl::StatusCode code = absl::StatusCode::kOk;
  std::vector<std::string> failures;
  for (int r = 0; r < world; ++r) {
    absl::Status s = DecodeStatus((*all)[r]);
    if (s.ok()) continue;
    if (code == absl::StatusCode::kOk) code = s.code();
    failures.push_back(absl::StrCat(RankName(r, world), ": ", s.message()));
  }
  if (failures.empty()) return absl::OkStatus();
  return absl::Status(code, absl::StrCat(ToAbsl(what), ": ", absl::StrJoin(failures, "; ")));
}

namespace {

// World size 1. Not thread-safe: one thread at a time (it holds no state, but the contract is
// Comm's).
class SingleProcessComm final : public Comm {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  std::string_view kind() const override { return "single process"; }

  absl::Status Barrier(absl::Duration) override { return absl::OkStatus(); }
  absl::Status AllReduce(absl::Span<double>, ReduceOp, absl::Duration) override {
    return absl::OkStatus();
  }
  absl::StatusOr<std::vector<std::string>> AllGather(std::string_view mine, absl::Duration) override {
    return std::vector<std::string>{std::string(mine)};
  }
  absl::Status Broadcast(std::string* blob, int root, absl::Duration) override {
    if (root != 0) {
      return absl::InvalidArgumentError(absl::StrCat(comm_internal::Where("single process", 0, 1, "Broadcast"),
                                                     ": root ", root, " is outside [0, 1)"));
    }
    return absl::OkStatus();
  }
  absl::StatusOr<std::unique_ptr<Comm>> Duplicate(absl::Duration) override {
    return std::unique_ptr<Comm>(std::make_unique<SingleProcessComm>());
  }
};

}  // namespace

std::unique_ptr<Comm> MakeSingleProcessComm() { return std::make_unique<SingleProcessComm>(); }

}  // namespace ferry
