// The C ABI's ferry_comm_callbacks (bindings/c/ferry.h) as a Comm: C functions over thread comms.
#include "c/c_comm.h"

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/time.h"
#include "c/ferry.h"
#include "comm/comm_checks.h"
#include "ferry/comm.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ferry::comm_test {
namespace {

using ::testing::HasSubstr;

// The `user` of the C functions: one rank's thread comm, and what the test makes fail.
struct Rank {
  std::unique_ptr<Comm> comm;
  int fail_gather_with = 0;           // nonzero: all_gather returns it
  std::unique_ptr<Rank> duplicate;    // made by Duplicate
  bool full = true;                   // with barrier, broadcast and duplicate
};

int Fail(char* err, size_t err_len, int rc, const absl::Status& s) {
  std::snprintf(err, err_len, "%s", std::string(s.message()).c_str());
  return rc;
}

int CReduce(void* user, double* values, size_t n, int op, double timeout_s, char* err, size_t err_len) {
  ReduceOp r = op == FERRY_REDUCE_SUM ? ReduceOp::kSum : op == FERRY_REDUCE_MAX ? ReduceOp::kMax : ReduceOp::kMin;
  absl::Status s = static_cast<Rank*>(user)->comm->AllReduce(absl::MakeSpan(values, n), r, absl::Seconds(timeout_s));
  return s.ok() ? 0 : Fail(err, err_len, static_cast<int>(s.code()), s);
}

int CGather(void* user, const void* mine, size_t bytes, void* out, double timeout_s, char* err, size_t err_len) {
  Rank* rank = static_cast<Rank*>(user);
  if (rank->fail_gather_with != 0) {
    std::snprintf(err, err_len, "nccl: peer 2 is gone");
    return rank->fail_gather_with;
  }
  absl::StatusOr<std::vector<std::string>> all =
      rank->comm->AllGather(std::string_view(static_cast<const char*>(mine), bytes), absl::Seconds(timeout_s));
  if (!all.ok()) return Fail(err, err_len, static_cast<int>(all.status().code()), all.status());
  for (size_t r = 0; r < all->size(); ++r) {
    if ((*all)[r].size() != bytes) return Fail(err, err_len, FERRY_INTERNAL, absl::InternalError("sizes differ"));
    std::memcpy(static_cast<char*>(out) + r * bytes, (*all)[r].data(), bytes);
  }
  return 0;
}

int CBarrier(void* user, double timeout_s, char* err, size_t err_len) {
  absl::Status s = static_cast<Rank*>(user)->comm->Barrier(absl::Seconds(timeout_s));
  return s.ok() ? 0 : Fail(err, err_len, static_cast<int>(s.code()), s);
}

int CBroadcast(void* user, void* data, size_t bytes, int root, double timeout_s, char* err, size_t err_len) {
  std::string blob(static_cast<const char*>(data), bytes);
  absl::Status s = static_cast<Rank*>(user)->comm->Broadcast(&blob, root, absl::Seconds(timeout_s));
  if (!s.ok()) return Fail(err, err_len, static_cast<int>(s.code()), s);
  if (blob.size() != bytes) return Fail(err, err_len, FERRY_INTERNAL, absl::InternalError("sizes differ"));
  std::memcpy(data, blob.data(), bytes);
  return 0;
}

ferry_comm_callbacks CallbacksFor(Rank* rank);

int CDuplicate(void* user, double timeout_s, ferry_comm_callbacks* out, char* err, size_t err_len) {
  Rank* rank = static_cast<Rank*>(user);
  absl::StatusOr<std::unique_ptr<Comm>> dup = rank->comm->Duplicate(absl::Seconds(timeout_s));
  if (!dup.ok()) return Fail(err, err_len, static_cast<int>(dup.status().code()), dup.status());
  rank->duplicate = std::make_unique<Rank>(Rank{.comm = std::move(*dup), .full = rank->full});
  *out = CallbacksFor(rank->duplicate.get());
  return 0;
}

ferry_comm_callbacks CallbacksFor(Rank* rank) {
  ferry_comm_callbacks c = {};
  c.user = rank;
  c.rank = rank->comm->rank();
  c.world_size = rank->comm->world_size();
  c.all_reduce = CReduce;
  c.all_gather = CGather;
  if (rank->full) {
    c.barrier = CBarrier;
    c.broadcast = CBroadcast;
    c.duplicate = CDuplicate;
  }
  return c;
}

TEST(CCommTest, CollectivesOverCFunctions) {
  for (bool full : {true, false}) {
    const int world = 3;
    std::vector<std::unique_ptr<Comm>> comms = MakeThreadComms(world);
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r) {
      threads.emplace_back([&, r] {
        Rank rank{.comm = std::move(comms[r]), .full = full};
        absl::StatusOr<std::unique_ptr<Comm>> comm = CommFromCallbacks(CallbacksFor(&rank));
        ASSERT_OK(comm.status());
        EXPECT_EQ((*comm)->rank(), r);
        EXPECT_EQ((*comm)->world_size(), world);
        CheckCollectives(**comm, full ? 11 : 12);
        CheckAgreeStatus(**comm);
        absl::StatusOr<std::unique_ptr<Comm>> dup = (*comm)->Duplicate(absl::Seconds(30));
        if (!full) {
          EXPECT_EQ(dup.status().code(), absl::StatusCode::kUnimplemented) << dup.status();
          return;
        }
        ASSERT_OK(dup.status());
        std::thread other([&] { CheckCollectives(**dup, 13); });
        CheckCollectives(**comm, 14);
        other.join();
      });
    }
    for (std::thread& t : threads) t.join();
  }
}

TEST(CCommTest, CallbackFailuresKeepTheirCodeAndMessage) {
  for (int rc : {static_cast<int>(FERRY_UNAVAILABLE), 77}) {
    Rank rank{.comm = MakeSingleProcessComm(), .fail_gather_with = rc};
    absl::StatusOr<std::unique_ptr<Comm>> comm = CommFromCallbacks(CallbacksFor(&rank));
    ASSERT_OK(comm.status());
    absl::StatusOr<std::vector<std::string>> all = (*comm)->AllGather("abc", absl::Seconds(5));
    EXPECT_EQ(all.status().code(), rc == 77 ? absl::StatusCode::kUnknown : absl::StatusCode::kUnavailable);
    EXPECT_THAT(std::string(all.status().message()),
                HasSubstr("callbacks comm, rank 0 of 1, AllGather: all_gather of 1 x 11 bytes failed: "
                          "nccl: peer 2 is gone [all_gather returned " + std::to_string(rc) + "]"));
  }
}

TEST(CCommTest, RejectsMissingFunctionsAndBadRanks) {
  Rank rank{.comm = MakeSingleProcessComm()};
  ferry_comm_callbacks c = CallbacksFor(&rank);
  c.all_gather = nullptr;
  absl::StatusOr<std::unique_ptr<Comm>> comm = CommFromCallbacks(c);
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(comm.status().message()), HasSubstr("all_gather is missing"));
  c = CallbacksFor(&rank);
  c.rank = 1;
  comm = CommFromCallbacks(c);
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(comm.status().message()), HasSubstr("rank 1 is outside [0, world_size)"));
}

}  // namespace
}  // namespace ferry::comm_test
