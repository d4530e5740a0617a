"""samples/python/bench_report.py: the spread between groupings run alternated (bench_train.py
--groups a,b,...) and a row's CPU note, on made-up results whose answers are known."""
import os
import re
import sys
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "samples", "python"))
import bench_report  # noqa: E402


def result(name, iteration, alone=None):
    row = {"name": name}
    if alone is not None:
        row["alone"] = alone
    return (row, iteration, None, None)


def printed(monkeypatch):
    """The lines bench_report prints from here on."""
    lines = []
    monkeypatch.setattr(bench_report, "print", lambda *a, **k: lines.append(" ".join(str(x) for x in a)),
                        raising=False)
    return lines


def test_spread_takes_each_groupings_median_and_the_larger_bound(monkeypatch):
    loops = [types.SimpleNamespace(groups="one"), types.SimpleNamespace(groups="decay")]
    # Three rounds each: the medians are 0.140 (one) and 0.147 (decay) whatever the order, and the
    # overlap row's ratio is to the larger of the round's all_gpu and its step alone.
    per_round = {
        "one": [[result("ferry all_gpu", 0.130), result("ferry offload + overlap", 0.140, alone=0.120)],
                [result("ferry all_gpu", 0.135), result("ferry offload + overlap", 0.150, alone=0.150)],
                [result("ferry all_gpu", 0.132), result("ferry offload + overlap", 0.139, alone=0.110)]],
        "decay": [[result("ferry all_gpu", 0.131), result("ferry offload + overlap", 0.147, alone=0.140)],
                  [result("ferry all_gpu", 0.134), result("ferry offload + overlap", 0.160, alone=0.125)],
                  [result("ferry all_gpu", 0.133), result("ferry offload + overlap", 0.145, alone=None)]],
    }
    lines = printed(monkeypatch)
    bench_report.print_spread(per_round, loops)
    assert "over 3 rounds" in lines[0]
    overlap = next(line for line in lines if "ferry offload + overlap" in line)
    assert "one 140.0 ms" in overlap and "decay 147.0 ms" in overlap
    # one: 0.140/0.130, 0.150/0.150, 0.139/0.132 -> median 1.053; decay: 0.147/0.140, 0.160/0.134 (the
    # third round has no step alone) -> median of two 1.122.
    ratios = [float(x) for x in re.findall(r"\(([0-9.]+)x the larger", overlap)]
    assert ratios == [round(sorted([0.140 / 0.130, 0.150 / 0.150, 0.139 / 0.132])[1], 2),
                      round((0.147 / 0.140 + 0.160 / 0.134) / 2, 2)]
    spread = float(re.search(r"spread ([0-9.]+)%", overlap).group(1))
    assert abs(spread - 100 * (0.147 / 0.140 - 1)) < 0.05
    base = next(line for line in lines if "ferry all_gpu" in line)
    assert "the larger" not in base  # no step alone: no ratio
    assert abs(float(re.search(r"spread ([0-9.]+)%", base).group(1)) - 100 * (0.133 / 0.132 - 1)) < 0.05


def test_a_grouping_without_the_row_leaves_it_out(monkeypatch):
    loops = [types.SimpleNamespace(groups="one"), types.SimpleNamespace(groups="block")]
    per_round = {"one": [[result("ferry offload", 0.2)]], "block": [[result("ferry offload", None)]]}
    lines = printed(monkeypatch)
    bench_report.print_spread(per_round, loops)
    assert len(lines) == 1  # the header only: a row skipped in one grouping has no spread


def test_cpu_note_gives_the_iteration_less_cpu_adam():
    cpu = {"ms": 121.8, "gbs": 41.7, "workers": 13, "huge": 1.0, "spare": 0.69, "kept": 140, "recomputed": 0,
           "skipped": 0}
    text = bench_report.cpu_text(cpu, "rank 0", 0.1707)
    assert "CPU Adam 121.8 ms/step at 41.7 GB/s on 13 workers (the iteration less it: 48.9 ms)" in text
    assert text.endswith(", rank 0]")
    assert "the iteration less it" not in bench_report.cpu_text(cpu)
    assert bench_report.cpu_text(None, "rank 0", 0.17) == ""


def test_spread_gives_the_groupings_idle_cpu_apart(monkeypatch):
    """An overlapped row's iteration less CPU Adam per grouping (each grouping's median), and how far
    apart those lie: the host's drift moves CPU Adam's time, not this."""
    loops = [types.SimpleNamespace(groups="one"), types.SimpleNamespace(groups="block")]

    def overlapped(iteration, cpu_ms):
        row, it, losses, why = result("ferry offload + overlap", iteration, alone=0.13)
        row.update(overlap=True, cpu={"ms": cpu_ms})
        return (row, it, losses, why)

    # one: idles 17.0, 19.0, 18.5 -> median 18.5; block: 21.0, 20.0, 30.0 -> median 21.0 (the CPU time
    # drifting from 120 to 150 ms between rounds moves the iteration, not the idle).
    per_round = {
        "one": [[overlapped(0.137, 120.0)], [overlapped(0.169, 150.0)], [overlapped(0.1485, 130.0)]],
        "block": [[overlapped(0.141, 120.0)], [overlapped(0.170, 150.0)], [overlapped(0.160, 130.0)]],
    }
    lines = printed(monkeypatch)
    bench_report.print_spread(per_round, loops)
    idle = next(line for line in lines if "the iteration less CPU Adam" in line)
    assert "one 18.5 ms" in idle and "block 21.0 ms" in idle
    assert "2.5 ms apart" in idle
    # the share is of the median of the groupings' median iterations: (148.5 + 160.0) / 2
    share = float(re.search(r"\(([0-9.]+)% of the iteration\)", idle).group(1))
    assert abs(share - 100 * 2.5 / ((148.5 + 160.0) / 2)) < 0.05
    # a row without the CPU update (no overlap) has no such line
    per_round = {"one": [[result("ferry offload", 0.2)]], "block": [[result("ferry offload", 0.21)]]}
    lines = printed(monkeypatch)
    bench_report.print_spread(per_round, loops)
    assert not any("the iteration less CPU Adam" in line for line in lines)
