// How an arena's region is set up: huge pages and their fallbacks, parallel prefaulting (checked with
// mincore), the setup record, and the process-wide pin/register/host-alloc counters staying flat
// across any number of allocations and releases.
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "memory/fake_device.h"
#include "memory/host_region.h"
#include "memory/pinned_arena.h"

namespace ferry {
namespace {

using fakes::FakeDevice;

constexpr size_t kMiB = size_t{1} << 20;

size_t PageSize() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }

bool Contains(const absl::Status& s, const std::string& text) {
  return absl::StrContains(s.message(), text);
}

// Resident base pages of [base, base + bytes), from mincore (which touches nothing).
size_t ResidentPages(void* base, size_t bytes) {
  const size_t pages = (bytes + PageSize() - 1) / PageSize();
  std::vector<unsigned char> vec(pages);
  EXPECT_EQ(mincore(base, bytes, vec.data()), 0) << std::strerror(errno);
  size_t resident = 0;
  for (unsigned char v : vec) resident += v & 1;
  return resident;
}

PinnedArenaOptions Options(size_t capacity, HugePages huge, int prefault_threads) {
  PinnedArenaOptions options;
  options.capacity_bytes = capacity;
  options.numa = NumaPolicy::kLocal;
  options.huge_pages = huge;
  options.prefault_threads = prefault_threads;
  options.name = "setup";
  return options;
}

std::unique_ptr<PinnedArena> Create(Device* device, const PinnedArenaOptions& options) {
  absl::StatusOr<std::unique_ptr<PinnedArena>> arena = PinnedArena::Create(device, options);
  EXPECT_TRUE(arena.ok()) << arena.status();
  return arena.ok() ? *std::move(arena) : nullptr;
}

TEST(HugePagesTest, ParsesEveryName) {
  for (HugePages h : {HugePages::kAuto, HugePages::kTransparent, HugePages::kHugetlb, HugePages::kOff}) {
    absl::StatusOr<HugePages> parsed = ParseHugePages(HugePagesName(h));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, h);
  }
  EXPECT_EQ(*ParseHugePages("Transparent"), HugePages::kTransparent);
  absl::Status s = ParseHugePages("giant").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(s, "'giant'")) << s;
  EXPECT_TRUE(Contains(s, "auto, thp, hugetlb, off")) << s;
  EXPECT_EQ(PageKindName(PageKind::kTransparentHuge), "thp");
}

TEST(ArenaSetupTest, PrefaultThreadsFaultEveryPageIn) {
  FakeDevice device;  // registers nothing for real: residency comes from the prefault alone
  for (int threads : {1, 3, 8}) {
    SCOPED_TRACE(::testing::Message() << threads << " thread(s)");
    std::unique_ptr<PinnedArena> arena =
        Create(&device, Options(16 * kMiB + 5, HugePages::kOff, threads));
    ASSERT_NE(arena, nullptr);
    const ArenaSetup& setup = arena->setup();
    EXPECT_GE(setup.prefault_threads, 1);
    EXPECT_LE(setup.prefault_threads, threads);
    EXPECT_EQ(ResidentPages(arena->base(), arena->capacity()), arena->capacity() / PageSize());
    // Anonymous memory: zeros, and writable.
    const auto* bytes = static_cast<const uint8_t*>(arena->base());
    for (size_t i = 0; i < arena->capacity(); i += 4093) ASSERT_EQ(bytes[i], 0) << "byte " << i;
    std::memset(arena->base(), 0x3C, arena->capacity());
  }
}

TEST(ArenaSetupTest, WithoutPrefaultNoPageIsTouched) {
  FakeDevice device;
  std::unique_ptr<PinnedArena> arena = Create(&device, Options(4 * kMiB, HugePages::kOff, 0));
  ASSERT_NE(arena, nullptr);
  EXPECT_EQ(arena->setup().prefault_threads, 0);
  EXPECT_EQ(arena->setup().prefault_seconds >= 0, true);
  EXPECT_EQ(ResidentPages(arena->base(), arena->capacity()), 0u);
}

TEST(ArenaSetupTest, AutomaticPrefaultUsesOneThreadPer64MiB) {
  FakeDevice device;
  std::unique_ptr<PinnedArena> small = Create(&device, Options(1 * kMiB, HugePages::kOff, -1));
  ASSERT_NE(small, nullptr);
  EXPECT_EQ(small->setup().prefault_threads, 1);
  EXPECT_EQ(ResidentPages(small->base(), small->capacity()), small->capacity() / PageSize());
  EXPECT_EQ(memory_internal::AutoPrefaultThreads(64 * kMiB - 1, {}), 1);
  EXPECT_LE(memory_internal::AutoPrefaultThreads(size_t{1} << 40, {}), 32);
  EXPECT_GE(memory_internal::AutoPrefaultThreads(size_t{1} << 40, {}), 1);
}

TEST(ArenaSetupTest, RejectsANegativeThreadCount) {
  FakeDevice device;
  absl::Status s = PinnedArena::Create(&device, Options(kMiB, HugePages::kOff, -2)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(Contains(s, "prefault_threads -2")) << s;
}

TEST(ArenaSetupTest, SetupRecordsTheSteps) {
  FakeDevice device;
  std::unique_ptr<PinnedArena> arena = Create(&device, Options(8 * kMiB, HugePages::kOff, 2));
  ASSERT_NE(arena, nullptr);
  const ArenaSetup& setup = arena->setup();
  EXPECT_EQ(setup.pages, PageKind::kBase);
  EXPECT_TRUE(setup.pages_note.empty()) << setup.pages_note;
  EXPECT_GE(setup.reserve_seconds, 0.0);
  EXPECT_GE(setup.prefault_seconds, 0.0);
  EXPECT_GE(setup.register_seconds, 0.0);
  EXPECT_DOUBLE_EQ(setup.total_seconds(),
                   setup.reserve_seconds + setup.prefault_seconds + setup.register_seconds);
  EXPECT_EQ(setup.huge_bytes, 0u) << "base pages, marked so that khugepaged leaves them";
  EXPECT_EQ(setup.host_calls, 2u);  // one mmap, one registration
  EXPECT_EQ(arena->stats().host_calls, 2u);
  EXPECT_EQ(setup.numa_applied, arena->numa_applied());
}

TEST(ArenaSetupTest, TransparentHugePagesAreAlignedOrExplained) {
  FakeDevice device;
  const HugePageInfo info = ReadHugePageInfo();
  std::unique_ptr<PinnedArena> arena =
      Create(&device, Options(8 * kMiB, HugePages::kTransparent, 2));
  ASSERT_NE(arena, nullptr);
  if (info.thp_enabled == "never") {
    EXPECT_EQ(arena->setup().pages, PageKind::kBase);
    EXPECT_TRUE(absl::StrContains(arena->setup().pages_note, "never")) << arena->setup().pages_note;
  } else {
    EXPECT_EQ(arena->setup().pages, PageKind::kTransparentHuge) << arena->setup().pages_note;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(arena->base()) % (2 * kMiB), 0u);
  }
  EXPECT_EQ(arena->capacity(), 8 * kMiB);
  // What the kernel managed to back with huge pages: whole ones, within the region (on a host with
  // memory to spare, all of it; a fragmented one may give fewer).
  EXPECT_LE(arena->setup().huge_bytes, arena->capacity());
  EXPECT_EQ(arena->setup().huge_bytes % (2 * kMiB), 0u);
  EXPECT_EQ(ResidentPages(arena->base(), arena->capacity()), arena->capacity() / PageSize());
  std::memset(arena->base(), 0x42, arena->capacity());  // all of it is usable memory

  // Smaller than a huge page: nothing to gain, base pages.
  std::unique_ptr<PinnedArena> small = Create(&device, Options(64 << 10, HugePages::kTransparent, 1));
  ASSERT_NE(small, nullptr);
  EXPECT_EQ(small->setup().pages, PageKind::kBase);
  EXPECT_EQ(small->capacity(), size_t{64} << 10);
}

// The huge-page bytes of a range, from /proc/<pid>/smaps: only mappings that overlap it count, each
// at most its overlap (a mapping merged with a neighbour), and every kind of PMD mapping counts.
TEST(HugeBackedBytesTest, CountsTheRangesHugePagesFromSmaps) {
  const std::string smaps =
      "7f0000000000-7f0000400000 rw-p 00000000 00:00 0 \n"  // before the range: 4 MiB, all huge
      "Size:               4096 kB\n"
      "AnonHugePages:      4096 kB\n"
      "VmFlags: rd wr mr mw me ac sd hg\n"
      "7f0000400000-7f0000c00000 rw-p 00000000 00:00 0 \n"  // 8 MiB, 2 MiB of it before the range
      "Size:               8192 kB\n"
      "AnonHugePages:      8192 kB\n"
      "ShmemPmdMapped:        0 kB\n"
      "THPeligible:    1\n"
      "7f0000c00000-7f0001000000 rw-s 00000000 00:05 1234  /dev/zero (deleted)\n"  // 4 MiB, 2 MiB huge
      "AnonHugePages:         0 kB\n"
      "ShmemPmdMapped:     2048 kB\n"
      "FilePmdMapped:         0 kB\n"
      "7f0001000000-7f0001200000 rw-p 00000000 00:00 0 [anon:after]\n"  // after the range
      "AnonHugePages:      2048 kB\n";
  const uintptr_t begin = 0x7f0000600000, end = 0x7f0001000000;  // 10 MiB
  EXPECT_EQ(memory_internal::HugeBackedBytesIn(smaps, begin, end), 6 * kMiB + 2 * kMiB);
  EXPECT_EQ(memory_internal::HugeBackedBytesIn(smaps, 0x7f0000000000, 0x7f0000200000), 2 * kMiB);
  EXPECT_EQ(memory_internal::HugeBackedBytesIn(smaps, 0x6000, 0x8000), 0u);
  EXPECT_EQ(memory_internal::HugeBackedBytesIn("", begin, end), 0u);
  // A hugetlb region is huge pages all through; a base-page region reads 0 without a look, and so
  // does a range of this process that THP leaves alone, read from smaps.
  const size_t bytes = 64 << 10;  // a mapping of its own (smaller than a huge page) that THP leaves alone
  void* plain = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(plain, MAP_FAILED) << std::strerror(errno);
  ASSERT_EQ(madvise(plain, bytes, MADV_NOHUGEPAGE), 0) << std::strerror(errno);
  std::memset(plain, 1, bytes);
  EXPECT_EQ(memory_internal::HugeBackedBytes(plain, bytes, PageKind::kHugetlb), bytes);
  EXPECT_EQ(memory_internal::HugeBackedBytes(plain, bytes, PageKind::kBase), 0u);
  EXPECT_EQ(memory_internal::HugeBackedBytes(plain, bytes, PageKind::kTransparentHuge), 0u);
  munmap(plain, bytes);
}

TEST(ArenaSetupTest, HugetlbWithoutRoomFailsWithHowToGrowThePool) {
  const HugePageInfo info = ReadHugePageInfo();
  if (info.hugetlb_page_bytes == 0) GTEST_SKIP() << "this kernel reports no hugetlb page size";
  FakeDevice device;
  PinnedBudget budget(PinnedBudget::kUnlimited, "hugetlb test");
  // More hugetlb pages than the pool has free.
  PinnedArenaOptions options =
      Options((info.hugetlb_free_pages + 1) * info.hugetlb_page_bytes, HugePages::kHugetlb, 1);
  options.budget = &budget;
  options.name = "pool";
  const PinnedHostCounters before = GetPinnedHostCounters();
  absl::Status s = PinnedArena::Create(&device, options).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_TRUE(Contains(s, "arena 'pool'")) << s;
  EXPECT_TRUE(Contains(s, "MAP_HUGETLB")) << s;
  EXPECT_TRUE(Contains(s, "vm.nr_hugepages")) << s;
  EXPECT_EQ(GetPinnedHostCounters().mmap_calls - before.mmap_calls, 1u);  // the failed attempt
  EXPECT_EQ(GetPinnedHostCounters().register_calls, before.register_calls);
  EXPECT_EQ(budget.stats().reserved_bytes, 0u);
  EXPECT_EQ(device.host_registrations(), 0u);
}

TEST(ArenaSetupTest, HugetlbWhenThePoolHasRoom) {
  const HugePageInfo info = ReadHugePageInfo();
  if (info.hugetlb_page_bytes == 0 || info.hugetlb_free_pages < 2) {
    GTEST_SKIP() << "no free hugetlb pages (HugePages_Free " << info.hugetlb_free_pages
                 << "; `sysctl vm.nr_hugepages=8` to run this test)";
  }
  FakeDevice device;
  for (HugePages mode : {HugePages::kHugetlb, HugePages::kAuto}) {
    SCOPED_TRACE(HugePagesName(mode));
    std::unique_ptr<PinnedArena> arena = Create(&device, Options(info.hugetlb_page_bytes + 1, mode, 2));
    ASSERT_NE(arena, nullptr);
    EXPECT_EQ(arena->setup().pages, PageKind::kHugetlb) << arena->setup().pages_note;
    EXPECT_EQ(arena->capacity(), 2 * info.hugetlb_page_bytes);  // whole hugetlb pages
    EXPECT_EQ(reinterpret_cast<uintptr_t>(arena->base()) % info.hugetlb_page_bytes, 0u);
    std::memset(arena->base(), 0x17, arena->capacity());
    absl::StatusOr<HostSpan> span = arena->Allocate(arena->capacity());
    ASSERT_TRUE(span.ok()) << span.status();
    ASSERT_TRUE(arena->Release(*span).ok());
  }
}

TEST(ArenaSetupTest, AutoFallsBackWithoutHugetlbRoom) {
  const HugePageInfo info = ReadHugePageInfo();
  if (info.hugetlb_page_bytes > 0 && info.hugetlb_free_pages * info.hugetlb_page_bytes >= 8 * kMiB) {
    GTEST_SKIP() << "the hugetlb pool has room: kAuto takes it (HugetlbWhenThePoolHasRoom)";
  }
  FakeDevice device;
  std::unique_ptr<PinnedArena> arena = Create(&device, Options(8 * kMiB, HugePages::kAuto, 2));
  ASSERT_NE(arena, nullptr);
  const PageKind expected =
      info.thp_enabled == "never" ? PageKind::kBase : PageKind::kTransparentHuge;
  EXPECT_EQ(arena->setup().pages, expected) << arena->setup().pages_note;
  EXPECT_EQ(arena->capacity(), 8 * kMiB);
}

// The counters of pin/register/host-alloc calls: Create makes them, nothing else does.
TEST(PinnedHostCountersTest, FlatAcrossAnyNumberOfAllocationsAndReleases) {
  FakeDevice device;
  const PinnedHostCounters start = GetPinnedHostCounters();
  std::unique_ptr<PinnedArena> arena = Create(&device, Options(4 * kMiB, HugePages::kOff, 1));
  ASSERT_NE(arena, nullptr);
  const PinnedHostCounters warm = GetPinnedHostCounters();
  EXPECT_EQ(warm.mmap_calls - start.mmap_calls, 1u);
  EXPECT_EQ(warm.register_calls - start.register_calls, 1u);
  EXPECT_EQ(warm.arenas_created - start.arenas_created, 1u);
  EXPECT_EQ(warm.arenas_live - start.arenas_live, 1u);
  EXPECT_EQ(warm.calls() - start.calls(), 2u);

  std::mt19937_64 rng(std::random_device{}());
  std::vector<HostSpan> live;
  for (int i = 0; i < 20000; ++i) {
    if (live.size() < 64 && (live.empty() || rng() % 2 == 0)) {
      absl::StatusOr<HostSpan> span = arena->Allocate(1 + rng() % 100000, size_t{1} << (rng() % 12));
      if (span.ok()) live.push_back(*span);
    } else {
      const size_t k = rng() % live.size();
      ASSERT_TRUE(arena->Release(live[k]).ok());
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
    }
  }
  for (const HostSpan& s : live) ASSERT_TRUE(arena->Release(s).ok());
  const PinnedHostCounters after = GetPinnedHostCounters();
  EXPECT_EQ(after.calls(), warm.calls());
  EXPECT_EQ(after.unregister_calls, warm.unregister_calls);
  EXPECT_EQ(arena->stats().host_calls, 2u);
  EXPECT_EQ(arena->stats().registrations, 1u);
  EXPECT_EQ(device.host_registrations(), 1u);
  EXPECT_GT(arena->stats().allocations, 1000u);

  arena.reset();
  const PinnedHostCounters end = GetPinnedHostCounters();
  EXPECT_EQ(end.unregister_calls - warm.unregister_calls, 1u);
  EXPECT_EQ(end.arenas_live, start.arenas_live);
  EXPECT_EQ(end.calls(), warm.calls());
}

}  // namespace
}  // namespace ferry
