// The `ferry` Lua module: the engine's API for trusted scripts run by the `ferry` command (the samples).
// Policy scripts never see it (they run in the policy layer's sandbox).
#ifndef FERRY_BINDINGS_LUA_FERRY_MODULE_H_
#define FERRY_BINDINGS_LUA_FERRY_MODULE_H_

#include <string>

#include <lua.hpp>

namespace ferry {

// Pushes the module table onto the stack (the lua_CFunction behind `require("ferry")`).
int OpenFerryModule(lua_State* L);

// Registers the module in package.preload and as the global `ferry`, with ferry.script_dir set to
// `script_dir` (the directory of the script being run, so samples find files beside them).
void InstallFerryModule(lua_State* L, const std::string& script_dir);

// Releases the module's device. REQUIRES: every Lua state that used the module is closed.
void CloseFerryModule();

}  // namespace ferry

#endif  // FERRY_BINDINGS_LUA_FERRY_MODULE_H_
