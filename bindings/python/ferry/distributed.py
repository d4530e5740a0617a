"""ferry.distributed: the engine's collectives over torch.distributed.

The C++ engine coordinates its ranks through a few small collectives (the Finalize exchange of the
param specs, one all-reduce per step for the global grad check and clip, the checkpoint protocol).
``TorchComm`` runs them on a torch.distributed **gloo** group of its own, beside the trainer's groups
(NCCL or gloo): ``ferry.Engine(comm=TorchComm(...), rank=, world_size=)`` maps its methods onto the
engine's callback comm (ferry::MakeCallbackComm).

Why a group of its own: the engine calls these collectives from inside step() and checkpoint calls,
interleaved with nothing of the trainer's, but torch.distributed collectives are not safe from two
threads on one group, and asynchronous checkpoint saves run their exchange from the engine's writer
thread. So ``make_comm`` creates two gloo groups over the same ranks: one for the thread that drives the
optimizer and one that ``duplicate()`` hands to the engine's writer thread. gloo because the payloads
are a few host bytes and gloo's ops can be polled from the host. One exception: where the optimizer's
params are CUDA tensors on an NCCL group, the step's gradient-check all-reduce runs on that group, on
the GPU (``reduce_on``): on a host whose cores run the offloaded update, gloo's ring of host threads
took 10-14 ms a step on 4 GPUs. Its wait is polled like any other.

Nothing hangs, and failures are named. Every collective is started asynchronously and polled until
its deadline (the engine passes the time left); meanwhile the store of the default group (a
TCPStore or FileStore, under the prefix ``ferry/<n>/``) carries two things:
  * an arrival count per rank (one ``add`` per collective, made by the notes' own thread after a
    rank's first on a channel, so that no round trip sits in the step; see ``_Notes``): a rank that never arrives is named in the
    TimeoutError the others raise ("rank 2 of 4 did not arrive"); the engine reports it as
    DeadlineExceeded (ferry.DeadlineExceededError);
  * abort notes: a rank that raises inside the optimizer (ferry.torch.Optimizer calls ``abort``)
    leaves its exception's text there, and every other rank's pending or later collective raises
    naming that rank and its error (ferry.FerryError) instead of waiting for the timeout;
  * each rank's process (host, pid, start time): a rank killed outright (SIGKILL, the OOM killer)
    leaves no note, and gloo's error for the closed connection names only an address, so a failed
    or timed-out collective looks up the processes of the ranks on its own host and names the ones
    that are gone ("rank 2 of 4 is gone: its process 1234 on host h exited or was killed"); a wait
    also looks them up every quarter second, since an NCCL collective does not fail when a peer dies.
After a failure the engine considers the comm unusable (its later calls fail at once), as in C++.
"""
import atexit
import collections
import contextlib
import datetime
import itertools
import os
import socket
import threading
import time
import weakref

import torch
import torch.distributed as dist

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_instances = itertools.count()
# The longest sleep between two looks at a collective that has not completed: a rank that arrived
# early returns at most this long after the last one (5 ms before: 1.7 ms median, 5.2 ms p90 on a
# two-rank gloo all-reduce with the other rank 0-12 ms late; 0.2 ms costs a thread a few thousand
# wake-ups a second while it waits).
_MAX_PAUSE_S = 2e-4
# How often a wait looks up the processes of the other ranks on this host (a few store reads).
_LOST_EVERY_S = 0.25
# How long a wait that found a peer's process gone still looks for its own collective to complete.
_LOST_GRACE_S = 0.2
# How often the notes' thread reads the store's abort count (check_aborts before a launch uses it).
_ABORTS_EVERY_S = 0.05
_store_lock = threading.Lock()  # store clients are used from the trainer's thread and the writer thread


def _global_rank(group, group_rank):
    if group is None or group is dist.group.WORLD:
        return group_rank
    fn = getattr(dist, "get_global_rank", None) or dist.distributed_c10d._get_global_rank
    return fn(group, group_rank)


def group_ranks(group):
    """The global ranks of `group` in group-rank order (WORLD or None: every rank)."""
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return [_global_rank(group, r) for r in range(dist.get_world_size(group))]


class _Poster:
    """The thread of one _Notes: adds the arrivals counted in the process to the store, in order, and
    reads the store's abort count every _ABORTS_EVERY_S. Holds no reference to its _Notes: it stops
    once that is gone (weakref.finalize), and at exit (a daemon thread still inside a store call when
    the interpreter finalizes aborts the process). A store that fails (gone with a failure) ends it:
    the counts are only read for the messages of a failed or timed-out collective."""

    def __init__(self, store):
        self._store = store
        self.cv = threading.Condition()
        self.posts = []       # arrival keys counted, not yet in the store
        self.queued = 0       # posts handed over so far
        self.posted = 0       # of those, the ones added to the store (or given up on)
        self.aborts = None    # the store's abort count as last read (None: not read yet, or stale)
        self.running = True   # False once stopped or failed: callers read the store themselves
        self.thread = threading.Thread(target=self._run, name="ferry-notes", daemon=True)
        self.thread.start()
        _posters.add(self)

    def post(self, key):
        with self.cv:
            if not self.running:
                return False
            self.posts.append(key)
            self.queued += 1
            self.cv.notify_all()
            return True

    def _run(self):
        next_read = 0.0
        while True:
            with self.cv:
                if not self.posts and self.running:
                    self.cv.wait(max(0.0, next_read - time.monotonic()))
                batch, self.posts = self.posts, []
                stopping = not self.running
            try:
                for key, n in collections.Counter(batch).items():
                    _store_add(self._store, key, n)
                if not stopping and time.monotonic() >= next_read:
                    self.aborts = _store_add(self._store, "aborts", 0)
                    next_read = time.monotonic() + _ABORTS_EVERY_S
            except Exception:  # noqa: BLE001 -- the store is gone: callers read it themselves
                stopping = True
            with self.cv:
                self.posted += len(batch)
                if stopping:
                    self.running = False
                    self.aborts = None
                    self.posted = self.queued
                self.cv.notify_all()
            if stopping:
                _posters.discard(self)
                return

    def flush(self, timeout_s):
        with self.cv:
            self.cv.wait_for(lambda: self.posted >= self.queued, timeout_s)

    def stop(self, join_s=0.0):
        with self.cv:
            self.running = False
            self.aborts = None
            self.cv.notify_all()
        if join_s > 0 and self.thread is not threading.current_thread():
            self.thread.join(join_s)


def _store_add(store, key, n):
    with _store_lock:
        return int(store.add(key, n))


_posters = set()  # the running _Posters (the atexit hook stops them)


@atexit.register
def _stop_posters():
    for poster in list(_posters):
        poster.stop(join_s=2.0)


def _default_store():
    return dist.distributed_c10d._get_default_store()


class _Notes:
    """The store under one comm's prefix: arrival counts and abort notes (shared by a comm and its
    duplicate, so an abort reaches the writer thread's exchange as well).

    Off the step's path: a store round trip took 1.1-1.6 ms on a 4-GPU host whose cores ran the
    offloaded update (cProfile of the trainer: 4 a ZeRO-1 step, each between the backward's end and
    the next forward). So a rank's arrivals after its first on a channel are counted here and posted in
    order by a _Poster, which also reads the abort count for check_aborts' look before a launch (a
    wait still reads the store itself). FERRY_STORE_ASYNC=0: every note a store round trip on the
    caller's thread, as before."""

    def __init__(self, store, prefix, rank, world_size):
        self.store = dist.PrefixStore(prefix, store)
        self.rank = rank
        self.world_size = world_size
        self._async = os.environ.get("FERRY_STORE_ASYNC", "1") != "0"
        self._lock = threading.Lock()
        self._seq = {}  # arrival key -> this rank's count (the store's own at the first arrival)
        self._poster = None
        self._aborted_here = False
        me = _process_identity(os.getpid())
        if me is not None:
            with _store_lock:
                self.store.set("proc/%d" % rank, " ".join(map(str, me)))
            self._add("proc-set/%d" % rank, 1)

    def _add(self, key, n):
        return _store_add(self.store, key, n)

    def arrive(self, channel):
        """This rank's arrival number at the next collective of `channel` (1, 2, ...)."""
        key = "%s/seq/%d" % (channel, self.rank)
        if not self._async:
            return self._add(key, 1)
        with self._lock:
            n = self._seq.get(key)
            if n is not None and self._poster is not None and self._poster.post(key):
                self._seq[key] = n + 1
                return n + 1
            n = self._seq[key] = self._add(key, 1)  # the first: the store's count, whatever was left there
            if self._poster is None:
                self._poster = _Poster(self.store)
                weakref.finalize(self, self._poster.stop)
            return n

    def flush(self, timeout_s=1.0):
        """Waits (up to timeout_s) until the arrivals counted so far are in the store."""
        if self._poster is not None:
            self._poster.flush(timeout_s)

    def none_aborted(self):
        """True when the abort count last read by the poster is 0 (at most _ABORTS_EVERY_S old); False
        when some rank aborted, or it is not known (the caller then reads the store itself)."""
        return self._poster is not None and self._poster.aborts == 0 and not self._aborted_here

    def positions(self, channel):
        self.flush()  # this rank's own arrivals, counted but not yet posted
        return [self._add("%s/seq/%d" % (channel, r), 0) for r in range(self.world_size)]

    def abort(self, message):
        with _store_lock:
            self.store.set("abort/%d" % self.rank, message.encode("utf-8", "replace"))
        self._add("aborted/%d" % self.rank, 1)
        self._add("aborts", 1)
        self._aborted_here = True  # this rank's own check_aborts reads the store from now on

    def aborted(self):
        """[(rank, message)] of the ranks that aborted, this one included (its writer thread stops
        too); one store round trip when none did."""
        if self._add("aborts", 0) == 0:
            return []
        out = []
        for r in range(self.world_size):
            if self._add("aborted/%d" % r, 0) > 0:
                with _store_lock:
                    out.append((r, self.store.get("abort/%d" % r).decode("utf-8", "replace")))
        return out


    def lost(self):
        """[(rank, text)] of the other ranks on this host whose process is gone (exited, killed, a
        zombie, or its pid taken by another process); ranks on other hosts are not looked up."""
        host = socket.gethostname()
        out = []
        for r in range(self.world_size):
            if r == self.rank or self._add("proc-set/%d" % r, 0) == 0:
                continue
            with _store_lock:
                their_host, pid, start = self.store.get("proc/%d" % r).decode("utf-8", "replace").split(" ")
            if their_host == host and _process_identity(int(pid)) != (their_host, int(pid), int(start)):
                out.append((r, "rank %d of %d is gone: its process %s on host %s exited or was killed"
                               % (r, self.world_size, pid, host)))
        return out


def _process_identity(pid):
    """(host, pid, start time in clock ticks since boot) of a live process (not a zombie), or None."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in ("Z", "X", "x"):  # state: a zombie or dead
        return None
    return (socket.gethostname(), pid, int(fields[19]))  # field 22 of stat: starttime


class TorchComm:
    """The engine's comm over one gloo group (see the module's documentation). One thread at a time;
    ``duplicate()`` gives the second thread its own group. Build it with ``make_comm``."""

    def __init__(self, group, notes, channel, dup_group=None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._notes = notes
        self._channel = channel
        self._dup_group = dup_group
        self._reduce_group, self._reduce_device = group, None

    def reduce_on(self, group, device):
        """Runs this comm's all-reduces (the step's gradient check: a few doubles holding integers, so
        the sum is exact in any order) on `group` with tensors on `device`: the trainer's NCCL group
        and its GPU, where gloo's ring of host threads waits for CPUs the offloaded update keeps busy.
        The same ranks in the same rank order as this comm's group. Only for the comm of the
        optimizer's thread (the trainer's group takes collectives from that thread only); the deadline
        and abort rules stay, and a rank whose process is gone is named while the wait polls.
        FERRY_COMM_DEVICE_REDUCE=0 keeps them on gloo."""
        if os.environ.get("FERRY_COMM_DEVICE_REDUCE", "1") == "0":
            return
        if group_ranks(group) != group_ranks(self.group):
            raise ValueError("reduce_on: the group holds ranks %s, this comm's group %s"
                             % (group_ranks(group), group_ranks(self.group)))
        self._reduce_group, self._reduce_device = group, device

    @property
    def reduces_on(self):
        """Where all_reduce runs: "gloo" or the device its tensors are on."""
        return "gloo" if self._reduce_device is None else str(self._reduce_device)

    # ---- the callbacks the engine calls (ferry._ferry's CommCallbacks) -------------------------------

    def all_reduce(self, values, op, timeout_s):
        group = self._reduce_group
        t = torch.tensor(values, dtype=torch.float64, device=self._reduce_device)
        self._run("all_reduce of %d values (%s)" % (len(values), op),
                  lambda: dist.all_reduce(t, op=_REDUCE_OPS[op], group=group, async_op=True), timeout_s)
        return t.tolist()  # on a device: after work.wait() ordered the current stream behind it

    def all_gather(self, mine, timeout_s):
        n = len(mine)
        src = torch.frombuffer(bytearray(mine), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
        out = torch.empty(n * self.world_size, dtype=torch.uint8)
        outs = list(out.split(n)) if n else [torch.empty(0, dtype=torch.uint8) for _ in range(self.world_size)]
        self._run("all_gather of %d bytes" % n,
                  lambda: dist.all_gather(outs, src, group=self.group, async_op=True), timeout_s)
        return out.numpy().tobytes()

    def broadcast(self, data, root, timeout_s):
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        if t.numel():
            self._run("broadcast of %d bytes from rank %d" % (t.numel(), root),
                      lambda: dist.broadcast(t, src=_global_rank(self.group, root), group=self.group,
                                             async_op=True), timeout_s)
        return t.numpy().tobytes()

    def barrier(self, timeout_s):
        t = torch.ones(1, dtype=torch.float64)
        self._run("barrier", lambda: dist.all_reduce(t, group=self.group, async_op=True), timeout_s)

    def duplicate(self, timeout_s):
        if self._dup_group is None:
            raise NotImplementedError("this TorchComm has no duplicate group (make_comm creates one)")
        return TorchComm(self._dup_group, self._notes, self._channel + "d")

    # ---- failures -------------------------------------------------------------------------------

    def abort(self, message):
        """Tells the other ranks that this rank failed (their collectives raise naming it)."""
        try:
            self._notes.abort(message)
        except Exception:  # noqa: BLE001 -- the store may be gone with the failure; the timeout remains
            pass

    def check_aborts(self, fresh=True):
        """RuntimeError naming the ranks that aborted, if any; first the ranks that are gone (a rank
        killed outright leaves no note: the ranks that saw its loss first abort naming it, and their
        notes then lead the others to it). fresh=False (before a launch): the abort count the notes'
        thread read at most _ABORTS_EVERY_S ago may answer, without a store round trip; a launch
        that an abort this recent would have stopped is caught by its wait, which reads the store."""
        if not fresh and self._notes.none_aborted():
            return
        aborted = self._notes.aborted()
        if aborted:
            try:
                gone = [g for _, g in self._notes.lost()]
            except Exception:  # noqa: BLE001 -- the store may be gone with the failure
                gone = []
            raise RuntimeError("; ".join(gone + [("this rank (%d of %d) failed earlier: %s" if r == self.rank else
                                                  "rank %d of %d failed: %s") % (r, self.world_size, m)
                                                 for r, m in aborted]))

    def _late(self, mine, channel):
        """Which ranks did not arrive at this comm's collective #mine, and which are gone."""
        pos = self._notes.positions(channel)
        late = [r for r, p in enumerate(pos) if p < mine]
        if not late:
            text = "every rank arrived (collective #%d)" % mine
        else:
            text = "%s of %d did not arrive at collective #%d (%s)" % (
                ("rank %d" % late[0]) if len(late) == 1 else "ranks " + ", ".join(map(str, late)), self.world_size,
                mine, ", ".join("rank %d at #%d" % (r, pos[r]) for r in late))
        gone = self._gone()
        return "; ".join([g for _, g in gone] + [text])

    def _raise_if_lost(self, what, work, mine, channel):
        try:
            gone = self._notes.lost()
        except Exception:  # noqa: BLE001 -- the store may be gone with the failure: the deadline remains
            return
        if gone:
            # A peer that did its part and then exited (its work is done before ours is marked so):
            # give this rank's work a moment to complete before calling the peer lost.
            end = time.monotonic() + _LOST_GRACE_S
            while time.monotonic() < end:
                if work.is_completed():
                    return
                time.sleep(0.005)
            self.check_aborts()  # a rank that failed and said why is named first
            raise RuntimeError("torch.distributed %s failed on rank %d of %d: %s%s"
                               % (what, self.rank, self.world_size, self._late(mine, channel), _SEE_GUIDE))

    def _gone(self):
        """The lost ranks' texts. A connection closed by a killed peer can be seen a moment before its
        process is reaped or turns zombie: look again for up to a second when none is found."""
        try:
            end = time.monotonic() + 1.0
            while True:
                gone = self._notes.lost()
                if gone or time.monotonic() >= end:
                    return gone
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 -- the store may be gone with the failure: name no one
            return []

    def run(self, what, launch, timeout_s, channel="g"):
        """Runs `launch()` (a torch.distributed call with async_op=True, on any group of these ranks)
        under this comm's deadline and abort rules; `channel` keeps its arrival count apart from the
        engine's collectives. For the optimizer's own bulk collectives (ZeRO-1's all-gather). Raises what the engine would:
        ferry.DeadlineExceededError (a rank did not arrive), ferry.FerryError (a rank failed)."""
        with _as_ferry_errors():
            self._run(what, launch, timeout_s, channel)

    def arrive(self, channel):
        """Counts this rank's arrival at the next collective of `channel` (for finish()'s message)."""
        return self._notes.arrive(channel)

    def finish(self, what, works, arrival, timeout_s, channel):
        """Waits on the host for `works` (launched after arrive(channel) returned `arrival`) under
        run()'s deadline and abort rules, and raises what it would."""
        with _as_ferry_errors():
            start = time.monotonic()
            for work in works:
                self._wait(what, work, arrival, channel, start + max(float(timeout_s), 0.0), timeout_s)

    def _run(self, what, launch, timeout_s, channel=None):
        channel = channel or self._channel
        self.check_aborts(fresh=False)
        mine = self._notes.arrive(channel)
        work = launch()
        self._wait(what, work, mine, channel, time.monotonic() + max(float(timeout_s), 0.0), timeout_s)

    def _wait(self, what, work, mine, channel, deadline, timeout_s):
        start = time.monotonic()
        pause, next_check, next_lost = 2e-5, start + 0.05, start + _LOST_EVERY_S
        while not work.is_completed():
            now = time.monotonic()
            if now >= next_check:
                self.check_aborts()
                next_check = now + 0.1
            if now >= next_lost:
                # A collective on the GPU (NCCL) never fails when a peer dies: it waits. Ranks on
                # this host whose process is gone are named now, not at the deadline.
                self._raise_if_lost(what, work, mine, channel)
                next_lost = now + _LOST_EVERY_S
            if now >= deadline:
                raise TimeoutError("torch.distributed %s timed out after %.1f s on rank %d of %d: %s%s"
                                   % (what, timeout_s, self.rank, self.world_size, self._late(mine, channel),
                                      _SEE_GUIDE))
            time.sleep(pause)
            pause = min(pause * 2, _MAX_PAUSE_S)
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001 -- gloo's error, with the ranks named
            self.check_aborts()
            raise RuntimeError("torch.distributed %s failed on rank %d of %d: %s; %s%s"
                               % (what, self.rank, self.world_size, e, self._late(mine, channel), _SEE_GUIDE)) from e


@contextlib.contextmanager
def _as_ferry_errors():
    """TimeoutError -> ferry.DeadlineExceededError, RuntimeError -> ferry.FerryError (what the engine raises)."""
    import ferry
    try:
        yield
    except TimeoutError as e:
        err = ferry.DeadlineExceededError(str(e))
        err.code = "DEADLINE_EXCEEDED"
        raise err from e
    except RuntimeError as e:
        err = ferry.FerryError(str(e))
        err.code = "UNAVAILABLE"
        raise err from e


# The end of the messages of a collective that timed out or lost a rank: the guide's section.
_SEE_GUIDE = " (see engine/TROUBLESHOOTING.md#a-rank-timed-out-or-was-lost)"


def make_comm(process_group=None, timeout_s=300.0, store=None):
    """A TorchComm over the ranks of `process_group` (None: every rank), on two new gloo groups (the
    second for the engine's writer thread). Collective over the whole world: every rank calls it in
    the same order (torch.distributed.new_group's rule), also ranks outside `process_group`, which get
    None. `store`: where arrivals and aborts are noted (default: the default group's store)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ferry: a process group needs torch.distributed initialised "
                           "(torch.distributed.init_process_group)")
    ranks = group_ranks(process_group)
    timeout = datetime.timedelta(seconds=max(float(timeout_s), 1.0) + 5.0)
    n = next(_instances)
    main = dist.new_group(ranks=ranks, timeout=timeout, backend="gloo")
    dup = dist.new_group(ranks=ranks, timeout=timeout, backend="gloo")
    if dist.get_rank() not in ranks:
        return None
    notes = _Notes(store if store is not None else _default_store(), "ferry/%d/" % n, ranks.index(dist.get_rank()),
                   len(ranks))
    return TorchComm(main, notes, "m", dup)
