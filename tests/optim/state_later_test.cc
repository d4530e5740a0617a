// StateLater's bookkeeping: what it stages (in-place fp32 updates with a param, while the kept grads'
// buffer has room; each piece's grads on a line of its own), what it refuses (leaving the tensor
// as it was), pieces done, and dropped by group only in their own step, the buffer handed out again
// once empty, `auto`'s limit following what the idle time held, and the setting's parsing (the
// engine's option, else FERRY_STATE_LATER).
#include "optim/state_later.h"

#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <vector>

#include "base/adam_math.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ferry {
namespace {

struct Tensor {
  std::vector<float> master, m, v;
  std::vector<uint16_t> grad, param;
  AdamScalars scalars = MakeAdamScalars(AdamHyper{}, 3);
  explicit Tensor(size_t n) : master(n), m(n), v(n), grad(n), param(n) {}
  CpuAdamTensor Args() {
    CpuAdamTensor t;
    t.master = master.data();
    t.exp_avg = m.data();
    t.exp_avg_sq = v.data();
    t.grad = grad.data();
    t.param = param.data();
    t.numel = static_cast<int64_t>(grad.size());
    t.grad_dtype = DType::kBF16;
    t.param_dtype = DType::kBF16;
    t.scalars = &scalars;
    return t;
  }
};

TEST(StateLaterTest, StagesWhatFitsAndRefusesTheRest) {
  StateLater later({.fraction = 0.5});
  ASSERT_TRUE(later.on());
  ASSERT_TRUE(later.Ensure(4000).ok());  // half of it, in whole lines: 1984 bytes
  ASSERT_TRUE(later.allocated());
  Tensor a(300), b(700), c(100);
  CpuAdamTensor ta = a.Args();
  ASSERT_TRUE(later.Stage(ta, 4, 1, 96));
  EXPECT_TRUE(ta.param_only);
  EXPECT_NE(ta.grad_copy, nullptr);
  CpuAdamTensor tb = b.Args();  // 600 + 1400 bytes: more than is left
  EXPECT_FALSE(later.Stage(tb, 5, 2, 0));
  EXPECT_FALSE(tb.param_only);
  EXPECT_EQ(tb.grad_copy, nullptr);
  // Refused: out of place, bf16 moments, no param.
  CpuAdamTensor out = c.Args();
  out.master_src = out.master;
  out.exp_avg_src = out.exp_avg;
  out.exp_avg_sq_src = out.exp_avg_sq;
  EXPECT_FALSE(later.Stage(out, 6, 2, 0));
  CpuAdamTensor typed = c.Args();
  typed.state.moments = DType::kBF16;
  EXPECT_FALSE(later.Stage(typed, 6, 2, 0));
  CpuAdamTensor no_param = c.Args();
  no_param.param = nullptr;
  EXPECT_FALSE(later.Stage(no_param, 6, 2, 0));
  CpuAdamTensor tc = c.Args();
  ASSERT_TRUE(later.Stage(tc, 6, 2, 8));
  ASSERT_EQ(later.pieces().size(), 2u);
  const StateLater::Piece& first = later.pieces()[0];
  const StateLater::Piece& second = later.pieces()[1];
  EXPECT_EQ(first.param, 4u);
  EXPECT_EQ(first.group, 1u);
  EXPECT_EQ(first.e0, 96u);
  EXPECT_EQ(first.n, 300);
  EXPECT_EQ(first.scalars.lr, a.scalars.lr);
  EXPECT_EQ(first.keep_at, 0u);
  EXPECT_EQ(second.keep_at, 640u);  // 600 bytes, rounded up to a line
  EXPECT_EQ(later.grads(second), tc.grad_copy);
  // A step's settling drops its own pieces only. In the next step (NextStep), dropping groups 1 and
  // 2 leaves both (a step before's, still to be written); a piece of group 1 staged now goes.
  later.NextStep();
  later.Drop({0, 1, 1});
  ASSERT_EQ(later.pieces().size(), 2u);
  Tensor d(50);
  CpuAdamTensor td = d.Args();
  ASSERT_TRUE(later.Stage(td, 7, 1, 0));
  EXPECT_EQ(later.pieces()[2].step, later.step_id());
  EXPECT_EQ(later.pieces()[0].step + 1, later.step_id());
  later.Drop({0, 1, 0});
  ASSERT_EQ(later.pieces().size(), 2u);
  EXPECT_EQ(later.pieces()[0].param, 4u);
  EXPECT_EQ(later.pieces()[1].param, 6u);
  // Once every piece is done the buffer starts over.
  later.Done(2, /*idle=*/true);
  EXPECT_TRUE(later.empty());
  CpuAdamTensor again = b.Args();  // 1400 bytes fit an empty buffer
  ASSERT_TRUE(later.Stage(again, 5, 2, 0));
  EXPECT_EQ(later.pieces()[0].keep_at, 0u);
}

TEST(StateLaterTest, AutoLimitFollowsWhatTheIdleTimeHeld) {
  constexpr size_t kCap = 64 * 1024;  // a step of kCap / 32: 2048 bytes
  // Some spilled: what the idle time held, in whole lines, at least a step.
  EXPECT_EQ(StateLater::AutoLimit(20000, kCap, 9000, 100, true), 8960u);
  EXPECT_EQ(StateLater::AutoLimit(20000, kCap, 0, 5000, false), 2048u);
  // None spilled: a step more where room was short, up to the buffer; else the same.
  EXPECT_EQ(StateLater::AutoLimit(20000, kCap, 20000, 0, true), 22048u);
  EXPECT_EQ(StateLater::AutoLimit(kCap - 1000, kCap, kCap - 1000, 0, true), kCap);
  EXPECT_EQ(StateLater::AutoLimit(20000, kCap, 12000, 0, false), 20000u);
  // A buffer smaller than a line's step still stages.
  EXPECT_EQ(StateLater::AutoLimit(64, 64, 0, 64, true), 64u);
}

TEST(StateLaterTest, AutoStagesUnderItsLimitAndAdaptsOncePerCycle) {
  StateLater later({.fraction = StateLater::kAutoFraction, .automatic = true});
  ASSERT_TRUE(later.on() && later.automatic());
  ASSERT_TRUE(later.Ensure(1 << 20).ok());  // a buffer of 256 KiB, a limit of a quarter of it
  ASSERT_EQ(later.limit(), 64u * 1024);
  Tensor a(16 * 1024), b(16 * 1024), c(8 * 1024);  // 32 KiB, 32 KiB, 16 KiB of bf16 grads
  CpuAdamTensor ta = a.Args(), tb = b.Args(), tc = c.Args();
  ASSERT_TRUE(later.Stage(ta, 0, 0, 0));
  ASSERT_TRUE(later.Stage(tb, 1, 0, 0));
  EXPECT_FALSE(later.Stage(tc, 2, 0, 0));  // past the limit, though the buffer has room
  EXPECT_FALSE(tc.param_only);
  // Both written in idle time, and room was short: a step (8 KiB) more, once the buffer is empty.
  later.Done(1, /*idle=*/true);
  EXPECT_EQ(later.limit(), 64u * 1024);
  later.Done(1, /*idle=*/true);
  EXPECT_EQ(later.limit(), 72u * 1024);
  // Next cycle: one piece written in idle time, the other at the next pass's start: the limit is
  // what the idle time held.
  ta = a.Args();
  tb = b.Args();
  ASSERT_TRUE(later.Stage(ta, 0, 0, 0));
  ASSERT_TRUE(later.Stage(tb, 1, 0, 0));
  later.Done(1, /*idle=*/true);
  later.Done(1, /*idle=*/false);
  EXPECT_EQ(later.limit(), 32u * 1024);
  // A cycle ended by a drop (an undone step) leaves it; one that fit without want of room too.
  later.NextStep();
  tc = c.Args();
  ASSERT_TRUE(later.Stage(tc, 2, 1, 0));
  later.Drop({0, 1});
  EXPECT_TRUE(later.empty());
  EXPECT_EQ(later.limit(), 32u * 1024);
  tc = c.Args();
  ASSERT_TRUE(later.Stage(tc, 2, 1, 0));
  later.Done(1, /*idle=*/true);
  EXPECT_EQ(later.limit(), 32u * 1024);
  // A fixed fraction stages up to its whole buffer, whatever was spilled.
  StateLater fixed({.fraction = 0.25});
  ASSERT_TRUE(fixed.Ensure(1 << 20).ok());
  EXPECT_EQ(fixed.limit(), 256u * 1024);
  ta = a.Args();
  ASSERT_TRUE(fixed.Stage(ta, 0, 0, 0));
  fixed.Done(1, /*idle=*/false);
  EXPECT_EQ(fixed.limit(), 256u * 1024);
}

TEST(StateLaterTest, ParsesOffAutoOrAFractionAndNamesABadValue) {
  for (const char* bad : {"", "-0.5", "1.5", "half", "0.5x", "Auto", "auto ", "nan", "1e400"}) {
    absl::StatusOr<StateLater::Setting> s = StateLater::Parse(bad, "the field");
    ASSERT_FALSE(s.ok()) << bad;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(s.status().message()), ::testing::HasSubstr(std::string("the field is '") + bad + "'"));
  }
  for (const char* off : {"off", "0"}) {
    absl::StatusOr<StateLater::Setting> s = StateLater::Parse(off, "x");
    ASSERT_TRUE(s.ok()) << off;
    EXPECT_EQ(s->fraction, 0.0);
    EXPECT_FALSE(s->automatic);
  }
  absl::StatusOr<StateLater::Setting> s = StateLater::Parse("0.25", "x");
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->fraction, 0.25);
  EXPECT_FALSE(s->automatic);
  s = StateLater::Parse("auto", "x");
  ASSERT_TRUE(s.ok());
  EXPECT_TRUE(s->automatic);
  EXPECT_EQ(s->fraction, StateLater::kAutoFraction);
  EXPECT_TRUE(StateLater::Parse("1", "x").ok());
}

TEST(StateLaterTest, TheOptionBeforeTheEnvironmentBeforeTheFallback) {
  const StateLater::Setting fallback{.fraction = 0.5};
  for (const char* bad : {"-1", "half", "Auto"}) {  // warned and off, whatever the fallback
    ASSERT_EQ(setenv("FERRY_STATE_LATER", bad, 1), 0);
    EXPECT_EQ(StateLater::FromEnv(fallback).fraction, 0.0) << bad;
    EXPECT_FALSE(StateLater::FromEnv(fallback).automatic) << bad;
  }
  ASSERT_EQ(setenv("FERRY_STATE_LATER", "off", 1), 0);
  EXPECT_EQ(StateLater::FromEnv(fallback).fraction, 0.0);
  ASSERT_EQ(setenv("FERRY_STATE_LATER", "0.25", 1), 0);
  EXPECT_EQ(StateLater::FromEnv(fallback).fraction, 0.25);
  ASSERT_EQ(setenv("FERRY_STATE_LATER", "auto", 1), 0);
  EXPECT_TRUE(StateLater::FromEnv(fallback).automatic);
  // The engine's option wins over the environment, which fills in only where the option is empty.
  absl::StatusOr<StateLater::Setting> r = StateLater::Resolve("0.125");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->fraction, 0.125);
  EXPECT_FALSE(r->automatic);
  r = StateLater::Resolve("off");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->fraction, 0.0);
  r = StateLater::Resolve("");
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->automatic);
  r = StateLater::Resolve("0.5x");
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), ::testing::HasSubstr("EngineOptions::state_later is '0.5x'"));
  for (const char* empty : std::initializer_list<const char*>{"", nullptr}) {
    if (empty == nullptr) {
      unsetenv("FERRY_STATE_LATER");
    } else {
      ASSERT_EQ(setenv("FERRY_STATE_LATER", empty, 1), 0);
    }
    EXPECT_EQ(StateLater::FromEnv(fallback).fraction, 0.5);
    r = StateLater::Resolve("");
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->fraction, 0.0);  // off by default
  }
}

TEST(StateLaterTest, OffStagesNothing) {
  StateLater off;
  EXPECT_FALSE(off.on());
  ASSERT_TRUE(off.Ensure(1 << 20).ok());
  EXPECT_FALSE(off.allocated());
  Tensor a(10);
  CpuAdamTensor t = a.Args();
  EXPECT_FALSE(off.Stage(t, 0, 0, 0));
}

}  // namespace
}  // namespace ferry
