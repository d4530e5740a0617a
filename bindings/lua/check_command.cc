// `ferry check`: a policy run against a synthetic or described model, without an engine or a GPU.
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/absl_compat.h"
#include "base/errors.h"
#include "base/host_share.h"
#include "device/device.h"
#include "memory/pinned_budget.h"
#include "optim/worker_knee.h"
#include "ferry/dtype.h"
#include "ferry/engine.h"
#include "ferry/status.h"
#include "lua/commands.h"
#include "lua/verb_flags.h"
#include "policy/policy.h"

ABSL_FLAG(std::string, ferry_check_model, "",
          "the model, a SPEC as described above (empty: gpt:12:768:50257)");
ABSL_FLAG(std::vector<std::string>, ferry_check_arg, {},
          "a policy argument, ctx.args[KEY] = VALUE; repeat for more (a comma also separates "
          "arguments, so values cannot hold one)");
ABSL_FLAG(std::string, ferry_check_gpu_free, "80GiB", "ctx.gpu_free_bytes, a byte size");
ABSL_FLAG(std::string, ferry_check_pinned_budget, "0",
          "ctx.pinned_budget_bytes, a byte size (0: no budget)");
ABSL_FLAG(int32_t, ferry_check_rank, 0, "ctx.rank");
ABSL_FLAG(int32_t, ferry_check_world_size, 1, "ctx.world_size");
ABSL_FLAG(int32_t, ferry_check_numa_nodes, 1, "ctx.numa_nodes");
ABSL_FLAG(int32_t, ferry_check_local_world_size, 0,
          "ranks sharing this host, for the host section (0: the launcher's environment, else 1)");
ABSL_FLAG(int32_t, ferry_check_trainer_threads, 1,
          "CPUs of each rank's share left to the trainer's threads, for the host section "
          "(EngineOptions::trainer_threads; ferry.torch leaves 2 for CUDA params)");
ABSL_FLAG(int64_t, ferry_check_step, 1000, "info.step of the checkpoint() call");
ABSL_FLAG(int32_t, ferry_check_steps, 3,
          "on_step() calls to simulate, each applying the moves it asks for");
ABSL_FLAG(double, ferry_check_step_seconds, 1.0, "stats.step_seconds of each on_step() call");

namespace ferry::cli {
namespace {

const std::vector<VerbFlag>& CheckFlags() {
  static const auto* flags = new std::vector<VerbFlag>{
      {"model", "ferry_check_model", "SPEC"},
      {"arg", "ferry_check_arg", "KEY=VALUE", /*repeatable=*/true},
      {"gpu_free", "ferry_check_gpu_free", "BYTES"},
      {"pinned_budget", "ferry_check_pinned_budget", "BYTES"},
      {"rank", "ferry_check_rank", "N"},
      {"world_size", "ferry_check_world_size", "N"},
      {"numa_nodes", "ferry_check_numa_nodes", "N"},
      {"local_world_size", "ferry_check_local_world_size", "N"},
      {"trainer_threads", "ferry_check_trainer_threads", "N"},
      {"step", "ferry_check_step", "N"},
      {"steps", "ferry_check_steps", "N"},
      {"step_seconds", "ferry_check_step_seconds", "SECONDS"},
  };
  return *flags;
}


// Each local rank's share of this host, as the engines of `local_world_size` ranks (0: the launcher's
// environment) would take it, each leaving `trainer_threads` CPUs to its trainer: their CPU Adam
// workers' CPUs and their pinned budgets.
void PrintHostShares(std::FILE* out, int local_world_size, size_t trainer_threads) {
  const HostTopology topo = ReadHostTopology();
  const LocalRanks detected = DetectLocalRanks(-1, -1);
  const int ranks = local_world_size > 0 ? local_world_size : detected.local_world_size;
  std::set<int> cores;
  for (const HostCpu& c : topo.cpus) cores.insert(c.core);
  absl::FPrintF(out, "host: %d CPUs online; this process may run on %d (%d cores); %d local rank%s (%s)\n",
                topo.online_cpus, topo.cpus.size(), cores.size(), ranks, ranks == 1 ? "" : "s",
                local_world_size > 0 ? "--local_world_size" : detected.source);
  const std::vector<int> gpu_nodes = CudaNumaNodes();
  for (int r = 0; r < ranks; ++r) {
    std::vector<int> nodes;
    for (int j = 0; !gpu_nodes.empty() && j < ranks; ++j) nodes.push_back(gpu_nodes[static_cast<size_t>(j) % gpu_nodes.size()]);
    const HostShare share = SplitHost(topo, LocalRanks{r, ranks, "check"}, nodes, trainer_threads);
    const size_t workers = share.Workers(0, CpuThreadsCap(0));
    const int pin = PinCpuThreads(-1);
    const std::vector<int> cpus = share.RestrictedTo(pin);
    const std::string measured =
        share.shares_bandwidth()
            ? absl::StrFormat(" (ranks joined by a comm measure %s together)",
                              absl::StrJoin(SharedKneeLadder(share.MaxWorkers(CpuThreadsCap(0))), "/"))
            : "";
    const std::string pinned =
        share.split ? absl::StrCat("; FERRY_PIN_CPU_THREADS=1: CPUs ", FormatCpuList(share.WorkerSet())) : "";
    const std::string freed = pin < 0 && share.split && cpus == share.WorkerSet()
                                  ? absl::StrCat("; more than ", kFreeWorkersMaxRanks,
                                                 " local ranks: each held to its slice; FERRY_PIN_CPU_THREADS=0: any CPU")
                                  : "";
    const std::string where = cpus.empty() ? absl::StrCat("on any CPU of the process (not restricted", pinned, ")")
                                           : absl::StrCat("on CPUs ", FormatCpuList(cpus), " (restricted to them", freed,
                                                          ")");
    const std::string held =
        share.HoldsTrainer(PinTrainerThreads(-1))
            ? " (its other threads held to them; FERRY_PIN_TRAINER_THREADS=0: free)"
            : (share.split ? " (its other threads free; FERRY_PIN_TRAINER_THREADS=1: held to them)" : "");
    absl::FPrintF(out, "  local rank %d: up to %d CPU Adam workers%s %s; share: CPUs %s%s, %d CPU%s left to the trainer; "
                  "pinned budget %s; pipeline chunk %s\n",
                  r, workers, measured, where, FormatCpuList(share.cpus), held,
                  share.trainer_cpus, share.trainer_cpus == 1 ? "" : "s",
                  HumanBytes(static_cast<int64_t>(PinnedBudget::DefaultProcessLimit() / static_cast<size_t>(ranks))),
                  HumanBytes(static_cast<int64_t>(TransferChunkBytes(0, ranks))));
    if (r == 0) absl::FPrintF(out, "    (%s)\n", share.reason);
  }
  absl::FPrintF(out, "  (one CPU of a share of up to %d CPUs, and of a slice of ranks that split more, is left for the "
                "thread that runs the pipeline; one rank on more than %d CPUs: the engine measures at Finalize how "
                "many workers help, and takes no more; ranks that split more than %d CPUs measure at their first "
                "Finalize, in lockstep, the counts shown, and take the most workers within %.0f%% of the best rate "
                "of all of them together; ranks without a comm between them take at most half their slice)\n",
                kSmallShareCpus, kKneeProbeAbove, kSmallShareCpus, 100 * kSharedKneeTolerance);
}

// Collects the report's errors.
class Reporter final {
 public:
  Reporter(std::FILE* out, std::FILE* err) : out_(out), err_(err) {}
  void Error(const absl::Status& status) {
    ++errors_;
    absl::FPrintF(err_, "error: %s\n", status.message());
    absl::FPrintF(out_, "  error (details on stderr): %s\n", FirstLine(status.message()));
  }
  int errors() const { return errors_; }

 private:
  static absl::string_view FirstLine(absl::string_view s) { return s.substr(0, s.find('\n')); }
  std::FILE* out_;
  std::FILE* err_;
  int errors_ = 0;
};

std::string Names(const std::vector<std::string>& names, size_t total) {
  if (names.empty()) return "none";
  if (names.size() == total && total > 1) return absl::StrCat("all ", total, " groups");
  constexpr size_t kShown = 8;
  if (names.size() <= kShown) return absl::StrJoin(names, ", ");
  std::vector<std::string> shown(names.begin(), names.begin() + kShown);
  return absl::StrCat(absl::StrJoin(shown, ", "), ", ... (", names.size(), " groups)");
}

const char* Bool(bool b) { return b ? "true" : "false"; }

// A state format as one word: "<master>/<moments>", "+sr" with stochastic rounding.
std::string StateWord(const StateFormat& f) {
  return absl::StrCat(ToAbsl(StateDTypeName(f.master)), "/", ToAbsl(StateDTypeName(f.moments)), f.stochastic() ? "+sr" : "");
}

// The placement table, the GPU and pinned totals and the spare state's cost, with the policy's bound
// on it (Placement::spare_state; unset: none).
void PrintPlacementTable(std::FILE* out, const std::vector<GroupInfo>& groups,
                         const std::vector<PlaceKind>& kinds, const std::vector<StateFormat>& formats,
                         const PolicyContext& ctx, std::optional<double> spare_state) {
  size_t width = 5;
  for (const GroupInfo& g : groups) width = std::max(width, g.name.size());
  const int w = static_cast<int>(width);
  absl::FPrintF(out, "  %-*s %14s %-5s %-6s %16s %16s %s\n", w, "group", "numel", "dtype", "device",
                "gpu_bytes", "cpu_bytes", "master/moments");
  int64_t numel = 0, gpu = 0, cpu = 0, gpu_state = 0, cpu_groups = 0, cpu_fp32_grads = 0;
  for (size_t i = 0; i < groups.size(); ++i) {
    const GroupInfo& g = groups[i];
    const bool on_cpu = kinds[i] == PlaceKind::kCpu;
    const int64_t state = static_cast<int64_t>(formats[i].bytes_per_element()) * g.numel;
    const int64_t g_gpu = 2 * g.bytes + (on_cpu ? 0 : state);
    const int64_t g_cpu = on_cpu ? state : 0;
    absl::FPrintF(out, "  %-*s %14d %-5s %-6s %16d %16d %s\n", w, g.name, g.numel,
                  ToAbsl(DTypeName(g.dtype)), ToAbsl(PlaceKindName(kinds[i])), g_gpu, g_cpu, StateWord(formats[i]));
    numel += g.numel;
    gpu += g_gpu;
    cpu += g_cpu;
    gpu_state += on_cpu ? 0 : state;
    cpu_groups += on_cpu ? 1 : 0;
    cpu_fp32_grads += on_cpu && formats[i].all_f32() ? g.bytes : 0;  // the grads have the params' dtype
  }
  absl::FPrintF(out, "  %-*s %14d %-5s %-6s %16d %16d\n", w, "total", numel, "",
                absl::StrCat(cpu_groups, "/", groups.size()), gpu, cpu);
  absl::FPrintF(out,
                "  (device: where the master and Adam moments live; gpu_bytes: params and grads,\n"
                "  2 x the dtype's size per element, plus the state on the GPU; cpu_bytes: the state in\n"
                "  pinned host memory; state per element: 12 B with fp32 master/moments, 8 B with bf16\n"
                "  moments, 6 B with a bf16 master too; +sr: stochastic rounding)\n");
  absl::FPrintF(out, "  GPU: %s in all; the optimizer state placed there is %s", HumanBytes(gpu),
                HumanBytes(gpu_state));
  if (gpu_state <= ctx.gpu_free_bytes) {
    absl::FPrintF(out, ", within gpu_free_bytes (%s)\n", HumanBytes(ctx.gpu_free_bytes));
  } else {
    absl::FPrintF(out, "\n  warning: the GPU state exceeds gpu_free_bytes (%s) by %s\n",
                  HumanBytes(ctx.gpu_free_bytes), HumanBytes(gpu_state - ctx.gpu_free_bytes));
  }
  absl::FPrintF(out, "  CPU: %s of pinned host memory", HumanBytes(cpu));
  if (ctx.pinned_budget_bytes > 0 && cpu > ctx.pinned_budget_bytes) {
    absl::FPrintF(out, "\n  warning: exceeds pinned_budget_bytes (%s) by %s\n",
                  HumanBytes(ctx.pinned_budget_bytes), HumanBytes(cpu - ctx.pinned_budget_bytes));
  } else if (ctx.pinned_budget_bytes > 0) {
    absl::FPrintF(out, ", within pinned_budget_bytes (%s)\n", HumanBytes(ctx.pinned_budget_bytes));
  } else {
    absl::FPrintF(out, "\n");
  }
  if (cpu > 0) {
    // Early steps (GradsReady, ferry.torch's overlap) double the offloaded state for their spare
    // buffers; EngineOptions::spare_state_fraction and the policy's spare_state bound it.
    absl::FPrintF(out,
                  "  overlap (GradsReady; ferry.torch's overlap) adds up to %s of pinned spare state (the "
                  "offloaded state again; EngineOptions::spare_state_fraction, ferry.torch's spare_state=, "
                  "bounds it)\n",
                  HumanBytes(cpu));
  }
  if (spare_state.has_value()) {
    const int64_t bound = static_cast<int64_t>(*spare_state * static_cast<double>(cpu));
    absl::FPrintF(out,
                  "  spare_state: %.6g: the policy bounds the spare state to %s (that fraction of the "
                  "offloaded state; the engine takes the smaller of it and its spare_state_fraction)\n",
                  *spare_state, HumanBytes(bound));
  } else if (cpu > 0) {
    absl::FPrintF(out, "  spare_state: (no bound from the policy)\n");
  }
  if (cpu_fp32_grads > 0) {
    // EngineOptions::state_later keeps grads aside in ordinary host memory: a quarter of the offloaded
    // fp32-state groups' grads with "auto" (StateLater::kAutoFraction), that fraction with a number.
    absl::FPrintF(out,
                  "  state_later (EngineOptions::state_later, ferry.torch's state_later=; off unless set): "
                  "\"auto\" keeps up to %s of grads in host memory, not pinned; a fraction F keeps F x %s\n",
                  HumanBytes(cpu_fp32_grads / 4), HumanBytes(cpu_fp32_grads));
  }
}

std::string HookState(const Policy& policy, const char* hook) {
  return policy.has_hook(hook) ? hook : absl::StrCat(hook, " (absent: engine default)");
}

}  // namespace

std::string CheckUsage() {
  return absl::StrCat(
      "usage: ferry check POLICY.lua [--model SPEC] [--arg KEY=VALUE ...] [flags]\n"
      "\n"
      "Loads POLICY.lua in the policy sandbox and runs its hooks against a model, without an engine\n"
      "or a GPU: place() gives the placement table (group, size, device, bytes per device),\n"
      "checkpoint() the checkpoint plan, after_load() its decisions after three kinds of load (a\n"
      "resume from the checkpoint just planned, a model-only load, an external load), and on_step()\n"
      "the moves it asks for over a few simulated steps. Every error is reported (on stderr, with\n"
      "the file, line and hook); the exit status is 0 when there is none, 1 when there are errors,\n"
      "2 for a usage error.\n"
      "\n"
      "SPEC, the model, in parameter order:\n"
      "  gpt:LAYERS:HIDDEN[:VOCAB]    GPT-style, bf16: embed (VOCAB x HIDDEN), layer0.. (12 HIDDEN^2\n"
      "                               + 13 HIDDEN each), head (VOCAB x HIDDEN); VOCAB default 50257.\n"
      "                               The default model is ",
      kDefaultModelSpec,
      ".\n"
      "  NAME:NUMEL[:DTYPE[:TAG+TAG]],...\n"
      "                               groups one by one; NUMEL may end in K, M, G or T (x 1000^n);\n"
      "                               DTYPE bf16 (default), f16 or f32\n"
      "  @FILE                        that list read from FILE (commas or newlines; # comments)\n"
      "\n"
      "BYTES: a number, optionally with B, K, M, G, T (x 1000^n) or KiB, MiB, GiB, TiB (x 1024^n).\n"
      "\n"
      "flags:\n",
      FlagsHelp(CheckFlags()),
      "\n"
      "example:\n"
      "  ferry check scripts/policies/memory_budget.lua --model gpt:24:2048 --gpu_free 24GiB \\\n"
      "      --arg reserve=4GiB\n");
}

int CheckCommand(const std::vector<std::string>& args, std::FILE* out, std::FILE* err) {
  if (WantsHelp(args)) {
    std::fputs(CheckUsage().c_str(), out);
    return 0;
  }
  auto usage_error = [&](absl::string_view message) {
    absl::FPrintF(err, "%s\n(ferry check --help for usage)\n", message);
    return 2;
  };
  absl::StatusOr<std::vector<std::string>> positional = ParseVerbFlags("check", args, CheckFlags());
  if (!positional.ok()) return usage_error(positional.status().message());
  if (positional->size() != 1) {
    return usage_error(absl::StrCat("ferry check: expected one POLICY.lua, got ",
                                    positional->size(), " arguments"));
  }
  const std::string& path = (*positional)[0];
  const std::string spec = absl::GetFlag(FLAGS_ferry_check_model);
  absl::StatusOr<std::vector<GroupInfo>> groups = ParseModelSpec(spec);
  if (!groups.ok()) return usage_error(absl::StrCat("ferry check: --model: ", groups.status().message()));

  PolicyContext ctx;
  ctx.rank = absl::GetFlag(FLAGS_ferry_check_rank);
  ctx.world_size = absl::GetFlag(FLAGS_ferry_check_world_size);
  ctx.numa_nodes = absl::GetFlag(FLAGS_ferry_check_numa_nodes);
  if (ctx.world_size < 1 || ctx.rank < 0 || ctx.rank >= ctx.world_size || ctx.numa_nodes < 1) {
    return usage_error(absl::StrCat("ferry check: need 0 <= --rank < --world_size and --numa_nodes "
                                    ">= 1; got rank ",
                                    ctx.rank, ", world_size ", ctx.world_size, ", numa_nodes ",
                                    ctx.numa_nodes));
  }
  absl::StatusOr<int64_t> gpu_free = ParseByteSize(absl::GetFlag(FLAGS_ferry_check_gpu_free));
  if (!gpu_free.ok()) return usage_error(absl::StrCat("ferry check: --gpu_free: ", gpu_free.status().message()));
  absl::StatusOr<int64_t> pinned = ParseByteSize(absl::GetFlag(FLAGS_ferry_check_pinned_budget));
  if (!pinned.ok()) {
    return usage_error(absl::StrCat("ferry check: --pinned_budget: ", pinned.status().message()));
  }
  ctx.gpu_free_bytes = *gpu_free;
  ctx.pinned_budget_bytes = *pinned;
  for (const std::string& kv : absl::GetFlag(FLAGS_ferry_check_arg)) {
    const size_t eq = kv.find('=');
    if (eq == std::string::npos || eq == 0) {
      return usage_error(absl::StrCat("ferry check: --arg \"", kv, "\": expected KEY=VALUE"));
    }
    if (!ctx.args.emplace(kv.substr(0, eq), kv.substr(eq + 1)).second) {
      return usage_error(absl::StrCat("ferry check: --arg ", kv.substr(0, eq), " given twice"));
    }
  }
  if (absl::GetFlag(FLAGS_ferry_check_trainer_threads) < 0) {
    return usage_error(absl::StrCat("ferry check: --trainer_threads must be >= 0; got ",
                                    absl::GetFlag(FLAGS_ferry_check_trainer_threads)));
  }
  const int64_t ckpt_step = absl::GetFlag(FLAGS_ferry_check_step);
  const int steps = absl::GetFlag(FLAGS_ferry_check_steps);
  const double step_seconds = absl::GetFlag(FLAGS_ferry_check_step_seconds);
  if (ckpt_step < 0 || steps < 0 || steps > 1'000'000 || !(step_seconds >= 0)) {
    return usage_error("ferry check: --step, --steps (at most 1000000) and --step_seconds must be >= 0");
  }

  Reporter report(out, err);
  absl::StatusOr<std::unique_ptr<Policy>> loaded = Policy::LoadFile(path);
  absl::FPrintF(out, "policy: %s\n", path);
  if (!loaded.ok()) {
    report.Error(loaded.status());
    absl::FPrintF(out, "result: 1 error\n");
    return 1;
  }
  Policy& policy = **loaded;
  const std::vector<GroupInfo>& model = *groups;
  int64_t total_numel = 0;
  for (const GroupInfo& g : model) total_numel += g.numel;
  absl::FPrintF(out, "hooks: %s, %s, %s, %s\n", HookState(policy, "place"),
                HookState(policy, "checkpoint"), HookState(policy, "after_load"),
                HookState(policy, "on_step"));
  // Which file supplies each hook (a base's, when the policy takes it over through ferry.policy).
  for (const char* hook : {"place", "checkpoint", "after_load", "on_step"}) {
    if (policy.has_hook(hook)) absl::FPrintF(out, "  %s from %s\n", hook, policy.hook_location(hook));
  }
  if (policy.files().size() > 1) {
    absl::FPrintF(out, "files: %s (bases through ferry.policy after the first)\n",
                  absl::StrJoin(policy.files(), ", "));
  }
  if (policy.declared_args().has_value()) {
    std::vector<std::string> taken;
    for (const auto& [name, description] : *policy.declared_args()) taken.push_back(name);
    absl::FPrintF(out, "args taken: %s\n", taken.empty() ? "none" : absl::StrJoin(taken, ", "));
  } else {
    absl::FPrintF(out, "args taken: not declared (any are accepted)\n");
  }
  if (absl::Status given = policy.CheckArgs(ctx.args); !given.ok()) {
    report.Error(given);
    absl::FPrintF(out, "result: 1 error\n");
    return 1;
  }
  absl::FPrintF(out, "model: %s: %d groups, %d elements\n", spec.empty() ? kDefaultModelSpec : spec,
                model.size(), total_numel);
  std::vector<std::string> arg_text;
  for (const auto& [k, v] : ctx.args) arg_text.push_back(absl::StrCat(k, "=", v));
  absl::FPrintF(out,
                "ctx: rank %d, world_size %d, gpu_free_bytes %d (%s), pinned_budget_bytes %d, "
                "numa_nodes %d, args {%s}\n",
                ctx.rank, ctx.world_size, ctx.gpu_free_bytes, HumanBytes(ctx.gpu_free_bytes),
                ctx.pinned_budget_bytes, ctx.numa_nodes, absl::StrJoin(arg_text, ", "));

  PrintHostShares(out, absl::GetFlag(FLAGS_ferry_check_local_world_size),
                  static_cast<size_t>(absl::GetFlag(FLAGS_ferry_check_trainer_threads)));

  // place()
  absl::FPrintF(out, "\nplace():\n");
  std::vector<PlaceKind> kinds(model.size(), PlaceKind::kGpu);
  std::vector<StateFormat> formats(model.size());
  absl::StatusOr<Placement> placement = policy.Place(model, ctx);
  if (placement.ok()) {
    for (size_t i = 0; i < model.size(); ++i) {
      kinds[i] = placement->groups.at(model[i].name);
      auto f = placement->state.find(model[i].name);
      if (f != placement->state.end()) formats[i] = f->second;
    }
    PrintPlacementTable(out, model, kinds, formats, ctx, placement->spare_state);
    absl::FPrintF(out, "  numa: %s\n", placement->numa.value_or("(the engine's choice)"));
  } else {
    report.Error(placement.status());
    absl::FPrintF(out, "  (what follows assumes every group on the GPU)\n");
  }

  // checkpoint()
  CheckpointInfo info;
  info.step = ckpt_step;
  info.reason = "save";
  for (size_t i = 0; i < model.size(); ++i) {
    info.groups.push_back(model[i].name);
    if (kinds[i] == PlaceKind::kCpu) info.offloaded.push_back(model[i].name);
    info.model_bytes += model[i].bytes;
    info.master_bytes += static_cast<int64_t>(DTypeSize(formats[i].master)) * model[i].numel;
    info.optimizer_bytes += 2 * static_cast<int64_t>(DTypeSize(formats[i].moments)) * model[i].numel;
  }
  absl::FPrintF(out, "\ncheckpoint(step=%d):\n", ckpt_step);
  absl::StatusOr<CheckpointPlan> plan = policy.Checkpoint(info, ctx);
  if (plan.ok()) {
    std::vector<std::string> skip;
    if (plan->skip_optimizer) skip.push_back("optimizer");
    if (plan->skip_master) skip.push_back("master");
    for (const std::string& g : plan->skip_groups) skip.push_back(absl::StrCat("group ", g));
    int64_t model_bytes = 0, master_bytes = 0, optimizer_bytes = 0;
    for (size_t i = 0; i < model.size(); ++i) {
      const GroupInfo& g = model[i];
      if (std::find(plan->skip_groups.begin(), plan->skip_groups.end(), g.name) !=
          plan->skip_groups.end()) {
        continue;
      }
      model_bytes += g.bytes;
      master_bytes += plan->skip_master ? 0 : static_cast<int64_t>(DTypeSize(formats[i].master)) * g.numel;
      optimizer_bytes += plan->skip_optimizer ? 0 : 2 * static_cast<int64_t>(DTypeSize(formats[i].moments)) * g.numel;
    }
    absl::FPrintF(out, "  skip: %s\n", skip.empty() ? "nothing" : absl::StrJoin(skip, ", "));
    absl::FPrintF(out, "  writes: model %d B, master %d B, optimizer %d B: %s in all\n",
                  model_bytes, master_bytes, optimizer_bytes,
                  HumanBytes(model_bytes + master_bytes + optimizer_bytes));
    absl::FPrintF(out, "  async: %s, keep_last: %d%s\n", Bool(plan->async), plan->keep_last,
                  plan->keep_last == 0 ? " (keep all)" : "");
  } else {
    report.Error(plan.status());
  }

  // after_load()
  absl::FPrintF(out, "\nafter_load():\n");
  struct NamedEvent {
    std::string what;
    LoadEvent event;
  };
  std::vector<NamedEvent> events;
  if (plan.ok()) {
    LoadEvent resume;
    for (const GroupInfo& g : model) {
      if (std::find(plan->skip_groups.begin(), plan->skip_groups.end(), g.name) ==
          plan->skip_groups.end()) {
        resume.groups.push_back(g.name);
      }
    }
    resume.masters_loaded = !plan->skip_master;
    resume.optimizer_loaded = !plan->skip_optimizer;
    resume.kind = resume.optimizer_loaded ? LoadKind::kCheckpoint : LoadKind::kModelOnly;
    if (resume.groups.empty()) {
      absl::FPrintF(out, "  (the checkpoint above holds no group: nothing to resume from)\n");
    } else {
      events.push_back({"resume from the checkpoint above", resume});
    }
  }
  LoadEvent model_only;
  model_only.kind = LoadKind::kModelOnly;
  LoadEvent external;
  external.kind = LoadKind::kExternal;
  for (const GroupInfo& g : model) {
    model_only.groups.push_back(g.name);
    external.groups.push_back(g.name);
  }
  events.push_back({"model-only load", model_only});
  events.push_back({"external load", external});
  for (const NamedEvent& e : events) {
    absl::FPrintF(out, "  %s (kind=%s, groups=%s, masters_loaded=%s, optimizer_loaded=%s):\n",
                  e.what, ToAbsl(LoadKindName(e.event.kind)),
                  Names(e.event.groups, model.size()), Bool(e.event.masters_loaded),
                  Bool(e.event.optimizer_loaded));
    absl::StatusOr<SyncPlan> sync = policy.AfterLoad(e.event, model, ctx);
    if (sync.ok()) {
      absl::FPrintF(out, "    sync: %s; reset_optimizer: %s\n",
                    Names(sync->sync_groups, model.size()), Bool(sync->reset_optimizer));
    } else {
      report.Error(sync.status());
    }
  }

  // on_step()
  absl::FPrintF(out, "\non_step():\n");
  if (!policy.has_hook("on_step")) {
    absl::FPrintF(out, "  absent: the placement stays as place() left it\n");
  } else {
    StepStats stats;
    for (size_t i = 0; i < model.size(); ++i) {
      stats.groups.push_back({model[i].name, kinds[i], model[i].numel, model[i].bytes});
    }
    bool moved = false;
    for (int s = 1; s <= steps; ++s) {
      stats.step = s;
      stats.step_seconds = step_seconds;
      stats.gpu_state_bytes = stats.pinned_bytes = 0;
      for (size_t i = 0; i < stats.groups.size(); ++i) {
        const GroupStepInfo& g = stats.groups[i];
        (g.placement == PlaceKind::kGpu ? stats.gpu_state_bytes : stats.pinned_bytes) +=
            static_cast<int64_t>(formats[i].bytes_per_element()) * g.numel;
      }
      absl::StatusOr<MoveRequest> request = policy.OnStep(stats, ctx);
      if (!request.ok()) {
        absl::FPrintF(out, "  step %d:\n", s);
        report.Error(request.status());
        break;
      }
      std::vector<std::string> moves;
      for (const GroupMove& m : request->moves) {
        moves.push_back(absl::StrCat(m.group, " -> ", ToAbsl(PlaceKindName(m.to))));
      }
      absl::FPrintF(out, "  step %d: %s\n", s,
                    moves.empty() ? "no moves" : absl::StrCat("move ", absl::StrJoin(moves, ", ")));
      moved = moved || !moves.empty();
      const Placement next = PlacementAfter(stats, *request);
      for (GroupStepInfo& g : stats.groups) g.placement = next.groups.at(g.name);
    }
    if (moved) {
      std::vector<std::string> cpu;
      for (const GroupStepInfo& g : stats.groups) {
        if (g.placement == PlaceKind::kCpu) cpu.push_back(g.name);
      }
      absl::FPrintF(out, "  after these steps, on the CPU: %s\n", Names(cpu, model.size()));
    }
  }

  if (report.errors() == 0) {
    absl::FPrintF(out, "\nresult: no errors\n");
    return 0;
  }
  absl::FPrintF(out, "\nresult: %d error%s\n", report.errors(), report.errors() == 1 ? "" : "s");
  return 1;
}

}  // namespace ferry::cli
