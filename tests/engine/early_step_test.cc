// Starting the step during backward (Engine::GradsReady): an engine that announces groups early is
// bit-identical to one that only calls Step, over 100 steps with random clipping triggers, injected
// NaN/Inf, loss scales, an lr schedule, announcements in random order and subsets, and announcements
// made with other options than the Step's; on every placement. The misuses each give a clear error or
// a defined behaviour with nothing lost: unknown groups, a group announced twice, calls between
// GradsReady and Step, a Step that fails after GradsReady, an asynchronous save overtaken by an early
// step.
#include <algorithm>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ckpt/checkpoint.h"
#include "device/device.h"
#include "engine/engine_test_util.h"
#include "ferry/engine.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ferry::engine_test {
namespace {

using ::testing::HasSubstr;

const std::vector<int64_t> kSizes = {1, 7, 1000, 4099, 65, 3, 20000, 513, 3000, 777};

std::string GroupName(size_t i) { return absl::StrCat("g", i); }

class EarlyStepTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Device>> d = CreateDevice();
    ASSERT_TRUE(d.ok()) << d.status();
    device_ = *std::move(d);
  }
  // An engine over `model` (a group per tensor) with `policy` (a shipped file, or a path).
  std::unique_ptr<Engine> Make(Model& model, const std::string& policy, std::map<std::string, std::string> args = {}) {
    EngineOptions o;
    o.policy_path = policy.find('/') == std::string::npos ? Policies() + policy : policy;
    o.policy_args = std::move(args);
    o.optimizer.lr = 1e-3f;
    o.optimizer.weight_decay = 0.01f;
    o.transfer_chunk_bytes = 4096;  // many pipeline chunks, tensors straddling them
    o.cpu_threads = 3;
    o.device = std::string(BackendName(device_->backend()));
    return MakeFinalizedEngine(o, model);
  }
  // The policy of a parameter: "offload_all.lua", "all_gpu.lua", "half" (offload_fraction 0.5) or
  // "bf16" (offloaded, bf16 moments and masters with stochastic rounding).
  std::unique_ptr<Engine> MakeParam(Model& model) {
    if (GetParam() == "half") return Make(model, "offload_fraction.lua", {{"fraction", "0.5"}});
    if (GetParam() == "bf16") {
      return Make(model, "offload_bf16_moments.lua", {{"master", "bf16"}, {"rounding", "stochastic"}});
    }
    return Make(model, GetParam());
  }
  std::unique_ptr<Device> device_;
  TempDir tmp_{"ferry-early"};
};

// 100 steps: random clipping triggers (grads scaled around the clipping norm), NaN/Inf injected, loss
// scales and an lr schedule; the early engine announces a random subset of groups in random order over
// a few calls (some never), sometimes with options that differ from the Step's. Params after every
// step and the whole state every 20 steps are the same bits as the engine that only steps.
TEST_P(EarlyStepTest, EarlyAnnouncementsAreBitIdenticalToStepAlone) {
  constexpr uint64_t kSeed = 7;
  Model ref_model(device_.get(), kSizes, kSeed), early_model(device_.get(), kSizes, kSeed);
  auto ref = MakeParam(ref_model);
  auto early = MakeParam(early_model);
  ASSERT_TRUE(ref && early);
  std::mt19937_64 rng(2026);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  // The norm of N(0, 1) grads over every element is about sqrt(total); clip around it.
  int64_t total = 0;
  for (int64_t n : kSizes) total += n;
  const float clip_norm = std::sqrt(static_cast<float>(total));
  int clipped_steps = 0, inf_steps = 0, other_option_steps = 0;
  for (int step = 1; step <= 100; ++step) {
    const uint64_t grad_seed = 5000 + static_cast<uint64_t>(step);
    ref_model.SetGrads(grad_seed);
    early_model.SetGrads(grad_seed);
    const float loss_scale = std::vector<float>{1.0f, 2.0f, 1024.0f}[rng() % 3];
    const float factor = loss_scale * (0.8f + 0.45f * unit(rng));  // clipping triggers about half the time
    ref_model.ScaleGrads(factor);
    early_model.ScaleGrads(factor);
    if (factor / loss_scale > 1.0f) ++clipped_steps;
    if (rng() % 10 == 0) {
      const size_t victim = rng() % kSizes.size();
      const uint16_t bad = rng() % 2 ? 0x7f80 : 0x7fc0;  // +Inf or NaN
      ref_model.PoisonGrad(victim, bad);
      early_model.PoisonGrad(victim, bad);
      ++inf_steps;
    }
    StepOptions options{.lr = 1e-3f * (1.0f + 0.01f * static_cast<float>(step)), .loss_scale = loss_scale,
                        .max_grad_norm = clip_norm};
    // Reverse order, like a backward, as a random subset over up to three calls.
    std::vector<std::string> order;
    for (size_t g = kSizes.size(); g-- > 0;) {
      if (unit(rng) < 0.8f) order.push_back(GroupName(g));
    }
    StepOptions announced_with = options;
    if (rng() % 10 == 0) {
      announced_with.loss_scale = loss_scale * 2.0f;  // the early work is discarded and recomputed
      ++other_option_steps;
    }
    size_t at = 0;
    while (at < order.size()) {
      const size_t n = std::min(order.size() - at, 1 + rng() % 4);
      ASSERT_OK(early->GradsReady(std::vector<std::string>(order.begin() + at, order.begin() + at + n), announced_with));
      at += n;
    }
    ASSERT_OK(ref->Step(options));
    ASSERT_OK(early->Step(options));
    ASSERT_EQ(early->Stats().last_step_skipped, ref->Stats().last_step_skipped) << "step " << step;
    ASSERT_EQ(early->Stats().last_grad_norm, ref->Stats().last_grad_norm) << "step " << step;
    for (size_t i = 0; i < kSizes.size(); ++i) {
      ASSERT_EQ(early_model.Param(i), ref_model.Param(i)) << "step " << step << ", param " << i;
    }
    if (step % 20 == 0) {
      absl::StatusOr<std::string> a = ref->SaveCheckpoint(tmp_.path() + "/ref", step);
      absl::StatusOr<std::string> b = early->SaveCheckpoint(tmp_.path() + "/early", step);
      ASSERT_TRUE(a.ok() && b.ok()) << a.status() << " " << b.status();
      ASSERT_EQ(ReadAll(*a), ReadAll(*b)) << "step " << step;
    }
  }
  EXPECT_GT(clipped_steps, 10);
  EXPECT_GT(inf_steps, 3);
  EXPECT_GT(other_option_steps, 2);
  EXPECT_EQ(early->Stats().skipped_steps, ref->Stats().skipped_steps);
  EXPECT_GT(early->Stats().skipped_steps, 0);
  bool any_offloaded = false;
  for (const GroupPlacement& g : early->Placement()) any_offloaded = any_offloaded || g.offloaded;
  if (any_offloaded) {
    // Both outcomes were exercised: updates kept, and updates recomputed (clipping, other options).
    EXPECT_GT(early->Stats().early_groups_kept, 0);
    EXPECT_GT(early->Stats().early_groups_recomputed, 0);
  } else {
    EXPECT_EQ(early->Stats().early_groups_kept + early->Stats().early_groups_recomputed, 0);
  }
  ASSERT_OK(early->VerifyMasters());
}

// What a trainer that breaks the contract does after announcing: other grads (every other step),
// scaled (every step), written while the early pass may be reading them. That is a race by design (on
// a GPU too): its early update is discarded, which is what the test checks. tests/tsan.supp names this
// function so that ThreadSanitizer reports any other race.
[[gnu::noinline]] void ChangeAnnouncedGrads(Model& model, int step) {
  if (step % 2 == 0) model.SetGrads(7000 + static_cast<uint64_t>(step));
  model.ScaleGrads(0.5f);
}

// StepOptions::discard_early: the trainer changed the announced grads after all (a second backward,
// an in-place clip). Every step announces every group, then the grads change (other values, scaled),
// and Step with discard_early recomputes each announced group: the same bits as an engine that only
// steps on the final grads, and no early update kept.
TEST_P(EarlyStepTest, DiscardEarlyRecomputesFromTheFinalGrads) {
  Model ref_model(device_.get(), kSizes, 11), early_model(device_.get(), kSizes, 11);
  auto ref = MakeParam(ref_model);
  auto early = MakeParam(early_model);
  ASSERT_TRUE(ref && early);
  std::vector<std::string> all;
  for (size_t g = 0; g < kSizes.size(); ++g) all.push_back(GroupName(g));
  for (int step = 1; step <= 12; ++step) {
    const StepOptions options{.lr = 1e-3f, .loss_scale = 2.0f};
    early_model.SetGrads(900 + static_cast<uint64_t>(step));
    ASSERT_OK(early->GradsReady(all, options));
    ChangeAnnouncedGrads(early_model, step);
    ref_model.SetGrads(static_cast<uint64_t>(step % 2 == 0 ? 7000 : 900) + static_cast<uint64_t>(step));
    ref_model.ScaleGrads(0.5f);
    StepOptions discard = options;
    discard.discard_early = true;
    ASSERT_OK(ref->Step(options));
    ASSERT_OK(early->Step(discard));
    for (size_t i = 0; i < kSizes.size(); ++i) {
      ASSERT_EQ(early_model.Param(i), ref_model.Param(i)) << "step " << step << ", param " << i;
    }
  }
  EXPECT_EQ(early->Stats().early_groups_kept, 0);
  bool any_offloaded = false;
  for (const GroupPlacement& g : early->Placement()) any_offloaded = any_offloaded || g.offloaded;
  if (any_offloaded) {
    EXPECT_GT(early->Stats().early_groups_recomputed, 0);
  }
  absl::StatusOr<std::string> a = ref->SaveCheckpoint(tmp_.path() + "/ref", 12);
  absl::StatusOr<std::string> b = early->SaveCheckpoint(tmp_.path() + "/early", 12);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << " " << b.status();
  ASSERT_EQ(ReadAll(*a), ReadAll(*b));
  ASSERT_OK(early->VerifyMasters());
}

// The misuses: each a clear error with nothing started or lost, or a defined behaviour.
TEST_P(EarlyStepTest, MisusesAreClearErrorsAndLoseNothing) {
  constexpr uint64_t kSeed = 11;
  Model ref_model(device_.get(), kSizes, kSeed), early_model(device_.get(), kSizes, kSeed);
  {
    // Before Finalize.
    EngineOptions o;
    o.device = std::string(BackendName(device_->backend()));
    auto e = Engine::Create(o);
    ASSERT_TRUE(e.ok());
    absl::Status s = (*e)->GradsReady({"g0"});
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  }
  auto ref = MakeParam(ref_model);
  auto early = MakeParam(early_model);
  ASSERT_TRUE(ref && early);
  ref_model.SetGrads(1);
  early_model.SetGrads(1);
  const StepOptions options{.lr = 2e-3f, .loss_scale = 4.0f, .max_grad_norm = 1e6f};

  absl::Status s = early->GradsReady({});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  s = early->GradsReady({"g1", "nope"});
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(s.message(), HasSubstr("'nope'"));
  s = early->GradsReady({"g1", "g1"}, options);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("'g1'"));
  s = early->GradsReady({"g1"}, StepOptions{.loss_scale = 0.0f});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  // None of those started a step: a save works.
  ASSERT_TRUE(early->SaveCheckpoint(tmp_.path() + "/before", 0).ok());

  ASSERT_OK(early->GradsReady({"g6", "g2"}, options));
  s = early->GradsReady({"g9", "g2"}, options);  // g2 again: refused, g9 not announced either
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("'g2'"));
  EXPECT_THAT(s.message(), HasSubstr("already announced"));
  ASSERT_OK(early->GradsReady({"g9"}, options));

  // Between GradsReady and Step: refused, naming what to do.
  const std::string policy = GetParam() == "half"   ? Policies() + "offload_fraction.lua"
                             : GetParam() == "bf16" ? Policies() + "offload_bf16_moments.lua"
                                                    : Policies() + GetParam();
  for (const absl::Status& between :
       {early->SaveCheckpoint(tmp_.path() + "/between", 1).status(), early->LoadCheckpoint(tmp_.path() + "/before"),
        early->SyncFromModel({}, false), early->ReloadPolicy(policy, {}), early->VerifyMasters(),
        early->WaitParams({"g0"})}) {
    EXPECT_EQ(between.code(), absl::StatusCode::kFailedPrecondition) << between;
    EXPECT_THAT(between.message(), HasSubstr("Step"));
  }
  // A Step with bad options fails and leaves the step in progress; the next Step completes it.
  s = early->Step(StepOptions{.loss_scale = -1.0f});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  ASSERT_OK(ref->Step(options));
  ASSERT_OK(early->Step(options));
  for (size_t i = 0; i < kSizes.size(); ++i) ASSERT_EQ(early_model.Param(i), ref_model.Param(i)) << i;

  // GradsReady after Step begins the next step; Step without any GradsReady steps as before.
  ref_model.SetGrads(2);
  early_model.SetGrads(2);
  ASSERT_OK(early->GradsReady({"g0", "g3"}, options));
  ASSERT_OK(ref->Step(options));
  ASSERT_OK(early->Step(options));
  ref_model.SetGrads(3);
  early_model.SetGrads(3);
  ASSERT_OK(ref->Step(options));
  ASSERT_OK(early->Step(options));
  for (size_t i = 0; i < kSizes.size(); ++i) ASSERT_EQ(early_model.Param(i), ref_model.Param(i)) << i;
  ASSERT_OK(early->VerifyMasters());
  absl::StatusOr<std::string> a = ref->SaveCheckpoint(tmp_.path() + "/ref", 3);
  absl::StatusOr<std::string> b = early->SaveCheckpoint(tmp_.path() + "/early", 3);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(ReadAll(*a), ReadAll(*b));
}

// wait_for_params = false: Step returns without the trainer's stream waiting for the uploads; after
// WaitParams the params are the step's, the same as with the default.
TEST_P(EarlyStepTest, WaitParamsOrdersTheNextForward) {
  Model ref_model(device_.get(), kSizes, 3), early_model(device_.get(), kSizes, 3);
  auto ref = MakeParam(ref_model);
  auto early = MakeParam(early_model);
  ASSERT_TRUE(ref && early);
  absl::StatusOr<std::unique_ptr<Stream>> stream = device_->CreateStream();
  ASSERT_TRUE(stream.ok());
  for (int step = 1; step <= 5; ++step) {
    ref_model.SetGrads(static_cast<uint64_t>(step));
    early_model.SetGrads(static_cast<uint64_t>(step));
    ASSERT_OK(ref->Step({}));
    for (size_t g = kSizes.size(); g-- > 0;) ASSERT_OK(early->GradsReady({GroupName(g)}));
    ASSERT_OK(early->Step({.wait_for_params = false}));
    ASSERT_OK(early->WaitParams({}));
    ASSERT_OK(early->WaitParams({"g0", "g5"}, device_->backend() == Backend::kCuda ? (*stream)->native() : nullptr));
    ASSERT_OK((*stream)->Synchronize());
    for (size_t i = 0; i < kSizes.size(); ++i) ASSERT_EQ(early_model.Param(i), ref_model.Param(i)) << step;
  }
  absl::Status s = early->WaitParams({"nope"});
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
}

// A deferred step (wait_for_params = false, every group announced): Step returns while CPU Adam still
// runs, and whatever comes next sees the step's values. After each deferred step one of these
// follows at once, before any WaitParams: the trainer waits per group in forward order and then
// reuses its grads, a save, a state read, a step without announcements, a clipped step (deferred
// too), a check of the masters, or the engine's destruction. Params, checkpoints and state equal an engine that only steps.
TEST_P(EarlyStepTest, DeferredStepsEndTheSameWhateverFollowsThem) {
  Model ref_model(device_.get(), kSizes, 21), early_model(device_.get(), kSizes, 21);
  auto ref = MakeParam(ref_model);
  auto early = MakeParam(early_model);
  ASSERT_TRUE(ref && early);
  bool any_offloaded = false;
  for (const GroupPlacement& g : early->Placement()) any_offloaded = any_offloaded || g.offloaded;
  std::mt19937_64 rng(99);
  int64_t total = 0;
  for (int64_t n : kSizes) total += n;
  const float clip_norm = 2.0f * std::sqrt(static_cast<float>(total));  // the grads' norm is about half
  int64_t expected_deferred = 0;
  for (int step = 1; step <= 24; ++step) {
    const uint64_t grad_seed = 900 + static_cast<uint64_t>(step);
    ref_model.SetGrads(grad_seed);
    early_model.SetGrads(grad_seed);
    const bool clip = step % 6 == 5;
    if (clip) {
      ref_model.ScaleGrads(3.0f);
      early_model.ScaleGrads(3.0f);
    }
    StepOptions options{.lr = 1e-3f * static_cast<float>(step), .max_grad_norm = clip_norm};
    std::vector<size_t> order(kSizes.size());
    for (size_t g = 0; g < order.size(); ++g) order[g] = kSizes.size() - 1 - g;
    if (step % 3 == 0) std::shuffle(order.begin(), order.end(), rng);
    for (size_t g : order) ASSERT_OK(early->GradsReady({GroupName(g)}, options));
    ASSERT_OK(ref->Step(options));
    StepOptions deferred = options;
    deferred.wait_for_params = false;
    ASSERT_OK(early->Step(deferred));
    // Every step is deferred: when clipping triggered the speculation fails, and the update runs with
    // the step's own scalars beside the next forward (the next step's announcements start nothing,
    // and that step's update is deferred the same way).
    if (any_offloaded) ++expected_deferred;
    switch (step % 6) {
      case 0:  // the next forward waits per group; then the grads may change
        for (size_t g = 0; g < kSizes.size(); ++g) ASSERT_OK(early->WaitParams({GroupName(g)}));
        early_model.SetGrads(grad_seed + 1000);
        break;
      case 1: {
        absl::StatusOr<std::string> a = ref->SaveCheckpoint(tmp_.path() + "/ref", step);
        absl::StatusOr<std::string> b = early->SaveCheckpoint(tmp_.path() + "/early", step);
        ASSERT_TRUE(a.ok() && b.ok()) << a.status() << " " << b.status();
        ASSERT_EQ(ReadAll(*a), ReadAll(*b)) << "step " << step;
        break;
      }
      case 2: {
        std::vector<float> a(static_cast<size_t>(kSizes[6])), b(a.size());
        for (const char* kind : {"master", "exp_avg", "exp_avg_sq"}) {
          ASSERT_OK(ref->ReadState("p6", kind, a.data()));
          ASSERT_OK(early->ReadState("p6", kind, b.data()));
          ASSERT_EQ(a, b) << kind << ", step " << step;
        }
        break;
      }
      case 3:  // the next step without announcements (after a forward: the grads may change)
        ASSERT_OK(early->WaitParams({}));
        ref_model.SetGrads(grad_seed + 2000);
        early_model.SetGrads(grad_seed + 2000);
        ASSERT_OK(ref->Step(options));
        ASSERT_OK(early->Step(options));
        break;
      case 4:
        ASSERT_OK(early->VerifyMasters());
        break;
      default:
        break;
    }
    ASSERT_OK(early->WaitParams({}));
    for (size_t i = 0; i < kSizes.size(); ++i) {
      ASSERT_EQ(early_model.Param(i), ref_model.Param(i)) << "step " << step << ", param " << i;
    }
  }
  EXPECT_EQ(early->Stats().deferred_steps, expected_deferred);
  EXPECT_EQ(early->Stats().step, ref->Stats().step);
  // Destroyed right after a deferred step: the update completes first (the model lives on).
  ref_model.SetGrads(1);
  early_model.SetGrads(1);
  for (size_t g = kSizes.size(); g-- > 0;) ASSERT_OK(early->GradsReady({GroupName(g)}));
  ASSERT_OK(ref->Step({}));
  ASSERT_OK(early->Step({.wait_for_params = false}));
  early.reset();
  for (size_t i = 0; i < kSizes.size(); ++i) ASSERT_EQ(early_model.Param(i), ref_model.Param(i)) << "param " << i;
}

// An asynchronous save in flight while the next step starts early writes the values of its own step.
TEST_P(EarlyStepTest, AsyncSaveOvertakenByAnEarlyStepKeepsItsValues) {
  const std::string policy = tmp_.Write("async.lua", R"(
return {
  place = function(groups, ctx)
    local p = {}
    for i, g in ipairs(groups) do p[g.name] = (i % 2 == 1 or ctx.args.all == "1") and "cpu" or "gpu" end
    return p
  end,
  checkpoint = function(info, ctx) return { async = true } end,
})");
  Model ref_model(device_.get(), kSizes, 5), early_model(device_.get(), kSizes, 5);
  auto ref = Make(ref_model, policy, {{"all", GetParam() == "offload_all.lua" ? "1" : "0"}});
  auto early = Make(early_model, policy, {{"all", GetParam() == "offload_all.lua" ? "1" : "0"}});
  ASSERT_TRUE(ref && early);
  for (int step = 1; step <= 6; ++step) {
    ref_model.SetGrads(static_cast<uint64_t>(step));
    early_model.SetGrads(static_cast<uint64_t>(step));
    ASSERT_OK(ref->Step({}));
    ASSERT_OK(early->Step({}));
    if (step == 3) {
      absl::StatusOr<std::string> a = ref->SaveCheckpoint(tmp_.path() + "/ref", step);
      ASSERT_TRUE(a.ok());
      ASSERT_OK(ref->WaitCheckpoint());
      absl::StatusOr<std::string> b = early->SaveCheckpoint(tmp_.path() + "/early", step);
      ASSERT_TRUE(b.ok());
      // The next steps start early while the writer may still read the state.
      for (int next = 4; next <= 5; ++next) {
        ref_model.SetGrads(static_cast<uint64_t>(100 + next));
        early_model.SetGrads(static_cast<uint64_t>(100 + next));
        for (size_t g = kSizes.size(); g-- > 0;) ASSERT_OK(early->GradsReady({GroupName(g)}));
        ASSERT_OK(ref->Step({}));
        ASSERT_OK(early->Step({}));
      }
      ASSERT_OK(early->WaitCheckpoint());
      EXPECT_EQ(ReadAll(*a), ReadAll(*b));
    }
  }
  for (size_t i = 0; i < kSizes.size(); ++i) ASSERT_EQ(early_model.Param(i), ref_model.Param(i)) << i;
}

INSTANTIATE_TEST_SUITE_P(Placements, EarlyStepTest, ::testing::Values("offload_all.lua", "half", "all_gpu.lua", "bf16"),
                         [](const ::testing::TestParamInfo<std::string>& p) {
                           if (p.param == "half" || p.param == "bf16") return p.param;
                           return p.param == "all_gpu.lua" ? std::string("all_gpu") : std::string("offload_all");
                         });

}  // namespace
}  // namespace ferry::engine_test
