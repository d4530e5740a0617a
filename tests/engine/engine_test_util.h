// Helpers shared by the engine tests: a scratch directory, the shipped policies, and a model of bf16
// tensors (with grads) in device memory.
#ifndef FERRY_TESTS_ENGINE_ENGINE_TEST_UTIL_H_
#define FERRY_TESTS_ENGINE_ENGINE_TEST_UTIL_H_

#include <stdlib.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "ckpt/checkpoint.h"
#include "device/device.h"
#include "ferry/dtype.h"
#include "ferry/engine.h"
#include "gtest/gtest.h"
#include "temp_dir.h"

#define ASSERT_OK(expr)                          \
  do {                                           \
    absl::Status s_ = (expr);                    \
    ASSERT_TRUE(s_.ok()) << #expr << ": " << s_; \
  } while (0)

namespace ferry::engine_test {

// The shipped policies' directory, with a trailing slash.
inline std::string Policies() { return std::string(FERRY_SOURCE_DIR) + "/scripts/policies/"; }

// A fresh directory under the system's temporary directory, removed with everything in it.
using testing_util::TempDir;

// Every tensor of a checkpoint, by name.
inline std::map<std::string, std::string> ReadAll(const std::string& path) {
  std::map<std::string, std::string> out;
  absl::StatusOr<std::unique_ptr<CheckpointReader>> r = CheckpointReader::Open(path);
  EXPECT_TRUE(r.ok()) << r.status();
  if (!r.ok()) return out;
  for (const TensorEntry& t : (*r)->tensors()) {
    std::string bytes(t.bytes, '\0');
    EXPECT_TRUE((*r)->ReadTensor(t.name, bytes.data(), bytes.size()).ok()) << t.name;
    out[t.name] = std::move(bytes);
  }
  return out;
}

// A model of a few bf16 tensors in device memory, with grads, and random initial values.
class Model {
 public:
  Model(Device* device, std::vector<int64_t> sizes, uint64_t seed) : device_(device), sizes_(std::move(sizes)) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int64_t n : sizes_) {
      params_.push_back(*device_->Allocate(static_cast<size_t>(n) * 2));
      grads_.push_back(*device_->Allocate(static_cast<size_t>(n) * 2));
      std::vector<uint16_t> init(static_cast<size_t>(n));
      for (auto& v : init) v = F32ToBF16(normal(rng));
      EXPECT_TRUE(device_->Copy(params_.back().data(), init.data(), init.size() * 2, CopyKind::kHostToDevice).ok());
    }
  }
  size_t size() const { return sizes_.size(); }
  std::string name(size_t i) const { return absl::StrCat("p", i); }
  // Tensor i's param and grad in device memory (for an optimizer built without an engine).
  void* param_data(size_t i) { return params_[i].data(); }
  void* grad_data(size_t i) { return grads_[i].data(); }
  // Registers every tensor; tensor i is in group "g<i % groups>" (groups 0: "g<i>", a group each).
  absl::Status Register(Engine& e, size_t groups = 0) {
    if (groups == 0) groups = sizes_.size();
    std::vector<std::string> group_of;
    // (not "g" + to_string: GCC 12 -Wrestrict false positive)
    for (size_t i = 0; i < sizes_.size(); ++i) group_of.push_back(absl::StrCat("g", i % groups));
    return RegisterIn(e, group_of);
  }
  // Registers every tensor, in order; tensor i in group group_of[i].
  absl::Status RegisterIn(Engine& e, const std::vector<std::string>& group_of) {
    for (size_t i = 0; i < sizes_.size(); ++i) {
      ParamSpec spec;
      spec.name = name(i);
      spec.group = group_of.at(i);
      spec.shape = {sizes_[i]};
      spec.dtype = DType::kBF16;
      spec.param = params_[i].data();
      spec.grad = grads_[i].data();
      absl::Status s = e.AddParam(spec);
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }
  void SetGrads(uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (size_t i = 0; i < sizes_.size(); ++i) {
      std::vector<uint16_t> g(static_cast<size_t>(sizes_[i]));
      for (auto& v : g) v = F32ToBF16(normal(rng));
      ASSERT_TRUE(device_->Copy(grads_[i].data(), g.data(), g.size() * 2, CopyKind::kHostToDevice).ok());
    }
  }
  void PoisonGrad(size_t i, uint16_t value) {
    std::vector<uint16_t> g(static_cast<size_t>(sizes_[i]));
    ASSERT_TRUE(device_->Copy(g.data(), grads_[i].data(), g.size() * 2, CopyKind::kDeviceToHost).ok());
    g[g.size() / 2] = value;
    ASSERT_TRUE(device_->Copy(grads_[i].data(), g.data(), g.size() * 2, CopyKind::kHostToDevice).ok());
  }
  void ScaleGrads(float factor) {
    for (size_t i = 0; i < sizes_.size(); ++i) {
      std::vector<uint16_t> g = Grad(i);
      for (auto& v : g) v = F32ToBF16(BF16ToF32(v) * factor);
      ASSERT_TRUE(device_->Copy(grads_[i].data(), g.data(), g.size() * 2, CopyKind::kHostToDevice).ok());
    }
  }
  std::vector<uint16_t> Grad(size_t i) const {
    std::vector<uint16_t> h(static_cast<size_t>(sizes_[i]));
    EXPECT_TRUE(device_->Copy(h.data(), grads_[i].data(), h.size() * 2, CopyKind::kDeviceToHost).ok());
    return h;
  }
  std::vector<uint16_t> Param(size_t i) const {
    std::vector<uint16_t> h(static_cast<size_t>(sizes_[i]));
    EXPECT_TRUE(device_->Copy(h.data(), params_[i].data(), h.size() * 2, CopyKind::kDeviceToHost).ok());
    return h;
  }
  std::vector<std::vector<uint16_t>> Params() const {
    std::vector<std::vector<uint16_t>> out;
    for (size_t i = 0; i < size(); ++i) out.push_back(Param(i));
    return out;
  }
  void SetParam(size_t i, const std::vector<uint16_t>& h) {
    ASSERT_TRUE(device_->Copy(params_[i].data(), h.data(), h.size() * 2, CopyKind::kHostToDevice).ok());
  }

 private:
  Device* device_;
  std::vector<int64_t> sizes_;
  std::vector<DeviceBuffer> params_, grads_;
};

// An engine created with `o`, `model` registered (a group per tensor) and finalized. Failures fail the
// test with their reason; nullptr when the engine could not be created.
// An engine of `o` with the params `add` registers (e.g. Model::Register with a group count),
// finalized; each failure is a failed expectation (null when Create failed).
inline std::unique_ptr<Engine> MakeFinalizedEngine(const EngineOptions& o,
                                                   const std::function<absl::Status(Engine&)>& add) {
  absl::StatusOr<std::unique_ptr<Engine>> e = Engine::Create(o);
  EXPECT_TRUE(e.ok()) << e.status();
  if (!e.ok()) return nullptr;
  absl::Status s = add(**e);
  EXPECT_TRUE(s.ok()) << s;
  if (s.ok()) {
    s = (*e)->Finalize();
    EXPECT_TRUE(s.ok()) << s;
  }
  return *std::move(e);
}

inline std::unique_ptr<Engine> MakeFinalizedEngine(const EngineOptions& o, Model& model) {
  return MakeFinalizedEngine(o, [&](Engine& e) { return model.Register(e); });
}

// Each of `model`'s params, once `e` has uploaded it (WaitParamsOf), bit for bit `ref_model`'s after
// the same step.
inline ::testing::AssertionResult ParamsMatchAfterStep(Engine& e, const Model& model, const Model& ref_model,
                                                      int step) {
  for (size_t k = 0; k < model.size(); ++k) {
    if (absl::Status s = e.WaitParamsOf({model.name(k)}); !s.ok()) {
      return ::testing::AssertionFailure() << "step " << step << ", WaitParamsOf(" << model.name(k) << "): " << s;
    }
    if (model.Param(k) != ref_model.Param(k)) {
      return ::testing::AssertionFailure() << "step " << step << ", tensor " << k
                                           << " differs from the reference's (Step alone)";
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace ferry::engine_test

#endif  // FERRY_TESTS_ENGINE_ENGINE_TEST_UTIL_H_
