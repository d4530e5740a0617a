// MakeCallbackComm: Comm over the trainer's own collectives.
//
// Only all_reduce (of doubles) and a fixed-size all_gather are required; the rest is built on them:
//   AllGather (blobs of any size): a max all_reduce of the sizes, then one all_gather of slots of
//     8 + max bytes each (a little-endian length prefix, the blob, padding). All empty: no all_gather.
//   Barrier without `barrier`: a sum all_reduce of one 1.0 per rank (the sum is checked).
//   Broadcast with `broadcast`: the root's size (8 bytes), then its bytes; without: the AllGather above
//     with every rank but the root contributing nothing.
// A collective made of two calls shares one deadline between them. After a failure other than
// InvalidArgument the ranks may disagree on which call is which, so the comm is poisoned: later calls
// return the first failure at once.
#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/absl_compat.h"
#include "comm/comm_internal.h"
#include "ferry/comm.h"
#include "ferry/status.h"

namespace ferry {
namespace {

using comm_internal::GetSize;
using comm_internal::kSizeBytes;
using comm_internal::Prefixed;
using comm_internal::PutSize;
using comm_internal::Seconds;

// Not thread-safe: one thread at a time (Duplicate for a second thread).
class CallbackComm final : public Comm {
 public:
  explicit CallbackComm(CommCallbacks callbacks) : cb_(std::move(callbacks)) {}

  int rank() const override { return cb_.rank; }
  int world_size() const override { return cb_.world_size; }
  std::string_view kind() const override { return "callbacks"; }

  absl::Status Barrier(absl::Duration timeout) override {
    Op op(this, "Barrier", timeout);
    if (!poisoned_.ok()) return op.Poisoned(poisoned_);
    if (cb_.barrier) return op.Check("barrier", cb_.barrier(op.Left()));
    double one = 1.0;
    absl::Status s = op.Check("all_reduce of 1 value (sum)", cb_.all_reduce(&one, 1, ReduceOp::kSum, op.Left()));
    if (s.ok() && one != cb_.world_size) {
      s = op.Fail(absl::InternalError(absl::StrCat("all_reduce (sum) of 1.0 per rank returned ", one,
                                                   ", expected the world size ", cb_.world_size)));
    }
    return s;
  }

  absl::Status AllReduce(absl::Span<double> values, ReduceOp reduce, absl::Duration timeout) override {
    Op op(this, "AllReduce", timeout);
    if (!poisoned_.ok()) return op.Poisoned(poisoned_);
    return op.Check(absl::StrCat("all_reduce of ", values.size(), " values (", ToAbsl(ReduceOpName(reduce)), ")"),
                    cb_.all_reduce(values.data(), values.size(), reduce, op.Left()));
  }

  absl::StatusOr<std::vector<std::string>> AllGather(std::string_view mine, absl::Duration timeout) override {
    Op op(this, "AllGather", timeout);
    if (!poisoned_.ok()) return op.Poisoned(poisoned_);
    return Gather(op, mine);
  }

  absl::Status Broadcast(std::string* blob, int root, absl::Duration timeout) override {
    Op op(this, "Broadcast", timeout);
    if (!poisoned_.ok()) return op.Poisoned(poisoned_);
    if (root < 0 || root >= cb_.world_size) {
      return absl::InvalidArgumentError(
          absl::StrCat(op.where, ": root ", root, " is outside [0, ", cb_.world_size, ")"));
    }
    if (!cb_.broadcast) {
      absl::StatusOr<std::vector<std::string>> all =
          Gather(op, cb_.rank == root ? std::string_view(*blob) : std::string_view());
      if (!all.ok()) return all.status();
      *blob = std::move((*all)[root]);
      return absl::OkStatus();
    }
    char size[kSizeBytes];
    PutSize(blob->size(), size);
    FERRY_RETURN_IF_ERROR(op.Check(absl::StrCat("broadcast of the size (", kSizeBytes, " bytes) from root ", root),
                               cb_.broadcast(size, kSizeBytes, root, op.Left())));
    if (cb_.rank != root) blob->resize(GetSize(size));
    if (blob->empty()) return absl::OkStatus();
    return op.Check(absl::StrCat("broadcast of ", blob->size(), " bytes from root ", root),
                    cb_.broadcast(blob->data(), blob->size(), root, op.Left()));
  }

  absl::StatusOr<std::unique_ptr<Comm>> Duplicate(absl::Duration timeout) override {
    Op op(this, "Duplicate", timeout);
    if (!poisoned_.ok()) return op.Poisoned(poisoned_);
    if (!cb_.duplicate) {
      return absl::UnimplementedError(absl::StrCat(
          op.where, ": no `duplicate` function was given (CommCallbacks::duplicate; "
                    "ferry_comm_callbacks.duplicate in C)"));
    }
    absl::StatusOr<CommCallbacks> dup = cb_.duplicate(op.Left());
    FERRY_RETURN_IF_ERROR(op.Check("duplicate", dup.status()));
    if (dup->rank != cb_.rank || dup->world_size != cb_.world_size) {
      return op.Fail(absl::InternalError(absl::StrCat("duplicate returned callbacks for rank ", dup->rank, " of ",
                                                      dup->world_size, ", expected ", cb_.rank, " of ",
                                                      cb_.world_size)));
    }
    absl::StatusOr<std::unique_ptr<Comm>> comm = MakeCallbackComm(*std::move(dup));
    if (!comm.ok()) return Prefixed(absl::StrCat(op.where, ": the callbacks `duplicate` returned"), comm.status());
    return comm;
  }

 private:
  // One collective: its name for messages, its deadline, and the wrapping of callback errors.
  struct Op {
    Op(CallbackComm* c, absl::string_view collective, absl::Duration timeout)
        : comm(c),
          where(comm_internal::Where("callbacks", c->cb_.rank, c->cb_.world_size, collective)),
          deadline(absl::Now() + timeout) {}

    double Left() const { return Seconds(deadline - absl::Now()); }

    // OK, or `s` from the callback `step`, wrapped, and the comm poisoned.
    absl::Status Check(absl::string_view step, const absl::Status& s) {
      if (s.ok()) return s;
      return Fail(Prefixed(absl::StrCat(step, " failed"), s));
    }
    absl::Status Fail(const absl::Status& s) {
      absl::Status wrapped = Prefixed(where, s);
      if (wrapped.code() != absl::StatusCode::kInvalidArgument) comm->poisoned_ = wrapped;
      return wrapped;
    }
    absl::Status Poisoned(const absl::Status& first) const {
      return Prefixed(absl::StrCat(where, ": unusable after an earlier failure"), first);
    }

    CallbackComm* comm;
    std::string where;
    absl::Time deadline;
  };

  absl::StatusOr<std::vector<std::string>> Gather(Op& op, std::string_view mine) {
    const int world = cb_.world_size;
    double max_size = static_cast<double>(mine.size());
    FERRY_RETURN_IF_ERROR(op.Check("all_reduce of the blob sizes (max)",
                               cb_.all_reduce(&max_size, 1, ReduceOp::kMax, op.Left())));
    std::vector<std::string> all(world);
    if (max_size == 0) return all;
    if (max_size < static_cast<double>(mine.size())) {
      return op.Fail(absl::InternalError(absl::StrCat("all_reduce (max) of the blob sizes returned ", max_size,
                                                      ", less than this rank's ", mine.size())));
    }
    const size_t slot = kSizeBytes + static_cast<size_t>(max_size);
    std::string in(slot, '\0'), out(slot * world, '\0');
    PutSize(mine.size(), in.data());
    if (!mine.empty()) std::memcpy(in.data() + kSizeBytes, mine.data(), mine.size());  // data() may be null
    FERRY_RETURN_IF_ERROR(op.Check(absl::StrCat("all_gather of ", world, " x ", slot, " bytes"),
                               cb_.all_gather(in.data(), slot, out.data(), op.Left())));
    for (int r = 0; r < world; ++r) {
      const char* p = out.data() + r * slot;
      const uint64_t size = GetSize(p);
      if (size > slot - kSizeBytes) {
        return op.Fail(absl::InternalError(absl::StrCat("all_gather returned a slot for rank ", r, " of ", world,
                                                        " announcing ", size, " bytes, more than the maximum ",
                                                        slot - kSizeBytes)));
      }
      all[r].assign(p + kSizeBytes, size);
    }
    return all;
  }

  const CommCallbacks cb_;
  absl::Status poisoned_;  // the first failure other than InvalidArgument
};

}  // namespace

absl::StatusOr<std::unique_ptr<Comm>> MakeCallbackComm(CommCallbacks callbacks) {
  if (callbacks.world_size < 1 || callbacks.rank < 0 || callbacks.rank >= callbacks.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("MakeCallbackComm: rank ", callbacks.rank,
                                                   " is outside [0, world_size) with world_size ",
                                                   callbacks.world_size));
  }
  if (!callbacks.all_reduce || !callbacks.all_gather) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MakeCallbackComm (rank ", callbacks.rank, " of ", callbacks.world_size, "): the required function",
        !callbacks.all_reduce && !callbacks.all_gather ? "s all_reduce and all_gather are"
        : !callbacks.all_reduce                        ? " all_reduce is"
                                                       : " all_gather is",
        " missing"));
  }
  return std::unique_ptr<Comm>(std::make_unique<CallbackComm>(std::move(callbacks)));
}

}  // namespace ferry
