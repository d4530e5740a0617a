// BuiltWithMpi and MakeMpiComm for a build without MPI; comm/mpi/mpi_comm.cc defines them when CMake
// found MPI (and then defines FERRY_HAVE_MPI for this layer).
#ifndef FERRY_HAVE_MPI
#include "absl/status/status.h"
#include "ferry/comm.h"

namespace ferry {

bool BuiltWithMpi() { return false; }

absl::StatusOr<std::unique_ptr<Comm>> MakeMpiComm() {
  return absl::UnimplementedError(
      "MakeMpiComm: this build of Ferry has no MPI comm (CMake did not find MPI, or "
      "-DFERRY_ENABLE_MPI=OFF); install MPI (Debian/Ubuntu: apt-get install libopenmpi-dev openmpi-bin) "
      "and reconfigure and rebuild with -DFERRY_ENABLE_MPI=ON");
}

}  // namespace ferry
#endif  // FERRY_HAVE_MPI
