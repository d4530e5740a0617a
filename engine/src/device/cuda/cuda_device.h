// The CUDA backend's factory (private to the device layer; everyone else calls CreateDevice()). This
// header includes no CUDA headers, so device.cc can use it without them; it is compiled into the build
// only when FERRY_HAVE_CUDA is defined.
#ifndef FERRY_DEVICE_CUDA_CUDA_DEVICE_H_
#define FERRY_DEVICE_CUDA_CUDA_DEVICE_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "device/device.h"

namespace ferry {

// The number of CUDA devices, or the error of cudaGetDeviceCount (no driver, no device, ...).
absl::StatusOr<int> CudaDeviceCount();

// The host NUMA node of CUDA device `ordinal`: its PCI bus id (cudaDeviceGetPCIBusId) looked up in
// /sys/bus/pci/devices/<id>/numa_node; -1 when unknown.
int CudaDeviceNumaNode(int ordinal);
// CudaDeviceNumaNode of every device; empty when there is none.
std::vector<int> CudaDeviceNumaNodes();

// The ordinals of the devices whose primary context this process holds (cuDevicePrimaryCtxGetState);
// empty when there is none or the driver cannot say.
std::vector<int> CudaDevicePrimaryContexts();

// A Device over CUDA device `ordinal`:
//   - streams are created with cudaStreamNonBlocking, events with cudaEventDisableTiming; WrapStream
//     does not own the native stream (nullptr is the legacy default stream);
//   - every call makes `ordinal` the calling thread's current device for its duration and restores
//     the previous one where the thread had a current context (a thread without one keeps `ordinal`,
//     so that no call creates another device's context);
//   - Free is cudaFree, which synchronizes the whole device: never on a hot path;
//   - LaunchAdam passes the tensor descriptors as kernel parameters (captured at launch), one launch
//     per up to 320 tensors and 16 scalar sets (see kernels.h).
// REQUIRES: 0 <= ordinal < CudaDeviceCount(); streams, events and buffers are destroyed before the
// device.
absl::StatusOr<std::unique_ptr<Device>> CreateCudaDevice(int ordinal);

}  // namespace ferry

#endif  // FERRY_DEVICE_CUDA_CUDA_DEVICE_H_
