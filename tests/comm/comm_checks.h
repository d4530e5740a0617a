// Checks of the collectives that every Comm implementation must pass, run by each rank on its own
// comm: every rank computes every rank's inputs from (seed, rank), so each can check its results alone
// (threads of one process, processes under mpirun alike). Every rank of a group calls the same checks
// with the same seed.
#ifndef FERRY_TESTS_COMM_COMM_CHECKS_H_
#define FERRY_TESTS_COMM_COMM_CHECKS_H_

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "ferry/comm.h"
#include "gtest/gtest.h"

#define ASSERT_OK(expr)                          \
  do {                                           \
    absl::Status s_ = (expr);                    \
    ASSERT_TRUE(s_.ok()) << #expr << ": " << s_; \
  } while (0)
#define EXPECT_OK(expr)                          \
  do {                                           \
    absl::Status s_ = (expr);                    \
    EXPECT_TRUE(s_.ok()) << #expr << ": " << s_; \
  } while (0)

namespace ferry::comm_test {

// n doubles in [-1000, 1000): rank r's AllReduce input in round `seed`.
inline std::vector<double> RankValues(uint64_t seed, int rank, size_t n) {
  std::mt19937_64 rng(seed * 7919 + static_cast<uint64_t>(rank));
  std::uniform_real_distribution<double> dist(-1000.0, 1000.0);
  std::vector<double> v(n);
  for (double& x : v) x = dist(rng);
  return v;
}

// Rank r's blob in round `seed`: empty for rank 0, else 1 to 300 random bytes (NULs included).
inline std::string RankBlob(uint64_t seed, int rank) {
  if (rank == 0) return std::string();
  std::mt19937_64 rng(seed * 104729 + static_cast<uint64_t>(rank));
  std::string s(1 + rng() % 300, '\0');
  for (char& c : s) c = static_cast<char>(rng() & 0xff);
  return s;
}

// Barrier, AllReduce (sum, max, min; and an exact integer sum), AllGather (sizes differing per rank,
// rank 0's empty; and all empty) and Broadcast from every root, on `comm`.
inline void CheckCollectives(Comm& comm, uint64_t seed, absl::Duration timeout = absl::Seconds(30)) {
  const int world = comm.world_size();
  const int me = comm.rank();
  ASSERT_OK(comm.Barrier(timeout));

  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin}) {
    const uint64_t round = seed * 3 + static_cast<uint64_t>(op);
    const size_t n = 7;
    std::vector<double> expected = RankValues(round, 0, n);
    for (int r = 1; r < world; ++r) {
      std::vector<double> in = RankValues(round, r, n);
      for (size_t i = 0; i < n; ++i) {
        if (op == ReduceOp::kSum) expected[i] += in[i];
        if (op == ReduceOp::kMax) expected[i] = std::max(expected[i], in[i]);
        if (op == ReduceOp::kMin) expected[i] = std::min(expected[i], in[i]);
      }
    }
    std::vector<double> values = RankValues(round, me, n);
    ASSERT_OK(comm.AllReduce(absl::MakeSpan(values), op, timeout));
    for (size_t i = 0; i < n; ++i) {
      if (op == ReduceOp::kSum) {  // the summation order is the implementation's
        EXPECT_NEAR(values[i], expected[i], 1e-9 * world * 1000) << "sum, element " << i << ", rank " << me;
      } else {
        EXPECT_EQ(values[i], expected[i]) << ReduceOpName(op) << ", element " << i << ", rank " << me;
      }
    }
  }
  std::vector<double> ints = {static_cast<double>(me + 1), static_cast<double>(1 << me), -3.0};
  ASSERT_OK(comm.AllReduce(absl::MakeSpan(ints), ReduceOp::kSum, timeout));
  EXPECT_EQ(ints[0], world * (world + 1) / 2);
  EXPECT_EQ(ints[1], (1 << world) - 1);
  EXPECT_EQ(ints[2], -3.0 * world);
  std::vector<double> none;
  ASSERT_OK(comm.AllReduce(absl::MakeSpan(none), ReduceOp::kMax, timeout));

  absl::StatusOr<std::vector<std::string>> all = comm.AllGather(RankBlob(seed, me), timeout);
  ASSERT_OK(all.status());
  ASSERT_EQ(all->size(), static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) EXPECT_EQ((*all)[r], RankBlob(seed, r)) << "rank " << r << "'s blob on rank " << me;
  all = comm.AllGather("", timeout);
  ASSERT_OK(all.status());
  EXPECT_EQ(*all, std::vector<std::string>(world));

  for (int root = 0; root < world; ++root) {
    const std::string sent = RankBlob(seed + 1000, root + 1);  // never empty
    std::string blob = me == root ? sent : std::string(static_cast<size_t>(me) * 5 + 1, 'x');
    ASSERT_OK(comm.Broadcast(&blob, root, timeout));
    EXPECT_EQ(blob, sent) << "broadcast from root " << root << " on rank " << me;
    std::string empty = me == root ? std::string() : std::string("stale");
    ASSERT_OK(comm.Broadcast(&empty, root, timeout));
    EXPECT_EQ(empty, "") << "empty broadcast from root " << root << " on rank " << me;
  }
}

// AgreeStatus: all OK; then the odd ranks (rank 0 when alone) fail, rank 1 with NotFound and the others
// with DataLoss: every rank gets exactly the status naming them, with rank 1's (the lowest's) code.
inline void CheckAgreeStatus(Comm& comm, absl::Duration timeout = absl::Seconds(30)) {
  const int world = comm.world_size();
  const int me = comm.rank();
  EXPECT_OK(AgreeStatus(comm, absl::OkStatus(), "all ok", timeout));

  auto fails = [&](int r) { return world == 1 ? r == 0 : r % 2 == 1; };
  auto status_of = [&](int r) {
    if (!fails(r)) return absl::OkStatus();
    std::string msg = absl::StrCat("shard ", r, " unreadable");
    return r == 1 ? absl::NotFoundError(msg) : absl::DataLossError(msg);
  };
  std::string expected_msg = "saving step 7: ";
  absl::StatusCode expected_code = absl::StatusCode::kOk;
  for (int r = 0; r < world; ++r) {
    if (!fails(r)) continue;
    if (expected_code == absl::StatusCode::kOk) {
      expected_code = status_of(r).code();
    } else {
      expected_msg += "; ";
    }
    absl::StrAppend(&expected_msg, "rank ", r, " of ", world, ": shard ", r, " unreadable");
  }
  absl::Status got = AgreeStatus(comm, status_of(me), "saving step 7", timeout);
  EXPECT_EQ(got.code(), expected_code) << got;
  EXPECT_EQ(got.message(), expected_msg) << "on rank " << me;
}

}  // namespace ferry::comm_test

#endif  // FERRY_TESTS_COMM_COMM_CHECKS_H_
