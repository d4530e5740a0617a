"""How the several-rank samples (ddp_zero1.py, fsdp2_sample.py) start their ranks: under torchrun
(RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR in the environment: env:// rendezvous), or on their own
with `--world N`: N processes from torch.multiprocessing.spawn that meet through a FileStore in a
temporary directory (nothing leaves the machine, no port to pick).

    launch(worker, args)   # calls worker(rank, world, local_rank, args) in every rank's process

The process group's backend: gloo for CPU tensors; for CUDA, NCCL when every rank of this host has a
GPU of its own, else gloo (NCCL refuses two ranks on one device; gloo runs collectives on CUDA
tensors by staging them through host memory). `backend_for` says which, and why, in one line.
"""
import datetime
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def under_torchrun():
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


def local_world(world):
    """How many ranks run on this host."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world)) if under_torchrun() else world


def backend_for(device, local_world):
    """(backend, reason) of the trainer's process group for `device` ("cpu" or "cuda")."""
    if device == "cpu":
        return "gloo", "CPU tensors"
    gpus = torch.cuda.device_count()
    if gpus >= local_world:
        return "nccl", "%d ranks on this host, %d GPUs: one GPU per rank" % (local_world, gpus)
    return "gloo", ("%d ranks on this host share %d GPU(s): NCCL refuses two ranks on one device, so the "
                    "process group is gloo (CUDA tensors staged through host memory)" % (local_world, gpus))


def cuda_device(local_rank):
    """This rank's GPU: its own, or (ranks sharing GPUs) local_rank modulo the GPUs."""
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _spawned(rank, world, store, worker, args):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Every spawned rank is on this host: say so as torchrun would (Ferry splits the host by it, and an
    # engine without a comm, a DDP rank's, names its trace file by RANK).
    os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = str(rank), str(world)
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    backend, _ = backend_for(args.device, world)
    if backend == "nccl":
        cuda_device(rank)
    dist.init_process_group(backend, init_method="file://" + store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        worker(rank, world, rank, args)
    finally:
        dist.destroy_process_group()


def launch(worker, args):
    """Runs worker(rank, world, local_rank, args) on every rank: torchrun's, or args.world spawned
    processes. An exception in any rank ends the launch with it (non-zero exit)."""
    if under_torchrun():
        rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
        backend, _ = backend_for(args.device, local_world(world))
        if backend == "nccl":
            cuda_device(local)
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
        try:
            worker(rank, world, local, args)
        finally:
            dist.destroy_process_group()
        return
    tmp = tempfile.mkdtemp(prefix="ferry-sample-")
    try:
        mp.spawn(_spawned, args=(args.world, os.path.join(tmp, "store"), worker, args), nprocs=args.world, join=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
