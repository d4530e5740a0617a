// The `ferry` command's verbs that do not run Lua scripts: `check` (a policy against a model) and
// `inspect` (a checkpoint). main.cc dispatches to them; tests call them directly with memory
// streams. Each verb takes the words after the verb name, writes its report to `out` and its
// errors and progress to `err`, and returns the process exit status: 0 when all is well, 1 when it
// found errors (in the policy, in the checkpoint), 2 for a usage error.
//
// Thread-safety: one verb at a time per process (the verbs' flags are process-wide).
#ifndef FERRY_BINDINGS_LUA_COMMANDS_H_
#define FERRY_BINDINGS_LUA_COMMANDS_H_

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "policy/policy_types.h"

namespace ferry::cli {

// ferry check POLICY.lua [--model SPEC] [--arg KEY=VALUE ...] [...]: loads the policy, runs its
// hooks against the model and prints the placement table, the checkpoint plan, the after_load
// decisions and the on_step requests; reports every error it finds (exit status 1).
int CheckCommand(const std::vector<std::string>& args, std::FILE* out, std::FILE* err);
// The text of `ferry check --help`.
std::string CheckUsage();

// ferry inspect CHECKPOINT [--verify] [...]: a checkpoint directory (or a root, through `latest`):
// its tensors, files, groups, what was skipped; with --verify every checksum, with a progress bar.
int InspectCommand(const std::vector<std::string>& args, std::FILE* out, std::FILE* err);
// The text of `ferry inspect --help`.
std::string InspectUsage();

// ferry trace FILE [--svg OUT.svg] [--ceiling KEY=GBPS,...]: the per-stage summary of a trace file
// beside each stage's ceiling; with --svg the timeline of one step as an SVG picture.
int TraceCommand(const std::vector<std::string>& args, std::FILE* out, std::FILE* err);
// The text of `ferry trace --help`.
std::string TraceUsage();

// The model `ferry check` uses when --model is not given.
inline constexpr char kDefaultModelSpec[] = "gpt:12:768:50257";

// The model of `ferry check --model SPEC` (model_spec.cc), in parameter order:
//   ""                            the default, gpt:12:768:50257
//   gpt:LAYERS:HIDDEN[:VOCAB]     a GPT-style model in bf16: "embed" (VOCAB x HIDDEN, tag
//                                 "embedding"), "layer0".."layer<LAYERS-1>" (12 HIDDEN^2 + 13 HIDDEN
//                                 each: attention, MLP and two layer norms; tag "transformer"),
//                                 "head" (VOCAB x HIDDEN, tag "head"); VOCAB defaults to 50257
//   NAME:NUMEL[:DTYPE[:TAG+TAG...]],...
//                                 groups listed one by one; NUMEL is an integer, optionally with a
//                                 suffix K, M, G or T (x 1000^n; "1.5M" = 1500000); DTYPE bf16
//                                 (default), f16 or f32
//   @FILE                         the same list read from FILE; commas or newlines separate groups,
//                                 "#" starts a comment
// Errors: InvalidArgument naming the entry and what is wrong (empty or duplicate names, a bad
// number or dtype); NotFound for an unreadable FILE.
absl::StatusOr<std::vector<GroupInfo>> ParseModelSpec(std::string_view spec);

// A byte size: a number (decimal, may have a fraction or exponent) optionally followed by B, K, KB,
// M, MB, G, GB, T, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024). The result is rounded
// down to whole bytes. InvalidArgument for anything else or a negative or too large value.
absl::StatusOr<int64_t> ParseByteSize(std::string_view text);

// "1.5 GiB", "512 B": for reports.
std::string HumanBytes(int64_t bytes);

}  // namespace ferry::cli

#endif  // FERRY_BINDINGS_LUA_COMMANDS_H_
