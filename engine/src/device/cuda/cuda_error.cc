#include "device/cuda/cuda_error.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace ferry {

absl::Status CudaError(std::string_view context, cudaError_t err) {
  (void)cudaGetLastError();
  const std::string msg = absl::StrCat(absl::string_view(context.data(), context.size()), ": ",
                                       cudaGetErrorString(err), " [", cudaGetErrorName(err), "]");
  switch (err) {
    case cudaErrorMemoryAllocation: return absl::ResourceExhaustedError(msg);
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevice:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidResourceHandle:
    case cudaErrorInvalidMemcpyDirection: return absl::InvalidArgumentError(msg);
    case cudaErrorHostMemoryAlreadyRegistered: return absl::AlreadyExistsError(msg);
    case cudaErrorHostMemoryNotRegistered: return absl::NotFoundError(msg);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver: return absl::UnavailableError(msg);
    default: return absl::InternalError(msg);
  }
}

absl::string_view CudaCallName(absl::string_view call) {
  const size_t paren = call.find('(');
  absl::string_view name = call.substr(0, paren);
  while (!name.empty() && name.back() == ' ') name.remove_suffix(1);
  return name;
}

}  // namespace ferry
