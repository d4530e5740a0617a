// The state later (EngineOptions::state_later, optim/state_later.h): the early pass writes the new params of a
// decided step's in-place pieces first and their state afterwards (in its idle time, at its next
// pass's start, or between steps before anything reads it). Over deferred and waiting steps, a
// skipped step (its params restored from the masters, which must hold the last step's values by
// then), a step whose clip was reached (its update recomputed in place beside the next forward) and
// the steps after it: every param bit-identical to an engine without it after every step, the same
// masters and the same checkpoint, and the state later ran (trace: `state_later`).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "device/device.h"
#include "engine/engine_test_util.h"
#include "ferry/dtype.h"
#include "ferry/engine.h"
#include "ferry/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "trace/trace_file.h"

namespace ferry::engine_test {
namespace {

// EngineOptions::state_later: half the grads' bytes, or `auto` (a quarter, the bytes a cycle stages following
// what the idle time held).
class StateLaterModeTest : public testing::TestWithParam<const char*> {};

TEST_P(StateLaterModeTest, ParamsFirstStateAfterIsBitIdenticalThroughSkipsClipsAndSaves) {
  const bool automatic = std::string(GetParam()) == "auto";
  const double fraction = automatic ? 0.25 : 0.5;
  absl::StatusOr<std::unique_ptr<Device>> d = CreateDevice();
  ASSERT_TRUE(d.ok()) << d.status();
  Device* device = d->get();
  constexpr size_t kLayers = 12;
  const std::vector<int64_t> sizes(kLayers, 300000);
  TempDir tmp("ferry-state-later");
  const std::string trace_path = tmp.path() + "/trace.json";
  Model ref_model(device, sizes, 41), model(device, sizes, 41);
  constexpr int kSteps = 10;
  uint64_t later_bytes = 0;  // the last one waiting: VerifyMasters and the save find its pieces pending
  {
    EngineOptions o;
    o.policy_path = Policies() + "offload_all.lua";
    o.transfer_chunk_bytes = 1 << 15;
    o.cpu_threads = 1;  // CPU Adam behind the announcements: most params begin after Step's keep
    o.device = std::string(BackendName(device->backend()));
    o.state_later = "off";  // whatever FERRY_STATE_LATER says
    auto ref = MakeFinalizedEngine(o, [&](Engine& x) { return ref_model.Register(x); });
    o.trace_path = trace_path;
    o.state_later = GetParam();
    auto e = MakeFinalizedEngine(o, [&](Engine& x) { return model.Register(x); });
    ASSERT_TRUE(ref && e);
    int skipped = 0;
    for (int step = 1; step <= kSteps; ++step) {
      ref_model.SetGrads(300 + static_cast<uint64_t>(step));
      model.SetGrads(300 + static_cast<uint64_t>(step));
      StepOptions options{.lr = 1e-3f, .check_finite = false};
      if (step == 5) {  // a NaN: the step is skipped, its params restored from the masters
        options.check_finite = true;
        ref_model.PoisonGrad(3, 0x7fc0);
        model.PoisonGrad(3, 0x7fc0);
      } else if (step == 6 || step == 7) {  // the clip reached: the speculation fails; the update runs
        options.check_finite = true;        // in Step (6, waiting), or in place beside the next forward
        options.max_grad_norm = 1.0f;       // (7, deferred)
      }
      const uint64_t before = e->Stats().cpu_adam_bytes;
      for (size_t k = kLayers; k-- > 0;) ASSERT_OK(e->GradsReadyParams({model.name(k)}, options));
      // CPU Adam has begun (when the step speculates): Step decides once a part is under way.
      for (int i = 0; i < 20000 && options.check_finite == false && e->Stats().cpu_adam_bytes == before; ++i) {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
      StepOptions mine = options;
      mine.wait_for_params = step % 2 == 0;
      ASSERT_OK(e->Step(mine));
      ASSERT_OK(ref->Step(options));
      ASSERT_EQ(e->Stats().last_step_skipped, ref->Stats().last_step_skipped) << "step " << step;
      skipped += e->Stats().last_step_skipped ? 1 : 0;
      ASSERT_TRUE(ParamsMatchAfterStep(*e, model, ref_model, step));
    }
    EXPECT_EQ(skipped, 1);
    EXPECT_GT(e->Stats().deferred_steps, 0);
    later_bytes = e->Stats().cpu_adam_later_bytes;
    EXPECT_EQ(ref->Stats().cpu_adam_later_bytes, 0u);
    // The kept grads' buffer: the fraction of the bf16 grads' bytes, in whole lines; what a cycle may
    // stage: all of it, or with `auto` a 32nd of it to all of it.
    const EngineStats s = e->Stats();
    const size_t kept = static_cast<size_t>(std::ceil(fraction * 2.0 * kLayers * 300000)) / 64 * 64;
    EXPECT_EQ(s.state_later_kept_bytes, kept);
    if (automatic) {
      EXPECT_GE(s.state_later_limit_bytes, kept / 32 / 64 * 64);
      EXPECT_LE(s.state_later_limit_bytes, kept);
    } else {
      EXPECT_EQ(s.state_later_limit_bytes, kept);
    }
    EXPECT_EQ(ref->Stats().state_later_kept_bytes + ref->Stats().state_later_limit_bytes, 0u);
    ASSERT_OK(e->VerifyMasters());  // the masters, written by the state later
    absl::StatusOr<std::string> a = ref->SaveCheckpoint(tmp.path() + "/ref", kSteps);
    absl::StatusOr<std::string> b = e->SaveCheckpoint(tmp.path() + "/later", kSteps);
    ASSERT_TRUE(a.ok() && b.ok()) << a.status() << " " << b.status();
    ASSERT_EQ(ReadAll(*a), ReadAll(*b));
  }
  absl::StatusOr<TraceFile> trace = ReadTraceFile(trace_path);
  ASSERT_TRUE(trace.ok()) << trace.status();
  double elements = 0.0, least_limit = 1e300, most_limit = 0.0;
  int idle = 0;
  for (const TraceFileEvent& ev : trace->events) {
    if (ev.name != "state_later") continue;
    elements += ev.args.at("elements");
    idle += ev.args.at("yield") != 0 && ev.args.at("elements") > 0 ? 1 : 0;
    least_limit = std::min(least_limit, ev.args.at("limit"));
    most_limit = std::max(most_limit, ev.args.at("limit"));
  }
  // The fraction of the grads' bytes a step at most, from the steps that kept their speculation.
  EXPECT_GT(elements, 0.0) << "no piece's state was written later";
  // The stats count the state's rounds: the fp32 state read and written, the kept bf16 grad read.
  EXPECT_EQ(static_cast<double>(later_bytes), 26.0 * elements);
  const double grad_bytes = 2.0 * static_cast<double>(kLayers * 300000);
  EXPECT_LE(elements, fraction * grad_bytes / 2.0 * kSteps);
  // A cycle stages at most the buffer (`auto`: within a step of a 32nd of it and the buffer).
  EXPECT_LE(most_limit, fraction * grad_bytes);
  EXPECT_GE(least_limit, automatic ? std::floor(fraction * grad_bytes / 32 / 64) * 64 : fraction * grad_bytes - 64);
  RecordProperty("state_later_idle_rounds", idle);
  RecordProperty("state_later_limits", absl::StrCat(least_limit, "-", most_limit));
}

INSTANTIATE_TEST_SUITE_P(Modes, StateLaterModeTest, testing::Values("0.5", "auto"),
                         [](const testing::TestParamInfo<const char*>& mode) {
                           return std::string(mode.param) == "auto" ? "Auto" : "Half";
                         });

// Without spare state every update is Step's (the early pass runs a deferred step's in place, its
// pieces split). A step announced right after a deferred one, before that step's pass has ended,
// makes the early thread leave its pieces (it yields to the announcement's wait), and a waiting Step
// with no early pass then writes them before its own pipeline reads the state: bit-identical to the
// engine without the state later, step by step, and the same checkpoint.
TEST(StateLaterTest, AStepWithoutAnEarlyPassWritesTheStateLeftBeforeItsPipeline) {
  absl::StatusOr<std::unique_ptr<Device>> d = CreateDevice();
  ASSERT_TRUE(d.ok()) << d.status();
  Device* device = d->get();
  constexpr size_t kLayers = 12;
  const std::vector<int64_t> sizes(kLayers, 300000);
  TempDir tmp("ferry-state-later-step");
  Model ref_model(device, sizes, 43), model(device, sizes, 43);
  EngineOptions o;
  o.policy_path = Policies() + "offload_all.lua";
  o.transfer_chunk_bytes = 1 << 15;
  o.cpu_threads = 1;
  o.spare_state_fraction = 0.0;  // nothing speculates: an announcement alone starts no pass
  o.device = std::string(BackendName(device->backend()));
  o.state_later = "off";
  auto ref = MakeFinalizedEngine(o, [&](Engine& x) { return ref_model.Register(x); });
  o.state_later = "1";
  auto e = MakeFinalizedEngine(o, [&](Engine& x) { return model.Register(x); });
  ASSERT_TRUE(ref && e);
  const StepOptions options{.lr = 1e-3f, .check_finite = false};
  auto announce = [&](Engine& x, Model& m) -> absl::Status {
    for (size_t k = kLayers; k-- > 0;) FERRY_RETURN_IF_ERROR(x.GradsReadyParams({m.name(k)}, options));
    return absl::OkStatus();
  };
  uint64_t later_before = 0;
  for (int pair = 1; pair <= 3; ++pair) {
    ref_model.SetGrads(500 + static_cast<uint64_t>(pair));
    model.SetGrads(500 + static_cast<uint64_t>(pair));
    // A deferred step (its update in place on the early thread, its pieces split), then at once the
    // next one on the same grads, waiting: its Step runs its own pipeline.
    StepOptions deferred = options;
    deferred.wait_for_params = false;
    ASSERT_OK(announce(*e, model));
    ASSERT_OK(e->Step(deferred));
    ASSERT_OK(announce(*e, model));
    ASSERT_OK(e->Step(options));
    for (int k = 0; k < 2; ++k) {
      ASSERT_OK(announce(*ref, ref_model));
      ASSERT_OK(ref->Step(options));
    }
    ASSERT_TRUE(ParamsMatchAfterStep(*e, model, ref_model, 2 * pair));
    const uint64_t later = e->Stats().cpu_adam_later_bytes;
    EXPECT_GT(later, later_before) << "pair " << pair << ": no state written later";
    later_before = later;
  }
  absl::StatusOr<std::string> a = ref->SaveCheckpoint(tmp.path() + "/ref", 6);
  absl::StatusOr<std::string> b = e->SaveCheckpoint(tmp.path() + "/later", 6);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << " " << b.status();
  ASSERT_EQ(ReadAll(*a), ReadAll(*b));
}

TEST(StateLaterOptionTest, ABadValueIsRefusedNamingTheField) {
  for (const char* bad : {"half", "2", "-0.1", "Auto"}) {
    EngineOptions o;
    o.state_later = bad;
    absl::StatusOr<std::unique_ptr<Engine>> e = Engine::Create(o);
    ASSERT_FALSE(e.ok()) << bad;
    EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(e.status().message()),
                testing::HasSubstr(std::string("EngineOptions::state_later is '") + bad + "'"));
  }
  for (const char* good : {"off", "auto", "0.1", "1", ""}) {
    EngineOptions o;
    o.state_later = good;
    EXPECT_TRUE(Engine::Create(o).ok()) << good;
  }
}

}  // namespace
}  // namespace ferry::engine_test
