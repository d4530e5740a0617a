"""samples/python/bench_threads.py: the benchmarks' report of where each thread's time went. The
engine names its threads (ferry-adam: CPU Adam's workers, ferry-early: the early steps' thread), so
an offloaded step with overlap shows up under those roles, and the trainer's own time under
`trainer`."""
import os
import sys
import threading

import pytest
import torch

import ferry.torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "samples", "python"))
import bench_threads  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="Linux /proc only")


def spin(seconds):
    import time
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_the_main_thread_is_the_trainer_and_its_cpu_time_counts():
    before = bench_threads.snapshot()
    spin(0.05)
    use = bench_threads.use(before, bench_threads.snapshot(), steps=2)
    threads, on_cpu, waiting = use["trainer"]
    assert threads == 1
    assert on_cpu >= 0.05 * 1e3 / 2 * 0.9  # ms per step, 2 steps
    assert waiting >= 0


def test_a_thread_started_between_snapshots_counts_from_zero_and_others_are_other():
    before = bench_threads.snapshot()
    t = threading.Thread(target=lambda: (spin(0.03), done.wait()))
    done = threading.Event()
    t.start()
    while t.is_alive() and not any(r == "other" and v[1] >= 30 for r, v in bench_threads.use(
            before, bench_threads.snapshot(), steps=1).items()):
        pass
    use = bench_threads.use(before, bench_threads.snapshot(), steps=1)
    done.set()
    t.join()
    assert use["other"][1] >= 30 * 0.9


def test_ferry_threads_carry_their_names(device):
    before = set(bench_threads.snapshot())  # threads of engines other tests of this process left
    gen = torch.Generator().manual_seed(3)
    params = [torch.randn(s, generator=gen).to(device).requires_grad_() for s in ((256, 64), (64,), (64, 32))]
    opt = ferry.torch.Optimizer([{"params": params[:2]}, {"params": params[2:]}], lr=1e-3, policy="offload_all",
                                overlap=True, cpu_threads=2)
    try:
        for _ in range(3):
            loss = sum((p.float() ** 2).sum() for p in params)
            loss.backward()
            opt.step()
            opt.zero_grad()
        opt.wait_params()
        now = bench_threads.snapshot()
        mine = {tid: v for tid, v in now.items() if tid not in before or not v[0].startswith("ferry-")}
        names = {name for name, _, _ in mine.values()}
        assert "ferry-adam" in names, names
        assert "ferry-early" in names, names
        line = bench_threads.text(bench_threads.use({}, mine, steps=3))
        assert line.startswith("threads, ms per step: trainer ")
        assert "; ferry-adam x2 " in line, line  # cpu_threads=2: two workers
    finally:
        del opt
