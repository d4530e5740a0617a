#!/usr/bin/env python3
"""A Ferry checkpoint saved on W ranks and loaded on fewer (resharded), exact, with the disk's
bandwidth beside its ceiling measured in the same run.

    # CI size, on its own (spawned processes, CPU tensors, gloo): save on 2 ranks, load on 1
    PYTHONPATH=build/python python3 samples/python/ckpt_reshard.py --save-world 2 --load-worlds 1 --dir /tmp/ck
    # ~1.07B params, one GPU per rank (NCCL for the trainer; Ferry's own collectives on gloo)
    PYTHONPATH=build-gpu/python python3 samples/python/ckpt_reshard.py --device cuda --dtype bfloat16 \
        --hidden 4096 --layers 8 --save-world 4 --load-worlds 2,1 --dir /path/on/the/disk/ck

Phases, each a fresh set of processes (torch.multiprocessing; under torchrun, one phase per launch
with --phase save|load):
  save on W ranks: ferry.torch.Optimizer(shard=True) (ZeRO-1; --fsdp2: DTensor params sharded on
    dim 0, as FSDP2 registers them) steps --steps times on fresh random grads; then the disk's write
    ceiling (W processes writing plain files of about the rank files' sizes, write + fsync), then
    save_checkpoint timed between barriers; then every tensor's checksum over its full value
    (ckpt_tools.state_sums: independent of the sharding) goes to <dir>/reference.json, and one more
    step's checksums too.
  load on each R of --load-worlds: another model (other random values: the check must see them
    replaced); the read ceiling (R processes reading the ceiling files, O_DIRECT); load_checkpoint of
    <dir>/ckpt/latest timed between barriers; the checksums of params, masters, moments and steps
    must equal the saving run's, and after one more step (the same grads) those of the saving run's
    next step: the load is exact and resumes bit-identically.

Bandwidth = bytes of every rank's file and the manifest / wall time of the slowest rank. The
ceiling files are dropped from the page cache after writing (posix_fadvise DONTNEED); the engine
reads with O_DIRECT. Prints a table and writes <dir>/summary.json (--out: elsewhere). A benchmark
beside the check: it asserts exactness, never a time.
"""
import argparse
import os
import re
import shutil
import sys

import torch

import ckpt_tools as ct
import dist_launch


def build(args, rank, world, device, seed):
    """(optimizer, params, names) of the toy model; every rank the same values."""
    import ferry.torch
    dtype = getattr(torch, args.dtype)
    made = ct.make_params(args.hidden, args.layers, device, dtype, seed)
    names = [n for n, _, _ in made]
    params = [t for _, t, _ in made]
    if args.fsdp2:
        params = to_dtensors(params, world, device)
    groups = [{"params": [p for p, (_, _, g) in zip(params, made) if g == 0], "weight_decay": 0.1},
              {"params": [p for p, (_, _, g) in zip(params, made) if g == 1], "weight_decay": 0.0}]
    order = [i for g in (0, 1) for i, (_, _, gi) in enumerate(made) if gi == g]
    params = [params[i] for i in order]
    names = [names[i] for i in order]
    opt = ferry.torch.Optimizer(groups, lr=1e-3, policy=args.policy, max_grad_norm=1.0, overlap=False,
                                shard=not args.fsdp2, collective_timeout=args.timeout,
                                checkpoint_timeout=args.timeout)
    return opt, params, names


def to_dtensors(params, world, device):
    """DTensor params sharded on dim 0 over every rank (what FSDP2's fully_shard registers)."""
    from torch.distributed.device_mesh import init_device_mesh
    try:
        from torch.distributed.tensor import Shard, distribute_tensor
    except ImportError:
        from torch.distributed._tensor import Shard, distribute_tensor
    mesh = init_device_mesh(device.type, (world,))
    out = []
    for p in params:
        d = distribute_tensor(p.detach(), mesh, [Shard(0)])
        out.append(torch.nn.Parameter(d))
    return out


def set_grads(args, params, step):
    if not args.fsdp2:
        ct.set_grads(params, step)
        return
    from torch.distributed.tensor import distribute_tensor
    plain = [torch.empty(p.shape, dtype=p.dtype, device=p.to_local().device) for p in params]
    ct.set_grads(plain, step)
    for p, g in zip(params, plain):
        p.grad = distribute_tensor(g.grad, p.device_mesh, p.placements)


def step(args, opt, params, i):
    set_grads(args, params, i)
    opt.step()
    opt.zero_grad()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def estimated_file_bytes(opt, params):
    """About this rank's file: its range of each param (params' own dtype) plus fp32 master and moments."""
    total = 0
    for k, p in enumerate(params):
        b, e = opt._zero.range(k) if opt._zero is not None else (0, p.numel())
        total += (e - b) * (p.element_size() + 12)
    return -(-total // 4096) * 4096


def checkpoint_files(path):
    """[(file, bytes)] of a checkpoint directory."""
    return [(os.path.join(path, f), os.path.getsize(os.path.join(path, f))) for f in sorted(os.listdir(path))]


def save_phase(rank, world, local_rank, args):
    device = dist_launch.cuda_device(local_rank) if args.device == "cuda" else torch.device("cpu")
    opt, params, names = build(args, rank, world, device, seed=0)
    for i in range(args.steps):
        step(args, opt, params, i)
    sync(device)
    ceiling_dir = os.path.join(args.dir, "ceiling")
    root = os.path.join(args.dir, "ckpt")
    if rank == 0:
        for d in (ceiling_dir, root):
            shutil.rmtree(d, ignore_errors=True)
            os.makedirs(d)
    ct.barrier()
    # The write ceiling first: the save then runs on a disk that has just absorbed as many bytes.
    est = estimated_file_bytes(opt, params)
    _, ceiling_s = ct.timed(lambda: ct.write_ceiling(os.path.join(ceiling_dir, "rank-%05d.bin" % rank), est))
    path, save_s = ct.timed(lambda: (opt.save_checkpoint(root, args.steps), opt.wait_checkpoint())[0])
    sums = ct.state_sums(opt, params, names, device)
    step(args, opt, params, args.steps)
    after = ct.state_sums(opt, params, names, device)
    if rank == 0:
        files = checkpoint_files(path)
        ceiling = checkpoint_files(ceiling_dir)
        ct.write_json(os.path.join(args.dir, "reference.json"), {
            "world": world, "path": path, "sums": sums, "after_step": after,
            "numel": sum(p.numel() for p in params), "ckpt_bytes": sum(s for _, s in files),
            "save_s": save_s, "ceiling_bytes": sum(s for _, s in ceiling), "ceiling_write_s": ceiling_s,
            "files": [os.path.basename(f) for f, _ in files]})
        print("save on %d ranks: %s params, %d files, %.3f GB in %.3f s; write ceiling %.3f GB in %.3f s"
              % (world, "{:,}".format(sum(p.numel() for p in params)), len(files), sum(s for _, s in files) / 1e9,
                 save_s, sum(s for _, s in ceiling) / 1e9, ceiling_s), flush=True)


def load_phase(rank, world, local_rank, args):
    device = dist_launch.cuda_device(local_rank) if args.device == "cuda" else torch.device("cpu")
    ref = ct.read_json(os.path.join(args.dir, "reference.json"))
    opt, params, names = build(args, rank, world, device, seed=1)  # other values: the load must replace them
    before = ct.state_sums(opt, params, names, device)
    same = [k for k, v in ref["sums"].items() if k.endswith(".param") and before[k] == v]
    if same:
        raise AssertionError("the loading run's params before the load already match the saved ones (%s): the "
                             "check could not tell a load from none" % ", ".join(same[:3]))
    ceiling_files = checkpoint_files(os.path.join(args.dir, "ceiling"))
    threads = max(1, min(8, (os.cpu_count() or 1) // world))
    how, read_ceiling_s = ct.timed(lambda: ct.read_ranges(ct.split_reads(ceiling_files, rank, world), threads))
    root = os.path.join(args.dir, "ckpt")
    if rank == 0:
        for f, _ in checkpoint_files(ref["path"]):
            ct.evict(f)
    loaded, load_s = ct.timed(lambda: opt.load_checkpoint(root))  # a root: its `latest`
    got = ct.state_sums(opt, params, names, device)
    ct.compare_sums(got, ref["sums"], "load of %s (saved on %d ranks) on %d ranks" % (loaded, ref["world"], world))
    step(args, opt, params, args.steps)
    after = ct.state_sums(opt, params, names, device)
    ct.compare_sums(after, ref["after_step"], "one step after loading on %d ranks" % world)
    if rank == 0:
        ct.write_json(os.path.join(args.dir, "load-%d.json" % world), {
            "world": world, "load_s": load_s, "read_ceiling_s": read_ceiling_s, "read_how": how,
            "read_threads_per_rank": threads, "tensors_checked": len(got) - 1})
        print("load on %d ranks: exact (%d checksums, and the next step's); %.3f GB in %.3f s; read ceiling "
              "%.3f s (%s, %d threads per rank)" % (world, len(got) - 1, ref["ckpt_bytes"] / 1e9, load_s,
                                                    read_ceiling_s, how, threads), flush=True)


def worker(rank, world, local_rank, args):
    (save_phase if args.phase == "save" else load_phase)(rank, world, local_rank, args)


def summary(args, loads):
    ref = ct.read_json(os.path.join(args.dir, "reference.json"))
    gbs = lambda b, s: b / s / 1e9 if s > 0 else float("nan")  # noqa: E731
    write = gbs(ref["ckpt_bytes"], ref["save_s"])
    write_ceiling = gbs(ref["ceiling_bytes"], ref["ceiling_write_s"])
    out = {"params": ref["numel"], "save_world": ref["world"], "ckpt_bytes": ref["ckpt_bytes"],
           "write_GBps": write, "write_ceiling_GBps": write_ceiling, "write_ratio": write / write_ceiling,
           "loads": []}
    print("\n%-22s %10s %12s %12s %8s" % ("", "GB", "GB/s", "ceiling GB/s", "ratio"))
    print("%-22s %10.3f %12.3f %12.3f %8.3f" % ("save on %d ranks" % ref["world"], ref["ckpt_bytes"] / 1e9, write,
                                                write_ceiling, write / write_ceiling))
    for w in loads:
        ld = ct.read_json(os.path.join(args.dir, "load-%d.json" % w))
        read = gbs(ref["ckpt_bytes"], ld["load_s"])
        ceiling = gbs(ref["ceiling_bytes"], ld["read_ceiling_s"])
        out["loads"].append({"world": w, "read_GBps": read, "read_ceiling_GBps": ceiling, "ratio": read / ceiling,
                             "ceiling_read": ld["read_how"], "exact": True})
        print("%-22s %10.3f %12.3f %12.3f %8.3f" % ("load on %d ranks" % w, ref["ckpt_bytes"] / 1e9, read, ceiling,
                                                    read / ceiling))
    print("(write ceiling: %d processes, buffered writes + fsync; read ceiling: %s; every load exact)"
          % (ref["world"], ", ".join(sorted({ld["ceiling_read"] for ld in out["loads"]})) or "-"))
    ct.write_json(args.out or os.path.join(args.dir, "summary.json"), out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="work directory on the disk to measure (checkpoints, ceiling files)")
    ap.add_argument("--save-world", type=int, default=4, help="ranks that save (default 4)")
    ap.add_argument("--load-worlds", default="2,1", help="comma-separated ranks that load, in turn (default 2,1)")
    ap.add_argument("--phase", choices=["save", "load"], help="under torchrun: this launch's phase")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the weights' dtype")
    ap.add_argument("--hidden", type=int, default=32, help="model width (4096 with --layers 8: 1.07B params)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2, help="steps before the save")
    ap.add_argument("--policy", default="offload_all")
    ap.add_argument("--fsdp2", action="store_true", help="DTensor params sharded on dim 0 (torch >= 2.4) "
                    "instead of ZeRO-1")
    ap.add_argument("--timeout", type=float, default=300.0, help="collective and checkpoint timeouts, seconds")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and ceiling files")
    ap.add_argument("--out", help="summary JSON (default <dir>/summary.json)")
    args = ap.parse_args()
    args.dir = os.path.abspath(args.dir)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("ckpt_reshard: --device cuda, but torch sees no GPU")
    if args.fsdp2 and tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", torch.__version__).groups()) < (2, 4):
        sys.exit("ckpt_reshard: --fsdp2 needs torch >= 2.4 (this is %s)" % torch.__version__)
    os.makedirs(args.dir, exist_ok=True)
    if dist_launch.under_torchrun():
        if not args.phase:
            sys.exit("ckpt_reshard: under torchrun give --phase save or --phase load (one world per launch)")
        dist_launch.launch(worker, args)
        return
    loads = [int(w) for w in args.load_worlds.split(",") if w]
    args.phase, args.world = "save", args.save_world
    dist_launch.launch(worker, args)
    for w in loads:
        args.phase, args.world = "load", w
        dist_launch.launch(worker, args)
    summary(args, loads)
    if not args.keep:
        for d in ("ckpt", "ceiling"):
            shutil.rmtree(os.path.join(args.dir, d), ignore_errors=True)


if __name__ == "__main__":
    main()
