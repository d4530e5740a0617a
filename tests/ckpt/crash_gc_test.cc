// Crash garbage of a checkpoint root (ckpt/checkpoint_gc.h): leftovers of crashed saves are removed
// at the next save, never a directory a live save (of this or another process) holds, never
// anything outside the root or not named exactly like a leftover; and saves killed with SIGKILL at
// random points (sync and async, 1 and 3 ranks) leave at most one leftover, which the next save
// removes, with `latest` always loading.
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "ckpt/checkpoint.h"
#include "ckpt/checkpoint_writer.h"
#include "ckpt/ckpt_test_util.h"
#include "ckpt/posix_file.h"
#include "ferry/comm.h"
#include "ferry/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ferry {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using namespace ::ferry::ckpt_test;  // NOLINT

void MakeDir(const std::string& path) { ASSERT_EQ(::mkdir(path.c_str(), 0755), 0) << path; }

// A directory holding one file of `bytes` bytes.
void MakeDirWithFile(const std::string& dir, size_t bytes) {
  MakeDir(dir);
  WriteWholeFile(dir + "/rank-00000.safetensors", std::string(bytes, 'x'));
}

// The real directories of `root` named step-<digits>.incomplete or .deleting.
std::vector<std::string> Leftovers(const std::string& root) {
  std::vector<std::string> out;
  absl::StatusOr<std::vector<std::string>> names = ListDir(root);
  if (!names.ok()) return out;
  for (const std::string& n : *names) {
    struct stat st;
    const bool is_dir = ::lstat((root + "/" + n).c_str(), &st) == 0 && S_ISDIR(st.st_mode);
    if (is_dir && (ParseStepDirNameWithSuffix(n, kCheckpointIncompleteSuffix).has_value() ||
                   ParseStepDirNameWithSuffix(n, kCheckpointDeletingSuffix).has_value())) {
      out.push_back(n);
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::string> Names(const std::vector<StaleCheckpointDir>& dirs) {
  std::vector<std::string> out;
  for (const StaleCheckpointDir& d : dirs) out.push_back(d.name);
  return out;
}

// Decoys beside and inside a root: nothing of them may change. `outside` holds a file that
// symlinks in the root point to, under names a collector must refuse.
struct Decoys {
  std::string outside, root;

  void Plant() {
    MakeDirWithFile(outside, 1000);
    MakeDirWithFile(root + "/step-00000001.incomplete.bak", 10);  // not exactly the pattern
    MakeDirWithFile(root + "/notes.deleting", 10);
    MakeDirWithFile(root + "/step-0000000x.incomplete", 10);
    WriteWholeFile(root + "/step-99999997.deleting", "a file, not a directory");
    ASSERT_EQ(::symlink(outside.c_str(), (root + "/step-99999998.incomplete").c_str()), 0);
    ASSERT_EQ(::symlink(outside.c_str(), (root + "/step-99999999.deleting").c_str()), 0);
  }
  void ExpectIntact() const {
    EXPECT_EQ(ReadWholeFile(outside + "/rank-00000.safetensors"), std::string(1000, 'x'));
    EXPECT_TRUE(Exists(root + "/step-00000001.incomplete.bak/rank-00000.safetensors"));
    EXPECT_TRUE(Exists(root + "/notes.deleting/rank-00000.safetensors"));
    EXPECT_TRUE(Exists(root + "/step-0000000x.incomplete/rank-00000.safetensors"));
    EXPECT_EQ(ReadWholeFile(root + "/step-99999997.deleting"), "a file, not a directory");
    struct stat st;
    EXPECT_TRUE(::lstat((root + "/step-99999998.incomplete").c_str(), &st) == 0 && S_ISLNK(st.st_mode));
    EXPECT_TRUE(::lstat((root + "/step-99999999.deleting").c_str(), &st) == 0 && S_ISLNK(st.st_mode));
  }
};

// ---- the collector ------------------------------------------------------------------------------

TEST(CheckpointGcTest, RemovesOnlyFreeLeftoversAndNothingOutsideTheRoot) {
  ScratchDir scratch;
  const std::string root = scratch.path() + "/root";
  MakeDir(root);
  Decoys decoys{scratch.path() + "/outside", root};
  decoys.Plant();
  // Crash leftovers with a free lock: an .incomplete with a symlink to outside inside it, and a
  // .deleting.
  {
    CKPT_ASSERT_OK_AND_ASSIGN(SaveLock l, SaveLock::CreateDir(root + "/step-00000005.incomplete"));
    WriteWholeFile(root + "/step-00000005.incomplete/rank-00000.safetensors", std::string(300, 'a'));
    ASSERT_EQ(::symlink(decoys.outside.c_str(), (root + "/step-00000005.incomplete/escape").c_str()), 0);
    CKPT_ASSERT_OK_AND_ASSIGN(SaveLock d, SaveLock::CreateDir(root + "/step-00000003.deleting"));
    WriteWholeFile(root + "/step-00000003.deleting/manifest.json", std::string(40, 'm'));
  }  // both released: their writers "died"
  // Held by a live save of this process.
  CKPT_ASSERT_OK_AND_ASSIGN(SaveLock held, SaveLock::CreateDir(root + "/step-00000006.incomplete"));
  WriteWholeFile(root + "/step-00000006.incomplete/rank-00000.safetensors", "in flight");
  // Without a lock file: empty (a save killed as it began), and with content (an older Ferry's).
  MakeDir(root + "/step-00000007.incomplete");
  MakeDirWithFile(root + "/step-00000008.incomplete", 20);
  // A lock file that is not a regular file: left alone.
  MakeDirWithFile(root + "/step-00000009.incomplete", 50);
  MakeDir(root + "/step-00000009.incomplete/.ferry-save.lock");

  CKPT_ASSERT_OK_AND_ASSIGN(std::vector<StaleCheckpointDir> found, FindStaleCheckpoints(root));
  ASSERT_THAT(Names(found), ElementsAre("step-00000003.deleting", "step-00000005.incomplete",
                                        "step-00000006.incomplete", "step-00000007.incomplete",
                                        "step-00000008.incomplete", "step-00000009.incomplete"));
  const std::vector<bool> removable = {true, true, false, true, true, false};
  const std::vector<uint64_t> bytes = {40, 300, 9, 0, 20, 50};
  for (size_t i = 0; i < found.size(); ++i) {
    EXPECT_EQ(found[i].removable, removable[i]) << found[i].name << ": " << found[i].reason;
    EXPECT_EQ(found[i].bytes, bytes[i]) << found[i].name;  // the symlink counts nothing of its target
  }
  EXPECT_THAT(found[2].reason, HasSubstr("in use"));
  EXPECT_THAT(found[5].reason, HasSubstr("not a regular file"));
  // Probing changed nothing.
  EXPECT_EQ(Leftovers(root).size(), 6u);
  EXPECT_FALSE(Exists(root + "/step-00000008.incomplete/.ferry-save.lock"));

  std::vector<StaleCheckpointDir> removed = CollectStaleCheckpoints(root, /*sync=*/true);
  EXPECT_THAT(Names(removed), ElementsAre("step-00000003.deleting", "step-00000005.incomplete",
                                          "step-00000007.incomplete", "step-00000008.incomplete"));
  EXPECT_THAT(Leftovers(root), ElementsAre("step-00000006.incomplete", "step-00000009.incomplete"));
  EXPECT_EQ(ReadWholeFile(root + "/step-00000006.incomplete/rank-00000.safetensors"), "in flight");
  decoys.ExpectIntact();

  // Once its writer is gone, the live one is garbage too.
  held.Release();
  removed = CollectStaleCheckpoints(root, /*sync=*/false);
  EXPECT_THAT(Names(removed), ElementsAre("step-00000006.incomplete"));
  decoys.ExpectIntact();
}

// A save of another live process holds its directory: neither a collection nor a save of the same
// step in this process takes it; once that process is killed, the next save removes it.
TEST(CheckpointGcTest, NeverTakesTheDirectoryOfAnotherLiveProcess) {
  ScratchDir scratch;
  const std::string root = scratch.path() + "/root";
  MakeDir(root);
  const std::string dir = root + "/step-00000004.incomplete";
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    absl::StatusOr<SaveLock> lock = SaveLock::CreateDir(dir);
    if (!lock.ok()) ::_exit(2);
    WriteWholeFile(dir + "/rank-00000.safetensors", "other process");
    char c = 1;
    if (::write(ready[1], &c, 1) != 1) ::_exit(3);
    while (true) ::pause();  // holds the lock until killed
  }
  ::close(ready[1]);
  char c = 0;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  ::close(ready[0]);

  EXPECT_TRUE(CollectStaleCheckpoints(root, false).empty());
  std::mt19937_64 rng(std::random_device{}());
  const std::vector<TestTensor> tensors = {RandomTensor(rng, "w", DType::kF32, {4})};
  CheckpointWriteOptions fast;
  fast.fsync = false;
  absl::StatusOr<std::string> same_step = WriteCheckpoint(root, 4, Records(tensors), {}, {}, fast);
  EXPECT_EQ(same_step.status().code(), absl::StatusCode::kFailedPrecondition) << same_step.status();
  EXPECT_THAT(same_step.status().message(), HasSubstr("step-00000004.incomplete"));
  CKPT_ASSERT_OK(WriteCheckpoint(root, 5, Records(tensors), {}, {}, fast).status());
  EXPECT_EQ(ReadWholeFile(dir + "/rank-00000.safetensors"), "other process");

  ASSERT_EQ(::kill(child, SIGKILL), 0);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  CKPT_ASSERT_OK(WriteCheckpoint(root, 6, Records(tensors), {}, {}, fast).status());
  EXPECT_TRUE(Leftovers(root).empty());
}

// A PendingCheckpoint holds its directory's lock until it is committed or aborted; moving it moves
// that, and one destroyed uncommitted removes its directory (the abort of a failed save).
TEST(CheckpointGcTest, PendingCheckpointLocksItsDirectoryUntilAbortedOrMoved) {
  ScratchDir scratch;
  const std::string root = scratch.path() + "/r";
  CheckpointWriteOptions fast;
  fast.fsync = false;
  std::optional<PendingCheckpoint> target;
  {
    CKPT_ASSERT_OK_AND_ASSIGN(PendingCheckpoint p, PendingCheckpoint::Begin(root, 1, fast));
    target.emplace(std::move(p));
  }  // the moved-from one is gone: the directory stays, still locked
  ASSERT_TRUE(Exists(target->dir()));
  CKPT_ASSERT_OK_AND_ASSIGN(std::vector<StaleCheckpointDir> found, FindStaleCheckpoints(root));
  ASSERT_EQ(found.size(), 1u);
  EXPECT_FALSE(found[0].removable) << found[0].reason;
  const std::string dir = target->dir();
  target.reset();  // uncommitted: aborted
  EXPECT_FALSE(Exists(dir));
  CKPT_ASSERT_OK_AND_ASSIGN(found, FindStaleCheckpoints(root));
  EXPECT_TRUE(found.empty());
}

// ---- SIGKILL at random points -------------------------------------------------------------------

struct CrashConfig {
  int ranks = 1;
  bool async = false;
};

// One save of `step` by `ranks` ranks of this process (threads over thread comms for 3), through
// CheckpointWriter: Write (sync) or Start then, while it runs, work, then Wait (async).
absl::Status SaveWithRanks(const CrashConfig& cfg, const std::string& root, int64_t step,
                           const std::vector<TensorRecord>& records, std::vector<CheckpointWriter>& writers,
                           std::vector<std::unique_ptr<Comm>>& comms) {
  CheckpointWriteOptions options;  // fsync on, as a trainer's
  options.keep_last = 2;
  absl::StatusOr<CheckpointShards> shards = CheckpointShards::Plan(records, cfg.ranks);
  if (!shards.ok()) return shards.status();
  std::vector<absl::Status> results(static_cast<size_t>(cfg.ranks));
  auto rank_save = [&](int r) {
    CheckpointJob job;
    job.root = root;
    job.step = step;
    job.tensors = records;
    job.metadata = {{"step", absl::StrCat(step)}};
    job.options = options;
    if (cfg.ranks > 1) {
      job.comm = comms[static_cast<size_t>(r)].get();
      job.comm_timeout = absl::Seconds(30);
      job.pieces = shards->pieces(r);
    }
    CheckpointWriter& w = writers[static_cast<size_t>(r)];
    if (!cfg.async) {
      results[static_cast<size_t>(r)] = w.Write(job).status();
      return;
    }
    absl::Status s = w.Start(std::move(job));
    volatile uint64_t work = 0;  // the trainer goes on meanwhile
    for (int i = 0; s.ok() && i < 200000; ++i) work = work + static_cast<uint64_t>(i);
    results[static_cast<size_t>(r)] = s.ok() ? w.Wait() : s;
  };
  if (cfg.ranks == 1) {
    rank_save(0);
  } else {
    std::vector<std::thread> threads;
    for (int r = 0; r < cfg.ranks; ++r) threads.emplace_back(rank_save, r);
    for (std::thread& t : threads) t.join();
  }
  for (const absl::Status& s : results) FERRY_RETURN_IF_ERROR(s);
  return absl::OkStatus();
}

// For each configuration, a child process saves every "step" in a loop; the parent kills it with
// SIGKILL after a random delay, 8 times. After each kill: the leftovers are counted (at most one:
// a save is killed in one place), `latest` loads and verifies, then the parent's next save (same
// ranks and mode) succeeds and leaves no leftover, and the decoys are intact.
TEST(CheckpointGcTest, SavesKilledAtRandomPointsLeaveAtMostOneLeftoverWhichTheNextSaveRemoves) {
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  std::vector<TestTensor> tensors;
  for (int i = 0; i < 10; ++i) {
    tensors.push_back(RandomTensor(rng, absl::StrCat("t", i), i % 2 ? DType::kF32 : DType::kBF16,
                                   {static_cast<int64_t>(30000 + 7 * i)}, i % 3 == 0 ? "model" : "exp_avg"));
  }
  const std::vector<TensorRecord> records = Records(tensors);
  constexpr int kKillsPerConfig = 8;
  const CrashConfig configs[] = {{1, false}, {1, true}, {3, false}, {3, true}};
  int kills = 0, left_incomplete = 0, left_deleting = 0, left_none = 0, max_left = 0, after_save = 0;
  for (const CrashConfig& cfg : configs) {
    SCOPED_TRACE(testing::Message() << cfg.ranks << " ranks, " << (cfg.async ? "async" : "sync"));
    ScratchDir scratch;
    const std::string root = scratch.path() + "/root";
    MakeDir(root);
    Decoys decoys{scratch.path() + "/outside", root};
    decoys.Plant();
    {
      std::vector<CheckpointWriter> writers(static_cast<size_t>(cfg.ranks));
      std::vector<std::unique_ptr<Comm>> comms = MakeThreadComms(cfg.ranks);
      CKPT_ASSERT_OK(SaveWithRanks(cfg, root, 0, records, writers, comms));
    }
    int64_t next_step = 1;
    for (int round = 0; round < kKillsPerConfig; ++round) {
      const pid_t child = ::fork();
      ASSERT_GE(child, 0);
      if (child == 0) {  // saves forever until killed; _exit, never back into gtest
        std::vector<CheckpointWriter> writers(static_cast<size_t>(cfg.ranks));
        std::vector<std::unique_ptr<Comm>> comms = MakeThreadComms(cfg.ranks);
        for (int64_t step = next_step;; ++step) {
          if (!SaveWithRanks(cfg, root, step, records, writers, comms).ok()) ::_exit(3);
        }
      }
      std::this_thread::sleep_for(std::chrono::microseconds(5000 + rng() % 60000));
      ASSERT_EQ(::kill(child, SIGKILL), 0);
      int status = 0;
      ASSERT_EQ(::waitpid(child, &status, 0), child);
      ASSERT_TRUE(WIFSIGNALED(status)) << "the child stopped by itself: status " << status;
      ++kills;

      const std::vector<std::string> left = Leftovers(root);
      EXPECT_LE(left.size(), 1u) << "after kill " << round;
      max_left = std::max<int>(max_left, static_cast<int>(left.size()));
      if (left.empty()) ++left_none;
      for (const std::string& n : left) (n.find(".incomplete") != std::string::npos ? left_incomplete : left_deleting)++;
      // `latest` always loads.
      CKPT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CheckpointReader> reader, CheckpointReader::Open(root));
      CKPT_ASSERT_OK(reader->VerifyAll());
      for (const TestTensor& t : tensors) {
        std::vector<uint8_t> out(t.data.size());
        CKPT_ASSERT_OK(reader->ReadTensor(t.name, out.data(), out.size()));
        ASSERT_TRUE(out == t.data) << t.name;
      }
      // The next successful save, beyond every step the child may have reached.
      CKPT_ASSERT_OK_AND_ASSIGN(std::vector<std::string> committed, ListCheckpoints(root));
      next_step = reader->step() + 1;
      for (const std::string& n : left) next_step = std::max<int64_t>(next_step, std::stoll(n.substr(5, 8)) + 1);
      for (const std::string& c : committed) {
        next_step = std::max<int64_t>(next_step, *ParseStepDirName(PathBaseName(c)) + 1);
      }
      {
        std::vector<CheckpointWriter> writers(static_cast<size_t>(cfg.ranks));
        std::vector<std::unique_ptr<Comm>> comms = MakeThreadComms(cfg.ranks);
        CKPT_ASSERT_OK(SaveWithRanks(cfg, root, next_step, records, writers, comms));
      }
      const std::vector<std::string> after = Leftovers(root);
      after_save = std::max<int>(after_save, static_cast<int>(after.size()));
      EXPECT_TRUE(after.empty()) << "after the save following kill " << round << ": " << after.front();
      CKPT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CheckpointReader> last, CheckpointReader::Open(root));
      EXPECT_EQ(last->step(), next_step);
      ++next_step;
      decoys.ExpectIntact();
    }
  }
  std::fprintf(stderr,
               "crash GC: %d kills; leftovers right after a kill: %d .incomplete, %d .deleting, %d kills left "
               "none, at most %d at once; at most %d after the next save\n",
               kills, left_incomplete, left_deleting, left_none, max_left, after_save);
  RecordProperty("kills", kills);
  RecordProperty("left_incomplete", left_incomplete);
  RecordProperty("left_deleting", left_deleting);
}

}  // namespace
}  // namespace ferry
