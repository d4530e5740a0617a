// The `ferry` Lua module's device and tensors: `ferry.tensor(dtype, numel)` is device memory that a
// script fills, reads and hands to an engine (e:add_param), on the one device the module opens per
// process. ferry_module.cc builds the module on these; the engine's methods live there.
#ifndef FERRY_BINDINGS_LUA_LUA_TENSOR_H_
#define FERRY_BINDINGS_LUA_LUA_TENSOR_H_

#include <cstdint>

#include <lua.hpp>

#include "absl/status/status.h"
#include "device/device.h"

namespace ferry {

// A `ferry.Tensor` userdata.
struct LuaTensor {
  DeviceBuffer buffer;
  DType dtype = DType::kF32;
  int64_t numel = 0;
};

// The device the module's tensors live on, opened at the first use (raises a Lua error if it cannot).
Device* ModuleDevice(lua_State* L);
// Releases it. REQUIRES: every Lua state that used the module is closed.
void CloseModuleDevice();

// Raises a Lua error with the status's message.
[[noreturn]] void RaiseStatus(lua_State* L, const absl::Status& s);

// The tensor at stack index `idx` (raises a Lua error if it is not one).
LuaTensor* CheckTensor(lua_State* L, int idx);

// Registers a metatable `name` whose __index holds `methods`, with `gc` as __gc (and a protected
// __metatable).
void NewLuaType(lua_State* L, const char* name, const luaL_Reg* methods, lua_CFunction gc);

// Registers the tensor type's metatable. Call once per Lua state, before any tensor is made.
void RegisterTensorType(lua_State* L);

// The module functions of this file: ferry.tensor(dtype, numel), ferry.backend(), ferry.device_name().
int LTensor(lua_State* L);
int LBackend(lua_State* L);
int LDeviceName(lua_State* L);

}  // namespace ferry

#endif  // FERRY_BINDINGS_LUA_LUA_TENSOR_H_
