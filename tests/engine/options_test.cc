// Engine::Create checks every EngineOptions field before it does anything (engine/engine_options.cc): a
// value out of range is refused with InvalidArgument naming the field and the value, and nothing of the
// process changes (the pinned budget a local-rank share would divide); the edges of each range are taken.
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "ferry/engine.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "memory/pinned_budget.h"

namespace ferry::engine_test {
namespace {

using Edit = std::function<void(EngineOptions&)>;

EngineOptions HostOptions() {
  EngineOptions o;
  o.device = "host";
  return o;
}

TEST(EngineOptionsTest, AValueOutOfRangeIsRefusedNamingTheFieldAndTheValue) {
  const std::vector<std::pair<Edit, std::string>> cases = {
      {[](EngineOptions& o) { o.optimizer.lr = -0.1f; }, "EngineOptions::optimizer.lr is -0.1; it must be >= 0"},
      {[](EngineOptions& o) { o.optimizer.lr = std::numeric_limits<float>::quiet_NaN(); },
       "EngineOptions::optimizer.lr is nan"},
      {[](EngineOptions& o) { o.optimizer.beta2 = 1.0f; }, "EngineOptions::optimizer: beta2 is 1"},
      {[](EngineOptions& o) { o.device_ordinal = -1; }, "EngineOptions::device_ordinal is -1; it must be >= 0"},
      {[](EngineOptions& o) { o.spare_state_fraction = 1.5; }, "EngineOptions::spare_state_fraction is 1.5"},
      {[](EngineOptions& o) { o.spare_state_fraction = -0.25; }, "EngineOptions::spare_state_fraction is -0.25"},
      {[](EngineOptions& o) { o.spare_state_fraction = std::numeric_limits<double>::quiet_NaN(); },
       "EngineOptions::spare_state_fraction is nan"},
      {[](EngineOptions& o) { o.state_later = "half"; }, "EngineOptions::state_later is 'half'"},
      {[](EngineOptions& o) { o.local_rank = 2, o.local_world_size = 2; },
       "EngineOptions::local_rank is 2 and local_world_size is 2; set both"},
      {[](EngineOptions& o) { o.local_rank = 1; }, "EngineOptions::local_rank is 1 and local_world_size is -1"},
      {[](EngineOptions& o) { o.local_world_size = 4; }, "EngineOptions::local_rank is -1 and local_world_size is 4"},
      {[](EngineOptions& o) { o.local_rank = 0, o.local_world_size = 0; }, "local_world_size is 0; set both"},
      {[](EngineOptions& o) { o.pin_cpu_threads = 2; }, "EngineOptions::pin_cpu_threads is 2; it must be -1"},
      {[](EngineOptions& o) { o.pin_trainer_threads = -2; }, "EngineOptions::pin_trainer_threads is -2"},
      {[](EngineOptions& o) { o.numa = "nearest"; }, "EngineOptions::numa: unknown NUMA policy 'nearest'"},
      {[](EngineOptions& o) { o.collective_timeout = absl::ZeroDuration(); },
       "EngineOptions::collective_timeout is 0; it must be > 0"},
      {[](EngineOptions& o) { o.checkpoint_timeout = absl::Seconds(-1); },
       "EngineOptions::checkpoint_timeout is -1s; it must be > 0"},
  };
  for (const auto& [edit, want] : cases) {
    EngineOptions o = HostOptions();
    edit(o);
    absl::StatusOr<std::unique_ptr<Engine>> e = Engine::Create(o);
    ASSERT_FALSE(e.ok()) << want;
    EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument) << e.status();
    EXPECT_THAT(std::string(e.status().message()), testing::HasSubstr(want));
  }
}

TEST(EngineOptionsTest, TheEdgesOfEachRangeAreTaken) {
  const std::vector<Edit> cases = {
      [](EngineOptions& o) { o.optimizer.lr = 0.0f; },
      [](EngineOptions& o) { o.spare_state_fraction = 0.0; },
      [](EngineOptions& o) { o.spare_state_fraction = 1.0; },
      [](EngineOptions& o) { o.state_later = "1"; },
      [](EngineOptions& o) { o.local_rank = 0, o.local_world_size = 1; },
      [](EngineOptions& o) { o.pin_cpu_threads = 0, o.pin_trainer_threads = 0; },
      [](EngineOptions& o) { o.pin_cpu_threads = 1, o.pin_trainer_threads = 1; },
      [](EngineOptions& o) { o.numa = "LOCAL"; },
      [](EngineOptions& o) { o.collective_timeout = absl::Milliseconds(1); },
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    EngineOptions o = HostOptions();
    cases[i](o);
    absl::StatusOr<std::unique_ptr<Engine>> e = Engine::Create(o);
    EXPECT_TRUE(e.ok()) << "case " << i << ": " << e.status();
  }
}

// A local rank's share divides the process's default pinned budget at Create; a refused Create divides
// nothing, whichever field was at fault.
TEST(EngineOptionsTest, ARefusedCreateLeavesThePinnedBudgetAsItWas) {
  PinnedBudget& budget = PinnedBudget::Process();
  const size_t before = budget.limit();
  ASSERT_EQ(before, PinnedBudget::DefaultProcessLimit());
  EngineOptions o = HostOptions();
  o.local_rank = 1;
  o.local_world_size = 4;
  o.pin_cpu_threads = 3;
  EXPECT_FALSE(Engine::Create(o).ok());
  o.pin_cpu_threads = -1;
  o.numa = "everywhere";
  EXPECT_FALSE(Engine::Create(o).ok());
  EXPECT_EQ(budget.limit(), before);
}

}  // namespace
}  // namespace ferry::engine_test
