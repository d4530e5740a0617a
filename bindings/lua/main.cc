// The `ferry` command.
//   ferry run SCRIPT.lua [ARGS...]   runs a script with the `ferry` module (arg[0] = SCRIPT, arg[1..] = ARGS)
//   ferry check POLICY.lua [flags]   runs a policy's hooks against a model (commands.h)
//   ferry inspect CHECKPOINT [flags] describes and verifies a checkpoint (commands.h)
//   ferry bench NAME [ARGS...]       runs a benchmark of tests/bench
//   ferry help [VERB] | --help       usage; VERB --help for a verb's flags
//   ferry version | --version
// Verbs take Abseil flags (lua/verb_flags.h), parsed per verb; `run` and `bench` pass their
// arguments through to the script or benchmark.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <lua.hpp>

#include "bench/bench.h"
#include "ferry/version.h"
#include "lua/commands.h"
#include "lua/ferry_module.h"

namespace {

constexpr char kUsage[] =
    "usage: ferry <verb> [args]\n"
    "\n"
    "verbs:\n"
    "  run SCRIPT.lua [ARGS...]  run a Lua script with the `ferry` module (the engine's API for\n"
    "                            scripts); ARGS reach the script as arg[1..] and as `...`\n"
    "  check POLICY.lua [flags]  run a policy's hooks against a synthetic or described model:\n"
    "                            placement table, checkpoint plan, after_load and on_step decisions,\n"
    "                            every error (--model SPEC, --arg KEY=VALUE, ...)\n"
    "  inspect CHECKPOINT        tensors, files, groups, sizes and what was skipped; --verify reads\n"
    "                            every tensor and checks its checksum\n"
    "  trace FILE [--svg OUT]    summarize a trace (FERRY_TRACE=FILE, run/bench --trace FILE) per\n"
    "                            stage beside its ceiling; --svg draws one step's timeline\n"
    "  bench NAME [ARGS...]      run a benchmark (`ferry bench` lists them; NAME --help)\n"
    "  version                   print the version\n"
    "  help [VERB]               this text, or VERB's (same as ferry VERB --help)\n"
    "\n"
    "environment:\n"
    "  FERRY_DEVICE=host|cuda    force the device backend (default: cuda when a GPU is present)\n"
    "  FERRY_TRACE=FILE          every engine writes a trace of its steps, saves and loads to FILE\n";

constexpr char kRunUsage[] =
    "usage: ferry run [--trace FILE] SCRIPT.lua [ARGS...]\n"
    "\n"
    "Runs SCRIPT.lua with the full Lua standard library, LuaJIT's ffi, and the `ferry` module\n"
    "(global `ferry`, also require(\"ferry\")). ferry.script_dir is the script's directory.\n"
    "--trace FILE: every engine the script creates writes a trace of its steps, saves and loads\n"
    "to FILE (as FERRY_TRACE=FILE does; `ferry trace FILE` summarizes it).\n"
    "The exit status is 0 when the script returns normally, 1 when it raises an error.\n";

int Traceback(lua_State* L) {
  const char* msg = lua_tostring(L, 1);
  if (msg == nullptr) msg = "(error object is not a string)";
  lua_getglobal(L, "debug");
  lua_getfield(L, -1, "traceback");
  lua_pushstring(L, msg);
  lua_pushinteger(L, 2);
  lua_call(L, 2, 1);
  return 1;
}

int Run(int argc, char** argv) {
  if (argc < 1 || std::strcmp(argv[0], "--help") == 0 || std::strcmp(argv[0], "-h") == 0) {
    std::fputs(kRunUsage, argc < 1 ? stderr : stdout);
    return argc < 1 ? 2 : 0;
  }
  if (std::strcmp(argv[0], "--trace") == 0 || std::strncmp(argv[0], "--trace=", 8) == 0) {
    // Every engine the script creates writes its trace there (FERRY_TRACE; see EngineOptions).
    const bool joined = argv[0][7] == '=';
    if (!joined && argc < 3) {
      std::fputs(kRunUsage, stderr);
      return 2;
    }
    ::setenv("FERRY_TRACE", joined ? argv[0] + 8 : argv[1], 1);
    argc -= joined ? 1 : 2;
    argv += joined ? 1 : 2;
  }
  const std::string script = argv[0];
  std::error_code ec;
  if (!std::filesystem::is_regular_file(script, ec)) {
    std::fprintf(stderr, "ferry run: no such script: %s\n", script.c_str());
    return 2;
  }
  std::string dir = std::filesystem::absolute(script, ec).parent_path().string();
  lua_State* L = luaL_newstate();
  if (L == nullptr) {
    std::fprintf(stderr, "ferry run: cannot create a Lua state\n");
    return 1;
  }
  luaL_openlibs(L);
  ferry::InstallFerryModule(L, dir);
  lua_createtable(L, argc, 1);
  for (int i = 0; i < argc; ++i) {
    lua_pushstring(L, argv[i]);
    lua_rawseti(L, -2, i);
  }
  lua_setglobal(L, "arg");
  int status = 0;
  lua_pushcfunction(L, Traceback);
  if (luaL_loadfile(L, script.c_str()) != 0) {
    std::fprintf(stderr, "ferry run: %s\n", lua_tostring(L, -1));
    status = 1;
  } else {
    for (int i = 1; i < argc; ++i) lua_pushstring(L, argv[i]);
    if (lua_pcall(L, argc - 1, 0, -(argc + 1)) != 0) {
      std::fprintf(stderr, "ferry run: %s\n", lua_tostring(L, -1));
      status = 1;
    }
  }
  lua_close(L);
  ferry::CloseFerryModule();
  return status;
}

int Bench(int argc, char** argv) {
  const std::vector<ferry::bench::BenchInfo> benches = ferry::bench::Benches();
  if (argc < 1 || std::strcmp(argv[0], "--help") == 0 || std::strcmp(argv[0], "-h") == 0) {
    std::fputs("usage: ferry bench NAME [ARGS...]   (NAME --help for its arguments)\n\nbenchmarks:\n",
               argc < 1 ? stderr : stdout);
    for (const auto& b : benches) std::fprintf(argc < 1 ? stderr : stdout, "  %-12s %s\n", b.name.c_str(), b.help.c_str());
    return argc < 1 ? 2 : 0;
  }
  for (const auto& b : benches) {
    if (b.name == argv[0]) return b.fn(argc, argv);
  }
  std::fprintf(stderr, "ferry bench: no benchmark '%s' (`ferry bench` lists them)\n", argv[0]);
  return 2;
}

std::vector<std::string> Words(int argc, char** argv) { return std::vector<std::string>(argv, argv + argc); }

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fputs(kUsage, stderr);
    return 2;
  }
  const std::string verb = argv[1];
  if (verb == "run") return Run(argc - 2, argv + 2);
  if (verb == "check") return ferry::cli::CheckCommand(Words(argc - 2, argv + 2), stdout, stderr);
  if (verb == "inspect") return ferry::cli::InspectCommand(Words(argc - 2, argv + 2), stdout, stderr);
  if (verb == "trace") return ferry::cli::TraceCommand(Words(argc - 2, argv + 2), stdout, stderr);
  if (verb == "bench") return Bench(argc - 2, argv + 2);
  if (verb == "help" || verb == "--help" || verb == "-h") {
    if (argc >= 3) {
      const std::string topic = argv[2];
      char help[] = "--help";
      char* help_argv[] = {help};
      if (topic == "run") return Run(1, help_argv);
      if (topic == "check") return ferry::cli::CheckCommand({"--help"}, stdout, stderr);
      if (topic == "inspect") return ferry::cli::InspectCommand({"--help"}, stdout, stderr);
      if (topic == "trace") return ferry::cli::TraceCommand({"--help"}, stdout, stderr);
      if (topic == "bench") return Bench(1, help_argv);
      std::fprintf(stderr, "ferry help: unknown verb '%s'\n\n%s", topic.c_str(), kUsage);
      return 2;
    }
    std::fputs(kUsage, stdout);
    return 0;
  }
  if (verb == "version" || verb == "--version") {
    std::puts("ferry " FERRY_VERSION_STRING);
    return 0;
  }
  std::fprintf(stderr, "ferry: unknown verb '%s'\n\n%s", verb.c_str(), kUsage);
  return 2;
}
