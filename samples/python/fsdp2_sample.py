#!/usr/bin/env python3
"""FSDP2 (torch.distributed fsdp `fully_shard`, torch >= 2.4) with ferry.torch.Optimizer: each block
and the root are fully_shard'ed, so every param is a DTensor sharded on dim 0; Ferry registers each
param's local rows (the global shape, the flattened range, the local tensor's storage) and steps them
in place, where FSDP2's next all-gather reads them. FSDP2 reduce-scatters the grads; Ferry's clip
is global across ranks (one small all-reduce).

    # on its own: 2 processes (torch.multiprocessing), CPU tensors, gloo
    PYTHONPATH=build/python python3 samples/python/fsdp2_sample.py --world 2 --check
    # under torchrun, one GPU per rank (NCCL)
    PYTHONPATH=build/python torchrun --nproc-per-node 2 samples/python/fsdp2_sample.py --device cuda --check

--check: every rank also steps an unsharded ferry.torch.Optimizer over a whole copy of the model
with the same grads (FSDP2's, gathered with full_tensor()), and asserts after every step that the
FSDP2 params (gathered) are the same bits. On CUDA, FSDP2 needs a GPU per rank here (its collectives
run on NCCL; ranks sharing one GPU: use --device cpu). On torch without FSDP2 this exits with a
message.
"""
import argparse
import re
import sys

import torch
import torch.distributed as dist

import dist_launch
from ddp_zero1 import check_same, forward_backward, lr_at, make_model, sync


def fsdp2():
    """(fully_shard, init_device_mesh), or None before torch 2.4 (fully_shard: torch.distributed.fsdp
    from 2.6, torch.distributed._composable.fsdp in 2.4-2.5)."""
    if tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", torch.__version__).groups()) < (2, 4):
        return None
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    return fully_shard, init_device_mesh


def worker(rank, world, local_rank, args):
    import ferry.torch
    fully_shard, init_device_mesh = fsdp2()
    device = dist_launch.cuda_device(local_rank) if args.device == "cuda" else torch.device("cpu")
    dtype = getattr(torch, args.dtype)
    mesh = init_device_mesh(device.type, (world,))
    model = make_model(args, device, dtype)
    ref_model = None
    if args.check:
        ref_model = make_model(args, device, dtype)  # the same seed: the same weights, whole
    for block in list(model)[:-1]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())  # DTensors: this rank's rows of each param
    opt = ferry.torch.Optimizer(params, lr=lr_at(0, args.steps), weight_decay=0.1, policy=args.policy,
                                max_grad_norm=args.clip, collective_timeout=args.timeout)
    ref = None
    if ref_model is not None:
        ref = ferry.torch.Optimizer(ref_model.parameters(), lr=lr_at(0, args.steps), weight_decay=0.1,
                                    policy=args.policy, max_grad_norm=args.clip, overlap=False)
    info = opt.sharding
    numel = sum(p.numel() for p in params)
    if rank == 0:
        print("fsdp2_sample: %d ranks, %s params (%s on %s), process group %s; FSDP2 DTensor params: %d, this rank "
              "steps %s elements" % (world, "{:,}".format(numel), args.dtype, device.type, dist.get_backend(),
                                     info["dtensor"], "{:,}".format(info["local_numel"])))
    gen = torch.Generator().manual_seed(1000 + rank)
    for step in range(args.steps):
        loss = forward_backward(model, (opt, ref), step, args, gen, device, dtype)
        if ref is not None:
            with torch.no_grad():
                for p, q in zip(params, ref_model.parameters()):
                    q.grad = p.grad.full_tensor()  # FSDP2's reduce-scattered grads, whole (collective)
        opt.step()
        stats = opt.stats()
        opt.zero_grad()
        if ref is not None:
            ref.step()
            ref.zero_grad()
            sync(device)
            with torch.no_grad():
                check_same(step, rank, [p.full_tensor() for p in params], list(ref_model.parameters()))
        if rank == 0 and (step % max(1, args.steps // 5) == 0 or step == args.steps - 1):
            print("step %3d  loss %.5f  grad norm %.4f%s" % (step, loss.item(), stats["last_grad_norm"],
                                                          " (clipped)" if stats["last_grad_norm"] > args.clip else ""))
    if args.check and rank == 0:
        print("check passed: FSDP2 + Ferry over %d ranks is bit-identical to the unsharded optimizer over %d steps "
              "(clipping, lr schedule) on every rank" % (world, args.steps))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2, help="processes to spawn when not under torchrun (default 2)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--hidden", type=int, default=48)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--policy", default="offload_all", help="Ferry policy (a shipped name or a file)")
    ap.add_argument("--clip", type=float, default=0.6, help="max_grad_norm")
    ap.add_argument("--timeout", type=float, default=120.0, help="collective timeout of the optimizer, seconds")
    ap.add_argument("--check", action="store_true", help="assert bit-identical params to the unsharded optimizer")
    args = ap.parse_args()
    if fsdp2() is None:
        sys.exit("fsdp2_sample: torch %s has no FSDP2 (fully_shard needs torch >= 2.4); see ddp_zero1.py for "
                 "DDP + ZeRO-1, which runs on any torch" % torch.__version__)
    if args.device == "cuda":
        world = dist_launch.local_world(args.world)
        if not torch.cuda.is_available() or torch.cuda.device_count() < world:
            sys.exit("fsdp2_sample: --device cuda needs a GPU per rank on this host (FSDP2's collectives run on "
                     "NCCL, which refuses two ranks on one GPU); torch sees %d. Use --device cpu"
                     % (torch.cuda.device_count() if torch.cuda.is_available() else 0))
    dist_launch.launch(worker, args)


if __name__ == "__main__":
    main()
