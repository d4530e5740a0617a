// End-to-end tests of the engine facade on whatever device CreateDevice picks (the host backend on a
// machine without a GPU, CUDA on the GPU machine): placement by a Lua policy, bit-identical CPU and GPU
// placements, bad input, stale masters, checkpoints and their corruption.
#include "ferry/engine.h"

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ckpt/checkpoint.h"
#include "device/device.h"
#include "gmock/gmock.h"
#include "engine/engine_test_util.h"
#include "gtest/gtest.h"

namespace ferry {
namespace {

using ::testing::HasSubstr;

using namespace ::ferry::engine_test;  // NOLINT

class EngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Device>> d = CreateDevice();
    ASSERT_TRUE(d.ok()) << d.status();
    device_ = *std::move(d);
  }
  std::unique_ptr<Engine> MakeEngine(const std::string& policy, std::map<std::string, std::string> args = {},
                                     size_t chunk_bytes = 8 << 20) {
    EngineOptions o;
    o.policy_path = policy;
    o.policy_args = std::move(args);
    o.optimizer.lr = 1e-2f;
    o.optimizer.weight_decay = 0.01f;
    o.transfer_chunk_bytes = chunk_bytes;
    o.device = std::string(BackendName(device_->backend()));
    absl::StatusOr<std::unique_ptr<Engine>> e = Engine::Create(o);
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? *std::move(e) : nullptr;
  }
  std::unique_ptr<Device> device_;
  TempDir tmp_{"ferry-engine"};
};

const std::vector<int64_t> kSizes = {1, 7, 1000, 4099, 65, 3, 20000, 513};

TEST_F(EngineTest, PolicyPlacesHalfTheGroupsOnTheCpu) {
  Model m(device_.get(), kSizes, 1);
  auto e = MakeEngine(Policies() + "offload_fraction.lua", {{"fraction", "0.5"}});
  ASSERT_OK(m.Register(*e, 4));
  ASSERT_OK(e->Finalize());
  int64_t cpu = 0, total = 0;
  for (const GroupPlacement& g : e->Placement()) {
    total += g.numel;
    if (g.offloaded) cpu += g.numel;
  }
  EXPECT_GT(cpu, 0);
  EXPECT_LE(cpu, total / 2);
  EXPECT_GT(e->Stats().pinned_bytes, 0u);
  ASSERT_OK(e->VerifyMasters());
}

// The same model stepped with every group offloaded and with every group on the device gives
// bit-identical params, masters and moments: both paths run base/adam_math.h with the same FMAs.
TEST_F(EngineTest, CpuAndGpuPlacementsAreBitIdentical) {
  Model a(device_.get(), kSizes, 7), b(device_.get(), kSizes, 7);
  // A small chunk size so the pipeline runs many chunks, with tensors straddling them.
  auto cpu = MakeEngine(Policies() + "offload_all.lua", {}, 4096);
  auto gpu = MakeEngine(Policies() + "all_gpu.lua");
  ASSERT_OK(a.Register(*cpu, 3));
  ASSERT_OK(b.Register(*gpu, 3));
  ASSERT_OK(cpu->Finalize());
  ASSERT_OK(gpu->Finalize());
  for (const GroupPlacement& g : cpu->Placement()) EXPECT_TRUE(g.offloaded) << g.group;
  for (const GroupPlacement& g : gpu->Placement()) EXPECT_FALSE(g.offloaded) << g.group;
  for (int step = 0; step < 100; ++step) {
    a.SetGrads(1000 + step);
    b.SetGrads(1000 + step);
    ASSERT_OK(cpu->Step({.lr = 1e-2f * (1.0f + 0.01f * static_cast<float>(step))}));
    ASSERT_OK(gpu->Step({.lr = 1e-2f * (1.0f + 0.01f * static_cast<float>(step))}));
  }
  ASSERT_OK(cpu->Synchronize());
  ASSERT_OK(gpu->Synchronize());
  std::vector<uint16_t> before = a.Param(2);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a.Param(i), b.Param(i)) << "param " << i;
  // The params moved: the test would notice a step that did nothing.
  Model init(device_.get(), kSizes, 7);
  EXPECT_NE(init.Param(2), before);
  // Masters and moments, through checkpoints.
  absl::StatusOr<std::string> da = cpu->SaveCheckpoint(tmp_.path() + "/cpu", 100);
  absl::StatusOr<std::string> db = gpu->SaveCheckpoint(tmp_.path() + "/gpu", 100);
  ASSERT_TRUE(da.ok()) << da.status();
  ASSERT_TRUE(db.ok()) << db.status();
  auto ra = CheckpointReader::Open(*da);
  auto rb = CheckpointReader::Open(*db);
  ASSERT_TRUE(ra.ok() && rb.ok());
  ASSERT_EQ((*ra)->tensors().size(), a.size() * 4);
  for (const TensorEntry& t : (*ra)->tensors()) {
    std::vector<char> x(t.bytes), y(t.bytes);
    ASSERT_OK((*ra)->ReadTensor(t.name, x.data(), x.size()));
    ASSERT_OK((*rb)->ReadTensor(t.name, y.data(), y.size()));
    EXPECT_EQ(0, std::memcmp(x.data(), y.data(), x.size())) << t.name;
  }
  ASSERT_OK(cpu->VerifyMasters());
  ASSERT_OK(gpu->VerifyMasters());
}

TEST_F(EngineTest, BadParamsAreRefusedAndChangeNothing) {
  Model m(device_.get(), {10, 20}, 3);
  auto e = MakeEngine("");
  ASSERT_OK(m.Register(*e, 2));
  DeviceBuffer buf = *device_->Allocate(64);
  ParamSpec ok{.name = "x", .group = "g", .shape = {4}, .dtype = DType::kBF16, .param = buf.data(), .grad = buf.data()};
  auto expect_error = [&](ParamSpec s, absl::StatusCode code, const std::string& text) {
    absl::Status st = e->AddParam(s);
    EXPECT_EQ(st.code(), code) << st;
    EXPECT_THAT(std::string(st.message()), HasSubstr(text));
  };
  ParamSpec dup = ok;
  dup.name = "p0";
  expect_error(dup, absl::StatusCode::kAlreadyExists, "p0");
  ParamSpec null_param = ok;
  null_param.param = nullptr;
  expect_error(null_param, absl::StatusCode::kInvalidArgument, "param pointer is null");
  ParamSpec null_grad = ok;
  null_grad.grad = nullptr;
  expect_error(null_grad, absl::StatusCode::kInvalidArgument, "grad pointer is null");
  ParamSpec zero = ok;
  zero.shape = {4, 0};
  expect_error(zero, absl::StatusCode::kInvalidArgument, "dimension 1 is 0");
  ParamSpec empty_shape = ok;
  empty_shape.shape = {};
  expect_error(empty_shape, absl::StatusCode::kInvalidArgument, "shape is empty");
  ParamSpec colon = ok;
  colon.name = "a:b";
  expect_error(colon, absl::StatusCode::kInvalidArgument, "':'");
  ParamSpec unnamed = ok;
  unnamed.name = "";
  expect_error(unnamed, absl::StatusCode::kInvalidArgument, "empty");
  ParamSpec mixed = ok;
  mixed.group = "g0";
  mixed.dtype = DType::kF32;
  expect_error(mixed, absl::StatusCode::kInvalidArgument, "group 'g0'");
  ASSERT_OK(e->Finalize());
  EXPECT_EQ(e->Placement().size(), 2u);  // nothing of the refused params got in
  expect_error(ok, absl::StatusCode::kFailedPrecondition, "finalized");
  EXPECT_EQ(e->Finalize().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(EngineTest, StepBeforeFinalizeIsRefused) {
  auto e = MakeEngine("");
  absl::Status s = e->Step();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_EQ(e->Finalize().code(), absl::StatusCode::kFailedPrecondition);  // no params
}

// Each broken policy yields a Status naming the file (and line / hook / field); the engine stays
// unfinalized, with nothing allocated.
TEST_F(EngineTest, BrokenPoliciesAreReported) {
  struct Case {
    std::string name, source, expect1, expect2;
  };
  std::vector<Case> cases = {
      {"runtime.lua", "return {\n place = function(groups, ctx)\n  local x = nil\n  return x.y\n end }\n",
       "runtime.lua:4", "place"},
      {"wrongtype.lua", "return { place = function() return 42 end }", "wrongtype.lua", "place"},
      {"unknown_group.lua", "return { place = function() return { g0 = 'cpu', g1 = 'gpu', nope = 'cpu' } end }",
       "unknown_group.lua", "nope"},
      {"unknown_placement.lua", "return { place = function() return { g0 = 'disk', g1 = 'gpu' } end }",
       "unknown_placement.lua", "disk"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    Model m(device_.get(), {10, 20}, 3);
    auto e = MakeEngine(tmp_.Write(c.name, c.source));
    ASSERT_NE(e, nullptr);
    ASSERT_OK(m.Register(*e, 2));
    absl::Status s = e->Finalize();
    ASSERT_FALSE(s.ok());
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.expect1));
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.expect2));
    EXPECT_EQ(e->Stats().pinned_bytes, 0u);
    EXPECT_EQ(e->Step().code(), absl::StatusCode::kFailedPrecondition);
  }
  // A syntax error is caught when the engine is created, naming file:line.
  EngineOptions o;
  o.policy_path = tmp_.Write("syntax.lua", "return {\n place = function(\n");
  absl::StatusOr<std::unique_ptr<Engine>> e = Engine::Create(o);
  ASSERT_FALSE(e.ok());
  EXPECT_THAT(std::string(e.status().message()), HasSubstr("syntax.lua:"));
}

// The stale-master scenario: the trainer loads weights by itself; the masters still hold the old
// values. VerifyMasters catches it; SyncFromModel fixes it, and the next step starts from the loaded
// weights.
TEST_F(EngineTest, StaleMastersAreCaughtAndSynced) {
  Model m(device_.get(), kSizes, 11);
  auto e = MakeEngine(Policies() + "offload_fraction.lua", {{"fraction", "0.5"}});
  ASSERT_OK(m.Register(*e, 4));
  ASSERT_OK(e->Finalize());
  for (int s = 0; s < 3; ++s) {
    m.SetGrads(50 + s);
    ASSERT_OK(e->Step());
  }
  ASSERT_OK(e->VerifyMasters());
  Model loaded(device_.get(), kSizes, 99);  // "weights from elsewhere"
  for (size_t i = 0; i < m.size(); ++i) m.SetParam(i, loaded.Param(i));
  absl::Status s = e->VerifyMasters();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("stale master"));
  ASSERT_OK(e->SyncFromModel({}, /*reset_optimizer=*/true));
  ASSERT_OK(e->VerifyMasters());
  // One step from the loaded weights equals one step of a fresh engine built on them.
  auto fresh = MakeEngine(Policies() + "offload_fraction.lua", {{"fraction", "0.5"}});
  ASSERT_OK(loaded.Register(*fresh, 4));
  ASSERT_OK(fresh->Finalize());
  m.SetGrads(77);
  loaded.SetGrads(77);
  ASSERT_OK(e->Step());
  ASSERT_OK(fresh->Step());
  ASSERT_OK(e->Synchronize());
  ASSERT_OK(fresh->Synchronize());
  for (size_t i = 0; i < m.size(); ++i) EXPECT_EQ(m.Param(i), loaded.Param(i)) << i;
}

// Save, keep training; a fresh engine loads the checkpoint and repeats the same steps bit for bit.
TEST_F(EngineTest, CheckpointResumeIsBitIdentical) {
  Model m(device_.get(), kSizes, 21);
  auto e = MakeEngine(Policies() + "offload_fraction.lua", {{"fraction", "0.5"}}, 8192);
  ASSERT_OK(m.Register(*e, 4));
  ASSERT_OK(e->Finalize());
  for (int s = 0; s < 5; ++s) {
    m.SetGrads(300 + s);
    ASSERT_OK(e->Step());
  }
  absl::StatusOr<std::string> dir = e->SaveCheckpoint(tmp_.path() + "/run", 5);
  ASSERT_TRUE(dir.ok()) << dir.status();
  for (int s = 5; s < 10; ++s) {
    m.SetGrads(300 + s);
    ASSERT_OK(e->Step());
  }
  ASSERT_OK(e->Synchronize());
  Model r(device_.get(), kSizes, 999);
  auto resumed = MakeEngine(Policies() + "offload_fraction.lua", {{"fraction", "0.5"}}, 8192);
  ASSERT_OK(r.Register(*resumed, 4));
  ASSERT_OK(resumed->Finalize());
  ASSERT_OK(resumed->LoadCheckpoint(tmp_.path() + "/run"));  // the root: follows `latest`
  ASSERT_OK(resumed->VerifyMasters());
  EXPECT_EQ(resumed->Stats().step, 5);
  for (int s = 5; s < 10; ++s) {
    r.SetGrads(300 + s);
    ASSERT_OK(resumed->Step());
  }
  ASSERT_OK(resumed->Synchronize());
  for (size_t i = 0; i < m.size(); ++i) EXPECT_EQ(m.Param(i), r.Param(i)) << i;
}

// A checkpoint with one flipped byte, or a truncated file, is refused naming the file and the tensor;
// the engine's params are unchanged.
TEST_F(EngineTest, CorruptCheckpointsAreRefused) {
  Model m(device_.get(), kSizes, 31);
  auto e = MakeEngine(Policies() + "offload_fraction.lua", {{"fraction", "0.5"}});
  ASSERT_OK(m.Register(*e, 4));
  ASSERT_OK(e->Finalize());
  m.SetGrads(1);
  ASSERT_OK(e->Step());
  absl::StatusOr<std::string> dir = e->SaveCheckpoint(tmp_.path() + "/c", 1);
  ASSERT_TRUE(dir.ok()) << dir.status();
  const std::string file = *dir + "/rank-00000.safetensors";
  auto reader = CheckpointReader::Open(*dir);
  ASSERT_TRUE(reader.ok());
  const TensorEntry* victim = (*reader)->Find("p6:exp_avg");
  ASSERT_NE(victim, nullptr);
  const size_t victim_offset = victim->file_offset + victim->bytes / 2;
  reader->reset();

  m.SetGrads(2);
  ASSERT_OK(e->Step());
  ASSERT_OK(e->Synchronize());
  std::vector<std::vector<uint16_t>> before;
  for (size_t i = 0; i < m.size(); ++i) before.push_back(m.Param(i));

  std::string original;
  {
    std::ifstream in(file, std::ios::binary);
    original.assign(std::istreambuf_iterator<char>(in), {});
  }
  std::string flipped = original;
  flipped[victim_offset] = static_cast<char>(flipped[victim_offset] ^ 0x10);
  std::ofstream(file, std::ios::binary | std::ios::trunc) << flipped;
  absl::Status s = e->LoadCheckpoint(*dir);
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()), HasSubstr("rank-00000.safetensors"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("p6:exp_avg"));
  for (size_t i = 0; i < m.size(); ++i) EXPECT_EQ(m.Param(i), before[i]) << i;

  std::ofstream(file, std::ios::binary | std::ios::trunc) << original.substr(0, original.size() - 100);
  s = e->LoadCheckpoint(*dir);
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()), HasSubstr("rank-00000.safetensors"));
  for (size_t i = 0; i < m.size(); ++i) EXPECT_EQ(m.Param(i), before[i]) << i;
  ASSERT_OK(e->VerifyMasters());
}


// Hot reload: a new policy moves groups between pinned host memory and the device between steps; the
// continued run is bit-identical to one that never moved. A broken policy leaves the old one in force.
TEST_F(EngineTest, ReloadPolicyMovesStateWithoutChangingValues) {
  Model a(device_.get(), kSizes, 41), b(device_.get(), kSizes, 41);
  auto moving = MakeEngine(Policies() + "offload_fraction.lua", {{"fraction", "0.5"}}, 4096);
  auto still = MakeEngine(Policies() + "offload_fraction.lua", {{"fraction", "0.5"}}, 4096);
  ASSERT_OK(a.Register(*moving, 4));
  ASSERT_OK(b.Register(*still, 4));
  ASSERT_OK(moving->Finalize());
  ASSERT_OK(still->Finalize());
  auto step_both = [&](int seed) {
    a.SetGrads(seed);
    b.SetGrads(seed);
    ASSERT_OK(moving->Step());
    ASSERT_OK(still->Step());
  };
  for (int s = 0; s < 4; ++s) step_both(500 + s);
  ASSERT_OK(moving->ReloadPolicy(Policies() + "offload_all.lua", {}));
  for (const GroupPlacement& g : moving->Placement()) EXPECT_TRUE(g.offloaded) << g.group;
  for (int s = 4; s < 8; ++s) step_both(500 + s);
  ASSERT_OK(moving->ReloadPolicy(Policies() + "all_gpu.lua", {}));
  for (const GroupPlacement& g : moving->Placement()) EXPECT_FALSE(g.offloaded) << g.group;
  for (int s = 8; s < 12; ++s) step_both(500 + s);
  // A policy that fails changes nothing.
  absl::Status bad = moving->ReloadPolicy(tmp_.Write("bad.lua", "return { place = function() error('no') end }"), {});
  EXPECT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.message()), HasSubstr("bad.lua"));
  for (const GroupPlacement& g : moving->Placement()) EXPECT_FALSE(g.offloaded) << g.group;
  for (int s = 12; s < 14; ++s) step_both(500 + s);
  ASSERT_OK(moving->Synchronize());
  ASSERT_OK(still->Synchronize());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a.Param(i), b.Param(i)) << i;
  ASSERT_OK(moving->VerifyMasters());
  EXPECT_EQ(moving->Stats().step, 14);
}

// The offload pipeline with one chunk, exactly two, a ragged last chunk and many chunks (tensors
// straddling chunk boundaries, more chunks than staging slots) gives the same bits as the device path.
TEST_F(EngineTest, PipelineChunkingDoesNotChangeResults) {
  int64_t grad_bytes = 0;
  for (int64_t n : kSizes) grad_bytes += 2 * n;
  Model ref_model(device_.get(), kSizes, 61);
  auto ref = MakeEngine(Policies() + "all_gpu.lua");
  ASSERT_OK(ref_model.Register(*ref, 3));
  ASSERT_OK(ref->Finalize());
  for (int s = 0; s < 20; ++s) {
    ref_model.SetGrads(700 + s);
    ASSERT_OK(ref->Step());
  }
  ASSERT_OK(ref->Synchronize());
  for (size_t chunk : {size_t{1} << 20, static_cast<size_t>(grad_bytes / 2), size_t{20000}, size_t{1024}}) {
    SCOPED_TRACE(absl::StrCat("chunk bytes ", chunk));
    Model m(device_.get(), kSizes, 61);
    auto e = MakeEngine(Policies() + "offload_all.lua", {}, chunk);
    ASSERT_OK(m.Register(*e, 3));
    ASSERT_OK(e->Finalize());
    for (int s = 0; s < 20; ++s) {
      m.SetGrads(700 + s);
      ASSERT_OK(e->Step());
    }
    ASSERT_OK(e->Synchronize());
    for (size_t i = 0; i < m.size(); ++i) EXPECT_EQ(m.Param(i), ref_model.Param(i)) << i;
    ASSERT_OK(e->VerifyMasters());
  }
}

// on_step moves a group to the CPU after step 3 and back after step 6; the run stays bit-identical to
// one that never moved, and a failing on_step reports that the step was applied.
TEST_F(EngineTest, OnStepMovesGroupsBetweenSteps) {
  const std::string mover = tmp_.Write("mover.lua", R"(
return {
  place = function(groups, ctx)
    local out = { numa = "interleave" }  -- kept by the moves below
    for _, g in ipairs(groups) do out[g.name] = "gpu" end
    return out
  end,
  on_step = function(stats, ctx)
    if stats.step == 3 then return { move = { g0 = "cpu", g2 = "cpu" } } end
    if stats.step == 6 then return { move = { g0 = "gpu" } } end
    if stats.step == 8 then error("on_step gave up") end
    return nil
  end,
})");
  Model a(device_.get(), kSizes, 81), b(device_.get(), kSizes, 81);
  auto moving = MakeEngine(mover, {}, 4096);
  auto still = MakeEngine(Policies() + "all_gpu.lua");
  ASSERT_OK(a.Register(*moving, 4));
  ASSERT_OK(b.Register(*still, 4));
  ASSERT_OK(moving->Finalize());
  ASSERT_OK(still->Finalize());
  auto offloaded = [&](const std::string& group) {
    for (const GroupPlacement& g : moving->Placement()) {
      if (g.group == group) return g.offloaded;
    }
    return false;
  };
  for (int s = 1; s <= 9; ++s) {
    a.SetGrads(900 + s);
    b.SetGrads(900 + s);
    absl::Status st = moving->Step();
    if (s == 8) {
      EXPECT_FALSE(st.ok());
      EXPECT_THAT(std::string(st.message()), HasSubstr("the step was applied"));
      EXPECT_THAT(std::string(st.message()), HasSubstr("on_step gave up"));
    } else {
      ASSERT_OK(st);
    }
    ASSERT_OK(still->Step());
    if (s == 3) {
      EXPECT_TRUE(offloaded("g0") && offloaded("g2") && !offloaded("g1"));
      EXPECT_EQ(moving->Stats().numa_policy, "interleave");  // the place() result's, not the default
    }
    if (s == 6) {
      EXPECT_TRUE(!offloaded("g0") && offloaded("g2"));
    }
  }
  ASSERT_OK(moving->Synchronize());
  ASSERT_OK(still->Synchronize());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a.Param(i), b.Param(i)) << i;
  ASSERT_OK(moving->VerifyMasters());
}

// No pinning, registration or host allocation of pinned memory on the hot path: after warm-up
// (Finalize, a first step, save and load) the counters stay flat across steps, saves and loads.
TEST_F(EngineTest, NoPinningAfterWarmUp) {
  Model m(device_.get(), kSizes, 91);
  auto e = MakeEngine(Policies() + "offload_fraction.lua", {{"fraction", "0.5"}}, 4096);
  ASSERT_OK(m.Register(*e, 4));
  ASSERT_OK(e->Finalize());
  m.SetGrads(1);
  ASSERT_OK(e->Step());
  absl::StatusOr<std::string> dir = e->SaveCheckpoint(tmp_.path() + "/warm", 1);
  ASSERT_TRUE(dir.ok()) << dir.status();
  ASSERT_OK(e->LoadCheckpoint(*dir));
  const EngineStats warm = e->Stats();
  EXPECT_GT(warm.pinned_host_calls, 0u);
  for (int s = 2; s <= 30; ++s) {
    m.SetGrads(s);
    ASSERT_OK(e->Step());
    if (s % 10 == 0) {
      absl::StatusOr<std::string> d = e->SaveCheckpoint(tmp_.path() + "/warm", s);
      ASSERT_TRUE(d.ok()) << d.status();
      ASSERT_OK(e->LoadCheckpoint(*d));
    }
  }
  const EngineStats after = e->Stats();
  EXPECT_EQ(after.pinned_host_calls, warm.pinned_host_calls);
  EXPECT_EQ(after.host_registrations, warm.host_registrations);
  EXPECT_EQ(after.step, 30);
}

// A NaN or Inf in any grad (of a CPU group or a GPU group) skips the step for every group: params,
// masters and moments unchanged, the skip reported; the run then continues exactly as one that never
// saw the bad step.
TEST_F(EngineTest, FoundInfSkipsTheWholeStep) {
  Model a(device_.get(), kSizes, 101), b(device_.get(), kSizes, 101);
  // From the start: g0 offloaded, g2 on the GPU (from the end both would stay on the GPU).
  auto e = MakeEngine(Policies() + "offload_fraction.lua", {{"fraction", "0.5"}, {"from", "start"}}, 4096);
  auto ref = MakeEngine(Policies() + "offload_fraction.lua", {{"fraction", "0.5"}, {"from", "start"}}, 4096);
  ASSERT_OK(a.Register(*e, 4));
  ASSERT_OK(b.Register(*ref, 4));
  ASSERT_OK(e->Finalize());
  ASSERT_OK(ref->Finalize());
  for (int s = 0; s < 3; ++s) {
    a.SetGrads(s);
    b.SetGrads(s);
    ASSERT_OK(e->Step());
    ASSERT_OK(ref->Step());
  }
  std::vector<bool> offloaded;
  for (const GroupPlacement& g : e->Placement()) offloaded.push_back(g.offloaded);
  // Tensor 0 is in group g0, tensor 2 in g2: one of them is offloaded and the other is not.
  ASSERT_NE(offloaded[0], offloaded[2]);
  for (size_t bad : {size_t{0}, size_t{2}}) {
    for (uint16_t poison : {uint16_t{0x7fc0}, uint16_t{0xff80}}) {  // NaN, -Inf
      SCOPED_TRACE(absl::StrCat("bad tensor ", bad, " value ", poison));
      std::vector<std::vector<uint16_t>> before;
      for (size_t i = 0; i < a.size(); ++i) before.push_back(a.Param(i));
      a.SetGrads(77);
      a.PoisonGrad(bad, poison);
      ASSERT_OK(e->Step());
      EXPECT_TRUE(e->Stats().last_step_skipped);
      ASSERT_OK(e->Synchronize());
      for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a.Param(i), before[i]) << i;
      ASSERT_OK(e->VerifyMasters());
    }
  }
  EXPECT_EQ(e->Stats().skipped_steps, 4);
  EXPECT_EQ(e->Stats().step, 3);
  for (int s = 3; s < 6; ++s) {
    a.SetGrads(s);
    b.SetGrads(s);
    ASSERT_OK(e->Step());
    EXPECT_FALSE(e->Stats().last_step_skipped);
    ASSERT_OK(ref->Step());
  }
  ASSERT_OK(e->Synchronize());
  ASSERT_OK(ref->Synchronize());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a.Param(i), b.Param(i)) << i;
}

// The global grad norm equals a float64 reference over every group; a power-of-two loss scale on
// scaled grads gives exactly the unscaled run; clipping scales every group's grads by
// min(1, max_norm / (norm + 1e-6)) before the update (checked against a float64 first step).
TEST_F(EngineTest, LossScaleAndGlobalNormClipping) {
  auto make = [&](const std::string& policy) {
    EngineOptions o;
    o.policy_path = Policies() + policy;
    o.policy_args = {{"fraction", "0.5"}};
    o.optimizer.lr = 0.5f;
    o.optimizer.eps = 1.0f;  // makes the first step sensitive to the grads' scale
    o.device = std::string(BackendName(device_->backend()));
    o.transfer_chunk_bytes = 4096;
    absl::StatusOr<std::unique_ptr<Engine>> e = Engine::Create(o);
    EXPECT_TRUE(e.ok()) << e.status();
    return *std::move(e);
  };
  Model plain(device_.get(), kSizes, 111), scaled(device_.get(), kSizes, 111), clipped(device_.get(), kSizes, 111);
  auto e_plain = make("offload_fraction.lua"), e_scaled = make("offload_fraction.lua"), e_clip = make("offload_fraction.lua");
  ASSERT_OK(plain.Register(*e_plain, 4));
  ASSERT_OK(scaled.Register(*e_scaled, 4));
  ASSERT_OK(clipped.Register(*e_clip, 4));
  ASSERT_OK(e_plain->Finalize());
  ASSERT_OK(e_scaled->Finalize());
  ASSERT_OK(e_clip->Finalize());
  const std::vector<std::vector<uint16_t>> p0 = [&] {
    std::vector<std::vector<uint16_t>> v;
    for (size_t i = 0; i < plain.size(); ++i) v.push_back(plain.Param(i));
    return v;
  }();
  plain.SetGrads(5);
  clipped.SetGrads(5);
  scaled.SetGrads(5);
  scaled.ScaleGrads(1024.0f);  // exact in bf16
  double sum_sq = 0;
  std::vector<std::vector<uint16_t>> grads;
  for (size_t i = 0; i < plain.size(); ++i) {
    grads.push_back(plain.Grad(i));
    for (uint16_t g : grads.back()) sum_sq += static_cast<double>(BF16ToF32(g)) * BF16ToF32(g);
  }
  const double norm = std::sqrt(sum_sq);
  ASSERT_OK(e_plain->Step());
  EXPECT_NEAR(e_plain->Stats().last_grad_norm, norm, 1e-9 * norm);
  ASSERT_OK(e_scaled->Step({.loss_scale = 1024.0f}));
  EXPECT_NEAR(e_scaled->Stats().last_grad_norm, norm, 1e-9 * norm);
  const float max_norm = static_cast<float>(norm / 8);
  ASSERT_OK(e_clip->Step({.max_grad_norm = max_norm}));
  ASSERT_OK(e_plain->Synchronize());
  ASSERT_OK(e_scaled->Synchronize());
  ASSERT_OK(e_clip->Synchronize());
  const double coef = std::min(1.0, static_cast<double>(max_norm) / (norm + 1e-6));
  size_t differs = 0;
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_EQ(scaled.Param(i), plain.Param(i)) << i;
    const std::vector<uint16_t> got = clipped.Param(i), unclipped = plain.Param(i);
    for (size_t k = 0; k < got.size(); ++k) {
      // Step 1 of Adam with bias correction: m_hat = g', v_hat = g'^2, update = g' / (|g'| + eps).
      const double g = coef * BF16ToF32(grads[i][k]);
      const double p = BF16ToF32(p0[i][k]);
      const double want = p - 0.5 * g / (std::fabs(g) + 1.0);
      EXPECT_NEAR(BF16ToF32(got[k]), want, std::fabs(want) * (1.0 / 128) + 1e-6) << i << "[" << k << "]";
      differs += got[k] != unclipped[k];
    }
  }
  EXPECT_GT(differs, 1000u);  // clipping changed the result
  // Bad inputs are refused before anything runs.
  EXPECT_EQ(e_plain->Step({.loss_scale = 0.0f}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(e_plain->Step({.max_grad_norm = 1.0f, .check_finite = false}).code(), absl::StatusCode::kInvalidArgument);
}

// The stale-master scenario through a model-only checkpoint: loaded by a policy that does not sync,
// VerifyMasters reports the stale masters; loaded by sync_after_load, the next step starts from the
// loaded weights (equal to a fresh engine built on them and stepped once).
TEST_F(EngineTest, ModelOnlyLoadWithAndWithoutSync) {
  Model src(device_.get(), kSizes, 121);
  const std::string model_only = tmp_.Write("model_only.lua", R"(
return {
  place = function(groups, ctx) local out = {} for _, g in ipairs(groups) do out[g.name] = "cpu" end return out end,
  checkpoint = function(info, ctx) return { skip = { "optimizer", "master" } } end,
})");
  auto writer = MakeEngine(model_only);
  ASSERT_OK(src.Register(*writer, 4));
  ASSERT_OK(writer->Finalize());
  for (int s = 0; s < 3; ++s) {
    src.SetGrads(s);
    ASSERT_OK(writer->Step());
  }
  absl::StatusOr<std::string> dir = writer->SaveCheckpoint(tmp_.path() + "/model_only", 3);
  ASSERT_TRUE(dir.ok()) << dir.status();
  const std::string no_sync = tmp_.Write("no_sync.lua", R"(
return {
  place = function(groups, ctx) local out = {} for _, g in ipairs(groups) do out[g.name] = "cpu" end return out end,
  after_load = function(event, ctx) return { sync = "none", reset_optimizer = true } end,
})");
  {
    Model m(device_.get(), kSizes, 122);
    auto e = MakeEngine(no_sync);
    ASSERT_OK(m.Register(*e, 4));
    ASSERT_OK(e->Finalize());
    m.SetGrads(9);
    ASSERT_OK(e->Step());
    ASSERT_OK(e->LoadCheckpoint(*dir));
    absl::Status s = e->VerifyMasters();
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("stale master"));
  }
  Model m(device_.get(), kSizes, 123);
  auto e = MakeEngine(Policies() + "sync_after_load.lua", {{"fraction", "1"}});
  ASSERT_OK(m.Register(*e, 4));
  ASSERT_OK(e->Finalize());
  m.SetGrads(9);
  ASSERT_OK(e->Step());
  ASSERT_OK(e->LoadCheckpoint(*dir));
  ASSERT_OK(e->VerifyMasters());
  for (size_t i = 0; i < m.size(); ++i) EXPECT_EQ(m.Param(i), src.Param(i)) << i;
  // One step from the loaded weights equals one step of a fresh engine on them.
  Model fresh_model(device_.get(), kSizes, 124);
  for (size_t i = 0; i < m.size(); ++i) fresh_model.SetParam(i, src.Param(i));
  auto fresh = MakeEngine(Policies() + "sync_after_load.lua", {{"fraction", "1"}});
  ASSERT_OK(fresh_model.Register(*fresh, 4));
  ASSERT_OK(fresh->Finalize());
  m.SetGrads(10);
  fresh_model.SetGrads(10);
  ASSERT_OK(e->Step());
  ASSERT_OK(fresh->Step());
  ASSERT_OK(e->Synchronize());
  ASSERT_OK(fresh->Synchronize());
  for (size_t i = 0; i < m.size(); ++i) EXPECT_EQ(m.Param(i), fresh_model.Param(i)) << i;
}

// An fp32 param is its own master: the checkpoint stores it once (no NAME:master), says so in the
// manifest, and a load restores the master from the param; the resumed run is bit-identical.
TEST_F(EngineTest, Fp32MastersAreNotWrittenTwice) {
  const int64_t n = 3001;
  auto make_model = [&](uint64_t seed, std::vector<DeviceBuffer>& bufs) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> init(static_cast<size_t>(n));
    for (float& v : init) v = normal(rng);
    bufs.push_back(*device_->Allocate(n * 4));
    bufs.push_back(*device_->Allocate(n * 4));
    EXPECT_TRUE(device_->Copy(bufs[0].data(), init.data(), n * 4, CopyKind::kHostToDevice).ok());
  };
  auto set_grad = [&](DeviceBuffer& g, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = normal(rng);
    ASSERT_TRUE(device_->Copy(g.data(), v.data(), n * 4, CopyKind::kHostToDevice).ok());
  };
  auto read = [&](DeviceBuffer& b) {
    std::vector<float> v(static_cast<size_t>(n));
    EXPECT_TRUE(device_->Copy(v.data(), b.data(), n * 4, CopyKind::kDeviceToHost).ok());
    return v;
  };
  std::vector<DeviceBuffer> a, b;
  make_model(1, a);
  make_model(2, b);
  auto e = MakeEngine(Policies() + "offload_all.lua");
  auto r = MakeEngine(Policies() + "offload_all.lua");
  ASSERT_OK(e->AddParam({.name = "w", .shape = {n}, .dtype = DType::kF32, .param = a[0].data(), .grad = a[1].data()}));
  ASSERT_OK(r->AddParam({.name = "w", .shape = {n}, .dtype = DType::kF32, .param = b[0].data(), .grad = b[1].data()}));
  ASSERT_OK(e->Finalize());
  ASSERT_OK(r->Finalize());
  for (int s = 0; s < 3; ++s) {
    set_grad(a[1], s);
    ASSERT_OK(e->Step());
  }
  absl::StatusOr<std::string> dir = e->SaveCheckpoint(tmp_.path() + "/f32", 3);
  ASSERT_TRUE(dir.ok()) << dir.status();
  auto reader = CheckpointReader::Open(*dir);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ((*reader)->Find("w:master"), nullptr);
  EXPECT_NE((*reader)->Find("w:exp_avg"), nullptr);
  ASSERT_OK(r->LoadCheckpoint(*dir));
  ASSERT_OK(r->VerifyMasters());
  for (int s = 3; s < 6; ++s) {
    set_grad(a[1], s);
    set_grad(b[1], s);
    ASSERT_OK(e->Step());
    ASSERT_OK(r->Step());
  }
  ASSERT_OK(e->Synchronize());
  ASSERT_OK(r->Synchronize());
  const std::vector<float> x = read(a[0]), y = read(b[0]);
  EXPECT_EQ(0, std::memcmp(x.data(), y.data(), x.size() * 4));
}
}  // namespace
}  // namespace ferry
