#include "lua/verb_flags.h"

#include <algorithm>

#include "absl/flags/reflection.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/absl_compat.h"
#include "base/logging.h"

namespace ferry::cli {
namespace {

absl::CommandLineFlag* Registered(const VerbFlag& f) {
  absl::CommandLineFlag* flag = absl::FindCommandLineFlag(f.flag_name);
  FERRY_CHECK(flag != nullptr) << "flag " << f.flag_name << " is not registered";
  return flag;
}

std::string Normalize(std::string_view name) {
  std::string out(name);
  std::replace(out.begin(), out.end(), '-', '_');
  return out;
}

}  // namespace

bool WantsHelp(const std::vector<std::string>& args) {
  for (const std::string& a : args) {
    if (a == "--") break;
    if (a == "--help" || a == "-h" || a == "-help") return true;
  }
  return !args.empty() && args[0] == "help";
}

absl::StatusOr<std::vector<std::string>> ParseVerbFlags(std::string_view verb,
                                                        const std::vector<std::string>& args,
                                                        absl::Span<const VerbFlag> flags) {
  const absl::string_view v = ToAbsl(verb);
  for (const VerbFlag& f : flags) {
    absl::CommandLineFlag* flag = Registered(f);
    std::string error;
    FERRY_CHECK(flag->ParseFrom(flag->DefaultValue(), &error)) << f.flag_name << ": " << error;
  }
  auto known = [&] {
    std::vector<std::string> names;
    for (const VerbFlag& f : flags) names.push_back("--" + f.name);
    return names.empty() ? std::string("none") : absl::StrJoin(names, ", ");
  };
  std::vector<std::string> positional;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--") {
      positional.insert(positional.end(), args.begin() + static_cast<std::ptrdiff_t>(i) + 1,
                        args.end());
      break;
    }
    if (arg.size() < 2 || arg[0] != '-' || arg == "-") {
      positional.push_back(arg);
      continue;
    }
    const size_t dashes = arg[1] == '-' ? 2 : 1;
    const size_t eq = arg.find('=');
    const std::string name = Normalize(arg.substr(dashes, eq == std::string::npos ? std::string::npos
                                                                                 : eq - dashes));
    const VerbFlag* match = nullptr;
    bool negated = false;
    for (const VerbFlag& f : flags) {
      if (Normalize(f.name) == name) match = &f;
    }
    if (match == nullptr && name.size() > 2 && name.compare(0, 2, "no") == 0) {
      for (const VerbFlag& f : flags) {
        if (Normalize(f.name) == name.substr(2) && Registered(f)->IsOfType<bool>()) {
          match = &f;
          negated = true;
        }
      }
    }
    if (match == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("ferry ", v, ": unknown flag ", arg, " (flags: ", known(), ")"));
    }
    absl::CommandLineFlag* flag = Registered(*match);
    std::string value;
    if (eq != std::string::npos) {
      if (negated) {
        return absl::InvalidArgumentError(
            absl::StrCat("ferry ", v, ": ", arg, ": --no", match->name, " takes no value"));
      }
      value = arg.substr(eq + 1);
    } else if (flag->IsOfType<bool>()) {
      value = negated ? "false" : "true";
    } else if (i + 1 < args.size()) {
      value = args[++i];
    } else {
      return absl::InvalidArgumentError(absl::StrCat("ferry ", v, ": flag --", match->name,
                                                     " needs a value (--", match->name, "=",
                                                     match->value_name, ")"));
    }
    if (match->repeatable) {
      const std::string current = flag->CurrentValue();
      if (!current.empty()) value = absl::StrCat(current, ",", value);
    }
    std::string error;
    if (!flag->ParseFrom(value, &error)) {
      return absl::InvalidArgumentError(absl::StrCat("ferry ", v, ": bad value for --", match->name,
                                                     ": ", error));
    }
  }
  return positional;
}

std::string FlagsHelp(absl::Span<const VerbFlag> flags) {
  std::string out;
  for (const VerbFlag& f : flags) {
    const absl::CommandLineFlag* flag = Registered(f);
    const std::string left = flag->IsOfType<bool>()
                                 ? absl::StrCat("--", f.name, ", --no", f.name)
                                 : absl::StrCat("--", f.name, "=", f.value_name);
    std::string def = flag->DefaultValue();
    if (def.empty()) def = "\"\"";
    absl::StrAppendFormat(&out, "  %-26s %s", left, flag->Help());
    if (!f.repeatable) absl::StrAppend(&out, " (default: ", def, ")");
    absl::StrAppend(&out, "\n");
  }
  return out;
}

}  // namespace ferry::cli
