#!/usr/bin/env python3
"""DistributedDataParallel with Ferry's ZeRO-1: every rank keeps the whole model and its grads (DDP
all-reduces them), and ferry.torch.Optimizer(..., shard=True) keeps and steps only this rank's 1/W of
the optimizer state; step() all-gathers the updated ranges into every replica.

    # on its own: 2 processes (torch.multiprocessing), CPU tensors, gloo
    PYTHONPATH=build/python python3 samples/python/ddp_zero1.py --world 2 --check
    # under torchrun
    PYTHONPATH=build/python torchrun --nproc-per-node 2 samples/python/ddp_zero1.py --check
    # CUDA: one GPU per rank (NCCL), or ranks sharing a GPU (gloo; see dist_launch.py)
    PYTHONPATH=build/python python3 samples/python/ddp_zero1.py --world 2 --device cuda --check
    PYTHONPATH=build/python python3 samples/python/ddp_zero1.py --world 2 --device cuda --bench \
        --hidden 4096 --layers 8 --dtype bfloat16            # ~1.07B params

--check: every rank also steps an unsharded ferry.torch.Optimizer over a copy of the model with the
same (all-reduced) grads, and asserts after every step that the ZeRO-1 params are the same bits.
--bench: prints the median time of the ZeRO-1 step (the engine's step on 1/W of the state, then the
all-gather) beside the unsharded step, and the Python overhead of opt.step(): its wall time minus
the engine's step call (stats()['last_step_seconds']) and the all-gather (['last_gather_seconds']),
as a percentage of the step. A benchmark: it asserts nothing about time.
--overlap: opt.attach_ddp(ddp) and overlap=True: each param group is announced once DDP's all-reduce
of its grads has landed (the same bits; --check still compares with the unsharded optimizer).
"""
import argparse
import copy
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import dist_launch


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.out(F.gelu(self.fc(self.ln(x))))


def make_model(args, device, dtype):
    torch.manual_seed(0)  # the same weights on every rank (DDP broadcasts rank 0's anyway)
    model = nn.Sequential(*[Block(args.hidden) for _ in range(args.layers)], nn.LayerNorm(args.hidden))
    return model.to(device=device, dtype=dtype)


def lr_at(step, steps):
    return 3e-3 * min(1.0, (step + 1) / 3.0) * (1.0 - 0.5 * step / max(steps, 1))


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def check_same(step, rank, params, ref_params):
    for i, (a, b) in enumerate(zip(params, ref_params)):
        diff = (bits(a.detach()) != bits(b.detach())).nonzero()
        if diff.numel():
            raise AssertionError("step %d, rank %d, param %d %s: %d elements differ from the unsharded optimizer's, "
                                 "first at %s" % (step, rank, i, tuple(a.shape), diff.shape[0], diff[0].tolist()))


def forward_backward(model, opts, step, args, gen, device, dtype):
    """Sets this step's lr in the optimizers (None: left out), runs one batch forward and backward;
    returns the loss."""
    for o in opts:
        if o is not None:
            for g in o.param_groups:
                g["lr"] = lr_at(step, args.steps)
    x = torch.randn(args.batch, args.hidden, generator=gen).to(device=device, dtype=dtype)
    target = torch.randn(args.batch, args.hidden, generator=gen).to(device=device, dtype=dtype)
    loss = F.mse_loss(model(x).float(), target.float())
    loss.backward()
    return loss


def worker(rank, world, local_rank, args):
    import ferry.torch
    device = dist_launch.cuda_device(local_rank) if args.device == "cuda" else torch.device("cpu")
    dtype = getattr(torch, args.dtype)
    model = make_model(args, device, dtype)
    ref_model = copy.deepcopy(model) if (args.check or args.bench) else None
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    # --overlap: attach_ddp announces each param group once DDP's all-reduce of its grads has landed.
    # Without it overlap=False: DDP writes the all-reduced grads after the backward that Ferry's grad
    # hooks see, so groups announced from those hooks would only be recomputed (exact either way).
    opt = ferry.torch.Optimizer(model.parameters(), lr=lr_at(0, args.steps), weight_decay=0.1, policy=args.policy,
                                max_grad_norm=args.clip, shard=True, overlap=args.overlap,
                                collective_timeout=args.timeout, cpu_threads=args.cpu_threads)
    if args.overlap:
        opt.attach_ddp(ddp)
    ref = None
    if ref_model is not None:
        ref = ferry.torch.Optimizer(ref_model.parameters(), lr=lr_at(0, args.steps), weight_decay=0.1,
                                    policy=args.policy, max_grad_norm=args.clip, overlap=False)
    info = opt.sharding
    numel = sum(p.numel() for p in model.parameters())
    if rank == 0:
        _, why = dist_launch.backend_for(args.device, dist_launch.local_world(world))
        print("ddp_zero1: %d ranks, %s params (%s on %s), process group %s (%s)"
              % (world, "{:,}".format(numel), args.dtype, device.type, dist.get_backend(), why))
        print("ddp_zero1: ZeRO-1 all-gather via %s; this rank steps %s of the %s elements"
              % (info["all_gather"], "{:,}".format(info["local_numel"]), "{:,}".format(numel)))
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches
    times = {"zero1": [], "unsharded": [], "engine": [], "gather": [], "overhead": []}
    for step in range(args.steps):
        loss = forward_backward(ddp, (opt, ref), step, args, gen, device, dtype)
        if ref is not None:
            with torch.no_grad():
                for p, q in zip(model.parameters(), ref_model.parameters()):
                    q.grad = p.grad.clone()  # DDP's all-reduced grads (assigned: the unsharded step sees them)
        sync(device)
        t0 = time.perf_counter()
        opt.step()
        t1 = time.perf_counter()
        sync(device)
        t2 = time.perf_counter()
        stats = opt.stats()
        if ref is not None:
            ref.step()
            sync(device)
            t3 = time.perf_counter()
            times["unsharded"].append(t3 - t2)
        times["zero1"].append(t2 - t0)
        times["engine"].append(stats["last_step_seconds"])
        times["gather"].append(stats["last_gather_seconds"])
        times["overhead"].append((t1 - t0) - stats["last_step_seconds"] - stats["last_gather_seconds"])
        opt.zero_grad()
        if ref is not None:
            ref.zero_grad()
        if args.check:
            check_same(step, rank, list(model.parameters()), list(ref_model.parameters()))
        if rank == 0 and (step % max(1, args.steps // 5) == 0 or step == args.steps - 1):
            print("step %3d  loss %.5f  grad norm %.4f%s" % (step, loss.item(), stats["last_grad_norm"],
                                                          " (clipped)" if stats["last_grad_norm"] > args.clip else ""))
    if args.check:
        # Every replica holds the same bits (the all-gather's work): compare checksums across ranks.
        mine = torch.stack([bits(p.detach()).long().sum() for p in model.parameters()]).to(device)
        every = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        for r, theirs in enumerate(every):
            if not torch.equal(theirs, mine):
                raise AssertionError("rank %d's params differ from rank %d's after %d steps" % (r, rank, args.steps))
        if rank == 0:
            print("check passed: ZeRO-1 over %d ranks is bit-identical to the unsharded optimizer over %d "
                  "steps (clipping, lr schedule) on every rank; every replica the same" % (world, args.steps))
    if args.bench and rank == 0:
        skip = min(args.warmup, args.steps - 1)
        med = {k: statistics.median(v[skip:]) for k, v in times.items() if v}
        print("bench (rank 0, median of %d steps after %d warm-up):" % (args.steps - skip, skip))
        print("  ZeRO-1 step   %9.3f ms  (engine step on 1/%d of the state %.3f ms; the all-gathers, unit by unit "
              "as the uploads land, add %.3f ms; their host time %.3f ms)"
              % (1e3 * med["zero1"], world, 1e3 * med["engine"], 1e3 * (med["zero1"] - med["engine"]),
                 1e3 * med["gather"]))
        print("  unsharded     %9.3f ms  (the whole state on each rank, ranks stepping at the same time)"
              % (1e3 * med["unsharded"]))
        print("  Python overhead of opt.step(): %.3f ms = %.2f%% of the ZeRO-1 step"
              % (1e3 * med["overhead"], 100.0 * med["overhead"] / med["zero1"]))
        sys.stdout.flush()
    if args.bench and world > 1:
        # The all-gather's ceiling: the process group's own all-gather of the same bytes, alone.
        elem = torch.empty((), dtype=dtype).element_size()
        flat = torch.empty(numel, dtype=dtype, device=device)
        piece = flat.narrow(0, 0, numel // world)
        gather = (lambda: dist.all_gather_into_tensor(flat.narrow(0, 0, piece.numel() * world), piece)) \
            if hasattr(dist, "all_gather_into_tensor") and dist.get_backend() == "nccl" else \
            (lambda: dist.all_gather(list(flat.narrow(0, 0, piece.numel() * world).chunk(world)), piece))
        def units_alone(coalesce):  # every unit, nothing to wait for (the host waits only for the GPU below)
            def run():
                opt._zero.coalesce = coalesce
                opt._zero.begin_gathers()
                opt._zero.gather_rest(lambda ks, stream: None)
            return run

        grouped = opt._zero.coalesce
        runs = [("one all-gather", gather, [])]
        if grouped:  # the default group size first, then larger ones and every unit in one group
            for cap in sorted({grouped, 4 * grouped, 1 << 62}):
                what = "in one NCCL group" if cap == 1 << 62 else "in NCCL groups of %d MiB%s" % (
                    cap >> 20, " (the default)" if cap == grouped else "")
                runs.append(("ZeRO-1's units %s" % what, units_alone(cap), []))
        runs.append(("ZeRO-1's units one by one", units_alone(0), []))
        for _, fn, into in runs:
            for _ in range(12):
                sync(device)
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                sync(device)
                into.append(time.perf_counter() - t0)
        opt._zero.finish_gathers()
        opt._zero.coalesce = grouped
        if rank == 0:
            bus = lambda s: (world - 1) / world * numel * elem / s / 1e9  # noqa: E731
            ceiling = statistics.median(runs[0][2][2:])
            print("  all-gather alone (%d units, %d in place): %s's one all-gather of the same bytes %.3f ms "
                  "(%.1f GB/s bus)" % (opt.sharding["gather_units"], opt.sharding["gather_units_in_place"],
                                       dist.get_backend(), 1e3 * ceiling, bus(ceiling)))
            for what, _, into in runs[1:]:
                ours = statistics.median(into[2:])
                print("    %-52s %.3f ms (%.1f GB/s bus): %.0f%% of it" % (what, 1e3 * ours, bus(ours), 100.0 * ceiling / ours))
            sys.stdout.flush()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2, help="processes to spawn when not under torchrun (default 2)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2, help="--bench: steps left out of the medians")
    ap.add_argument("--policy", default="offload_all", help="Ferry policy (a shipped name or a file)")
    ap.add_argument("--clip", type=float, default=0.6, help="max_grad_norm (the tiny default model's norms are "
                    "about 0.55-0.65: some steps clip)")
    ap.add_argument("--cpu-threads", type=int, default=0, help="ferry's CPU Adam workers per rank (0: its own choice)")
    ap.add_argument("--timeout", type=float, default=120.0, help="collective timeout of the optimizer, seconds")
    ap.add_argument("--check", action="store_true", help="assert bit-identical params to the unsharded optimizer")
    ap.add_argument("--bench", action="store_true", help="print the ZeRO-1 and unsharded step times")
    ap.add_argument("--overlap", action="store_true", help="opt.attach_ddp(ddp) with overlap=True: each param "
                    "group is announced once DDP's all-reduce of its grads has landed")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("ddp_zero1: --device cuda, but torch sees no GPU")
    dist_launch.launch(worker, args)


if __name__ == "__main__":
    main()
