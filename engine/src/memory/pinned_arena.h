// The memory layer: pinned host memory for offloaded master weights, optimizer state and staging.
//
// A PinnedArena reserves one region, places it by a NUMA policy before any page is touched, registers
// it with the device once, and hands out sub-allocations (HostSpan) that are released explicitly.
// Allocate and Release are bookkeeping only: no mmap, no pinning, no registration on the hot path.
#ifndef FERRY_MEMORY_PINNED_ARENA_H_
#define FERRY_MEMORY_PINNED_ARENA_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include <mutex>
#include "device/device.h"
#include "memory/range_allocator.h"

namespace ferry {

// Where the arena's pages are placed (libnuma / mbind semantics).
enum class NumaPolicy : uint8_t {
  kInterleave,  // pages spread round-robin over every node this process may allocate on (default)
  kBind,        // pages only on one node; allocation fails rather than spill elsewhere
  kPreferred,   // pages on one node while it has memory, elsewhere after that
  kLocal,       // pages on the node of the CPU that first touches them
};

// "interleave", "bind", "preferred" or "local" (ASCII case ignored); InvalidArgument otherwise.
absl::StatusOr<NumaPolicy> ParseNumaPolicy(std::string_view text);
// The name ParseNumaPolicy accepts for `policy`.
std::string_view NumaPolicyName(NumaPolicy policy);

// Number of NUMA nodes with memory on this machine; 1 when libnuma says NUMA is unavailable.
int NumaNodeCount();

struct PinnedArenaOptions {
  size_t capacity_bytes = 0;  // rounded up to whole pages
  NumaPolicy numa = NumaPolicy::kInterleave;
  int numa_node = -1;      // for kBind / kPreferred; -1 = the node of the calling CPU
  size_t alignment = 256;  // default alignment of every span; a power of two
  std::string name = "arena";  // appears in every error message and log line
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
  uint64_t allocations = 0;   // successful Allocate calls
  uint64_t releases = 0;      // successful Release calls
};

// PinnedArena: safe for concurrent use (Allocate, Release and stats from any thread).
class PinnedArena final {
 public:
  // Spans are carved in granules of this many bytes: each starts and ends on a multiple of it (from
  // the page-aligned base), so in_use_bytes counts requests rounded up to it.
  static constexpr size_t kGranule = 64;

  // Reserves one region of options.capacity_bytes (rounded up to pages) with an anonymous mmap, applies
  // the NUMA policy with mbind before any page is touched, then registers the region with `device`
  // once (Device::RegisterHost). Errors say which step and which limit stopped it (mmap, mbind, or
  // registration with the RLIMIT_MEMLOCK numbers and how to raise them); nothing is left mapped or
  // registered on failure. When the kernel refuses mbind (no NUMA support, or a container without
  // CAP_SYS_NICE) the arena is still created if placement cannot matter (one node, or kLocal), with a
  // warning and numa_applied() == false; otherwise that is an error.
  // REQUIRES: `device` is not null and outlives the arena.
  static absl::StatusOr<std::unique_ptr<PinnedArena>> Create(Device* device,
                                                             const PinnedArenaOptions& options);

  // Unregisters and unmaps the region. Logs an error when spans are still allocated (they dangle).
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

  void* base() const { return base_; }
  size_t capacity() const { return capacity_; }
  NumaPolicy numa_policy() const { return options_.numa; }
  // False when the kernel refused the NUMA policy and the arena went on without it (see Create).
  bool numa_applied() const { return numa_applied_; }
  const std::string& name() const { return options_.name; }
  Device* device() const { return device_; }

 private:
  PinnedArena(Device* device, const PinnedArenaOptions& options, void* base, size_t capacity,
              bool numa_applied);

  Device* const device_;
  const PinnedArenaOptions options_;
  void* const base_;
  const size_t capacity_;
  const bool numa_applied_;

  mutable std::mutex mu_;  // std::mutex: TSan sees it (Debian's Abseil is not TSan-built)
  RangeAllocator ranges_ ABSL_GUARDED_BY(mu_);
  size_t peak_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t allocations_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t releases_ ABSL_GUARDED_BY(mu_) = 0;
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
