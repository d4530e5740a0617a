// Policy::OnStep: what on_step(stats, ctx) sees, the move requests it returns, their validation, and
// PlacementAfter.
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "policy/policy.h"

namespace ferry {
namespace {

using ::testing::HasSubstr;

#define ASSERT_OK_AND_MOVE(lhs, expr)              \
  auto lhs##_or = (expr);                          \
  ASSERT_TRUE(lhs##_or.ok()) << lhs##_or.status(); \
  auto lhs = std::move(*lhs##_or)

std::string Msg(const absl::Status& status) { return std::string(status.message()); }

PolicyContext Ctx(std::map<std::string, std::string> args = {}) {
  PolicyContext ctx;
  ctx.gpu_free_bytes = int64_t{5} << 30;
  ctx.args = std::move(args);
  return ctx;
}

// embed (cpu), layer0 (gpu), head (gpu).
StepStats Stats(int64_t step = 7) {
  StepStats stats;
  stats.step = step;
  stats.step_seconds = 0.25;
  stats.gpu_state_bytes = 123456;
  stats.pinned_bytes = 654321;
  stats.groups = {{.name = "embed", .placement = PlaceKind::kCpu, .numel = 1000, .bytes = 2000},
                  {.name = "layer0", .placement = PlaceKind::kGpu, .numel = 3000, .bytes = 6000},
                  {.name = "head", .placement = PlaceKind::kGpu, .numel = 500, .bytes = 1000}};
  return stats;
}

std::unique_ptr<Policy> MustLoad(const std::string& source) {
  auto policy = Policy::LoadString(source, "steps.lua");
  EXPECT_TRUE(policy.ok()) << policy.status();
  return policy.ok() ? std::move(*policy) : nullptr;
}

TEST(OnStepTest, AbsentHookAsksForNothing) {
  auto policy = MustLoad("return { place = function(g, c) return {} end }");
  ASSERT_NE(policy, nullptr);
  EXPECT_FALSE(policy->has_hook("on_step"));
  ASSERT_OK_AND_MOVE(request, policy->OnStep(Stats(), Ctx()));
  EXPECT_TRUE(request.empty());
}

TEST(OnStepTest, SeesStatsAndContext) {
  auto policy = MustLoad(R"lua(
    return { on_step = function(stats, ctx)
      assert(stats.step == 7 and stats.step_seconds == 0.25)
      assert(stats.gpu_state_bytes == 123456 and stats.pinned_bytes == 654321)
      assert(#stats.groups == 3)
      local g = stats.groups[1]
      assert(g.name == "embed" and g.placement == "cpu" and g.numel == 1000 and g.bytes == 2000)
      assert(stats.groups[2].name == "layer0" and stats.groups[2].placement == "gpu")
      assert(stats.groups[3].name == "head" and stats.groups[3].bytes == 1000)
      assert(ctx.gpu_free_bytes == 5 * 2^30 and ctx.args.mode == "check")
      return { move = { head = "cpu" } }
    end }
  )lua");
  ASSERT_NE(policy, nullptr);
  EXPECT_TRUE(policy->has_hook("on_step"));
  ASSERT_OK_AND_MOVE(request, policy->OnStep(Stats(), Ctx({{"mode", "check"}})));
  EXPECT_EQ(request.moves, (std::vector<GroupMove>{{"head", PlaceKind::kCpu}}));
}

TEST(OnStepTest, RequestsKeepOnlyRealChangesInGroupOrder) {
  auto policy = MustLoad(R"lua(
    return { on_step = function(stats, ctx)
      local m = ctx.args.mode
      if m == "nil" then return nil end
      if m == "empty" then return {} end
      if m == "empty_move" then return { move = {} } end
      if m == "same" then return { move = { embed = "cpu", layer0 = "gpu" } } end
      -- Listed out of order, with one group already where it is asked to be.
      return { move = { head = "cpu", embed = "gpu", layer0 = "gpu" } }
    end }
  )lua");
  ASSERT_NE(policy, nullptr);
  for (const char* mode : {"nil", "empty", "empty_move", "same"}) {
    SCOPED_TRACE(mode);
    ASSERT_OK_AND_MOVE(request, policy->OnStep(Stats(), Ctx({{"mode", mode}})));
    EXPECT_TRUE(request.empty());
  }
  ASSERT_OK_AND_MOVE(request, policy->OnStep(Stats(), Ctx()));
  EXPECT_EQ(request.moves, (std::vector<GroupMove>{{"embed", PlaceKind::kGpu},
                                                   {"head", PlaceKind::kCpu}}));
  const Placement after = PlacementAfter(Stats(), request);
  EXPECT_EQ(after.groups, (std::map<std::string, PlaceKind>{{"embed", PlaceKind::kGpu},
                                                            {"layer0", PlaceKind::kGpu},
                                                            {"head", PlaceKind::kCpu}}));
  EXPECT_FALSE(after.numa.has_value());
  EXPECT_EQ(PlacementAfter(Stats(), MoveRequest{}).groups,
            (std::map<std::string, PlaceKind>{{"embed", PlaceKind::kCpu},
                                              {"layer0", PlaceKind::kGpu},
                                              {"head", PlaceKind::kGpu}}));
}

TEST(OnStepTest, StatefulPolicyMovesOnceItHasSeenEnoughSteps) {
  // Offloads the largest GPU group once three steps have been slower than args.slow seconds.
  auto policy = MustLoad(R"lua(
    local slow_steps = 0
    return { on_step = function(stats, ctx)
      if stats.step_seconds > tonumber(ctx.args.slow) then slow_steps = slow_steps + 1 end
      if slow_steps < 3 then return nil end
      local largest
      for _, g in ipairs(stats.groups) do
        if g.placement == "gpu" and (largest == nil or g.numel > largest.numel) then largest = g end
      end
      if largest == nil then return nil end
      return { move = { [largest.name] = "cpu" } }
    end }
  )lua");
  ASSERT_NE(policy, nullptr);
  StepStats stats = Stats();
  std::vector<size_t> sizes;
  for (int step = 1; step <= 6; ++step) {
    stats.step = step;
    stats.step_seconds = step == 2 ? 0.01 : 1.0;  // step 2 is fast: the third slow one is step 4
    ASSERT_OK_AND_MOVE(request, policy->OnStep(stats, Ctx({{"slow", "0.5"}})));
    sizes.push_back(request.moves.size());
    if (step == 4) {
      EXPECT_EQ(request.moves, (std::vector<GroupMove>{{"layer0", PlaceKind::kCpu}}));
    }
    const Placement next = PlacementAfter(stats, request);
    for (GroupStepInfo& g : stats.groups) g.placement = next.groups.at(g.name);
  }
  // Steps 4, 5, 6 each offload the largest remaining GPU group: layer0, head, then nothing.
  EXPECT_EQ(sizes, (std::vector<size_t>{0, 0, 0, 1, 1, 0}));
  EXPECT_EQ(stats.groups[2].placement, PlaceKind::kCpu);
}

TEST(OnStepTest, WrongResultsAreRefusedAndThePolicyKeepsWorking) {
  auto policy = MustLoad(R"lua(
    return { on_step = function(stats, ctx)
      local m = ctx.args.mode
      if m == "number" then return 3 end
      if m == "string" then return "cpu" end
      if m == "field" then return { moves = { head = "cpu" } } end
      if m == "move_string" then return { move = "head" } end
      if m == "move_array" then return { move = { "head" } } end
      if m == "unknown" then return { move = { head = "cpu", layer9 = "cpu" } } end
      if m == "value" then return { move = { head = "disk" } } end
      if m == "bool" then return { move = { head = true } } end
      if m == "error" then error("on_step gave up") end
      if m == "loop" then while true do end end
      return { move = { head = "cpu" } }
    end }
  )lua");
  ASSERT_NE(policy, nullptr);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"number",
       "steps.lua: on_step(): returned the number 3; expected nil (nothing to do) or a table "
       "{move = {[group name] = \"cpu\" | \"gpu\"}}"},
      {"string", "on_step(): returned \"cpu\"; expected nil (nothing to do) or a table"},
      {"field", "on_step(): unknown field \"moves\"; expected only \"move\""},
      {"move_string",
       "on_step(): field \"move\" is \"head\"; expected a table mapping group names to \"cpu\" "
       "or \"gpu\""},
      {"move_array",
       "on_step(): field \"move\" has key the number 1; expected group names (strings) from "
       "stats.groups"},
      {"unknown",
       "on_step(): field \"move\" names unknown group \"layer9\"; expected only the 3 groups of "
       "stats.groups"},
      {"value", "on_step(): field \"move\" group \"head\" is \"disk\"; expected \"cpu\" or \"gpu\""},
      {"bool", "field \"move\" group \"head\" is the boolean true; expected \"cpu\" or \"gpu\""},
      {"error", "steps.lua: on_step(): steps.lua:12: on_step gave up"},
      {"loop", "on_step(): steps.lua:13: instruction limit exceeded"},
  };
  for (const auto& [mode, expected] : cases) {
    SCOPED_TRACE(mode);
    absl::StatusOr<MoveRequest> bad = policy->OnStep(Stats(), Ctx({{"mode", mode}}));
    ASSERT_FALSE(bad.ok());
    EXPECT_EQ(bad.status().code(), mode == "loop" ? absl::StatusCode::kResourceExhausted
                                                  : absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(Msg(bad.status()), HasSubstr(expected));
    ASSERT_OK_AND_MOVE(good, policy->OnStep(Stats(), Ctx()));
    EXPECT_EQ(good.moves, (std::vector<GroupMove>{{"head", PlaceKind::kCpu}}));
  }
}

TEST(OnStepTest, RejectsBadHostInput) {
  auto policy = MustLoad("return { on_step = function() return nil end }");
  ASSERT_NE(policy, nullptr);
  StepStats stats = Stats();
  stats.groups[2].name = "embed";
  absl::StatusOr<MoveRequest> dup = policy->OnStep(stats, Ctx());
  ASSERT_FALSE(dup.ok());
  EXPECT_THAT(Msg(dup.status()), HasSubstr("on_step(): input: group \"embed\" appears twice"));
  stats.groups[2].name = "";
  EXPECT_FALSE(policy->OnStep(stats, Ctx()).ok());
}

TEST(OnStepTest, ModuleMayDefineOnlyKnownHooks) {
  absl::StatusOr<std::unique_ptr<Policy>> typo =
      Policy::LoadString("return { onstep = function() end }", "typo.lua");
  ASSERT_FALSE(typo.ok());
  EXPECT_THAT(Msg(typo.status()),
              HasSubstr("typo.lua: the returned table has unknown hook \"onstep\"; expected place, "
                        "after_load, checkpoint or on_step"));
}

}  // namespace
}  // namespace ferry
