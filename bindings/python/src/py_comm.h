// ferry._ferry's comm through Python: the engine's small collectives (ferry::MakeCallbackComm)
// carried out by a Python object's methods, for Engine(comm=obj, rank=, world_size=). `obj`
// (ferry.distributed.TorchComm over torch.distributed) has
//   all_reduce(values: list[float], op: "sum"|"max"|"min", timeout_s) -> list[float]
//   all_gather(mine: bytes, timeout_s) -> bytes        (every rank the same length; world * len)
//   barrier(timeout_s), broadcast(data: bytes, root, timeout_s) -> bytes   (optional)
//   duplicate(timeout_s) -> another such object over the same ranks (optional)
// mapped onto ferry::MakeCallbackComm. The engine calls them from the thread that drives it and,
// for asynchronous checkpoint saves, from its writer thread (on the duplicate): each call takes the
// GIL. A Python exception becomes an error Status: TimeoutError -> DeadlineExceeded, anything else
// Unavailable, with the exception's type and message.
#ifndef FERRY_BINDINGS_PYTHON_PY_COMM_H_
#define FERRY_BINDINGS_PYTHON_PY_COMM_H_

#include <pybind11/pybind11.h>

#include "ferry/comm.h"

namespace ferry::python {

// The callbacks that run the engine's collectives through `obj`'s methods (each call under the GIL).
absl::StatusOr<CommCallbacks> MakePyCallbacks(pybind11::object obj, int rank, int world_size);

}  // namespace ferry::python

#endif  // FERRY_BINDINGS_PYTHON_PY_COMM_H_
