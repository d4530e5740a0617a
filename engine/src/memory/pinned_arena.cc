#include "memory/pinned_arena.h"

#include <sys/mman.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "base/errors.h"
#include "base/logging.h"
#include "ferry/status.h"
#include "memory/format.h"

namespace ferry {
namespace {

using memory_internal::FormatBytes;

bool IsPowerOfTwo(size_t x) { return x != 0 && (x & (x - 1)) == 0; }

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

// Process-wide pin/register/host-alloc counters (GetPinnedHostCounters).
struct Counters {
  std::atomic<uint64_t> mmap_calls{0};
  std::atomic<uint64_t> register_calls{0};
  std::atomic<uint64_t> unregister_calls{0};
  std::atomic<uint64_t> arenas_created{0};
  std::atomic<uint64_t> arenas_live{0};
};

Counters& GlobalCounters() {
  static Counters* const counters = new Counters();
  return *counters;
}

std::string FormatLimit(rlim_t limit) {
  return limit == RLIM_INFINITY ? std::string("unlimited") : FormatBytes(static_cast<size_t>(limit));
}

// Bytes this process has locked already (VmLck in /proc/self/status), or 0 when unknown.
size_t LockedBytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (!absl::StartsWith(line, "VmLck:")) continue;
    std::vector<absl::string_view> parts = absl::StrSplit(line, ' ', absl::SkipEmpty());
    uint64_t kib = 0;
    if (parts.size() >= 2 && absl::SimpleAtoi(parts[1], &kib)) return static_cast<size_t>(kib) * 1024;
  }
  return 0;
}

// The registration error, saying whether the locked-memory limit is what stopped it.
absl::Status RegistrationError(const absl::Status& cause, const Device& device, size_t bytes,
                               const std::string& arena) {
  const std::string head =
      absl::StrCat("arena '", arena, "': registering (page-locking) ", FormatBytes(bytes),
                   " with device ", device.name(), " failed: ", cause.message(), ". ");
  rlimit rl{};
  if (getrlimit(RLIMIT_MEMLOCK, &rl) != 0) {
    return absl::Status(cause.code(), absl::StrCat(head, "RLIMIT_MEMLOCK unknown (getrlimit: ",
                                                   std::strerror(errno), ")"));
  }
  const std::string limits = absl::StrCat("RLIMIT_MEMLOCK soft ", FormatLimit(rl.rlim_cur),
                                          ", hard ", FormatLimit(rl.rlim_max));
  const size_t locked = LockedBytes();
  const bool over = rl.rlim_cur != RLIM_INFINITY &&
                    static_cast<rlim_t>(bytes) + static_cast<rlim_t>(locked) > rl.rlim_cur;
  if (over) {
    return absl::Status(
        cause.code(),
        absl::StrCat(head, "The memlock limit is the likely cause: ", limits, ", with ",
                     FormatBytes(locked), " already locked, is below the ", FormatBytes(bytes),
                     " this arena needs. Raise it with `ulimit -l unlimited` in the launching "
                     "shell, a `memlock` line in /etc/security/limits.conf, LimitMEMLOCK= for "
                     "systemd services or `--ulimit memlock=-1` for containers, or use a smaller "
                     "arena (see engine/TROUBLESHOOTING.md#locked-memory-ulimit--l)"));
  }
  return absl::Status(
      cause.code(),
      absl::StrCat(head, "The memlock limit is not what stopped it (", limits,
                   ", enough for this arena): the device refused the registration (out of host "
                   "memory, or a driver limit); free host memory or use a smaller arena (the limit "
                   "would be raised with `ulimit -l` or /etc/security/limits.conf) (see "
                   "engine/TROUBLESHOOTING.md#locked-memory-ulimit--l)"));
}

}  // namespace

PinnedHostCounters GetPinnedHostCounters() {
  const Counters& c = GlobalCounters();
  return PinnedHostCounters{.mmap_calls = c.mmap_calls.load(),
                            .register_calls = c.register_calls.load(),
                            .unregister_calls = c.unregister_calls.load(),
                            .arenas_created = c.arenas_created.load(),
                            .arenas_live = c.arenas_live.load()};
}

absl::StatusOr<std::unique_ptr<PinnedArena>> PinnedArena::Create(
    Device* device, const PinnedArenaOptions& options) {
  const std::string& name = options.name;
  if (device == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("arena '", name, "': device is null"));
  }
  if (options.capacity_bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat("arena '", name, "': capacity_bytes is 0"));
  }
  if (!IsPowerOfTwo(options.alignment)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "arena '", name, "': alignment ", options.alignment, " is not a power of two"));
  }
  if (options.prefault_threads < -1) {
    return absl::InvalidArgumentError(
        absl::StrCat("arena '", name, "': prefault_threads ", options.prefault_threads,
                     "; expected -1 (automatic), 0 (none) or a thread count"));
  }
  // Room for rounding up to any page size, including a 1 GiB hugetlb page.
  if (options.capacity_bytes > std::numeric_limits<size_t>::max() / 2) {
    return absl::InvalidArgumentError(absl::StrCat("arena '", name, "': capacity_bytes ",
                                                   options.capacity_bytes, " is too large"));
  }
  PinnedBudget* budget = options.budget != nullptr ? options.budget : &PinnedBudget::Process();
  Counters& counters = GlobalCounters();
  ArenaSetup setup;
  auto start = std::chrono::steady_clock::now();

  // 1. The budget, for the size the region will have.
  const int bind_node = options.numa != NumaPolicy::kBind ? -1
                        : options.numa_node >= 0   ? options.numa_node
                                                   : memory_internal::CallingThreadNode();
  const PageKind planned =
      memory_internal::ChoosePageKind(options.huge_pages, options.capacity_bytes, bind_node,
                                      &setup.pages_note);
  size_t budgeted = memory_internal::RegionBytes(options.capacity_bytes, planned);
  FERRY_RETURN_IF_ERROR(budget->Reserve(budgeted, absl::StrCat("arena '", name, "'")));
  absl::Cleanup give_back = [&] { budget->Release(budgeted); };

  // 2. The region.
  int mmap_calls = 0;
  absl::StatusOr<memory_internal::HostRegion> region =
      memory_internal::ReserveHostRegion(options.capacity_bytes, planned,
                                         options.huge_pages == HugePages::kAuto, name, &mmap_calls);
  counters.mmap_calls.fetch_add(static_cast<uint64_t>(mmap_calls));
  setup.host_calls += static_cast<uint64_t>(mmap_calls);
  if (!region.ok()) return region.status();
  if (region->bytes() != budgeted) {  // a hugetlb fallback: smaller
    budget->Release(budgeted);
    budgeted = region->bytes();
    if (absl::Status s = budget->Reserve(budgeted, absl::StrCat("arena '", name, "'")); !s.ok()) {
      budgeted = 0;
      std::move(give_back).Cancel();
      return s;
    }
  }
  setup.pages = region->kind();
  if (!region->note().empty()) {
    setup.pages_note = setup.pages_note.empty()
                           ? region->note()
                           : absl::StrCat(setup.pages_note, "; ", region->note());
  }
  const size_t capacity = region->bytes();

  // 3. NUMA placement, before any page is touched. libnuma fills its per-node CPU masks lazily and
  // without locking, so arenas are placed and prefaulted one at a time in a process (the placement
  // below fills the masks of every node the prefault threads will use before they start).
  static std::mutex* const numa_mu = new std::mutex;
  std::unique_lock<std::mutex> numa_lock(*numa_mu);
  FERRY_ASSIGN_OR_RETURN(const memory_internal::NumaPlacement placement,
                         memory_internal::ApplyNumaPolicy(region->base(), capacity, options.numa,
                                                          options.numa_node, name));
  setup.numa_applied = placement.applied;
  setup.reserve_seconds = Seconds(start);

  // 4. Fault the pages in, in parallel, where the policy puts them.
  start = std::chrono::steady_clock::now();
  const int threads = options.prefault_threads >= 0
                          ? options.prefault_threads
                          : memory_internal::AutoPrefaultThreads(capacity, placement.toucher_nodes);
  FERRY_ASSIGN_OR_RETURN(setup.prefault_threads,
                         memory_internal::PrefaultRegion(region->base(), capacity, region->kind(),
                                                         threads, placement.toucher_nodes, name));
  setup.prefault_seconds = Seconds(start);
  numa_lock.unlock();

  // 5. One registration.
  start = std::chrono::steady_clock::now();
  counters.register_calls.fetch_add(1);
  ++setup.host_calls;
  if (absl::Status s = device->RegisterHost(region->base(), capacity); !s.ok()) {
    return RegistrationError(s, *device, capacity, name);
  }
  setup.register_seconds = Seconds(start);
  setup.huge_bytes = memory_internal::HugeBackedBytes(region->base(), capacity, region->kind());

  std::move(give_back).Cancel();
  counters.arenas_created.fetch_add(1);
  counters.arenas_live.fetch_add(1);
  return std::unique_ptr<PinnedArena>(
      new PinnedArena(device, budget, options, region->release(), capacity, std::move(setup)));
}

PinnedArena::PinnedArena(Device* device, PinnedBudget* budget, const PinnedArenaOptions& options,
                         void* base, size_t capacity, ArenaSetup setup)
    : device_(device),
      budget_(budget),
      options_(options),
      base_(base),
      capacity_(capacity),
      setup_(std::move(setup)),
      ranges_(reinterpret_cast<uintptr_t>(base), capacity, PinnedArena::kGranule) {}

PinnedArena::~PinnedArena() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (ranges_.num_allocations() > 0) {
      FERRY_LOG(ERROR) << "arena '" << options_.name << "' destroyed with "
                       << ranges_.num_allocations() << " span(s) still allocated ("
                       << FormatBytes(ranges_.in_use_bytes()) << "); they dangle now";
    }
  }
  GlobalCounters().unregister_calls.fetch_add(1);
  if (absl::Status s = device_->UnregisterHost(base_); !s.ok()) {
    FERRY_LOG(ERROR) << "arena '" << options_.name << "': UnregisterHost failed: " << s;
  }
  if (munmap(base_, capacity_) != 0) {
    FERRY_LOG(ERROR) << PosixError(absl::StrCat("arena '", options_.name, "': munmap"), errno);
  }
  budget_->Release(capacity_);
  GlobalCounters().arenas_live.fetch_sub(1);
}

absl::StatusOr<HostSpan> PinnedArena::Allocate(size_t bytes, size_t alignment) {
  if (alignment == 0) alignment = options_.alignment;
  if (bytes == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("arena '", options_.name, "': allocation of 0 bytes"));
  }
  if (!IsPowerOfTwo(alignment)) {
    return absl::InvalidArgumentError(absl::StrCat("arena '", options_.name, "': alignment ",
                                                   alignment, " is not a power of two"));
  }
  std::lock_guard<std::mutex> lock(mu_);
  const std::optional<size_t> offset = ranges_.Allocate(bytes, alignment);
  if (!offset.has_value()) {
    ++failed_allocations_;
    return absl::ResourceExhaustedError(absl::StrCat(
        "arena '", options_.name, "': cannot allocate ", FormatBytes(bytes), " (alignment ",
        alignment, "): ", FormatBytes(ranges_.free_bytes()), " free in ",
        ranges_.num_free_blocks(), " block(s), largest free block ",
        FormatBytes(ranges_.largest_free_block()), ", capacity ", FormatBytes(capacity_), ", ",
        ranges_.num_allocations(), " span(s) live"));
  }
  ++allocations_;
  peak_bytes_ = std::max(peak_bytes_, ranges_.in_use_bytes());
  return HostSpan{.data = static_cast<char*>(base_) + *offset, .bytes = bytes, .offset = *offset};
}

absl::Status PinnedArena::Release(const HostSpan& span) {
  if (span.data == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("arena '", options_.name, "': release of an empty span"));
  }
  const auto addr = reinterpret_cast<uintptr_t>(span.data);
  const auto begin = reinterpret_cast<uintptr_t>(base_);
  if (addr < begin || addr - begin >= capacity_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "arena '%s': release of %p, which is not in this arena [%p, %p): a foreign pointer",
        options_.name, span.data, base_, static_cast<char*>(base_) + capacity_));
  }
  const size_t offset = addr - begin;
  if (span.offset != offset) {
    return absl::InvalidArgumentError(
        absl::StrCat("arena '", options_.name, "': span says offset ", span.offset,
                     " but its pointer is at offset ", offset));
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (absl::Status s = ranges_.Release(offset, span.bytes); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("arena '", options_.name, "': ", s.message()));
  }
  ++releases_;
  return absl::OkStatus();
}

ArenaStats PinnedArena::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ArenaStats{.reserved_bytes = capacity_,
                    .in_use_bytes = ranges_.in_use_bytes(),
                    .peak_bytes = peak_bytes_,
                    .registrations = 1,
                    .host_calls = setup_.host_calls,
                    .allocations = allocations_,
                    .releases = releases_,
                    .failed_allocations = failed_allocations_,
                    .live_spans = ranges_.num_allocations()};
}

absl::StatusOr<PinnedBlock> PinnedBlock::Allocate(PinnedArena& arena, size_t bytes,
                                                  size_t alignment) {
  FERRY_ASSIGN_OR_RETURN(HostSpan span, arena.Allocate(bytes, alignment));
  return PinnedBlock(&arena, span);
}

PinnedBlock::~PinnedBlock() {
  if (absl::Status s = Reset(); !s.ok()) FERRY_LOG(ERROR) << "PinnedBlock: " << s;
}

PinnedBlock::PinnedBlock(PinnedBlock&& other) noexcept
    : arena_(std::exchange(other.arena_, nullptr)), span_(std::exchange(other.span_, {})) {}

PinnedBlock& PinnedBlock::operator=(PinnedBlock&& other) noexcept {
  if (this != &other) {
    if (absl::Status s = Reset(); !s.ok()) FERRY_LOG(ERROR) << "PinnedBlock: " << s;
    arena_ = std::exchange(other.arena_, nullptr);
    span_ = std::exchange(other.span_, {});
  }
  return *this;
}

absl::Status PinnedBlock::Reset() {
  if (arena_ == nullptr) return absl::OkStatus();
  PinnedArena* arena = std::exchange(arena_, nullptr);
  const HostSpan span = std::exchange(span_, {});
  return arena->Release(span);
}

}  // namespace ferry
