// Policy: hook calls, validation of results, defaults, and the sandbox.
#include "policy/policy.h"

#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

#if __has_include(<luajit-2.1/lua.hpp>)
#include <luajit-2.1/lua.hpp>
#else
#include <lua.hpp>
#endif

namespace ferry {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

const std::string kTestData = std::string(FERRY_SOURCE_DIR) + "/tests/policy/testdata/";

#define ASSERT_OK_AND_MOVE(lhs, expr)              \
  auto lhs##_or = (expr);                          \
  ASSERT_TRUE(lhs##_or.ok()) << lhs##_or.status(); \
  auto lhs = std::move(*lhs##_or)

std::vector<GroupInfo> ThreeGroups() {
  return {
      {.name = "embed", .numel = 1000, .bytes = 2000, .dtype = DType::kBF16, .tags = {"embedding"}},
      {.name = "layer0", .numel = 3000, .bytes = 6000, .dtype = DType::kF16, .tags = {}},
      {.name = "head", .numel = 500, .bytes = 2000, .dtype = DType::kF32, .tags = {"a", "b"}},
  };
}

GroupInfo Group(std::string name, int64_t numel) {
  GroupInfo g;
  g.name = std::move(name);
  g.numel = numel;
  g.bytes = 2 * numel;
  return g;
}

LoadEvent Event(LoadKind kind, bool optimizer_loaded, bool masters_loaded,
                std::vector<std::string> groups = {}) {
  LoadEvent e;
  e.kind = kind;
  e.optimizer_loaded = optimizer_loaded;
  e.masters_loaded = masters_loaded;
  e.groups = std::move(groups);
  return e;
}

CheckpointInfo Info(int64_t step, std::vector<std::string> groups) {
  CheckpointInfo info;
  info.step = step;
  info.reason = "periodic";
  info.groups = std::move(groups);
  return info;
}

std::string Msg(const absl::Status& status) { return std::string(status.message()); }

PolicyContext Ctx(std::map<std::string, std::string> args = {}) {
  PolicyContext ctx;
  ctx.rank = 3;
  ctx.world_size = 8;
  ctx.gpu_free_bytes = int64_t{1} << 40;
  ctx.pinned_budget_bytes = int64_t{3} << 33;
  ctx.numa_nodes = 2;
  ctx.args = std::move(args);
  return ctx;
}

std::unique_ptr<Policy> MustLoad(const std::string& source, const PolicyOptions& options = {}) {
  auto policy = Policy::LoadString(source, "test.lua", options);
  EXPECT_TRUE(policy.ok()) << policy.status();
  return policy.ok() ? std::move(*policy) : nullptr;
}

// A place() hook whose body is `body`, returning {embed=, layer0=, head=} = "gpu" if it gets there.
std::string PlaceWith(const std::string& body) {
  return "return { place = function(groups, ctx)\n" + body +
         "\nreturn { embed = 'gpu', layer0 = 'gpu', head = 'gpu' } end }\n";
}

// ---- happy paths and defaults -------------------------------------------------------------------

TEST(PolicyTest, PlaceSeesGroupsAndContextAndDecides) {
  // The hook checks every marshalled field (an assert failure fails the call) and offloads the
  // groups that carry the tag named in args or whose numel reaches args.min_numel.
  auto policy = MustLoad(R"lua(
    local M = {}
    function M.place(groups, ctx)
      assert(#groups == 3, "three groups")
      assert(groups[1].name == "embed" and groups[1].numel == 1000 and groups[1].bytes == 2000)
      assert(groups[1].dtype == "bf16" and groups[2].dtype == "f16" and groups[3].dtype == "f32")
      assert(#groups[1].tags == 1 and groups[1].tags[1] == "embedding")
      assert(#groups[2].tags == 0 and #groups[3].tags == 2 and groups[3].tags[2] == "b")
      assert(ctx.rank == 3 and ctx.world_size == 8 and ctx.numa_nodes == 2)
      assert(ctx.gpu_free_bytes == 2^40 and ctx.pinned_budget_bytes == 3 * 2^33)
      local min_numel = tonumber(ctx.args.min_numel)
      local out = { numa = "interleave" }
      for _, g in ipairs(groups) do
        local tagged = false
        for _, t in ipairs(g.tags) do tagged = tagged or t == ctx.args.tag end
        out[g.name] = (tagged or g.numel >= min_numel) and "cpu" or "gpu"
      end
      return out
    end
    return M
  )lua");
  ASSERT_NE(policy, nullptr);
  EXPECT_TRUE(policy->has_hook("place"));
  EXPECT_FALSE(policy->has_hook("after_load"));
  EXPECT_FALSE(policy->has_hook("checkpoint"));
  EXPECT_EQ(policy->path(), "test.lua");
  const std::vector<GroupInfo> groups = ThreeGroups();

  ASSERT_OK_AND_MOVE(p1, policy->Place(groups, Ctx({{"tag", "a"}, {"min_numel", "2000"}})));
  EXPECT_EQ(p1.groups, (std::map<std::string, PlaceKind>{{"embed", PlaceKind::kGpu},
                                                         {"layer0", PlaceKind::kCpu},
                                                         {"head", PlaceKind::kCpu}}));
  EXPECT_EQ(p1.numa, "interleave");

  ASSERT_OK_AND_MOVE(p2, policy->Place(groups, Ctx({{"tag", "embedding"}, {"min_numel", "1e9"}})));
  EXPECT_EQ(p2.groups, (std::map<std::string, PlaceKind>{{"embed", PlaceKind::kCpu},
                                                         {"layer0", PlaceKind::kGpu},
                                                         {"head", PlaceKind::kGpu}}));
}

TEST(PolicyTest, DefaultsWhenHooksAreAbsent) {
  auto policy = MustLoad("return {}");
  ASSERT_NE(policy, nullptr);
  const std::vector<GroupInfo> groups = ThreeGroups();
  ASSERT_OK_AND_MOVE(placement, policy->Place(groups, Ctx()));
  EXPECT_EQ(placement.groups.size(), 3u);
  for (const auto& [name, kind] : placement.groups) EXPECT_EQ(kind, PlaceKind::kGpu) << name;
  EXPECT_FALSE(placement.numa.has_value());

  LoadEvent event =
      Event(LoadKind::kModelOnly, /*optimizer_loaded=*/false, /*masters_loaded=*/false);
  ASSERT_OK_AND_MOVE(s1, policy->AfterLoad(event, groups, Ctx()));
  EXPECT_EQ(s1.sync_groups, (std::vector<std::string>{"embed", "layer0", "head"}));
  EXPECT_TRUE(s1.reset_optimizer);
  event = Event(LoadKind::kCheckpoint, /*optimizer_loaded=*/true, /*masters_loaded=*/true);
  ASSERT_OK_AND_MOVE(s2, policy->AfterLoad(event, groups, Ctx()));
  EXPECT_TRUE(s2.sync_groups.empty());
  EXPECT_FALSE(s2.reset_optimizer);

  const CheckpointInfo info = Info(10, {"embed", "layer0", "head"});
  ASSERT_OK_AND_MOVE(plan, policy->Checkpoint(info, Ctx()));
  EXPECT_FALSE(plan.skip_optimizer);
  EXPECT_FALSE(plan.skip_master);
  EXPECT_TRUE(plan.skip_groups.empty());
  EXPECT_FALSE(plan.async);
  EXPECT_EQ(plan.keep_last, 0);
}

TEST(PolicyTest, AfterLoadSeesEventAndReturnsPlan) {
  auto policy = MustLoad(R"lua(
    return { after_load = function(event, ctx)
      assert(event.optimizer_loaded == true and event.masters_loaded == false)
      assert(#event.groups == 1 and event.groups[1] == "layer0")
      assert(#event.all_groups == 3 and event.all_groups[3] == "head")
      if ctx.args.mode == "list" then
        assert(event.kind == "external")
        return { sync = { "head", "embed" }, reset_optimizer = true }
      elseif ctx.args.mode == "all" then
        return { sync = "all", reset_optimizer = false }
      elseif ctx.args.mode == "none" then
        return { sync = "none" }  -- reset_optimizer defaults to not optimizer_loaded = false
      else
        return {}  -- both fields default: sync all (masters not loaded)
      end
    end }
  )lua");
  ASSERT_NE(policy, nullptr);
  const std::vector<GroupInfo> groups = ThreeGroups();
  const LoadEvent event =
      Event(LoadKind::kExternal, /*optimizer_loaded=*/true, /*masters_loaded=*/false, {"layer0"});
  ASSERT_OK_AND_MOVE(list, policy->AfterLoad(event, groups, Ctx({{"mode", "list"}})));
  EXPECT_EQ(list.sync_groups, (std::vector<std::string>{"embed", "head"}));  // engine order
  EXPECT_TRUE(list.reset_optimizer);
  ASSERT_OK_AND_MOVE(all, policy->AfterLoad(event, groups, Ctx({{"mode", "all"}})));
  EXPECT_EQ(all.sync_groups, (std::vector<std::string>{"embed", "layer0", "head"}));
  EXPECT_FALSE(all.reset_optimizer);
  ASSERT_OK_AND_MOVE(none, policy->AfterLoad(event, groups, Ctx({{"mode", "none"}})));
  EXPECT_TRUE(none.sync_groups.empty());
  EXPECT_FALSE(none.reset_optimizer);
  ASSERT_OK_AND_MOVE(dflt, policy->AfterLoad(event, groups, Ctx()));
  EXPECT_EQ(dflt.sync_groups.size(), 3u);
  EXPECT_FALSE(dflt.reset_optimizer);
}

TEST(PolicyTest, CheckpointSeesInfoAndReturnsPlan) {
  auto policy = MustLoad(R"lua(
    return { checkpoint = function(info, ctx)
      assert(info.step == 1234 and info.reason == "preempt")
      assert(info.bytes.model == 100 and info.bytes.master == 200 and info.bytes.optimizer == 400)
      assert(#info.offloaded == 1 and info.offloaded[1] == "layer0")
      assert(#info.groups == 3)
      if ctx.args.mode == "partial" then return { async = true } end
      return { skip = { "optimizer", "head", "master", "embed" }, async = true, keep_last = 3 }
    end }
  )lua");
  ASSERT_NE(policy, nullptr);
  const CheckpointInfo info{.step = 1234,
                            .reason = "preempt",
                            .model_bytes = 100,
                            .master_bytes = 200,
                            .optimizer_bytes = 400,
                            .offloaded = {"layer0"},
                            .groups = {"embed", "layer0", "head"}};
  ASSERT_OK_AND_MOVE(plan, policy->Checkpoint(info, Ctx()));
  EXPECT_TRUE(plan.skip_optimizer);
  EXPECT_TRUE(plan.skip_master);
  EXPECT_EQ(plan.skip_groups, (std::vector<std::string>{"embed", "head"}));
  EXPECT_TRUE(plan.async);
  EXPECT_EQ(plan.keep_last, 3);
  ASSERT_OK_AND_MOVE(partial, policy->Checkpoint(info, Ctx({{"mode", "partial"}})));
  EXPECT_FALSE(partial.skip_optimizer);
  EXPECT_FALSE(partial.skip_master);
  EXPECT_TRUE(partial.skip_groups.empty());
  EXPECT_TRUE(partial.async);
  EXPECT_EQ(partial.keep_last, 0);
}

TEST(PolicyTest, NumaFieldAndGroupNamedNuma) {
  auto policy = MustLoad(R"lua(
    return { place = function(groups, ctx)
      local out = {}
      for _, g in ipairs(groups) do out[g.name] = "cpu" end
      if ctx.args.numa then out.numa = ctx.args.numa end
      return out
    end }
  )lua");
  ASSERT_NE(policy, nullptr);
  std::vector<GroupInfo> groups = ThreeGroups();
  for (const char* mode : {"interleave", "bind", "preferred", "local"}) {
    ASSERT_OK_AND_MOVE(p, policy->Place(groups, Ctx({{"numa", mode}})));
    EXPECT_EQ(p.numa, mode);
  }
  absl::StatusOr<Placement> bad = policy->Place(groups, Ctx({{"numa", "spread"}}));
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(
      Msg(bad.status()),
      HasSubstr("test.lua: place(): field \"numa\" is \"spread\"; expected \"interleave\""));
  // A group literally named "numa": "cpu"/"gpu" under that key place the group.
  groups.push_back(Group("numa", 1));
  ASSERT_OK_AND_MOVE(p, policy->Place(groups, Ctx()));
  EXPECT_EQ(p.groups.at("numa"), PlaceKind::kCpu);
  EXPECT_FALSE(p.numa.has_value());
}

// place()'s optional "spare_state" key: a number in [0, 1], read into Placement::spare_state; any
// other value refused naming the field and the value; a group named "spare_state" is still a group.
TEST(PolicyTest, SpareStateFieldAndGroupNamedSpareState) {
  auto policy = MustLoad(R"lua(
    local values = { half = 0.5, zero = 0, one = 1, tiny = 2^-30, nan = 0/0, neg = -0.25,
                     big = 1.5, inf = math.huge, text = "0.5", yes = true, tbl = {} }
    return { place = function(groups, ctx)
      local out = {}
      for _, g in ipairs(groups) do out[g.name] = "cpu" end
      if ctx.args.spare then out.spare_state = values[ctx.args.spare] end
      return out
    end }
  )lua");
  ASSERT_NE(policy, nullptr);
  std::vector<GroupInfo> groups = ThreeGroups();
  ASSERT_OK_AND_MOVE(none, policy->Place(groups, Ctx()));
  EXPECT_FALSE(none.spare_state.has_value());
  for (const auto& [name, value] : std::vector<std::pair<std::string, double>>{
           {"half", 0.5}, {"zero", 0.0}, {"one", 1.0}, {"tiny", std::ldexp(1.0, -30)}}) {
    ASSERT_OK_AND_MOVE(p, policy->Place(groups, Ctx({{"spare", name}})));
    ASSERT_TRUE(p.spare_state.has_value()) << name;
    EXPECT_EQ(*p.spare_state, value) << name;
    EXPECT_EQ(p.groups.size(), groups.size()) << name;  // the key is no group
  }
  for (const auto& [name, shown] : std::vector<std::pair<std::string, std::string>>{
           {"nan", "the number "},  // "nan" or "-nan", as printf spells it
           {"neg", "the number -0.25"}, {"big", "the number 1.5"}, {"inf", "the number inf"},
           {"text", "\"0.5\""}, {"yes", "the boolean true"}, {"tbl", "a table"}}) {
    absl::StatusOr<Placement> bad = policy->Place(groups, Ctx({{"spare", name}}));
    ASSERT_FALSE(bad.ok()) << name;
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_THAT(Msg(bad.status()), HasSubstr("test.lua: place(): field \"spare_state\" is " + shown)) << name;
    EXPECT_THAT(Msg(bad.status()), HasSubstr("expected a number in [0, 1]")) << name;
    if (name == "nan") {
      EXPECT_THAT(Msg(bad.status()), HasSubstr("nan;"));
    }
  }
  // A group literally named "spare_state": "cpu"/"gpu" (or a table) under that key place the group.
  groups.push_back(Group("spare_state", 1));
  ASSERT_OK_AND_MOVE(p, policy->Place(groups, Ctx()));
  EXPECT_EQ(p.groups.at("spare_state"), PlaceKind::kCpu);
  EXPECT_FALSE(p.spare_state.has_value());
  // ... and a number under it, with such a group, leaves that group without a placement.
  absl::StatusOr<Placement> shadowed = policy->Place(groups, Ctx({{"spare", "half"}}));
  ASSERT_FALSE(shadowed.ok());
  EXPECT_THAT(Msg(shadowed.status()), HasSubstr("group \"spare_state\" has no placement"));
}

// place() may give a group a table with its state precision; strings keep fp32 state.
TEST(PolicyTest, PlaceTablesGiveStatePrecision) {
  auto policy = MustLoad(R"lua(
    return { place = function(groups, ctx)
      local m = ctx.args.mode
      if m == "master16" then
        return { embed = "gpu", layer0 = { device = "cpu", master = "bf16" }, head = "gpu" }
      end
      if m == "meta" then  -- fields are read raw: __index cannot supply the device
        return { embed = setmetatable({}, { __index = function() return "cpu" end }), layer0 = "gpu", head = "gpu" }
      end
      return {
        embed = { device = "cpu", moments = "bf16", master = "bf16", rounding = "stochastic" },
        layer0 = { device = "gpu", moments = "bf16" },
        head = "cpu",
      }
    end }
  )lua");
  ASSERT_NE(policy, nullptr);
  const std::vector<GroupInfo> groups = ThreeGroups();
  ASSERT_OK_AND_MOVE(p, policy->Place(groups, Ctx()));
  EXPECT_EQ(p.groups.at("embed"), PlaceKind::kCpu);
  EXPECT_EQ(p.groups.at("layer0"), PlaceKind::kGpu);
  EXPECT_EQ(p.groups.at("head"), PlaceKind::kCpu);
  ASSERT_EQ(p.state.size(), 2u);
  EXPECT_TRUE(p.state.at("embed") == (StateFormat{DType::kBF16, DType::kBF16, StateRounding::kStochastic}));
  EXPECT_TRUE(p.state.at("layer0") == (StateFormat{DType::kF32, DType::kBF16, StateRounding::kNearest}));
  EXPECT_EQ(DescribeStateFormat(p.state.at("embed")), "bf16 master+moments, stochastic");
  EXPECT_EQ(DescribeStateFormat(StateFormat{}), "fp32");
  absl::StatusOr<Placement> bad = policy->Place(groups, Ctx({{"mode", "master16"}}));
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(Msg(bad.status()), HasSubstr("test.lua: place(): group \"layer0\": master = \"bf16\" needs bf16 "
                                           "params, but its params are f16"));
  bad = policy->Place(groups, Ctx({{"mode", "meta"}}));
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(Msg(bad.status()), HasSubstr("group \"embed\": device is nil; expected \"cpu\" or \"gpu\""));
}

// ---- wrong results: each error, then the same object still works --------------------------------

class WrongResultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    PolicyOptions options;
    options.instruction_limit = 200'000;
    options.memory_limit_bytes = 16 << 20;
    policy_ = MustLoad(R"lua(
      local calls = 0  -- upvalue state survives errors
      return { place = function(groups, ctx)
        calls = calls + 1
        local m = ctx.args.mode
        if m == "number" then return 7 end
        if m == "nothing" then return end
        if m == "unknown" then
          return { embed = "gpu", layer0 = "cpu", head = "gpu", layer9 = "cpu" }
        end
        if m == "missing" then return { embed = "gpu" } end
        if m == "disk" then return { embed = "gpu", layer0 = "disk", head = "gpu" } end
        if m == "bool" then return { embed = true, layer0 = "gpu", head = "gpu" } end
        if m == "key" then return { "cpu", embed = "gpu", layer0 = "gpu", head = "gpu" } end
        if m == "error" then error("policy gave up") end
        if m == "loop" then while true do end end
        if m == "oom" then local s = string.rep("x", 2^30) end
        -- A result table with a metatable: values are read raw, so __index cannot supply them.
        if m == "meta" then
          return setmetatable({ embed = "gpu" }, { __index = function() return "gpu" end })
        end
        return { embed = "cpu", layer0 = calls % 2 == 0 and "cpu" or "gpu", head = "gpu" }
      end }
    )lua",
                       options);
    ASSERT_NE(policy_, nullptr);
  }

  // Expects Place(mode) to fail with `code` and a message containing every `parts`, then checks
  // that a correct call on the same object works and returns exactly the expected placement.
  void ExpectError(const std::string& mode, absl::StatusCode code,
                   const std::vector<std::string>& parts) {
    SCOPED_TRACE(mode);
    const std::vector<GroupInfo> groups = ThreeGroups();
    absl::StatusOr<Placement> bad = policy_->Place(groups, Ctx({{"mode", mode}}));
    ASSERT_FALSE(bad.ok());
    EXPECT_EQ(bad.status().code(), code) << bad.status();
    for (const std::string& part : parts) EXPECT_THAT(Msg(bad.status()), HasSubstr(part));
    ASSERT_OK_AND_MOVE(good, policy_->Place(groups, Ctx({{"mode", "ok"}})));
    EXPECT_EQ(good.groups.at("embed"), PlaceKind::kCpu);
    EXPECT_EQ(good.groups.at("head"), PlaceKind::kGpu);
    EXPECT_EQ(good.groups.size(), 3u);
  }

  std::unique_ptr<Policy> policy_;
};

TEST_F(WrongResultTest, NumberInsteadOfTable) {
  ExpectError(
      "number", absl::StatusCode::kInvalidArgument,
      {"test.lua: place(): returned the number 7; expected a table mapping each group name"});
}
TEST_F(WrongResultTest, Nothing) {
  ExpectError("nothing", absl::StatusCode::kInvalidArgument,
              {"test.lua: place(): returned nil; expected a table"});
}
TEST_F(WrongResultTest, UnknownGroup) {
  ExpectError("unknown", absl::StatusCode::kInvalidArgument,
              {"test.lua: place(): names unknown group \"layer9\"; expected only the 3 groups"});
}
TEST_F(WrongResultTest, MissingGroup) {
  ExpectError("missing", absl::StatusCode::kInvalidArgument,
              {"test.lua: place(): group \"layer0\" has no placement (nor do 1 other groups); "
               "expected \"cpu\" or \"gpu\" for every group"});
}
TEST_F(WrongResultTest, UnknownPlacementValue) {
  ExpectError("disk", absl::StatusCode::kInvalidArgument,
              {"test.lua: place(): group \"layer0\" has placement \"disk\"; expected \"cpu\" or "
               "\"gpu\""});
  ExpectError("bool", absl::StatusCode::kInvalidArgument,
              {"group \"embed\" has placement the boolean true; expected \"cpu\" or \"gpu\""});
}
TEST_F(WrongResultTest, NonStringKey) {
  ExpectError("key", absl::StatusCode::kInvalidArgument,
              {"test.lua: place(): has key the number 1; expected group names (strings)"});
}
TEST_F(WrongResultTest, MetatablesAreIgnored) {
  ExpectError("meta", absl::StatusCode::kInvalidArgument, {"group \"layer0\" has no placement"});
}
TEST_F(WrongResultTest, RuntimeError) {
  ExpectError("error", absl::StatusCode::kInvalidArgument,
              {"test.lua: place(): test.lua:", ": policy gave up", "stack traceback:"});
}
TEST_F(WrongResultTest, InstructionLimit) {
  ExpectError("loop", absl::StatusCode::kResourceExhausted,
              {"test.lua: place(): test.lua:", "instruction limit exceeded (200000 per call)",
               "stack traceback:"});
}
TEST_F(WrongResultTest, MemoryLimit) {
  ExpectError("oom", absl::StatusCode::kResourceExhausted,
              {"test.lua: place(): memory limit of 16777216 bytes exceeded"});
}

TEST(PolicyTest, UpvaluesPersistAcrossCallsAndErrors) {
  auto policy = MustLoad(R"lua(
    local calls = 0
    return { place = function(groups, ctx)
      calls = calls + 1
      if ctx.args.fail then error("fail") end
      return { a = calls == 3 and "cpu" or "gpu" }
    end }
  )lua");
  ASSERT_NE(policy, nullptr);
  std::vector<GroupInfo> groups = {Group("a", 1)};
  ASSERT_OK_AND_MOVE(p1, policy->Place(groups, Ctx()));
  EXPECT_EQ(p1.groups.at("a"), PlaceKind::kGpu);
  EXPECT_FALSE(policy->Place(groups, Ctx({{"fail", "1"}})).ok());
  ASSERT_OK_AND_MOVE(p3, policy->Place(groups, Ctx()));
  EXPECT_EQ(p3.groups.at("a"), PlaceKind::kCpu);  // third call
}

TEST(PolicyTest, WrongAfterLoadResults) {
  auto policy = MustLoad(R"lua(
    return { after_load = function(event, ctx)
      local m = ctx.args.mode
      if m == "number" then return 1 end
      if m == "sync_number" then return { sync = 3 } end
      if m == "sync_word" then return { sync = "some" } end
      if m == "sync_unknown" then return { sync = { "embed", "nope" } } end
      if m == "sync_twice" then return { sync = { "embed", "embed" } } end
      if m == "sync_holes" then return { sync = { [1] = "embed", [3] = "head" } } end
      if m == "sync_entry" then return { sync = { "embed", 5 } } end
      if m == "reset" then return { sync = "all", reset_optimizer = "yes" } end
      if m == "field" then return { sync = "all", reset_optimiser = true } end
      return { sync = { "layer0" }, reset_optimizer = false }
    end }
  )lua");
  ASSERT_NE(policy, nullptr);
  const std::vector<GroupInfo> groups = ThreeGroups();
  const LoadEvent event = Event(LoadKind::kCheckpoint, /*optimizer_loaded=*/false, false);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"number", "test.lua: after_load(): returned the number 1; expected a table {sync ="},
      {"sync_number",
       "after_load(): field \"sync\" is the number 3; expected \"all\", \"none\" or "
       "an array of group names"},
      {"sync_word", "field \"sync\" is \"some\"; expected \"all\""},
      {"sync_unknown", "field \"sync\" entry 2 is \"nope\", which is not a group"},
      {"sync_twice", "field \"sync\" names group \"embed\" twice"},
      {"sync_holes", "field \"sync\" has holes (2 entries, largest key 3)"},
      {"sync_entry", "field \"sync\" entry 2 is the number 5; expected a string"},
      {"reset", "field \"reset_optimizer\" is \"yes\"; expected a boolean"},
      {"field", "unknown field \"reset_optimiser\"; expected only \"sync\", \"reset_optimizer\""},
  };
  for (const auto& [mode, expected] : cases) {
    SCOPED_TRACE(mode);
    absl::StatusOr<SyncPlan> bad = policy->AfterLoad(event, groups, Ctx({{"mode", mode}}));
    ASSERT_FALSE(bad.ok());
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(Msg(bad.status()), HasSubstr(expected));
    ASSERT_OK_AND_MOVE(good, policy->AfterLoad(event, groups, Ctx()));
    EXPECT_EQ(good.sync_groups, std::vector<std::string>{"layer0"});
    EXPECT_FALSE(good.reset_optimizer);
  }
}

TEST(PolicyTest, WrongCheckpointResults) {
  auto policy = MustLoad(R"lua(
    return { checkpoint = function(info, ctx)
      local m = ctx.args.mode
      if m == "string" then return "skip" end
      if m == "skip_word" then return { skip = { "optimiser" } } end
      if m == "skip_twice" then return { skip = { "master", "master" } } end
      if m == "skip_string" then return { skip = "optimizer" } end
      if m == "skip_key" then return { skip = { optimizer = true } } end
      if m == "async" then return { async = 1 } end
      if m == "keep_negative" then return { keep_last = -1 } end
      if m == "keep_fraction" then return { keep_last = 2.5 } end
      if m == "keep_string" then return { keep_last = "3" } end
      if m == "field" then return { keeplast = 3 } end
      return { skip = { "layer0" }, keep_last = 2 }
    end }
  )lua");
  ASSERT_NE(policy, nullptr);
  const CheckpointInfo info = Info(5, {"embed", "layer0", "head"});
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"string", "test.lua: checkpoint(): returned \"skip\"; expected a table"},
      {"skip_word",
       "checkpoint(): field \"skip\" entry 1 is \"optimiser\"; expected "
       "\"optimizer\", \"master\" or a group name"},
      {"skip_twice", "field \"skip\" names \"master\" twice"},
      {"skip_string", "field \"skip\" is \"optimizer\"; expected an array"},
      {"skip_key", "field \"skip\" has key \"optimizer\"; expected an array (keys 1..n)"},
      {"async", "field \"async\" is the number 1; expected a boolean"},
      {"keep_negative", "field \"keep_last\" is the number -1; expected an integer >= 0"},
      {"keep_fraction", "field \"keep_last\" is the number 2.5; expected an integer >= 0"},
      {"keep_string", "field \"keep_last\" is \"3\"; expected an integer >= 0"},
      {"field", "unknown field \"keeplast\"; expected only \"skip\", \"async\", \"keep_last\""},
  };
  for (const auto& [mode, expected] : cases) {
    SCOPED_TRACE(mode);
    absl::StatusOr<CheckpointPlan> bad = policy->Checkpoint(info, Ctx({{"mode", mode}}));
    ASSERT_FALSE(bad.ok());
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(Msg(bad.status()), HasSubstr(expected));
    ASSERT_OK_AND_MOVE(good, policy->Checkpoint(info, Ctx()));
    EXPECT_EQ(good.skip_groups, std::vector<std::string>{"layer0"});
    EXPECT_FALSE(good.skip_optimizer);
    EXPECT_FALSE(good.skip_master);
    EXPECT_FALSE(good.async);
    EXPECT_EQ(good.keep_last, 2);
  }
}

TEST(PolicyTest, RejectsBadHostInput) {
  auto policy = MustLoad("return {}");
  ASSERT_NE(policy, nullptr);
  std::vector<GroupInfo> dup = {Group("a", 1), Group("a", 2)};
  absl::StatusOr<Placement> p = policy->Place(dup, Ctx());
  ASSERT_FALSE(p.ok());
  EXPECT_THAT(Msg(p.status()), HasSubstr("place(): input: group \"a\" appears twice"));
  std::vector<GroupInfo> empty = {Group("", 1)};
  EXPECT_FALSE(policy->Place(empty, Ctx()).ok());
  const LoadEvent event = Event(LoadKind::kCheckpoint, true, true, {"zzz"});
  absl::StatusOr<SyncPlan> s = policy->AfterLoad(event, ThreeGroups(), Ctx());
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(Msg(s.status()), HasSubstr("event.groups names \"zzz\", which is not a group"));
}

// ---- loading
// -------------------------------------------------------------------------------------

TEST(PolicyLoadTest, SyntaxErrorNamesFileAndLine) {
  const std::string path = kTestData + "syntax_error.lua";
  absl::StatusOr<std::unique_ptr<Policy>> policy = Policy::LoadFile(path);
  ASSERT_FALSE(policy.ok());
  EXPECT_EQ(policy.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(policy.status()), HasSubstr("syntax_error.lua:5:"));
  EXPECT_THAT(Msg(policy.status()), HasSubstr("near '='"));
}

TEST(PolicyLoadTest, RuntimeErrorNamesFileLineHookAndTraceback) {
  const std::string path = kTestData + "runtime_error.lua";
  ASSERT_OK_AND_MOVE(policy, Policy::LoadFile(path));
  EXPECT_EQ(policy->path(), path);
  absl::StatusOr<Placement> p = policy->Place(ThreeGroups(), Ctx());
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string message(Msg(p.status()));
  EXPECT_THAT(message, HasSubstr(path + ": place(): "));
  EXPECT_THAT(message, HasSubstr("runtime_error.lua:9: attempt to index field 'missing'"));
  EXPECT_THAT(message, HasSubstr("stack traceback:"));
  EXPECT_THAT(message, HasSubstr("runtime_error.lua:14:"));  // the caller's line, in the traceback
}

TEST(PolicyLoadTest, WrongReturnTypeFromFile) {
  ASSERT_OK_AND_MOVE(policy, Policy::LoadFile(kTestData + "returns_number.lua"));
  absl::StatusOr<Placement> p = policy->Place(ThreeGroups(), Ctx());
  ASSERT_FALSE(p.ok());
  EXPECT_THAT(Msg(p.status()),
              HasSubstr("returns_number.lua: place(): returned the number 42; expected a table"));
}

TEST(PolicyLoadTest, MissingFile) {
  absl::StatusOr<std::unique_ptr<Policy>> policy = Policy::LoadFile(kTestData + "no_such.lua");
  ASSERT_FALSE(policy.ok());
  EXPECT_EQ(policy.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Msg(policy.status()), HasSubstr("no_such.lua"));
}

TEST(PolicyLoadTest, ModuleMustBeATableOfHooks) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"return 5", "test.lua: the chunk returned number; expected a table of hooks"},
      {"", "test.lua: the chunk returned nil; expected a table of hooks"},
      {"return { plase = function() end }", "unknown hook \"plase\"; expected place, after_load"},
      {"return { place = 'cpu' }", "hook \"place\" is a string; expected a function"},
      {"return { [1] = function() end }", "has a number key; expected only hook names"},
      {"error('nope')", "test.lua: top level: test.lua:1: nope"},
  };
  for (const auto& [source, expected] : cases) {
    absl::StatusOr<std::unique_ptr<Policy>> policy = Policy::LoadString(source, "test.lua");
    ASSERT_FALSE(policy.ok()) << source;
    EXPECT_THAT(Msg(policy.status()), HasSubstr(expected)) << source;
  }
}

TEST(PolicyLoadTest, TopLevelIsBounded) {
  PolicyOptions options;
  options.instruction_limit = 100'000;
  absl::StatusOr<std::unique_ptr<Policy>> loop =
      Policy::LoadString("while true do end", "loop.lua", options);
  ASSERT_FALSE(loop.ok());
  EXPECT_EQ(loop.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(Msg(loop.status()), HasSubstr("loop.lua: top level: loop.lua:1: instruction limit"));
  options.memory_limit_bytes = 4 << 20;
  absl::StatusOr<std::unique_ptr<Policy>> big =
      Policy::LoadString("local s = string.rep('x', 2^26) return {}", "big.lua", options);
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(Msg(big.status()), HasSubstr("memory limit"));
}

// Writer for lua_dump.
int AppendChunk(lua_State*, const void* p, size_t size, void* ud) {
  static_cast<std::string*>(ud)->append(static_cast<const char*>(p), size);
  return 0;
}

TEST(PolicyLoadTest, BytecodeIsRefused) {
  // Real bytecode of a valid policy, made with the host's own (unrestricted) LuaJIT.
  lua_State* L = luaL_newstate();
  ASSERT_NE(L, nullptr);
  ASSERT_EQ(luaL_loadstring(L, "return { place = function(g, c) return {} end }"), 0);
  std::string bytecode;
  ASSERT_EQ(lua_dump(L, AppendChunk, &bytecode), 0);
  lua_close(L);
  ASSERT_GT(bytecode.size(), 4u);
  ASSERT_EQ(bytecode[0], '\x1b');
  absl::StatusOr<std::unique_ptr<Policy>> policy = Policy::LoadString(bytecode, "compiled.lua");
  ASSERT_FALSE(policy.ok());
  EXPECT_EQ(policy.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(policy.status()), HasSubstr("compiled.lua: is a precompiled (bytecode) chunk"));
}

// ---- the sandbox
// ---------------------------------------------------------------------------------

struct EscapeCase {
  std::string code;
  std::string expected;
};

TEST(PolicySandboxTest, EveryEscapeFailsWithAClearStatus) {
  const std::vector<EscapeCase> cases = {
      {"io.open('/etc/passwd', 'r')", "'io' is not available in the policy sandbox"},
      {"io.write('x')", "'io' is not available"},
      {"os.execute('true')", "'os.execute' is not available in the policy sandbox"},
      {"os.getenv('HOME')", "'os.getenv' is not available"},
      {"os.exit(1)", "'os.exit' is not available"},
      {"os.remove('/tmp/x')", "'os.remove' is not available"},
      {"require('os')", "'require' is not available"},
      {"require('ffi')", "'require' is not available"},
      {"package.loadlib('libc.so.6', 'system')", "'package' is not available"},
      {"local C = ffi.C", "'ffi' is not available"},
      {"jit.off()", "'jit' is not available"},
      {"loadstring('return 1')()", "'loadstring' is not available"},
      {"load(function() return nil end)", "'load' is not available"},
      {"dofile('/etc/passwd')", "'dofile' is not available"},
      {"loadfile('/etc/passwd')", "'loadfile' is not available"},
      {"debug.getregistry()", "'debug' is not available"},
      {"getfenv(1)", "'getfenv' is not available"},
      {"setfenv(1, {})", "'setfenv' is not available"},
      {"newproxy(true)", "'newproxy' is not available"},
      {"module('x')", "'module' is not available"},
      {"coroutine.wrap(function() end)()", "'coroutine' is not available"},
      {"local g = _G.io", "'_G' is not available"},
      {"string.dump(function() end)", "'string.dump' is not available"},
      {"local s = (''):dump()", "dump"},  // the string methods have no dump either
      {"collectgarbage('collect')", "collectgarbage(\"collect\") is not available"},
      {"collectgarbage()", "collectgarbage(\"collect\") is not available"},
      {"collectgarbage('stop')", "collectgarbage(\"stop\") is not available"},
      // The string metatable is hidden and strings take no metatable.
      {"getmetatable('').__index = {}", "attempt to index a string value"},
      {"getmetatable('').__index.upper = nil", "attempt to index field '__index' (a nil value)"},
      {"rawset(getmetatable(''), '__index', {})", "bad argument #1 to 'rawset'"},
      {"setmetatable('', {})", "bad argument #1 to 'setmetatable'"},
      // Library copies carry a protected metatable.
      {"setmetatable(math, {})", "cannot change a protected metatable"},
  };
  for (const EscapeCase& c : cases) {
    SCOPED_TRACE(c.code);
    auto policy = MustLoad(PlaceWith(c.code));
    ASSERT_NE(policy, nullptr);
    absl::StatusOr<Placement> p = policy->Place(ThreeGroups(), Ctx());
    ASSERT_FALSE(p.ok());
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(Msg(p.status()), HasSubstr("test.lua: place(): test.lua:2: "));
    EXPECT_THAT(Msg(p.status()), HasSubstr(c.expected));
  }
}

TEST(PolicySandboxTest, EscapeAtTopLevelFailsTheLoad) {
  absl::StatusOr<std::unique_ptr<Policy>> policy = Policy::LoadFile(kTestData + "escape_io.lua");
  ASSERT_FALSE(policy.ok());
  EXPECT_THAT(Msg(policy.status()), HasSubstr("escape_io.lua: top level: "));
  EXPECT_THAT(Msg(policy.status()), HasSubstr("escape_io.lua:2: 'io' is not available"));
}

TEST(PolicySandboxTest, SafeLibrariesWork) {
  auto policy = MustLoad(PlaceWith(R"lua(
    assert(string.format("%05.1f|%s", 3.14159, "x") == "003.1|x")
    assert(("abc"):upper() == "ABC" and ("a,b"):find(",", 1, true) == 2)
    assert(string.rep("ab", 3) == "ababab" and ("x"):rep(2) == "xx")
    local t = { 3, 1, 2 }
    table.sort(t)
    assert(table.concat(t, ",") == "1,2,3")
    table.insert(t, 4)
    assert(#t == 4 and table.remove(t) == 4)
    assert(math.floor(2.7) == 2 and math.max(1, 5, 3) == 5 and math.huge > 1e308)
    assert(type(os.clock()) == "number")
    assert(select("#", 1, 2, 3) == 3 and select(2, "a", "b") == "b")
    assert(tonumber("0x10") == 16 and tostring(12) == "12")
    local ok, err = pcall(error, "caught")
    assert(not ok and err == "caught")
    local ok2 = xpcall(function() error("x") end, function(m) return m end)
    assert(not ok2)
    local proto = setmetatable({}, { __index = { answer = 42 } })
    assert(proto.answer == 42 and rawget(proto, "answer") == nil)
    rawset(proto, "own", 1)
    assert(proto.own == 1 and rawequal(proto, proto))
    assert(next({}) == nil and type(pairs({})) == "function")
    assert(unpack({ 1, 2 }) == 1)
    assert(collectgarbage("count") > 0)
    assert(type(getmetatable("")) == "string")
    assert(undefined_global == nil)
    assert(_VERSION == "Lua 5.1")
  )lua"));
  ASSERT_NE(policy, nullptr);
  ASSERT_OK_AND_MOVE(p, policy->Place(ThreeGroups(), Ctx()));
  EXPECT_EQ(p.groups.at("embed"), PlaceKind::kGpu);
}

TEST(PolicySandboxTest, GlobalsDoNotLeakBetweenCalls) {
  auto policy = MustLoad(R"lua(
    local M = {}
    counter = 10                  -- a top-level global: every call starts from this value
    function twice(x) return 2 * x end  -- a top-level global function: visible in hooks
    local function set_global() from_helper = true end
    function M.place(groups, ctx)
      assert(leaked == nil, "a global from an earlier call is visible")
      assert(from_helper == nil, "a global set by a helper in an earlier call is visible")
      assert(counter == 10, "counter is " .. tostring(counter))
      assert(string.upper ~= nil and math.pi > 3.14 and math[1] == nil and os.clock ~= nil)
      assert(("x"):upper() == "X")
      leaked = true
      counter = counter + 1
      set_global()
      string.upper = nil        -- library tables are per-call copies
      math.pi = 3
      table.insert(math, 1)
      rawset(os, "clock", nil)
      if ctx.args.fail then error("failing after setting globals") end
      return { a = twice(1) == 2 and "cpu" or "gpu" }
    end
    return M
  )lua");
  ASSERT_NE(policy, nullptr);
  std::vector<GroupInfo> groups = {Group("a", 1)};
  for (int i = 0; i < 3; ++i) {
    ASSERT_OK_AND_MOVE(p, policy->Place(groups, Ctx()));
    EXPECT_EQ(p.groups.at("a"), PlaceKind::kCpu);
    EXPECT_FALSE(policy->Place(groups, Ctx({{"fail", "1"}})).ok());
  }
}

TEST(PolicySandboxTest, InstructionLimitCannotBeCaughtByPcall) {
  PolicyOptions options;
  options.instruction_limit = 50'000;
  auto policy = MustLoad(PlaceWith(R"lua(
    if ctx.args.mode == "pcall" then
      while true do pcall(function() while true do end end) end
    elseif ctx.args.mode == "xpcall" then
      while true do xpcall(function() while true do end end, function() while true do end end) end
    elseif ctx.args.mode == "recurse" then
      local function f() return pcall(f) end
      while true do f() end
    end
  )lua"),
                         options);
  ASSERT_NE(policy, nullptr);
  for (const char* mode : {"pcall", "xpcall", "recurse"}) {
    SCOPED_TRACE(mode);
    absl::StatusOr<Placement> p = policy->Place(ThreeGroups(), Ctx({{"mode", mode}}));
    ASSERT_FALSE(p.ok());
    EXPECT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted) << p.status();
    EXPECT_THAT(Msg(p.status()), HasSubstr("place(): "));
    EXPECT_THAT(Msg(p.status()), HasSubstr("instruction limit exceeded (50000 per call)"));
    // A modest call under the same limit still runs.
    ASSERT_OK_AND_MOVE(ok, policy->Place(ThreeGroups(), Ctx()));
    EXPECT_EQ(ok.groups.size(), 3u);
  }
}

TEST(PolicySandboxTest, HugeAllocationStopsAtMemoryLimit) {
  PolicyOptions options;
  options.memory_limit_bytes = 8 << 20;
  auto policy = MustLoad(PlaceWith(R"lua(
    if ctx.args.mode == "rep" then local s = string.rep("x", 2^30) end
    if ctx.args.mode == "concat" then
      local s = "x"
      for i = 1, 40 do s = s .. s end
    end
    if ctx.args.mode == "caught" then
      -- Catching the memory error does not lift the limit; keeping what it got, the hook
      -- fails again.
      local keep = {}
      for i = 1, 100 do
        local ok = pcall(function() keep[#keep + 1] = string.rep("y", 2^20 + i) end)
      end
      error("kept " .. #keep .. " MiB")
    end
  )lua"),
                         options);
  ASSERT_NE(policy, nullptr);
  for (const char* mode : {"rep", "concat"}) {
    SCOPED_TRACE(mode);
    absl::StatusOr<Placement> p = policy->Place(ThreeGroups(), Ctx({{"mode", mode}}));
    ASSERT_FALSE(p.ok());
    EXPECT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted) << p.status();
    EXPECT_THAT(Msg(p.status()), HasSubstr("place(): memory limit of 8388608 bytes exceeded"));
    ASSERT_OK_AND_MOVE(ok, policy->Place(ThreeGroups(), Ctx()));
    EXPECT_EQ(ok.groups.size(), 3u);
  }
  absl::StatusOr<Placement> caught = policy->Place(ThreeGroups(), Ctx({{"mode", "caught"}}));
  ASSERT_FALSE(caught.ok());
  EXPECT_EQ(caught.status().code(), absl::StatusCode::kResourceExhausted) << caught.status();
  // Fewer than 8 one-MiB strings fit under 8 MiB.
  EXPECT_THAT(Msg(caught.status()), Not(HasSubstr("kept 100 MiB")));
  EXPECT_THAT(Msg(caught.status()), HasSubstr("refused at the memory limit"));
  ASSERT_OK_AND_MOVE(ok, policy->Place(ThreeGroups(), Ctx()));
  EXPECT_EQ(ok.groups.size(), 3u);
}

TEST(PolicySandboxTest, RejectsNonPositiveLimits) {
  PolicyOptions options;
  options.instruction_limit = 0;
  absl::StatusOr<std::unique_ptr<Policy>> policy =
      Policy::LoadString("return {}", "x.lua", options);
  ASSERT_FALSE(policy.ok());
  EXPECT_EQ(policy.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ferry
