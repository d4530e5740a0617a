#include "ckpt/checkpoint_writer.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "base/thread_affinity.h"
#include "ferry/status.h"

namespace ferry {
namespace {

size_t IoThreads(size_t requested) {
  if (requested > 0) return requested;
  return std::max<size_t>(1, std::min<size_t>(4, ThreadPool::DefaultThreads()));
}

}  // namespace

CheckpointWriter::CheckpointWriter(size_t io_threads)
    : io_pool_(IoThreads(io_threads), -1, {}, "ferry-ckpt-io"), thread_([this] {
        NameCurrentThread("ferry-ckpt");
        Loop();
      }) {}

CheckpointWriter::~CheckpointWriter() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return !running_; });
    stopping_ = true;
    if (!error_.ok()) {
      FERRY_LOG(ERROR) << "a background checkpoint save failed and nobody collected the error: "
                       << error_;
    }
  }
  cv_.notify_all();
  thread_.join();
}

void CheckpointWriter::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [this] { return stopping_ || job_.has_value(); });
    if (!job_.has_value()) return;  // stopping, nothing queued
    CheckpointJob job = *std::move(job_);
    job_.reset();
    lock.unlock();
    absl::StatusOr<std::string> dir = WriteJob(job);
    if (job.on_finished) job.on_finished();
    lock.lock();
    if (dir.ok()) {
      last_committed_ = *std::move(dir);
    } else {
      error_ = absl::Status(dir.status().code(),
                            absl::StrCat("background checkpoint save of step ", job.step, " in ",
                                         job.root, " failed: ", dir.status().message()));
    }
    running_ = false;
    cv_.notify_all();
  }
}

absl::StatusOr<std::string> CheckpointWriter::WriteJob(const CheckpointJob& job) {
  CheckpointWriteOptions options = job.options;
  options.pool = &io_pool_;
  if (job.comm != nullptr) {
    return WriteDistributedCheckpoint(*job.comm, job.comm_timeout, job.root, job.step, job.tensors, job.pieces,
                                      job.skipped, job.metadata, options);
  }
  return WriteShardedCheckpoint(job.root, job.step, job.tensors, job.world_size, job.skipped, job.metadata, options);
}

absl::StatusOr<std::string> CheckpointWriter::Write(const CheckpointJob& job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (running_) {
      return absl::FailedPreconditionError(
          "CheckpointWriter::Write: a background save is in flight; call Wait first");
    }
    if (!error_.ok()) return std::exchange(error_, absl::OkStatus());
  }
  absl::StatusOr<std::string> dir = WriteJob(job);
  if (job.on_finished) job.on_finished();
  if (dir.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    last_committed_ = *dir;
  }
  return dir;
}

absl::Status CheckpointWriter::Start(CheckpointJob job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (running_) {
      return absl::FailedPreconditionError(
          "CheckpointWriter::Start: a background save is in flight; call Wait first");
    }
    if (!error_.ok()) return std::exchange(error_, absl::OkStatus());
    job_ = std::move(job);
    running_ = true;
  }
  cv_.notify_all();
  return absl::OkStatus();
}

absl::Status CheckpointWriter::Wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return !running_; });
  return std::exchange(error_, absl::OkStatus());
}

void CheckpointWriter::WaitIdle() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return !running_; });
}

std::optional<absl::Status> CheckpointWriter::Poll() {
  std::lock_guard<std::mutex> lock(mu_);
  if (running_) return std::nullopt;
  return std::exchange(error_, absl::OkStatus());
}

bool CheckpointWriter::busy() {
  std::lock_guard<std::mutex> lock(mu_);
  return running_;
}

std::string CheckpointWriter::last_committed() {
  std::lock_guard<std::mutex> lock(mu_);
  return last_committed_;
}

}  // namespace ferry
