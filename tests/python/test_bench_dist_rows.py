"""samples/python/bench_train_dist.py --check-exact: an overlap row's mate without overlap runs
before it when --rows left it out or put it after (else nothing would be compared); every row once."""
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "samples", "python"))
import bench_train_dist  # noqa: E402


def names(rows):
    return [r["name"] for r in rows]


def test_a_mate_put_after_its_row_moves_before_it():
    rows = bench_train_dist.ROWS
    overlap = next(r for r in rows if r.get("same_as"))
    mate = next(r for r in rows if r["name"] == overlap["same_as"])
    assert names(bench_train_dist.with_exact_mates([overlap, mate], rank=1)) == [mate["name"], overlap["name"]]
    assert names(bench_train_dist.with_exact_mates([overlap], rank=1)) == [mate["name"], overlap["name"]]


def test_every_compared_row_has_its_mate_before_it():
    rows = bench_train_dist.ROWS
    rng = random.Random(7)
    for _ in range(50):
        picked = rng.sample(rows, rng.randint(1, len(rows)))
        got = bench_train_dist.with_exact_mates(picked, rank=1)
        assert sorted(names(r for r in got if r in picked)) == sorted(names(picked))  # each picked row
        seen = []
        for r in got:
            mate = r.get("same_as")
            if mate:
                assert mate in seen, "%s compared with %s, not run before it" % (r["name"], mate)
            seen.append(r["name"])
        assert len(set(seen)) == len(seen), "a row run twice: %s" % seen
        added = [r for r in got if r not in picked]
        assert all(any(p.get("same_as") == a["name"] for p in picked) for a in added)


def test_nothing_added_when_the_mates_are_there():
    rows = bench_train_dist.ROWS
    assert names(bench_train_dist.with_exact_mates(list(rows), rank=1)) == names(rows)
    mated = [r for r in rows if r.get("same_as")]
    assert mated, "the rows compare overlap with its mate"
