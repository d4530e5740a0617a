// Policies that build on other policies (ferry.policy): the base's hooks are taken over unchanged,
// see their own args, fail with their own file and line, run under the policy's limits, and are read
// again by a reload; every name that would leave the shipped policies or the policy's directory,
// every cycle and every unknown arg is refused with a message that says why.
#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "policy/policy.h"

namespace ferry {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

const std::string kPolicies = std::string(FERRY_SOURCE_DIR) + "/scripts/policies";

std::string Msg(const absl::Status& status) { return std::string(status.message()); }

GroupInfo Group(std::string name, int64_t numel) {
  GroupInfo g;
  g.name = std::move(name);
  g.numel = numel;
  g.bytes = 2 * numel;
  return g;
}

// 4500 elements: fraction 0.25 (budget 1125) offloads c, the walk from the end stopping at b
// (500 + 3000 > 1125); from the start it would offload a (1000 <= 1125).
std::vector<GroupInfo> Model() { return {Group("a", 1000), Group("b", 3000), Group("c", 500)}; }

PolicyContext Ctx(std::map<std::string, std::string> args) {
  PolicyContext ctx;
  ctx.args = std::move(args);
  return ctx;
}

std::vector<std::string> Offloaded(const Placement& p) {
  std::vector<std::string> out;
  for (const auto& [name, kind] : p.groups) {
    if (kind == PlaceKind::kCpu) out.push_back(name);
  }
  return out;
}

class ComposeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (std::filesystem::temp_directory_path() / "ferry-compose-XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string Write(const std::string& name, const std::string& text) const {
    const std::string path = dir_ + "/" + name;
    std::filesystem::create_directories(std::filesystem::path(path).parent_path());
    std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
    return path;
  }
  absl::StatusOr<std::unique_ptr<Policy>> Load(const std::string& name, const std::string& text) {
    return Policy::LoadFile(Write(name, text));
  }

  std::string dir_;
};

// "offload_fraction, but skip the moments on save": place and after_load are offload_fraction's,
// bit for bit, with the base's own fraction; only checkpoint changes.
TEST_F(ComposeTest, OverridesOnlyTheHooksItChanges) {
  auto derived = Load("lean.lua", R"lua(local base = ferry.policy("offload_fraction", { fraction = 0.25 })
return {
  args = base.args,
  place = base.place,
  after_load = base.after_load,
  checkpoint = function(info, ctx)
    local plan = base.checkpoint(info, ctx)
    plan.skip = { "optimizer" }
    return plan
  end,
}
)lua");
  ASSERT_TRUE(derived.ok()) << derived.status();
  auto base = Policy::LoadFile(kPolicies + "/offload_fraction.lua");
  ASSERT_TRUE(base.ok()) << base.status();
  const std::vector<GroupInfo> model = Model();

  absl::StatusOr<Placement> mine = (*derived)->Place(model, Ctx({{"numa", "bind"}}));
  absl::StatusOr<Placement> theirs = (*base)->Place(model, Ctx({{"fraction", "0.25"}, {"numa", "bind"}}));
  ASSERT_TRUE(mine.ok()) << mine.status();
  ASSERT_TRUE(theirs.ok()) << theirs.status();
  EXPECT_EQ(mine->groups, theirs->groups);
  EXPECT_THAT(Offloaded(*mine), ElementsAre("c"));
  EXPECT_EQ(mine->numa, "bind");  // numa is shared: the derived policy's arg reaches the base

  LoadEvent event;
  event.kind = LoadKind::kCheckpoint;
  event.groups = {"a"};
  event.masters_loaded = true;
  event.optimizer_loaded = false;
  absl::StatusOr<SyncPlan> s1 = (*derived)->AfterLoad(event, model, Ctx({}));
  absl::StatusOr<SyncPlan> s2 = (*base)->AfterLoad(event, model, Ctx({}));
  ASSERT_TRUE(s1.ok() && s2.ok()) << s1.status() << s2.status();
  EXPECT_EQ(s1->sync_groups, (std::vector<std::string>{"b", "c"}));
  EXPECT_EQ(s1->sync_groups, s2->sync_groups);
  EXPECT_EQ(s1->reset_optimizer, s2->reset_optimizer);

  CheckpointInfo info;
  info.groups = {"a", "b", "c"};
  absl::StatusOr<CheckpointPlan> plan = (*derived)->Checkpoint(info, Ctx({}));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->skip_optimizer);
  EXPECT_FALSE(plan->skip_master);

  // Which file supplies each hook.
  EXPECT_THAT((*derived)->hook_location("place"), HasSubstr("offload_fraction.lua:"));
  EXPECT_THAT((*derived)->hook_location("after_load"), HasSubstr("offload_fraction.lua:"));
  EXPECT_EQ((*derived)->hook_location("checkpoint"), dir_ + "/lean.lua:6");
  EXPECT_EQ((*derived)->hook_location("on_step"), "");
  EXPECT_THAT((*derived)->files(), ElementsAre(dir_ + "/lean.lua", kPolicies + "/offload_fraction.lua"));
  // fraction is fixed by the derived policy: it takes from and numa only.
  ASSERT_TRUE((*derived)->declared_args().has_value());
  EXPECT_THAT(*(*derived)->declared_args(), ElementsAre(testing::Key("from"), testing::Key("numa")));
}

// The base sees its own args: the fixed ones, and of the policy's args only those it declares
// (and does not have fixed); the policy's own hooks see all of its args.
TEST_F(ComposeTest, TheBaseSeesItsOwnArgs) {
  Write("counting.lua", R"lua(return {
  args = { k = "a number", d = "a device" },
  place = function(groups, ctx)
    local p = {}
    for _, g in ipairs(groups) do p[g.name] = ctx.args.d or "gpu" end
    return p
  end,
  checkpoint = function(info, ctx)
    local n = 0
    for _ in pairs(ctx.args) do n = n + 1 end
    ctx.args.k = "999"  -- a base that scribbles on its args changes nothing outside
    return { keep_last = tonumber(ctx.args.k == "999" and rawget(ctx, "k0") or 0) + n }
  end,
  after_load = function(event, ctx) return { reset_optimizer = ctx.args.top == nil } end,
}
)lua");
  const std::string top_fixed = R"lua(local base = ferry.policy("counting.lua", { k = "3" })
return {
  args = { top = "only mine", d = base.args.d },
  place = base.place,
  after_load = base.after_load,
  checkpoint = function(info, ctx)
    local plan = base.checkpoint(info, ctx)
    plan.keep_last = plan.keep_last * 100 + (ctx.args.top == "x" and 1 or 0) + (ctx.args.k == nil and 10 or 0)
    return plan
  end,
}
)lua";
  auto fixed = Load("fixed.lua", top_fixed);
  ASSERT_TRUE(fixed.ok()) << fixed.status();
  CheckpointInfo info;
  info.groups = {"a", "b", "c"};
  // The base saw {k = "3", d = "cpu"}: 2 args; the top saw its own top = "x" and no k.
  absl::StatusOr<CheckpointPlan> plan = (*fixed)->Checkpoint(info, Ctx({{"top", "x"}, {"d", "cpu"}}));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->keep_last, 211);
  absl::StatusOr<Placement> place = (*fixed)->Place(Model(), Ctx({{"top", "x"}, {"d", "cpu"}}));
  ASSERT_TRUE(place.ok()) << place.status();
  EXPECT_THAT(Offloaded(*place), ElementsAre("a", "b", "c"));
  // after_load is the base's: it never sees "top".
  LoadEvent event;
  absl::StatusOr<SyncPlan> sync = (*fixed)->AfterLoad(event, Model(), Ctx({{"top", "x"}}));
  ASSERT_TRUE(sync.ok()) << sync.status();
  EXPECT_TRUE(sync->reset_optimizer);

  // Sharing every arg (no args table): the base sees k and d, never top.
  auto shared = Load("shared.lua", R"lua(local base = ferry.policy("counting.lua")
local M = { args = base.args, checkpoint = base.checkpoint }
M.args.top = "only mine"
return M
)lua");
  ASSERT_TRUE(shared.ok()) << shared.status();
  plan = (*shared)->Checkpoint(info, Ctx({{"top", "x"}, {"k", "5"}, {"d", "gpu"}}));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->keep_last, 2);
  plan = (*shared)->Checkpoint(info, Ctx({{"top", "x"}}));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->keep_last, 0);
}

TEST_F(ComposeTest, ErrorsNameTheBaseFileAndLine) {
  const std::string base = Write("broken_base.lua", R"lua(local M = {}
function M.place(groups, ctx)
  error("the base cannot place " .. #groups .. " groups")
end
function M.checkpoint(info, ctx) return { keep_last = -1 } end
return M
)lua");
  auto top = Load("top.lua", "local base = ferry.policy('broken_base.lua')\nreturn base\n");
  ASSERT_TRUE(top.ok()) << top.status();
  absl::StatusOr<Placement> place = (*top)->Place(Model(), Ctx({}));
  ASSERT_FALSE(place.ok());
  EXPECT_THAT(Msg(place.status()), HasSubstr(base + ":3: the base cannot place 3 groups"));
  EXPECT_THAT(Msg(place.status()), HasSubstr("stack traceback:"));
  CheckpointInfo info;
  absl::StatusOr<CheckpointPlan> plan = (*top)->Checkpoint(info, Ctx({}));
  ASSERT_FALSE(plan.ok());
  EXPECT_THAT(Msg(plan.status()), HasSubstr("(hook defined at " + base + ":5)"));

  // Errors while the base loads: at its top level, and a syntax error; both also say where the
  // policy called ferry.policy.
  const std::string raising = Write("raising.lua", "local x = 1\nerror('no base today')\n");
  auto t1 = Load("t1.lua", "\nlocal base = ferry.policy('raising.lua')\nreturn base\n");
  ASSERT_FALSE(t1.ok());
  EXPECT_THAT(Msg(t1.status()), HasSubstr(dir_ + "/t1.lua:2: ferry.policy(\"raising.lua\"): " + raising +
                                          ":2: no base today"));
  const std::string syntax = Write("syntax.lua", "return {\n  place = function(g, c) return { = } end\n}\n");
  auto t2 = Load("t2.lua", "return ferry.policy('syntax.lua')\n");
  ASSERT_FALSE(t2.ok());
  EXPECT_THAT(Msg(t2.status()), HasSubstr(syntax + ":2:"));
  const std::string wrong = Write("wrong.lua", "return { plaec = function() end }\n");
  auto t3 = Load("t3.lua", "return ferry.policy('wrong.lua')\n");
  ASSERT_FALSE(t3.ok());
  EXPECT_THAT(Msg(t3.status()), HasSubstr(wrong + ": the returned table has unknown hook \"plaec\""));
}

// The base runs under the policy's limits: its top level counts against the policy's top level,
// and its hooks against the hook call.
TEST_F(ComposeTest, TheBaseRunsUnderThePolicysLimits) {
  Write("spin_load.lua", "while true do end\n");
  PolicyOptions options;
  options.instruction_limit = 100000;
  auto t1 = Policy::LoadFile(Write("t1.lua", "return ferry.policy('spin_load.lua')\n"), options);
  ASSERT_FALSE(t1.ok());
  EXPECT_EQ(t1.status().code(), absl::StatusCode::kResourceExhausted) << t1.status();
  EXPECT_THAT(Msg(t1.status()), HasSubstr("instruction limit exceeded"));
  // A policy that catches the error with pcall is stopped again at once.
  auto t2 = Policy::LoadFile(Write("t2.lua", "pcall(ferry.policy, 'spin_load.lua')\nreturn {}\n"), options);
  ASSERT_FALSE(t2.ok());
  EXPECT_EQ(t2.status().code(), absl::StatusCode::kResourceExhausted) << t2.status();

  Write("spin_hook.lua", "return { place = function() while true do end end }\n");
  auto t3 = Policy::LoadFile(Write("t3.lua", "return ferry.policy('spin_hook.lua')\n"), options);
  ASSERT_TRUE(t3.ok()) << t3.status();
  absl::StatusOr<Placement> place = (*t3)->Place(Model(), Ctx({}));
  ASSERT_FALSE(place.ok());
  EXPECT_EQ(place.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(Msg(place.status()), HasSubstr("spin_hook.lua:1: instruction limit exceeded"));

  // The base is sandboxed like the policy.
  Write("escape.lua", "local f = io.open('/etc/passwd')\nreturn {}\n");
  auto t4 = Load("t4.lua", "return ferry.policy('escape.lua')\n");
  ASSERT_FALSE(t4.ok());
  EXPECT_THAT(Msg(t4.status()), HasSubstr("escape.lua:1: 'io' is not available in the policy sandbox"));
}

// A reload reads every file again: an edit to the base takes effect (what Engine::ReloadPolicy
// does; tests/engine/policy_compose_engine_test.cc checks it through the engine).
TEST_F(ComposeTest, ReloadReadsAnEditedBase) {
  Write("base.lua", "return { place = function(groups, ctx) local p = {} for _, g in ipairs(groups) do p[g.name] = 'cpu' end return p end }\n");
  const std::string top = Write("top.lua", "return ferry.policy('base.lua')\n");
  auto first = Policy::LoadFile(top);
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<Placement> p1 = (*first)->Place(Model(), Ctx({}));
  ASSERT_TRUE(p1.ok()) << p1.status();
  EXPECT_THAT(Offloaded(*p1), ElementsAre("a", "b", "c"));
  Write("base.lua", "return { place = function(groups, ctx) local p = {} for _, g in ipairs(groups) do p[g.name] = 'gpu' end return p end }\n");
  auto second = Policy::LoadFile(top);
  ASSERT_TRUE(second.ok()) << second.status();
  absl::StatusOr<Placement> p2 = (*second)->Place(Model(), Ctx({}));
  ASSERT_TRUE(p2.ok()) << p2.status();
  EXPECT_THAT(Offloaded(*p2), ElementsAre());
}

TEST_F(ComposeTest, RefusesNamesOutsideTheShippedPoliciesAndTheOwnDirectory) {
  Write("inner/x.lua", "return {}\n");
  Write("ok.lua", "return {}\n");
  struct Case {
    std::string call;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"ferry.policy('../x.lua')", "\"../x.lua\" leaves the policy's directory (path traversal), refused"},
      {"ferry.policy('inner/../ok.lua')", "leaves the policy's directory (path traversal), refused"},
      {"ferry.policy('inner/x.lua')", "\"inner/x.lua\" names another directory, refused"},
      {"ferry.policy('" + dir_ + "/ok.lua')", "is an absolute path, refused"},
      {"ferry.policy('/etc/passwd')", "\"/etc/passwd\" is an absolute path, refused"},
      {"ferry.policy('..')", "is neither a shipped policy's name"},
      {"ferry.policy('.hidden.lua')", "is a hidden file, refused"},
      {"ferry.policy('nope.lua')", "no policy file " + dir_ + "/nope.lua"},
      {"ferry.policy('no_such_policy')", "no shipped policy \"no_such_policy\" in " + kPolicies +
                                             " (shipped: all_gpu, memory_budget, offload_all"},
      {"ferry.policy(42)", "name must be a string"},
      {"ferry.policy('ok.lua', 'fraction=1')", "args is \"fraction=1\"; expected a table of args"},
  };
  for (const Case& c : cases) {
    auto policy = Load("top.lua", "local base = " + c.call + "\nreturn base\n");
    ASSERT_FALSE(policy.ok()) << c.call;
    EXPECT_THAT(Msg(policy.status()), HasSubstr(c.expected)) << c.call;
    EXPECT_THAT(Msg(policy.status()), HasSubstr("top.lua:1: ferry.policy(")) << c.call;
  }
  // A symbolic link out of the directory counts as leaving it.
  const std::string outside = (std::filesystem::path(dir_).parent_path() / "ferry-compose-outside.lua").string();
  std::ofstream(outside) << "return {}\n";
  ASSERT_EQ(symlink(outside.c_str(), (dir_ + "/link.lua").c_str()), 0);
  auto linked = Load("top.lua", "return ferry.policy('link.lua')\n");
  std::filesystem::remove(outside);
  ASSERT_FALSE(linked.ok());
  EXPECT_THAT(Msg(linked.status()), HasSubstr("link.lua resolves to"));
  EXPECT_THAT(Msg(linked.status()), HasSubstr("outside " + dir_ + ", refused"));
  // A file in the directory and a shipped policy load.
  EXPECT_TRUE(Load("top.lua", "return ferry.policy('ok.lua')\n").ok());
  EXPECT_TRUE(Load("top.lua", "return ferry.policy('all_gpu')\n").ok());
  // A policy from a string has no directory: shipped policies only.
  auto from_string = Policy::LoadString("return ferry.policy('ok.lua')", "inline");
  ASSERT_FALSE(from_string.ok());
  EXPECT_THAT(Msg(from_string.status()), HasSubstr("a policy loaded from a string has no directory"));
  EXPECT_TRUE(Policy::LoadString("return ferry.policy('offload_all')", "inline").ok());
}

TEST_F(ComposeTest, RefusesCycles) {
  Write("a.lua", "return ferry.policy('b.lua')\n");
  Write("b.lua", "local x = ferry.policy('a.lua')\nreturn x\n");
  auto a = Policy::LoadFile(dir_ + "/a.lua");
  ASSERT_FALSE(a.ok());
  EXPECT_THAT(Msg(a.status()), HasSubstr("a cycle of policies, refused: " + dir_ + "/a.lua -> " + dir_ +
                                         "/b.lua -> " + dir_ + "/a.lua"));
  EXPECT_THAT(Msg(a.status()), HasSubstr(dir_ + "/b.lua:1: ferry.policy(\"a.lua\")"));
  auto self = Load("self.lua", "return ferry.policy('self.lua')\n");
  ASSERT_FALSE(self.ok());
  // A tail call leaves no line to name: the message names the file.
  EXPECT_THAT(Msg(self.status()), HasSubstr("self.lua: top level: " + dir_ + "/self.lua: ferry.policy(\"self.lua\")"));
  EXPECT_THAT(Msg(self.status()), HasSubstr("a cycle of policies, refused: " + dir_ + "/self.lua -> " +
                                            dir_ + "/self.lua"));
  // The same base twice (no cycle) is fine, each with its own args.
  auto twice = Load("twice.lua", R"lua(local quarter = ferry.policy("offload_fraction", { fraction = "0.25" })
local all = ferry.policy("offload_fraction", { fraction = "1" })
return { args = quarter.args, place = function(groups, ctx)
  if #groups > 2 then return quarter.place(groups, ctx) end
  return all.place(groups, ctx)
end }
)lua");
  ASSERT_TRUE(twice.ok()) << twice.status();
  absl::StatusOr<Placement> p = (*twice)->Place(Model(), Ctx({}));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_THAT(Offloaded(*p), ElementsAre("c"));
}

TEST_F(ComposeTest, CallableFromTheTopLevelOnly) {
  auto policy = Load("late.lua", "return { place = function(g, ctx) return ferry.policy('all_gpu').place(g, ctx) end }\n");
  ASSERT_TRUE(policy.ok()) << policy.status();
  absl::StatusOr<Placement> p = (*policy)->Place(Model(), Ctx({}));
  ASSERT_FALSE(p.ok());
  EXPECT_THAT(Msg(p.status()), HasSubstr("late.lua:1: ferry.policy(\"all_gpu\"): ferry.policy can only be "
                                         "called from a policy's top level"));
  auto engine = Load("engine.lua", "local e = ferry.engine\nreturn {}\n");
  ASSERT_FALSE(engine.ok());
  EXPECT_THAT(Msg(engine.status()), HasSubstr("'ferry.engine' is not available in the policy sandbox"));
}

TEST_F(ComposeTest, UnknownArgsAreRefusedNamingThemAndTheKnownOnes) {
  auto fraction = Policy::LoadFile(kPolicies + "/offload_fraction.lua");
  ASSERT_TRUE(fraction.ok()) << fraction.status();
  absl::StatusOr<Placement> typo = (*fraction)->Place(Model(), Ctx({{"fracton", "0.25"}}));
  ASSERT_FALSE(typo.ok());
  EXPECT_EQ(typo.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(typo.status()), HasSubstr("offload_fraction.lua: unknown arg \"fracton\" (fracton=0.25); "
                                            "it takes fraction, from, numa"));
  // Every hook checks, not only place.
  CheckpointInfo info;
  EXPECT_THAT(Msg((*fraction)->Checkpoint(info, Ctx({{"fracton", "0.25"}})).status()), HasSubstr("unknown arg"));
  EXPECT_TRUE((*fraction)->Place(Model(), Ctx({{"fraction", "0.25"}})).ok());

  // A derived shipped policy takes the base's args and its own.
  auto skip = Policy::LoadFile(kPolicies + "/skip_optimizer_on_save.lua");
  ASSERT_TRUE(skip.ok()) << skip.status();
  EXPECT_THAT(Msg((*skip)->Place(Model(), Ctx({{"keep_lats", "2"}})).status()),
              HasSubstr("unknown arg \"keep_lats\" (keep_lats=2); it takes always, fraction, from, keep_last, numa"));

  // Args given to a base are checked against the base's declaration.
  auto fixed = Load("fixed.lua", "local base = ferry.policy('offload_fraction', { fracton = '0.25' })\nreturn base\n");
  ASSERT_FALSE(fixed.ok());
  EXPECT_THAT(Msg(fixed.status()), HasSubstr("fixed.lua:1: ferry.policy(\"offload_fraction\"): " + kPolicies +
                                             "/offload_fraction.lua: unknown arg \"fracton\" (fracton=0.25); "
                                             "it takes fraction, from, numa"));
  // A policy that shares its args with a base must declare the base's (the union).
  auto partial = Load("partial.lua", R"lua(local base = ferry.policy("offload_fraction")
return { args = { fraction = "mine" }, place = base.place }
)lua");
  ASSERT_FALSE(partial.ok());
  EXPECT_THAT(Msg(partial.status()), HasSubstr("partial.lua: " + dir_ + "/partial.lua:1: ferry.policy(\"offload_fraction\") "
                                               "shares this policy's args with the base, which takes \"from\""));
  // A policy that declares nothing is not checked (policies written before declarations).
  auto old = Load("old.lua", "return { place = function(g, ctx) local p = {} for _, x in ipairs(g) do p[x.name] = 'gpu' end return p end }\n");
  ASSERT_TRUE(old.ok()) << old.status();
  EXPECT_FALSE((*old)->declared_args().has_value());
  EXPECT_TRUE((*old)->Place(Model(), Ctx({{"anything", "1"}})).ok());
  // A malformed declaration is refused at load.
  auto bad = Load("bad.lua", "return { args = { 'fraction' } }\n");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(Msg(bad.status()), HasSubstr("field \"args\" has the number 1 = \"fraction\"; expected arg names"));
}

// The README's worked example, "offload_fraction, but skip the moments on save".
TEST_F(ComposeTest, TheReadmeExample) {
  auto lean = Policy::LoadFile(std::string(FERRY_SOURCE_DIR) + "/tests/policy/testdata/lean_offload.lua");
  ASSERT_TRUE(lean.ok()) << lean.status();
  absl::StatusOr<Placement> place = (*lean)->Place(Model(), Ctx({{"keep_last", "2"}}));
  ASSERT_TRUE(place.ok()) << place.status();
  EXPECT_THAT(Offloaded(*place), ElementsAre("c"));
  CheckpointInfo info;
  info.groups = {"a", "b", "c"};
  info.offloaded = {"c"};
  absl::StatusOr<CheckpointPlan> plan = (*lean)->Checkpoint(info, Ctx({{"keep_last", "2"}}));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->skip_optimizer);
  EXPECT_FALSE(plan->skip_master);
  EXPECT_EQ(plan->keep_last, 2);
  EXPECT_FALSE(plan->async);
  EXPECT_THAT(Msg((*lean)->Place(Model(), Ctx({{"fraction", "0.5"}})).status()),
              HasSubstr("unknown arg \"fraction\" (fraction=0.5); it takes from, keep_last, numa"));
}

// Every shipped policy declares its args.
TEST_F(ComposeTest, EveryShippedPolicyDeclaresItsArgs) {
  for (const auto& entry : std::filesystem::directory_iterator(kPolicies)) {
    if (entry.path().extension() != ".lua") continue;
    auto policy = Policy::LoadFile(entry.path().string());
    ASSERT_TRUE(policy.ok()) << policy.status();
    EXPECT_TRUE((*policy)->declared_args().has_value()) << entry.path();
    EXPECT_THAT(Msg((*policy)->CheckArgs({{"no_such_arg", "1"}})), HasSubstr("unknown arg \"no_such_arg\"")) << entry.path();
  }
}

}  // namespace
}  // namespace ferry
