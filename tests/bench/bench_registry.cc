#include <algorithm>
#include <vector>

#include "bench/bench.h"

namespace ferry::bench {
namespace {

std::vector<BenchInfo>& Registry() {
  static auto* registry = new std::vector<BenchInfo>();
  return *registry;
}

}  // namespace

Registrar::Registrar(const char* name, const char* help, BenchFn fn) { Registry().push_back({name, help, fn}); }

std::vector<BenchInfo> Benches() {
  std::vector<BenchInfo> out = Registry();
  std::sort(out.begin(), out.end(), [](const BenchInfo& a, const BenchInfo& b) { return a.name < b.name; });
  return out;
}

}  // namespace ferry::bench
