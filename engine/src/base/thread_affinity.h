// Which CPUs the threads of this process run on: the threads CPU Adam's pools hold to their CPUs, and
// holding every other thread of the process (the trainer's, autograd's, NCCL's, the pipeline's) to
// the rank's share of its host.
//
// Where several local ranks divide a host, each rank's workers are held to its own slice
// (HostShare::RestrictedTo), but the trainer's threads of every rank were free to run on any CPU:
// on the 4 x H100 host (64 CPUs, 4 ranks, FSDP2) the workers then ran on a CPU only 89-92% of their
// time, and one rank's autograd thread, sharing CPUs with other ranks' workers, launched its
// backward late enough that every rank's reduce-scatters waited for it (tests/bench/README.md,
// `bench_train_dist.py`). Held to its slice, a rank's threads meet only its own workers.
#ifndef FERRY_BASE_THREAD_AFFINITY_H_
#define FERRY_BASE_THREAD_AFFINITY_H_

#include <sys/types.h>

#include <cstddef>
#include <vector>

#include "absl/status/statusor.h"

namespace ferry {

// The calling thread's id (gettid).
pid_t CurrentThreadId();

// Names the calling thread (what top, perf and /proc/<pid>/task/<tid>/comm show; at most 15 bytes
// are kept): Ferry's threads are named ferry-<job> so that a trainer can tell them from its own.
void NameCurrentThread(const char* name);

// A thread that holds itself to CPUs of its own (a pool's worker) registers here before it does,
// so that HoldProcessThreads leaves it alone; it unregisters before it exits.
void RegisterHeldThread(pid_t tid);
void UnregisterHeldThread(pid_t tid);

// The CPUs thread `tid` of this process may run on, ascending; empty when the kernel does not say.
std::vector<int> ThreadCpus(pid_t tid);

// Restricts every thread of this process (/proc/self/task) but the registered ones to `cpus`;
// threads they start later inherit it. Returns how many threads were restricted. Threads that exit
// meanwhile are skipped. An error when `cpus` is empty or has no CPU the kernel accepts (nothing is
// changed then, as far as the first thread tells).
absl::StatusOr<size_t> HoldProcessThreads(const std::vector<int>& cpus);

// The CPUs the calling thread could run on before the process's first HoldProcessThreads; empty when
// none held it yet. ReadHostTopology reads the process's CPUs from it, so that a hold of Ferry's own
// is not taken for a launcher's binding.
std::vector<int> ProcessCpusBeforeHold();

}  // namespace ferry

#endif  // FERRY_BASE_THREAD_AFFINITY_H_
