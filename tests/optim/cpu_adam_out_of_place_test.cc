// CpuAdam out of place (CpuAdamTensor::*_src, the speculative step of Engine::GradsReady): reading the
// state from one place and writing it to another gives the same bits as updating it in place, leaves
// the source untouched, on every ISA path, every state format (fp32, bf16 moments, bf16 master and
// moments, nearest and stochastic rounding) and every alignment of the ranges.
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "base/adam_math.h"
#include "base/adam_state.h"
#include "base/thread_pool.h"
#include "ferry/dtype.h"
#include "gtest/gtest.h"
#include "optim/cpu_adam.h"

namespace ferry {
namespace {

struct Format {
  const char* name;
  StateFormat state;
  DType param;
};

const Format kFormats[] = {
    {"fp32", {DType::kF32, DType::kF32, StateRounding::kNearest}, DType::kBF16},
    {"fp32 params", {DType::kF32, DType::kF32, StateRounding::kNearest}, DType::kF32},
    {"bf16 moments nearest", {DType::kF32, DType::kBF16, StateRounding::kNearest}, DType::kBF16},
    {"bf16 moments stochastic", {DType::kF32, DType::kBF16, StateRounding::kStochastic}, DType::kBF16},
    {"bf16 master and moments", {DType::kBF16, DType::kBF16, StateRounding::kStochastic}, DType::kBF16},
};

// One tensor's state in its format (master | m | v), random but finite. The three arrays start 64-byte
// aligned in the buffer as it was made (so a state used as the destination takes the streaming path
// for every skew); copies keep the offsets, not the alignment.
struct State {
  std::vector<char> buf;
  size_t mo = 0, mmo = 0, vo = 0;
  char* master() { return buf.data() + mo; }
  char* m() { return buf.data() + mmo; }
  char* v() { return buf.data() + vo; }
};

State RandomState(const StateFormat& f, int64_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const size_t mb = static_cast<size_t>(n) * DTypeSize(f.master), vb = static_cast<size_t>(n) * DTypeSize(f.moments);
  auto up = [](size_t x) { return (x + 63) / 64 * 64; };
  State s;
  s.buf.resize(64 + up(mb) + 2 * up(vb));
  const size_t base = (64 - reinterpret_cast<uintptr_t>(s.buf.data()) % 64) % 64;
  s.mo = base;
  s.mmo = base + up(mb);
  s.vo = base + up(mb) + up(vb);
  for (int64_t e = 0; e < n; ++e) {
    const size_t k = static_cast<size_t>(e);
    StoreFromF32(s.master(), f.master, k, normal(rng));
    StoreFromF32(s.m(), f.moments, k, 0.1f * normal(rng));
    StoreFromF32(s.v(), f.moments, k, 0.01f * std::abs(normal(rng)));
  }
  return s;
}

class CpuAdamOutOfPlaceTest : public ::testing::TestWithParam<CpuAdamIsa> {};

TEST_P(CpuAdamOutOfPlaceTest, EqualsInPlaceAndLeavesTheSourceAlone) {
  const CpuAdamIsa isa = GetParam();
  if (!CpuSupportsAdamIsa(isa)) GTEST_SKIP() << "this CPU lacks " << CpuAdamIsaName(isa);
  ThreadPool pool(3);
  CpuAdam adam(&pool, CpuAdamOptions{.isa = isa, .block_elements = 1000});
  ASSERT_TRUE(adam.init_status().ok()) << adam.init_status();
  std::mt19937_64 rng(20261124);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const Format& format : kFormats) {
    SCOPED_TRACE(format.name);
    // Uneven sizes; each tensor starts `skew` elements into its buffers, so the ranges take every
    // alignment against the vector width and the streaming stores' lines.
    const std::vector<int64_t> sizes = {1, 7, 33, 1000, 4099, 12345};
    std::vector<State> in_place, source, dest;
    std::vector<std::vector<char>> grads, params_a, params_b;
    std::vector<CpuAdamTensor> a, b;
    std::vector<AdamScalars> scalars;
    AdamHyper hyper;
    hyper.lr = 1e-2f;
    hyper.weight_decay = 0.05f;
    scalars.push_back(MakeAdamScalars(hyper, 3, 0.5));
    for (size_t i = 0; i < sizes.size(); ++i) {
      const int64_t skew = static_cast<int64_t>(i % 5);
      const int64_t n = sizes[i] + skew;
      in_place.push_back(RandomState(format.state, n, rng));
      source.push_back(in_place.back());
      dest.push_back(RandomState(format.state, n, rng));  // garbage to be overwritten
      grads.emplace_back(static_cast<size_t>(n) * 2);
      for (int64_t e = 0; e < n; ++e) StoreFromF32(grads.back().data(), DType::kBF16, static_cast<size_t>(e), normal(rng));
      params_a.emplace_back(static_cast<size_t>(n) * DTypeSize(format.param));
      params_b.emplace_back(params_a.back().size());
    }
    for (size_t i = 0; i < sizes.size(); ++i) {
      const size_t skew = i % 5;
      const size_t ms = DTypeSize(format.state.master), vs = DTypeSize(format.state.moments);
      const size_t ps = DTypeSize(format.param);
      CpuAdamTensor t;
      t.numel = sizes[i];
      t.grad = grads[i].data() + skew * 2;
      t.grad_dtype = DType::kBF16;
      t.param_dtype = format.param;
      t.scalars = &scalars[0];
      t.state = format.state;
      t.rounding = StateRoundingKey{.tensor_key = 0x1234567 + i, .index0 = static_cast<int64_t>(1000 * i)};
      CpuAdamTensor ta = t, tb = t;
      ta.master = in_place[i].master() + skew * ms;
      ta.exp_avg = in_place[i].m() + skew * vs;
      ta.exp_avg_sq = in_place[i].v() + skew * vs;
      ta.param = params_a[i].data() + skew * ps;
      tb.master_src = source[i].master() + skew * ms;
      tb.exp_avg_src = source[i].m() + skew * vs;
      tb.exp_avg_sq_src = source[i].v() + skew * vs;
      tb.master = dest[i].master() + skew * ms;
      tb.exp_avg = dest[i].m() + skew * vs;
      tb.exp_avg_sq = dest[i].v() + skew * vs;
      tb.param = params_b[i].data() + skew * ps;
      a.push_back(ta);
      b.push_back(tb);
    }
    const std::vector<State> before = source;
    ASSERT_TRUE(adam.Step(a).ok());
    ASSERT_TRUE(adam.Step(b).ok());
    for (size_t i = 0; i < sizes.size(); ++i) {
      const size_t skew = i % 5;
      const size_t ms = DTypeSize(format.state.master), vs = DTypeSize(format.state.moments);
      const size_t n = static_cast<size_t>(sizes[i]);
      const std::string what = absl::StrFormat("%s, tensor %d", CpuAdamIsaName(isa), i);
      // The written range equals the in-place result; the source did not change at all.
      EXPECT_EQ(0, std::memcmp(dest[i].master() + skew * ms, in_place[i].master() + skew * ms, n * ms)) << what;
      EXPECT_EQ(0, std::memcmp(dest[i].m() + skew * vs, in_place[i].m() + skew * vs, n * vs)) << what;
      EXPECT_EQ(0, std::memcmp(dest[i].v() + skew * vs, in_place[i].v() + skew * vs, n * vs)) << what;
      EXPECT_EQ(params_a[i], params_b[i]) << what;
      EXPECT_EQ(source[i].buf, before[i].buf) << what;
      // And the update did something.
      EXPECT_NE(0, std::memcmp(dest[i].master() + skew * ms, const_cast<State&>(before[i]).master() + skew * ms, n * ms)) << what;
    }
  }
}

TEST(CpuAdamOutOfPlace, SomeSourcesButNotAllAreRefused) {
  ThreadPool pool(1);
  CpuAdam adam(&pool);
  std::vector<float> master(8, 1.0f), m(8), v(8), src(8);
  std::vector<uint16_t> grad(8, F32ToBF16(1.0f));
  AdamScalars s = MakeAdamScalars(AdamHyper{}, 1);
  CpuAdamTensor t;
  t.master = master.data();
  t.exp_avg = m.data();
  t.exp_avg_sq = v.data();
  t.grad = grad.data();
  t.grad_dtype = DType::kBF16;
  t.numel = 8;
  t.scalars = &s;
  t.master_src = src.data();
  const absl::Status st = adam.Step({&t, 1});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_EQ(master[0], 1.0f);
}

INSTANTIATE_TEST_SUITE_P(Paths, CpuAdamOutOfPlaceTest,
                         ::testing::Values(CpuAdamIsa::kScalar, CpuAdamIsa::kAvx2, CpuAdamIsa::kAvx512,
                                           CpuAdamIsa::kAvx512Bf16),
                         [](const ::testing::TestParamInfo<CpuAdamIsa>& p) {
                           return std::string(CpuAdamIsaName(p.param));
                         });

}  // namespace
}  // namespace ferry
