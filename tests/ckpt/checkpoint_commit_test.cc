// The commit protocol of single-rank checkpoints: `latest`, never overwriting, keep_last, failures
// mid-write and at `latest` rolled back, requests refused before anything is written, stale
// directories, listing.
#include "ckpt/checkpoint_test_fixture.h"

namespace ferry {
namespace {

using namespace ::ferry::checkpoint_test;  // NOLINT

// ---- commit protocol ----------------------------------------------------------------------------

TEST_F(CheckpointTest, LatestNamesTheCheckpointWrittenLast) {
  SCOPED_TRACE(testing::Message() << "seed " << seed_);
  std::vector<TestTensor> last;
  for (int64_t step : {100, 200, 300}) {
    last = SmallSet();
    CKPT_ASSERT_OK(Write(step, last).status());
    EXPECT_EQ(Latest(), absl::StrFormat("step-%08d\n", step));
  }
  CKPT_ASSERT_OK_AND_ASSIGN(auto reader, CheckpointReader::Open(root_));
  EXPECT_EQ(reader->step(), 300);
  EXPECT_EQ(reader->dir(), StepDir(300));
  ExpectReadsBack(*reader, last);
  CKPT_ASSERT_OK_AND_ASSIGN(std::vector<std::string> list, ListCheckpoints(root_));
  EXPECT_THAT(list, ElementsAre(StepDir(100), StepDir(200), StepDir(300)));
  EXPECT_THAT(DirNames(root_),
              ElementsAre("latest", "step-00000100", "step-00000200", "step-00000300"));
}

TEST_F(CheckpointTest, ExistingStepIsNeverOverwritten) {
  SCOPED_TRACE(testing::Message() << "seed " << seed_);
  const std::vector<TestTensor> first = SmallSet();
  CKPT_ASSERT_OK(Write(100, first).status());
  absl::StatusOr<std::string> again = Write(100, SmallSet());
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists) << again.status();
  EXPECT_THAT(std::string(again.status().message()), HasSubstr("step-00000100"));
  EXPECT_EQ(Latest(), "step-00000100\n");
  EXPECT_THAT(DirNames(root_), ElementsAre("latest", "step-00000100"));
  CKPT_ASSERT_OK_AND_ASSIGN(auto reader, CheckpointReader::Open(root_));
  ExpectReadsBack(*reader, first);
}

TEST_F(CheckpointTest, KeepLastDeletesOnlyOlderCheckpointsAndOnlyAfterCommit) {
  SCOPED_TRACE(testing::Message() << "seed " << seed_);
  CheckpointWriteOptions keep3{.keep_last = 3};
  const std::vector<std::vector<std::string>> expected = {
      {"latest", "step-00000001"},
      {"latest", "step-00000001", "step-00000002"},
      {"latest", "step-00000001", "step-00000002", "step-00000003"},
      {"latest", "step-00000002", "step-00000003", "step-00000004"},
      {"latest", "step-00000003", "step-00000004", "step-00000005"}};
  for (int64_t step = 1; step <= 5; ++step) {
    CKPT_ASSERT_OK(Write(step, SmallSet(), keep3).status());
    EXPECT_EQ(DirNames(root_), expected[step - 1]) << "after step " << step;
  }

  // A failed write deletes nothing, whatever keep_last says.
  std::vector<TestTensor> bad = SmallSet();
  std::vector<TensorRecord> records = Records(bad);
  records[1].data = nullptr;
  absl::StatusOr<std::string> failed =
      WriteCheckpoint(root_, 6, records, skipped_, metadata_, {.keep_last = 1});
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kInvalidArgument) << failed.status();
  EXPECT_EQ(DirNames(root_), expected[4]);
  EXPECT_EQ(Latest(), "step-00000005\n");

  // Writing an older step (a run resumed from an earlier checkpoint) never deletes newer ones.
  CKPT_ASSERT_OK(Write(2, SmallSet(), {.keep_last = 1}).status());
  EXPECT_THAT(DirNames(root_), ElementsAre("latest", "step-00000002", "step-00000003",
                                           "step-00000004", "step-00000005"));
  EXPECT_EQ(Latest(), "step-00000002\n");

  // keep_last = 1 keeps just the new one among those at or below its step.
  CKPT_ASSERT_OK(Write(9, SmallSet(), {.keep_last = 1}).status());
  EXPECT_THAT(DirNames(root_), ElementsAre("latest", "step-00000009"));
}

// A tensor whose memory ends in an inaccessible page: write() fails with EFAULT partway through the
// safetensors file, after the header and some data are on disk.
TEST_F(CheckpointTest, FailureMidWriteLeavesPreviousCheckpointIntact) {
  SCOPED_TRACE(testing::Message() << "seed " << seed_);
  const std::vector<TestTensor> first = SmallSet();
  CKPT_ASSERT_OK(Write(1, first, {.keep_last = 1}).status());

  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  void* mem = ::mmap(nullptr, 3 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mem, MAP_FAILED);
  std::memset(mem, 0x5a, 3 * page);
  ASSERT_EQ(::mprotect(static_cast<char*>(mem) + 2 * page, page, PROT_NONE), 0);

  std::vector<TestTensor> second = SmallSet();
  std::vector<TensorRecord> records = Records(second);
  records.push_back({.name = "poisoned",
                     .dtype = DType::kF32,
                     .shape = {static_cast<int64_t>(3 * page / 4)},
                     .data = mem,
                     .bytes = 3 * page,
                     .kind = "master",
                     .group = "g0"});
  absl::StatusOr<std::string> r =
      WriteCheckpoint(root_, 2, records, skipped_, metadata_, {.keep_last = 1});
  ::munmap(mem, 3 * page);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr(kRankFile));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("'poisoned'"));

  EXPECT_THAT(DirNames(root_), ElementsAre("latest", "step-00000001"));  // no .incomplete left
  EXPECT_EQ(Latest(), "step-00000001\n");
  CKPT_ASSERT_OK_AND_ASSIGN(auto reader, CheckpointReader::Open(root_));
  EXPECT_EQ(reader->step(), 1);
  CKPT_ASSERT_OK(reader->VerifyAll());
  ExpectReadsBack(*reader, first);

  // The same step can be written once the problem is gone.
  CKPT_ASSERT_OK(Write(2, second, {.keep_last = 1}).status());
  EXPECT_THAT(DirNames(root_), ElementsAre("latest", "step-00000002"));
}

// `latest` cannot be replaced (latest.tmp is a non-empty directory): the new checkpoint, already
// renamed into place, is rolled back.
TEST_F(CheckpointTest, FailureToReplaceLatestRollsBack) {
  const std::vector<TestTensor> first = SmallSet();
  CKPT_ASSERT_OK(Write(1, first).status());
  ASSERT_TRUE(std::filesystem::create_directories(root_ + "/latest.tmp/blocker"));
  absl::StatusOr<std::string> r = Write(2, SmallSet(), {.keep_last = 1});
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("latest.tmp"));
  EXPECT_THAT(DirNames(root_), ElementsAre("latest", "latest.tmp", "step-00000001"));
  EXPECT_EQ(Latest(), "step-00000001\n");
  CKPT_ASSERT_OK_AND_ASSIGN(auto reader, CheckpointReader::Open(root_));
  ExpectReadsBack(*reader, first);
}

TEST_F(CheckpointTest, InvalidRequestsAreRefusedBeforeAnythingIsWritten) {
  std::vector<TestTensor> tensors = SmallSet();
  auto expect_refused = [&](std::vector<TensorRecord> records, const std::string& needle,
                            std::map<std::string, std::string> metadata = {}) {
    absl::StatusOr<std::string> r = WriteCheckpoint(root_, 1, records, skipped_, metadata);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(needle));
    EXPECT_FALSE(Exists(root_)) << "the root was created for a refused request";
  };
  std::vector<TensorRecord> records = Records(tensors);
  records[2].data = nullptr;
  expect_refused(records, "'c'");

  records = Records(tensors);
  records[3].name = "a";
  expect_refused(records, "'a' appears more than once");

  records = Records(tensors);
  records[1].bytes += 2;
  expect_refused(records, "'b'");

  records = Records(tensors);
  records[0].shape = {5, -3};
  expect_refused(records, "'a'");

  records = Records(tensors);
  records[0].name = "__metadata__";
  expect_refused(records, "__metadata__");

  records = Records(tensors);
  records[0].kind = "";
  expect_refused(records, "kind");

  expect_refused(Records(tensors), "UTF-8", {{"bad", "\xff\xfe"}});
  records = Records(tensors);
  records[1].group = "\xc3";
  expect_refused(records, "UTF-8");

  absl::StatusOr<std::string> r = WriteCheckpoint(root_, -1, Records(tensors), skipped_, metadata_);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(Exists(root_));
}

TEST_F(CheckpointTest, StaleIncompleteDirectoryOfTheSameStepIsReplaced) {
  SCOPED_TRACE(testing::Message() << "seed " << seed_);
  ASSERT_TRUE(std::filesystem::create_directories(StepDir(5) + ".incomplete/junk"));
  WriteWholeFile(StepDir(5) + ".incomplete/rank-00000.safetensors", "partial");
  const std::vector<TestTensor> tensors = SmallSet();
  CKPT_ASSERT_OK_AND_ASSIGN(std::string dir, Write(5, tensors));
  EXPECT_THAT(DirNames(root_), ElementsAre("latest", "step-00000005"));
  EXPECT_THAT(DirNames(dir), ElementsAre("manifest.json", kRankFile));
  CKPT_ASSERT_OK_AND_ASSIGN(auto reader, CheckpointReader::Open(dir));
  ExpectReadsBack(*reader, tensors);
}

TEST_F(CheckpointTest, ListCheckpointsIgnoresIncompleteAndUnrelatedEntries) {
  CKPT_ASSERT_OK(Write(9, SmallSet(), {.fsync = false}).status());
  CKPT_ASSERT_OK(Write(123456789, SmallSet(), {.fsync = false}).status());
  CKPT_ASSERT_OK(Write(7, SmallSet(), {.fsync = false}).status());
  ASSERT_TRUE(std::filesystem::create_directories(StepDir(8) + ".incomplete"));
  ASSERT_TRUE(std::filesystem::create_directories(StepDir(10) + ".deleting"));
  ASSERT_TRUE(std::filesystem::create_directories(root_ + "/step-abc"));
  ASSERT_TRUE(std::filesystem::create_directories(root_ + "/step-"));
  WriteWholeFile(StepDir(11), "a file, not a checkpoint");
  WriteWholeFile(root_ + "/notes.txt", "x");
  CKPT_ASSERT_OK_AND_ASSIGN(std::vector<std::string> list, ListCheckpoints(root_));
  EXPECT_THAT(list, ElementsAre(StepDir(7), StepDir(9), root_ + "/step-123456789"));
  EXPECT_EQ(ListCheckpoints(scratch_ + "/nowhere").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(CheckpointTest, EmptyCheckpointRoundTrips) {
  CKPT_ASSERT_OK_AND_ASSIGN(std::string dir, WriteCheckpoint(root_, 0, {}, {}, {}));
  CKPT_ASSERT_OK_AND_ASSIGN(auto reader, CheckpointReader::Open(dir));
  EXPECT_EQ(reader->step(), 0);
  EXPECT_TRUE(reader->tensors().empty());
  EXPECT_TRUE(reader->metadata().empty());
  EXPECT_TRUE(reader->skipped().empty());
  CKPT_ASSERT_OK(reader->VerifyAll());
}

}  // namespace
}  // namespace ferry
