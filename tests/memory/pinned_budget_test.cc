// PinnedBudget: accounting, refusals and their messages, arenas drawing from a shared budget, the
// process budget's default, and concurrent use.
#include "memory/pinned_budget.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <latch>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "memory/fake_device.h"
#include "memory/pinned_arena.h"

namespace ferry {
namespace {

using fakes::FakeDevice;

bool Contains(const absl::Status& s, const std::string& text) {
  return absl::StrContains(s.message(), text);
}

PinnedArenaOptions Options(size_t capacity, PinnedBudget* budget, const std::string& name) {
  PinnedArenaOptions options;
  options.capacity_bytes = capacity;
  options.numa = NumaPolicy::kLocal;
  options.huge_pages = HugePages::kOff;  // exact sizes: base pages only
  options.budget = budget;
  options.name = name;
  return options;
}

TEST(PinnedBudgetTest, ReserveReleaseAndPeak) {
  PinnedBudget budget(1000, "b");
  EXPECT_EQ(budget.limit(), 1000u);
  EXPECT_EQ(budget.name(), "b");
  ASSERT_TRUE(budget.Reserve(600, "first").ok());
  ASSERT_TRUE(budget.Reserve(400, "second").ok());  // exactly the limit
  PinnedBudgetStats st = budget.stats();
  EXPECT_EQ(st.reserved_bytes, 1000u);
  EXPECT_EQ(st.peak_bytes, 1000u);
  EXPECT_EQ(st.live_reservations, 2u);
  EXPECT_EQ(st.refusals, 0u);

  absl::Status s = budget.Reserve(1, "third");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_TRUE(Contains(s, "third")) << s;
  EXPECT_TRUE(Contains(s, "budget 'b'")) << s;
  EXPECT_TRUE(Contains(s, "limit is 1000 bytes")) << s;
  EXPECT_TRUE(Contains(s, "1000 bytes is reserved by 2 live arena(s)")) << s;
  EXPECT_TRUE(Contains(s, "leaving 0 bytes")) << s;
  EXPECT_TRUE(Contains(s, "set_limit")) << s;  // how to raise it
  EXPECT_EQ(budget.stats().refusals, 1u);
  EXPECT_EQ(budget.stats().reserved_bytes, 1000u);  // a refusal changes nothing

  budget.Release(600);
  st = budget.stats();
  EXPECT_EQ(st.reserved_bytes, 400u);
  EXPECT_EQ(st.peak_bytes, 1000u);
  EXPECT_EQ(st.live_reservations, 1u);
  budget.Release(400);
  EXPECT_EQ(budget.stats().reserved_bytes, 0u);
}

TEST(PinnedBudgetTest, LoweringTheLimitStopsLaterReservationsOnly) {
  PinnedBudget budget(1000);
  ASSERT_TRUE(budget.Reserve(800, "a").ok());
  budget.set_limit(500);
  EXPECT_EQ(budget.stats().reserved_bytes, 800u);
  EXPECT_EQ(budget.Reserve(1, "b").code(), absl::StatusCode::kResourceExhausted);
  budget.Release(800);
  EXPECT_TRUE(budget.Reserve(500, "c").ok());
  budget.Release(500);
  budget.set_limit(PinnedBudget::kUnlimited);
  absl::Status s = budget.Reserve(size_t{1} << 60, "d");
  EXPECT_TRUE(s.ok()) << s;
  budget.Release(size_t{1} << 60);
}

TEST(PinnedBudgetTest, ProcessBudgetStartsAtNinetyPercentOfUsableMemory) {
  const size_t physical =
      static_cast<size_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t limit = PinnedBudget::DefaultProcessLimit();
  EXPECT_GT(limit, 0u);
  EXPECT_LE(limit, physical / 10 * 9);
  EXPECT_EQ(PinnedBudget::Process().name(), "process");
  EXPECT_EQ(&PinnedBudget::Process(), &PinnedBudget::Process());
  // Arenas without a budget draw from it.
  FakeDevice device;
  const size_t before = PinnedBudget::Process().stats().reserved_bytes;
  absl::StatusOr<std::unique_ptr<PinnedArena>> arena =
      PinnedArena::Create(&device, Options(1 << 20, nullptr, "default budget"));
  ASSERT_TRUE(arena.ok()) << arena.status();
  EXPECT_EQ(&(*arena)->budget(), &PinnedBudget::Process());
  EXPECT_EQ(PinnedBudget::Process().stats().reserved_bytes, before + (1 << 20));
  arena->reset();
  EXPECT_EQ(PinnedBudget::Process().stats().reserved_bytes, before);
}

TEST(PinnedBudgetTest, ArenaRefusedByTheBudgetMapsAndRegistersNothing) {
  FakeDevice device;
  PinnedBudget budget(1 << 20, "offload");
  const PinnedHostCounters before = GetPinnedHostCounters();
  absl::Status s = PinnedArena::Create(&device, Options(2 << 20, &budget, "grads")).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_TRUE(Contains(s, "arena 'grads'")) << s;
  EXPECT_TRUE(Contains(s, "budget 'offload'")) << s;
  EXPECT_TRUE(Contains(s, "2097152 bytes (2.00 MiB)")) << s;  // what was asked
  EXPECT_TRUE(Contains(s, "1048576 bytes (1.00 MiB)")) << s;  // the limit
  EXPECT_TRUE(Contains(s, "set_limit")) << s;
  const PinnedHostCounters after = GetPinnedHostCounters();
  EXPECT_EQ(after.calls(), before.calls());  // stopped before any mmap or registration
  EXPECT_EQ(device.host_registrations(), 0u);
  EXPECT_EQ(budget.stats().refusals, 1u);
}

TEST(PinnedBudgetTest, ArenasShareTheBudgetAndGiveItBack) {
  FakeDevice device;
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  PinnedBudget budget(3 << 20, "shared");
  absl::StatusOr<std::unique_ptr<PinnedArena>> a =
      PinnedArena::Create(&device, Options(2 << 20, &budget, "a"));
  ASSERT_TRUE(a.ok()) << a.status();
  // The arena is charged its region's size: rounded up to pages.
  absl::StatusOr<std::unique_ptr<PinnedArena>> b =
      PinnedArena::Create(&device, Options(page + 1, &budget, "b"));
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(budget.stats().reserved_bytes, (2u << 20) + 2 * page);
  absl::Status s = PinnedArena::Create(&device, Options(1 << 20, &budget, "c")).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_TRUE(Contains(s, "by 2 live arena(s)")) << s;
  a->reset();  // gives its 2 MiB back
  absl::StatusOr<std::unique_ptr<PinnedArena>> c =
      PinnedArena::Create(&device, Options(1 << 20, &budget, "c"));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(budget.stats().reserved_bytes, (1u << 20) + 2 * page);
  EXPECT_EQ(budget.stats().peak_bytes, (2u << 20) + 2 * page);
  b->reset();
  c->reset();
  EXPECT_EQ(budget.stats().reserved_bytes, 0u);
  EXPECT_EQ(budget.stats().live_reservations, 0u);
}

// Threads create and destroy arenas against one budget: it is never exceeded, and everything comes
// back. (Run under ThreadSanitizer with -DFERRY_TSAN=ON.)
TEST(PinnedBudgetTest, ConcurrentArenasNeverExceedTheBudget) {
  FakeDevice device;
  constexpr int kThreads = 4;
  constexpr int kRounds = 40;
  constexpr size_t kArena = 1 << 20;
  PinnedBudget budget(2 * kArena, "concurrent");
  std::atomic<int> created{0}, refused{0}, other_errors{0};
  std::latch start(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      start.arrive_and_wait();
      for (int r = 0; r < kRounds; ++r) {
        absl::StatusOr<std::unique_ptr<PinnedArena>> arena = PinnedArena::Create(
            &device, Options(kArena, &budget, "t" + std::to_string(t)));
        if (arena.ok()) {
          ++created;
          absl::StatusOr<HostSpan> span = (*arena)->Allocate(4096);
          if (!span.ok() || !(*arena)->Release(*span).ok()) ++other_errors;
        } else if (arena.status().code() == absl::StatusCode::kResourceExhausted) {
          ++refused;
        } else {
          ++other_errors;
        }
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(other_errors.load(), 0);
  EXPECT_GT(created.load(), 0);
  EXPECT_EQ(created.load() + refused.load(), kThreads * kRounds);
  const PinnedBudgetStats st = budget.stats();
  EXPECT_LE(st.peak_bytes, 2 * kArena);
  EXPECT_EQ(st.reserved_bytes, 0u);
  EXPECT_EQ(st.refusals, static_cast<uint64_t>(refused.load()));
  EXPECT_TRUE(device.registered().empty());
}

}  // namespace
}  // namespace ferry
