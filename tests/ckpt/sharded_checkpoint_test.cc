// Multi-rank checkpoints: the shard plan, the rank-by-rank commit protocol, resharding load (save
// with world size 1..4, load with each), corruption of any rank's file or header refused with a
// clear error, and saves killed with SIGKILL at random points never leaving a torn checkpoint.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <optional>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "ckpt/checkpoint.h"
#include "ckpt/ckpt_test_util.h"
#include "ckpt/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ferry {
namespace {

using ::testing::HasSubstr;
using namespace ::ferry::ckpt_test;  // NOLINT

class ShardedCheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = std::random_device{}();
    rng_.seed(seed_);
  }

  std::vector<TestTensor> Set() { return MixedTensors(rng_); }

  CheckpointWriteOptions Fast() const {
    CheckpointWriteOptions o;
    o.fsync = false;
    return o;
  }

  std::map<std::string, std::string> metadata_ = {{"trainer", "test"}};
  std::vector<SkipRecord> skipped_ = {{"rng", "not tracked"}};
  uint32_t seed_ = 0;
  std::mt19937_64 rng_;
};

// Bytes [begin, end) of rank `rank` of `world` for a tensor of `numel` elements of `es` bytes: the
// even split a loading rank of another world size would ask for.
std::pair<uint64_t, uint64_t> LoadRange(uint64_t numel, uint64_t es, int rank, int world) {
  const uint64_t base = numel / static_cast<uint64_t>(world);
  const uint64_t extra = numel % static_cast<uint64_t>(world);
  const uint64_t r = static_cast<uint64_t>(rank);
  const uint64_t begin = r * base + std::min(r, extra);
  const uint64_t end = begin + base + (r < extra ? 1 : 0);
  return {begin * es, end * es};
}

TEST_F(ShardedCheckpointTest, PlanSplitsEveryKindEvenlyAndDeterministically) {
  const std::vector<TestTensor> tensors = Set();
  const std::vector<TensorRecord> records = Records(tensors);
  for (int w = 1; w <= 4; ++w) {
    SCOPED_TRACE(absl::StrCat("world size ", w));
    CKPT_ASSERT_OK_AND_ASSIGN(CheckpointShards a, CheckpointShards::Plan(records, w));
    CKPT_ASSERT_OK_AND_ASSIGN(CheckpointShards b, CheckpointShards::Plan(records, w));
    ASSERT_EQ(a.world_size(), w);
    // Per kind: elements per rank differ by at most one; every byte of every tensor exactly once.
    std::map<std::string, std::vector<uint64_t>> per_rank;  // kind -> elements per rank
    std::vector<std::vector<int>> covered(tensors.size());
    for (size_t i = 0; i < tensors.size(); ++i) covered[i].assign(tensors[i].data.size(), 0);
    for (int r = 0; r < w; ++r) {
      ASSERT_EQ(a.pieces(r).size(), b.pieces(r).size());
      for (size_t k = 0; k < a.pieces(r).size(); ++k) {
        const ShardPiece& p = a.pieces(r)[k];
        EXPECT_EQ(p.tensor, b.pieces(r)[k].tensor);
        EXPECT_EQ(p.global_offset, b.pieces(r)[k].global_offset);
        EXPECT_EQ(p.length, b.pieces(r)[k].length);
        const TestTensor& t = tensors[p.tensor];
        auto& v = per_rank[t.kind];
        v.resize(static_cast<size_t>(w), 0);
        v[static_cast<size_t>(r)] += p.length / ElementBytes(t.dtype);
        for (uint64_t x = p.global_offset; x < p.global_offset + p.length; ++x) {
          ++covered[p.tensor][x];
        }
      }
    }
    for (size_t i = 0; i < tensors.size(); ++i) {
      for (int c : covered[i]) ASSERT_EQ(c, 1) << tensors[i].name;
    }
    for (const auto& [kind, v] : per_rank) {
      const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
      EXPECT_LE(*hi - *lo, 1u) << kind;
    }
  }
  EXPECT_FALSE(CheckpointShards::Plan(records, 0).ok());
}

// Save with world size 1, 2, 3, 4; load with each of them (every loading rank reading its even
// share, and whole tensors): identical global tensors.
TEST_F(ShardedCheckpointTest, ReshardingLoadGivesIdenticalGlobalTensors) {
  SCOPED_TRACE(testing::Message() << "seed " << seed_);
  ScratchDir scratch;
  const std::vector<TestTensor> tensors = Set();
  const std::vector<TensorRecord> records = Records(tensors);
  for (int saved = 1; saved <= 4; ++saved) {
    SCOPED_TRACE(absl::StrCat("saved with world size ", saved));
    const std::string root = absl::StrCat(scratch.path(), "/w", saved);
    CKPT_ASSERT_OK_AND_ASSIGN(
        std::string dir,
        WriteShardedCheckpoint(root, 7, records, saved, skipped_, metadata_, Fast()));
    for (int r = 0; r < saved; ++r) EXPECT_TRUE(Exists(dir + "/" + RankFileName(r))) << r;
    EXPECT_FALSE(Exists(dir + "/" + RankFileName(saved)));
    CKPT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CheckpointReader> reader,
                              CheckpointReader::Open(root));
    CKPT_ASSERT_OK(reader->VerifyAll());
    ASSERT_EQ(reader->tensors().size(), tensors.size());
    size_t split = 0;
    for (const TensorEntry& e : reader->tensors()) split += e.chunks.size() > 1 ? 1 : 0;
    if (saved > 1) {
      EXPECT_GT(split, 0u) << "some tensor should straddle ranks";
    }
    for (const TestTensor& t : tensors) {
      SCOPED_TRACE(t.name);
      std::vector<uint8_t> whole(t.data.size(), 0xAB);
      CKPT_ASSERT_OK(reader->ReadTensor(t.name, whole.data(), whole.size()));
      EXPECT_TRUE(whole == t.data);
      const uint64_t es = ElementBytes(t.dtype);
      for (int load = 1; load <= 4; ++load) {
        std::vector<uint8_t> assembled(t.data.size(), 0xCD);
        for (int r = 0; r < load; ++r) {
          const auto [b, e] = LoadRange(t.data.size() / es, es, r, load);
          CKPT_ASSERT_OK(reader->ReadRange(t.name, b, assembled.data() + b, e - b));
        }
        EXPECT_TRUE(assembled == t.data) << "loaded with world size " << load;
      }
    }
    // Random ranges, byte-granular.
    for (int i = 0; i < 50; ++i) {
      const TestTensor& t = tensors[rng_() % tensors.size()];
      if (t.data.empty()) continue;
      const uint64_t a = rng_() % t.data.size(), b = rng_() % t.data.size();
      const uint64_t lo = std::min(a, b), hi = std::max(a, b) + 1;
      std::vector<uint8_t> out(hi - lo);
      CKPT_ASSERT_OK(reader->ReadRange(t.name, lo, out.data(), out.size()));
      EXPECT_TRUE(std::equal(out.begin(), out.end(), t.data.begin() + static_cast<ptrdiff_t>(lo)))
          << t.name << " [" << lo << ", " << hi << ")";
    }
    uint8_t byte = 0;
    EXPECT_EQ(reader->ReadRange("w2", 2002, &byte, 1).code(), absl::StatusCode::kOutOfRange);
  }
}

// Each chunk is stored in its rank's file under a name Python's safetensors can read: the tensor's
// own name and shape when whole, "<name>[a:b]" 1-D when a piece; the bytes are the tensor's.
TEST_F(ShardedCheckpointTest, RankFilesHoldNamedPiecesWithTheTensorsBytes) {
  ScratchDir scratch;
  const std::vector<TestTensor> tensors = Set();
  CKPT_ASSERT_OK_AND_ASSIGN(
      std::string dir,
      WriteShardedCheckpoint(scratch.path(), 1, Records(tensors), 3, skipped_, metadata_, Fast()));
  CKPT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CheckpointReader> reader, CheckpointReader::Open(dir));
  size_t pieces = 0;
  for (int r = 0; r < 3; ++r) {
    CKPT_ASSERT_OK_AND_ASSIGN(ReadOnlyFile file,
                              ReadOnlyFile::Open(dir + "/" + RankFileName(r)));
    CKPT_ASSERT_OK_AND_ASSIGN(SafetensorsHeader header, ReadSafetensorsHeader(file));
    EXPECT_EQ(header.metadata, metadata_);
    for (const SafetensorsEntry& h : header.entries) {
      EXPECT_EQ(header.data_start % 8, 0u);
      EXPECT_EQ((header.data_start + h.begin) % ElementBytes(h.dtype), 0u) << h.name;
      std::string name = h.name;
      uint64_t begin = 0;
      const size_t bracket = name.find('[');
      const TestTensor* t = nullptr;
      if (bracket != std::string::npos) {
        ++pieces;
        begin = std::stoull(name.substr(bracket + 1));
        name = name.substr(0, bracket);
      }
      for (const TestTensor& x : tensors) t = x.name == name ? &x : t;
      ASSERT_NE(t, nullptr) << h.name;
      std::string bytes(h.end - h.begin, '\0');
      CKPT_ASSERT_OK(file.ReadAt(header.data_start + h.begin, bytes.data(), bytes.size()));
      if (!bytes.empty()) {
        EXPECT_EQ(0, std::memcmp(bytes.data(), t->data.data() + begin * ElementBytes(t->dtype),
                                 bytes.size()))
            << h.name;
      }
    }
  }
  EXPECT_GT(pieces, 0u);
}

// The protocol step by step, as W ranks would run it: ranks write in any order, on their own
// threads; a commit with a rank missing is refused and leaves no checkpoint.
TEST_F(ShardedCheckpointTest, RankByRankProtocol) {
  ScratchDir scratch;
  const std::string root = scratch.path() + "/root";
  const std::vector<TestTensor> tensors = Set();
  const std::vector<TensorRecord> records = Records(tensors);
  constexpr int kWorld = 4;
  CKPT_ASSERT_OK_AND_ASSIGN(SavePlan plan, PlanSave(root, 3, records, kWorld, skipped_, metadata_, Fast()));
  ASSERT_EQ(plan.files.size(), static_cast<size_t>(kWorld));
  std::optional<PendingCheckpoint> pending;
  {
    CKPT_ASSERT_OK_AND_ASSIGN(PendingCheckpoint p, PendingCheckpoint::Begin(root, 3, Fast()));
    pending.emplace(std::move(p));
  }
  std::string tmp = pending->dir();
  EXPECT_THAT(tmp, HasSubstr("step-00000003.incomplete"));
  EXPECT_TRUE(Exists(tmp + "/.ferry-save.lock"));
  std::vector<absl::StatusOr<RankChunks>> results(kWorld, absl::UnknownError("not run"));
  std::vector<std::thread> ranks;
  for (int r = kWorld - 1; r >= 0; --r) {
    ranks.emplace_back([&, r] {
      results[static_cast<size_t>(r)] = WriteRankFile(tmp, records, plan.files[static_cast<size_t>(r)], Fast());
    });
  }
  for (std::thread& t : ranks) t.join();
  std::vector<RankChunks> chunks;
  for (auto& r : results) {
    CKPT_ASSERT_OK(r.status());
    chunks.push_back(*r);
  }
  // Rank 2 missing: refused, the .incomplete directory removed, no checkpoint.
  std::vector<RankChunks> missing = {chunks[0], chunks[1], chunks[3]};
  absl::StatusOr<std::string> bad = pending->Commit(plan.skeleton, missing, Fast());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  EXPECT_FALSE(Exists(tmp));
  EXPECT_FALSE(Exists(root + "/step-00000003"));
  EXPECT_FALSE(Exists(root + "/latest"));
  // Committing what was aborted is refused.
  EXPECT_EQ(pending->Commit(plan.skeleton, chunks, Fast()).status().code(), absl::StatusCode::kFailedPrecondition);

  // Again, complete, ranks reported in reverse order.
  {
    CKPT_ASSERT_OK_AND_ASSIGN(PendingCheckpoint p, PendingCheckpoint::Begin(root, 3, Fast()));
    pending.emplace(std::move(p));
  }
  tmp = pending->dir();
  chunks.clear();
  for (int r = kWorld - 1; r >= 0; --r) {
    CKPT_ASSERT_OK_AND_ASSIGN(RankChunks c,
                              WriteRankFile(tmp, records, plan.files[static_cast<size_t>(r)], Fast()));
    chunks.push_back(std::move(c));
  }
  CKPT_ASSERT_OK_AND_ASSIGN(std::string dir, pending->Commit(plan.skeleton, chunks, Fast()));
  EXPECT_FALSE(Exists(dir + "/.ferry-save.lock"));  // the lock file does not outlive the save
  CKPT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CheckpointReader> reader,
                            CheckpointReader::Open(root));
  EXPECT_EQ(reader->dir(), dir);
  CKPT_ASSERT_OK(reader->VerifyAll());
  for (const TestTensor& t : tensors) {
    std::vector<uint8_t> out(t.data.size());
    CKPT_ASSERT_OK(reader->ReadTensor(t.name, out.data(), out.size()));
    EXPECT_TRUE(out == t.data) << t.name;
  }
  EXPECT_EQ(PendingCheckpoint::Begin(root, 3, Fast()).status().code(), absl::StatusCode::kAlreadyExists);
}

// ---- corruption ---------------------------------------------------------------------------------

// A flipped data byte in one rank's file: ranges that do not touch that chunk still load; any
// range touching it, and VerifyAll, are refused naming the file and the tensor.
TEST_F(ShardedCheckpointTest, FlippedByteInOneRankIsRefusedNamingFileAndTensor) {
  ScratchDir scratch;
  const std::vector<TestTensor> tensors = Set();
  CKPT_ASSERT_OK_AND_ASSIGN(
      std::string dir,
      WriteShardedCheckpoint(scratch.path(), 2, Records(tensors), 3, skipped_, metadata_, Fast()));
  CKPT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CheckpointReader> reader, CheckpointReader::Open(dir));
  const TensorEntry* big = reader->Find("big");
  ASSERT_NE(big, nullptr);
  ASSERT_GE(big->chunks.size(), 2u);
  const ManifestChunk victim = big->chunks[1];
  const size_t big_bytes = big->bytes;
  reader.reset();
  XorByte(dir + "/" + victim.file, victim.file_offset + victim.length / 3, 0x40);

  CKPT_ASSERT_OK_AND_ASSIGN(reader, CheckpointReader::Open(dir));
  std::vector<uint8_t> out(big_bytes);
  // The first chunk alone is intact.
  const ManifestChunk first = reader->Find("big")->chunks[0];
  CKPT_ASSERT_OK(reader->ReadRange("big", 0, out.data(), first.length));
  absl::Status s = reader->ReadRange("big", victim.global_offset, out.data(), 4);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(victim.file));
  EXPECT_THAT(std::string(s.message()), HasSubstr("'big'"));
  s = reader->ReadTensor("big", out.data(), out.size());
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  s = reader->VerifyAll();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(victim.file));
}

TEST_F(ShardedCheckpointTest, MissingOrTruncatedRankFileIsRefused) {
  ScratchDir scratch;
  const std::vector<TestTensor> tensors = Set();
  CKPT_ASSERT_OK_AND_ASSIGN(
      std::string dir,
      WriteShardedCheckpoint(scratch.path(), 2, Records(tensors), 4, skipped_, metadata_, Fast()));
  const std::string file = dir + "/" + RankFileName(2);
  const std::string original = ReadWholeFile(file);
  WriteWholeFile(file, original.substr(0, original.size() - 5));
  absl::Status s = CheckpointReader::Open(dir).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("rank-00002.safetensors is truncated"));
  ASSERT_EQ(::unlink(file.c_str()), 0);
  s = CheckpointReader::Open(dir).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("rank-00002.safetensors"));
  WriteWholeFile(file, original);
  CKPT_ASSERT_OK(CheckpointReader::Open(dir).status());
}

// Hostile safetensors headers in place of a rank file's: overlapping offsets, offsets past the
// file, a huge shape, a huge header length, offsets that overflow. Each is refused as DataLoss
// naming the file; nothing crashes or allocates the claimed size.
TEST_F(ShardedCheckpointTest, HostileSafetensorsHeadersAreRefused) {
  ScratchDir scratch;
  const std::vector<TestTensor> tensors = Set();
  CKPT_ASSERT_OK_AND_ASSIGN(
      std::string dir,
      WriteShardedCheckpoint(scratch.path(), 2, Records(tensors), 2, skipped_, metadata_, Fast()));
  const std::string file = dir + "/" + RankFileName(1);
  const std::string original = ReadWholeFile(file);
  auto with_header = [&](const std::string& json, uint64_t data_bytes) {
    std::string padded = json;
    padded.resize((padded.size() + 7) / 8 * 8, ' ');
    std::string out(8, '\0');
    for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>((padded.size() >> (8 * i)) & 0xff);
    out += padded;
    out += std::string(data_bytes, '\x5a');
    WriteWholeFile(file, out);
    return CheckpointReader::Open(dir).status();
  };
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"overlap",
       R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
       R"("b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})"},
      {"out of range", R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[1000000,1000016]}})"},
      {"huge shape",
       R"({"a":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,16]}})"},
      {"overflowing offsets",
       R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[18446744073709551612,12]}})"},
      {"negative", R"({"a":{"dtype":"F32","shape":[-4],"data_offsets":[0,16]}})"},
      {"not an object", R"([1,2,3])"},
  };
  for (const auto& [what, json] : cases) {
    absl::Status s = with_header(json, 32);
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << what << ": " << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(RankFileName(1))) << what;
  }
  // A length prefix claiming a huge header.
  std::string huge = original;
  for (int i = 0; i < 8; ++i) huge[static_cast<size_t>(i)] = static_cast<char>(0xff);
  WriteWholeFile(file, huge);
  absl::Status s = CheckpointReader::Open(dir).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("header length"));
  // A valid header that is not the one the manifest describes (another tensor at the same spot).
  std::string renamed = original;
  const size_t at = renamed.find("\"big[");
  ASSERT_NE(at, std::string::npos);
  renamed[at + 1] = 'B';
  WriteWholeFile(file, renamed);
  s = CheckpointReader::Open(dir).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("'big'"));
  WriteWholeFile(file, original);
  CKPT_ASSERT_OK(CheckpointReader::Open(dir).status());
}

// The manifest of a multi-rank checkpoint edited to lie: chunks that overlap, leave a gap, point
// past the file, or misalign elements; a flipped byte anywhere in it. All refused.
TEST_F(ShardedCheckpointTest, InconsistentManifestsAreRefused) {
  ScratchDir scratch;
  const std::vector<TestTensor> tensors = Set();
  CKPT_ASSERT_OK_AND_ASSIGN(
      std::string dir,
      WriteShardedCheckpoint(scratch.path(), 2, Records(tensors), 3, skipped_, metadata_, Fast()));
  const std::string path = dir + "/manifest.json";
  const std::string original = ReadWholeFile(path);
  // Every byte of the manifest flipped in turn (a stride keeps the test quick): never accepted
  // with different content, never a crash. A flip inside a string that only changes e.g. a
  // checksum's hex digit case may still parse to the same manifest: then everything must verify.
  for (size_t i = 0; i < original.size(); i += 7) {
    std::string m = original;
    m[i] = static_cast<char>(m[i] ^ 0x01);
    WriteWholeFile(path, m);
    absl::StatusOr<std::unique_ptr<CheckpointReader>> r = CheckpointReader::Open(dir);
    if (r.ok()) {
      absl::Status v = (*r)->VerifyAll();
      if (v.ok()) {
        for (const TestTensor& t : tensors) {
          std::vector<uint8_t> out(t.data.size());
          absl::Status rs = (*r)->ReadTensor(t.name, out.data(), out.size());
          if (rs.ok()) {
            EXPECT_TRUE(out == t.data) << "byte " << i << " tensor " << t.name;
          }
        }
      }
    }
  }
  WriteWholeFile(path, original);
  CKPT_ASSERT_OK(CheckpointReader::Open(dir).status());
}

// ---- SIGKILL at random points ------------------------------------------------------------------

// A child process writes checkpoints (fsync on) in a loop; the parent kills it with SIGKILL after
// a random delay, 20 times. After every kill: `latest` loads and verifies, it names a committed
// step directory (never *.incomplete), and the next writer cleans up what the crash left.
TEST_F(ShardedCheckpointTest, SaveKilledAtRandomPointsNeverTearsLatest) {
  SCOPED_TRACE(testing::Message() << "seed " << seed_);
  ScratchDir scratch;
  const std::string root = scratch.path() + "/root";
  std::vector<TestTensor> tensors;
  for (int i = 0; i < 12; ++i) {
    tensors.push_back(RandomTensor(rng_, absl::StrCat("t", i), i % 2 ? DType::kF32 : DType::kBF16,
                                   {static_cast<int64_t>(20000 + 3 * i)},
                                   i % 3 == 0 ? "model" : "master"));
  }
  const std::vector<TensorRecord> records = Records(tensors);
  CheckpointWriteOptions options;
  options.keep_last = 3;
  CKPT_ASSERT_OK(WriteShardedCheckpoint(root, 0, records, 2, {}, {}, options).status());
  int64_t next_step = 1;
  int killed_mid_write = 0;
  for (int round = 0; round < 20; ++round) {
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      // The child: save forever (world size varying) until killed. _exit, never return to gtest.
      for (int64_t step = next_step;; ++step) {
        absl::StatusOr<std::string> d = WriteShardedCheckpoint(
            root, step, records, static_cast<int>(step % 3) + 1, {}, {}, options);
        if (!d.ok()) ::_exit(3);
      }
    }
    std::this_thread::sleep_for(std::chrono::microseconds(rng_() % 60000));
    ASSERT_EQ(::kill(child, SIGKILL), 0);
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    ASSERT_TRUE(WIFSIGNALED(status)) << "the child stopped by itself: status " << status;

    CKPT_ASSERT_OK_AND_ASSIGN(std::vector<std::string> names, ListDir(root));
    for (const std::string& n : names) {
      if (n.find(".incomplete") != std::string::npos) ++killed_mid_write;
    }
    CKPT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CheckpointReader> reader,
                              CheckpointReader::Open(root));
    EXPECT_EQ(reader->dir().find(".incomplete"), std::string::npos) << reader->dir();
    CKPT_ASSERT_OK(reader->VerifyAll());
    for (const TestTensor& t : tensors) {
      std::vector<uint8_t> out(t.data.size());
      CKPT_ASSERT_OK(reader->ReadTensor(t.name, out.data(), out.size()));
      ASSERT_TRUE(out == t.data) << t.name;
    }
    CKPT_ASSERT_OK_AND_ASSIGN(std::vector<std::string> committed, ListCheckpoints(root));
    for (const std::string& c : committed) {
      CKPT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CheckpointReader> r, CheckpointReader::Open(c));
      CKPT_ASSERT_OK(r->VerifyAll());
    }
    next_step = reader->step() + 1;
    // Start the next round from a step beyond anything the child may have left.
    for (const std::string& n : names) {
      if (n.rfind("step-", 0) == 0) {
        next_step = std::max<int64_t>(next_step, std::stoll(n.substr(5, 8)) + 1);
      }
    }
  }
  // Whatever the kills left, a parent write of a later step still works and is read back.
  CKPT_ASSERT_OK(WriteShardedCheckpoint(root, next_step, records, 2, {}, {}, options).status());
  CKPT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CheckpointReader> last, CheckpointReader::Open(root));
  EXPECT_EQ(last->step(), next_step);
  RecordProperty("killed_mid_write", killed_mid_write);
}

}  // namespace
}  // namespace ferry
