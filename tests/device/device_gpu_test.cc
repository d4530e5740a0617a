// Tests of the CUDA backend: copies, streams, events, registration and errors on a real GPU, and the
// kernels against the host backend bit for bit (LaunchAdam over 100 steps with every dtype pair and
// mode, hundreds of odd-sized tensors plus one of more than 2^20 elements; LaunchAdamWith's runtime
// inputs at every alignment; LaunchGradStats against the exact big-integer reference, every dtype and
// magnitude, any split; LaunchConvert over every 16-bit pattern and
// NaN/Inf/subnormal float32s). Skips when the build has no CUDA backend or no CUDA
// device is present.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "device/adam_reference.h"
#include "device/device.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ferry {
namespace {

using ::testing::HasSubstr;

#ifndef FERRY_TEST_ASSERT_OK
#define FERRY_TEST_ASSERT_OK(expr)               \
  do {                                           \
    const absl::Status s_ = (expr);              \
    ASSERT_TRUE(s_.ok()) << #expr << ": " << s_; \
  } while (0)
#endif
#define FERRY_TEST_EXPECT_OK(expr)               \
  do {                                           \
    const absl::Status s_ = (expr);              \
    EXPECT_TRUE(s_.ok()) << #expr << ": " << s_; \
  } while (0)

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

std::vector<uint8_t> RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> out(n);
  for (uint8_t& b : out) b = static_cast<uint8_t>(rng());
  return out;
}

class CudaDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!BuiltWithCuda()) GTEST_SKIP() << "this build has no CUDA backend";
    absl::StatusOr<std::unique_ptr<Device>> cuda = CreateDevice({.backend = "cuda"});
    if (!cuda.ok() && cuda.status().code() == absl::StatusCode::kUnavailable) {
      GTEST_SKIP() << "no CUDA device: " << cuda.status();
    }
    ASSERT_TRUE(cuda.ok()) << cuda.status();
    cuda_ = *std::move(cuda);
    absl::StatusOr<std::unique_ptr<Device>> host = CreateDevice({.backend = "host"});
    ASSERT_TRUE(host.ok()) << host.status();
    host_ = *std::move(host);
  }

  static std::unique_ptr<Stream> NewStream(Device& d) {
    absl::StatusOr<std::unique_ptr<Stream>> s = d.CreateStream();
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *std::move(s) : nullptr;
  }
  static std::unique_ptr<Event> NewEvent(Device& d) {
    absl::StatusOr<std::unique_ptr<Event>> e = d.CreateEvent();
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? *std::move(e) : nullptr;
  }
  static DeviceBuffer Alloc(Device& d, size_t bytes) {
    absl::StatusOr<DeviceBuffer> b = d.Allocate(bytes);
    EXPECT_TRUE(b.ok()) << b.status();
    return b.ok() ? *std::move(b) : DeviceBuffer();
  }
  // A device buffer holding `bytes`.
  static DeviceBuffer Upload(Device& d, const void* data, size_t bytes) {
    DeviceBuffer b = Alloc(d, bytes);
    absl::Status s = d.Copy(b.data(), data, bytes, CopyKind::kHostToDevice);
    EXPECT_TRUE(s.ok()) << s;
    return b;
  }
  static std::vector<uint8_t> Download(Device& d, const void* p, size_t bytes) {
    std::vector<uint8_t> out(bytes);
    absl::Status s = d.Copy(out.data(), p, bytes, CopyKind::kDeviceToHost);
    EXPECT_TRUE(s.ok()) << s;
    return out;
  }

  std::unique_ptr<Device> cuda_;
  std::unique_ptr<Device> host_;
};

TEST_F(CudaDeviceTest, NameAndMemory) {
  EXPECT_EQ(cuda_->backend(), Backend::kCuda);
  EXPECT_THAT(cuda_->name(), HasSubstr("cuda:0"));
  EXPECT_THAT(cuda_->name(), HasSubstr("sm_"));
  absl::StatusOr<size_t> free = cuda_->FreeMemory();
  ASSERT_TRUE(free.ok()) << free.status();
  EXPECT_GT(*free, size_t{1} << 20);
  DeviceBuffer empty = Alloc(*cuda_, 0);
  EXPECT_EQ(empty.data(), nullptr);
}

TEST_F(CudaDeviceTest, CopiesAndMemsetRoundTripExactly) {
  std::unique_ptr<Stream> stream = NewStream(*cuda_);
  for (size_t bytes : {1u, 7u, 4096u, 1000003u}) {
    const std::vector<uint8_t> src = RandomBytes(bytes, bytes);
    DeviceBuffer d1 = Alloc(*cuda_, bytes + 3);
    DeviceBuffer d2 = Alloc(*cuda_, bytes);
    char* d1_odd = static_cast<char*>(d1.data()) + 3;
    std::vector<uint8_t> out(bytes, 0), out2(bytes, 0);
    FERRY_TEST_ASSERT_OK(cuda_->CopyAsync(d1_odd, src.data(), bytes, CopyKind::kHostToDevice, *stream));
    FERRY_TEST_ASSERT_OK(cuda_->CopyAsync(d2.data(), d1_odd, bytes, CopyKind::kDeviceToDevice, *stream));
    FERRY_TEST_ASSERT_OK(
        cuda_->CopyAsync(out.data(), d2.data(), bytes, CopyKind::kDeviceToHost, *stream));
    FERRY_TEST_ASSERT_OK(
        cuda_->CopyAsync(out2.data(), out.data(), bytes, CopyKind::kHostToHost, *stream));
    FERRY_TEST_ASSERT_OK(stream->Synchronize());
    EXPECT_EQ(out, src) << bytes;
    EXPECT_EQ(out2, src) << bytes;
    if (bytes > 10) {
      FERRY_TEST_ASSERT_OK(
          cuda_->MemsetAsync(static_cast<char*>(d2.data()) + 5, 0xA7, bytes - 10, *stream));
      FERRY_TEST_ASSERT_OK(
          cuda_->CopyAsync(out.data(), d2.data(), bytes, CopyKind::kDeviceToHost, *stream));
      FERRY_TEST_ASSERT_OK(stream->Synchronize());
      for (size_t i = 0; i < bytes; ++i) {
        ASSERT_EQ(out[i], (i >= 5 && i < bytes - 5) ? 0xA7 : src[i]) << i;
      }
    }
  }
}

TEST_F(CudaDeviceTest, StreamOrderAndHostFunctions) {
  std::unique_ptr<Stream> stream = NewStream(*cuda_);
  constexpr int kOps = 100;
  DeviceBuffer d = Alloc(*cuda_, 64);
  std::vector<uint8_t> seen(kOps, 0);
  std::vector<int> order;  // appended by host functions, in stream order
  for (int i = 0; i < kOps; ++i) {
    FERRY_TEST_ASSERT_OK(cuda_->MemsetAsync(d.data(), static_cast<uint8_t>(i), 64, *stream));
    FERRY_TEST_ASSERT_OK(
        cuda_->CopyAsync(&seen[static_cast<size_t>(i)], d.data(), 1, CopyKind::kDeviceToHost, *stream));
    FERRY_TEST_ASSERT_OK(stream->EnqueueHost([i, &order] { order.push_back(i); }));
  }
  FERRY_TEST_ASSERT_OK(stream->Synchronize());
  ASSERT_EQ(order.size(), static_cast<size_t>(kOps));
  for (int i = 0; i < kOps; ++i) {
    EXPECT_EQ(order[static_cast<size_t>(i)], i);
    EXPECT_EQ(seen[static_cast<size_t>(i)], static_cast<uint8_t>(i));
  }
}

TEST_F(CudaDeviceTest, EventsOrderStreams) {
  std::unique_ptr<Stream> a = NewStream(*cuda_);
  std::unique_ptr<Stream> b = NewStream(*cuda_);
  std::unique_ptr<Event> a_done = NewEvent(*cuda_);
  std::unique_ptr<Event> b_done = NewEvent(*cuda_);
  std::unique_ptr<Event> never = NewEvent(*cuda_);
  absl::StatusOr<bool> q = never->Query();
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_TRUE(*q);
  FERRY_TEST_EXPECT_OK(never->Synchronize());

  // Only device-side work behind the blocked host function: a copy from pageable host memory may
  // block the calling thread until the stream reaches it, which here would be never.
  constexpr size_t kBytes = 1 << 16;
  const std::vector<uint8_t> old = RandomBytes(kBytes, 2);
  DeviceBuffer d = Upload(*cuda_, old.data(), kBytes);
  DeviceBuffer d2 = Upload(*cuda_, old.data(), kBytes);
  absl::Notification release;
  ReleaseOnExit release_guard(release);
  FERRY_TEST_ASSERT_OK(a->EnqueueHost([&release] { release.WaitForNotification(); }));
  FERRY_TEST_ASSERT_OK(cuda_->MemsetAsync(d.data(), 0x5A, kBytes, *a));
  FERRY_TEST_ASSERT_OK(a->Record(*a_done));
  FERRY_TEST_ASSERT_OK(b->WaitFor(*a_done));
  FERRY_TEST_ASSERT_OK(cuda_->CopyAsync(d2.data(), d.data(), kBytes, CopyKind::kDeviceToDevice, *b));
  FERRY_TEST_ASSERT_OK(b->Record(*b_done));
  q = b_done->Query();
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_FALSE(*q);  // A is held by the host function, so B is held by the wait
  q = a_done->Query();
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_FALSE(*q);
  release.Notify();
  FERRY_TEST_ASSERT_OK(b_done->Synchronize());
  q = b_done->Query();
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_TRUE(*q);
  FERRY_TEST_EXPECT_OK(a->Synchronize());
  FERRY_TEST_EXPECT_OK(b->Synchronize());
  // Without the wait, B's copy would have read the old contents.
  EXPECT_EQ(Download(*cuda_, d2.data(), kBytes), std::vector<uint8_t>(kBytes, 0x5A));
}

TEST_F(CudaDeviceTest, WrapStreamIsNonOwningAndNullIsTheLegacyStream) {
  std::unique_ptr<Stream> owned = NewStream(*cuda_);
  ASSERT_NE(owned->native(), nullptr);
  {
    absl::StatusOr<std::unique_ptr<Stream>> wrapped = cuda_->WrapStream(owned->native());
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    EXPECT_EQ((*wrapped)->native(), owned->native());
  }  // destroying the wrapper leaves the stream alive
  DeviceBuffer d = Alloc(*cuda_, 256);
  FERRY_TEST_ASSERT_OK(cuda_->MemsetAsync(d.data(), 0x11, 256, *owned));
  FERRY_TEST_ASSERT_OK(owned->Synchronize());
  EXPECT_EQ(Download(*cuda_, d.data(), 256), std::vector<uint8_t>(256, 0x11));

  absl::StatusOr<std::unique_ptr<Stream>> legacy = cuda_->WrapStream(nullptr);
  ASSERT_TRUE(legacy.ok()) << legacy.status();
  EXPECT_EQ((*legacy)->native(), nullptr);
  // Work on the legacy stream, then Device::Copy (which must be ordered after it).
  FERRY_TEST_ASSERT_OK(cuda_->MemsetAsync(d.data(), 0x22, 256, **legacy));
  EXPECT_EQ(Download(*cuda_, d.data(), 256), std::vector<uint8_t>(256, 0x22));
}

TEST_F(CudaDeviceTest, ErrorsNameTheCallAndContext) {
  absl::StatusOr<DeviceBuffer> huge = cuda_->Allocate(size_t{1} << 60);
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted) << huge.status();
  EXPECT_THAT(huge.status().message(), HasSubstr("cudaMalloc"));
  EXPECT_THAT(huge.status().message(), HasSubstr("Allocate(1152921504606846976 bytes)"));
  int never_registered = 0;
  absl::Status s = cuda_->UnregisterHost(&never_registered);
  // cudaErrorHostMemoryNotRegistered (NotFound); some drivers answer cudaErrorInvalidValue instead.
  EXPECT_THAT(s.code(),
              ::testing::AnyOf(absl::StatusCode::kNotFound, absl::StatusCode::kInvalidArgument))
      << s;
  EXPECT_THAT(s.message(), HasSubstr("cudaHostUnregister in UnregisterHost("));
  // A stream of the other backend is refused before anything reaches CUDA.
  std::unique_ptr<Stream> host_stream = NewStream(*host_);
  DeviceBuffer d = Alloc(*cuda_, 16);
  s = cuda_->MemsetAsync(d.data(), 0, 16, *host_stream);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  // The device is still healthy afterwards (these errors are not sticky).
  FERRY_TEST_EXPECT_OK(cuda_->Copy(d.data(), RandomBytes(16, 3).data(), 16, CopyKind::kHostToDevice));
}

TEST_F(CudaDeviceTest, RegisterHostCounts) {
  constexpr size_t kBytes = 1 << 20;
  void* region = std::aligned_alloc(4096, kBytes);
  ASSERT_NE(region, nullptr);
  const uint64_t before = cuda_->host_registrations();
  FERRY_TEST_ASSERT_OK(cuda_->RegisterHost(region, kBytes));
  EXPECT_EQ(cuda_->host_registrations(), before + 1);
  absl::Status s = cuda_->RegisterHost(region, kBytes);
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists) << s;
  EXPECT_THAT(s.message(), HasSubstr("cudaHostRegister"));
  EXPECT_EQ(cuda_->host_registrations(), before + 1);
  // Registered memory takes part in asynchronous copies.
  std::unique_ptr<Stream> stream = NewStream(*cuda_);
  const std::vector<uint8_t> src = RandomBytes(kBytes, 4);
  std::memcpy(region, src.data(), kBytes);
  DeviceBuffer d = Alloc(*cuda_, kBytes);
  FERRY_TEST_ASSERT_OK(cuda_->CopyAsync(d.data(), region, kBytes, CopyKind::kHostToDevice, *stream));
  FERRY_TEST_ASSERT_OK(stream->Synchronize());
  EXPECT_EQ(Download(*cuda_, d.data(), kBytes), src);
  FERRY_TEST_EXPECT_OK(cuda_->UnregisterHost(region));
  EXPECT_THAT(cuda_->UnregisterHost(region).code(),
              ::testing::AnyOf(absl::StatusCode::kNotFound, absl::StatusCode::kInvalidArgument));
  std::free(region);
}

// ---- kernels: CUDA equals host bit for bit ---------------------------------------------------------

// One Adam tensor held on both devices.
struct TwinTensor {
  int64_t numel = 0;
  DType grad_dtype = DType::kF32;
  DType param_dtype = DType::kF32;
  bool has_param = false;
  DeviceBuffer master[2], m[2], v[2], grad[2], param[2];  // [0] host, [1] cuda
};

TEST_F(CudaDeviceTest, LaunchAdamEqualsHostBitForBit) {
  std::mt19937_64 rng(77);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const DType kTypes[] = {DType::kF32, DType::kBF16, DType::kF16};
  // More scalar sets (20) and tensors (335) than one launch holds (16, 320), so LaunchAdam splits the
  // list: on odd steps runs of 19 consecutive tensors share a set (launches end at the 17th set), on
  // even steps tensor i uses set i % 4 (launches end at 320 tensors).
  constexpr int kScalarSets = 20;
  std::vector<TwinTensor> tensors;
  // 9 dtype pairs x 37 odd sizes = 333 tensors (more than one launch holds), then a big one.
  for (DType gt : kTypes) {
    for (DType pt : kTypes) {
      for (int k = 0; k < 37; ++k) {
        TwinTensor t;
        t.numel = k == 0 ? 1 : static_cast<int64_t>(rng() % 9000) + 1;
        t.grad_dtype = gt;
        t.param_dtype = pt;
        t.has_param = k % 11 != 5;
        tensors.push_back(std::move(t));
      }
    }
  }
  {
    TwinTensor big;
    big.numel = (int64_t{1} << 20) + 4097;
    big.grad_dtype = DType::kBF16;
    big.param_dtype = DType::kBF16;
    big.has_param = true;
    tensors.push_back(std::move(big));
  }
  tensors.insert(tensors.begin() + 100, TwinTensor{});  // an empty tensor is skipped
  Device* devices[2] = {host_.get(), cuda_.get()};
  std::unique_ptr<Stream> streams[2] = {NewStream(*host_), NewStream(*cuda_)};
  std::vector<AdamTensorArgs> args[2];
  for (TwinTensor& t : tensors) {
    const size_t n = static_cast<size_t>(t.numel);
    std::vector<float> master(n), m(n), v(n);
    for (size_t i = 0; i < n; ++i) {
      master[i] = normal(rng);
      m[i] = 0.01f * normal(rng);
      v[i] = 1e-4f * std::abs(normal(rng));
    }
    for (int d = 0; d < 2; ++d) {
      t.master[d] = Upload(*devices[d], master.data(), 4 * n);
      t.m[d] = Upload(*devices[d], m.data(), 4 * n);
      t.v[d] = Upload(*devices[d], v.data(), 4 * n);
      t.grad[d] = Alloc(*devices[d], DTypeSize(t.grad_dtype) * n);
      if (t.has_param) t.param[d] = Alloc(*devices[d], DTypeSize(t.param_dtype) * n);
      AdamTensorArgs a;
      a.master = t.master[d].as<float>();
      a.exp_avg = t.m[d].as<float>();
      a.exp_avg_sq = t.v[d].as<float>();
      a.grad = t.grad[d].data();
      a.param = t.param[d].data();
      a.numel = t.numel;
      a.grad_dtype = t.grad_dtype;
      a.param_dtype = t.param_dtype;
      args[d].push_back(a);  // scalars_index is set per step
    }
  }

  for (int64_t step = 1; step <= 100; ++step) {
    std::vector<AdamScalars> scalars;
    for (int j = 0; j < kScalarSets; ++j) {
      AdamHyper h;
      h.lr = 1e-3f * static_cast<float>(j + 1);
      h.beta1 = j % 3 == 0 ? 0.9f : 0.85f;
      h.beta2 = j % 4 == 0 ? 0.999f : 0.95f;
      h.eps = j % 5 == 0 ? 1e-8f : 1e-6f;
      h.weight_decay = 0.01f * static_cast<float>(j % 7);
      h.mode = j % 2 == 0 ? AdamMode::kAdamW : AdamMode::kAdamL2;
      h.bias_correction = (j / 2) % 2 == 0;
      scalars.push_back(MakeAdamScalars(h, step, j % 3 == 1 ? 0.37 : 1.0));
    }
    std::vector<std::vector<uint8_t>> grads(tensors.size());  // kept until the copies ran
    for (size_t ti = 0; ti < tensors.size(); ++ti) {
      TwinTensor& t = tensors[ti];
      const size_t n = static_cast<size_t>(t.numel);
      std::vector<uint8_t>& grad = grads[ti];
      grad.resize(DTypeSize(t.grad_dtype) * n);
      // Uniform in (-scale, scale), scale a power of two from 2^-8 to 2^3 (cheap; cover many exponents).
      const float scale = std::ldexp(1.0f, static_cast<int>(rng() % 12) - 8);
      for (size_t i = 0; i < n; ++i) {
        const float u = static_cast<float>(static_cast<int32_t>(rng() >> 32)) * 0x1p-31f;
        StoreFromF32(grad.data(), t.grad_dtype, i, scale * u);
      }
      for (int d = 0; d < 2; ++d) {
        FERRY_TEST_ASSERT_OK(devices[d]->CopyAsync(t.grad[d].data(), grad.data(), grad.size(),
                                                   CopyKind::kHostToDevice, *streams[d]));
      }
    }
    for (int d = 0; d < 2; ++d) {
      for (size_t ti = 0; ti < args[d].size(); ++ti) {
        args[d][ti].scalars_index =
            static_cast<uint32_t>(step % 2 == 1 ? (ti / 19) % kScalarSets : ti % 4);
      }
      FERRY_TEST_ASSERT_OK(devices[d]->LaunchAdam(args[d], scalars, *streams[d]));
    }
    for (int d = 0; d < 2; ++d) FERRY_TEST_ASSERT_OK(streams[d]->Synchronize());
  }

  for (size_t ti = 0; ti < tensors.size(); ++ti) {
    const TwinTensor& t = tensors[ti];
    const size_t n = static_cast<size_t>(t.numel);
    const std::string where =
        absl::StrCat("tensor ", ti, " (n ", t.numel, ", grad ", DTypeName(t.grad_dtype).data(),
                     ", param ", DTypeName(t.param_dtype).data(), ")");
    auto same = [&](const DeviceBuffer* bufs, size_t bytes, const char* field) {
      if (bytes == 0) return;
      const std::vector<uint8_t> h = Download(*host_, bufs[0].data(), bytes);
      const std::vector<uint8_t> c = Download(*cuda_, bufs[1].data(), bytes);
      ASSERT_EQ(h.size(), c.size());
      for (size_t i = 0; i < bytes; ++i) {
        ASSERT_EQ(h[i], c[i]) << where << " " << field << " differs at byte " << i;
      }
    };
    same(t.master, 4 * n, "master");
    same(t.m, 4 * n, "exp_avg");
    same(t.v, 4 * n, "exp_avg_sq");
    if (t.has_param) same(t.param, DTypeSize(t.param_dtype) * n, "param");
  }
}

TEST_F(CudaDeviceTest, LaunchConvertEqualsHostBitForBit) {
  // Every 16-bit pattern; float32 specials, subnormals, rounding ties and random patterns.
  std::vector<uint16_t> all16(65536);
  for (uint32_t i = 0; i < 65536; ++i) all16[i] = static_cast<uint16_t>(i);
  std::vector<uint32_t> f32 = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u,
                               0xffc00001u, 0x7f800001u, 0x7fbfffffu, 0x00000001u, 0x807fffffu,
                               0x00400000u, 0x7f7fffffu, 0x477fefffu, 0x477ff000u, 0x33000000u,
                               0x33000001u, 0x387fe000u, 0x38800000u, 0x3f808000u, 0x3f818000u};
  std::mt19937_64 rng(5);
  while (f32.size() < (1u << 20) + 333) {
    const uint32_t r = static_cast<uint32_t>(rng());
    f32.push_back(r);
    f32.push_back((r & 0x807fffffu) | (0x30800000u + (static_cast<uint32_t>(rng() % 40) << 23)));
  }
  const DType kTypes[] = {DType::kF32, DType::kBF16, DType::kF16};
  std::unique_ptr<Stream> streams[2] = {NewStream(*host_), NewStream(*cuda_)};
  Device* devices[2] = {host_.get(), cuda_.get()};
  for (DType src_t : kTypes) {
    const void* src_data = src_t == DType::kF32 ? static_cast<const void*>(f32.data()) : all16.data();
    const int64_t n = src_t == DType::kF32 ? static_cast<int64_t>(f32.size()) : 65536;
    for (DType dst_t : kTypes) {
      std::vector<uint8_t> results[2];
      for (int d = 0; d < 2; ++d) {
        DeviceBuffer src = Upload(*devices[d], src_data, DTypeSize(src_t) * static_cast<size_t>(n));
        DeviceBuffer dst = Alloc(*devices[d], DTypeSize(dst_t) * static_cast<size_t>(n));
        FERRY_TEST_ASSERT_OK(
            devices[d]->LaunchConvert(dst.data(), dst_t, src.data(), src_t, n, *streams[d]));
        FERRY_TEST_ASSERT_OK(streams[d]->Synchronize());
        results[d] = Download(*devices[d], dst.data(), dst.bytes());
      }
      ASSERT_EQ(results[0].size(), results[1].size());
      for (size_t i = 0; i < results[0].size(); ++i) {
        ASSERT_EQ(results[0][i], results[1][i])
            << DTypeName(src_t).data() << " -> " << DTypeName(dst_t).data() << " byte " << i;
      }
    }
  }
}


// The CUDA kernel against the float64 reference over 1,000 steps (the same check and bounds as the host
// backend's HostAdamTest).
TEST_F(CudaDeviceTest, LaunchAdamMatchesFloat64ReferenceOver1000Steps) { CheckLaunchAdamAgainstFloat64(*cuda_); }

// LaunchAdamWith reading lr, step counts, the loss scale and the gradient check from device memory
// equals LaunchAdam with host-made scalars, and a NaN/Inf gradient skips the whole step.
TEST_F(CudaDeviceTest, LaunchAdamWithRuntimeInputsEqualsHostMadeScalars) { CheckAdamRuntimeInputs(*cuda_); }

// The gradient check's kernels compute the exact sum: the whole GradStats equals the big-integer
// reference bit for bit, on every dtype and magnitude and for any split of the tensors.
TEST_F(CudaDeviceTest, LaunchGradStatsIsExact) { CheckGradStatsAgainstExact(*cuda_); }

// CUDA equals the host backend bit for bit with runtime inputs, for tensors whose arrays start at every
// offset modulo the 16-byte vectors: all arrays in phase (vector path with a head of 0..3 elements) and
// out of phase (element path).
TEST_F(CudaDeviceTest, LaunchAdamWithEqualsHostAtAnyAlignment) {
  std::mt19937_64 rng(std::random_device{}());
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const DType kTypes[] = {DType::kF32, DType::kBF16, DType::kF16};
  struct Arrays {
    DeviceBuffer master, m, v, grad, param;
  };
  struct Tensor {
    int64_t n;
    DType gt, pt;
    int offsets[5];  // elements, per array: master, m, v, grad, param
    Arrays on[2];    // [0] host, [1] cuda
  };
  Device* devices[2] = {host_.get(), cuda_.get()};
  std::unique_ptr<Stream> streams[2] = {NewStream(*host_), NewStream(*cuda_)};
  std::vector<Tensor> tensors;
  for (int k = 0; k < 72; ++k) {
    Tensor t;
    t.n = k % 9 == 0 ? 1 + k / 9 : 1 + static_cast<int64_t>(rng() % 30000);
    t.gt = kTypes[k % 3];
    t.pt = kTypes[(k / 3) % 3];
    // Offsets of master, m, v, grad, param: all in phase (k % 8 < 4); the state in phase but the grad
    // (k % 8 == 4) or the param (5) out of it; the state itself out of phase (6); anything (7).
    const int phase = k % 4;
    for (int a = 0; a < 5; ++a) t.offsets[a] = phase;
    if (k % 8 == 4) t.offsets[3] = (phase + 1 + static_cast<int>(rng() % 3)) % 4;
    if (k % 8 == 5) t.offsets[4] = (phase + 1 + static_cast<int>(rng() % 3)) % 4;
    if (k % 8 == 6) t.offsets[1] = (phase + 2) % 4;
    if (k % 8 == 7) {
      for (int a = 0; a < 5; ++a) t.offsets[a] = static_cast<int>(rng() % 4);
    }
    tensors.push_back(std::move(t));
  }
  std::vector<AdamTensorArgs> args[2];
  std::vector<GradTensorArgs> grads[2];
  for (Tensor& t : tensors) {
    const size_t n = static_cast<size_t>(t.n);
    std::vector<float> init(n + 4), m(n + 4), v(n + 4);
    for (size_t i = 0; i < n + 4; ++i) {
      init[i] = normal(rng);
      m[i] = 0.01f * normal(rng);
      v[i] = 1e-4f * std::abs(normal(rng));
    }
    for (int d = 0; d < 2; ++d) {
      Arrays& a = t.on[d];
      a.master = Upload(*devices[d], init.data(), 4 * (n + 4));
      a.m = Upload(*devices[d], m.data(), 4 * (n + 4));
      a.v = Upload(*devices[d], v.data(), 4 * (n + 4));
      a.grad = Alloc(*devices[d], DTypeSize(t.gt) * (n + 4));
      const std::vector<uint8_t> zeros(DTypeSize(t.pt) * (n + 4), 0);  // the bytes around the param too
      a.param = Upload(*devices[d], zeros.data(), zeros.size());
      AdamTensorArgs x;
      x.master = a.master.as<float>() + t.offsets[0];
      x.exp_avg = a.m.as<float>() + t.offsets[1];
      x.exp_avg_sq = a.v.as<float>() + t.offsets[2];
      x.grad = a.grad.as<uint8_t>() + DTypeSize(t.gt) * static_cast<size_t>(t.offsets[3]);
      x.param = a.param.as<uint8_t>() + DTypeSize(t.pt) * static_cast<size_t>(t.offsets[4]);
      x.numel = t.n;
      x.grad_dtype = t.gt;
      x.param_dtype = t.pt;
      x.scalars_index = static_cast<uint32_t>(args[d].size() % 3);
      args[d].push_back(x);
      grads[d].push_back(GradTensorArgs{x.grad, t.n, t.gt});
    }
  }
  std::vector<AdamScalars> scalars;
  for (int j = 0; j < 3; ++j) {
    AdamHyper h;
    h.lr = 1.0f;
    h.weight_decay = 0.02f * static_cast<float>(j);
    h.mode = j == 1 ? AdamMode::kAdamL2 : AdamMode::kAdamW;
    h.bias_correction = j != 2;
    scalars.push_back(MakeAdamScalars(h, 1));
  }
  DeviceBuffer inputs[2], steps[2], ws[2];
  const size_t ws_bytes = GradStatsWorkspaceBytes(tensors.size());
  AdamRuntimeArgs runtime[2];
  for (int d = 0; d < 2; ++d) {
    inputs[d] = Alloc(*devices[d], 16);
    steps[d] = Alloc(*devices[d], 24);
    ws[d] = Alloc(*devices[d], ws_bytes);
    const int64_t zero[3] = {0, 0, 0};
    FERRY_TEST_ASSERT_OK(devices[d]->Copy(steps[d].data(), zero, 24, CopyKind::kHostToDevice));
    runtime[d].grad_stats = GradStatsResult(ws[d].data());
    runtime[d].max_grad_norm = 20.0f;
    runtime[d].lr = inputs[d].as<float>();
    runtime[d].grad_scale = inputs[d].as<float>() + 3;
    runtime[d].step = steps[d].as<int64_t>();
  }
  for (int step = 1; step <= 20; ++step) {
    const float values[4] = {1e-3f, 2e-3f * static_cast<float>(step), 5e-4f, 512.0f};
    std::vector<std::vector<uint8_t>> g(tensors.size());
    for (size_t k = 0; k < tensors.size(); ++k) {
      const Tensor& t = tensors[k];
      g[k].resize(DTypeSize(t.gt) * static_cast<size_t>(t.n));
      for (size_t i = 0; i < static_cast<size_t>(t.n); ++i)
        StoreFromF32(g[k].data(), t.gt, i, 64.0f * normal(rng));
    }
    for (int d = 0; d < 2; ++d) {
      FERRY_TEST_ASSERT_OK(devices[d]->Copy(inputs[d].data(), values, 16, CopyKind::kHostToDevice));
      for (size_t k = 0; k < tensors.size(); ++k) {
        FERRY_TEST_ASSERT_OK(devices[d]->Copy(const_cast<void*>(grads[d][k].grad), g[k].data(), g[k].size(),
                                              CopyKind::kHostToDevice));
      }
      FERRY_TEST_ASSERT_OK(devices[d]->LaunchGradStats(grads[d], ws[d].data(), ws_bytes, *streams[d]));
      FERRY_TEST_ASSERT_OK(devices[d]->LaunchAdamWith(args[d], scalars, runtime[d], *streams[d]));
      FERRY_TEST_ASSERT_OK(streams[d]->Synchronize());
    }
  }
  GradStats stats[2];
  for (int d = 0; d < 2; ++d) {
    FERRY_TEST_ASSERT_OK(
        devices[d]->Copy(&stats[d], ws[d].data(), sizeof(GradStats), CopyKind::kDeviceToHost));
  }
  EXPECT_EQ(std::memcmp(&stats[0], &stats[1], sizeof(GradStats)), 0);
  for (size_t k = 0; k < tensors.size(); ++k) {
    const Tensor& t = tensors[k];
    const std::string where = absl::StrCat("tensor ", k, " (n ", t.n, ", offsets ", t.offsets[0],
                                           t.offsets[1], t.offsets[2], t.offsets[3], t.offsets[4], ")");
    auto same = [&](const DeviceBuffer Arrays::*field, size_t bytes, const char* name) {
      const std::vector<uint8_t> h = Download(*host_, (t.on[0].*field).data(), bytes);
      const std::vector<uint8_t> c = Download(*cuda_, (t.on[1].*field).data(), bytes);
      EXPECT_EQ(h, c) << where << " " << name;
    };
    const size_t n = static_cast<size_t>(t.n) + 4;
    same(&Arrays::master, 4 * n, "master");
    same(&Arrays::m, 4 * n, "exp_avg");
    same(&Arrays::v, 4 * n, "exp_avg_sq");
    same(&Arrays::param, DTypeSize(t.pt) * n, "param");
  }
}
// A rank that drives GPU r > 0 holds no context on GPU 0, whichever of its threads call Ferry: a
// thread that never used CUDA (one of Ferry's own) reports device 0, and switching it back to 0 after
// a call would create GPU 0's primary context in the process. The last GPU is driven from fresh
// threads; afterwards the process holds that GPU's context alone. Needs two GPUs and a process of its
// own (ctest runs each test alone).
TEST(CudaContextTest, CallsFromFreshThreadsCreateNoOtherDevicesContext) {
  if (!BuiltWithCuda()) GTEST_SKIP() << "this build has no CUDA backend";
  const size_t devices = CudaNumaNodes().size();  // one entry per CUDA device
  if (devices < 2) GTEST_SKIP() << "needs 2 CUDA devices, found " << devices;
  if (!CudaPrimaryContexts().empty()) GTEST_SKIP() << "this process holds a context already (run alone, as ctest does)";
  const int last = static_cast<int>(devices) - 1;
  std::unique_ptr<Device> cuda;
  std::thread([&] {
    absl::StatusOr<std::unique_ptr<Device>> d = CreateDevice({.backend = "cuda", .ordinal = last});
    ASSERT_TRUE(d.ok()) << d.status();
    cuda = *std::move(d);
  }).join();
  ASSERT_NE(cuda, nullptr);
  constexpr size_t kBytes = 1 << 20;
  const std::vector<uint8_t> src = RandomBytes(kBytes, 5);
  std::vector<uint8_t> out(kBytes, 0);
  for (int round = 0; round < 3; ++round) {
    std::thread([&] {
      absl::StatusOr<std::unique_ptr<Stream>> stream = cuda->CreateStream();
      ASSERT_TRUE(stream.ok()) << stream.status();
      absl::StatusOr<std::unique_ptr<Event>> done = cuda->CreateEvent();
      ASSERT_TRUE(done.ok()) << done.status();
      absl::StatusOr<DeviceBuffer> buffer = cuda->Allocate(kBytes);
      ASSERT_TRUE(buffer.ok()) << buffer.status();
      FERRY_TEST_ASSERT_OK(cuda->CopyAsync(buffer->data(), src.data(), kBytes, CopyKind::kHostToDevice, **stream));
      FERRY_TEST_ASSERT_OK(cuda->CopyAsync(out.data(), buffer->data(), kBytes, CopyKind::kDeviceToHost, **stream));
      FERRY_TEST_ASSERT_OK((*stream)->Record(**done));
      absl::StatusOr<bool> ready = (*done)->Query();
      ASSERT_TRUE(ready.ok()) << ready.status();
      FERRY_TEST_ASSERT_OK((*done)->Synchronize());
    }).join();
    ASSERT_FALSE(HasFailure());
    EXPECT_EQ(out, src);
  }
  EXPECT_EQ(CudaPrimaryContexts(), std::vector<int>{last});
}

}  // namespace
}  // namespace ferry
