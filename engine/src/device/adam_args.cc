// The Adam launch API shared by both backends: checks of LaunchAdamWith's runtime inputs and of
// LaunchGradStats' arguments, and the Device defaults for backends without them.
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "device/device.h"
#include "ferry/status.h"

namespace ferry {
namespace {

absl::Status CheckAligned(const void* p, size_t alignment, absl::string_view what) {
  if (reinterpret_cast<uintptr_t>(p) % alignment != 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, " (", absl::Hex(reinterpret_cast<uintptr_t>(p)),
                                                   ") is not aligned to ", alignment, " bytes"));
  }
  return absl::OkStatus();
}

bool ValidDType(DType t) { return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16; }

}  // namespace

absl::Status ValidateAdamRuntimeArgs(const AdamRuntimeArgs& runtime) {
  FERRY_RETURN_IF_ERROR(CheckAligned(runtime.grad_stats, 8, "LaunchAdamWith grad_stats"));
  FERRY_RETURN_IF_ERROR(CheckAligned(runtime.grad_scale, 4, "LaunchAdamWith grad_scale"));
  FERRY_RETURN_IF_ERROR(CheckAligned(runtime.lr, 4, "LaunchAdamWith lr"));
  FERRY_RETURN_IF_ERROR(CheckAligned(runtime.step, 8, "LaunchAdamWith step"));
  if (!(runtime.max_grad_norm >= 0.0f) || !(runtime.max_grad_norm <= 3.4028234663852886e38f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("LaunchAdamWith max_grad_norm must be finite and >= 0, got ", runtime.max_grad_norm));
  }
  if (runtime.max_grad_norm > 0.0f && runtime.grad_stats == nullptr) {
    return absl::InvalidArgumentError(
        "LaunchAdamWith max_grad_norm > 0 needs grad_stats (the gradient check of the step)");
  }
  return absl::OkStatus();
}

absl::Status ValidateGradStatsArgs(absl::Span<const GradTensorArgs> grads, const void* workspace,
                                   size_t workspace_bytes) {
  for (size_t i = 0; i < grads.size(); ++i) {
    const GradTensorArgs& g = grads[i];
    const std::string what = absl::StrCat("LaunchGradStats tensor ", i);
    if (g.numel < 0) return absl::InvalidArgumentError(absl::StrCat(what, ": negative numel ", g.numel));
    if (!ValidDType(g.dtype)) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": invalid dtype ", static_cast<int>(g.dtype)));
    }
    if (g.numel == 0) continue;
    if (g.grad == nullptr) return absl::InvalidArgumentError(absl::StrCat(what, ": null grad"));
    FERRY_RETURN_IF_ERROR(CheckAligned(g.grad, DTypeSize(g.dtype), absl::StrCat(what, " grad")));
  }
  if (workspace == nullptr) return absl::InvalidArgumentError("LaunchGradStats: null workspace");
  FERRY_RETURN_IF_ERROR(CheckAligned(workspace, 8, "LaunchGradStats workspace"));
  if (workspace_bytes < GradStatsWorkspaceBytes(grads.size())) {
    return absl::InvalidArgumentError(absl::StrCat("LaunchGradStats: the workspace has ", workspace_bytes,
                                                   " bytes, ", grads.size(), " tensors need ",
                                                   GradStatsWorkspaceBytes(grads.size())));
  }
  return absl::OkStatus();
}

absl::Status Device::LaunchAdamWith(absl::Span<const AdamTensorArgs> tensors,
                                    absl::Span<const AdamScalars> scalars, const AdamRuntimeArgs& runtime,
                                    Stream& stream) {
  if (runtime.empty()) return LaunchAdam(tensors, scalars, stream);
  return absl::UnimplementedError(
      absl::StrCat("LaunchAdamWith with runtime inputs is not supported by the ", name(), " device"));
}

absl::Status Device::LaunchGradStats(absl::Span<const GradTensorArgs> grads, void* workspace,
                                     size_t workspace_bytes, Stream& stream) {
  return absl::UnimplementedError(
      absl::StrCat("LaunchGradStats is not supported by the ", name(), " device"));
}

}  // namespace ferry
