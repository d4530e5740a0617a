// Policies through the engine: every escape attempt and broken hook fails with a clear error and the
// engine keeps training exactly as if nothing had happened (params bit-identical to an engine that
// never saw the broken policy); the shipped policies' decisions take effect in checkpoints, loads
// and placements.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ckpt/checkpoint.h"
#include "device/device.h"
#include "ferry/engine.h"
#include "gmock/gmock.h"
#include "engine/engine_test_util.h"
#include "gtest/gtest.h"

namespace ferry {
namespace {

using ::testing::HasSubstr;

using namespace ::ferry::engine_test;  // NOLINT

// offload_fraction 0.5 offloads g3 (7 of 1347 elements; walked from the end, g2 would pass half).
const std::vector<int64_t> kSizes = {300, 40, 1000, 7};

std::vector<bool> Offloaded(const Engine& e) {
  std::vector<bool> out;
  for (const GroupPlacement& g : e.Placement()) out.push_back(g.offloaded);
  return out;
}

class PolicyEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Device>> d = CreateDevice();
    ASSERT_TRUE(d.ok()) << d.status();
    device_ = *std::move(d);
  }

  std::unique_ptr<Engine> MakeEngine(const std::string& policy, std::map<std::string, std::string> args) {
    EngineOptions o;
    o.policy_path = policy;
    o.policy_args = std::move(args);
    o.optimizer.lr = 1e-2f;
    o.transfer_chunk_bytes = 1024;
    o.device = std::string(BackendName(device_->backend()));
    absl::StatusOr<std::unique_ptr<Engine>> e = Engine::Create(o);
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? *std::move(e) : nullptr;
  }

  // `engine_` over model `a` and `reference_` over model `b` (the same initial values), both with
  // offload_fraction 0.5, finalized.
  void MakePair() {
    a_ = std::make_unique<Model>(device_.get(), kSizes, 77);
    b_ = std::make_unique<Model>(device_.get(), kSizes, 77);
    engine_ = MakeEngine(Policies() + "offload_fraction.lua", {{"fraction", "0.5"}});
    reference_ = MakeEngine(Policies() + "offload_fraction.lua", {{"fraction", "0.5"}});
    ASSERT_NE(engine_, nullptr);
    ASSERT_NE(reference_, nullptr);
    ASSERT_OK(a_->Register(*engine_));
    ASSERT_OK(b_->Register(*reference_));
    ASSERT_OK(engine_->Finalize());
    ASSERT_OK(reference_->Finalize());
    ASSERT_EQ(Offloaded(*engine_), (std::vector<bool>{false, false, false, true}));
  }

  // Steps both engines with the same grads, then checks their params are bit-identical.
  void StepBothAndCompare(int steps) {
    for (int s = 0; s < steps; ++s) {
      a_->SetGrads(seed_);
      b_->SetGrads(seed_);
      ++seed_;
      ASSERT_OK(engine_->Step());
      ASSERT_OK(reference_->Step());
    }
    ASSERT_OK(engine_->Synchronize());
    ASSERT_OK(reference_->Synchronize());
    ASSERT_EQ(a_->Params(), b_->Params()) << "after " << seed_ - 1000 << " steps";
    ASSERT_EQ(engine_->Stats().step, reference_->Stats().step);
  }

  std::unique_ptr<Device> device_;
  TempDir tmp_{"ferry-policy-engine"};
  std::unique_ptr<Model> a_, b_;
  std::unique_ptr<Engine> engine_, reference_;
  uint64_t seed_ = 1000;
};

struct Broken {
  std::string name;
  std::string source;
  std::vector<std::string> expected;  // substrings of the error
  absl::StatusCode code = absl::StatusCode::kInvalidArgument;
};

// place() bodies that try to escape the sandbox or break it; each is a complete policy file.
std::vector<Broken> BrokenPolicies() {
  auto place = [](const std::string& body) {
    return "return { place = function(groups, ctx)\n" + body + "\nend }\n";
  };
  return {
      {"io_open.lua", place("io.open('/etc/passwd', 'r')"), {"io_open.lua:2: 'io' is not available"}},
      {"os_execute.lua", place("os.execute('touch /tmp/ferry-escaped')"),
       {"os_execute.lua:2: 'os.execute' is not available"}},
      {"require.lua", place("require('os')"), {"require.lua:2: 'require' is not available"}},
      {"ffi.lua", place("local C = ffi.C"), {"ffi.lua:2: 'ffi' is not available"}},
      {"load_bytecode.lua", place("load(string.char(27) .. 'LJ')()"), {"'load' is not available"}},
      {"string_dump.lua", place("string.dump(function() end)"), {"'string.dump' is not available"}},
      {"debug.lua", place("debug.getregistry()"), {"debug.lua:2: 'debug' is not available"}},
      {"collectgarbage.lua", place("collectgarbage('stop')"),
       {"collectgarbage(\"stop\") is not available"}},
      {"loop.lua", place("while true do end"), {"loop.lua:2: instruction limit exceeded"},
       absl::StatusCode::kResourceExhausted},
      {"recursion.lua", place("local function f(n) return 1 + f(n + 1) end\nf(0)"), {"stack overflow"}},
      {"c_recursion.lua",
       place("local function f() return (string.gsub('x', 'x', f)) end\nf()"), {"C stack overflow"}},
      // The memory limit (64 MiB) or the instruction limit, whichever comes first.
      {"huge_table.lua", place("local t = {}\nfor i = 1, 1e9 do t[i] = { i } end"),
       {"huge_table.lua: place(): "}, absl::StatusCode::kResourceExhausted},
      {"wrong_result.lua", place("return { g0 = 'cpu', g1 = 'gpu', g2 = 'gpu', g3 = 'tape' }"),
       {"wrong_result.lua: place(): group \"g3\" has placement \"tape\"; expected \"cpu\" or \"gpu\" "
        "(hook defined at "}},
      {"missing_group.lua", place("return { g0 = 'gpu' }"), {"has no placement"}},
      {"syntax.lua", "return { place = function(groups, ctx)\n  return { = 'cpu' }\nend }\n",
       {"syntax.lua:2:"}},
      {"top_level.lua", "local f = io.open('/etc/passwd')\nreturn {}\n",
       {"top_level.lua: top level: ", "top_level.lua:1: 'io' is not available"}},
      {"bytecode.lua", std::string("\x1bLJ\x02\x00\x00", 6), {"precompiled (bytecode) chunk"}},
  };
}

TEST_F(PolicyEngineTest, BrokenPoliciesAtReloadLeaveTheEngineTraining) {
  ASSERT_NO_FATAL_FAILURE(MakePair());
  ASSERT_NO_FATAL_FAILURE(StepBothAndCompare(2));
  for (const Broken& b : BrokenPolicies()) {
    SCOPED_TRACE(b.name);
    const std::string path = tmp_.Write(b.name, b.source);
    absl::Status s = engine_->ReloadPolicy(path, {{"fraction", "1"}});
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.code(), b.code) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(path));
    for (const std::string& part : b.expected) EXPECT_THAT(std::string(s.message()), HasSubstr(part));
    EXPECT_EQ(Offloaded(*engine_), (std::vector<bool>{false, false, false, true}));
    ASSERT_NO_FATAL_FAILURE(StepBothAndCompare(2));
  }
  EXPECT_FALSE(std::filesystem::exists("/tmp/ferry-escaped"));
  // A good reload still works.
  ASSERT_OK(engine_->ReloadPolicy(Policies() + "offload_all.lua", {}));
  EXPECT_EQ(Offloaded(*engine_), (std::vector<bool>{true, true, true, true}));
  ASSERT_NO_FATAL_FAILURE(StepBothAndCompare(2));
  ASSERT_OK(engine_->VerifyMasters());
}

TEST_F(PolicyEngineTest, RawsetOnTheGlobalsOfAnotherHookThroughTheEngine) {
  ASSERT_NO_FATAL_FAILURE(MakePair());
  // place() plants globals and rewrites its library tables; checkpoint() must see none of it, or
  // the save fails with the assertion's message.
  const std::string path = tmp_.Write("globals.lua", R"lua(
local saved = {}
return {
  place = function(groups, ctx)
    saved.string, saved.table = string, table
    planted = true
    rawset(string, "format", function() return "hijacked" end)
    local out = {}
    for i, g in ipairs(groups) do out[g.name] = i == 1 and "cpu" or "gpu" end
    return out
  end,
  checkpoint = function(info, ctx)
    rawset(saved.table, "concat", function() return "hijacked" end)
    assert(planted == nil, "a global of place() leaked into checkpoint()")
    assert(string.format("%d", 3) == "3", "string.format was hijacked")
    assert(table.concat({ "a" }) == "a", "table.concat was hijacked")
    return { keep_last = 1 }
  end,
}
)lua");
  ASSERT_OK(engine_->ReloadPolicy(path, {}));
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<std::string> dir = engine_->SaveCheckpoint(tmp_.path() + "/globals", 10 + i);
    ASSERT_TRUE(dir.ok()) << dir.status();
  }
  // keep_last = 1 took effect: only the second checkpoint is left.
  EXPECT_FALSE(std::filesystem::exists(tmp_.path() + "/globals/step-00000010"));
  EXPECT_TRUE(std::filesystem::exists(tmp_.path() + "/globals/step-00000011"));
  ASSERT_NO_FATAL_FAILURE(StepBothAndCompare(2));
}

TEST_F(PolicyEngineTest, BrokenCheckpointAndAfterLoadHooksChangeNothing) {
  ASSERT_NO_FATAL_FAILURE(MakePair());
  ASSERT_NO_FATAL_FAILURE(StepBothAndCompare(3));
  const std::string root = tmp_.path() + "/ckpt";
  absl::StatusOr<std::string> good = engine_->SaveCheckpoint(root, 3);  // offload_fraction: full
  ASSERT_TRUE(good.ok()) << good.status();

  const std::string place_ok =
      "local M = {}\n"
      "function M.place(groups, ctx)\n"
      "  local out = {}\n"
      "  for i, g in ipairs(groups) do out[g.name] = i == 1 and 'cpu' or 'gpu' end\n"
      "  return out\n"
      "end\n";
  const std::string bad_checkpoint = tmp_.Write(
      "bad_checkpoint.lua",
      place_ok + "function M.checkpoint(info, ctx)\n  return { skip = { 'master', 'optimiser' } }\nend\nreturn M\n");
  ASSERT_OK(engine_->ReloadPolicy(bad_checkpoint, {}));
  absl::StatusOr<std::string> bad = engine_->SaveCheckpoint(root, 5);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()),
              HasSubstr("bad_checkpoint.lua: checkpoint(): field \"skip\" entry 2 is \"optimiser\"; "
                        "expected \"optimizer\", \"master\" or a group name from info.groups (hook "
                        "defined at " + bad_checkpoint + ":7)"));
  EXPECT_FALSE(std::filesystem::exists(root + "/step-00000005"));
  EXPECT_FALSE(std::filesystem::exists(root + "/step-00000005.incomplete"));
  ASSERT_NO_FATAL_FAILURE(StepBothAndCompare(2));

  for (const std::string& after_load :
       {std::string("function M.after_load(event, ctx)\n  error('refusing ' .. event.kind)\nend\n"),
        std::string("function M.after_load(event, ctx)\n  return { sync = { 'g0', 'g9' } }\nend\n"),
        std::string("function M.after_load(event, ctx)\n  while true do end\nend\n")}) {
    const std::string path = tmp_.Write("bad_after_load.lua", place_ok + after_load + "return M\n");
    ASSERT_OK(engine_->ReloadPolicy(path, {}));
    absl::Status load = engine_->LoadCheckpoint(root);
    ASSERT_FALSE(load.ok());
    EXPECT_THAT(std::string(load.message()), HasSubstr("bad_after_load.lua"));
    EXPECT_THAT(std::string(load.message()), HasSubstr("after_load(): "));
    // Nothing was loaded: the params are still those of step 5, not of the checkpoint (step 3).
    ASSERT_NO_FATAL_FAILURE(StepBothAndCompare(1));
  }
  ASSERT_OK(engine_->VerifyMasters());
}

TEST_F(PolicyEngineTest, FailingPlaceLeavesFinalizeRetryable) {
  Model m(device_.get(), kSizes, 5);
  // place() fails on its first call only (the count lives in an upvalue).
  const std::string path = tmp_.Write("flaky.lua", R"lua(
local calls = 0
return { place = function(groups, ctx)
  calls = calls + 1
  if calls == 1 then error("not yet") end
  local out = {}
  for _, g in ipairs(groups) do out[g.name] = g.numel >= 300 and "cpu" or "gpu" end
  return out
end }
)lua");
  auto e = MakeEngine(path, {});
  ASSERT_NE(e, nullptr);
  ASSERT_OK(m.Register(*e));
  absl::Status first = e->Finalize();
  ASSERT_FALSE(first.ok());
  EXPECT_THAT(std::string(first.message()), HasSubstr("flaky.lua:5: not yet"));
  EXPECT_EQ(e->Stats().pinned_bytes, 0u);
  EXPECT_FALSE(e->Step().ok());  // not finalized
  ASSERT_OK(e->Finalize());
  EXPECT_EQ(Offloaded(*e), (std::vector<bool>{true, false, true, false}));
  m.SetGrads(3);
  ASSERT_OK(e->Step());
  ASSERT_OK(e->VerifyMasters());

  // A policy broken at load time fails Engine::Create, naming the file and line.
  EngineOptions o;
  o.policy_path = tmp_.Write("escape_top.lua", "local x = os.getenv('HOME')\nreturn {}\n");
  o.device = std::string(BackendName(device_->backend()));
  absl::StatusOr<std::unique_ptr<Engine>> broken = Engine::Create(o);
  ASSERT_FALSE(broken.ok());
  EXPECT_THAT(std::string(broken.status().message()),
              HasSubstr("escape_top.lua:1: 'os.getenv' is not available in the policy sandbox"));
}

// ---- shipped policies through the engine ----------------------------------------------------------

TEST_F(PolicyEngineTest, MemoryBudgetOffloadsTheLastGroupsUntilTheStateFits) {
  Model m(device_.get(), kSizes, 9);
  // 12 B per element: 16164 B in all; 9000 B available: walked from the end, g3 (7 elements) and g2
  // (1000) go, leaving 4080; g3's 84 B fit back.
  auto e = MakeEngine(Policies() + "memory_budget.lua", {{"budget", "9000"}, {"reserve", "0"}});
  ASSERT_NE(e, nullptr);
  ASSERT_OK(m.Register(*e));
  ASSERT_OK(e->Finalize());
  EXPECT_EQ(Offloaded(*e), (std::vector<bool>{false, false, true, false}));
  EXPECT_GE(e->Stats().gpu_state_bytes, (300 + 40 + 7) * 12u);
  // A tighter budget, hot-reloaded: g3, g2, then g1 (40) leave 3600; g3 fits back (3684).
  ASSERT_OK(e->ReloadPolicy(Policies() + "memory_budget.lua", {{"budget", "4000"}, {"reserve", "0"}}));
  EXPECT_EQ(Offloaded(*e), (std::vector<bool>{false, true, true, false}));
  // order=largest, the rule before: g2, then g0 (300).
  ASSERT_OK(e->ReloadPolicy(Policies() + "memory_budget.lua",
                            {{"budget", "4000"}, {"reserve", "0"}, {"order", "largest"}}));
  EXPECT_EQ(Offloaded(*e), (std::vector<bool>{true, false, true, false}));
  absl::Status bad = e->ReloadPolicy(Policies() + "memory_budget.lua", {{"budget", "lots"}});
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.message()), HasSubstr("args.budget must be a byte size"));
  EXPECT_EQ(Offloaded(*e), (std::vector<bool>{true, false, true, false}));
}

TEST_F(PolicyEngineTest, SkipOptimizerOnSaveWritesModelOnlyAndResumesWithFreshAdam) {
  Model a(device_.get(), kSizes, 21);
  auto e = MakeEngine(Policies() + "skip_optimizer_on_save.lua", {{"fraction", "0.5"}});
  ASSERT_NE(e, nullptr);
  ASSERT_OK(a.Register(*e));
  ASSERT_OK(e->Finalize());
  for (int s = 0; s < 4; ++s) {
    a.SetGrads(40 + s);
    ASSERT_OK(e->Step());
  }
  absl::StatusOr<std::string> dir = e->SaveCheckpoint(tmp_.path() + "/lean", 4);
  ASSERT_TRUE(dir.ok()) << dir.status();
  absl::StatusOr<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::Open(*dir);
  ASSERT_TRUE(reader.ok()) << reader.status();
  ASSERT_EQ((*reader)->tensors().size(), kSizes.size());  // the params only
  for (const TensorEntry& t : (*reader)->tensors()) EXPECT_EQ(t.kind, "model") << t.name;
  std::vector<std::string> skipped;
  for (const SkipRecord& r : (*reader)->skipped()) skipped.push_back(r.what);
  EXPECT_EQ(skipped, (std::vector<std::string>{"optimizer", "master"}));

  // A fresh engine over other weights loads it: masters re-synced, Adam from step 0.
  Model b(device_.get(), kSizes, 22);
  auto resumed = MakeEngine(Policies() + "skip_optimizer_on_save.lua", {{"fraction", "0.5"}});
  ASSERT_NE(resumed, nullptr);
  ASSERT_OK(b.Register(*resumed));
  ASSERT_OK(resumed->Finalize());
  ASSERT_OK(resumed->LoadCheckpoint(*dir));
  ASSERT_OK(resumed->VerifyMasters());
  EXPECT_EQ(resumed->Stats().step, 0);
  EXPECT_EQ(b.Params(), a.Params());
  // From here it trains exactly like an engine that started from these weights.
  Model c(device_.get(), kSizes, 22);
  auto fresh = MakeEngine(Policies() + "all_gpu.lua", {});
  ASSERT_NE(fresh, nullptr);
  ASSERT_OK(c.Register(*fresh));
  ASSERT_OK(fresh->Finalize());
  ASSERT_OK(fresh->LoadCheckpoint(*dir));  // default after_load: the same sync and reset
  for (int s = 0; s < 3; ++s) {
    b.SetGrads(90 + s);
    c.SetGrads(90 + s);
    ASSERT_OK(resumed->Step());
    ASSERT_OK(fresh->Step());
  }
  ASSERT_OK(resumed->Synchronize());
  ASSERT_OK(fresh->Synchronize());
  EXPECT_EQ(b.Params(), c.Params());
}

TEST_F(PolicyEngineTest, SyncAfterLoadResyncsEveryMasterAfterAModelOnlyLoad) {
  // Write a model-only checkpoint, then load it into an engine run by sync_after_load.
  Model a(device_.get(), kSizes, 31);
  auto writer = MakeEngine(Policies() + "skip_optimizer_on_save.lua", {{"always", "true"}});
  ASSERT_NE(writer, nullptr);
  ASSERT_OK(a.Register(*writer));
  ASSERT_OK(writer->Finalize());
  a.SetGrads(1);
  ASSERT_OK(writer->Step());
  absl::StatusOr<std::string> dir = writer->SaveCheckpoint(tmp_.path() + "/m", 1);
  ASSERT_TRUE(dir.ok()) << dir.status();

  Model b(device_.get(), kSizes, 32);
  auto e = MakeEngine(Policies() + "sync_after_load.lua", {{"fraction", "1"}});
  ASSERT_NE(e, nullptr);
  ASSERT_OK(b.Register(*e));
  ASSERT_OK(e->Finalize());
  EXPECT_EQ(Offloaded(*e), (std::vector<bool>{true, true, true, true}));
  b.SetGrads(2);
  ASSERT_OK(e->Step());
  ASSERT_OK(e->LoadCheckpoint(*dir));
  ASSERT_OK(e->VerifyMasters());  // every CPU master re-synced from the loaded params
  EXPECT_EQ(e->Stats().step, 0);  // reset_optimizer "auto": the optimizer was not loaded
  EXPECT_EQ(b.Params(), a.Params());

  // A full checkpoint needs no sync: resuming from it with sync_after_load continues exactly like
  // the writer (a sync would round the masters to bf16 and the runs would part).
  Model w(device_.get(), kSizes, 34), r(device_.get(), kSizes, 35);
  auto full_writer = MakeEngine(Policies() + "offload_fraction.lua", {});
  auto full_reader = MakeEngine(Policies() + "sync_after_load.lua", {});
  ASSERT_NE(full_writer, nullptr);
  ASSERT_NE(full_reader, nullptr);
  ASSERT_OK(w.Register(*full_writer));
  ASSERT_OK(r.Register(*full_reader));
  ASSERT_OK(full_writer->Finalize());
  ASSERT_OK(full_reader->Finalize());
  for (int s = 0; s < 3; ++s) {
    w.SetGrads(60 + s);
    ASSERT_OK(full_writer->Step());
  }
  absl::StatusOr<std::string> full = full_writer->SaveCheckpoint(tmp_.path() + "/full", 3);
  ASSERT_TRUE(full.ok()) << full.status();
  ASSERT_OK(full_reader->LoadCheckpoint(*full));
  EXPECT_EQ(full_reader->Stats().step, 3);
  for (int s = 0; s < 5; ++s) {
    w.SetGrads(70 + s);
    r.SetGrads(70 + s);
    ASSERT_OK(full_writer->Step());
    ASSERT_OK(full_reader->Step());
  }
  ASSERT_OK(full_writer->Synchronize());
  ASSERT_OK(full_reader->Synchronize());
  EXPECT_EQ(r.Params(), w.Params());
}

}  // namespace
}  // namespace ferry
