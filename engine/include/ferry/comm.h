// Ferry's comm layer (public: a trainer may implement Comm itself): coordination between the ranks
// of a multi-process trainer, behind one interface.
//
// Only small collectives: a barrier, an all-reduce of a few doubles, all-gather and broadcast of small
// byte blobs (specs, chunk tables, statuses). Bulk tensor traffic (grad reduce-scatter, param
// all-gather) stays the trainer's. Every collective has a timeout, and nothing ever hangs: a rank that
// does not arrive in time makes the others return DeadlineExceeded naming it (where the
// implementation can tell which), and a rank that reports a failure (see AgreeStatus) makes every
// rank return an error that names it.
//
// Implementations:
//   - single process (MakeSingleProcessComm): world size 1, every collective returns at once;
//   - in-process group (MakeThreadComms): W comms for W threads of one process, for tests and for
//     trainers that run one engine per thread;
//   - MPI (comm/mpi, built when CMake finds MPI): MakeMpiComm;
//   - callbacks (MakeCallbackComm): the trainer's own collectives (NCCL/gloo/torch.distributed),
//     given as functions; the C ABI's ferry_comm_callbacks maps onto it.
// The comm layer knows nothing of MPI outside its MPI implementation.
#ifndef FERRY_COMM_H_
#define FERRY_COMM_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace ferry {

enum class ReduceOp : uint8_t { kSum, kMax, kMin };
std::string_view ReduceOpName(ReduceOp op);  // "sum", "max", "min"

// A communicator over `world_size` ranks. Every rank calls the same collectives in the same order
// (from one thread at a time per Comm object: use Duplicate() for a second thread). Errors:
// DeadlineExceeded when the collective did not complete within `timeout` (naming the ranks that did
// not arrive when known); Unavailable when a peer is gone (naming it); InvalidArgument for a bad call
// (sizes that differ between ranks where they must agree, a root out of range). After an error other
// than InvalidArgument the communicator may be unusable: later calls fail fast with the same error.
class Comm {
 public:
  virtual ~Comm() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // "single process", "threads", "mpi", "callbacks": for messages.
  virtual std::string_view kind() const = 0;

  virtual absl::Status Barrier(absl::Duration timeout) = 0;

  // Element-wise reduction of `values` across ranks, in place. Every rank passes the same count.
  // Sums of doubles are exact when every partial sum is (integers below 2^53): callers that need a
  // result independent of the world size reduce integers held in doubles.
  virtual absl::Status AllReduce(absl::Span<double> values, ReduceOp op, absl::Duration timeout) = 0;

  // Every rank's blob (any size, may differ between ranks, may be empty), indexed by rank.
  virtual absl::StatusOr<std::vector<std::string>> AllGather(std::string_view mine,
                                                             absl::Duration timeout) = 0;

  // Root's `*blob` replaces every other rank's. REQUIRES: 0 <= root < world_size().
  virtual absl::Status Broadcast(std::string* blob, int root, absl::Duration timeout) = 0;

  // A communicator over the same ranks whose collectives are independent of this one's (a writer
  // thread runs its own while the trainer's thread runs this one's). Collective: every rank calls it.
  // Unimplemented where the implementation cannot (callbacks without a `duplicate` function).
  virtual absl::StatusOr<std::unique_ptr<Comm>> Duplicate(absl::Duration timeout) = 0;
};

// Every rank passes its own outcome of some step; every rank gets the same answer: OK when every rank
// was OK, else an error with the code of the lowest failing rank and a message naming each failing
// rank with its message ("rank 2 of 4: ...; rank 3 of 4: ..."), prefixed by `what`. When the exchange
// itself fails, that error (naming `what`). One AllGather.
absl::Status AgreeStatus(Comm& comm, const absl::Status& mine, std::string_view what,
                         absl::Duration timeout);

// World size 1: every collective completes at once (AllGather returns {mine}).
std::unique_ptr<Comm> MakeSingleProcessComm();

// `world_size` communicators of one in-process group: comms[r] is rank r, to be used from its own
// thread. Destroying one makes the others' collectives (those waiting and every later one) return
// Unavailable naming that rank; a rank that does not arrive in time is named in the others'
// DeadlineExceeded, and the group then fails every later call at once. Calls that disagree
// (collective, AllReduce count or op, Broadcast root) return InvalidArgument naming the disagreeing
// rank on every rank, and the group stays usable. The comms of a group may be used concurrently, each
// from one thread at a time. An empty vector when world_size < 1.
std::vector<std::unique_ptr<Comm>> MakeThreadComms(int world_size);

// The trainer's collectives. Each function returns OK or an error (its message is kept); each gets
// the timeout in seconds and should honour it. all_reduce and all_gather are required; barrier and
// broadcast are derived from them when absent; duplicate is optional (see Comm::Duplicate).
struct CommCallbacks {
  int rank = 0;
  int world_size = 1;
  // values[0..n) reduced in place across ranks.
  std::function<absl::Status(double* values, size_t n, ReduceOp op, double timeout_s)> all_reduce;
  // Each rank contributes `bytes` bytes (the same count on every rank); out receives
  // world_size * bytes, rank r's at out + r * bytes.
  std::function<absl::Status(const void* mine, size_t bytes, void* out, double timeout_s)> all_gather;
  std::function<absl::Status(double timeout_s)> barrier;
  std::function<absl::Status(void* data, size_t bytes, int root, double timeout_s)> broadcast;
  std::function<absl::StatusOr<CommCallbacks>(double timeout_s)> duplicate;
};

// InvalidArgument for a rank outside [0, world_size) or a missing required function.
absl::StatusOr<std::unique_ptr<Comm>> MakeCallbackComm(CommCallbacks callbacks);

// True when this build includes the MPI implementation.
bool BuiltWithMpi();

// A duplicate of MPI_COMM_WORLD (MPI_Comm_dup: collective and blocking, so every process calls it),
// initialising MPI with MPI_THREAD_MULTIPLE if nobody has (and then finalising it at exit). Its
// collectives are non-blocking MPI operations polled until the timeout, so none blocks past it, and a
// DeadlineExceeded names the ranks that had not arrived; they check that every rank made the same call
// (InvalidArgument otherwise). Duplicate needs MPI initialised with MPI_THREAD_MULTIPLE
// (FailedPrecondition otherwise). Unimplemented in a build without MPI (see BuiltWithMpi).
absl::StatusOr<std::unique_ptr<Comm>> MakeMpiComm();

}  // namespace ferry

#endif  // FERRY_COMM_H_
