// The model descriptions and byte sizes of `ferry check` (commands.h: ParseModelSpec, ParseByteSize,
// HumanBytes). Split out of check_command.cc.
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>
#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/absl_compat.h"
#include "base/errors.h"
#include "ferry/dtype.h"
#include "ferry/status.h"
#include "lua/commands.h"
#include "lua/verb_flags.h"
#include "policy/policy.h"

namespace ferry::cli {
namespace {

// A number with an optional unit from `units` (exact, case-sensitive names), e.g. "1.5M".
absl::StatusOr<double> ParseScaled(absl::string_view text,
                                   const std::vector<std::pair<absl::string_view, double>>& units,
                                   absl::string_view what) {
  absl::string_view t = absl::StripAsciiWhitespace(text);
  size_t split = t.size();
  while (split > 0 && absl::ascii_isalpha(static_cast<unsigned char>(t[split - 1]))) --split;
  absl::string_view number = absl::StripAsciiWhitespace(t.substr(0, split));
  absl::string_view unit = t.substr(split);
  double scale = 0;
  for (const auto& [name, factor] : units) {
    if (unit == name) scale = factor;
  }
  double value = 0;
  // Plain decimal notation only (SimpleAtod alone would also take "0x1p4", "inf", "nan").
  const bool digit_first =
      !number.empty() &&
      (absl::ascii_isdigit(static_cast<unsigned char>(number[0])) || number[0] == '.') &&
      number.find_first_not_of("0123456789.eE+-") == absl::string_view::npos;
  if (scale == 0 || !digit_first || !absl::SimpleAtod(number, &value) || !std::isfinite(value) ||
      value < 0 || value * scale >= 9.2e18) {
    return absl::InvalidArgumentError(absl::StrCat("\"", text, "\" is not ", what));
  }
  return value * scale;
}

std::vector<std::pair<absl::string_view, double>> ByteUnits() {
  return {{"", 1},       {"B", 1},          {"K", 1e3},        {"KB", 1e3},
          {"M", 1e6},    {"MB", 1e6},       {"G", 1e9},        {"GB", 1e9},
          {"T", 1e12},   {"TB", 1e12},      {"KiB", 0x1p10},   {"MiB", 0x1p20},
          {"GiB", 0x1p30}, {"TiB", 0x1p40}};
}

absl::StatusOr<int64_t> ParseCount(absl::string_view text) {
  const std::vector<std::pair<absl::string_view, double>> units = {
      {"", 1}, {"K", 1e3}, {"M", 1e6}, {"G", 1e9}, {"T", 1e12}};
  FERRY_ASSIGN_OR_RETURN(
      double n,
      ParseScaled(text, units, "an element count (an integer, optionally with K, M, G or T)"));
  if (n != std::floor(n)) {
    return absl::InvalidArgumentError(
        absl::StrCat("\"", text, "\" is not a whole number of elements"));
  }
  return static_cast<int64_t>(n);
}

GroupInfo MakeGroup(std::string name, int64_t numel, DType dtype, std::vector<std::string> tags) {
  GroupInfo g;
  g.name = std::move(name);
  g.numel = numel;
  g.dtype = dtype;
  g.bytes = numel * static_cast<int64_t>(DTypeSize(dtype));
  g.tags = std::move(tags);
  return g;
}

absl::StatusOr<std::vector<GroupInfo>> GptModel(absl::string_view spec) {
  std::vector<absl::string_view> parts = absl::StrSplit(spec, ':');
  const std::string usage = absl::StrCat("model \"", spec, "\": expected gpt:LAYERS:HIDDEN[:VOCAB]");
  if (parts.size() < 3 || parts.size() > 4) return absl::InvalidArgumentError(usage);
  int64_t layers = 0, hidden = 0, vocab = 50257;
  if (!absl::SimpleAtoi(parts[1], &layers) || !absl::SimpleAtoi(parts[2], &hidden) ||
      (parts.size() == 4 && !absl::SimpleAtoi(parts[3], &vocab)) || layers < 0 ||
      layers > 100000 || hidden <= 0 || hidden > (int64_t{1} << 20) || vocab <= 0 ||
      vocab > (int64_t{1} << 24)) {
    return absl::InvalidArgumentError(
        absl::StrCat(usage, ", with 0 <= LAYERS <= 100000, 0 < HIDDEN <= 2^20, 0 < VOCAB <= 2^24"));
  }
  std::vector<GroupInfo> groups;
  groups.push_back(MakeGroup("embed", vocab * hidden, DType::kBF16, {"embedding"}));
  for (int64_t i = 0; i < layers; ++i) {
    groups.push_back(MakeGroup(absl::StrCat("layer", i), 12 * hidden * hidden + 13 * hidden,
                               DType::kBF16, {"transformer"}));
  }
  groups.push_back(MakeGroup("head", vocab * hidden, DType::kBF16, {"head"}));
  return groups;
}

absl::StatusOr<std::string> ReadWholeFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return PosixError(absl::StrCat("cannot open model file ", path), errno);
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return PosixError(absl::StrCat("cannot read model file ", path), errno);
  return text.str();
}

// "name:numel[:dtype[:tag+tag]]" entries separated by commas or newlines; '#' comments.
absl::StatusOr<std::vector<GroupInfo>> GroupList(absl::string_view text, absl::string_view where) {
  std::vector<GroupInfo> groups;
  std::set<std::string> names;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    line = line.substr(0, line.find('#'));
    for (absl::string_view entry : absl::StrSplit(line, ',')) {
      entry = absl::StripAsciiWhitespace(entry);
      if (entry.empty()) continue;
      const std::string at =
          where.empty() ? absl::StrCat("group \"", entry, "\"")
                        : absl::StrCat(where, ":", line_number, ": group \"", entry, "\"");
      std::vector<std::string> parts = absl::StrSplit(entry, ':');
      if (parts.size() < 2 || parts.size() > 4) {
        return absl::InvalidArgumentError(
            absl::StrCat(at, ": expected NAME:NUMEL[:DTYPE[:TAG+TAG...]]"));
      }
      for (std::string& p : parts) p = std::string(absl::StripAsciiWhitespace(p));
      if (parts[0].empty()) return absl::InvalidArgumentError(absl::StrCat(at, ": empty name"));
      if (!names.insert(parts[0]).second) {
        return absl::InvalidArgumentError(absl::StrCat(at, ": name \"", parts[0], "\" appears twice"));
      }
      absl::StatusOr<int64_t> numel = ParseCount(parts[1]);
      if (!numel.ok()) return absl::InvalidArgumentError(absl::StrCat(at, ": ", numel.status().message()));
      DType dtype = DType::kBF16;
      if (parts.size() >= 3 && !parts[2].empty()) {
        absl::StatusOr<DType> d = ParseDType(parts[2]);
        if (!d.ok()) {
          return absl::InvalidArgumentError(
              absl::StrCat(at, ": dtype \"", parts[2], "\"; expected bf16, f16 or f32"));
        }
        dtype = *d;
      }
      std::vector<std::string> tags;
      if (parts.size() == 4 && !parts[3].empty()) tags = absl::StrSplit(parts[3], '+');
      groups.push_back(MakeGroup(parts[0], *numel, dtype, std::move(tags)));
    }
  }
  if (groups.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(where.empty() ? "model" : where, ": no groups"));
  }
  return groups;
}

}  // namespace

std::string HumanBytes(int64_t bytes) {
  const char* units[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  if (bytes < 1024) return absl::StrCat(bytes, " B");
  double v = static_cast<double>(bytes);
  int u = -1;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  return absl::StrFormat("%.1f %s", v, units[u]);
}

absl::StatusOr<int64_t> ParseByteSize(std::string_view text) {
  FERRY_ASSIGN_OR_RETURN(
      double bytes,
      ParseScaled(ToAbsl(text), ByteUnits(),
                  "a byte size (a number, optionally with B, K, M, G, T, KiB, MiB, GiB or TiB)"));
  return static_cast<int64_t>(std::floor(bytes));
}

absl::StatusOr<std::vector<GroupInfo>> ParseModelSpec(std::string_view spec_in) {
  absl::string_view spec = absl::StripAsciiWhitespace(ToAbsl(spec_in));
  if (spec.empty()) spec = kDefaultModelSpec;
  if (absl::StartsWith(spec, "gpt:")) return GptModel(spec);
  if (absl::ConsumePrefix(&spec, "@")) {
    const std::string path(spec);
    FERRY_ASSIGN_OR_RETURN(std::string text, ReadWholeFile(path));
    return GroupList(text, path);
  }
  return GroupList(spec, "");
}

}  // namespace ferry::cli
