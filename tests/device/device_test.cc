// Tests of the device layer's host backend (streams as worker threads, events, copies, registration,
// errors) and of CreateDevice's backend choice. Blocking host functions released by the test make the
// ordering checks deterministic: nothing here depends on timing.
#include "device/device.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ferry {
namespace {

using ::testing::HasSubstr;

#define FERRY_TEST_ASSERT_OK(expr)               \
  do {                                           \
    const absl::Status s_ = (expr);              \
    ASSERT_TRUE(s_.ok()) << #expr << ": " << s_; \
  } while (0)
#define FERRY_TEST_EXPECT_OK(expr)               \
  do {                                           \
    const absl::Status s_ = (expr);              \
    EXPECT_TRUE(s_.ok()) << #expr << ": " << s_; \
  } while (0)

// Sets an environment variable for the scope of a test and restores the old value.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    had_old_ = old != nullptr;
    if (had_old_) old_ = old;
    if (value == nullptr) {
      unsetenv(name);
    } else {
      setenv(name, value, 1);
    }
  }
  ~ScopedEnv() {
    if (had_old_) {
      setenv(name_.c_str(), old_.c_str(), 1);
    } else {
      unsetenv(name_.c_str());
    }
  }

 private:
  std::string name_;
  std::string old_;
  bool had_old_ = false;
};

class HostDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Device>> device = CreateDevice({.backend = "host"});
    ASSERT_TRUE(device.ok()) << device.status();
    device_ = *std::move(device);
    ASSERT_EQ(device_->backend(), Backend::kHost);
  }
  std::unique_ptr<Stream> NewStream() {
    absl::StatusOr<std::unique_ptr<Stream>> s = device_->CreateStream();
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *std::move(s) : nullptr;
  }
  std::unique_ptr<Event> NewEvent() {
    absl::StatusOr<std::unique_ptr<Event>> e = device_->CreateEvent();
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? *std::move(e) : nullptr;
  }
  DeviceBuffer Alloc(size_t bytes) {
    absl::StatusOr<DeviceBuffer> b = device_->Allocate(bytes);
    EXPECT_TRUE(b.ok()) << b.status();
    return b.ok() ? *std::move(b) : DeviceBuffer();
  }

  std::unique_ptr<Device> device_;
};

// Notifies `n` on scope exit unless already notified, so a failed assertion does not leave a stream
// blocked forever in a host function (and the test hanging in a destructor that waits for it).
class ReleaseOnExit {
 public:
  explicit ReleaseOnExit(absl::Notification& n) : n_(n) {}
  ~ReleaseOnExit() {
    if (!n_.HasBeenNotified()) n_.Notify();
  }
  ReleaseOnExit(const ReleaseOnExit&) = delete;
  ReleaseOnExit& operator=(const ReleaseOnExit&) = delete;

 private:
  absl::Notification& n_;
};

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> out(n);
  for (uint8_t& b : out) b = static_cast<uint8_t>(rng());
  return out;
}

TEST_F(HostDeviceTest, NameAndFreeMemory) {
  EXPECT_THAT(device_->name(), HasSubstr("host"));
  absl::StatusOr<size_t> free = device_->FreeMemory();
  ASSERT_TRUE(free.ok()) << free.status();
  EXPECT_GT(*free, 0u);
  EXPECT_EQ(BackendName(Backend::kHost), "host");
  EXPECT_EQ(BackendName(Backend::kCuda), "cuda");
}

TEST_F(HostDeviceTest, AllocateZeroIsEmptyAndAllocationsAreAligned) {
  DeviceBuffer empty = Alloc(0);
  EXPECT_EQ(empty.data(), nullptr);
  EXPECT_EQ(empty.bytes(), 0u);
  for (size_t bytes : {1u, 3u, 64u, 1000u, 4097u}) {
    DeviceBuffer b = Alloc(bytes);
    ASSERT_NE(b.data(), nullptr);
    EXPECT_EQ(b.bytes(), bytes);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % 64, 0u) << bytes;
  }
}

TEST_F(HostDeviceTest, DeviceBufferMoveTransfersOwnership) {
  DeviceBuffer a = Alloc(128);
  void* p = a.data();
  DeviceBuffer b = std::move(a);
  EXPECT_EQ(a.data(), nullptr);  // NOLINT(bugprone-use-after-move): checking the moved-from state
  EXPECT_EQ(a.bytes(), 0u);
  EXPECT_EQ(b.data(), p);
  DeviceBuffer c = Alloc(64);
  c = std::move(b);  // frees c's old memory, takes b's
  EXPECT_EQ(c.data(), p);
  EXPECT_EQ(c.bytes(), 128u);
  c.Reset();
  EXPECT_EQ(c.data(), nullptr);
  c.Reset();  // no-op
}

TEST_F(HostDeviceTest, FreeOfForeignPointerIsIgnored) {
  // A pointer Allocate did not return must not reach free(): with glibc (and under ASan) that would
  // abort the process.
  uint64_t on_stack[4] = {1, 2, 3, 4};
  device_->Free(on_stack);
  DeviceBuffer b = Alloc(32);
  device_->Free(static_cast<char*>(b.data()) + 8);  // interior pointer
  EXPECT_EQ(on_stack[2], 3u);
  // The buffer is still live and usable.
  std::vector<uint8_t> src = RandomBytes(32, 1), dst(32);
  FERRY_TEST_ASSERT_OK(device_->Copy(b.data(), src.data(), 32, CopyKind::kHostToDevice));
  FERRY_TEST_ASSERT_OK(device_->Copy(dst.data(), b.data(), 32, CopyKind::kDeviceToHost));
  EXPECT_EQ(src, dst);
}

TEST_F(HostDeviceTest, CopiesRoundTripRandomBytesExactly) {
  std::unique_ptr<Stream> stream = NewStream();
  for (size_t bytes : {1u, 7u, 4096u, 100003u}) {
    const std::vector<uint8_t> src = RandomBytes(bytes, static_cast<uint32_t>(bytes));
    DeviceBuffer d1 = Alloc(bytes + 3);
    DeviceBuffer d2 = Alloc(bytes);
    std::vector<uint8_t> h2(bytes, 0), h3(bytes, 0);
    char* d1_odd = static_cast<char*>(d1.data()) + 3;  // unaligned device address
    FERRY_TEST_ASSERT_OK(
        device_->CopyAsync(d1_odd, src.data(), bytes, CopyKind::kHostToDevice, *stream));
    FERRY_TEST_ASSERT_OK(
        device_->CopyAsync(d2.data(), d1_odd, bytes, CopyKind::kDeviceToDevice, *stream));
    FERRY_TEST_ASSERT_OK(
        device_->CopyAsync(h2.data(), d2.data(), bytes, CopyKind::kDeviceToHost, *stream));
    FERRY_TEST_ASSERT_OK(
        device_->CopyAsync(h3.data(), h2.data(), bytes, CopyKind::kHostToHost, *stream));
    FERRY_TEST_ASSERT_OK(stream->Synchronize());
    EXPECT_EQ(h2, src) << bytes;
    EXPECT_EQ(h3, src) << bytes;
  }
}

TEST_F(HostDeviceTest, MemsetWritesTheByteAndOnlyTheRange) {
  std::unique_ptr<Stream> stream = NewStream();
  DeviceBuffer d = Alloc(1000);
  const std::vector<uint8_t> src = RandomBytes(1000, 7);
  FERRY_TEST_ASSERT_OK(device_->Copy(d.data(), src.data(), 1000, CopyKind::kHostToDevice));
  FERRY_TEST_ASSERT_OK(device_->MemsetAsync(static_cast<char*>(d.data()) + 100, 0x5A, 333, *stream));
  std::vector<uint8_t> out(1000);
  FERRY_TEST_ASSERT_OK(device_->CopyAsync(out.data(), d.data(), 1000, CopyKind::kDeviceToHost, *stream));
  FERRY_TEST_ASSERT_OK(stream->Synchronize());
  for (size_t i = 0; i < 1000; ++i) {
    const uint8_t want = (i >= 100 && i < 433) ? 0x5A : src[i];
    ASSERT_EQ(out[i], want) << i;
  }
}

TEST_F(HostDeviceTest, CopyOrMemsetPastTheEndOfAnAllocationIsRefused) {
  std::unique_ptr<Stream> stream = NewStream();
  DeviceBuffer d = Alloc(100);
  std::vector<uint8_t> host(200);
  absl::Status s = device_->CopyAsync(d.data(), host.data(), 101, CopyKind::kHostToDevice, *stream);
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange) << s;
  EXPECT_THAT(s.message(), HasSubstr("past the end"));
  s = device_->MemsetAsync(static_cast<char*>(d.data()) + 50, 0, 51, *stream);
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange) << s;
  s = device_->CopyAsync(host.data(), nullptr, 1, CopyKind::kDeviceToHost, *stream);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  // Exactly to the end is fine; a zero-byte copy is a no-op even with null pointers.
  FERRY_TEST_EXPECT_OK(device_->CopyAsync(d.data(), host.data(), 100, CopyKind::kHostToDevice, *stream));
  FERRY_TEST_EXPECT_OK(device_->CopyAsync(nullptr, nullptr, 0, CopyKind::kHostToDevice, *stream));
  FERRY_TEST_EXPECT_OK(stream->Synchronize());
}

TEST_F(HostDeviceTest, StreamRunsWorkInEnqueueOrder) {
  std::unique_ptr<Stream> stream = NewStream();
  constexpr int kOps = 200;
  DeviceBuffer d = Alloc(64);
  std::vector<uint8_t> seen(kOps, 0);
  std::vector<int> host_order;  // written only by the stream's worker until Synchronize
  for (int i = 0; i < kOps; ++i) {
    // memset to i, then (after a host function that sometimes sleeps) read it back: each read must see
    // exactly the memset enqueued just before it, never a later one.
    FERRY_TEST_ASSERT_OK(device_->MemsetAsync(d.data(), static_cast<uint8_t>(i), 64, *stream));
    FERRY_TEST_ASSERT_OK(stream->EnqueueHost([i, &host_order] {
      if (i % 50 == 0) absl::SleepFor(absl::Milliseconds(5));
      host_order.push_back(i);
    }));
    FERRY_TEST_ASSERT_OK(device_->CopyAsync(&seen[static_cast<size_t>(i)],
                                            static_cast<char*>(d.data()) + i % 64, 1,
                                            CopyKind::kDeviceToHost, *stream));
  }
  FERRY_TEST_ASSERT_OK(stream->Synchronize());
  ASSERT_EQ(host_order.size(), static_cast<size_t>(kOps));
  for (int i = 0; i < kOps; ++i) {
    EXPECT_EQ(host_order[static_cast<size_t>(i)], i);
    EXPECT_EQ(seen[static_cast<size_t>(i)], static_cast<uint8_t>(i));
  }
}

TEST_F(HostDeviceTest, StreamIsAsynchronousToTheCaller) {
  std::unique_ptr<Stream> stream = NewStream();
  absl::Notification release;
  ReleaseOnExit release_guard(release);
  bool ran_after = false;
  FERRY_TEST_ASSERT_OK(stream->EnqueueHost([&release] { release.WaitForNotification(); }));
  FERRY_TEST_ASSERT_OK(stream->EnqueueHost([&ran_after] { ran_after = true; }));
  // Both calls returned while the first function is still blocked: enqueueing did not wait.
  release.Notify();
  FERRY_TEST_ASSERT_OK(stream->Synchronize());
  EXPECT_TRUE(ran_after);
}

TEST_F(HostDeviceTest, WaitForOrdersAcrossStreams) {
  std::unique_ptr<Stream> a = NewStream();
  std::unique_ptr<Stream> b = NewStream();
  std::unique_ptr<Event> a_done = NewEvent();
  std::unique_ptr<Event> b_done = NewEvent();
  constexpr size_t kBytes = 4096;
  const std::vector<uint8_t> data = RandomBytes(kBytes, 42);
  DeviceBuffer d = Alloc(kBytes);
  FERRY_TEST_ASSERT_OK(
      device_->Copy(d.data(), RandomBytes(kBytes, 43).data(), kBytes, CopyKind::kHostToDevice));
  std::vector<uint8_t> out(kBytes, 0);

  absl::Notification release;
  ReleaseOnExit release_guard(release);
  FERRY_TEST_ASSERT_OK(a->EnqueueHost([&release] { release.WaitForNotification(); }));  // A is held
  FERRY_TEST_ASSERT_OK(device_->CopyAsync(d.data(), data.data(), kBytes, CopyKind::kHostToDevice, *a));
  FERRY_TEST_ASSERT_OK(a->Record(*a_done));
  FERRY_TEST_ASSERT_OK(b->WaitFor(*a_done));
  FERRY_TEST_ASSERT_OK(device_->CopyAsync(out.data(), d.data(), kBytes, CopyKind::kDeviceToHost, *b));
  FERRY_TEST_ASSERT_OK(b->Record(*b_done));

  // A cannot have finished, so B's copy (behind the wait) cannot have run either.
  absl::StatusOr<bool> q = b_done->Query();
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_FALSE(*q);
  q = a_done->Query();
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_FALSE(*q);

  release.Notify();
  FERRY_TEST_ASSERT_OK(b->Synchronize());
  EXPECT_EQ(out, data);  // without the wait, B would have read the old contents
  q = a_done->Query();
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_TRUE(*q);
}

TEST_F(HostDeviceTest, EventQueryFalseThenTrue) {
  std::unique_ptr<Stream> stream = NewStream();
  std::unique_ptr<Event> event = NewEvent();
  absl::Notification release;
  ReleaseOnExit release_guard(release);
  FERRY_TEST_ASSERT_OK(stream->EnqueueHost([&release] { release.WaitForNotification(); }));
  FERRY_TEST_ASSERT_OK(stream->Record(*event));
  absl::StatusOr<bool> q = event->Query();
  ASSERT_TRUE(q.ok());
  EXPECT_FALSE(*q);
  release.Notify();
  FERRY_TEST_ASSERT_OK(event->Synchronize());
  q = event->Query();
  ASSERT_TRUE(q.ok());
  EXPECT_TRUE(*q);
}

TEST_F(HostDeviceTest, NeverRecordedEventIsComplete) {
  std::unique_ptr<Event> event = NewEvent();
  absl::StatusOr<bool> q = event->Query();
  ASSERT_TRUE(q.ok());
  EXPECT_TRUE(*q);
  FERRY_TEST_EXPECT_OK(event->Synchronize());
  std::unique_ptr<Stream> stream = NewStream();
  FERRY_TEST_EXPECT_OK(stream->WaitFor(*event));  // must not block the stream
  FERRY_TEST_EXPECT_OK(stream->Synchronize());
}

TEST_F(HostDeviceTest, EventRefersToTheLatestRecord) {
  std::unique_ptr<Stream> stream = NewStream();
  std::unique_ptr<Event> event = NewEvent();
  FERRY_TEST_ASSERT_OK(stream->Record(*event));
  FERRY_TEST_ASSERT_OK(event->Synchronize());
  absl::Notification release;
  ReleaseOnExit release_guard(release);
  FERRY_TEST_ASSERT_OK(stream->EnqueueHost([&release] { release.WaitForNotification(); }));
  FERRY_TEST_ASSERT_OK(stream->Record(*event));  // re-record behind the blocked function
  absl::StatusOr<bool> q = event->Query();
  ASSERT_TRUE(q.ok());
  EXPECT_FALSE(*q);
  release.Notify();
  FERRY_TEST_ASSERT_OK(stream->Synchronize());
  q = event->Query();
  ASSERT_TRUE(q.ok());
  EXPECT_TRUE(*q);
}

TEST_F(HostDeviceTest, SynchronizeReturnsTheFirstAsynchronousError) {
  std::unique_ptr<Stream> stream = NewStream();
  DeviceBuffer small = Alloc(8);
  DeviceBuffer src = Alloc(400);
  const std::vector<uint8_t> before = RandomBytes(8, 9);
  FERRY_TEST_ASSERT_OK(device_->Copy(small.data(), before.data(), 8, CopyKind::kHostToDevice));
  // The launch is accepted (like a kernel launch) but fails when it runs: 100 f32 do not fit in 8 bytes.
  FERRY_TEST_ASSERT_OK(
      device_->LaunchConvert(small.data(), DType::kF32, src.data(), DType::kF32, 100, *stream));
  bool later_work_ran = false;
  FERRY_TEST_ASSERT_OK(stream->EnqueueHost([&later_work_ran] { later_work_ran = true; }));
  absl::Status s = stream->Synchronize();
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange) << s;
  EXPECT_THAT(s.message(), HasSubstr("LaunchConvert dst"));
  EXPECT_TRUE(later_work_ran);
  // Sticky, and an event recorded afterwards reports it too.
  EXPECT_EQ(stream->Synchronize().code(), absl::StatusCode::kOutOfRange);
  std::unique_ptr<Event> event = NewEvent();
  FERRY_TEST_ASSERT_OK(stream->Record(*event));
  EXPECT_EQ(event->Synchronize().code(), absl::StatusCode::kOutOfRange);
  // The failed launch wrote nothing.
  std::vector<uint8_t> after(8);
  FERRY_TEST_ASSERT_OK(device_->Copy(after.data(), small.data(), 8, CopyKind::kDeviceToHost));
  EXPECT_EQ(after, before);
  // Other streams are unaffected.
  std::unique_ptr<Stream> other = NewStream();
  FERRY_TEST_EXPECT_OK(other->Synchronize());
}

TEST_F(HostDeviceTest, WrappedNullStreamIsTheCallingThread) {
  absl::StatusOr<std::unique_ptr<Stream>> wrapped = device_->WrapStream(nullptr);
  ASSERT_TRUE(wrapped.ok()) << wrapped.status();
  Stream& inline_stream = **wrapped;
  EXPECT_EQ(inline_stream.native(), nullptr);

  // Work runs before the call returns.
  bool ran = false;
  FERRY_TEST_ASSERT_OK(inline_stream.EnqueueHost([&ran] { ran = true; }));
  EXPECT_TRUE(ran);
  DeviceBuffer d = Alloc(256);
  const std::vector<uint8_t> src = RandomBytes(256, 5);
  FERRY_TEST_ASSERT_OK(
      device_->CopyAsync(d.data(), src.data(), 256, CopyKind::kHostToDevice, inline_stream));
  std::vector<uint8_t> out(256, 0);
  FERRY_TEST_ASSERT_OK(
      device_->CopyAsync(out.data(), d.data(), 256, CopyKind::kDeviceToHost, inline_stream));
  EXPECT_EQ(out, src);

  // WaitFor blocks the caller until the other stream's recorded work has run.
  std::unique_ptr<Stream> worker = NewStream();
  std::unique_ptr<Event> event = NewEvent();
  bool worker_done = false;
  FERRY_TEST_ASSERT_OK(worker->EnqueueHost([&worker_done] {
    absl::SleepFor(absl::Milliseconds(20));
    worker_done = true;
  }));
  FERRY_TEST_ASSERT_OK(worker->Record(*event));
  FERRY_TEST_ASSERT_OK(inline_stream.WaitFor(*event));
  EXPECT_TRUE(worker_done);

  // An event recorded on the inline stream is complete at once.
  std::unique_ptr<Event> inline_event = NewEvent();
  FERRY_TEST_ASSERT_OK(inline_stream.Record(*inline_event));
  absl::StatusOr<bool> q = inline_event->Query();
  ASSERT_TRUE(q.ok());
  EXPECT_TRUE(*q);
  FERRY_TEST_EXPECT_OK(inline_stream.Synchronize());
}

TEST_F(HostDeviceTest, WrapStreamOfANativeHandleIsRefused) {
  int not_a_stream = 0;
  absl::StatusOr<std::unique_ptr<Stream>> wrapped = device_->WrapStream(&not_a_stream);
  EXPECT_EQ(wrapped.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(wrapped.status().message(), HasSubstr("nullptr"));
}

TEST_F(HostDeviceTest, FreeWaitsForPendingWork) {
  std::unique_ptr<Stream> stream = NewStream();
  const std::vector<uint8_t> src = RandomBytes(1 << 16, 11);
  std::vector<uint8_t> out(1 << 16, 0);
  absl::Notification release;
  {
    DeviceBuffer d = Alloc(1 << 16);
    FERRY_TEST_ASSERT_OK(stream->EnqueueHost([&release] { release.WaitForNotification(); }));
    FERRY_TEST_ASSERT_OK(
        device_->CopyAsync(d.data(), src.data(), src.size(), CopyKind::kHostToDevice, *stream));
    FERRY_TEST_ASSERT_OK(
        device_->CopyAsync(out.data(), d.data(), out.size(), CopyKind::kDeviceToHost, *stream));
    std::thread releaser([&release] {
      absl::SleepFor(absl::Milliseconds(10));
      release.Notify();
    });
    d.Reset();  // must wait for both copies (ASan would flag a use after free otherwise)
    releaser.join();
  }
  FERRY_TEST_ASSERT_OK(stream->Synchronize());
  EXPECT_EQ(out, src);
}

TEST_F(HostDeviceTest, ConcurrentSynchronousCopies) {
  constexpr int kThreads = 4;
  constexpr size_t kBytes = 1 << 14;
  std::vector<std::thread> threads;
  std::vector<int> ok(kThreads, 0);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([this, t, &ok] {
      absl::StatusOr<DeviceBuffer> d = device_->Allocate(kBytes);
      if (!d.ok()) return;
      for (int round = 0; round < 20; ++round) {
        const std::vector<uint8_t> src = RandomBytes(kBytes, static_cast<uint32_t>(t * 100 + round));
        std::vector<uint8_t> out(kBytes);
        if (!device_->Copy(d->data(), src.data(), kBytes, CopyKind::kHostToDevice).ok()) return;
        if (!device_->Copy(out.data(), d->data(), kBytes, CopyKind::kDeviceToHost).ok()) return;
        if (out != src) return;
      }
      ok[static_cast<size_t>(t)] = 1;
    });
  }
  for (std::thread& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(ok[static_cast<size_t>(t)], 1) << t;
}

TEST_F(HostDeviceTest, RegisterHostCountsAndChecksPairing) {
  std::vector<uint8_t> region(1 << 12);
  std::vector<uint8_t> other(64);
  EXPECT_EQ(device_->host_registrations(), 0u);
  FERRY_TEST_ASSERT_OK(device_->RegisterHost(region.data(), region.size()));
  EXPECT_EQ(device_->host_registrations(), 1u);
  absl::Status s = device_->RegisterHost(region.data(), region.size());
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists) << s;
  s = device_->RegisterHost(region.data() + 100, 10);  // inside the registered region
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists) << s;
  EXPECT_EQ(device_->host_registrations(), 1u);
  FERRY_TEST_ASSERT_OK(device_->RegisterHost(other.data(), other.size()));
  EXPECT_EQ(device_->host_registrations(), 2u);
  s = device_->UnregisterHost(region.data() + 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  FERRY_TEST_EXPECT_OK(device_->UnregisterHost(region.data()));
  s = device_->UnregisterHost(region.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  FERRY_TEST_EXPECT_OK(device_->UnregisterHost(other.data()));
  EXPECT_EQ(device_->RegisterHost(nullptr, 8).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(device_->RegisterHost(region.data(), 0).code(), absl::StatusCode::kInvalidArgument);
  // Re-registering after unregistering is allowed and counted.
  FERRY_TEST_EXPECT_OK(device_->RegisterHost(region.data(), region.size()));
  EXPECT_EQ(device_->host_registrations(), 3u);
  FERRY_TEST_EXPECT_OK(device_->UnregisterHost(region.data()));
}

TEST_F(HostDeviceTest, LaunchArgumentsAreValidatedAtEnqueue) {
  std::unique_ptr<Stream> stream = NewStream();
  DeviceBuffer d = Alloc(64);
  AdamScalars scalars = MakeAdamScalars(AdamHyper{}, 1);
  AdamTensorArgs t;
  t.master = d.as<float>();
  t.exp_avg = d.as<float>();
  t.exp_avg_sq = d.as<float>();
  t.grad = d.data();
  t.numel = 4;
  t.scalars_index = 1;  // out of range
  absl::Status s = device_->LaunchAdam({&t, 1}, {&scalars, 1}, *stream);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("tensor 0"));
  t.scalars_index = 0;
  t.grad = nullptr;
  s = device_->LaunchAdam({&t, 1}, {&scalars, 1}, *stream);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("grad"));
  t.grad = static_cast<char*>(d.data()) + 1;  // misaligned bf16
  t.grad_dtype = DType::kBF16;
  s = device_->LaunchAdam({&t, 1}, {&scalars, 1}, *stream);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  s = device_->LaunchConvert(d.data(), DType::kF16, nullptr, DType::kF32, 3, *stream);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  s = device_->LaunchConvert(d.data(), DType::kF16, d.data(), DType::kF32, -1, *stream);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  FERRY_TEST_EXPECT_OK(stream->Synchronize());
}

TEST_F(HostDeviceTest, LaunchConvertMatchesTheScalarConversions) {
  std::unique_ptr<Stream> stream = NewStream();
  std::mt19937 rng(3);
  constexpr int64_t kN = 5001;
  std::vector<uint32_t> bits(kN);
  for (uint32_t& b : bits) b = static_cast<uint32_t>(rng());
  DeviceBuffer f32 = Alloc(kN * 4), half = Alloc(kN * 2), back = Alloc(kN * 4);
  FERRY_TEST_ASSERT_OK(device_->Copy(f32.data(), bits.data(), kN * 4, CopyKind::kHostToDevice));
  for (DType t : {DType::kBF16, DType::kF16}) {
    FERRY_TEST_ASSERT_OK(device_->LaunchConvert(half.data(), t, f32.data(), DType::kF32, kN, *stream));
    FERRY_TEST_ASSERT_OK(device_->LaunchConvert(back.data(), DType::kF32, half.data(), t, kN, *stream));
    std::vector<uint16_t> h(kN);
    std::vector<uint32_t> b(kN);
    FERRY_TEST_ASSERT_OK(
        device_->CopyAsync(h.data(), half.data(), kN * 2, CopyKind::kDeviceToHost, *stream));
    FERRY_TEST_ASSERT_OK(
        device_->CopyAsync(b.data(), back.data(), kN * 4, CopyKind::kDeviceToHost, *stream));
    FERRY_TEST_ASSERT_OK(stream->Synchronize());
    for (int64_t i = 0; i < kN; ++i) {
      const size_t k = static_cast<size_t>(i);
      const float f = F32FromBits(bits[k]);
      const uint16_t want = t == DType::kBF16 ? F32ToBF16(f) : F32ToF16(f);
      ASSERT_EQ(h[k], want) << DTypeName(t) << " element " << i;
      const float back_want = t == DType::kBF16 ? BF16ToF32(want) : F16ToF32(want);
      ASSERT_EQ(b[k], F32Bits(back_want)) << DTypeName(t) << " element " << i;
    }
  }
}

// ---- CreateDevice --------------------------------------------------------------------------------

TEST(CreateDeviceTest, HostByName) {
  ScopedEnv env("FERRY_DEVICE", nullptr);
  absl::StatusOr<std::unique_ptr<Device>> d = CreateDevice({.backend = "host"});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ((*d)->backend(), Backend::kHost);
}

TEST(CreateDeviceTest, BadBackendNameIsNamed) {
  ScopedEnv env("FERRY_DEVICE", nullptr);
  absl::StatusOr<std::unique_ptr<Device>> d = CreateDevice({.backend = "gpu"});
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(d.status().message(), HasSubstr("'gpu'"));
  EXPECT_THAT(d.status().message(), HasSubstr("DeviceOptions::backend"));
}

TEST(CreateDeviceTest, EnvironmentOverride) {
  {
    ScopedEnv env("FERRY_DEVICE", "host");
    absl::StatusOr<std::unique_ptr<Device>> d = CreateDevice();
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ((*d)->backend(), Backend::kHost);
  }
  {
    ScopedEnv env("FERRY_DEVICE", "tpu");
    absl::StatusOr<std::unique_ptr<Device>> d = CreateDevice();
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(d.status().message(), HasSubstr("FERRY_DEVICE='tpu'"));
    // DeviceOptions::backend takes precedence over the environment.
    d = CreateDevice({.backend = "host"});
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ((*d)->backend(), Backend::kHost);
  }
}

TEST(CreateDeviceTest, AutomaticChoiceWorks) {
  ScopedEnv env("FERRY_DEVICE", nullptr);
  absl::StatusOr<std::unique_ptr<Device>> d = CreateDevice();
  ASSERT_TRUE(d.ok()) << d.status();
  if (!BuiltWithCuda()) {
    EXPECT_EQ((*d)->backend(), Backend::kHost);
  }
}

TEST(CreateDeviceTest, CudaWithoutBackendOrDeviceIsAClearError) {
  ScopedEnv env("FERRY_DEVICE", "cuda");
  absl::StatusOr<std::unique_ptr<Device>> d = CreateDevice();
  if (d.ok()) {  // a CUDA build on a machine with a GPU
    EXPECT_TRUE(BuiltWithCuda());
    EXPECT_EQ((*d)->backend(), Backend::kCuda);
    return;
  }
  if (BuiltWithCuda()) {
    EXPECT_EQ(d.status().code(), absl::StatusCode::kUnavailable) << d.status();
    EXPECT_THAT(d.status().message(), HasSubstr("FERRY_DEVICE=cuda but no CUDA device is present"));
    EXPECT_THAT(d.status().message(), HasSubstr("cudaGetDeviceCount"));
  } else {
    EXPECT_EQ(d.status().code(), absl::StatusCode::kFailedPrecondition) << d.status();
    EXPECT_THAT(d.status().message(), HasSubstr("FERRY_DEVICE=cuda but this build has no CUDA backend"));
  }
}

}  // namespace
}  // namespace ferry
