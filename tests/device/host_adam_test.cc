// The host backend's Adam launches (see adam_reference.h): LaunchAdam against a float64 reference,
// LaunchAdamWith's runtime inputs (device-resident lr and step counts, unscaling, clipping, the skip on
// NaN/Inf) against host-made scalars, LaunchGradStats against the exact sum (big-integer reference, any split); argument errors.
#include "device/adam_reference.h"

namespace ferry {
namespace {

std::unique_ptr<Device> HostDevice() {
  absl::StatusOr<std::unique_ptr<Device>> created = CreateDevice({.backend = "host"});
  EXPECT_TRUE(created.ok()) << created.status();
  return created.ok() ? *std::move(created) : nullptr;
}

TEST(HostAdamTest, MatchesFloat64ReferenceOver1000Steps) {
  std::unique_ptr<Device> device = HostDevice();
  ASSERT_NE(device, nullptr);
  CheckLaunchAdamAgainstFloat64(*device);
}

TEST(HostAdamTest, RuntimeInputsEqualHostMadeScalars) {
  std::unique_ptr<Device> device = HostDevice();
  ASSERT_NE(device, nullptr);
  CheckAdamRuntimeInputs(*device);
}

TEST(HostAdamTest, GradStatsAreExact) {
  std::unique_ptr<Device> device = HostDevice();
  ASSERT_NE(device, nullptr);
  CheckGradStatsAgainstExact(*device);
}

TEST(HostAdamTest, BadArgumentsAreRefused) {
  std::unique_ptr<Device> device = HostDevice();
  ASSERT_NE(device, nullptr);
  absl::StatusOr<std::unique_ptr<Stream>> stream = device->CreateStream();
  ASSERT_TRUE(stream.ok());
  absl::StatusOr<DeviceBuffer> buf = device->Allocate(1 << 16);
  ASSERT_TRUE(buf.ok());
  char* base = buf->as<char>();
  const std::vector<GradTensorArgs> grads = {{base, 100, DType::kF32}};
  // Workspace too small, misaligned, null.
  absl::Status s = device->LaunchGradStats(grads, base + 4096, GradStatsWorkspaceBytes(1) - 1, **stream);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("workspace"), absl::string_view::npos) << s;
  EXPECT_EQ(device->LaunchGradStats(grads, base + 4100, GradStatsWorkspaceBytes(1), **stream).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(device->LaunchGradStats(grads, nullptr, GradStatsWorkspaceBytes(1), **stream).code(),
            absl::StatusCode::kInvalidArgument);
  // A misaligned or null gradient, a negative length.
  EXPECT_EQ(
      device
          ->LaunchGradStats({{base + 1, 10, DType::kBF16}}, base + 4096, GradStatsWorkspaceBytes(1), **stream)
          .code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      device->LaunchGradStats({{nullptr, 10, DType::kF32}}, base + 4096, GradStatsWorkspaceBytes(1), **stream)
          .code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      device->LaunchGradStats({{base, -1, DType::kF32}}, base + 4096, GradStatsWorkspaceBytes(1), **stream)
          .code(),
      absl::StatusCode::kInvalidArgument);
  // A workspace that runs past its allocation fails on the stream, like a kernel would.
  FERRY_TEST_ASSERT_OK(
      device->LaunchGradStats(grads, base + (1 << 16) - 4096, GradStatsWorkspaceBytes(1), **stream));
  s = (*stream)->Synchronize();
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange) << s;

  // Runtime inputs: clipping without a check, a negative or NaN norm, misaligned pointers.
  std::unique_ptr<Stream> fresh = *device->CreateStream();
  AdamRuntimeArgs runtime;
  runtime.max_grad_norm = 1.0f;
  const std::vector<AdamScalars> scalars = {MakeAdamScalars(AdamHyper{}, 1)};
  s = device->LaunchAdamWith({}, scalars, runtime, *fresh);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("grad_stats"), absl::string_view::npos) << s;
  runtime.grad_stats = GradStatsResult(base);
  runtime.max_grad_norm = -1.0f;
  EXPECT_EQ(device->LaunchAdamWith({}, scalars, runtime, *fresh).code(), absl::StatusCode::kInvalidArgument);
  runtime.max_grad_norm = NAN;
  EXPECT_EQ(device->LaunchAdamWith({}, scalars, runtime, *fresh).code(), absl::StatusCode::kInvalidArgument);
  runtime = {};
  runtime.step = reinterpret_cast<int64_t*>(base + 4);
  s = device->LaunchAdamWith({}, scalars, runtime, *fresh);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("step"), absl::string_view::npos) << s;
  runtime = {};
  runtime.lr = reinterpret_cast<const float*>(base + 2);
  EXPECT_EQ(device->LaunchAdamWith({}, scalars, runtime, *fresh).code(), absl::StatusCode::kInvalidArgument);
  FERRY_TEST_ASSERT_OK(fresh->Synchronize());
}

}  // namespace
}  // namespace ferry
