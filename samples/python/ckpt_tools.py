"""Helpers of the checkpoint samples (ckpt_reshard.py, kill_rank.py): a toy model given as a list of
tensors, world-size-independent checksums of an optimizer's full state, and the disk's ceiling.

Checksums. `state_sums(opt)` gives, for every param and every state kind (the param itself, its fp32
master, exp_avg, exp_avg_sq), three sums over the elements of the whole (global, flattened) tensor:
the sum of each element's bits, and the sums of the low and high 16 bits times two weights that
depend on the element's global index. Each rank sums only the elements of its own range (ZeRO-1's
range of a replicated param, a DTensor's local rows), the ranks' sums are all-gathered and added, so
the result does not depend on how the state is sharded: a checkpoint saved on 4 ranks and loaded on
2 or 1 gives the same sums only if every element came back to its place with the same bits. No
arithmetic overflows (16-bit halves times 20-bit weights, summed in pieces of 2^24 elements), so it
is exact integer arithmetic on any device.

The disk's ceiling. `write_ceiling` writes plain files of given sizes from W processes at once
(buffered writes of 16 MiB, then fsync), the way a rank file is written; `read_ceiling` reads them
back from R processes, each with a few threads, with O_DIRECT (the page cache bypassed, as the
engine's reader does) or, where the file system refuses O_DIRECT, buffered after
posix_fadvise(DONTNEED) evicted the files' clean pages.
"""
import json
import mmap
import os
import threading
import time

import torch
import torch.distributed as dist

PIECE = 1 << 24  # elements summed at once (keeps every partial sum below 2^63)
IO_BLOCK = 16 << 20  # bytes per write or read call of the ceiling
KINDS = ("param", "master", "exp_avg", "exp_avg_sq")


# ---- the model: a list of tensors ---------------------------------------------------------------

def make_params(hidden, layers, device, dtype, seed):
    """[(name, tensor, group index)]: per layer the weights of an MLP block (dtype) and its biases and
    norm (fp32), then a final norm; group 0 the weights (decayed), group 1 the rest. Fresh random
    values from `seed` on `device` (every rank the same). hidden 4096, layers 8: 1.07B params."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for i in range(layers):
        for name, shape, dt, g in (("fc", (4 * hidden, hidden), dtype, 0), ("fc_bias", (4 * hidden,), torch.float32, 1),
                                   ("out", (hidden, 4 * hidden), dtype, 0), ("out_bias", (hidden,), torch.float32, 1),
                                   ("norm", (hidden,), torch.float32, 1)):
            t = (torch.randn(shape, generator=gen, device=device) * 0.02).to(dt)
            out.append(("layer%d.%s" % (i, name), t.requires_grad_(), g))
    out.append(("final_norm", torch.randn((hidden,), generator=gen, device=device).requires_grad_(), 1))
    return out


def set_grads(params, step, seed=7):
    """Fresh random grads for `step`, the same on every rank (as after DDP's all-reduce)."""
    with torch.no_grad():
        for i, p in enumerate(params):
            gen = torch.Generator(device=p.device).manual_seed(seed * 1000003 + step * 7919 + i)
            p.grad = (torch.randn(p.shape, generator=gen, device=p.device) * (1.0 + 0.1 * i)).to(p.dtype)


# ---- checksums of the full state --------------------------------------------------------------------

def _bits(t):
    """The elements' bits as int64 in [0, 2^bits)."""
    if t.element_size() == 2:
        return t.view(torch.int16).to(torch.int64) & 0xFFFF
    return t.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _sums(flat, start):
    """(sum of bits, weighted sum of the low halves, weighted sum of the high halves) of a 1-D tensor
    whose first element is element `start` of the global tensor; Python ints."""
    s = w = v = 0
    n = flat.numel()
    for off in range(0, n, PIECE):
        x = _bits(flat[off:off + PIECE])
        i = torch.arange(start + off, start + off + x.numel(), dtype=torch.int64, device=x.device)
        w1 = ((i % 1000003) * 1021 + 7) % 1048573 + 1
        w2 = ((i % 999983) * 2039 + 11) % 1048571 + 1
        s += int(x.sum())
        w += int(((x & 0xFFFF) * w1).sum())
        v += int(((x >> 16) * w2).sum())
    return [s, w, v]


def state_sums(opt, params, names, device):
    """{"<name>.<kind>": [s, w, v], "steps": [group steps]} of the optimizer's full state; collective
    (every rank gets the same dict). Reads each rank's range through the optimizer's sharding (so a
    1B-param model needs no gather of its state); the state is summed on `device`."""
    zero = opt._zero  # ferry._zero.Sharding: each param's [begin, end) on this rank
    mine = []
    for k, (p, name) in enumerate(zip(params, names)):
        if zero is not None:
            b, e = zero.range(k)
            local = zero_local(p)
            flat = local.detach().reshape(-1)
            part = flat[b:e] if zero.kind[k] == "replica" else flat
        else:
            b, e = 0, p.numel()
            part = p.detach().reshape(-1)
        mine.append(_sums(part, b) if e > b else [0, 0, 0])
        for kind in KINDS[1:]:
            if e > b:
                t = opt._read(k, kind).to(device)
                mine.append(_sums(t.reshape(-1), b))
            else:
                mine.append([0, 0, 0])
    total = all_sum(mine)
    out = {}
    it = iter(total)
    for name in names:
        for kind in KINDS:
            out["%s.%s" % (name, kind)] = next(it)
    out["steps"] = [int(opt.engine.group_step(g)) for g in opt._groups]
    return out


def zero_local(p):
    from ferry import _zero
    return _zero.local(p)


def all_sum(rows):
    """Elementwise sums over the ranks of a list of [int, int, int] (all-gathered as int64, added in
    Python: exact)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return rows
    t = torch.tensor(rows, dtype=torch.int64)
    every = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(every, t, group=cpu_group())
    out = [[0, 0, 0] for _ in rows]
    for theirs in every:
        for i, row in enumerate(theirs.tolist()):
            for j in range(3):
                out[i][j] += row[j]
    return out


_CPU_GROUP = []


def cpu_group():
    """A gloo group over every rank (the sums and barriers stay on the host whatever the trainer's backend)."""
    if not _CPU_GROUP:
        _CPU_GROUP.append(dist.new_group(backend="gloo"))
    return _CPU_GROUP[0]


def barrier():
    if dist.is_initialized():
        dist.barrier(group=cpu_group())


def compare_sums(got, want, what):
    """Raises AssertionError naming the first tensors whose sums differ."""
    bad = [k for k in want if got.get(k) != want[k]]
    if bad:
        raise AssertionError("%s: %d of %d checksums differ from the saving run's, first %s (got %s, saved %s)"
                             % (what, len(bad), len(want), ", ".join(bad[:4]), got.get(bad[0]), want[bad[0]]))


def write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def read_json(path):
    with open(path) as f:
        return json.load(f)


# ---- the disk's ceiling ---------------------------------------------------------------------------

def _buffer(n, random=False):
    buf = mmap.mmap(-1, n)  # page-aligned (O_DIRECT needs it)
    if random:
        buf.write(os.urandom(n))  # incompressible
    return buf


def evict(path):
    """Drops the clean cached pages of `path` (posix_fadvise DONTNEED)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def write_ceiling(path, nbytes):
    """Writes `nbytes` to a new file `path` in IO_BLOCK writes, fsyncs it, drops it from the page cache."""
    buf = _buffer(min(IO_BLOCK, max(nbytes, 4096)), random=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < nbytes:
            done += os.write(fd, memoryview(buf)[:min(len(buf), nbytes - done)])
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    buf.close()


def _open_read(path):
    """(fd, how): O_DIRECT where the file system takes it, else buffered after evicting the file."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT), "O_DIRECT"
    except OSError:
        evict(path)
        return os.open(path, os.O_RDONLY), "buffered after posix_fadvise(DONTNEED)"


def read_ranges(ranges, threads):
    """Reads [(path, begin, end)] with `threads` threads in IO_BLOCK reads (begin aligned to 4096);
    returns how the files were opened."""
    work = []
    for path, begin, end in ranges:
        for off in range(begin, end, IO_BLOCK):
            work.append((path, off, min(end, off + IO_BLOCK)))
    lock = threading.Lock()
    how = set()
    errors = []

    def run():
        buf = _buffer(IO_BLOCK)
        fds = {}
        try:
            while True:
                with lock:
                    if not work:
                        return
                    path, off, end = work.pop()
                if path not in fds:
                    fds[path] = _open_read(path)
                    how.add(fds[path][1])
                fd = fds[path][0]
                want = -(-(end - off) // 4096) * 4096  # O_DIRECT: whole blocks (short at the end of the file)
                os.preadv(fd, [memoryview(buf)[:min(want, IO_BLOCK)]], off)
        except OSError as e:
            errors.append(e)
        finally:
            for fd, _ in fds.values():
                os.close(fd)
            buf.close()

    ts = [threading.Thread(target=run) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]
    return ", ".join(sorted(how))


def split_reads(files, rank, world):
    """This reader's share of the bytes of `files` [(path, size)]: the concatenation cut into `world`
    contiguous pieces (boundaries aligned to IO_BLOCK)."""
    total = sum(s for _, s in files)
    per = -(-total // world)
    per = -(-per // IO_BLOCK) * IO_BLOCK
    lo, hi = rank * per, min(total, (rank + 1) * per)
    out, at = [], 0
    for path, size in files:
        b, e = max(lo, at), min(hi, at + size)
        if e > b:
            out.append((path, b - at, e - at))
        at += size
    return out


def timed(fn):
    """(result, seconds) of fn() between two barriers of every rank: the wall time of the slowest."""
    barrier()
    start = time.perf_counter()
    result = fn()
    barrier()
    return result, time.perf_counter() - start
