// The host backend's streams and events (private to device/host): a stream is a worker thread that
// runs its work in order (or, for WrapStream(nullptr), the calling thread, which runs it before the
// enqueueing call returns); an event completes when the work recorded before it has run. A stream's
// first error is sticky and passes to the events it records. Safe for concurrent use.
//
// Synchronization uses std::mutex and std::condition_variable rather than absl::Mutex: the
// distributions' Abseil is not built with ThreadSanitizer, whose runtime therefore cannot see
// absl::Mutex's synchronization and would report races on everything it guards. This backend is what
// the other layers' concurrency tests run on, so it must stay checkable with -DFERRY_TSAN=ON.
#ifndef FERRY_DEVICE_HOST_HOST_STREAMS_H_
#define FERRY_DEVICE_HOST_HOST_STREAMS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "device/device.h"

namespace ferry::host_backend {

// One unit of stream work. Its Status becomes the stream's error if it is the first failure.
using Op = std::function<absl::Status()>;

// True on the worker thread of a stream from NewQueueStream (Free must not wait for streams there: it
// could be waiting for itself).
bool OnStreamWorker();

// The queue of one worker-thread stream (host_streams.cc).
class QueueCore;

// The worker-thread streams of one device, so Free can wait for all of them. Safe for concurrent use.
class StreamRegistry {
 public:
  void Add(std::shared_ptr<QueueCore> core);
  void Remove(const std::shared_ptr<QueueCore>& core);
  // Waits for the work enqueued so far on every registered stream.
  void WaitForAll() const;

 private:
  mutable std::mutex mu_;
  absl::flat_hash_set<std::shared_ptr<QueueCore>> cores_ ABSL_GUARDED_BY(mu_);
};

// What the device's operations need from a host stream. Safe for concurrent use.
class HostStreamBase : public Stream {
 public:
  // Runs `op` in stream order (now, or on the worker). The returned Status is an enqueue error; the
  // op's own failure becomes the stream's (sticky) error.
  virtual absl::Status Submit(Op op) = 0;
  void* native() const override { return nullptr; }
};

// A stream with its own worker thread, in `registry` while it lives. Its destructor finishes the
// queued work, then joins the worker.
std::unique_ptr<Stream> NewQueueStream(std::shared_ptr<StreamRegistry> registry);

// WrapStream(nullptr)'s stream: the calling thread runs the work before the enqueueing call returns.
std::unique_ptr<Stream> NewInlineStream();

// An event of this backend (its state is shared with the stream work that completes it, so the event
// may be destroyed while a record is still pending).
std::unique_ptr<Event> NewEvent();

// `stream` as this backend's, or InvalidArgument naming `what` when another device made it.
absl::StatusOr<HostStreamBase*> AsHostStream(Stream& stream, absl::string_view what);

}  // namespace ferry::host_backend

#endif  // FERRY_DEVICE_HOST_HOST_STREAMS_H_
