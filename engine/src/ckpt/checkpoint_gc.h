// Crash garbage of a checkpoint root, and the lock that tells it from a save in flight.
//
// A save killed before its commit leaves <root>/step-<N>.incomplete; one killed while keep_last
// deletes an old checkpoint leaves <root>/step-<N>.deleting. Each is as large as a checkpoint and
// nothing reads it. CollectStaleCheckpoints removes them, safely:
//
//   * Liveness. A directory being written or deleted holds a lock file, <dir>/.ferry-save.lock,
//     flock()ed (LOCK_EX) by the process that writes or deletes it for the whole of that work
//     (rank 0's process, from PendingCheckpoint::Begin to the end of the commit or abort). The lock
//     file is created before anything else in the directory and removed after everything else, so
//     a directory with content and no lock file is never one of ours in flight. The collector takes
//     a directory only when it gets that lock without blocking (a live holder, in this process or
//     any other, makes it skip the directory), and removes it while holding the lock. A directory
//     without a lock file is taken if it is empty (a crash between its mkdir and its lock file:
//     rmdir fails on anything non-empty, and a writer that loses that race retries), or if it has
//     content (no save of this Ferry writes anything before its lock file: a leftover of an older
//     Ferry, which had none; such a save running at the same time was never supported).
//   * Containment. Only entries of `root` itself whose names are exactly step-<digits>.incomplete
//     or step-<digits>.deleting, and that are real directories (lstat: a symlink is never taken, nor
//     followed), are candidates. Removal never follows a symlink inside them (unlinks the link).
//   * One collector. It runs inside PendingCheckpoint::Begin, that is at the start of every save, on
//     the one rank that begins it (rank 0); the other ranks wait for rank 0's agreement before they
//     touch the root. Loading a checkpoint never collects: readers may be read-only consumers (an
//     evaluation job, `ferry inspect`) and do not make the root grow.
//   * Limits. flock() is advisory and local to one kernel: it protects against saves of processes on
//     the same host, and across hosts only where the filesystem propagates flock (Linux NFS clients
//     emulate it with byte-range locks that the server sees, NFSv4 or NLM; some FUSE and object-store
//     filesystems do not, and a lock is lost with a client whose lease expires). Where flock() fails
//     as unsupported, saves go on unlocked (with a warning) and the collector leaves every leftover
//     that has a lock file alone, since it cannot tell a live one. Rank 0 holds the lock
//     for every rank: another rank still writing its file into a directory whose rank 0 died loses
//     it (that save could not commit anyway). A racer that swaps a directory for a symlink between
//     the checks and the unlinks is out of scope (the root is the trainer's own directory).
#ifndef FERRY_CKPT_CHECKPOINT_GC_H_
#define FERRY_CKPT_CHECKPOINT_GC_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ferry {

inline constexpr absl::string_view kSaveLockFileName = ".ferry-save.lock";

// The exclusive lock on a checkpoint directory being written or deleted (see above). Move-only;
// the lock is released when the object is destroyed or Release is called. One thread at a time.
class SaveLock final {
 public:
  // Creates directory `dir` (mode 0755; its parent must exist) with its lock file, locked.
  // AlreadyExists if `dir` exists; I/O errors with the path.
  static absl::StatusOr<SaveLock> CreateDir(const std::string& dir);
  // Locks the existing directory `dir` (a real directory, not a symlink), creating its lock file if
  // missing; with `wait` blocks while another holder has it, else returns FailedPrecondition
  // ("in use"). NotFound if `dir` is gone.
  static absl::StatusOr<SaveLock> LockDir(const std::string& dir, bool wait);

  SaveLock() = default;
  SaveLock(SaveLock&& other) noexcept;
  SaveLock& operator=(SaveLock&& other) noexcept;
  ~SaveLock();

  bool held() const { return fd_ >= 0; }
  // Unlocks and closes (the lock file stays). No-op when not held.
  void Release();

 private:
  explicit SaveLock(int fd) : fd_(fd) {}
  int fd_ = -1;
};

// Removes directory `dir`, whose SaveLock the caller holds: everything in it but the lock file (never
// following symlinks), then the lock file, then the directory itself.
absl::Status RemoveLockedDir(const std::string& dir);

// One leftover directory of a root and what the collector makes of it.
struct StaleCheckpointDir {
  std::string name;    // "step-00000007.incomplete"
  uint64_t bytes = 0;  // sum of the sizes of the regular files in it
  bool removable = false;  // false: in use by a live save (see `reason`)
  std::string reason;      // why it is (or is not) removable, for the log and `ferry inspect`
};

// The leftover directories of `root` (names as above), each probed without changing anything: the
// lock is tried and released at once. Sorted by name. NotFound if root does not exist.
absl::StatusOr<std::vector<StaleCheckpointDir>> FindStaleCheckpoints(const std::string& root);

// Removes the removable leftovers of `root` and returns what was removed (each also logged, with its
// bytes). A leftover that cannot be removed is logged as a warning and skipped: collecting garbage
// never fails a save. With `sync` the root is fsynced after a removal. OK (and nothing) if root does
// not exist.
std::vector<StaleCheckpointDir> CollectStaleCheckpoints(const std::string& root, bool sync);

}  // namespace ferry

#endif  // FERRY_CKPT_CHECKPOINT_GC_H_
