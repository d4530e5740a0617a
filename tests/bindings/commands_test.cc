// `ferry check` and `ferry inspect`: their output checked value by value (the verbs called as
// functions with memory streams), their exit statuses, and the built `ferry` binary end to end.
// `ferry trace`: trace_command_test.cc.
#include "lua/commands.h"

#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bindings/command_capture.h"
#include "absl/strings/str_split.h"
#include "base/host_share.h"
#include "ckpt/checkpoint.h"
#include "memory/pinned_budget.h"
#include "ferry/version.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ferry::cli {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

const std::string kPolicies = std::string(FERRY_SOURCE_DIR) + "/scripts/policies/";

Result Check(const std::vector<std::string>& args) { return RunVerb(CheckCommand, args); }
Result Inspect(const std::vector<std::string>& args) { return RunVerb(InspectCommand, args); }

// ---- model specs and sizes -----------------------------------------------------------------------

TEST(ModelSpecTest, ListsPresetsAndFiles) {
  absl::StatusOr<std::vector<GroupInfo>> list = ParseModelSpec(" a:1000, b:1.5K:f32:x+y ,c:2M:f16");
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->size(), 3u);
  EXPECT_EQ((*list)[0].name, "a");
  EXPECT_EQ((*list)[0].numel, 1000);
  EXPECT_EQ((*list)[0].dtype, DType::kBF16);
  EXPECT_EQ((*list)[0].bytes, 2000);
  EXPECT_EQ((*list)[1].numel, 1500);
  EXPECT_EQ((*list)[1].dtype, DType::kF32);
  EXPECT_EQ((*list)[1].bytes, 6000);
  EXPECT_EQ((*list)[1].tags, (std::vector<std::string>{"x", "y"}));
  EXPECT_EQ((*list)[2].numel, 2000000);
  EXPECT_EQ((*list)[2].dtype, DType::kF16);

  absl::StatusOr<std::vector<GroupInfo>> gpt = ParseModelSpec("gpt:2:64:1000");
  ASSERT_TRUE(gpt.ok()) << gpt.status();
  ASSERT_EQ(gpt->size(), 4u);
  EXPECT_EQ((*gpt)[0].name, "embed");
  EXPECT_EQ((*gpt)[0].numel, 64000);
  EXPECT_EQ((*gpt)[0].tags, std::vector<std::string>{"embedding"});
  EXPECT_EQ((*gpt)[1].name, "layer0");
  EXPECT_EQ((*gpt)[1].numel, 12 * 64 * 64 + 13 * 64);
  EXPECT_EQ((*gpt)[2].name, "layer1");
  EXPECT_EQ((*gpt)[3].name, "head");
  EXPECT_EQ((*gpt)[3].numel, 64000);

  absl::StatusOr<std::vector<GroupInfo>> dflt = ParseModelSpec("");
  ASSERT_TRUE(dflt.ok());
  EXPECT_EQ(dflt->size(), 14u);  // gpt:12:768:50257
  EXPECT_EQ(dflt->front().numel, 50257 * 768);

  TempDir tmp;
  const std::string file = tmp.Write("model.txt", "# a model\nembed:100 # the embedding\n\nx:7,y:8:f32\n");
  absl::StatusOr<std::vector<GroupInfo>> from_file = ParseModelSpec("@" + file);
  ASSERT_TRUE(from_file.ok()) << from_file.status();
  ASSERT_EQ(from_file->size(), 3u);
  EXPECT_EQ((*from_file)[2].name, "y");
  EXPECT_EQ((*from_file)[2].bytes, 32);
}

TEST(ModelSpecTest, ErrorsNameTheEntry) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"a", "group \"a\": expected NAME:NUMEL[:DTYPE[:TAG+TAG...]]"},
      {"a:1,a:2", "group \"a:2\": name \"a\" appears twice"},
      {":5", "group \":5\": empty name"},
      {"a:-3", "group \"a:-3\": \"-3\" is not an element count"},
      {"a:1.5", "\"1.5\" is not a whole number of elements"},
      {"a:12Q", "\"12Q\" is not an element count"},
      {"a:1:f64", "group \"a:1:f64\": dtype \"f64\"; expected bf16, f16 or f32"},
      {"gpt:2", "expected gpt:LAYERS:HIDDEN[:VOCAB]"},
      {"gpt:x:64", "expected gpt:LAYERS:HIDDEN[:VOCAB]"},
      {" , ", "model: no groups"},
  };
  for (const auto& [spec, expected] : cases) {
    absl::StatusOr<std::vector<GroupInfo>> groups = ParseModelSpec(spec);
    ASSERT_FALSE(groups.ok()) << spec;
    EXPECT_EQ(groups.status().code(), absl::StatusCode::kInvalidArgument) << spec;
    EXPECT_THAT(std::string(groups.status().message()), HasSubstr(expected)) << spec;
  }
  TempDir tmp;
  const std::string file = tmp.Write("bad.txt", "a:1\nb:zz\n");
  absl::StatusOr<std::vector<GroupInfo>> bad = ParseModelSpec("@" + file);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr(file + ":2: group \"b:zz\""));
  absl::StatusOr<std::vector<GroupInfo>> missing = ParseModelSpec("@" + tmp.path() + "/nope.txt");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
}

TEST(ByteSizeTest, UnitsAndErrors) {
  const std::map<std::string, int64_t> good = {
      {"0", 0},           {"123", 123},        {"1.5K", 1500},          {"2G", 2000000000},
      {"2GB", 2000000000}, {"1KiB", 1024},      {"1.5MiB", 1572864},     {"80GiB", int64_t{80} << 30},
      {"1e9", 1000000000}, {" 7 B ", 7},        {"1TiB", int64_t{1} << 40}, {"0.5", 0},
  };
  for (const auto& [text, bytes] : good) {
    absl::StatusOr<int64_t> b = ParseByteSize(text);
    ASSERT_TRUE(b.ok()) << text << ": " << b.status();
    EXPECT_EQ(*b, bytes) << text;
  }
  for (const char* bad : {"", "-1", "G", "1X", "1 gib", "inf", "nan", "1e30", "0x10"}) {
    EXPECT_FALSE(ParseByteSize(bad).ok()) << bad;
  }
  EXPECT_EQ(HumanBytes(512), "512 B");
  EXPECT_EQ(HumanBytes(1536), "1.5 KiB");
  EXPECT_EQ(HumanBytes(int64_t{80} << 30), "80.0 GiB");
}

// ---- ferry check -----------------------------------------------------------------------------------

TEST(CheckCommandTest, PlacementTableCheckpointPlanAndAfterLoad) {
  // offload_fraction with fraction 0.25 of 4500 elements, walked from the end: c (500) fits the budget
  // of 1125, b would not.
  Result r = Check({kPolicies + "offload_fraction.lua", "--model", "a:1000,b:3000:f32,c:500:f16",
                    "--arg", "fraction=0.25", "--gpu_free=1MiB", "--step", "77"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.err, "");
  EXPECT_THAT(r.out, HasSubstr("model: a:1000,b:3000:f32,c:500:f16: 3 groups, 4500 elements\n"));
  EXPECT_THAT(r.out, HasSubstr("ctx: rank 0, world_size 1, gpu_free_bytes 1048576 (1.0 MiB), "
                               "pinned_budget_bytes 0, numa_nodes 1, args {fraction=0.25}\n"));
  // group, numel, dtype, device, gpu_bytes (params + grads + 12 B/element on the GPU), cpu_bytes.
  EXPECT_THAT(Row(r.out, "  a "), ElementsAre("a", "1000", "bf16", "gpu", "16000", "0", "fp32/fp32"));
  EXPECT_THAT(Row(r.out, "  b "), ElementsAre("b", "3000", "f32", "gpu", "60000", "0", "fp32/fp32"));
  EXPECT_THAT(Row(r.out, "  c "), ElementsAre("c", "500", "f16", "cpu", "2000", "6000", "fp32/fp32"));
  EXPECT_THAT(Row(r.out, "  total "), ElementsAre("total", "4500", "1/3", "78000", "6000"));
  EXPECT_THAT(r.out, HasSubstr("the optimizer state placed there is 46.9 KiB, within "
                               "gpu_free_bytes (1.0 MiB)"));
  EXPECT_THAT(r.out, HasSubstr("overlap (GradsReady; ferry.torch's overlap) adds up to 5.9 KiB of pinned "
                               "spare state"));
  EXPECT_THAT(r.out, HasSubstr("checkpoint(step=77):\n  skip: nothing\n"
                               "  writes: model 15000 B, master 18000 B, optimizer 36000 B"));
  EXPECT_THAT(r.out, HasSubstr("  async: false, keep_last: 0 (keep all)\n"));
  EXPECT_THAT(r.out, HasSubstr("  resume from the checkpoint above (kind=checkpoint, groups=all 3 "
                               "groups, masters_loaded=true, optimizer_loaded=true):\n"
                               "    sync: none; reset_optimizer: false\n"));
  EXPECT_THAT(r.out, HasSubstr("  model-only load (kind=model_only, groups=all 3 groups, "
                               "masters_loaded=false, optimizer_loaded=false):\n"
                               "    sync: all 3 groups; reset_optimizer: true\n"));
  EXPECT_THAT(r.out, HasSubstr("on_step():\n  absent"));
  EXPECT_THAT(r.out, HasSubstr("result: no errors\n"));
}

// memory_budget's bound on the spare state, printed beside the spare state's cost: from
// --pinned_budget (ctx.pinned_budget_bytes) or the host_budget arg; none without either.
TEST(CheckCommandTest, PrintsThePolicysSpareStateBound) {
  // a (1000 elements) offloaded: 12000 bytes of state; 18000 bytes of host budget leave half again.
  Result r = Check({kPolicies + "memory_budget.lua", "--model", "a:1000", "--arg", "budget=0", "--arg",
                    "reserve=0", "--pinned_budget=18000"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("adds up to 11.7 KiB of pinned spare state"));
  EXPECT_THAT(r.out, HasSubstr("  spare_state: 0.5: the policy bounds the spare state to 5.9 KiB (that "
                               "fraction of the offloaded state;"));
  r = Check({kPolicies + "memory_budget.lua", "--model", "a:1000", "--arg", "budget=0", "--arg", "reserve=0",
             "--arg", "host_budget=15000"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("  spare_state: 0.25: the policy bounds the spare state to 2.9 KiB"));
  r = Check({kPolicies + "memory_budget.lua", "--model", "a:1000", "--arg", "budget=0", "--arg", "reserve=0"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("  spare_state: (no bound from the policy)\n"));
  // The state later's kept grads: a quarter of the offloaded fp32-state groups' grads (2000 bf16 bytes).
  EXPECT_THAT(r.out, HasSubstr("\"auto\" keeps up to 500 B of grads in host memory, not pinned; a fraction F "
                               "keeps F x 2.0 KiB\n"));
  r = Check({kPolicies + "offload_bf16_moments.lua", "--model", "a:1000"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.out, Not(HasSubstr("state_later")));  // bf16 moments: nothing to split
  r = Check({kPolicies + "all_gpu.lua", "--model", "a:1000"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.out, Not(HasSubstr("state_later")));  // nothing offloaded
}

TEST(CheckCommandTest, WarnsWhenTheStateDoesNotFit) {
  Result r = Check({kPolicies + "all_gpu.lua", "--model", "a:1000", "--gpu_free", "10000",
                    "--pinned_budget=1"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(Row(r.out, "  a "), ElementsAre("a", "1000", "bf16", "gpu", "16000", "0", "fp32/fp32"));
  EXPECT_THAT(r.out, HasSubstr("warning: the GPU state exceeds gpu_free_bytes (9.8 KiB) by 2.0 KiB"));
  EXPECT_THAT(r.out, HasSubstr("hooks: place, checkpoint (absent: engine default), after_load "
                               "(absent: engine default), on_step (absent: engine default)\n"));
}

// The host section: each local rank's share of this machine's CPUs, disjoint, and its pinned budget.
TEST(CheckCommandTest, ShowsEachLocalRanksShareOfTheHost) {
  Result r = Check({kPolicies + "offload_all.lua", "--model", "a:1000", "--local_world_size", "2"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("2 local ranks (--local_world_size)\n"));
  const HostTopology topo = ReadHostTopology();
  std::vector<std::string> lists;
  for (int rank = 0; rank < 2; ++rank) {
    const HostShare share = SplitHost(topo, LocalRanks{rank, 2, "test"}, {}, 1);
    // No GPU node here: the host is split flat, and the workers are not restricted unless pinned.
    EXPECT_THAT(r.out, HasSubstr(absl::StrCat("  local rank ", rank, ": up to ", share.Workers(0, CpuThreadsCap(0)),
                                              " CPU Adam workers on any CPU of the process (not restricted; "
                                              "FERRY_PIN_CPU_THREADS=1: CPUs ", FormatCpuList(share.WorkerSet()),
                                              "); share: CPUs ", FormatCpuList(share.cpus))));
    lists.push_back(FormatCpuList(share.cpus));
    // Two ranks keep their other threads free by default (pin_trainer_threads).
    EXPECT_THAT(r.out, HasSubstr(absl::StrCat("share: CPUs ", FormatCpuList(share.cpus),
                                              " (its other threads free; FERRY_PIN_TRAINER_THREADS=1: held to them)")));
  }
  EXPECT_NE(lists[0], lists[1]) << "the two shares are disjoint";
  EXPECT_THAT(r.out, HasSubstr("pinned budget " + HumanBytes(static_cast<int64_t>(PinnedBudget::DefaultProcessLimit() / 2)) +
                               "; pipeline chunk 4.0 MiB\n"));
  Result quarter = Check({kPolicies + "offload_all.lua", "--model", "a:1000", "--local_world_size", "4"});
  EXPECT_EQ(quarter.status, 0) << quarter.err;
  EXPECT_THAT(quarter.out, HasSubstr("; pipeline chunk 2.0 MiB\n"));
  Result one = Check({kPolicies + "offload_all.lua", "--model", "a:1000", "--local_world_size", "1"});
  EXPECT_THAT(one.out, HasSubstr("one rank on this host: every CPU of the process"));
  // --trainer_threads: the CPUs each share leaves to its trainer (ferry.torch leaves 2 for CUDA params).
  const size_t cpus = topo.cpus.size();
  Result torch_loop = Check({kPolicies + "offload_all.lua", "--model", "a:1000", "--local_world_size", "1",
                             "--trainer_threads", "2"});
  EXPECT_EQ(torch_loop.status, 0) << torch_loop.err;
  const size_t left = std::min<size_t>(2, cpus - 1);
  EXPECT_THAT(torch_loop.out, HasSubstr(absl::StrCat(", ", left, " CPU", left == 1 ? "" : "s", " left to the trainer; ")));
  EXPECT_THAT(torch_loop.out,
              HasSubstr(absl::StrCat("  local rank 0: up to ", SplitHost(topo, LocalRanks{0, 1, "test"}, {}, 2)
                                                                     .Workers(0, CpuThreadsCap(0)),
                                     " CPU Adam workers")));
  Result bad = Check({kPolicies + "offload_all.lua", "--trainer_threads", "-1"});
  EXPECT_EQ(bad.status, 2);
  EXPECT_THAT(bad.err, HasSubstr("--trainer_threads must be >= 0; got -1"));
  // More than two local ranks: each rank's workers are held to its slice by default.
  Result four = Check({kPolicies + "offload_all.lua", "--model", "a:1000", "--local_world_size", "4"});
  EXPECT_EQ(four.status, 0) << four.err;
  for (int rank = 0; rank < 4; ++rank) {
    const HostShare share = SplitHost(topo, LocalRanks{rank, 4, "test"}, {}, 1);
    EXPECT_THAT(four.out, HasSubstr(absl::StrCat("  local rank ", rank, ": up to ", share.Workers(0, CpuThreadsCap(0)),
                                                 " CPU Adam workers on CPUs ", FormatCpuList(share.WorkerSet()),
                                                 " (restricted to them; more than 2 local ranks: each held to its "
                                                 "slice; FERRY_PIN_CPU_THREADS=0: any CPU); share: CPUs ",
                                                 FormatCpuList(share.cpus))));
  }
}

// Per-group state precision: the table's last column and the bytes follow it (8 B per element with
// bf16 moments, 6 B with a bf16 master; a bf16 master only for the bf16 group).
TEST(CheckCommandTest, ShowsStatePrecisionAndBytesPerGroup) {
  Result r = Check({kPolicies + "offload_bf16_moments.lua", "--model", "a:1000,b:3000:f32", "--arg", "master=bf16",
                    "--arg", "rounding=stochastic"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(Row(r.out, "  a "), ElementsAre("a", "1000", "bf16", "cpu", "4000", "6000", "bf16/bf16+sr"));
  EXPECT_THAT(Row(r.out, "  b "), ElementsAre("b", "3000", "f32", "cpu", "24000", "24000", "fp32/bf16+sr"));
  EXPECT_THAT(r.out, HasSubstr("writes: model 14000 B, master 14000 B, optimizer 16000 B"));
  Result gpu = Check({kPolicies + "offload_bf16_moments.lua", "--model", "a:1000", "--arg", "device=gpu"});
  EXPECT_THAT(Row(gpu.out, "  a "), ElementsAre("a", "1000", "bf16", "gpu", "12000", "0", "fp32/bf16"));
  Result bad = Check({kPolicies + "offload_bf16_moments.lua", "--model", "a:1000", "--arg", "rounding=up"});
  EXPECT_EQ(bad.status, 1);
  EXPECT_THAT(bad.out + bad.err, HasSubstr("args.rounding must be one of nearest, stochastic"));
}

TEST(CheckCommandTest, ShippedPoliciesOnADescribedModel) {
  // memory_budget: 12 B per element of 1000 + 3000 + 500 = 54000 B; 40000 available: b goes.
  Result budget = Check({kPolicies + "memory_budget.lua", "--model", "a:1000,b:3000,c:500",
                         "--arg", "budget=40000", "--arg", "reserve=0"});
  EXPECT_EQ(budget.status, 0) << budget.err;
  EXPECT_THAT(Row(budget.out, "  a "), ElementsAre("a", "1000", "bf16", "gpu", "16000", "0", "fp32/fp32"));
  EXPECT_THAT(Row(budget.out, "  b "), ElementsAre("b", "3000", "bf16", "cpu", "12000", "36000", "fp32/fp32"));
  EXPECT_THAT(Row(budget.out, "  c "), ElementsAre("c", "500", "bf16", "gpu", "8000", "0", "fp32/fp32"));

  // skip_optimizer_on_save: offloading, so model-only; the resume re-initialises Adam.
  Result skip = Check({kPolicies + "skip_optimizer_on_save.lua", "--model", "a:1000,b:3000,c:500",
                       "--arg=keep_last=2"});
  EXPECT_EQ(skip.status, 0) << skip.err;
  EXPECT_THAT(skip.out, HasSubstr("  skip: optimizer, master\n"
                                  "  writes: model 9000 B, master 0 B, optimizer 0 B"));
  EXPECT_THAT(skip.out, HasSubstr("keep_last: 2\n"));
  EXPECT_THAT(skip.out, HasSubstr("  resume from the checkpoint above (kind=model_only, groups=all "
                                  "3 groups, masters_loaded=false, optimizer_loaded=false):\n"
                                  "    sync: all 3 groups; reset_optimizer: true\n"));

  // sync_after_load: a full checkpoint resumes without a sync; other loads sync everything.
  Result sync = Check({kPolicies + "sync_after_load.lua", "--model", "a:1000,b:3000,c:500"});
  EXPECT_EQ(sync.status, 0) << sync.err;
  EXPECT_THAT(sync.out, HasSubstr("optimizer_loaded=true):\n    sync: none; reset_optimizer: false"));
  EXPECT_THAT(sync.out, HasSubstr("external load (kind=external, groups=all 3 groups, "
                                  "masters_loaded=false, optimizer_loaded=false):\n"
                                  "    sync: all 3 groups; reset_optimizer: true"));
}

// A policy built on others: each hook is shown with the file that supplies it, the files loaded and
// the args taken; an unknown arg stops the check naming it and the known ones.
TEST(CheckCommandTest, ShowsWhichFileSuppliesEachHookAndTheArgsTaken) {
  TempDir tmp;
  const std::string policy = tmp.Write("lean.lua", R"lua(local base = ferry.policy("offload_fraction", { fraction = "0.25" })
local M = { args = base.args, place = base.place }
function M.checkpoint(info, ctx) return { skip = { "optimizer" } } end
return M
)lua");
  Result r = Check({policy, "--model", "a:1000,b:3000,c:500", "--arg", "numa=bind"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("hooks: place, checkpoint, after_load (absent: engine default), on_step (absent: "
                               "engine default)\n"
                               "  place from " + kPolicies + "offload_fraction.lua:"));
  EXPECT_THAT(r.out, HasSubstr("\n  checkpoint from " + policy + ":3\n"));
  EXPECT_THAT(r.out, HasSubstr("files: " + policy + ", " + kPolicies + "offload_fraction.lua (bases"));
  EXPECT_THAT(r.out, HasSubstr("args taken: from, numa\n"));
  EXPECT_THAT(Row(r.out, "  c "), ElementsAre("c", "500", "bf16", "cpu", "2000", "6000", "fp32/fp32"));
  EXPECT_THAT(r.out, HasSubstr("  numa: bind\n"));
  EXPECT_THAT(r.out, HasSubstr("  skip: optimizer\n"));

  Result typo = Check({kPolicies + "skip_optimizer_on_save.lua", "--arg", "fracton=0.25"});
  EXPECT_EQ(typo.status, 1);
  EXPECT_THAT(typo.err, HasSubstr("skip_optimizer_on_save.lua: unknown arg \"fracton\" (fracton=0.25); it takes "
                                  "always, fraction, from, keep_last, numa"));
  EXPECT_THAT(typo.out, HasSubstr("result: 1 error\n"));
  EXPECT_THAT(typo.out, Not(HasSubstr("place():")));

  const std::string old = tmp.Write("old.lua", "return {}\n");
  Result undeclared = Check({old, "--arg", "anything=1"});
  EXPECT_EQ(undeclared.status, 0) << undeclared.err;
  EXPECT_THAT(undeclared.out, HasSubstr("args taken: not declared (any are accepted)\n"));
}

TEST(CheckCommandTest, OnStepIsSimulated) {
  TempDir tmp;
  const std::string policy = tmp.Write("steps.lua", R"lua(
return {
  on_step = function(stats, ctx)
    if stats.step == 2 then return { move = { b = "cpu", a = "gpu" } } end
    if stats.step == 3 then return { move = { b = "gpu" } } end
  end,
}
)lua");
  Result r = Check({policy, "--model", "a:10,b:20", "--steps", "4"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("on_step():\n  step 1: no moves\n  step 2: move b -> cpu\n"
                               "  step 3: move b -> gpu\n  step 4: no moves\n"
                               "  after these steps, on the CPU: none\n"));
}

TEST(CheckCommandTest, ReportsEveryErrorAndFailsTheRun) {
  TempDir tmp;
  const std::string policy = tmp.Write("broken.lua", R"lua(local M = {}
function M.place(groups, ctx)
  return { a = "cpu", b = "gpu", extra = "cpu" }
end
function M.checkpoint(info, ctx) return { skip = { "optimiser" } } end
function M.after_load(event, ctx)
  if event.kind == "external" then error("cannot handle " .. event.kind) end
  return { sync = "all" }
end
function M.on_step(stats, ctx)
  if stats.step == 2 then return { move = { b = "sideways" } } end
end
return M
)lua");
  Result r = Check({policy, "--model", "a:10,b:20"});
  EXPECT_EQ(r.status, 1);
  const std::vector<std::string> errors = {
      policy + ": place(): names unknown group \"extra\"; expected only the 2 groups passed to "
               "place() (hook defined at " + policy + ":2)",
      policy + ": checkpoint(): field \"skip\" entry 1 is \"optimiser\"; expected \"optimizer\", "
               "\"master\" or a group name from info.groups (hook defined at " + policy + ":5)",
      policy + ": after_load(): " + policy + ":7: cannot handle external",
      policy + ": on_step(): field \"move\" group \"b\" is \"sideways\"; expected \"cpu\" or "
               "\"gpu\" (hook defined at " + policy + ":10)",
  };
  for (const std::string& e : errors) EXPECT_THAT(r.err, HasSubstr("error: " + e)) << e;
  EXPECT_THAT(r.err, HasSubstr("stack traceback:"));
  EXPECT_THAT(r.out, HasSubstr("(what follows assumes every group on the GPU)"));
  EXPECT_THAT(r.out, HasSubstr("  step 1: no moves\n  step 2:\n"));
  EXPECT_THAT(r.out, HasSubstr("result: 4 errors\n"));

  const std::string syntax = tmp.Write("syntax.lua", "return { place = function(g, c)\n  return { = 1 }\nend }\n");
  Result s = Check({syntax});
  EXPECT_EQ(s.status, 1);
  EXPECT_THAT(s.err, HasSubstr("syntax.lua:2:"));
  EXPECT_THAT(s.out, HasSubstr("result: 1 error\n"));

  const std::string escape = tmp.Write("escape.lua", "return { place = function(g, c) os.execute('true') end }\n");
  Result e = Check({escape});
  EXPECT_EQ(e.status, 1);
  EXPECT_THAT(e.err, HasSubstr("escape.lua:1: 'os.execute' is not available in the policy sandbox"));

  Result missing = Check({tmp.path() + "/nope.lua"});
  EXPECT_EQ(missing.status, 1);
  EXPECT_THAT(missing.err, HasSubstr("cannot open policy " + tmp.path() + "/nope.lua"));
}

TEST(CheckCommandTest, UsageErrorsAndHelp) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{}, "ferry check: expected one POLICY.lua, got 0 arguments"},
      {{"a.lua", "b.lua"}, "expected one POLICY.lua, got 2 arguments"},
      {{"a.lua", "--bogus"}, "ferry check: unknown flag --bogus (flags: --model, --arg,"},
      {{"a.lua", "--model"}, "ferry check: flag --model needs a value (--model=SPEC)"},
      {{"a.lua", "--rank=x"}, "ferry check: bad value for --rank"},
      {{"a.lua", "--rank=1"}, "need 0 <= --rank < --world_size"},
      {{"a.lua", "--gpu_free=lots"}, "ferry check: --gpu_free: \"lots\" is not a byte size"},
      {{"a.lua", "--arg", "novalue"}, "--arg \"novalue\": expected KEY=VALUE"},
      {{"a.lua", "--arg", "k=1", "--arg", "k=2"}, "--arg k given twice"},
      {{"a.lua", "--model", "a:1:f64"}, "ferry check: --model: group \"a:1:f64\""},
  };
  for (const auto& [args, expected] : cases) {
    Result r = Check(args);
    EXPECT_EQ(r.status, 2) << expected;
    EXPECT_THAT(r.err, HasSubstr(expected));
    EXPECT_THAT(r.err, HasSubstr("(ferry check --help for usage)"));
    EXPECT_EQ(r.out, "");
  }
  // Flags are reset between runs: the --rank=1 above does not stick.
  Result ok = Check({kPolicies + "all_gpu.lua", "--model=a:1"});
  EXPECT_EQ(ok.status, 0) << ok.err;
  EXPECT_THAT(ok.out, HasSubstr("ctx: rank 0,"));
  // Dashes work as well as underscores; --no for booleans is refused on non-booleans.
  Result dashed = Check({kPolicies + "all_gpu.lua", "--model=a:1", "--gpu-free", "2KiB"});
  EXPECT_EQ(dashed.status, 0) << dashed.err;
  EXPECT_THAT(dashed.out, HasSubstr("gpu_free_bytes 2048 "));

  Result help = Check({"--help"});
  EXPECT_EQ(help.status, 0);
  EXPECT_THAT(help.out, HasSubstr("usage: ferry check POLICY.lua"));
  EXPECT_THAT(help.out, HasSubstr("  --model=SPEC"));
  EXPECT_THAT(help.out, HasSubstr("  --gpu_free=BYTES           ctx.gpu_free_bytes, a byte size "
                                  "(default: 80GiB)"));
  EXPECT_EQ(help.err, "");
}

// ---- ferry inspect ---------------------------------------------------------------------------------

class InspectCommandTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int i = 0; i < 24; ++i) weights_.push_back(static_cast<float>(i) * 0.5f - 3.0f);
    for (int i = 0; i < 6; ++i) bias_.push_back(static_cast<uint16_t>(0x3f80 + i));
    std::vector<TensorRecord> records = {
        {"w", DType::kF32, {4, 6}, weights_.data(), weights_.size() * 4, "model", "body"},
        {"w:master", DType::kF32, {4, 6}, weights_.data(), weights_.size() * 4, "master", "body"},
        {"b", DType::kBF16, {6}, bias_.data(), bias_.size() * 2, "model", "head"},
    };
    const std::vector<SkipRecord> skipped = {{"optimizer", "policy skip_optimizer_on_save.lua"}};
    const std::map<std::string, std::string> metadata = {{"ferry.group.body.placement", "cpu"},
                                                         {"ferry.group.body.step", "12"},
                                                         {"ferry.world_size", "1"}};
    CheckpointWriteOptions options;
    options.fsync = false;
    absl::StatusOr<std::string> dir =
        WriteCheckpoint(tmp_.path() + "/run", 12, records, skipped, metadata, options);
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_ = *dir;
  }

  TempDir tmp_;
  std::vector<float> weights_;
  std::vector<uint16_t> bias_;
  std::string dir_;
};

TEST_F(InspectCommandTest, DescribesTensorsFilesGroupsAndSkips) {
  Result r = Inspect({tmp_.path() + "/run"});  // a root: follows `latest`
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.err, "");
  EXPECT_THAT(r.out, HasSubstr("checkpoint: " + dir_ + "\nstep: 12\n"));
  EXPECT_THAT(r.out, HasSubstr("format: ferry-checkpoint version 1, world size 1\n"));
  EXPECT_THAT(r.out, HasSubstr("  ferry.group.body.placement = cpu\n"));
  EXPECT_THAT(r.out, HasSubstr("skipped:\n  optimizer (policy skip_optimizer_on_save.lua)\n"));
  EXPECT_THAT(r.out, HasSubstr("  rank-00000.safetensors: 3 tensors, 204 bytes of tensor data, "
                               "file size "));
  EXPECT_THAT(r.out, HasSubstr("  body: placement cpu, step 12, 2 tensors (model, master), 192 bytes\n"
                               "  head: placement ?, step ?, 1 tensors (model), 12 bytes\n"));
  EXPECT_THAT(r.out, HasSubstr("tensors: 3, 204 bytes (204 B)\n  master: 1 tensors, 96 bytes\n"
                               "  model: 2 tensors, 108 bytes\n"));
  std::vector<std::string> w = Row(r.out, "  w ");
  ASSERT_EQ(w.size(), 8u) << r.out;
  EXPECT_THAT(std::vector<std::string>(w.begin(), w.begin() + 6),
              ElementsAre("w", "model", "body", "f32", "[4,6]", "96"));
  EXPECT_THAT(w[6], HasSubstr("rank-00000.safetensors@"));
  EXPECT_THAT(w[7], testing::MatchesRegex("xxh3:[0-9a-f]{16}"));
  std::vector<std::string> b = Row(r.out, "  b ");
  ASSERT_EQ(b.size(), 8u);
  EXPECT_THAT(std::vector<std::string>(b.begin(), b.begin() + 6),
              ElementsAre("b", "model", "head", "bf16", "[6]", "12"));
  EXPECT_THAT(r.out, Not(HasSubstr("verify")));

  Result summary = Inspect({dir_, "--notensors"});
  EXPECT_EQ(summary.status, 0);
  EXPECT_THAT(summary.out, Not(HasSubstr("w:master")));
  EXPECT_THAT(summary.out, HasSubstr("tensors: 3, 204 bytes"));
}

TEST_F(InspectCommandTest, VerifyChecksEveryChecksumWithProgress) {
  Result r = Inspect({dir_, "--verify", "--progress=on"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("verify: all 3 checksums match (204 bytes read)\n"));
  // Not a terminal: a line per tenth; the last one says it all.
  EXPECT_THAT(r.err, HasSubstr("verify: 100% (3/3 tensors, 204 B of 204 B)\n"));
  EXPECT_THAT(r.err, HasSubstr("verify: 40% (1/3 tensors, 96 B of 204 B)\n"
                               "verify: 90% (2/3 tensors, 192 B of 204 B)\n"));
  Result quiet = Inspect({dir_, "--verify"});  // auto: not a terminal, so no progress
  EXPECT_EQ(quiet.status, 0);
  EXPECT_EQ(quiet.err, "");

  // Flip one byte of "b": its checksum fails, the others still pass.
  const std::string file = dir_ + "/rank-00000.safetensors";
  std::unique_ptr<CheckpointReader> reader = *CheckpointReader::Open(dir_);
  const size_t offset = reader->Find("b")->file_offset + 3;
  reader.reset();
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x10);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
  f.close();

  Result bad = Inspect({dir_, "--verify"});
  EXPECT_EQ(bad.status, 1);
  EXPECT_THAT(bad.out, HasSubstr("verify: 1 of 3 tensors FAILED: b\n"));
  EXPECT_THAT(bad.err, HasSubstr("error: "));
  EXPECT_THAT(bad.err, HasSubstr("rank-00000.safetensors"));
  EXPECT_THAT(bad.err, HasSubstr("'b'"));
  // Without --verify the corruption is not read, so the description still succeeds.
  EXPECT_EQ(Inspect({dir_}).status, 0);
}

TEST_F(InspectCommandTest, UnreadableCheckpointsAndUsage) {
  Result missing = Inspect({tmp_.path() + "/nothing"});
  EXPECT_EQ(missing.status, 1);
  EXPECT_THAT(missing.err, HasSubstr("error: "));
  EXPECT_THAT(missing.err, HasSubstr(tmp_.path() + "/nothing"));

  // A truncated shard is refused on opening.
  std::filesystem::resize_file(dir_ + "/rank-00000.safetensors", 100);
  Result truncated = Inspect({dir_});
  EXPECT_EQ(truncated.status, 1);
  EXPECT_THAT(truncated.err, HasSubstr("rank-00000.safetensors"));

  Result none = Inspect({});
  EXPECT_EQ(none.status, 2);
  EXPECT_THAT(none.err, HasSubstr("ferry inspect: expected one CHECKPOINT, got 0 arguments"));
  Result progress = Inspect({dir_, "--progress=sometimes"});
  EXPECT_EQ(progress.status, 2);
  EXPECT_THAT(progress.err, HasSubstr("--progress must be auto, on or off, got \"sometimes\""));
  Result value = Inspect({dir_, "--noverify=1"});
  EXPECT_EQ(value.status, 2);
  EXPECT_THAT(value.err, HasSubstr("--noverify takes no value"));
  Result help = Inspect({"-h"});
  EXPECT_EQ(help.status, 0);
  EXPECT_THAT(help.out, HasSubstr("usage: ferry inspect CHECKPOINT [--verify]"));
  EXPECT_THAT(help.out, HasSubstr("  --verify, --noverify"));
}

// ---- the built binary ------------------------------------------------------------------------------

// Runs the `ferry` binary of this build with `args` (a shell word list); returns its exit status and
// output. Skips the test when the binary has not been built.
Result RunFerry(const std::string& args, const std::string& cwd = FERRY_SOURCE_DIR) {
  Result r;
  const std::string binary = std::string(FERRY_BINARY_DIR) + "/ferry";
  TempDir tmp;
  const std::string cmd = absl::StrCat("cd '", cwd, "' && '", binary, "' ", args, " > '", tmp.path(),
                                       "/out' 2> '", tmp.path(), "/err'");
  const int raw = std::system(cmd.c_str());
  r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  std::ifstream out(tmp.path() + "/out"), err(tmp.path() + "/err");
  std::stringstream o, e;
  o << out.rdbuf();
  e << err.rdbuf();
  r.out = o.str();
  r.err = e.str();
  return r;
}

class FerryBinaryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(std::string(FERRY_BINARY_DIR) + "/ferry")) {
      GTEST_SKIP() << "the ferry binary is not built in " << FERRY_BINARY_DIR;
    }
  }
};

TEST_F(FerryBinaryTest, VerbsHelpAndExitStatuses) {
  Result help = RunFerry("help");
  EXPECT_EQ(help.status, 0);
  for (const char* verb : {"run SCRIPT.lua", "check POLICY.lua", "inspect CHECKPOINT", "bench NAME"}) {
    EXPECT_THAT(help.out, HasSubstr(verb));
  }
  EXPECT_EQ(RunFerry("").status, 2);
  EXPECT_EQ(RunFerry("frobnicate").status, 2);
  for (const char* verb : {"run", "check", "inspect", "bench"}) {
    Result r = RunFerry(absl::StrCat(verb, " --help"));
    EXPECT_EQ(r.status, 0) << verb;
    EXPECT_THAT(r.out, HasSubstr(absl::StrCat("usage: ferry ", verb))) << verb;
    Result h = RunFerry(absl::StrCat("help ", verb));
    EXPECT_EQ(h.status, 0) << verb;
    EXPECT_EQ(h.out, r.out) << verb;
  }
  Result check = RunFerry("check scripts/policies/offload_all.lua --model a:10,b:20");
  EXPECT_EQ(check.status, 0) << check.err;
  EXPECT_THAT(Row(check.out, "  b "), ElementsAre("b", "20", "bf16", "cpu", "80", "240", "fp32/fp32"));
  Result broken = RunFerry("check tests/policy/testdata/runtime_error.lua");
  EXPECT_EQ(broken.status, 1);
  EXPECT_THAT(broken.err, HasSubstr("runtime_error.lua:9: attempt to index field 'missing'"));
  EXPECT_EQ(RunFerry("check").status, 2);
  EXPECT_EQ(RunFerry("inspect /nonexistent/checkpoint").status, 1);
  EXPECT_EQ(RunFerry("run /nonexistent/script.lua").status, 2);
}

TEST_F(FerryBinaryTest, VersionIsTheProjectVersion) {
  for (const char* verb : {"--version", "version"}) {
    Result r = RunFerry(verb);
    EXPECT_EQ(r.status, 0) << verb;
    EXPECT_EQ(r.out, absl::StrCat("ferry ", FERRY_VERSION_STRING, "\n")) << verb;
  }
}

}  // namespace
}  // namespace ferry::cli
