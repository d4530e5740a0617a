// The policies shipped in scripts/policies/, loaded from the source tree as a trainer would.
#include <algorithm>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "policy/policy.h"

namespace ferry {
namespace {

using ::testing::HasSubstr;

const std::string kPolicies = std::string(FERRY_SOURCE_DIR) + "/scripts/policies/";

GroupInfo Group(std::string name, int64_t numel) {
  GroupInfo g;
  g.name = std::move(name);
  g.numel = numel;
  g.bytes = 2 * numel;
  return g;
}

// A synthetic model in parameter order: 10000 elements in all.
std::vector<GroupInfo> Model() {
  return {Group("embed", 1000),  Group("layer0", 2000), Group("layer1", 2000),
          Group("layer2", 2000), Group("layer3", 2000), Group("head", 1000)};
}

PolicyContext Args(std::map<std::string, std::string> args) {
  PolicyContext ctx;
  ctx.args = std::move(args);
  return ctx;
}

std::unique_ptr<Policy> MustLoad(const std::string& file) {
  auto policy = Policy::LoadFile(kPolicies + file);
  EXPECT_TRUE(policy.ok()) << policy.status();
  return policy.ok() ? std::move(*policy) : nullptr;
}

// The groups placed on the CPU, in the order of `groups`; every group must be placed.
std::vector<std::string> Offloaded(const Placement& p, const std::vector<GroupInfo>& groups) {
  EXPECT_EQ(p.groups.size(), groups.size());
  std::vector<std::string> out;
  for (const GroupInfo& g : groups) {
    auto it = p.groups.find(g.name);
    EXPECT_NE(it, p.groups.end()) << g.name;
    if (it != p.groups.end() && it->second == PlaceKind::kCpu) out.push_back(g.name);
  }
  return out;
}

std::vector<std::string> OffloadedWith(Policy& policy, const std::vector<GroupInfo>& groups,
                                       std::map<std::string, std::string> args) {
  absl::StatusOr<Placement> p = policy.Place(groups, Args(std::move(args)));
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? Offloaded(*p, groups) : std::vector<std::string>{"<error>"};
}

using Names = std::vector<std::string>;

// Place() with `args` is refused as InvalidArgument, its message holding `message`.
void ExpectRefused(Policy& policy, const std::vector<GroupInfo>& groups, std::map<std::string, std::string> args,
                   const std::string& message) {
  absl::StatusOr<Placement> p = policy.Place(groups, Args(std::move(args)));
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(p.status().message()), HasSubstr(message));
}

TEST(OffloadFractionTest, PlacesExactlyTheDocumentedGroups) {
  auto policy = MustLoad("offload_fraction.lua");
  ASSERT_NE(policy, nullptr);
  EXPECT_TRUE(policy->has_hook("place"));
  EXPECT_TRUE(policy->has_hook("after_load"));
  EXPECT_TRUE(policy->has_hook("checkpoint"));
  const std::vector<GroupInfo> model = Model();
  EXPECT_EQ(OffloadedWith(*policy, model, {{"fraction", "0"}}), Names{});
  // By default the walk starts at the end of the parameter order (the head).
  // budget 2500: head (1000) fits, layer3 would make 3000.
  EXPECT_EQ(OffloadedWith(*policy, model, {{"fraction", "0.25"}}), Names{"head"});
  // budget 5000: head + layer3 + layer2 = 5000 <= 5000 (the bound is inclusive).
  EXPECT_EQ(OffloadedWith(*policy, model, {{"fraction", "0.5"}}), (Names{"layer2", "layer3", "head"}));
  EXPECT_EQ(OffloadedWith(*policy, model, {{"fraction", "0.5"}, {"from", "end"}}),
            (Names{"layer2", "layer3", "head"}));
  EXPECT_EQ(OffloadedWith(*policy, model, {{"fraction", "1"}}),
            (Names{"embed", "layer0", "layer1", "layer2", "layer3", "head"}));
  // The default fraction is 0.5.
  EXPECT_EQ(OffloadedWith(*policy, model, {}), (Names{"layer2", "layer3", "head"}));
  // A suffix: stops at the first group that does not fit (layer2 would make 5000 > 4900) even
  // though an earlier, smaller group (embed) would.
  EXPECT_EQ(OffloadedWith(*policy, model, {{"fraction", "0.49"}}), (Names{"layer3", "head"}));
  // fraction > 0 offloads at least the walk's first group (the head), even past the budget (500).
  EXPECT_EQ(OffloadedWith(*policy, model, {{"fraction", "0.05"}}), Names{"head"});
  // fraction < 1 keeps the walk's tail (the embeddings) on the GPU (budget 9900).
  EXPECT_EQ(OffloadedWith(*policy, model, {{"fraction", "0.99"}}),
            (Names{"layer0", "layer1", "layer2", "layer3", "head"}));
}

TEST(OffloadFractionTest, FromTheStartOffloadsAPrefixOfTheParameterOrder) {
  auto policy = MustLoad("offload_fraction.lua");
  ASSERT_NE(policy, nullptr);
  const std::vector<GroupInfo> model = Model();
  auto start = [&](const char* fraction) {
    return OffloadedWith(*policy, model, {{"fraction", fraction}, {"from", "start"}});
  };
  // budget 2500: embed (1000) fits, layer0 would make 3000.
  EXPECT_EQ(start("0.25"), Names{"embed"});
  // budget 5000: embed + layer0 + layer1 = 5000 <= 5000.
  EXPECT_EQ(start("0.5"), (Names{"embed", "layer0", "layer1"}));
  // budget 4900: layer1 would make 5000 > 4900, even though the smaller head would fit.
  EXPECT_EQ(start("0.49"), (Names{"embed", "layer0"}));
  EXPECT_EQ(start("0.05"), Names{"embed"});
  EXPECT_EQ(start("0.99"), (Names{"embed", "layer0", "layer1", "layer2", "layer3"}));
  EXPECT_EQ(start("1").size(), 6u);
  EXPECT_EQ(start("0"), Names{});
  // All groups empty: the walk's last group goes back to the GPU.
  const std::vector<GroupInfo> empty = {Group("a", 0), Group("b", 0), Group("c", 0)};
  EXPECT_EQ(OffloadedWith(*policy, empty, {{"fraction", "0.5"}, {"from", "start"}}), (Names{"a", "b"}));
  for (const char* bad : {"END", "last", "", "1"}) {
    SCOPED_TRACE(bad);
    ExpectRefused(*policy, model, {{"fraction", "0.5"}, {"from", bad}},
                  "offload_fraction.lua: place(): args.from must be \"end\" or \"start\", got \"" + std::string(bad) + "\"");
  }
}

TEST(OffloadFractionTest, EdgeCases) {
  auto policy = MustLoad("offload_fraction.lua");
  ASSERT_NE(policy, nullptr);
  const std::vector<GroupInfo> one = {Group("only", 100)};
  EXPECT_EQ(OffloadedWith(*policy, one, {{"fraction", "0.5"}}), Names{"only"});
  EXPECT_EQ(OffloadedWith(*policy, one, {{"fraction", "0"}}), Names{});
  // All groups empty: every suffix fits, and fraction < 1 gives the walk's last group (the first in
  // parameter order) back to the GPU.
  const std::vector<GroupInfo> empty = {Group("a", 0), Group("b", 0), Group("c", 0)};
  EXPECT_EQ(OffloadedWith(*policy, empty, {{"fraction", "0.5"}}), (Names{"b", "c"}));
  EXPECT_EQ(OffloadedWith(*policy, {}, {{"fraction", "0.5"}}), Names{});
  // numa is passed through (and validated by the engine).
  absl::StatusOr<Placement> p =
      policy->Place(Model(), Args({{"fraction", "0.5"}, {"numa", "interleave"}}));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->numa, "interleave");
  absl::StatusOr<Placement> bad_numa = policy->Place(Model(), Args({{"numa", "everywhere"}}));
  ASSERT_FALSE(bad_numa.ok());
  EXPECT_THAT(std::string(bad_numa.status().message()),
              HasSubstr("field \"numa\" is \"everywhere\""));
}

TEST(OffloadFractionTest, RejectsBadFraction) {
  auto policy = MustLoad("offload_fraction.lua");
  ASSERT_NE(policy, nullptr);
  for (const char* bad : {"abc", "1.5", "-0.1", "", "0.5x"}) {
    SCOPED_TRACE(bad);
    ExpectRefused(*policy, Model(), {{"fraction", bad}},
                  "offload_fraction.lua: place(): args.fraction must be a number in [0, 1], got \"" +
                      std::string(bad) + "\"");
  }
}

// The documented rule, written again in C++; `from_end` walks the groups last to first (from = "end").
Names ReferenceOffload(const std::vector<GroupInfo>& in_order, double fraction, bool from_end) {
  std::vector<GroupInfo> groups = in_order;
  if (from_end) std::reverse(groups.begin(), groups.end());
  Names out;
  const size_t n = groups.size();
  if (n == 0 || fraction == 0) return out;
  if (fraction == 1) {
    for (const GroupInfo& g : in_order) out.push_back(g.name);
    return out;
  }
  double total = 0;
  for (const GroupInfo& g : groups) total += static_cast<double>(g.numel);
  const double budget = fraction * total;
  double used = 0;
  for (const GroupInfo& g : groups) {
    if (used + static_cast<double>(g.numel) > budget) break;
    used += static_cast<double>(g.numel);
    out.push_back(g.name);
  }
  if (out.empty()) {
    out.push_back(groups[0].name);
  } else if (out.size() == n && n >= 2) {
    out.pop_back();
  }
  if (from_end) std::reverse(out.begin(), out.end());  // Offloaded() lists in parameter order
  return out;
}

TEST(OffloadFractionTest, MatchesTheRuleOnRandomModels) {
  auto policy = MustLoad("offload_fraction.lua");
  ASSERT_NE(policy, nullptr);
  std::mt19937_64 rng(std::random_device{}());
  std::uniform_int_distribution<int> count(1, 12);
  std::uniform_int_distribution<int64_t> numel(1, int64_t{1} << 30);
  std::uniform_int_distribution<int> millis(0, 1000);
  std::set<size_t> sizes_seen;
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<GroupInfo> groups;
    const int n = count(rng);
    for (int i = 0; i < n; ++i) groups.push_back(Group("g" + std::to_string(i), numel(rng)));
    const int m = millis(rng);
    const std::string text =
        std::to_string(m / 1000) + "." + std::to_string(1000 + m % 1000).substr(1);
    const double fraction = std::strtod(text.c_str(), nullptr);
    const bool from_end = trial % 2 == 1;
    const Names expected = ReferenceOffload(groups, fraction, from_end);
    sizes_seen.insert(expected.size());
    std::map<std::string, std::string> args = {{"fraction", text}};
    if (!from_end || trial % 4 == 3) args["from"] = from_end ? "end" : "start";  // "end": the default
    ASSERT_EQ(OffloadedWith(*policy, groups, args), expected)
        << "fraction " << text << ", " << n << " groups, from " << (from_end ? "end" : "start");
  }
  EXPECT_GT(sizes_seen.size(), 3u);  // the trials covered several outcomes
}

TEST(OffloadFractionTest, AfterLoadSyncsGroupsWithoutMasters) {
  auto policy = MustLoad("offload_fraction.lua");
  ASSERT_NE(policy, nullptr);
  const std::vector<GroupInfo> model = Model();
  LoadEvent event;
  event.kind = LoadKind::kModelOnly;
  event.optimizer_loaded = false;
  event.masters_loaded = false;
  absl::StatusOr<SyncPlan> all = policy->AfterLoad(event, model, Args({}));
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->sync_groups.size(), model.size());
  EXPECT_TRUE(all->reset_optimizer);

  event.kind = LoadKind::kCheckpoint;
  event.optimizer_loaded = true;
  event.masters_loaded = true;
  event.groups = {"layer1", "embed", "head"};
  absl::StatusOr<SyncPlan> some = policy->AfterLoad(event, model, Args({}));
  ASSERT_TRUE(some.ok()) << some.status();
  EXPECT_EQ(some->sync_groups, (Names{"layer0", "layer2", "layer3"}));
  EXPECT_FALSE(some->reset_optimizer);

  event.groups = {"embed", "layer0", "layer1", "layer2", "layer3", "head"};
  absl::StatusOr<SyncPlan> none = policy->AfterLoad(event, model, Args({}));
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_TRUE(none->sync_groups.empty());
}

TEST(OffloadFractionTest, CheckpointUsesTheDefaults) {
  auto policy = MustLoad("offload_fraction.lua");
  ASSERT_NE(policy, nullptr);
  CheckpointInfo info;
  info.step = 100;
  info.reason = "periodic";
  info.groups = {"embed", "head"};
  info.offloaded = {"embed"};
  absl::StatusOr<CheckpointPlan> plan = policy->Checkpoint(info, Args({}));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_FALSE(plan->skip_optimizer);
  EXPECT_FALSE(plan->skip_master);
  EXPECT_TRUE(plan->skip_groups.empty());
  EXPECT_FALSE(plan->async);
  EXPECT_EQ(plan->keep_last, 0);
}

TEST(ShippedPoliciesTest, AllGpuAndOffloadAll) {
  const std::vector<GroupInfo> model = Model();
  auto all_gpu = MustLoad("all_gpu.lua");
  ASSERT_NE(all_gpu, nullptr);
  EXPECT_FALSE(all_gpu->has_hook("after_load"));
  EXPECT_EQ(OffloadedWith(*all_gpu, model, {}), Names{});
  // all_gpu declares that it takes no args: an arg meant for another policy is refused, not ignored.
  absl::StatusOr<Placement> stray = all_gpu->Place(model, Args({{"fraction", "1"}}));
  ASSERT_FALSE(stray.ok());
  EXPECT_THAT(std::string(stray.status().message()), HasSubstr("all_gpu.lua: unknown arg \"fraction\" (fraction=1); it takes no args"));

  auto offload_all = MustLoad("offload_all.lua");
  ASSERT_NE(offload_all, nullptr);
  EXPECT_EQ(OffloadedWith(*offload_all, model, {}),
            (Names{"embed", "layer0", "layer1", "layer2", "layer3", "head"}));
  absl::StatusOr<Placement> p = offload_all->Place(model, Args({{"numa", "bind"}}));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->numa, "bind");
  absl::StatusOr<Placement> none = offload_all->Place(model, Args({}));
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_FALSE(none->numa.has_value());
}

// ---- offload_bf16_moments.lua --------------------------------------------------------------------

TEST(ShippedPoliciesTest, OffloadBf16Moments) {
  std::vector<GroupInfo> model = Model();
  model[5].dtype = DType::kF32;  // head: fp32 params keep an fp32 master
  auto policy = MustLoad("offload_bf16_moments.lua");
  ASSERT_NE(policy, nullptr);
  absl::StatusOr<Placement> p = policy->Place(model, Args({}));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(Offloaded(*p, model), (Names{"embed", "layer0", "layer1", "layer2", "layer3", "head"}));
  ASSERT_EQ(p->state.size(), model.size());
  for (const GroupInfo& g : model) {
    EXPECT_TRUE(p->state.at(g.name) == (StateFormat{DType::kF32, DType::kBF16, StateRounding::kNearest})) << g.name;
  }
  p = policy->Place(model, Args({{"device", "gpu"}, {"master", "bf16"}, {"rounding", "stochastic"}}));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(Offloaded(*p, model), Names{});
  EXPECT_TRUE(p->state.at("embed") == (StateFormat{DType::kBF16, DType::kBF16, StateRounding::kStochastic}));
  EXPECT_TRUE(p->state.at("head") == (StateFormat{DType::kF32, DType::kBF16, StateRounding::kStochastic}));
  for (const auto& [arg, value] : std::map<std::string, std::string>{{"device", "disk"}, {"master", "fp16"}}) {
    absl::StatusOr<Placement> bad = policy->Place(model, Args({{arg, value}}));
    ASSERT_FALSE(bad.ok());
    EXPECT_THAT(std::string(bad.status().message()), HasSubstr(absl::StrCat("args.", arg, " must be one of")));
  }
}

// ---- memory_budget.lua ---------------------------------------------------------------------------

// The documented rule, written again in C++: offload the largest GPU groups (earliest first among
// equals) while 12 * numel of the GPU groups exceeds max(available, 0).
Names ReferenceBudget(const std::vector<GroupInfo>& groups, double available, bool largest = false) {
  const double room = std::max(available, 0.0);
  double need = 0;
  for (const GroupInfo& g : groups) need += 12.0 * static_cast<double>(g.numel);
  std::vector<size_t> order(groups.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = largest ? i : order.size() - 1 - i;
  if (largest) {
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return groups[a].numel > groups[b].numel; });
  }
  std::vector<bool> off(groups.size(), false);
  std::vector<size_t> walked;
  for (size_t i : order) {
    if (need <= room) break;
    off[i] = true;
    need -= 12.0 * static_cast<double>(groups[i].numel);
    walked.push_back(i);
  }
  if (!largest) {  // the overshoot back to the GPU, the last offloaded first
    for (auto it = walked.rbegin(); it != walked.rend(); ++it) {
      const double bytes = 12.0 * static_cast<double>(groups[*it].numel);
      if (need + bytes <= room) {
        off[*it] = false;
        need += bytes;
      }
    }
  }
  Names out;
  for (size_t i = 0; i < groups.size(); ++i) {
    if (off[i]) out.push_back(groups[i].name);
  }
  return out;
}

std::vector<std::string> BudgetOffloaded(Policy& policy, const std::vector<GroupInfo>& groups,
                                         std::map<std::string, std::string> args,
                                         int64_t gpu_free = 0) {
  PolicyContext ctx = Args(std::move(args));
  ctx.gpu_free_bytes = gpu_free;
  absl::StatusOr<Placement> p = policy.Place(groups, ctx);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? Offloaded(*p, groups) : std::vector<std::string>{"<error>"};
}

TEST(MemoryBudgetTest, OffloadsTheLastGroupsUntilTheStateFitsAndGivesBackTheOvershoot) {
  auto policy = MustLoad("memory_budget.lua");
  ASSERT_NE(policy, nullptr);
  const std::vector<GroupInfo> model = Model();  // 10000 elements: 120000 bytes of state
  auto with = [&](const char* budget, const char* reserve) {
    return BudgetOffloaded(*policy, model, {{"budget", budget}, {"reserve", reserve}});
  };
  EXPECT_EQ(with("120000", "0"), Names{});
  // One byte short: the last group goes (head).
  EXPECT_EQ(with("119999", "0"), Names{"head"});
  EXPECT_EQ(BudgetOffloaded(*policy, model, {{"budget", "119999"}, {"reserve", "0"}, {"order", "end"}}),
            Names{"head"});
  // 96000: head, then layer3 make it fit (84000); head's 12000 fit back (96000, the bound inclusive).
  EXPECT_EQ(with("96000", "0"), Names{"layer3"});
  // One byte less and head cannot come back.
  EXPECT_EQ(with("95999", "0"), (Names{"layer3", "head"}));
  // available = 100000 - 50000: head, layer3, layer2, layer1 leave 36000; head fits back (48000).
  EXPECT_EQ(with("100000", "50000"), (Names{"layer1", "layer2", "layer3"}));
  // 12000: everything but embed, which fits exactly; 11999: everything.
  EXPECT_EQ(with("12000", "0"), (Names{"layer0", "layer1", "layer2", "layer3", "head"}));
  EXPECT_EQ(with("11999", "0"), (Names{"embed", "layer0", "layer1", "layer2", "layer3", "head"}));
  // A reserve larger than the budget offloads everything.
  EXPECT_EQ(with("1000", "5000"), (Names{"embed", "layer0", "layer1", "layer2", "layer3", "head"}));
  for (const char* bad : {"END", "first", "", "smallest"}) {
    SCOPED_TRACE(bad);
    ExpectRefused(*policy, model, {{"budget", "0"}, {"order", bad}},
                  "memory_budget.lua: place(): args.order must be \"end\" or \"largest\", got \"" + std::string(bad) + "\"");
  }
}

TEST(MemoryBudgetTest, OrderLargestOffloadsTheLargestGroupsUntilTheStateFits) {
  auto policy = MustLoad("memory_budget.lua");
  ASSERT_NE(policy, nullptr);
  const std::vector<GroupInfo> model = Model();  // 10000 elements: 120000 bytes of state
  auto with = [&](const char* budget, const char* reserve) {
    return BudgetOffloaded(*policy, model, {{"budget", budget}, {"reserve", reserve}, {"order", "largest"}});
  };
  EXPECT_EQ(with("120000", "0"), Names{});
  // One byte short: the largest group goes (layer0, the first of four equal ones).
  EXPECT_EQ(with("119999", "0"), Names{"layer0"});
  // 96000 left exactly fits (the bound is inclusive).
  EXPECT_EQ(with("96000", "0"), Names{"layer0"});
  EXPECT_EQ(with("95999", "0"), (Names{"layer0", "layer1"}));
  // available = 100000 - 50000: three 2000-element groups leave 48000.
  EXPECT_EQ(with("100000", "50000"), (Names{"layer0", "layer1", "layer2"}));
  // After the four large groups, the two of 1000: embed (first) before head.
  EXPECT_EQ(with("12000", "0"), (Names{"embed", "layer0", "layer1", "layer2", "layer3"}));
  EXPECT_EQ(with("11999", "0"), (Names{"embed", "layer0", "layer1", "layer2", "layer3", "head"}));
  // A reserve larger than the budget offloads everything.
  EXPECT_EQ(with("1000", "5000"),
            (Names{"embed", "layer0", "layer1", "layer2", "layer3", "head"}));
}

TEST(MemoryBudgetTest, DefaultsAndUnits) {
  auto policy = MustLoad("memory_budget.lua");
  ASSERT_NE(policy, nullptr);
  const std::vector<GroupInfo> model = Model();
  const int64_t gib = int64_t{1} << 30;
  // Defaults: budget = ctx.gpu_free_bytes, reserve = 1 GiB.
  EXPECT_EQ(BudgetOffloaded(*policy, model, {}, gib + 120000), Names{});
  EXPECT_EQ(BudgetOffloaded(*policy, model, {}, gib + 60000), (Names{"layer2", "layer3", "head"}));
  EXPECT_EQ(BudgetOffloaded(*policy, model, {{"reserve", "0"}}, 96000), Names{"layer3"});
  // The same 120000 bytes in every unit: nothing offloaded; one byte (or unit) less: head.
  for (const char* fits : {"120000", "120K", "120KB", "0.12M", "1.2e5", "117.1875KiB", " 120000 B "}) {
    EXPECT_EQ(BudgetOffloaded(*policy, model, {{"budget", fits}, {"reserve", "0"}}), Names{})
        << fits;
  }
  for (const char* short_by_one : {"119999", "119.999K", "1.19999e5"}) {
    EXPECT_EQ(BudgetOffloaded(*policy, model, {{"budget", short_by_one}, {"reserve", "0"}}),
              Names{"head"})
        << short_by_one;
  }
  // Binary units: 1 MiB of budget less 0.5 MiB of reserve = 524288 bytes: everything fits.
  EXPECT_EQ(BudgetOffloaded(*policy, model, {{"budget", "1MiB"}, {"reserve", "0.5MiB"}}), Names{});
  EXPECT_EQ(BudgetOffloaded(*policy, model, {{"budget", "1GiB"}, {"reserve", "1GiB"}}),
            (Names{"embed", "layer0", "layer1", "layer2", "layer3", "head"}));
  EXPECT_EQ(BudgetOffloaded(*policy, model, {{"budget", "1T"}, {"reserve", "1TiB"}}),
            (Names{"embed", "layer0", "layer1", "layer2", "layer3", "head"}));
}

TEST(MemoryBudgetTest, EmptyGroupsStayAndNumaPassesThrough) {
  auto policy = MustLoad("memory_budget.lua");
  ASSERT_NE(policy, nullptr);
  const std::vector<GroupInfo> groups = {Group("empty", 0), Group("big", 10), Group("small", 5)};
  EXPECT_EQ(BudgetOffloaded(*policy, groups, {{"budget", "0"}, {"reserve", "0"}}),
            (Names{"big", "small"}));
  EXPECT_EQ(BudgetOffloaded(*policy, groups, {{"budget", "60"}, {"reserve", "0"}}), Names{"big"});
  EXPECT_EQ(BudgetOffloaded(*policy, {}, {{"budget", "0"}}), Names{});
  PolicyContext ctx = Args({{"budget", "0"}, {"numa", "preferred"}});
  absl::StatusOr<Placement> p = policy->Place(groups, ctx);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->numa, "preferred");
}

TEST(MemoryBudgetTest, RejectsBadSizes) {
  auto policy = MustLoad("memory_budget.lua");
  ASSERT_NE(policy, nullptr);
  for (const auto& [arg, value] : std::vector<std::pair<std::string, std::string>>{
           {"budget", "abc"}, {"budget", "-1"}, {"reserve", "12XB"}, {"reserve", ""},
           {"budget", "1e400"}, {"reserve", "5 G B"}, {"host_budget", "lots"}, {"host_budget", "-5"}}) {
    SCOPED_TRACE(arg + "=" + value);
    ExpectRefused(*policy, Model(), {{arg, value}},
                  "memory_budget.lua: place(): args." + arg +
                      " must be a byte size such as \"512MiB\", \"2G\" or \"1e9\", got \"" + value + "\"");
  }
}

TEST(MemoryBudgetTest, MatchesTheRuleOnRandomModels) {
  auto policy = MustLoad("memory_budget.lua");
  ASSERT_NE(policy, nullptr);
  std::mt19937_64 rng(std::random_device{}());
  std::uniform_int_distribution<int> count(1, 12);
  std::uniform_int_distribution<int64_t> numel(0, int64_t{1} << 20);
  std::uniform_int_distribution<int> few(0, 3);  // repeated sizes, to exercise the ties
  std::set<size_t> sizes_seen;
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<GroupInfo> groups;
    const int n = count(rng);
    for (int i = 0; i < n; ++i) {
      groups.push_back(Group("g" + std::to_string(i), trial % 2 == 0 ? numel(rng) : few(rng) * 1000));
    }
    double total = 0;
    for (const GroupInfo& g : groups) total += 12.0 * static_cast<double>(g.numel);
    const int64_t budget =
        std::uniform_int_distribution<int64_t>(0, static_cast<int64_t>(total) + 1)(rng);
    const int64_t reserve = std::uniform_int_distribution<int64_t>(0, budget / 2 + 1)(rng);
    const bool largest = (trial / 2) % 2 == 1;
    const Names expected = ReferenceBudget(groups, static_cast<double>(budget - reserve), largest);
    sizes_seen.insert(expected.size());
    std::map<std::string, std::string> args = {{"budget", std::to_string(budget)},
                                               {"reserve", std::to_string(reserve)}};
    if (largest || trial % 8 == 4) args["order"] = largest ? "largest" : "end";
    ASSERT_EQ(BudgetOffloaded(*policy, groups, args), expected)
        << "budget " << budget << ", reserve " << reserve << ", " << n << " groups, order "
        << (largest ? "largest" : "end");
  }
  EXPECT_GT(sizes_seen.size(), 3u);
}

// The spare-state rule of the header, written again in C++: state = 12 * (numel offloaded);
// min(1, max(0, (host_budget - state) / state)), 1 when state = 0.
double ReferenceSpare(const std::vector<GroupInfo>& groups, const Names& offloaded, double host_budget) {
  double state = 0;
  for (const GroupInfo& g : groups) {
    if (std::find(offloaded.begin(), offloaded.end(), g.name) != offloaded.end()) {
      state += 12.0 * static_cast<double>(g.numel);
    }
  }
  if (state == 0) return 1.0;
  return std::min(1.0, std::max(0.0, (host_budget - state) / state));
}

// Placement::spare_state of memory_budget with `args` (and ctx.pinned_budget_bytes); nullopt: unset.
std::optional<double> BudgetSpare(Policy& policy, const std::vector<GroupInfo>& groups,
                                  std::map<std::string, std::string> args, int64_t pinned_budget = 0) {
  PolicyContext ctx = Args(std::move(args));
  ctx.pinned_budget_bytes = pinned_budget;
  absl::StatusOr<Placement> p = policy.Place(groups, ctx);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? p->spare_state : std::optional<double>(-1.0);
}

TEST(MemoryBudgetTest, HostBudgetBoundsTheSpareState) {
  auto policy = MustLoad("memory_budget.lua");
  ASSERT_NE(policy, nullptr);
  const std::vector<GroupInfo> model = Model();  // 10000 elements: 120000 bytes of fp32 state
  // Every group offloaded (no GPU room): the state is 120000 bytes.
  auto all_off = [&](const char* host) {
    return BudgetSpare(*policy, model, {{"budget", "0"}, {"reserve", "0"}, {"host_budget", host}});
  };
  EXPECT_EQ(all_off("240000"), 1.0);  // the state and its spare state fit: no bound below 1
  EXPECT_EQ(all_off("1G"), 1.0);      // far more: still 1 (clamped)
  EXPECT_EQ(all_off("180000"), 0.5);  // the state and half of it again
  EXPECT_EQ(all_off("180K"), 0.5);    // the same in a unit
  EXPECT_EQ(all_off("150000"), 0.25);
  EXPECT_EQ(all_off("120001"), 1.0 / 120000.0);
  EXPECT_EQ(all_off("120000"), 0.0);  // the state alone, exactly: no spare state
  EXPECT_EQ(all_off("119999"), 0.0);  // less than the state: 0, not an error
  EXPECT_EQ(all_off("0"), 0.0);
  // No host budget (no arg, ctx.pinned_budget_bytes 0): no bound.
  EXPECT_EQ(BudgetSpare(*policy, model, {{"budget", "0"}, {"reserve", "0"}}), std::nullopt);
  // ctx.pinned_budget_bytes > 0 is the default host budget; the arg replaces it.
  EXPECT_EQ(BudgetSpare(*policy, model, {{"budget", "0"}, {"reserve", "0"}}, 180000), 0.5);
  EXPECT_EQ(BudgetSpare(*policy, model, {{"budget", "0"}, {"reserve", "0"}, {"host_budget", "150000"}}, 180000),
            0.25);
  // Only the offloaded groups count: layer0 alone (24000 bytes of state).
  EXPECT_EQ(BudgetSpare(*policy, model, {{"budget", "96000"}, {"reserve", "0"}, {"host_budget", "36000"}}), 0.5);
  EXPECT_EQ(BudgetSpare(*policy, model, {{"budget", "96000"}, {"reserve", "0"}, {"host_budget", "23999"}}), 0.0);
  // Nothing offloaded: nothing to bound, 1.
  EXPECT_EQ(BudgetSpare(*policy, model, {{"budget", "1G"}, {"reserve", "0"}, {"host_budget", "0"}}), 1.0);
  // The placement does not depend on the host budget.
  EXPECT_EQ(BudgetOffloaded(*policy, model, {{"budget", "96000"}, {"reserve", "0"}, {"host_budget", "1"}}),
            Names{"layer3"});
  // A group named "spare_state" keeps its placement under that key; the bound is then left out.
  std::vector<GroupInfo> named = model;
  named.push_back(Group("spare_state", 10));
  absl::StatusOr<Placement> p = policy->Place(named, Args({{"budget", "0"}, {"reserve", "0"}, {"host_budget", "1"}}));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->groups.at("spare_state"), PlaceKind::kCpu);
  EXPECT_FALSE(p->spare_state.has_value());
}

TEST(MemoryBudgetTest, SpareStateMatchesTheRuleOnRandomModels) {
  auto policy = MustLoad("memory_budget.lua");
  ASSERT_NE(policy, nullptr);
  std::mt19937_64 rng(std::random_device{}());
  std::uniform_int_distribution<int> count(1, 12);
  std::uniform_int_distribution<int64_t> numel(0, int64_t{1} << 20);
  int partial = 0;
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<GroupInfo> groups;
    const int n = count(rng);
    double total = 0;
    for (int i = 0; i < n; ++i) {
      groups.push_back(Group("g" + std::to_string(i), numel(rng)));
      total += 12.0 * static_cast<double>(groups.back().numel);
    }
    const int64_t budget = std::uniform_int_distribution<int64_t>(0, static_cast<int64_t>(total) + 1)(rng);
    const int64_t host = std::uniform_int_distribution<int64_t>(0, 2 * static_cast<int64_t>(total) + 2)(rng);
    const std::map<std::string, std::string> args = {
        {"budget", std::to_string(budget)}, {"reserve", "0"}, {"host_budget", std::to_string(host)}};
    const Names off = BudgetOffloaded(*policy, groups, args);
    ASSERT_EQ(off, ReferenceBudget(groups, static_cast<double>(budget)));
    const double expected = ReferenceSpare(groups, off, static_cast<double>(host));
    const std::optional<double> spare = BudgetSpare(*policy, groups, args);
    ASSERT_TRUE(spare.has_value());
    ASSERT_DOUBLE_EQ(*spare, expected) << "budget " << budget << ", host " << host << ", " << n << " groups";
    partial += expected > 0 && expected < 1 ? 1 : 0;
  }
  EXPECT_GT(partial, 10);  // the random budgets reach the fractional case, not only 0 and 1
}

// ---- skip_optimizer_on_save.lua and sync_after_load.lua --------------------------------------------

LoadEvent Event(LoadKind kind, bool optimizer_loaded, bool masters_loaded, Names groups) {
  LoadEvent e;
  e.kind = kind;
  e.optimizer_loaded = optimizer_loaded;
  e.masters_loaded = masters_loaded;
  e.groups = std::move(groups);
  return e;
}

CheckpointInfo Info(Names offloaded) {
  CheckpointInfo info;
  info.step = 500;
  info.reason = "save";
  for (const GroupInfo& g : Model()) info.groups.push_back(g.name);
  info.offloaded = std::move(offloaded);
  return info;
}

TEST(SharedPlacementTest, NewPoliciesPlaceExactlyLikeOffloadFraction) {
  std::mt19937_64 rng(std::random_device{}());
  std::uniform_int_distribution<int> count(1, 10);
  std::uniform_int_distribution<int64_t> numel(1, int64_t{1} << 24);
  std::uniform_int_distribution<int> millis(0, 1000);
  for (const char* file : {"skip_optimizer_on_save.lua", "sync_after_load.lua"}) {
    SCOPED_TRACE(file);
    auto policy = MustLoad(file);
    ASSERT_NE(policy, nullptr);
    EXPECT_EQ(OffloadedWith(*policy, Model(), {}), (Names{"layer2", "layer3", "head"}));
    EXPECT_EQ(OffloadedWith(*policy, Model(), {{"fraction", "0.25"}}), Names{"head"});
    EXPECT_EQ(OffloadedWith(*policy, Model(), {{"fraction", "0.25"}, {"from", "start"}}), Names{"embed"});
    EXPECT_EQ(OffloadedWith(*policy, Model(), {{"fraction", "1"}}).size(), 6u);
    EXPECT_EQ(OffloadedWith(*policy, Model(), {{"fraction", "0"}}), Names{});
    for (int trial = 0; trial < 100; ++trial) {
      std::vector<GroupInfo> groups;
      const int n = count(rng);
      for (int i = 0; i < n; ++i) groups.push_back(Group("g" + std::to_string(i), numel(rng)));
      const int m = millis(rng);
      const std::string text =
          std::to_string(m / 1000) + "." + std::to_string(1000 + m % 1000).substr(1);
      const bool from_end = trial % 2 == 1;
      std::map<std::string, std::string> args = {{"fraction", text}};
      if (!from_end) args["from"] = "start";
      ASSERT_EQ(OffloadedWith(*policy, groups, args),
                ReferenceOffload(groups, std::strtod(text.c_str(), nullptr), from_end))
          << text << (from_end ? ", from end" : "");
    }
    absl::StatusOr<Placement> bad = policy->Place(Model(), Args({{"fraction", "2"}}));
    ASSERT_FALSE(bad.ok());
    EXPECT_THAT(std::string(bad.status().message()),
                HasSubstr("place(): args.fraction must be a number in [0, 1], got \"2\""));
  }
}

TEST(SkipOptimizerOnSaveTest, ModelOnlyCheckpointsWhileOffloading) {
  auto policy = MustLoad("skip_optimizer_on_save.lua");
  ASSERT_NE(policy, nullptr);
  EXPECT_TRUE(policy->has_hook("checkpoint"));
  EXPECT_TRUE(policy->has_hook("after_load"));
  struct Case {
    Names offloaded;
    std::map<std::string, std::string> args;
    bool model_only;
    int keep_last;
  };
  const std::vector<Case> cases = {
      {{"embed", "layer0"}, {}, true, 0},
      {{"head"}, {{"keep_last", "3"}}, true, 3},
      {{}, {}, false, 0},
      {{}, {{"keep_last", "5"}}, false, 5},
      {{}, {{"always", "true"}}, true, 0},
      {{}, {{"always", "false"}, {"keep_last", "0"}}, false, 0},
      {{"embed"}, {{"always", "false"}}, true, 0},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(testing::PrintToString(c.offloaded) + " " + testing::PrintToString(c.args));
    absl::StatusOr<CheckpointPlan> plan = policy->Checkpoint(Info(c.offloaded), Args(c.args));
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->skip_optimizer, c.model_only);
    EXPECT_EQ(plan->skip_master, c.model_only);
    EXPECT_TRUE(plan->skip_groups.empty());
    EXPECT_FALSE(plan->async);
    EXPECT_EQ(plan->keep_last, c.keep_last);
  }
  for (const auto& [arg, value, expected] :
       std::vector<std::tuple<std::string, std::string, std::string>>{
           {"keep_last", "-1", "args.keep_last must be an integer >= 0, got \"-1\""},
           {"keep_last", "2.5", "args.keep_last must be an integer >= 0, got \"2.5\""},
           {"keep_last", "many", "args.keep_last must be an integer >= 0, got \"many\""},
           {"always", "yes", "args.always must be \"true\" or \"false\", got \"yes\""}}) {
    absl::StatusOr<CheckpointPlan> plan = policy->Checkpoint(Info({}), Args({{arg, value}}));
    ASSERT_FALSE(plan.ok()) << arg << "=" << value;
    EXPECT_THAT(std::string(plan.status().message()),
                HasSubstr("skip_optimizer_on_save.lua: checkpoint(): " + expected));
  }
}

TEST(SkipOptimizerOnSaveTest, ResumeReinitialisesTheOptimizerAndSyncsMasters) {
  auto policy = MustLoad("skip_optimizer_on_save.lua");
  ASSERT_NE(policy, nullptr);
  const std::vector<GroupInfo> model = Model();
  struct Case {
    LoadEvent event;
    Names sync;
    bool reset;
  };
  const std::vector<Case> cases = {
      // One of its own model-only checkpoints, of every group: sync them all, fresh Adam.
      {Event(LoadKind::kModelOnly, false, false,
             {"embed", "layer0", "layer1", "layer2", "layer3", "head"}),
       {"embed", "layer0", "layer1", "layer2", "layer3", "head"},
       true},
      // Of some groups, listed out of order: those, in engine order.
      {Event(LoadKind::kModelOnly, false, false, {"head", "layer1"}), {"layer1", "head"}, true},
      // A full checkpoint: resume exactly.
      {Event(LoadKind::kCheckpoint, true, true, {"embed", "head"}), {}, false},
      // Masters but no moments: keep the masters, reset Adam.
      {Event(LoadKind::kModelOnly, false, true, {"embed"}), {}, true},
      // Moments but no masters (odd, but possible): sync, keep the moments.
      {Event(LoadKind::kCheckpoint, true, false, {"layer2"}), {"layer2"}, false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(testing::PrintToString(c.event.groups));
    absl::StatusOr<SyncPlan> plan = policy->AfterLoad(c.event, model, Args({}));
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->sync_groups, c.sync);
    EXPECT_EQ(plan->reset_optimizer, c.reset);
  }
}

TEST(SyncAfterLoadTest, ResyncsEveryMasterAfterModelOnlyOrExternalLoads) {
  auto policy = MustLoad("sync_after_load.lua");
  ASSERT_NE(policy, nullptr);
  EXPECT_TRUE(policy->has_hook("after_load"));
  EXPECT_FALSE(policy->has_hook("checkpoint"));
  const std::vector<GroupInfo> model = Model();
  const Names all = {"embed", "layer0", "layer1", "layer2", "layer3", "head"};
  struct Case {
    LoadEvent event;
    std::string reset_arg;  // "" = absent
    Names sync;
    bool reset;
  };
  const std::vector<Case> cases = {
      {Event(LoadKind::kModelOnly, false, false, {"layer0"}), "", all, true},
      {Event(LoadKind::kExternal, false, false, {}), "", all, true},
      // An external load is re-synced even if the caller says the masters were loaded.
      {Event(LoadKind::kExternal, true, true, {"embed"}), "", all, false},
      {Event(LoadKind::kModelOnly, true, true, {"embed"}), "", all, false},
      {Event(LoadKind::kCheckpoint, true, false, {"embed", "head"}), "", all, false},
      // A full checkpoint restored the masters it loaded; the others never changed.
      {Event(LoadKind::kCheckpoint, true, true, {"embed", "head"}), "", {}, false},
      {Event(LoadKind::kCheckpoint, true, true, all), "", {}, false},
      // reset_optimizer overrides.
      {Event(LoadKind::kCheckpoint, true, true, all), "always", {}, true},
      {Event(LoadKind::kModelOnly, false, false, all), "never", all, false},
      {Event(LoadKind::kModelOnly, false, false, all), "auto", all, true},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(LoadKindName(c.event.kind)) + " " + c.reset_arg);
    std::map<std::string, std::string> args;
    if (!c.reset_arg.empty()) args["reset_optimizer"] = c.reset_arg;
    absl::StatusOr<SyncPlan> plan = policy->AfterLoad(c.event, model, Args(args));
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->sync_groups, c.sync);
    EXPECT_EQ(plan->reset_optimizer, c.reset);
  }
  absl::StatusOr<SyncPlan> bad = policy->AfterLoad(Event(LoadKind::kExternal, false, false, {}),
                                                   model, Args({{"reset_optimizer", "sometimes"}}));
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()),
              HasSubstr("sync_after_load.lua: after_load(): args.reset_optimizer must be \"auto\", "
                        "\"always\" or \"never\", got \"sometimes\""));
}

}  // namespace
}  // namespace ferry
