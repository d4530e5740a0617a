// The worker-count knee (optim/worker_knee.h): the ladder, the pick, and a real measurement.
#include "optim/worker_knee.h"

#include <memory>
#include <thread>
#include <vector>

#include "absl/time/time.h"
#include "ferry/comm.h"
#include "gtest/gtest.h"

namespace ferry {
namespace {

TEST(WorkerKneeTest, Ladder) {
  EXPECT_EQ(KneeLadder(63), (std::vector<size_t>{8, 12, 16, 24, 32, 48, 63}));
  EXPECT_EQ(KneeLadder(64), (std::vector<size_t>{8, 12, 16, 24, 32, 48, 64}));
  EXPECT_EQ(KneeLadder(20), (std::vector<size_t>{8, 12, 16, 20}));
  EXPECT_EQ(KneeLadder(5), (std::vector<size_t>{5}));
  EXPECT_EQ(KneeLadder(0), (std::vector<size_t>{1}));
}

TEST(WorkerKneeTest, PicksTheFewestWithinTolerance) {
  // The 64-CPU H100 host's CPU Adam alone: 181, 168, 161, 163, 159 ms at 16, 24, 32, 48, 63 workers.
  const std::vector<std::pair<size_t, double>> rates = {
      {16, 1.0 / 181}, {24, 1.0 / 168}, {32, 1.0 / 161}, {48, 1.0 / 163}, {63, 1.0 / 159}};
  EXPECT_EQ(PickKnee(rates, 0.05), 32u);
  EXPECT_EQ(PickKnee(rates, 0.06), 24u);
  EXPECT_EQ(PickKnee(rates, 0.0), 63u);
  EXPECT_EQ(PickKnee({}, 0.05), 0u);
  // A rate that falls past the knee: the peak decides.
  EXPECT_EQ(PickKnee({{8, 1.0}, {12, 2.0}, {16, 1.5}}, 0.05), 12u);
}

// Ranks sharing a host take the most workers within the tolerance: the 4 x H100 host's shared
// measurements of 2026-11-28 (7, 10 and 13 workers per rank).
TEST(WorkerKneeTest, SharedPicksTheMostWithinTolerance) {
  EXPECT_EQ(PickMostWithin({{7, 5.70}, {10, 5.95}, {13, 5.86}}, kSharedKneeTolerance), 13u);
  EXPECT_EQ(PickMostWithin({{7, 4.91}, {10, 4.75}, {13, 5.04}}, kSharedKneeTolerance), 13u);
  EXPECT_EQ(PickMostWithin({{7, 5.20}, {10, 5.81}, {13, 5.16}}, kSharedKneeTolerance), 10u) << "13 fell 11%";
  EXPECT_EQ(PickMostWithin({{7, 5.20}, {10, 5.81}, {13, 5.16}}, 0.15), 13u);
  EXPECT_EQ(PickMostWithin({{7, 2.0}, {10, 1.0}, {13, 1.0}}, 0.03), 7u) << "the best alone";
  EXPECT_EQ(PickMostWithin({}, 0.03), 0u);
}

TEST(WorkerKneeTest, SmallSharesAreNotMeasured) {
  const WorkerKnee k = MeasureWorkerKnee(kKneeProbeAbove, {});
  EXPECT_EQ(k.workers, kKneeProbeAbove);
  EXPECT_TRUE(k.rates.empty());
}

// A real measurement on scratch memory (small, so it runs anywhere): every count of the ladder timed,
// the pick among them, and the second call answered from the cache.
TEST(WorkerKneeTest, MeasuresEveryCountOnce) {
  const size_t max_workers = kKneeProbeAbove + 4;
  const WorkerKnee k = MeasureWorkerKnee(max_workers, {}, int64_t{1} << 18);
  ASSERT_EQ(k.rates.size(), KneeLadder(max_workers).size());
  for (size_t i = 0; i < k.rates.size(); ++i) {
    EXPECT_EQ(k.rates[i].first, KneeLadder(max_workers)[i]);
    EXPECT_GT(k.rates[i].second, 0.0);
  }
  EXPECT_EQ(k.workers, PickKnee(k.rates, kKneeTolerance));
  EXPECT_NE(k.Describe().find(" of 20 workers"), std::string::npos) << k.Describe();
  const WorkerKnee again = MeasureWorkerKnee(max_workers, {}, int64_t{1} << 18);
  EXPECT_EQ(again.rates, k.rates) << "measured once per process";
}

TEST(WorkerKneeTest, SharedLadder) {
  EXPECT_EQ(SharedKneeLadder(15), (std::vector<size_t>{8, 12, 15}));
  EXPECT_EQ(SharedKneeLadder(27), (std::vector<size_t>{14, 21, 27}));
  EXPECT_EQ(SharedKneeLadder(7), (std::vector<size_t>{4, 6, 7}));
  EXPECT_EQ(SharedKneeLadder(2), (std::vector<size_t>{1, 2}));
  EXPECT_EQ(SharedKneeLadder(1), (std::vector<size_t>{1}));
  EXPECT_EQ(SharedKneeLadder(0), (std::vector<size_t>{1}));
}

// Ranks measuring together: every rank tries every count of the ladder, and all take the same pick,
// made on the rates of all the ranks over the slowest one's time (each rank its own pool on scratch
// memory of its own).
TEST(WorkerKneeTest, RanksMeasureTogetherAndTakeTheSamePick) {
  constexpr int kWorld = 3;
  std::vector<std::unique_ptr<Comm>> comms = MakeThreadComms(kWorld);
  std::vector<absl::StatusOr<WorkerKnee>> knees(kWorld, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] { knees[r] = MeasureSharedKnee(*comms[r], 4, {}, absl::Seconds(60), int64_t{1} << 16); });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(knees[r].ok()) << knees[r].status();
    const WorkerKnee& k = *knees[r];
    ASSERT_EQ(k.rates.size(), SharedKneeLadder(4).size());
    for (size_t i = 0; i < k.rates.size(); ++i) {
      EXPECT_EQ(k.rates[i].first, SharedKneeLadder(4)[i]);
      EXPECT_GT(k.rates[i].second, 0.0);
      EXPECT_EQ(k.rates[i].second, knees[0]->rates[i].second) << "the same sums on every rank";
    }
    EXPECT_EQ(k.workers, PickMostWithin(k.rates, kSharedKneeTolerance));
    EXPECT_EQ(k.workers, knees[0]->workers);
    EXPECT_EQ(k.ranks, kWorld);
    EXPECT_NE(k.Describe().find("per rank (CPU Adam's G params/s of 3 ranks measuring together"), std::string::npos)
        << k.Describe();
  }
}

// A rank that never comes: the others fail at the first barrier's deadline, naming what they waited for.
TEST(WorkerKneeTest, ARankMissingFromTheSharedMeasurementFailsTheOthers) {
  std::vector<std::unique_ptr<Comm>> comms = MakeThreadComms(2);
  const absl::StatusOr<WorkerKnee> k = MeasureSharedKnee(*comms[0], 2, {}, absl::Milliseconds(200), int64_t{1} << 12);
  ASSERT_FALSE(k.ok());
  EXPECT_EQ(k.status().code(), absl::StatusCode::kDeadlineExceeded) << k.status();
}

}  // namespace
}  // namespace ferry
