// `ferry bench transfer`: Ferry's pinned arena + Transfer against the copies users make today and
// against the hardware ceiling, all measured in one run through the Device API:
//   - the ceiling: one large copy between registered pinned memory and device memory, D2H, H2D, and
//     both at once on two streams;
//   - the baseline: one copy per tensor from/to pageable (malloc'd, unregistered) host memory, for
//     ~1,000 tensors of mixed sizes (4 KiB to 64 MiB, log-uniform, fixed seed, several GiB);
//   - Ferry: the same tensors through a PinnedArena and a Transfer (D2H, H2D, both at once), and a
//     sweep of chunk sizes;
//   - the time to reserve and register a large arena (16 GiB by default), for several ways of setting
//     it up (huge pages, parallel prefault), so the fastest can be seen on the machine at hand.
// Every copied byte pattern is checked on samples after the runs; a mismatch exits non-zero. Targets
// are reported, not asserted: Ferry >= 95% of the ceiling each way, >= 90% with both at once, >= 3x
// the pageable baseline.
#include <sched.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/types/span.h"
#include "base/absl_compat.h"
#include "bench/bench.h"
#include "device/device.h"
#include "ferry/status.h"
#include "memory/host_region.h"
#include "memory/numa.h"
#include "memory/pinned_arena.h"
#include "transfer/transfer.h"

namespace ferry::bench {
namespace {

constexpr size_t kKiB = size_t{1} << 10;
constexpr size_t kMiB = size_t{1} << 20;
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

struct Flags {
  double total_gib = 4;
  int tensors = 1000;
  size_t min_bytes = 4 * kKiB;
  size_t max_bytes = 64 * kMiB;
  size_t chunk_bytes = TransferOptions{}.chunk_bytes;
  std::vector<size_t> sweep = {1 * kMiB, 2 * kMiB, 4 * kMiB, 8 * kMiB, 16 * kMiB, 32 * kMiB, 64 * kMiB};
  int reps = 5;
  int warmup = 1;
  double arena_gib = 16;
  bool arena_compare = true;
  uint64_t seed = 20240601;
  NumaPolicy numa = NumaPolicy::kInterleave;
  int numa_node = -1;
  HugePages huge_pages = HugePages::kAuto;
};

constexpr char kUsage[] =
    "usage: ferry bench transfer [--quick] [--total-gib=G] [--tensors=N] [--min-kib=K] [--max-mib=M]\n"
    "                            [--chunk=SIZE] [--sweep=SIZE,SIZE,...|off] [--reps=N] [--warmup=N]\n"
    "                            [--arena-gib=G] [--arena-compare=0|1] [--numa=POLICY] [--numa-node=N]\n"
    "                            [--huge-pages=auto|thp|hugetlb|off] [--seed=N]\n"
    "\n"
    "  --total-gib   bytes of the tensor set, each way (default 4)\n"
    "  --tensors     number of tensors (default 1000); sizes log-uniform in [--min-kib, --max-mib]\n"
    "                (default 4 KiB .. 64 MiB), skewed so that they add up to --total-gib\n"
    "  --chunk       Transfer chunk size for the main rows (default 8M); SIZE: bytes with an optional\n"
    "                K/M/G suffix (binary); a plain number means MiB\n"
    "  --sweep       chunk sizes for the sweep (default 1,2,4,8,16,32,64 MiB); off to skip\n"
    "  --reps        timed repetitions per measurement, median reported (default 5)\n"
    "  --warmup      untimed runs before them (default 1)\n"
    "  --arena-gib   size of the arena whose reservation + registration is timed (default 16; 0 skips)\n"
    "  --arena-compare  also time other setups of that arena: base pages, THP, hugetlb, with and\n"
    "                without parallel prefault (default 1)\n"
    "  --numa, --numa-node, --huge-pages   options of every arena (default interleave, auto)\n"
    "  --quick       small sizes, a few seconds on the host backend (the ctest smoke run)\n"
    "\n"
    "Device: CUDA when present, else the host backend; FERRY_DEVICE=host|cuda overrides.\n"
    "Exit status: 0 when every measurement ran and every copy was verified, 1 otherwise, 2 for bad flags.\n";

void ApplyQuick(Flags& f) {
  f.total_gib = 24.0 * kMiB / kGiB;
  f.tensors = 48;
  f.min_bytes = 4 * kKiB;
  f.max_bytes = 2 * kMiB;
  f.chunk_bytes = 256 * kKiB;
  f.sweep = {64 * kKiB, 1 * kMiB};
  f.reps = 2;
  f.warmup = 1;
  f.arena_gib = 64.0 * kMiB / kGiB;
}

// SIZE: a number of bytes with an optional K/KiB/M/MiB/G/GiB suffix; a plain number means MiB.
bool ParseSize(std::string text, size_t* out) {
  size_t unit = kMiB;
  auto strip = [&](const char* suffix, size_t u) {
    const size_t n = std::strlen(suffix);
    if (text.size() > n && text.compare(text.size() - n, n, suffix) == 0) {
      text.resize(text.size() - n);
      unit = u;
      return true;
    }
    return false;
  };
  strip("KiB", kKiB) || strip("MiB", kMiB) || strip("GiB", kMiB * kKiB) || strip("K", kKiB) ||
      strip("M", kMiB) || strip("G", kMiB * kKiB) || strip("B", 1);
  double value = 0;
  if (!absl::SimpleAtod(text, &value) || !(value > 0) || value * static_cast<double>(unit) > 1e15) {
    return false;
  }
  *out = static_cast<size_t>(value * static_cast<double>(unit));
  return *out > 0;
}

// Parses argv into `f`; returns false (after printing why) on a bad flag.
bool ParseFlags(int argc, char** argv, Flags& f, bool* help) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) ApplyQuick(f);  // first, so later flags override it
  }
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--quick") continue;
    if (arg == "--help" || arg == "-h") {
      *help = true;
      return true;
    }
    std::string name = arg, value;
    if (const size_t eq = arg.find('='); eq != std::string::npos) name = arg.substr(0, eq);
    static const char* const kKnown[] = {
        "--total-gib", "--tensors", "--min-kib",       "--max-mib", "--chunk",     "--sweep",
        "--reps",      "--warmup",  "--arena-gib",     "--seed",    "--numa",      "--numa-node",
        "--huge-pages", "--arena-compare"};
    if (std::none_of(std::begin(kKnown), std::end(kKnown),
                     [&](const char* known) { return name == known; })) {
      std::fprintf(stderr, "ferry bench transfer: unknown flag %s\n%s", name.c_str(), kUsage);
      return false;
    }
    if (const size_t eq = arg.find('='); eq != std::string::npos) {
      name = arg.substr(0, eq);
      value = arg.substr(eq + 1);
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      std::fprintf(stderr, "ferry bench transfer: %s needs a value\n%s", arg.c_str(), kUsage);
      return false;
    }
    bool ok = true;
    int64_t n = 0;
    if (name == "--total-gib") {
      ok = absl::SimpleAtod(value, &f.total_gib) && f.total_gib > 0;
    } else if (name == "--tensors") {
      ok = absl::SimpleAtoi(value, &n) && n >= 1 && n <= 1000000;
      f.tensors = static_cast<int>(n);
    } else if (name == "--min-kib") {
      ok = absl::SimpleAtoi(value, &n) && n >= 1;
      f.min_bytes = static_cast<size_t>(n) * kKiB;
    } else if (name == "--max-mib") {
      ok = absl::SimpleAtoi(value, &n) && n >= 1;
      f.max_bytes = static_cast<size_t>(n) * kMiB;
    } else if (name == "--chunk") {
      ok = ParseSize(value, &f.chunk_bytes);
    } else if (name == "--sweep") {
      f.sweep.clear();
      if (value != "off" && value != "0") {
        for (absl::string_view part : absl::StrSplit(value, ',', absl::SkipEmpty())) {
          size_t size = 0;
          ok = ok && ParseSize(std::string(part), &size);
          f.sweep.push_back(size);
        }
      }
    } else if (name == "--reps") {
      ok = absl::SimpleAtoi(value, &n) && n >= 1 && n <= 1000;
      f.reps = static_cast<int>(n);
    } else if (name == "--warmup") {
      ok = absl::SimpleAtoi(value, &n) && n >= 0 && n <= 1000;
      f.warmup = static_cast<int>(n);
    } else if (name == "--arena-gib") {
      ok = absl::SimpleAtod(value, &f.arena_gib) && f.arena_gib >= 0;
    } else if (name == "--arena-compare") {
      ok = value == "0" || value == "1";
      f.arena_compare = value == "1";
    } else if (name == "--seed") {
      ok = absl::SimpleAtoi(value, &f.seed);
    } else if (name == "--numa") {
      absl::StatusOr<NumaPolicy> p = ParseNumaPolicy(value);
      ok = p.ok();
      if (ok) f.numa = *p;
    } else if (name == "--numa-node") {
      ok = absl::SimpleAtoi(value, &n) && n >= -1;
      f.numa_node = static_cast<int>(n);
    } else if (name == "--huge-pages") {
      absl::StatusOr<HugePages> h = ParseHugePages(value);
      ok = h.ok();
      if (ok) f.huge_pages = *h;
    }
    if (!ok) {
      std::fprintf(stderr, "ferry bench transfer: bad value '%s' for %s\n%s", value.c_str(),
                   name.c_str(), kUsage);
      return false;
    }
  }
  if (f.min_bytes > f.max_bytes) {
    std::fprintf(stderr, "ferry bench transfer: --min-kib is above --max-mib\n");
    return false;
  }
  return true;
}

std::string Bytes(size_t bytes) {
  if (bytes >= (size_t{1} << 30)) return absl::StrFormat("%.2f GiB", static_cast<double>(bytes) / kGiB);
  if (bytes >= kMiB) return absl::StrFormat("%.2f MiB", static_cast<double>(bytes) / kMiB);
  if (bytes >= kKiB) return absl::StrFormat("%.1f KiB", static_cast<double>(bytes) / kKiB);
  return absl::StrFormat("%u B", bytes);
}

double GBps(size_t bytes, double seconds) {
  return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0;
}

// ---- the tensor set ---------------------------------------------------------------------------------

// `n` sizes in [lo, hi], multiples of 4 bytes (fp32 tensors): lo * (hi/lo)^(u^p) with u uniform in
// [0, 1) from `seed` (u = 0 and u = 1 included, so both ends occur), and p found by bisection so
// that the sizes add up to `total` (p = 1 is log-uniform; p > 1 leans to small tensors).
absl::StatusOr<std::vector<size_t>> TensorSizes(int n, size_t lo, size_t hi, size_t total,
                                                uint64_t seed, double* skew) {
  const size_t count = static_cast<size_t>(n);
  if (count * lo > total || count * hi < total) {
    return absl::InvalidArgumentError(absl::StrCat(
        n, " tensors of ", Bytes(lo), " to ", Bytes(hi), " cannot add up to ", Bytes(total),
        ": change --tensors, --total-gib, --min-kib or --max-mib"));
  }
  std::mt19937_64 rng(seed);
  std::vector<double> u(count);
  for (double& x : u) x = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
  u[0] = 0.0;
  if (count > 1) u[1] = 1.0;
  const double ratio = static_cast<double>(hi) / static_cast<double>(lo);
  auto sizes_for = [&](double p) {
    std::vector<size_t> sizes(count);
    for (size_t i = 0; i < count; ++i) {
      const double s = static_cast<double>(lo) * std::pow(ratio, std::pow(u[i], p));
      sizes[i] = std::clamp<size_t>(static_cast<size_t>(s) / 4 * 4, lo, hi);
    }
    return sizes;
  };
  auto sum = [](const std::vector<size_t>& v) {
    size_t s = 0;
    for (size_t x : v) s += x;
    return s;
  };
  double p_lo = 1e-3, p_hi = 1e3;  // the sum falls as p grows
  for (int it = 0; it < 200; ++it) {
    const double mid = std::sqrt(p_lo * p_hi);
    (sum(sizes_for(mid)) > total ? p_lo : p_hi) = mid;
  }
  *skew = p_hi;
  return sizes_for(p_hi);
}

// The byte at offset j of tensor t's pattern (`salt` tells the two directions' data apart).
inline uint64_t PatternWord(uint64_t salt, size_t t, size_t word) {
  uint64_t z = salt ^ (static_cast<uint64_t>(t) << 40) ^ static_cast<uint64_t>(word);
  z += 0x9e3779b97f4a7c15ULL;  // splitmix64
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

void FillPattern(uint8_t* p, size_t n, uint64_t salt, size_t t) {
  size_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const uint64_t w = PatternWord(salt, t, j / 8);
    std::memcpy(p + j, &w, 8);
  }
  if (j < n) {
    const uint64_t w = PatternWord(salt, t, j / 8);
    std::memcpy(p + j, &w, n - j);
  }
}

// Whether bytes [off, off + len) of tensor t hold its pattern; `p` points at byte `off`.
bool MatchesPattern(const uint8_t* p, size_t off, size_t len, uint64_t salt, size_t t) {
  for (size_t j = 0; j < len; ++j) {
    const size_t at = off + j;
    const uint64_t w = PatternWord(salt, t, at / 8);
    if (p[j] != static_cast<uint8_t>(w >> (8 * (at % 8)))) return false;
  }
  return true;
}

// Runs fn(i) for i in [0, n) on up to 16 threads.
void ParallelFor(size_t n, const std::function<void(size_t)>& fn) {
  const size_t threads =
      std::min<size_t>({n, 16, std::max<unsigned>(1, std::thread::hardware_concurrency())});
  if (threads <= 1) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::vector<std::thread> workers;
  for (size_t w = 0; w < threads; ++w) {
    workers.emplace_back([&, w] {
      for (size_t i = w; i < n; i += threads) fn(i);
    });
  }
  for (std::thread& th : workers) th.join();
}

struct FreeDeleter {
  void operator()(uint8_t* p) const { std::free(p); }
};
using PageableBuffer = std::unique_ptr<uint8_t, FreeDeleter>;

constexpr uint64_t kSaltDown = 0xD2D2D2D2ULL;  // the data that travels device -> host
constexpr uint64_t kSaltUp = 0x42424242ULL;    // the data that travels host -> device
constexpr uint8_t kPoison = 0xEE;

// Everything the copies use. Set A goes device -> host, set B host -> device.
struct Buffers {
  std::vector<size_t> sizes;
  size_t total = 0;
  std::vector<DeviceBuffer> dev_a, dev_b;        // per tensor
  std::vector<PageableBuffer> page_a, page_b;    // pageable host, per tensor
  std::unique_ptr<PinnedArena> arena;            // the pinned side: ceiling and Ferry
  std::vector<HostSpan> pin_a, pin_b;            // Ferry, per tensor
  HostSpan ceil_host_a, ceil_host_b;             // the ceiling: one span each way
  DeviceBuffer ceil_dev_a, ceil_dev_b;
  std::unique_ptr<Stream> s_down, s_up;          // the ceiling's and the baseline's streams

  Buffers() = default;
  Buffers(const Buffers&) = delete;
  Buffers& operator=(const Buffers&) = delete;
  ~Buffers() {
    if (arena == nullptr) return;
    for (auto* list : {&pin_a, &pin_b}) {
      for (const HostSpan& s : *list) (void)arena->Release(s);
    }
    for (const HostSpan* s : {&ceil_host_a, &ceil_host_b}) {
      if (!s->empty()) (void)arena->Release(*s);
    }
  }
};

// Sampled windows of tensor t (offset, length): the start, the end and one in between.
std::vector<std::pair<size_t, size_t>> Windows(size_t n, uint64_t seed, size_t t) {
  const size_t w = std::min<size_t>(n, 4096);
  std::mt19937_64 rng(seed ^ (t * 0x9e3779b97f4a7c15ULL));
  const size_t mid = n > w ? rng() % (n - w + 1) : 0;
  return {{0, w}, {n - w, w}, {mid, w}};
}

// Checks the sampled windows of every tensor in host memory `bufs[t]` against the pattern.
absl::Status VerifyHost(const std::vector<const uint8_t*>& bufs, const std::vector<size_t>& sizes,
                        uint64_t salt, uint64_t seed, const std::string& what, size_t* checked) {
  for (size_t t = 0; t < sizes.size(); ++t) {
    for (const auto& [off, len] : Windows(sizes[t], seed, t)) {
      if (!MatchesPattern(bufs[t] + off, off, len, salt, t)) {
        return absl::DataLossError(absl::StrCat(what, ": tensor ", t, " (", sizes[t],
                                                " bytes) holds wrong bytes in [", off, ", ",
                                                off + len, ")"));
      }
      *checked += len;
    }
  }
  return absl::OkStatus();
}

// The same for device memory, read back window by window.
absl::Status VerifyDevice(Device& device, const std::vector<DeviceBuffer>& bufs,
                          const std::vector<size_t>& sizes, uint64_t salt, uint64_t seed,
                          const std::string& what, size_t* checked) {
  std::vector<uint8_t> window(4096);
  for (size_t t = 0; t < sizes.size(); ++t) {
    for (const auto& [off, len] : Windows(sizes[t], seed, t)) {
      FERRY_RETURN_IF_ERROR(
          device.Copy(window.data(), bufs[t].as<uint8_t>() + off, len, CopyKind::kDeviceToHost));
      if (!MatchesPattern(window.data(), off, len, salt, t)) {
        return absl::DataLossError(absl::StrCat(what, ": device tensor ", t, " (", sizes[t],
                                                " bytes) holds wrong bytes in [", off, ", ",
                                                off + len, ")"));
      }
      *checked += len;
    }
  }
  return absl::OkStatus();
}

void PoisonHost(const std::vector<uint8_t*>& bufs, const std::vector<size_t>& sizes) {
  ParallelFor(sizes.size(), [&](size_t t) { std::memset(bufs[t], kPoison, sizes[t]); });
}

absl::Status PoisonDevice(Device& device, std::vector<DeviceBuffer>& bufs, Stream& stream) {
  for (DeviceBuffer& b : bufs) FERRY_RETURN_IF_ERROR(device.MemsetAsync(b.data(), kPoison, b.bytes(), stream));
  return stream.Synchronize();
}

absl::StatusOr<size_t> HostMemAvailable() {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("MemAvailable:", 0) == 0) {
      std::istringstream fields(line.substr(13));
      uint64_t kib = 0;
      if (fields >> kib) return static_cast<size_t>(kib) * 1024;
    }
  }
  return absl::UnavailableError("no MemAvailable in /proc/meminfo");
}

absl::StatusOr<std::unique_ptr<Buffers>> Allocate(Device& device, const Flags& f,
                                                   std::vector<size_t> sizes) {
  auto owned = std::make_unique<Buffers>();
  Buffers& b = *owned;
  b.sizes = std::move(sizes);
  for (size_t s : b.sizes) b.total += s;
  const size_t n = b.sizes.size();
  // Device: two tensor sets and two ceiling buffers. Host: the same pinned, and two pageable sets.
  const size_t device_need = 4 * b.total + n * 2 * 512 + 256 * kMiB;
  if (absl::StatusOr<size_t> free = device.FreeMemory(); free.ok() && *free < device_need) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the device has ", Bytes(*free), " free; this run needs about ", Bytes(device_need),
        " (4x the tensor set): use a smaller --total-gib"));
  }
  const size_t host_need = 6 * b.total + 512 * kMiB;
  if (absl::StatusOr<size_t> avail = HostMemAvailable(); avail.ok() && *avail < host_need) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the host has ", Bytes(*avail), " available; this run needs about ", Bytes(host_need),
        " (4x the tensor set pinned, 2x pageable): use a smaller --total-gib"));
  }
  FERRY_ASSIGN_OR_RETURN(b.s_down, device.CreateStream());
  FERRY_ASSIGN_OR_RETURN(b.s_up, device.CreateStream());
  FERRY_ASSIGN_OR_RETURN(b.ceil_dev_a, device.Allocate(b.total));
  FERRY_ASSIGN_OR_RETURN(b.ceil_dev_b, device.Allocate(b.total));
  for (size_t t = 0; t < n; ++t) {
    FERRY_ASSIGN_OR_RETURN(DeviceBuffer a, device.Allocate(b.sizes[t]));
    FERRY_ASSIGN_OR_RETURN(DeviceBuffer bb, device.Allocate(b.sizes[t]));
    b.dev_a.push_back(std::move(a));
    b.dev_b.push_back(std::move(bb));
    auto* pa = static_cast<uint8_t*>(std::malloc(b.sizes[t]));
    auto* pb = static_cast<uint8_t*>(std::malloc(b.sizes[t]));
    b.page_a.emplace_back(pa);
    b.page_b.emplace_back(pb);
    if (pa == nullptr || pb == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("malloc of ", b.sizes[t], " bytes (pageable tensor ", t, ") failed"));
    }
  }
  PinnedArenaOptions options;
  options.name = "transfer bench";
  options.capacity_bytes = 4 * b.total + 2 * n * 256 + 4 * kMiB;
  options.numa = f.numa;
  options.numa_node = f.numa_node;
  options.huge_pages = f.huge_pages;
  FERRY_ASSIGN_OR_RETURN(b.arena, PinnedArena::Create(&device, options));
  FERRY_ASSIGN_OR_RETURN(b.ceil_host_a, b.arena->Allocate(b.total));
  FERRY_ASSIGN_OR_RETURN(b.ceil_host_b, b.arena->Allocate(b.total));
  for (size_t t = 0; t < n; ++t) {
    FERRY_ASSIGN_OR_RETURN(HostSpan a, b.arena->Allocate(b.sizes[t]));
    b.pin_a.push_back(a);
    FERRY_ASSIGN_OR_RETURN(HostSpan bb, b.arena->Allocate(b.sizes[t]));
    b.pin_b.push_back(bb);
  }
  return owned;
}

// Fills the sources with their patterns (set A on the device through the pinned staging, set B in
// pinned and pageable memory) and poisons the destinations.
absl::Status Fill(Device& device, Buffers& b) {
  const size_t n = b.sizes.size();
  ParallelFor(n, [&](size_t t) {
    FillPattern(b.pin_a[t].as<uint8_t>(), b.sizes[t], kSaltDown, t);
    FillPattern(b.pin_b[t].as<uint8_t>(), b.sizes[t], kSaltUp, t);
    FillPattern(b.page_b[t].get(), b.sizes[t], kSaltUp, t);
    std::memset(b.page_a[t].get(), kPoison, b.sizes[t]);
  });
  for (size_t t = 0; t < n; ++t) {
    FERRY_RETURN_IF_ERROR(device.CopyAsync(b.dev_a[t].data(), b.pin_a[t].data, b.sizes[t],
                                           CopyKind::kHostToDevice, *b.s_up));
  }
  FERRY_RETURN_IF_ERROR(b.s_up->Synchronize());
  ParallelFor(n, [&](size_t t) { std::memset(b.pin_a[t].data, kPoison, b.sizes[t]); });
  std::memset(b.ceil_host_b.data, 0x5A, b.total);
  FERRY_RETURN_IF_ERROR(device.MemsetAsync(b.ceil_dev_a.data(), 0xA5, b.total, *b.s_down));
  return b.s_down->Synchronize();
}

// Median seconds of `reps` timed runs of fn after `warmup` untimed ones.
absl::StatusOr<double> Measure(const Flags& f, const std::function<absl::Status()>& fn) {
  for (int w = 0; w < f.warmup; ++w) FERRY_RETURN_IF_ERROR(fn());
  std::vector<double> samples;
  for (int r = 0; r < f.reps; ++r) {
    const double t0 = Now();
    FERRY_RETURN_IF_ERROR(fn());
    samples.push_back(Now() - t0);
  }
  return Median(samples);
}

enum Direction : int { kDown = 1, kUp = 2, kBoth = 3 };

std::string DirName(Direction d) { return d == kDown ? "D2H" : d == kUp ? "H2D" : "both"; }

absl::Status CeilingRun(Device& device, Buffers& b, Direction d) {
  if (d & kDown) {
    FERRY_RETURN_IF_ERROR(device.CopyAsync(b.ceil_host_a.data, b.ceil_dev_a.data(), b.total,
                                           CopyKind::kDeviceToHost, *b.s_down));
  }
  if (d & kUp) {
    FERRY_RETURN_IF_ERROR(device.CopyAsync(b.ceil_dev_b.data(), b.ceil_host_b.data, b.total,
                                           CopyKind::kHostToDevice, *b.s_up));
  }
  FERRY_RETURN_IF_ERROR(b.s_down->Synchronize());
  return b.s_up->Synchronize();
}

absl::Status PageableRun(Device& device, Buffers& b, Direction d) {
  for (size_t t = 0; t < b.sizes.size(); ++t) {
    if (d & kDown) {
      FERRY_RETURN_IF_ERROR(device.CopyAsync(b.page_a[t].get(), b.dev_a[t].data(), b.sizes[t],
                                             CopyKind::kDeviceToHost, *b.s_down));
    }
    if (d & kUp) {
      FERRY_RETURN_IF_ERROR(device.CopyAsync(b.dev_b[t].data(), b.page_b[t].get(), b.sizes[t],
                                             CopyKind::kHostToDevice, *b.s_up));
    }
  }
  FERRY_RETURN_IF_ERROR(b.s_down->Synchronize());
  return b.s_up->Synchronize();
}

absl::Status FerryRun(Transfer& transfer, const std::vector<CopyRegion>& down,
                      const std::vector<CopyRegion>& up, Direction d) {
  std::unique_ptr<TransferBatch> down_batch, up_batch;
  if (d & kDown) {
    FERRY_ASSIGN_OR_RETURN(down_batch, transfer.DeviceToHost(down));
  }
  if (d & kUp) {
    FERRY_ASSIGN_OR_RETURN(up_batch, transfer.HostToDevice(up));
  }
  FERRY_RETURN_IF_ERROR(transfer.d2h_stream().Synchronize());
  FERRY_RETURN_IF_ERROR(transfer.h2d_stream().Synchronize());
  if (down_batch != nullptr) FERRY_RETURN_IF_ERROR(down_batch->Wait());  // done: surfaces errors
  if (up_batch != nullptr) FERRY_RETURN_IF_ERROR(up_batch->Wait());
  return absl::OkStatus();
}

struct Row {
  std::string name;
  size_t bytes = 0;
  double seconds = 0;
  double gbps() const { return GBps(bytes, seconds); }
};

// ---- the arena step ---------------------------------------------------------------------------------

// AnonHugePages of the mapping that holds `addr` (/proc/self/smaps), or -1 when not found.
long long AnonHugeBytes(const void* addr) {
  std::ifstream in("/proc/self/smaps");
  std::string line;
  const auto target = reinterpret_cast<uintptr_t>(addr);
  bool inside = false;
  while (std::getline(in, line)) {
    const size_t dash = line.find('-');
    const size_t space = line.find(' ');
    if (dash != std::string::npos && space != std::string::npos && dash < space &&
        line.find(':') > space) {  // a mapping's header line: "start-end perms ..."
      uint64_t start = 0, end = 0;
      inside = absl::SimpleHexAtoi(line.substr(0, dash), &start) &&
               absl::SimpleHexAtoi(line.substr(dash + 1, space - dash - 1), &end) &&
               target >= start && target < end;
      continue;
    }
    if (inside && line.rfind("AnonHugePages:", 0) == 0) {
      std::istringstream fields(line.substr(14));
      long long kib = 0;
      return fields >> kib ? kib * 1024 : -1;
    }
  }
  return -1;
}

struct ArenaVariant {
  std::string name;
  HugePages huge_pages;
  int prefault_threads;
};

// Times reserve + register of an arena of f.arena_gib for each variant. Returns false if the default
// variant failed.
bool ArenaStep(Device& device, const Flags& f) {
  const size_t bytes = static_cast<size_t>(f.arena_gib * kGiB);
  std::printf("\n== pinned arena: reserve + prefault + register %s (numa %s) ==\n", Bytes(bytes).c_str(),
              std::string(NumaPolicyName(f.numa)).c_str());
  if (absl::StatusOr<size_t> avail = HostMemAvailable(); avail.ok() && *avail < bytes + 512 * kMiB) {
    std::printf("  FAILED: the host has %s available, less than the arena: use a smaller --arena-gib\n",
                Bytes(*avail).c_str());
    return false;
  }
  const HugePageInfo info = ReadHugePageInfo();
  std::vector<ArenaVariant> variants = {{"default (huge pages auto, prefault auto)", f.huge_pages, -1}};
  if (f.arena_compare) {
    variants.push_back({"base pages, no prefault (registration faults)", HugePages::kOff, 0});
    variants.push_back({"base pages, prefault auto", HugePages::kOff, -1});
    variants.push_back({"thp, no prefault", HugePages::kTransparent, 0});
    variants.push_back({"thp, prefault 1 thread", HugePages::kTransparent, 1});
    variants.push_back({"thp, prefault auto", HugePages::kTransparent, -1});
    variants.push_back({"hugetlb, prefault auto", HugePages::kHugetlb, -1});
    // The first arena of a process may pay for memory the host has not backed yet (first touch in a
    // VM): the default again, last, shows whether the order mattered.
    variants.push_back({"default again", f.huge_pages, -1});
  }
  std::printf("  %-46s %-7s %7s %10s %11s %11s %10s %8s %6s\n", "setup", "pages", "threads",
              "reserve ms", "prefault ms", "register ms", "total ms", "GB/s", "huge%");
  bool default_ok = true;
  for (size_t v = 0; v < variants.size(); ++v) {
    const ArenaVariant& var = variants[v];
    if (var.huge_pages == HugePages::kHugetlb) {
      const size_t need = info.hugetlb_page_bytes > 0
                              ? (bytes + info.hugetlb_page_bytes - 1) / info.hugetlb_page_bytes
                              : 0;
      if (info.hugetlb_page_bytes == 0 || info.hugetlb_free_pages < need) {
        std::printf("  %-46s skipped: the hugetlb pool has %zu free pages of %s, needs %zu "
                    "(sysctl vm.nr_hugepages=%zu to try it)\n",
                    var.name.c_str(), info.hugetlb_free_pages,
                    Bytes(info.hugetlb_page_bytes).c_str(), need, need);
        continue;
      }
    }
    PinnedArenaOptions options;
    options.name = "arena bench";
    options.capacity_bytes = bytes;
    options.numa = f.numa;
    options.numa_node = f.numa_node;
    options.huge_pages = var.huge_pages;
    options.prefault_threads = var.prefault_threads;
    const double t0 = Now();
    absl::StatusOr<std::unique_ptr<PinnedArena>> arena = PinnedArena::Create(&device, options);
    const double wall = Now() - t0;
    if (!arena.ok()) {
      std::printf("  %-46s FAILED: %s\n", var.name.c_str(), std::string(arena.status().message()).c_str());
      if (v == 0) default_ok = false;
      continue;
    }
    const ArenaSetup& s = (*arena)->setup();
    const long long huge = AnonHugeBytes((*arena)->base());
    const std::string huge_share =
        s.pages == PageKind::kHugetlb ? "100"
        : huge < 0                    ? "?"
                                      : absl::StrFormat("%.0f", 100.0 * static_cast<double>(huge) /
                                                                    static_cast<double>((*arena)->capacity()));
    std::printf("  %-46s %-7s %7d %10.1f %11.1f %11.1f %10.1f %8.2f %6s\n", var.name.c_str(),
                std::string(PageKindName(s.pages)).c_str(), s.prefault_threads,
                1e3 * s.reserve_seconds, 1e3 * s.prefault_seconds, 1e3 * s.register_seconds, 1e3 * wall,
                GBps((*arena)->capacity(), wall), huge_share.c_str());
    if (!s.pages_note.empty()) std::printf("  %-46s   note: %s\n", "", s.pages_note.c_str());
    const double d0 = Now();
    arena->reset();
    if (v == 0) std::printf("  %-46s   (destroying it: %.1f ms)\n", "", 1e3 * (Now() - d0));
  }
  std::printf("  GB/s = arena bytes / total time; huge%% = share of the region backed by huge pages "
              "(AnonHugePages in /proc/self/smaps)\n");
  return default_ok;
}

// ---- the run ----------------------------------------------------------------------------------------

int Run(int argc, char** argv) {
  Flags f;
  bool help = false;
  if (!ParseFlags(argc, argv, f, &help)) return 2;
  if (help) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  std::vector<std::string> problems;
  auto fail = [&](const std::string& step, const absl::Status& s) {
    std::fprintf(stderr, "ferry bench transfer: %s: %s\n", step.c_str(), s.ToString().c_str());
    std::fflush(stdout);
    problems.push_back(step);
  };

  absl::StatusOr<std::unique_ptr<Device>> device_or = CreateDevice();
  if (!device_or.ok()) {
    fail("creating the device", device_or.status());
    return 1;
  }
  Device& device = **device_or;
  const HugePageInfo hp = ReadHugePageInfo();
  std::printf("ferry bench transfer on %s (%s backend)\n", device.name().c_str(),
              std::string(BackendName(device.backend())).c_str());
  std::printf("host: %u CPUs, %d NUMA node(s), THP %s, hugetlb pool %zu free of %zu pages of %s\n",
              std::thread::hardware_concurrency(), NumaNodeCount(),
              hp.thp_enabled.empty() ? "unknown" : hp.thp_enabled.c_str(), hp.hugetlb_free_pages,
              hp.hugetlb_total_pages, Bytes(hp.hugetlb_page_bytes).c_str());

  // 1. The arena's reservation + registration.
  if (f.arena_gib > 0 && !ArenaStep(device, f)) problems.push_back("arena reservation");

  // 2. The tensor set and its buffers.
  double skew = 1;
  absl::StatusOr<std::vector<size_t>> sizes =
      TensorSizes(f.tensors, f.min_bytes, f.max_bytes, static_cast<size_t>(f.total_gib * kGiB),
                  f.seed, &skew);
  if (!sizes.ok()) {
    fail("choosing tensor sizes", sizes.status());
    return 1;
  }
  {
    std::vector<size_t> sorted = *sizes;
    std::sort(sorted.begin(), sorted.end());
    size_t total = 0;
    for (size_t s : sorted) total += s;
    std::printf("\ntensors: %zu, %s each way; sizes %s .. %s, median %s (log-uniform in [%s, %s] "
                "with exponent %.2f on the uniform draw, seed %llu)\n",
                sorted.size(), Bytes(total).c_str(), Bytes(sorted.front()).c_str(),
                Bytes(sorted.back()).c_str(), Bytes(sorted[sorted.size() / 2]).c_str(),
                Bytes(f.min_bytes).c_str(), Bytes(f.max_bytes).c_str(), skew,
                static_cast<unsigned long long>(f.seed));
  }
  const double t_alloc = Now();
  absl::StatusOr<std::unique_ptr<Buffers>> buffers = Allocate(device, f, *std::move(sizes));
  if (!buffers.ok()) {
    fail("allocating buffers", buffers.status());
    return 1;
  }
  Buffers& b = **buffers;
  if (absl::Status s = Fill(device, b); !s.ok()) {
    fail("filling buffers", s);
    return 1;
  }
  std::printf("buffers: %s device, %s pinned (arena: %s pages, %d prefault threads, %.0f ms to "
              "create), %s pageable; set up in %.1f s\n",
              Bytes(4 * b.total).c_str(), Bytes(b.arena->capacity()).c_str(),
              std::string(PageKindName(b.arena->setup().pages)).c_str(),
              b.arena->setup().prefault_threads, 1e3 * b.arena->setup().total_seconds(),
              Bytes(2 * b.total).c_str(), Now() - t_alloc);
  std::printf("timing: median of %d after %d warm-up run(s); host wall clock around stream "
              "synchronization; GB/s = 1e9 bytes/s (both: bytes of both directions)\n",
              f.reps, f.warmup);

  std::vector<CopyRegion> down(b.sizes.size()), up(b.sizes.size());
  for (size_t t = 0; t < b.sizes.size(); ++t) {
    down[t] = {b.pin_a[t].data, b.dev_a[t].data(), b.sizes[t]};
    up[t] = {b.dev_b[t].data(), b.pin_b[t].data, b.sizes[t]};
  }
  std::vector<uint8_t*> pin_a_ptrs, page_a_ptrs;
  std::vector<const uint8_t*> pin_a_const, page_a_const;
  for (size_t t = 0; t < b.sizes.size(); ++t) {
    pin_a_ptrs.push_back(b.pin_a[t].as<uint8_t>());
    page_a_ptrs.push_back(b.page_a[t].get());
    pin_a_const.push_back(pin_a_ptrs.back());
    page_a_const.push_back(page_a_ptrs.back());
  }
  size_t verified = 0;
  // Poisons what `d` writes, runs the measurement, then checks what it wrote.
  auto measured = [&](const std::string& what, Direction d, bool pinned,
                      const std::function<absl::Status()>& fn) -> absl::StatusOr<double> {
    if (d & kDown) PoisonHost(pinned ? pin_a_ptrs : page_a_ptrs, b.sizes);
    if (d & kUp) FERRY_RETURN_IF_ERROR(PoisonDevice(device, b.dev_b, *b.s_up));
    FERRY_ASSIGN_OR_RETURN(const double seconds, Measure(f, fn));
    if (d & kDown) {
      FERRY_RETURN_IF_ERROR(VerifyHost(pinned ? pin_a_const : page_a_const, b.sizes, kSaltDown,
                                       f.seed, what, &verified));
    }
    if (d & kUp) {
      FERRY_RETURN_IF_ERROR(VerifyDevice(device, b.dev_b, b.sizes, kSaltUp, f.seed, what, &verified));
    }
    return seconds;
  };

  const size_t n = b.sizes.size();
  std::vector<Row> ceiling(4), pageable(4), ferry(4);  // indexed by Direction
  for (Direction d : {kDown, kUp, kBoth}) {
    const size_t bytes = d == kBoth ? 2 * b.total : b.total;
    absl::StatusOr<double> s = Measure(f, [&] { return CeilingRun(device, b, d); });
    if (!s.ok()) fail("ceiling " + DirName(d), s.status());
    ceiling[d] = {absl::StrCat("ceiling ", DirName(d), d == kBoth ? " (two streams)" : " (one copy)"),
                  bytes, s.value_or(0)};
  }
  for (Direction d : {kDown, kUp, kBoth}) {
    const size_t bytes = d == kBoth ? 2 * b.total : b.total;
    const std::string name = absl::StrCat("pageable ", DirName(d), " (", n, " copies",
                                          d == kBoth ? " each way)" : ")");
    absl::StatusOr<double> s = measured(name, d, false, [&] { return PageableRun(device, b, d); });
    if (!s.ok()) fail(name, s.status());
    pageable[d] = {name, bytes, s.value_or(0)};
  }

  const PinnedHostCounters counters_before = GetPinnedHostCounters();
  const uint64_t registrations_before = device.host_registrations();
  absl::StatusOr<std::unique_ptr<Transfer>> transfer =
      Transfer::Create(&device, TransferOptions{.chunk_bytes = f.chunk_bytes});
  if (!transfer.ok()) {
    fail("creating the Transfer", transfer.status());
    return 1;
  }
  // Warm-up: both directions at once hold the most chunk events at a time.
  if (absl::Status s = FerryRun(**transfer, down, up, kBoth); !s.ok()) {
    fail("warming up the Transfer", s);
    return 1;
  }
  const uint64_t events_after_warmup = (*transfer)->stats().events_created;
  for (Direction d : {kDown, kUp, kBoth}) {
    const size_t bytes = d == kBoth ? 2 * b.total : b.total;
    const std::string name = absl::StrCat("Ferry ", DirName(d), " (chunk ", Bytes(f.chunk_bytes), ")");
    absl::StatusOr<double> s =
        measured(name, d, true, [&] { return FerryRun(**transfer, down, up, d); });
    if (!s.ok()) fail(name, s.status());
    ferry[d] = {name, bytes, s.value_or(0)};
  }
  const TransferStats tstats = (*transfer)->stats();

  std::printf("\n== copies: %zu tensors, %s each way ==\n", n, Bytes(b.total).c_str());
  std::printf("  %-40s %9s %12s %15s\n", "measurement", "GB/s", "vs ceiling", "Ferry speedup");
  auto print_row = [&](const Row& r, const Row& ceil, const Row* base) {
    const double ratio = ceil.gbps() > 0 ? r.gbps() / ceil.gbps() : 0;
    std::string speedup;
    if (base != nullptr && base->gbps() > 0) speedup = absl::StrFormat("%.2fx", r.gbps() / base->gbps());
    std::printf("  %-40s %9.2f %11.1f%% %15s\n", r.name.c_str(), r.gbps(), 100 * ratio, speedup.c_str());
  };
  for (Direction d : {kDown, kUp, kBoth}) print_row(ceiling[d], ceiling[d], nullptr);
  for (Direction d : {kDown, kUp, kBoth}) print_row(pageable[d], ceiling[d], nullptr);
  for (Direction d : {kDown, kUp, kBoth}) print_row(ferry[d], ceiling[d], &pageable[d]);
  std::printf("  Ferry issued %.1f copies and %.1f chunk events per submission (%zu regions)\n",
              tstats.submissions > 0 ? static_cast<double>(tstats.copies) / tstats.submissions : 0,
              tstats.submissions > 0 ? static_cast<double>(tstats.chunks) / tstats.submissions : 0, n);

  auto pct = [](const Row& r, const Row& c) { return c.gbps() > 0 ? 100 * r.gbps() / c.gbps() : 0; };
  auto x = [](const Row& r, const Row& p) { return p.gbps() > 0 ? r.gbps() / p.gbps() : 0; };
  auto mark = [](bool ok) { return ok ? "met" : "MISSED"; };
  std::printf("\ntargets (reported, not asserted):\n");
  std::printf("  Ferry >= 95%% of the ceiling each way:  D2H %.1f%% %s, H2D %.1f%% %s\n",
              pct(ferry[kDown], ceiling[kDown]), mark(pct(ferry[kDown], ceiling[kDown]) >= 95),
              pct(ferry[kUp], ceiling[kUp]), mark(pct(ferry[kUp], ceiling[kUp]) >= 95));
  std::printf("  Ferry >= 90%% of the two-stream ceiling: both %.1f%% %s\n",
              pct(ferry[kBoth], ceiling[kBoth]), mark(pct(ferry[kBoth], ceiling[kBoth]) >= 90));
  std::printf("  Ferry >= 3x pageable:                  D2H %.2fx %s, H2D %.2fx %s, both %.2fx %s\n",
              x(ferry[kDown], pageable[kDown]), mark(x(ferry[kDown], pageable[kDown]) >= 3),
              x(ferry[kUp], pageable[kUp]), mark(x(ferry[kUp], pageable[kUp]) >= 3),
              x(ferry[kBoth], pageable[kBoth]), mark(x(ferry[kBoth], pageable[kBoth]) >= 3));

  // 3. The chunk size sweep.
  if (!f.sweep.empty()) {
    std::printf("\n== chunk size sweep: Ferry on the same tensors ==\n");
    std::printf("  %-10s %9s %9s %9s %10s %9s\n", "chunk", "D2H GB/s", "H2D GB/s", "both GB/s",
                "copies", "chunks");
    double best[4] = {0, 0, 0, 0};
    size_t best_chunk[4] = {0, 0, 0, 0};
    for (size_t chunk : f.sweep) {
      absl::StatusOr<std::unique_ptr<Transfer>> t =
          Transfer::Create(&device, TransferOptions{.chunk_bytes = chunk});
      if (!t.ok()) {
        fail(absl::StrCat("creating a Transfer with chunk ", chunk), t.status());
        continue;
      }
      double gbps[4] = {0, 0, 0, 0};
      for (Direction d : {kDown, kUp, kBoth}) {
        const size_t bytes = d == kBoth ? 2 * b.total : b.total;
        const std::string name = absl::StrCat("sweep ", DirName(d), " chunk ", Bytes(chunk));
        // Checked once per chunk size, on the both-at-once runs.
        absl::StatusOr<double> s =
            d == kBoth ? measured(name, d, true, [&] { return FerryRun(**t, down, up, d); })
                       : Measure(f, [&] { return FerryRun(**t, down, up, d); });
        if (!s.ok()) {
          fail(name, s.status());
          continue;
        }
        gbps[d] = GBps(bytes, *s);
        if (gbps[d] > best[d]) {
          best[d] = gbps[d];
          best_chunk[d] = chunk;
        }
      }
      const TransferStats st = (*t)->stats();
      std::printf("  %-10s %9.2f %9.2f %9.2f %10.1f %9.1f\n", Bytes(chunk).c_str(), gbps[kDown],
                  gbps[kUp], gbps[kBoth],
                  st.submissions > 0 ? static_cast<double>(st.copies) / st.submissions : 0,
                  st.submissions > 0 ? static_cast<double>(st.chunks) / st.submissions : 0);
    }
    std::printf("  best: D2H %s, H2D %s, both %s (copies, chunks: per submission)\n",
                Bytes(best_chunk[kDown]).c_str(), Bytes(best_chunk[kUp]).c_str(),
                Bytes(best_chunk[kBoth]).c_str());
  }

  // 4. Nothing pinned, registered or created on the copy path.
  const PinnedHostCounters counters_after = GetPinnedHostCounters();
  const uint64_t pin_calls = counters_after.calls() - counters_before.calls();
  const uint64_t registrations = device.host_registrations() - registrations_before;
  const uint64_t new_events = tstats.events_created - events_after_warmup;
  std::printf("\nhot path: %llu pin/register/host-alloc calls and %llu device registrations during "
              "the Transfer runs, %llu chunk events created after its warm-up%s\n",
              static_cast<unsigned long long>(pin_calls),
              static_cast<unsigned long long>(registrations),
              static_cast<unsigned long long>(new_events),
              pin_calls == 0 && registrations == 0 && new_events == 0 ? " (as it should be)" : "");
  if (pin_calls != 0 || registrations != 0 || new_events != 0) {
    problems.push_back("the copy path pinned, registered or created something after warm-up");
  }
  std::printf("verified: %s of sampled bytes (start, end and one window of every tensor, after every "
              "measurement that wrote them)\n",
              Bytes(verified).c_str());
  transfer->reset();

  if (!problems.empty()) {
    std::printf("\nFAILED: %zu problem(s): ", problems.size());
    for (size_t i = 0; i < problems.size(); ++i) std::printf("%s%s", i ? "; " : "", problems[i].c_str());
    std::printf("\n");
    return 1;
  }
  std::printf("\nOK\n");
  return 0;
}

}  // namespace

FERRY_BENCH(transfer,
            "pinned arena + Transfer vs pageable per-tensor copies and the pinned ceiling; arena setup",
            Run);

}  // namespace ferry::bench
