// ReadTensors, the bulk reader: every world size, pool size, segment size and I/O mode gives the
// written tensors byte for byte (and what CheckpointReader::ReadTensor gives), into unaligned
// destinations without touching a byte around them; subsets read only what they need.
#include "ckpt/bulk_reader_test_fixture.h"

namespace ferry {
namespace {

using namespace ::ferry::bulk_reader_test;  // NOLINT

TEST_F(BulkReaderTest, EveryWorldSizePoolSegmentAndModeGivesTheWrittenTensors) {
  SCOPED_TRACE(testing::Message() << "seed " << seed_);
  ScratchDir scratch;
  const bool temp_direct = DirAllowsODirect(scratch.path());
  const std::vector<TestTensor> tensors = Set();
  ThreadPool pool1(1), pool4(4);
  for (int world = 1; world <= 4; ++world) {
    SCOPED_TRACE(absl::StrCat("world size ", world));
    const std::string root = absl::StrCat(scratch.path(), "/w", world);
    CKPT_ASSERT_OK_AND_ASSIGN(std::string dir, Write(root, tensors, world));
    CKPT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CheckpointReader> reader,
                              CheckpointReader::Open(dir));
    if (world > 1) {
      size_t split = 0;
      for (const TensorEntry& e : reader->tensors()) split += e.chunks.size() > 1 ? 1 : 0;
      ASSERT_GT(split, 0u) << "some tensor should straddle ranks";
    }
    // The reference: CheckpointReader::ReadTensor, itself checked against the written bytes.
    std::vector<std::vector<uint8_t>> reference;
    for (const TestTensor& t : tensors) {
      reference.emplace_back(t.data.size(), 0xEE);
      CKPT_ASSERT_OK(reader->ReadTensor(t.name, reference.back().data(), t.data.size()));
      ASSERT_TRUE(reference.back() == t.data) << t.name;
    }
    const uint64_t ceiling = FileBytesCeiling(*reader);
    size_t combination = 0;
    for (ThreadPool* pool : {static_cast<ThreadPool*>(nullptr), &pool1, &pool4}) {
      for (size_t segment : {size_t{4096}, size_t{12288}, BulkReadOptions{}.segment_bytes}) {
        for (bool direct : {true, false}) {
          SCOPED_TRACE(absl::StrCat("pool ", pool == nullptr ? 0 : pool->num_threads(),
                                    " threads, segment ", segment, ", direct_io ", direct));
          ++combination;
          Destinations d(tensors, combination);
          std::vector<TensorRead> reads = AllReads(tensors, d);
          if (combination % 2 == 0) {  // a null dst is fine for the empty tensor
            for (TensorRead& r : reads) r.dst = r.bytes == 0 ? nullptr : r.dst;
          }
          std::shuffle(reads.begin(), reads.end(), rng_);
          BulkReadStats stats;
          stats.bytes_read = 12345;
          CKPT_ASSERT_OK(ReadTensors(
              *reader, reads, {.pool = pool, .segment_bytes = segment, .direct_io = direct},
              &stats));
          for (size_t i = 0; i < tensors.size(); ++i) {
            const std::vector<uint8_t> got = d.Contents(i, tensors[i].data.size());
            EXPECT_TRUE(got == tensors[i].data) << tensors[i].name;
            EXPECT_TRUE(got == reference[i]) << tensors[i].name;
            EXPECT_TRUE(d.GuardsIntact(i, tensors[i].data.size())) << tensors[i].name;
          }
          EXPECT_GE(stats.bytes_read, TotalBytes(tensors));
          EXPECT_LE(stats.bytes_read, ceiling);
          EXPECT_EQ(stats.direct, direct && temp_direct);
        }
      }
    }
  }
}

// Partial reads (a rank of another world size reading its range): random element ranges of every
// tensor, of checkpoints of every world size, give the written bytes of exactly that range, with
// chunks that stick out of a range read and verified whole; a chunk outside every range is never
// read (its corruption goes unnoticed), one overlapping a range is (DataLoss).
TEST_F(BulkReaderTest, PartialReadsGiveTheirRangeAndVerifyWholeChunks) {
  SCOPED_TRACE(testing::Message() << "seed " << seed_);
  ScratchDir scratch;
  const std::vector<TestTensor> tensors = Set();
  ThreadPool pool(3);
  for (int world = 1; world <= 4; ++world) {
    SCOPED_TRACE(absl::StrCat("world size ", world));
    CKPT_ASSERT_OK_AND_ASSIGN(std::string dir, Write(absl::StrCat(scratch.path(), "/w", world), tensors, world));
    CKPT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CheckpointReader> reader, CheckpointReader::Open(dir));
    for (int round = 0; round < 8; ++round) {
      std::vector<TensorRead> reads;
      std::vector<std::vector<uint8_t>> buffers(tensors.size());
      std::vector<std::pair<size_t, size_t>> ranges(tensors.size());
      for (size_t i = 0; i < tensors.size(); ++i) {
        const size_t es = ElementBytes(tensors[i].dtype), n = tensors[i].data.size() / es;
        size_t a = n == 0 ? 0 : rng_() % (n + 1), b = n == 0 ? 0 : rng_() % (n + 1);
        if (a > b) std::swap(a, b);
        ranges[i] = {a * es, b * es};
        buffers[i].assign(b * es - a * es + 2 * kGuardBytes, kGuard);
        reads.push_back({.name = tensors[i].name, .dst = buffers[i].data() + kGuardBytes, .bytes = b * es - a * es,
                         .offset = a * es, .partial = true});
      }
      std::shuffle(reads.begin(), reads.end(), rng_);  // (buffers stay indexed by tensor)
      CKPT_ASSERT_OK(ReadTensors(*reader, reads, {.pool = &pool, .segment_bytes = 4096}));
      for (size_t i = 0; i < tensors.size(); ++i) {
        const auto [a, b] = ranges[i];
        const std::vector<uint8_t> want(tensors[i].data.begin() + static_cast<ptrdiff_t>(a),
                                        tensors[i].data.begin() + static_cast<ptrdiff_t>(b));
        const std::vector<uint8_t> got(buffers[i].begin() + kGuardBytes, buffers[i].end() - kGuardBytes);
        EXPECT_TRUE(got == want) << tensors[i].name << " [" << a << ", " << b << ")";
        for (size_t k = 0; k < kGuardBytes; ++k) {
          ASSERT_EQ(buffers[i][k], kGuard) << tensors[i].name;
          ASSERT_EQ(buffers[i][buffers[i].size() - 1 - k], kGuard) << tensors[i].name;
        }
      }
    }
  }
  // Corruption: the last chunk of the largest tensor of a 4-rank checkpoint.
  CKPT_ASSERT_OK_AND_ASSIGN(std::string dir, Write(scratch.path() + "/corrupt", tensors, 4));
  CKPT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CheckpointReader> before, CheckpointReader::Open(dir));
  const TensorEntry* big = nullptr;
  for (const TensorEntry& e : before->tensors()) {
    if (big == nullptr || e.bytes > big->bytes) big = &e;
  }
  ASSERT_GT(big->chunks.size(), 1u);
  const ManifestChunk last = big->chunks.back();
  XorByte(JoinPath(dir, last.file), last.file_offset + last.length / 2, 0x10);
  CKPT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CheckpointReader> reader, CheckpointReader::Open(dir));
  const size_t es = big->bytes / static_cast<size_t>(std::max<int64_t>(1, [&] {
                      int64_t n = 1;
                      for (int64_t d : big->shape) n *= d;
                      return n;
                    }()));
  std::vector<uint8_t> out(big->bytes);
  // Outside the corrupt chunk: fine.
  EXPECT_TRUE(ReadTensors(*reader, std::vector<TensorRead>{{.name = big->name, .dst = out.data(), .bytes = es,
                                                            .offset = 0, .partial = true}}, {}).ok());
  // Overlapping it by one element: the whole chunk is verified.
  absl::Status s = ReadTensors(*reader, std::vector<TensorRead>{{.name = big->name, .dst = out.data(), .bytes = es,
                                                                 .offset = last.global_offset, .partial = true}}, {});
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(big->name));
  // A range past the end is refused before any I/O.
  s = ReadTensors(*reader, std::vector<TensorRead>{{.name = big->name, .dst = out.data(), .bytes = es * 2,
                                                    .offset = big->bytes - es, .partial = true}}, {});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
}

// Many small tensors: many chunks per segment, and chunks split by segments and ranks.
TEST_F(BulkReaderTest, ManySmallTensorsShareSegments) {
  SCOPED_TRACE(testing::Message() << "seed " << seed_);
  ScratchDir scratch;
  std::vector<TestTensor> tensors;
  const DType dtypes[] = {DType::kF32, DType::kBF16, DType::kF16};
  for (int i = 0; i < 300; ++i) {
    tensors.push_back(RandomTensor(rng_, absl::StrCat("t", i), dtypes[i % 3],
                                   {static_cast<int64_t>(1 + rng_() % 3000)}));
  }
  ThreadPool pool(4);
  for (int world : {1, 3}) {
    SCOPED_TRACE(absl::StrCat("world size ", world));
    CKPT_ASSERT_OK_AND_ASSIGN(std::string dir,
                              Write(absl::StrCat(scratch.path(), "/w", world), tensors, world));
    CKPT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CheckpointReader> reader,
                              CheckpointReader::Open(dir));
    for (size_t segment : {size_t{4096}, size_t{65536}, BulkReadOptions{}.segment_bytes}) {
      SCOPED_TRACE(absl::StrCat("segment ", segment));
      Destinations d(tensors, segment);
      BulkReadStats stats;
      CKPT_ASSERT_OK(ReadTensors(*reader, AllReads(tensors, d),
                                 {.pool = &pool, .segment_bytes = segment}, &stats));
      for (size_t i = 0; i < tensors.size(); ++i) {
        ASSERT_TRUE(d.Contents(i, tensors[i].data.size()) == tensors[i].data) << tensors[i].name;
        ASSERT_TRUE(d.GuardsIntact(i, tensors[i].data.size())) << tensors[i].name;
      }
      EXPECT_GE(stats.bytes_read, TotalBytes(tensors));
      EXPECT_LE(stats.bytes_read, FileBytesCeiling(*reader));
    }
  }
}

// A subset: only the requested tensors are written, and a few small ones far from the big one do
// not make the reader read the big one.
TEST_F(BulkReaderTest, SubsetReadsOnlyWhatItNeeds) {
  SCOPED_TRACE(testing::Message() << "seed " << seed_);
  ScratchDir scratch;
  const std::vector<TestTensor> tensors = Set();
  ThreadPool pool(4);
  for (int world : {1, 2}) {
    SCOPED_TRACE(absl::StrCat("world size ", world));
    CKPT_ASSERT_OK_AND_ASSIGN(std::string dir,
                              Write(absl::StrCat(scratch.path(), "/w", world), tensors, world));
    CKPT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CheckpointReader> reader,
                              CheckpointReader::Open(dir));
    // 2-byte tensors are stored after the 4-byte ones (the 8 MiB "big" among them).
    const std::vector<std::string> wanted = {"w3", "w0", "one", "w2", "w1"};
    Destinations d(tensors, 5);
    std::vector<TensorRead> reads;
    uint64_t wanted_bytes = 0;
    for (const std::string& name : wanted) {
      for (size_t i = 0; i < tensors.size(); ++i) {
        if (tensors[i].name != name) continue;
        reads.push_back({.name = name, .dst = d.dst(i), .bytes = tensors[i].data.size()});
        wanted_bytes += tensors[i].data.size();
      }
    }
    ASSERT_EQ(reads.size(), wanted.size());
    BulkReadStats stats;
    CKPT_ASSERT_OK(ReadTensors(*reader, reads, {.pool = &pool}, &stats));
    for (size_t i = 0; i < tensors.size(); ++i) {
      const bool is_wanted =
          std::find(wanted.begin(), wanted.end(), tensors[i].name) != wanted.end();
      if (is_wanted) {
        EXPECT_TRUE(d.Contents(i, tensors[i].data.size()) == tensors[i].data) << tensors[i].name;
        EXPECT_TRUE(d.GuardsIntact(i, tensors[i].data.size())) << tensors[i].name;
      } else {
        EXPECT_TRUE(d.GuardsIntact(i, 0)) << tensors[i].name << " was not requested";
      }
    }
    EXPECT_GE(stats.bytes_read, wanted_bytes);
    EXPECT_LT(stats.bytes_read, uint64_t{1} << 20) << "the 8 MiB tensor should not be read";

    // Only the big one, and only with world size 2, a piece of it in each file.
    const size_t big = 8;
    ASSERT_EQ(tensors[big].name, "big");
    TensorRead r{.name = "big", .dst = d.dst(big), .bytes = tensors[big].data.size()};
    CKPT_ASSERT_OK(ReadTensors(*reader, absl::MakeConstSpan(&r, 1), {.pool = &pool}, &stats));
    EXPECT_TRUE(d.Contents(big, tensors[big].data.size()) == tensors[big].data);
    EXPECT_LE(stats.bytes_read, tensors[big].data.size() + (uint64_t{2} << 20));
  }
}

TEST_F(BulkReaderTest, EmptyRequestReadsNothing) {
  ScratchDir scratch;
  CKPT_ASSERT_OK_AND_ASSIGN(std::string dir, Write(scratch.path(), Set(), 2));
  CKPT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CheckpointReader> reader, CheckpointReader::Open(dir));
  BulkReadStats stats;
  stats.bytes_read = 99;
  CKPT_ASSERT_OK(ReadTensors(*reader, {}, {}, &stats));
  EXPECT_EQ(stats.bytes_read, 0u);
  // Only the empty tensor: its checksum (of no bytes) is verified, nothing is read.
  TensorRead r{.name = "empty"};
  CKPT_ASSERT_OK(ReadTensors(*reader, absl::MakeConstSpan(&r, 1), {}, &stats));
  EXPECT_EQ(stats.bytes_read, 0u);
}


}  // namespace
}  // namespace ferry
