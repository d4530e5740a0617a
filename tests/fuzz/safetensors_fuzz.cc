// Fuzz target for the checkpoint parsers that read untrusted bytes: the safetensors header
// (ParseSafetensorsFile) and manifest.json (ParseManifest). The first input byte picks the parser;
// the rest is the file. A parser must return a Status for any input: never crash, hang, or
// allocate what a header claims.
//
// Built two ways (tests/fuzz/CMakeLists.txt): with libFuzzer (-fsanitize=fuzzer, clang only) and
// run for a bounded time by ctest; and everywhere as a plain executable whose main() replays the
// files given on the command line (the corpus in tests/fuzz/corpus/).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>

#include "absl/strings/string_view.h"
#include "ckpt/manifest.h"
#include "ckpt/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const absl::string_view bytes(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 0) {
    absl::StatusOr<ferry::SafetensorsHeader> h = ferry::ParseSafetensorsFile(bytes, "fuzz.safetensors");
    if (h.ok()) {
      // What a reader relies on: entries tile the data section inside the file.
      uint64_t expected = 0;
      for (const ferry::SafetensorsEntry& e : h->entries) {
        if (e.begin != expected || e.end < e.begin) __builtin_trap();
        expected = e.end;
      }
      if (h->data_start + expected != bytes.size()) __builtin_trap();
    }
  } else {
    absl::StatusOr<ferry::Manifest> m = ferry::ParseManifest(bytes, "fuzz/manifest.json");
    if (m.ok()) {
      for (const ferry::ManifestTensor& t : m->tensors) {
        uint64_t covered = 0;
        for (const ferry::ManifestChunk& c : t.chunks) {
          if (c.global_offset != covered || c.rank < 0 || c.rank >= m->world_size) __builtin_trap();
          covered += c.length;
        }
        if (covered != t.bytes) __builtin_trap();
      }
      // A parsed manifest serializes and parses back.
      absl::StatusOr<std::string> text = ferry::SerializeManifest(*m);
      if (text.ok() && !ferry::ParseManifest(*text, "again").ok()) __builtin_trap();
    }
  }
  return 0;
}

#ifndef FERRY_LIBFUZZER
// Replays every file named on the command line; exits non-zero if one cannot be read.
int main(int argc, char** argv) {
  int replayed = 0;
  for (int i = 1; i < argc; ++i) {
    std::ifstream in(argv[i], std::ios::binary);
    if (!in) {
      std::fprintf(stderr, "safetensors_fuzz: cannot read %s\n", argv[i]);
      return 1;
    }
    const std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(data.data()), data.size());
    ++replayed;
  }
  std::printf("safetensors_fuzz: replayed %d inputs\n", replayed);
  return 0;
}
#endif
