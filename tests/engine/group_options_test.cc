// Per-group optimizer settings (Engine::AddGroup): weight decay, lr scale, betas, eps and Adam/AdamW
// per group, checked against a float64 Adam on fresh random data with CPU, GPU and mixed placements
// (bit-identical between them); bad settings refused with nothing changed; the settings recorded in
// checkpoints and their differences reported on load; checkpoints of the format before them load.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "ckpt/checkpoint.h"
#include "device/device.h"
#include "engine/engine_test_util.h"
#include "ferry/engine.h"
#include "ferry/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ferry::engine_test {
namespace {

using ::testing::HasSubstr;

// The engine's defaults in these tests; groups override parts of them.
constexpr float kLr = 1e-2f;
constexpr float kWeightDecay = 0.1f;

// fp32 params (so the param is the master, compared without rounding) in device memory.
struct F32Param {
  std::string name, group;
  int64_t numel;
};

const std::vector<F32Param> kParams = {
    {"l0.w", "weights", 4099}, {"l0.b", "no_decay", 65},   {"l1.w", "weights", 1000},
    {"l1.b", "no_decay", 7},   {"norm.w", "norm", 513},    {"norm.b", "norm", 3},
    {"head", "head_l2", 2000}, {"embed", "embed_slow", 1500},
};

// The groups' settings: no weight decay for biases, other betas and eps for the norms with a larger
// lr, Adam with L2 for the head, a slower embedding with its own decay. "weights" uses the defaults.
std::map<std::string, GroupOptions> Groups() {
  return {
      {"no_decay", {.weight_decay = 0.0f}},
      {"norm", {.lr_scale = 2.0f, .weight_decay = 0.0f, .beta1 = 0.8f, .beta2 = 0.95f, .eps = 1e-3f}},
      {"head_l2", {.weight_decay = 0.05f, .adamw = false}},
      {"embed_slow", {.lr_scale = 0.25f, .weight_decay = 0.01f, .beta2 = 0.99f}},
  };
}

class F32Model {
 public:
  F32Model(Device* device, uint64_t seed) : device_(device) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (const F32Param& p : kParams) {
      params_.push_back(*device_->Allocate(static_cast<size_t>(p.numel) * 4));
      grads_.push_back(*device_->Allocate(static_cast<size_t>(p.numel) * 4));
      std::vector<float> init(static_cast<size_t>(p.numel));
      for (float& v : init) v = normal(rng);
      EXPECT_TRUE(device_->Copy(params_.back().data(), init.data(), init.size() * 4, CopyKind::kHostToDevice).ok());
    }
  }
  absl::Status Register(Engine& e) {
    for (size_t i = 0; i < kParams.size(); ++i) {
      FERRY_RETURN_IF_ERROR(e.AddParam({.name = kParams[i].name, .group = kParams[i].group, .shape = {kParams[i].numel},
                                        .dtype = DType::kF32, .param = params_[i].data(), .grad = grads_[i].data()}));
    }
    return absl::OkStatus();
  }
  // Fresh normal grads for every param (never zeros); returns them.
  std::vector<std::vector<float>> SetGrads(uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<std::vector<float>> out;
    for (size_t i = 0; i < kParams.size(); ++i) {
      std::vector<float> g(static_cast<size_t>(kParams[i].numel));
      for (float& v : g) v = normal(rng);
      EXPECT_TRUE(device_->Copy(grads_[i].data(), g.data(), g.size() * 4, CopyKind::kHostToDevice).ok());
      out.push_back(std::move(g));
    }
    return out;
  }
  std::vector<float> Param(size_t i) const {
    std::vector<float> h(static_cast<size_t>(kParams[i].numel));
    EXPECT_TRUE(device_->Copy(h.data(), params_[i].data(), h.size() * 4, CopyKind::kDeviceToHost).ok());
    return h;
  }
  size_t size() const { return kParams.size(); }

 private:
  Device* device_;
  std::vector<DeviceBuffer> params_, grads_;
};

// Adam/AdamW in float64 (torch's formulas) over one param's elements.
struct RefAdam {
  std::vector<double> p, m, v;
  void Step(const GroupOptions& o, double lr, int64_t t, const std::vector<float>& grad) {
    const double b1 = *o.beta1, b2 = *o.beta2, eps = *o.eps, wd = *o.weight_decay;
    const double bc1 = 1.0 - std::pow(b1, static_cast<double>(t)), bc2 = 1.0 - std::pow(b2, static_cast<double>(t));
    for (size_t k = 0; k < p.size(); ++k) {
      double g = grad[k];
      if (!*o.adamw) g += wd * p[k];
      m[k] = b1 * m[k] + (1.0 - b1) * g;
      v[k] = b2 * v[k] + (1.0 - b2) * g * g;
      double update = (m[k] / bc1) / (std::sqrt(v[k]) / std::sqrt(bc2) + eps);
      if (*o.adamw) update += wd * p[k];
      p[k] -= lr * update;
    }
  }
};

class GroupOptionsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Device>> d = CreateDevice();
    ASSERT_TRUE(d.ok()) << d.status();
    device_ = *std::move(d);
  }
  EngineOptions Options(const std::string& policy, std::map<std::string, std::string> args = {}) {
    EngineOptions o;
    o.policy_path = policy.empty() ? "" : Policies() + policy;
    o.policy_args = std::move(args);
    o.optimizer.lr = kLr;
    o.optimizer.weight_decay = kWeightDecay;
    o.transfer_chunk_bytes = 4096;  // many pipeline chunks, tensors straddling them
    o.device = std::string(BackendName(device_->backend()));
    return o;
  }
  // An engine over `model` with Groups() (when `with_groups`), finalized.
  std::unique_ptr<Engine> Make(F32Model& model, const std::string& policy, bool with_groups = true,
                               std::map<std::string, std::string> args = {}) {
    absl::StatusOr<std::unique_ptr<Engine>> e = Engine::Create(Options(policy, std::move(args)));
    EXPECT_TRUE(e.ok()) << e.status();
    if (!e.ok()) return nullptr;
    if (with_groups) {
      for (const auto& [name, o] : Groups()) EXPECT_TRUE((*e)->AddGroup(name, o).ok()) << name;
    }
    EXPECT_TRUE(model.Register(**e).ok());
    absl::Status s = (*e)->Finalize();
    EXPECT_TRUE(s.ok()) << s;
    return *std::move(e);
  }
  std::unique_ptr<Device> device_;
  TempDir tmp_{"ferry-groups"};
};

// Every group steps with its own settings, matching a float64 Adam; every placement (all offloaded,
// all on the device, half and half in one engine) gives the same bits.
TEST_F(GroupOptionsTest, PerGroupSettingsMatchFloat64ReferenceOnEveryPlacement) {
  constexpr uint64_t kSeed = 42;
  F32Model cpu_model(device_.get(), kSeed), gpu_model(device_.get(), kSeed), mixed_model(device_.get(), kSeed);
  auto cpu = Make(cpu_model, "offload_all.lua");
  auto gpu = Make(gpu_model, "all_gpu.lua");
  auto mixed = Make(mixed_model, "offload_fraction.lua", true, {{"fraction", "0.5"}});
  ASSERT_TRUE(cpu && gpu && mixed);
  size_t mixed_cpu = 0, mixed_gpu = 0;
  for (const GroupPlacement& g : mixed->Placement()) (g.offloaded ? mixed_cpu : mixed_gpu) += 1;
  EXPECT_GT(mixed_cpu, 0u);
  EXPECT_GT(mixed_gpu, 0u);

  // The settings each group runs with, as Placement reports them.
  std::map<std::string, GroupOptions> resolved;
  for (const GroupPlacement& g : cpu->Placement()) resolved[g.group] = g.options;
  ASSERT_EQ(resolved.size(), 5u);
  EXPECT_EQ(*resolved["weights"].weight_decay, kWeightDecay);
  EXPECT_EQ(*resolved["weights"].lr_scale, 1.0f);
  EXPECT_EQ(*resolved["no_decay"].weight_decay, 0.0f);
  EXPECT_EQ(*resolved["no_decay"].beta1, 0.9f);
  EXPECT_EQ(*resolved["norm"].beta2, 0.95f);
  EXPECT_FALSE(*resolved["head_l2"].adamw);

  std::vector<RefAdam> ref(kParams.size());
  for (size_t i = 0; i < kParams.size(); ++i) {
    std::vector<float> p0 = cpu_model.Param(i);
    ref[i].p.assign(p0.begin(), p0.end());
    ref[i].m.assign(p0.size(), 0.0);
    ref[i].v.assign(p0.size(), 0.0);
  }
  constexpr int kSteps = 12;
  for (int step = 1; step <= kSteps; ++step) {
    const float lr = kLr * (1.0f + 0.05f * static_cast<float>(step));  // a schedule: StepOptions::lr
    const std::vector<std::vector<float>> grads = cpu_model.SetGrads(1000 + static_cast<uint64_t>(step));
    gpu_model.SetGrads(1000 + static_cast<uint64_t>(step));
    mixed_model.SetGrads(1000 + static_cast<uint64_t>(step));
    ASSERT_OK(cpu->Step({.lr = lr}));
    ASSERT_OK(gpu->Step({.lr = lr}));
    ASSERT_OK(mixed->Step({.lr = lr}));
    for (size_t i = 0; i < kParams.size(); ++i) {
      const GroupOptions& o = resolved[kParams[i].group];
      ref[i].Step(o, static_cast<double>(lr) * static_cast<double>(*o.lr_scale), step, grads[i]);
    }
  }
  ASSERT_OK(cpu->Synchronize());
  ASSERT_OK(gpu->Synchronize());
  ASSERT_OK(mixed->Synchronize());
  for (size_t i = 0; i < kParams.size(); ++i) {
    const std::vector<float> got = cpu_model.Param(i);
    EXPECT_EQ(0, std::memcmp(got.data(), gpu_model.Param(i).data(), got.size() * 4)) << kParams[i].name << ": cpu vs gpu";
    EXPECT_EQ(0, std::memcmp(got.data(), mixed_model.Param(i).data(), got.size() * 4)) << kParams[i].name << ": cpu vs mixed";
    double worst = 0.0;
    for (size_t k = 0; k < got.size(); ++k) {
      // fp32 rounding over 12 steps of size ~lr: far below the effect of any setting (wd * lr * p is
      // ~1e-3 per step; a wrong lr scale or beta moves a param by ~1e-3, the norms' eps by ~2e-5).
      const double err = std::fabs(static_cast<double>(got[k]) - ref[i].p[k]);
      worst = std::max(worst, err / (2e-6 + 2e-6 * std::fabs(ref[i].p[k])));
    }
    EXPECT_LE(worst, 1.0) << kParams[i].name << " (group " << kParams[i].group << "): off the float64 reference";
  }
  // The settings matter: the same run with the engine's defaults for every group differs in every
  // group that has its own settings.
  F32Model plain_model(device_.get(), kSeed);
  auto plain = Make(plain_model, "all_gpu.lua", /*with_groups=*/false);
  ASSERT_TRUE(plain);
  for (int step = 1; step <= kSteps; ++step) {
    plain_model.SetGrads(1000 + static_cast<uint64_t>(step));
    ASSERT_OK(plain->Step({.lr = kLr * (1.0f + 0.05f * static_cast<float>(step))}));
  }
  ASSERT_OK(plain->Synchronize());
  for (size_t i = 0; i < kParams.size(); ++i) {
    const bool own = kParams[i].group != "weights";
    EXPECT_EQ(own, plain_model.Param(i) != cpu_model.Param(i)) << kParams[i].name;
  }
}

// AddGroup before or after the group's params; bad settings and names are refused with nothing
// changed.
TEST_F(GroupOptionsTest, BadSettingsAreRefusedAndChangeNothing) {
  F32Model model(device_.get(), 3);
  absl::StatusOr<std::unique_ptr<Engine>> made = Engine::Create(Options("all_gpu.lua"));
  ASSERT_TRUE(made.ok()) << made.status();
  Engine& e = **made;
  struct Bad {
    GroupOptions options;
    std::string message;
  };
  const std::vector<Bad> bad = {
      {{.weight_decay = -0.01f}, "weight_decay is -0.01; it must be >= 0"},
      {{.beta1 = 1.0f}, "beta1 is 1; it must be in [0, 1)"},
      {{.beta2 = -0.5f}, "beta2 is -0.5; it must be in [0, 1)"},
      {{.beta2 = 1.5f}, "beta2 is 1.5"},
      {{.eps = 0.0f}, "eps is 0; it must be > 0"},
      {{.lr_scale = -1.0f}, "lr_scale is -1"},
      {{.lr_scale = std::nanf("")}, "lr_scale is nan"},
      {{.weight_decay = INFINITY}, "weight_decay is inf"},
  };
  for (const Bad& b : bad) {
    absl::Status s = e.AddGroup("no_decay", b.options);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << b.message << ": " << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(b.message));
    EXPECT_THAT(std::string(s.message()), HasSubstr("AddGroup('no_decay')"));
  }
  EXPECT_EQ(e.AddGroup("", {}).code(), absl::StatusCode::kInvalidArgument);
  // Nothing was recorded: the group can still be given its settings, once.
  ASSERT_OK(e.AddGroup("no_decay", {.weight_decay = 0.0f}));
  EXPECT_EQ(e.AddGroup("no_decay", {.weight_decay = 0.0f}).code(), absl::StatusCode::kAlreadyExists);

  // Options by name (the bindings' path): an unknown name or a bad value leaves the options unchanged.
  GroupOptions o;
  ASSERT_OK(SetGroupOption(o, "weight_decay", 0.5));
  absl::Status s = SetGroupOption(o, "weight_decay_typo", 0.0);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("unknown group option 'weight_decay_typo' (known: lr_scale, "
                                                  "weight_decay, beta1, beta2, eps, adamw)"));
  EXPECT_EQ(SetGroupOption(o, "weight_decay", -1.0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SetGroupOption(o, "beta2", 1.0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SetGroupOption(o, "adamw", 2.0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(*o.weight_decay, 0.5f);
  EXPECT_FALSE(o.beta2.has_value());
  EXPECT_FALSE(o.adamw.has_value());

  // A group given settings that no param joined fails Finalize; after adding a param to it, Finalize
  // succeeds. Then AddGroup is too late.
  ASSERT_OK(e.AddGroup("norm", {.beta1 = 0.5f}));
  ASSERT_OK(model.Register(e));
  ASSERT_OK(e.AddGroup("orphan", {.lr_scale = 3.0f}));
  s = e.Finalize();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("AddGroup('orphan') gave options to a group that no param joined"));
  DeviceBuffer buf = *device_->Allocate(64);
  ASSERT_OK(e.AddParam({.name = "orphan.w", .group = "orphan", .shape = {4}, .dtype = DType::kF32, .param = buf.data(),
                        .grad = buf.data()}));
  ASSERT_OK(e.Finalize());
  EXPECT_EQ(e.AddGroup("late", {}).code(), absl::StatusCode::kFailedPrecondition);
  std::map<std::string, GroupOptions> resolved;
  for (const GroupPlacement& g : e.Placement()) resolved[g.group] = g.options;
  EXPECT_EQ(*resolved["orphan"].lr_scale, 3.0f);
  EXPECT_EQ(*resolved["norm"].beta1, 0.5f);
  EXPECT_EQ(*resolved["norm"].weight_decay, kWeightDecay);  // the engine's default where the group gave none
  EXPECT_EQ(*resolved["no_decay"].weight_decay, 0.0f);

  // The engine's defaults are checked the same way.
  EngineOptions bad_defaults = Options("");
  bad_defaults.optimizer.beta2 = 1.0f;
  absl::StatusOr<std::unique_ptr<Engine>> refused = Engine::Create(bad_defaults);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("EngineOptions::optimizer: beta2 is 1"));
}

// `json` without its "ferry.group.<group>.optimizer" entries (each followed by another entry); the
// number removed in *removed.
std::string WithoutGroupSettings(const std::string& json, size_t* removed) {
  std::string out;
  size_t at = 0;
  for (size_t key = json.find("\"ferry.group."); key != std::string::npos; key = json.find("\"ferry.group.", at)) {
    const size_t key_end = json.find('"', key + 1);
    if (json.compare(key_end - 10, 10, ".optimizer") != 0) {
      out += json.substr(at, key_end + 1 - at);
      at = key_end + 1;
      continue;
    }
    const size_t value_end = json.find('"', json.find('"', key_end + 1) + 1);
    out += json.substr(at, key - at);
    at = json.find('"', value_end + 1);  // past the comma: at the next entry's key
    ++*removed;
  }
  return out + json.substr(at);
}

// Turns a checkpoint into one of the format before per-group settings: their metadata removed from
// the manifest and from the safetensors header (padded with spaces to its length, so every data
// offset stays valid).
void StripGroupSettings(const std::string& dir) {
  auto read = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  size_t removed = 0;
  const std::string manifest = WithoutGroupSettings(read(dir + "/manifest.json"), &removed);
  ASSERT_EQ(removed, 5u);
  std::ofstream(dir + "/manifest.json", std::ios::binary | std::ios::trunc) << manifest;
  std::string file = read(dir + "/rank-00000.safetensors");
  uint64_t n = 0;
  std::memcpy(&n, file.data(), 8);
  std::string header = WithoutGroupSettings(file.substr(8, n), &removed);
  ASSERT_EQ(removed, 10u);
  ASSERT_LT(header.size(), n);
  header.resize(n, ' ');
  file.replace(8, n, header);
  std::ofstream(dir + "/rank-00000.safetensors", std::ios::binary | std::ios::trunc) << file;
}

// The settings are recorded per group; a load reports every one that differs (and keeps the
// engine's); the same settings report nothing; a checkpoint of the format before them loads.
TEST_F(GroupOptionsTest, CheckpointsRecordSettingsAndLoadsReportDifferences) {
  F32Model model(device_.get(), 9);
  auto e = Make(model, "offload_fraction.lua", true, {{"fraction", "0.5"}});
  ASSERT_TRUE(e);
  for (int step = 1; step <= 3; ++step) {
    model.SetGrads(50 + static_cast<uint64_t>(step));
    ASSERT_OK(e->Step());
  }
  absl::StatusOr<std::string> dir = e->SaveCheckpoint(tmp_.path() + "/ck", 3);
  ASSERT_TRUE(dir.ok()) << dir.status();
  {
    absl::StatusOr<std::unique_ptr<CheckpointReader>> r = CheckpointReader::Open(*dir);
    ASSERT_TRUE(r.ok()) << r.status();
    const auto& md = (*r)->metadata();
    ASSERT_TRUE(md.contains("ferry.group.norm.optimizer"));
    EXPECT_EQ(md.at("ferry.group.norm.optimizer"),
              "adamw=1 lr_scale=2 weight_decay=0 beta1=0.8 beta2=0.95 eps=0.001 bias_correction=1");
    EXPECT_EQ(md.at("ferry.group.weights.optimizer"),
              "adamw=1 lr_scale=1 weight_decay=0.1 beta1=0.9 beta2=0.999 eps=1e-08 bias_correction=1");
  }
  // The same settings: nothing to report.
  ASSERT_OK(e->LoadCheckpoint(*dir));
  EXPECT_EQ(e->LastLoad().dir, *dir);
  EXPECT_TRUE(e->LastLoad().optimizer_differences.empty());

  // Changed settings: each difference reported, naming group, field and both values.
  F32Model other_model(device_.get(), 9);
  absl::StatusOr<std::unique_ptr<Engine>> other = Engine::Create(Options("all_gpu.lua"));
  ASSERT_TRUE(other.ok());
  std::map<std::string, GroupOptions> changed = Groups();
  changed["no_decay"].weight_decay = 0.01f;
  changed["norm"].beta2 = 0.98f;
  changed["head_l2"].adamw = true;
  for (const auto& [name, o] : changed) ASSERT_OK((*other)->AddGroup(name, o));
  ASSERT_OK(other_model.Register(**other));
  ASSERT_OK((*other)->Finalize());
  ASSERT_OK((*other)->LoadCheckpoint(*dir));
  EXPECT_THAT((*other)->LastLoad().optimizer_differences,
              ::testing::UnorderedElementsAre("group 'no_decay': weight_decay 0 in the checkpoint, 0.01 in this engine",
                                              "group 'norm': beta2 0.95 in the checkpoint, 0.98 in this engine",
                                              "group 'head_l2': adamw 0 in the checkpoint, 1 in this engine"));
  // The engine keeps its own settings.
  for (const GroupPlacement& g : (*other)->Placement()) {
    if (g.group == "no_decay") {
      EXPECT_EQ(*g.options.weight_decay, 0.01f);
    }
  }
  // Loaded values are the checkpoint's.
  for (size_t i = 0; i < model.size(); ++i) EXPECT_EQ(other_model.Param(i), model.Param(i)) << kParams[i].name;

  // The format before per-group settings: loads, nothing compared.
  StripGroupSettings(*dir);
  {
    absl::StatusOr<std::unique_ptr<CheckpointReader>> r = CheckpointReader::Open(*dir);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_FALSE((*r)->metadata().contains("ferry.group.norm.optimizer"));
    EXPECT_TRUE((*r)->metadata().contains("ferry.group.norm.step"));
  }
  ASSERT_OK((*other)->LoadCheckpoint(*dir));
  EXPECT_TRUE((*other)->LastLoad().optimizer_differences.empty());
  for (size_t i = 0; i < model.size(); ++i) EXPECT_EQ(other_model.Param(i), model.Param(i)) << kParams[i].name;
  // And it resumes: a step runs with the engine's settings.
  other_model.SetGrads(99);
  ASSERT_OK((*other)->Step());
  EXPECT_EQ((*other)->Stats().step, 4);
}

}  // namespace
}  // namespace ferry::engine_test
