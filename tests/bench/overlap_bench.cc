// `ferry bench overlap`: how much of the optimizer step a trainer still waits for when it announces
// each group's grads during backward (Engine::GradsReady), against Step alone on the same engine.
//
// A synthetic training loop: a forward of --forward-ms (groups in order, each after WaitParams of
// its group), a backward of --backward-ms that produces the groups' grads in reverse order, then
// Step. The compute is device-to-device copies sized by a calibration in this run, one slice per
// group. Timestamps are host functions enqueued on the streams.
//
// Two ways to drive it:
//   host ahead (default): as a real trainer runs. The trainer's stream is the device's legacy
//     default stream (PyTorch's default stream), and the host enqueues iteration after iteration
//     without ever waiting for the GPU: only the engine's own calls block it. Reported: the
//     iteration time (forward start to forward start) beside an all-GPU iteration of the same
//     synthetic model (policy all_gpu), and the exposed optimizer time: the iteration less the
//     all-GPU one. The host waits for nothing but the engine: its forward waits per group
//     (WaitParams), so a deferred Step's CPU Adam overlaps it (HybridOptimizer::deferred).
//   --host-paced: every iteration ends with the host waiting for the GPU, on a stream of the
//     engine's own; the next backward starts from an idle GPU. The exposed optimizer time is from
//     the last grad ready to the last param uploaded, the GPU idle time from the last grad ready to
//     the start of the next forward.
// Reported per configuration: the exposed optimizer time, the GPU idle time (host paced), the
// backward as measured, and how many early group updates Step kept or recomputed. Configurations:
// fully offloaded and 50%, each with and without GradsReady, without clipping, and with clipping
// triggered at every step.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "base/thread_pool.h"
#include "bench/bench.h"
#include "device/device.h"
#include "ferry/engine.h"
#include "ferry/status.h"

namespace ferry::bench {
namespace {

struct Options {
  int64_t params = 1'000'000'000;
  int groups = 32;
  int steps = 5;
  double backward_ms = 250.0;
  double forward_ms = 100.0;
  size_t chunk_bytes = size_t{8} << 20;
  std::string moments;  // "", "fp32" or "bf16" (bf16: offload_bf16_moments.lua instead)
  bool host_paced = false;
};

struct Model {
  std::vector<int64_t> sizes;
  std::vector<DeviceBuffer> params, grads;
  int64_t total = 0;
  DeviceBuffer scratch_a, scratch_b;  // the synthetic compute: copies between these
};

absl::StatusOr<Model> MakeModel(Device& device, const Options& o) {
  Model m;
  std::mt19937_64 rng(11);
  std::vector<uint16_t> fill(1 << 20);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  for (auto& v : fill) v = F32ToBF16(normal(rng));
  for (int g = 0; g < o.groups; ++g) {
    const int64_t n = o.params / o.groups;
    m.sizes.push_back(n);
    m.total += n;
    for (auto* list : {&m.params, &m.grads}) {
      FERRY_ASSIGN_OR_RETURN(DeviceBuffer b, FilledBuffer16(device, n, fill));
      list->push_back(std::move(b));
    }
  }
  const size_t scratch = size_t{64} << 20;
  FERRY_ASSIGN_OR_RETURN(m.scratch_a, device.Allocate(scratch));
  FERRY_ASSIGN_OR_RETURN(m.scratch_b, device.Allocate(scratch));
  return m;
}

// Busy work on `stream` for about `ms`, as whole copies of the scratch buffer plus one partial copy.
absl::Status Busy(Device& device, Model& m, Stream& stream, double ms, double bytes_per_ms) {
  double bytes = ms * bytes_per_ms;
  const double whole = static_cast<double>(m.scratch_a.bytes());
  while (bytes > 0) {
    const size_t n = static_cast<size_t>(std::min(bytes, whole)) / 256 * 256;
    if (n == 0) break;
    FERRY_RETURN_IF_ERROR(device.CopyAsync(m.scratch_b.data(), m.scratch_a.data(), n, CopyKind::kDeviceToDevice, stream));
    bytes -= static_cast<double>(n);
  }
  return absl::OkStatus();
}

// A host timestamp taken when `stream` reaches this point.
absl::Status Stamp(Stream& stream, std::atomic<double>* at) {
  return stream.EnqueueHost([at] { at->store(Now()); });
}

// Device-to-device copy rate on `stream` (bytes per ms), from 20 copies of the scratch buffer.
absl::StatusOr<double> Calibrate(Device& device, Model& m, Stream& stream) {
  FERRY_RETURN_IF_ERROR(Busy(device, m, stream, 1.0, static_cast<double>(m.scratch_a.bytes())));  // warm-up
  FERRY_RETURN_IF_ERROR(stream.Synchronize());
  std::atomic<double> t0{0}, t1{0};
  FERRY_RETURN_IF_ERROR(Stamp(stream, &t0));
  for (int i = 0; i < 20; ++i) {
    FERRY_RETURN_IF_ERROR(device.CopyAsync(m.scratch_b.data(), m.scratch_a.data(), m.scratch_a.bytes(),
                                           CopyKind::kDeviceToDevice, stream));
  }
  FERRY_RETURN_IF_ERROR(Stamp(stream, &t1));
  FERRY_RETURN_IF_ERROR(stream.Synchronize());
  const double ms = (t1.load() - t0.load()) * 1e3;
  return 20.0 * static_cast<double>(m.scratch_a.bytes()) / std::max(ms, 1e-3);
}

struct Result {
  double exposed_ms = 0, idle_ms = 0, backward_ms = 0, iteration_ms = 0;
  int64_t kept = 0, recomputed = 0;
};

std::string GroupName(int g) { return "layer" + std::to_string(g); }

absl::StatusOr<Result> RunConfig(Device& device, Model& m, const Options& o, const std::string& policy,
                                 const std::map<std::string, std::string>& args, bool early, bool clip,
                                 double bytes_per_ms) {
  EngineOptions eo;
  eo.policy_path = policy;
  eo.policy_args = args;
  eo.device = std::string(BackendName(device.backend()));
  eo.transfer_chunk_bytes = o.chunk_bytes;
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::Create(eo));
  for (int g = 0; g < o.groups; ++g) {
    ParamSpec spec;
    spec.name = GroupName(g) + ".w";
    spec.group = GroupName(g);
    spec.shape = {m.sizes[static_cast<size_t>(g)]};
    spec.param = m.params[static_cast<size_t>(g)].data();
    spec.grad = m.grads[static_cast<size_t>(g)].data();
    FERRY_RETURN_IF_ERROR(engine->AddParam(spec));
  }
  FERRY_RETURN_IF_ERROR(engine->Finalize());
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Stream> trainer_owned, device.CreateStream());
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Stream> side, device.CreateStream());
  // On the host backend the trainer's stream is the calling thread. Host ahead on CUDA: the legacy
  // default stream, as PyTorch's loops use.
  void* native = device.backend() == Backend::kCuda && o.host_paced ? trainer_owned->native() : nullptr;
  void* side_native = device.backend() == Backend::kCuda ? side->native() : nullptr;
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Stream> trainer, device.WrapStream(native));
  // Clipping at every step: a max norm far below the grads' norm (bf16 N(0, 0.02) grads).
  const StepOptions options{.lr = 1e-4f, .max_grad_norm = clip ? 1e-3f : 1e9f, .wait_for_params = false};
  std::vector<double> exposed, idle, backward;
  if (!o.host_paced) {
    // Host ahead: iterations back to back, the host never waits for the GPU (one warm-up iteration
    // and one more forward to close the last timed iteration).
    const int iterations = o.steps + 1;
    std::vector<std::atomic<double>> t_forward(static_cast<size_t>(iterations) + 1), t_backward(static_cast<size_t>(iterations)),
        t_last_grad(static_cast<size_t>(iterations));
    for (int it = 0; it <= iterations; ++it) {
      const size_t i = static_cast<size_t>(it);
      for (int g = 0; g < o.groups; ++g) {
        if (it > 0) FERRY_RETURN_IF_ERROR(engine->WaitParams({GroupName(g)}, native));
        if (g == 0) FERRY_RETURN_IF_ERROR(Stamp(*trainer, &t_forward[i]));
        FERRY_RETURN_IF_ERROR(Busy(device, m, *trainer, o.forward_ms / o.groups, bytes_per_ms));
      }
      if (it == iterations) break;
      FERRY_RETURN_IF_ERROR(Stamp(*trainer, &t_backward[i]));
      for (int g = o.groups - 1; g >= 0; --g) {
        FERRY_RETURN_IF_ERROR(Busy(device, m, *trainer, o.backward_ms / o.groups, bytes_per_ms));
        if (early) FERRY_RETURN_IF_ERROR(engine->GradsReady({GroupName(g)}, options, native));
      }
      FERRY_RETURN_IF_ERROR(Stamp(*trainer, &t_last_grad[i]));
      FERRY_RETURN_IF_ERROR(engine->Step(options, native));
    }
    FERRY_RETURN_IF_ERROR(trainer->Synchronize());
    FERRY_RETURN_IF_ERROR(side->Synchronize());
    std::vector<double> iteration;
    for (int it = 1; it < iterations; ++it) {  // the first is a warm-up
      const size_t i = static_cast<size_t>(it);
      iteration.push_back((t_forward[i + 1].load() - t_forward[i].load()) * 1e3);
      backward.push_back((t_last_grad[i].load() - t_backward[i].load()) * 1e3);
    }
    Result r;
    r.iteration_ms = Median(iteration);
    r.backward_ms = Median(backward);
    r.kept = engine->Stats().early_groups_kept;
    r.recomputed = engine->Stats().early_groups_recomputed;
    return r;
  }
  for (int step = 0; step < o.steps + 1; ++step) {  // the first is a warm-up
    std::atomic<double> t_backward{0}, t_last_grad{0}, t_forward{0}, t_params{0};
    FERRY_RETURN_IF_ERROR(Stamp(*trainer, &t_backward));
    for (int g = o.groups - 1; g >= 0; --g) {
      FERRY_RETURN_IF_ERROR(Busy(device, m, *trainer, o.backward_ms / o.groups, bytes_per_ms));
      if (early) FERRY_RETURN_IF_ERROR(engine->GradsReady({GroupName(g)}, options, native));
    }
    FERRY_RETURN_IF_ERROR(Stamp(*trainer, &t_last_grad));
    FERRY_RETURN_IF_ERROR(engine->Step(options, native));
    FERRY_RETURN_IF_ERROR(engine->WaitParams({}, side_native));
    FERRY_RETURN_IF_ERROR(Stamp(*side, &t_params));
    for (int g = 0; g < o.groups; ++g) {
      FERRY_RETURN_IF_ERROR(engine->WaitParams({GroupName(g)}, native));
      if (g == 0) FERRY_RETURN_IF_ERROR(Stamp(*trainer, &t_forward));
      FERRY_RETURN_IF_ERROR(Busy(device, m, *trainer, o.forward_ms / o.groups, bytes_per_ms));
    }
    FERRY_RETURN_IF_ERROR(trainer->Synchronize());
    FERRY_RETURN_IF_ERROR(side->Synchronize());
    if (step == 0) continue;
    exposed.push_back((t_params.load() - t_last_grad.load()) * 1e3);
    idle.push_back((t_forward.load() - t_last_grad.load()) * 1e3);
    backward.push_back((t_last_grad.load() - t_backward.load()) * 1e3);
  }
  Result r;
  r.exposed_ms = Median(exposed);
  r.idle_ms = Median(idle);
  r.backward_ms = Median(backward);
  r.kept = engine->Stats().early_groups_kept;
  r.recomputed = engine->Stats().early_groups_recomputed;
  return r;
}

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "ferry bench overlap: %s\n", std::string(s.message()).c_str());
  return 1;
}

int Run(int argc, char** argv) {
  Options o;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&](const char* flag) -> const char* {
      const size_t n = std::strlen(flag);
      if (a.compare(0, n, flag) == 0 && a.size() > n && a[n] == '=') return argv[i] + n + 1;
      return nullptr;
    };
    if (a == "--help" || a == "-h") {
      std::puts("usage: ferry bench overlap [--quick] [--params=N] [--groups=N] [--steps=N] [--backward-ms=X]\n"
                "                           [--forward-ms=X] [--chunk-mib=N] [--moments=fp32|bf16] [--host-paced]\n"
                "  A synthetic training loop: a forward (default 100 ms), a backward (default 250 ms) producing N\n"
                "  bf16 params' grads (default 1e9) group by group in reverse order, and Step; with and without\n"
                "  GradsReady, fully and 50% offloaded, without clipping and with clipping at every step. By default\n"
                "  the host runs ahead of the GPU as a real trainer's does (the legacy default stream, no waits\n"
                "  but the engine's), and the iteration is reported beside an all-GPU iteration of the same model;\n"
                "  --host-paced waits for the GPU after every iteration. Prints the exposed optimizer time and the\n"
                "  GPU idle time between backward and forward.");
      return 0;
    } else if (a == "--quick") {
      quick = true;
    } else if (const char* v = value("--params")) {
      o.params = static_cast<int64_t>(std::atof(v));
    } else if (const char* v1 = value("--groups")) {
      o.groups = std::atoi(v1);
    } else if (const char* v2 = value("--steps")) {
      o.steps = std::atoi(v2);
    } else if (const char* v3 = value("--backward-ms")) {
      o.backward_ms = std::atof(v3);
    } else if (const char* v4 = value("--forward-ms")) {
      o.forward_ms = std::atof(v4);
    } else if (const char* v5 = value("--chunk-mib")) {
      o.chunk_bytes = static_cast<size_t>(std::atof(v5) * (1 << 20));
    } else if (const char* v6 = value("--moments")) {
      o.moments = v6;
    } else if (a == "--host-paced") {
      o.host_paced = true;
    } else {
      std::fprintf(stderr, "ferry bench overlap: unknown argument '%s' (--help)\n", a.c_str());
      return 2;
    }
  }
  if (quick) {
    o.params = 2'000'000;
    o.groups = 8;
    o.steps = 2;
    o.backward_ms = 20;
    o.forward_ms = 5;
    o.chunk_bytes = 1 << 20;
  }
  if (o.params <= 0 || o.groups <= 0 || o.steps <= 0 || o.backward_ms < 0 || o.forward_ms < 0 ||
      o.chunk_bytes < 1024 || (o.moments != "" && o.moments != "fp32" && o.moments != "bf16")) {
    std::fprintf(stderr, "ferry bench overlap: sizes must be positive, chunk at least 1 KiB, moments fp32 or bf16\n");
    return 2;
  }
  absl::StatusOr<std::unique_ptr<Device>> device = CreateDevice();
  if (!device.ok()) return Fail(device.status());
  absl::StatusOr<Model> model = MakeModel(**device, o);
  if (!model.ok()) return Fail(model.status());
  absl::StatusOr<std::unique_ptr<Stream>> cal_stream = (*device)->CreateStream();
  if (!cal_stream.ok()) return Fail(cal_stream.status());
  absl::StatusOr<double> rate = Calibrate(**device, *model, **cal_stream);
  if (!rate.ok()) return Fail(rate.status());
  std::printf("ferry bench overlap on %s: %lld bf16 params in %d groups, backward %.0f ms, forward %.0f ms, "
              "chunk %.1f MiB, %zu CPUs, median of %d steps, %s\n",
              (*device)->name().c_str(), static_cast<long long>(model->total), o.groups, o.backward_ms, o.forward_ms,
              static_cast<double>(o.chunk_bytes) / (1 << 20), ThreadPool::DefaultThreads(), o.steps,
              o.host_paced ? "host paced (waits for the GPU every iteration)"
                           : "host ahead (the legacy default stream; the host never waits for the GPU)");
  std::printf("synthetic compute: device-to-device copies at %.0f GB/s\n\n", *rate / 1e6);
  const std::string policies = std::string(FERRY_SOURCE_DIR) + "/scripts/policies/";
  struct Placement {
    const char* name;
    std::string policy;
    std::map<std::string, std::string> args;
  };
  std::vector<Placement> placements = {{"fully offloaded", policies + "offload_all.lua", {}},
                                       {"50% offloaded", policies + "offload_fraction.lua", {{"fraction", "0.5"}}}};
  if (o.moments == "bf16") {
    // The moments are a policy's decision: offload_bf16_moments.lua offloads every group with them.
    // (offload_all and offload_fraction take no "moments" arg; it used to be ignored silently.)
    placements = {{"fully off., bf16", policies + "offload_bf16_moments.lua", {}}};
    std::printf("--moments=bf16: fully offloaded only (no shipped policy offloads a fraction with bf16 moments)\n");
  }
  double all_gpu_ms = 0.0;
  if (!o.host_paced) {
    absl::StatusOr<Result> r = RunConfig(**device, *model, o, policies + "all_gpu.lua", {}, false, false, *rate);
    if (!r.ok()) return Fail(r.status());
    all_gpu_ms = r->iteration_ms;
    std::printf("all-GPU iteration (policy all_gpu, the same synthetic model): %.1f ms\n\n", all_gpu_ms);
  }
  std::printf("%-16s %-14s %-10s %12s %9s %12s %12s %12s %7s %7s\n", "placement", "clipping", "mode", "iteration ms",
              "x all-GPU", "exposed ms", "GPU idle ms", "backward ms", "kept", "recomp.");
  for (const Placement& p : placements) {
    for (bool clip : {false, true}) {
      Result without, with;
      for (bool early : {false, true}) {
        absl::StatusOr<Result> r = RunConfig(**device, *model, o, p.policy, p.args, early, clip, *rate);
        if (!r.ok()) return Fail(r.status());
        if (!o.host_paced) r->exposed_ms = std::max(0.0, r->iteration_ms - all_gpu_ms);
        (early ? with : without) = *r;
        std::printf("%-16s %-14s %-10s %12s %9s %12.1f %12s %12.1f %7lld %7lld\n", p.name,
                    clip ? "every step" : "none", early ? "GradsReady" : "Step only",
                    o.host_paced ? "-" : absl::StrFormat("%.1f", r->iteration_ms).c_str(),
                    o.host_paced || all_gpu_ms <= 0 ? "-" : absl::StrFormat("%.3f", r->iteration_ms / all_gpu_ms).c_str(),
                    r->exposed_ms, o.host_paced ? absl::StrFormat("%.1f", r->idle_ms).c_str() : "-", r->backward_ms,
                    static_cast<long long>(r->kept),
                    static_cast<long long>(r->recomputed));
      }
      if (!clip) {
        std::printf("  -> exposed with GradsReady: %.1f ms = %.3f of Step alone's (target, fully offloaded, 1B, "
                    "250 ms backward: <= 68 ms)\n",
                    with.exposed_ms, with.exposed_ms / std::max(without.exposed_ms, 1e-9));
      } else {
        std::printf("  -> clipping every step: GradsReady / Step alone = %.3f (target <= 1.05)\n",
                    with.exposed_ms / std::max(without.exposed_ms, 1e-9));
      }
    }
  }
  return 0;
}

}  // namespace

FERRY_BENCH(overlap, "optimizer time exposed after backward, with and without GradsReady", Run);

}  // namespace ferry::bench
