// The CUDA backend's view of the driver's contexts (private to device/cuda): which device a call runs
// on, whether a thread holds a context, which allocation a pointer lies in. This header includes no
// CUDA headers.
#ifndef FERRY_DEVICE_CUDA_CUDA_CONTEXT_H_
#define FERRY_DEVICE_CUDA_CUDA_CONTEXT_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "ferry/status.h"  // FERRY_RETURN_IF_ERROR, in FERRY_CUDA_ENTER_DEVICE

namespace ferry::cuda_backend {

// Whether the calling thread has a current CUDA context (cuCtxGetCurrent); true when that cannot be
// told (the guard then behaves as it always did).
bool ThreadHasContext();

// The start of the device allocation holding `p` (cuMemGetAddressRange), or 0 when `p` is not device
// memory.
uintptr_t AllocationStart(const void* p);

// Makes `ordinal` the calling thread's current device for the guard's lifetime, then restores the
// previous one where the thread had one (the trainer's threads keep their own current device). A
// thread without a current context (Ferry's own, or a trainer thread that never used CUDA) keeps
// `ordinal`: cudaGetDevice says 0 there, and switching such a thread to device 0 would create device
// 0's primary context in this process (cudaSetDevice initializes it since CUDA 12), so that on a host
// of several GPUs every rank but the one on GPU 0 would hold a context, and its memory, on GPU 0.
// One thread.
class ScopedCudaDevice {
 public:
  explicit ScopedCudaDevice(int ordinal);
  ~ScopedCudaDevice();
  ScopedCudaDevice(const ScopedCudaDevice&) = delete;
  ScopedCudaDevice& operator=(const ScopedCudaDevice&) = delete;
  const absl::Status& status() const { return status_; }

 private:
  int previous_ = 0;
  bool restore_ = false;
  absl::Status status_;
};

// Kernel launches report their failure through cudaGetLastError, so an error left behind by an earlier
// CUDA call of this thread (outside Ferry: Ferry's own calls clear theirs in CudaError) would be taken
// for the launch's. Report such an error as what it is instead.
absl::Status CheckNoPendingError(absl::string_view before);

}  // namespace ferry::cuda_backend

// Enters `ordinal` for the rest of the scope (ScopedCudaDevice); returns its error from the enclosing
// function when the switch failed.
#define FERRY_CUDA_ENTER_DEVICE(ordinal)                                 \
  ::ferry::cuda_backend::ScopedCudaDevice ferry_device_guard_(ordinal); \
  FERRY_RETURN_IF_ERROR(ferry_device_guard_.status())

#endif  // FERRY_DEVICE_CUDA_CUDA_CONTEXT_H_
