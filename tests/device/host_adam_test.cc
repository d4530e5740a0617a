// LaunchAdam on the host backend against a float64 reference (see adam_reference.h).
#include "device/adam_reference.h"

namespace ferry {
namespace {

TEST(HostAdamTest, MatchesFloat64ReferenceOver1000Steps) {
  absl::StatusOr<std::unique_ptr<Device>> created = CreateDevice({.backend = "host"});
  ASSERT_TRUE(created.ok()) << created.status();
  CheckLaunchAdamAgainstFloat64(**created);
}

}  // namespace
}  // namespace ferry
