// Helpers shared by the checkpoint tests: a scratch directory, random tensors, file surgery.
#ifndef FERRY_TESTS_CKPT_CKPT_TEST_UTIL_H_
#define FERRY_TESTS_CKPT_CKPT_TEST_UTIL_H_

#include <stdlib.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "ckpt/checkpoint.h"
#include "gtest/gtest.h"

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

namespace ferry::ckpt_test {

struct TestTensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::string kind;
  std::string group;
  std::vector<uint8_t> data;
};

inline size_t ElementBytes(DType t) { return t == DType::kF32 ? 4 : 2; }

// Fresh random bytes (every bit pattern; the comparisons are bitwise), never all zeros.
inline TestTensor RandomTensor(std::mt19937_64& rng, std::string name, DType dtype,
                               std::vector<int64_t> shape, std::string kind = "model",
                               std::string group = "g0") {
  size_t n = ElementBytes(dtype);
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  TestTensor t{std::move(name), dtype, std::move(shape), std::move(kind), std::move(group), {}};
  t.data.resize(n);
  for (size_t i = 0; i < n; i += 8) {
    uint64_t w = rng();
    std::memcpy(t.data.data() + i, &w, std::min<size_t>(8, n - i));
  }
  if (n > 0) t.data[0] |= 1;
  return t;
}

// Kinds of several dtypes, sizes that split mid-tensor for every world size up to 4, a scalar, an
// empty tensor, 1-element tensors, and a tensor larger than the 8 MiB write pieces and read
// segments: fresh random values each call.
inline std::vector<TestTensor> MixedTensors(std::mt19937_64& rng) {
  std::vector<TestTensor> v;
  v.push_back(RandomTensor(rng, "w0", DType::kBF16, {37, 11}));
  v.push_back(RandomTensor(rng, "w0:master", DType::kF32, {37, 11}, "master"));
  v.push_back(RandomTensor(rng, "w0:exp_avg", DType::kF32, {37, 11}, "exp_avg"));
  v.push_back(RandomTensor(rng, "w1", DType::kF16, {5}, "model", "g1"));
  v.push_back(RandomTensor(rng, "w1:master", DType::kF32, {5}, "master", "g1"));
  v.push_back(RandomTensor(rng, "scale", DType::kF32, {}, "model", ""));
  v.push_back(RandomTensor(rng, "one", DType::kBF16, {1}));
  v.push_back(RandomTensor(rng, "empty", DType::kF32, {4, 0}));
  v.push_back(RandomTensor(rng, "big", DType::kF32, {2 * 1024 * 1024 + 3}, "master", "g2"));
  v.push_back(RandomTensor(rng, "w2", DType::kBF16, {1001}));
  return v;
}

inline std::vector<TensorRecord> Records(const std::vector<TestTensor>& tensors) {
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

inline std::string ReadWholeFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

inline void WriteWholeFile(const std::string& path, const std::string& contents) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
}

// Flips the bits `mask` of the byte at `offset` in place.
inline void XorByte(const std::string& path, uint64_t offset, uint8_t mask) {
  std::error_code ec;
  ASSERT_LT(offset, std::filesystem::file_size(path, ec)) << path << (ec ? ": " + ec.message() : "");
  std::fstream f(path, std::ios::binary | std::ios::in | std::ios::out);
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(static_cast<uint8_t>(c) ^ mask);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
}

inline bool Exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

// A fresh directory under the test temp dir, removed on destruction.
class ScratchDir {
 public:
  ScratchDir() {
    std::string tmpl = ::testing::TempDir() + "ferry_ckpt_XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) ADD_FAILURE() << std::strerror(errno);
    path_ = tmpl;
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace ferry::ckpt_test

#endif  // FERRY_TESTS_CKPT_CKPT_TEST_UTIL_H_
