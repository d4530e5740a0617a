// ReadTensors under faults: corruption, truncation and bad requests are refused with errors that
// name the file and the tensor; file systems without O_DIRECT fall back to buffered reads; reads
// run concurrently with other reads.
#include "ckpt/bulk_reader_test_fixture.h"

namespace ferry {
namespace {

using namespace ::ferry::bulk_reader_test;  // NOLINT

// The first chunk (in file order) of `tensor` stored in `file`, or nullopt.
std::optional<ManifestChunk> ChunkIn(const CheckpointReader& reader, const std::string& tensor,
                                     const std::string& file) {
  const TensorEntry* e = reader.Find(tensor);
  if (e == nullptr) return std::nullopt;
  for (const ManifestChunk& c : e->chunks) {
    if (c.file == file && c.length > 0) return c;
  }
  return std::nullopt;
}

TEST_F(BulkReaderTest, FlippedByteIsDataLossNamingFileAndTensor) {
  SCOPED_TRACE(testing::Message() << "seed " << seed_);
  ScratchDir scratch;
  const std::vector<TestTensor> tensors = Set();
  CKPT_ASSERT_OK_AND_ASSIGN(std::string dir, Write(scratch.path(), tensors, 2));
  CKPT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CheckpointReader> reader, CheckpointReader::Open(dir));
  const std::string file = RankFileName(1);
  const std::string path = JoinPath(dir, file);
  std::optional<ManifestChunk> big = ChunkIn(*reader, "big", file);
  std::optional<ManifestChunk> w2 = ChunkIn(*reader, "w2", file);
  ASSERT_TRUE(big.has_value() && w2.has_value());
  XorByte(path, big->file_offset + rng_() % big->length, 0x10);

  ThreadPool pool(4);
  for (bool direct : {true, false}) {
    for (size_t segment : {size_t{4096}, BulkReadOptions{}.segment_bytes}) {
      SCOPED_TRACE(absl::StrCat("direct_io ", direct, ", segment ", segment));
      Destinations d(tensors, 0);
      const absl::Status s = ReadTensors(
          *reader, AllReads(tensors, d),
          {.pool = &pool, .segment_bytes = segment, .direct_io = direct});
      EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
      EXPECT_THAT(std::string(s.message()), HasSubstr(path));
      EXPECT_THAT(std::string(s.message()), HasSubstr("tensor 'big'"));
      EXPECT_THAT(std::string(s.message()), HasSubstr("expected xxh3:"));
      EXPECT_THAT(std::string(s.message()), HasSubstr("found xxh3:"));
    }
  }
  // The reader that does not use the bulk path agrees.
  std::vector<uint8_t> out(tensors[8].data.size());
  EXPECT_EQ(reader->ReadTensor("big", out.data(), out.size()).code(),
            absl::StatusCode::kDataLoss);

  // Two corrupt tensors: the first one in request order is reported, whatever finishes first.
  XorByte(path, w2->file_offset + rng_() % w2->length, 0x01);
  for (bool big_first : {true, false}) {
    SCOPED_TRACE(absl::StrCat("big first ", big_first));
    Destinations d(tensors, 0);
    std::vector<TensorRead> reads = AllReads(tensors, d);
    std::stable_partition(reads.begin(), reads.end(), [&](const TensorRead& r) {
      return r.name == (big_first ? "big" : "w2");
    });
    for (int repeat = 0; repeat < 3; ++repeat) {
      const absl::Status s =
          ReadTensors(*reader, reads, {.pool = &pool, .segment_bytes = 4096});
      EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
      EXPECT_THAT(std::string(s.message()),
                  HasSubstr(big_first ? "tensor 'big'" : "tensor 'w2'"));
    }
  }
  // Tensors that do not touch the corrupt bytes still read fine.
  Destinations d(tensors, 0);
  TensorRead ok{.name = "w0", .dst = d.dst(0), .bytes = tensors[0].data.size()};
  CKPT_ASSERT_OK(ReadTensors(*reader, absl::MakeConstSpan(&ok, 1), {.pool = &pool}));
  EXPECT_TRUE(d.Contents(0, tensors[0].data.size()) == tensors[0].data);
}

// A zero-length tensor is not read, but its chunk's checksum (of no bytes) is still checked.
TEST_F(BulkReaderTest, EmptyTensorWithWrongChecksumIsDataLoss) {
  ScratchDir scratch;
  const std::vector<TestTensor> tensors = Set();
  CKPT_ASSERT_OK_AND_ASSIGN(std::string dir, Write(scratch.path(), tensors, 2));
  const std::string manifest_path = JoinPath(dir, "manifest.json");
  nlohmann::json manifest = nlohmann::json::parse(ReadWholeFile(manifest_path));
  bool edited = false;
  for (nlohmann::json& t : manifest["tensors"]) {
    if (t["name"] != "empty") continue;
    ASSERT_EQ(t["chunks"].size(), 1u);
    t["chunks"][0]["checksum"] = "xxh3:0123456789abcdef";
    edited = true;
  }
  ASSERT_TRUE(edited);
  WriteWholeFile(manifest_path, manifest.dump(2) + "\n");
  CKPT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CheckpointReader> reader, CheckpointReader::Open(dir));
  ThreadPool pool(2);
  Destinations d(tensors, 0);
  const absl::Status s = ReadTensors(*reader, AllReads(tensors, d), {.pool = &pool});
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("tensor 'empty'"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("expected xxh3:0123456789abcdef"));
  EXPECT_EQ(reader->ReadTensor("empty", nullptr, 0).code(), absl::StatusCode::kDataLoss);
  // Without it, everything else reads fine.
  std::vector<TensorRead> others = AllReads(tensors, d);
  others.erase(std::remove_if(others.begin(), others.end(),
                              [](const TensorRead& r) { return r.name == "empty"; }),
               others.end());
  CKPT_ASSERT_OK(ReadTensors(*reader, others, {.pool = &pool}));
}

TEST_F(BulkReaderTest, FileTruncatedAfterOpenIsDataLoss) {
  SCOPED_TRACE(testing::Message() << "seed " << seed_);
  ScratchDir scratch;
  const std::vector<TestTensor> tensors = Set();
  CKPT_ASSERT_OK_AND_ASSIGN(std::string dir, Write(scratch.path(), tensors, 3));
  CKPT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CheckpointReader> reader, CheckpointReader::Open(dir));
  // Cut the last chunk of rank 2's file in half.
  const std::string file = RankFileName(2);
  const std::string path = JoinPath(dir, file);
  std::string last;
  ManifestChunk last_chunk;
  for (const TensorEntry& e : reader->tensors()) {
    for (const ManifestChunk& c : e.chunks) {
      if (c.file == file && c.length > 0 && c.file_offset >= last_chunk.file_offset) {
        last = e.name;
        last_chunk = c;
      }
    }
  }
  ASSERT_FALSE(last.empty());
  ASSERT_GE(last_chunk.length, 2u);
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(last_chunk.file_offset +
                                                         last_chunk.length / 2)),
            0);
  ThreadPool pool(4);
  for (bool direct : {true, false}) {
    for (size_t segment : {size_t{4096}, BulkReadOptions{}.segment_bytes}) {
      SCOPED_TRACE(absl::StrCat("direct_io ", direct, ", segment ", segment));
      Destinations d(tensors, 0);
      BulkReadStats stats;
      const absl::Status s = ReadTensors(
          *reader, AllReads(tensors, d),
          {.pool = &pool, .segment_bytes = segment, .direct_io = direct}, &stats);
      EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
      EXPECT_THAT(std::string(s.message()), HasSubstr("short read"));
      EXPECT_THAT(std::string(s.message()), HasSubstr(path));
      EXPECT_THAT(std::string(s.message()), HasSubstr(absl::StrCat("tensor '", last, "'")));
      EXPECT_THAT(std::string(s.message()),
                  HasSubstr(absl::StrCat("ended at offset ",
                                         last_chunk.file_offset + last_chunk.length / 2)));
      EXPECT_GT(stats.bytes_read, 0u);
    }
  }
}

TEST_F(BulkReaderTest, BadRequestsAreRefusedBeforeAnyIo) {
  ScratchDir scratch;
  const std::vector<TestTensor> tensors = Set();
  CKPT_ASSERT_OK_AND_ASSIGN(std::string dir, Write(scratch.path(), tensors, 2));
  CKPT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CheckpointReader> reader, CheckpointReader::Open(dir));
  ThreadPool pool(2);
  auto check = [&](std::vector<TensorRead> bad, absl::StatusCode code, const std::string& what,
                   Destinations& d) {
    SCOPED_TRACE(what);
    // Valid requests before the bad one: none of them may be read.
    std::vector<TensorRead> reads = AllReads(tensors, d);
    reads.insert(reads.end(), bad.begin(), bad.end());
    BulkReadStats stats;
    stats.bytes_read = 7;
    stats.direct = true;
    const absl::Status s = ReadTensors(*reader, reads, {.pool = &pool}, &stats);
    EXPECT_EQ(s.code(), code) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(what));
    EXPECT_EQ(stats.bytes_read, 0u);
    EXPECT_FALSE(stats.direct);
    for (size_t i = 0; i < tensors.size(); ++i) {
      EXPECT_TRUE(d.GuardsIntact(i, 0)) << tensors[i].name << " was written";
    }
  };
  Destinations d(tensors, 0);
  std::vector<uint8_t> spare(1 << 16);
  // The valid requests cover every tensor, so a new name is the duplicate; use a partial list.
  std::vector<TestTensor> some(tensors.begin() + 1, tensors.end());
  {
    Destinations ds(some, 0);
    std::vector<TensorRead> reads = AllReads(some, ds);
    reads.push_back({.name = "nope", .dst = spare.data(), .bytes = 4});
    const absl::Status s = ReadTensors(*reader, reads, {});
    EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("'nope'"));
    for (size_t i = 0; i < some.size(); ++i) EXPECT_TRUE(ds.GuardsIntact(i, 0)) << some[i].name;

    reads.back() = {.name = "w0", .dst = spare.data(), .bytes = tensors[0].data.size() + 2};
    const absl::Status w = ReadTensors(*reader, reads, {.pool = &pool});
    EXPECT_EQ(w.code(), absl::StatusCode::kInvalidArgument) << w;
    EXPECT_THAT(std::string(w.message()), HasSubstr("'w0'"));
    EXPECT_THAT(std::string(w.message()), HasSubstr(absl::StrCat(tensors[0].data.size() + 2)));

    reads.back() = {.name = "w0", .dst = nullptr, .bytes = tensors[0].data.size()};
    const absl::Status n = ReadTensors(*reader, reads, {.pool = &pool});
    EXPECT_EQ(n.code(), absl::StatusCode::kInvalidArgument) << n;
    EXPECT_THAT(std::string(n.message()), HasSubstr("'w0'"));
    EXPECT_THAT(std::string(n.message()), HasSubstr("null"));
    for (size_t i = 0; i < some.size(); ++i) EXPECT_TRUE(ds.GuardsIntact(i, 0)) << some[i].name;
  }
  check({{.name = "w2", .dst = spare.data(), .bytes = tensors[9].data.size()}},
        absl::StatusCode::kInvalidArgument, "'w2'", d);
  check({{.name = "missing", .dst = spare.data(), .bytes = 1}}, absl::StatusCode::kNotFound,
        "'missing'", d);
  // The first bad request in order is the one reported.
  check({{.name = "zz", .dst = spare.data(), .bytes = 1},
         {.name = "w0", .dst = spare.data(), .bytes = 1}},
        absl::StatusCode::kNotFound, "'zz'", d);
}

// On a file system that refuses O_DIRECT the read falls back to buffered reads and says so.
// /dev/shm is tried, plus $FERRY_TEST_NO_ODIRECT_DIR if set (e.g. a ramfs mount): recent kernels'
// tmpfs accepts O_DIRECT, in which case the fallback is not exercised and the test says so.
TEST_F(BulkReaderTest, FileSystemWithoutODirectFallsBackToBufferedReads) {
  SCOPED_TRACE(testing::Message() << "seed " << seed_);
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("FERRY_TEST_NO_ODIRECT_DIR"); env != nullptr && *env != '\0') {
    candidates.push_back(env);
  }
  if (Exists("/dev/shm")) candidates.push_back("/dev/shm");
  if (candidates.empty()) GTEST_SKIP() << "/dev/shm is absent and FERRY_TEST_NO_ODIRECT_DIR unset";
  const std::vector<TestTensor> tensors = Set();
  ThreadPool pool(3);
  bool fell_back = false;
  for (const std::string& base : candidates) {
    SCOPED_TRACE(base);
    std::string tmpl = base + "/ferry_bulk_XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr) << std::strerror(errno);
    const std::string root = tmpl;
    const bool allows = DirAllowsODirect(root);
    absl::StatusOr<std::string> dir = Write(root, tensors, 2);
    std::unique_ptr<CheckpointReader> reader;
    absl::Status s = dir.status();
    if (s.ok()) {
      absl::StatusOr<std::unique_ptr<CheckpointReader>> r = CheckpointReader::Open(*dir);
      s = r.status();
      if (s.ok()) reader = *std::move(r);
    }
    Destinations d(tensors, 3);
    BulkReadStats stats;
    if (s.ok()) {
      s = ReadTensors(*reader, AllReads(tensors, d),
                      {.pool = &pool, .segment_bytes = 12288, .direct_io = true}, &stats);
    }
    reader.reset();
    std::error_code ec;
    std::filesystem::remove_all(root, ec);
    CKPT_ASSERT_OK(s);
    for (size_t i = 0; i < tensors.size(); ++i) {
      EXPECT_TRUE(d.Contents(i, tensors[i].data.size()) == tensors[i].data) << tensors[i].name;
    }
    EXPECT_EQ(stats.direct, allows);
    fell_back = fell_back || !allows;
  }
  if (!fell_back) {
    GTEST_SKIP() << "every candidate (" << candidates.back()
                 << ") accepts O_DIRECT on this kernel; values were checked, the buffered "
                    "fallback was not exercised (set FERRY_TEST_NO_ODIRECT_DIR to a ramfs mount)";
  }
}

TEST_F(BulkReaderTest, TempDirWithODirectReadsDirect) {
  ScratchDir scratch;
  if (!DirAllowsODirect(scratch.path())) {
    GTEST_SKIP() << "the test temp dir " << scratch.path() << " does not allow O_DIRECT";
  }
  const std::vector<TestTensor> tensors = Set();
  CKPT_ASSERT_OK_AND_ASSIGN(std::string dir, Write(scratch.path(), tensors, 3));
  CKPT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CheckpointReader> reader, CheckpointReader::Open(dir));
  for (bool direct : {true, false}) {
    Destinations d(tensors, 1);
    BulkReadStats stats;
    CKPT_ASSERT_OK(
        ReadTensors(*reader, AllReads(tensors, d), {.direct_io = direct}, &stats));
    EXPECT_EQ(stats.direct, direct);
    for (size_t i = 0; i < tensors.size(); ++i) {
      EXPECT_TRUE(d.Contents(i, tensors[i].data.size()) == tensors[i].data) << tensors[i].name;
    }
  }
}

// ReadTensors alongside itself and the reader's own const methods on one reader (for TSan).
TEST_F(BulkReaderTest, ConcurrentWithOtherReads) {
  SCOPED_TRACE(testing::Message() << "seed " << seed_);
  ScratchDir scratch;
  const std::vector<TestTensor> tensors = Set();
  CKPT_ASSERT_OK_AND_ASSIGN(std::string dir, Write(scratch.path(), tensors, 3));
  CKPT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CheckpointReader> reader, CheckpointReader::Open(dir));
  ThreadPool pool_a(3), pool_b(2);
  std::vector<absl::Status> results(4);
  std::vector<std::unique_ptr<Destinations>> dests;
  for (int i = 0; i < 3; ++i) dests.push_back(std::make_unique<Destinations>(tensors, i));
  std::vector<std::thread> threads;
  threads.emplace_back([&] {
    results[0] = ReadTensors(*reader, AllReads(tensors, *dests[0]),
                             {.pool = &pool_a, .segment_bytes = 4096});
  });
  threads.emplace_back([&] {
    results[1] = ReadTensors(*reader, AllReads(tensors, *dests[1]), {.pool = &pool_b});
  });
  threads.emplace_back([&] {
    results[2] = ReadTensors(*reader, AllReads(tensors, *dests[2]), {.direct_io = false});
  });
  threads.emplace_back([&] { results[3] = reader->VerifyAll(); });
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : results) CKPT_ASSERT_OK(s);
  for (const auto& d : dests) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      EXPECT_TRUE(d->Contents(i, tensors[i].data.size()) == tensors[i].data) << tensors[i].name;
    }
  }
}

}  // namespace
}  // namespace ferry
