// A model of global tensors whose values are a pure function of (seed, param, element), so that any
// rank can produce its own shard of the params and grads without the rest: the multi-rank tests run
// the same global model with 1..4 ranks (threads with thread comms, or processes under mpirun) and
// compare bit for bit.
#ifndef FERRY_TESTS_ENGINE_SHARDED_MODEL_H_
#define FERRY_TESTS_ENGINE_SHARDED_MODEL_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "device/device.h"
#include "ferry/dtype.h"
#include "ferry/engine.h"

namespace ferry::engine_test {

struct GlobalParam {
  std::string name, group;
  int64_t numel = 0;
  DType dtype = DType::kBF16;
};

// A mixed model: bf16 and f32 params of uneven sizes in a few groups.
inline std::vector<GlobalParam> MixedModel() {
  return {{"embed", "embed", 5000, DType::kBF16}, {"l0.w", "l0", 3001, DType::kBF16}, {"l0.b", "biases", 17, DType::kF32},
          {"l1.w", "l1", 4096, DType::kBF16}, {"l1.b", "biases", 1, DType::kF32},   {"head", "head", 2500, DType::kF32}};
}

inline uint64_t SplitMix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A value in about [-scale, scale): the same for every world size.
inline float GlobalValue(uint64_t seed, size_t param, int64_t element, float scale) {
  const uint64_t h = SplitMix(seed * 0x100000001B3ull ^ (static_cast<uint64_t>(param) << 40) ^ static_cast<uint64_t>(element));
  return scale * (static_cast<float>(h >> 40) / static_cast<float>(1ull << 23) - 1.0f);
}

// Contiguous uneven ranges of [0, numel) for `world` ranks, some possibly empty; a pure function of
// the seed.
inline std::vector<std::pair<int64_t, int64_t>> RandomRanges(int64_t numel, int world, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> cuts = {0, numel};
  for (int r = 1; r < world; ++r) cuts.push_back(static_cast<int64_t>(rng() % static_cast<uint64_t>(numel + 1)));
  std::sort(cuts.begin(), cuts.end());
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int r = 0; r < world; ++r) out.emplace_back(cuts[static_cast<size_t>(r)], cuts[static_cast<size_t>(r) + 1]);
  return out;
}

// The ranges of rank `rank` of `world` for every param of MixedModel (world 1: everything).
inline std::vector<std::pair<int64_t, int64_t>> RangesOf(int rank, int world, uint64_t seed) {
  std::vector<std::pair<int64_t, int64_t>> out;
  const std::vector<GlobalParam> model = MixedModel();
  for (size_t i = 0; i < model.size(); ++i) {
    out.push_back(RandomRanges(model[i].numel, world, seed * 131 + i)[static_cast<size_t>(rank)]);
  }
  return out;
}

// One rank's shards of the global model, in device memory.
class ShardedModel {
 public:
  // ranges[i]: this rank's [begin, end) of param i.
  ShardedModel(Device* device, std::vector<GlobalParam> params, std::vector<std::pair<int64_t, int64_t>> ranges,
               uint64_t seed)
      : device_(device), params_(std::move(params)), ranges_(std::move(ranges)) {
    for (size_t i = 0; i < params_.size(); ++i) {
      const size_t bytes = static_cast<size_t>(local(i)) * DTypeSize(params_[i].dtype);
      param_.push_back(*device_->Allocate(bytes));
      grad_.push_back(*device_->Allocate(bytes));
      (void)Fill(param_.back(), i, seed, 1.0f, -1, 0.0f);
    }
  }
  int64_t local(size_t i) const { return ranges_[i].second - ranges_[i].first; }
  size_t size() const { return params_.size(); }
  const std::pair<int64_t, int64_t>& range(size_t i) const { return ranges_[i]; }

  absl::Status Register(Engine& e) const {
    for (size_t i = 0; i < params_.size(); ++i) {
      ParamSpec spec;
      spec.name = params_[i].name;
      spec.group = params_[i].group;
      spec.shape = {params_[i].numel};
      spec.dtype = params_[i].dtype;
      spec.param = local(i) > 0 ? param_[i].data() : nullptr;
      spec.grad = local(i) > 0 ? grad_[i].data() : nullptr;
      spec.shard_begin = ranges_[i].first;
      spec.shard_end = ranges_[i].second;
      absl::Status s = e.AddParam(spec);
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }

  // The grads of one step: global values from `seed` times `scale`; with inf_param >= 0, global
  // element inf_element of that param is +Inf (only the rank holding it sees it).
  absl::Status SetGrads(uint64_t seed, float scale, int inf_param = -1, int64_t inf_element = 0) {
    for (size_t i = 0; i < params_.size(); ++i) {
      const int64_t inf = static_cast<int>(i) == inf_param ? inf_element : -1;
      absl::Status s = Fill(grad_[i], i, seed, scale, inf, INFINITY);
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }

  // This rank's bytes of param i.
  std::vector<char> Param(size_t i) const {
    std::vector<char> h(static_cast<size_t>(local(i)) * DTypeSize(params_[i].dtype));
    if (!h.empty()) (void)device_->Copy(h.data(), param_[i].data(), h.size(), CopyKind::kDeviceToHost);
    return h;
  }

 private:
  absl::Status Fill(DeviceBuffer& buf, size_t i, uint64_t seed, float scale, int64_t special, float special_value) {
    const int64_t n = local(i);
    if (n == 0) return absl::OkStatus();
    const DType dt = params_[i].dtype;
    std::vector<char> h(static_cast<size_t>(n) * DTypeSize(dt));
    for (int64_t e = 0; e < n; ++e) {
      const int64_t global = ranges_[i].first + e;
      const float v = global == special ? special_value : GlobalValue(seed, i, global, scale);
      StoreFromF32(h.data(), dt, static_cast<size_t>(e), v);
    }
    return device_->Copy(buf.data(), h.data(), h.size(), CopyKind::kHostToDevice);
  }

  Device* device_;
  std::vector<GlobalParam> params_;
  std::vector<std::pair<int64_t, int64_t>> ranges_;
  std::vector<DeviceBuffer> param_, grad_;
};

// One rank of a multi-rank test: its device, its shards of the model and its engine.
struct Rank {
  std::unique_ptr<Device> device;
  std::unique_ptr<ShardedModel> model;
  std::unique_ptr<Engine> engine;
  int engine_rank = 0;  // this rank's index
};

}  // namespace ferry::engine_test

#endif  // FERRY_TESTS_ENGINE_SHARDED_MODEL_H_
