// The single-process comm, the in-process thread group, and the callback comm driven by callbacks
// built over a thread group.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "comm/comm_checks.h"
#include "ferry/comm.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ferry::comm_test {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// Runs fn(rank) on one thread per rank and joins them.
void RunRanks(int world, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) threads.emplace_back(fn, r);
  for (std::thread& t : threads) t.join();
}

std::string Message(const absl::Status& s) { return std::string(s.message()); }

TEST(SingleProcessCommTest, CollectivesAreIdentities) {
  std::unique_ptr<Comm> comm = MakeSingleProcessComm();
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->world_size(), 1);
  EXPECT_EQ(comm->kind(), "single process");
  CheckCollectives(*comm, 1);
  CheckAgreeStatus(*comm);
  absl::StatusOr<std::unique_ptr<Comm>> dup = comm->Duplicate(absl::Seconds(1));
  ASSERT_OK(dup.status());
  CheckCollectives(**dup, 2);
  std::string blob = "x";
  absl::Status s = comm->Broadcast(&blob, 1, absl::Seconds(1));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(Message(s), HasSubstr("root 1"));
}

TEST(ReduceOpNameTest, Names) {
  EXPECT_EQ(ReduceOpName(ReduceOp::kSum), "sum");
  EXPECT_EQ(ReduceOpName(ReduceOp::kMax), "max");
  EXPECT_EQ(ReduceOpName(ReduceOp::kMin), "min");
}

TEST(ThreadCommTest, CollectivesForOneToFourRanks) {
  for (int world = 1; world <= 4; ++world) {
    SCOPED_TRACE(absl::StrCat("world size ", world));
    std::vector<std::unique_ptr<Comm>> comms = MakeThreadComms(world);
    ASSERT_EQ(comms.size(), static_cast<size_t>(world));
    RunRanks(world, [&](int r) {
      EXPECT_EQ(comms[r]->rank(), r);
      EXPECT_EQ(comms[r]->world_size(), world);
      for (uint64_t seed = 1; seed <= 3; ++seed) CheckCollectives(*comms[r], seed * 10 + world);
      CheckAgreeStatus(*comms[r]);
    });
  }
  EXPECT_TRUE(MakeThreadComms(0).empty());
}

TEST(ThreadCommTest, BarrierWaitsForEveryRank) {
  const int world = 4;
  std::vector<std::unique_ptr<Comm>> comms = MakeThreadComms(world);
  std::atomic<int> before{0};
  RunRanks(world, [&](int r) {
    for (int round = 1; round <= 20; ++round) {
      before.fetch_add(1);
      ASSERT_OK(comms[r]->Barrier(absl::Seconds(30)));
      EXPECT_GE(before.load(), round * world) << "rank " << r << " left barrier " << round << " early";
      ASSERT_OK(comms[r]->Barrier(absl::Seconds(30)));  // nobody starts the next round before all checked
    }
  });
}

TEST(ThreadCommTest, AbsentRankIsNamedInDeadlineExceeded) {
  const int world = 3;
  std::vector<std::unique_ptr<Comm>> comms = MakeThreadComms(world);
  const absl::Duration timeout = absl::Milliseconds(300);
  std::vector<absl::Time> starts(world - 1), ends(world - 1);
  RunRanks(world - 1, [&](int r) {  // rank 2 never calls
    starts[r] = absl::Now();
    absl::Status s = comms[r]->AllReduce({}, ReduceOp::kSum, timeout);
    ends[r] = absl::Now();
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    EXPECT_THAT(Message(s), HasSubstr("had not arrived: rank 2"));
    EXPECT_THAT(Message(s), HasSubstr(absl::StrCat("rank ", r, " of 3, AllReduce")));
  });
  // The first rank in times out after its timeout and poisons the group, so a rank that came in
  // later (a busy host starts the threads apart) fails with it, before its own timeout.
  const absl::Time first = *std::min_element(starts.begin(), starts.end());
  for (int r = 0; r < world - 1; ++r) {
    EXPECT_GE(ends[r] - first, timeout - absl::Milliseconds(5)) << "rank " << r;
    EXPECT_LT(ends[r] - starts[r], timeout + absl::Seconds(5)) << "rank " << r;
  }
  // The group is poisoned: every later call, the late rank's included, fails at once with the cause.
  const absl::Time start = absl::Now();
  absl::Status late = comms[2]->Barrier(absl::Seconds(30));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(late.code(), absl::StatusCode::kDeadlineExceeded) << late;
  EXPECT_THAT(Message(late), HasSubstr("had not arrived: rank 2"));
  EXPECT_THAT(Message(late), HasSubstr("rank 2 of 3, Barrier"));
}

TEST(ThreadCommTest, DestroyedRankIsNamedInUnavailable) {
  const int world = 3;
  std::vector<std::unique_ptr<Comm>> comms = MakeThreadComms(world);
  // Ranks 0 and 1 wait in a collective with a long timeout while rank 2's comm is destroyed.
  std::thread killer([&] {
    absl::SleepFor(absl::Milliseconds(100));
    comms[2].reset();
  });
  RunRanks(2, [&](int r) {
    const absl::Time start = absl::Now();
    absl::StatusOr<std::vector<std::string>> all = comms[r]->AllGather("x", absl::Seconds(60));
    EXPECT_LT(absl::Now() - start, absl::Seconds(10));
    EXPECT_EQ(all.status().code(), absl::StatusCode::kUnavailable) << all.status();
    EXPECT_THAT(Message(all.status()), HasSubstr("rank 2 of 3 left the group"));
  });
  killer.join();
  // Later collectives fail at once too.
  RunRanks(2, [&](int r) {
    absl::Status s = comms[r]->Barrier(absl::Seconds(60));
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    EXPECT_THAT(Message(s), HasSubstr("rank 2 of 3 left the group"));
  });
}

TEST(ThreadCommTest, DisagreeingCallsAreInvalidArgumentNamingTheRank) {
  const int world = 3;
  std::vector<std::unique_ptr<Comm>> comms = MakeThreadComms(world);
  RunRanks(world, [&](int r) {
    Comm& c = *comms[r];
    std::vector<double> v(r == 1 ? 3 : 2, 1.0);
    absl::Status s = c.AllReduce(absl::MakeSpan(v), ReduceOp::kSum, absl::Seconds(30));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(Message(s), HasSubstr("rank 1 of 3 called AllReduce of 3 values (sum) but rank 0 of 3 called "
                                      "AllReduce of 2 values (sum)"));
    EXPECT_EQ(v, std::vector<double>(v.size(), 1.0)) << "values changed by a failed AllReduce";

    std::vector<double> w = {1.0};
    s = c.AllReduce(absl::MakeSpan(w), r == 2 ? ReduceOp::kMax : ReduceOp::kSum, absl::Seconds(30));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(Message(s), HasSubstr("rank 2 of 3 called AllReduce of 1 values (max)"));

    std::string blob = "b";
    s = c.Broadcast(&blob, r == 0 ? 0 : 1, absl::Seconds(30));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(Message(s), HasSubstr("rank 1 of 3 called Broadcast from root 1 but rank 0 of 3 called "
                                      "Broadcast from root 0"));
    s = c.Broadcast(&blob, 3, absl::Seconds(30));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(Message(s), HasSubstr("root 3, outside [0, 3)"));

    s = r == 1 ? c.Barrier(absl::Seconds(30)) : c.AllGather("g", absl::Seconds(30)).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(Message(s), HasSubstr("rank 1 of 3 called Barrier but rank 0 of 3 called AllGather"));

    // The group is still usable.
    CheckCollectives(c, 5);
  });
}

TEST(ThreadCommTest, DuplicateRunsConcurrentlyWithTheOriginal) {
  const int world = 3;
  std::vector<std::unique_ptr<Comm>> comms = MakeThreadComms(world);
  RunRanks(world, [&](int r) {
    absl::StatusOr<std::unique_ptr<Comm>> dup = comms[r]->Duplicate(absl::Seconds(30));
    ASSERT_OK(dup.status());
    EXPECT_EQ((*dup)->rank(), r);
    EXPECT_EQ((*dup)->world_size(), world);
    // Two threads per rank: the original and the duplicate run different collectives at once.
    std::thread writer([&] {
      for (uint64_t seed = 100; seed < 110; ++seed) CheckCollectives(**dup, seed);
    });
    for (uint64_t seed = 200; seed < 210; ++seed) CheckCollectives(*comms[r], seed);
    writer.join();
  });
}

// CommCallbacks whose functions run `comm`'s collectives (the comm is shared by the callbacks, and by
// those of its duplicates).
CommCallbacks CallbacksOver(std::shared_ptr<Comm> comm, bool with_barrier, bool with_broadcast) {
  CommCallbacks cb;
  cb.rank = comm->rank();
  cb.world_size = comm->world_size();
  cb.all_reduce = [comm](double* values, size_t n, ReduceOp op, double timeout_s) {
    return comm->AllReduce(absl::MakeSpan(values, n), op, absl::Seconds(timeout_s));
  };
  cb.all_gather = [comm](const void* mine, size_t bytes, void* out, double timeout_s) -> absl::Status {
    absl::StatusOr<std::vector<std::string>> all =
        comm->AllGather(std::string_view(static_cast<const char*>(mine), bytes), absl::Seconds(timeout_s));
    if (!all.ok()) return all.status();
    for (size_t r = 0; r < all->size(); ++r) {
      if ((*all)[r].size() != bytes) return absl::InternalError("all_gather: sizes differ between ranks");
      std::memcpy(static_cast<char*>(out) + r * bytes, (*all)[r].data(), bytes);
    }
    return absl::OkStatus();
  };
  if (with_barrier) {
    cb.barrier = [comm](double timeout_s) { return comm->Barrier(absl::Seconds(timeout_s)); };
  }
  if (with_broadcast) {
    cb.broadcast = [comm](void* data, size_t bytes, int root, double timeout_s) -> absl::Status {
      std::string blob(static_cast<const char*>(data), bytes);
      absl::Status s = comm->Broadcast(&blob, root, absl::Seconds(timeout_s));
      if (!s.ok()) return s;
      if (blob.size() != bytes) return absl::InternalError("broadcast: sizes differ between ranks");
      std::memcpy(data, blob.data(), bytes);
      return absl::OkStatus();
    };
  }
  cb.duplicate = [comm, with_barrier, with_broadcast](double timeout_s) -> absl::StatusOr<CommCallbacks> {
    absl::StatusOr<std::unique_ptr<Comm>> dup = comm->Duplicate(absl::Seconds(timeout_s));
    if (!dup.ok()) return dup.status();
    return CallbacksOver(std::shared_ptr<Comm>(std::move(*dup)), with_barrier, with_broadcast);
  };
  return cb;
}

TEST(CallbackCommTest, CollectivesOverThreadComms) {
  for (int world = 1; world <= 4; ++world) {
    for (int variant = 0; variant < 4; ++variant) {  // with / without barrier and broadcast
      SCOPED_TRACE(absl::StrCat("world size ", world, ", variant ", variant));
      std::vector<std::unique_ptr<Comm>> threads = MakeThreadComms(world);
      RunRanks(world, [&](int r) {
        absl::StatusOr<std::unique_ptr<Comm>> comm = MakeCallbackComm(
            CallbacksOver(std::shared_ptr<Comm>(std::move(threads[r])), variant & 1, variant & 2));
        ASSERT_OK(comm.status());
        EXPECT_EQ((*comm)->kind(), "callbacks");
        EXPECT_EQ((*comm)->rank(), r);
        CheckCollectives(**comm, 40 + variant);
        CheckAgreeStatus(**comm);
        absl::StatusOr<std::unique_ptr<Comm>> dup = (*comm)->Duplicate(absl::Seconds(30));
        ASSERT_OK(dup.status());
        std::thread other([&] { CheckCollectives(**dup, 50 + variant); });
        CheckCollectives(**comm, 60 + variant);
        other.join();
      });
    }
  }
}

TEST(CallbackCommTest, ValidatesItsCallbacks) {
  CommCallbacks cb;
  cb.world_size = 2;
  cb.rank = 2;
  absl::StatusOr<std::unique_ptr<Comm>> comm = MakeCallbackComm(cb);
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(comm.status()), HasSubstr("rank 2 is outside [0, world_size) with world_size 2"));
  cb.rank = 1;
  comm = MakeCallbackComm(cb);
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(comm.status()), HasSubstr("all_reduce and all_gather are missing"));
  cb.all_reduce = [](double*, size_t, ReduceOp, double) { return absl::OkStatus(); };
  comm = MakeCallbackComm(cb);
  EXPECT_THAT(Message(comm.status()), HasSubstr("all_gather is missing"));
}

TEST(CallbackCommTest, WrapsCallbackErrorsAndPoisons) {
  CommCallbacks cb;
  cb.world_size = 4;
  cb.rank = 3;
  int calls = 0;
  double seen_timeout = -1;
  cb.all_reduce = [&](double* values, size_t n, ReduceOp, double timeout_s) {
    ++calls;
    seen_timeout = timeout_s;
    return absl::OkStatus();  // the size exchange "succeeds" (leaves this rank's size)
  };
  cb.all_gather = [&](const void*, size_t, void*, double) {
    ++calls;
    return absl::UnavailableError("peer 1 reset the connection");
  };
  absl::StatusOr<std::unique_ptr<Comm>> comm = MakeCallbackComm(cb);
  ASSERT_OK(comm.status());
  absl::StatusOr<std::vector<std::string>> all = (*comm)->AllGather("abc", absl::Seconds(7));
  EXPECT_EQ(all.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(Message(all.status()),
            "callbacks comm, rank 3 of 4, AllGather: all_gather of 4 x 11 bytes failed: peer 1 reset the connection");
  EXPECT_GT(seen_timeout, 6.0);
  EXPECT_LE(seen_timeout, 7.0);
  EXPECT_EQ(calls, 2);
  // Poisoned: the next call fails at once without calling back.
  absl::Status s = (*comm)->Barrier(absl::Seconds(1));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(Message(s), HasSubstr("rank 3 of 4, Barrier: unusable after an earlier failure"));
  EXPECT_THAT(Message(s), HasSubstr("peer 1 reset the connection"));
  EXPECT_EQ(calls, 2);
  // No duplicate function: Unimplemented (checked before poisoning on a fresh comm).
  absl::StatusOr<std::unique_ptr<Comm>> fresh = MakeCallbackComm(cb);
  ASSERT_OK(fresh.status());
  absl::StatusOr<std::unique_ptr<Comm>> dup = (*fresh)->Duplicate(absl::Seconds(1));
  EXPECT_EQ(dup.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(Message(dup.status()), HasSubstr("no `duplicate` function"));
  // A barrier derived from all_reduce checks the sum it gets back.
  s = (*fresh)->Barrier(absl::Seconds(1));
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(Message(s), HasSubstr("returned 1, expected the world size 4"));
  // Root out of range: InvalidArgument, and the comm stays usable... (it is poisoned by the barrier now)
  std::string blob;
  absl::StatusOr<std::unique_ptr<Comm>> third = MakeCallbackComm(cb);
  ASSERT_OK(third.status());
  s = (*third)->Broadcast(&blob, 4, absl::Seconds(1));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(s), HasSubstr("root 4 is outside [0, 4)"));
  std::vector<double> v = {1.0};
  EXPECT_OK((*third)->AllReduce(absl::MakeSpan(v), ReduceOp::kSum, absl::Seconds(1)));
}

TEST(MpiCommTest, BuiltWithMpiMatchesMakeMpiComm) {
  if (BuiltWithMpi()) GTEST_SKIP() << "MPI build: tests/comm/mpi runs the MPI comm under mpirun";
  absl::StatusOr<std::unique_ptr<Comm>> comm = MakeMpiComm();
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(Message(comm.status()), HasSubstr("libopenmpi-dev"));
}

}  // namespace
}  // namespace ferry::comm_test
