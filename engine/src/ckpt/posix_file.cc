#include "ckpt/posix_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "base/errors.h"
#include "ferry/status.h"

namespace ferry {
namespace {

// Linux transfers at most 0x7ffff000 bytes per read/write call; stay well below it.
constexpr size_t kMaxIoPerCall = size_t{1} << 30;

// Closes `fd`, retrying nothing (close must not be retried on Linux, even after EINTR).
absl::Status CloseFd(int fd, absl::string_view path) {
  if (::close(fd) != 0) return PosixError(absl::StrCat("close ", path), errno);
  return absl::OkStatus();
}

std::string ParentDir(const std::string& path) {
  size_t end = path.size();
  while (end > 1 && path[end - 1] == '/') --end;  // ignore trailing slashes
  size_t slash = path.rfind('/', end - 1);
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

}  // namespace

std::string JoinPath(absl::string_view dir, absl::string_view name) {
  if (dir.empty()) return std::string(name);
  if (dir.back() == '/') return absl::StrCat(dir, name);
  return absl::StrCat(dir, "/", name);
}

// ---- WritableFile -------------------------------------------------------------------------------

absl::StatusOr<WritableFile> WritableFile::Create(const std::string& path) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return PosixError(absl::StrCat("create ", path), errno);
  return WritableFile(fd, path);
}

WritableFile::WritableFile(WritableFile&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), path_(std::move(other.path_)) {}

WritableFile& WritableFile::operator=(WritableFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    path_ = std::move(other.path_);
  }
  return *this;
}

WritableFile::~WritableFile() {
  if (fd_ >= 0) ::close(fd_);  // failure path only: the caller removes the file
}

absl::Status WritableFile::Append(const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd_, p, std::min(n, kMaxIoPerCall));
    if (w < 0) {
      if (errno == EINTR) continue;
      return PosixError(absl::StrCat("write ", path_), errno);
    }
    if (w == 0) return absl::InternalError(absl::StrCat("write ", path_, ": wrote 0 bytes"));
    p += w;
    n -= static_cast<size_t>(w);
  }
  return absl::OkStatus();
}

absl::Status WritableFile::WriteAt(uint64_t offset, const void* data, size_t n) const {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::pwrite(fd_, p, std::min(n, kMaxIoPerCall), static_cast<off_t>(offset));
    if (w < 0) {
      if (errno == EINTR) continue;
      return PosixError(absl::StrCat("pwrite ", path_, " at offset ", offset), errno);
    }
    if (w == 0) return absl::InternalError(absl::StrCat("pwrite ", path_, ": wrote 0 bytes"));
    p += w;
    offset += static_cast<uint64_t>(w);
    n -= static_cast<size_t>(w);
  }
  return absl::OkStatus();
}

absl::Status WritableFile::StartWriteback(uint64_t offset, uint64_t n) const {
  if (::sync_file_range(fd_, static_cast<off_t>(offset), static_cast<off_t>(n),
                        SYNC_FILE_RANGE_WRITE) != 0) {
    return PosixError(absl::StrCat("sync_file_range ", path_), errno);
  }
  return absl::OkStatus();
}

absl::Status WritableFile::Sync() {
  if (::fsync(fd_) != 0) return PosixError(absl::StrCat("fsync ", path_), errno);
  return absl::OkStatus();
}

absl::Status WritableFile::Close() {
  int fd = std::exchange(fd_, -1);
  return CloseFd(fd, path_);
}

// ---- ReadOnlyFile -------------------------------------------------------------------------------

absl::StatusOr<ReadOnlyFile> ReadOnlyFile::Open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return PosixError(absl::StrCat("open ", path), errno);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    absl::Status s = PosixError(absl::StrCat("fstat ", path), errno);
    ::close(fd);
    return s;
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::FailedPreconditionError(absl::StrCat(path, " is not a regular file"));
  }
  return ReadOnlyFile(fd, path, static_cast<uint64_t>(st.st_size));
}

ReadOnlyFile::ReadOnlyFile(ReadOnlyFile&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), path_(std::move(other.path_)), size_(other.size_) {}

ReadOnlyFile& ReadOnlyFile::operator=(ReadOnlyFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    path_ = std::move(other.path_);
    size_ = other.size_;
  }
  return *this;
}

ReadOnlyFile::~ReadOnlyFile() {
  if (fd_ >= 0) ::close(fd_);  // read-only: nothing to lose
}

absl::Status ReadOnlyFile::ReadAt(uint64_t offset, void* dst, size_t n) const {
  char* p = static_cast<char*>(dst);
  const uint64_t end = offset + n;
  while (n > 0) {
    ssize_t r = ::pread(fd_, p, std::min(n, kMaxIoPerCall), static_cast<off_t>(offset));
    if (r < 0) {
      if (errno == EINTR) continue;
      return PosixError(absl::StrCat("read ", path_, " at offset ", offset), errno);
    }
    if (r == 0) {
      return absl::DataLossError(absl::StrCat("read ", path_, ": unexpected end of file at offset ",
                                              offset, " (wanted bytes up to ", end, ")"));
    }
    p += r;
    offset += static_cast<uint64_t>(r);
    n -= static_cast<size_t>(r);
  }
  return absl::OkStatus();
}

// ---- whole files and directories ----------------------------------------------------------------

absl::StatusOr<std::string> ReadFileToString(const std::string& path, uint64_t max_bytes) {
  FERRY_ASSIGN_OR_RETURN(ReadOnlyFile file, ReadOnlyFile::Open(path));
  if (file.size() > max_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " has ", file.size(), " bytes, more than the limit of ", max_bytes));
  }
  std::string out(static_cast<size_t>(file.size()), '\0');
  FERRY_RETURN_IF_ERROR(file.ReadAt(0, out.data(), out.size()));
  return out;
}

absl::StatusOr<bool> PathExists(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) == 0) return true;
  if (errno == ENOENT) return false;
  return PosixError(absl::StrCat("lstat ", path), errno);
}

absl::StatusOr<bool> IsDirectory(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) == 0) return S_ISDIR(st.st_mode);
  if (errno == ENOENT) return false;
  return PosixError(absl::StrCat("stat ", path), errno);
}

absl::Status MakeDirs(const std::string& path, bool sync) {
  if (path.empty()) return absl::InvalidArgumentError("MakeDirs: empty path");
  FERRY_ASSIGN_OR_RETURN(bool is_dir, IsDirectory(path));
  if (is_dir) return absl::OkStatus();
  std::string parent = ParentDir(path);
  if (parent != path) FERRY_RETURN_IF_ERROR(MakeDirs(parent, sync));
  if (::mkdir(path.c_str(), 0755) != 0) {
    if (errno == EEXIST) {
      FERRY_ASSIGN_OR_RETURN(bool now_dir, IsDirectory(path));
      if (now_dir) return absl::OkStatus();  // created concurrently
      return absl::FailedPreconditionError(
          absl::StrCat("mkdir ", path, ": exists and is not a directory"));
    }
    return PosixError(absl::StrCat("mkdir ", path), errno);
  }
  if (sync) FERRY_RETURN_IF_ERROR(SyncDir(parent));
  return absl::OkStatus();
}

absl::Status SyncDir(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return PosixError(absl::StrCat("open directory ", path), errno);
  if (::fsync(fd) != 0) {
    absl::Status s = PosixError(absl::StrCat("fsync directory ", path), errno);
    ::close(fd);
    return s;
  }
  return CloseFd(fd, path);
}

absl::StatusOr<std::vector<std::string>> ListDir(const std::string& path) {
  DIR* dir = ::opendir(path.c_str());
  if (dir == nullptr) return PosixError(absl::StrCat("opendir ", path), errno);
  std::vector<std::string> names;
  while (true) {
    errno = 0;
    struct dirent* e = ::readdir(dir);
    if (e == nullptr) {
      if (errno != 0) {
        absl::Status s = PosixError(absl::StrCat("readdir ", path), errno);
        ::closedir(dir);
        return s;
      }
      break;
    }
    absl::string_view name = e->d_name;
    if (name == "." || name == "..") continue;
    names.emplace_back(name);
  }
  ::closedir(dir);
  return names;
}

absl::Status RemoveTree(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return PosixError(absl::StrCat("lstat ", path), errno);
  if (!S_ISDIR(st.st_mode)) {
    if (::unlink(path.c_str()) != 0) return PosixError(absl::StrCat("unlink ", path), errno);
    return absl::OkStatus();
  }
  FERRY_ASSIGN_OR_RETURN(std::vector<std::string> names, ListDir(path));
  for (const std::string& name : names) FERRY_RETURN_IF_ERROR(RemoveTree(JoinPath(path, name)));
  if (::rmdir(path.c_str()) != 0) return PosixError(absl::StrCat("rmdir ", path), errno);
  return absl::OkStatus();
}

absl::Status Rename(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) {
    return PosixError(absl::StrCat("rename ", from, " to ", to), errno);
  }
  return absl::OkStatus();
}

absl::Status RenameNoReplace(const std::string& from, const std::string& to) {
  if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_NOREPLACE) == 0) {
    return absl::OkStatus();
  }
  if (errno != EINVAL && errno != ENOSYS) {
    return PosixError(absl::StrCat("rename ", from, " to ", to), errno);
  }
  // The filesystem has no RENAME_NOREPLACE: check, then rename (not atomic against a concurrent
  // writer of the same name, which the callers exclude).
  FERRY_ASSIGN_OR_RETURN(bool exists, PathExists(to));
  if (exists) return PosixError(absl::StrCat("rename ", from, " to ", to), EEXIST);
  return Rename(from, to);
}

absl::Status ReplaceFileAtomically(const std::string& dir, const std::string& name,
                                   absl::string_view contents, bool sync, bool* renamed) {
  *renamed = false;
  const std::string target = JoinPath(dir, name);
  const std::string tmp = absl::StrCat(target, ".tmp");
  if (::unlink(tmp.c_str()) != 0 && errno != ENOENT) {  // left over from a crash
    return PosixError(absl::StrCat("unlink stale ", tmp), errno);
  }
  absl::Status s = [&]() -> absl::Status {
    FERRY_ASSIGN_OR_RETURN(WritableFile file, WritableFile::Create(tmp));
    FERRY_RETURN_IF_ERROR(file.Append(contents.data(), contents.size()));
    if (sync) FERRY_RETURN_IF_ERROR(file.Sync());
    FERRY_RETURN_IF_ERROR(file.Close());
    return Rename(tmp, target);
  }();
  if (!s.ok()) {
    if (::unlink(tmp.c_str()) != 0 && errno != ENOENT) {
      return absl::Status(s.code(), absl::StrCat(s.message(), "; and removing ", tmp, " failed: ",
                                                 PosixError("unlink", errno).message()));
    }
    return s;
  }
  *renamed = true;
  if (sync) FERRY_RETURN_IF_ERROR(SyncDir(dir));
  return absl::OkStatus();
}

}  // namespace ferry
