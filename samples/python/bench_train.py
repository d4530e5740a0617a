#!/usr/bin/env python3
"""A real training loop, timed as a trainer runs it: a plain torch transformer, forward, backward and
optimizer step, with no host synchronization inside the loop (the host runs ahead of its GPU, as
production loops do). Prints the iteration time of each optimizer row beside the all-GPU iterations
of the same model and loop in the same run (Ferry's `all_gpu` row and torch's AdamW) and its ratios:

    torch AdamW (fused)          state on the GPU (torch's fused kernel where the build has it)
    ferry all_gpu                Ferry's GPU Adam, state on the GPU
    ferry offload                fp32 state in pinned host memory, step() only
    ferry offload + overlap      the same, buckets (or groups) announced from grad hooks during backward
    ferry offload bf16 (+ overlap)  bf16 moments (8 B of host state per param), without and with overlap
    ferry offload 50% (start) + overlap  offload_fraction 0.5: whole groups from the end of the parameter
                                 order (the head and the last blocks, whose grads come first in a
                                 backward: the policy's default), or from its start (the embeddings
                                 and the first blocks, which the next forward needs first)
    ferry memory_budget half (largest) + overlap  memory_budget with GPU room for half the state: its
                                 default order (from the end) or order=largest (the largest groups first)

Beside each offloaded row, its bound: the offloaded step measured alone (the GPU idle, the grads
ready: CPU Adam and the copies). When that bound exceeds forward + backward (also measured alone),
no overlap can bring the iteration down to the all-GPU one: the row says which case it is. With
overlap the CPU work can start only when the first announced bucket's grads are final (the head's,
after the forward and the head's backward), and with deferred steps the work left when the backward
ends runs beside the next forward: a CPU-bound overlapped iteration takes about the step alone plus
the time CPU Adam has nothing to do (the forward to the first bucket's grads). The run measures that
wait (the forward of the module whose param a backward finishes first, to its grad: FirstGradsWait)
and shows each overlapped row against the larger of forward + backward and the step alone plus it.

The loop's shape, the same for every row of a run (torch's AdamW row included) and named in the table
(a ferry.torch that overlaps by buckets of --bucket-mb MiB announces them whatever the groups; an older
one announces whole groups, so fewer groups start CPU Adam later):
    --groups block     the embeddings, a group per transformer block, the final norm with the head (14
                       groups at 735M; the default; `split` is its older name); `joined`: the embeddings
                       with the head (their grads are final last: CPU Adam starts one block later)
    --groups one       Optimizer(model.parameters(), ...): one group
    --groups decay     two groups as nanoGPT's and HF Trainer's configure_optimizers make them: params
                       of dim >= 2 with weight_decay 0.1, the rest (biases, norms) with 0
    --groups one,decay,block   several: each round runs every grouping's rows in turn (with --repeat N,
                       N rounds), and the run ends with each row's median per grouping and the spread
                       between them: on a host whose CPU Adam rate moves from run to run, the groupings
                       compared in one process, alternated
    --clip opt         between backward and step, opt.clip_grad_norm_(1e9) (ferry rows) or
                       torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9) (torch's): never reached
    --clip reached     the same calls with max_norm 1e-3: reached at every step (checked on the norms
                       the calls return; the run fails otherwise)
    --no-check-finite  ferry rows without the NaN/Inf check (check_finite=False, as torch's AdamW):
                       step() then decides at once, and what CPU Adam has not begun updates in place
    --amp fp16         fp32 params, forward under autocast(fp16), loss scaled by torch's GradScaler:
                       scaler.scale(loss).backward(); scaler.step(opt); scaler.update() (torch's row
                       calls scaler.unscale_(opt) before its clip; ferry's optimizer takes the scale
                       itself). Without --amp the params are bf16 and nothing is autocast. CUDA only:
                       on the CPU the same loop runs without autocast and with the scaler disabled.

    python3 samples/python/bench_train.py                        # the 735M model (dim 2048, 12 blocks)
    python3 samples/python/bench_train.py --size all             # small, medium and large
    python3 samples/python/bench_train.py --groups decay --clip reached --amp fp16   # nanoGPT's loop
    python3 samples/python/bench_train.py --check-exact          # losses bit-identical across rows
    python3 samples/python/bench_train.py --compile --groups decay   # torch.compile(model), torch >= 2.0
    python3 samples/python/bench_train.py --groups one,decay,block --rows 1,2,3 --repeat 3   # the spread
    python3 samples/python/bench_train.py --device cpu --size tiny --steps 2   # smoke (host backend)

A benchmark, not a test: it asserts nothing about time; --check-exact exits non-zero when the losses of
the fp32 Ferry rows differ from ferry all_gpu's in any bit (that row runs first whatever --rows picks)
or when no row was compared.
"""
import argparse
import gc
import inspect
import os
import re
import statistics
import sys
import time

import torch

import ferry
import ferry.torch

from bench_bounds import compute_alone
from bench_report import check_losses, cpu_text, cpu_update, print_medians, print_spread, print_table
from bench_model import CLIP_NORMS, LAYOUTS, SIZES, VOCAB, Loop, Model
import bench_threads


def has_option(name):
    return name in inspect.signature(ferry.torch.Optimizer.__init__).parameters


def state_later_arg(text):
    """--state-later: 'off', 'auto' or a fraction in (0, 1] (ferry.torch's state_later=)."""
    if text in ("off", "auto"):
        return text
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError("'%s' is not off, auto or a fraction in (0, 1]" % text)
    return value


def has_overlap_option():
    return has_option("overlap")


class Announcer:
    """Announces each param group from post-accumulate-grad hooks when its last grad is final (for a
    ferry.torch without the `overlap` option)."""

    def __init__(self, opt, groups):
        self.opt, self.sizes, self.count, self.handles = opt, [len(g["params"]) for g in groups], {}, []
        for gi, g in enumerate(groups):
            for p in g["params"]:
                self.handles.append(p.register_post_accumulate_grad_hook(lambda _p, gi=gi: self.hook(gi)))

    def hook(self, gi):
        n = self.count.get(gi, 0) + 1
        self.count[gi] = n
        if n == self.sizes[gi]:
            self.opt.grads_ready(gi)

    def reset(self):
        self.count.clear()

    def remove(self):
        for h in self.handles:
            h.remove()


def row_slug(row):
    """A row's name in file names: 'offload_overlap' for 'ferry offload + overlap'."""
    return "_".join(w for w in re.split(r"[^a-z0-9]+", row["name"].lower()) if w and w != "ferry")


def trace_path(path, row):
    """Each ferry row's own trace: 'run.json' -> 'run.offload_overlap.json' for 'ferry offload + overlap'."""
    if not path:
        return ""
    root, ext = os.path.splitext(path)
    return "%s.%s%s" % (root, row_slug(row), ext or ".json")


def make_optimizer(row, model, loop, args):
    """(optimizer, Announcer or None), or (None, why the row is skipped)."""
    groups = model.param_groups(loop.groups)
    kw = dict(lr=args.lr, weight_decay=0.1)
    if row["kind"] == "torch":
        fused = {"fused": True} if "fused" in inspect.signature(torch.optim.AdamW).parameters and \
            args.device == "cuda" else {}
        return torch.optim.AdamW(groups, **kw, **fused), None
    policy_args = row.get("policy_args")
    if row.get("gpu_room"):  # memory_budget's budget: that share of the model's fp32 state (12 B per param)
        numel = sum(p.numel() for p in model.parameters())
        policy_args = dict(policy_args, budget=str(int(12 * numel * row["gpu_room"])))
    extra = {"policy": row["policy"], "policy_args": policy_args, "trace_path": trace_path(args.trace, row)}
    if args.cpu_threads:
        extra["cpu_threads"] = args.cpu_threads
    if args.trainer_threads >= 0 and has_option("trainer_threads"):
        extra["trainer_threads"] = args.trainer_threads
    if args.chunk_bytes:
        extra["transfer_chunk_bytes"] = args.chunk_bytes
    if args.spare is not None and row.get("overlap") and has_option("spare_state"):
        extra["spare_state"] = args.spare
    if args.state_later is not None and has_option("state_later"):
        extra["state_later"] = args.state_later
    if args.bucket_mb and has_option("bucket_mb"):
        extra["bucket_mb"] = args.bucket_mb
    if args.no_check_finite:
        extra["check_finite"] = False
    announcer = None
    if has_overlap_option():
        extra["overlap"] = row.get("overlap", False)
    opt = ferry.torch.Optimizer(groups, **kw, **extra)
    if loop.autocast and not getattr(opt, "_step_supports_amp_scaling", False):
        del opt
        gc.collect()
        return None, "ferry.torch does not take GradScaler's scale yet"
    if row.get("overlap") and has_overlap_option() and not args.no_attach:
        # Each layer's forward waits only for its own params' uploads (each block's, with --attach-units).
        opt.attach(model, units=model.blocks) if args.attach_units else opt.attach(model)
    if row.get("overlap") and not has_overlap_option():
        if not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
            return None, "needs torch >= 2.1 (post-accumulate-grad hooks) or ferry.torch's overlap option"
        announcer = Announcer(opt, opt.param_groups)
    return opt, announcer


def run_row(row, model, init, data, loop, args):
    """Iteration time (s), losses (a CPU tensor), the offloaded step alone (s, or None), and None or
    why the row was skipped. Sets row["deferred"], row["clip"] (clip_verdict's) and row["cpu"]
    (cpu_update's, over the timed steps)."""
    model.load_state_dict(init)
    for p in model.parameters():
        p.grad = None  # an optimizer adopts the grads it finds; each row starts from none
    opt, announcer = make_optimizer(row, model, loop, args)
    if opt is None:
        return None, None, None, announcer
    loop.fresh()  # --compile: compiled with this row's hooks
    scaler, kind = loop.scaler(), row["kind"]
    row["placed"] = placed_share(opt) if kind == "ferry" else None
    losses, norms = [], []
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    sync()
    t0, before = None, None
    for it in range(args.warmup + args.steps):
        if it == args.warmup:
            sync()
            t0 = time.perf_counter()
            before = opt.stats() if kind == "ferry" else None
            threads0 = bench_threads.snapshot()
        if isinstance(announcer, Announcer):
            announcer.reset()
        loss = loop.backward(model, data[it % len(data)], opt, kind, scaler, norms)
        loop.step(opt, scaler)
        opt.zero_grad(set_to_none=kind == "torch")
        losses.append(loss.detach())
    iteration, after, row["threads"], row["tail"] = end_window(opt, kind == "ferry", sync, t0, threads0,
                                                               args.steps)
    deferred = after.get("deferred_steps", 0) if after else 0
    row["cpu"] = cpu_update(before, after, args.steps) if after else None
    alone = None
    if row.get("offloaded") and not row.get("overlap") and args.device == "cuda":
        # The offloaded step alone: grads final, the GPU idle (one backward and the loop's clip call,
        # then synchronized steps on the same grads; each step is timed by itself).
        times = []
        for _ in range(3):
            opt.zero_grad()
            loop.backward(model, data[0], opt, kind, scaler, [])
            sync()
            t = time.perf_counter()
            loop.step(opt, scaler)
            sync()
            times.append(time.perf_counter() - t)
        alone = statistics.median(times)
    if isinstance(announcer, Announcer):
        announcer.remove()
    del opt
    gc.collect()
    row["deferred"] = deferred
    row["clip"] = loop.clip_verdict(norms)
    return iteration, torch.stack(losses).float().cpu(), alone, None


def placed_share(opt):
    """(share of the params offloaded, offloaded groups, groups) from opt.placement(), or None where
    this ferry.torch has no placement(). Placement is by param group: with one group, `offload_fraction`
    offloads all of it or nothing."""
    if not hasattr(opt, "placement"):
        return None
    groups = opt.placement()
    total = sum(g["numel"] for g in groups)
    off = [g for g in groups if g["offloaded"]]
    return (sum(g["numel"] for g in off) / total if total else 0.0), len(off), len(groups)


def end_window(opt, is_ferry, sync, t0, threads0, steps):
    """The end of a row's timed window: (mean iteration in s since t0, the optimizer's stats then for a
    ferry row, bench_threads.use() since the snapshot threads0, the tail in s). The window ends in the
    phase of the loop it began in: the GPU idle after a step whose deferred update may still run on the
    host (at t0 the warm-up's last one, which the first timed forward overlaps), so it holds `steps`
    iterations of a long loop; waiting for the last step's update too would count one update's tail
    twice. The tail: that update's wait, done after the window (before the step-alone timing or the
    next row)."""
    sync()
    t1 = time.perf_counter()
    stats = opt.stats() if is_ferry else None
    threads = bench_threads.use(threads0, bench_threads.snapshot(), steps)
    if is_ferry:
        opt.wait_params()
        sync()
    return (t1 - t0) / steps, stats, threads, time.perf_counter() - t1


REFERENCE = "ferry all_gpu"  # --check-exact: every exact row's losses are compared with this row's


def rows_for(args):
    rows = [
        {"name": "torch AdamW (fused)", "kind": "torch"},
        {"name": "ferry all_gpu", "kind": "ferry", "policy": "all_gpu", "exact": True},
        {"name": "ferry offload", "kind": "ferry", "policy": "offload_all", "offloaded": True, "exact": True},
        {"name": "ferry offload + overlap", "kind": "ferry", "policy": "offload_all", "offloaded": True,
         "overlap": True, "exact": True},
        {"name": "ferry offload bf16", "kind": "ferry", "policy": "offload_bf16_moments", "offloaded": True},
        {"name": "ferry offload bf16 + overlap", "kind": "ferry", "policy": "offload_bf16_moments", "offloaded": True, "overlap": True},
        # Half the groups' bytes offloaded (a group is the unit of placement: with one group the policy
        # offloads all of it or none), taken from the end of the parameter order (the policy's default:
        # the head and the last blocks, whose grads come first in a backward and params last in a forward).
        {"name": "ferry offload 50% + overlap", "kind": "ferry", "policy": "offload_fraction",
         "policy_args": {"fraction": "0.5"}, "offloaded": True, "overlap": True, "exact": True},
        # The same share from the start (the embeddings and first blocks: the policy's rule before).
        {"name": "ferry offload 50% start + overlap", "kind": "ferry", "policy": "offload_fraction",
         "policy_args": {"fraction": "0.5", "from": "start"}, "offloaded": True, "overlap": True,
         "exact": True},
        # memory_budget given room on the GPU for half the state: its default walks from the end of the
        # parameter order (and gives back what it overshot); order=largest, the rule before, offloads the
        # largest groups first (the embeddings and the head, then the first blocks).
        {"name": "ferry memory_budget half + overlap", "kind": "ferry", "policy": "memory_budget",
         "policy_args": {"reserve": "0"}, "gpu_room": 0.5, "offloaded": True, "overlap": True, "exact": True},
        {"name": "ferry memory_budget half largest + overlap", "kind": "ferry", "policy": "memory_budget",
         "policy_args": {"reserve": "0", "order": "largest"}, "gpu_room": 0.5, "offloaded": True,
         "overlap": True, "exact": True},
    ]
    if args.rows:
        wanted = [int(i) for i in args.rows.split(",")]
        rows = [rows[i] for i in wanted]
    return rows


def with_reference(wanted, rows):
    """--check-exact compares each exact row's losses with ferry all_gpu's: the row indices `wanted`
    (of `rows`) with that row first, where --rows left it out or put it later (else nothing would be
    compared). Every row once. ValueError: no picked row is compared."""
    ref = next(i for i, r in enumerate(rows) if r["name"] == REFERENCE)
    compared = [i for i, r in enumerate(rows) if r.get("exact") and i != ref]
    if not any(i in compared for i in wanted):
        raise ValueError("--check-exact compares none of them with %s (rows %s are)"
                         % (REFERENCE, ",".join(map(str, compared))))
    return [ref] + [i for i in wanted if i != ref]


def bench_size(name, args):
    dim, blocks, heads, batch, seq = SIZES[name]
    if args.batch:
        batch = args.batch
    # One Loop per grouping (--groups a,b,...): the same model, data and bounds; the rows of every
    # grouping run in each round, alternated.
    loops = [Loop(argparse.Namespace(**dict(vars(args), groups=g))) for g in args.groups.split(",")]
    loop = loops[0]
    torch.manual_seed(0)
    model = Model(dim, blocks, heads, exact=args.check_exact).to(device=args.device, dtype=loop.param_dtype())
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    gen = torch.Generator(device="cpu").manual_seed(1)
    data = [torch.randint(0, VOCAB, (batch, seq + 1), generator=gen).to(args.device) for _ in range(4)]
    numel = sum(p.numel() for p in model.parameters())
    cpu_amp = " (on the CPU: no autocast, the scaler disabled)" if loop.amp == "fp16" and not loop.autocast else ""
    print("== %s: dim %d, %d blocks, %.0fM %s params, batch %d x %d tokens, %d timed steps after %d" % (
        name, dim, blocks, numel / 1e6, str(loop.param_dtype()).replace("torch.", ""), batch, seq, args.steps,
        args.warmup), flush=True)
    for each in loops:
        groups = model.param_groups(each.groups)
        n_groups = len(groups) if isinstance(groups, list) else 1
        print("   loop: --groups %s (%d group%s), --clip %s%s, --amp %s%s" % (
            each.groups, n_groups, "" if n_groups == 1 else "s", each.clip,
            "" if each.max_norm is None else " (max_norm %g)" % each.max_norm, each.amp, cpu_amp), flush=True)
    if args.bucket_mb:
        print("   bucket_mb=%d %s" % (args.bucket_mb, "passed to ferry.torch.Optimizer" if has_option("bucket_mb")
                                      else "ignored: ferry.torch.Optimizer takes no bucket_mb"), flush=True)
    later = args.state_later if args.state_later is not None else os.environ.get("FERRY_STATE_LATER") or None
    if later is not None:
        print("   the state later: %s (%s)" % (later, "--state-later" if args.state_later is not None
                                            else "FERRY_STATE_LATER"), flush=True)
    # The bounds do not depend on the grouping: the passes run without an optimizer.
    fwd_bwd, wait, tail = compute_alone(model, data, loop, args)
    print("   forward + backward alone: %.1f ms" % (fwd_bwd * 1e3), flush=True)
    if wait is not None:
        print("   the forward of the param a backward finishes first to its grad: %.1f ms (CPU Adam's least "
              "wait in a CPU-bound overlapped iteration)" % (wait * 1e3), flush=True)
    clipped = loop.clip == "reached" and tail is not None
    if clipped:
        print("   the same forward to the backward's end: %.1f ms (a clipped step's update waits for it)" % (
            tail * 1e3), flush=True)
    bounds = (fwd_bwd, wait, tail if clipped else None)
    ok, rounds = True, max(1, args.repeat)
    per_round = {each.groups: [] for each in loops}  # each grouping's results, a list per round
    for round_ in range(rounds):
        for each in loops:
            if rounds > 1 or len(loops) > 1:
                print("  round %d of %d%s" % (round_ + 1, rounds, ", --groups " + each.groups if len(loops) > 1
                                              else ""), flush=True)
            results, rows_ok = run_rows(model, init, data, each, args, bounds)
            ok = ok and rows_ok
            print_table(results, each)
            per_round[each.groups].append(results)
    for each in loops:
        if rounds > 1:
            print_medians(per_round[each.groups], each)
        if args.check_exact:
            ok = check_losses(per_round[each.groups][-1]) and ok
    if len(loops) > 1:
        print_spread(per_round, loops)
    del model
    gc.collect()
    return ok


def run_rows(model, init, data, loop, args, bounds):
    """One round of the rows in `loop`'s shape, each printed with its bounds: (results, whether every
    clip did what --clip promises). results: (row, iteration, losses, why skipped) per row; an
    offloaded row's row["alone"] is the offloaded step alone of its placement in this round."""
    fwd_bwd, wait, tail = bounds
    ok, results = True, []
    alone_of = {}  # (policy, its args) -> the offloaded step alone, from the row without overlap
    for row in rows_for(args):
        iteration, losses, alone, why = run_row(row, model, init, data, loop, args)
        results.append((row, iteration, losses, why))
        if iteration is None:
            print("   %-30s skipped: %s" % (row["name"], why), flush=True)
            continue
        line = "   %-30s %8.1f ms" % (row["name"], iteration * 1e3)
        key = (row.get("policy"), str(row.get("policy_args")))
        if alone is not None:
            alone_of[key] = alone
        alone = row["alone"] = alone_of.get(key) if row.get("offloaded") else None
        if alone is not None:
            bound = "CPU-bound: the step alone exceeds fwd+bwd" if alone > fwd_bwd else \
                "GPU-bound: overlap can hide the step"
            line += "   bound: step alone %.1f ms (%s)" % (alone * 1e3, bound)
            if row.get("overlap") and tail is not None:
                floor = max(fwd_bwd, alone + tail)
                line += "   [%.2fx the larger of fwd+bwd and step alone + the forward's tail, %.1f ms]" % (
                    iteration / floor, floor * 1e3)
            elif row.get("overlap") and wait is not None:
                floor = max(fwd_bwd, alone + wait)
                line += "   [%.2fx the larger of fwd+bwd and step alone + the least wait, %.1f ms]" % (
                    iteration / floor, floor * 1e3)
        if row.get("deferred"):
            line += "   [%d of %d steps deferred; the last one's update done %.1f ms after its GPU work]" % (
                row["deferred"], args.warmup + args.steps, 1e3 * row.get("tail", 0.0))
        fraction = row.get("policy_args", {}).get("fraction")
        if row.get("placed") and (fraction is not None or row.get("gpu_room")):
            share, off, n = row["placed"]
            line += "   [offloaded %.0f%% of the params: %d of %d param groups%s]" % (
                100 * share, off, n,
                "; placement is by group" if fraction is not None and abs(share - float(fraction)) > 0.1 else "")
        line += cpu_text(row.get("cpu"), iteration=iteration if row.get("overlap") else None)
        clip_text, clip_ok = row["clip"]
        if clip_text:
            line += "   [%s]" % clip_text
        if row.get("threads"):
            line += "\n      " + bench_threads.text(row["threads"])
        ok = ok and clip_ok
        print(line, flush=True)
    return results, ok


def groupings(text):
    """--groups: one grouping or several, comma-separated, each one bench_model's layouts."""
    names = text.split(",")
    for name in names:
        if name not in LAYOUTS:
            raise argparse.ArgumentTypeError("unknown grouping %r (of %s)" % (name, ", ".join(LAYOUTS)))
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError("a grouping named twice in %r" % text)
    return text


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", default="medium", choices=list(SIZES) + ["all"])
    ap.add_argument("--batch", type=int, default=0, help="override the size's batch")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the rows this many times, alternated (each row's optimizer built afresh), and print "
                         "each row's median iteration and ratio over the rounds: a noisy host's figures")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--rows", default="", help="comma-separated row indices (default: all)")
    ap.add_argument("--cpu-threads", type=int, default=0, help="ferry's CPU Adam threads (0: its default)")
    ap.add_argument("--trainer-threads", type=int, default=-1,
                    help="CPUs left to the trainer's threads (-1: ferry.torch's default)")
    ap.add_argument("--chunk-bytes", type=int, default=0,
                    help="ferry's transfer_chunk_bytes: grads per pipeline chunk (0: its default, 8 MiB)")
    ap.add_argument("--spare", type=float, default=None,
                    help="the overlap rows' spare state, a fraction of the offloaded state (ferry.torch's spare_state=; "
                         "default: Ferry's, 1)")
    ap.add_argument("--state-later", default=None, type=state_later_arg,
                    help="ferry.torch's state_later= for every ferry row: off, auto or a fraction of the offloaded "
                         "fp32 grads' bytes (default: the FERRY_STATE_LATER environment variable, else off)")
    ap.add_argument("--bucket-mb", type=int, default=0,
                    help="ferry.torch.Optimizer's bucket_mb (0: its default; ignored, with a note, by a "
                    "ferry.torch that takes no bucket_mb)")
    ap.add_argument("--no-attach", action="store_true",
                    help="overlap rows without opt.attach(model): the next forward waits for every upload")
    ap.add_argument("--attach-units", action="store_true",
                    help="overlap rows attach with units=model.blocks: each block's forward waits once for all of "
                         "its params (a hook per block, not per module: fewer splits of a --compile forward)")
    ap.add_argument("--groups", default="block", type=groupings,
                    help="the param groups of every row, torch's included. block (default; split is the same): "
                    "embeddings, a group per block, head; joined: blocks, then embeddings + head; one: "
                    "model.parameters(); decay: dim >= 2 with weight decay, the rest without (nanoGPT, HF Trainer). "
                    "Several, comma-separated (one,decay,block): each round runs every grouping's rows, "
                    "alternated, and the run ends with each row's median per grouping and their spread")
    ap.add_argument("--clip", default="none", choices=list(CLIP_NORMS),
                    help="none; opt: clip_grad_norm_(1e9) between backward and step, never reached (ferry rows: "
                    "opt.clip_grad_norm_, torch's: torch.nn.utils.clip_grad_norm_); reached: max_norm 1e-3, "
                    "clipped at every step (checked on the returned norms)")
    ap.add_argument("--amp", default="none", choices=["none", "fp16"],
                    help="none: bf16 params, no autocast; fp16: fp32 params (torch's AMP recipe), forward under "
                    "autocast(fp16), GradScaler (torch's row unscale_s before its clip; ferry rows skip, saying so, "
                    "until ferry.torch takes GradScaler's scale); CUDA only, on the CPU autocast and scaler are off")
    ap.add_argument("--no-check-finite", action="store_true",
                    help="ferry rows: check_finite=False, as torch's AdamW (no NaN/Inf check, so step() decides "
                    "without waiting for the backward: the params CPU Adam has not begun then update in place); "
                    "with --clip none and --amp none only")
    ap.add_argument("--trace", default="", help="ferry trace (Chrome JSON) of each ferry row: PATH with the row's name before the "
                    "extension, e.g. run.offload_overlap.json")
    ap.add_argument("--compile", action="store_true",
                    help="the forward through torch.compile(model) (torch >= 2.0), compiled anew for each row "
                         "once its optimizer is attached")
    ap.add_argument("--check-exact", action="store_true",
                    help="deterministic kernels; the fp32 ferry rows' losses must be the same bits")
    args = ap.parse_args()
    if args.rows:
        every = rows_for(argparse.Namespace(rows=""))
        try:
            wanted = [int(i) for i in args.rows.split(",")]
        except ValueError:
            ap.error("--rows %s: comma-separated row indices" % args.rows)
        if any(not 0 <= i < len(every) for i in wanted):
            ap.error("--rows %s: rows are 0 to %d" % (args.rows, len(every) - 1))
        if args.check_exact:
            try:
                resolved = with_reference(wanted, every)
            except ValueError as e:
                ap.error("--rows %s: %s" % (args.rows, e))
            if resolved != wanted:
                print("--check-exact: row %d (%s) runs first: the exact rows' losses are compared with its losses"
                      % (resolved[0], REFERENCE), flush=True)
            args.rows = ",".join(map(str, resolved))
    if args.compile and not hasattr(torch, "compile"):
        ap.error("--compile: torch %s has no torch.compile (torch >= 2.0)" % torch.__version__)
    if args.no_check_finite and (args.clip != "none" or args.amp != "none"):
        ap.error("--no-check-finite: clipping and GradScaler need the gradient check (use --clip none --amp none)")
    if args.check_exact:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    print("torch %s on %s; ferry %s" % (torch.__version__, torch.cuda.get_device_name() if args.device == "cuda"
                                          else "cpu", getattr(ferry, "__version__", "?")), flush=True)
    sizes = ["small", "medium", "large"] if args.size == "all" else [args.size]
    ok = all([bench_size(s, args) for s in sizes])
    if not ok:
        print("FAILED: losses differ between placements or with overlap, or the clip did not do what --clip "
              "promises", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
