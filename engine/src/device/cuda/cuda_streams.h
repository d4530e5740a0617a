// The CUDA backend's streams and events (private to device/cuda): a cudaStream_t and a cudaEvent_t
// behind the device layer's Stream and Event. Every call enters the object's device for its duration
// (cuda_context.h). Safe for concurrent use (CUDA's streams and events are).
#ifndef FERRY_DEVICE_CUDA_CUDA_STREAMS_H_
#define FERRY_DEVICE_CUDA_CUDA_STREAMS_H_

#include <cuda_runtime_api.h>

#include <functional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "device/device.h"

namespace ferry::cuda_backend {

// Event: cudaEvent_t (created with cudaEventDisableTiming, and cudaEventBlockingSync for a blocking
// event), owned.
class CudaEvent final : public Event {
 public:
  CudaEvent(int ordinal, cudaEvent_t event) : ordinal_(ordinal), event_(event) {}
  ~CudaEvent() override;
  absl::Status Synchronize() override;
  absl::StatusOr<bool> Query() override;
  cudaEvent_t native() const { return event_; }

 private:
  const int ordinal_;
  const cudaEvent_t event_;
};

// Stream: a cudaStream_t, owned (cudaStreamNonBlocking, from CreateStream) or borrowed (WrapStream;
// nullptr is the legacy default stream).
class CudaStream final : public Stream {
 public:
  CudaStream(int ordinal, cudaStream_t stream, bool owned)
      : ordinal_(ordinal), stream_(stream), owned_(owned) {}
  // An owned stream is destroyed; work still queued on it completes first.
  ~CudaStream() override;

  absl::Status Record(Event& event) override;
  absl::Status WaitFor(Event& event) override;
  absl::Status Synchronize() override;
  absl::Status EnqueueHost(std::function<void()> fn) override;
  void* native() const override { return stream_; }
  cudaStream_t stream() const { return stream_; }

 private:
  const int ordinal_;
  const cudaStream_t stream_;
  const bool owned_;
};

// `stream` as this backend's, or InvalidArgument naming `what` when another device made it.
absl::StatusOr<CudaStream*> AsCudaStream(Stream& stream, absl::string_view what);

}  // namespace ferry::cuda_backend

#endif  // FERRY_DEVICE_CUDA_CUDA_STREAMS_H_
