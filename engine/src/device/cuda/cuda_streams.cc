#include "device/cuda/cuda_streams.h"

#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "device/cuda/cuda_context.h"
#include "device/cuda/cuda_error.h"
#include "ferry/status.h"

namespace ferry::cuda_backend {
namespace {

void CUDART_CB RunHostFunction(void* arg) {
  std::unique_ptr<std::function<void()>> fn(static_cast<std::function<void()>*>(arg));
  (*fn)();
}

absl::StatusOr<CudaEvent*> AsCudaEvent(Event& event, absl::string_view what) {
  auto* e = dynamic_cast<CudaEvent*>(&event);
  if (e == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": the event was not created by a CUDA-backend device"));
  }
  return e;
}

}  // namespace

CudaEvent::~CudaEvent() {
  ScopedCudaDevice guard(ordinal_);
  const cudaError_t err = cudaEventDestroy(event_);
  if (err != cudaSuccess) FERRY_LOG(ERROR) << CudaError("cudaEventDestroy", err);
}

absl::Status CudaEvent::Synchronize() {
  FERRY_CUDA_ENTER_DEVICE(ordinal_);
  FERRY_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(event_), "Event::Synchronize");
  return absl::OkStatus();
}

absl::StatusOr<bool> CudaEvent::Query() {
  FERRY_CUDA_ENTER_DEVICE(ordinal_);
  const cudaError_t err = cudaEventQuery(event_);
  if (err == cudaSuccess) return true;
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();  // "not ready" is an answer, not an error: do not leave it behind
    return false;
  }
  return CudaError("cudaEventQuery in Event::Query", err);
}

CudaStream::~CudaStream() {
  if (!owned_) return;
  ScopedCudaDevice guard(ordinal_);
  // Work still queued completes; the stream's resources are released afterwards.
  const cudaError_t err = cudaStreamDestroy(stream_);
  if (err != cudaSuccess) FERRY_LOG(ERROR) << CudaError("cudaStreamDestroy", err);
}

absl::Status CudaStream::Record(Event& event) {
  FERRY_ASSIGN_OR_RETURN(CudaEvent * e, AsCudaEvent(event, "Stream::Record"));
  FERRY_CUDA_ENTER_DEVICE(ordinal_);
  FERRY_CUDA_RETURN_IF_ERROR(cudaEventRecord(e->native(), stream_), "Stream::Record");
  return absl::OkStatus();
}

absl::Status CudaStream::WaitFor(Event& event) {
  FERRY_ASSIGN_OR_RETURN(CudaEvent * e, AsCudaEvent(event, "Stream::WaitFor"));
  FERRY_CUDA_ENTER_DEVICE(ordinal_);
  FERRY_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream_, e->native(), 0), "Stream::WaitFor");
  return absl::OkStatus();
}

absl::Status CudaStream::Synchronize() {
  FERRY_CUDA_ENTER_DEVICE(ordinal_);
  FERRY_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_), "Stream::Synchronize");
  return absl::OkStatus();
}

absl::Status CudaStream::EnqueueHost(std::function<void()> fn) {
  if (!fn) return absl::InvalidArgumentError("Stream::EnqueueHost: empty function");
  FERRY_CUDA_ENTER_DEVICE(ordinal_);
  // The closure lives on the heap until the callback has run it; freed here if the launch fails.
  auto closure = std::make_unique<std::function<void()>>(std::move(fn));
  FERRY_CUDA_RETURN_IF_ERROR(cudaLaunchHostFunc(stream_, &RunHostFunction, closure.get()),
                             "Stream::EnqueueHost");
  closure.release();  // now owned by the callback
  return absl::OkStatus();
}

absl::StatusOr<CudaStream*> AsCudaStream(Stream& stream, absl::string_view what) {
  auto* s = dynamic_cast<CudaStream*>(&stream);
  if (s == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": the stream was not created by a CUDA-backend device"));
  }
  return s;
}

}  // namespace ferry::cuda_backend
