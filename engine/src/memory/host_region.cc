#include "memory/host_region.h"

#include <numa.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/absl_compat.h"
#include "base/errors.h"
#include "base/logging.h"
#include "base/thread_affinity.h"
#include "memory/format.h"
#include "memory/numa.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older C libraries lack the name
#endif

namespace ferry {
namespace memory_internal {
namespace {

constexpr size_t kMiB = size_t{1} << 20;
// Transparent huge pages are PMD-sized: 2 MiB on x86-64 and on arm64 with 4 KiB base pages.
constexpr size_t kDefaultThpBytes = 2 * kMiB;
constexpr size_t kBytesPerPrefaultThread = 64 * kMiB;
constexpr int kMaxPrefaultThreads = 32;

size_t BasePage() {
  const long page = sysconf(_SC_PAGESIZE);
  return page > 0 ? static_cast<size_t>(page) : 4096;
}

size_t RoundUp(size_t x, size_t align) { return (x + align - 1) / align * align; }

std::string ReadFirstLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return "";
  return line;
}

size_t ThpBytes() {
  uint64_t value = 0;
  const std::string text =
      ReadFirstLine("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size");
  if (absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &value) && value > 0) {
    return static_cast<size_t>(value);
  }
  return kDefaultThpBytes;
}

// Free hugetlb pages of `page_bytes` on `node`, or -1 when unknown.
long NodeFreeHugePages(int node, size_t page_bytes) {
  const std::string path = absl::StrCat("/sys/devices/system/node/node", node, "/hugepages/hugepages-",
                                        page_bytes / 1024, "kB/free_hugepages");
  uint64_t value = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(ReadFirstLine(path)), &value)) return -1;
  return static_cast<long>(value);
}

std::string PoolDescription(const HugePageInfo& info) {
  return absl::StrCat("the hugetlb pool has ", info.hugetlb_free_pages, " free of ",
                      info.hugetlb_total_pages, " pages of ", FormatBytes(info.hugetlb_page_bytes));
}

std::string ThpOffNote(const HugePageInfo& info) {
  return absl::StrCat("transparent huge pages are off (/sys/kernel/mm/transparent_hugepage/enabled: ",
                      info.thp_enabled, ")");
}

// kTransparentHuge, or kBase (with the reason in *note) when THP cannot apply.
PageKind TransparentOrBase(size_t bytes, const HugePageInfo& info, std::string* note) {
  if (info.thp_enabled == "never") {
    if (note != nullptr) *note = ThpOffNote(info);
    return PageKind::kBase;
  }
  if (bytes < ThpBytes()) return PageKind::kBase;  // smaller than one huge page: nothing to gain
  return PageKind::kTransparentHuge;
}

void AppendNote(std::string* note, const std::string& more) {
  if (more.empty()) return;
  absl::StrAppend(note, note->empty() ? "" : "; ", more);
}

std::string MmapAdvice() {
  return "not enough memory or address space (check free memory, vm.overcommit_memory and "
         "`ulimit -v`)";
}

// One slice's prefault: 0 populated with MADV_POPULATE_WRITE, 1 touched page by page, 2 left to the
// registration (hugetlb on a kernel without MADV_POPULATE_WRITE).
absl::StatusOr<int> PrefaultSlice(char* p, size_t len, PageKind kind) {
  for (int attempt = 0; attempt < 3; ++attempt) {
    if (madvise(p, len, MADV_POPULATE_WRITE) == 0) return 0;
    if (errno != EINTR && errno != EAGAIN) break;
  }
  const int err = errno;
  if (err == EINVAL) {  // a kernel before 5.14
    if (kind == PageKind::kHugetlb) return 2;
    const size_t page = BasePage();
    for (size_t off = 0; off < len; off += page) static_cast<volatile char*>(p)[off] = 0;
    return 1;
  }
  return PosixError("madvise(MADV_POPULATE_WRITE)", err);
}

}  // namespace

HostRegion::~HostRegion() {
  if (base_ != nullptr && munmap(base_, bytes_) != 0) {
    FERRY_LOG(ERROR) << PosixError(absl::StrCat("munmap of ", FormatBytes(bytes_)), errno);
  }
}

HostRegion::HostRegion(HostRegion&& other) noexcept { *this = std::move(other); }

HostRegion& HostRegion::operator=(HostRegion&& other) noexcept {
  if (this != &other) {
    if (base_ != nullptr) munmap(base_, bytes_);
    base_ = std::exchange(other.base_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    kind_ = other.kind_;
    note_ = std::move(other.note_);
  }
  return *this;
}

void* HostRegion::release() {
  bytes_ = 0;
  return std::exchange(base_, nullptr);
}

size_t RegionBytes(size_t bytes, PageKind kind) {
  if (kind == PageKind::kHugetlb) {
    const size_t hp = ReadHugePageInfo().hugetlb_page_bytes;
    if (hp > 0) return RoundUp(bytes, hp);
  }
  return RoundUp(bytes, BasePage());
}

PageKind ChoosePageKind(HugePages mode, size_t bytes, int bind_node, std::string* note) {
  const HugePageInfo info = ReadHugePageInfo();
  switch (mode) {
    case HugePages::kOff: return PageKind::kBase;
    case HugePages::kHugetlb: return PageKind::kHugetlb;
    case HugePages::kTransparent: return TransparentOrBase(bytes, info, note);
    case HugePages::kAuto: break;
  }
  const size_t hp = info.hugetlb_page_bytes;
  if (hp > 0 && bytes >= hp && info.hugetlb_total_pages > 0) {
    const size_t need = RoundUp(bytes, hp) / hp;
    bool fits = info.hugetlb_free_pages >= need;
    std::string why = absl::StrCat(PoolDescription(info), ", the arena needs ", need);
    if (fits && bind_node >= 0) {
      // MPOL_BIND takes hugetlb pages only from the bound node's pool (no fallback to others).
      const long node_free = NodeFreeHugePages(bind_node, hp);
      fits = node_free >= 0 && static_cast<size_t>(node_free) >= need;
      why = absl::StrCat("node ", bind_node, "'s hugetlb pool has ", node_free,
                         " free pages, the arena needs ", need);
    }
    if (fits) return PageKind::kHugetlb;
    if (note != nullptr) *note = why;
  }
  std::string thp_note;
  const PageKind kind = TransparentOrBase(bytes, info, &thp_note);
  if (note != nullptr) AppendNote(note, thp_note);
  return kind;
}

absl::StatusOr<HostRegion> ReserveHostRegion(size_t bytes, PageKind kind, bool fall_back,
                                             const std::string& name, int* mmap_calls) {
  HostRegion region;
  const std::string arena = absl::StrCat("arena '", name, "'");
  if (kind == PageKind::kHugetlb) {
    const HugePageInfo info = ReadHugePageInfo();
    const size_t size = RegionBytes(bytes, PageKind::kHugetlb);
    ++*mmap_calls;
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB,
                   -1, 0);
    if (p != MAP_FAILED) {
      region.base_ = p;
      region.bytes_ = size;
      region.kind_ = PageKind::kHugetlb;
      return region;
    }
    const int err = errno;
    const std::string cause =
        absl::StrCat("mmap(MAP_HUGETLB) of ", FormatBytes(size), " failed: ", std::strerror(err),
                     " (", PoolDescription(info), ")");
    if (!fall_back) {
      const size_t need = info.hugetlb_page_bytes > 0 ? size / info.hugetlb_page_bytes : 0;
      return absl::ResourceExhaustedError(absl::StrCat(
          arena, ": ", cause, ". Grow the pool to at least ", need + info.hugetlb_total_pages -
          std::min(info.hugetlb_total_pages, info.hugetlb_free_pages),
          " pages (`sysctl vm.nr_hugepages=N`, or per node in /sys/devices/system/node/nodeN/"
          "hugepages/), or ask for huge pages 'auto' or 'thp'"));
    }
    region.note_ = cause;
    std::string thp_note;
    kind = TransparentOrBase(bytes, info, &thp_note);
    AppendNote(&region.note_, thp_note);
  }

  const size_t size = RoundUp(bytes, BasePage());
  const size_t align = kind == PageKind::kTransparentHuge ? ThpBytes() : BasePage();
  const size_t map_bytes = size + (align > BasePage() ? align - BasePage() : 0);
  ++*mmap_calls;
  void* p = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    absl::Status status = PosixError(absl::StrCat(arena, ": mmap of ", FormatBytes(map_bytes)), err);
    if (err == ENOMEM) {
      return absl::Status(status.code(), absl::StrCat(status.message(), ": ", MmapAdvice()));
    }
    return status;
  }
  // Trim to an `align`-aligned start, so that every whole huge page of the range can be a huge page.
  char* raw = static_cast<char*>(p);
  char* start = reinterpret_cast<char*>(RoundUp(reinterpret_cast<uintptr_t>(raw), align));
  const size_t head = static_cast<size_t>(start - raw);
  const size_t tail = map_bytes - head - size;
  if (head > 0) munmap(raw, head);
  if (tail > 0) munmap(start + size, tail);
  region.base_ = start;
  region.bytes_ = size;
  region.kind_ = kind;
  if (kind == PageKind::kTransparentHuge) {
    if (madvise(start, size, MADV_HUGEPAGE) != 0) {
      AppendNote(&region.note_, absl::StrCat("madvise(MADV_HUGEPAGE) failed: ",
                                             std::strerror(errno), "; base pages"));
      region.kind_ = PageKind::kBase;
    }
  } else if (size >= ThpBytes()) {
    // Base pages asked for (or THP is off): keep khugepaged from collapsing them later.
    (void)madvise(start, size, MADV_NOHUGEPAGE);
  }
  return region;
}

absl::StatusOr<int> PrefaultRegion(void* base, size_t bytes, PageKind kind, int threads,
                                   const std::vector<int>& toucher_nodes, const std::string& name) {
  if (threads <= 0 || bytes == 0) return 0;
  size_t align = std::max(kDefaultThpBytes, ThpBytes());
  if (kind == PageKind::kHugetlb) align = std::max(align, ReadHugePageInfo().hugetlb_page_bytes);
  const size_t slice = RoundUp((bytes + static_cast<size_t>(threads) - 1) / static_cast<size_t>(threads),
                               align);
  const size_t n = (bytes + slice - 1) / slice;
  std::vector<absl::StatusOr<int>> results(n, 0);
  auto run = [&](size_t i, bool place) {
    if (place && !toucher_nodes.empty()) {
      // Best effort: a node without CPUs leaves the thread where it is; the policy still places.
      (void)RunCallingThreadOnNode(toucher_nodes[i % toucher_nodes.size()]);
    }
    const size_t begin = i * slice;
    results[i] = PrefaultSlice(static_cast<char*>(base) + begin, std::min(slice, bytes - begin), kind);
  };
  if (n == 1) {
    run(0, /*place=*/false);  // the calling thread: its placement is the caller's business
  } else {
    std::vector<std::thread> workers;
    workers.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      try {
        workers.emplace_back([&run, i] {
          NameCurrentThread("ferry-prefault");
          run(i, true);
        });
      } catch (const std::system_error&) {  // no more threads: do this slice here
        run(i, false);
      }
    }
    for (std::thread& t : workers) t.join();
  }
  int used = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!results[i].ok()) {
      const size_t begin = i * slice;
      std::string advice;
      if (results[i].status().code() == absl::StatusCode::kResourceExhausted ||
          kind == PageKind::kHugetlb) {
        advice = kind == PageKind::kHugetlb
                     ? absl::StrCat(": the hugetlb pool ran out (", PoolDescription(ReadHugePageInfo()),
                                    ")")
                     : ": the host (or the NUMA node(s) the policy allows) has not enough free memory";
      }
      return absl::Status(results[i].status().code(),
                          absl::StrCat("arena '", name, "': prefaulting bytes [", begin, ", ",
                                       begin + std::min(slice, bytes - begin), ") of ",
                                       FormatBytes(bytes), ": ", results[i].status().message(),
                                       advice));
    }
    if (*results[i] != 2) ++used;
  }
  return used;
}

int AutoPrefaultThreads(size_t bytes, const std::vector<int>& toucher_nodes) {
  cpu_set_t set;
  CPU_ZERO(&set);
  int cpus = 1;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) cpus = std::max(1, CPU_COUNT(&set));
  if (!toucher_nodes.empty() && numa_available() >= 0) {
    int node_cpus = 0;
    bitmask* mask = numa_allocate_cpumask();
    if (mask != nullptr) {
      for (int node : toucher_nodes) {
        if (numa_node_to_cpus(node, mask) == 0) {
          node_cpus += static_cast<int>(numa_bitmask_weight(mask));
        }
      }
      numa_bitmask_free(mask);
    }
    if (node_cpus > 0) cpus = std::min(cpus, node_cpus);
  }
  const size_t by_size = std::max<size_t>(1, bytes / kBytesPerPrefaultThread);
  return static_cast<int>(
      std::min<size_t>({by_size, static_cast<size_t>(cpus), static_cast<size_t>(kMaxPrefaultThreads)}));
}

size_t HugeBackedBytesIn(std::string_view smaps, uintptr_t begin, uintptr_t end) {
  size_t total = 0;
  size_t overlap = 0;  // of the mapping being read; 0: it does not overlap [begin, end)
  size_t huge = 0;     // its huge bytes so far
  auto close = [&] {
    total += std::min(huge, overlap);
    overlap = huge = 0;
  };
  for (absl::string_view line : absl::StrSplit(ToAbsl(smaps), '\n')) {
    // A mapping's header starts with its range, "start-end perms offset dev inode path"; a field's
    // line with its name, "AnonHugePages:   2048 kB".
    const absl::string_view first = line.substr(0, line.find(' '));
    const size_t dash = first.find('-');
    uint64_t lo = 0, hi = 0;
    if (dash != absl::string_view::npos && absl::SimpleHexAtoi(first.substr(0, dash), &lo) &&
        absl::SimpleHexAtoi(first.substr(dash + 1), &hi)) {
      close();
      const uint64_t a = std::max<uint64_t>(lo, begin), b = std::min<uint64_t>(hi, end);
      overlap = b > a ? static_cast<size_t>(b - a) : 0;
      continue;
    }
    if (overlap == 0) continue;
    if (first != "AnonHugePages:" && first != "ShmemPmdMapped:" && first != "FilePmdMapped:") continue;
    uint64_t kb = 0;
    if (absl::SimpleAtoi(absl::StripAsciiWhitespace(absl::StripSuffix(line.substr(first.size()), "kB")), &kb)) {
      huge += static_cast<size_t>(kb) * 1024;
    }
  }
  close();
  return total;
}

size_t HugeBackedBytes(const void* base, size_t bytes, PageKind kind) {
  if (kind == PageKind::kHugetlb) return bytes;
  if (kind == PageKind::kBase) return 0;  // marked MADV_NOHUGEPAGE (ReserveHostRegion), or under a huge page
  std::ifstream in("/proc/self/smaps");
  if (!in) return 0;
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto begin = reinterpret_cast<uintptr_t>(base);
  return HugeBackedBytesIn(text, begin, begin + bytes);
}

}  // namespace memory_internal

absl::StatusOr<HugePages> ParseHugePages(std::string_view text) {
  const std::string lower = absl::AsciiStrToLower(ToAbsl(text));
  if (lower == "auto") return HugePages::kAuto;
  if (lower == "thp" || lower == "transparent") return HugePages::kTransparent;
  if (lower == "hugetlb") return HugePages::kHugetlb;
  if (lower == "off") return HugePages::kOff;
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown huge pages mode '", ToAbsl(text), "'; expected one of auto, thp, hugetlb, off"));
}

std::string_view HugePagesName(HugePages mode) {
  switch (mode) {
    case HugePages::kAuto: return "auto";
    case HugePages::kTransparent: return "thp";
    case HugePages::kHugetlb: return "hugetlb";
    case HugePages::kOff: return "off";
  }
  return "unknown";
}

std::string_view PageKindName(PageKind kind) {
  switch (kind) {
    case PageKind::kBase: return "base";
    case PageKind::kTransparentHuge: return "thp";
    case PageKind::kHugetlb: return "hugetlb";
  }
  return "unknown";
}

HugePageInfo ReadHugePageInfo() {
  HugePageInfo info;
  const std::string thp = memory_internal::ReadFirstLine("/sys/kernel/mm/transparent_hugepage/enabled");
  const size_t open = thp.find('['), close = thp.find(']');
  if (open != std::string::npos && close != std::string::npos && close > open) {
    info.thp_enabled = thp.substr(open + 1, close - open - 1);
  }
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    std::vector<absl::string_view> parts =
        absl::StrSplit(line, absl::ByAnyChar(": \t"), absl::SkipEmpty());
    if (parts.size() < 2) continue;
    uint64_t value = 0;
    if (!absl::SimpleAtoi(parts[1], &value)) continue;
    if (parts[0] == "HugePages_Total") info.hugetlb_total_pages = static_cast<size_t>(value);
    if (parts[0] == "HugePages_Free") info.hugetlb_free_pages = static_cast<size_t>(value);
    if (parts[0] == "Hugepagesize") info.hugetlb_page_bytes = static_cast<size_t>(value) * 1024;
  }
  return info;
}

}  // namespace ferry
