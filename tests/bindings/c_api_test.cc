// The C ABI over the host backend (device memory = host memory, so plain arrays serve as tensors).
#include "c/ferry.h"

#include <unistd.h>

#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "ferry/dtype.h"
#include "ferry/version.h"
#include "gtest/gtest.h"

namespace {

std::string Policy(const char* name) { return std::string(FERRY_SOURCE_DIR) + "/scripts/policies/" + name; }

TEST(CApiTest, TrainSaveLoadAndErrors) {
  ferry_engine_options o;
  ferry_engine_options_init(&o);
  EXPECT_FLOAT_EQ(o.beta1, 0.9f);
  std::string policy = Policy("offload_fraction.lua");
  const char* keys[] = {"fraction"};
  const char* values[] = {"0.5"};
  o.policy_path = policy.c_str();
  o.policy_arg_keys = keys;
  o.policy_arg_values = values;
  o.num_policy_args = 1;
  o.device = "host";
  o.lr = 0.01f;
  ferry_engine* e = nullptr;
  ASSERT_EQ(ferry_engine_create(&o, &e), FERRY_OK) << ferry_last_error();

  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  const int64_t n = 300;
  std::vector<uint16_t> w1(n), w2(n), g1(n), g2(n);
  for (auto* v : {&w1, &w2, &g1, &g2})
    for (auto& x : *v) x = ferry::F32ToBF16(normal(rng));
  const std::vector<uint16_t> w1_init = w1;
  ASSERT_EQ(ferry_add_param(e, "a", "ga", &n, 1, FERRY_BF16, w1.data(), g1.data()), FERRY_OK) << ferry_last_error();
  ASSERT_EQ(ferry_add_param(e, "b", "gb", &n, 1, FERRY_BF16, w2.data(), g2.data()), FERRY_OK) << ferry_last_error();
  EXPECT_EQ(ferry_add_param(e, "a", "ga", &n, 1, FERRY_BF16, w1.data(), g1.data()), FERRY_ALREADY_EXISTS);
  EXPECT_NE(std::string(ferry_last_error()).find("'a'"), std::string::npos) << ferry_last_error();
  EXPECT_EQ(ferry_add_param(e, "c", nullptr, &n, 1, static_cast<ferry_dtype>(9), w1.data(), g1.data()),
            FERRY_INVALID_ARGUMENT);
  ASSERT_EQ(ferry_finalize(e), FERRY_OK) << ferry_last_error();
  int off_a = -1, off_b = -1;
  ASSERT_EQ(ferry_group_offloaded(e, "ga", &off_a), FERRY_OK);
  ASSERT_EQ(ferry_group_offloaded(e, "gb", &off_b), FERRY_OK);
  EXPECT_EQ(off_a + off_b, 1);  // half of the elements offloaded: exactly one group
  EXPECT_EQ(ferry_group_offloaded(e, "nope", &off_a), FERRY_NOT_FOUND);
  for (int s = 0; s < 3; ++s) ASSERT_EQ(ferry_step(e, -1.0f, nullptr), FERRY_OK) << ferry_last_error();
  ASSERT_EQ(ferry_synchronize(e), FERRY_OK);
  EXPECT_NE(w1, w1_init);
  ASSERT_EQ(ferry_verify_masters(e), FERRY_OK) << ferry_last_error();

  std::string root = (std::filesystem::temp_directory_path() / ("ferry-capi-" + std::to_string(getpid()))).string();
  char dir[4096];
  ASSERT_EQ(ferry_save_checkpoint(e, root.c_str(), 3, dir, sizeof(dir)), FERRY_OK) << ferry_last_error();
  const std::vector<uint16_t> saved = w1;
  w1 = w1_init;  // the trainer clobbers its weights; the masters are now stale
  EXPECT_EQ(ferry_verify_masters(e), FERRY_FAILED_PRECONDITION);
  ASSERT_EQ(ferry_load_checkpoint(e, dir), FERRY_OK) << ferry_last_error();
  EXPECT_EQ(w1, saved);
  ASSERT_EQ(ferry_verify_masters(e), FERRY_OK) << ferry_last_error();
  w1 = w1_init;
  const char* groups[] = {"ga"};
  ASSERT_EQ(ferry_sync_from_model(e, groups, 1, 1), FERRY_OK) << ferry_last_error();
  ASSERT_EQ(ferry_verify_masters(e), FERRY_OK) << ferry_last_error();
  // Hot reload: everything offloaded, then a policy that does not exist (nothing changes).
  const std::string all = Policy("offload_all.lua");
  ASSERT_EQ(ferry_reload_policy(e, all.c_str(), nullptr, nullptr, 0), FERRY_OK) << ferry_last_error();
  ASSERT_EQ(ferry_group_offloaded(e, "ga", &off_a), FERRY_OK);
  ASSERT_EQ(ferry_group_offloaded(e, "gb", &off_b), FERRY_OK);
  EXPECT_EQ(off_a + off_b, 2);
  EXPECT_EQ(ferry_reload_policy(e, "/no/such/policy.lua", nullptr, nullptr, 0), FERRY_NOT_FOUND);
  EXPECT_NE(std::string(ferry_last_error()).find("/no/such/policy.lua"), std::string::npos) << ferry_last_error();
  ASSERT_EQ(ferry_step(e, -1.0f, nullptr), FERRY_OK) << ferry_last_error();
  ASSERT_EQ(ferry_verify_masters(e), FERRY_OK) << ferry_last_error();
  ferry_engine_destroy(e);
  std::filesystem::remove_all(root);

  EXPECT_EQ(ferry_finalize(nullptr), FERRY_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ferry_last_error()).find("NULL"), std::string::npos);
  EXPECT_EQ(ferry_engine_create(nullptr, &e), FERRY_INVALID_ARGUMENT);
}

TEST(CApiTest, VersionIsTheProjectVersion) {
  EXPECT_STREQ(ferry_version(), FERRY_VERSION_STRING);
  EXPECT_EQ(FERRY_VERSION_NUMBER,
            FERRY_VERSION_MAJOR * 10000 + FERRY_VERSION_MINOR * 100 + FERRY_VERSION_PATCH);
  EXPECT_EQ(std::string(FERRY_VERSION_STRING),
            std::to_string(FERRY_VERSION_MAJOR) + "." + std::to_string(FERRY_VERSION_MINOR) + "." +
                std::to_string(FERRY_VERSION_PATCH));
}

}  // namespace
