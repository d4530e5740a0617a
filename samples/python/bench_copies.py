#!/usr/bin/env python3
"""Pinned host <-> GPU copies of every GPU of this host at once, against each GPU's copies alone: how
much of the host's PCIe and memory bandwidth ranks that share a host get together (one thread per GPU,
each with its own pinned buffer, as one rank per GPU has).

    python3 samples/python/bench_copies.py [--mib 1024] [--reps 10]

Prints, per direction, each GPU alone (GB/s), the sum of those, all GPUs at once (their aggregate
GB/s), and the ratio of the two (target >= 0.9). A benchmark: it asserts nothing about time.
"""
import argparse
import statistics
import threading
import time

import torch


def timed_copies(index, host, dev, direction, reps, barrier, out):
    torch.cuda.set_device(index)
    stream = torch.cuda.Stream(index)
    with torch.cuda.stream(stream):
        for r in range(reps + 1):
            if barrier is not None:
                barrier.wait()
            t0 = time.perf_counter()
            if direction == "h2d":
                dev.copy_(host, non_blocking=True)
            else:
                host.copy_(dev, non_blocking=True)
            stream.synchronize()
            if r > 0:  # the first is a warm-up
                out.append(time.perf_counter() - t0)


def run(gpus, buffers, direction, reps, together):
    results = {i: [] for i in gpus}
    barrier = threading.Barrier(len(gpus)) if together else None
    if together:
        threads = [threading.Thread(target=timed_copies, args=(i, *buffers[i], direction, reps, barrier, results[i]))
                   for i in gpus]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for i in gpus:
            timed_copies(i, *buffers[i], direction, reps, None, results[i])
    return {i: statistics.median(v) for i, v in results.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1024, help="bytes per copy, MiB")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    n = torch.cuda.device_count()
    if n == 0:
        raise SystemExit("bench_copies: no CUDA device")
    gpus = list(range(n))
    nbytes = args.mib << 20
    buffers = {i: (torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(i + 1),
                   torch.empty(nbytes, dtype=torch.uint8, device="cuda:%d" % i)) for i in gpus}
    print("bench_copies: %d GPU(s) (%s), %d MiB pinned per copy, median of %d"
          % (n, torch.cuda.get_device_name(0), args.mib, args.reps))
    for direction in ("h2d", "d2h"):
        alone = run(gpus, buffers, direction, args.reps, together=False)
        together = run(gpus, buffers, direction, args.reps, together=True)
        gbps = lambda s: nbytes / s / 1e9  # noqa: E731
        sum_alone = sum(gbps(s) for s in alone.values())
        # All at once: the bytes of every GPU over the slowest GPU's median time.
        aggregate = n * nbytes / max(together.values()) / 1e9
        print("  %s: alone %s GB/s (sum %.1f); all at once %s GB/s, aggregate %.1f GB/s = %.2f of the sum"
              % (direction, ", ".join("%.1f" % gbps(alone[i]) for i in gpus), sum_alone,
                 ", ".join("%.1f" % gbps(together[i]) for i in gpus), aggregate, aggregate / sum_alone))


if __name__ == "__main__":
    main()
