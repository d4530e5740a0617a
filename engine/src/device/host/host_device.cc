#include "device/host/host_device.h"

#include <sys/sysinfo.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "base/adam_element.h"
#include "base/grad_squares.h"
#include "base/adam_math.h"
#include "base/errors.h"
#include "base/logging.h"
#include "device/host/host_streams.h"
#include "ferry/dtype.h"
#include "ferry/status.h"

namespace ferry {
namespace {

// Like cudaMalloc, which returns at least 256-byte aligned memory.
constexpr size_t kAlignment = 256;
// New allocations are filled with this byte: 0xFFFF... is a NaN in f32, bf16 and f16.
constexpr uint8_t kUninitialisedByte = 0xFF;

// Synchronization: see host_streams.h (std::mutex, so that ThreadSanitizer sees it).

// This Abseil build's absl::string_view is not std::string_view, and StrCat takes only the former.
absl::string_view ToAbsl(std::string_view s) { return absl::string_view(s.data(), s.size()); }

using host_backend::AsHostStream;
using host_backend::HostStreamBase;
using host_backend::Op;
using host_backend::StreamRegistry;

// The live allocations of one device. Safe for concurrent use.
class AllocationTable {
 public:
  void Add(void* p, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    live_[reinterpret_cast<uintptr_t>(p)] = bytes;
  }
  bool Contains(void* p) const {
    std::lock_guard<std::mutex> lock(mu_);
    return live_.contains(reinterpret_cast<uintptr_t>(p));
  }
  // The start of the live allocation holding `p`, or 0 when none does.
  uintptr_t StartOf(const void* p) const {
    const uintptr_t at = reinterpret_cast<uintptr_t>(p);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.upper_bound(at);
    if (it == live_.begin()) return 0;
    --it;
    return at < it->first + it->second ? it->first : 0;
  }
  // Removes `p`; false when it is not a live allocation.
  bool Remove(void* p) {
    std::lock_guard<std::mutex> lock(mu_);
    return live_.erase(reinterpret_cast<uintptr_t>(p)) == 1;
  }
  // OK unless [p, p + bytes) overlaps a live allocation without lying inside it (memory that is not
  // from Allocate is allowed: any host memory may serve as device memory on this backend).
  absl::Status CheckRange(const void* p, size_t bytes, absl::string_view what) const {
    if (bytes == 0) return absl::OkStatus();
    const uintptr_t begin = reinterpret_cast<uintptr_t>(p);
    const uintptr_t end = begin + bytes;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.upper_bound(begin);  // first allocation starting after `begin`
    if (it != live_.end() && it->first < end) {
      return absl::OutOfRangeError(absl::StrFormat(
          "%s: [%p, +%u bytes) overlaps the device allocation at %p (%u bytes) without lying inside it",
          what, p, bytes, reinterpret_cast<void*>(it->first), it->second));
    }
    if (it != live_.begin()) {
      --it;  // last allocation starting at or before `begin`
      const uintptr_t alloc_end = it->first + it->second;
      if (begin < alloc_end && end > alloc_end) {
        return absl::OutOfRangeError(absl::StrFormat(
            "%s: [%p, +%u bytes) runs %u bytes past the end of the device allocation at %p (%u bytes)",
            what, p, bytes, end - alloc_end, reinterpret_cast<void*>(it->first), it->second));
      }
    }
    return absl::OkStatus();
  }

 private:
  mutable std::mutex mu_;
  std::map<uintptr_t, size_t> live_ ABSL_GUARDED_BY(mu_);  // start -> requested bytes
};

bool IsDeviceSide(CopyKind kind, bool dst) {
  switch (kind) {
    case CopyKind::kHostToDevice: return dst;
    case CopyKind::kDeviceToHost: return !dst;
    case CopyKind::kDeviceToDevice: return true;
    case CopyKind::kHostToHost: return false;
  }
  return false;
}

// One tensor of LaunchAdam on the host: the same element update as the CUDA kernel.
void AdamTensorOnHost(const AdamTensorArgs& t, const AdamScalars& s) {
  if (!t.state.all_f32()) {
    AdamStepRangeTyped(s, t.state, t.rounding, t.master, t.exp_avg, t.exp_avg_sq, t.grad, t.grad_dtype, t.param,
                       t.param_dtype, 0, t.numel);
    return;
  }
  for (int64_t i = 0; i < t.numel; ++i) {
    const size_t k = static_cast<size_t>(i);
    AdamStepElement(s, static_cast<float*>(t.master), static_cast<float*>(t.exp_avg), static_cast<float*>(t.exp_avg_sq),
                    t.grad, t.grad_dtype, t.param, t.param_dtype, k);
  }
}

// LaunchGradStats on the host: the exact sum of base/exact_sum.h, serially.
GradStats GradStatsOnHost(const std::vector<GradTensorArgs>& grads) {
  GradSquareAccumulator acc;
  for (const GradTensorArgs& g : grads) acc.Add(g.grad, g.dtype, 0, g.numel);
  return acc.Stats();
}

absl::StatusOr<size_t> AvailableHostMemory() {
  std::ifstream meminfo("/proc/meminfo");
  std::string line;
  while (std::getline(meminfo, line)) {
    unsigned long long kib = 0;  // "MemAvailable:   123456 kB"
    if (std::sscanf(line.c_str(), "MemAvailable: %llu kB", &kib) == 1)
      return static_cast<size_t>(kib) * 1024;
  }
  struct sysinfo info {};
  if (sysinfo(&info) != 0) return PosixError("FreeMemory: sysinfo", errno);
  return static_cast<size_t>(info.freeram) * info.mem_unit;
}

// Thread-safety: safe for concurrent use (the tables and the registry have their own locks).
class HostDevice final : public Device {
 public:
  HostDevice()
      : allocations_(std::make_shared<AllocationTable>()),
        registry_(std::make_shared<StreamRegistry>()) {}

  Backend backend() const override { return Backend::kHost; }
  std::string name() const override { return "host (emulated device memory)"; }
  absl::StatusOr<size_t> FreeMemory() override { return AvailableHostMemory(); }

  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override {
    if (bytes == 0) return DeviceBuffer();
    const size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
    if (rounded < bytes) {
      return absl::InvalidArgumentError(absl::StrCat("Allocate: ", bytes, " bytes is too large"));
    }
    void* p = std::aligned_alloc(kAlignment, rounded);
    if (p == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("Allocate: host backend could not allocate ", bytes, " bytes"));
    }
    std::memset(p, kUninitialisedByte, rounded);
    allocations_->Add(p, bytes);
    return DeviceBuffer(this, p, bytes);
  }

  void Free(void* data) override {
    if (data == nullptr) return;
    if (!allocations_->Contains(data)) {
      FERRY_LOG(ERROR) << "Device::Free(" << data << "): not a live allocation of this device; ignored";
      return;
    }
    if (!host_backend::OnStreamWorker()) registry_->WaitForAll();
    if (!allocations_->Remove(data)) {  // freed by another thread meanwhile
      FERRY_LOG(ERROR) << "Device::Free(" << data << "): freed twice concurrently; ignored";
      return;
    }
    std::free(data);
  }

  absl::StatusOr<std::unique_ptr<Stream>> CreateStream() override {
    return host_backend::NewQueueStream(registry_);
  }
  absl::StatusOr<std::unique_ptr<Event>> CreateEvent() override {
    return host_backend::NewEvent();
  }
  absl::StatusOr<std::unique_ptr<Stream>> WrapStream(void* native) override {
    if (native != nullptr) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "WrapStream(%p): the host backend has no native streams; pass nullptr for the calling thread",
          native));
    }
    return host_backend::NewInlineStream();
  }

  absl::Status CopyAsync(void* dst, const void* src, size_t bytes, CopyKind kind,
                         Stream& stream) override {
    FERRY_ASSIGN_OR_RETURN(HostStreamBase * s, AsHostStream(stream, "CopyAsync"));
    if (bytes == 0) return absl::OkStatus();
    const std::string what =
        absl::StrCat("CopyAsync ", ToAbsl(CopyKindName(kind)), " of ", bytes, " bytes");
    if (dst == nullptr || src == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": null ", dst == nullptr ? "dst" : "src"));
    }
    if (IsDeviceSide(kind, /*dst=*/true)) {
      FERRY_RETURN_IF_ERROR(allocations_->CheckRange(dst, bytes, absl::StrCat(what, ", dst")));
    }
    if (IsDeviceSide(kind, /*dst=*/false)) {
      FERRY_RETURN_IF_ERROR(allocations_->CheckRange(src, bytes, absl::StrCat(what, ", src")));
    }
    return s->Submit([dst, src, bytes] {
      std::memmove(dst, src, bytes);
      return absl::OkStatus();
    });
  }

  absl::Status MemsetAsync(void* dst, uint8_t value, size_t bytes, Stream& stream) override {
    FERRY_ASSIGN_OR_RETURN(HostStreamBase * s, AsHostStream(stream, "MemsetAsync"));
    if (bytes == 0) return absl::OkStatus();
    const std::string what = absl::StrCat("MemsetAsync of ", bytes, " bytes");
    if (dst == nullptr) return absl::InvalidArgumentError(absl::StrCat(what, ": null dst"));
    FERRY_RETURN_IF_ERROR(allocations_->CheckRange(dst, bytes, what));
    return s->Submit([dst, value, bytes] {
      std::memset(dst, value, bytes);
      return absl::OkStatus();
    });
  }

  absl::Status RegisterHost(void* data, size_t bytes) override {
    if (data == nullptr || bytes == 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "RegisterHost(%p, %u bytes): need a non-null region of at least one byte", data, bytes));
    }
    const uintptr_t begin = reinterpret_cast<uintptr_t>(data);
    std::lock_guard<std::mutex> lock(registered_mu_);
    auto next = registered_.lower_bound(begin);
    bool overlaps = next != registered_.end() && next->first < begin + bytes;
    if (!overlaps && next != registered_.begin()) {
      auto prev = std::prev(next);
      overlaps = prev->first + prev->second > begin;
    }
    if (overlaps) {
      return absl::AlreadyExistsError(absl::StrFormat(
          "RegisterHost(%p, %u bytes): overlaps a region that is already registered", data, bytes));
    }
    registered_.emplace(begin, bytes);
    ++registrations_;
    return absl::OkStatus();
  }

  absl::Status UnregisterHost(void* data) override {
    std::lock_guard<std::mutex> lock(registered_mu_);
    if (registered_.erase(reinterpret_cast<uintptr_t>(data)) != 1) {
      return absl::NotFoundError(absl::StrFormat(
          "UnregisterHost(%p): not the start of a region registered with RegisterHost", data));
    }
    return absl::OkStatus();
  }

  uint64_t host_registrations() const override {
    std::lock_guard<std::mutex> lock(registered_mu_);
    return registrations_;
  }
  bool SameAllocation(const void* a, const void* b) override {
    const uintptr_t start = allocations_->StartOf(a);
    return start != 0 && start == allocations_->StartOf(b);
  }

  absl::Status LaunchAdam(absl::Span<const AdamTensorArgs> tensors,
                          absl::Span<const AdamScalars> scalars, Stream& stream) override {
    return EnqueueAdam(tensors, scalars, AdamRuntimeArgs{}, stream);
  }

  absl::Status LaunchAdamWith(absl::Span<const AdamTensorArgs> tensors, absl::Span<const AdamScalars> scalars,
                              const AdamRuntimeArgs& runtime, Stream& stream) override {
    return EnqueueAdam(tensors, scalars, runtime, stream);
  }

  absl::Status LaunchGradStats(absl::Span<const GradTensorArgs> grads, void* workspace,
                               size_t workspace_bytes, Stream& stream) override {
    FERRY_ASSIGN_OR_RETURN(HostStreamBase * s, AsHostStream(stream, "LaunchGradStats"));
    FERRY_RETURN_IF_ERROR(ValidateGradStatsArgs(grads, workspace, workspace_bytes));
    return s->Submit([allocations = allocations_,
                      grad_args = std::vector<GradTensorArgs>(grads.begin(), grads.end()), workspace] {
      for (size_t i = 0; i < grad_args.size(); ++i) {
        const GradTensorArgs& g = grad_args[i];
        FERRY_RETURN_IF_ERROR(allocations->CheckRange(g.grad,
                                                      DTypeSize(g.dtype) * static_cast<size_t>(g.numel),
                                                      absl::StrCat("LaunchGradStats tensor ", i, " grad")));
      }
      FERRY_RETURN_IF_ERROR(allocations->CheckRange(workspace, GradStatsWorkspaceBytes(grad_args.size()),
                                                    "LaunchGradStats workspace"));
      const GradStats result = GradStatsOnHost(grad_args);
      std::memcpy(workspace, &result, sizeof(result));
      return absl::OkStatus();
    });
  }

  absl::Status LaunchConvert(void* dst, DType dst_dtype, const void* src, DType src_dtype, int64_t numel,
                             Stream& stream) override {
    FERRY_ASSIGN_OR_RETURN(HostStreamBase * s, AsHostStream(stream, "LaunchConvert"));
    FERRY_RETURN_IF_ERROR(ValidateConvertArgs(dst, dst_dtype, src, src_dtype, numel));
    if (numel == 0) return absl::OkStatus();
    return s->Submit([allocations = allocations_, dst, dst_dtype, src, src_dtype, numel] {
      const size_t n = static_cast<size_t>(numel);
      FERRY_RETURN_IF_ERROR(allocations->CheckRange(src, DTypeSize(src_dtype) * n, "LaunchConvert src"));
      FERRY_RETURN_IF_ERROR(allocations->CheckRange(dst, DTypeSize(dst_dtype) * n, "LaunchConvert dst"));
      if (dst_dtype == src_dtype) {
        std::memmove(dst, src, DTypeSize(dst_dtype) * n);
      } else {
        for (size_t i = 0; i < n; ++i) StoreFromF32(dst, dst_dtype, i, LoadAsF32(src, src_dtype, i));
      }
      return absl::OkStatus();
    });
  }

 private:
  // LaunchAdam and LaunchAdamWith: one op that checks every range, reads the runtime inputs, and
  // updates every tensor (or nothing, when the gradient check found NaN or Inf).
  absl::Status EnqueueAdam(absl::Span<const AdamTensorArgs> tensors, absl::Span<const AdamScalars> scalars,
                           const AdamRuntimeArgs& runtime, Stream& stream) {
    FERRY_ASSIGN_OR_RETURN(HostStreamBase * s, AsHostStream(stream, "LaunchAdam"));
    FERRY_RETURN_IF_ERROR(ValidateAdamArgs(tensors, scalars));
    FERRY_RETURN_IF_ERROR(ValidateAdamRuntimeArgs(runtime));
    if (tensors.empty() && runtime.step == nullptr) return absl::OkStatus();
    return s->Submit([allocations = allocations_,
                      tensor_args = std::vector<AdamTensorArgs>(tensors.begin(), tensors.end()),
                      scalar_args = std::vector<AdamScalars>(scalars.begin(), scalars.end()), runtime] {
      // Like a kernel touching memory past an allocation: the whole launch fails, nothing is written.
      for (size_t i = 0; i < tensor_args.size(); ++i) {
        const AdamTensorArgs& t = tensor_args[i];
        const size_t n = static_cast<size_t>(t.numel);
        const std::string what = absl::StrCat("LaunchAdam tensor ", i);
        const size_t ms = DTypeSize(t.state.master), vs = DTypeSize(t.state.moments);
        FERRY_RETURN_IF_ERROR(allocations->CheckRange(t.master, ms * n, absl::StrCat(what, " master")));
        FERRY_RETURN_IF_ERROR(allocations->CheckRange(t.exp_avg, vs * n, absl::StrCat(what, " exp_avg")));
        FERRY_RETURN_IF_ERROR(
            allocations->CheckRange(t.exp_avg_sq, vs * n, absl::StrCat(what, " exp_avg_sq")));
        FERRY_RETURN_IF_ERROR(
            allocations->CheckRange(t.grad, DTypeSize(t.grad_dtype) * n, absl::StrCat(what, " grad")));
        if (t.param != nullptr) {
          FERRY_RETURN_IF_ERROR(
              allocations->CheckRange(t.param, DTypeSize(t.param_dtype) * n, absl::StrCat(what, " param")));
        }
      }
      const size_t sets = scalar_args.size();
      if (runtime.grad_stats != nullptr) {
        FERRY_RETURN_IF_ERROR(
            allocations->CheckRange(runtime.grad_stats, sizeof(GradStats), "LaunchAdam grad_stats"));
      }
      if (runtime.grad_scale != nullptr) {
        FERRY_RETURN_IF_ERROR(allocations->CheckRange(runtime.grad_scale, 4, "LaunchAdam grad_scale"));
      }
      if (runtime.lr != nullptr)
        FERRY_RETURN_IF_ERROR(allocations->CheckRange(runtime.lr, 4 * sets, "LaunchAdam lr"));
      if (runtime.step != nullptr) {
        FERRY_RETURN_IF_ERROR(allocations->CheckRange(runtime.step, 8 * sets, "LaunchAdam step"));
      }
      if (runtime.grad_stats != nullptr && runtime.grad_stats->found_inf != 0)
        return absl::OkStatus();  // skipped
      const bool set_multiplier = runtime.grad_scale != nullptr || runtime.max_grad_norm > 0.0f;
      const float multiplier =
          set_multiplier
              ? AdamGradMultiplier(runtime.grad_scale != nullptr ? *runtime.grad_scale : 1.0f,
                                   runtime.grad_stats != nullptr ? runtime.grad_stats->sum_sq : 0.0,
                                   runtime.max_grad_norm)
              : 1.0f;
      std::vector<AdamScalars> resolved = scalar_args;
      for (size_t i = 0; i < sets; ++i) {
        AdamApplyRuntime(resolved[i], runtime.lr != nullptr ? runtime.lr + i : nullptr,
                         runtime.step != nullptr ? runtime.step + i : nullptr,
                         set_multiplier ? &multiplier : nullptr);
      }
      for (const AdamTensorArgs& t : tensor_args) AdamTensorOnHost(t, resolved[t.scalars_index]);
      if (runtime.step != nullptr) {
        for (size_t i = 0; i < sets; ++i) ++runtime.step[i];
      }
      return absl::OkStatus();
    });
  }

  std::shared_ptr<AllocationTable> allocations_;
  std::shared_ptr<StreamRegistry> registry_;
  mutable std::mutex registered_mu_;
  std::map<uintptr_t, size_t> registered_ ABSL_GUARDED_BY(registered_mu_);  // start -> bytes
  uint64_t registrations_ ABSL_GUARDED_BY(registered_mu_) = 0;
};

}  // namespace

std::unique_ptr<Device> CreateHostDevice() { return std::make_unique<HostDevice>(); }

}  // namespace ferry
