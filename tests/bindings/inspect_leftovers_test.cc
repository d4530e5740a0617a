// `ferry inspect ROOT` lists the leftovers of crashed saves (step-N.incomplete, step-N.deleting)
// with their sizes and which of them the next save removes, and changes nothing itself.
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "bindings/command_capture.h"
#include "ckpt/checkpoint.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "lua/commands.h"

namespace ferry::cli {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

Result Inspect(const std::vector<std::string>& args) { return RunVerb(InspectCommand, args); }

void WriteFile(const std::string& path, size_t bytes) { std::ofstream(path, std::ios::binary) << std::string(bytes, 'z'); }

class InspectLeftoversTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (std::filesystem::temp_directory_path() / "ferry-inspect-XXXXXX").string();
    tmp_ = mkdtemp(tmpl.data());
    root_ = tmp_ + "/run";
    std::mt19937 rng(std::random_device{}());
    for (int i = 0; i < 8; ++i) data_.push_back(static_cast<float>(rng() % 1000) * 0.25f + 1.0f);
    CheckpointWriteOptions options;
    options.fsync = false;
    std::vector<TensorRecord> records = {{"w", DType::kF32, {8}, data_.data(), data_.size() * 4, "model", "g"}};
    ASSERT_TRUE(WriteCheckpoint(root_, 3, records, {}, {}, options).ok());
  }
  void TearDown() override { std::filesystem::remove_all(tmp_); }

  std::string tmp_, root_;
  std::vector<float> data_;
};

TEST_F(InspectLeftoversTest, ListsWhatTheNextSaveRemovesAndChangesNothing) {
  Result clean = Inspect({root_});
  ASSERT_EQ(clean.status, 0) << clean.err;
  EXPECT_THAT(clean.out, HasSubstr("leftovers of crashed saves: none"));
  // A step directory is not a root: no such section.
  EXPECT_THAT(Inspect({root_ + "/step-00000003"}).out, Not(HasSubstr("leftovers")));

  {  // a crashed save: its lock is free
    absl::StatusOr<SaveLock> lock = SaveLock::CreateDir(root_ + "/step-00000004.incomplete");
    ASSERT_TRUE(lock.ok()) << lock.status();
    WriteFile(root_ + "/step-00000004.incomplete/rank-00000.safetensors", 1234);
  }
  // A save in flight (this process holds its lock).
  absl::StatusOr<SaveLock> live = SaveLock::CreateDir(root_ + "/step-00000005.incomplete");
  ASSERT_TRUE(live.ok()) << live.status();
  WriteFile(root_ + "/step-00000005.incomplete/rank-00000.safetensors", 77);

  Result r = Inspect({root_});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("step-00000004.incomplete: 1234 bytes"));
  EXPECT_THAT(r.out, HasSubstr("the next save removes it: left by a crashed save"));
  EXPECT_THAT(r.out, HasSubstr("step-00000005.incomplete: 77 bytes"));
  EXPECT_THAT(r.out, HasSubstr("kept: in use"));
  EXPECT_THAT(r.out, HasSubstr("the next save removes 1 of 2"));
  struct stat st;
  EXPECT_EQ(::stat((root_ + "/step-00000004.incomplete/rank-00000.safetensors").c_str(), &st), 0);

  // A root whose only save crashed has no `latest`: the leftovers are still listed, and it fails.
  const std::string fresh = tmp_ + "/fresh";
  std::filesystem::create_directory(fresh);
  {
    absl::StatusOr<SaveLock> lock = SaveLock::CreateDir(fresh + "/step-00000000.incomplete");
    ASSERT_TRUE(lock.ok()) << lock.status();
  }
  Result first = Inspect({fresh});
  EXPECT_EQ(first.status, 1);
  EXPECT_THAT(first.out, HasSubstr("step-00000000.incomplete: 0 bytes"));
  EXPECT_THAT(first.err, HasSubstr("latest"));
}

}  // namespace
}  // namespace ferry::cli
