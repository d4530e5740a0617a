#include "lua/lua_tensor.h"

#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace ferry {
namespace {

constexpr char kTensorMeta[] = "ferry.Tensor";

// The device the module's tensors live on: one per process, chosen like the engine's (FERRY_DEVICE).
std::unique_ptr<Device>& ModuleDeviceSlot() {
  static auto* device = new std::unique_ptr<Device>();  // released by CloseModuleDevice, never at exit
  return *device;
}

}  // namespace

Device* ModuleDevice(lua_State* L) {
  std::unique_ptr<Device>& device = ModuleDeviceSlot();
  if (device == nullptr) {
    absl::StatusOr<std::unique_ptr<Device>> d = CreateDevice();
    if (!d.ok()) {
      std::string msg = std::string(d.status().message());
      luaL_error(L, "ferry: cannot open a device: %s", msg.c_str());
    }
    device = *std::move(d);
  }
  return device.get();
}

void CloseModuleDevice() { ModuleDeviceSlot().reset(); }

[[noreturn]] void RaiseStatus(lua_State* L, const absl::Status& s) {
  lua_pushstring(L, std::string(s.message()).c_str());
  lua_error(L);
  __builtin_unreachable();
}

LuaTensor* CheckTensor(lua_State* L, int idx) { return static_cast<LuaTensor*>(luaL_checkudata(L, idx, kTensorMeta)); }

void NewLuaType(lua_State* L, const char* name, const luaL_Reg* methods, lua_CFunction gc) {
  luaL_newmetatable(L, name);
  lua_newtable(L);
  luaL_register(L, nullptr, methods);
  lua_setfield(L, -2, "__index");
  lua_pushcfunction(L, gc);
  lua_setfield(L, -2, "__gc");
  lua_pushstring(L, name);
  lua_setfield(L, -2, "__metatable");
  lua_pop(L, 1);
}

namespace {

DType CheckDType(lua_State* L, int idx) {
  const char* name = luaL_checkstring(L, idx);
  absl::StatusOr<DType> t = ParseDType(name);
  if (!t.ok()) RaiseStatus(L, t.status());
  return *t;
}

int LTensorGc(lua_State* L) {
  auto* t = static_cast<LuaTensor*>(luaL_checkudata(L, 1, kTensorMeta));
  t->~LuaTensor();
  return 0;
}

// t:upload(values): a Lua array of numbers, rounded to the tensor's dtype.
int LTensorUpload(lua_State* L) {
  LuaTensor* t = CheckTensor(L, 1);
  luaL_checktype(L, 2, LUA_TTABLE);
  const size_t n = lua_objlen(L, 2);
  if (static_cast<int64_t>(n) != t->numel) {
    luaL_error(L, "tensor:upload: got %d values for a tensor of %d elements", static_cast<int>(n), static_cast<int>(t->numel));
  }
  std::vector<char> host(static_cast<size_t>(t->numel) * DTypeSize(t->dtype));
  for (size_t i = 0; i < n; ++i) {
    lua_rawgeti(L, 2, static_cast<int>(i + 1));
    if (!lua_isnumber(L, -1)) luaL_error(L, "tensor:upload: element %d is not a number", static_cast<int>(i + 1));
    StoreFromF32(host.data(), t->dtype, i, static_cast<float>(lua_tonumber(L, -1)));
    lua_pop(L, 1);
  }
  absl::Status s = ModuleDevice(L)->Copy(t->buffer.data(), host.data(), host.size(), CopyKind::kHostToDevice);
  if (!s.ok()) RaiseStatus(L, s);
  return 0;
}

std::vector<char> Download(lua_State* L, LuaTensor* t) {
  std::vector<char> host(static_cast<size_t>(t->numel) * DTypeSize(t->dtype));
  absl::Status s = ModuleDevice(L)->Copy(host.data(), t->buffer.data(), host.size(), CopyKind::kDeviceToHost);
  if (!s.ok()) RaiseStatus(L, s);
  return host;
}

// t:download() -> array of numbers.
int LTensorDownload(lua_State* L) {
  LuaTensor* t = CheckTensor(L, 1);
  std::vector<char> host = Download(L, t);
  lua_createtable(L, static_cast<int>(t->numel), 0);
  for (int64_t i = 0; i < t->numel; ++i) {
    lua_pushnumber(L, LoadAsF32(host.data(), t->dtype, static_cast<size_t>(i)));
    lua_rawseti(L, -2, static_cast<int>(i + 1));
  }
  return 1;
}

// t:raw() -> the tensor's bytes as a string (for bit-exact comparisons).
int LTensorRaw(lua_State* L) {
  LuaTensor* t = CheckTensor(L, 1);
  std::vector<char> host = Download(L, t);
  lua_pushlstring(L, host.data(), host.size());
  return 1;
}

int LTensorNumel(lua_State* L) {
  lua_pushnumber(L, static_cast<lua_Number>(CheckTensor(L, 1)->numel));
  return 1;
}

int LTensorDType(lua_State* L) {
  lua_pushstring(L, std::string(DTypeName(CheckTensor(L, 1)->dtype)).c_str());
  return 1;
}

}  // namespace

void RegisterTensorType(lua_State* L) {
  static const luaL_Reg methods[] = {{"upload", LTensorUpload}, {"download", LTensorDownload},
                                     {"raw", LTensorRaw},       {"numel", LTensorNumel},
                                     {"dtype", LTensorDType},   {nullptr, nullptr}};
  NewLuaType(L, kTensorMeta, methods, LTensorGc);
}

// ferry.tensor(dtype, numel): device memory, zero-filled.
int LTensor(lua_State* L) {
  DType dtype = CheckDType(L, 1);
  lua_Number n = luaL_checknumber(L, 2);
  if (!(n >= 1) || n != std::floor(n) || n > 1e12) luaL_error(L, "ferry.tensor: numel must be a positive integer, got %f", n);
  Device* device = ModuleDevice(L);
  auto* t = static_cast<LuaTensor*>(lua_newuserdata(L, sizeof(LuaTensor)));
  new (t) LuaTensor();
  luaL_getmetatable(L, kTensorMeta);
  lua_setmetatable(L, -2);
  t->dtype = dtype;
  t->numel = static_cast<int64_t>(n);
  const size_t bytes = static_cast<size_t>(t->numel) * DTypeSize(dtype);
  absl::StatusOr<DeviceBuffer> buf = device->Allocate(bytes);
  if (!buf.ok()) RaiseStatus(L, buf.status());
  t->buffer = *std::move(buf);
  std::vector<char> zeros(bytes, 0);
  absl::Status s = device->Copy(t->buffer.data(), zeros.data(), bytes, CopyKind::kHostToDevice);
  if (!s.ok()) RaiseStatus(L, s);
  return 1;
}

int LBackend(lua_State* L) {
  lua_pushstring(L, std::string(BackendName(ModuleDevice(L)->backend())).c_str());
  return 1;
}

int LDeviceName(lua_State* L) {
  lua_pushstring(L, ModuleDevice(L)->name().c_str());
  return 1;
}

}  // namespace ferry
