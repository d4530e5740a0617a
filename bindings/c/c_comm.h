// The C ABI's ferry_comm_callbacks as a ferry::Comm (internal to the bindings, C++ only).
#ifndef FERRY_C_C_COMM_H_
#define FERRY_C_C_COMM_H_

#include <memory>

#include "absl/status/statusor.h"
#include "c/ferry.h"
#include "ferry/comm.h"

namespace ferry {

// A Comm whose collectives call `c`'s functions (see ferry.h), through MakeCallbackComm: a failing
// function's code and message become the Status, wrapped naming the collective and the rank. `c` is
// copied; c.user and the functions must outlive the Comm. InvalidArgument for a rank outside
// [0, world_size) or a NULL all_reduce or all_gather.
absl::StatusOr<std::unique_ptr<Comm>> CommFromCallbacks(const ferry_comm_callbacks& c);

}  // namespace ferry

#endif  // FERRY_C_C_COMM_H_
