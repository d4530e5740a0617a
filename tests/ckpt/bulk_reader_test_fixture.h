// The fixture and helpers of the bulk reader tests (bulk_reader_test.cc: what is read;
// bulk_reader_fault_test.cc: corruption, truncation, bad requests, O_DIRECT fallback).
#ifndef FERRY_TESTS_CKPT_BULK_READER_TEST_FIXTURE_H_
#define FERRY_TESTS_CKPT_BULK_READER_TEST_FIXTURE_H_

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

namespace ferry::bulk_reader_test {

using ::testing::HasSubstr;
using namespace ::ferry::ckpt_test;  // NOLINT

inline constexpr uint8_t kGuard = 0x5A;
inline constexpr size_t kGuardBytes = 64;

// Whether files in `dir` can be opened and read with O_DIRECT.
inline bool DirAllowsODirect(const std::string& dir) {
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

inline std::vector<TensorRead> AllReads(const std::vector<TestTensor>& tensors, Destinations& d) {
  std::vector<TensorRead> reads;
  for (size_t i = 0; i < tensors.size(); ++i) {
    reads.push_back({.name = tensors[i].name, .dst = d.dst(i), .bytes = tensors[i].data.size()});
  }
  return reads;
}

// Sum over the checkpoint's rank files of their sizes rounded up to 4 KiB: the most that reading
// every byte of every file once can cost.
inline uint64_t FileBytesCeiling(const CheckpointReader& reader) {
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

inline uint64_t TotalBytes(const std::vector<TestTensor>& tensors) {
  uint64_t n = 0;
  for (const TestTensor& t : tensors) n += t.data.size();
  return n;
}


}  // namespace ferry::bulk_reader_test

#endif  // FERRY_TESTS_CKPT_BULK_READER_TEST_FIXTURE_H_
