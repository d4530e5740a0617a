// `ferry bench ckpt`: checkpoints of a few GiB of optimizer state (bf16 params, fp32 masters and
// Adam moments; half the groups on the GPU, half offloaded to pinned host memory) through the
// Engine API, next to the ceilings measured in the same run on the same file system:
//   - sequential write bandwidth (large writes + fsync of one file as big as the checkpoint),
//   - sequential read bandwidth (O_DIRECT reads of that file, or buffered reads after dropping it
//     from the page cache when O_DIRECT is refused),
//   - the D2H rate into pinned memory (the floor of the blocked time for device-resident state).
// Reports a synchronous save, an asynchronous save (time the trainer is blocked, the extra time of
// the step that follows at once, time to commit)
// and a load (after the checkpoint's pages are dropped from the page cache with
// posix_fadvise(DONTNEED), so it is read from the disk), each as GB/s and as a ratio to its ceiling.
#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/bench.h"
#include "ckpt/checkpoint.h"
#include "device/device.h"
#include "ferry/engine.h"
#include "ferry/status.h"

namespace ferry::bench {
namespace {

struct Options {
  int64_t params = 250'000'000;  // 14 B of state each: ~3.5 GB
  int tensors = 64;
  int reps = 3;
  std::string dir;  // default: a fresh directory under $TMPDIR (or /tmp)
  bool keep = false;
};

// Offloads every other group; checkpoints as ctx.args.async says, keeping only the newest.
constexpr char kPolicy[] = R"(
return {
  place = function(groups, ctx)
    local out = {}
    for i, g in ipairs(groups) do out[g.name] = (i % 2 == 1) and "cpu" or "gpu" end
    return out
  end,
  checkpoint = function(info, ctx) return { async = ctx.args.async == "1", keep_last = 1 } end,
}
)";

constexpr size_t kIoBytes = size_t{64} << 20;

void Fail(const absl::Status& s) {
  std::fprintf(stderr, "ferry bench ckpt: %s\n", std::string(s.ToString()).c_str());
}

struct AlignedBuffer {
  // aligned_alloc requires a size that is a multiple of the alignment.
  explicit AlignedBuffer(size_t n)
      : data(static_cast<char*>(std::aligned_alloc(4096, (n + 4095) / 4096 * 4096))), size(n) {}
  ~AlignedBuffer() { std::free(data); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  char* data;
  size_t size;
};

// Drops the (clean) pages of `path` from the page cache.
void DropFromCache(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

void DropTreeFromCache(const std::string& dir) {
  std::error_code ec;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir, ec)) {
    if (e.is_regular_file()) DropFromCache(e.path().string());
  }
}

// Sequential write of `bytes` in large writes, then fsync: GB/s.
absl::StatusOr<double> MeasureWrite(const std::string& path, uint64_t bytes, const AlignedBuffer& buf) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return absl::InternalError(absl::StrCat("open ", path, ": ", std::strerror(errno)));
  const double t0 = Now();
  for (uint64_t done = 0; done < bytes;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size, bytes - done));
    ssize_t w = ::write(fd, buf.data, n);
    if (w <= 0) {
      ::close(fd);
      return absl::InternalError(absl::StrCat("write ", path, ": ", std::strerror(errno)));
    }
    done += static_cast<uint64_t>(w);
  }
  if (::fsync(fd) != 0) {
    ::close(fd);
    return absl::InternalError(absl::StrCat("fsync ", path, ": ", std::strerror(errno)));
  }
  const double t = Now() - t0;
  ::close(fd);
  return static_cast<double>(bytes) / t / 1e9;
}

// Sequential read of the whole file: O_DIRECT when the file system allows it, else buffered after
// dropping the file from the page cache. GB/s; *direct says which.
absl::StatusOr<double> MeasureRead(const std::string& path, const AlignedBuffer& buf, bool* direct) {
  DropFromCache(path);
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
  *direct = fd >= 0;
  if (fd < 0) fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::InternalError(absl::StrCat("open ", path, ": ", std::strerror(errno)));
  uint64_t total = 0;
  const double t0 = Now();
  while (true) {
    ssize_t r = ::read(fd, buf.data, buf.size);
    if (r < 0 && *direct && total == 0) {  // O_DIRECT refused at read time: buffered instead
      ::close(fd);
      *direct = false;
      DropFromCache(path);
      fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) return absl::InternalError(absl::StrCat("open ", path, ": ", std::strerror(errno)));
      continue;
    }
    if (r < 0) {
      ::close(fd);
      return absl::InternalError(absl::StrCat("read ", path, ": ", std::strerror(errno)));
    }
    if (r == 0) break;
    total += static_cast<uint64_t>(r);
  }
  const double t = Now() - t0;
  ::close(fd);
  return static_cast<double>(total) / t / 1e9;
}

struct Model {
  std::vector<int64_t> sizes;
  std::vector<DeviceBuffer> params, grads;
};

absl::StatusOr<Model> MakeModel(Device& device, const Options& o) {
  Model m;
  std::mt19937_64 rng(11);
  std::vector<uint16_t> fill(1 << 20);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  for (auto& v : fill) v = F32ToBF16(normal(rng));
  const int64_t each = std::max<int64_t>(1, o.params / o.tensors);
  for (int i = 0; i < o.tensors; ++i) {
    const int64_t n = each + (i % 3);  // uneven sizes
    m.sizes.push_back(n);
    for (auto* list : {&m.params, &m.grads}) {
      FERRY_ASSIGN_OR_RETURN(DeviceBuffer b, FilledBuffer16(device, n, fill));
      list->push_back(std::move(b));
    }
  }
  return m;
}

uint64_t TreeBytes(const std::string& dir) {
  uint64_t n = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir, ec)) {
    if (e.is_regular_file()) n += e.file_size();
  }
  return n;
}

int RunBench(const Options& o) {
  absl::StatusOr<std::unique_ptr<Device>> device = CreateDevice();
  if (!device.ok()) return Fail(device.status()), 1;
  std::string dir = o.dir;
  if (dir.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    std::string tmpl = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/ferry-bench-ckpt-XXXXXX");
    if (::mkdtemp(tmpl.data()) == nullptr) return Fail(absl::InternalError("mkdtemp failed")), 1;
    dir = tmpl;
  } else {
    std::filesystem::create_directories(dir);
  }
  const std::string policy = dir + "/policy.lua";
  std::ofstream(policy) << kPolicy;
  struct Cleanup {
    std::string dir;
    bool keep;
    ~Cleanup() {
      std::error_code ec;
      if (!keep) std::filesystem::remove_all(dir, ec);
    }
  } cleanup{dir, o.keep};

  absl::StatusOr<Model> model = MakeModel(**device, o);
  if (!model.ok()) return Fail(model.status()), 1;
  EngineOptions eo;
  eo.policy_path = policy;
  eo.policy_args = {{"async", "0"}};
  eo.device = std::string(BackendName((*device)->backend()));
  absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(eo);
  if (!engine.ok()) return Fail(engine.status()), 1;
  Engine& e = **engine;
  auto register_model = [&](Engine& target) -> absl::Status {
    for (size_t i = 0; i < model->sizes.size(); ++i) {
      FERRY_RETURN_IF_ERROR(target.AddParam({.name = absl::StrCat("t", i), .group = absl::StrCat("g", i),
                                             .shape = {model->sizes[i]}, .dtype = DType::kBF16,
                                             .param = model->params[i].data(), .grad = model->grads[i].data()}));
    }
    return target.Finalize();
  };
  if (absl::Status s = register_model(e); !s.ok()) return Fail(s), 1;
  if (absl::Status s = e.Step(); !s.ok()) return Fail(s), 1;  // non-zero moments
  if (absl::Status s = e.Synchronize(); !s.ok()) return Fail(s), 1;
  int64_t gpu_numel = 0, cpu_numel = 0;
  for (const GroupPlacement& g : e.Placement()) (g.offloaded ? cpu_numel : gpu_numel) += g.numel;
  const double state_bytes = 14.0 * static_cast<double>(gpu_numel + cpu_numel);
  // Device-resident bytes copied to the host per save: the GPU groups' params and fp32 state, and
  // the offloaded groups' params (their state is already on the host).
  const double d2h_bytes = 14.0 * static_cast<double>(gpu_numel) + 2.0 * static_cast<double>(cpu_numel);
  std::printf("ferry bench ckpt on %s: %lld bf16 params in %d tensors (%lld on the GPU, %lld offloaded), "
              "%.2f GB of state, in %s\n",
              e.DeviceName().c_str(), static_cast<long long>(gpu_numel + cpu_numel), o.tensors,
              static_cast<long long>(gpu_numel), static_cast<long long>(cpu_numel), state_bytes / 1e9, dir.c_str());

  // Ceilings.
  AlignedBuffer io(kIoBytes);
  std::memset(io.data, 0x5a, io.size);
  const std::string probe = dir + "/probe.bin";
  absl::StatusOr<double> write_bw = MeasureWrite(probe, static_cast<uint64_t>(state_bytes), io);
  if (!write_bw.ok()) return Fail(write_bw.status()), 1;
  bool direct = false;
  absl::StatusOr<double> read_bw = MeasureRead(probe, io, &direct);
  if (!read_bw.ok()) return Fail(read_bw.status()), 1;
  std::filesystem::remove(probe);
  double d2h_bw = 0;
  {
    const size_t n = std::min<size_t>(static_cast<size_t>(model->sizes[1]) * 2, size_t{1} << 30);
    AlignedBuffer host(std::max<size_t>(n, 4096));
    absl::Status s = (*device)->RegisterHost(host.data, host.size);
    if (!s.ok()) return Fail(s), 1;
    std::vector<double> t;
    for (int r = 0; r < 3; ++r) {
      const double t0 = Now();
      s = (*device)->Copy(host.data, model->params[1].data(), n, CopyKind::kDeviceToHost);
      t.push_back(Now() - t0);
      if (!s.ok()) break;
    }
    absl::Status u = (*device)->UnregisterHost(host.data);
    if (!s.ok() || !u.ok()) return Fail(s.ok() ? u : s), 1;
    d2h_bw = static_cast<double>(n) / Median(t) / 1e9;
  }
  std::printf("\nceilings\n  sequential write + fsync   %8.2f GB/s\n  sequential read (%s) %8.2f GB/s\n"
              "  D2H into pinned memory     %8.2f GB/s\n",
              *write_bw, direct ? "O_DIRECT" : "buffered", *read_bw, d2h_bw);

  // A step without a save in flight, for the cost of the step that follows an asynchronous save.
  std::vector<double> plain_step_t;
  for (int r = 0; r < 3; ++r) {
    const double t0 = Now();
    if (absl::Status s = e.Step(); !s.ok()) return Fail(s), 1;
    if (absl::Status s = e.Synchronize(); !s.ok()) return Fail(s), 1;
    plain_step_t.push_back(Now() - t0);
  }
  const std::string root = dir + "/ckpt";
  int64_t step = 0;
  std::vector<double> sync_t, blocked_t, next_step_t, commit_t, load_t;
  uint64_t copied_aside = 0;  // by the step after the last async save
  uint64_t ckpt_bytes = 0;
  for (int r = 0; r < o.reps; ++r) {
    // Synchronous.
    if (absl::Status s = e.ReloadPolicy(policy, {{"async", "0"}}); !s.ok()) return Fail(s), 1;
    double t0 = Now();
    absl::StatusOr<std::string> d = e.SaveCheckpoint(root, ++step);
    sync_t.push_back(Now() - t0);
    if (!d.ok()) return Fail(d.status()), 1;
    ckpt_bytes = TreeBytes(*d);
    // Asynchronous: blocked until the call returns; committed when WaitCheckpoint returns.
    if (absl::Status s = e.ReloadPolicy(policy, {{"async", "1"}}); !s.ok()) return Fail(s), 1;
    const uint64_t copied_before = e.Stats().checkpoint_copied_aside_bytes;
    t0 = Now();
    d = e.SaveCheckpoint(root, ++step);
    blocked_t.push_back(Now() - t0);
    if (!d.ok()) return Fail(d.status()), 1;
    // The trainer steps on at once: its CPU updates wait for the params not yet written.
    const double t1 = Now();
    if (absl::Status s = e.Step(); !s.ok()) return Fail(s), 1;
    if (absl::Status s = e.Synchronize(); !s.ok()) return Fail(s), 1;
    next_step_t.push_back(Now() - t1);
    copied_aside = e.Stats().checkpoint_copied_aside_bytes - copied_before;
    if (absl::Status s = e.WaitCheckpoint(); !s.ok()) return Fail(s), 1;
    commit_t.push_back(Now() - t0);
    // Load, from the disk.
    DropTreeFromCache(root);
    t0 = Now();
    if (absl::Status s = e.LoadCheckpoint(root); !s.ok()) return Fail(s), 1;
    load_t.push_back(Now() - t0);
  }
  // A resume in a fresh process: a new engine, whose load allocates and registers its staging while
  // the reads run.
  engine->reset();
  double fresh_load_s = 0;
  {
    absl::StatusOr<std::unique_ptr<Engine>> fresh = Engine::Create(eo);
    if (!fresh.ok()) return Fail(fresh.status()), 1;
    if (absl::Status s = register_model(**fresh); !s.ok()) return Fail(s), 1;
    DropTreeFromCache(root);
    const double t0 = Now();
    if (absl::Status s = (*fresh)->LoadCheckpoint(root); !s.ok()) return Fail(s), 1;
    fresh_load_s = Now() - t0;
  }
  const double gb = static_cast<double>(ckpt_bytes) / 1e9;
  const double sync_s = Median(sync_t), blocked_s = Median(blocked_t), commit_s = Median(commit_t),
               load_s = Median(load_t);
  const double d2h_floor = d2h_bytes / (d2h_bw * 1e9);
  std::printf("\ncheckpoint: %.2f GB on disk, median of %d\n", gb, o.reps);
  std::printf("  sync save                  %8.1f ms  %7.2f GB/s  = %.2f of write ceiling (target >= 0.90)\n",
              sync_s * 1e3, gb / sync_s, gb / sync_s / *write_bw);
  std::printf("  async save: blocked        %8.1f ms  = %.3f of sync (target <= 0.10)\n", blocked_s * 1e3,
              blocked_s / sync_s);
  std::printf("              D2H floor      %8.1f ms  (%.2f GB device-resident at the pinned rate); blocked / floor %.2f\n",
              d2h_floor * 1e3, d2h_bytes / 1e9, blocked_s / d2h_floor);
  const double next_s = Median(next_step_t), plain_s = Median(plain_step_t);
  std::printf("              next step      %8.1f ms  (%.1f ms without a save in flight): %.1f ms more, "
              "blocked + that = %.3f of sync\n",
              next_s * 1e3, plain_s * 1e3, (next_s - plain_s) * 1e3,
              (blocked_s + std::max(0.0, next_s - plain_s)) / sync_s);
  std::printf("                             it copied aside %.2f GB of offloaded state the writer had not reached "
              "(last run)\n", static_cast<double>(copied_aside) / 1e9);
  std::printf("              to commit      %8.1f ms  %7.2f GB/s  = %.2f of write ceiling (one step ran meanwhile)\n",
              commit_s * 1e3, gb / commit_s, gb / commit_s / *write_bw);
  std::printf("  load (page cache dropped)  %8.1f ms  %7.2f GB/s  = %.2f of read ceiling (target >= 0.90)\n",
              load_s * 1e3, gb / load_s, gb / load_s / *read_bw);
  std::printf("  load into a fresh engine   %8.1f ms  %7.2f GB/s  = %.2f of read ceiling (staging allocated and pinned meanwhile)\n",
              fresh_load_s * 1e3, gb / fresh_load_s, gb / fresh_load_s / *read_bw);
  std::printf("\nnote: an async save copies the device-resident tensors into cached pinned staging in stream\n"
              "      order (the trainer does not wait for them) and writes the offloaded state straight\n"
              "      from the arena; a step that overtakes the writer copies aside the state it is about to\n"
              "      update (copy-on-write) and never waits for the disk.\n");
  return 0;
}

int Run(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&](const char* flag) -> const char* {
      const size_t n = std::strlen(flag);
      if (a.compare(0, n, flag) == 0 && a.size() > n && a[n] == '=') return argv[i] + n + 1;
      return nullptr;
    };
    if (a == "--help") {
      std::puts("usage: ferry bench ckpt [--quick] [--params=N] [--tensors=N] [--reps=N] [--dir=PATH] [--keep]\n"
                "  --dir: where to write (default: a fresh directory under $TMPDIR); put it on the disk to measure");
      return 0;
    } else if (a == "--quick") {
      o.params = 2'000'000;
      o.tensors = 12;
      o.reps = 1;
    } else if (a == "--keep") {
      o.keep = true;
    } else if (const char* v = value("--params")) {
      o.params = std::atoll(v);
    } else if (const char* v2 = value("--tensors")) {
      o.tensors = std::atoi(v2);
    } else if (const char* v3 = value("--reps")) {
      o.reps = std::atoi(v3);
    } else if (const char* v4 = value("--dir")) {
      o.dir = v4;
    } else {
      std::fprintf(stderr, "ferry bench ckpt: unknown argument '%s' (--help)\n", a.c_str());
      return 2;
    }
  }
  if (o.params < 1 || o.tensors < 2 || o.reps < 1) {
    std::fprintf(stderr, "ferry bench ckpt: --params, --reps must be >= 1 and --tensors >= 2\n");
    return 2;
  }
  return RunBench(o);
}

}  // namespace

FERRY_BENCH(ckpt, "checkpoint save (sync, async blocked time) and load vs the disk's bandwidth", Run);

}  // namespace ferry::bench
