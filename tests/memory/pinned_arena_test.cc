// PinnedArena: creation and its errors, alignment, fragmentation against a reference model, reuse
// without re-registration, release errors, exhaustion messages, threads, stats, PinnedBlock.
#include "memory/pinned_arena.h"

#include <numa.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <latch>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "memory/fake_device.h"

namespace ferry {
namespace {

using fakes::FakeDevice;

#define FERRY_TEST_ASSERT_OK(expr)                     \
  do {                                                 \
    const absl::Status ferry_test_s_ = (expr);         \
    ASSERT_TRUE(ferry_test_s_.ok()) << ferry_test_s_;  \
  } while (0)

size_t RoundUp(size_t x, size_t a) { return (x + a - 1) / a * a; }

bool Contains(const absl::Status& s, const std::string& text) {
  return absl::StrContains(s.message(), text);
}

std::unique_ptr<PinnedArena> MakeArena(Device* device, size_t capacity, size_t alignment = 256,
                                       const std::string& name = "test") {
  PinnedArenaOptions options;
  options.capacity_bytes = capacity;
  options.alignment = alignment;
  options.name = name;
  // kLocal: valid on every machine, so these tests do not depend on the NUMA layout.
  options.numa = NumaPolicy::kLocal;
  absl::StatusOr<std::unique_ptr<PinnedArena>> arena = PinnedArena::Create(device, options);
  EXPECT_TRUE(arena.ok()) << arena.status();
  return arena.ok() ? *std::move(arena) : nullptr;
}

TEST(NumaPolicyTest, ParsesEveryName) {
  for (NumaPolicy p : {NumaPolicy::kInterleave, NumaPolicy::kBind, NumaPolicy::kPreferred,
                       NumaPolicy::kLocal}) {
    absl::StatusOr<NumaPolicy> parsed = ParseNumaPolicy(NumaPolicyName(p));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, p);
  }
  EXPECT_EQ(*ParseNumaPolicy("Interleave"), NumaPolicy::kInterleave);
  absl::StatusOr<NumaPolicy> bad = ParseNumaPolicy("spread");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(bad.status(), "'spread'")) << bad.status();
  EXPECT_TRUE(Contains(bad.status(), "interleave, bind, preferred, local")) << bad.status();
  EXPECT_GE(NumaNodeCount(), 1);
}

TEST(PinnedArenaTest, CreateRegistersOncePageAlignedAndUnregistersOnDestruction) {
  FakeDevice device;
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  std::unique_ptr<PinnedArena> arena = MakeArena(&device, 3 * page + 1);
  ASSERT_NE(arena, nullptr);
  EXPECT_EQ(arena->capacity(), 4 * page);  // rounded up to pages
  EXPECT_EQ(reinterpret_cast<uintptr_t>(arena->base()) % page, 0u);
  EXPECT_EQ(arena->device(), &device);
  EXPECT_EQ(arena->numa_policy(), NumaPolicy::kLocal);
  EXPECT_EQ(device.host_registrations(), 1u);
  EXPECT_EQ(device.registered(), (std::map<void*, size_t>{{arena->base(), 4 * page}}));
  // The whole region is usable memory.
  std::memset(arena->base(), 0x5A, arena->capacity());
  arena.reset();
  EXPECT_EQ(device.unregistrations(), 1u);
  EXPECT_TRUE(device.registered().empty());
}

TEST(PinnedArenaTest, CreateRejectsBadOptions) {
  FakeDevice device;
  PinnedArenaOptions options;
  options.name = "grads";
  options.capacity_bytes = 1 << 20;
  EXPECT_EQ(PinnedArena::Create(nullptr, options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options.capacity_bytes = 0;
  absl::Status s = PinnedArena::Create(&device, options).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(s, "'grads'")) << s;
  options.capacity_bytes = 1 << 20;
  options.alignment = 48;
  s = PinnedArena::Create(&device, options).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(s, "48")) << s;
  options.alignment = 256;
  options.numa = NumaPolicy::kBind;
  options.numa_node = 1 << 20;  // no machine has that node
  if (numa_available() >= 0) {  // without NUMA support no node is checked (nor applied)
    s = PinnedArena::Create(&device, options).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_TRUE(Contains(s, "allowed nodes")) << s;
  }
  EXPECT_EQ(device.host_registrations(), 0u);
}

TEST(PinnedArenaTest, MmapFailureSaysSo) {
  FakeDevice device;
  PinnedBudget unlimited(PinnedBudget::kUnlimited, "unlimited");
  PinnedArenaOptions options;
  options.budget = &unlimited;  // so that the mmap, not the budget, is what refuses
  options.name = "huge";
  options.numa = NumaPolicy::kLocal;
  options.capacity_bytes = size_t{1} << 62;  // more address space than any machine has
  absl::Status s = PinnedArena::Create(&device, options).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_TRUE(Contains(s, "mmap")) << s;
  EXPECT_TRUE(Contains(s, "'huge'")) << s;
  EXPECT_EQ(device.host_registrations(), 0u);
  EXPECT_EQ(unlimited.stats().reserved_bytes, 0u);  // given back
  EXPECT_EQ(unlimited.stats().live_reservations, 0u);
}

// Lowers RLIMIT_MEMLOCK's soft limit for the scope (lowering is always allowed; the old soft limit is
// at most the hard one, so restoring it is allowed too).
class ScopedMemlockLimit final {
 public:
  explicit ScopedMemlockLimit(rlim_t soft) {
    ok_ = getrlimit(RLIMIT_MEMLOCK, &saved_) == 0;
    rlimit lowered = saved_;
    lowered.rlim_cur = soft;
    ok_ = ok_ && (saved_.rlim_cur == RLIM_INFINITY || soft <= saved_.rlim_cur) &&
          setrlimit(RLIMIT_MEMLOCK, &lowered) == 0;
  }
  ~ScopedMemlockLimit() {
    if (ok_) setrlimit(RLIMIT_MEMLOCK, &saved_);
  }
  bool ok() const { return ok_; }

 private:
  rlimit saved_{};
  bool ok_ = false;
};

TEST(PinnedArenaTest, RegistrationFailureBelowTheMemlockLimitSaysSoAndHowToRaiseIt) {
  FakeDevice device;
  PinnedBudget budget(PinnedBudget::kUnlimited, "test");
  PinnedArenaOptions options;
  options.name = "master";
  options.numa = NumaPolicy::kLocal;
  options.capacity_bytes = 1 << 20;
  options.budget = &budget;
  const PinnedHostCounters before = GetPinnedHostCounters();
  {
    ScopedMemlockLimit limit(64 << 10);  // 64 KiB: below the 1 MiB arena
    ASSERT_TRUE(limit.ok()) << "cannot lower RLIMIT_MEMLOCK";
    device.FailNextRegistration(absl::ResourceExhaustedError("cudaHostRegister: out of memory"));
    absl::Status s = PinnedArena::Create(&device, options).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
    EXPECT_TRUE(Contains(s, "'master'")) << s;
    EXPECT_TRUE(Contains(s, "cudaHostRegister: out of memory")) << s;  // the cause
    EXPECT_TRUE(Contains(s, "memlock limit is the likely cause")) << s;
    EXPECT_TRUE(Contains(s, "RLIMIT_MEMLOCK soft 65536 bytes")) << s;
    EXPECT_TRUE(Contains(s, "ulimit -l")) << s;
    EXPECT_TRUE(Contains(s, "limits.conf")) << s;
  }
  EXPECT_TRUE(device.registered().empty());
  EXPECT_EQ(budget.stats().reserved_bytes, 0u);  // nothing stays reserved
  // One mmap and one registration attempt were made and counted.
  const PinnedHostCounters after = GetPinnedHostCounters();
  EXPECT_EQ(after.register_calls - before.register_calls, 1u);
  EXPECT_GE(after.mmap_calls - before.mmap_calls, 1u);
  EXPECT_EQ(after.arenas_live, before.arenas_live);
  // The next attempt works.
  EXPECT_TRUE(PinnedArena::Create(&device, options).ok());
}

TEST(PinnedArenaTest, RegistrationFailureAboveTheMemlockLimitBlamesTheDevice) {
  FakeDevice device;
  PinnedArenaOptions options;
  options.name = "master";
  options.numa = NumaPolicy::kLocal;
  options.capacity_bytes = 64 << 10;
  rlimit rl{};
  ASSERT_EQ(getrlimit(RLIMIT_MEMLOCK, &rl), 0);
  if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < (rlim_t{1} << 20)) {
    GTEST_SKIP() << "RLIMIT_MEMLOCK is " << rl.rlim_cur << ": too low to rule it out";
  }
  device.FailNextRegistration(absl::InternalError("cudaHostRegister: driver says no"));
  absl::Status s = PinnedArena::Create(&device, options).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_TRUE(Contains(s, "driver says no")) << s;
  EXPECT_TRUE(Contains(s, "memlock limit is not what stopped it")) << s;
  EXPECT_TRUE(Contains(s, "RLIMIT_MEMLOCK soft")) << s;
}

TEST(PinnedArenaTest, EverySpanIsAlignedAndInside) {
  FakeDevice device;
  // Room for every span at its worst padding (200 x (3000 + 64 KiB)): random alignments of up to
  // 64 KiB once exhausted a 1 MiB arena.
  std::unique_ptr<PinnedArena> arena = MakeArena(&device, 16 << 20);
  ASSERT_NE(arena, nullptr);
  const auto base = reinterpret_cast<uintptr_t>(arena->base());
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  std::vector<HostSpan> spans;
  for (int i = 0; i < 200; ++i) {
    const size_t alignment = i % 3 == 0 ? 0 : size_t{1} << (rng() % 17);  // 0 = default 256
    const size_t bytes = 1 + rng() % 3000;
    absl::StatusOr<HostSpan> span = arena->Allocate(bytes, alignment);
    ASSERT_TRUE(span.ok()) << span.status();
    const auto addr = reinterpret_cast<uintptr_t>(span->data);
    EXPECT_EQ(addr % (alignment == 0 ? 256 : alignment), 0u) << "alignment " << alignment;
    EXPECT_EQ(addr % PinnedArena::kGranule, 0u);
    EXPECT_EQ(span->bytes, bytes);
    EXPECT_EQ(span->offset, addr - base);
    EXPECT_LE(span->offset + bytes, arena->capacity());
    EXPECT_EQ(span->as<char>(), static_cast<char*>(span->data));
    EXPECT_FALSE(span->empty());
    spans.push_back(*span);
  }
  for (const HostSpan& s : spans) FERRY_TEST_ASSERT_OK(arena->Release(s));
}

TEST(PinnedArenaTest, ZeroBytesAndBadAlignmentAreInvalid) {
  FakeDevice device;
  std::unique_ptr<PinnedArena> arena = MakeArena(&device, 1 << 16);
  ASSERT_NE(arena, nullptr);
  absl::Status s = arena->Allocate(0).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(s, "0 bytes")) << s;
  s = arena->Allocate(64, 3).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(arena->stats().allocations, 0u);
}

TEST(PinnedArenaTest, ExhaustionNamesRequestFreeLargestAndCapacity) {
  FakeDevice device;
  std::unique_ptr<PinnedArena> arena = MakeArena(&device, 1 << 20, 256, "grads");
  ASSERT_NE(arena, nullptr);
  // Four quarters, then free two that are not adjacent: 512 KiB free, largest block 256 KiB.
  std::vector<HostSpan> q;
  for (int i = 0; i < 4; ++i) q.push_back(*arena->Allocate(256 << 10));
  FERRY_TEST_ASSERT_OK(arena->Release(q[0]));
  FERRY_TEST_ASSERT_OK(arena->Release(q[2]));
  absl::Status s = arena->Allocate(300 << 10).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_TRUE(Contains(s, "'grads'")) << s;
  EXPECT_TRUE(Contains(s, "cannot allocate 307200 bytes")) << s;
  EXPECT_TRUE(Contains(s, "524288 bytes")) << s;                   // free
  EXPECT_TRUE(Contains(s, "largest free block 262144 bytes")) << s;
  EXPECT_TRUE(Contains(s, "capacity 1048576 bytes")) << s;
  // A request that fits the largest block still works.
  absl::StatusOr<HostSpan> fits = arena->Allocate(256 << 10);
  ASSERT_TRUE(fits.ok()) << fits.status();
  FERRY_TEST_ASSERT_OK(arena->Release(*fits));
  FERRY_TEST_ASSERT_OK(arena->Release(q[1]));
  FERRY_TEST_ASSERT_OK(arena->Release(q[3]));
}

TEST(PinnedArenaTest, ReleaseErrorsAreClearAndChangeNothing) {
  FakeDevice device;
  std::unique_ptr<PinnedArena> arena = MakeArena(&device, 1 << 16, 256, "stage");
  std::unique_ptr<PinnedArena> other = MakeArena(&device, 1 << 16, 256, "other");
  ASSERT_NE(arena, nullptr);
  ASSERT_NE(other, nullptr);
  HostSpan a = *arena->Allocate(1000);
  HostSpan b = *arena->Allocate(2000);
  HostSpan foreign = *other->Allocate(1000);
  const ArenaStats before = arena->stats();

  absl::Status s = arena->Release(foreign);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(Contains(s, "foreign pointer")) << s;
  EXPECT_TRUE(Contains(s, "'stage'")) << s;

  int on_stack = 0;
  s = arena->Release(HostSpan{.data = &on_stack, .bytes = sizeof(on_stack), .offset = 0});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;

  s = arena->Release(HostSpan{});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(Contains(s, "empty span")) << s;

  HostSpan wrong_size = a;
  wrong_size.bytes = 999;
  s = arena->Release(wrong_size);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(Contains(s, "999")) << s;
  EXPECT_TRUE(Contains(s, "1000")) << s;

  HostSpan inside{.data = static_cast<char*>(b.data) + 64, .bytes = 100, .offset = b.offset + 64};
  s = arena->Release(inside);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(Contains(s, "inside the allocation")) << s;

  HostSpan wrong_offset = a;
  wrong_offset.offset += 256;
  s = arena->Release(wrong_offset);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;

  const ArenaStats after_errors = arena->stats();
  EXPECT_EQ(after_errors.in_use_bytes, before.in_use_bytes);
  EXPECT_EQ(after_errors.releases, 0u);

  FERRY_TEST_ASSERT_OK(arena->Release(a));
  s = arena->Release(a);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_TRUE(Contains(s, "double release")) << s;
  EXPECT_EQ(arena->stats().releases, 1u);

  FERRY_TEST_ASSERT_OK(arena->Release(b));
  FERRY_TEST_ASSERT_OK(other->Release(foreign));
}

// Random allocate/release sequences on the arena, checked against a model of the used ranges: no two
// live spans overlap (also checked through memory: each span carries its own byte pattern until it is
// released), and once everything is released the full capacity comes back as one span. The device
// sees exactly one registration throughout.
TEST(PinnedArenaTest, FragmentationAgainstReferenceModelWithoutReRegistering) {
  FakeDevice device;
  constexpr size_t kCapacity = 1 << 20;
  std::unique_ptr<PinnedArena> arena = MakeArena(&device, kCapacity);
  ASSERT_NE(arena, nullptr);
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  struct Live {
    HostSpan span;
    uint8_t tag;
  };
  std::map<size_t, Live> live;  // offset -> span
  uint64_t allocations = 0;
  uint64_t releases = 0;
  int exhausted = 0;
  size_t peak = 0;

  auto verify_and_release = [&](std::map<size_t, Live>::iterator it) {
    const auto* p = it->second.span.as<const uint8_t>();
    for (size_t i = 0; i < it->second.span.bytes; ++i) {
      ASSERT_EQ(p[i], it->second.tag) << "span at offset " << it->first << " byte " << i;
    }
    FERRY_TEST_ASSERT_OK(arena->Release(it->second.span));
    ++releases;
    live.erase(it);
  };

  for (int step = 0; step < 5000; ++step) {
    if (live.empty() || rng() % 100 < 55) {
      const size_t bytes = 1 + rng() % (rng() % 8 == 0 ? 100000 : 5000);
      const size_t alignment = size_t{1} << (rng() % 13);
      absl::StatusOr<HostSpan> span = arena->Allocate(bytes, alignment);
      if (!span.ok()) {
        ASSERT_EQ(span.status().code(), absl::StatusCode::kResourceExhausted) << span.status();
        ++exhausted;
        continue;
      }
      ++allocations;
      // No overlap with the neighbours in address order.
      auto next = live.lower_bound(span->offset);
      if (next != live.end()) {
        ASSERT_LE(span->offset + bytes, next->first);
      }
      if (next != live.begin()) {
        auto prev = std::prev(next);
        ASSERT_LE(prev->first + prev->second.span.bytes, span->offset);
      }
      const auto tag = static_cast<uint8_t>(1 + rng() % 255);
      std::memset(span->data, tag, bytes);
      live.emplace(span->offset, Live{*span, tag});
    } else {
      auto it = live.begin();
      std::advance(it, rng() % live.size());
      verify_and_release(it);
    }
    size_t in_use = 0;
    for (const auto& [off, l] : live) in_use += RoundUp(l.span.bytes, PinnedArena::kGranule);
    const ArenaStats st = arena->stats();
    ASSERT_EQ(st.in_use_bytes, in_use);
    peak = std::max(peak, in_use);
  }
  EXPECT_GT(exhausted, 10);  // the sequence really filled the arena
  while (!live.empty()) verify_and_release(live.begin());

  const ArenaStats st = arena->stats();
  EXPECT_EQ(st.in_use_bytes, 0u);
  EXPECT_EQ(st.peak_bytes, peak);
  EXPECT_EQ(st.allocations, allocations);
  EXPECT_EQ(st.releases, releases);
  EXPECT_EQ(st.registrations, 1u);
  EXPECT_EQ(device.host_registrations(), 1u);
  absl::StatusOr<HostSpan> all = arena->Allocate(kCapacity);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->data, arena->base());
  FERRY_TEST_ASSERT_OK(arena->Release(*all));
}

TEST(PinnedArenaTest, ThousandsOfCyclesNeverRegisterAgain) {
  FakeDevice device;
  std::unique_ptr<PinnedArena> arena = MakeArena(&device, 1 << 20);
  ASSERT_NE(arena, nullptr);
  for (int i = 0; i < 5000; ++i) {
    absl::StatusOr<PinnedBlock> block = PinnedBlock::Allocate(*arena, 4096 + i);
    ASSERT_TRUE(block.ok()) << block.status();
  }
  EXPECT_EQ(device.host_registrations(), 1u);
  EXPECT_EQ(arena->stats().allocations, 5000u);
  EXPECT_EQ(arena->stats().releases, 5000u);
  EXPECT_EQ(arena->stats().in_use_bytes, 0u);
}

TEST(PinnedArenaTest, ConcurrentAllocationsNeverOverlap) {
  FakeDevice device;
  constexpr size_t kCapacity = 4 << 20;
  constexpr int kThreads = 4;
  constexpr int kSteps = 2000;
  constexpr int kKeep = 16;  // spans each thread still holds at the end
  std::unique_ptr<PinnedArena> arena = MakeArena(&device, kCapacity);
  ASSERT_NE(arena, nullptr);
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::vector<std::vector<HostSpan>> kept(kThreads);
  std::vector<int> corrupted(kThreads, 0);
  std::vector<int> failed(kThreads, 0);
  std::latch start(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(seed + t);
      // Every byte a thread writes says which thread owns it: 1..kThreads.
      const auto tag = static_cast<uint8_t>(t + 1);
      std::vector<HostSpan> mine;
      start.arrive_and_wait();
      for (int step = 0; step < kSteps; ++step) {
        if (mine.size() < 8 || rng() % 2 == 0) {
          absl::StatusOr<HostSpan> span = arena->Allocate(1 + rng() % 8000);
          if (!span.ok()) {  // a full arena is fine; any other error is not
            failed[t] += span.status().code() != absl::StatusCode::kResourceExhausted;
            continue;
          }
          std::memset(span->data, tag, span->bytes);
          mine.push_back(*span);
        } else {
          const size_t i = rng() % mine.size();
          const auto* p = mine[i].as<const uint8_t>();
          for (size_t b = 0; b < mine[i].bytes; ++b) corrupted[t] += p[b] != tag;
          if (!arena->Release(mine[i]).ok()) ++failed[t];
          mine.erase(mine.begin() + static_cast<std::ptrdiff_t>(i));
        }
      }
      while (mine.size() > kKeep) {
        if (!arena->Release(mine.back()).ok()) ++failed[t];
        mine.pop_back();
      }
      while (mine.size() < kKeep) {
        absl::StatusOr<HostSpan> span = arena->Allocate(1 + rng() % 8000);
        if (!span.ok()) {
          ++failed[t];
          break;
        }
        mine.push_back(*span);
      }
      kept[t] = std::move(mine);
    });
  }
  for (std::thread& th : threads) th.join();
  std::map<uintptr_t, size_t> all;
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(corrupted[t], 0) << "thread " << t << " saw its bytes overwritten";
    EXPECT_EQ(failed[t], 0) << "thread " << t;
    for (const HostSpan& s : kept[t]) all.emplace(reinterpret_cast<uintptr_t>(s.data), s.bytes);
  }
  ASSERT_EQ(all.size(), static_cast<size_t>(kThreads * kKeep));
  uintptr_t end = 0;
  for (const auto& [addr, bytes] : all) {
    EXPECT_GE(addr, end) << "overlapping spans";
    end = addr + bytes;
  }
  for (const auto& spans : kept) {
    for (const HostSpan& s : spans) FERRY_TEST_ASSERT_OK(arena->Release(s));
  }
  EXPECT_EQ(arena->stats().in_use_bytes, 0u);
  EXPECT_EQ(device.host_registrations(), 1u);
}

TEST(PinnedArenaTest, StatsTrackInUseAndPeak) {
  FakeDevice device;
  std::unique_ptr<PinnedArena> arena = MakeArena(&device, 1 << 16);
  ASSERT_NE(arena, nullptr);
  ArenaStats st = arena->stats();
  EXPECT_EQ(st.reserved_bytes, size_t{1} << 16);
  EXPECT_EQ(st.in_use_bytes, 0u);
  EXPECT_EQ(st.peak_bytes, 0u);
  HostSpan a = *arena->Allocate(100);   // 128 with the granule
  HostSpan b = *arena->Allocate(1000);  // 1024
  st = arena->stats();
  EXPECT_EQ(st.in_use_bytes, 128u + 1024u);
  EXPECT_EQ(st.peak_bytes, 128u + 1024u);
  FERRY_TEST_ASSERT_OK(arena->Release(b));
  HostSpan c = *arena->Allocate(64);
  st = arena->stats();
  EXPECT_EQ(st.in_use_bytes, 128u + 64u);
  EXPECT_EQ(st.peak_bytes, 128u + 1024u);  // the peak stays
  EXPECT_EQ(st.allocations, 3u);
  EXPECT_EQ(st.releases, 1u);
  EXPECT_EQ(st.registrations, 1u);
  FERRY_TEST_ASSERT_OK(arena->Release(a));
  FERRY_TEST_ASSERT_OK(arena->Release(c));
  EXPECT_EQ(arena->stats().in_use_bytes, 0u);
}

TEST(PinnedBlockTest, ReleasesOnDestructionAndMoves) {
  FakeDevice device;
  std::unique_ptr<PinnedArena> arena = MakeArena(&device, 1 << 16);
  ASSERT_NE(arena, nullptr);
  {
    absl::StatusOr<PinnedBlock> a = PinnedBlock::Allocate(*arena, 500, 1024);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a->data()) % 1024, 0u);
    EXPECT_EQ(a->bytes(), 500u);
    EXPECT_EQ(a->as<char>(), static_cast<char*>(a->data()));
    PinnedBlock moved = *std::move(a);
    EXPECT_FALSE(moved.empty());
    EXPECT_EQ(arena->stats().in_use_bytes, 512u);
    PinnedBlock other = *PinnedBlock::Allocate(*arena, 64);
    EXPECT_EQ(arena->stats().in_use_bytes, 512u + 64u);
    other = std::move(moved);  // releases other's span, takes moved's
    EXPECT_TRUE(moved.empty());  // NOLINT(bugprone-use-after-move): checking the moved-from state
    EXPECT_EQ(arena->stats().in_use_bytes, 512u);
    EXPECT_EQ(other.bytes(), 500u);
  }
  EXPECT_EQ(arena->stats().in_use_bytes, 0u);
  EXPECT_EQ(arena->stats().releases, 2u);
  PinnedBlock c = *PinnedBlock::Allocate(*arena, 10);
  FERRY_TEST_ASSERT_OK(c.Reset());
  EXPECT_TRUE(c.empty());
  FERRY_TEST_ASSERT_OK(c.Reset());  // no-op when empty
  EXPECT_EQ(arena->stats().in_use_bytes, 0u);
  EXPECT_EQ(arena->stats().releases, 3u);
}

}  // namespace
}  // namespace ferry
