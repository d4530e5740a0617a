// CheckpointWriter: checkpoint saves on a background thread, with a pool of I/O threads writing the
// chunks of each rank file in parallel. The caller hands over a snapshot (host memory it promises
// not to modify until the save is reported finished) and goes on; Wait/Poll report the outcome,
// and an error is kept until one of them (or the next Start) has delivered it: never lost.
#ifndef FERRY_CKPT_CHECKPOINT_WRITER_H_
#define FERRY_CKPT_CHECKPOINT_WRITER_H_

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/thread_pool.h"
#include "ckpt/checkpoint.h"
#include "ckpt/distributed_checkpoint.h"

namespace ferry {

// One save: everything WriteShardedCheckpoint takes. The tensors' `data` is borrowed (see Start).
struct CheckpointJob {
  std::string root;
  int64_t step = 0;
  int world_size = 1;  // ranks simulated in this process (1 for a single-process trainer)
  std::vector<TensorRecord> tensors;
  std::vector<SkipRecord> skipped;
  std::map<std::string, std::string> metadata;
  CheckpointWriteOptions options;  // `pool` is replaced by the writer's own I/O pool
  // Several ranks in several processes (or threads): non-null runs WriteDistributedCheckpoint over
  // this comm (borrowed until the save finished; every rank starts the same save), with `tensors`
  // holding this rank's data and `pieces` its ranges; `world_size` is then ignored.
  Comm* comm = nullptr;
  absl::Duration comm_timeout = absl::Minutes(60);
  std::vector<ShardPiece> pieces;
  // Called once the save has finished, whatever its outcome, before Wait or Poll report it (on the
  // thread that wrote it): the tensors' bytes are no longer read.
  std::function<void()> on_finished;
};

// One thread at a time (the trainer's): the background work is internal. The destructor waits for
// the save in flight and joins every thread; an error nobody collected is logged, not dropped
// silently.
class CheckpointWriter final {
 public:
  // `io_threads` (>= 1) write chunks in parallel; 0 picks min(4, CPUs).
  explicit CheckpointWriter(size_t io_threads = 0);
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // Writes `job` now, on the calling thread and the I/O pool; returns the committed directory.
  // First delivers an uncollected error of an earlier background save (returning it, and writing
  // nothing). REQUIRES: no save in flight (FailedPrecondition otherwise).
  absl::StatusOr<std::string> Write(const CheckpointJob& job);

  // Starts `job` in the background and returns at once. The bytes of job.tensors must stay valid
  // and unchanged until Wait returns or Poll returns a value. Returns (and clears) an uncollected
  // error of an earlier save instead of starting. REQUIRES: no save in flight
  // (FailedPrecondition otherwise: call Wait first).
  absl::Status Start(CheckpointJob job);

  // Blocks until no save is in flight; returns the error of a finished save not yet delivered (and
  // clears it), else OK.
  absl::Status Wait();

  // Blocks until no save is in flight; an error stays to be delivered by Wait, Poll or Start.
  void WaitIdle();

  // nullopt while a save is in flight; otherwise what Wait would return, without blocking.
  std::optional<absl::Status> Poll();

  // Whether a save is in flight.
  bool busy();

  // The directory of the last save that committed (empty if none).
  std::string last_committed();

 private:
  void Loop();
  // The save itself, on the calling thread and the I/O pool.
  absl::StatusOr<std::string> WriteJob(const CheckpointJob& job);

  ThreadPool io_pool_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::optional<CheckpointJob> job_ ABSL_GUARDED_BY(mu_);  // waiting to be picked up
  bool running_ ABSL_GUARDED_BY(mu_) = false;              // a job is queued or being written
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status error_ ABSL_GUARDED_BY(mu_);  // of a finished save, not yet delivered
  std::string last_committed_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;  // last: starts after everything above is initialised
};

}  // namespace ferry

#endif  // FERRY_CKPT_CHECKPOINT_WRITER_H_
