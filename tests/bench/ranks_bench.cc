// `ferry bench ranks`: several ranks on one host, each with its own engine and a shard of the same
// global bf16 params, fully offloaded, against one rank holding all of them, in the same run:
//   - step: aggregate throughput (params per second over all ranks) / one rank's;
//   - checkpoint: every rank saving its shard (synchronously, then asynchronously): aggregate write
//     GB/s / the write ceiling (large writes + fsync of one file as big as the checkpoint, same file
//     system), and how long each rank's SaveCheckpoint blocked for an asynchronous save.
// Ranks are threads of this process with thread comms (--ranks N), or, under mpirun, the processes
// of MPI_COMM_WORLD (--mpi; rank 0 prints). Each rank gets its share of the CPU threads.
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/thread_pool.h"
#include "bench/bench.h"
#include "device/device.h"
#include "ferry/comm.h"
#include "ferry/engine.h"
#include "ferry/status.h"

namespace ferry::bench {
namespace {

struct Options {
  int64_t params = 1'000'000'000;
  int tensors = 64;
  int ranks = 4;
  int steps = 5;
  bool mpi = false;
  std::string dir = "/tmp/ferry-bench-ranks-" + std::to_string(::getpid());
  bool ckpt = true;
};

// One rank: its engine over its shard [begin, end) of each of `sizes`' tensors.
struct RankRun {
  std::unique_ptr<Device> device;
  std::vector<DeviceBuffer> params, grads;
  std::unique_ptr<Engine> engine;
  int64_t local = 0;
};

absl::StatusOr<std::unique_ptr<RankRun>> MakeRank(const Options& o, const std::vector<int64_t>& sizes, int rank,
                                                  int world, std::shared_ptr<Comm> comm, const std::string& policy) {
  auto r = std::make_unique<RankRun>();
  FERRY_ASSIGN_OR_RETURN(r->device, CreateDevice({}));
  EngineOptions eo;
  eo.policy_path = policy;
  eo.device = std::string(BackendName(r->device->backend()));
  eo.cpu_threads = std::max<size_t>(1, ThreadPool::DefaultThreads() / static_cast<size_t>(world));
  eo.rank = rank;
  eo.world_size = world;
  eo.comm = std::move(comm);
  FERRY_ASSIGN_OR_RETURN(r->engine, Engine::Create(eo));
  std::vector<uint16_t> fill(1 << 20, F32ToBF16(0.001f));
  for (size_t i = 0; i < sizes.size(); ++i) {
    const int64_t begin = sizes[i] * rank / world, end = sizes[i] * (rank + 1) / world;
    const size_t bytes = static_cast<size_t>(end - begin) * 2;
    FERRY_ASSIGN_OR_RETURN(DeviceBuffer p, r->device->Allocate(bytes));
    FERRY_ASSIGN_OR_RETURN(DeviceBuffer g, r->device->Allocate(bytes));
    for (size_t at = 0; at < bytes; at += fill.size() * 2) {
      const size_t n = std::min(bytes - at, fill.size() * 2);
      FERRY_RETURN_IF_ERROR(r->device->Copy(p.as<char>() + at, fill.data(), n, CopyKind::kHostToDevice));
      FERRY_RETURN_IF_ERROR(r->device->Copy(g.as<char>() + at, fill.data(), n, CopyKind::kHostToDevice));
    }
    ParamSpec spec;
    spec.name = "t" + std::to_string(i);
    spec.shape = {sizes[i]};
    spec.param = bytes > 0 ? p.data() : nullptr;
    spec.grad = bytes > 0 ? g.data() : nullptr;
    spec.shard_begin = begin;
    spec.shard_end = end;
    FERRY_RETURN_IF_ERROR(r->engine->AddParam(spec));
    r->local += end - begin;
    r->params.push_back(std::move(p));
    r->grads.push_back(std::move(g));
  }
  FERRY_RETURN_IF_ERROR(r->engine->Finalize());
  return r;
}

struct Figures {
  double step = 0;        // median seconds of one step (slowest rank)
  double sync_save = 0;   // seconds
  double async_blocked_max = 0;
  double async_commit = 0;
  int64_t ckpt_bytes = 0;
};

// The whole measurement on one rank; collectives keep the ranks in step.
absl::Status RunRank(const Options& o, const std::vector<int64_t>& sizes, int rank, int world,
                     std::shared_ptr<Comm> comm, const std::string& policy, const std::string& async_policy,
                     Figures* out) {
  Comm* c = comm.get();
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<RankRun> r, MakeRank(o, sizes, rank, world, comm, policy));
  std::vector<double> samples;
  for (int s = 0; s <= o.steps; ++s) {
    FERRY_RETURN_IF_ERROR(c->Barrier(absl::Minutes(5)));
    const double t0 = Now();
    FERRY_RETURN_IF_ERROR(r->engine->Step({.check_finite = true}));
    FERRY_RETURN_IF_ERROR(r->engine->Synchronize());
    std::vector<double> t = {Now() - t0};
    FERRY_RETURN_IF_ERROR(c->AllReduce(absl::MakeSpan(t), ReduceOp::kMax, absl::Minutes(5)));
    if (s > 0) samples.push_back(t[0]);  // the first is the warm-up
  }
  out->step = Median(samples);
  if (!o.ckpt) return absl::OkStatus();
  const std::string root = absl::StrCat(o.dir, "/w", world);
  if (rank == 0) std::filesystem::remove_all(root);
  // Each engine's first save allocates and registers its pinned staging (kept across saves): a
  // warm-up, as in `ferry bench ckpt`; the second save is measured.
  FERRY_RETURN_IF_ERROR(r->engine->SaveCheckpoint(root, 1).status());
  FERRY_RETURN_IF_ERROR(c->Barrier(absl::Minutes(5)));
  double t0 = Now();
  FERRY_RETURN_IF_ERROR(r->engine->SaveCheckpoint(root, 2).status());
  out->sync_save = Now() - t0;
  // Asynchronous: a second engine over the same tensors with a policy that saves asynchronously.
  r->engine.reset();
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<RankRun> a, MakeRank(o, sizes, rank, world, comm, async_policy));
  FERRY_RETURN_IF_ERROR(a->engine->Step({}));
  FERRY_RETURN_IF_ERROR(a->engine->SaveCheckpoint(root, 3).status());  // warm-up
  FERRY_RETURN_IF_ERROR(a->engine->WaitCheckpoint());
  FERRY_RETURN_IF_ERROR(a->engine->Step({}));
  FERRY_RETURN_IF_ERROR(a->engine->Synchronize());
  FERRY_RETURN_IF_ERROR(c->Barrier(absl::Minutes(5)));
  t0 = Now();
  FERRY_RETURN_IF_ERROR(a->engine->SaveCheckpoint(root, 4).status());
  std::vector<double> blocked = {Now() - t0};
  FERRY_RETURN_IF_ERROR(a->engine->WaitCheckpoint());
  std::vector<double> commit = {Now() - t0};
  FERRY_RETURN_IF_ERROR(c->AllReduce(absl::MakeSpan(blocked), ReduceOp::kMax, absl::Minutes(5)));
  FERRY_RETURN_IF_ERROR(c->AllReduce(absl::MakeSpan(commit), ReduceOp::kMax, absl::Minutes(5)));
  out->async_blocked_max = blocked[0];
  out->async_commit = commit[0];
  std::vector<double> bytes = {static_cast<double>(a->local) * (2 + 12)};
  FERRY_RETURN_IF_ERROR(c->AllReduce(absl::MakeSpan(bytes), ReduceOp::kSum, absl::Minutes(5)));
  out->ckpt_bytes = static_cast<int64_t>(bytes[0]);
  return absl::OkStatus();
}

// Large writes + fsync of one file of `bytes`: GB/s.
absl::StatusOr<double> WriteCeiling(const std::string& dir, int64_t bytes) {
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/ceiling.bin";
  const int fd = ::open(path.c_str(), O_CREAT | O_TRUNC | O_WRONLY, 0644);
  if (fd < 0) return absl::InternalError(absl::StrCat("open ", path, ": ", std::strerror(errno)));
  std::vector<char> buf(size_t{64} << 20, 1);
  const double t0 = Now();
  for (int64_t at = 0; at < bytes; at += static_cast<int64_t>(buf.size())) {
    const size_t n = static_cast<size_t>(std::min<int64_t>(bytes - at, static_cast<int64_t>(buf.size())));
    if (::write(fd, buf.data(), n) != static_cast<ssize_t>(n)) {
      ::close(fd);
      return absl::InternalError(absl::StrCat("write ", path, ": ", std::strerror(errno)));
    }
  }
  ::fsync(fd);
  const double secs = Now() - t0;
  ::close(fd);
  std::filesystem::remove(path);
  return static_cast<double>(bytes) / secs / 1e9;
}

int RunRanks(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* flag) -> const char* {
      const std::string f = std::string(flag) + "=";
      return a.rfind(f, 0) == 0 ? argv[i] + f.size() : nullptr;
    };
    if (const char* v = value("--params")) {
      double d = 0;
      if (!absl::SimpleAtod(v, &d)) return 2;
      o.params = static_cast<int64_t>(d);
    } else if (const char* v2 = value("--ranks")) {
      if (!absl::SimpleAtoi(v2, &o.ranks)) return 2;
    } else if (const char* v3 = value("--steps")) {
      if (!absl::SimpleAtoi(v3, &o.steps)) return 2;
    } else if (const char* v4 = value("--dir")) {
      o.dir = v4;
    } else if (a == "--quick") {  // a smoke run: small, any backend
      o.params = 2'000'000;
      o.tensors = 8;
      o.ranks = 2;
      o.steps = 2;
    } else if (a == "--mpi") {
      o.mpi = true;
    } else if (a == "--no-ckpt") {
      o.ckpt = false;
    } else {
      std::fprintf(stderr,
                   "usage: ferry bench ranks [--params=1e9] [--ranks=4] [--steps=5] [--dir=/tmp/ferry-bench-ranks-PID] "
                   "[--no-ckpt] [--mpi] [--quick]\n");
      return a == "--help" ? 0 : 2;
    }
  }
  const std::string policy = std::string(FERRY_SOURCE_DIR) + "/scripts/policies/offload_all.lua";
  const std::string async_policy = o.dir + "/async_offload_all.lua";
  std::filesystem::create_directories(o.dir);
  {
    FILE* f = std::fopen(async_policy.c_str(), "w");
    if (f == nullptr) return 1;
    std::fputs("return { place = function(groups, ctx) local out = {} for _, g in ipairs(groups) do out[g.name] = "
               "'cpu' end return out end, checkpoint = function(info, ctx) return { async = true } end }\n", f);
    std::fclose(f);
  }
  std::vector<int64_t> sizes;
  for (int i = 0; i < o.tensors; ++i) sizes.push_back(o.params / o.tensors);

  auto run_world = [&](int world, Figures* fig) -> absl::Status {
    if (o.mpi) {
      FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Comm> c, MakeMpiComm());
      std::shared_ptr<Comm> comm(std::move(c));
      return RunRank(o, sizes, comm->rank(), comm->world_size(), comm, policy, async_policy, fig);
    }
    std::vector<std::unique_ptr<Comm>> comms = MakeThreadComms(world);
    std::vector<absl::Status> st(static_cast<size_t>(world));
    std::vector<Figures> figs(static_cast<size_t>(world));
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r) {
      threads.emplace_back([&, r] {
        st[static_cast<size_t>(r)] = RunRank(o, sizes, r, world, std::shared_ptr<Comm>(std::move(comms[static_cast<size_t>(r)])),
                                             policy, async_policy, &figs[static_cast<size_t>(r)]);
      });
    }
    for (std::thread& t : threads) t.join();
    for (const absl::Status& s : st) FERRY_RETURN_IF_ERROR(s);
    *fig = figs[0];
    return absl::OkStatus();
  };
  if (o.mpi) {
    // One rank holding everything cannot be measured inside an MPI job of N: run `ferry bench ranks
    // --ranks=1` beside it for that figure.
    Figures f;
    absl::Status s = run_world(0, &f);
    if (!s.ok()) {
      std::fprintf(stderr, "ferry bench ranks: %s\n", std::string(s.message()).c_str());
      return 1;
    }
    std::printf("%lld params over the MPI ranks, offloaded: step %.1f ms = %.2f G params/s aggregate\n",
                static_cast<long long>(o.params), f.step * 1e3, static_cast<double>(o.params) / f.step / 1e9);
    return 0;
  }
  Figures one, many;
  absl::Status s = run_world(1, &one);
  if (s.ok()) s = run_world(o.ranks, &many);
  if (!s.ok()) {
    std::fprintf(stderr, "ferry bench ranks: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  std::printf("ferry bench ranks: %lld bf16 params in %d tensors, fully offloaded, %s\n",
              static_cast<long long>(o.params), o.tensors, (*CreateDevice({}))->name().c_str());
  std::printf("  one rank, all params        step %8.1f ms  %6.2f G params/s\n", one.step * 1e3,
              static_cast<double>(o.params) / one.step / 1e9);
  std::printf("  %d ranks, a shard each       step %8.1f ms  %6.2f G params/s aggregate = %.3f of one rank (target >= 0.90)\n",
              o.ranks, many.step * 1e3, static_cast<double>(o.params) / many.step / 1e9, one.step / many.step);
  if (o.ckpt) {
    absl::StatusOr<double> ceiling = WriteCeiling(o.dir, many.ckpt_bytes);
    const double gbs = static_cast<double>(many.ckpt_bytes) / many.sync_save / 1e9;
    std::printf("  checkpoint of %.2f GB by %d ranks:\n", static_cast<double>(many.ckpt_bytes) / 1e9, o.ranks);
    std::printf("    write ceiling (one file, large writes + fsync)  %6.2f GB/s\n", ceiling.ok() ? *ceiling : 0.0);
    std::printf("    sync save    %8.1f ms  %6.2f GB/s aggregate = %.2f of the write ceiling (target >= 0.90)\n",
                many.sync_save * 1e3, gbs, ceiling.ok() ? gbs / *ceiling : 0.0);
    std::printf("    async save   blocked %.2f ms on the slowest rank (target <= 10 ms); committed after %.1f ms\n",
                many.async_blocked_max * 1e3, many.async_commit * 1e3);
  }
  std::filesystem::remove_all(o.dir);
  return 0;
}

}  // namespace

FERRY_BENCH(ranks, "N ranks with a shard each vs one rank: step throughput, checkpoint write, async blocked time",
            RunRanks);

}  // namespace ferry::bench
