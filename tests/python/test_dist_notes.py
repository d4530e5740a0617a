"""ferry.distributed's notes in the store (arrival counts, abort notes) kept off the caller's thread:
after a rank's first arrival on a channel, its arrivals are counted in the process and posted in order
by the notes' own thread; the abort count that check_aborts looks at before a launch is read by that
thread. One process, a store of torch's own (no process group)."""
import random
import threading
import time

import pytest
import torch.distributed as dist

from ferry import distributed as fdist


class CountingStore(dist.Store):
    """A HashStore that records which thread made each add."""

    def __init__(self):
        super().__init__()
        self.inner = dist.HashStore()
        self.adds = []
        self.lock = threading.Lock()

    def add(self, key, n):
        with self.lock:
            self.adds.append((threading.current_thread().name, key, n))
        return self.inner.add(key, n)

    def set(self, key, value):
        self.inner.set(key, value)

    def get(self, key):
        return self.inner.get(key)


def caller_adds(store, key_part):
    return [a for a in store.adds if a[0] != "ferry-notes" and key_part in a[1]]


def wait_until(cond, limit_s=10.0):
    end = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < end, "not within %.0f s" % limit_s
        time.sleep(0.01)


def test_arrivals_count_from_the_stores_value_and_reach_it_in_order():
    store = CountingStore()
    base = random.randint(1, 50)
    dist.PrefixStore("ferry/0/", store).add("m/seq/1", base)  # an earlier user of the same keys
    notes = fdist._Notes(store, "ferry/0/", 1, 3)
    before = len(caller_adds(store, "m/seq/"))
    n = random.randint(20, 60)
    got = [notes.arrive("m") for _ in range(n)]
    assert got == list(range(base + 1, base + n + 1))
    assert len(caller_adds(store, "m/seq/")) == before + 1  # the first only: the rest went by the notes' thread
    assert notes.positions("m") == [0, base + n, 0]  # positions() posts this rank's own first


def test_two_threads_arriving_on_their_own_channels():
    store = CountingStore()
    notes = fdist._Notes(store, "ferry/0/", 0, 2)
    counts = {"m": random.randint(50, 150), "md": random.randint(50, 150)}
    out = {}

    def run(channel):
        out[channel] = [notes.arrive(channel) for _ in range(counts[channel])]

    threads = [threading.Thread(target=run, args=(c,)) for c in counts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for channel, n in counts.items():
        assert out[channel] == list(range(1, n + 1))
        assert notes.positions(channel)[0] == n


def test_an_abort_is_seen_without_a_store_read_on_the_callers_thread():
    store = CountingStore()
    mine = fdist._Notes(store, "ferry/0/", 0, 2)
    theirs = fdist._Notes(store, "ferry/0/", 1, 2)
    assert not mine.none_aborted()  # not read yet: the caller reads the store itself
    mine.arrive("m")  # starts the notes' thread
    wait_until(mine.none_aborted)
    before = len(caller_adds(store, "aborts"))
    for _ in range(20):
        assert mine.none_aborted()
    assert len(caller_adds(store, "aborts")) == before
    theirs.abort("injected failure on rank 1")
    wait_until(lambda: not mine.none_aborted())
    assert mine.aborted() == [(1, "injected failure on rank 1")]


def test_a_ranks_own_abort_is_seen_at_once():
    store = CountingStore()
    notes = fdist._Notes(store, "ferry/0/", 0, 2)
    notes.arrive("m")
    wait_until(notes.none_aborted)
    notes.abort("this rank failed")
    assert not notes.none_aborted()


def test_store_async_off_keeps_every_note_on_the_callers_thread(monkeypatch):
    monkeypatch.setenv("FERRY_STORE_ASYNC", "0")
    store = CountingStore()
    notes = fdist._Notes(store, "ferry/0/", 0, 2)
    n = random.randint(5, 20)
    assert [notes.arrive("m") for _ in range(n)] == list(range(1, n + 1))
    assert len(caller_adds(store, "m/seq/")) == n
    assert not notes.none_aborted()


@pytest.mark.parametrize("fail_after", [0, 3])
def test_a_store_that_fails_stops_the_posting_and_the_cached_answer(fail_after):
    store = CountingStore()
    notes = fdist._Notes(store, "ferry/0/", 0, 2)
    notes.arrive("m")
    wait_until(notes.none_aborted)
    left = [fail_after]

    def failing(key, n):
        if threading.current_thread().name == "ferry-notes":
            if left[0] == 0:
                raise RuntimeError("store gone")
            left[0] -= 1
        return dist.HashStore.add(store.inner, key, n)

    store.add = failing
    for _ in range(fail_after + 5):
        notes.arrive("m")
    wait_until(lambda: not notes.none_aborted())
    notes.flush(1.0)  # returns: nothing is left waiting for a thread that stopped


def test_at_exit_the_thread_posts_what_was_counted_and_ends():
    store = CountingStore()
    notes = fdist._Notes(store, "ferry/0/", 0, 2)
    n = random.randint(10, 40)
    for _ in range(n):
        notes.arrive("m")
    poster = notes._poster
    fdist._stop_posters()  # what the atexit hook runs, before the interpreter finalizes
    assert not poster.thread.is_alive()
    assert poster not in fdist._posters
    assert dist.PrefixStore("ferry/0/", store).add("m/seq/0", 0) == n
    before = len(caller_adds(store, "m/seq/"))
    assert notes.arrive("m") == n + 1  # after it: on the caller's thread
    assert len(caller_adds(store, "m/seq/")) == before + 1
    assert not notes.none_aborted()


def test_the_thread_ends_with_its_notes():
    import gc
    store = CountingStore()
    notes = fdist._Notes(store, "ferry/0/", 0, 2)
    notes.arrive("m")
    notes.arrive("m")
    poster = notes._poster
    del notes
    gc.collect()
    poster.thread.join(5.0)
    assert not poster.thread.is_alive()
    assert poster not in fdist._posters
    assert dist.PrefixStore("ferry/0/", store).add("m/seq/0", 0) == 2
