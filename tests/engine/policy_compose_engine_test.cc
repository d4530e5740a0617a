// A policy built on another (ferry.policy) through the engine: a hot reload (Engine::ReloadPolicy)
// reads the base again, so an edit to the base moves groups; a misspelled arg fails Finalize and a
// reload, naming it, and leaves the engine training as it was.
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "device/device.h"
#include "engine/engine_test_util.h"
#include "ferry/engine.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ferry {
namespace {

using ::testing::HasSubstr;
using namespace ::ferry::engine_test;  // NOLINT

std::vector<bool> Offloaded(const Engine& e) {
  std::vector<bool> out;
  for (const GroupPlacement& g : e.Placement()) out.push_back(g.offloaded);
  return out;
}

// A base that offloads the groups named in its body.
std::string BaseOffloading(const std::string& lua_set) {
  return "local cpu = " + lua_set + R"lua(
return { place = function(groups, ctx)
  local p = {}
  for _, g in ipairs(groups) do p[g.name] = cpu[g.name] and "cpu" or "gpu" end
  return p
end }
)lua";
}

TEST(PolicyComposeEngineTest, ReloadPicksUpAnEditedBase) {
  std::string tmpl = (std::filesystem::temp_directory_path() / "ferry-compose-engine-XXXXXX").string();
  ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
  const std::string dir = tmpl;
  auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir + "/" + name, std::ios::trunc) << text;
    return dir + "/" + name;
  };
  write("base.lua", BaseOffloading("{ g0 = true }"));
  const std::string top = write("top.lua", R"lua(local base = ferry.policy("base.lua")
return { place = base.place, args = { unused = "an arg of the top only" } }
)lua");

  absl::StatusOr<std::unique_ptr<Device>> device = CreateDevice();
  ASSERT_TRUE(device.ok()) << device.status();
  EngineOptions o;
  o.policy_path = top;
  o.device = std::string(BackendName((*device)->backend()));
  o.transfer_chunk_bytes = 1024;
  absl::StatusOr<std::unique_ptr<Engine>> e = Engine::Create(o);
  ASSERT_TRUE(e.ok()) << e.status();
  Model model(device->get(), {300, 40, 1000}, 5);
  ASSERT_TRUE(model.Register(**e).ok());
  ASSERT_TRUE((*e)->Finalize().ok());
  EXPECT_EQ(Offloaded(**e), (std::vector<bool>{true, false, false}));
  model.SetGrads(1);
  ASSERT_TRUE((*e)->Step().ok());

  // The base is edited; reloading the (unchanged) top reads it again.
  write("base.lua", BaseOffloading("{ g1 = true, g2 = true }"));
  ASSERT_TRUE((*e)->ReloadPolicy(top, {{"unused", "1"}}).ok());
  EXPECT_EQ(Offloaded(**e), (std::vector<bool>{false, true, true}));

  // A misspelled arg: refused naming it, and the placement stays.
  absl::Status typo = (*e)->ReloadPolicy(top, {{"unsued", "1"}});
  ASSERT_FALSE(typo.ok());
  EXPECT_THAT(std::string(typo.message()), HasSubstr("unknown arg \"unsued\" (unsued=1); it takes unused"));
  EXPECT_EQ(Offloaded(**e), (std::vector<bool>{false, true, true}));
  // A broken base: refused naming the base's file, and the placement stays.
  const std::string base = write("base.lua", "return { place = function() error('edited badly') end }\n");
  absl::Status broken = (*e)->ReloadPolicy(top, {});
  ASSERT_FALSE(broken.ok());
  EXPECT_THAT(std::string(broken.message()), HasSubstr(base + ":1: edited badly"));
  EXPECT_EQ(Offloaded(**e), (std::vector<bool>{false, true, true}));
  model.SetGrads(2);
  EXPECT_TRUE((*e)->Step().ok());

  // A misspelled arg at creation fails Finalize, naming it.
  o.policy_path = Policies() + "offload_fraction.lua";
  o.policy_args = {{"fracton", "0.25"}};
  absl::StatusOr<std::unique_ptr<Engine>> typo_engine = Engine::Create(o);
  ASSERT_TRUE(typo_engine.ok()) << typo_engine.status();
  Model other(device->get(), {300, 40, 1000}, 6);
  ASSERT_TRUE(other.Register(**typo_engine).ok());
  absl::Status fin = (*typo_engine)->Finalize();
  ASSERT_FALSE(fin.ok());
  EXPECT_THAT(std::string(fin.message()), HasSubstr("unknown arg \"fracton\" (fracton=0.25); it takes fraction, from, numa"));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace ferry
