// Engine: several ranks. The exchange of param specs at Finalize (same params everywhere, ranges that
// tile every global tensor), the all-reduce of a step's gradient check, and the small agreements
// that make every rank return the same outcome.
#include <algorithm>
#include <cstring>
#include <map>
#include <string_view>

#include "base/exact_sum.h"
#include "engine/engine_impl.h"

namespace ferry {
namespace engine_internal {
namespace {

// Field-by-field encoding of the specs a rank registered (little-endian host order is fine: every
// rank of one job runs the same build on the same kind of machine, and the blob never leaves the job).
void PutI64(std::string& out, int64_t v) { out.append(reinterpret_cast<const char*>(&v), sizeof(v)); }
void PutStr(std::string& out, std::string_view s) {
  PutI64(out, static_cast<int64_t>(s.size()));
  out.append(s.data(), s.size());
}

class Cursor {
 public:
  explicit Cursor(std::string_view data) : data_(data) {}
  bool I64(int64_t* v) {
    if (data_.size() < sizeof(*v)) return false;
    std::memcpy(v, data_.data(), sizeof(*v));
    data_.remove_prefix(sizeof(*v));
    return true;
  }
  bool Str(std::string* s) {
    int64_t n = 0;
    if (!I64(&n) || n < 0 || static_cast<uint64_t>(n) > data_.size()) return false;
    s->assign(data_.data(), static_cast<size_t>(n));
    data_.remove_prefix(static_cast<size_t>(n));
    return true;
  }
  bool done() const { return data_.empty(); }

 private:
  std::string_view data_;
};

// What one rank registered for one param.
struct RemoteSpec {
  std::string name, group;
  int64_t dtype = 0, grad_dtype = 0;
  std::vector<int64_t> shape;
  int64_t begin = 0, end = 0;
};

// `groups`: every group's FormatGroupSettings, by name (after the params).
std::string EncodeSpecs(const std::vector<ParamRecord>& params, const std::map<std::string, std::string>& groups) {
  std::string out;
  PutI64(out, static_cast<int64_t>(params.size()));
  for (const ParamRecord& p : params) {
    PutStr(out, p.spec.name);
    PutStr(out, p.spec.group);
    PutI64(out, static_cast<int64_t>(p.spec.dtype));
    PutI64(out, static_cast<int64_t>(p.spec.grad_dtype.value_or(p.spec.dtype)));
    PutI64(out, static_cast<int64_t>(p.spec.shape.size()));
    for (int64_t d : p.spec.shape) PutI64(out, d);
    PutI64(out, p.spec.shard_begin);
    PutI64(out, p.spec.shard_end);
  }
  PutI64(out, static_cast<int64_t>(groups.size()));
  for (const auto& [name, settings] : groups) {
    PutStr(out, name);
    PutStr(out, settings);
  }
  return out;
}

absl::StatusOr<std::vector<RemoteSpec>> DecodeSpecs(std::string_view blob, int rank,
                                                     std::map<std::string, std::string>* groups) {
  Cursor c(blob);
  int64_t n = 0;
  std::vector<RemoteSpec> out;
  bool ok = c.I64(&n) && n >= 0;
  for (int64_t i = 0; ok && i < n; ++i) {
    RemoteSpec s;
    int64_t ndim = 0;
    ok = c.Str(&s.name) && c.Str(&s.group) && c.I64(&s.dtype) && c.I64(&s.grad_dtype) && c.I64(&ndim) && ndim >= 0 &&
         ndim <= 64;
    for (int64_t d = 0; ok && d < ndim; ++d) {
      int64_t v = 0;
      ok = c.I64(&v);
      s.shape.push_back(v);
    }
    ok = ok && c.I64(&s.begin) && c.I64(&s.end);
    out.push_back(std::move(s));
  }
  int64_t num_groups = 0;
  ok = ok && c.I64(&num_groups) && num_groups >= 0;
  for (int64_t i = 0; ok && i < num_groups; ++i) {
    std::string name, settings;
    ok = c.Str(&name) && c.Str(&settings);
    (*groups)[name] = settings;
  }
  if (!ok || !c.done()) {
    return absl::DataLossError(absl::StrCat("Finalize: the param specs received from rank ", rank, " are malformed"));
  }
  return out;
}

std::string DescribeSpec(const RemoteSpec& s) {
  return absl::StrCat("group '", s.group, "', ", ToAbsl(DTypeName(static_cast<DType>(s.dtype))), "[",
                      absl::StrJoin(s.shape, ","), "] (grads ", ToAbsl(DTypeName(static_cast<DType>(s.grad_dtype))), ")");
}

// The verdict on every rank's specs: the same names, groups, dtypes and global shapes everywhere, and
// for every param ranges that tile [0, numel) without overlap. The same on every rank (same input).
absl::Status CheckSpecs(const std::vector<std::vector<RemoteSpec>>& ranks) {
  const int world = static_cast<int>(ranks.size());
  const std::vector<RemoteSpec>& first = ranks[0];
  absl::flat_hash_map<std::string, size_t> index;
  for (size_t i = 0; i < first.size(); ++i) index.emplace(first[i].name, i);
  // ranges[i]: (begin, end, rank) of every non-empty range of param i of rank 0's list.
  std::vector<std::vector<std::tuple<int64_t, int64_t, int>>> ranges(first.size());
  for (int r = 0; r < world; ++r) {
    std::vector<bool> seen(first.size(), false);
    for (const RemoteSpec& s : ranks[static_cast<size_t>(r)]) {
      auto it = index.find(s.name);
      if (it == index.end()) {
        return absl::InvalidArgumentError(absl::StrCat("Finalize: rank ", r, " of ", world, " registered param '",
                                                       s.name, "', which rank 0 did not"));
      }
      const RemoteSpec& ref = first[it->second];
      if (s.group != ref.group || s.dtype != ref.dtype || s.grad_dtype != ref.grad_dtype || s.shape != ref.shape) {
        return absl::InvalidArgumentError(absl::StrCat("Finalize: rank ", r, " of ", world, " registered param '", s.name,
                                                       "' as ", DescribeSpec(s), " but rank 0 as ", DescribeSpec(ref)));
      }
      seen[it->second] = true;
      if (s.end > s.begin) ranges[it->second].emplace_back(s.begin, s.end, r);
    }
    for (size_t i = 0; i < first.size(); ++i) {
      if (!seen[i]) {
        return absl::InvalidArgumentError(absl::StrCat("Finalize: rank ", r, " of ", world, " did not register param '",
                                                       first[i].name, "' (rank 0 did; register it with an empty range "
                                                       "where the rank holds none of it)"));
      }
    }
  }
  for (size_t i = 0; i < first.size(); ++i) {
    int64_t numel = 1;
    for (int64_t d : first[i].shape) numel *= d;
    std::sort(ranges[i].begin(), ranges[i].end());
    int64_t covered = 0;
    int last_rank = -1;
    for (const auto& [begin, end, r] : ranges[i]) {
      if (begin < covered) {
        return absl::InvalidArgumentError(absl::StrCat("Finalize: ranks ", last_rank, " and ", r, " both hold elements [",
                                                       begin, ", ", std::min(end, covered), ") of param '",
                                                       first[i].name, "'; the ranks' ranges must not overlap"));
      }
      if (begin > covered) {
        return absl::InvalidArgumentError(absl::StrCat("Finalize: no rank holds elements [", covered, ", ", begin,
                                                       ") of param '", first[i].name, "' (", numel, " elements)"));
      }
      covered = end;
      last_rank = r;
    }
    if (covered != numel) {
      return absl::InvalidArgumentError(absl::StrCat("Finalize: no rank holds elements [", covered, ", ", numel,
                                                     ") of param '", first[i].name, "' (", numel, " elements)"));
    }
  }
  return absl::OkStatus();
}

// Every group's optimizer settings must be the same on every rank (every rank steps its shards of
// a group with them). The same verdict on every rank (same input).
absl::Status CheckGroupSettings(const std::vector<std::map<std::string, std::string>>& ranks) {
  const int world = static_cast<int>(ranks.size());
  for (int r = 1; r < world; ++r) {
    for (const auto& [name, settings] : ranks[static_cast<size_t>(r)]) {
      auto it = ranks[0].find(name);
      if (it == ranks[0].end() || it->second == settings) continue;  // (a missing group is CheckSpecs')
      std::vector<std::string> diffs;
      for (const auto& [field, theirs, rank0] : DiffGroupSettings(settings, it->second)) {
        diffs.push_back(absl::StrCat(field, " ", theirs, " (rank 0: ", rank0, ")"));
      }
      return absl::InvalidArgumentError(absl::StrCat("Finalize: rank ", r, " of ", world, " gives group '", name,
                                                     "' other optimizer settings than rank 0: ",
                                                     diffs.empty() ? settings : absl::StrJoin(diffs, ", "),
                                                     "; every rank must give every group the same"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status EngineImpl::Agree(const absl::Status& mine, std::string_view what) {
  if (!multi_rank()) return mine;
  return AgreeStatus(*comm_, mine, what, options_.collective_timeout);
}

absl::Status EngineImpl::BroadcastFromRankZero(std::string* blob, std::string_view what) {
  if (!multi_rank()) return absl::OkStatus();
  absl::Status s = comm_->Broadcast(blob, 0, options_.collective_timeout);
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat(ToAbsl(what), ": ", s.message()));
  return s;
}

absl::Status EngineImpl::ExchangeSpecs() {
  canonical_.resize(params_.size());
  std::iota(canonical_.begin(), canonical_.end(), 0);
  if (options_.world_size != world_size() || options_.rank != rank()) {
    // Not collective: the options contradict the comm, which is a bug of this process's setup.
    return absl::InvalidArgumentError(absl::StrCat("Finalize: EngineOptions say rank ", options_.rank, " of ",
                                                   options_.world_size, " but the ", ToAbsl(comm_->kind()), " comm is rank ",
                                                   rank(), " of ", world_size()));
  }
  if (!multi_rank()) return absl::OkStatus();
  std::map<std::string, std::string> settings;
  for (size_t g = 0; g < group_names_.size(); ++g) {
    settings[group_names_[g]] = FormatGroupSettings(ResolvedGroupOptions(g), options_.optimizer.bias_correction);
  }
  FERRY_ASSIGN_OR_RETURN(std::vector<std::string> blobs,
                         comm_->AllGather(EncodeSpecs(params_, settings), options_.collective_timeout));
  std::vector<std::vector<RemoteSpec>> ranks;
  std::vector<std::map<std::string, std::string>> group_settings(blobs.size());
  for (size_t r = 0; r < blobs.size(); ++r) {
    FERRY_ASSIGN_OR_RETURN(std::vector<RemoteSpec> specs,
                           DecodeSpecs(blobs[r], static_cast<int>(r), &group_settings[r]));
    ranks.push_back(std::move(specs));
  }
  if (ranks[0].empty()) return absl::FailedPreconditionError("Finalize: no params were added (on rank 0)");
  FERRY_RETURN_IF_ERROR(CheckSpecs(ranks));
  FERRY_RETURN_IF_ERROR(CheckGroupSettings(group_settings));
  for (size_t i = 0; i < ranks[0].size(); ++i) canonical_[i] = param_index_.at(ranks[0][i].name);
  return absl::OkStatus();
}

absl::Status EngineImpl::CheckStatePrecisionAgrees(const HybridOptimizer& optimizer) {
  if (!multi_rank()) return absl::OkStatus();
  // One line per group, by name (the same groups on every rank: ExchangeSpecs checked them).
  std::map<std::string, std::string> formats;
  for (size_t g = 0; g < group_names_.size(); ++g) formats[group_names_[g]] = DescribeStateFormat(optimizer.group_state(g));
  std::string mine;
  for (const auto& [name, format] : formats) absl::StrAppend(&mine, name, "\t", format, "\n");
  FERRY_ASSIGN_OR_RETURN(std::vector<std::string> all, comm_->AllGather(mine, options_.collective_timeout));
  // Line i of a rank's report: group i's name, a tab, its format.
  auto line = [](const std::string& report, size_t i) {
    size_t begin = 0;
    for (size_t k = 0; k < i && begin != std::string::npos; ++k) {
      begin = report.find('\n', begin);
      if (begin != std::string::npos) ++begin;
    }
    if (begin == std::string::npos || begin >= report.size()) return std::string();
    return report.substr(begin, report.find('\n', begin) - begin);
  };
  for (size_t r = 1; r < all.size(); ++r) {
    if (all[r] == all[0]) continue;
    for (size_t g = 0; g < formats.size(); ++g) {
      const std::string a = line(all[0], g), b = line(all[r], g);
      if (a == b) continue;
      auto format = [](const std::string& l) { return l.substr(std::min(l.size(), l.find('\t') + 1)); };
      return absl::InvalidArgumentError(absl::StrCat(
          "Finalize: the policy gave group '", b.substr(0, b.find('\t')), "' another state precision on rank ", r, " of ",
          all.size(), " (", format(b), ") than on rank 0 (", format(a), "); every rank must keep a group's ",
          "optimizer state in the same dtypes (a policy must not decide precision by rank)"));
    }
    return absl::InvalidArgumentError(absl::StrCat("Finalize: rank ", r, " reports other groups' state precision than rank 0"));
  }
  return absl::OkStatus();
}

absl::Status EngineImpl::ReduceGradStats(GradStats& stats, const absl::Status& mine) {
  // [failed, found_inf, the exact sum's digits]: integers held exactly in doubles, so the sum over
  // the ranks is exact and the same whatever the world size.
  std::vector<double> values(2 + ExactSumSq::kExchangeDoubles, 0.0);
  values[0] = mine.ok() ? 0.0 : 1.0;
  if (mine.ok()) {
    values[1] = stats.found_inf != 0 ? 1.0 : 0.0;
    stats.exact.ToExchange(values.data() + 2);
  }
  absl::Status s = comm_->AllReduce(absl::MakeSpan(values), ReduceOp::kSum, options_.collective_timeout);
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat("Step: the gradient check's all-reduce failed: ", s.message()));
  if (values[0] > 0.0) return Agree(mine, "Step");  // every rank saw the failure: name the ranks
  stats = GradStatsFromExact(ExactSumSq::FromExchange(values.data() + 2), values[1] > 0.0);
  return absl::OkStatus();
}

}  // namespace engine_internal
}  // namespace ferry
