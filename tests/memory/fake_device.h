// A Device for the memory tests: it only records host registrations (and can be told to refuse the
// next one); everything else is Unimplemented. Lets the arena be tested without any backend.
#ifndef FERRY_TESTS_MEMORY_FAKE_DEVICE_H_
#define FERRY_TESTS_MEMORY_FAKE_DEVICE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "device/device.h"

namespace ferry::fakes {

// Safe for concurrent use.
class FakeDevice final : public Device {
 public:
  Backend backend() const override { return Backend::kHost; }
  std::string name() const override { return "fake"; }
  absl::StatusOr<size_t> FreeMemory() override { return Unimplemented("FreeMemory"); }
  absl::StatusOr<DeviceBuffer> Allocate(size_t) override { return Unimplemented("Allocate"); }
  void Free(void*) override {}
  absl::StatusOr<std::unique_ptr<Stream>> CreateStream() override {
    return Unimplemented("CreateStream");
  }
  absl::StatusOr<std::unique_ptr<Event>> CreateEvent() override {
    return Unimplemented("CreateEvent");
  }
  absl::StatusOr<std::unique_ptr<Stream>> WrapStream(void*) override {
    return Unimplemented("WrapStream");
  }
  absl::Status CopyAsync(void*, const void*, size_t, CopyKind, Stream&) override {
    return Unimplemented("CopyAsync");
  }
  absl::Status MemsetAsync(void*, uint8_t, size_t, Stream&) override {
    return Unimplemented("MemsetAsync");
  }
  absl::Status LaunchAdam(absl::Span<const AdamTensorArgs>, absl::Span<const AdamScalars>,
                          Stream&) override {
    return Unimplemented("LaunchAdam");
  }
  absl::Status LaunchConvert(void*, DType, const void*, DType, int64_t, Stream&) override {
    return Unimplemented("LaunchConvert");
  }

  absl::Status RegisterHost(void* data, size_t bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (fail_next_.has_value()) {
      absl::Status s = *std::move(fail_next_);
      fail_next_.reset();
      return s;
    }
    if (registered_.count(data) != 0) return absl::AlreadyExistsError("registered twice");
    registered_[data] = bytes;
    ++registrations_;
    return absl::OkStatus();
  }
  absl::Status UnregisterHost(void* data) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (registered_.erase(data) == 0) return absl::NotFoundError("not registered");
    ++unregistrations_;
    return absl::OkStatus();
  }
  uint64_t host_registrations() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return registrations_;
  }

  // Test controls and observations.
  void FailNextRegistration(absl::Status status) {
    std::lock_guard<std::mutex> lock(mu_);
    fail_next_ = std::move(status);
  }
  uint64_t unregistrations() const {
    std::lock_guard<std::mutex> lock(mu_);
    return unregistrations_;
  }
  // The registered regions: address -> bytes.
  std::map<void*, size_t> registered() const {
    std::lock_guard<std::mutex> lock(mu_);
    return registered_;
  }

 private:
  static absl::Status Unimplemented(const char* what) {
    return absl::UnimplementedError(std::string("FakeDevice::") + what);
  }

  mutable std::mutex mu_;  // std::mutex: visible to ThreadSanitizer, unlike Debian's absl::Mutex
  std::optional<absl::Status> fail_next_ ABSL_GUARDED_BY(mu_);
  std::map<void*, size_t> registered_ ABSL_GUARDED_BY(mu_);
  uint64_t registrations_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t unregistrations_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace ferry::fakes

#endif  // FERRY_TESTS_MEMORY_FAKE_DEVICE_H_
