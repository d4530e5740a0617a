// Absolute per-group learning rates (StepOptions::group_lr), a step's own betas (group_betas) and
// per-param state access (Engine::ReadState/WriteState, GroupStep/SetGroupStep), which the Python
// binding builds torch's param groups and state_dict on. Every placement (all offloaded, all on the
// device, mixed).
#include <algorithm>
#include <cmath>
#include <tuple>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "device/adam_reference.h"
#include "device/device.h"
#include "engine/engine_test_util.h"
#include "ferry/engine.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ferry::engine_test {
namespace {

using ::testing::HasSubstr;

const std::vector<int64_t> kSizes = {3001, 17, 1024, 515};  // two groups: g0 = {p0, p2}, g1 = {p1, p3}
constexpr size_t kGroups = 2;

class GroupLrTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Device>> d = CreateDevice();
    ASSERT_TRUE(d.ok()) << d.status();
    device_ = *std::move(d);
  }
  std::unique_ptr<Engine> Make(Model& model) {
    EngineOptions o;
    o.policy_path = Policies() + GetParam();
    if (GetParam() == std::string("offload_fraction.lua")) o.policy_args = {{"fraction", "0.5"}};  // the others take none
    o.optimizer.weight_decay = 0.05f;
    o.transfer_chunk_bytes = 2048;
    o.device = std::string(BackendName(device_->backend()));
    absl::StatusOr<std::unique_ptr<Engine>> e = Engine::Create(o);
    EXPECT_TRUE(e.ok()) << e.status();
    if (!e.ok()) return nullptr;
    EXPECT_TRUE(model.Register(**e, kGroups).ok());
    absl::Status s = (*e)->Finalize();
    EXPECT_TRUE(s.ok()) << s;
    return s.ok() ? *std::move(e) : nullptr;
  }
  std::unique_ptr<Device> device_;
};

// A group given its own rate steps exactly as an engine whose global rate is that rate; the other
// group keeps the global rate. The rates change at every step, as a scheduler's do.
TEST_P(GroupLrTest, GroupRateReplacesTheGlobalRateBitForBit) {
  Model own(device_.get(), kSizes, 7), as_g0(device_.get(), kSizes, 7), as_g1(device_.get(), kSizes, 7);
  auto e_own = Make(own), e_g0 = Make(as_g0), e_g1 = Make(as_g1);
  ASSERT_TRUE(e_own && e_g0 && e_g1);
  for (int step = 1; step <= 6; ++step) {
    const float global = 1e-2f / static_cast<float>(step);
    const float g0 = 3e-3f * static_cast<float>(step);
    for (Model* m : {&own, &as_g0, &as_g1}) m->SetGrads(100 + static_cast<uint64_t>(step));
    ASSERT_OK(e_own->Step({.lr = global, .group_lr = {{"g0", g0}}}));
    ASSERT_OK(e_g0->Step({.lr = g0}));
    ASSERT_OK(e_g1->Step({.lr = global}));
  }
  for (Engine* e : {e_own.get(), e_g0.get(), e_g1.get()}) ASSERT_OK(e->Synchronize());
  for (size_t i = 0; i < kSizes.size(); ++i) {
    const Model& want = i % kGroups == 0 ? as_g0 : as_g1;
    EXPECT_EQ(own.Param(i), want.Param(i)) << "param " << i;
  }
  EXPECT_NE(as_g0.Param(0), as_g1.Param(0));  // the rates differ enough to matter
}

TEST_P(GroupLrTest, BadGroupRatesAreRefusedWithNothingStepped) {
  Model model(device_.get(), kSizes, 8);
  auto e = Make(model);
  ASSERT_TRUE(e);
  model.SetGrads(5);
  const auto before = model.Params();
  absl::Status s = e->Step({.lr = 1e-2f, .group_lr = {{"g0", 1e-3f}, {"nope", 1e-3f}}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("'nope'"));
  s = e->Step({.group_lr = {{"g1", -1.0f}}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("'g1'"));
  s = e->Step({.group_lr = {{"g1", 1e-3f}, {"g1", 2e-3f}}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  ASSERT_OK(e->Synchronize());
  EXPECT_EQ(model.Params(), before);
  EXPECT_EQ(e->Stats().step, 0);
  EXPECT_EQ(*e->GroupStep("g0"), 0);
}

// A scheduler that cycles momentum (torch's OneCycleLR) gives a group other betas at every step, and
// one that schedules weight decay (DINO's) the other group another decay: the masters and moments
// follow the float64 reference (tests/device/adam_reference.h) with each step's values, bias
// corrections included (1 - beta1^t with this step's beta1), within its bounds. Fresh random grads
// every step.
TEST_P(GroupLrTest, GroupBetasAndDecayOfAStepFollowTheFloat64Reference) {
  Model model(device_.get(), kSizes, 11);
  auto e = Make(model);
  ASSERT_TRUE(e);
  constexpr float kLr = 1e-2f;
  std::vector<RefState> ref(kSizes.size());
  for (size_t i = 0; i < kSizes.size(); ++i) {
    std::vector<float> master(static_cast<size_t>(kSizes[i]));
    ASSERT_OK(e->ReadState(model.name(i), "master", master.data()));
    ref[i].p.assign(master.begin(), master.end());
    ref[i].m.assign(master.size(), 0.0);
    ref[i].v.assign(master.size(), 0.0);
  }
  for (int step = 1; step <= 8; ++step) {
    const std::pair<float, float> g0_betas{0.95f - 0.02f * static_cast<float>(step % 5), 0.99f};
    const float g1_decay = 0.5f / static_cast<float>(step);
    model.SetGrads(300 + static_cast<uint64_t>(step));
    ASSERT_OK(e->Step({.lr = kLr, .group_betas = {{"g0", g0_betas}}, .group_weight_decay = {{"g1", g1_decay}}}));
    for (size_t i = 0; i < kSizes.size(); ++i) {
      AdamHyper h{.lr = kLr, .weight_decay = 0.05f};
      if (i % kGroups == 0) std::tie(h.beta1, h.beta2) = g0_betas;
      if (i % kGroups == 1) h.weight_decay = g1_decay;
      const std::vector<uint16_t> grad = model.Grad(i);
      for (size_t j = 0; j < grad.size(); ++j) {
        RefUpdate(h, 1.0, step, ref[i].p[j], ref[i].m[j], ref[i].v[j], BF16ToF32(grad[j]));
      }
    }
  }
  ASSERT_OK(e->Synchronize());
  for (size_t i = 0; i < kSizes.size(); ++i) {
    std::vector<float> master(static_cast<size_t>(kSizes[i])), m(master.size());
    ASSERT_OK(e->ReadState(model.name(i), "master", master.data()));
    ASSERT_OK(e->ReadState(model.name(i), "exp_avg", m.data()));
    for (size_t j = 0; j < master.size(); ++j) {
      ASSERT_LE(std::abs(master[j] - ref[i].p[j]), 1e-4 * std::abs(ref[i].p[j]) + 1e-3 * kLr)
          << "param " << i << " element " << j;
      ASSERT_LE(std::abs(m[j] - ref[i].m[j]), 1e-5 * std::abs(ref[i].m[j]) + 1e-6) << "param " << i << " element " << j;
    }
  }
}

TEST_P(GroupLrTest, BadGroupBetasOrDecayAreRefusedWithNothingStepped) {
  Model model(device_.get(), kSizes, 12);
  auto e = Make(model);
  ASSERT_TRUE(e);
  model.SetGrads(6);
  const auto before = model.Params();
  absl::Status s = e->Step({.group_betas = {{"nope", {0.9f, 0.999f}}}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("group_betas names no parameter group 'nope'"));
  s = e->Step({.group_betas = {{"g1", {0.9f, 0.999f}}, {"g1", {0.8f, 0.999f}}}});
  EXPECT_THAT(std::string(s.message()), HasSubstr("names group 'g1' twice"));
  for (const std::pair<float, float>& bad : {std::pair{1.0f, 0.999f}, std::pair{0.9f, -0.1f},
                                            std::pair{std::nanf(""), 0.999f}}) {
    s = e->Step({.group_betas = {{"g1", bad}}});
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(s.message()), HasSubstr("the betas of group 'g1'"));
  }
  for (const float bad : {-0.1f, std::nanf(""), std::numeric_limits<float>::infinity()}) {
    s = e->Step({.group_weight_decay = {{"g0", bad}}});
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(s.message()), HasSubstr("the weight decay of group 'g0'"));
  }
  s = e->Step({.group_weight_decay = {{"g2", 0.1f}}});
  EXPECT_THAT(std::string(s.message()), HasSubstr("group_weight_decay names no parameter group 'g2'"));
  ASSERT_OK(e->Synchronize());
  EXPECT_EQ(model.Params(), before);
  EXPECT_EQ(*e->GroupStep("g0"), 0);
}

// State read from one engine and written into a fresh one (with the step counts) continues the run
// bit-identically: what torch's state_dict / load_state_dict round trip needs.
TEST_P(GroupLrTest, StateReadAndWrittenContinuesBitIdentically) {
  Model a(device_.get(), kSizes, 9), b(device_.get(), kSizes, 9);
  auto ea = Make(a);
  ASSERT_TRUE(ea);
  for (int step = 1; step <= 3; ++step) {
    a.SetGrads(200 + static_cast<uint64_t>(step));
    ASSERT_OK(ea->Step({.lr = 1e-2f}));
  }
  ASSERT_OK(ea->SetGroupStep("g1", 2));  // groups may have different counts
  for (size_t i = 0; i < kSizes.size(); ++i) b.SetParam(i, a.Param(i));
  auto eb = Make(b);
  ASSERT_TRUE(eb);
  for (size_t i = 0; i < kSizes.size(); ++i) {
    std::vector<float> buf(static_cast<size_t>(kSizes[i]));
    for (const char* kind : {"master", "exp_avg", "exp_avg_sq"}) {
      ASSERT_OK(ea->ReadState(a.name(i), kind, buf.data()));
      if (std::string(kind) != "master") {
        bool nonzero = false;
        for (float v : buf) nonzero = nonzero || v != 0.0f;
        EXPECT_TRUE(nonzero) << kind;
      }
      ASSERT_OK(eb->WriteState(b.name(i), kind, buf.data()));
    }
  }
  EXPECT_EQ(*ea->GroupStep("g0"), 3);
  EXPECT_EQ(*ea->GroupStep("g1"), 2);
  ASSERT_OK(eb->SetGroupStep("g0", 3));
  ASSERT_OK(eb->SetGroupStep("g1", 2));
  for (int step = 4; step <= 6; ++step) {
    a.SetGrads(200 + static_cast<uint64_t>(step));
    b.SetGrads(200 + static_cast<uint64_t>(step));
    ASSERT_OK(ea->Step({.lr = 1e-2f}));
    ASSERT_OK(eb->Step({.lr = 1e-2f}));
  }
  ASSERT_OK(ea->Synchronize());
  ASSERT_OK(eb->Synchronize());
  EXPECT_EQ(a.Params(), b.Params());
  std::vector<float> sa(static_cast<size_t>(kSizes[0])), sb(sa.size());
  ASSERT_OK(ea->ReadState(a.name(0), "exp_avg_sq", sa.data()));
  ASSERT_OK(eb->ReadState(b.name(0), "exp_avg_sq", sb.data()));
  EXPECT_EQ(0, std::memcmp(sa.data(), sb.data(), sa.size() * 4));

  // Errors name what is wrong.
  absl::Status s = ea->ReadState("p0", "moment", sa.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("'moment'"));
  s = ea->WriteState("nope", "master", sa.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("'nope'"));
  EXPECT_EQ(ea->GroupStep("nope").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ea->SetGroupStep("g0", -1).code(), absl::StatusCode::kInvalidArgument);
}

TEST(GroupLrUnfinalizedTest, StateAccessBeforeFinalizeIsRefused) {
  EngineOptions o;
  o.device = "host";
  auto e = Engine::Create(o);
  ASSERT_TRUE(e.ok()) << e.status();
  float x = 0.0f;
  EXPECT_EQ((*e)->ReadState("p", "master", &x).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*e)->GroupStep("g").status().code(), absl::StatusCode::kFailedPrecondition);
}

INSTANTIATE_TEST_SUITE_P(Placements, GroupLrTest,
                         ::testing::Values("offload_all.lua", "all_gpu.lua", "offload_fraction.lua"),
                         [](const ::testing::TestParamInfo<std::string>& p) {
                           std::string n = p.param.substr(0, p.param.find('.'));
                           n.erase(std::remove(n.begin(), n.end(), '_'), n.end());
                           return n;
                         });

}  // namespace
}  // namespace ferry::engine_test
