// Plain POSIX file and directory operations for checkpoints: every syscall error becomes a Status
// through PosixError with the path in its context.
#ifndef FERRY_CKPT_POSIX_FILE_H_
#define FERRY_CKPT_POSIX_FILE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ferry {

// "<dir>/<name>", without doubling a trailing slash of `dir`.
std::string JoinPath(absl::string_view dir, absl::string_view name);

// A file opened for writing, created by Create (never an existing file). One thread at a time.
// Move-only; the destructor closes the descriptor if Close was not called (ignoring errors: that
// only happens on failure paths, where the caller removes the file anyway).
class WritableFile final {
 public:
  // Creates `path` (O_EXCL: fails with AlreadyExists if it exists), mode 0644.
  static absl::StatusOr<WritableFile> Create(const std::string& path);

  WritableFile(WritableFile&& other) noexcept;
  WritableFile& operator=(WritableFile&& other) noexcept;
  WritableFile(const WritableFile&) = delete;
  WritableFile& operator=(const WritableFile&) = delete;
  ~WritableFile();

  // Writes all `n` bytes of `data` at the current position (looping over short writes and EINTR).
  // `data` is borrowed for the call. On error the file holds an unspecified prefix of the bytes.
  // REQUIRES: the file is open (Close not called).
  absl::Status Append(const void* data, size_t n);
  // Writes all `n` bytes of `data` at absolute `offset` (pwrite; looping over short writes and
  // EINTR); does not move the file position. Safe to call from several threads at once for disjoint
  // ranges (and alongside StartWriteback). REQUIRES: the file is open.
  absl::Status WriteAt(uint64_t offset, const void* data, size_t n) const;
  // Asks the kernel to start writing back the dirty pages of [offset, offset + n) now, without
  // waiting (Linux sync_file_range(SYNC_FILE_RANGE_WRITE)), so a final Sync has less left to do.
  // Advisory: durability still needs Sync. Thread-safe like WriteAt. REQUIRES: the file is open.
  absl::Status StartWriteback(uint64_t offset, uint64_t n) const;
  // fsync. REQUIRES: the file is open.
  absl::Status Sync();
  // Closes the descriptor and reports close()'s error. REQUIRES: the file is open.
  absl::Status Close();

  const std::string& path() const { return path_; }

 private:
  WritableFile(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}

  int fd_ = -1;
  std::string path_;
};

// A file opened read-only; reads are positional (pread), so they do not share a file position.
// Safe for concurrent reads. Move-only; the destructor closes the descriptor.
class ReadOnlyFile final {
 public:
  static absl::StatusOr<ReadOnlyFile> Open(const std::string& path);

  ReadOnlyFile(ReadOnlyFile&& other) noexcept;
  ReadOnlyFile& operator=(ReadOnlyFile&& other) noexcept;
  ReadOnlyFile(const ReadOnlyFile&) = delete;
  ReadOnlyFile& operator=(const ReadOnlyFile&) = delete;
  ~ReadOnlyFile();

  // Size in bytes at the time Open ran.
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }

  // Reads exactly `n` bytes at `offset` into `dst` (borrowed for the call). Reading past the end of
  // the file is a DataLoss error. On error `dst` holds unspecified bytes.
  absl::Status ReadAt(uint64_t offset, void* dst, size_t n) const;

 private:
  ReadOnlyFile(int fd, std::string path, uint64_t size)
      : fd_(fd), path_(std::move(path)), size_(size) {}

  int fd_ = -1;
  std::string path_;
  uint64_t size_ = 0;
};

// The whole file as a string. A file larger than `max_bytes` is refused (InvalidArgument).
absl::StatusOr<std::string> ReadFileToString(const std::string& path, uint64_t max_bytes);

// Whether `path` exists (lstat; a dangling symlink exists). Errors other than ENOENT are returned.
absl::StatusOr<bool> PathExists(const std::string& path);
// Whether `path` exists and is a directory (stat, following symlinks).
absl::StatusOr<bool> IsDirectory(const std::string& path);

// Creates `path` and any missing parents (mode 0755). If `sync`, the parent of each directory
// created is fsynced so the new entry is durable. An existing directory is fine.
absl::Status MakeDirs(const std::string& path, bool sync);
// Opens directory `path` and fsyncs it.
absl::Status SyncDir(const std::string& path);
// Removes `path`: a file, or a directory with everything under it. Does not follow symlinks.
absl::Status RemoveTree(const std::string& path);
// rename(2).
absl::Status Rename(const std::string& from, const std::string& to);
// Renames `from` to `to`, failing with AlreadyExists if `to` exists (never replaces: renameat2
// RENAME_NOREPLACE, or a check followed by rename(2) on filesystems without it).
absl::Status RenameNoReplace(const std::string& from, const std::string& to);
// The names in directory `path`, without "." and "..", in no particular order.
absl::StatusOr<std::vector<std::string>> ListDir(const std::string& path);

// Replaces `dir`/`name` with `contents` safely: writes `dir`/`name`.tmp, fsyncs and closes it,
// renames it over `dir`/`name`, then fsyncs `dir` (the fsyncs are skipped when !sync). *renamed
// tells whether the rename happened: on an error with *renamed == false the target is untouched and
// the temporary has been removed; with *renamed == true only the final directory fsync failed.
absl::Status ReplaceFileAtomically(const std::string& dir, const std::string& name,
                                   absl::string_view contents, bool sync, bool* renamed);

}  // namespace ferry

#endif  // FERRY_CKPT_POSIX_FILE_H_
