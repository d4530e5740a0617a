// Host memory regions for arenas: reserved with mmap (huge pages where the host offers them), and
// pre-faulted by parallel threads placed by the NUMA policy, so that registering the region with the
// device afterwards only has to pin pages that already exist.
//
// What this buys, measured on a 2-core VM (Linux 6.18, THP "madvise", no hugetlb pool), 4 GiB, with
// io_uring buffer registration standing in for cudaHostRegister (both pin pages with FOLL_LONGTERM):
//   base pages, no prefault (pinning faults every page, one thread)   1.0 - 2.4 s
//   base pages, MADV_POPULATE_WRITE on 2 threads, then pin             2.0 - 3.4 s (pin 0.07 - 0.2 s)
//   THP, MADV_POPULATE_WRITE on 2 threads, then pin                    0.54 - 0.57 s (pin 0.009 s)
// Zeroing the pages is the cost that remains; it scales with the threads.
#ifndef FERRY_MEMORY_HOST_REGION_H_
#define FERRY_MEMORY_HOST_REGION_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ferry {

// Which pages back an arena's region.
enum class HugePages : uint8_t {
  kAuto,         // hugetlb pages when the pool has room for the whole region (on the bound node for
                 // NumaPolicy::kBind), else transparent huge pages, else base pages (default)
  kTransparent,  // transparent huge pages (madvise MADV_HUGEPAGE); base pages when THP is off
  kHugetlb,      // hugetlb pages (MAP_HUGETLB) only: an error that says how to grow the pool otherwise
  kOff,          // base pages only (madvise MADV_NOHUGEPAGE)
};

// "auto", "thp" (or "transparent"), "hugetlb", "off"; InvalidArgument otherwise.
absl::StatusOr<HugePages> ParseHugePages(std::string_view text);
std::string_view HugePagesName(HugePages mode);

// Which pages a region got.
enum class PageKind : uint8_t {
  kBase,             // base pages (4 KiB on x86-64)
  kTransparentHuge,  // marked MADV_HUGEPAGE on a huge-page-aligned range: the kernel backs it with
                     // 2 MiB pages where it can (HugeBackedBytes says how much it did)
  kHugetlb,          // hugetlb pages from the reserved pool
};
std::string_view PageKindName(PageKind kind);  // "base", "thp", "hugetlb"

// What this host offers, read from /proc/meminfo and /sys/kernel/mm/transparent_hugepage.
struct HugePageInfo {
  std::string thp_enabled;       // "always", "madvise", "never"; "" when unknown
  size_t hugetlb_page_bytes = 0; // Hugepagesize; 0 when unknown
  size_t hugetlb_total_pages = 0;
  size_t hugetlb_free_pages = 0;
};
HugePageInfo ReadHugePageInfo();

namespace memory_internal {

// An anonymous private mapping, unmapped on destruction. Move-only; one thread at a time.
class HostRegion final {
 public:
  HostRegion() = default;
  ~HostRegion();
  HostRegion(HostRegion&& other) noexcept;
  HostRegion& operator=(HostRegion&& other) noexcept;
  HostRegion(const HostRegion&) = delete;
  HostRegion& operator=(const HostRegion&) = delete;

  void* base() const { return base_; }
  size_t bytes() const { return bytes_; }
  PageKind kind() const { return kind_; }
  // Why the region got other pages than asked for ("" when it got what was asked).
  const std::string& note() const { return note_; }
  // Gives up ownership: the caller unmaps [base, base + bytes).
  void* release();

 private:
  friend absl::StatusOr<HostRegion> ReserveHostRegion(size_t, PageKind, bool, const std::string&,
                                                      int*);
  void* base_ = nullptr;
  size_t bytes_ = 0;
  PageKind kind_ = PageKind::kBase;
  std::string note_;
};

// The size a region of `bytes` will have with `kind` pages: rounded up to the page size (the hugetlb
// page size for kHugetlb).
size_t RegionBytes(size_t bytes, PageKind kind);

// The pages a request for `mode` will get on this host, before any mapping is made, and why (see
// HugePages). `bind_node` >= 0: hugetlb pages must come from that node's pool.
PageKind ChoosePageKind(HugePages mode, size_t bytes, int bind_node, std::string* note);

// Reserves a region of RegionBytes(bytes, kind) bytes of `kind` pages (from ChoosePageKind), aligned to
// the huge page size for huge kinds. No page is touched. When a hugetlb mapping fails and `fall_back`
// is set (HugePages::kAuto), the region gets transparent huge pages (or base pages when THP is off)
// instead, and note() says why; its bytes() may then be smaller. `name` appears in errors. Adds the
// mmap calls made (failed ones included) to *mmap_calls.
// Errors: ResourceExhausted (ENOMEM) with what to check; for kHugetlb without fall_back, how to grow
// the pool.
absl::StatusOr<HostRegion> ReserveHostRegion(size_t bytes, PageKind kind, bool fall_back,
                                             const std::string& name, int* mmap_calls);

// Faults every page of [base, base + bytes) in, writable, with `threads` threads (1: the calling
// thread only), each on a slice aligned to 2 MiB and run on toucher_nodes[i % size] when that list is
// not empty. Uses MADV_POPULATE_WRITE (Linux 5.14+), which reports a failure as an error; older
// kernels get a write to every page, except for hugetlb regions, which are then left to the device's
// registration to fault in (a touch there could raise SIGBUS). Returns the number of threads that
// prefaulted (0 when it was left to the registration). Errors name `name`, the slice and the cause.
absl::StatusOr<int> PrefaultRegion(void* base, size_t bytes, PageKind kind, int threads,
                                   const std::vector<int>& toucher_nodes, const std::string& name);

// The bytes of [begin, end) that huge pages back, from the text of /proc/<pid>/smaps: for each mapping
// overlapping the range, its AnonHugePages, ShmemPmdMapped and FilePmdMapped, at most its overlap with
// the range (a mapping the kernel merged with a neighbour counts no more than its part in the range).
size_t HugeBackedBytesIn(std::string_view smaps, uintptr_t begin, uintptr_t end);

// The bytes of this process's [base, base + bytes) that huge pages back now: every byte of a
// kHugetlb region, none of a kBase one (marked MADV_NOHUGEPAGE, or smaller than a huge page), and
// for a kTransparentHuge one HugeBackedBytesIn of /proc/self/smaps (the kernel walks every mapping's
// page tables for it: 40-77 ms for a process holding 4 GiB of base pages on a 2-CPU VM, far less per
// GiB of huge pages; arenas ask once, after a prefault that takes longer); 0 when smaps cannot be
// read. THP regions the kernel could not back with huge pages (fragmented memory, THP defrag off)
// read low, and CPU Adam runs slower through their TLB misses.
size_t HugeBackedBytes(const void* base, size_t bytes, PageKind kind);

// The number of prefault threads for a region of `bytes` when the options say "auto": one per 64 MiB,
// at most the CPUs this process may run on (of `toucher_nodes` when given) and at most 32.
int AutoPrefaultThreads(size_t bytes, const std::vector<int>& toucher_nodes);

}  // namespace memory_internal
}  // namespace ferry

#endif  // FERRY_MEMORY_HOST_REGION_H_
