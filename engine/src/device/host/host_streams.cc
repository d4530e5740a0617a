#include "device/host/host_streams.h"

#include <condition_variable>
#include <deque>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/thread_affinity.h"
#include "ferry/status.h"

namespace ferry::host_backend {
namespace {

thread_local bool tls_on_stream_worker = false;

// What a completed Record leaves behind. Generations: each Record takes the next number; a Synchronize
// or WaitFor waits for the generation that was latest when it was called. Safe for concurrent use.
class EventState {
 public:
  // Starts a record; returns its generation.
  uint64_t BeginRecord() {
    std::lock_guard<std::mutex> lock(mu_);
    ++latest_;
    pending_.insert(latest_);
    return latest_;
  }
  // Marks generation `gen` complete; `stream_error` is the recording stream's error so far.
  void Complete(uint64_t gen, const absl::Status& stream_error) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      pending_.erase(gen);
      if (!stream_error.ok() && error_.ok()) error_ = stream_error;
    }
    completed_.notify_all();
  }
  uint64_t latest() const {
    std::lock_guard<std::mutex> lock(mu_);
    return latest_;
  }
  bool IsComplete(uint64_t gen) const {
    std::lock_guard<std::mutex> lock(mu_);
    return !pending_.contains(gen);
  }
  // Blocks until generation `gen` is complete; returns the error its stream had, if any.
  absl::Status Wait(uint64_t gen) const {
    std::unique_lock<std::mutex> lock(mu_);
    completed_.wait(
        lock, [this, gen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !pending_.contains(gen); });
    return error_;
  }

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable completed_;  // signalled by Complete
  uint64_t latest_ ABSL_GUARDED_BY(mu_) = 0;   // 0: never recorded
  absl::flat_hash_set<uint64_t> pending_ ABSL_GUARDED_BY(mu_);
  absl::Status error_ ABSL_GUARDED_BY(mu_);
};

// Event: safe for concurrent use (the state is shared with the stream work that completes it, so the
// event may be destroyed while a record is still pending).
class HostEvent final : public Event {
 public:
  HostEvent() : state_(std::make_shared<EventState>()) {}
  absl::Status Synchronize() override { return state_->Wait(state_->latest()); }
  absl::StatusOr<bool> Query() override { return state_->IsComplete(state_->latest()); }
  const std::shared_ptr<EventState>& state() const { return state_; }

 private:
  std::shared_ptr<EventState> state_;
};

absl::StatusOr<HostEvent*> AsHostEvent(Event& event, absl::string_view what) {
  auto* e = dynamic_cast<HostEvent*>(&event);
  if (e == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": the event was not created by a host-backend device"));
  }
  return e;
}

}  // namespace

// The queue and counters of one worker-thread stream. Safe for concurrent use; shared between the
// stream, its worker and the device's stream registry (which waits on it in Free).
class QueueCore {
 public:
  // Appends `op`; returns its ticket (ops are numbered from 1 in enqueue order).
  uint64_t Push(Op op) {
    uint64_t ticket;
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(op));
      ticket = ++enqueued_;
    }
    work_.notify_one();
    return ticket;
  }
  // The ticket of the last op enqueued so far.
  uint64_t last_ticket() const {
    std::lock_guard<std::mutex> lock(mu_);
    return enqueued_;
  }
  // Blocks until the op with `ticket` (and all before it) has run; returns the first error.
  absl::Status WaitUntil(uint64_t ticket) const {
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock,
               [this, ticket]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return completed_ >= ticket; });
    return error_;
  }
  absl::Status error() const {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }
  void Stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    work_.notify_one();
  }
  // The worker loop: runs ops in order until stopped and drained.
  void Run() {
    tls_on_stream_worker = true;
    while (true) {
      Op op;
      {
        std::unique_lock<std::mutex> lock(mu_);
        work_.wait(lock,
                   [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping and drained
        op = std::move(queue_.front());
        queue_.pop_front();
      }
      absl::Status status = op();
      op = nullptr;  // destroy the closure (and what it captured) before the op counts as complete
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!status.ok() && error_.ok()) error_ = std::move(status);
        ++completed_;
      }
      done_.notify_all();
    }
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable work_;          // signalled by Push and Stop (one waiter: the worker)
  mutable std::condition_variable done_;  // signalled when an op completes
  std::deque<Op> queue_ ABSL_GUARDED_BY(mu_);
  uint64_t enqueued_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t completed_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

void StreamRegistry::Add(std::shared_ptr<QueueCore> core) {
  std::lock_guard<std::mutex> lock(mu_);
  cores_.insert(std::move(core));
}

void StreamRegistry::Remove(const std::shared_ptr<QueueCore>& core) {
  std::lock_guard<std::mutex> lock(mu_);
  cores_.erase(core);
}

void StreamRegistry::WaitForAll() const {
  std::vector<std::pair<std::shared_ptr<QueueCore>, uint64_t>> targets;
  {
    std::lock_guard<std::mutex> lock(mu_);
    targets.reserve(cores_.size());
    for (const auto& core : cores_) targets.emplace_back(core, core->last_ticket());
  }
  for (const auto& [core, ticket] : targets) core->WaitUntil(ticket).IgnoreError();
}

namespace {

// A stream with its own worker thread.
class HostQueueStream final : public HostStreamBase {
 public:
  explicit HostQueueStream(std::shared_ptr<StreamRegistry> registry)
      : registry_(std::move(registry)), core_(std::make_shared<QueueCore>()) {
    registry_->Add(core_);
    worker_ = std::thread([core = core_] {
      NameCurrentThread("ferry-hstream");
      core->Run();
    });
  }
  // Finishes the queued work, then joins the worker.
  ~HostQueueStream() override {
    core_->Stop();
    worker_.join();
    registry_->Remove(core_);
  }

  absl::Status Submit(Op op) override {
    core_->Push(std::move(op));
    return absl::OkStatus();
  }
  absl::Status Record(Event& event) override {
    FERRY_ASSIGN_OR_RETURN(HostEvent * e, AsHostEvent(event, "Stream::Record"));
    std::shared_ptr<EventState> state = e->state();
    const uint64_t gen = state->BeginRecord();
    // The record runs on the worker after everything before it; it passes on the stream's error.
    core_->Push([state, gen, core = core_.get()] {
      state->Complete(gen, core->error());
      return absl::OkStatus();
    });
    return absl::OkStatus();
  }
  absl::Status WaitFor(Event& event) override {
    FERRY_ASSIGN_OR_RETURN(HostEvent * e, AsHostEvent(event, "Stream::WaitFor"));
    std::shared_ptr<EventState> state = e->state();
    const uint64_t gen = state->latest();
    if (gen == 0 || state->IsComplete(gen)) return absl::OkStatus();
    core_->Push([state, gen] {
      state->Wait(gen).IgnoreError();  // the other stream's error is that stream's to report
      return absl::OkStatus();
    });
    return absl::OkStatus();
  }
  absl::Status Synchronize() override { return core_->WaitUntil(core_->last_ticket()); }
  absl::Status EnqueueHost(std::function<void()> fn) override {
    if (!fn) return absl::InvalidArgumentError("Stream::EnqueueHost: empty function");
    core_->Push([fn = std::move(fn)] {
      fn();
      return absl::OkStatus();
    });
    return absl::OkStatus();
  }

 private:
  std::shared_ptr<StreamRegistry> registry_;
  std::shared_ptr<QueueCore> core_;
  std::thread worker_;
};

// WrapStream(nullptr): the calling thread is the stream; work runs before the enqueueing call returns.
class HostInlineStream final : public HostStreamBase {
 public:
  absl::Status Submit(Op op) override {
    absl::Status status = op();
    if (!status.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      if (error_.ok()) error_ = std::move(status);
    }
    return absl::OkStatus();
  }
  absl::Status Record(Event& event) override {
    FERRY_ASSIGN_OR_RETURN(HostEvent * e, AsHostEvent(event, "Stream::Record"));
    const uint64_t gen = e->state()->BeginRecord();
    e->state()->Complete(gen, error());
    return absl::OkStatus();
  }
  absl::Status WaitFor(Event& event) override {
    FERRY_ASSIGN_OR_RETURN(HostEvent * e, AsHostEvent(event, "Stream::WaitFor"));
    e->state()->Wait(e->state()->latest()).IgnoreError();
    return absl::OkStatus();
  }
  absl::Status Synchronize() override { return error(); }
  absl::Status EnqueueHost(std::function<void()> fn) override {
    if (!fn) return absl::InvalidArgumentError("Stream::EnqueueHost: empty function");
    fn();
    return absl::OkStatus();
  }

 private:
  absl::Status error() const {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }
  mutable std::mutex mu_;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

bool OnStreamWorker() { return tls_on_stream_worker; }

std::unique_ptr<Stream> NewQueueStream(std::shared_ptr<StreamRegistry> registry) {
  return std::make_unique<HostQueueStream>(std::move(registry));
}

std::unique_ptr<Stream> NewInlineStream() { return std::make_unique<HostInlineStream>(); }

std::unique_ptr<Event> NewEvent() { return std::make_unique<HostEvent>(); }

absl::StatusOr<HostStreamBase*> AsHostStream(Stream& stream, absl::string_view what) {
  auto* s = dynamic_cast<HostStreamBase*>(&stream);
  if (s == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": the stream was not created by a host-backend device"));
  }
  return s;
}

}  // namespace ferry::host_backend
