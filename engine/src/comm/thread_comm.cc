// MakeThreadComms: the ranks of one in-process group, one thread each.
//
// A Group is the state the group's comms share: one rendezvous at a time, numbered by a generation
// counter. Each rank deposits its call (what it asked for and its input) in its slot and waits on the
// condition variable until the generation advances; the last rank to arrive checks that every call
// agrees, computes the results into the group, advances the generation and wakes everyone, who copy
// their outputs out. Results of generation g stay valid until generation g+1 completes, which needs
// every rank, including one that has not yet copied its output: so no rank's output can be
// overwritten before it is read. Calls deposited for generation g+1 by fast ranks live in the slots,
// apart from the results.
//
// Failures: a rank whose deadline passes before the generation completes poisons the group with a
// DeadlineExceeded naming the ranks that had not arrived (every later call of every rank returns it at
// once: the ranks no longer agree on which collective is which). A destroyed comm marks its rank gone:
// every collective waiting or started afterwards returns Unavailable naming it. Calls that disagree
// (collective, count, op, root) complete with InvalidArgument on every rank and leave the group usable.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "base/absl_compat.h"
#include "base/errors.h"
#include "comm/comm_internal.h"
#include "ferry/comm.h"

namespace ferry {
namespace {

using comm_internal::CallShape;
using comm_internal::Collective;
using comm_internal::Prefixed;
using comm_internal::RankList;
using comm_internal::CollectiveName;

// One rank's call: what it asked for, and its input.
struct Call {
  CallShape shape;
  std::vector<double> values;  // AllReduce
  std::string blob;            // AllGather: mine; Broadcast: the root's blob
};

class Group;

// One rank's outputs of a completed collective.
struct Outputs {
  std::vector<double> values;               // AllReduce
  std::vector<std::string> blobs;           // AllGather: every rank's; Broadcast: {root's}
  std::shared_ptr<Group> duplicate;         // Duplicate
};

// The state shared by the comms of one group. Safe for concurrent use; each rank calls Run from one
// thread at a time.
class Group {
 public:
  explicit Group(int world_size)
      : world_(world_size), here_(world_size, false), gone_(world_size, false), calls_(world_size) {}

  int world_size() const { return world_; }

  // Runs `call` as `rank`'s part of the current collective; fills *out on success.
  absl::Status Run(int rank, Call call, absl::Duration timeout, Outputs* out) {
    const std::string where =
        comm_internal::Where("threads", rank, world_, CollectiveName(call.shape.collective));
    // The steady clock for the deadline: a wall-clock step must not shorten or stretch a wait.
    // (Capped at a century, so that an infinite timeout does not overflow the clock.)
    const auto deadline = std::chrono::steady_clock::now() +
                          absl::ToChronoNanoseconds(std::min(timeout, absl::Hours(24 * 365 * 100)));
    std::unique_lock<std::mutex> lock(mu_);
    if (absl::Status failed = Failed(where); !failed.ok()) return failed;
    const uint64_t generation = generation_;
    calls_[rank] = std::move(call);
    here_[rank] = true;
    if (++arrived_ == world_) {
      Complete();
    } else {
      while (generation_ == generation) {
        if (absl::Status failed = Failed(where); !failed.ok()) return failed;
        if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && generation_ == generation) {
          std::vector<int> missing;
          for (int r = 0; r < world_; ++r)
            if (!here_[r]) missing.push_back(r);
          poisoned_ = absl::DeadlineExceededError(
              absl::StrCat(where, ": timed out after ", absl::FormatDuration(timeout),
                           "; had not arrived: ", RankList(missing)));
          cv_.notify_all();
          return UnsharedCopy(poisoned_);  // each rank's thread drops its own
        }
      }
    }
    if (!result_.ok()) return Prefixed(where, result_);
    switch (calls_[rank].shape.collective) {  // this rank's slot is untouched until it calls again
      case Collective::kAllReduce: out->values = result_values_; break;
      case Collective::kAllGather: out->blobs = result_blobs_; break;
      case Collective::kBroadcast: out->blobs = {result_blobs_[0]}; break;
      case Collective::kDuplicate: out->duplicate = result_group_; break;
      case Collective::kBarrier: break;
    }
    return absl::OkStatus();
  }

  // `rank`'s comm is gone: every collective waiting or started afterwards fails naming it.
  void Leave(int rank) {
    std::lock_guard<std::mutex> lock(mu_);
    gone_[rank] = true;
    cv_.notify_all();
  }

 private:
  // The group's failure, if any: the poison of an earlier timeout, else Unavailable naming the ranks
  // whose comm was destroyed.
  absl::Status Failed(absl::string_view where) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!poisoned_.ok()) return Prefixed(absl::StrCat(where, ": the group failed earlier"), poisoned_);
    std::vector<int> gone;
    for (int r = 0; r < world_; ++r)
      if (gone_[r]) gone.push_back(r);
    if (gone.empty()) return absl::OkStatus();
    return absl::UnavailableError(
        absl::StrCat(where, ": ", RankList(gone), " of ", world_, " left the group (comm destroyed)"));
  }

  // The last rank arrived: check that the calls agree, compute the results, start a new generation.
  void Complete() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<CallShape> shapes;
    for (const Call& c : calls_) shapes.push_back(c.shape);
    result_ = comm_internal::CheckCallsAgree(shapes);
    const CallShape& first = calls_[0].shape;
    if (result_.ok()) {
      switch (first.collective) {
        case Collective::kAllReduce:
          result_values_ = calls_[0].values;
          for (int r = 1; r < world_; ++r) {
            comm_internal::ReduceInto(first.op, calls_[r].values, absl::MakeSpan(result_values_));
          }
          break;
        case Collective::kAllGather:
          result_blobs_.resize(world_);
          for (int r = 0; r < world_; ++r) result_blobs_[r] = std::move(calls_[r].blob);
          break;
        case Collective::kBroadcast: result_blobs_ = {std::move(calls_[first.root].blob)}; break;
        case Collective::kDuplicate: result_group_ = std::make_shared<Group>(world_); break;
        case Collective::kBarrier: break;
      }
    }
    here_.assign(world_, false);
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
  }

  const int world_;
  // std::mutex rather than absl::Mutex: Debian's Abseil is not built for ThreadSanitizer, which then
  // cannot see absl::Mutex and reports false races.
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;     // collectives completed
  int arrived_ ABSL_GUARDED_BY(mu_) = 0;             // in the current generation
  std::vector<bool> here_ ABSL_GUARDED_BY(mu_);      // here_[r]: r arrived in the current generation
  std::vector<bool> gone_ ABSL_GUARDED_BY(mu_);      // gone_[r]: r's comm was destroyed
  std::vector<Call> calls_ ABSL_GUARDED_BY(mu_);     // calls_[r]: r's call in the current generation
  absl::Status poisoned_ ABSL_GUARDED_BY(mu_);       // set by the first timeout; then every call fails
  // The results of the last completed generation.
  absl::Status result_ ABSL_GUARDED_BY(mu_);
  std::vector<double> result_values_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> result_blobs_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<Group> result_group_ ABSL_GUARDED_BY(mu_);
};

// Rank `rank` of a Group. One thread at a time; the group's comms may be used concurrently.
class ThreadComm final : public Comm {
 public:
  ThreadComm(std::shared_ptr<Group> group, int rank) : group_(std::move(group)), rank_(rank) {}
  ~ThreadComm() override { group_->Leave(rank_); }

  int rank() const override { return rank_; }
  int world_size() const override { return group_->world_size(); }
  std::string_view kind() const override { return "threads"; }

  absl::Status Barrier(absl::Duration timeout) override {
    Outputs out;
    return group_->Run(rank_, Call{.shape = {.collective = Collective::kBarrier}}, timeout, &out);
  }

  absl::Status AllReduce(absl::Span<double> values, ReduceOp op, absl::Duration timeout) override {
    Outputs out;
    absl::Status s = group_->Run(
        rank_, Call{.shape = {.collective = Collective::kAllReduce, .op = op, .count = static_cast<int64_t>(values.size())},
             .values = {values.begin(), values.end()}},
        timeout, &out);
    if (s.ok()) std::copy(out.values.begin(), out.values.end(), values.begin());
    return s;
  }

  absl::StatusOr<std::vector<std::string>> AllGather(std::string_view mine, absl::Duration timeout) override {
    Outputs out;
    absl::Status s =
        group_->Run(rank_, Call{.shape = {.collective = Collective::kAllGather}, .blob = std::string(mine)}, timeout, &out);
    if (!s.ok()) return s;
    return std::move(out.blobs);
  }

  absl::Status Broadcast(std::string* blob, int root, absl::Duration timeout) override {
    Outputs out;
    Call call{.shape = {.collective = Collective::kBroadcast, .root = root}};
    if (root == rank_) call.blob = *blob;  // only the root's input is used
    absl::Status s = group_->Run(rank_, std::move(call), timeout, &out);
    if (s.ok()) *blob = std::move(out.blobs[0]);
    return s;
  }

  absl::StatusOr<std::unique_ptr<Comm>> Duplicate(absl::Duration timeout) override {
    Outputs out;
    absl::Status s = group_->Run(rank_, Call{.shape = {.collective = Collective::kDuplicate}}, timeout, &out);
    if (!s.ok()) return s;
    return std::unique_ptr<Comm>(std::make_unique<ThreadComm>(std::move(out.duplicate), rank_));
  }

 private:
  const std::shared_ptr<Group> group_;
  const int rank_;
};

}  // namespace

std::vector<std::unique_ptr<Comm>> MakeThreadComms(int world_size) {
  std::vector<std::unique_ptr<Comm>> comms;
  if (world_size < 1) return comms;
  auto group = std::make_shared<Group>(world_size);
  for (int r = 0; r < world_size; ++r) comms.push_back(std::make_unique<ThreadComm>(group, r));
  return comms;
}

}  // namespace ferry
