// Buckets, not groups, as the unit of overlap (Engine::GradsReadyParams, WaitParamsOf): a model in one
// group, or in two, announced in buckets of params as a backward would finish them, is bit-identical
// to an engine that only calls Step, over many steps with random buckets (some params never
// announced, some groups finished by a group announcement), clipping reached or not, NaN/Inf, loss
// scales, deferred steps whose next "forward" waits param by param, and steps whose speculation
// fails while the trainer waits per param (deferred with the step's own scalars); a clipped step's
// update in the order of the next forward. The misuses are clear errors. The spare state under a
// budget: spare_state_test.cc; the order of the early work around the keep: early_order_test.cc.
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "device/device.h"
#include "engine/engine_test_util.h"
#include "ferry/engine.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "optim/hybrid_optimizer.h"
#include "trace/trace_file.h"

namespace ferry::engine_test {
namespace {

using ::testing::HasSubstr;

const std::vector<int64_t> kSizes = {1000, 7, 4099, 65, 3, 20000, 513, 3000, 777, 12000, 1, 2500};

struct Case {
  std::string policy;  // "offload_all.lua", "half" (offload_fraction 0.5), "all_gpu.lua", "bf16"
  size_t groups;       // tensor i in group "g<i % groups>"
};

// How gtest (and so ctest's test list) shows a Case.
void PrintTo(const Case& c, std::ostream* os) { *os << c.policy << ", " << c.groups << " groups"; }

class BucketStepTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Device>> d = CreateDevice();
    ASSERT_TRUE(d.ok()) << d.status();
    device_ = *std::move(d);
  }
  std::unique_ptr<Engine> Make(Model& model) {
    EngineOptions o;
    const std::string& p = GetParam().policy;
    if (p == "half") {
      o.policy_path = Policies() + "offload_fraction.lua";
      o.policy_args = {{"fraction", "0.5"}};
    } else if (p == "bf16") {
      o.policy_path = Policies() + "offload_bf16_moments.lua";
      o.policy_args = {{"master", "bf16"}, {"rounding", "stochastic"}};
    } else {
      o.policy_path = Policies() + p;
    }
    o.optimizer.lr = 1e-3f;
    o.optimizer.weight_decay = 0.01f;
    o.transfer_chunk_bytes = 4096;  // many chunks; buckets of a few params each
    o.cpu_threads = 3;
    o.device = std::string(BackendName(device_->backend()));
    absl::StatusOr<std::unique_ptr<Engine>> e = Engine::Create(o);
    EXPECT_TRUE(e.ok()) << e.status();
    if (!e.ok()) return nullptr;
    EXPECT_TRUE(model.Register(**e, GetParam().groups).ok());
    absl::Status s = (*e)->Finalize();
    EXPECT_TRUE(s.ok()) << s;
    return *std::move(e);
  }
  bool AnyOffloaded(Engine& e) {
    for (const GroupPlacement& g : e.Placement()) {
      if (g.offloaded) return true;
    }
    return false;
  }
  std::unique_ptr<Device> device_;
  TempDir tmp_{"ferry-buckets"};
};

TEST_P(BucketStepTest, BucketsOfAnyGroupingAreBitIdenticalToStepAlone) {
  Model ref_model(device_.get(), kSizes, 5), early_model(device_.get(), kSizes, 5);
  auto ref = Make(ref_model);
  auto early = Make(early_model);
  ASSERT_TRUE(ref && early);
  const bool offloaded = AnyOffloaded(*early);
  std::mt19937_64 rng(31);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  int64_t total = 0;
  for (int64_t n : kSizes) total += n;
  const float clip_norm = std::sqrt(static_cast<float>(total));
  int clipped = 0, poisoned = 0, deferred_expected = 0, per_param_waits = 0;
  for (int step = 1; step <= 60; ++step) {
    const uint64_t seed = 300 + static_cast<uint64_t>(step);
    ref_model.SetGrads(seed);
    early_model.SetGrads(seed);
    const float loss_scale = std::vector<float>{1.0f, 8.0f}[rng() % 2];
    const float factor = loss_scale * (0.8f + 0.45f * unit(rng));  // the clip is reached about half the time
    ref_model.ScaleGrads(factor);
    early_model.ScaleGrads(factor);
    if (factor / loss_scale > 1.0f) ++clipped;
    const bool poison = rng() % 12 == 0;
    if (poison) {
      const size_t victim = rng() % kSizes.size();
      ref_model.PoisonGrad(victim, 0x7f80);
      early_model.PoisonGrad(victim, 0x7f80);
      ++poisoned;
    }
    const StepOptions options{.lr = 1e-3f * (1.0f + 0.02f * static_cast<float>(step)), .loss_scale = loss_scale,
                              .max_grad_norm = clip_norm};
    // A backward: params from the last to the first, in buckets of 1 to 4; a few never announced;
    // sometimes a group announcement finishes what is left of group g0.
    std::vector<std::string> bucket;
    for (size_t i = kSizes.size(); i-- > 0;) {
      if (unit(rng) < 0.1f) continue;
      bucket.push_back(early_model.name(i));
      if (bucket.size() == 1 + rng() % 4 || i == 0) {
        ASSERT_OK(early->GradsReadyParams(bucket, options));
        bucket.clear();
      }
    }
    if (!bucket.empty()) ASSERT_OK(early->GradsReadyParams(bucket, options));
    if (rng() % 4 == 0) {
      const absl::Status s = early->GradsReady({"g0"}, options);  // the rest of g0, if any is left
      ASSERT_TRUE(s.ok() || absl::IsInvalidArgument(s)) << s;
    }
    const bool defer = rng() % 2 == 0;
    ASSERT_OK(ref->Step(options));
    StepOptions stepped = options;
    stepped.wait_for_params = !defer;
    ASSERT_OK(early->Step(stepped));
    if (defer && offloaded && !poison) ++deferred_expected;
    ASSERT_EQ(early->Stats().last_step_skipped, ref->Stats().last_step_skipped) << "step " << step;
    if (defer) {
      // The next forward: param by param, in forward order; after each wait that param is the step's.
      for (size_t i = 0; i < kSizes.size(); ++i) {
        ASSERT_OK(early->WaitParamsOf({early_model.name(i)}));
        ASSERT_EQ(early_model.Param(i), ref_model.Param(i)) << "step " << step << ", param " << i;
        ++per_param_waits;
      }
    }
    ASSERT_OK(early->WaitParams({}));
    for (size_t i = 0; i < kSizes.size(); ++i) {
      ASSERT_EQ(early_model.Param(i), ref_model.Param(i)) << "step " << step << ", param " << i;
    }
    if (step % 15 == 0) {
      absl::StatusOr<std::string> a = ref->SaveCheckpoint(tmp_.path() + "/ref", step);
      absl::StatusOr<std::string> b = early->SaveCheckpoint(tmp_.path() + "/early", step);
      ASSERT_TRUE(a.ok() && b.ok()) << a.status() << " " << b.status();
      ASSERT_EQ(ReadAll(*a), ReadAll(*b)) << "step " << step;
    }
  }
  EXPECT_GT(clipped, 10);
  EXPECT_GT(poisoned, 1);
  EXPECT_GT(per_param_waits, 0);
  // Every deferrable step was deferred, the clipped ones included (their update ran with the step's
  // own scalars beside the "forward").
  EXPECT_EQ(early->Stats().deferred_steps, deferred_expected);
  if (offloaded) {
    EXPECT_GT(early->Stats().early_groups_kept, 0);
    EXPECT_GT(early->Stats().early_groups_recomputed, 0);
  }
  ASSERT_OK(early->VerifyMasters());
}

TEST_P(BucketStepTest, MisusesAreClearErrors) {
  Model model(device_.get(), kSizes, 9);
  auto e = Make(model);
  ASSERT_TRUE(e);
  model.SetGrads(1);
  absl::Status s = e->GradsReadyParams({});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  s = e->GradsReadyParams({"p1", "nope"});
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(s.message(), HasSubstr("'nope'"));
  s = e->GradsReadyParams({"p1", "p1"});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("'p1'"));
  s = e->WaitParamsOf({"nope"});
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  // None of those started a step: a save works.
  ASSERT_TRUE(e->SaveCheckpoint(tmp_.path() + "/before", 0).ok());

  ASSERT_OK(e->GradsReadyParams({"p2", "p5"}));
  s = e->GradsReadyParams({"p3", "p5"});  // p5 again: refused, p3 not announced either
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("'p5'"));
  EXPECT_THAT(s.message(), HasSubstr("already announced"));
  s = e->WaitParamsOf({"p0"});
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("Step"));
  // Every param of the groups announced one by one: the groups are then announced, and a group
  // announcement of them is refused.
  for (size_t i = 0; i < kSizes.size(); ++i) {
    if (i != 2 && i != 5) ASSERT_OK(e->GradsReadyParams({model.name(i)}));
  }
  s = e->GradsReady({"g0"});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  ASSERT_OK(e->Step({.wait_for_params = false}));
  ASSERT_OK(e->WaitParamsOf({"p0", "p11", "p0"}));
  ASSERT_OK(e->Synchronize());
  ASSERT_OK(e->VerifyMasters());
}

// A step whose clip is reached cannot keep its speculation: after a deferred Step its whole update
// runs in place beside the next forward, which waits layer by layer. The update must go in the
// order that forward needs it, as the backward's announcements give it, whatever the registration:
// here, as ferry.torch registers decay / no-decay groups, every weight comes before every bias, and
// a layer's bias must not wait behind the last layer's weight. The part the trainer waits for first
// is the one the early thread takes first (the latest queued), so, layer by layer in forward order,
// each wait's part was queued before the one before it. Exact as Step alone.
class DeferredOrderTest : public ::testing::TestWithParam<bool> {};  // announced as a backward does, or not

TEST_P(DeferredOrderTest, AClippedStepUpdatesLayersInForwardOrder) {
  const bool backward = GetParam();
  absl::StatusOr<std::unique_ptr<Device>> d = CreateDevice();
  ASSERT_TRUE(d.ok()) << d.status();
  Device* device = d->get();
  constexpr size_t kLayers = 8;
  std::vector<int64_t> sizes(kLayers, 6000);            // layer k's weight: tensor k, group "decay"
  sizes.insert(sizes.end(), kLayers, 97);               // its bias: tensor kLayers + k, "no_decay"
  std::vector<std::string> group_of(kLayers, "decay");
  group_of.insert(group_of.end(), kLayers, "no_decay");
  TempDir tmp("ferry-deferred-order");
  const std::string trace_path = tmp.path() + "/trace.json";
  Model ref_model(device, sizes, 23), model(device, sizes, 23);
  constexpr int kSteps = 4;
  {
    auto make = [&](Model& m, const std::string& trace) -> std::unique_ptr<Engine> {
      EngineOptions o;
      o.policy_path = Policies() + "offload_all.lua";
      o.transfer_chunk_bytes = 4096;  // a weight is three chunks: a bucket (two chunks) of its own
      o.cpu_threads = 2;
      o.device = std::string(BackendName(device->backend()));
      o.trace_path = trace;
      return MakeFinalizedEngine(o, [&](Engine& e) { return m.RegisterIn(e, group_of); });
    };
    auto ref = make(ref_model, "");
    auto e = make(model, trace_path);
    ASSERT_TRUE(ref && e);
    for (int step = 1; step <= kSteps; ++step) {
      ref_model.SetGrads(70 + static_cast<uint64_t>(step));
      model.SetGrads(70 + static_cast<uint64_t>(step));
      const StepOptions options{.lr = 1e-3f, .max_grad_norm = 1e-3f};  // reached at every step
      for (size_t i = 0; i < kLayers; ++i) {  // a layer's weight and bias together
        const size_t k = backward ? kLayers - 1 - i : i;  // as a backward, or after it in forward order
        ASSERT_OK(e->GradsReadyParams({model.name(k), model.name(kLayers + k)}, options));
      }
      ASSERT_OK(ref->Step(options));
      StepOptions deferred = options;
      deferred.wait_for_params = false;
      ASSERT_OK(e->Step(deferred));
      for (size_t k = 0; k < kLayers; ++k) {  // the next forward
        for (size_t i : {k, kLayers + k}) {
          ASSERT_OK(e->WaitParamsOf({model.name(i)}));
          ASSERT_EQ(model.Param(i), ref_model.Param(i)) << "step " << step << ", tensor " << i;
        }
      }
    }
    EXPECT_EQ(e->Stats().deferred_steps, kSteps);
    EXPECT_EQ(e->Stats().early_groups_kept, 0);
    ASSERT_OK(e->VerifyMasters());
  }
  absl::StatusOr<TraceFile> trace = ReadTraceFile(trace_path);
  ASSERT_TRUE(trace.ok()) << trace.status();
  std::vector<const TraceFileEvent*> waits;
  for (const TraceFileEvent& ev : trace->events) {
    if (ev.name == "wait.upload" && ev.args.count("part") != 0) waits.push_back(&ev);
  }
  std::stable_sort(waits.begin(), waits.end(),
                   [](const TraceFileEvent* a, const TraceFileEvent* b) { return a->ts_us < b->ts_us; });
  ASSERT_EQ(waits.size(), kSteps * 2 * kLayers);  // every wait found its part (none waited a group)
  for (int step = 0; step < kSteps; ++step) {
    for (size_t w = 1; w < 2 * kLayers; ++w) {
      const TraceFileEvent& before = *waits[step * 2 * kLayers + w - 1];
      const TraceFileEvent& now = *waits[step * 2 * kLayers + w];
      EXPECT_LT(now.args.at("part"), before.args.at("part"))
          << "step " << step + 1 << ": param " << now.args.at("param") << " (wait " << w << " of the forward) is in part "
          << now.args.at("part") << ", queued after param " << before.args.at("param") << "'s part "
          << before.args.at("part") << ": the early thread takes it first, though the forward needs it later";
    }
  }
  // Each part's end names the step its update computes (`ferry trace` lines the ranks' update ends up
  // by it): steps 1 to kSteps, each step's parts done before the next step's begin.
  std::map<int, std::pair<double, double>> parts_of_step;  // step -> its first part's start, last part's end
  for (const TraceFileEvent& ev : trace->events) {
    if (ev.name != "early.part_done") continue;
    ASSERT_EQ(ev.args.count("step"), 1u) << "an early.part_done span without its step";
    auto [it, fresh] = parts_of_step.try_emplace(static_cast<int>(ev.args.at("step")), ev.ts_us, ev.ts_us + ev.dur_us);
    if (!fresh) {
      it->second.first = std::min(it->second.first, ev.ts_us);
      it->second.second = std::max(it->second.second, ev.ts_us + ev.dur_us);
    }
  }
  ASSERT_EQ(parts_of_step.size(), static_cast<size_t>(kSteps));
  EXPECT_EQ(parts_of_step.begin()->first, 1);
  EXPECT_EQ(parts_of_step.rbegin()->first, kSteps);
  for (auto it = parts_of_step.begin(); std::next(it) != parts_of_step.end(); ++it) {
    EXPECT_LE(it->second.second, std::next(it)->second.first)
        << "step " << it->first << "'s last part ended after step " << std::next(it)->first << "'s first began";
  }
}

// Announced during the backward (the last layer first), and after it in forward order (a trainer
// announcing group by group once its backward is done): the update follows the forward either way.
INSTANTIATE_TEST_SUITE_P(Announcements, DeferredOrderTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& p) {
                           return std::string(p.param ? "as_the_backward" : "in_forward_order");
                         });

INSTANTIATE_TEST_SUITE_P(Placements, BucketStepTest,
                         ::testing::Values(Case{"offload_all.lua", 1}, Case{"offload_all.lua", 2},
                                           Case{"half", 2}, Case{"all_gpu.lua", 1}, Case{"bf16", 1}),
                         [](const ::testing::TestParamInfo<Case>& p) {
                           std::string name = p.param.policy == "offload_all.lua" ? "offload_all"
                                              : p.param.policy == "all_gpu.lua"   ? "all_gpu"
                                                                                  : p.param.policy;
                           return absl::StrCat(name, "_", p.param.groups, "_groups");
                         });

}  // namespace
}  // namespace ferry::engine_test
