// CpuAdam with the param first and the state later (CpuAdamTensor::param_only and grad_copy): a pass
// that writes the new param and a copy of the grad but leaves the state as it was, followed by an
// in-place pass over the copied grad that writes the state and no param, gives the bits of the whole
// update, on every ISA path, every grad and param dtype, every alignment of the ranges and of the
// copy, over several steps. Arguments the kernels cannot honour are refused, changing nothing.
#include <cmath>
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

// 64-byte aligned bytes; `at(skew, esize)` points `skew` elements past the start.
struct Buffer {
  std::vector<char> bytes;
  size_t base = 0;
  explicit Buffer(size_t n) : bytes(n + 128) { base = (64 - reinterpret_cast<uintptr_t>(bytes.data()) % 64) % 64; }
  char* at(size_t skew, size_t esize) { return bytes.data() + base + skew * esize; }
};

// One tensor twice: `whole` updated by the whole update, `split` by the two passes.
struct Pair {
  int64_t n = 0;
  size_t skew = 0, copy_skew = 0;
  DType grad_dtype = DType::kBF16, param_dtype = DType::kBF16;
  Buffer whole_state, split_state, grad, copy, whole_param, split_param;
  Pair(int64_t numel, size_t s, size_t cs, DType g, DType p)
      : n(numel),
        skew(s),
        copy_skew(cs),
        grad_dtype(g),
        param_dtype(p),
        whole_state(12 * static_cast<size_t>(numel + 64)),
        split_state(12 * static_cast<size_t>(numel + 64)),
        grad(4 * static_cast<size_t>(numel + 64)),
        copy(4 * static_cast<size_t>(numel + 64)),
        whole_param(4 * static_cast<size_t>(numel + 64)),
        split_param(4 * static_cast<size_t>(numel + 64)) {}
  // master | m | v, each `skew` elements past a 64-byte boundary.
  float* state(Buffer& b, int which) {
    const size_t stride = (static_cast<size_t>(n) + 64) / 16 * 16;
    return reinterpret_cast<float*>(b.at(0, 4)) + static_cast<size_t>(which) * stride + skew;
  }
  CpuAdamTensor Tensor(Buffer& state_buf, const AdamScalars* s) {
    CpuAdamTensor t;
    t.master = state(state_buf, 0);
    t.exp_avg = state(state_buf, 1);
    t.exp_avg_sq = state(state_buf, 2);
    t.grad = grad.at(skew, DTypeSize(grad_dtype));
    t.numel = n;
    t.grad_dtype = grad_dtype;
    t.param_dtype = param_dtype;
    t.scalars = s;
    return t;
  }
  std::vector<char> StateBytes(Buffer& b) {
    std::vector<char> out;
    for (int k = 0; k < 3; ++k) {
      const char* p = reinterpret_cast<const char*>(state(b, k));
      out.insert(out.end(), p, p + 4 * n);
    }
    return out;
  }
};

class CpuAdamParamOnlyTest : public ::testing::TestWithParam<CpuAdamIsa> {};

TEST_P(CpuAdamParamOnlyTest, ParamFirstThenStateEqualsTheWholeUpdate) {
  const CpuAdamIsa isa = GetParam();
  if (!CpuSupportsAdamIsa(isa)) GTEST_SKIP() << "this CPU lacks " << CpuAdamIsaName(isa);
  ThreadPool pool(3);
  CpuAdam adam(&pool, CpuAdamOptions{.isa = isa, .block_elements = 1000});
  ASSERT_TRUE(adam.init_status().ok()) << adam.init_status();
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(absl::StrFormat("seed %d", seed));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // Sizes around the vector widths and the tasks' 1000 elements; the copy's skew against the param's
  // takes both the streaming and the ordinary stores.
  const std::vector<int64_t> sizes = {1, 7, 16, 33, 1000, 4099, 12345};
  const std::vector<std::pair<DType, DType>> dtypes = {
      {DType::kBF16, DType::kBF16}, {DType::kF32, DType::kF32}, {DType::kF16, DType::kF16},
      {DType::kF32, DType::kBF16}};
  std::vector<Pair> pairs;
  for (size_t i = 0; i < sizes.size() * dtypes.size(); ++i) {
    const auto [g, p] = dtypes[i % dtypes.size()];
    pairs.emplace_back(sizes[i / dtypes.size()], i % 5, i % 3 == 0 ? i % 5 : (i + 1) % 7, g, p);
    Pair& t = pairs.back();
    for (int k = 0; k < 3; ++k) {
      float* s = t.state(t.whole_state, k);
      const float scale = k == 0 ? 1.0f : k == 1 ? 0.1f : 0.01f;
      for (int64_t e = 0; e < t.n; ++e) s[e] = k == 2 ? scale * std::abs(normal(rng)) : scale * normal(rng);
      std::memcpy(t.state(t.split_state, k), s, 4 * static_cast<size_t>(t.n));
    }
  }
  std::vector<AdamScalars> scalars(2);
  for (int step = 1; step <= 3; ++step) {
    AdamHyper w;
    w.lr = 1e-2f;
    w.weight_decay = 0.05f;
    AdamHyper l2 = w;
    l2.mode = AdamMode::kAdamL2;
    scalars[0] = MakeAdamScalars(w, step, 0.5);
    scalars[1] = MakeAdamScalars(l2, step, 1.0);
    std::vector<CpuAdamTensor> whole, first, then;
    std::vector<std::vector<char>> state_before;
    for (size_t i = 0; i < pairs.size(); ++i) {
      Pair& t = pairs[i];
      const size_t gs = DTypeSize(t.grad_dtype), ps = DTypeSize(t.param_dtype);
      for (int64_t e = 0; e < t.n; ++e) {
        StoreFromF32(t.grad.at(t.skew, gs), t.grad_dtype, static_cast<size_t>(e), normal(rng));
      }
      std::memset(t.copy.bytes.data(), 0x5a, t.copy.bytes.size());
      const AdamScalars* s = &scalars[i % 2];
      CpuAdamTensor a = t.Tensor(t.whole_state, s);
      a.param = t.whole_param.at(t.skew, ps);
      whole.push_back(a);
      CpuAdamTensor b = t.Tensor(t.split_state, s);
      b.param = t.split_param.at(t.skew, ps);
      b.param_only = true;
      b.grad_copy = t.copy.at(t.copy_skew, gs);
      first.push_back(b);
      CpuAdamTensor c = t.Tensor(t.split_state, s);
      c.grad = b.grad_copy;
      then.push_back(c);
      state_before.push_back(t.StateBytes(t.split_state));
      EXPECT_EQ(CpuAdamTrafficBytes(b), static_cast<double>(t.n) * static_cast<double>(12 + 2 * gs + ps));
    }
    ASSERT_TRUE(adam.Step(whole).ok());
    ASSERT_TRUE(adam.Step(first).ok());
    for (size_t i = 0; i < pairs.size(); ++i) {
      Pair& t = pairs[i];
      const size_t gs = DTypeSize(t.grad_dtype), ps = DTypeSize(t.param_dtype), n = static_cast<size_t>(t.n);
      const std::string what = absl::StrFormat("%s, step %d, tensor %d (%d elements, grad %s, param %s, skews %d/%d)",
                                               CpuAdamIsaName(isa), step, i, t.n, DTypeName(t.grad_dtype),
                                               DTypeName(t.param_dtype), t.skew, t.copy_skew);
      EXPECT_EQ(0, std::memcmp(t.split_param.at(t.skew, ps), t.whole_param.at(t.skew, ps), n * ps)) << what;
      EXPECT_EQ(0, std::memcmp(t.copy.at(t.copy_skew, gs), t.grad.at(t.skew, gs), n * gs)) << what;
      // Not a byte of the copy's buffer outside its range.
      for (size_t k = 0; k < t.copy_skew * gs; ++k) ASSERT_EQ(t.copy.at(0, 1)[k], 0x5a) << what;
      EXPECT_EQ(t.copy.at(t.copy_skew, gs)[n * gs], 0x5a) << what;
      EXPECT_EQ(t.StateBytes(t.split_state), state_before[i]) << what << ": the first pass wrote the state";
    }
    ASSERT_TRUE(adam.Step(then).ok());
    for (size_t i = 0; i < pairs.size(); ++i) {
      Pair& t = pairs[i];
      const std::vector<char> whole_state = t.StateBytes(t.whole_state);
      EXPECT_EQ(t.StateBytes(t.split_state), whole_state)
          << CpuAdamIsaName(isa) << ", step " << step << ", tensor " << i;
      EXPECT_NE(whole_state, state_before[i]) << "the update changed nothing";
    }
  }
}

TEST(CpuAdamParamOnly, ArgumentsItCannotHonourAreRefusedChangingNothing) {
  ThreadPool pool(1);
  CpuAdam adam(&pool);
  std::vector<float> master(64, 1.0f), m(64, 0.5f), v(64, 0.25f), src(64), param(64, 7.0f), copy(64, 9.0f);
  std::vector<uint16_t> grad(64, F32ToBF16(1.0f)), bf16_state(64, F32ToBF16(0.5f));
  const AdamScalars s = MakeAdamScalars(AdamHyper{}, 1);
  CpuAdamTensor good;
  good.master = master.data();
  good.exp_avg = m.data();
  good.exp_avg_sq = v.data();
  good.grad = grad.data();
  good.grad_dtype = DType::kBF16;
  good.param = param.data();
  good.param_dtype = DType::kF32;
  good.numel = 64;
  good.scalars = &s;
  good.param_only = true;
  good.grad_copy = copy.data();
  struct Case {
    const char* what;
    CpuAdamTensor t;
  };
  std::vector<Case> cases;
  cases.push_back({"bf16 moments", good});
  cases.back().t.state.moments = DType::kBF16;
  cases.back().t.exp_avg = cases.back().t.exp_avg_sq = bf16_state.data();
  cases.push_back({"out of place", good});
  cases.back().t.master_src = cases.back().t.exp_avg_src = cases.back().t.exp_avg_sq_src = src.data();
  cases.push_back({"no param", good});
  cases.back().t.param = nullptr;
  cases.push_back({"a copy without param_only", good});
  cases.back().t.param_only = false;
  cases.push_back({"a copy over its grad", good});
  cases.back().t.grad_copy = grad.data() + 8;
  cases.push_back({"a misaligned copy", good});
  cases.back().t.grad_copy = reinterpret_cast<char*>(copy.data()) + 1;
  for (const Case& c : cases) {
    const absl::Status st = adam.Step({&c.t, 1});
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << c.what << ": " << st;
    EXPECT_EQ(master[0], 1.0f) << c.what;
    EXPECT_EQ(param[0], 7.0f) << c.what;
    EXPECT_EQ(copy[0], 9.0f) << c.what;
  }
  // And the good one runs: the param changes, the state does not.
  ASSERT_TRUE(adam.Step({&good, 1}).ok());
  EXPECT_NE(param[0], 7.0f);
  EXPECT_EQ(master[0], 1.0f);
  EXPECT_EQ(m[0], 0.5f);
  EXPECT_EQ(0, std::memcmp(copy.data(), grad.data(), grad.size() * sizeof(uint16_t)));
}

INSTANTIATE_TEST_SUITE_P(Paths, CpuAdamParamOnlyTest,
                         ::testing::Values(CpuAdamIsa::kScalar, CpuAdamIsa::kAvx2, CpuAdamIsa::kAvx512,
                                           CpuAdamIsa::kAvx512Bf16),
                         [](const ::testing::TestParamInfo<CpuAdamIsa>& p) {
                           return std::string(CpuAdamIsaName(p.param));
                         });

}  // namespace
}  // namespace ferry
