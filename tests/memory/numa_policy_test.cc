// The arena's NUMA placement, read back from the kernel with get_mempolicy(MPOL_F_ADDR) on its pages.
#include <numa.h>
#include <numaif.h>
#include <sched.h>
#include <sys/mman.h>
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

// The prefault threads place the pages by the policy before anyone else touches them: the pages are
// resident right after Create (mincore, which touches nothing) and sit where the policy says, with base
// pages and with transparent huge pages.
class PrefaultPlacementTest : public ::testing::TestWithParam<HugePages> {
 protected:
  void SetUp() override {
    if (numa_available() < 0) GTEST_SKIP() << "libnuma: NUMA is not available on this system";
  }

  std::unique_ptr<PinnedArena> Create(NumaPolicy policy, int node) {
    PinnedArenaOptions options;
    options.capacity_bytes = kBytes;
    options.numa = policy;
    options.numa_node = node;
    options.huge_pages = GetParam();
    options.prefault_threads = 4;
    options.name = std::string(NumaPolicyName(policy)) + " prefault";
    absl::StatusOr<std::unique_ptr<PinnedArena>> arena = PinnedArena::Create(&device_, options);
    EXPECT_TRUE(arena.ok()) << arena.status();
    if (!arena.ok()) return nullptr;
    EXPECT_GE((*arena)->setup().prefault_threads, 2);
    return *std::move(arena);
  }

  // Every MiB of the arena: resident already, and on one of `nodes`. Returns the nodes seen.
  std::set<int> CheckPlaced(const PinnedArena& arena, const std::set<int>& nodes) {
    std::set<int> seen;
    char* base = static_cast<char*>(arena.base());
    for (size_t off = 0; off < arena.capacity(); off += size_t{1} << 20) {
      unsigned char resident = 0;
      EXPECT_EQ(mincore(base + off, PageSize(), &resident), 0) << std::strerror(errno);
      EXPECT_EQ(resident & 1, 1) << "page at offset " << off << " was not prefaulted";
      const int node = NodeOf(base + off);
      EXPECT_EQ(nodes.count(node), 1u) << "page at offset " << off << " on node " << node;
      seen.insert(node);
    }
    return seen;
  }

  static constexpr size_t kBytes = size_t{16} << 20;
  FakeDevice device_;
};

TEST_P(PrefaultPlacementTest, Interleave) {
  std::unique_ptr<PinnedArena> arena = Create(NumaPolicy::kInterleave, -1);
  ASSERT_NE(arena, nullptr);
  SKIP_IF_REFUSED(arena);
  EXPECT_EQ(PolicyAt(arena->base()).mode, MPOL_INTERLEAVE);
  // 16 MiB interleaved in pages of at most 2 MiB reaches every node (of up to 8).
  const std::set<int> seen = CheckPlaced(*arena, AllowedNodes());
  if (AllowedNodes().size() <= 8) {
    EXPECT_EQ(seen, AllowedNodes());
  }
}

TEST_P(PrefaultPlacementTest, BindAndPreferred) {
  for (NumaPolicy policy : {NumaPolicy::kBind, NumaPolicy::kPreferred}) {
    for (int node : AllowedNodes()) {
      SCOPED_TRACE(::testing::Message() << NumaPolicyName(policy) << " node " << node);
      std::unique_ptr<PinnedArena> arena = Create(policy, node);
      ASSERT_NE(arena, nullptr);
      SKIP_IF_REFUSED(arena);
      EXPECT_EQ(PolicyAt(arena->base()).mode,
                policy == NumaPolicy::kBind ? MPOL_BIND : MPOL_PREFERRED);
      CheckPlaced(*arena, {node});
    }
  }
}

TEST_P(PrefaultPlacementTest, LocalMeansTheCreatingThreadsNode) {
  // Keep this thread on its node while the arena is created (restored below).
  const int cpu = sched_getcpu();
  ASSERT_GE(cpu, 0);
  const int node = numa_node_of_cpu(cpu);
  ASSERT_EQ(numa_run_on_node(node), 0) << std::strerror(errno);
  std::unique_ptr<PinnedArena> arena = Create(NumaPolicy::kLocal, -1);
  numa_run_on_node_mask(numa_all_nodes_ptr);
  ASSERT_NE(arena, nullptr);
  SKIP_IF_REFUSED(arena);
  CheckPlaced(*arena, {node});
}

INSTANTIATE_TEST_SUITE_P(Pages, PrefaultPlacementTest,
                         ::testing::Values(HugePages::kOff, HugePages::kTransparent),
                         [](const ::testing::TestParamInfo<HugePages>& param) {
                           return std::string(HugePagesName(param.param));
                         });

TEST_F(NumaPolicyTest, NodeCountMatchesLibnuma) {
  EXPECT_EQ(NumaNodeCount(), numa_num_configured_nodes());
}

}  // namespace
}  // namespace ferry
