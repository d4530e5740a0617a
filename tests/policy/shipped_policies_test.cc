// The policies shipped in scripts/policies/, loaded from the source tree as a trainer would.
#include <cstdlib>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

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

TEST(OffloadFractionTest, PlacesExactlyTheDocumentedGroups) {
  auto policy = MustLoad("offload_fraction.lua");
  ASSERT_NE(policy, nullptr);
  EXPECT_TRUE(policy->has_hook("place"));
  EXPECT_TRUE(policy->has_hook("after_load"));
  EXPECT_TRUE(policy->has_hook("checkpoint"));
  const std::vector<GroupInfo> model = Model();
  EXPECT_EQ(OffloadedWith(*policy, model, {{"fraction", "0"}}), Names{});
  // budget 2500: embed (1000) fits, layer0 would make 3000.
  EXPECT_EQ(OffloadedWith(*policy, model, {{"fraction", "0.25"}}), Names{"embed"});
  // budget 5000: embed + layer0 + layer1 = 5000 <= 5000 (the bound is inclusive).
  EXPECT_EQ(OffloadedWith(*policy, model, {{"fraction", "0.5"}}),
            (Names{"embed", "layer0", "layer1"}));
  EXPECT_EQ(OffloadedWith(*policy, model, {{"fraction", "1"}}),
            (Names{"embed", "layer0", "layer1", "layer2", "layer3", "head"}));
  // The default is 0.5.
  EXPECT_EQ(OffloadedWith(*policy, model, {}), (Names{"embed", "layer0", "layer1"}));
  // A prefix: stops at the first group that does not fit (layer1 would make 5000 > 4900) even
  // though a later, smaller group would.
  EXPECT_EQ(OffloadedWith(*policy, model, {{"fraction", "0.49"}}), (Names{"embed", "layer0"}));
  // fraction > 0 offloads at least the first group, even if it exceeds the budget (500).
  EXPECT_EQ(OffloadedWith(*policy, model, {{"fraction", "0.05"}}), Names{"embed"});
  // fraction < 1 keeps the tail that does not fit on the GPU (budget 9900).
  EXPECT_EQ(OffloadedWith(*policy, model, {{"fraction", "0.99"}}),
            (Names{"embed", "layer0", "layer1", "layer2", "layer3"}));
}

TEST(OffloadFractionTest, EdgeCases) {
  auto policy = MustLoad("offload_fraction.lua");
  ASSERT_NE(policy, nullptr);
  const std::vector<GroupInfo> one = {Group("only", 100)};
  EXPECT_EQ(OffloadedWith(*policy, one, {{"fraction", "0.5"}}), Names{"only"});
  EXPECT_EQ(OffloadedWith(*policy, one, {{"fraction", "0"}}), Names{});
  // All groups empty: every prefix fits, and fraction < 1 gives the last group back to the GPU.
  const std::vector<GroupInfo> empty = {Group("a", 0), Group("b", 0), Group("c", 0)};
  EXPECT_EQ(OffloadedWith(*policy, empty, {{"fraction", "0.5"}}), (Names{"a", "b"}));
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
    absl::StatusOr<Placement> p = policy->Place(Model(), Args({{"fraction", bad}}));
    ASSERT_FALSE(p.ok());
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
    const std::string message(p.status().message());
    EXPECT_THAT(message, HasSubstr("offload_fraction.lua: place(): args.fraction must be a number "
                                   "in [0, 1], got \"" +
                                   std::string(bad) + "\""));
  }
}

// The documented rule, written again in C++.
Names ReferenceOffload(const std::vector<GroupInfo>& groups, double fraction) {
  Names out;
  const size_t n = groups.size();
  if (n == 0 || fraction == 0) return out;
  if (fraction == 1) {
    for (const GroupInfo& g : groups) out.push_back(g.name);
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
    const Names expected = ReferenceOffload(groups, fraction);
    sizes_seen.insert(expected.size());
    ASSERT_EQ(OffloadedWith(*policy, groups, {{"fraction", text}}), expected)
        << "fraction " << text << ", " << n << " groups";
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
  EXPECT_EQ(OffloadedWith(*all_gpu, model, {{"fraction", "1"}}), Names{});

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

}  // namespace
}  // namespace ferry
