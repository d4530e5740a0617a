// The MPI comm, run under mpirun by the ctest tests comm.mpi.np1 .. comm.mpi.np4 (every process runs
// these tests in the same order; each checks its own rank's results). Not named *_test.cc: it is not a
// standalone GoogleTest executable.
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

std::unique_ptr<Comm> NewComm() {
  absl::StatusOr<std::unique_ptr<Comm>> comm = MakeMpiComm();
  EXPECT_TRUE(comm.ok()) << comm.status();
  return comm.ok() ? std::move(*comm) : nullptr;
}

TEST(MpiCommTest, Collectives) {
  ASSERT_TRUE(BuiltWithMpi());
  std::unique_ptr<Comm> comm = NewComm();
  ASSERT_NE(comm, nullptr);
  EXPECT_EQ(comm->kind(), "mpi");
  ASSERT_GE(comm->world_size(), 1);
  ASSERT_LT(comm->rank(), comm->world_size());
  for (uint64_t seed = 1; seed <= 3; ++seed) CheckCollectives(*comm, seed);
  CheckAgreeStatus(*comm);
}

TEST(MpiCommTest, DuplicateFromASecondThread) {
  std::unique_ptr<Comm> comm = NewComm();
  ASSERT_NE(comm, nullptr);
  absl::StatusOr<std::unique_ptr<Comm>> dup = comm->Duplicate(absl::Seconds(30));
  ASSERT_OK(dup.status());
  EXPECT_EQ((*dup)->rank(), comm->rank());
  EXPECT_EQ((*dup)->world_size(), comm->world_size());
  std::thread writer([&] {
    for (uint64_t seed = 100; seed < 104; ++seed) CheckCollectives(**dup, seed);
  });
  for (uint64_t seed = 200; seed < 204; ++seed) CheckCollectives(*comm, seed);
  writer.join();
}

TEST(MpiCommTest, DisagreeingCallsAreInvalidArgumentAndTheCommStaysUsable) {
  std::unique_ptr<Comm> comm = NewComm();
  ASSERT_NE(comm, nullptr);
  const int world = comm->world_size();
  const int me = comm->rank();
  const int odd = world - 1;  // the rank that passes a different count (rank 0 when alone: no disagreement)
  std::vector<double> v(me == odd && world > 1 ? 3 : 2, 1.0);
  absl::Status s = comm->AllReduce(absl::MakeSpan(v), ReduceOp::kSum, absl::Seconds(30));
  if (world == 1) {
    EXPECT_OK(s);
  } else {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()),
                HasSubstr(absl::StrCat("rank ", odd, " of ", world, " called AllReduce of 3 values (sum) but rank 0 of ",
                                       world, " called AllReduce of 2 values (sum)")));
    EXPECT_EQ(v, std::vector<double>(v.size(), 1.0));
  }
  std::string blob = "b";
  s = comm->Broadcast(&blob, world, absl::Seconds(30));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(absl::StrCat("outside [0, ", world, ")")));
  CheckCollectives(*comm, 7);
}

// Runs last: the comm it times out on is poisoned, and the late rank's collective never completes.
TEST(MpiCommTest, LateRankIsNamedInTheOthersDeadlineExceeded) {
  std::unique_ptr<Comm> comm = NewComm();
  ASSERT_NE(comm, nullptr);
  const int world = comm->world_size();
  const int me = comm->rank();
  if (world == 1) GTEST_SKIP() << "needs a second rank";
  const int late = world - 1;
  const absl::Duration timeout = absl::Milliseconds(500);
  if (me != late) {
    const absl::Time start = absl::Now();
    absl::Status s = comm->Barrier(timeout);
    const absl::Duration took = absl::Now() - start;
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(absl::StrCat("had not arrived: rank ", late)));
    EXPECT_THAT(std::string(s.message()), HasSubstr(absl::StrCat("mpi comm, rank ", me, " of ", world, ", Barrier")));
    EXPECT_GE(took, timeout);
    EXPECT_LT(took, timeout + absl::Seconds(5));
    // Poisoned: the next call fails at once with the cause.
    const absl::Time again = absl::Now();
    s = comm->Barrier(absl::Seconds(30));
    EXPECT_LT(absl::Now() - again, absl::Seconds(1));
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("unusable after an earlier failure"));
  } else {
    absl::SleepFor(timeout * 3);
    // The others gave up: this rank's descriptors cross, but the others never join the barrier.
    absl::Status s = comm->Barrier(timeout);
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  }
  // Every rank leaves together, on a fresh comm.
  std::unique_ptr<Comm> fresh = NewComm();
  ASSERT_NE(fresh, nullptr);
  EXPECT_OK(fresh->Barrier(absl::Seconds(60)));
}

}  // namespace
}  // namespace ferry::comm_test
