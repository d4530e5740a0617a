// Flags of the `ferry` command's verbs. Each verb declares its flags with ABSL_FLAG under the name
// ferry_<verb>_<flag> (Abseil's flag registry is one namespace for the whole process, which the
// benchmarks share) and lists them as VerbFlags under the names users type (--<flag>). A verb's
// arguments are parsed by ParseVerbFlags instead of absl::ParseCommandLine, which would exit the
// process on --help and on errors, and could run only once per process.
//
// Thread-safety: the flags are process-wide; run one verb at a time.
#ifndef FERRY_BINDINGS_LUA_VERB_FLAGS_H_
#define FERRY_BINDINGS_LUA_VERB_FLAGS_H_

#include <string>
#include <string_view>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace ferry::cli {

struct VerbFlag {
  std::string name;                       // as typed after "--" (underscores; dashes also accepted)
  std::string flag_name;                  // the Abseil flag's registered name
  std::string value_name = "VALUE";       // for --help: --name=VALUE
  bool repeatable = false;                // std::vector<std::string> flags: occurrences accumulate
};

// Resets every flag of `flags` to its default, then parses `args` (the words after the verb):
// --name=value and --name value; for bool flags also --name and --noname; a lone "--" ends the
// flags. Everything else is positional and returned in order. Errors (InvalidArgument, naming the
// verb and the flag): an unknown flag (listing the known ones), a missing value, a value the flag's
// type refuses (Abseil's message). REQUIRES: every flag_name is registered.
absl::StatusOr<std::vector<std::string>> ParseVerbFlags(std::string_view verb,
                                                        const std::vector<std::string>& args,
                                                        absl::Span<const VerbFlag> flags);

// The flags part of a verb's --help: one "  --name=VALUE  help (default: ...)" entry per flag.
std::string FlagsHelp(absl::Span<const VerbFlag> flags);

// True when `args` asks for help (--help, -h or help as the first word).
bool WantsHelp(const std::vector<std::string>& args);

}  // namespace ferry::cli

#endif  // FERRY_BINDINGS_LUA_VERB_FLAGS_H_
