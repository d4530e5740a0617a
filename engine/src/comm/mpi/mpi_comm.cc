// MakeMpiComm: Comm over MPI (the only file of Ferry that includes mpi.h; built when CMake finds MPI).
//
// Nothing hangs: every collective is non-blocking (MPI_Ibarrier, MPI_Iallreduce, MPI_Iallgatherv,
// MPI_Ibcast, MPI_Comm_idup) and completed by polling MPI_Test* with a short backoff sleep (20 us
// doubling to 1 ms) until the deadline.
//
// Naming the ranks that did not arrive (the arrival exchange): before each collective every rank sends
// every other rank a small descriptor of its call {sequence number, collective, op, count, root} with
// MPI_Isend, and posts an MPI_Irecv for each peer's, all completed by the same polling. When the
// deadline passes in this phase, the peers whose descriptor has not been received are the ones that
// had not arrived, and are named. The descriptors also let every rank check, before any MPI collective
// is started, that all ranks made the same call (collective, AllReduce count and op, Broadcast root:
// InvalidArgument naming the first rank that differs from rank 0, identically on every rank, and the
// comm stays usable) and carry the sizes that AllGather (counts of MPI_Iallgatherv) and Broadcast (the
// root's size) need, so no separate size exchange is needed. The cost is world_size - 1 messages of
// 40 bytes sent and received per rank and collective; Ferry runs a few small collectives per step, so
// this is negligible next to the step up to hundreds of ranks (a tree could replace it beyond).
// A timeout after every descriptor arrived (a rank failed or gave up inside the collective) is reported
// without names.
//
// After a timeout or an MPI error the comm is poisoned: later calls return that error at once (the
// ranks no longer agree on which collective is which). The requests of the collective that timed out
// can be neither cancelled (MPI forbids cancelling collectives) nor completed, and MPI may still write
// into their buffers: those buffers are never the caller's (every collective copies in and out of its
// own) and are kept alive until the process exits.
// The C API only: without these, Open MPI's and MPICH's mpi.h pull in their deprecated C++ bindings,
// which need libmpi_cxx.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/absl_compat.h"
#include "comm/comm_internal.h"
#include "ferry/comm.h"
#include "ferry/status.h"

namespace ferry {
namespace {

using comm_internal::CallShape;
using comm_internal::Collective;
using comm_internal::DescribeCall;
using comm_internal::Prefixed;
using comm_internal::RankList;
using comm_internal::RankName;

// Every MPI error code becomes a Status here.
absl::Status MpiError(absl::string_view context, int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) len = 0;
  return absl::InternalError(absl::StrCat(context, ": MPI error ", code, ": ",
                                          len > 0 ? absl::string_view(text, len) : "(no description)"));
}

#define FERRY_MPI_CALL_(context, call)                             \
  do {                                                             \
    int mpi_rc_ = (call);                                          \
    if (mpi_rc_ != MPI_SUCCESS) return MpiError(context, mpi_rc_); \
  } while (0)

std::mutex init_mu;  // std::mutex, as everywhere in Ferry: TSan sees it

void FinalizeAtExit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

// Initialises MPI with MPI_THREAD_MULTIPLE unless someone has; finalises it at exit if we did.
absl::Status EnsureMpiInitialized() {
  std::lock_guard<std::mutex> lock(init_mu);
  int initialized = 0, finalized = 0;
  FERRY_MPI_CALL_("MPI_Initialized", MPI_Initialized(&initialized));
  FERRY_MPI_CALL_("MPI_Finalized", MPI_Finalized(&finalized));
  if (finalized) return absl::FailedPreconditionError("MakeMpiComm: MPI has been finalized already");
  if (initialized) return absl::OkStatus();
  int provided = 0;
  FERRY_MPI_CALL_("MPI_Init_thread(MPI_THREAD_MULTIPLE)",
                  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided));
  std::atexit(FinalizeAtExit);
  return absl::OkStatus();
}

// One rank's call, as the arrival exchange sends it (kArrivalInts MPI_INT64_T): a CallShape with a
// sequence number. `count`: AllReduce's number of values, AllGather's blob size, Broadcast's blob size
// (the root's is the one used).
struct Arrival {
  int64_t seq = 0;
  int64_t collective = 0;
  int64_t op = 0;
  int64_t count = 0;
  int64_t root = 0;
};
constexpr int kArrivalInts = 5;
constexpr int64_t Int(Collective c) { return static_cast<int64_t>(c); }
static_assert(sizeof(Arrival) == kArrivalInts * sizeof(int64_t));
constexpr int kArrivalTag = 0x4665;  // "Fe"

CallShape ShapeOf(const Arrival& a) {
  return {.collective = static_cast<Collective>(a.collective), .op = static_cast<ReduceOp>(a.op),
          .count = a.count, .root = a.root};
}

MPI_Op MpiOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return MPI_SUM;
    case ReduceOp::kMax: return MPI_MAX;
    case ReduceOp::kMin: return MPI_MIN;
  }
  return MPI_SUM;
}

// The buffers and requests of one collective, owned here and never the caller's (see the top).
struct Pending {
  std::vector<Arrival> arrivals;          // [world]: every rank's call, this rank's at [rank]
  std::vector<MPI_Request> recvs, sends;  // the arrival exchange; recvs[peer] (own: MPI_REQUEST_NULL)
  MPI_Request request = MPI_REQUEST_NULL; // the collective
  std::vector<double> values;             // AllReduce
  std::string send, recv;                 // AllGather, Broadcast
  std::vector<int> counts, displs;        // AllGather
  MPI_Comm duplicate = MPI_COMM_NULL;     // Duplicate
};

// Where the Pending of collectives that timed out go: alive until the process exits.
std::mutex graveyard_mu;
std::vector<std::unique_ptr<Pending>>* graveyard ABSL_GUARDED_BY(graveyard_mu) = nullptr;

void Bury(std::unique_ptr<Pending> p) {
  std::lock_guard<std::mutex> lock(graveyard_mu);
  if (graveyard == nullptr) graveyard = new std::vector<std::unique_ptr<Pending>>();
  graveyard->push_back(std::move(p));
}

// Polls until every request of `requests` completed (each becomes MPI_REQUEST_NULL): true; or until
// `deadline` passed first: false, and the requests that did complete are MPI_REQUEST_NULL.
absl::StatusOr<bool> PollUntil(absl::Span<MPI_Request> requests, absl::Time deadline, absl::string_view what) {
  absl::Duration nap = absl::Microseconds(20);
  while (true) {
    int done = 0;
    FERRY_MPI_CALL_(absl::StrCat("MPI_Testall (", what, ")"),
                    MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done, MPI_STATUSES_IGNORE));
    if (done) return true;
    if (absl::Now() >= deadline) break;
    absl::SleepFor(nap);
    nap = std::min(nap * 2, absl::Milliseconds(1));
  }
  // MPI_Testall changes nothing unless all completed: test one by one to learn which did.
  for (MPI_Request& r : requests) {
    int done = 0;
    FERRY_MPI_CALL_(absl::StrCat("MPI_Test (", what, ")"), MPI_Test(&r, &done, MPI_STATUS_IGNORE));
  }
  return false;
}

// A duplicate of an MPI communicator. Not thread-safe: one thread at a time (Duplicate gives a comm
// for another thread).
class MpiComm final : public Comm {
 public:
  // Takes ownership of `comm`.
  MpiComm(MPI_Comm comm, int rank, int world) : comm_(comm), rank_(rank), world_(world) {}
  ~MpiComm() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    // Pending operations (of a collective that timed out) complete normally after the free.
    if (!finalized) MPI_Comm_free(&comm_);
  }

  static absl::StatusOr<std::unique_ptr<Comm>> Adopt(MPI_Comm comm, absl::string_view context) {
    int rank = 0, world = 0;
    FERRY_MPI_CALL_(absl::StrCat(context, ": MPI_Comm_set_errhandler"),
                    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN));
    FERRY_MPI_CALL_(absl::StrCat(context, ": MPI_Comm_rank"), MPI_Comm_rank(comm, &rank));
    FERRY_MPI_CALL_(absl::StrCat(context, ": MPI_Comm_size"), MPI_Comm_size(comm, &world));
    return std::unique_ptr<Comm>(std::make_unique<MpiComm>(comm, rank, world));
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string_view kind() const override { return "mpi"; }

  absl::Status Barrier(absl::Duration timeout) override {
    return Run({.collective = Int(Collective::kBarrier)}, timeout, [&](Pending& p) {
      FERRY_MPI_CALL_("MPI_Ibarrier", MPI_Ibarrier(comm_, &p.request));
      return absl::OkStatus();
    }, nullptr);
  }

  absl::Status AllReduce(absl::Span<double> values, ReduceOp op, absl::Duration timeout) override {
    if (values.size() > static_cast<size_t>(INT_MAX)) {
      return absl::InvalidArgumentError(absl::StrCat(Where("AllReduce"), ": ", values.size(),
                                                     " values, more than MPI's int count allows"));
    }
    const int n = static_cast<int>(values.size());
    return Run(
        {.collective = Int(Collective::kAllReduce), .op = static_cast<int64_t>(op), .count = n}, timeout,
        [&](Pending& p) {
          p.values.assign(values.begin(), values.end());
          FERRY_MPI_CALL_("MPI_Iallreduce", MPI_Iallreduce(MPI_IN_PLACE, p.values.data(), n, MPI_DOUBLE,
                                                           MpiOp(op), comm_, &p.request));
          return absl::OkStatus();
        },
        [&](Pending& p) { std::copy(p.values.begin(), p.values.end(), values.begin()); });
  }

  absl::StatusOr<std::vector<std::string>> AllGather(std::string_view mine, absl::Duration timeout) override {
    if (mine.size() > static_cast<size_t>(INT_MAX)) {
      return absl::InvalidArgumentError(absl::StrCat(Where("AllGather"), ": a blob of ", mine.size(),
                                                     " bytes, more than MPI's int count allows"));
    }
    std::vector<std::string> all(world_);
    absl::Status s = Run(
        {.collective = Int(Collective::kAllGather), .count = static_cast<int64_t>(mine.size())}, timeout,
        [&](Pending& p) -> absl::Status {
          int64_t total = 0;
          for (const Arrival& a : p.arrivals) {
            p.displs.push_back(static_cast<int>(total));
            p.counts.push_back(static_cast<int>(a.count));
            total += a.count;
            if (total > INT_MAX) {
              return absl::InvalidArgumentError(absl::StrCat(
                  "the blobs of all ranks add up to more than MPI's int count allows (", INT_MAX, " bytes)"));
            }
          }
          if (total == 0) return absl::OkStatus();  // every rank knows: no collective
          p.send.assign(mine.data(), mine.size());
          p.recv.resize(total);
          FERRY_MPI_CALL_("MPI_Iallgatherv",
                          MPI_Iallgatherv(p.send.data(), static_cast<int>(p.send.size()), MPI_BYTE, p.recv.data(),
                                          p.counts.data(), p.displs.data(), MPI_BYTE, comm_, &p.request));
          return absl::OkStatus();
        },
        [&](Pending& p) {
          if (p.recv.empty()) return;
          for (int r = 0; r < world_; ++r) all[r] = p.recv.substr(p.displs[r], p.counts[r]);
        });
    if (!s.ok()) return s;
    return all;
  }

  absl::Status Broadcast(std::string* blob, int root, absl::Duration timeout) override {
    if (blob->size() > static_cast<size_t>(INT_MAX)) {
      return absl::InvalidArgumentError(absl::StrCat(Where("Broadcast"), ": a blob of ", blob->size(),
                                                     " bytes, more than MPI's int count allows"));
    }
    return Run(
        {.collective = Int(Collective::kBroadcast), .count = static_cast<int64_t>(blob->size()), .root = root}, timeout,
        [&](Pending& p) {
          const int64_t size = p.arrivals[root].count;
          if (size == 0) return absl::OkStatus();
          p.recv = rank_ == root ? *blob : std::string(size, '\0');
          FERRY_MPI_CALL_("MPI_Ibcast", MPI_Ibcast(p.recv.data(), static_cast<int>(size), MPI_BYTE, root,
                                                   comm_, &p.request));
          return absl::OkStatus();
        },
        [&](Pending& p) { *blob = std::move(p.recv); });
  }

  absl::StatusOr<std::unique_ptr<Comm>> Duplicate(absl::Duration timeout) override {
    int provided = 0;
    FERRY_MPI_CALL_("MPI_Query_thread", MPI_Query_thread(&provided));
    if (provided < MPI_THREAD_MULTIPLE) {
      return absl::FailedPreconditionError(absl::StrCat(
          Where("Duplicate"), ": a duplicate is for another thread, which needs MPI initialised with "
          "MPI_THREAD_MULTIPLE, but this process has thread level ", provided, " (MPI_THREAD_MULTIPLE is ",
          MPI_THREAD_MULTIPLE, "); initialise MPI with MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...), or let "
          "MakeMpiComm initialise it, with an MPI library that supports it"));
    }
    MPI_Comm dup = MPI_COMM_NULL;
    FERRY_RETURN_IF_ERROR(Run({.collective = Int(Collective::kDuplicate)}, timeout, [&](Pending& p) {
      FERRY_MPI_CALL_("MPI_Comm_idup", MPI_Comm_idup(comm_, &p.duplicate, &p.request));
      return absl::OkStatus();
    }, [&](Pending& p) { dup = p.duplicate; }));
    return Adopt(dup, Where("Duplicate"));
  }

 private:
  std::string Where(absl::string_view collective) const {
    return comm_internal::Where("mpi", rank_, world_, collective);
  }

  // One collective: the arrival exchange of `mine`, then start(p) (which may start p.request, or leave
  // it null when there is nothing to exchange), polled to completion, then finish(p) (may be null).
  // Every failure names this rank and the collective; timeouts and MPI errors poison the comm.
  template <typename Start, typename Finish>
  absl::Status Run(Arrival mine, absl::Duration timeout, Start start, Finish finish) {
    const std::string where = Where(comm_internal::CollectiveName(ShapeOf(mine).collective));
    if (!poisoned_.ok()) return Prefixed(absl::StrCat(where, ": unusable after an earlier failure"), poisoned_);
    const absl::Time deadline = absl::Now() + timeout;
    auto p = std::make_unique<Pending>();
    mine.seq = ++seq_;
    absl::Status s = Arrive(*p, mine, deadline, timeout);
    if (s.ok()) s = start(*p);
    if (s.ok() && p->request != MPI_REQUEST_NULL) {
      absl::StatusOr<bool> done = PollUntil(absl::MakeSpan(&p->request, 1), deadline, "the collective");
      if (!done.ok()) {
        s = done.status();
      } else if (!*done) {
        s = absl::DeadlineExceededError(absl::StrCat(
            "timed out after ", absl::FormatDuration(timeout),
            " inside the collective, after every rank had arrived (a rank failed or gave up)"));
      }
    }
    if (s.ok()) {
      if constexpr (!std::is_same_v<Finish, std::nullptr_t>) finish(*p);
      return s;
    }
    s = Prefixed(where, s);
    if (s.code() == absl::StatusCode::kDeadlineExceeded) {  // once: what a later call reports starts with it
      s = absl::Status(s.code(),
                       absl::StrCat(s.message(), " (see engine/TROUBLESHOOTING.md#a-rank-timed-out-or-was-lost)"));
    }
    if (s.code() != absl::StatusCode::kInvalidArgument) {
      poisoned_ = s;
      Bury(std::move(p));  // its requests may still be pending
    }
    return s;
  }

  // The arrival exchange (see the top): fills p.arrivals with every rank's call, or fails naming the
  // ranks whose call did not arrive by `deadline`, or the first rank whose call differs from rank 0's.
  absl::Status Arrive(Pending& p, const Arrival& mine, absl::Time deadline, absl::Duration timeout) {
    p.arrivals.assign(world_, Arrival());
    p.arrivals[rank_] = mine;
    p.recvs.assign(world_, MPI_REQUEST_NULL);
    p.sends.assign(world_, MPI_REQUEST_NULL);
    for (int peer = 0; peer < world_; ++peer) {
      if (peer == rank_) continue;
      FERRY_MPI_CALL_("MPI_Irecv (arrival)", MPI_Irecv(&p.arrivals[peer], kArrivalInts, MPI_INT64_T, peer,
                                                       kArrivalTag, comm_, &p.recvs[peer]));
      FERRY_MPI_CALL_("MPI_Isend (arrival)", MPI_Isend(&p.arrivals[rank_], kArrivalInts, MPI_INT64_T, peer,
                                                       kArrivalTag, comm_, &p.sends[peer]));
    }
    FERRY_ASSIGN_OR_RETURN(bool arrived, PollUntil(absl::MakeSpan(p.recvs), deadline, "arrival"));
    if (!arrived) {
      std::vector<int> missing;
      for (int peer = 0; peer < world_; ++peer)
        if (p.recvs[peer] != MPI_REQUEST_NULL) missing.push_back(peer);
      return absl::DeadlineExceededError(absl::StrCat("timed out after ", absl::FormatDuration(timeout),
                                                      "; had not arrived: ", RankList(missing)));
    }
    // Our descriptor reached every peer that posted its receive; the sends complete at once (40 bytes).
    FERRY_ASSIGN_OR_RETURN(bool sent, PollUntil(absl::MakeSpan(p.sends), deadline, "arrival sends"));
    if (!sent) return absl::DeadlineExceededError("timed out sending this rank's arrival");
    std::vector<CallShape> shapes;
    for (int r = 0; r < world_; ++r) {
      if (p.arrivals[r].seq != mine.seq) {
        return absl::InternalError(absl::StrCat(RankName(r, world_), " is at collective #", p.arrivals[r].seq,
                                                ", this rank at #", mine.seq, " (",
                                                DescribeCall(ShapeOf(p.arrivals[r])), " there, ",
                                                DescribeCall(ShapeOf(mine)), " here)"));
      }
      shapes.push_back(ShapeOf(p.arrivals[r]));
    }
    return comm_internal::CheckCallsAgree(shapes);
  }

  MPI_Comm comm_;
  const int rank_;
  const int world_;
  int64_t seq_ = 0;         // collectives started on this comm
  absl::Status poisoned_;   // the first timeout or MPI error
};

}  // namespace

bool BuiltWithMpi() { return true; }

absl::StatusOr<std::unique_ptr<Comm>> MakeMpiComm() {
  FERRY_RETURN_IF_ERROR(EnsureMpiInitialized());
  MPI_Comm comm = MPI_COMM_NULL;
  FERRY_MPI_CALL_("MakeMpiComm: MPI_Comm_dup(MPI_COMM_WORLD)", MPI_Comm_dup(MPI_COMM_WORLD, &comm));
  return MpiComm::Adopt(comm, "MakeMpiComm");
}

}  // namespace ferry
