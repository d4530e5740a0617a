#!/usr/bin/env python3
"""A rank SIGKILLed under torchrun: the others end with an error naming it, nothing hangs, nothing is
left running, and the last committed checkpoint (`latest`) still verifies and loads on 2 ranks.

    # CPU, gloo (Debian's torch: /usr/bin/python3 -m torch.distributed.run is the torchrun)
    PYTHONPATH=build/python /usr/bin/python3 samples/python/kill_rank.py --dir /tmp/kill
    # CUDA, one GPU per rank (NCCL for the trainer's group; Ferry's own collectives are gloo)
    PYTHONPATH=build-gpu/python python3 samples/python/kill_rank.py --device cuda --dir $OUT/kill

For each case (--cases, default both), the driver starts `torchrun --nproc_per_node 4` in a session of
its own, running this file with --worker: ZeRO-1 (ferry.torch.Optimizer(shard=True)) over a small
model, a synchronous checkpoint at step 2 whose checksums (ckpt_tools.state_sums) rank 0 records,
then at step 4 rank --victim (default 2) kills itself with SIGKILL:
  step: inside the optimizer's step, in the engine's grad-check all-reduce (the other ranks are in it);
  save: during an asynchronous save of step 4 (a policy with checkpoint() async = true), in the
        engine's writer thread, at its second collective of the checkpoint protocol (its file is
        written, the commit not made); the other ranks wait for the save (wait_checkpoint).
Then the driver checks, and exits non-zero naming what failed:
  * torchrun exits non-zero, reporting the victim's exit by SIGKILL;
  * every other rank raised an error whose text names the victim ("rank 2 of 4"), each recorded in
    <dir>/<case>/error-rank-N.txt by the worker's except clause before it exits;
  * the whole launch ended within --timeout (the collective and checkpoint timeout) + --margin
    seconds of the kill;
  * no process of the launch is left: none of the workers' pids (each wrote its own) and nothing
    in torchrun's session;
  * `latest` still names step 2 (a checkpoint killed mid-save is never committed), and a second
    torchrun on 2 ranks loads it, finds every checksum equal to the saving run's, and saves again
    (which collects the killed save's leftover step-4.incomplete).
"""
import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

ASYNC_POLICY = """
return {
  place = function(groups, ctx) local out = {} for _, g in ipairs(groups) do out[g.name] = "cpu" end return out end,
  checkpoint = function(info, ctx) return { skip = {}, async = true, keep_last = 0 } end,
}
"""
SAVED_AT, KILL_AT, STEPS = 2, 4, 8


# ---- the workers (under torchrun) ------------------------------------------------------------------

def arm_kill(case, victim_collective):
    """Makes this process SIGKILL itself at the engine's next grad-check all-reduce (case step) or at
    the `victim_collective`-th collective of the checkpoint writer's comm (case save)."""
    from ferry import distributed as fdist
    calls = [0]

    def die(what):
        with open(os.environ["KILL_MARK"], "w") as f:
            f.write("%.6f %s\n" % (time.time(), what))
        os.kill(os.getpid(), signal.SIGKILL)

    for name in ("all_reduce", "all_gather", "broadcast", "barrier"):
        orig = getattr(fdist.TorchComm, name)

        def wrapped(self, *a, _orig=orig, _name=name):
            writer = self._channel.endswith("d")  # the duplicate: the checkpoint writer's thread
            if case == "step" and not writer and _name == "all_reduce":
                die("in step(): the engine's all_reduce")
            if case == "save" and writer:
                calls[0] += 1
                if calls[0] == victim_collective:
                    die("in the async save's writer thread: its %s (collective %d of the save)" % (_name, calls[0]))
            return _orig(self, *a)
        setattr(fdist.TorchComm, name, wrapped)


def train(rank, world, local_rank, args):
    import torch
    import ckpt_tools as ct
    import dist_launch
    import ferry.torch
    device = dist_launch.cuda_device(local_rank) if args.device == "cuda" else torch.device("cpu")
    made = ct.make_params(args.hidden, 2, device, torch.float32, seed=0)
    params, names = [t for _, t, _ in made], [n for n, _, _ in made]
    policy = "offload_all"
    if args.case == "save":
        policy = os.path.join(args.dir, "async.lua")
    root = os.path.join(os.path.dirname(args.dir), "ckpt-" + args.case)
    opt = ferry.torch.Optimizer(params, lr=1e-3, policy=policy, shard=True, overlap=False,
                                collective_timeout=args.timeout, checkpoint_timeout=args.timeout)
    for step in range(STEPS):
        if step == KILL_AT and rank == args.victim and args.case == "step":
            arm_kill(args.case, 2)
        ct.set_grads(params, step)
        opt.step()
        opt.zero_grad()
        if step + 1 == SAVED_AT:
            opt.save_checkpoint(root, SAVED_AT)
            opt.wait_checkpoint()
            sums = ct.state_sums(opt, params, names, device)
            if rank == 0:
                ct.write_json(os.path.join(args.dir, "reference.json"), {"step": SAVED_AT, "sums": sums})
        if step + 1 == KILL_AT and args.case == "save":
            if rank == args.victim:
                arm_kill(args.case, 2)
            opt.save_checkpoint(root, KILL_AT)  # asynchronous: returns while the writer thread saves
            # Wait here rather than step on: this case checks what the save's own collectives say.
            # (A step would name the victim too: its collectives' waits look up the ranks' processes;
            # with NCCL, all-gathers queued on the GPU behind the dead rank stall the stream instead.)
            # Steps overlapping a writer: tests/python/test_dist_zero.py.
            opt.wait_checkpoint()
    opt.wait_checkpoint()
    raise AssertionError("rank %d: the run went on to its end: the victim (rank %d) was not killed"
                         % (rank, args.victim))


def load(rank, world, local_rank, args):
    """For each case of args.case (comma-separated): `latest` of its root loads, with the checksums
    its saving run recorded; one step and a save follow, which collects the killed save's leftovers."""
    import torch
    import ckpt_tools as ct
    import dist_launch
    import ferry.torch
    device = dist_launch.cuda_device(local_rank) if args.device == "cuda" else torch.device("cpu")
    for case in args.case.split(","):
        made = ct.make_params(args.hidden, 2, device, torch.float32, seed=1)
        params, names = [t for _, t, _ in made], [n for n, _, _ in made]
        opt = ferry.torch.Optimizer(params, lr=1e-3, policy="offload_all", shard=True, overlap=False,
                                    collective_timeout=args.timeout, checkpoint_timeout=args.timeout)
        root = os.path.join(args.dir, "ckpt-" + case)
        ref = ct.read_json(os.path.join(args.dir, case, "reference.json"))
        loaded = opt.load_checkpoint(root)  # a root: its `latest`
        if os.path.basename(loaded) != "step-%08d" % ref["step"]:
            raise AssertionError("%s: latest loaded %s, expected step %d (the last committed save)"
                                 % (case, loaded, ref["step"]))
        ct.compare_sums(ct.state_sums(opt, params, names, device), ref["sums"],
                        "%s: latest (%s) loaded on %d ranks after the kill" % (case, loaded, world))
        ct.set_grads(params, 100)
        opt.step()
        opt.save_checkpoint(root, 100)  # collects the killed save's leftovers
        opt.wait_checkpoint()
        if rank == 0:
            left = [d for d in os.listdir(root) if d.endswith((".incomplete", ".deleting"))]
            if left:
                raise AssertionError("%s: leftovers of the killed save not collected by the next save: %s"
                                     % (case, left))
            print("kill_rank: %s: latest (%s) verified and loaded on %d ranks; the next save collected the "
                  "leftovers" % (case, os.path.basename(loaded), world), flush=True)


def worker_main(args):
    import dist_launch
    if not args.load:
        with open(os.path.join(args.dir, "pid-rank-%s.txt" % os.environ["RANK"]), "w") as f:
            f.write("%d\n" % os.getpid())
    os.environ["KILL_MARK"] = os.path.join(args.dir, "killed.txt")

    def run(rank, world, local_rank, args):
        try:
            (load if args.load else train)(rank, world, local_rank, args)
        except BaseException as e:
            with open(os.path.join(args.dir, "error-rank-%d.txt" % rank), "w") as f:  # the driver reads it
                f.write("%.6f %s: %s\n" % (time.time(), type(e).__name__, e))
            raise
    dist_launch.launch(run, args)


# ---- the driver -----------------------------------------------------------------------------------

def torchrun_cmd(args, nproc, extra):
    launcher = args.torchrun.split() if args.torchrun else [sys.executable, "-m", "torch.distributed.run"]
    # --redirects 1 --tee 1: the workers' stdout also lands in files under --log_dir. Not for its own
    # sake: torch 1.13's torchrun on Python 3.11 fails with the default (0: its Std flag lookup finds
    # no member for 0 there); 1 works on every version.
    logs = os.path.join(args.dir, "torchrun-logs-%d" % nproc)
    return launcher + ["--standalone", "--nproc_per_node", str(nproc), "--monitor_interval", str(args.monitor),
                       "--redirects", "1", "--tee", "1", "--log_dir", logs,
                       os.path.abspath(__file__), "--worker", "--device", args.device, "--timeout", str(args.timeout),
                       "--victim", str(args.victim), "--hidden", str(args.hidden)] + extra


def session_procs(sid):
    """Pids of the live processes (not zombies) of session `sid`."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % d) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # fields after the name: state, ppid, pgrp, session
            out.append(int(d))
    return out


def alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def run_case(args, case, failures):
    d = os.path.join(args.dir, case)
    shutil.rmtree(d, ignore_errors=True)
    shutil.rmtree(os.path.join(args.dir, "ckpt-" + case), ignore_errors=True)
    os.makedirs(d)
    with open(os.path.join(d, "async.lua"), "w") as f:
        f.write(ASYNC_POLICY)
    log = os.path.join(d, "torchrun.log")
    start = time.time()
    with open(log, "w") as out:
        proc = subprocess.Popen(torchrun_cmd(args, args.world, ["--case", case, "--dir", d]), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        limit = args.startup + args.timeout + args.margin
        try:
            code = proc.wait(limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    end = time.time()
    text = open(log).read()
    fail = lambda msg: failures.append("%s: %s" % (case, msg))  # noqa: E731
    left = session_procs(proc.pid)
    pids = {}
    for r in range(args.world):
        try:
            pids[r] = int(open(os.path.join(d, "pid-rank-%d.txt" % r)).read())
        except OSError:
            fail("rank %d never started (no pid file)" % r)
    orphans = sorted({p for p in pids.values() if alive(p)} | set(left))
    if orphans:
        fail("processes left running after torchrun exited: %s" % orphans)
        for p in orphans:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
    if code is None:
        fail("torchrun still running %.0f s after its start: a hang (killed)" % limit)
    elif code == 0:
        fail("torchrun exited 0")
    try:
        killed_at, how = open(os.path.join(d, "killed.txt")).read().split(" ", 1)
        killed_at = float(killed_at)
    except OSError:
        fail("the victim (rank %d) never killed itself" % args.victim)
        print(text[-4000:])
        return
    codes = {int(r): int(c) for r, c in re.findall(r"rank\s*:\s*(\d+) \(local_rank[^\n]*\n\s*exitcode\s*:\s*(-?\d+)",
                                                     text)}
    # A survivor exits 1 on its own once its collective names the lost rank (checked below, from its
    # error file), or is stopped by torchrun's SIGTERM first (torchrun >= 2.x ends the other workers as
    # soon as one fails): listed with -15, or not at all by torch 1.13's torchrun, which lists only the
    # failures of the moment it noticed the first. The lost rank is listed with -9, or not at all when a
    # survivor's own exit was noticed first; a survivor that wrote no error needs that -9 in the report.
    for r in range(args.world):
        want = (-9, None) if r == args.victim else (1, -15, None)
        if codes.get(r) not in want:
            fail("torchrun reports rank %d's exit code as %s, expected %s" % (
                r, codes.get(r), "-9 (SIGKILL) or none" if r == args.victim else
                "1 (its own error), or -15 or none (stopped by torchrun)"))
    silent = [r for r in range(args.world)
              if r != args.victim and not os.path.exists(os.path.join(d, "error-rank-%d.txt" % r))]
    if silent and codes.get(args.victim) != -9:
        fail("rank(s) %s wrote no error and torchrun's report has no SIGKILL of rank %d; its log: %s"
             % (silent, args.victim, log))

    print("%s: rank %d SIGKILLed %s; torchrun exited %s %.1f s later" % (case, args.victim, how.strip(), code,
                                                                        end - killed_at))
    if end - killed_at > args.timeout + args.margin:
        fail("the launch ended %.1f s after the kill, over the timeout %.0f s + %.0f s" % (end - killed_at,
                                                                                       args.timeout, args.margin))
    victim_text = "rank %d of %d" % (args.victim, args.world)
    for r in range(args.world):
        if r == args.victim:
            continue
        path = os.path.join(d, "error-rank-%d.txt" % r)
        if not os.path.exists(path):
            if codes.get(r) in (-15, None):
                print("  rank %d: stopped by torchrun (SIGTERM) before its collective failed; torchrun "
                      "reports rank %d's SIGKILL" % (r, args.victim))
            else:
                fail("rank %d left no error and was not stopped by torchrun" % r)
            continue
        at, message = open(path).read().split(" ", 1)
        print("  rank %d after %.2f s: %s" % (r, float(at) - killed_at, message.strip()[:400]))
        if victim_text not in message:
            fail("rank %d's error does not name %s: %s" % (r, victim_text, message.strip()[:600]))
    if failures:
        print(text[-6000:])
    print("%s: %.1f s in all" % (case, time.time() - start), flush=True)


def verify_latest(args, cases, failures):
    """One torchrun on 2 ranks: each case's `latest` loads exactly (see load())."""
    out = subprocess.run(torchrun_cmd(args, 2, ["--case", ",".join(cases), "--dir", args.dir, "--load"]),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=args.startup + args.timeout + args.margin, start_new_session=True)
    if out.returncode != 0:
        failures.append("latest did not load on 2 ranks (exit %d):\n%s" % (out.returncode, out.stdout[-4000:]))
    else:
        print("\n".join(l.split("]:", 1)[-1] for l in out.stdout.splitlines() if "kill_rank:" in l))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="work directory (logs, checkpoints); default a temporary one, removed")
    ap.add_argument("--cases", default="step,save")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--victim", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=20.0, help="the optimizer's collective and checkpoint timeouts")
    ap.add_argument("--margin", type=float, default=15.0, help="seconds allowed past the timeout (exits, teardown)")
    ap.add_argument("--startup", type=float, default=60.0, help="seconds allowed for torchrun to start the ranks")
    ap.add_argument("--monitor", type=float, default=5.0, help="torchrun's --monitor_interval (its poll of the "
                    "workers: once it sees the victim dead it SIGTERMs the rest)")
    ap.add_argument("--torchrun", help="the launcher (default: this python -m torch.distributed.run)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--load", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--case", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker_main(args)
        return
    tmp = None
    if not args.dir:
        import tempfile
        tmp = args.dir = tempfile.mkdtemp(prefix="ferry-kill-")
    args.dir = os.path.abspath(args.dir)
    failures = []
    cases = args.cases.split(",")
    for case in cases:
        run_case(args, case, failures)
    verify_latest(args, cases, failures)
    if failures:
        sys.exit("kill_rank FAILED:\n  " + "\n  ".join(failures))
    print("kill_rank: every check passed (%s)" % args.cases)
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
