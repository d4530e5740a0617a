// A fresh directory under the system's temporary directory, removed with everything in it: the
// scratch space the tests share (engine/engine_test_util.h, bindings/command_capture.h).
#ifndef FERRY_TESTS_TEMP_DIR_H_
#define FERRY_TESTS_TEMP_DIR_H_

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace ferry::testing_util {

class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "ferry-test") {
    std::string tmpl = (std::filesystem::temp_directory_path() / (prefix + "-XXXXXX")).string();
    path_ = mkdtemp(tmpl.data());
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  // Writes `text` to <path>/<name> and returns that path.
  std::string Write(const std::string& name, const std::string& text) const {
    const std::string p = path_ + "/" + name;
    std::ofstream(p, std::ios::binary) << text;
    return p;
  }

 private:
  std::string path_;
};

}  // namespace ferry::testing_util

#endif  // FERRY_TESTS_TEMP_DIR_H_
