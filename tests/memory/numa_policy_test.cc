// The arena's NUMA placement, read back from the kernel with get_mempolicy(MPOL_F_ADDR) on its pages.
#include <numa.h>
#include <numaif.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "memory/fake_device.h"
#include "memory/pinned_arena.h"

namespace ferry {
namespace {

using fakes::FakeDevice;

constexpr size_t kPages = 64;

size_t PageSize() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }

std::set<int> AllowedNodes() {
  std::set<int> nodes;
  for (int n = 0; n <= numa_max_node(); ++n) {
    if (numa_bitmask_isbitset(numa_all_nodes_ptr, static_cast<unsigned>(n))) nodes.insert(n);
  }
  return nodes;
}

struct PagePolicy {
  int mode = -1;
  std::set<int> nodes;
};

// The policy the kernel holds for the page at `addr`.
PagePolicy PolicyAt(void* addr) {
  PagePolicy out;
  bitmask* mask = numa_allocate_nodemask();
  EXPECT_EQ(get_mempolicy(&out.mode, mask->maskp, mask->size + 1, addr, MPOL_F_ADDR), 0)
      << std::strerror(errno);
  for (unsigned n = 0; n < mask->size; ++n) {
    if (numa_bitmask_isbitset(mask, n)) out.nodes.insert(static_cast<int>(n));
  }
  numa_bitmask_free(mask);
  return out;
}

// The node the page at `addr` sits on (touch it first).
int NodeOf(void* addr) {
  int node = -1;
  EXPECT_EQ(get_mempolicy(&node, nullptr, 0, addr, MPOL_F_NODE | MPOL_F_ADDR), 0)
      << std::strerror(errno);
  return node;
}

class NumaPolicyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (numa_available() < 0) GTEST_SKIP() << "libnuma: NUMA is not available on this system";
  }

  // Creates an arena with `policy`; skips the test when the kernel refused mbind (sandbox).
  std::unique_ptr<PinnedArena> Create(NumaPolicy policy, int node) {
    PinnedArenaOptions options;
    options.capacity_bytes = kPages * PageSize();
    options.numa = policy;
    options.numa_node = node;
    options.name = std::string(NumaPolicyName(policy));
    absl::StatusOr<std::unique_ptr<PinnedArena>> arena = PinnedArena::Create(&device_, options);
    EXPECT_TRUE(arena.ok()) << arena.status();
    if (!arena.ok()) return nullptr;
    EXPECT_EQ((*arena)->numa_policy(), policy);
    return *std::move(arena);
  }

  // The pages to check: first, middle and last.
  std::vector<void*> SamplePages(const PinnedArena& arena) {
    char* base = static_cast<char*>(arena.base());
    return {base, base + (kPages / 2) * PageSize(), base + (kPages - 1) * PageSize()};
  }

  FakeDevice device_;
};

#define SKIP_IF_REFUSED(arena)                                                                  \
  if ((arena)->numa_applied() == false)                                                         \
  GTEST_SKIP() << "the kernel refused mbind in this sandbox (EPERM/ENOSYS); the arena went on " \
                  "without a NUMA policy"

TEST_F(NumaPolicyTest, InterleaveSpreadsOverEveryAllowedNode) {
  std::unique_ptr<PinnedArena> arena = Create(NumaPolicy::kInterleave, -1);
  ASSERT_NE(arena, nullptr);
  SKIP_IF_REFUSED(arena);
  for (void* page : SamplePages(*arena)) {
    const PagePolicy p = PolicyAt(page);
    EXPECT_EQ(p.mode, MPOL_INTERLEAVE);
    EXPECT_EQ(p.nodes, AllowedNodes());
  }
  // Placed by the policy when touched: only allowed nodes, every one of them when there are enough
  // pages to go round.
  std::memset(arena->base(), 0x11, arena->capacity());
  std::set<int> seen;
  for (size_t i = 0; i < kPages; ++i) {
    seen.insert(NodeOf(static_cast<char*>(arena->base()) + i * PageSize()));
  }
  EXPECT_EQ(seen, AllowedNodes());
}

TEST_F(NumaPolicyTest, BindPinsToTheNode) {
  for (int node : AllowedNodes()) {
    SCOPED_TRACE(::testing::Message() << "node " << node);
    std::unique_ptr<PinnedArena> arena = Create(NumaPolicy::kBind, node);
    ASSERT_NE(arena, nullptr);
    SKIP_IF_REFUSED(arena);
    for (void* page : SamplePages(*arena)) {
      const PagePolicy p = PolicyAt(page);
      EXPECT_EQ(p.mode, MPOL_BIND);
      EXPECT_EQ(p.nodes, std::set<int>{node});
    }
    std::memset(arena->base(), 0x22, arena->capacity());
    for (void* page : SamplePages(*arena)) EXPECT_EQ(NodeOf(page), node);
  }
}

TEST_F(NumaPolicyTest, BindWithoutNodeUsesTheCallingCpusNode) {
  std::unique_ptr<PinnedArena> arena = Create(NumaPolicy::kBind, -1);
  ASSERT_NE(arena, nullptr);
  SKIP_IF_REFUSED(arena);
  const PagePolicy p = PolicyAt(arena->base());
  EXPECT_EQ(p.mode, MPOL_BIND);
  ASSERT_EQ(p.nodes.size(), 1u);
  EXPECT_EQ(AllowedNodes().count(*p.nodes.begin()), 1u);
}

TEST_F(NumaPolicyTest, PreferredPrefersTheNode) {
  for (int node : AllowedNodes()) {
    SCOPED_TRACE(::testing::Message() << "node " << node);
    std::unique_ptr<PinnedArena> arena = Create(NumaPolicy::kPreferred, node);
    ASSERT_NE(arena, nullptr);
    SKIP_IF_REFUSED(arena);
    for (void* page : SamplePages(*arena)) {
      const PagePolicy p = PolicyAt(page);
      EXPECT_EQ(p.mode, MPOL_PREFERRED);
      EXPECT_EQ(p.nodes, std::set<int>{node});
    }
  }
  std::unique_ptr<PinnedArena> arena = Create(NumaPolicy::kPreferred, -1);
  ASSERT_NE(arena, nullptr);
  const PagePolicy p = PolicyAt(arena->base());
  EXPECT_EQ(p.mode, MPOL_PREFERRED);
  EXPECT_EQ(p.nodes.size(), 1u);
}

TEST_F(NumaPolicyTest, LocalAllocatesOnTheTouchingCpusNode) {
  std::unique_ptr<PinnedArena> arena = Create(NumaPolicy::kLocal, -1);
  ASSERT_NE(arena, nullptr);
  SKIP_IF_REFUSED(arena);
  for (void* page : SamplePages(*arena)) {
    const PagePolicy p = PolicyAt(page);
    // MPOL_LOCAL; kernels before 3.8 express it as MPOL_PREFERRED with an empty mask.
    const bool local = p.mode == MPOL_LOCAL || (p.mode == MPOL_PREFERRED && p.nodes.empty());
    EXPECT_TRUE(local) << "mode " << p.mode << " with " << p.nodes.size() << " node(s)";
  }
}

TEST_F(NumaPolicyTest, NodeCountMatchesLibnuma) {
  EXPECT_EQ(NumaNodeCount(), numa_num_configured_nodes());
}

}  // namespace
}  // namespace ferry
