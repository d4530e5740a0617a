// The policy sandbox against hostile or broken scripts: deep recursion (Lua frames and nesting through
// C functions, also on a thread with a small stack), rawset on the globals of another hook, huge
// tables, string.dump, collectgarbage, and every hook's errors naming where the hook is defined.
// Each failure is checked to leave the Policy working (a correct call right after returns exactly
// the expected result).
#include <pthread.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "policy/policy.h"

namespace ferry {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;

#define ASSERT_OK_AND_MOVE(lhs, expr)              \
  auto lhs##_or = (expr);                          \
  ASSERT_TRUE(lhs##_or.ok()) << lhs##_or.status(); \
  auto lhs = std::move(*lhs##_or)

std::string Msg(const absl::Status& status) { return std::string(status.message()); }

GroupInfo Group(std::string name, int64_t numel) {
  GroupInfo g;
  g.name = std::move(name);
  g.numel = numel;
  g.bytes = 2 * numel;
  return g;
}

std::vector<GroupInfo> Groups() { return {Group("embed", 100), Group("head", 10)}; }

PolicyContext Ctx(std::map<std::string, std::string> args = {}) {
  PolicyContext ctx;
  ctx.args = std::move(args);
  return ctx;
}

std::unique_ptr<Policy> MustLoad(const std::string& source, const PolicyOptions& options = {}) {
  auto policy = Policy::LoadString(source, "hostile.lua", options);
  EXPECT_TRUE(policy.ok()) << policy.status();
  return policy.ok() ? std::move(*policy) : nullptr;
}

// A policy whose place() runs the Lua statement args.code names (from the table CASES defined by
// `cases`, a Lua table constructor body of name = function() ... end entries), then places embed on
// the CPU and head on the GPU.
std::string PlaceRunning(const std::string& cases) {
  return "local CASES = {\n" + cases +
         "\n}\n"
         "return { place = function(groups, ctx)\n"
         "  if ctx.args.code then CASES[ctx.args.code]() end\n"
         "  return { embed = 'cpu', head = 'gpu' }\n"
         "end }\n";
}

// Expects Place(code) to fail with a message containing `expected` and the given code, then a
// correct call on the same policy to return exactly the expected placement.
void ExpectFailsThenWorks(Policy& policy, const std::string& code, const std::string& expected,
                          absl::StatusCode status_code = absl::StatusCode::kInvalidArgument) {
  SCOPED_TRACE(code);
  absl::StatusOr<Placement> bad = policy.Place(Groups(), Ctx({{"code", code}}));
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), status_code) << bad.status();
  EXPECT_THAT(Msg(bad.status()), HasSubstr("hostile.lua: place(): "));
  EXPECT_THAT(Msg(bad.status()), HasSubstr(expected));
  ASSERT_OK_AND_MOVE(good, policy.Place(Groups(), Ctx()));
  EXPECT_EQ(good.groups, (std::map<std::string, PlaceKind>{{"embed", PlaceKind::kCpu},
                                                           {"head", PlaceKind::kGpu}}));
}

const char kRecursions[] = R"lua(
  lua_frames = function()
    local function f(n) return 1 + f(n + 1) end
    f(0)
  end,
  gsub_function = function()
    local function f() return (string.gsub("x", "x", function() return f() end)) end
    f()
  end,
  gsub_method = function()
    local function f() return (("x"):gsub("x", f)) end
    f()
  end,
  gsub_table = function()
    local repl
    repl = setmetatable({}, { __index = function(t, k) return (string.gsub("x", "x", repl)) end })
    string.gsub("x", "x", repl)
  end,
  format_tostring = function()
    local t
    t = setmetatable({}, { __tostring = function() return string.format("%s", t) end })
    string.format("%s", t)
  end,
  sort_comparator = function()
    local function f() table.sort({ 3, 2, 1 }, function(a, b) f() return a < b end) end
    f()
  end,
  xpcall_rethrow = function()
    local function f()
      local ok, err = xpcall(f, function(m) return m end)
      if not ok then error(err, 0) end
    end
    f()
  end,
  pcall_rethrow = function()
    local function f()
      local ok, err = pcall(f)
      if not ok then error(err, 0) end
    end
    f()
  end,
  index_function = function()
    local t
    t = setmetatable({}, { __index = function(_, k) return t[k] end })
    return t.x
  end,
  index_loop = function()
    local t = {}
    setmetatable(t, { __index = t })
    return t.x
  end,
  deep_table = function()
    local t = {}
    for i = 1, 100000 do t = { t } end
    local function depth(x) if x[1] then return 1 + depth(x[1]) end return 0 end
    depth(t)
  end,
)lua";

// What each recursion ends with.
const std::vector<std::pair<std::string, std::string>> kRecursionErrors = {
    {"lua_frames", "stack overflow"},
    {"gsub_function", "C stack overflow"},
    {"gsub_method", "C stack overflow"},
    {"gsub_table", "C stack overflow"},
    {"format_tostring", "stack overflow"},
    {"sort_comparator", "stack overflow"},
    {"xpcall_rethrow", "stack overflow"},
    {"pcall_rethrow", "stack overflow"},
    {"index_function", "stack overflow"},
    {"index_loop", "loop in gettable"},
    {"deep_table", "stack overflow"},
};

TEST(SandboxRecursionTest, DeepRecursionIsACleanError) {
  auto policy = MustLoad(PlaceRunning(kRecursions));
  ASSERT_NE(policy, nullptr);
  for (const auto& [code, expected] : kRecursionErrors) {
    ExpectFailsThenWorks(*policy, code, expected);
  }
}

// Runs `fn` on a thread with a 1 MiB stack (a trainer's worker thread may have a small one).
void RunOnSmallStack(const std::function<void()>& fn) {
  pthread_attr_t attr;
  ASSERT_EQ(pthread_attr_init(&attr), 0);
  // Sanitizer builds use several times more stack per frame (and on the error path): give them 8 MiB.
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
  constexpr size_t kStack = size_t{8} << 20;
#else
  constexpr size_t kStack = size_t{1} << 20;
#endif
  ASSERT_EQ(pthread_attr_setstacksize(&attr, kStack), 0);
  pthread_t thread;
  auto* task = new std::function<void()>(fn);
  ASSERT_EQ(pthread_create(
                &thread, &attr,
                [](void* p) -> void* {
                  std::unique_ptr<std::function<void()>> f(static_cast<std::function<void()>*>(p));
                  (*f)();
                  return nullptr;
                },
                task),
            0);
  pthread_attr_destroy(&attr);
  ASSERT_EQ(pthread_join(thread, nullptr), 0);
}

TEST(SandboxRecursionTest, RecursionThroughCFunctionsFitsASmallThreadStack) {
  // Without the C stack bound, gsub's recursion would overflow a 1 MiB stack and crash the process.
  auto policy = MustLoad(PlaceRunning(kRecursions));
  ASSERT_NE(policy, nullptr);
  RunOnSmallStack([&] {
    for (const auto& [code, expected] : kRecursionErrors) {
      ExpectFailsThenWorks(*policy, code, expected);
    }
  });
}

TEST(SandboxRecursionTest, ModestNestingThroughCFunctionsStillWorks) {
  // A few levels of gsub-in-gsub and sort-in-sort are legitimate and must not trip the bound.
  auto policy = MustLoad(R"lua(
    return { place = function(groups, ctx)
      local function nest(n)
        if n == 0 then return "x" end
        return (string.gsub("y", "y", function() return nest(n - 1) end))
      end
      assert(nest(10) == "x")
      local t = { 3, 1, 2 }
      table.sort(t, function(a, b)
        local inner = { b, a }
        table.sort(inner)
        return a < b
      end)
      assert(t[1] == 1 and t[3] == 3)
      return { embed = "gpu", head = "gpu" }
    end }
  )lua");
  ASSERT_NE(policy, nullptr);
  ASSERT_OK_AND_MOVE(p, policy->Place(Groups(), Ctx()));
  EXPECT_EQ(p.groups.at("embed"), PlaceKind::kGpu);
}

TEST(SandboxRecursionTest, TailCallLoopsStopAtTheInstructionLimit) {
  PolicyOptions options;
  options.instruction_limit = 100'000;
  auto policy = MustLoad(PlaceRunning(R"lua(
    tostring_loop = function()
      local t
      t = setmetatable({}, { __tostring = function() return tostring(t) end })
      tostring(t)
    end,
    tail = function()
      local function f(n) return f(n + 1) end
      f(0)
    end,
  )lua"),
                         options);
  ASSERT_NE(policy, nullptr);
  for (const char* code : {"tostring_loop", "tail"}) {
    ExpectFailsThenWorks(*policy, code, "instruction limit exceeded (100000 per call)",
                         absl::StatusCode::kResourceExhausted);
  }
}

// ---- globals of other hooks -----------------------------------------------------------------------

TEST(SandboxGlobalsTest, RawsetOnTheGlobalsOfAnotherHookChangesNothing) {
  // place() keeps its own library tables and module table in an upvalue and sets globals; the other
  // hooks then write into those tables of a finished call. Nothing of it reaches a later call.
  auto policy = MustLoad(R"lua(
    local M = {}
    local saved = {}
    function M.place(groups, ctx)
      saved.string, saved.math, saved.table, saved.os = string, math, table, os
      leaked_function = function() return "leaked" end
      rawset(string, "format", function() return "hijacked" end)
      rawset(math, "floor", function() return 42 end)
      M.checkpoint = function() return { keep_last = 99 } end  -- hooks were taken at load time
      local out = {}
      for _, g in ipairs(groups) do out[g.name] = "gpu" end
      return out
    end
    function M.checkpoint(info, ctx)
      assert(leaked_function == nil, "a global set by place() is visible in checkpoint()")
      assert(saved.string ~= string and saved.math ~= math, "checkpoint() sees place()'s tables")
      rawset(saved.string, "rep", function() return "hijacked" end)
      rawset(saved.table, "concat", function() return "hijacked" end)
      rawset(saved.os, "clock", function() return -1 end)
      saved.math.max = function() return -1 end
      assert(string.format("%d", 7) == "7", "string.format hijacked")
      assert(math.floor(2.5) == 2, "math.floor hijacked")
      return { keep_last = 2 }
    end
    function M.after_load(event, ctx)
      assert(string.rep("a", 2) == "aa" and ("b"):rep(2) == "bb", "string.rep hijacked")
      assert(table.concat({ "a", "b" }) == "ab", "table.concat hijacked")
      assert(math.max(1, 2) == 2 and os.clock() >= 0, "math.max or os.clock hijacked")
      assert(leaked_function == nil)
      return { sync = "none", reset_optimizer = false }
    end
    return M
  )lua");
  ASSERT_NE(policy, nullptr);
  ASSERT_OK_AND_MOVE(p, policy->Place(Groups(), Ctx()));
  EXPECT_EQ(p.groups.at("head"), PlaceKind::kGpu);
  CheckpointInfo info;
  info.groups = {"embed", "head"};
  for (int round = 0; round < 2; ++round) {
    ASSERT_OK_AND_MOVE(plan, policy->Checkpoint(info, Ctx()));
    EXPECT_EQ(plan.keep_last, 2);  // the original hook, not the one place() stored in M
    LoadEvent event;
    event.groups = {"embed"};
    event.masters_loaded = event.optimizer_loaded = true;
    ASSERT_OK_AND_MOVE(sync, policy->AfterLoad(event, Groups(), Ctx()));
    EXPECT_TRUE(sync.sync_groups.empty());
    EXPECT_FALSE(sync.reset_optimizer);
  }
}

TEST(SandboxGlobalsTest, TopLevelCannotReachTheGlobalsOfLaterCalls) {
  // The chunk's top level runs once; a table it captures is its own load-time copy.
  auto policy = MustLoad(R"lua(
    local load_time_string = string
    rawset(load_time_string, "upper", function() return "hijacked" end)
    local M = {}
    function M.place(groups, ctx)
      assert(string ~= load_time_string)
      assert(("abc"):upper() == "ABC" and string.upper("abc") == "ABC", "string.upper hijacked")
      return { embed = "cpu", head = "cpu" }
    end
    return M
  )lua");
  ASSERT_NE(policy, nullptr);
  ASSERT_OK_AND_MOVE(p, policy->Place(Groups(), Ctx()));
  EXPECT_EQ(p.groups.at("embed"), PlaceKind::kCpu);
}

// ---- huge tables ---------------------------------------------------------------------------------

TEST(SandboxMemoryTest, HugeTablesStopAtTheMemoryLimitAndAreReclaimed) {
  PolicyOptions options;
  options.instruction_limit = int64_t{1} << 40;  // the memory limit, not the instruction limit
  options.memory_limit_bytes = 16 << 20;
  auto policy = MustLoad(PlaceRunning(R"lua(
    array = function() local t = {} for i = 1, 1e9 do t[i] = i end end,
    hash = function() local t = {} for i = 1, 1e9 do t["k" .. i] = true end end,
    nested = function() local t = {} for i = 1, 1e9 do t[i] = { i } end end,
    concat = function()
      local parts = {}
      for i = 1, 1000 do parts[i] = string.rep("z", 100000) end
      local s = table.concat(parts)
    end,
    -- Six MiB (twelve at the peak of string.rep) fit only if the garbage of the failed call before
    -- was collected.
    six_mib = function()
      local s = string.rep("q", 6 * 2^20)
      assert(#s == 6 * 2^20)
      error("allocated six MiB", 0)
    end,
  )lua"),
                         options);
  ASSERT_NE(policy, nullptr);
  for (const char* code : {"array", "hash", "nested", "concat"}) {
    ExpectFailsThenWorks(*policy, code, "memory limit of 16777216 bytes exceeded",
                         absl::StatusCode::kResourceExhausted);
    absl::StatusOr<Placement> big = policy->Place(Groups(), Ctx({{"code", "six_mib"}}));
    ASSERT_FALSE(big.ok());
    EXPECT_THAT(Msg(big.status()), HasSubstr("allocated six MiB")) << code;
  }
}

TEST(SandboxMemoryTest, HugeResultTablesAreRefusedAtTheFirstBadEntry) {
  auto policy = MustLoad(R"lua(
    return { place = function(groups, ctx)
      local out = {}
      for i = 1, 200000 do out["bogus" .. i] = "cpu" end
      out.embed, out.head = "gpu", "gpu"
      return out
    end }
  )lua");
  ASSERT_NE(policy, nullptr);
  absl::StatusOr<Placement> p = policy->Place(Groups(), Ctx());
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(p.status()), HasSubstr("place(): names unknown group \"bogus"));
  EXPECT_THAT(Msg(p.status()), HasSubstr("expected only the 2 groups passed to place()"));
}

TEST(SandboxMemoryTest, TooManyResultsIsAnError) {
  auto policy = MustLoad(PlaceRunning(R"lua(
    unpack_many = function() return unpack({}, 1, 1e8) end,
    select_many = function() local t = {} for i = 1, 1e6 do t[i] = i end return select("#", unpack(t)) end,
  )lua"));
  ASSERT_NE(policy, nullptr);
  ExpectFailsThenWorks(*policy, "unpack_many", "too many results to unpack");
  ExpectFailsThenWorks(*policy, "select_many", "too many results to unpack");
}

// ---- string.dump, collectgarbage, bytecode ---------------------------------------------------------

TEST(SandboxLibrariesTest, StringDumpIsAbsentEverywhere) {
  auto policy = MustLoad(PlaceRunning(R"lua(
    check = function()
      assert(rawget(string, "dump") == nil, "string.dump is present")
      for name in pairs(string) do assert(name ~= "dump", "pairs(string) lists dump") end
      assert(("").dump == nil, "(''):dump is reachable")
      error("no dump anywhere", 0)
    end,
    call = function() string.dump(function() end) end,
    method = function() return ("x"):dump() end,
  )lua"));
  ASSERT_NE(policy, nullptr);
  ExpectFailsThenWorks(*policy, "check", "no dump anywhere");
  ExpectFailsThenWorks(*policy, "call", "'string.dump' is not available in the policy sandbox");
  ExpectFailsThenWorks(*policy, "method", "attempt to call method 'dump' (a nil value)");
}

TEST(SandboxLibrariesTest, CollectGarbageOnlyCounts) {
  auto policy = MustLoad(PlaceRunning(R"lua(
    count = function()
      local kib = collectgarbage("count")
      assert(type(kib) == "number" and kib > 0)
      error("count is " .. (kib > 0 and "positive" or "zero"), 0)
    end,
    collect = function() collectgarbage("collect") end,
    default = function() collectgarbage() end,
    stop = function() collectgarbage("stop") end,
    restart = function() collectgarbage("restart") end,
    step = function() collectgarbage("step", 100) end,
    setpause = function() collectgarbage("setpause", 1000) end,
    setstepmul = function() collectgarbage("setstepmul", 1) end,
    number = function() collectgarbage(1) end,
  )lua"));
  ASSERT_NE(policy, nullptr);
  ExpectFailsThenWorks(*policy, "count", "count is positive");
  for (const char* option : {"collect", "stop", "restart", "step", "setpause", "setstepmul"}) {
    ExpectFailsThenWorks(*policy, option,
                         "collectgarbage(\"" + std::string(option) +
                             "\") is not available in the policy sandbox (only "
                             "collectgarbage(\"count\") is)");
  }
  ExpectFailsThenWorks(*policy, "default", "collectgarbage(\"collect\") is not available");
  ExpectFailsThenWorks(*policy, "number", "collectgarbage(\"1\") is not available");
}

TEST(SandboxLibrariesTest, BytecodeStringsCannotBeLoaded) {
  auto policy = MustLoad(PlaceRunning(R"lua(
    load = function() load("\27LJ\2\0")() end,
    loadstring = function() loadstring("\27LJ\2\0")() end,
  )lua"));
  ASSERT_NE(policy, nullptr);
  ExpectFailsThenWorks(*policy, "load", "'load' is not available in the policy sandbox");
  ExpectFailsThenWorks(*policy, "loadstring",
                       "'loadstring' is not available in the policy sandbox");
  // And a policy file that is bytecode is refused as a whole.
  absl::StatusOr<std::unique_ptr<Policy>> compiled =
      Policy::LoadString(std::string("\x1bLJ\x02\x00return {}", 14), "compiled.lua");
  ASSERT_FALSE(compiled.ok());
  EXPECT_THAT(Msg(compiled.status()), HasSubstr("compiled.lua: is a precompiled (bytecode) chunk"));
}

// ---- errors name where the hook is defined -------------------------------------------------------

TEST(SandboxErrorsTest, WrongResultsNameTheHookDefinition) {
  auto policy = MustLoad(R"lua(local M = {}

function M.place(groups, ctx)
  return { embed = "disk", head = "gpu" }
end

M.after_load = function(event, ctx) return { sync = 5 } end

function M.checkpoint(info, ctx)
  return { keep_last = -2 }
end

function M.on_step(stats, ctx) return { move = { embed = "tape" } } end

return M
)lua");
  ASSERT_NE(policy, nullptr);
  absl::StatusOr<Placement> p = policy->Place(Groups(), Ctx());
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(Msg(p.status()),
            "hostile.lua: place(): group \"embed\" has placement \"disk\"; expected \"cpu\" or "
            "\"gpu\" (hook defined at hostile.lua:3)");
  LoadEvent event;
  absl::StatusOr<SyncPlan> s = policy->AfterLoad(event, Groups(), Ctx());
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(Msg(s.status()),
            "hostile.lua: after_load(): field \"sync\" is the number 5; expected \"all\", \"none\" "
            "or an array of group names (hook defined at hostile.lua:7)");
  CheckpointInfo info;
  info.groups = {"embed", "head"};
  absl::StatusOr<CheckpointPlan> c = policy->Checkpoint(info, Ctx());
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(Msg(c.status()),
            "hostile.lua: checkpoint(): field \"keep_last\" is the number -2; expected an integer "
            ">= 0 (0 keeps all) (hook defined at hostile.lua:9)");
  StepStats stats;
  stats.groups = {{.name = "embed", .placement = PlaceKind::kGpu, .numel = 1, .bytes = 2}};
  absl::StatusOr<MoveRequest> m = policy->OnStep(stats, Ctx());
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(Msg(m.status()),
            "hostile.lua: on_step(): field \"move\" group \"embed\" is \"tape\"; expected \"cpu\" "
            "or \"gpu\" (hook defined at hostile.lua:13)");
}

TEST(SandboxErrorsTest, FilePoliciesNameTheirFullPath) {
  const std::string path = std::string(FERRY_SOURCE_DIR) + "/tests/policy/testdata/returns_number.lua";
  auto policy = Policy::LoadFile(path);
  ASSERT_TRUE(policy.ok()) << policy.status();
  absl::StatusOr<Placement> p = (*policy)->Place(Groups(), Ctx());
  ASSERT_FALSE(p.ok());
  EXPECT_THAT(Msg(p.status()), HasSubstr("(hook defined at " + path + ":3)"));
}

TEST(SandboxErrorsTest, ErrorObjectsThatAreNotStrings) {
  auto policy = MustLoad(PlaceRunning(R"lua(
    table_error = function() error({ code = 7 }) end,
    tostring_error = function() error(setmetatable({}, { __tostring = function() while true do end end })) end,
    nil_error = function() error() end,
    number_error = function() error(42) end,
  )lua"));
  ASSERT_NE(policy, nullptr);
  ExpectFailsThenWorks(*policy, "table_error", "(error object is a table value)");
  // __tostring is never called on an error object (it could loop outside any limit).
  ExpectFailsThenWorks(*policy, "tostring_error", "(error object is a table value)");
  ExpectFailsThenWorks(*policy, "nil_error", "(error object is a nil value)");
  ExpectFailsThenWorks(*policy, "number_error", "42");
}

}  // namespace
}  // namespace ferry
