// The memory layer: pinned host memory for offloaded master weights, optimizer state and staging.
//
// A PinnedArena takes its size from a PinnedBudget, reserves one region (huge pages where the host
// offers them), places it by a NUMA policy before any page is touched, faults its pages in with
// threads placed by that policy, registers it with the device once, and hands out sub-allocations
// (HostSpan) that are released explicitly. Allocate and Release are bookkeeping only: no mmap, no
// pinning, no registration on the hot path (GetPinnedHostCounters() counts every such call).
#ifndef FERRY_MEMORY_PINNED_ARENA_H_
#define FERRY_MEMORY_PINNED_ARENA_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "device/device.h"
#include "memory/host_region.h"
#include "memory/numa.h"
#include "memory/pinned_budget.h"
#include "memory/range_allocator.h"

namespace ferry {

struct PinnedArenaOptions {
  size_t capacity_bytes = 0;  // rounded up to whole pages (hugetlb pages when it gets them)
  NumaPolicy numa = NumaPolicy::kInterleave;
  int numa_node = -1;      // for kBind / kPreferred; -1 = the node of the calling CPU
  size_t alignment = 256;  // default alignment of every span; a power of two
  std::string name = "arena";  // appears in every error message and log line
  HugePages huge_pages = HugePages::kAuto;
  // Threads that fault the region's pages in (placed by the NUMA policy) before it is registered:
  // -1 = automatic (one per 64 MiB, at most the CPUs of the policy's nodes and 32); 0 = none (the
  // device's registration then faults them in, on one thread); n = n threads.
  int prefault_threads = -1;
  // The budget the region is taken from; nullptr = PinnedBudget::Process(). REQUIRES: it outlives the
  // arena.
  PinnedBudget* budget = nullptr;
};

// A borrowed piece of an arena. Valid until released (or until the arena is destroyed).
struct HostSpan {
  void* data = nullptr;
  size_t bytes = 0;   // what was requested
  size_t offset = 0;  // data - arena base

  template <class T>
  T* as() const {
    return static_cast<T*>(data);
  }
  bool empty() const { return bytes == 0; }
};

struct ArenaStats {
  size_t reserved_bytes = 0;  // the region's size (capacity)
  size_t in_use_bytes = 0;    // held by live spans, including rounding to the arena's granule
  size_t peak_bytes = 0;      // highest in_use_bytes so far
  uint64_t registrations = 0; // RegisterHost calls this arena made (1 for its lifetime)
  // Pin/register/host-alloc calls this arena made (mmap and RegisterHost, failed attempts included).
  // All are made by Create: the count never grows after it, whatever Allocate and Release do.
  uint64_t host_calls = 0;
  uint64_t allocations = 0;   // successful Allocate calls
  uint64_t releases = 0;      // successful Release calls
  uint64_t failed_allocations = 0;  // Allocate calls refused for lack of room
  uint64_t live_spans = 0;
};

// How an arena's region was set up: fixed by Create.
struct ArenaSetup {
  PageKind pages = PageKind::kBase;
  std::string pages_note;     // why the pages differ from what options.huge_pages asked ("" if not)
  bool numa_applied = false;  // see PinnedArena::numa_applied()
  int prefault_threads = 0;   // threads that faulted the pages in; 0: left to the registration
  // Bytes of the region huge pages back once it was faulted in (hugetlb: all; THP: what the kernel
  // managed, from /proc/self/smaps; see memory_internal::HugeBackedBytes). Left to the registration
  // (prefault_threads 0): read after it.
  size_t huge_bytes = 0;
  double reserve_seconds = 0;   // budget, mmap, madvise and mbind
  double prefault_seconds = 0;  // faulting every page in
  double register_seconds = 0;  // Device::RegisterHost
  uint64_t host_calls = 0;      // as ArenaStats::host_calls

  double total_seconds() const { return reserve_seconds + prefault_seconds + register_seconds; }
};

// Process-wide counts of the calls that reserve or pin host memory, made by every arena so far. Arenas
// make them only in Create (and unregister in their destructor), so these stay flat once a process has
// created its arenas, across any number of allocations, releases, steps, offloads and reloads.
struct PinnedHostCounters {
  uint64_t mmap_calls = 0;        // host-alloc calls: region reservations, failed ones included
  uint64_t register_calls = 0;    // Device::RegisterHost calls by arenas, failed ones included
  uint64_t unregister_calls = 0;  // Device::UnregisterHost calls by arenas
  uint64_t arenas_created = 0;
  uint64_t arenas_live = 0;

  // The pin/register/host-alloc calls.
  uint64_t calls() const { return mmap_calls + register_calls; }
};
PinnedHostCounters GetPinnedHostCounters();

// PinnedArena: safe for concurrent use (Allocate, Release and stats from any thread).
class PinnedArena final {
 public:
  // Spans are carved in granules of this many bytes: each starts and ends on a multiple of it (from
  // the page-aligned base), so in_use_bytes counts requests rounded up to it.
  static constexpr size_t kGranule = 64;

  // Creates the arena, in this order:
  //   1. takes the region's size from options.budget (ResourceExhausted naming the budget, its limit
  //      and what holds it, and how to raise it);
  //   2. reserves the region with mmap: hugetlb or transparent huge pages per options.huge_pages
  //      (setup().pages says what it got and pages_note why);
  //   3. applies the NUMA policy with mbind before any page is touched;
  //   4. faults every page in with options.prefault_threads threads placed on the policy's nodes;
  //   5. registers the region with `device` once (Device::RegisterHost).
  // Errors say which step and which limit stopped it; a failed registration says whether the
  // RLIMIT_MEMLOCK limit was below what the arena needs, and how to raise it. Nothing is left
  // mapped, registered or reserved on failure. When the kernel refuses mbind (no NUMA support, or a
  // container without CAP_SYS_NICE) the arena is still created if placement cannot matter (one node,
  // or kLocal), with a warning and numa_applied() == false; otherwise that is an error.
  // REQUIRES: `device` is not null and outlives the arena; so does options.budget.
  static absl::StatusOr<std::unique_ptr<PinnedArena>> Create(Device* device,
                                                             const PinnedArenaOptions& options);

  // Unregisters and unmaps the region and gives its size back to the budget. Logs an error when spans
  // are still allocated (they dangle).
  ~PinnedArena();

  PinnedArena(const PinnedArena&) = delete;
  PinnedArena& operator=(const PinnedArena&) = delete;

  // A new span of `bytes` whose address is a multiple of `alignment` (0 = options.alignment). Contents
  // are unspecified (not zeroed). The caller owns the span and must Release it before the arena dies.
  // Errors: InvalidArgument for zero bytes or an alignment that is not a power of two;
  // ResourceExhausted, naming requested, free, largest free block and capacity, when nothing fits.
  absl::StatusOr<HostSpan> Allocate(size_t bytes, size_t alignment = 0);

  // Returns a span from Allocate to the arena. Errors (nothing changes): InvalidArgument for an empty
  // span, a pointer outside this arena, a pointer inside another span, a size or offset that does not
  // match what Allocate returned; FailedPrecondition for a span already released.
  absl::Status Release(const HostSpan& span);

  ArenaStats stats() const;
  // How the region was set up (pages, prefault, timings). Fixed at Create.
  const ArenaSetup& setup() const { return setup_; }

  void* base() const { return base_; }
  size_t capacity() const { return capacity_; }
  NumaPolicy numa_policy() const { return options_.numa; }
  // False when the kernel refused the NUMA policy and the arena went on without it (see Create).
  bool numa_applied() const { return setup_.numa_applied; }
  const std::string& name() const { return options_.name; }
  Device* device() const { return device_; }
  PinnedBudget& budget() const { return *budget_; }

 private:
  PinnedArena(Device* device, PinnedBudget* budget, const PinnedArenaOptions& options, void* base,
              size_t capacity, ArenaSetup setup);

  Device* const device_;
  PinnedBudget* const budget_;
  const PinnedArenaOptions options_;
  void* const base_;
  const size_t capacity_;
  const ArenaSetup setup_;

  mutable std::mutex mu_;  // std::mutex: TSan sees it (Debian's Abseil is not TSan-built)
  RangeAllocator ranges_ ABSL_GUARDED_BY(mu_);
  size_t peak_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t allocations_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t releases_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t failed_allocations_ ABSL_GUARDED_BY(mu_) = 0;
};

// PinnedBlock: a span that releases itself. Move-only; one thread at a time.
class PinnedBlock final {
 public:
  PinnedBlock() = default;
  // Allocates from `arena` (see PinnedArena::Allocate). REQUIRES: `arena` outlives the block.
  static absl::StatusOr<PinnedBlock> Allocate(PinnedArena& arena, size_t bytes,
                                              size_t alignment = 0);

  ~PinnedBlock();
  PinnedBlock(PinnedBlock&& other) noexcept;
  PinnedBlock& operator=(PinnedBlock&& other) noexcept;
  PinnedBlock(const PinnedBlock&) = delete;
  PinnedBlock& operator=(const PinnedBlock&) = delete;

  const HostSpan& span() const { return span_; }
  void* data() const { return span_.data; }
  size_t bytes() const { return span_.bytes; }
  template <class T>
  T* as() const {
    return span_.as<T>();
  }
  bool empty() const { return arena_ == nullptr; }

  // Releases the span now (no-op when empty); the block is empty afterwards whatever the result.
  absl::Status Reset();

 private:
  PinnedBlock(PinnedArena* arena, HostSpan span) : arena_(arena), span_(span) {}

  PinnedArena* arena_ = nullptr;
  HostSpan span_;
};

}  // namespace ferry

#endif  // FERRY_MEMORY_PINNED_ARENA_H_
