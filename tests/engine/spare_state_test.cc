// The spare state of early steps under a budget (EngineOptions::spare_state_fraction, a policy's
// spare_state): which params get it (SpareSpread: spread over the model), exactness at any budget and
// grouping, a spare state the pinned budget cannot hold, and a policy's bound (memory_budget.lua's
// host_budget, reloads). The order of the early work around Step's keep: early_order_test.cc.
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "device/device.h"
#include "engine/engine_test_util.h"
#include "ferry/engine.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "memory/pinned_budget.h"
#include "optim/hybrid_optimizer.h"

namespace ferry::engine_test {
namespace {

using ::testing::HasSubstr;

const std::vector<int64_t> kSizes = {1000, 7, 4099, 65, 3, 20000, 513, 3000, 777, 12000, 1, 2500};

// An engine of `model` (a group per tensor, or tensor i in group i % `groups`) placed by `policy`
// with `args`, its spare state bounded by EngineOptions::spare_state_fraction = `fraction`.
std::unique_ptr<Engine> MakeSpareEngine(Device* device, Model& model, double fraction, const std::string& policy,
                                        std::map<std::string, std::string> args = {}, size_t groups = 0) {
  EngineOptions o;
  o.state_later = "off";  // the bytes counted are whole updates'
  o.policy_path = policy;
  o.policy_args = std::move(args);
  o.optimizer.lr = 1e-3f;
  o.optimizer.weight_decay = 0.01f;
  o.transfer_chunk_bytes = 4096;
  o.cpu_threads = 3;
  o.spare_state_fraction = fraction;
  o.device = std::string(BackendName(device->backend()));
  return MakeFinalizedEngine(o, [&](Engine& e) { return model.Register(e, groups); });
}

// EngineOptions::spare_state_fraction: the spare state takes at most that fraction of the offloaded
// state; the params that fit (spread over the model: SpareSpread) speculate, the others update once Step knows
// the step (deferred, in place), whatever the grouping: a group per tensor, one group (a group's
// params share its spare state and speculate in part), two groups whose params interleave.
// Bit-identical to an engine that only steps at 0, 0.5 and 1.
class SpareStateGroupingTest : public ::testing::TestWithParam<size_t> {};

TEST_P(SpareStateGroupingTest, SpeculatesOnWhatFitsAndStaysExact) {
  absl::StatusOr<std::unique_ptr<Device>> d = CreateDevice();
  ASSERT_TRUE(d.ok()) << d.status();
  Device* device = d->get();
  const size_t groups = GetParam();
  auto make = [&](Model& model, double fraction) {
    return MakeSpareEngine(device, model, fraction, Policies() + "offload_all.lua", {}, groups);
  };
  for (const double fraction : {0.0, 0.5, 1.0}) {
    Model ref_model(device, kSizes, 17), early_model(device, kSizes, 17);
    auto ref = make(ref_model, 1.0);
    auto early = make(early_model, fraction);
    ASSERT_TRUE(ref && early);
    // The offloaded state as the spare state counts it: each group's in whole pages.
    size_t state_bytes = 0;
    for (const GroupPlacement& g : early->Placement()) {
      state_bytes += (static_cast<size_t>(g.host_state_bytes) + 4095) / 4096 * 4096;
    }
    int64_t total = 0;
    for (int64_t n : kSizes) total += n;
    const float clip_norm = std::sqrt(static_cast<float>(total));
    for (int step = 1; step <= 12; ++step) {
      ref_model.SetGrads(40 + static_cast<uint64_t>(step));
      early_model.SetGrads(40 + static_cast<uint64_t>(step));
      const float factor = step % 4 == 0 ? 1.3f : 0.8f;  // the clip reached every fourth step
      ref_model.ScaleGrads(factor);
      early_model.ScaleGrads(factor);
      const StepOptions options{.lr = 1e-3f, .max_grad_norm = clip_norm};
      for (size_t i = kSizes.size(); i-- > 0;) ASSERT_OK(early->GradsReadyParams({early_model.name(i)}, options));
      ASSERT_OK(ref->Step(options));
      StepOptions deferred = options;
      deferred.wait_for_params = step % 2 == 0;
      ASSERT_OK(early->Step(deferred));
      for (size_t i = 0; i < kSizes.size(); ++i) {
        ASSERT_OK(early->WaitParamsOf({early_model.name(i)}));
        ASSERT_EQ(early_model.Param(i), ref_model.Param(i)) << "fraction " << fraction << ", step " << step;
      }
    }
    const EngineStats stats = early->Stats();
    // CPU Adam's bytes: per element and step, the fp32 master, m and v read and written, the bf16 grad
    // read and the bf16 param written (28 B); the engine that only steps does each update once, the
    // other recomputes what a clip made wrong.
    const EngineStats ref_stats = ref->Stats();
    EXPECT_EQ(ref_stats.cpu_adam_bytes, 12u * 28u * static_cast<uint64_t>(total)) << fraction;
    EXPECT_GE(stats.cpu_adam_bytes, ref_stats.cpu_adam_bytes) << fraction;
    EXPECT_GT(ref_stats.cpu_adam_busy_seconds, 0.0);
    EXPECT_GT(stats.cpu_adam_busy_seconds, 0.0) << fraction;
    EXPECT_LE(stats.spare_state_bytes, std::max<size_t>(4096, static_cast<size_t>(fraction * static_cast<double>(state_bytes))))
        << fraction;
    if (fraction == 1.0) {
      EXPECT_EQ(stats.spare_state_bytes, state_bytes);
    } else if (fraction > 0.0) {
      // Some, in any grouping (a group is not the unit): short of the budget by what the largest
      // params, which do not fit when their turn comes, leave out.
      EXPECT_GE(stats.spare_state_bytes, static_cast<size_t>(0.2 * static_cast<double>(state_bytes))) << fraction;
    }
    // The out-of-place share: none without spare state or announcements; with it, the speculations
    // (kept or not), while the clipped steps' updates ran in place.
    EXPECT_EQ(ref_stats.cpu_adam_spare_bytes, 0u);
    if (fraction == 0.0) {
      EXPECT_EQ(stats.early_groups_kept, 0);
      EXPECT_EQ(stats.cpu_adam_spare_bytes, 0u);
    } else {
      EXPECT_GT(stats.early_groups_kept, 0) << fraction;
      EXPECT_GT(stats.cpu_adam_spare_bytes, 0u) << fraction;
      EXPECT_LT(stats.cpu_adam_spare_bytes, stats.cpu_adam_bytes) << fraction;
    }
    EXPECT_EQ(stats.deferred_steps, 6) << fraction;  // the steps with wait_for_params = false
    TempDir tmp("ferry-spare");
    absl::StatusOr<std::string> a = ref->SaveCheckpoint(tmp.path() + "/ref", 12);
    absl::StatusOr<std::string> b = early->SaveCheckpoint(tmp.path() + "/early", 12);
    ASSERT_TRUE(a.ok() && b.ok()) << a.status() << " " << b.status();
    ASSERT_EQ(ReadAll(*a), ReadAll(*b)) << fraction;
    ASSERT_OK(early->VerifyMasters());
  }
}

INSTANTIATE_TEST_SUITE_P(Groupings, SpareStateGroupingTest, ::testing::Values(0, 1, 2),
                         [](const ::testing::TestParamInfo<size_t>& p) {
                           return p.param == 0 ? std::string("GroupPerTensor")
                                                  : absl::StrCat(p.param, "Groups");
                         });

// A spare state that the pinned budget cannot hold: the announcement that would allocate it fails
// (ResourceExhausted, naming the spare state), and the steps go on exact without overlap; once the
// budget has room, the next announcement allocates it and speculates.
TEST(SpareStateBudgetTest, ASpareStateTheBudgetCannotHoldFailsItsAnnouncementAndNothingElse) {
  absl::StatusOr<std::unique_ptr<Device>> d = CreateDevice();
  ASSERT_TRUE(d.ok()) << d.status();
  Device* device = d->get();
  Model ref_model(device, kSizes, 23), model(device, kSizes, 23);
  auto ref = MakeSpareEngine(device, ref_model, 1.0, Policies() + "offload_all.lua", {}, 1);
  auto e = MakeSpareEngine(device, model, 0.5, Policies() + "offload_all.lua", {}, 1);
  ASSERT_TRUE(ref && e);
  PinnedBudget& budget = PinnedBudget::Process();
  const size_t limit = budget.limit();
  budget.set_limit(budget.stats().reserved_bytes + 4096);  // room for nothing more than a page
  const StepOptions options{.lr = 1e-3f};
  for (int step = 1; step <= 4; ++step) {
    if (step == 3) budget.set_limit(limit);
    ref_model.SetGrads(60 + static_cast<uint64_t>(step));
    model.SetGrads(60 + static_cast<uint64_t>(step));
    absl::Status announced = e->GradsReadyParams({model.name(kSizes.size() - 1)}, options);
    if (step < 3) {
      EXPECT_EQ(announced.code(), absl::StatusCode::kResourceExhausted) << announced;
      EXPECT_THAT(std::string(announced.message()), HasSubstr("spare state"));
    } else {
      ASSERT_OK(announced);
    }
    ASSERT_OK(ref->Step(options));
    ASSERT_OK(e->Step(options));
    for (size_t i = 0; i < kSizes.size(); ++i) {
      ASSERT_EQ(model.Param(i), ref_model.Param(i)) << "step " << step << ", tensor " << i;
    }
    EXPECT_EQ(e->Stats().spare_state_bytes > 0, step >= 3) << step;
  }
  budget.set_limit(limit);
  EXPECT_GT(e->Stats().early_groups_kept, 0);
  ASSERT_OK(e->VerifyMasters());
}

// A policy that offloads every group and, with the arg `spare`, bounds the spare state to it.
constexpr char kSparePolicy[] = R"lua(
local M = { args = { spare = "the place() result's spare_state (default: none)",
                     budget_is = "0.25 when ctx.pinned_budget_bytes is this number, else 1" } }
function M.place(groups, ctx)
  local out = {}
  for _, g in ipairs(groups) do out[g.name] = "cpu" end
  if ctx.args.spare then out.spare_state = tonumber(ctx.args.spare) end
  -- budget_is: the bound is 0.25 when ctx.pinned_budget_bytes is that number, else 1
  if ctx.args.budget_is then
    out.spare_state = ctx.pinned_budget_bytes == tonumber(ctx.args.budget_is) and 0.25 or 1
  end
  return out
end
return M
)lua";

// The spare state's bytes by the engine's rule (EngineOptions::spare_state_fraction) for a group per
// tensor: the params SpareSpread chooses by their state's bytes under `fraction` of the groups' state
// in whole pages, each chosen group's in whole pages, the first chosen given up while that is over
// the budget.
size_t ExpectedSpareBytes(Engine& e, double fraction) {
  std::vector<size_t> state, pages;
  size_t total = 0;
  for (const GroupPlacement& g : e.Placement()) {
    state.push_back(static_cast<size_t>(g.host_state_bytes));
    pages.push_back((state.back() + 4095) / 4096 * 4096);
    total += pages.back();
  }
  const size_t budget = static_cast<size_t>(fraction * static_cast<double>(total));
  std::vector<uint8_t> chosen = SpareSpread(state, budget);
  auto bytes = [&] {
    size_t sum = 0;
    for (size_t g = 0; g < pages.size(); ++g) sum += chosen[g] != 0 ? pages[g] : 0;
    return sum;
  };
  for (size_t g = 0; fraction < 1.0 && bytes() > budget && g < chosen.size(); ++g) chosen[g] = 0;
  return std::max<size_t>(bytes(), 4096);
}

// Which params get spare state under a budget: spread over the model from its end (a backward's
// order), each taken when that brings the bytes taken nearer to the budget's share of the bytes
// walked; never more than the budget. (Given a model's groups here, as one param each.)
TEST(SpareSpreadTest, SpreadFromTheEndWithinTheBudget) {
  using V = std::vector<uint8_t>;
  // The 735M model of bench_train.py by groups (M params): embeddings, 12 blocks, the final norm
  // with the head. Half of it: the head (its grads come first), then every other block, and the
  // last block in what the embeddings, too large when their turn came, left.
  std::vector<size_t> model = {655};
  for (int b = 0; b < 12; ++b) model.push_back(503);
  model.push_back(655);
  EXPECT_EQ(SpareSpread(model, 3676), (V{0, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 1}));
  EXPECT_EQ(SpareSpread(model, 7346), V(14, 1));  // all fit: all
  EXPECT_EQ(SpareSpread(model, 0), V(14, 0));     // none fits
  EXPECT_EQ(SpareSpread({10, 10, 10, 10}, 20), (V{0, 1, 0, 1}));
  EXPECT_EQ(SpareSpread({10, 10, 10, 10, 10, 10, 10, 10}, 20), (V{0, 0, 1, 0, 0, 0, 1, 0}));
  EXPECT_EQ(SpareSpread({10, 0, 10, 10}, 20), (V{1, 0, 0, 1}));  // a GPU param (0 bytes) is never chosen
  EXPECT_EQ(SpareSpread({100, 1, 1}, 50), (V{0, 1, 1}));          // what fits, though small
  EXPECT_EQ(SpareSpread({6, 6, 6, 6, 6}, 12), (V{0, 1, 0, 1, 0}));
  for (size_t budget = 0; budget <= 40; ++budget) {
    const std::vector<size_t> bytes = {7, 3, 9, 1, 12, 5};
    const V chosen = SpareSpread(bytes, budget);
    size_t sum = 0;
    for (size_t g = 0; g < bytes.size(); ++g) sum += chosen[g] != 0 ? bytes[g] : 0;
    EXPECT_LE(sum, budget);
    if (budget >= 37) {
      EXPECT_EQ(chosen, V(6, 1));
    }
  }
}

class SparePolicyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Device>> d = CreateDevice();
    ASSERT_TRUE(d.ok()) << d.status();
    device_ = *std::move(d);
    policy_ = tmp_.Write("spare.lua", kSparePolicy);
  }
  // An engine with every group offloaded (a group per tensor), the option `fraction` and `policy`
  // with `args`.
  std::unique_ptr<Engine> Make(Model& model, double fraction, const std::string& policy,
                               std::map<std::string, std::string> args) {
    return MakeSpareEngine(device_.get(), model, fraction, policy, std::move(args));
  }
  // One step whose grads are all announced (the first allocates the spare state); its spare bytes.
  size_t SpareAfterStep(Engine& e, Model& model, uint64_t seed) {
    auto expect_ok = [](const absl::Status& s) { EXPECT_TRUE(s.ok()) << s; };
    model.SetGrads(seed);
    for (size_t i = model.size(); i-- > 0;) expect_ok(e.GradsReadyParams({model.name(i)}));
    expect_ok(e.Step({.wait_for_params = false}));
    expect_ok(e.Synchronize());
    return e.Stats().spare_state_bytes;
  }
  // EngineStats::pinned_limit_bytes of a fresh engine: the process's pinned budget.
  size_t Stats0PinnedLimit() {
    Model model(device_.get(), kSizes, 5);
    auto e = Make(model, 1.0, policy_, {});
    return e == nullptr ? 0 : e->Stats().pinned_limit_bytes;
  }
  std::unique_ptr<Device> device_;
  TempDir tmp_{"ferry-spare-policy"};
  std::string policy_;
};

// A policy's spare_state bounds the spare state as EngineOptions::spare_state_fraction does, and the
// smaller of the two wins; memory_budget's host_budget gives that bound from a byte size.
TEST_F(SparePolicyTest, PolicyBoundTakesTheSmallerFraction) {
  std::map<double, size_t> by_option;  // the option alone
  for (const double fraction : {0.25, 0.5, 1.0}) {
    Model model(device_.get(), kSizes, 5);
    auto e = Make(model, fraction, policy_, {});
    ASSERT_NE(e, nullptr);
    by_option[fraction] = SpareAfterStep(*e, model, 9);
    EXPECT_EQ(by_option[fraction], ExpectedSpareBytes(*e, fraction)) << fraction;
  }
  // Distinct sizes, so that the comparisons below tell the fractions apart.
  ASSERT_LT(by_option[0.25], by_option[0.5]);
  ASSERT_LT(by_option[0.5], by_option[1.0]);
  struct Bound {
    double option;
    const char* policy;  // the policy's spare_state
    double expected;     // the fraction that must apply
  };
  for (const Bound& b : {Bound{1.0, "0.5", 0.5}, Bound{0.5, "1", 0.5}, Bound{0.25, "0.5", 0.25},
                         Bound{0.5, "0.25", 0.25}, Bound{1.0, "1", 1.0}, Bound{0.5, "0.5", 0.5}}) {
    Model model(device_.get(), kSizes, 5);
    auto e = Make(model, b.option, policy_, {{"spare", b.policy}});
    ASSERT_NE(e, nullptr);
    EXPECT_EQ(SpareAfterStep(*e, model, 9), by_option.at(b.expected))
        << "option " << b.option << ", policy " << b.policy;
  }
  // memory_budget: everything offloaded; a host budget of the state and half of it again gives
  // spare_state 0.5 (the policy counts 12 B per element: the engine's pages hold as much or more).
  int64_t numel = 0;
  for (int64_t n : kSizes) numel += n;
  const std::string host_budget = std::to_string(12 * numel * 3 / 2);
  ASSERT_EQ(12 * numel * 3 % 2, 0);
  Model model(device_.get(), kSizes, 5);
  auto e = Make(model, 1.0, Policies() + "memory_budget.lua",
                {{"budget", "0"}, {"reserve", "0"}, {"host_budget", host_budget}});
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(SpareAfterStep(*e, model, 9), by_option.at(0.5)) << "host_budget " << host_budget;
  // place() sees the process's pinned budget (this rank's share) as ctx.pinned_budget_bytes, the
  // default host budget of memory_budget.
  const size_t limit = Stats0PinnedLimit();
  ASSERT_GT(limit, 0u);
  Model seen_model(device_.get(), kSizes, 5);
  auto seen = Make(seen_model, 1.0, policy_, {{"budget_is", std::to_string(limit)}});
  ASSERT_NE(seen, nullptr);
  EXPECT_EQ(SpareAfterStep(*seen, seen_model, 9), by_option.at(0.25)) << "ctx.pinned_budget_bytes != " << limit;
  // An invalid option is still refused, whatever the policy's bound: at Create, naming the field.
  EngineOptions o;
  o.policy_path = policy_;
  o.policy_args = {{"spare", "0.5"}};
  o.spare_state_fraction = 1.5;
  o.device = std::string(BackendName(device_->backend()));
  absl::StatusOr<std::unique_ptr<Engine>> bad = Engine::Create(o);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("EngineOptions::spare_state_fraction is 1.5"));
}

// ReloadPolicy: a new bound applies at the spare state's next allocation (engine.h): before the first
// announcement it sizes the spare state; once allocated the spare state keeps its size; a reload
// that moves groups rebuilds the offloaded state and allocates it afresh under the bound.
TEST_F(SparePolicyTest, ReloadedBoundAppliesAtTheNextAllocation) {
  std::map<double, size_t> by_option;
  for (const double fraction : {0.25, 0.5}) {
    Model model(device_.get(), kSizes, 5);
    auto e = Make(model, fraction, policy_, {});
    ASSERT_NE(e, nullptr);
    by_option[fraction] = SpareAfterStep(*e, model, 9);
  }
  ASSERT_LT(by_option[0.25], by_option[0.5]);
  Model model(device_.get(), kSizes, 5);
  auto e = Make(model, 1.0, policy_, {{"spare", "0.5"}});
  ASSERT_NE(e, nullptr);
  ASSERT_OK(e->ReloadPolicy(policy_, {{"spare", "0.25"}}));  // nothing allocated yet
  EXPECT_EQ(e->Stats().spare_state_bytes, 0u);
  EXPECT_EQ(SpareAfterStep(*e, model, 9), by_option.at(0.25));
  ASSERT_OK(e->ReloadPolicy(policy_, {{"spare", "0.5"}}));  // same placement: kept as allocated
  EXPECT_EQ(SpareAfterStep(*e, model, 10), by_option.at(0.25));
  // All on the GPU and back: the offloaded state is rebuilt, its spare state sized by the new bound.
  ASSERT_OK(e->ReloadPolicy(Policies() + "all_gpu.lua", {}));
  EXPECT_EQ(e->Stats().spare_state_bytes, 0u);
  ASSERT_OK(e->ReloadPolicy(policy_, {{"spare", "0.5"}}));
  EXPECT_EQ(SpareAfterStep(*e, model, 11), by_option.at(0.5));
  ASSERT_OK(e->VerifyMasters());
}

}  // namespace
}  // namespace ferry::engine_test
