"""`python3 -m ferry trace FILE...` (ferry._ferry.trace_report): the report `ferry trace` prints, for
the pip package's users, of Ferry's own traces and of torch.profiler's traces of the ranks."""
import gc
import json
import os
import random
import subprocess
import sys

import pytest
import torch

import ferry
import ferry.torch


def run_ferry(*args):
    return subprocess.run([sys.executable, "-m", "ferry"] + list(args), capture_output=True, text=True, timeout=300,
                          env=dict(os.environ))


def test_a_trace_of_the_optimizer_gets_its_stages_and_iterations(tmp_path, device):
    path = str(tmp_path / "t.json")
    params = [torch.randn(300, 7, device=device).requires_grad_(), torch.randn(11, device=device).requires_grad_()]
    opt = ferry.torch.Optimizer(params, lr=1e-3, policy="offload_all", trace_path=path)
    steps = 4
    for _ in range(steps):
        opt.zero_grad()
        ((params[0] * torch.randn_like(params[0])).sum() + (params[1] ** 2).sum()).backward()
        opt.step()
    del opt
    gc.collect()  # the engine writes its trace when it is destroyed
    done = run_ferry("trace", path, "--ceiling", "mem=100")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith("trace %s:" % path), out
    assert "step: %d steps" % steps in out, out
    assert "  mem     100.00  given" in out, out
    assert "iterations (from the end of one step to the end of the next, per rank)" in out, out
    assert out == ferry._ferry.trace_report([path], "mem=100")


def profile(rank, world, starts, launch_ends, end):
    """A torch.profiler-shaped trace of one rank: one all-gather kernel per entry of `starts`, each ending
    at `end[i]` (a collective's kernels end together), launched by a call returning at launch_ends[i]."""
    events = []
    for i, (s, l, e) in enumerate(zip(starts, launch_ends, end)):
        events.append({"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather_RING_LL(x)", "pid": 0,
                       "tid": 24, "ts": s, "dur": e - s, "args": {"correlation": i + 1}})
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 7, "tid": 7,
                       "ts": l - 4.0, "dur": 4.0, "args": {"correlation": i + 1}})
    return {"schemaVersion": 1, "distributedInfo": {"rank": rank, "world_size": world}, "traceEvents": events}


def test_torch_profiler_traces_of_the_ranks_name_the_rank_each_collective_waited_for(tmp_path):
    rng = random.Random()
    world, n = 3, 5
    starts = [[1e9 + 10000.0 * i + rng.uniform(0, 3000) for i in range(n)] for _ in range(world)]
    ends = [max(starts[r][i] for r in range(world)) + 200.0 for i in range(n)]
    paths = []
    for r in range(world):
        # the last rank's launch returns 5 us before its kernel starts: its host late
        launches = [starts[r][i] - 5.0 for i in range(n)]
        p = tmp_path / ("prof.rank-%d.json" % r)
        p.write_text(json.dumps(profile(r, world, starts[r], launches, ends)))
        paths.append(str(p))
    report = ferry._ferry.trace_report(paths)
    spreads = sorted((max(starts[r][i] for r in range(world)) - min(starts[r][i] for r in range(world))) / 1e3
                     for i in range(n))
    lasts = [max(range(world), key=lambda r: starts[r][i]) for i in range(n)]
    assert report.startswith("torch.profiler traces of 3 ranks (0, 1, 2 of 3)"), report
    row = next(line for line in report.splitlines() if line.startswith("AllGather "))
    words = row.split()
    assert words[1] == str(n), row
    assert words[2] == "%.2f" % spreads[n // 2], row          # the median of 5
    assert words[6] == "%.2f" % spreads[-1], row              # the largest
    assert row.endswith("%d of %d" % (n, n)), row             # every last rank's host late
    counted = {r: lasts.count(r) for r in sorted(set(lasts))}
    assert ", ".join("%d: %d" % kv for kv in counted.items()) in row, row
    done = run_ferry("trace", *paths)
    assert done.returncode == 0, done.stderr
    assert done.stdout == report


def test_errors_name_the_file_and_the_bad_argument(tmp_path):
    missing = str(tmp_path / "none.json")
    with pytest.raises(ferry.NotFoundError, match="none.json"):
        ferry._ferry.trace_report([missing])
    done = run_ferry("trace", missing)
    assert done.returncode == 1 and "cannot read trace file %s" % missing in done.stderr, done.stderr
    done = run_ferry("trace", missing, "--ceiling", "pcie=3")
    assert done.returncode == 2 and 'KEY one of d2h, h2d, mem, disk and GBPS > 0, got "pcie=3"' in done.stderr, \
        done.stderr
    with pytest.raises(ferry.InvalidArgumentError, match="got \"mem=0\""):
        ferry._ferry.trace_report([missing], "mem=0")
    mine = tmp_path / "ferry.json"
    mine.write_text(json.dumps({"traceEvents": [{"ph": "X", "name": "step", "ts": 0, "dur": 5}]}))
    prof = tmp_path / "prof.json"
    prof.write_text(json.dumps(profile(0, 1, [10.0], [9.0], [20.0])))
    with pytest.raises(ferry.InvalidArgumentError, match="not a torch.profiler trace"):
        ferry._ferry.trace_report([str(prof), str(mine)])
