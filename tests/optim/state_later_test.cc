// StateLater's bookkeeping: what it stages (in-place fp32 updates with a param, while the kept grads'
// buffer has room; each piece's grads on a line of its own), what it refuses (leaving the tensor
// as it was), pieces done, and dropped by group only in their own step, the buffer handed out again
// once empty, and FERRY_STATE_LATER's parsing.
#include "optim/state_later.h"

#include <cstdint>
#include <cstdlib>
#include <vector>

#include "base/adam_math.h"
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
  StateLater later(0.5);
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
  later.Done(2);
  EXPECT_TRUE(later.empty());
  CpuAdamTensor again = b.Args();  // 1400 bytes fit an empty buffer
  ASSERT_TRUE(later.Stage(again, 5, 2, 0));
  EXPECT_EQ(later.pieces()[0].keep_at, 0u);
}

TEST(StateLaterTest, OffUnlessTheEnvironmentGivesAFraction) {
  for (const char* bad : {"", "0", "-0.5", "1.5", "half", "0.5x"}) {
    ASSERT_EQ(setenv("FERRY_STATE_LATER", bad, 1), 0);
    EXPECT_EQ(StateLater::FractionFromEnv(), 0.0) << bad;
  }
  ASSERT_EQ(setenv("FERRY_STATE_LATER", "0.25", 1), 0);
  EXPECT_EQ(StateLater::FractionFromEnv(), 0.25);
  unsetenv("FERRY_STATE_LATER");
  EXPECT_EQ(StateLater::FractionFromEnv(), 0.0);
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
