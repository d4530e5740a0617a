"""Where a benchmark's threads spent the timed steps: each thread's time on a CPU and its time ready to
run but waiting for one (the kernel's run-queue delay, /proc/self/task/<tid>/schedstat), summed by
role. A trainer thread that waits for a CPU, or one whose work takes longer on a CPU, issues the GPU's
work late: on a host whose CPUs CPU Adam's workers keep busy this is where the time of a loop paced by
its host goes. Linux only: elsewhere `snapshot()` is empty and `text()` says nothing.

Roles: `trainer` (the process's main thread), `autograd` (torch's backward threads, pt_autograd_*),
Ferry's threads by name (ferry-adam: CPU Adam's workers, ferry-early: the early steps' thread, ...;
the engine names them), and `other` (NCCL's, the profiler's, torch's pools)."""
import os

_TASKS = "/proc/self/task"


def snapshot():
    """{tid: (name, ns on a CPU, ns waiting for one)} of this process's threads now."""
    out = {}
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return out
    for tid in tids:
        try:
            with open(os.path.join(_TASKS, tid, "comm")) as f:
                name = f.read().strip()
            with open(os.path.join(_TASKS, tid, "schedstat")) as f:
                on_cpu, waiting = (int(v) for v in f.read().split()[:2])
        except (OSError, ValueError):
            continue  # exited meanwhile, or no schedstat (a kernel without CONFIG_SCHED_INFO)
        out[int(tid)] = (name, on_cpu, waiting)
    return out


def role(tid, name):
    if tid == os.getpid():
        return "trainer"
    if name.startswith("pt_autograd"):
        return "autograd"
    if name.startswith("ferry-"):
        return name
    return "other"


def use(before, after, steps):
    """{role: [threads, ms on a CPU per step, ms waiting for a CPU per step]} between two snapshots
    (threads started meanwhile count from zero; threads gone by `after` are not counted)."""
    out = {}
    for tid, (name, on_cpu, waiting) in after.items():
        _, on0, wait0 = before.get(tid, (name, 0, 0))
        r = out.setdefault(role(tid, name), [0, 0.0, 0.0])
        r[0] += 1
        r[1] += (on_cpu - on0) / 1e6 / steps
        r[2] += (waiting - wait0) / 1e6 / steps
    return out


ORDER = ("trainer", "autograd", "ferry-early", "ferry-adam")


def text(by_role):
    """use()'s dict as one line: each role's CPU time and wait per step, the trainer's first."""
    if not by_role:
        return ""
    roles = [r for r in ORDER if r in by_role] + sorted(r for r in by_role if r not in ORDER)
    parts = []
    for r in roles:
        n, on_cpu, waiting = by_role[r]
        if on_cpu < 0.05 and waiting < 0.05:
            continue
        label = r if n == 1 else "%s x%d" % (r, n)
        parts.append("%s %.1f on a CPU + %.1f waiting" % (label, on_cpu, waiting))
    return "threads, ms per step: " + "; ".join(parts)
