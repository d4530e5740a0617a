// ReadTensors, the bulk reader: every world size, pool size, segment size and I/O mode gives the
// written tensors byte for byte (and what CheckpointReader::ReadTensor gives), into unaligned
// destinations without touching a byte around them; subsets read only what they need; corruption,
// truncation and bad requests are refused with errors that name the file and the tensor; file
// systems without O_DIRECT fall back to buffered reads.
#include "ckpt/bulk_reader.h"

#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "base/thread_pool.h"
#include "ckpt/checkpoint.h"
#include "ckpt/ckpt_test_util.h"
#include "ckpt/posix_file.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace ferry {
namespace {

using ::testing::HasSubstr;
using namespace ::ferry::ckpt_test;  // NOLINT

constexpr uint8_t kGuard = 0x5A;
constexpr size_t kGuardBytes = 64;

// Whether files in `dir` can be opened and read with O_DIRECT.
bool DirAllowsODirect(const std::string& dir) {
  const std::string path = dir + "/odirect_probe";
  {
    std::string block(8192, 'x');
    WriteWholeFile(path, block);
  }
  bool ok = false;
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
  if (fd >= 0) {
    void* buf = std::aligned_alloc(4096, 4096);
    ok = buf != nullptr && ::pread(fd, buf, 4096, 0) == 4096;
    std::free(buf);
    ::close(fd);
  }
  ::unlink(path.c_str());
  return ok;
}

// Destinations for every tensor of a set at an odd offset inside a buffer filled with kGuard, so
// both misalignment and any write outside [dst, dst + bytes) show.
class Destinations {
 public:
  Destinations(const std::vector<TestTensor>& tensors, size_t skew) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      const size_t skewed = 1 + (i + skew) % 13;  // never 0: unaligned for every dtype
      buffers_.emplace_back(kGuardBytes + 13 + tensors[i].data.size() + kGuardBytes, kGuard);
      offsets_.push_back(kGuardBytes + skewed);
    }
  }
  uint8_t* dst(size_t i) { return buffers_[i].data() + offsets_[i]; }
  // The bytes written to tensor i's destination.
  std::vector<uint8_t> Contents(size_t i, size_t bytes) const {
    auto begin = buffers_[i].begin() + static_cast<ptrdiff_t>(offsets_[i]);
    return std::vector<uint8_t>(begin, begin + static_cast<ptrdiff_t>(bytes));
  }
  // Whether every byte outside tensor i's destination still holds kGuard.
  bool GuardsIntact(size_t i, size_t bytes) const {
    const std::vector<uint8_t>& b = buffers_[i];
    for (size_t k = 0; k < b.size(); ++k) {
      if (k >= offsets_[i] && k < offsets_[i] + bytes) continue;
      if (b[k] != kGuard) return false;
    }
    return true;
  }

 private:
  std::vector<std::vector<uint8_t>> buffers_;
  std::vector<size_t> offsets_;
};

class BulkReaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = std::random_device{}();
    rng_.seed(seed_);
  }

  // Several dtypes and odd sizes that split mid-tensor for every world size, a scalar, an empty
  // tensor, 1-element tensors, and a tensor larger than the default 8 MiB segment.
  std::vector<TestTensor> Set() {
    std::vector<TestTensor> v = MixedTensors(rng_);
    v.push_back(RandomTensor(rng_, "w3", DType::kF16, {3, 7, 5}, "model", "g1"));
    v.push_back(RandomTensor(rng_, "w3:exp_avg_sq", DType::kF32, {3, 7, 5}, "exp_avg_sq", "g1"));
    return v;
  }

  CheckpointWriteOptions Fast() const {
    CheckpointWriteOptions o;
    o.fsync = false;
    return o;
  }

  absl::StatusOr<std::string> Write(const std::string& root, const std::vector<TestTensor>& t,
                                    int world_size) {
    return WriteShardedCheckpoint(root, 3, Records(t), world_size, {}, {{"trainer", "bulk"}},
                                  Fast());
  }

  uint32_t seed_ = 0;
  std::mt19937_64 rng_;
};

std::vector<TensorRead> AllReads(const std::vector<TestTensor>& tensors, Destinations& d) {
  std::vector<TensorRead> reads;
  for (size_t i = 0; i < tensors.size(); ++i) {
    reads.push_back({.name = tensors[i].name, .dst = d.dst(i), .bytes = tensors[i].data.size()});
  }
  return reads;
}

// Sum over the checkpoint's rank files of their sizes rounded up to 4 KiB: the most that reading
// every byte of every file once can cost.
uint64_t FileBytesCeiling(const CheckpointReader& reader) {
  std::map<std::string, bool> files;
  for (const TensorEntry& e : reader.tensors()) {
    for (const ManifestChunk& c : e.chunks) files[c.file] = true;
  }
  uint64_t total = 0;
  for (const auto& [name, unused] : files) {
    total += (ReadWholeFile(JoinPath(reader.dir(), name)).size() + 4095) / 4096 * 4096;
  }
  return total;
}

uint64_t TotalBytes(const std::vector<TestTensor>& tensors) {
  uint64_t n = 0;
  for (const TestTensor& t : tensors) n += t.data.size();
  return n;
}

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
