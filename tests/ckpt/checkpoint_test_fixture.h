// The fixture and helpers of the single-rank checkpoint tests (checkpoint_test.cc: round trip and
// corruption; checkpoint_commit_test.cc: the commit protocol), with an independent parser of the
// files (nlohmann + xxHash directly), so the format is tested without our reader.
#ifndef FERRY_TESTS_CKPT_CHECKPOINT_TEST_FIXTURE_H_
#define FERRY_TESTS_CKPT_CHECKPOINT_TEST_FIXTURE_H_

#include "ckpt/checkpoint.h"
#include "ckpt/ckpt_test_util.h"

#include <fcntl.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "xxhash.h"

namespace ferry::checkpoint_test {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Json = nlohmann::json;

inline constexpr char kRankFile[] = "rank-00000.safetensors";

using ckpt_test::Exists;
using ckpt_test::ReadWholeFile;
using ckpt_test::Records;
using ckpt_test::TestTensor;
using ckpt_test::WriteWholeFile;
using ckpt_test::XorByte;

inline std::string Hex16(uint64_t v) { return absl::StrFormat("%016x", v); }

inline std::string SafetensorsDTypeName(DType t) {
  switch (t) {
    case DType::kF32: return "F32";
    case DType::kBF16: return "BF16";
    case DType::kF16: return "F16";
  }
  return "?";
}

using ckpt_test::ElementBytes;

// Everything in a directory, names only, sorted.
inline std::vector<std::string> DirNames(const std::string& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = ::testing::TempDir() + "ferry_ckpt_test_XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr) << std::strerror(errno);
    scratch_ = tmpl;
    root_ = scratch_ + "/ckpts";
    seed_ = std::random_device{}();
    rng_.seed(seed_);
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(scratch_, ec);
  }

  // Fresh random bytes (every bit pattern, NaNs included: the comparisons are bitwise).
  TestTensor Random(std::string name, DType dtype, std::vector<int64_t> shape,
                    std::string kind = "model", std::string group = "g0") {
    return ckpt_test::RandomTensor(rng_, std::move(name), dtype, std::move(shape), std::move(kind), std::move(group));
  }

  // Every dtype, a scalar, 1-element tensors, an empty tensor, odd sizes that would misalign the
  // next tensor, and tensors larger than the writer's 8 MiB I/O pieces.
  std::vector<TestTensor> StandardSet() {
    std::vector<TestTensor> v;
    v.push_back(Random("layer0.weight", DType::kBF16, {64, 48}));
    v.push_back(Random("layer0.master", DType::kF32, {64, 48}, "master"));
    v.push_back(Random("layer0.exp_avg", DType::kF32, {64, 48}, "exp_avg"));
    v.push_back(Random("layer0.exp_avg_sq", DType::kF32, {64, 48}, "exp_avg_sq"));
    v.push_back(Random("odd.bf16", DType::kBF16, {3}, "model", "g1"));
    v.push_back(Random("scale", DType::kF32, {}, "model", ""));
    v.push_back(Random("one.bf16", DType::kBF16, {1}));
    v.push_back(Random("one.f16", DType::kF16, {1, 1, 1}));
    v.push_back(Random("h", DType::kF16, {3, 5, 7}, "model", "g1"));
    v.push_back(Random("empty", DType::kF32, {4, 0}));
    v.push_back(Random("big.master", DType::kF32, {3 * 1024 * 1024 + 5}, "master", "g2"));
    v.push_back(Random("big.weight", DType::kBF16, {4096, 1030}, "model", "g2"));
    return v;
  }

  // A small set without empty tensors (so file offsets are distinct).
  std::vector<TestTensor> SmallSet() {
    std::vector<TestTensor> v;
    v.push_back(Random("a", DType::kF32, {5, 3}));
    v.push_back(Random("b", DType::kBF16, {7}));
    v.push_back(Random("c", DType::kF16, {2, 2, 3}, "exp_avg"));
    v.push_back(Random("d", DType::kF32, {}, "exp_avg_sq"));
    return v;
  }

  absl::StatusOr<std::string> Write(int64_t step, const std::vector<TestTensor>& tensors,
                                    CheckpointWriteOptions options = {}) {
    std::vector<TensorRecord> records = Records(tensors);
    return WriteCheckpoint(root_, step, records, skipped_, metadata_, options);
  }

  std::string StepDir(int64_t step) const { return absl::StrFormat("%s/step-%08d", root_, step); }
  std::string Latest() const { return ReadWholeFile(root_ + "/latest"); }

  // Checks that every tensor reads back bit-exactly through the reader.
  void ExpectReadsBack(const CheckpointReader& reader, const std::vector<TestTensor>& tensors) {
    ASSERT_EQ(reader.tensors().size(), tensors.size());
    for (const TestTensor& t : tensors) {
      SCOPED_TRACE(t.name);
      std::vector<uint8_t> out(t.data.size(), 0xAB);
      CKPT_ASSERT_OK(reader.ReadTensor(t.name, out.data(), out.size()));
      EXPECT_TRUE(out == t.data) << "tensor bytes differ";
    }
  }

  std::string scratch_;
  std::string root_;
  uint32_t seed_ = 0;
  std::mt19937_64 rng_;
  std::map<std::string, std::string> metadata_ = {
      {"trainer", "llm.c"}, {"lr", "3e-4"}, {"note", "quote \" newline \n unicode \xc3\xbc"}};
  std::vector<SkipRecord> skipped_ = {{"optimizer", "policy skip_optimizer_on_save"},
                                      {"rng", "not tracked yet"}};
};

}  // namespace ferry::checkpoint_test

#endif  // FERRY_TESTS_CKPT_CHECKPOINT_TEST_FIXTURE_H_
