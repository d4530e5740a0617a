// cudaError_t -> absl::Status, in one place (CUDA backend only; includes the CUDA runtime headers).
#ifndef FERRY_DEVICE_CUDA_CUDA_ERROR_H_
#define FERRY_DEVICE_CUDA_CUDA_ERROR_H_

#include <cuda_runtime_api.h>

#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace ferry {

// A Status for a failed CUDA call: "<context>: <cudaGetErrorString> [<cudaGetErrorName>]", with a code
// chosen from the error (out of memory -> ResourceExhausted, invalid value/handle/device ->
// InvalidArgument, already/not registered -> AlreadyExists/NotFound, no device or driver ->
// Unavailable, anything else -> Internal). The error is now reported through the Status, so this also
// clears the calling thread's last CUDA error (cudaGetLastError), which would otherwise be mistaken
// for the failure of a later kernel launch. REQUIRES: err != cudaSuccess.
absl::Status CudaError(std::string_view context, cudaError_t err);

// "cudaMemcpyAsync(dst, src, ...)" -> "cudaMemcpyAsync": the called function of a stringified call.
absl::string_view CudaCallName(absl::string_view call);

}  // namespace ferry

// Evaluates the CUDA call `call`; on failure returns CudaError naming the called function and
// `context` (an expression convertible to absl::AlphaNum, evaluated only on failure).
#define FERRY_CUDA_RETURN_IF_ERROR(call, context)                                              \
  do {                                                                                         \
    const cudaError_t ferry_cuda_err_ = (call);                                                \
    if (ferry_cuda_err_ != cudaSuccess) {                                                      \
      return ::ferry::CudaError(::absl::StrCat(::ferry::CudaCallName(#call), " in ", context), \
                                ferry_cuda_err_);                                              \
    }                                                                                          \
  } while (0)

#endif  // FERRY_DEVICE_CUDA_CUDA_ERROR_H_
