#include "ckpt/checkpoint_gc.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/errors.h"
#include "base/logging.h"
#include "ckpt/checkpoint_root.h"
#include "ckpt/posix_file.h"
#include "ferry/status.h"

namespace ferry {
namespace {

// A writer that loses its fresh directory to a collector (see CreateDir) tries again this often.
constexpr int kCreateAttempts = 4;

bool SameFile(const struct stat& a, const struct stat& b) { return a.st_dev == b.st_dev && a.st_ino == b.st_ino; }

// Opens (or creates) the lock file of `dir` and locks it; returns the descriptor, or -1 if another
// holder has it and `wait` is false. After the lock is taken, checks that the lock file is still
// the one inside `dir` (a collector may have removed the directory meanwhile): NotFound otherwise.
absl::StatusOr<int> OpenAndLock(const std::string& dir, bool create_exclusive, bool wait) {
  const std::string path = JoinPath(dir, kSaveLockFileName);
  const int flags = O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC | (create_exclusive ? O_EXCL : 0);
  const int fd = ::open(path.c_str(), flags, 0644);
  if (fd < 0) return PosixError(absl::StrCat("open ", path), errno);
  int rc;
  do {
    rc = ::flock(fd, LOCK_EX | (wait ? 0 : LOCK_NB));
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    const int err = errno;
    if (err == EWOULDBLOCK) {
      ::close(fd);
      return -1;
    }
    if (err == ENOLCK || err == EOPNOTSUPP || err == ENOSYS || err == EINVAL) {
      // The file system has no flock(): the descriptor is returned unlocked (see CreateDir, Probe).
      if (!create_exclusive) ::close(fd);
      if (!create_exclusive) return absl::UnimplementedError(absl::StrCat("flock ", path, ": ", std::strerror(err)));
      FERRY_LOG(WARNING) << "flock " << path << ": " << std::strerror(err)
                         << ": this file system has no locks; a collector elsewhere cannot tell this save is live";
      return fd;
    }
    ::close(fd);
    return PosixError(absl::StrCat("flock ", path), err);
  }
  struct stat held, now;
  if (::fstat(fd, &held) != 0 || ::lstat(path.c_str(), &now) != 0 || !SameFile(held, now)) {
    ::close(fd);
    return absl::NotFoundError(absl::StrCat(dir, " was removed while it was being locked"));
  }
  return fd;
}

// The sum of the regular files' sizes under `path`. Never follows a symlink.
absl::Status Measure(const std::string& path, uint64_t* bytes) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return PosixError(absl::StrCat("lstat ", path), errno);
  if (S_ISREG(st.st_mode)) *bytes += static_cast<uint64_t>(st.st_size);
  if (!S_ISDIR(st.st_mode)) return absl::OkStatus();
  FERRY_ASSIGN_OR_RETURN(std::vector<std::string> names, ListDir(path));
  for (const std::string& name : names) FERRY_RETURN_IF_ERROR(Measure(JoinPath(path, name), bytes));
  return absl::OkStatus();
}

// The candidate `name` of `root` probed; with `take` the lock is kept in *lock when removable.
absl::StatusOr<StaleCheckpointDir> Probe(const std::string& root, const std::string& name, bool take,
                                         std::optional<SaveLock>* lock) {
  const std::string dir = JoinPath(root, name);
  StaleCheckpointDir out;
  out.name = name;
  FERRY_RETURN_IF_ERROR(Measure(dir, &out.bytes));
  struct stat st;
  const std::string lock_path = JoinPath(dir, kSaveLockFileName);
  if (::lstat(lock_path.c_str(), &st) == 0) {
    if (!S_ISREG(st.st_mode)) {
      out.reason = absl::StrCat(kSaveLockFileName, " is not a regular file: left alone");
      return out;
    }
    absl::StatusOr<SaveLock> l = SaveLock::LockDir(dir, /*wait=*/false);
    if (absl::IsFailedPrecondition(l.status())) {
      out.reason = "in use: a live save holds its lock";
      return out;
    }
    if (absl::IsUnimplemented(l.status())) {
      out.reason = "the file system has no flock(), so whether a save is writing it cannot be told: left alone";
      return out;
    }
    FERRY_RETURN_IF_ERROR(l.status());
    out.removable = true;
    out.reason = "left by a crashed save (its lock is free)";
    if (take) lock->emplace(*std::move(l));
    return out;
  }
  if (errno != ENOENT) return PosixError(absl::StrCat("lstat ", lock_path), errno);
  FERRY_ASSIGN_OR_RETURN(std::vector<std::string> names, ListDir(dir));
  if (names.empty()) {
    out.removable = true;  // removed with rmdir, which refuses a directory a writer has just filled
    out.reason = "empty, no lock file (a save killed as it began)";
    return out;
  }
  // Every save of this Ferry creates its lock file before anything else in the directory: content
  // without one is a leftover of a Ferry that had no lock files (or of something else that named a
  // directory like a leftover).
  out.removable = true;
  out.reason = "no lock file: not a save in flight (left by an older Ferry)";
  if (take) {
    absl::StatusOr<SaveLock> l = SaveLock::LockDir(dir, /*wait=*/false);
    if (!l.ok()) {
      out.removable = false;
      out.reason = absl::StrCat("could not be locked: ", l.status().message());
      return out;
    }
    lock->emplace(*std::move(l));
  }
  return out;
}

absl::StatusOr<std::vector<std::string>> CandidateNames(const std::string& root) {
  FERRY_ASSIGN_OR_RETURN(std::vector<std::string> names, ListDir(root));
  std::vector<std::string> out;
  for (std::string& name : names) {
    if (!ParseStepDirNameWithSuffix(name, kCheckpointIncompleteSuffix).has_value() &&
        !ParseStepDirNameWithSuffix(name, kCheckpointDeletingSuffix).has_value()) {
      continue;
    }
    struct stat st;
    const std::string path = JoinPath(root, name);
    if (::lstat(path.c_str(), &st) != 0) {
      if (errno == ENOENT) continue;  // removed meanwhile
      return PosixError(absl::StrCat("lstat ", path), errno);
    }
    if (S_ISDIR(st.st_mode)) out.push_back(std::move(name));  // never a symlink, nor a file
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

absl::StatusOr<SaveLock> SaveLock::CreateDir(const std::string& dir) {
  for (int attempt = 1;; ++attempt) {
    if (::mkdir(dir.c_str(), 0755) != 0) {
      if (errno == EEXIST) return absl::AlreadyExistsError(absl::StrCat(dir, " already exists"));
      return PosixError(absl::StrCat("mkdir ", dir), errno);
    }
    absl::StatusOr<int> fd = OpenAndLock(dir, /*create_exclusive=*/true, /*wait=*/true);
    // A collector took the fresh, empty directory before its lock file existed (open: ENOENT), or
    // between the lock file's creation and its flock (NotFound): make it again.
    if (absl::IsNotFound(fd.status()) && attempt < kCreateAttempts) continue;
    FERRY_RETURN_IF_ERROR(fd.status());
    return SaveLock(*fd);
  }
}

absl::StatusOr<SaveLock> SaveLock::LockDir(const std::string& dir, bool wait) {
  struct stat st;
  if (::lstat(dir.c_str(), &st) != 0) return PosixError(absl::StrCat("lstat ", dir), errno);
  if (!S_ISDIR(st.st_mode)) return absl::FailedPreconditionError(absl::StrCat(dir, " is not a directory"));
  FERRY_ASSIGN_OR_RETURN(int fd, OpenAndLock(dir, /*create_exclusive=*/false, wait));
  if (fd < 0) return absl::FailedPreconditionError(absl::StrCat(dir, " is in use by a live save"));
  return SaveLock(fd);
}

SaveLock::SaveLock(SaveLock&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}

SaveLock& SaveLock::operator=(SaveLock&& other) noexcept {
  if (this != &other) {
    Release();
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

SaveLock::~SaveLock() { Release(); }

void SaveLock::Release() {
  if (fd_ < 0) return;
  ::close(fd_);  // drops the flock
  fd_ = -1;
}

absl::Status RemoveLockedDir(const std::string& dir) {
  FERRY_ASSIGN_OR_RETURN(std::vector<std::string> names, ListDir(dir));
  for (const std::string& name : names) {
    if (name != kSaveLockFileName) FERRY_RETURN_IF_ERROR(RemoveTree(JoinPath(dir, name)));
  }
  const std::string lock_path = JoinPath(dir, kSaveLockFileName);
  if (::unlink(lock_path.c_str()) != 0 && errno != ENOENT) {
    return PosixError(absl::StrCat("unlink ", lock_path), errno);
  }
  if (::rmdir(dir.c_str()) != 0) return PosixError(absl::StrCat("rmdir ", dir), errno);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<StaleCheckpointDir>> FindStaleCheckpoints(const std::string& root) {
  FERRY_ASSIGN_OR_RETURN(std::vector<std::string> names, CandidateNames(root));
  std::vector<StaleCheckpointDir> out;
  for (const std::string& name : names) {
    absl::StatusOr<StaleCheckpointDir> d = Probe(root, name, /*take=*/false, nullptr);
    if (absl::IsNotFound(d.status())) continue;  // removed meanwhile
    FERRY_RETURN_IF_ERROR(d.status());
    out.push_back(*std::move(d));
  }
  return out;
}

std::vector<StaleCheckpointDir> CollectStaleCheckpoints(const std::string& root, bool sync) {
  std::vector<StaleCheckpointDir> removed;
  absl::StatusOr<std::vector<std::string>> names = CandidateNames(root);
  if (!names.ok()) {
    if (!absl::IsNotFound(names.status())) {
      FERRY_LOG(WARNING) << "checkpoint root " << root << ": listing leftovers of crashed saves failed: "
                         << names.status();
    }
    return removed;
  }
  for (const std::string& name : *names) {
    const std::string dir = JoinPath(root, name);
    std::optional<SaveLock> lock;
    absl::StatusOr<StaleCheckpointDir> d = Probe(root, name, /*take=*/true, &lock);
    absl::Status s = d.status();
    if (s.ok() && !d->removable) {
      FERRY_LOG(INFO) << "checkpoint root " << root << ": kept " << name << " (" << d->bytes
                      << " bytes): " << d->reason;
      continue;
    }
    if (s.ok()) {
      if (lock.has_value()) {
        s = RemoveLockedDir(dir);
      } else if (::rmdir(dir.c_str()) != 0) {  // empty and unlocked: rmdir refuses it once filled
        s = PosixError(absl::StrCat("rmdir ", dir), errno);
      }
    }
    if (!s.ok()) {
      if (!absl::IsNotFound(s)) {
        FERRY_LOG(WARNING) << "checkpoint root " << root << ": removing the leftover " << name << " failed: " << s;
      }
      continue;
    }
    FERRY_LOG(INFO) << "checkpoint root " << root << ": removed " << name << " (" << d->bytes
                    << " bytes): " << d->reason;
    removed.push_back(*std::move(d));
  }
  if (sync && !removed.empty()) {
    absl::Status s = SyncDir(root);
    if (!s.ok()) FERRY_LOG(WARNING) << "checkpoint root " << root << ": fsync after removing leftovers: " << s;
  }
  return removed;
}

}  // namespace ferry
