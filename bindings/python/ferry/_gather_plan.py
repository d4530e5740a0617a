"""ZeRO-1's gathers in a forward, planned: which gather units one launch takes (gather_ahead,
launch_through), how consecutive units group into one NCCL call (coalesced_runs), and the sizes
behind them (their defaults and environment overrides). Pure functions of the units' sizes; the
gathers themselves are ferry/_zero.py's Sharding. Internal."""
import inspect
import os

import torch.distributed as dist


# ZeRO-1's NCCL gathers: consecutive units are gathered as one NCCL group of up to this many bytes
# (a larger unit alone): 84-85% of one all-gather of the same bytes on 4 H100s, 86-88% with every
# unit in one group, 75-78% at 256 MiB.
COALESCE_BYTES = 1 << 30


def coalesce_bytes():
    """COALESCE_BYTES, or FERRY_ZERO_COALESCE_MB (0: every unit alone)."""
    return size_from_env("FERRY_ZERO_COALESCE_MB", COALESCE_BYTES)


# After a deferred step (attach), the gathers run ahead of the forward by up to this many bytes
# (gather_ahead), so that a forward launches a few large grouped all-gathers instead of one per module:
# each launch, its copies and the hook's bookkeeping cost the trainer's thread 0.3-0.6 ms on a host
# whose CPUs stream CPU Adam, and the forward is paced by that thread there. 256 MiB (about two blocks
# of the 735M model): on the 4 x H200 host, 4 GPUs, 2026-11-28, the 735M loop's ZeRO-1 iteration ran
# 160.6-177.5 ms against 168.5-188.1 ms at 64 MiB in three pairs over two leases (200.2 ms at 0), the
# gathers ahead launched in the pre-hooks then. Launched after a module's forward instead (the
# default, launch_through: the host waits for this rank's uploads ahead with the module's kernels
# queued, and the stream waits only for the units its module needs), alternated pairs over two
# leases: 169.6 / 182.8, 169.7 / 179.6, 163.4 / 170.6, 165.6 / 157.9 ms against the pre-hooks
# (all-GPU DDP 142.5-143.3 ms); ahead 128 / 256 / 512 / 1024 MiB, one run each: 167.6 / 176.5 /
# 173.1 / 192.9 ms. FERRY_ZERO_GATHER_AHEAD_MB overrides (0: only what the module needs),
# FERRY_ZERO_AHEAD_AFTER=0 launches them in the pre-hooks.
GATHER_AHEAD_BYTES = 256 << 20


def size_from_env(name, default):
    """`default` bytes, or the environment variable `name` in MiB (>= 0)."""
    text = os.environ.get(name)
    if text is None or not text.strip():
        return default
    try:
        mb = float(text)
    except ValueError:
        mb = -1.0
    if mb < 0:
        raise ValueError("%s=%r: expected a size in MiB >= 0" % (name, text))
    return int(mb * (1 << 20))


def gather_ahead(sizes, last, ahead):
    """The last unit to gather when units up to `last` are needed: `last`, and the units after it
    while they add up to at most `ahead` bytes (`sizes`: each unit's bytes)."""
    end, total = last, 0
    while end + 1 < len(sizes) and total + sizes[end + 1] <= ahead:
        end += 1
        total += sizes[end]
    return end


def launch_through(sizes, next_unit, last, ahead):
    """After the forward of a module whose units end at `last`, with units before `next_unit`
    launched: the last unit to launch the gathers through (gather_ahead's of `ahead` bytes), where
    those launched reach less than half of `ahead` bytes past `last`; else None (far enough ahead:
    a launch then gathers half of `ahead` at least, not a module's units at a time)."""
    if not ahead or next_unit > gather_ahead(sizes, last, ahead // 2):
        return None
    return gather_ahead(sizes, last, ahead)


def coalesced_runs(sizes, first, last, cap):
    """(j, end) of each run of units first..last (inclusive) gathered as one NCCL group: consecutive
    units while the run holds at most `cap` bytes (`sizes`: each unit's bytes); a unit of more than
    `cap` is a run of its own."""
    j = first
    while j <= last:
        end, size = j, sizes[j]
        while end < last and size < cap and size + sizes[end + 1] <= cap:
            end += 1
            size += sizes[end]
        yield j, end
        j = end + 1


def can_coalesce():
    """Whether torch.distributed's coalescing manager groups all_gather_into_tensor calls into one
    collective and hands back its work (torch 2.1 on: the `async_ops` argument)."""
    manager = getattr(dist, "_coalescing_manager", None)
    if manager is None or not hasattr(dist, "all_gather_into_tensor"):
        return False
    try:
        return "async_ops" in inspect.signature(manager).parameters
    except (TypeError, ValueError):
        return False
