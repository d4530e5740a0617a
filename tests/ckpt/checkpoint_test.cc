// Tests of the single-rank checkpoint writer and reader. The safetensors file and manifest.json are
// also checked with an independent parser (nlohmann + xxHash directly), so the format is tested
// without our reader.
//
// Set FERRY_CKPT_SAMPLE_DIR to an empty or missing directory to have RoundTripAllDtypesAndShapes
// leave a checkpoint there (step 42) for tests/ckpt/check_safetensors.py.
#include "ckpt/checkpoint_test_fixture.h"

namespace ferry {
namespace {

using namespace ::ferry::checkpoint_test;  // NOLINT

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

}  // namespace
}  // namespace ferry
