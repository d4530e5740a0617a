// The host side of samples/cpp/nccl_trainer: its flat layout and shards (flat_layout.h) and its exact
// gradient math (exact_math.h, the functions its CUDA kernels call). A host simulation of the
// trainer's step (the ranks' slices of the batch, the fixed-point sums, a reduce-scatter that adds the
// ranks in a different order per chunk as NCCL's ring does, an elementwise Adam on each rank's shard
// through the same pointer arithmetic as the sample's ParamSpecs, the all-gather) gives the same bits
// on 1, 2, 3 and 4 ranks, with a gradient that matches a float64 reference.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "exact_math.h"
#include "flat_layout.h"
#include "gtest/gtest.h"

namespace nccl_trainer {
namespace {

static_assert(kMaxTerm <= std::numeric_limits<int64_t>::max() / kMaxBatch, "a global sum could overflow");

TEST(NcclTrainerLayout, ShardsTileEveryTensorAndChunksAreAligned) {
  for (const Shape& shape : {Shape{}, Shape{.in = 3, .hidden = 5, .out = 2, .batch = 4},
                             Shape{.in = 77, .hidden = 129, .out = 1, .batch = 8}}) {
    const FlatLayout one = MakeLayout(shape, 1);
    for (int world : {1, 2, 3, 4, 8}) {
      const FlatLayout layout = MakeLayout(shape, world);
      ASSERT_EQ(layout.tensors.size(), 4u);
      EXPECT_EQ(layout.chunk % kAlign, 0);
      EXPECT_GE(layout.total(), layout.used);
      EXPECT_LT(layout.total() - layout.used, world * kAlign + layout.chunk);
      int64_t end = 0;
      for (size_t t = 0; t < layout.tensors.size(); ++t) {
        const TensorSlot& s = layout.tensors[t];
        EXPECT_EQ(s.offset, one.tensors[t].offset) << s.name << ": the offsets do not depend on the world size";
        EXPECT_EQ(s.offset % kAlign, 0) << s.name;
        EXPECT_GE(s.offset, end) << s.name;
        end = s.offset + s.numel;
        // Ferry's Finalize: the ranks' ranges, sorted, tile [0, numel) without overlap.
        std::vector<std::tuple<int64_t, int64_t, int>> ranges;
        for (int r = 0; r < world; ++r) {
          const auto [b, e] = layout.ShardOf(t, r);
          ASSERT_LE(b, e);
          ranges.emplace_back(b, e, r);
          if (b < e) {  // the shard lies inside the rank's chunk of the flat buffer
            EXPECT_GE(s.offset + b, layout.chunk_begin(r));
            EXPECT_LE(s.offset + e, layout.chunk_begin(r) + layout.chunk);
          }
        }
        std::sort(ranges.begin(), ranges.end());
        int64_t covered = 0;
        for (const auto& [b, e, r] : ranges) {
          EXPECT_EQ(b, covered) << s.name << " world " << world << " rank " << r;
          covered = e;
        }
        EXPECT_EQ(covered, s.numel) << s.name << " world " << world;
      }
      EXPECT_EQ(end, layout.used);
    }
  }
}

TEST(NcclTrainerLayout, TensorElementsDropThePadding) {
  const FlatLayout layout = MakeLayout({.in = 3, .hidden = 5, .out = 2, .batch = 4}, 3);
  std::vector<int64_t> flat(static_cast<size_t>(layout.total()), -1);
  int64_t next = 0;
  for (const TensorSlot& s : layout.tensors) {
    for (int64_t k = 0; k < s.numel; ++k) flat[s.offset + k] = next++;
  }
  const std::vector<int64_t> elements = TensorElements(layout, flat);
  ASSERT_EQ(static_cast<int64_t>(elements.size()), next);
  for (int64_t k = 0; k < next; ++k) EXPECT_EQ(elements[k], k);
}

TEST(NcclTrainerMath, QuantizeRoundsToNearestEvenAndSaturates) {
  EXPECT_EQ(Quantize(0.5f), int64_t{1} << 39);
  EXPECT_EQ(Quantize(-0.25f), -(int64_t{1} << 38));
  EXPECT_EQ(Quantize(std::ldexp(1.0f, -41)), 0);  // half of the last unit: to even (0)
  EXPECT_EQ(Quantize(std::ldexp(3.0f, -41)), 2);  // one and a half units: to even (2)
  EXPECT_EQ(Quantize(std::ldexp(1.0f, -42)), 0);
  EXPECT_EQ(Quantize(5000.0f), kMaxTerm);
  EXPECT_EQ(Quantize(-std::numeric_limits<float>::infinity()), -kMaxTerm);
  EXPECT_EQ(Quantize(std::numeric_limits<float>::quiet_NaN()), 0);
  for (float v : {0.123456f, -3.5e-3f, 1.0e-7f, 4095.0f}) {
    EXPECT_NEAR(Dequantize(Quantize(v) * 8, 8), v, std::ldexp(1.0, -40) + std::abs(v) * 1e-7) << v;
  }
}

// One step of the sample on the host: every rank's fixed-point sums over its slice of the batch.
struct HostGrads {
  std::vector<std::vector<int64_t>> per_rank;  // [rank][flat element]
  double squared_error = 0;
  std::vector<double> reference;  // float64 gradient of the loss, [flat element] (tensor elements only)
};

HostGrads Backward(const Shape& sh, const FlatLayout& layout, const std::vector<uint16_t>& params) {
  HostGrads g;
  g.per_rank.assign(layout.world, std::vector<int64_t>(static_cast<size_t>(layout.total()), 0));
  g.reference.assign(static_cast<size_t>(layout.total()), 0.0);
  const uint16_t* w1 = params.data() + layout.tensors[0].offset;
  const uint16_t* b1 = params.data() + layout.tensors[1].offset;
  const uint16_t* w2 = params.data() + layout.tensors[2].offset;
  const uint16_t* b2 = params.data() + layout.tensors[3].offset;
  const int64_t count = sh.batch / layout.world, I = sh.in, H = sh.hidden, O = sh.out;
  for (int r = 0; r < layout.world; ++r) {
    std::vector<float> x(count * I), h(count * H), dout(count * O), dz(count * H);
    for (int64_t b = 0; b < count; ++b) {
      for (int64_t i = 0; i < I; ++i) x[b * I + i] = Input(r * count + b, i);
      for (int64_t j = 0; j < H; ++j) h[b * H + j] = Hidden(w1, b1, x.data(), I, b, j);
      for (int64_t o = 0; o < O; ++o) {
        dout[b * O + o] = Output(w2, b2, h.data(), H, b, o) - Target(x.data() + b * I, I, o);
        g.squared_error += double{dout[b * O + o]} * dout[b * O + o];
      }
      for (int64_t j = 0; j < H; ++j) dz[b * H + j] = HiddenDelta(dout.data(), w2, h.data(), H, O, b, j);
    }
    int64_t* q = g.per_rank[r].data();
    for (int64_t o = 0; o < O; ++o) {
      for (int64_t j = 0; j < H; ++j) q[layout.tensors[2].offset + o * H + j] = WeightGradTerms(dout.data(), h.data(), count, O, H, o, j);
      q[layout.tensors[3].offset + o] = BiasGradTerms(dout.data(), count, O, o);
    }
    for (int64_t j = 0; j < H; ++j) {
      for (int64_t i = 0; i < I; ++i) q[layout.tensors[0].offset + j * I + i] = WeightGradTerms(dz.data(), x.data(), count, H, I, j, i);
      q[layout.tensors[1].offset + j] = BiasGradTerms(dz.data(), count, H, j);
    }
    // The float64 reference of the loss (1 / 2B) sum (out - y)^2, from the same params and data.
    for (int64_t b = 0; b < count; ++b) {
      std::vector<double> hd(H), dzd(H), dd(O);
      for (int64_t j = 0; j < H; ++j) {
        double z = Bf16ToF32(b1[j]);
        for (int64_t i = 0; i < I; ++i) z += double{Bf16ToF32(w1[j * I + i])} * x[b * I + i];
        hd[j] = std::tanh(z);
      }
      for (int64_t o = 0; o < O; ++o) {
        double z = Bf16ToF32(b2[o]);
        for (int64_t j = 0; j < H; ++j) z += double{Bf16ToF32(w2[o * H + j])} * hd[j];
        dd[o] = (z - Target(x.data() + b * I, I, o)) / static_cast<double>(sh.batch);
      }
      for (int64_t j = 0; j < H; ++j) {
        double s = 0;
        for (int64_t o = 0; o < O; ++o) s += dd[o] * Bf16ToF32(w2[o * H + j]);
        dzd[j] = s * (1 - hd[j] * hd[j]);
      }
      for (int64_t o = 0; o < O; ++o) {
        for (int64_t j = 0; j < H; ++j) g.reference[layout.tensors[2].offset + o * H + j] += dd[o] * hd[j];
        g.reference[layout.tensors[3].offset + o] += dd[o];
      }
      for (int64_t j = 0; j < H; ++j) {
        for (int64_t i = 0; i < I; ++i) g.reference[layout.tensors[0].offset + j * I + i] += dzd[j] * x[b * I + i];
        g.reference[layout.tensors[1].offset + j] += dzd[j];
      }
    }
  }
  return g;
}

struct Simulated {
  std::vector<uint16_t> tensors;  // TensorElements of the final params
  std::vector<float> state;       // ... and of the fp32 masters, first and second moments
  double first_loss = 0, last_loss = 0;
  double worst_grad_error = 0;  // max |grad - float64 reference| / max |reference|, over the steps
};

// `steps` steps of the sample on `world` simulated ranks; Adam in fp32 on each rank's shards.
Simulated Simulate(const Shape& sh, int world, int64_t steps) {
  const FlatLayout layout = MakeLayout(sh, world);
  std::vector<uint16_t> params = InitialParams(layout);
  std::vector<float> master(params.size()), m(params.size(), 0.0f), v(params.size(), 0.0f);
  for (size_t k = 0; k < params.size(); ++k) master[k] = Bf16ToF32(params[k]);
  Simulated out;
  for (int64_t step = 1; step <= steps; ++step) {
    const HostGrads g = Backward(sh, layout, params);
    const double loss = g.squared_error / (2.0 * static_cast<double>(sh.batch));
    if (step == 1) out.first_loss = loss;
    out.last_loss = loss;
    // Reduce-scatter: rank r's chunk, the ranks added starting at rank r + 1 (a ring's order).
    std::vector<std::vector<float>> grad(world, std::vector<float>(static_cast<size_t>(layout.chunk)));
    for (int r = 0; r < world; ++r) {
      for (int64_t k = 0; k < layout.chunk; ++k) {
        int64_t sum = 0;
        for (int i = 1; i <= world; ++i) sum += g.per_rank[(r + i) % world][layout.chunk_begin(r) + k];
        grad[r][k] = Dequantize(sum, sh.batch);
      }
    }
    double worst = 0, scale = 0, norm2 = 0;
    for (const TensorSlot& s : layout.tensors) {
      for (int64_t k = s.offset; k < s.offset + s.numel; ++k) {
        const int64_t r = k / layout.chunk;
        const double got = grad[r][k - layout.chunk_begin(r)];
        worst = std::max(worst, std::abs(got - g.reference[k]));
        scale = std::max(scale, std::abs(g.reference[k]));
        norm2 += got * got;  // in flat order: the same sum whatever the world size
      }
    }
    out.worst_grad_error = std::max(out.worst_grad_error, worst / scale);
    const float clip = norm2 > 1.0 ? static_cast<float>(1.0 / std::sqrt(norm2)) : 1.0f;
    const float lr = 2e-3f * (1.0f - 0.5f * static_cast<float>(step - 1) / static_cast<float>(steps));
    const float c1 = 1.0f - std::pow(0.9f, static_cast<float>(step)), c2 = 1.0f - std::pow(0.999f, static_cast<float>(step));
    // Each rank steps the parts of the tensors in its chunk, addressed as the sample's ParamSpecs are.
    for (int r = 0; r < world; ++r) {
      for (size_t t = 0; t < layout.tensors.size(); ++t) {
        const auto [b, e] = layout.ShardOf(t, r);
        const int64_t at = layout.tensors[t].offset + b;
        const float* gs = grad[r].data() + (at - layout.chunk_begin(r));
        for (int64_t k = 0; k < e - b; ++k) {
          const float gk = gs[k] * clip;
          float& w = master[at + k];
          m[at + k] = 0.9f * m[at + k] + 0.1f * gk;
          v[at + k] = 0.999f * v[at + k] + 0.001f * gk * gk;
          w = w * (1.0f - lr * 0.01f) - lr * (m[at + k] / c1) / (std::sqrt(v[at + k] / c2) + 1e-8f);
          params[at + k] = F32ToBf16(w);  // into this rank's chunk of the full params
        }
      }
    }
    // The all-gather: one shared full buffer here, every chunk already in place.
  }
  out.tensors = TensorElements(layout, params);
  for (const std::vector<float>* f : {&master, &m, &v}) {
    const std::vector<float> e = TensorElements(layout, *f);
    out.state.insert(out.state.end(), e.begin(), e.end());
  }
  return out;
}

TEST(NcclTrainerMath, SameBitsOnOneToFourRanksAndTheGradientIsRight) {
  const Shape shape{.in = 24, .hidden = 40, .out = 6, .batch = 12};
  const Simulated one = Simulate(shape, 1, 12);
  EXPECT_LT(one.worst_grad_error, 1e-4) << "the fixed-point gradient against float64";
  EXPECT_LT(one.last_loss, 0.9 * one.first_loss) << one.first_loss << " -> " << one.last_loss;
  for (int world : {2, 3, 4}) {
    const Simulated many = Simulate(shape, world, 12);
    EXPECT_EQ(many.tensors, one.tensors) << world << " ranks";
    // The fp32 state too: bf16 params alone could hide a last-bit difference in the grads.
    ASSERT_EQ(many.state.size(), one.state.size());
    EXPECT_EQ(0, std::memcmp(many.state.data(), one.state.data(), one.state.size() * sizeof(float)))
        << world << " ranks";
    EXPECT_NEAR(many.last_loss, one.last_loss, 1e-9 * one.last_loss) << world << " ranks";
  }
}

}  // namespace
}  // namespace nccl_trainer
