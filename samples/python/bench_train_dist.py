#!/usr/bin/env python3
"""bench_train.py's transformer on N ranks: one GPU per rank (NCCL), or N CPU processes (gloo) for a
smoke test. Every rank trains the same model on batches of its own; each row is timed as
bench_train.py times its rows (no host synchronization inside the loop), and rank 0 prints the
slowest rank's iteration time and its ratio to the all-GPU DDP row of the same run:

    DDP torch AdamW (fused)          all-GPU: DDP, torch's AdamW (fused where the build has it)
    DDP ferry all_gpu                all-GPU: DDP, Ferry's GPU Adam, every rank the whole state
    DDP ZeRO-1 offload               DDP, ferry shard=True: this rank's 1/N of the state in pinned
                                     host memory, step() only (overlap=False)
    DDP ZeRO-1 offload + overlap     the same with opt.attach_ddp(ddp) (each param group announced
                                     once DDP's all-reduce of its grads has landed) and
                                     attach(model): the step returns before its update and all-gather,
                                     each layer's forward waits for its own units' gathers
    DDP offload + overlap            unsharded (every rank the whole state offloaded), attach_ddp, and
                                     attach(model) as bench_train.py's overlap rows (deferred steps)
    FSDP2 offload                    fully_shard per block and the root (DTensor params; --fsdp-units
                                     split: the embeddings and the norm with the head as units too),
                                     offloaded
    FSDP2 offload + overlap          the same with overlap=True (groups announced once FSDP2's
                                     reduce-scatter has landed: its post-accumulate-grad hooks) and
                                     attach(model): the step returns before its update, and each
                                     FSDP2 module's forward waits for its own params before FSDP2
                                     all-gathers them
    FSDP2 torch AdamW                all-GPU: the FSDP2 model with torch's AdamW (foreach) on the GPU
                                     (what FSDP2's own collectives cost beside DDP's)

    torchrun --nproc-per-node 4 samples/python/bench_train_dist.py --size medium     # 4 GPUs
    python3 samples/python/bench_train_dist.py --world 2 --size medium                # spawned ranks
    python3 samples/python/bench_train_dist.py --world 2 --device cpu --size tiny --dtype float32 --check-exact

--phases (CUDA): each row's GPU time per iteration split into forward, backward and step (CUDA events
on the compute stream), rank 0's and the slowest rank's: where an N-GPU row loses to one GPU. Under
`torchrun --nproc-per-node 1` the same rows run on one GPU (DDP over one rank, ZeRO-1 of the whole
state): the 1-GPU ratio in the same harness.

--check-exact: deterministic kernels; the losses of each overlap row must be the same bits as the
same row without overlap (exits non-zero otherwise). FSDP2 rows need torch >= 2.4 and, on CUDA, a
GPU per rank; elsewhere they are skipped with the reason. A benchmark: it asserts nothing about time.
"""
import argparse
import gc
import inspect
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_model  # noqa: E402  (the model, its sizes and param groups)
import bench_report  # noqa: E402  (the CPU notes, --repeat's medians)
import bench_threads  # noqa: E402  (where the threads spent the timed steps)
import bench_train  # noqa: E402  (the rows' options)
import dist_launch  # noqa: E402
from fsdp2_sample import fsdp2  # noqa: E402

ROWS = [
    {"name": "DDP torch AdamW (fused)", "kind": "torch", "wrap": "ddp"},
    {"name": "DDP ferry all_gpu", "kind": "ferry", "wrap": "ddp", "policy": "all_gpu"},
    {"name": "DDP ZeRO-1 offload", "kind": "ferry", "wrap": "ddp", "policy": "offload_all", "shard": True},
    {"name": "DDP ZeRO-1 offload + overlap", "kind": "ferry", "wrap": "ddp", "policy": "offload_all", "shard": True,
     "overlap": True, "attach": True, "same_as": "DDP ZeRO-1 offload"},
    {"name": "DDP offload", "kind": "ferry", "wrap": "ddp", "policy": "offload_all"},
    {"name": "DDP offload + overlap", "kind": "ferry", "wrap": "ddp", "policy": "offload_all", "overlap": True,
     "attach": True, "same_as": "DDP offload"},
    {"name": "FSDP2 offload", "kind": "ferry", "wrap": "fsdp2", "policy": "offload_all"},
    {"name": "FSDP2 offload + overlap", "kind": "ferry", "wrap": "fsdp2", "policy": "offload_all", "overlap": True,
     "attach": True, "same_as": "FSDP2 offload"},
    {"name": "FSDP2 torch AdamW", "kind": "torch", "wrap": "fsdp2"},
]


def skip_reason(row, args, world):
    if row["wrap"] != "fsdp2":
        return None
    if fsdp2() is None:
        return "torch %s has no FSDP2 (fully_shard needs torch >= 2.4)" % torch.__version__
    if args.device == "cuda" and dist.get_backend() != "nccl":
        return "FSDP2 on CUDA needs a GPU per rank (NCCL)"
    return None


def build(row, args, device, world, local_rank):
    """(model to call, optimizer) of a row: a fresh model with the same weights on every rank."""
    import ferry.torch
    dim, blocks, heads, _, _ = bench_model.SIZES[args.size]
    torch.manual_seed(0)
    model = bench_model.Model(dim, blocks, heads, exact=args.check_exact)
    model = model.to(device=device, dtype=getattr(torch, args.dtype))
    if row["wrap"] == "fsdp2":
        fully_shard, init_device_mesh = fsdp2()
        mesh = init_device_mesh(device.type, (world,))
        if args.fsdp_units == "split":  # torchtitan's units: the embeddings, each block, the norm and head
            fully_shard(model.embed, mesh=mesh)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        if args.fsdp_units == "split":
            fully_shard([model.ln, model.head], mesh=mesh)
        fully_shard(model, mesh=mesh)
        outer = model
    else:
        outer = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)
    groups = model.param_groups(args.groups)
    kw = dict(lr=args.lr, weight_decay=0.1)
    if row["kind"] == "torch":
        fused = {"fused": True} if "fused" in inspect.signature(torch.optim.AdamW).parameters and \
            device.type == "cuda" and row["wrap"] == "ddp" else {}
        return outer, torch.optim.AdamW(groups, **kw, **fused)
    extra = dict(policy=row["policy"], overlap=bool(row.get("overlap")), collective_timeout=args.timeout,
                 trace_path=bench_train.trace_path(args.trace, row))
    if row.get("shard"):
        extra["shard"] = True
    if "local_rank" in inspect.signature(ferry.torch.Optimizer.__init__).parameters:
        # this rank's share of the host's CPUs and pinned budget (spawned ranks have no torchrun environment)
        extra.update(local_rank=local_rank, local_world_size=dist_launch.local_world(world))
    if args.cpu_threads:
        extra["cpu_threads"] = args.cpu_threads
    if args.chunk_bytes:
        extra["transfer_chunk_bytes"] = args.chunk_bytes
    if args.trainer_threads >= 0 and bench_train.has_option("trainer_threads"):
        extra["trainer_threads"] = args.trainer_threads
    opt = ferry.torch.Optimizer(groups, **kw, **extra)
    if row.get("overlap") and row["wrap"] == "ddp":
        opt.attach_ddp(outer)  # announce each group once DDP's all-reduce of its grads has landed
    if row.get("attach") and not args.no_attach:
        opt.attach(model)  # each layer's forward waits for its own group's upload
    return outer, opt


class Phases:
    """--phases: CUDA events on the current (compute) stream at the start of each timed iteration and
    after its forward, backward and step + zero_grad. The host runs ahead, so the time between two
    events is what the GPU spent between those points of the loop: the forward's includes any wait of
    its layers for params (uploads, ZeRO-1 all-gathers), the backward's any wait in the grad hooks."""

    NAMES = ("forward", "backward", "step")

    def __init__(self, device):
        self.device = device
        self.events = []  # per timed iteration: {"start": e, "forward": e, ...}

    def mark(self, name):
        if self.device.type != "cuda":
            return
        if name == "start":
            self.events.append({})
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        self.events[-1][name] = e

    def summary(self):
        """{phase: [this rank's mean ms, the slowest rank's mean ms]} (collective), or None off CUDA."""
        if self.device.type != "cuda" or not self.events:
            return None
        torch.cuda.synchronize(self.device)
        mean = []
        for b, name in zip(("start",) + self.NAMES, self.NAMES):
            mean.append(statistics.mean(it[b].elapsed_time(it[name]) for it in self.events))
        mine = torch.tensor(mean, dtype=torch.float64, device=self.device)
        slowest = mine.clone()
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return {name: (m, x) for name, m, x in zip(self.NAMES, mine.tolist(), slowest.tolist())}


def profile_steps(prof, where, row, rank, device):
    """Starts torch.profiler (CPU and CUDA activity) when `prof` is None, else stops it and writes its
    Chrome trace to WHERE/<row>.rank-R.json (<row> as --trace names it: fsdp2_offload_overlap): the
    GPU's streams (kernels, copies, NCCL) of the steps between, beside the trace of Ferry's own threads
    that --trace writes. It profiles two steps after
    the timed ones, which its cost leaves alone."""
    from torch.profiler import ProfilerActivity, profile
    if prof is None:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        prof = profile(activities=activities)
        prof.__enter__()
        return prof
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    prof.__exit__(None, None, None)
    os.makedirs(where, exist_ok=True)
    prof.export_chrome_trace(os.path.join(where, "%s.rank-%d.json" % (bench_train.row_slug(row), rank)))
    return None


def pyprofile_steps(prof, where, row, rank, device):
    """Starts cProfile on the trainer's thread when `prof` is None, else stops it and writes its
    summary (the 40 functions of most own time, then of most time below them) to
    WHERE/<row>.rank-R.txt: where the trainer's Python goes in the steps between (the autograd
    thread's hooks are not in it). cProfile slows Python down: read the shares, not the times."""
    import cProfile
    import io
    import pstats
    if prof is None:
        prof = cProfile.Profile()
        prof.enable()
        return prof
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(40)
    os.makedirs(where, exist_ok=True)
    with open(os.path.join(where, "%s.rank-%d.txt" % (bench_train.row_slug(row), rank)), "w") as f:
        f.write(out.getvalue())
    return None


def timed_end(opt, row, sync, t0, threads0, steps):
    """(this rank's mean iteration in s since t0; the optimizer's stats then, for a ferry row;
    bench_threads.use() since the snapshot threads0): bench_train.end_window's, its tail in row["tail"]."""
    iteration, stats, threads, row["tail"] = bench_train.end_window(opt, row["kind"] == "ferry", sync, t0,
                                                                    threads0, steps)
    return iteration, stats, threads


def collective_device(device):
    """Where a small tensor for a collective lives: the GPU under NCCL, else the CPU."""
    return device if dist.get_backend() == "nccl" else "cpu"


def gather_by_rank(values, device):
    """`values` (a few floats, the same count on every rank) of every rank, in rank order (collective)."""
    mine = torch.tensor(values, dtype=torch.float64, device=collective_device(device))
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [t.tolist() for t in every]


def threads_by_rank(threads, device):
    """(this rank's bench_threads.use() dict, [[trainer ms on a CPU, ms waiting for one] per rank])."""
    trainer = threads.get("trainer", [1, 0.0, 0.0])
    return threads, gather_by_rank(trainer[1:], device)


def cpu_by_rank(stats, device):
    """[[CPU Adam's busy ms per step, its GB/s] per rank] from each rank's bench_report.cpu_update
    dict, or None where no rank's CPU update ran (collective: every rank calls it for every row). The
    forward of the next step runs at the pace of the rank whose update of each layer ends last."""
    every = gather_by_rank([stats["ms"], stats["gbs"]] if stats else [0.0, 0.0], device)
    return every if any(ms > 0 for ms, _ in every) else None


def run_row(row, args, device, rank, world, local_rank, data):
    """(slowest rank's iteration time in s, this rank's losses, bench_report.cpu_update's dict of this
    rank's timed steps or None)."""
    outer, opt = build(row, args, device, world, local_rank)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    losses = []
    phases = Phases(device) if args.phases else None
    dist.barrier()
    t0, before, threads0 = time.perf_counter(), None, None
    prof, end = None, args.warmup + args.steps
    # two more steps after the timed ones, profiled (--profile, --pyprofile)
    profiled = (args.profile or args.pyprofile) and row["kind"] == "ferry"
    pyprof = None
    for it in range(end + (4 if profiled else 0)):
        if it == end:
            mine, after, threads = timed_end(opt, row, sync, t0, threads0, args.steps)
        if args.profile and profiled and it in (end + 1, end + 3):
            prof = profile_steps(prof, args.profile, row, rank, device)
        if args.pyprofile and profiled and it in (end + 1, end + 3):
            pyprof = pyprofile_steps(pyprof, args.pyprofile, row, rank, device)
        if it == args.warmup:
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            before = opt.stats() if row["kind"] == "ferry" else None
            threads0 = bench_threads.snapshot()
        timed = phases is not None and args.warmup <= it < end
        if timed:
            phases.mark("start")
        loss = outer(data[it % len(data)])
        if timed:
            phases.mark("forward")
        loss.backward()
        if timed:
            phases.mark("backward")
        opt.step()
        opt.zero_grad(set_to_none=row["kind"] == "torch")
        if timed:
            phases.mark("step")
        if it < end:
            losses.append(loss.detach())
    if not profiled:
        mine, after, threads = timed_end(opt, row, sync, t0, threads0, args.steps)
    row["threads"] = threads_by_rank(threads, device)
    slowest = torch.tensor([mine], dtype=torch.float64, device=collective_device(device))
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    stats = bench_report.cpu_update(before, after, args.steps) if row["kind"] == "ferry" else None
    row["cpu_ranks"] = cpu_by_rank(stats, device)
    if phases is not None:
        row["phases"] = phases.summary()
    del outer, opt
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the next row builds its model afresh
    return slowest.item(), torch.stack(losses).float().cpu(), stats


def with_exact_mates(rows, rank):
    """--check-exact compares each overlap row's losses with those of its row without overlap
    (`same_as`), run before it: a mate the --rows left out, or put after it, runs just before it
    (said on rank 0; else nothing would be compared). Each row runs once."""
    out, done = [], set()
    for row in rows:
        mate = row.get("same_as")
        if mate and mate not in done:
            out.append(next(r for r in ROWS if r["name"] == mate))
            done.add(mate)
            if rank == 0:
                print("--check-exact: row %d (%s) runs before %s, to be compared with it"
                      % (ROWS.index(out[-1]), mate, row["name"]), flush=True)
        if row["name"] not in done:
            out.append(row)
            done.add(row["name"])
    return out


def worker(rank, world, local_rank, args):
    device = dist_launch.cuda_device(local_rank) if args.device == "cuda" else torch.device("cpu")
    if args.solo_mb is not None:  # ZeRO-1's gather units: the size from which a param is gathered alone
        from ferry import _zero
        _zero.SOLO_BYTES = int(args.solo_mb * (1 << 20))
    if args.check_exact:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    dim, blocks, heads, batch, seq = bench_model.SIZES[args.size]
    batch = args.batch or batch
    gen = torch.Generator().manual_seed(1 + rank)  # each rank its own batches
    data = [torch.randint(0, bench_model.VOCAB, (batch, seq + 1), generator=gen).to(device) for _ in range(4)]
    if rank == 0:
        print("torch %s, %d ranks (%s, %s); %s: dim %d, %d blocks, %s params, batch %d x %d tokens per rank, %d "
              "timed steps after %d" % (torch.__version__, world, dist.get_backend(),
                                        torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                                        args.size, dim, blocks, args.dtype, batch, seq, args.steps, args.warmup),
              flush=True)
    rows = ROWS if not args.rows else [ROWS[int(i)] for i in args.rows.split(",")]
    if args.check_exact:
        rows = with_exact_mates(rows, rank)
    rounds, ok, runs = max(1, args.repeat), True, {}  # runs: row name -> [(iteration, ratio)] per round
    for round_ in range(rounds):
        if rounds > 1 and rank == 0:
            print("  round %d of %d" % (round_ + 1, rounds), flush=True)
        base, results = None, {}  # each round's ratios against its own all-GPU row
        for row in rows:
            why = skip_reason(row, args, world)
            if why:
                if rank == 0:
                    print("   %-30s skipped: %s" % (row["name"], why), flush=True)
                continue
            iteration, losses, stats = run_row(row, args, device, rank, world, local_rank, data)
            results[row["name"]] = losses
            if base is None and row.get("policy", "all_gpu") == "all_gpu":
                base = iteration  # the first all-GPU DDP row: torch's AdamW, else ferry all_gpu
            line = "   %-30s %8.1f ms" % (row["name"], iteration * 1e3)
            if base:
                line += "  %5.2fx all-GPU DDP" % (iteration / base)
            runs.setdefault(row["name"], []).append((iteration, iteration / base if base else None))
            line += bench_report.cpu_text(stats, "rank 0", iteration if row.get("overlap") else None)
            if row.get("phases"):
                line += "\n      GPU time per iteration (rank 0 / the slowest rank): " + ", ".join(
                    "%s %.1f / %.1f ms" % (name, m, x) for name, (m, x) in row["phases"].items())
            elif args.phases and rank == 0 and device.type != "cuda":
                line += "   (--phases: CUDA only)"
            threads, trainers = row["threads"]
            if threads:
                line += "\n      %s (rank 0)" % bench_threads.text(threads)
                if world > 1:
                    line += "\n      each rank's trainer thread, ms per step on a CPU + waiting for one: " + ", ".join(
                        "%.1f + %.1f" % (c, w) for c, w in trainers)
            if world > 1 and row.get("cpu_ranks"):
                line += "\n      each rank's CPU Adam, ms per step (GB/s): " + ", ".join(
                    "%.1f (%.1f)" % (ms, gbs) for ms, gbs in row["cpu_ranks"])
            if args.profile and row["kind"] == "ferry" and world > 1:
                line += "\n      which rank each collective waited for: ferry trace %s" % os.path.join(
                    args.profile, "%s.rank-*.json" % bench_train.row_slug(row))
            if rank == 0:
                print(line, flush=True)
            if args.check_exact and row.get("same_as") in results:
                same = torch.equal(losses, results[row["same_as"]])
                flag = torch.tensor([0 if same else 1], device=collective_device(device))
                dist.all_reduce(flag)
                ok = ok and flag.item() == 0
                if rank == 0:
                    print("   losses of %-30s %s %s's on every rank" % (row["name"], "==" if flag.item() == 0 else "!=",
                                                                         row["same_as"]), flush=True)
    if rounds > 1 and rank == 0:
        print("  over %d rounds, alternated: the median (the range)" % rounds, flush=True)
        for name, got in runs.items():
            print(bench_report.median_line("%-30s" % name, [t for t, _ in got], [r for _, r in got if r is not None],
                                          "all-GPU DDP"), flush=True)
    if not ok:
        raise SystemExit("FAILED: the losses of an overlap row differ from the same row without overlap")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2, help="processes to spawn when not under torchrun (default 2)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--size", default="medium", choices=list(bench_model.SIZES))
    ap.add_argument("--batch", type=int, default=0, help="override the size's batch (per rank)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the rows this many times, alternated (each row built afresh), and print each "
                         "row's median iteration and ratio over the rounds: a noisy host's figures")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="the params' dtype (float32 for gloo on torch 1.13, which has no bf16 collectives)")
    ap.add_argument("--rows", default="", help="comma-separated row indices (default: all)")
    ap.add_argument("--groups", default="split", choices=["split", "joined"], help="as bench_train.py's")
    ap.add_argument("--fsdp-units", default="root", choices=["root", "split"],
                    help="FSDP2's units: root, fully_shard per block and the root (the embeddings, the final norm "
                         "and the head in the root's unit, as torch's FSDP2 example writes it); split, the "
                         "embeddings and the final norm with the head in units of their own (as torchtitan "
                         "wraps a transformer)")
    ap.add_argument("--cpu-threads", type=int, default=0, help="ferry's CPU Adam threads per rank (0: its default)")
    ap.add_argument("--chunk-bytes", type=int, default=0,
                    help="ferry's transfer_chunk_bytes per rank: grads per pipeline chunk (0: its default)")
    ap.add_argument("--trainer-threads", type=int, default=-1,
                    help="CPUs of each rank's share left to the trainer's threads (-1: ferry.torch's default)")
    ap.add_argument("--timeout", type=float, default=300.0, help="the optimizer's collective timeout, seconds")
    ap.add_argument("--trace", default="", help="ferry trace of each ferry row and rank: PATH with the row's name before "
                    "the extension and the engine's rank suffix, e.g. run.ddp_zero_1_offload_overlap.rank-0.json")
    ap.add_argument("--solo-mb", type=float, default=None,
                    help="ZeRO-1: MiB from which an evenly split param is a gather unit of its own, gathered in place "
                    "under NCCL (ferry._zero.SOLO_BYTES, default 1; a huge value: every unit through copies)")
    ap.add_argument("--profile", default="", metavar="DIR",
                    help="torch.profiler's Chrome trace of two steps after the timed ones, of each ferry row and "
                         "rank, into DIR (the GPU's kernels, copies and NCCL; `ferry trace DIR/ROW.rank-*.json` says "
                         "which rank each collective waited for)")
    ap.add_argument("--pyprofile", default="", metavar="DIR",
                    help="cProfile of the trainer's thread over two steps after the timed ones, of each ferry row "
                         "and rank: DIR/ROW.rank-R.txt (the functions of most own and most total time)")
    ap.add_argument("--phases", action="store_true",
                    help="CUDA: each row's GPU time per iteration in forward, backward and step (CUDA events on "
                         "the compute stream; rank 0's and the slowest rank's mean)")
    ap.add_argument("--no-attach", action="store_true", help="overlap rows without opt.attach(model): step() "
                    "waits for every upload (and ZeRO-1's all-gathers) before the next forward")
    ap.add_argument("--check-exact", action="store_true",
                    help="deterministic kernels; each overlap row's losses must be the same bits as without overlap")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_train_dist: --device cuda, but torch sees no GPU")
    dist_launch.launch(worker, args)


if __name__ == "__main__":
    main()
