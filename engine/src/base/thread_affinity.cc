#include "base/thread_affinity.h"

#include <dirent.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/host_share.h"

namespace ferry {
namespace {

std::mutex& HeldMutex() {
  static auto* mu = new std::mutex();
  return *mu;
}

std::set<pid_t>& HeldThreads() {
  static auto* held = new std::set<pid_t>();
  return *held;
}

std::vector<int>& CpusBeforeHold() {  // guarded by HeldMutex()
  static auto* cpus = new std::vector<int>();
  return *cpus;
}

std::vector<pid_t> ProcessThreads() {
  std::vector<pid_t> tids;
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return {CurrentThreadId()};
  while (dirent* e = readdir(dir)) {
    char* end = nullptr;
    const long tid = std::strtol(e->d_name, &end, 10);
    if (end != e->d_name && *end == '\0' && tid > 0) tids.push_back(static_cast<pid_t>(tid));
  }
  closedir(dir);
  return tids;
}

}  // namespace

pid_t CurrentThreadId() { return static_cast<pid_t>(syscall(SYS_gettid)); }

void NameCurrentThread(const char* name) {
  char buf[16];  // the kernel keeps 15 bytes and the terminator
  std::strncpy(buf, name, sizeof(buf) - 1);
  buf[sizeof(buf) - 1] = '\0';
  pthread_setname_np(pthread_self(), buf);  // best effort: a name is a label, never a failure
}

void RegisterHeldThread(pid_t tid) {
  std::lock_guard<std::mutex> lock(HeldMutex());
  HeldThreads().insert(tid);
}

void UnregisterHeldThread(pid_t tid) {
  std::lock_guard<std::mutex> lock(HeldMutex());
  HeldThreads().erase(tid);
}

std::vector<int> ProcessCpusBeforeHold() {
  std::lock_guard<std::mutex> lock(HeldMutex());
  return CpusBeforeHold();
}

std::vector<int> ThreadCpus(pid_t tid) {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(tid, sizeof(set), &set) != 0) return {};
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  return cpus;
}

absl::StatusOr<size_t> HoldProcessThreads(const std::vector<int>& cpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) {
    if (c >= 0 && c < CPU_SETSIZE) CPU_SET(c, &set);
  }
  if (CPU_COUNT(&set) == 0) {
    return absl::InvalidArgumentError(absl::StrCat("HoldProcessThreads: no CPU to hold the threads to (",
                                                   FormatCpuList(cpus), ")"));
  }
  // The registered threads are read once: one that registers later holds itself after it registered.
  std::set<pid_t> held;
  std::vector<int> before = ThreadCpus(CurrentThreadId());
  {
    std::lock_guard<std::mutex> lock(HeldMutex());
    held = HeldThreads();
  }
  size_t count = 0;
  // The calling thread first: a refusal there (CPUs outside the process's cpuset) changes nothing.
  const pid_t self = CurrentThreadId();
  if (held.count(self) == 0) {
    if (sched_setaffinity(self, sizeof(set), &set) != 0) {
      return absl::FailedPreconditionError(absl::StrCat("HoldProcessThreads: the kernel refused CPUs ",
                                                        FormatCpuList(cpus), ": ", std::strerror(errno)));
    }
    ++count;
  }
  {
    std::lock_guard<std::mutex> lock(HeldMutex());
    if (CpusBeforeHold().empty()) CpusBeforeHold() = std::move(before);
  }
  for (pid_t tid : ProcessThreads()) {
    if (tid == self || held.count(tid) != 0) continue;
    if (sched_setaffinity(tid, sizeof(set), &set) == 0) ++count;  // ESRCH: it exited meanwhile
  }
  return count;
}

}  // namespace ferry
