#include "device/cuda/cuda_context.h"

#include <cuda.h>  // driver types for cuMemGetAddressRange and cuCtxGetCurrent (called through the runtime)
#include <cuda_runtime_api.h>

#include <vector>

#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "device/cuda/cuda_device.h"
#include "device/cuda/cuda_error.h"

namespace ferry {
namespace {

// A driver API function reached through the runtime's driver entry point (so that the build needs no
// libcuda and runs where there is none), or nullptr when the driver does not have it.
template <typename Fn>
Fn DriverFunction(const char* symbol) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(symbol, &fn, 12000, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return reinterpret_cast<Fn>(fn);
}

}  // namespace

namespace cuda_backend {

bool ThreadHasContext() {
  using GetCurrent = CUresult (*)(CUcontext*);
  static const GetCurrent get_current = DriverFunction<GetCurrent>("cuCtxGetCurrent");
  if (get_current == nullptr) return true;
  CUcontext context = nullptr;
  return get_current(&context) != CUDA_SUCCESS || context != nullptr;
}

uintptr_t AllocationStart(const void* p) {
  using GetAddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static const GetAddressRange get_range = DriverFunction<GetAddressRange>("cuMemGetAddressRange");
  if (get_range == nullptr || p == nullptr) return 0;
  CUdeviceptr base = 0;
  size_t size = 0;
  if (get_range(&base, &size, reinterpret_cast<CUdeviceptr>(p)) != CUDA_SUCCESS) return 0;
  return static_cast<uintptr_t>(base);
}

ScopedCudaDevice::ScopedCudaDevice(int ordinal) {
  cudaError_t err = cudaGetDevice(&previous_);
  if (err != cudaSuccess) {
    status_ = CudaError(absl::StrCat("cudaGetDevice (switching to cuda:", ordinal, ")"), err);
    return;
  }
  if (previous_ == ordinal) return;
  const bool had_context = ThreadHasContext();
  err = cudaSetDevice(ordinal);
  if (err != cudaSuccess) {
    status_ = CudaError(absl::StrCat("cudaSetDevice(", ordinal, ")"), err);
    return;
  }
  restore_ = had_context;
}

ScopedCudaDevice::~ScopedCudaDevice() {
  if (restore_) {
    const cudaError_t err = cudaSetDevice(previous_);
    if (err != cudaSuccess) {
      FERRY_LOG(ERROR) << CudaError(absl::StrCat("cudaSetDevice(", previous_, ") restoring"), err);
    }
  }
}

absl::Status CheckNoPendingError(absl::string_view before) {
  const cudaError_t pending = cudaPeekAtLastError();
  if (pending == cudaSuccess) return absl::OkStatus();
  return CudaError(absl::StrCat("an earlier CUDA call of this thread had failed before ", before),
                   pending);
}

}  // namespace cuda_backend

// Declared in cuda_device.h (the device layer asks it); here beside the driver's other context calls.
std::vector<int> CudaDevicePrimaryContexts() {
  using DeviceGet = CUresult (*)(CUdevice*, int);
  using PrimaryState = CUresult (*)(CUdevice, unsigned int*, int*);
  static const DeviceGet device_get = DriverFunction<DeviceGet>("cuDeviceGet");
  static const PrimaryState primary_state = DriverFunction<PrimaryState>("cuDevicePrimaryCtxGetState");
  absl::StatusOr<int> count = CudaDeviceCount();
  std::vector<int> active;
  if (device_get == nullptr || primary_state == nullptr) return active;
  for (int i = 0; count.ok() && i < *count; ++i) {
    CUdevice device = 0;
    unsigned int flags = 0;
    int is_active = 0;
    if (device_get(&device, i) == CUDA_SUCCESS && primary_state(device, &flags, &is_active) == CUDA_SUCCESS &&
        is_active != 0) {
      active.push_back(i);
    }
  }
  return active;
}

}  // namespace ferry
