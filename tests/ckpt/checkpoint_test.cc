// Tests of the single-rank checkpoint writer and reader. The safetensors file and manifest.json are
// also checked with an independent parser (nlohmann + xxHash directly), so the format is tested
// without our reader.
//
// Set FERRY_CKPT_SAMPLE_DIR to an empty or missing directory to have RoundTripAllDtypesAndShapes
// leave a checkpoint there (step 42) for tests/ckpt/check_safetensors.py.
#include "ckpt/checkpoint.h"

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

namespace ferry {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Json = nlohmann::json;

#define CKPT_CONCAT_INNER_(a, b) a##b
#define CKPT_CONCAT_(a, b) CKPT_CONCAT_INNER_(a, b)
#define CKPT_ASSERT_OK(expr)              \
  do {                                    \
    const absl::Status ckpt_s_ = (expr);  \
    ASSERT_TRUE(ckpt_s_.ok()) << ckpt_s_; \
  } while (0)
#define CKPT_ASSERT_OK_AND_ASSIGN(lhs, rexpr) \
  CKPT_ASSERT_OK_AND_ASSIGN_IMPL_(CKPT_CONCAT_(ckpt_sor_, __LINE__), lhs, rexpr)
#define CKPT_ASSERT_OK_AND_ASSIGN_IMPL_(tmp, lhs, rexpr) \
  auto tmp = (rexpr);                                    \
  ASSERT_TRUE(tmp.ok()) << tmp.status();                 \
  lhs = std::move(tmp).value()

constexpr char kRankFile[] = "rank-00000.safetensors";

struct TestTensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::string kind;
  std::string group;
  std::vector<uint8_t> data;
};

std::string ReadWholeFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void WriteWholeFile(const std::string& path, const std::string& contents) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
}

void XorByte(const std::string& path, uint64_t offset, uint8_t mask) {
  std::fstream f(path, std::ios::binary | std::ios::in | std::ios::out);
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(static_cast<uint8_t>(c) ^ mask);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
}

bool Exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

std::string Hex16(uint64_t v) { return absl::StrFormat("%016x", v); }

std::string SafetensorsDTypeName(DType t) {
  switch (t) {
    case DType::kF32: return "F32";
    case DType::kBF16: return "BF16";
    case DType::kF16: return "F16";
  }
  return "?";
}

size_t ElementBytes(DType t) { return t == DType::kF32 ? 4 : 2; }

// Everything in a directory, names only, sorted.
std::vector<std::string> DirNames(const std::string& dir) {
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
    size_t n = ElementBytes(dtype);
    for (int64_t d : shape) n *= static_cast<size_t>(d);
    TestTensor t{std::move(name), dtype, std::move(shape), std::move(kind), std::move(group), {}};
    t.data.resize(n);
    for (size_t i = 0; i < n; i += 8) {
      uint64_t w = rng_();
      std::memcpy(t.data.data() + i, &w, std::min<size_t>(8, n - i));
    }
    if (n > 0) t.data[0] |= 1;  // never all zeros
    return t;
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

  static std::vector<TensorRecord> Records(const std::vector<TestTensor>& tensors) {
    std::vector<TensorRecord> r;
    for (const TestTensor& t : tensors) {
      r.push_back({.name = t.name,
                   .dtype = t.dtype,
                   .shape = t.shape,
                   .data = t.data.data(),
                   .bytes = t.data.size(),
                   .kind = t.kind,
                   .group = t.group});
    }
    return r;
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

// ---- round trip ---------------------------------------------------------------------------------

TEST_F(CheckpointTest, RoundTripAllDtypesAndShapes) {
  SCOPED_TRACE(testing::Message() << "seed " << seed_);
  const std::vector<TestTensor> tensors = StandardSet();
  CKPT_ASSERT_OK_AND_ASSIGN(std::string dir, Write(42, tensors));
  EXPECT_EQ(dir, StepDir(42));
  EXPECT_THAT(DirNames(dir), ElementsAre("manifest.json", kRankFile));

  for (const std::string& path : {dir, root_}) {
    SCOPED_TRACE(path);
    CKPT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CheckpointReader> reader,
                              CheckpointReader::Open(path));
    EXPECT_EQ(reader->dir(), dir);
    EXPECT_EQ(reader->step(), 42);
    EXPECT_EQ(reader->metadata(), metadata_);
    ASSERT_EQ(reader->skipped().size(), skipped_.size());
    for (size_t i = 0; i < skipped_.size(); ++i) {
      EXPECT_EQ(reader->skipped()[i].what, skipped_[i].what);
      EXPECT_EQ(reader->skipped()[i].reason, skipped_[i].reason);
    }
    ASSERT_EQ(reader->tensors().size(), tensors.size());
    for (size_t i = 0; i < tensors.size(); ++i) {
      const TestTensor& t = tensors[i];
      const TensorEntry& e = reader->tensors()[i];  // manifest order is the caller's order
      SCOPED_TRACE(t.name);
      EXPECT_EQ(e.name, t.name);
      EXPECT_EQ(e.kind, t.kind);
      EXPECT_EQ(e.group, t.group);
      EXPECT_EQ(e.dtype, t.dtype);
      EXPECT_EQ(e.shape, t.shape);
      EXPECT_EQ(e.bytes, t.data.size());
      EXPECT_EQ(e.checksum, XXH3_64bits(t.data.data(), t.data.size()));
      EXPECT_EQ(e.file, kRankFile);
      EXPECT_EQ(reader->Find(t.name), &e);
    }
    ExpectReadsBack(*reader, tensors);
    CKPT_ASSERT_OK(reader->VerifyAll());
    EXPECT_EQ(reader->Find("no.such.tensor"), nullptr);
    std::vector<uint8_t> buf(16);
    EXPECT_EQ(reader->ReadTensor("no.such.tensor", buf.data(), buf.size()).code(),
              absl::StatusCode::kNotFound);
    absl::Status wrong_size = reader->ReadTensor("h", buf.data(), buf.size());
    EXPECT_EQ(wrong_size.code(), absl::StatusCode::kInvalidArgument) << wrong_size;
  }

  if (const char* sample = std::getenv("FERRY_CKPT_SAMPLE_DIR"); sample != nullptr && *sample) {
    std::vector<TensorRecord> records = Records(tensors);
    absl::StatusOr<std::string> kept = WriteCheckpoint(sample, 42, records, skipped_, metadata_);
    ASSERT_TRUE(kept.ok()) << kept.status();
    std::printf("sample checkpoint for check_safetensors.py: %s\n", kept->c_str());
  }
}

TEST_F(CheckpointTest, SafetensorsFileParsedIndependently) {
  SCOPED_TRACE(testing::Message() << "seed " << seed_);
  const std::vector<TestTensor> tensors = StandardSet();
  CKPT_ASSERT_OK_AND_ASSIGN(std::string dir, Write(7, tensors));
  const std::string file = ReadWholeFile(dir + "/" + kRankFile);
  ASSERT_GE(file.size(), 8u);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(static_cast<uint8_t>(file[i])) << (8 * i);
  EXPECT_EQ(n % 8, 0u) << "header must be padded to a multiple of 8";
  ASSERT_LE(8 + n, file.size());
  const Json header =
      Json::parse(file.substr(8, n));  // trailing spaces are allowed JSON whitespace
  ASSERT_TRUE(header.is_object());
  EXPECT_EQ(header.at("__metadata__"), Json(metadata_));
  EXPECT_EQ(header.size(), tensors.size() + 1);
  const uint64_t data_start = 8 + n;

  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const TestTensor& t : tensors) {
    SCOPED_TRACE(t.name);
    ASSERT_TRUE(header.contains(t.name));
    const Json& e = header.at(t.name);
    EXPECT_EQ(e.at("dtype"), SafetensorsDTypeName(t.dtype));
    EXPECT_EQ(e.at("shape"), Json(t.shape));
    ASSERT_TRUE(e.at("data_offsets").is_array());
    ASSERT_EQ(e.at("data_offsets").size(), 2u);
    const uint64_t begin = e.at("data_offsets")[0].get<uint64_t>();
    const uint64_t end = e.at("data_offsets")[1].get<uint64_t>();
    ASSERT_EQ(end - begin, t.data.size());
    EXPECT_EQ((data_start + begin) % ElementBytes(t.dtype), 0u) << "element-aligned in the file";
    ASSERT_LE(data_start + end, file.size());
    EXPECT_TRUE(std::equal(t.data.begin(), t.data.end(),
                           reinterpret_cast<const uint8_t*>(file.data() + data_start + begin)))
        << "bytes at data_offsets differ from the input";
    ranges.emplace_back(begin, end);
  }
  // The tensors tile the data section: no gaps, no overlap, nothing after.
  std::sort(ranges.begin(), ranges.end());
  uint64_t expected = 0;
  for (const auto& [begin, end] : ranges) {
    EXPECT_EQ(begin, expected);
    expected = end;
  }
  EXPECT_EQ(data_start + expected, file.size());
}

TEST_F(CheckpointTest, ManifestParsedIndependently) {
  SCOPED_TRACE(testing::Message() << "seed " << seed_);
  const std::vector<TestTensor> tensors = SmallSet();
  CKPT_ASSERT_OK_AND_ASSIGN(std::string dir, Write(1234, tensors));
  const Json m = Json::parse(ReadWholeFile(dir + "/manifest.json"));
  EXPECT_EQ(m.at("format"), "ferry-checkpoint");
  EXPECT_EQ(m.at("format_version"), 1);
  EXPECT_EQ(m.at("step"), 1234);
  EXPECT_EQ(m.at("world_size"), 1);
  EXPECT_EQ(m.at("metadata"), Json(metadata_));
  ASSERT_EQ(m.at("skipped").size(), 2u);
  EXPECT_EQ(m.at("skipped")[0].at("what"), "optimizer");
  EXPECT_EQ(m.at("skipped")[0].at("reason"), "policy skip_optimizer_on_save");
  EXPECT_EQ(m.at("skipped")[1].at("what"), "rng");

  const std::string file = ReadWholeFile(dir + "/" + kRankFile);
  ASSERT_EQ(m.at("tensors").size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TestTensor& t = tensors[i];
    const Json& e = m.at("tensors")[i];
    SCOPED_TRACE(t.name);
    EXPECT_EQ(e.at("name"), t.name);
    EXPECT_EQ(e.at("kind"), t.kind);
    EXPECT_EQ(e.at("group"), t.group);
    EXPECT_EQ(e.at("dtype"), SafetensorsDTypeName(t.dtype));
    EXPECT_EQ(e.at("shape"), Json(t.shape));
    EXPECT_EQ(e.at("bytes"), t.data.size());
    ASSERT_EQ(e.at("chunks").size(), 1u);
    const Json& c = e.at("chunks")[0];
    EXPECT_EQ(c.at("rank"), 0);
    EXPECT_EQ(c.at("file"), kRankFile);
    EXPECT_EQ(c.at("global_offset"), 0);
    EXPECT_EQ(c.at("length"), t.data.size());
    EXPECT_EQ(c.at("checksum"), "xxh3:" + Hex16(XXH3_64bits(t.data.data(), t.data.size())));
    const uint64_t offset = c.at("file_offset").get<uint64_t>();
    ASSERT_LE(offset + t.data.size(), file.size());
    EXPECT_EQ(file.compare(offset, t.data.size(), std::string(t.data.begin(), t.data.end())), 0)
        << "file_offset does not point at the tensor's bytes";
  }
}

// ---- corruption ---------------------------------------------------------------------------------

TEST_F(CheckpointTest, FlippedDataByteIsDataLossNamingFileAndTensor) {
  SCOPED_TRACE(testing::Message() << "seed " << seed_);
  const std::vector<TestTensor> tensors = SmallSet();
  CKPT_ASSERT_OK_AND_ASSIGN(std::string dir, Write(3, tensors));
  uint64_t offset_c = 0, offset_a = 0;
  {
    CKPT_ASSERT_OK_AND_ASSIGN(auto reader, CheckpointReader::Open(dir));
    offset_c = reader->Find("c")->file_offset;
    offset_a = reader->Find("a")->file_offset;
  }
  const std::string path = dir + "/" + kRankFile;
  XorByte(path, offset_c + 5, 0x10);

  CKPT_ASSERT_OK_AND_ASSIGN(auto reader, CheckpointReader::Open(dir));  // Open does not read data
  std::vector<uint8_t> out(tensors[2].data.size());
  absl::Status s = reader->ReadTensor("c", out.data(), out.size());
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(path));
  EXPECT_THAT(std::string(s.message()), HasSubstr("'c'"));
  const uint64_t expected = XXH3_64bits(tensors[2].data.data(), tensors[2].data.size());
  EXPECT_THAT(std::string(s.message()), HasSubstr(Hex16(expected)));
  // The other tensors are unaffected.
  for (const char* name : {"a", "b", "d"}) {
    const TestTensor& t = *std::find_if(tensors.begin(), tensors.end(),
                                        [&](const TestTensor& x) { return x.name == name; });
    std::vector<uint8_t> ok(t.data.size());
    CKPT_ASSERT_OK(reader->ReadTensor(name, ok.data(), ok.size()));
    EXPECT_TRUE(ok == t.data) << name;
  }
  absl::Status all = reader->VerifyAll();
  EXPECT_EQ(all.code(), absl::StatusCode::kDataLoss) << all;
  EXPECT_THAT(std::string(all.message()), HasSubstr("'c'"));
  EXPECT_THAT(std::string(all.message()), HasSubstr(kRankFile));

  // A second corrupt tensor: VerifyAll still reports the first and counts both.
  XorByte(path, offset_a, 0x01);
  CKPT_ASSERT_OK_AND_ASSIGN(auto reader2, CheckpointReader::Open(dir));
  all = reader2->VerifyAll();
  EXPECT_EQ(all.code(), absl::StatusCode::kDataLoss) << all;
  EXPECT_THAT(std::string(all.message()), HasSubstr("'a'"));
  EXPECT_THAT(std::string(all.message()), HasSubstr("2 of 4"));
}

TEST_F(CheckpointTest, EveryFlippedHeaderByteIsRefused) {
  SCOPED_TRACE(testing::Message() << "seed " << seed_);
  const std::vector<TestTensor> tensors = SmallSet();
  CKPT_ASSERT_OK_AND_ASSIGN(std::string dir, Write(3, tensors));
  const std::string path = dir + "/" + kRankFile;
  const std::string original = ReadWholeFile(path);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) {
    n |= static_cast<uint64_t>(static_cast<uint8_t>(original[i])) << (8 * i);
  }
  ASSERT_LT(n, original.size());
  for (uint8_t mask : {uint8_t{0x01}, uint8_t{0x20}, uint8_t{0x80}}) {
    for (uint64_t pos = 0; pos < 8 + n; ++pos) {
      XorByte(path, pos, mask);
      absl::StatusOr<std::unique_ptr<CheckpointReader>> r = CheckpointReader::Open(dir);
      XorByte(path, pos, mask);
      ASSERT_FALSE(r.ok()) << "flipping mask " << int{mask} << " at header byte " << pos << " ('"
                           << original[pos] << "') went unnoticed";
      EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
      EXPECT_THAT(std::string(r.status().message()), HasSubstr(kRankFile)) << "at byte " << pos;
    }
  }
  ASSERT_EQ(ReadWholeFile(path), original);
  CKPT_ASSERT_OK_AND_ASSIGN(auto reader, CheckpointReader::Open(dir));
  CKPT_ASSERT_OK(reader->VerifyAll());
}

TEST_F(CheckpointTest, TruncatedFileRefusedNamingFileAndFirstTensorThatDoesNotFit) {
  SCOPED_TRACE(testing::Message() << "seed " << seed_);
  const std::vector<TestTensor> tensors = SmallSet();
  CKPT_ASSERT_OK_AND_ASSIGN(std::string dir, Write(3, tensors));
  std::vector<TensorEntry> entries;
  {
    CKPT_ASSERT_OK_AND_ASSIGN(auto reader, CheckpointReader::Open(dir));
    entries = reader->tensors();
  }
  std::sort(entries.begin(), entries.end(), [](const TensorEntry& a, const TensorEntry& b) {
    return a.file_offset < b.file_offset;
  });
  const std::string path = dir + "/" + kRankFile;
  const uint64_t full = ReadWholeFile(path).size();
  // Cut inside the second tensor in file order, then one byte short, then into the header.
  const std::vector<std::pair<uint64_t, std::string>> cuts = {
      {entries[1].file_offset + entries[1].bytes / 2, entries[1].name},
      {full - 1, entries.back().name},
      {4, entries.front().name}};
  for (const auto& [size, first_missing] : cuts) {
    SCOPED_TRACE(testing::Message() << "truncated to " << size);
    ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(size)), 0);
    absl::StatusOr<std::unique_ptr<CheckpointReader>> r = CheckpointReader::Open(dir);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(path));
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("truncated"));
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("'" + first_missing + "'"));
  }
}

TEST_F(CheckpointTest, MissingManifestOrDataFileIsNotFound) {
  const std::vector<TestTensor> tensors = SmallSet();
  CKPT_ASSERT_OK_AND_ASSIGN(std::string dir, Write(3, tensors));
  const std::string data = ReadWholeFile(dir + "/" + kRankFile);
  ASSERT_EQ(::unlink((dir + "/" + kRankFile).c_str()), 0);
  absl::StatusOr<std::unique_ptr<CheckpointReader>> r = CheckpointReader::Open(dir);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr(kRankFile));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("'a'"));
  WriteWholeFile(dir + "/" + kRankFile, data);

  ASSERT_EQ(::unlink((dir + "/manifest.json").c_str()), 0);
  for (const std::string& path : {dir, root_}) {
    r = CheckpointReader::Open(path);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status();
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("manifest.json"));
  }
  r = CheckpointReader::Open(scratch_ + "/nowhere");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status();
  r = CheckpointReader::Open(scratch_);  // exists, but neither a checkpoint nor a root
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("latest"));
}

TEST_F(CheckpointTest, ManifestProblemsAreNamed) {
  const std::vector<TestTensor> tensors = SmallSet();
  CKPT_ASSERT_OK_AND_ASSIGN(std::string dir, Write(3, tensors));
  const std::string path = dir + "/manifest.json";
  const std::string original = ReadWholeFile(path);
  auto open_with = [&](const std::function<void(Json&)>& edit) {
    Json m = Json::parse(original);
    edit(m);
    WriteWholeFile(path, m.dump(2));
    return CheckpointReader::Open(dir).status();
  };

  absl::Status s = open_with([](Json& m) { m["format_version"] = 2; });
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("format_version 2"));

  s = open_with([](Json& m) { m["format"] = "something-else"; });
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;

  s = open_with([](Json& m) { m["tensors"][1]["bytes"] = 13; });
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("'b'"));

  s = open_with([](Json& m) { m["tensors"][0].erase("kind"); });
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("'kind'"));

  // Same bytes, different shape: consistent in itself, but the safetensors header disagrees.
  s = open_with([](Json& m) { m["tensors"][0]["shape"] = Json::array({3, 5}); });
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("disagrees"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("'a'"));

  s = open_with([](Json& m) { m["metadata"]["trainer"] = "other"; });
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("__metadata__"));

  s = open_with([](Json& m) { m["tensors"][2]["chunks"][0]["checksum"] = "xxh3:12"; });
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;

  s = open_with([](Json& m) { m["step"] = 4; });
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("step-00000003"));

  s = open_with([](Json& m) { m["tensors"][0]["chunks"][0]["rank"] = 1; });
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;  // rank 1 of world size 1
  EXPECT_THAT(std::string(s.message()), HasSubstr("rank 1"));

  s = open_with([](Json& m) {  // a chunk whose file is not its rank's
    m["world_size"] = 2;
    m["tensors"][0]["chunks"][0]["rank"] = 1;
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("rank-00001.safetensors"));

  WriteWholeFile(path, "{not json");
  s = CheckpointReader::Open(dir).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("manifest.json"));

  WriteWholeFile(path, original);
  CKPT_ASSERT_OK(CheckpointReader::Open(dir).status());
}

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
