// The order of the early thread's work around Step's keep, with spare state: what a decided Step
// queues interleaves with the speculation not started yet by the next forward's order; the params
// begun after Step kept the speculation run in place (and keep their side); a param begun goes down
// whole before the keep. Each bit-identical to Step alone, checked on the trace's `early.part_start`
// and the stats' out-of-place bytes. Step decides at once (no gradient check) once CPU Adam has
// begun: the orders are then certain, not a race with the check's pass over the grads.
#include <algorithm>
#include <chrono>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "device/device.h"
#include "engine/engine_test_util.h"
#include "ferry/engine.h"
#include "gtest/gtest.h"
#include "trace/trace_file.h"

namespace ferry::engine_test {
namespace {

// Under a spare-state budget, some groups speculate and the others update once Step knows the step.
// When CPU Adam is behind the backward, speculating parts are still waiting when Step queues the
// rest: all of it must then go in the order the next forward needs it, the speculating parts
// between the others by their announcement (EarlyPart::priority), not after every one of them. The
// early thread starts a part (trace: `early.part_start`) the highest priority first once Step's
// parts have joined, so from the first of them on, the priorities never rise. Step comes once CPU Adam
// has begun the speculation and decides at once (no gradient check). Bit-identical to Step alone.
TEST(SpareStateBudgetTest, WhatStepQueuesInterleavesWithTheSpeculationByTheForwardsOrder) {
  absl::StatusOr<std::unique_ptr<Device>> d = CreateDevice();
  ASSERT_TRUE(d.ok()) << d.status();
  Device* device = d->get();
  constexpr size_t kLayers = 12;  // a group each; SpareSpread gives the spare state to every other one
  const std::vector<int64_t> sizes(kLayers, 300000);  // 18 chunks each: more than the staging ring holds
  TempDir tmp("ferry-spare-order");
  const std::string trace_path = tmp.path() + "/trace.json";
  Model ref_model(device, sizes, 29), model(device, sizes, 29);
  constexpr int kSteps = 6;
  {
    auto make = [&](Model& m, double fraction, const std::string& trace) -> std::unique_ptr<Engine> {
      EngineOptions o;
      o.state_later = "off";  // the bytes counted below are whole updates'
      o.policy_path = Policies() + "offload_all.lua";
      o.transfer_chunk_bytes = 1 << 15;
      o.cpu_threads = 1;  // CPU Adam far behind the "backward", which announces at once
      o.spare_state_fraction = 0.5;
      o.device = std::string(BackendName(device->backend()));
      o.trace_path = trace;
      return MakeFinalizedEngine(o, [&](Engine& e) { return m.Register(e, kLayers); });
    };
    auto ref = make(ref_model, 1.0, "");
    auto e = make(model, 0.5, trace_path);
    ASSERT_TRUE(ref && e);
    for (int step = 1; step <= kSteps; ++step) {
      ref_model.SetGrads(90 + static_cast<uint64_t>(step));
      model.SetGrads(90 + static_cast<uint64_t>(step));
      // No gradient check: Step decides when it is called. With one it decided after the check's pass
      // over every grad, which the host backend's stream thread takes about as long to run as CPU Adam
      // the speculation here, so whether a speculating part still waited was a race.
      const StepOptions options{.lr = 1e-3f, .check_finite = false};
      const uint64_t before = e->Stats().cpu_adam_bytes;
      for (size_t k = kLayers; k-- > 0;) ASSERT_OK(e->GradsReadyParams({model.name(k)}, options));
      // CPU Adam has begun the speculation (a part or more started before Step), far from done.
      for (int i = 0; i < 20000 && e->Stats().cpu_adam_bytes == before; ++i) {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
      ASSERT_GT(e->Stats().cpu_adam_bytes, before) << "step " << step;
      StepOptions deferred = options;
      deferred.wait_for_params = false;
      ASSERT_OK(e->Step(deferred));
      ASSERT_OK(ref->Step(options));
      ASSERT_TRUE(ParamsMatchAfterStep(*e, model, ref_model, step));
    }
    const EngineStats stats = e->Stats();
    EXPECT_EQ(stats.deferred_steps, kSteps);
    EXPECT_GT(stats.early_groups_kept, 0);
    ASSERT_OK(e->VerifyMasters());
  }
  absl::StatusOr<TraceFile> trace = ReadTraceFile(trace_path);
  ASSERT_TRUE(trace.ok()) << trace.status();
  std::vector<const TraceFileEvent*> starts;
  for (const TraceFileEvent& ev : trace->events) {
    if (ev.name == "early.part_start") starts.push_back(&ev);
  }
  std::stable_sort(starts.begin(), starts.end(),
                   [](const TraceFileEvent* a, const TraceFileEvent* b) { return a->ts_us < b->ts_us; });
  // A step's parts are numbered from 0, and each starts once; every part of a step is done before the
  // next step's first starts: a step's starts run until a part number comes again.
  int steps_seen = 0, interleaved = 0;
  for (size_t i = 0; i < starts.size();) {
    size_t end = i;
    for (std::set<double> parts; end < starts.size() && parts.insert(starts[end]->args.at("part")).second;) ++end;
    ++steps_seen;
    bool rest = false, spec_after_rest = false;
    for (size_t j = i; j < end; ++j) {
      const TraceFileEvent& now = *starts[j];
      const bool kept = now.args.at("kept") != 0;  // a speculating part started after Step kept it
      if (rest) {
        const TraceFileEvent& before = *starts[j - 1];
        EXPECT_LE(now.args.at("priority"), before.args.at("priority"))
            << "step " << steps_seen << ": part " << now.args.at("part") << " (priority " << now.args.at("priority")
            << (kept ? ", speculating" : ", Step's") << ") started after part " << before.args.at("part")
            << " (priority " << before.args.at("priority") << "), once Step's parts had joined: the next forward "
            << "needs it first";
        // Step queues its parts after keeping the speculation: what speculates from then on runs in place.
        EXPECT_NE(now.args.at("in_place"), 0) << "step " << steps_seen << ", part " << now.args.at("part");
        spec_after_rest = spec_after_rest || kept;
      }
      rest = rest || (now.args.at("in_place") != 0 && !kept);
    }
    interleaved += spec_after_rest ? 1 : 0;
    i = end;
  }
  EXPECT_EQ(steps_seen, kSteps);
  // The case this is about happened: a speculating part started after Step's first part.
  EXPECT_GT(interleaved, 0) << "CPU Adam finished every speculation before Step in every step";
}

// Once Step has kept a speculation (its scalars are the step's own), the params the early thread has
// not begun yet run in place, faster than into the spare buffers; they keep their side at the commit
// while the others take the spare one, so that a group, and a part, may end with its params on both
// sides. With the whole spare state, CPU Adam far behind the announcements and Step at once (deferred
// or waiting, in turn), a group per tensor announced one by one, or one group announced three tensors
// at a time (parts begun before Step whose later params begin after it): bit-identical to Step alone,
// the same checkpoint, part of the bytes in place (trace: `early.part_start` with `kept`).
class KeptInPlaceTest : public ::testing::TestWithParam<size_t> {};

TEST_P(KeptInPlaceTest, ParamsBegunAfterAKeptStepRunInPlace) {
  const size_t per_part = GetParam();  // tensors per announcement; 1: a group per tensor, else one group
  absl::StatusOr<std::unique_ptr<Device>> d = CreateDevice();
  ASSERT_TRUE(d.ok()) << d.status();
  Device* device = d->get();
  constexpr size_t kLayers = 12;
  const std::vector<int64_t> sizes(kLayers, 300000);
  TempDir tmp("ferry-kept-in-place");
  const std::string trace_path = tmp.path() + "/trace.json";
  Model ref_model(device, sizes, 31), model(device, sizes, 31);
  constexpr int kSteps = 6;
  {
    EngineOptions o;
    o.state_later = "off";  // the bytes counted below are whole updates'
    o.policy_path = Policies() + "offload_all.lua";
    o.transfer_chunk_bytes = 1 << 15;
    o.cpu_threads = 1;
    o.device = std::string(BackendName(device->backend()));
    const size_t groups = per_part == 1 ? kLayers : 1;
    auto ref = MakeFinalizedEngine(o, [&](Engine& e) { return ref_model.Register(e, groups); });
    o.trace_path = trace_path;
    auto e = MakeFinalizedEngine(o, [&](Engine& x) { return model.Register(x, groups); });
    ASSERT_TRUE(ref && e);
    for (int step = 1; step <= kSteps; ++step) {
      ref_model.SetGrads(70 + static_cast<uint64_t>(step));
      model.SetGrads(70 + static_cast<uint64_t>(step));
      // Step decides when called (no gradient check: with one, whether every part began before it was a
      // race with the check's pass), once CPU Adam has begun the speculation.
      const StepOptions options{.lr = 1e-3f, .check_finite = false};
      const uint64_t before = e->Stats().cpu_adam_bytes;
      for (size_t k = kLayers; k >= per_part; k -= per_part) {
        std::vector<std::string> names;
        for (size_t i = k - per_part; i < k; ++i) names.push_back(model.name(i));
        ASSERT_OK(e->GradsReadyParams(names, options));
      }
      for (int i = 0; i < 20000 && e->Stats().cpu_adam_bytes == before; ++i) {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
      ASSERT_GT(e->Stats().cpu_adam_bytes, before) << "step " << step;
      StepOptions mine = options;
      mine.wait_for_params = step % 2 == 0;
      ASSERT_OK(e->Step(mine));
      ASSERT_OK(ref->Step(options));
      ASSERT_TRUE(ParamsMatchAfterStep(*e, model, ref_model, step));
    }
    const EngineStats stats = e->Stats();
    EXPECT_EQ(stats.early_groups_kept, static_cast<int64_t>(kSteps * groups));
    EXPECT_EQ(stats.cpu_adam_bytes, ref->Stats().cpu_adam_bytes);  // nothing recomputed
    EXPECT_GT(stats.cpu_adam_spare_bytes, 0u);
    EXPECT_LT(stats.cpu_adam_spare_bytes, stats.cpu_adam_bytes);
    ASSERT_OK(e->VerifyMasters());
    // Sides as they should be: a further step and a checkpoint read every param's state.
    absl::StatusOr<std::string> a = ref->SaveCheckpoint(tmp.path() + "/ref", kSteps);
    absl::StatusOr<std::string> b = e->SaveCheckpoint(tmp.path() + "/early", kSteps);
    ASSERT_TRUE(a.ok() && b.ok()) << a.status() << " " << b.status();
    ASSERT_EQ(ReadAll(*a), ReadAll(*b));
  }
  absl::StatusOr<TraceFile> trace = ReadTraceFile(trace_path);
  ASSERT_TRUE(trace.ok()) << trace.status();
  int kept = 0, speculated = 0;
  for (const TraceFileEvent& ev : trace->events) {
    if (ev.name != "early.part_start") continue;
    if (ev.args.at("kept") != 0) {
      EXPECT_NE(ev.args.at("in_place"), 0);
      ++kept;
    } else {
      EXPECT_EQ(ev.args.at("in_place"), 0);  // no Step's parts here: every param has spare state
      ++speculated;
    }
  }
  EXPECT_EQ(kept + speculated, static_cast<int>(kSteps * kLayers / per_part));
  EXPECT_GT(kept, 0) << "CPU Adam started every part before Step in every step";
  EXPECT_GT(speculated, 0);
}

INSTANTIATE_TEST_SUITE_P(Announcements, KeptInPlaceTest, ::testing::Values(1, 3),
                         [](const ::testing::TestParamInfo<size_t>& p) {
                           return p.param == 1 ? std::string("GroupPerTensor") : std::string("OneGroupThreeAtATime");
                         });

// Before Step keeps the speculation, a param begun goes down whole before another begins, even when a
// later announcement (whose part the pass takes first) becomes final meanwhile: so the params of that
// announcement are not begun when Step keeps the speculation at once (no gradient check to wait for),
// and run in place. One group: a large param announced and begun, then three small ones, then Step.
// Out of place exactly the large param's bytes each step; bit-identical to Step alone.
TEST(SpareStateBudgetTest, ABegunParamGoesDownWholeBeforeTheKeep) {
  absl::StatusOr<std::unique_ptr<Device>> d = CreateDevice();
  ASSERT_TRUE(d.ok()) << d.status();
  Device* device = d->get();
  const std::vector<int64_t> sizes = {2000000, 3000, 5000, 7000};
  Model ref_model(device, sizes, 37), model(device, sizes, 37);
  EngineOptions o;
  o.state_later = "off";  // the bytes counted below are whole updates'
  o.policy_path = Policies() + "offload_all.lua";
  o.transfer_chunk_bytes = 1 << 15;
  o.cpu_threads = 1;
  o.device = std::string(BackendName(device->backend()));
  auto ref = MakeFinalizedEngine(o, [&](Engine& x) { return ref_model.Register(x, 1); });
  auto e = MakeFinalizedEngine(o, [&](Engine& x) { return model.Register(x, 1); });
  ASSERT_TRUE(ref && e);
  const uint64_t large_bytes = 28u * static_cast<uint64_t>(sizes[0]);  // fp32 state, bf16 grads and params
  const uint64_t small_bytes = 28u * (3000 + 5000 + 7000);
  constexpr int kSteps = 6;
  int large_only = 0;  // steps whose out-of-place bytes were the large param's alone
  for (int step = 1; step <= kSteps; ++step) {
    ref_model.SetGrads(80 + static_cast<uint64_t>(step));
    model.SetGrads(80 + static_cast<uint64_t>(step));
    const StepOptions options{.lr = 1e-3f, .check_finite = false};
    const EngineStats before = e->Stats();
    ASSERT_OK(e->GradsReadyParams({model.name(0)}, options));
    // Its first round has run: the large param is begun.
    for (int i = 0; i < 20000 && e->Stats().cpu_adam_bytes == before.cpu_adam_bytes; ++i) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    ASSERT_GT(e->Stats().cpu_adam_bytes, before.cpu_adam_bytes) << "step " << step;
    const uint64_t at_second = e->Stats().cpu_adam_bytes;
    ASSERT_OK(e->GradsReadyParams({model.name(1), model.name(2), model.name(3)}, options));
    // A few more rounds (a chunk holds 16384 elements) before Step: time for the pass to jump to the
    // later part, were it to begin a param before finishing the one begun.
    const uint64_t rounds = 4u * 28u * 16384u;
    for (int i = 0; i < 20000 && e->Stats().cpu_adam_bytes < at_second + rounds; ++i) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    StepOptions mine = options;
    mine.wait_for_params = step % 2 == 0;
    ASSERT_OK(e->Step(mine));
    ASSERT_OK(ref->Step(options));
    ASSERT_TRUE(ParamsMatchAfterStep(*e, model, ref_model, step));
    ASSERT_OK(e->Synchronize());
    const EngineStats after = e->Stats();
    // Out of place: the large param, and the small ones only if the large one was all down before
    // Step (a host too loaded to run this test's timing; most steps must not be such).
    const uint64_t spare = after.cpu_adam_spare_bytes - before.cpu_adam_spare_bytes;
    EXPECT_TRUE(spare == large_bytes || spare == large_bytes + small_bytes) << "step " << step << ": " << spare;
    large_only += spare == large_bytes ? 1 : 0;
    EXPECT_EQ(after.cpu_adam_bytes - before.cpu_adam_bytes, large_bytes + small_bytes) << step;
  }
  EXPECT_GE(large_only, kSteps / 2) << "the small params went out of place in most steps: they were begun "
                                    << "before the large one was all down";
  ASSERT_OK(e->VerifyMasters());
  TempDir tmp("ferry-param-first");
  absl::StatusOr<std::string> a = ref->SaveCheckpoint(tmp.path() + "/ref", kSteps);
  absl::StatusOr<std::string> b = e->SaveCheckpoint(tmp.path() + "/early", kSteps);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << " " << b.status();
  ASSERT_EQ(ReadAll(*a), ReadAll(*b));
}

}  // namespace
}  // namespace ferry::engine_test
