// Several ranks in one process: each rank is a thread with its own engine and a thread comm, holding
// random uneven shards (some empty) of one global model. Checks that 1..4 ranks give bit-identical
// params (with clipping, loss scaling and an injected inf), that checkpoints saved with W ranks load
// with any W' and resume bit-identically, and that a rank's failure fails every rank, naming it.
#include <atomic>
#include <filesystem>
#include <fstream>
#include <functional>
#include <thread>

#include "absl/strings/match.h"
#include "ckpt/checkpoint.h"
#include "engine/engine_test_util.h"
#include "engine/sharded_model.h"
#include "ferry/comm.h"
#include "ferry/engine.h"
#include "ferry/status.h"
#include "gtest/gtest.h"

namespace ferry::engine_test {
namespace {

constexpr uint64_t kInitSeed = 7;

struct RunSetup {
  std::string policy = "all_gpu.lua";  // a shipped policy, or an absolute path
  std::map<std::string, std::string> policy_args;
  uint64_t range_seed = 1;
  float max_grad_norm = 20.0f;
  float loss_scale = 2.0f;
  int inf_step = 3;  // this step's grads hold one +Inf (held by one rank): skipped on every rank
  std::map<std::string, GroupOptions> groups;  // Engine::AddGroup on every rank
  bool early = false;  // announce groups with GradsReady before each Step (a different subset per rank)
};


absl::StatusOr<Rank> MakeRank(int rank, int world, std::shared_ptr<Comm> comm, const RunSetup& setup,
                              absl::Duration timeout = absl::Seconds(30)) {
  Rank r;
  r.engine_rank = rank;
  FERRY_ASSIGN_OR_RETURN(r.device, CreateDevice({}));
  r.model = std::make_unique<ShardedModel>(r.device.get(), MixedModel(), RangesOf(rank, world, setup.range_seed),
                                           kInitSeed);
  EngineOptions o;
  o.policy_path = setup.policy.empty() || setup.policy[0] == '/' ? setup.policy : Policies() + setup.policy;
  o.policy_args = setup.policy_args;
  o.optimizer.lr = 1e-2f;
  o.optimizer.weight_decay = 0.01f;
  o.cpu_threads = 2;
  o.transfer_chunk_bytes = 4096;  // several pipeline chunks even for this small model
  o.rank = rank;
  o.world_size = world;
  o.comm = std::move(comm);
  o.collective_timeout = timeout;
  o.checkpoint_timeout = timeout;
  FERRY_ASSIGN_OR_RETURN(r.engine, Engine::Create(o));
  for (const auto& [name, options] : setup.groups) FERRY_RETURN_IF_ERROR(r.engine->AddGroup(name, options));
  FERRY_RETURN_IF_ERROR(r.model->Register(*r.engine));
  return r;
}

absl::Status TrainSteps(Rank& r, const RunSetup& setup, int first, int last) {
  for (int step = first; step <= last; ++step) {
    const float scale = step % 3 == 0 ? 50.0f : 0.5f;  // every third step's norm is clipped
    FERRY_RETURN_IF_ERROR(r.model->SetGrads(100 + static_cast<uint64_t>(step), scale * setup.loss_scale,
                                            step == setup.inf_step ? 3 : -1, 1234));
    const StepOptions options{.lr = 1e-2f / static_cast<float>(step), .loss_scale = setup.loss_scale,
                              .max_grad_norm = setup.max_grad_norm};
    if (setup.early) {
      // Reverse order; each rank leaves out other groups (rank r: every (r + 2)-th, shifted by the step).
      const std::vector<GroupPlacement> groups = r.engine->Placement();
      for (size_t g = groups.size(); g-- > 0;) {
        if ((g + static_cast<size_t>(step)) % static_cast<size_t>(r.engine_rank + 2) == 0) continue;
        FERRY_RETURN_IF_ERROR(r.engine->GradsReady({groups[g].group}, options));
      }
    }
    FERRY_RETURN_IF_ERROR(r.engine->Step(options));
  }
  return r.engine->Synchronize();
}

// Runs fn(rank, comm) on `world` threads with one thread-comm group; returns each rank's status.
std::vector<absl::Status> RunRanks(int world, const std::function<absl::Status(int, std::shared_ptr<Comm>)>& fn) {
  std::vector<std::unique_ptr<Comm>> comms = MakeThreadComms(world);
  std::vector<absl::Status> status(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      status[static_cast<size_t>(r)] = fn(r, std::shared_ptr<Comm>(std::move(comms[static_cast<size_t>(r)])));
    });
  }
  for (std::thread& t : threads) t.join();
  return status;
}

// The global params, assembled from every rank's shard.
using GlobalParams = std::vector<std::vector<char>>;

GlobalParams Assemble(const std::vector<std::vector<std::vector<char>>>& per_rank, int world, uint64_t range_seed) {
  const std::vector<GlobalParam> model = MixedModel();
  GlobalParams out(model.size());
  for (size_t i = 0; i < model.size(); ++i) {
    const size_t es = DTypeSize(model[i].dtype);
    out[i].assign(static_cast<size_t>(model[i].numel) * es, 0);
    for (int r = 0; r < world; ++r) {
      const auto range = RangesOf(r, world, range_seed)[i];
      const std::vector<char>& shard = per_rank[static_cast<size_t>(r)][i];
      if (!shard.empty()) std::memcpy(out[i].data() + static_cast<size_t>(range.first) * es, shard.data(), shard.size());
    }
  }
  return out;
}

// Early group updates (kept or recomputed) of every Train so far, summed over the ranks.
std::atomic<int64_t> early_updates{0};

// Trains `world` ranks for steps [1, steps]; the assembled params.
GlobalParams Train(int world, const RunSetup& setup, int steps) {
  std::vector<std::vector<std::vector<char>>> shards(static_cast<size_t>(world));
  std::vector<absl::Status> st = RunRanks(world, [&](int rank, std::shared_ptr<Comm> comm) -> absl::Status {
    FERRY_ASSIGN_OR_RETURN(Rank r, MakeRank(rank, world, std::move(comm), setup));
    FERRY_RETURN_IF_ERROR(r.engine->Finalize());
    FERRY_RETURN_IF_ERROR(TrainSteps(r, setup, 1, steps));
    EngineStats stats = r.engine->Stats();
    early_updates += stats.early_groups_kept + stats.early_groups_recomputed;
    if (stats.skipped_steps != (setup.inf_step >= 1 && setup.inf_step <= steps ? 1 : 0)) {
      return absl::InternalError(absl::StrCat("rank ", rank, ": ", stats.skipped_steps, " skipped steps"));
    }
    for (size_t i = 0; i < r.model->size(); ++i) shards[static_cast<size_t>(rank)].push_back(r.model->Param(i));
    return absl::OkStatus();
  });
  for (int r = 0; r < world; ++r) EXPECT_TRUE(st[static_cast<size_t>(r)].ok()) << "rank " << r << ": " << st[static_cast<size_t>(r)];
  return Assemble(shards, world, setup.range_seed);
}

void ExpectSameParams(const GlobalParams& a, const GlobalParams& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(a[i] == b[i]) << what << ": param " << MixedModel()[i].name << " differs";
  }
}

class WorldSizeTest : public ::testing::TestWithParam<std::string> {};

TEST_P(WorldSizeTest, OneToFourRanksGiveBitIdenticalParams) {
  RunSetup setup;
  setup.policy = GetParam();
  const GlobalParams one = Train(1, setup, 6);
  // The run changed the params (so equality below means something), and differs from an unclipped run.
  std::unique_ptr<Device> device = *CreateDevice({});
  ShardedModel init(device.get(), MixedModel(), RangesOf(0, 1, 1), kInitSeed);
  EXPECT_FALSE(one[0] == init.Param(0));
  for (int world = 2; world <= 4; ++world) {
    for (uint64_t seed = 1; seed <= 2; ++seed) {
      RunSetup s = setup;
      s.range_seed = seed + static_cast<uint64_t>(world) * 10;
      ExpectSameParams(one, Train(world, s, 6), absl::StrCat(world, " ranks, range seed ", s.range_seed));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Placements, WorldSizeTest,
                         ::testing::Values("all_gpu.lua", "offload_all.lua", "offload_fraction.lua"));

// GradsReady on several ranks, each announcing other groups (the decision to keep or recompute is
// global, from the step's one all-reduce): the same bits as one rank that only steps.
TEST(MultiRankEngineTest, EarlyAnnouncementsOnSomeRanksAreBitIdentical) {
  for (const char* policy : {"offload_all.lua", "offload_fraction.lua"}) {
    RunSetup setup;
    setup.policy = policy;
    const GlobalParams one = Train(1, setup, 6);
    for (int world = 1; world <= 3; ++world) {
      RunSetup s = setup;
      s.early = true;
      s.range_seed = 40 + static_cast<uint64_t>(world);
      const int64_t before = early_updates.load();
      ExpectSameParams(one, Train(world, s, 6), absl::StrCat(policy, ", ", world, " ranks announcing early"));
      EXPECT_GT(early_updates.load(), before) << "the early path ran";
    }
  }
}

// Per-group settings with shards: 1 and 3 ranks give the same bits, and the settings changed the run.
TEST(MultiRankEngineTest, PerGroupSettingsAreBitIdenticalForAnyWorldSize) {
  RunSetup setup;
  setup.policy = "offload_fraction.lua";
  setup.policy_args = {{"fraction", "0.5"}};
  const GlobalParams plain = Train(1, setup, 5);
  setup.groups = {{"biases", {.weight_decay = 0.0f}},
                  {"head", {.lr_scale = 0.5f, .beta2 = 0.99f}},
                  {"embed", {.weight_decay = 0.05f, .adamw = false}}};
  const GlobalParams one = Train(1, setup, 5);
  for (const char* name : {"embed", "l1.b", "head"}) {
    size_t i = 0;
    while (MixedModel()[i].name != name) ++i;
    EXPECT_FALSE(one[i] == plain[i]) << name << ": its group's settings changed nothing";
  }
  for (int world : {2, 3}) ExpectSameParams(one, Train(world, setup, 5), absl::StrCat(world, " ranks"));
}

// bf16 state: the stochastic rounding counts global elements, so 1 to 4 ranks give the same bits,
// offloaded or on the GPU, with fp32 or bf16 masters; CPU and GPU placements agree too; and the bf16
// run differs from the fp32 one (the state precision is real).
TEST(MultiRankEngineTest, Bf16StateIsBitIdenticalForAnyWorldSizeAndPlacement) {
  RunSetup fp32;
  fp32.policy = "offload_all.lua";
  const GlobalParams reference = Train(1, fp32, 6);
  for (const char* master : {"fp32", "bf16"}) {
    GlobalParams by_device[2];
    for (int d = 0; d < 2; ++d) {
      RunSetup setup;
      setup.policy = "offload_bf16_moments.lua";
      setup.policy_args = {{"device", d == 0 ? "cpu" : "gpu"}, {"master", master}, {"rounding", "stochastic"}};
      by_device[d] = Train(1, setup, 6);
      EXPECT_FALSE(by_device[d][0] == reference[0]) << master << ": bf16 state gave the fp32 run's bits";
      for (int world = 2; world <= 4; ++world) {
        RunSetup s = setup;
        s.range_seed = 5 + static_cast<uint64_t>(world) * 10;
        ExpectSameParams(by_device[d], Train(world, s, 6),
                         absl::StrCat(world, " ranks, ", setup.policy_args["device"], ", master ", master));
      }
    }
    ExpectSameParams(by_device[0], by_device[1], absl::StrCat("cpu vs gpu placement, master ", master));
  }
}

// Every rank must give every group the same settings: one rank that differs fails Finalize on every
// rank, naming it, the group and the setting.
TEST(MultiRankEngineTest, RanksWithDifferentGroupSettingsAreRefused) {
  std::vector<absl::Status> st = RunRanks(3, [&](int rank, std::shared_ptr<Comm> comm) -> absl::Status {
    RunSetup setup;
    setup.groups = {{"biases", {.weight_decay = rank == 1 ? 0.5f : 0.0f}}};
    FERRY_ASSIGN_OR_RETURN(Rank r, MakeRank(rank, 3, std::move(comm), setup));
    return r.engine->Finalize();
  });
  for (int r = 0; r < 3; ++r) {
    const absl::Status& s = st[static_cast<size_t>(r)];
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << "rank " << r << ": " << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "rank 1 of 3 gives group 'biases' other optimizer settings than rank 0: "
                                               "weight_decay 0.5 (rank 0: 0)"))
        << "rank " << r << ": " << s;
  }
}

TEST(MultiRankEngineTest, ClippingIsGlobal) {
  // A norm that clips only when every rank's grads count: a run without clipping differs.
  RunSetup clipped;
  RunSetup unclipped;
  unclipped.max_grad_norm = 0.0f;
  const GlobalParams a = Train(3, clipped, 4);
  const GlobalParams b = Train(3, unclipped, 4);
  EXPECT_FALSE(a[0] == b[0]);
}

// Saves with `save_world` ranks after `saved` steps (training on to `total` while an async save may
// be in flight), loads with `load_world` fresh ranks, trains to `total`: the assembled params.
GlobalParams SaveAndResume(const std::string& root, int save_world, int load_world, const RunSetup& setup, int saved,
                           int total) {
  std::vector<absl::Status> st = RunRanks(save_world, [&](int rank, std::shared_ptr<Comm> comm) -> absl::Status {
    FERRY_ASSIGN_OR_RETURN(Rank r, MakeRank(rank, save_world, std::move(comm), setup));
    FERRY_RETURN_IF_ERROR(r.engine->Finalize());
    FERRY_RETURN_IF_ERROR(TrainSteps(r, setup, 1, saved));
    FERRY_RETURN_IF_ERROR(r.engine->SaveCheckpoint(root, saved).status());
    FERRY_RETURN_IF_ERROR(TrainSteps(r, setup, saved + 1, total));  // overtakes an async writer
    return r.engine->WaitCheckpoint();
  });
  for (int r = 0; r < save_world; ++r) EXPECT_TRUE(st[static_cast<size_t>(r)].ok()) << "save rank " << r << ": " << st[static_cast<size_t>(r)];
  std::vector<std::vector<std::vector<char>>> shards(static_cast<size_t>(load_world));
  RunSetup load_setup = setup;
  load_setup.range_seed = setup.range_seed + 1000;  // other ranges than the writer's
  st = RunRanks(load_world, [&](int rank, std::shared_ptr<Comm> comm) -> absl::Status {
    FERRY_ASSIGN_OR_RETURN(Rank r, MakeRank(rank, load_world, std::move(comm), load_setup));
    FERRY_RETURN_IF_ERROR(r.engine->Finalize());
    FERRY_RETURN_IF_ERROR(r.engine->LoadCheckpoint(root));
    FERRY_RETURN_IF_ERROR(TrainSteps(r, setup, saved + 1, total));
    for (size_t i = 0; i < r.model->size(); ++i) shards[static_cast<size_t>(rank)].push_back(r.model->Param(i));
    return absl::OkStatus();
  });
  for (int r = 0; r < load_world; ++r) EXPECT_TRUE(st[static_cast<size_t>(r)].ok()) << "load rank " << r << ": " << st[static_cast<size_t>(r)];
  return Assemble(shards, load_world, load_setup.range_seed);
}

TEST(MultiRankEngineTest, SaveWithAnyWorldSizeLoadWithAnyOther) {
  RunSetup setup;
  setup.policy = "offload_fraction.lua";
  const GlobalParams reference = Train(1, setup, 6);
  for (int w = 1; w <= 4; ++w) {
    for (int w2 = 1; w2 <= 4; ++w2) {
      TempDir dir;
      const std::string root = dir.path() + "/ckpt";
      ExpectSameParams(reference, SaveAndResume(root, w, w2, setup, 4, 6), absl::StrCat("saved by ", w, ", loaded by ", w2));
      // One file per writing rank; the manifest says the world size.
      absl::StatusOr<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::Open(root);
      ASSERT_TRUE(reader.ok()) << reader.status();
      EXPECT_EQ((*reader)->metadata().at("ferry.world_size"), absl::StrCat(w));
      for (int r = 0; r < w; ++r) EXPECT_TRUE(std::filesystem::exists((*reader)->dir() + "/" + RankFileName(r)));
      EXPECT_FALSE(std::filesystem::exists((*reader)->dir() + "/" + RankFileName(w)));
    }
  }
}

// bf16 state (moments and masters, stochastic rounding) saved with W ranks and resumed with W': the
// same bits as one rank that never stopped (the state is saved as bf16, no conversion on load).
TEST(MultiRankEngineTest, Bf16StateSavesAndResumesWithAnyWorldSize) {
  RunSetup setup;
  setup.policy = "offload_bf16_moments.lua";
  setup.policy_args = {{"master", "bf16"}, {"rounding", "stochastic"}};
  const GlobalParams reference = Train(1, setup, 6);
  for (const auto& [w, w2] : std::vector<std::pair<int, int>>{{1, 3}, {2, 1}, {3, 4}}) {
    TempDir dir;
    ExpectSameParams(reference, SaveAndResume(dir.path() + "/ckpt", w, w2, setup, 4, 6),
                     absl::StrCat("bf16 state, saved by ", w, ", loaded by ", w2));
  }
}

TEST(MultiRankEngineTest, AsyncSavesCommitOnlyWhenEveryRankIsDone) {
  TempDir dir;
  RunSetup setup;
  setup.policy = "offload_all.lua";
  const GlobalParams reference = Train(1, setup, 6);
  RunSetup async_setup = setup;
  async_setup.policy = dir.Write("async.lua", R"(
    return {
      place = function(groups, ctx) local out = {} for _, g in ipairs(groups) do out[g.name] = "cpu" end return out end,
      checkpoint = function(info, ctx) return { async = true, keep_last = 2 } end,
    })");
  for (auto [w, w2] : {std::pair{2, 3}, std::pair{4, 1}, std::pair{3, 3}}) {
    TempDir d;
    ExpectSameParams(reference, SaveAndResume(d.path() + "/ckpt", w, w2, async_setup, 4, 6),
                     absl::StrCat("async, saved by ", w, ", loaded by ", w2));
  }
}

TEST(MultiRankEngineTest, RanksThatRegisteredDifferentParamsAreRefused) {
  struct Case {
    std::string what;
    std::function<void(int rank, std::vector<std::pair<int64_t, int64_t>>&, ParamSpec&)> change;
    std::string expect;
  };
  // Ranks register MixedModel with ranges from RandomRanges, then one rank changes one spec.
  const std::vector<Case> cases = {
      {"dtype", [](int rank, auto&, ParamSpec& s) { if (rank == 2 && s.name == "l1.w") s.dtype = DType::kF32; },
       "rank 2 of 3 registered param 'l1.w' as group 'l1', f32[4096]"},
      {"shape", [](int rank, auto&, ParamSpec& s) { if (rank == 1 && s.name == "head") s.shape = {50, 50}; },
       "rank 1 of 3 registered param 'head'"},
      {"overlap", [](int rank, auto&, ParamSpec& s) { if (rank == 1 && s.name == "embed") { s.shard_begin = 0; s.shard_end = 5000; } },
       "of param 'embed'; the ranks' ranges must not overlap"},
      {"gap", [](int rank, auto&, ParamSpec& s) { if (rank == 2 && s.name == "l0.w") { s.shard_begin = s.shard_end; } },
       "no rank holds elements"},
  };
  for (const Case& c : cases) {
    std::vector<absl::Status> st = RunRanks(3, [&](int rank, std::shared_ptr<Comm> comm) -> absl::Status {
      EngineOptions o;
      o.rank = rank;
      o.world_size = 3;
      o.comm = std::move(comm);
      o.collective_timeout = absl::Seconds(30);
      FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Engine> e, Engine::Create(o));
      FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Device> device, CreateDevice({}));
      std::vector<std::pair<int64_t, int64_t>> ranges = RangesOf(rank, 3, 5);
      std::vector<DeviceBuffer> buffers;
      const std::vector<GlobalParam> model = MixedModel();
      for (size_t i = 0; i < model.size(); ++i) {
        ParamSpec s;
        s.name = model[i].name;
        s.group = model[i].group;
        s.shape = {model[i].numel};
        s.dtype = model[i].dtype;
        s.shard_begin = ranges[i].first;
        s.shard_end = ranges[i].second;
        c.change(rank, ranges, s);
        FERRY_ASSIGN_OR_RETURN(DeviceBuffer b, device->Allocate(static_cast<size_t>(model[i].numel) * 4));
        s.param = s.grad = b.data();
        buffers.push_back(std::move(b));
        FERRY_RETURN_IF_ERROR(e->AddParam(s));
      }
      return e->Finalize();
    });
    for (int r = 0; r < 3; ++r) {
      const absl::Status& s = st[static_cast<size_t>(r)];
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.what << ", rank " << r << ": " << s;
      EXPECT_TRUE(absl::StrContains(s.message(), c.expect)) << c.what << ", rank " << r << ": " << s;
    }
  }
}

TEST(MultiRankEngineTest, AFailingRankFailsEveryRankNamingIt) {
  RunSetup setup;
  // Step: rank 1 passes a bad loss scale; every rank fails, naming rank 1, and stays usable.
  std::vector<absl::Status> st = RunRanks(3, [&](int rank, std::shared_ptr<Comm> comm) -> absl::Status {
    FERRY_ASSIGN_OR_RETURN(Rank r, MakeRank(rank, 3, std::move(comm), setup));
    FERRY_RETURN_IF_ERROR(r.engine->Finalize());
    FERRY_RETURN_IF_ERROR(r.model->SetGrads(1, 1.0f));
    absl::Status s = r.engine->Step({.loss_scale = rank == 1 ? -1.0f : 1.0f});
    if (s.ok() || !absl::StrContains(s.message(), "rank 1 of 3")) {
      return absl::InternalError(absl::StrCat("Step: expected an error naming rank 1, got ", s.ToString()));
    }
    return r.engine->Step({});  // the next step works everywhere
  });
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(st[static_cast<size_t>(r)].ok()) << "rank " << r << ": " << st[static_cast<size_t>(r)];

  // Save: rank 2 cannot write its file (its root does not exist); nothing is committed and the
  // previous checkpoint stays `latest` and loadable.
  TempDir dir;
  const std::string root = dir.path() + "/ckpt";
  st = RunRanks(3, [&](int rank, std::shared_ptr<Comm> comm) -> absl::Status {
    FERRY_ASSIGN_OR_RETURN(Rank r, MakeRank(rank, 3, std::move(comm), setup));
    FERRY_RETURN_IF_ERROR(r.engine->Finalize());
    FERRY_RETURN_IF_ERROR(TrainSteps(r, setup, 1, 2));
    FERRY_RETURN_IF_ERROR(r.engine->SaveCheckpoint(root, 2).status());
    FERRY_RETURN_IF_ERROR(TrainSteps(r, setup, 3, 4));
    absl::StatusOr<std::string> bad = r.engine->SaveCheckpoint(rank == 2 ? dir.path() + "/missing/ckpt" : root, 4);
    if (bad.ok() || !absl::StrContains(bad.status().message(), "rank 2 of 3: writing rank-00002.safetensors")) {
      return absl::InternalError(absl::StrCat("Save: expected an error naming rank 2, got ", bad.status().ToString()));
    }
    if (rank == 0) {
      absl::StatusOr<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::Open(root);
      if (!reader.ok()) return reader.status();
      if ((*reader)->step() != 2) return absl::InternalError("latest is not the step-2 checkpoint");
    }
    return absl::OkStatus();
  });
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(st[static_cast<size_t>(r)].ok()) << "rank " << r << ": " << st[static_cast<size_t>(r)];
  EXPECT_FALSE(std::filesystem::exists(root + "/" + CheckpointDirName(4) + ".incomplete"));

  // Load: flip a byte of rank 1's file: every rank refuses the load naming rank 1; params unchanged.
  {
    const std::string file = root + "/" + CheckpointDirName(2) + "/" + RankFileName(1);
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(0, std::ios::end);
    const std::streamoff size = f.tellg();
    f.seekp(size - 3);
    char c = 0;
    f.seekg(size - 3);
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x5A);
    f.seekp(size - 3);
    f.write(&c, 1);
  }
  st = RunRanks(3, [&](int rank, std::shared_ptr<Comm> comm) -> absl::Status {
    FERRY_ASSIGN_OR_RETURN(Rank r, MakeRank(rank, 3, std::move(comm), setup));
    FERRY_RETURN_IF_ERROR(r.engine->Finalize());
    std::vector<std::vector<char>> before;
    for (size_t i = 0; i < r.model->size(); ++i) before.push_back(r.model->Param(i));
    absl::Status s = r.engine->LoadCheckpoint(root);
    if (s.code() != absl::StatusCode::kDataLoss || !absl::StrContains(s.message(), "rank 1 of 3")) {
      return absl::InternalError(absl::StrCat("Load: expected DataLoss naming rank 1, got ", s.ToString()));
    }
    for (size_t i = 0; i < r.model->size(); ++i) {
      if (r.model->Param(i) != before[i]) return absl::InternalError("a refused load changed a param");
    }
    return absl::OkStatus();
  });
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(st[static_cast<size_t>(r)].ok()) << "rank " << r << ": " << st[static_cast<size_t>(r)];
}

TEST(MultiRankEngineTest, APolicyFailingOnOneRankFailsFinalizeOnEveryRank) {
  TempDir dir;
  RunSetup good;
  RunSetup bad;
  bad.policy = dir.Write("broken.lua", "return { place = function(groups, ctx) error('no placement today') end }");
  std::vector<absl::Status> st = RunRanks(3, [&](int rank, std::shared_ptr<Comm> comm) -> absl::Status {
    FERRY_ASSIGN_OR_RETURN(Rank r, MakeRank(rank, 3, std::move(comm), rank == 1 ? bad : good));
    absl::Status s = r.engine->Finalize();
    if (s.ok() || !absl::StrContains(s.message(), "rank 1 of 3") ||
        !absl::StrContains(s.message(), "no placement today")) {
      return absl::InternalError(absl::StrCat("Finalize: expected rank 1's policy error, got ", s.ToString()));
    }
    // Nothing was finalized anywhere: a step is refused, not half-run.
    if (r.engine->Step({}).code() != absl::StatusCode::kFailedPrecondition) {
      return absl::InternalError("a step ran after a failed Finalize");
    }
    return absl::OkStatus();
  });
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(st[static_cast<size_t>(r)].ok()) << "rank " << r << ": " << st[static_cast<size_t>(r)];
}

// A policy that decides state precision by rank would give ranks shards of one group in different
// dtypes: refused at Finalize on every rank, naming the rank, the group and both precisions.
TEST(MultiRankEngineTest, RanksWithDifferentStatePrecisionAreRefused) {
  TempDir dir;
  RunSetup setup;
  setup.policy = dir.Write("by_rank.lua", R"(
    return { place = function(groups, ctx)
      local p = {}
      for _, g in ipairs(groups) do
        p[g.name] = { device = "cpu", moments = (ctx.rank == 2 and g.name == groups[1].name) and "bf16" or "fp32" }
      end
      return p
    end })");
  std::vector<absl::Status> st = RunRanks(3, [&](int rank, std::shared_ptr<Comm> comm) -> absl::Status {
    FERRY_ASSIGN_OR_RETURN(Rank r, MakeRank(rank, 3, std::move(comm), setup));
    absl::Status s = r.engine->Finalize();
    if (s.code() != absl::StatusCode::kInvalidArgument || !absl::StrContains(s.message(), "rank 2 of 3") ||
        !absl::StrContains(s.message(), "state precision") || !absl::StrContains(s.message(), "bf16")) {
      return absl::InternalError(absl::StrCat("Finalize: expected the precision mismatch of rank 2, got ", s.ToString()));
    }
    if (r.engine->Step({}).code() != absl::StatusCode::kFailedPrecondition) {
      return absl::InternalError("a step ran after a failed Finalize");
    }
    return absl::OkStatus();
  });
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(st[static_cast<size_t>(r)].ok()) << "rank " << r << ": " << st[static_cast<size_t>(r)];
}

TEST(MultiRankEngineTest, ARankThatNeverArrivesTimesOutNamingIt) {
  RunSetup setup;
  std::vector<absl::Status> st = RunRanks(3, [&](int rank, std::shared_ptr<Comm> comm) -> absl::Status {
    FERRY_ASSIGN_OR_RETURN(Rank r, MakeRank(rank, 3, std::move(comm), setup, absl::Seconds(1)));
    FERRY_RETURN_IF_ERROR(r.engine->Finalize());
    FERRY_RETURN_IF_ERROR(r.model->SetGrads(1, 1.0f));
    if (rank == 2) {
      std::this_thread::sleep_for(std::chrono::seconds(3));  // never steps in time
      return absl::OkStatus();
    }
    const absl::Time start = absl::Now();
    absl::Status s = r.engine->Step({});
    if (s.code() != absl::StatusCode::kDeadlineExceeded || !absl::StrContains(s.message(), "2")) {
      return absl::InternalError(absl::StrCat("expected DeadlineExceeded naming rank 2, got ", s.ToString()));
    }
    if (absl::Now() - start > absl::Seconds(2.5)) return absl::InternalError("the timeout was not honoured");
    return absl::OkStatus();
  });
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(st[static_cast<size_t>(r)].ok()) << "rank " << r << ": " << st[static_cast<size_t>(r)];
}

}  // namespace
}  // namespace ferry::engine_test
