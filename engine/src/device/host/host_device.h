// The host backend's factory (private to the device layer; everyone else calls CreateDevice()).
#ifndef FERRY_DEVICE_HOST_HOST_DEVICE_H_
#define FERRY_DEVICE_HOST_HOST_DEVICE_H_

#include <memory>

#include "device/device.h"

namespace ferry {

// A Device whose "device memory" is 256-byte aligned host memory and whose streams are worker threads.
//   - Allocate fills new memory with 0xFF bytes (NaN in every float type), so reading memory that was
//     never written shows up in results instead of passing by luck.
//   - Any host memory may be used as device memory; memory from Allocate is tracked, so a copy or
//     memset that would run past the end of an allocation is refused when enqueued, a kernel that would
//     is a stream error when it runs (as an illegal address is on a GPU), and Free of a pointer that
//     Allocate did not return (or returned and was freed) is logged and otherwise ignored.
//   - Free first waits for all work enqueued so far on every stream of this device (cudaFree
//     synchronizes the device too), except when called on a stream's worker thread.
//   - Streams finish their queue before their destructor returns. A stream's first error is sticky:
//     Synchronize returns it from then on; later work still runs (so events complete).
// REQUIRES: streams, events and buffers are destroyed before the device.
std::unique_ptr<Device> CreateHostDevice();

}  // namespace ferry

#endif  // FERRY_DEVICE_HOST_HOST_DEVICE_H_
