#include "ckpt/distributed_checkpoint.h"

#include <cstring>
#include <optional>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "ckpt/posix_file.h"
#include "ferry/status.h"

namespace ferry {
namespace {

// A rank's outcome of step 2, field by field: ok flag, status code and message, then its chunks.
void PutU64(std::string& out, uint64_t v) { out.append(reinterpret_cast<const char*>(&v), sizeof(v)); }
void PutStr(std::string& out, std::string_view s) {
  PutU64(out, s.size());
  out.append(s.data(), s.size());
}

bool GetU64(std::string_view& in, uint64_t* v) {
  if (in.size() < sizeof(*v)) return false;
  std::memcpy(v, in.data(), sizeof(*v));
  in.remove_prefix(sizeof(*v));
  return true;
}
bool GetStr(std::string_view& in, std::string* s) {
  uint64_t n = 0;
  if (!GetU64(in, &n) || n > in.size()) return false;
  s->assign(in.data(), static_cast<size_t>(n));
  in.remove_prefix(static_cast<size_t>(n));
  return true;
}

std::string EncodeOutcome(const absl::StatusOr<RankChunks>& written) {
  std::string out;
  PutU64(out, static_cast<uint64_t>(written.status().code()));
  PutStr(out, std::string(written.status().message()));
  if (!written.ok()) return out;
  PutU64(out, written->chunks.size());
  for (const auto& [tensor, c] : written->chunks) {
    PutU64(out, tensor);
    PutStr(out, c.file);
    PutU64(out, c.global_offset);
    PutU64(out, c.length);
    PutU64(out, c.file_offset);
    PutU64(out, c.checksum);
  }
  return out;
}

absl::StatusOr<RankChunks> DecodeOutcome(std::string_view in, int rank) {
  const absl::Status malformed =
      absl::DataLossError(absl::StrCat("checkpoint: the outcome received from rank ", rank, " is malformed"));
  uint64_t code = 0, n = 0;
  std::string message;
  if (!GetU64(in, &code) || !GetStr(in, &message)) return malformed;
  if (code != 0) return absl::Status(static_cast<absl::StatusCode>(code), message);
  RankChunks out;
  out.rank = rank;
  if (!GetU64(in, &n)) return malformed;
  for (uint64_t i = 0; i < n; ++i) {
    uint64_t tensor = 0;
    ManifestChunk c;
    c.rank = rank;
    if (!GetU64(in, &tensor) || !GetStr(in, &c.file) || !GetU64(in, &c.global_offset) || !GetU64(in, &c.length) ||
        !GetU64(in, &c.file_offset) || !GetU64(in, &c.checksum)) {
      return malformed;
    }
    out.chunks.emplace_back(static_cast<size_t>(tensor), std::move(c));
  }
  if (!in.empty()) return malformed;
  return out;
}

}  // namespace

absl::StatusOr<std::string> WriteDistributedCheckpoint(Comm& comm, absl::Duration timeout, const std::string& root,
                                                       int64_t step, absl::Span<const TensorRecord> tensors,
                                                       std::vector<ShardPiece> pieces,
                                                       absl::Span<const SkipRecord> skipped,
                                                       const std::map<std::string, std::string>& metadata,
                                                       const CheckpointWriteOptions& options) {
  const int rank = comm.rank();
  const int world = comm.world_size();
  const std::string what = absl::StrCat("checkpoint ", step, " in ", root);
  // 1. Plan: every rank plans its own file (no disk); rank 0 then begins the checkpoint (collecting
  // the root's crash leftovers first, the other ranks waiting at the agreement).
  absl::StatusOr<SavePlan> plan =
      PlanRankSave(root, step, tensors, world, rank, std::move(pieces), skipped, metadata, options);
  std::optional<PendingCheckpoint> pending;  // rank 0's; aborts itself unless committed
  absl::Status mine = plan.status();
  if (mine.ok() && rank == 0) {
    absl::StatusOr<PendingCheckpoint> begun = PendingCheckpoint::Begin(root, step, options);
    mine = begun.status();
    if (begun.ok()) pending.emplace(*std::move(begun));
  }
  FERRY_RETURN_IF_ERROR(AgreeStatus(comm, mine, what, timeout));

  // 2. Pieces: every rank writes its file; the outcomes and chunk tables go to every rank.
  absl::StatusOr<RankChunks> written = WriteRankFile(IncompleteDirPath(root, step), tensors, plan->files[0], options);
  if (!written.ok()) {
    written = absl::Status(written.status().code(),
                           absl::StrCat("writing ", RankFileName(rank), ": ", written.status().message()));
  }
  absl::StatusOr<std::vector<std::string>> outcomes = comm.AllGather(EncodeOutcome(written), timeout);
  if (!outcomes.ok()) {
    return absl::Status(outcomes.status().code(), absl::StrCat(what, ": exchanging the ranks' outcomes failed: ",
                                                               outcomes.status().message()));
  }
  std::vector<RankChunks> ranks;
  std::vector<std::string> failures;
  absl::StatusCode first_code = absl::StatusCode::kOk;
  for (int r = 0; r < world; ++r) {
    absl::StatusOr<RankChunks> o = DecodeOutcome((*outcomes)[static_cast<size_t>(r)], r);
    if (o.ok()) {
      ranks.push_back(*std::move(o));
      continue;
    }
    if (first_code == absl::StatusCode::kOk) first_code = o.status().code();
    failures.push_back(absl::StrCat("rank ", r, " of ", world, ": ", o.status().message()));
  }
  if (!failures.empty()) {
    return absl::Status(first_code, absl::StrCat(what, " failed (nothing committed; the previous checkpoint stays "
                                                 "`latest`): ", absl::StrJoin(failures, "; ")));
  }

  // 3. Rank 0 commits; its outcome goes to every rank.
  std::string result;
  if (rank == 0) {
    absl::StatusOr<std::string> dir = pending->Commit(plan->skeleton, ranks, options);
    result = EncodeOutcome(dir.ok() ? absl::StatusOr<RankChunks>(RankChunks{}) : dir.status());
    if (dir.ok()) result += *dir;  // after an OK outcome with no chunks: the directory
  }
  absl::Status b = comm.Broadcast(&result, 0, timeout);
  if (!b.ok()) {
    return absl::Status(b.code(), absl::StrCat(what, ": learning rank 0's commit failed: ", b.message()));
  }
  std::string_view in(result);
  uint64_t code = 0;
  std::string message;
  if (!GetU64(in, &code) || !GetStr(in, &message)) return absl::DataLossError(absl::StrCat(what, ": malformed commit"));
  if (code != 0) {
    return absl::Status(static_cast<absl::StatusCode>(code), absl::StrCat("rank 0 of ", world, ": ", message));
  }
  uint64_t none = 0;
  if (!GetU64(in, &none)) return absl::DataLossError(absl::StrCat(what, ": malformed commit"));
  return std::string(in);
}

}  // namespace ferry
