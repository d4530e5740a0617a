#include "device/device.h"

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "device/host/host_device.h"
#include "ferry/status.h"

#if defined(FERRY_HAVE_CUDA)
#include "device/cuda/cuda_device.h"
#endif

namespace ferry {
namespace {

// This Abseil build's absl::string_view is not std::string_view, and StrCat takes only the former.
absl::string_view ToAbsl(std::string_view s) { return absl::string_view(s.data(), s.size()); }

bool ValidDType(DType t) { return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16; }

// OK when `p` is non-null and aligned to `alignment`; the message names `what`.
absl::Status CheckPointer(const void* p, size_t alignment, absl::string_view what) {
  if (p == nullptr) return absl::InvalidArgumentError(absl::StrCat(what, " is null"));
  if (reinterpret_cast<uintptr_t>(p) % alignment != 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, " (", absl::Hex(reinterpret_cast<uintptr_t>(p)),
                                                   ") is not aligned to its element size of ", alignment,
                                                   " bytes"));
  }
  return absl::OkStatus();
}

// The backend to create and where that choice came from ("DeviceOptions::backend", "FERRY_DEVICE").
struct BackendChoice {
  std::string value;  // empty: automatic
  std::string source;
};

BackendChoice ChooseBackend(const DeviceOptions& options) {
  if (!options.backend.empty()) return {options.backend, "DeviceOptions::backend"};
  const char* env = std::getenv("FERRY_DEVICE");
  if (env != nullptr && *env != '\0') return {env, "FERRY_DEVICE"};
  return {};
}

}  // namespace

std::string_view BackendName(Backend b) {
  switch (b) {
    case Backend::kHost: return "host";
    case Backend::kCuda: return "cuda";
  }
  return "invalid";
}

std::string_view CopyKindName(CopyKind k) {
  switch (k) {
    case CopyKind::kHostToDevice: return "host-to-device";
    case CopyKind::kDeviceToHost: return "device-to-host";
    case CopyKind::kDeviceToDevice: return "device-to-device";
    case CopyKind::kHostToHost: return "host-to-host";
  }
  return "invalid";
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    Reset();
    device_ = std::exchange(o.device_, nullptr);
    data_ = std::exchange(o.data_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

void DeviceBuffer::Reset() {
  if (device_ != nullptr && data_ != nullptr) device_->Free(data_);
  device_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
}

absl::Status Device::Copy(void* dst, const void* src, size_t bytes, CopyKind kind) {
  // A wrapper per call: nothing shared between concurrent callers, and WrapStream is cheap on both
  // backends (no native stream is created).
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream, WrapStream(nullptr));
  FERRY_RETURN_IF_ERROR(CopyAsync(dst, src, bytes, kind, *stream));
  return stream->Synchronize();
}

absl::Status ValidateAdamArgs(absl::Span<const AdamTensorArgs> tensors,
                              absl::Span<const AdamScalars> scalars) {
  for (size_t s = 0; s < scalars.size(); ++s) {
    if (scalars[s].mode != AdamMode::kAdamW && scalars[s].mode != AdamMode::kAdamL2) {
      return absl::InvalidArgumentError(
          absl::StrCat("LaunchAdam scalars ", s, ": invalid mode ", static_cast<int>(scalars[s].mode)));
    }
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    const AdamTensorArgs& t = tensors[i];
    const std::string what = absl::StrCat("LaunchAdam tensor ", i);
    if (t.numel < 0) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": negative numel ", t.numel));
    }
    if (t.scalars_index >= scalars.size()) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": scalars_index ", t.scalars_index,
                                                     " but the launch has ", scalars.size(),
                                                     " scalars"));
    }
    if (!ValidDType(t.grad_dtype) || !ValidDType(t.param_dtype)) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": invalid dtype (grad ",
                                                     static_cast<int>(t.grad_dtype), ", param ",
                                                     static_cast<int>(t.param_dtype), ")"));
    }
    const bool state_ok = (t.state.master == DType::kF32 || t.state.master == DType::kBF16) &&
                          (t.state.moments == DType::kF32 || t.state.moments == DType::kBF16) &&
                          (t.state.rounding == StateRounding::kNearest || t.state.rounding == StateRounding::kStochastic);
    if (!state_ok) return absl::InvalidArgumentError(absl::StrCat(what, ": invalid state format"));
    if (t.numel == 0) continue;
    FERRY_RETURN_IF_ERROR(CheckPointer(t.master, DTypeSize(t.state.master), absl::StrCat(what, " master")));
    FERRY_RETURN_IF_ERROR(CheckPointer(t.exp_avg, DTypeSize(t.state.moments), absl::StrCat(what, " exp_avg")));
    FERRY_RETURN_IF_ERROR(CheckPointer(t.exp_avg_sq, DTypeSize(t.state.moments), absl::StrCat(what, " exp_avg_sq")));
    FERRY_RETURN_IF_ERROR(CheckPointer(t.grad, DTypeSize(t.grad_dtype), absl::StrCat(what, " grad")));
    if (t.param != nullptr) {
      FERRY_RETURN_IF_ERROR(
          CheckPointer(t.param, DTypeSize(t.param_dtype), absl::StrCat(what, " param")));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateConvertArgs(const void* dst, DType dst_dtype, const void* src, DType src_dtype,
                                 int64_t numel) {
  if (!ValidDType(dst_dtype) || !ValidDType(src_dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("LaunchConvert: invalid dtype (dst ",
                                                   static_cast<int>(dst_dtype), ", src ",
                                                   static_cast<int>(src_dtype), ")"));
  }
  if (numel < 0) {
    return absl::InvalidArgumentError(absl::StrCat("LaunchConvert: negative numel ", numel));
  }
  if (numel == 0) return absl::OkStatus();
  FERRY_RETURN_IF_ERROR(CheckPointer(dst, DTypeSize(dst_dtype), "LaunchConvert dst"));
  return CheckPointer(src, DTypeSize(src_dtype), "LaunchConvert src");
}

absl::StatusOr<std::unique_ptr<Device>> CreateDevice(const DeviceOptions& options) {
  const BackendChoice choice = ChooseBackend(options);
  if (choice.value.empty()) {  // automatic: CUDA when a device is present
#if defined(FERRY_HAVE_CUDA)
    absl::StatusOr<int> count = CudaDeviceCount();
    if (count.ok() && *count > 0) {
      if (options.ordinal < 0 || options.ordinal >= *count) {
        return absl::InvalidArgumentError(absl::StrCat("DeviceOptions::ordinal ", options.ordinal,
                                                       " but ", *count, " CUDA device(s) present"));
      }
      return CreateCudaDevice(options.ordinal);
    }
#endif
    return CreateHostDevice();
  }
  if (choice.value == "host") return CreateHostDevice();
  if (choice.value == "cuda") {
#if defined(FERRY_HAVE_CUDA)
    absl::StatusOr<int> count = CudaDeviceCount();
    if (!count.ok()) {
      return absl::UnavailableError(absl::StrCat(choice.source, "=cuda but no CUDA device is present (",
                                                 count.status().message(), ")"));
    }
    if (*count == 0) {
      return absl::UnavailableError(absl::StrCat(
          choice.source, "=cuda but no CUDA device is present (cudaGetDeviceCount: 0 devices)"));
    }
    if (options.ordinal < 0 || options.ordinal >= *count) {
      return absl::InvalidArgumentError(absl::StrCat(choice.source, "=cuda with ordinal ",
                                                     options.ordinal, " but ", *count,
                                                     " CUDA device(s) present"));
    }
    return CreateCudaDevice(options.ordinal);
#else
    return absl::FailedPreconditionError(absl::StrCat(
        choice.source,
        "=cuda but this build has no CUDA backend (nvcc was not found or FERRY_ENABLE_CUDA=OFF)"));
#endif
  }
  return absl::InvalidArgumentError(absl::StrCat(
      choice.source, "='", choice.value, "' is not a device backend (expected \"",
      ToAbsl(BackendName(Backend::kHost)), "\" or \"", ToAbsl(BackendName(Backend::kCuda)), "\")"));
}

std::vector<int> CudaNumaNodes() {
#if defined(FERRY_HAVE_CUDA)
  return CudaDeviceNumaNodes();
#else
  return {};
#endif
}

std::vector<int> CudaPrimaryContexts() {
#if defined(FERRY_HAVE_CUDA)
  return CudaDevicePrimaryContexts();
#else
  return {};
#endif
}

bool BuiltWithCuda() {
#if defined(FERRY_HAVE_CUDA)
  return true;
#else
  return false;
#endif
}

}  // namespace ferry
