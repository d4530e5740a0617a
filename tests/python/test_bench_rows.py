"""samples/python/bench_train.py --check-exact: ferry all_gpu, whose losses every exact row is compared
with, runs first whatever --rows picks; a pick with no compared row is refused; a check that compared
nothing fails."""
import argparse
import os
import random
import subprocess
import sys

import pytest

SAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "samples", "python")
sys.path.insert(0, SAMPLES)
import bench_report  # noqa: E402
import bench_train  # noqa: E402

ROWS = bench_train.rows_for(argparse.Namespace(rows=""))
REF = next(i for i, r in enumerate(ROWS) if r["name"] == bench_train.REFERENCE)
COMPARED = [i for i, r in enumerate(ROWS) if r.get("exact") and i != REF]
UNCOMPARED = [i for i, r in enumerate(ROWS) if not r.get("exact")]


def test_the_reference_moves_first_or_joins():
    assert bench_train.with_reference([2, 3], ROWS) == [REF, 2, 3]
    assert bench_train.with_reference([3, REF, 2], ROWS) == [REF, 3, 2]
    assert bench_train.with_reference([REF, 3], ROWS) == [REF, 3]


def test_random_picks_keep_every_row_once_with_the_reference_first():
    rng = random.Random(11)
    for _ in range(200):
        wanted = rng.sample(range(len(ROWS)), rng.randint(1, len(ROWS)))
        if not any(i in COMPARED for i in wanted):
            with pytest.raises(ValueError, match="compares none"):
                bench_train.with_reference(wanted, ROWS)
            continue
        got = bench_train.with_reference(wanted, ROWS)
        assert got[0] == REF
        assert sorted(got) == sorted(set(wanted) | {REF})
        assert [i for i in got if i != REF] == [i for i in wanted if i != REF]  # the user's order otherwise


def test_a_pick_without_a_compared_row_is_refused_on_the_command_line():
    assert UNCOMPARED, "the rows have changed: every row is compared"
    run = subprocess.run([sys.executable, os.path.join(SAMPLES, "bench_train.py"), "--device", "cpu", "--size", "tiny",
                          "--check-exact", "--rows", ",".join(map(str, UNCOMPARED))],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "compares none of them with ferry all_gpu" in run.stderr
    run = subprocess.run([sys.executable, os.path.join(SAMPLES, "bench_train.py"), "--device", "cpu", "--size", "tiny",
                          "--rows", "1,%d" % len(ROWS)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "rows are 0 to %d" % (len(ROWS) - 1) in run.stderr


def result(name, losses, exact=True):
    import torch
    return ({"name": name, "exact": exact}, 0.1, torch.tensor(losses, dtype=torch.float64), None)


def test_check_losses_fails_when_nothing_was_compared():
    assert bench_report.check_losses([result("ferry all_gpu", [1.0, 2.0]), result("ferry offload", [1.0, 2.0])])
    assert not bench_report.check_losses([result("ferry all_gpu", [1.0, 2.0]),
                                          result("ferry offload", [1.0, 2.0 + 2 ** -40])])
    assert not bench_report.check_losses([result("ferry offload", [1.0, 2.0]),
                                          result("ferry offload + overlap", [1.0, 2.0])])  # no reference
    assert not bench_report.check_losses([result("ferry all_gpu", [1.0, 2.0]),
                                          result("ferry offload bf16", [1.0, 2.0], exact=False)])
