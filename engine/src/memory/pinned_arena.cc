#include "memory/pinned_arena.h"

#include <numa.h>
#include <numaif.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/errors.h"
#include "base/logging.h"
#include "ferry/status.h"

namespace ferry {
namespace {

bool IsPowerOfTwo(size_t x) { return x != 0 && (x & (x - 1)) == 0; }

std::string FormatBytes(size_t bytes) {
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  constexpr double kMiB = 1024.0 * 1024.0;
  if (bytes >= (size_t{1} << 30)) return absl::StrFormat("%zu bytes (%.2f GiB)", bytes, bytes / kGiB);
  if (bytes >= (size_t{1} << 20)) return absl::StrFormat("%zu bytes (%.2f MiB)", bytes, bytes / kMiB);
  return absl::StrFormat("%zu bytes", bytes);
}

std::string FormatLimit(rlim_t limit) {
  return limit == RLIM_INFINITY ? std::string("unlimited") : FormatBytes(static_cast<size_t>(limit));
}

// A libnuma node mask freed on scope exit.
class NodeMask final {
 public:
  NodeMask() : mask_(numa_allocate_nodemask()) {}
  ~NodeMask() {
    if (mask_ != nullptr) numa_bitmask_free(mask_);
  }
  NodeMask(const NodeMask&) = delete;
  NodeMask& operator=(const NodeMask&) = delete;
  bitmask* get() const { return mask_; }

 private:
  bitmask* mask_;
};

std::string AllowedNodes() {
  std::string out;
  const int max_node = numa_max_node();
  for (int n = 0; n <= max_node; ++n) {
    if (numa_bitmask_isbitset(numa_all_nodes_ptr, static_cast<unsigned>(n))) {
      absl::StrAppend(&out, out.empty() ? "" : ",", n);
    }
  }
  return out.empty() ? std::string("none") : out;
}

// The node for kBind / kPreferred: `requested`, or the calling CPU's node for -1.
absl::StatusOr<int> ResolveNode(int requested, const std::string& arena) {
  int node = requested;
  if (node == -1) {
    const int cpu = sched_getcpu();
    if (cpu < 0) return PosixError(absl::StrCat("arena '", arena, "': sched_getcpu"), errno);
    node = numa_node_of_cpu(cpu);
    if (node < 0) {
      return PosixError(absl::StrCat("arena '", arena, "': numa_node_of_cpu(", cpu, ")"), errno);
    }
  }
  if (node < 0 || node > numa_max_node() ||
      !numa_bitmask_isbitset(numa_all_nodes_ptr, static_cast<unsigned>(node))) {
    return absl::InvalidArgumentError(
        absl::StrCat("arena '", arena, "': numa_node ", requested,
                     " is not a node this process may allocate on (allowed nodes: ", AllowedNodes(),
                     "; -1 means the node of the calling CPU)"));
  }
  return node;
}

// Applies `options.numa` to [addr, addr + bytes), which no one has touched yet. Returns whether the
// policy is in force (false: refused by the kernel where that cannot matter; see PinnedArena::Create).
absl::StatusOr<bool> ApplyNumaPolicy(void* addr, size_t bytes, const PinnedArenaOptions& options) {
  const std::string policy_name(NumaPolicyName(options.numa));
  if (numa_available() < 0) {
    FERRY_LOG(WARNING) << "arena '" << options.name << "': NUMA is not available on this system; "
                       << "policy " << policy_name << " not applied";
    return false;
  }
  NodeMask mask;
  if (mask.get() == nullptr) return absl::ResourceExhaustedError("numa_allocate_nodemask failed");
  int mode = MPOL_DEFAULT;
  std::string what;
  switch (options.numa) {
    case NumaPolicy::kInterleave:
      mode = MPOL_INTERLEAVE;
      copy_bitmask_to_bitmask(numa_all_nodes_ptr, mask.get());
      what = absl::StrCat("MPOL_INTERLEAVE over nodes ", AllowedNodes());
      break;
    case NumaPolicy::kBind:
    case NumaPolicy::kPreferred: {
      FERRY_ASSIGN_OR_RETURN(const int node, ResolveNode(options.numa_node, options.name));
      mode = options.numa == NumaPolicy::kBind ? MPOL_BIND : MPOL_PREFERRED;
      numa_bitmask_setbit(mask.get(), static_cast<unsigned>(node));
      what = absl::StrCat(options.numa == NumaPolicy::kBind ? "MPOL_BIND" : "MPOL_PREFERRED",
                          " to node ", node);
      break;
    }
    case NumaPolicy::kLocal:
      mode = MPOL_LOCAL;
      what = "MPOL_LOCAL";
      break;
  }
  const bool has_mask = options.numa != NumaPolicy::kLocal;
  // mbind's maxnode counts one past the last bit the kernel reads (libnuma passes size + 1 too).
  long rc = mbind(addr, bytes, mode, has_mask ? mask.get()->maskp : nullptr,
                  has_mask ? mask.get()->size + 1 : 0, 0);
  if (rc != 0 && errno == EINVAL && options.numa == NumaPolicy::kLocal) {
    // Kernels before 3.8 lack MPOL_LOCAL; MPOL_PREFERRED with an empty mask means the same.
    rc = mbind(addr, bytes, MPOL_PREFERRED, nullptr, 0, 0);
  }
  if (rc == 0) return true;
  const int err = errno;
  const std::string context = absl::StrCat("arena '", options.name, "': mbind(", what, ") over ",
                                           FormatBytes(bytes), " (numa policy ", policy_name, ")");
  const bool refused = err == EPERM || err == ENOSYS;
  if (refused && (options.numa == NumaPolicy::kLocal || NumaNodeCount() == 1)) {
    FERRY_LOG(WARNING) << context << " was refused (" << PosixError("mbind", err).message()
                       << "); going on without it: placement cannot matter on " << NumaNodeCount()
                       << " node(s) with this policy";
    return false;
  }
  absl::Status status = PosixError(context, err);
  if (refused) {
    return absl::Status(status.code(),
                        absl::StrCat(status.message(),
                                     ". The kernel refused the NUMA policy: containers need "
                                     "CAP_SYS_NICE for mbind (Docker's default seccomp profile "
                                     "blocks it), or choose numa policy 'local'"));
  }
  return status;
}

// The registration error, with the locked-memory limit that usually explains it.
absl::Status RegistrationError(const absl::Status& cause, const Device& device, size_t bytes,
                               const std::string& arena) {
  std::string limits = "RLIMIT_MEMLOCK unknown";
  bool over = false;
  rlimit rl{};
  if (getrlimit(RLIMIT_MEMLOCK, &rl) == 0) {
    limits = absl::StrCat("RLIMIT_MEMLOCK soft ", FormatLimit(rl.rlim_cur), ", hard ",
                          FormatLimit(rl.rlim_max));
    over = rl.rlim_cur != RLIM_INFINITY && static_cast<rlim_t>(bytes) > rl.rlim_cur;
  }
  return absl::Status(
      cause.code(),
      absl::StrCat("arena '", arena, "': registering (page-locking) ", FormatBytes(bytes),
                   " with device ", device.name(), " failed: ", cause.message(), ". ", limits,
                   over ? " (smaller than the arena)" : "",
                   "; raise it with `ulimit -l unlimited` in the launching shell, a `memlock` line "
                   "in /etc/security/limits.conf, LimitMEMLOCK= for systemd services or "
                   "`--ulimit memlock=-1` for containers, or use a smaller arena"));
}

}  // namespace

absl::StatusOr<NumaPolicy> ParseNumaPolicy(std::string_view text) {
  const std::string lower = absl::AsciiStrToLower(std::string(text));
  if (lower == "interleave") return NumaPolicy::kInterleave;
  if (lower == "bind") return NumaPolicy::kBind;
  if (lower == "preferred") return NumaPolicy::kPreferred;
  if (lower == "local") return NumaPolicy::kLocal;
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown NUMA policy '", std::string(text), "'; expected one of interleave, bind, preferred, local"));
}

std::string_view NumaPolicyName(NumaPolicy policy) {
  switch (policy) {
    case NumaPolicy::kInterleave: return "interleave";
    case NumaPolicy::kBind: return "bind";
    case NumaPolicy::kPreferred: return "preferred";
    case NumaPolicy::kLocal: return "local";
  }
  return "unknown";
}

int NumaNodeCount() {
  if (numa_available() < 0) return 1;
  const int n = numa_num_configured_nodes();
  return n < 1 ? 1 : n;
}

absl::StatusOr<std::unique_ptr<PinnedArena>> PinnedArena::Create(
    Device* device, const PinnedArenaOptions& options) {
  if (device == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("arena '", options.name, "': device is null"));
  }
  if (options.capacity_bytes == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("arena '", options.name, "': capacity_bytes is 0"));
  }
  if (!IsPowerOfTwo(options.alignment)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "arena '", options.name, "': alignment ", options.alignment, " is not a power of two"));
  }
  const long page_size_or_error = sysconf(_SC_PAGESIZE);
  const size_t page = page_size_or_error > 0 ? static_cast<size_t>(page_size_or_error) : 4096;
  if (options.capacity_bytes > std::numeric_limits<size_t>::max() - page) {
    return absl::InvalidArgumentError(absl::StrCat("arena '", options.name, "': capacity_bytes ",
                                                   options.capacity_bytes, " is too large"));
  }
  const size_t capacity = (options.capacity_bytes + page - 1) / page * page;

  void* base = mmap(nullptr, capacity, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) {
    const int err = errno;
    absl::Status status =
        PosixError(absl::StrCat("arena '", options.name, "': mmap of ", FormatBytes(capacity)), err);
    if (err == ENOMEM) {
      return absl::Status(status.code(),
                          absl::StrCat(status.message(),
                                       ": not enough memory or address space (check free memory, "
                                       "vm.overcommit_memory and `ulimit -v`)"));
    }
    return status;
  }
  auto unmap = [&] { munmap(base, capacity); };

  absl::StatusOr<bool> numa_applied = ApplyNumaPolicy(base, capacity, options);
  if (!numa_applied.ok()) {
    unmap();
    return numa_applied.status();
  }
  if (absl::Status s = device->RegisterHost(base, capacity); !s.ok()) {
    unmap();
    return RegistrationError(s, *device, capacity, options.name);
  }
  return std::unique_ptr<PinnedArena>(
      new PinnedArena(device, options, base, capacity, *numa_applied));
}

PinnedArena::PinnedArena(Device* device, const PinnedArenaOptions& options, void* base,
                         size_t capacity, bool numa_applied)
    : device_(device),
      options_(options),
      base_(base),
      capacity_(capacity),
      numa_applied_(numa_applied),
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
  if (absl::Status s = device_->UnregisterHost(base_); !s.ok()) {
    FERRY_LOG(ERROR) << "arena '" << options_.name << "': UnregisterHost failed: " << s;
  }
  if (munmap(base_, capacity_) != 0) {
    FERRY_LOG(ERROR) << PosixError(absl::StrCat("arena '", options_.name, "': munmap"), errno);
  }
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
                    .allocations = allocations_,
                    .releases = releases_};
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
