// Checkpoints through the Engine API: asynchronous saves (fresh values on every save although the
// staging is cached, errors delivered, no leaked threads or descriptors), loads of checkpoints of
// any world size, corrupt checkpoints refused without changing the engine, and the fall-back to the
// previous complete checkpoint.
#include <dirent.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ckpt/checkpoint.h"
#include "device/device.h"
#include "ferry/engine.h"
#include "gmock/gmock.h"
#include "engine/engine_test_util.h"
#include "gtest/gtest.h"

namespace ferry {
namespace {

using ::testing::HasSubstr;

using namespace ::ferry::engine_test;  // NOLINT

std::string ReadWholeFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void WriteWholeFile(const std::string& path, const std::string& contents) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
}

size_t CountEntries(const char* dir) {
  size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir)) ++n;
  return n;
}

// Groups g0, g2, ... offloaded, g1, g3, ... on the device; checkpoints as the args say.
constexpr char kPolicy[] = R"(
return {
  place = function(groups, ctx)
    local out = {}
    for i, g in ipairs(groups) do out[g.name] = (i % 2 == 1) and "cpu" or "gpu" end
    return out
  end,
  checkpoint = function(info, ctx)
    local skip = {}
    if ctx.args.skip_optimizer == "1" then skip = { "optimizer" } end
    return { async = ctx.args.async == "1", keep_last = tonumber(ctx.args.keep_last or "0"),
             skip = skip }
  end,
}
)";

const std::vector<int64_t> kSizes = {1, 7, 1000, 4099, 65, 3, 20000, 513};

std::string AsBytes(const std::vector<uint16_t>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 2);
}

class CheckpointEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Device>> d = CreateDevice();
    ASSERT_TRUE(d.ok()) << d.status();
    device_ = *std::move(d);
    policy_ = tmp_.Write("policy.lua", kPolicy);
  }
  std::unique_ptr<Engine> MakeEngine(std::map<std::string, std::string> args) {
    EngineOptions o;
    o.policy_path = policy_;
    o.policy_args = std::move(args);
    o.optimizer.lr = 1e-2f;
    o.optimizer.weight_decay = 0.01f;
    o.transfer_chunk_bytes = 8192;
    o.cpu_threads = 2;
    o.device = std::string(BackendName(device_->backend()));
    absl::StatusOr<std::unique_ptr<Engine>> e = Engine::Create(o);
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? *std::move(e) : nullptr;
  }
  // An engine over `m`, finalized and stepped `steps` times.
  std::unique_ptr<Engine> Trained(Model& m, std::map<std::string, std::string> args, int steps, int seed) {
    auto e = MakeEngine(std::move(args));
    EXPECT_TRUE(m.Register(*e, 4).ok());
    EXPECT_TRUE(e->Finalize().ok());
    for (int s = 0; s < steps; ++s) {
      m.SetGrads(static_cast<uint64_t>(seed + s));
      EXPECT_TRUE(e->Step().ok());
    }
    EXPECT_TRUE(e->Synchronize().ok());
    return e;
  }

  std::unique_ptr<Device> device_;
  TempDir tmp_{"ferry-ckpt-engine"};
  std::string policy_;
};

// Async saves with the same structure and different values: each checkpoint holds the values of
// the moment it was taken, although the trainer stepped on at once and the staging is reused.
// The offloaded state is written in place while the next steps already run (each waits for the
// params it updates), the device-resident tensors are copied in stream order: a twin engine trained
// on the same grads and saving synchronously at the same points gives the reference for every
// tensor (masters and moments included).
TEST_F(CheckpointEngineTest, AsyncSavesWriteTheValuesOfTheirOwnStep) {
  Model m(device_.get(), kSizes, 5);
  auto e = Trained(m, {{"async", "1"}, {"keep_last", "2"}}, 3, 100);
  Model twin_model(device_.get(), kSizes, 5);
  auto twin = Trained(twin_model, {}, 3, 100);
  const std::string root = tmp_.path() + "/async";
  std::vector<std::vector<std::vector<uint16_t>>> saved;
  for (int round = 0; round < 3; ++round) {
    saved.push_back(m.Params());
    absl::StatusOr<std::string> reference = twin->SaveCheckpoint(tmp_.path() + "/sync", 10 + round);
    ASSERT_TRUE(reference.ok()) << reference.status();
    absl::StatusOr<std::string> dir = e->SaveCheckpoint(root, 10 + round);
    ASSERT_TRUE(dir.ok()) << dir.status();
    EXPECT_EQ(*dir, absl::StrCat(root, "/step-0000001", round));
    for (int s = 0; s < 3; ++s) {  // the trainer goes on at once
      m.SetGrads(static_cast<uint64_t>(200 + 10 * round + s));
      ASSERT_OK(e->Step());
      twin_model.SetGrads(static_cast<uint64_t>(200 + 10 * round + s));
      ASSERT_OK(twin->Step());
    }
    ASSERT_OK(e->WaitCheckpoint());
    std::map<std::string, std::string> tensors = ReadAll(*dir);
    ASSERT_EQ(tensors.size(), kSizes.size() * 4);
    for (size_t i = 0; i < m.size(); ++i) {
      EXPECT_EQ(tensors[absl::StrCat("p", i)], AsBytes(saved.back()[i])) << "round " << round << " p" << i;
    }
    EXPECT_TRUE(tensors == ReadAll(*reference)) << "round " << round << ": the async checkpoint differs from the sync one";
    if (round > 0) {
      // The values moved between saves: a stale staging would have been caught.
      EXPECT_NE(saved[static_cast<size_t>(round)][6], saved[static_cast<size_t>(round) - 1][6]);
    }
  }
  // keep_last = 2, applied after each commit.
  absl::StatusOr<std::vector<std::string>> left = ListCheckpoints(root);
  ASSERT_TRUE(left.ok());
  EXPECT_EQ(left->size(), 2u);
  // Loading the last async checkpoint restores exactly its params; masters agree with them.
  Model r(device_.get(), kSizes, 77);
  auto fresh = MakeEngine({});
  ASSERT_OK(r.Register(*fresh, 4));
  ASSERT_OK(fresh->Finalize());
  ASSERT_OK(fresh->LoadCheckpoint(root));
  ASSERT_OK(fresh->VerifyMasters());
  for (size_t i = 0; i < r.size(); ++i) EXPECT_EQ(r.Param(i), saved.back()[i]) << i;
}

// Async and sync saves of the same state write the same bytes (masters and moments included).
TEST_F(CheckpointEngineTest, AsyncAndSyncSavesAreIdentical) {
  Model m(device_.get(), kSizes, 6);
  auto a = Trained(m, {{"async", "1"}}, 4, 300);
  absl::StatusOr<std::string> da = a->SaveCheckpoint(tmp_.path() + "/a", 4);
  ASSERT_TRUE(da.ok()) << da.status();
  ASSERT_OK(a->WaitCheckpoint());
  a.reset();
  Model m2(device_.get(), kSizes, 6);
  auto b = Trained(m2, {}, 4, 300);
  absl::StatusOr<std::string> db = b->SaveCheckpoint(tmp_.path() + "/b", 4);
  ASSERT_TRUE(db.ok()) << db.status();
  std::map<std::string, std::string> ta = ReadAll(*da), tb = ReadAll(*db);
  ASSERT_EQ(ta.size(), kSizes.size() * 4);
  EXPECT_TRUE(ta == tb);
}

// Calls that change the offloaded state wholesale while an async save still reads it in place (a
// placement move, a sync from the model, a load) wait for the save: the checkpoint holds the state
// of its own step, like a synchronous save of a twin engine.
TEST_F(CheckpointEngineTest, StateChangesDuringAnAsyncSaveWaitForIt) {
  const std::string all_gpu = tmp_.Write("all_gpu.lua", R"(
return {
  place = function(groups, ctx)
    local out = {}
    for _, g in ipairs(groups) do out[g.name] = "gpu" end
    return out
  end,
  checkpoint = function(info, ctx) return { async = true } end,
}
)");
  Model m(device_.get(), kSizes, 12);
  auto e = Trained(m, {{"async", "1"}}, 3, 1300);
  Model twin_model(device_.get(), kSizes, 12);
  auto twin = Trained(twin_model, {}, 3, 1300);
  const std::vector<std::vector<uint16_t>> params = m.Params();

  // A move of every offloaded group to the GPU right after the save.
  absl::StatusOr<std::string> reference = twin->SaveCheckpoint(tmp_.path() + "/twin", 1);
  ASSERT_TRUE(reference.ok()) << reference.status();
  absl::StatusOr<std::string> moved = e->SaveCheckpoint(tmp_.path() + "/moved", 1);
  ASSERT_TRUE(moved.ok()) << moved.status();
  ASSERT_OK(e->ReloadPolicy(all_gpu, {}));
  for (const GroupPlacement& g : e->Placement()) EXPECT_FALSE(g.offloaded) << g.group;
  ASSERT_OK(e->WaitCheckpoint());
  EXPECT_TRUE(ReadAll(*moved) == ReadAll(*reference)) << "a move during the save changed what it wrote";

  // A sync from the model (resetting the moments) right after the save; the engine is back on the
  // mixed placement first.
  ASSERT_OK(e->ReloadPolicy(policy_, {{"async", "1"}}));
  absl::StatusOr<std::string> synced = e->SaveCheckpoint(tmp_.path() + "/synced", 2);
  ASSERT_TRUE(synced.ok()) << synced.status();
  std::vector<std::string> groups;
  for (const GroupPlacement& g : e->Placement()) groups.push_back(g.group);
  ASSERT_OK(e->SyncFromModel(groups, /*reset_optimizer=*/true));
  ASSERT_OK(e->WaitCheckpoint());
  absl::StatusOr<std::string> reference2 = twin->SaveCheckpoint(tmp_.path() + "/twin", 2);
  ASSERT_TRUE(reference2.ok()) << reference2.status();
  EXPECT_TRUE(ReadAll(*synced) == ReadAll(*reference2)) << "a sync during the save changed what it wrote";

  // A load right after an async save (of another root) waits for it too, then loads. The twin
  // takes the same sync for the reference.
  ASSERT_OK(twin->SyncFromModel(groups, /*reset_optimizer=*/true));
  absl::StatusOr<std::string> reference3 = twin->SaveCheckpoint(tmp_.path() + "/twin", 3);
  ASSERT_TRUE(reference3.ok()) << reference3.status();
  absl::StatusOr<std::string> third = e->SaveCheckpoint(tmp_.path() + "/third", 3);
  ASSERT_TRUE(third.ok()) << third.status();
  ASSERT_OK(e->LoadCheckpoint(*reference));
  ASSERT_OK(e->WaitCheckpoint());
  ASSERT_OK(e->VerifyMasters());
  for (size_t i = 0; i < m.size(); ++i) EXPECT_EQ(m.Param(i), params[i]) << i;
  EXPECT_TRUE(ReadAll(*third) == ReadAll(*reference3)) << "the load during the save changed what it wrote";
}

// A background save that fails reports its error to the trainer: through WaitCheckpoint, or, if the
// trainer never asked, through the next SaveCheckpoint. The error is delivered once; then saving
// works again.
TEST_F(CheckpointEngineTest, AsyncErrorsAreDeliveredNeverLost) {
  Model m(device_.get(), kSizes, 7);
  auto e = Trained(m, {{"async", "1"}}, 1, 400);
  const std::string not_a_dir = tmp_.Write("file", "x");
  absl::StatusOr<std::string> dir = e->SaveCheckpoint(not_a_dir, 1);  // fails in the background
  ASSERT_TRUE(dir.ok()) << dir.status();
  absl::Status s = e->WaitCheckpoint();
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()), HasSubstr(not_a_dir));
  ASSERT_OK(e->WaitCheckpoint());  // delivered once

  ASSERT_TRUE(e->SaveCheckpoint(not_a_dir, 2).ok());
  absl::StatusOr<std::string> next = e->SaveCheckpoint(tmp_.path() + "/ok", 3);
  EXPECT_FALSE(next.ok());  // the failure of step 2, not lost
  EXPECT_THAT(std::string(next.status().message()), HasSubstr("step 2"));
  next = e->SaveCheckpoint(tmp_.path() + "/ok", 3);
  ASSERT_TRUE(next.ok()) << next.status();
  std::optional<absl::Status> polled;
  while (!(polled = e->PollCheckpoint()).has_value()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_OK(*polled);
  absl::StatusOr<std::unique_ptr<CheckpointReader>> r = CheckpointReader::Open(*next);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_OK((*r)->VerifyAll());
}

// Engines that save asynchronously and are destroyed, even with a save in flight, leave no thread
// or file descriptor behind, and the save in flight is committed.
TEST_F(CheckpointEngineTest, NoLeakedThreadsOrDescriptors) {
  Model m(device_.get(), kSizes, 8);
  {  // warm-up: whatever the process keeps for good (device, libraries) is opened now
    auto e = Trained(m, {{"async", "1"}}, 1, 500);
    ASSERT_TRUE(e->SaveCheckpoint(tmp_.path() + "/warm", 1).ok());
    ASSERT_OK(e->WaitCheckpoint());
  }
  const size_t fds = CountEntries("/proc/self/fd");
  const size_t threads = CountEntries("/proc/self/task");
  for (int round = 0; round < 3; ++round) {
    auto e = Trained(m, {{"async", "1"}}, 1, 600 + round);
    const std::string root = absl::StrCat(tmp_.path(), "/leak", round);
    ASSERT_TRUE(e->SaveCheckpoint(root, 1).ok());
    ASSERT_OK(e->WaitCheckpoint());
    absl::StatusOr<std::string> dir = e->SaveCheckpoint(root, 2);
    ASSERT_TRUE(dir.ok());
    e.reset();  // with the second save (probably) in flight
    absl::StatusOr<std::unique_ptr<CheckpointReader>> r = CheckpointReader::Open(*dir);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_OK((*r)->VerifyAll());
  }
  EXPECT_EQ(CountEntries("/proc/self/fd"), fds);
  EXPECT_EQ(CountEntries("/proc/self/task"), threads);
}

// A checkpoint written with world sizes 2, 3, 4 (from the tensors of a single-rank save) loads into
// the engine exactly like the single-rank one.
TEST_F(CheckpointEngineTest, LoadsCheckpointsOfAnyWorldSize) {
  Model m(device_.get(), kSizes, 9);
  auto e = Trained(m, {}, 3, 700);
  absl::StatusOr<std::string> dir = e->SaveCheckpoint(tmp_.path() + "/w1", 3);
  ASSERT_TRUE(dir.ok()) << dir.status();
  const std::vector<std::vector<uint16_t>> saved = m.Params();
  absl::StatusOr<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::Open(*dir);
  ASSERT_TRUE(reader.ok());
  std::vector<std::string> bytes;
  std::vector<TensorRecord> records;
  bytes.reserve((*reader)->tensors().size());
  for (const TensorEntry& t : (*reader)->tensors()) {
    bytes.emplace_back(t.bytes, '\0');
    ASSERT_OK((*reader)->ReadTensor(t.name, bytes.back().data(), t.bytes));
    records.push_back({t.name, t.dtype, t.shape, bytes.back().data(), t.bytes, t.kind, t.group});
  }
  for (int w = 2; w <= 4; ++w) {
    SCOPED_TRACE(absl::StrCat("world size ", w));
    const std::string root = absl::StrCat(tmp_.path(), "/w", w);
    ASSERT_TRUE(WriteShardedCheckpoint(root, 3, records, w, (*reader)->skipped(), (*reader)->metadata()).ok());
    Model r(device_.get(), kSizes, 1000 + static_cast<uint64_t>(w));
    auto fresh = MakeEngine({});
    ASSERT_OK(r.Register(*fresh, 4));
    ASSERT_OK(fresh->Finalize());
    ASSERT_OK(fresh->LoadCheckpoint(root));
    ASSERT_OK(fresh->VerifyMasters());
    EXPECT_EQ(fresh->Stats().step, 3);
    for (size_t i = 0; i < r.size(); ++i) EXPECT_EQ(r.Param(i), saved[i]) << i;
    // The same next step as the original engine.
    absl::StatusOr<std::string> again = fresh->SaveCheckpoint(absl::StrCat(tmp_.path(), "/again", w), 3);
    ASSERT_TRUE(again.ok());
    EXPECT_TRUE(ReadAll(*again) == ReadAll(*dir));
  }
}

// Every corruption of a two-rank checkpoint is refused with an error naming the file, and the
// engine's params, masters and moments are exactly as before.
TEST_F(CheckpointEngineTest, CorruptCheckpointsChangeNothing) {
  Model m(device_.get(), kSizes, 10);
  auto e = Trained(m, {}, 2, 800);
  absl::StatusOr<std::string> w1 = e->SaveCheckpoint(tmp_.path() + "/w1", 2);
  ASSERT_TRUE(w1.ok());
  // Re-written with two ranks.
  absl::StatusOr<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::Open(*w1);
  ASSERT_TRUE(reader.ok());
  std::vector<std::string> bytes;
  std::vector<TensorRecord> records;
  bytes.reserve((*reader)->tensors().size());
  for (const TensorEntry& t : (*reader)->tensors()) {
    bytes.emplace_back(t.bytes, '\0');
    ASSERT_OK((*reader)->ReadTensor(t.name, bytes.back().data(), t.bytes));
    records.push_back({t.name, t.dtype, t.shape, bytes.back().data(), t.bytes, t.kind, t.group});
  }
  absl::StatusOr<std::string> dir = WriteShardedCheckpoint(tmp_.path() + "/w2", 2, records, 2, {}, (*reader)->metadata());
  ASSERT_TRUE(dir.ok()) << dir.status();
  // The engine moves on, so a load would visibly change it.
  m.SetGrads(900);
  ASSERT_OK(e->Step());
  ASSERT_OK(e->Synchronize());
  const std::vector<std::vector<uint16_t>> before = m.Params();
  absl::StatusOr<std::string> state_before = e->SaveCheckpoint(tmp_.path() + "/before", 3);
  ASSERT_TRUE(state_before.ok());
  const std::map<std::string, std::string> expected = ReadAll(*state_before);

  const std::string rank1 = *dir + "/" + RankFileName(1);
  const std::string manifest = *dir + "/manifest.json";
  const std::string rank1_original = ReadWholeFile(rank1), manifest_original = ReadWholeFile(manifest);
  struct Case {
    std::string what, file, contents;
  };
  std::vector<Case> cases;
  auto flipped = [](std::string s, size_t at) {
    s[at] = static_cast<char>(s[at] ^ 0x08);
    return s;
  };
  cases.push_back({"data byte", rank1, flipped(rank1_original, rank1_original.size() - 3)});
  cases.push_back({"header byte", rank1, flipped(rank1_original, 20)});
  cases.push_back({"manifest byte", manifest, flipped(manifest_original, manifest_original.find("\"checksum\"") + 20)});
  cases.push_back({"truncated", rank1, rank1_original.substr(0, rank1_original.size() / 2)});
  cases.push_back({"huge header length", rank1, std::string(8, '\xff') + rank1_original.substr(8)});
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    WriteWholeFile(c.file, c.contents);
    absl::Status s = e->LoadCheckpoint(*dir);
    EXPECT_FALSE(s.ok());
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.file == manifest ? std::string("manifest.json") : RankFileName(1)));
    WriteWholeFile(rank1, rank1_original);
    WriteWholeFile(manifest, manifest_original);
  }
  ASSERT_EQ(::unlink(rank1.c_str()), 0);
  absl::Status s = e->LoadCheckpoint(*dir);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(RankFileName(1)));

  EXPECT_EQ(m.Params(), before);
  ASSERT_OK(e->VerifyMasters());
  absl::StatusOr<std::string> state_after = e->SaveCheckpoint(tmp_.path() + "/after", 3);
  ASSERT_TRUE(state_after.ok());
  EXPECT_TRUE(ReadAll(*state_after) == expected);
}

// A corrupt newest checkpoint: refused by default; with fall_back_to_previous, the newest older
// checkpoint that verifies is loaded instead (never a newer one, never an incomplete one).
TEST_F(CheckpointEngineTest, FallsBackToThePreviousCompleteCheckpoint) {
  Model m(device_.get(), kSizes, 11);
  auto e = Trained(m, {}, 1, 1000);
  const std::string root = tmp_.path() + "/run";
  ASSERT_TRUE(e->SaveCheckpoint(root, 1).ok());
  const std::vector<std::vector<uint16_t>> at1 = m.Params();
  for (int step = 2; step <= 3; ++step) {
    m.SetGrads(static_cast<uint64_t>(1000 + step));
    ASSERT_OK(e->Step());
    ASSERT_OK(e->Synchronize());
    ASSERT_TRUE(e->SaveCheckpoint(root, step).ok());
  }
  // Step 2 and 3 corrupt (3 is `latest`); a stray incomplete step 4 lies around.
  for (const char* d : {"/step-00000002/", "/step-00000003/"}) {
    const std::string f = root + d + RankFileName(0);
    std::string s = ReadWholeFile(f);
    s[s.size() - 1] = static_cast<char>(s[s.size() - 1] ^ 1);
    WriteWholeFile(f, s);
  }
  std::filesystem::create_directory(root + "/step-00000004.incomplete");

  Model r(device_.get(), kSizes, 99);
  auto fresh = MakeEngine({});
  ASSERT_OK(r.Register(*fresh, 4));
  ASSERT_OK(fresh->Finalize());
  const std::vector<std::vector<uint16_t>> untouched = r.Params();
  absl::Status s = fresh->LoadCheckpoint(root);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_EQ(r.Params(), untouched);
  ASSERT_OK(fresh->LoadCheckpoint(root, {.fall_back_to_previous = true}));
  EXPECT_EQ(r.Params(), at1);
  EXPECT_EQ(fresh->Stats().step, 1);
  ASSERT_OK(fresh->VerifyMasters());
  // Given the corrupt directory itself, the fall-back also goes to an older one.
  Model r2(device_.get(), kSizes, 98);
  auto fresh2 = MakeEngine({});
  ASSERT_OK(r2.Register(*fresh2, 4));
  ASSERT_OK(fresh2->Finalize());
  ASSERT_OK(fresh2->LoadCheckpoint(root + "/step-00000002", {.fall_back_to_previous = true}));
  EXPECT_EQ(r2.Params(), at1);
}

// skip = optimizer through an async save: the checkpoint says so, holds no moments, and a load
// resets the moments and re-syncs nothing stale (masters verify).
TEST_F(CheckpointEngineTest, AsyncSaveHonoursPolicySkips) {
  Model m(device_.get(), kSizes, 12);
  auto e = Trained(m, {{"async", "1"}, {"skip_optimizer", "1"}}, 2, 1100);
  absl::StatusOr<std::string> dir = e->SaveCheckpoint(tmp_.path() + "/skip", 2);
  ASSERT_TRUE(dir.ok());
  ASSERT_OK(e->WaitCheckpoint());
  absl::StatusOr<std::unique_ptr<CheckpointReader>> r = CheckpointReader::Open(*dir);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ((*r)->tensors().size(), kSizes.size() * 2);
  ASSERT_EQ((*r)->skipped().size(), 1u);
  EXPECT_EQ((*r)->skipped()[0].what, "optimizer");
  EXPECT_EQ((*r)->Find("p0:exp_avg"), nullptr);
}

}  // namespace
}  // namespace ferry
