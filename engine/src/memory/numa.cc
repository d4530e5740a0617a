#include "memory/numa.h"

#include <numa.h>
#include <numaif.h>
#include <sched.h>

#include <cerrno>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "base/absl_compat.h"
#include "base/errors.h"
#include "base/logging.h"
#include "ferry/status.h"
#include "memory/format.h"

namespace ferry {
namespace {

using memory_internal::FormatBytes;

// A libnuma bitmask freed on scope exit.
class Bitmask final {
 public:
  explicit Bitmask(bitmask* mask) : mask_(mask) {}
  ~Bitmask() {
    if (mask_ != nullptr) numa_bitmask_free(mask_);
  }
  Bitmask(const Bitmask&) = delete;
  Bitmask& operator=(const Bitmask&) = delete;
  bitmask* get() const { return mask_; }

 private:
  bitmask* mask_;
};

bool NodeAllowed(int node) {
  return node >= 0 && node <= numa_max_node() &&
         numa_bitmask_isbitset(numa_all_nodes_ptr, static_cast<unsigned>(node));
}

std::string AllowedNodes() {
  std::string out;
  for (int n = 0; n <= numa_max_node(); ++n) {
    if (NodeAllowed(n)) absl::StrAppend(&out, out.empty() ? "" : ",", n);
  }
  return out.empty() ? std::string("none") : out;
}

bool NodeHasCpus(int node) {
  Bitmask cpus(numa_allocate_cpumask());
  if (cpus.get() == nullptr || numa_node_to_cpus(node, cpus.get()) != 0) return false;
  return numa_bitmask_weight(cpus.get()) > 0;
}

absl::StatusOr<int> CallingCpuNode(const std::string& name) {
  const int cpu = sched_getcpu();
  if (cpu < 0) return PosixError(absl::StrCat("arena '", name, "': sched_getcpu"), errno);
  const int node = numa_node_of_cpu(cpu);
  if (node < 0) {
    return PosixError(absl::StrCat("arena '", name, "': numa_node_of_cpu(", cpu, ")"), errno);
  }
  return node;
}

// The node for kBind / kPreferred: `requested`, or the calling CPU's node for -1.
absl::StatusOr<int> ResolveNode(int requested, const std::string& name) {
  int node = requested;
  if (node == -1) {
    FERRY_ASSIGN_OR_RETURN(node, CallingCpuNode(name));
  }
  if (!NodeAllowed(node)) {
    return absl::InvalidArgumentError(
        absl::StrCat("arena '", name, "': numa_node ", requested,
                     " is not a node this process may allocate on (allowed nodes: ", AllowedNodes(),
                     "; -1 means the node of the calling CPU)"));
  }
  return node;
}

}  // namespace

absl::StatusOr<NumaPolicy> ParseNumaPolicy(std::string_view text) {
  const std::string lower = absl::AsciiStrToLower(ToAbsl(text));
  if (lower == "interleave") return NumaPolicy::kInterleave;
  if (lower == "bind") return NumaPolicy::kBind;
  if (lower == "preferred") return NumaPolicy::kPreferred;
  if (lower == "local") return NumaPolicy::kLocal;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown NUMA policy '", ToAbsl(text),
                   "'; expected one of interleave, bind, preferred, local"));
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

namespace memory_internal {

absl::StatusOr<NumaPlacement> ApplyNumaPolicy(void* addr, size_t bytes, NumaPolicy policy, int node,
                                              const std::string& name) {
  const absl::string_view policy_name = ToAbsl(NumaPolicyName(policy));
  NumaPlacement placement;
  if (numa_available() < 0) {
    FERRY_LOG(WARNING) << "arena '" << name << "': NUMA is not available on this system; policy "
                       << policy_name << " not applied";
    return placement;
  }
  Bitmask mask(numa_allocate_nodemask());
  if (mask.get() == nullptr) return absl::ResourceExhaustedError("numa_allocate_nodemask failed");
  int mode = MPOL_DEFAULT;
  std::string what;
  switch (policy) {
    case NumaPolicy::kInterleave:
      mode = MPOL_INTERLEAVE;
      copy_bitmask_to_bitmask(numa_all_nodes_ptr, mask.get());
      what = absl::StrCat("MPOL_INTERLEAVE over nodes ", AllowedNodes());
      for (int n = 0; n <= numa_max_node(); ++n) {
        if (NodeAllowed(n) && NodeHasCpus(n)) placement.toucher_nodes.push_back(n);
      }
      break;
    case NumaPolicy::kBind:
    case NumaPolicy::kPreferred: {
      FERRY_ASSIGN_OR_RETURN(const int target, ResolveNode(node, name));
      mode = policy == NumaPolicy::kBind ? MPOL_BIND : MPOL_PREFERRED;
      numa_bitmask_setbit(mask.get(), static_cast<unsigned>(target));
      what = absl::StrCat(policy == NumaPolicy::kBind ? "MPOL_BIND" : "MPOL_PREFERRED", " to node ",
                          target);
      if (NodeHasCpus(target)) placement.toucher_nodes.push_back(target);
      break;
    }
    case NumaPolicy::kLocal: {
      mode = MPOL_LOCAL;
      what = "MPOL_LOCAL";
      absl::StatusOr<int> here = CallingCpuNode(name);
      if (here.ok()) placement.toucher_nodes.push_back(*here);
      break;
    }
  }
  const bool has_mask = policy != NumaPolicy::kLocal;
  // mbind's maxnode counts one past the last bit the kernel reads (libnuma passes size + 1 too).
  long rc = mbind(addr, bytes, mode, has_mask ? mask.get()->maskp : nullptr,
                  has_mask ? mask.get()->size + 1 : 0, 0);
  if (rc != 0 && errno == EINVAL && policy == NumaPolicy::kLocal) {
    // Kernels before 3.8 lack MPOL_LOCAL; MPOL_PREFERRED with an empty mask means the same.
    rc = mbind(addr, bytes, MPOL_PREFERRED, nullptr, 0, 0);
  }
  if (rc == 0) {
    placement.applied = true;
    return placement;
  }
  const int err = errno;
  const std::string context = absl::StrCat("arena '", name, "': mbind(", what, ") over ",
                                           FormatBytes(bytes), " (numa policy ", policy_name, ")");
  const bool refused = err == EPERM || err == ENOSYS;
  if (refused && (policy == NumaPolicy::kLocal || NumaNodeCount() == 1)) {
    FERRY_LOG(WARNING) << context << " was refused (" << PosixError("mbind", err).message()
                       << "); going on without it: placement cannot matter on " << NumaNodeCount()
                       << " node(s) with this policy";
    return placement;
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

int CallingThreadNode() {
  if (numa_available() < 0) return -1;
  const int cpu = sched_getcpu();
  return cpu < 0 ? -1 : numa_node_of_cpu(cpu);
}

bool RunCallingThreadOnNode(int node) {
  if (numa_available() < 0) return false;
  return numa_run_on_node(node) == 0;
}

}  // namespace memory_internal
}  // namespace ferry
