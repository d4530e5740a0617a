// `ferry bench step`: one optimizer step of ~1B bf16 params in ~200 tensors, fully offloaded and with
// half the groups offloaded, against each stage of the pipeline timed alone (D2H of grads, CPU Adam,
// H2D of params, GPU Adam) on the same data; then fully offloaded with fp32 and with bf16 moments side
// by side (step, CPU Adam, host memory per param). Reports the step time, the stages, their sum and the
// overlap efficiency = slowest stage / step time (1.0 = the step costs no more than its slowest stage).
// --streamed=SHARE,...: the offloaded step of part of the params beside a GPU Adam that streams the
// rest's host-resident state through the device (bench/streamed_adam.h), against the fully offloaded step.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/thread_pool.h"
#include "bench/bench.h"
#include "bench/streamed_adam.h"
#include "device/device.h"
#include "ferry/engine.h"
#include "ferry/status.h"
#include "memory/pinned_arena.h"
#include "optim/cpu_adam.h"
#include "transfer/transfer.h"

namespace ferry::bench {
namespace {

struct Options {
  int64_t params = 1'000'000'000;
  int tensors = 200;
  int steps = 5;
  size_t chunk_bytes = size_t{8} << 20;
  // --streamed: elements per streamed piece (0: as many as a grad chunk holds) and pieces in flight.
  int64_t streamed_piece = 0;
  size_t streamed_slots = 4;
  size_t cpu_threads = 0;  // EngineOptions::cpu_threads and CPU Adam alone's workers (0: the defaults)
};

struct Tensors {
  std::vector<int64_t> sizes;
  std::vector<DeviceBuffer> params, grads;
  int64_t total = 0;
};

// ~`count` tensors of mixed sizes summing to about `params` elements, bf16 params and grads on the
// device, filled with small random values.
absl::StatusOr<Tensors> MakeTensors(Device& device, const Options& o) {
  Tensors t;
  std::mt19937_64 rng(7);
  std::vector<double> weights(static_cast<size_t>(o.tensors));
  double sum = 0;
  for (double& w : weights) sum += (w = std::exp(std::uniform_real_distribution<double>(0, 3)(rng)));
  std::vector<uint16_t> fill(1 << 20);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  for (auto& v : fill) v = F32ToBF16(normal(rng));
  for (double w : weights) {
    const int64_t n = std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(o.params) * w / sum));
    t.sizes.push_back(n);
    t.total += n;
    for (auto* list : {&t.params, &t.grads}) {
      FERRY_ASSIGN_OR_RETURN(DeviceBuffer b, FilledBuffer16(device, n, fill));
      list->push_back(std::move(b));
    }
  }
  return t;
}

template <typename F>
absl::StatusOr<double> MedianSeconds(int reps, F&& fn) {
  FERRY_RETURN_IF_ERROR(fn());  // warm-up
  std::vector<double> samples;
  for (int r = 0; r < reps; ++r) {
    const double t0 = Now();
    FERRY_RETURN_IF_ERROR(fn());
    samples.push_back(Now() - t0);
  }
  return Median(samples);
}

// A finalized engine over the first `count` tensors of `t` with `policy` (every group its own tensor).
absl::StatusOr<std::unique_ptr<Engine>> MakeEngine(Device& device, Tensors& t, const Options& o,
                                                   const std::string& policy,
                                                   const std::map<std::string, std::string>& args, size_t count,
                                                   const std::string& trace_path = "") {
  EngineOptions eo;
  eo.trace_path = trace_path;
  eo.policy_path = policy;
  eo.policy_args = args;
  eo.device = std::string(BackendName(device.backend()));
  eo.transfer_chunk_bytes = o.chunk_bytes;
  eo.cpu_threads = o.cpu_threads;
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::Create(eo));
  for (size_t i = 0; i < count; ++i) {
    ParamSpec spec;
    spec.name = "t" + std::to_string(i);
    spec.shape = {t.sizes[i]};
    spec.param = t.params[i].data();
    spec.grad = t.grads[i].data();
    FERRY_RETURN_IF_ERROR(engine->AddParam(spec));
  }
  FERRY_RETURN_IF_ERROR(engine->Finalize());
  return engine;
}

// Step time of an engine over `t` with `policy` (every group its own tensor). `adam_busy`: CPU Adam's
// busy seconds per step over the steps run (its workers' rounds, EngineStats::cpu_adam_busy_seconds).
absl::StatusOr<double> EngineStep(Device& device, Tensors& t, const Options& o, const std::string& policy,
                                  const std::map<std::string, std::string>& args, int64_t* offloaded_numel,
                                  const std::string& trace_path = "", size_t* pinned_bytes = nullptr,
                                  size_t* workers = nullptr, size_t* huge_bytes = nullptr,
                                  double* adam_busy = nullptr) {
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                         MakeEngine(device, t, o, policy, args, t.sizes.size(), trace_path));
  if (workers != nullptr) *workers = engine->Stats().cpu_threads;
  *offloaded_numel = 0;
  for (const GroupPlacement& g : engine->Placement()) *offloaded_numel += g.offloaded ? g.numel : 0;
  if (pinned_bytes != nullptr) *pinned_bytes = engine->Stats().pinned_bytes;
  if (huge_bytes != nullptr) *huge_bytes = engine->Stats().pinned_huge_bytes;
  const EngineStats before = engine->Stats();
  absl::StatusOr<double> step = MedianSeconds(o.steps, [&]() -> absl::Status {
    FERRY_RETURN_IF_ERROR(engine->Step());
    return engine->Synchronize();
  });
  if (step.ok() && adam_busy != nullptr) {
    const EngineStats after = engine->Stats();
    *adam_busy = (after.cpu_adam_busy_seconds - before.cpu_adam_busy_seconds) /
                 static_cast<double>(std::max<int64_t>(1, after.step - before.step));
  }
  return step;
}

struct Stages {
  double d2h = 0, cpu_adam = 0, h2d = 0, gpu_adam = 0;
};

// Each stage alone over the first `count` tensors (the offloaded ones) and GPU Adam over the rest.
// With `bf16_moments`, CPU Adam keeps its moments in bf16 (nearest), as offload_bf16_moments.lua asks.
absl::StatusOr<Stages> TimeStages(Device& device, Tensors& t, const Options& o, size_t cpu_count,
                                  bool bf16_moments = false) {
  Stages s;
  int64_t cpu_numel = 0, gpu_numel = 0;
  for (size_t i = 0; i < t.sizes.size(); ++i) (i < cpu_count ? cpu_numel : gpu_numel) += t.sizes[i];
  if (cpu_numel > 0) {
    // CPU Adam alone reads and writes the state where the engine keeps it: in a pinned arena (huge
    // pages where the host gives them, interleaved over the NUMA nodes), beside the grads and params.
    const size_t n = static_cast<size_t>(cpu_numel);
    const size_t moment_bytes = bf16_moments ? 2 : 4;
    PinnedArenaOptions ao;
    ao.capacity_bytes = n * (4 + 4 + 2 * moment_bytes) + (8 << 20);
    FERRY_ASSIGN_OR_RETURN(std::unique_ptr<PinnedArena> arena, PinnedArena::Create(&device, ao));
    FERRY_ASSIGN_OR_RETURN(HostSpan grads, arena->Allocate(n * 2));
    FERRY_ASSIGN_OR_RETURN(HostSpan params, arena->Allocate(n * 2));
    FERRY_ASSIGN_OR_RETURN(HostSpan master, arena->Allocate(n * 4));
    FERRY_ASSIGN_OR_RETURN(HostSpan m, arena->Allocate(n * moment_bytes));
    FERRY_ASSIGN_OR_RETURN(HostSpan v, arena->Allocate(n * moment_bytes));
    TransferOptions to;
    to.chunk_bytes = o.chunk_bytes;
    FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Transfer> transfer, Transfer::Create(&device, to));
    std::vector<CopyRegion> down, up;
    size_t at = 0;
    for (size_t i = 0; i < cpu_count; ++i) {
      const size_t bytes = static_cast<size_t>(t.sizes[i]) * 2;
      down.push_back({grads.as<char>() + at, t.grads[i].data(), bytes});
      up.push_back({t.params[i].data(), params.as<char>() + at, bytes});
      at += bytes;
    }
    FERRY_ASSIGN_OR_RETURN(s.d2h, MedianSeconds(o.steps, [&]() -> absl::Status {
                             FERRY_ASSIGN_OR_RETURN(auto b, transfer->DeviceToHost(down));
                             return b->Wait();
                           }));
    FERRY_ASSIGN_OR_RETURN(s.h2d, MedianSeconds(o.steps, [&]() -> absl::Status {
                             FERRY_ASSIGN_OR_RETURN(auto b, transfer->HostToDevice(up));
                             return b->Wait();
                           }));
    // CPU Adam alone: 12 B of fp32 state per param (8 B with bf16 moments), bf16 grads in, bf16
    // params out.
    ThreadPool pool(o.cpu_threads > 0 ? o.cpu_threads : ThreadPool::DefaultThreads());
    const size_t parts = pool.num_threads() * 4;
    pool.ParallelFor(parts, [&](size_t part) {
      const size_t lo = n * part / parts, hi = n * (part + 1) / parts;
      std::fill(master.as<float>() + lo, master.as<float>() + hi, 0.01f);
      std::memset(m.as<char>() + lo * moment_bytes, 0, (hi - lo) * moment_bytes);
      std::memset(v.as<char>() + lo * moment_bytes, 0, (hi - lo) * moment_bytes);
    });
    CpuAdam adam(&pool);
    AdamScalars scalars = MakeAdamScalars(AdamHyper{}, 1);
    CpuAdamTensor ct{master.data, m.data, v.data, grads.data, params.data, cpu_numel, DType::kBF16, DType::kBF16,
                     &scalars};
    if (bf16_moments) ct.state.moments = DType::kBF16;
    FERRY_ASSIGN_OR_RETURN(s.cpu_adam, MedianSeconds(o.steps, [&] { return adam.Step({&ct, 1}); }));
    for (const HostSpan& span : {grads, params, master, m, v}) FERRY_RETURN_IF_ERROR(arena->Release(span));
  }
  if (gpu_numel > 0) {
    FERRY_ASSIGN_OR_RETURN(DeviceBuffer state, device.Allocate(static_cast<size_t>(gpu_numel) * 12));
    FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream, device.CreateStream());
    FERRY_RETURN_IF_ERROR(device.MemsetAsync(state.data(), 0, state.bytes(), *stream));
    std::vector<AdamTensorArgs> args;
    int64_t at = 0;
    for (size_t i = cpu_count; i < t.sizes.size(); ++i) {
      AdamTensorArgs a;
      a.master = state.as<float>() + at;
      a.exp_avg = state.as<float>() + gpu_numel + at;
      a.exp_avg_sq = state.as<float>() + 2 * gpu_numel + at;
      a.grad = t.grads[i].data();
      a.param = t.params[i].data();
      a.numel = t.sizes[i];
      a.grad_dtype = a.param_dtype = DType::kBF16;
      args.push_back(a);
      at += t.sizes[i];
    }
    AdamScalars scalars = MakeAdamScalars(AdamHyper{}, 1);
    FERRY_ASSIGN_OR_RETURN(s.gpu_adam, MedianSeconds(o.steps, [&]() -> absl::Status {
                             FERRY_RETURN_IF_ERROR(device.LaunchAdam(args, {&scalars, 1}, *stream));
                             return stream->Synchronize();
                           }));
  }
  return s;
}

// `ferry bench step --streamed=SHARE,...`: per share, the offloaded step of the first (1 - SHARE) of
// the params alone, the streamed Adam of the rest alone, and both at once, against the fully
// offloaded step.
int RunStreamed(Device& device, Tensors& t, const Options& o, const std::vector<double>& shares) {
  const std::string policy = std::string(FERRY_SOURCE_DIR) + "/scripts/policies/offload_all.lua";
  auto fail = [](const absl::Status& s) {
    std::fprintf(stderr, "ferry bench step: %s\n", std::string(s.message()).c_str());
    return 1;
  };
  // Elements per streamed piece: as many as a grad chunk of the pipeline holds unless given.
  const int64_t piece =
      o.streamed_piece > 0 ? o.streamed_piece : std::max<int64_t>(1, static_cast<int64_t>(o.chunk_bytes / 2));
  int64_t all_numel = 0;
  absl::StatusOr<double> full = EngineStep(device, t, o, policy, {}, &all_numel);
  if (!full.ok()) return fail(full.status());
  std::printf("\nGPU-streamed Adam beside the offloaded step (fp32 state in pinned host memory, 12 B up and 12 B "
              "down per param)\n");
  std::printf("  fully offloaded step: %.2f ms (%.2f G params/s)\n", *full * 1e3,
              static_cast<double>(t.total) / *full / 1e9);
  std::printf("  %6s %10s %10s %12s %12s %12s %10s\n", "share", "CPU params", "streamed", "CPU step", "streamed",
              "both", "vs full");
  for (double share : shares) {
    size_t first = 0;  // the tensors before `first` stay on the offloaded step
    for (int64_t acc = 0; first < t.sizes.size() &&
                          static_cast<double>(acc + t.sizes[first]) <= (1.0 - share) * static_cast<double>(t.total);
         ++first) {
      acc += t.sizes[first];
    }
    absl::StatusOr<std::unique_ptr<Engine>> engine =
        first > 0 ? MakeEngine(device, t, o, policy, {}, first) : absl::StatusOr<std::unique_ptr<Engine>>(nullptr);
    if (!engine.ok()) return fail(engine.status());
    std::vector<StreamedAdam::Tensor> rest;
    for (size_t i = first; i < t.sizes.size(); ++i) rest.push_back({t.params[i].data(), t.grads[i].data(), t.sizes[i]});
    absl::StatusOr<std::unique_ptr<StreamedAdam>> streamed =
        StreamedAdam::Create(device, rest, piece, o.streamed_slots);
    if (!streamed.ok()) return fail(streamed.status());
    auto step = [&]() -> absl::Status {
      if (*engine == nullptr) return absl::OkStatus();
      FERRY_RETURN_IF_ERROR((*engine)->Step());
      return (*engine)->Synchronize();
    };
    absl::StatusOr<double> cpu = MedianSeconds(o.steps, step);
    absl::StatusOr<double> alone = MedianSeconds(o.steps, [&]() -> absl::Status {
      (*streamed)->Start();
      return (*streamed)->Wait();
    });
    absl::StatusOr<double> both = MedianSeconds(o.steps, [&]() -> absl::Status {
      (*streamed)->Start();
      const absl::Status stepped = step();
      const absl::Status waited = (*streamed)->Wait();
      return stepped.ok() ? waited : stepped;
    });
    if (!cpu.ok() || !alone.ok() || !both.ok()) return fail(!cpu.ok() ? cpu.status() : !alone.ok() ? alone.status() : both.status());
    std::printf("  %6.2f %10lld %10lld %9.2f ms %9.2f ms %9.2f ms %9.2fx\n", share,
                static_cast<long long>(t.total - (*streamed)->numel()), static_cast<long long>((*streamed)->numel()),
                *cpu * 1e3, *alone * 1e3, *both * 1e3, *full / *both);
  }
  std::printf("  (vs full: the fully offloaded step's time / both's; both = the step of the CPU share with the "
              "streamed share beside it)\n");
  return 0;
}

// `ferry bench step --threads=N,...`: the fully offloaded fp32 step and CPU Adam alone with N workers
// each (beside the thread that runs the step), and the engine's own choice (0), against the copies
// alone: where more workers stop helping, and whether the step follows CPU Adam alone.
int RunThreadSweep(Device& device, Tensors& t, Options o, const std::vector<size_t>& counts,
                   const std::string& trace_path) {
  const std::string policy = std::string(FERRY_SOURCE_DIR) + "/scripts/policies/offload_all.lua";
  auto fail = [](const absl::Status& s) {
    std::fprintf(stderr, "ferry bench step: %s\n", std::string(s.message()).c_str());
    return 1;
  };
  std::printf("\nworkers sweep, fully offloaded fp32\n");
  std::printf("  %8s %12s %16s %16s %12s %12s %12s %12s\n", "workers", "step", "CPU Adam in it", "CPU Adam alone",
              "D2H alone", "H2D alone", "efficiency", "step / Adam");
  for (size_t n : counts) {
    o.cpu_threads = n;
    int64_t numel = 0;
    size_t workers = 0;
    const std::string trace = trace_path.empty() ? "" : absl::StrCat(trace_path, ".workers-", n, ".json");
    double adam_busy = 0;
    absl::StatusOr<double> step =
        EngineStep(device, t, o, policy, {}, &numel, trace, nullptr, &workers, nullptr, &adam_busy);
    if (!step.ok()) return fail(step.status());
    o.cpu_threads = workers;
    absl::StatusOr<Stages> alone = TimeStages(device, t, o, t.sizes.size());
    if (!alone.ok()) return fail(alone.status());
    const double slowest = std::max({alone->d2h, alone->h2d, alone->cpu_adam});
    std::printf("  %5zu%3s %9.2f ms %13.2f ms %13.2f ms %9.2f ms %9.2f ms %12.3f %12.3f\n", workers,
                n == 0 ? "(0)" : "", *step * 1e3, adam_busy * 1e3, alone->cpu_adam * 1e3, alone->d2h * 1e3,
                alone->h2d * 1e3, slowest / *step, *step / alone->cpu_adam);
  }
  std::printf("  ((0): the engine's own choice; efficiency = slowest stage alone / step, target >= 0.9; CPU Adam in\n"
              "   it: its workers' busy time per step, against CPU Adam alone on the same kind of memory: where the\n"
              "   two differ, the step's rounds ran slower than the kernel alone; where they agree, the rest of the\n"
              "   step is the pipeline's)\n");
  return 0;
}

void PrintRow(const char* name, double seconds, int64_t numel) {
  std::printf("  %-28s %9.2f ms  %7.2f G params/s\n", name, seconds * 1e3,
              seconds > 0 ? static_cast<double>(numel) / seconds / 1e9 : 0.0);
}

int Run(int argc, char** argv) {
  Options o;
  bool quick = false;
  std::string trace_path;  // the fully offloaded engine's trace (`ferry trace FILE` summarizes it)
  std::vector<double> streamed;  // --streamed=SHARE,...: only the GPU-streamed measurement
  std::vector<size_t> sweep;     // --threads=N,...: only the workers sweep
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&](const char* flag) -> const char* {
      const size_t n = std::strlen(flag);
      if (a.compare(0, n, flag) == 0 && a.size() > n && a[n] == '=') return argv[i] + n + 1;
      return nullptr;
    };
    if (a == "--help" || a == "-h") {
      std::puts("usage: ferry bench step [--quick] [--params=N] [--tensors=N] [--steps=N] [--chunk-mib=N] [--trace FILE]\n"
                "                        [--streamed=SHARE,... [--streamed-piece-mib=N] [--streamed-slots=N]]\n"
                "                        [--threads=N,...]\n"
                "  One Adam step of N bf16 params (default 1e9) in ~200 tensors, fully offloaded and half\n"
                "  offloaded, against each pipeline stage timed alone; prints overlap efficiency; then fully\n"
                "  offloaded with fp32 and with bf16 moments side by side (step, stages, host bytes per param).\n"
                "  --trace FILE: the fully offloaded engine writes a trace of its steps to FILE.\n"
                "  --streamed=SHARE,...: instead, per share (0 to 1), the offloaded step of the other params\n"
                "  beside a GPU Adam that streams this share's fp32 state from pinned host memory and back,\n"
                "  in pieces of N MiB per state tensor (default: a grad chunk's elements), N in flight (4).\n"
                "  --threads=N,...: instead, the fully offloaded fp32 step and CPU Adam alone with N workers\n"
                "  each (0: the engine's own choice), beside the copies alone (traces: FILE.workers-N.json).");
      return 0;
    } else if (a == "--quick") {
      quick = true;
    } else if (a == "--trace" && i + 1 < argc) {
      trace_path = argv[++i];
    } else if (const char* t = value("--trace")) {
      trace_path = t;
    } else if (const char* v = value("--params")) {
      o.params = static_cast<int64_t>(std::atof(v));
    } else if (const char* v2 = value("--tensors")) {
      o.tensors = std::atoi(v2);
    } else if (const char* v3 = value("--steps")) {
      o.steps = std::atoi(v3);
    } else if (const char* v4 = value("--chunk-mib")) {
      o.chunk_bytes = static_cast<size_t>(std::atof(v4) * (1 << 20));
    } else if (const char* v8 = value("--threads")) {
      for (absl::string_view part : absl::StrSplit(v8, ',')) {
        size_t n = 0;
        if (!absl::SimpleAtoi(part, &n)) {
          std::fprintf(stderr, "ferry bench step: --threads takes worker counts (0: the engine's choice), "
                               "comma-separated; got '%s'\n", v8);
          return 2;
        }
        sweep.push_back(n);
      }
    } else if (const char* v6 = value("--streamed-piece-mib")) {
      o.streamed_piece = static_cast<int64_t>(std::atof(v6) * (1 << 20) / 4);  // MiB of one fp32 state tensor
    } else if (const char* v7 = value("--streamed-slots")) {
      o.streamed_slots = static_cast<size_t>(std::max(1, std::atoi(v7)));
    } else if (const char* v5 = value("--streamed")) {
      for (const char* at = v5; *at != '\0';) {
        char* end = nullptr;
        const double share = std::strtod(at, &end);
        if (end == at || share < 0.0 || share > 1.0 || (*end != ',' && *end != '\0')) {
          std::fprintf(stderr, "ferry bench step: --streamed takes shares from 0 to 1, comma-separated; got '%s'\n", v5);
          return 2;
        }
        streamed.push_back(share);
        at = *end == ',' ? end + 1 : end;
      }
    } else {
      std::fprintf(stderr, "ferry bench step: unknown argument '%s' (--help)\n", a.c_str());
      return 2;
    }
  }
  if (quick) {
    o.params = 4'000'000;
    o.tensors = 20;
    o.steps = 2;
    o.chunk_bytes = 1 << 20;
  }
  if (o.params <= 0 || o.tensors <= 0 || o.steps <= 0 || o.chunk_bytes < 1024) {
    std::fprintf(stderr, "ferry bench step: sizes must be positive (chunk at least 1 KiB)\n");
    return 2;
  }
  absl::StatusOr<std::unique_ptr<Device>> device = CreateDevice();
  if (!device.ok()) {
    std::fprintf(stderr, "ferry bench step: %s\n", std::string(device.status().message()).c_str());
    return 1;
  }
  absl::StatusOr<Tensors> tensors = MakeTensors(**device, o);
  if (!tensors.ok()) {
    std::fprintf(stderr, "ferry bench step: %s\n", std::string(tensors.status().message()).c_str());
    return 1;
  }
  std::printf("ferry bench step on %s: %lld bf16 params in %d tensors, chunk %.1f MiB, %zu CPU threads, "
              "median of %d\n",
              (*device)->name().c_str(), static_cast<long long>(tensors->total), o.tensors,
              static_cast<double>(o.chunk_bytes) / (1 << 20), ThreadPool::DefaultThreads(), o.steps);
  if (!streamed.empty()) return RunStreamed(**device, *tensors, o, streamed);
  if (!sweep.empty()) return RunThreadSweep(**device, *tensors, o, sweep, trace_path);
  const std::string policies = std::string(FERRY_SOURCE_DIR) + "/scripts/policies/";
  int64_t cpu_numel = 0;
  size_t pinned_fp32 = 0, pinned_bf16 = 0, huge_fp32 = 0;
  absl::StatusOr<double> full = EngineStep(**device, *tensors, o, policies + "offload_all.lua", {}, &cpu_numel,
                                           trace_path, &pinned_fp32, nullptr, &huge_fp32);
  if (!full.ok()) {
    std::fprintf(stderr, "ferry bench step: %s\n", std::string(full.status().message()).c_str());
    return 1;
  }
  absl::StatusOr<Stages> all = TimeStages(**device, *tensors, o, tensors->sizes.size());
  int64_t half_numel = 0;
  absl::StatusOr<double> half =
      EngineStep(**device, *tensors, o, policies + "offload_fraction.lua", {{"fraction", "0.5"}}, &half_numel);
  // offload_fraction offloads whole groups in parameter order: the first ones.
  size_t half_count = 0;
  for (int64_t acc = 0; half_count < tensors->sizes.size() && acc < half_numel; ++half_count) {
    acc += tensors->sizes[half_count];
  }
  absl::StatusOr<Stages> halves = half.ok() ? TimeStages(**device, *tensors, o, half_count) : absl::StatusOr<Stages>(half.status());
  if (!all.ok() || !half.ok() || !halves.ok()) {
    absl::Status s = !all.ok() ? all.status() : !half.ok() ? half.status() : halves.status();
    std::fprintf(stderr, "ferry bench step: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  const int64_t n = tensors->total;
  // The share of the pinned memory huge pages back: below 100%, CPU Adam pays TLB misses.
  std::printf("\nfully offloaded (%lld params on the CPU; pinned memory %.0f%% huge pages)\n",
              static_cast<long long>(cpu_numel),
              pinned_fp32 > 0 ? 100.0 * static_cast<double>(huge_fp32) / static_cast<double>(pinned_fp32) : 0.0);
  PrintRow("step", *full, n);
  PrintRow("D2H of grads alone", all->d2h, n);
  PrintRow("CPU Adam alone", all->cpu_adam, n);
  PrintRow("H2D of params alone", all->h2d, n);
  const double slowest = std::max({all->d2h, all->cpu_adam, all->h2d});
  PrintRow("sum of stages", all->d2h + all->cpu_adam + all->h2d, n);
  std::printf("  overlap efficiency (slowest stage / step) %.3f   step / CPU Adam alone %.3f   (target: "
              "efficiency >= 0.9)\n",
              slowest / *full, *full / all->cpu_adam);
  std::printf("\nhalf offloaded (%lld params on the CPU, %lld on the GPU)\n", static_cast<long long>(half_numel),
              static_cast<long long>(n - half_numel));
  PrintRow("step", *half, n);
  PrintRow("D2H of grads alone", halves->d2h, half_numel);
  PrintRow("CPU Adam alone", halves->cpu_adam, half_numel);
  PrintRow("H2D of params alone", halves->h2d, half_numel);
  PrintRow("GPU Adam alone", halves->gpu_adam, n - half_numel);
  const double cpu_side = std::max({halves->d2h, halves->cpu_adam, halves->h2d});
  const double slower_side = std::max(cpu_side, halves->gpu_adam);
  std::printf("  step / slower side %.3f   (target <= 1.1; CPU side = slowest CPU stage)\n", *half / slower_side);
  // Fully offloaded again with bf16 moments (scripts/policies/offload_bf16_moments.lua).
  int64_t bf16_numel = 0;
  absl::StatusOr<double> full_bf16 = EngineStep(**device, *tensors, o, policies + "offload_bf16_moments.lua", {},
                                                &bf16_numel, "", &pinned_bf16);
  absl::StatusOr<Stages> all_bf16 =
      full_bf16.ok() ? TimeStages(**device, *tensors, o, tensors->sizes.size(), /*bf16_moments=*/true)
                     : absl::StatusOr<Stages>(full_bf16.status());
  if (!all_bf16.ok()) {
    absl::Status s = all_bf16.status();
    std::fprintf(stderr, "ferry bench step: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  std::printf("\nfully offloaded, fp32 vs bf16 moments (offload_all.lua vs offload_bf16_moments.lua)\n");
  std::printf("  %-28s %12s %12s %8s\n", "", "fp32 moments", "bf16 moments", "ratio");
  auto side = [](const char* name, double a, double b) {
    std::printf("  %-28s %9.2f ms %9.2f ms %7.2fx\n", name, a * 1e3, b * 1e3, a / b);
  };
  side("step", *full, *full_bf16);
  side("CPU Adam alone", all->cpu_adam, all_bf16->cpu_adam);
  side("D2H of grads alone", all->d2h, all_bf16->d2h);
  side("H2D of params alone", all->h2d, all_bf16->h2d);
  std::printf("  (targets: CPU Adam with bf16 moments >= 1.3x the params/s of fp32 moments; the step follows\n"
              "  it while CPU Adam is the slowest stage)\n");
  const double staging = 4.0 * 2 * static_cast<double>(o.chunk_bytes);
  std::printf("\nhost memory per offloaded param: fp32 moments %.2f B, bf16 moments %.2f B (pinned bytes / params, "
              "less %.1f MiB of staging; expected 12 and 8)\n",
              (static_cast<double>(pinned_fp32) - staging) / static_cast<double>(n),
              (static_cast<double>(pinned_bf16) - staging) / static_cast<double>(n), staging / (1 << 20));
  return 0;
}

}  // namespace

FERRY_BENCH(step, "one offloaded Adam step vs its stages alone (overlap efficiency)", Run);

}  // namespace ferry::bench
