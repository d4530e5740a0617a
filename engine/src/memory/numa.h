// NUMA placement of host memory (libnuma / mbind semantics), for the memory layer's arenas.
#ifndef FERRY_MEMORY_NUMA_H_
#define FERRY_MEMORY_NUMA_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ferry {

// Where an arena's pages are placed.
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

namespace memory_internal {

// What ApplyNumaPolicy did.
struct NumaPlacement {
  bool applied = false;  // false: NUMA unavailable, or mbind refused where placement cannot matter
  // The nodes whose CPUs should touch the pages first (prefault threads run there): the bound or
  // preferred node, the calling CPU's node for kLocal, every allowed node with CPUs for kInterleave.
  // Empty when NUMA is unavailable (threads then run wherever the scheduler puts them).
  std::vector<int> toucher_nodes;
};

// Applies `policy` to [addr, addr + bytes), which no one has touched yet. `node` is the node for
// kBind / kPreferred (-1: the calling CPU's node). `name` appears in messages. When the kernel
// refuses mbind (no NUMA support, or a container without CAP_SYS_NICE) this logs a warning and
// returns applied == false if placement cannot matter (one node, or kLocal); otherwise an error that
// says how to fix it. InvalidArgument for a node this process may not allocate on.
absl::StatusOr<NumaPlacement> ApplyNumaPolicy(void* addr, size_t bytes, NumaPolicy policy, int node,
                                              const std::string& name);

// The NUMA node of the CPU the calling thread runs on; -1 when unknown (no NUMA support).
int CallingThreadNode();

// Restricts the calling thread to the CPUs of `node`. False (and nothing changes) when that fails, for
// example for a node without CPUs.
bool RunCallingThreadOnNode(int node);

}  // namespace memory_internal
}  // namespace ferry

#endif  // FERRY_MEMORY_NUMA_H_
