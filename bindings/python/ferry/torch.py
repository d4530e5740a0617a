"""ferry.torch.Optimizer: AdamW through Ferry's engine, a drop-in for torch.optim.AdamW.

    import ferry.torch
    opt = ferry.torch.Optimizer(model.parameters(), lr=3e-4, weight_decay=0.1, policy="offload_all")
    opt.attach(model)                     # optional: each layer's forward waits for its own params
    for batch in data:
        for micro in batch[:-1]:
            with opt.accumulate():        # not the last micro-batch: nothing is announced
                loss_fn(model(micro)).backward()
        loss_fn(model(batch[-1])).backward()   # announces each param group as its grads are final
        opt.step()          # the engine's step on the current CUDA stream (CPU tensors: host backend)
        opt.zero_grad()     # zeroes the grads in place (see zero_grad)

Each torch param group is a Ferry group ("group<i>"); each param is a Ferry param ("p<k>", k its
index across the groups in order, as in torch's state_dict). The Lua policy (`policy=`: a file or a
shipped policy's name) places each group's fp32 master and moments on the device or in pinned host
memory. The math is AdamW's (decoupled weight decay, bias correction) in fp32 on the masters.

Which params step: those that received a grad since the last zero_grad(), from a backward (a hook
after the grad's accumulation sees it: ferry/_hooks.py) or by assigning p.grad; the others are
skipped as torch skips a None grad (values, masters and moments kept), whichever zero_grad mode is
used: frozen params, params a backward did not reach, and every param at a step() before any backward.

Overlap (`overlap=`): during the last backward of a step, each bucket of params (`bucket_mb` of
grads, in the order the backward finishes them, whatever the param groups: one group, decay/no-decay
groups and a group per block overlap alike) is announced to the engine once its grads are all final
(Engine.grads_ready_params), so its offloaded update (grad download, CPU Adam, param upload) runs
during the rest of the backward; step() keeps that work only where it was exact, so the result is
the same bits as without it. The rule and its cases: ferry/_hooks.py and README.

What differs from torch.optim.AdamW, on purpose:
  * Grads live in buffers the optimizer owns: at construction p.grad of each param that requires grad
    is set to one, so backward accumulates into it, and zero_grad() zeroes them in place
    (set_to_none=False is the default; both modes skip params without a grad as torch's None does).
    With zero_grad(set_to_none=True), or code that replaces p.grad, the new grad is copied into the
    buffer at step() (one extra copy per param; correct, slower). Grads written into p.grad in place
    without a backward are not seen: assign p.grad instead.
  * A skipped param's bias-correction step is its group's, so when only part of a group is skipped,
    that param's later steps use a step count one higher than torch's per-param count would be (a
    whole group skipped keeps its count). A step with skipped params synchronizes the host once.
  * eps of a group is fixed at construction (the engine's group setting);
    changing them in param_groups raises ValueError at step(). lr may change at every step (schedulers).
  * state_dict() holds fp32 CPU tensors: 'exp_avg', 'exp_avg_sq', 'step' (a float tensor), and
    'master' for params that are not fp32. self.state stays empty: the state lives in the engine.
  * A step skipped because a grad is NaN/Inf (check_finite) changes nothing and warns once
    (stats()['skipped_steps'] counts them). check_finite=False (as torch's AdamW; no clipping then)
    lets step() decide without waiting for the backward's end, and the overlapped update CPU Adam has
    not begun by then runs in place (faster); a NaN/Inf grad then reaches the params.
  * The optimizer cannot be copied or pickled (copy.deepcopy, torch.save(opt)): save its state_dict().
"""
import numbers
import os
import sys
import threading
import warnings

import torch

import ferry
from . import _amp, _attach, _buckets, _checks, _clip, _ddp, _hooks
from . import _state
from ._checks import FIXED
from ._state import StateMixin
from . import _zero


# MiB of grads per bucket (ferry.torch.Optimizer's bucket_mb; measured: tests/bench/README.md).
BUCKET_MB = 16

_INTERNAL = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.abspath(torch.__file__)))


def _caller_level():
    """warnings.warn's stacklevel (seen from _warn_once) of the first frame outside ferry and torch:
    the trainer's line."""
    level, frame = 2, sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame = frame.f_back
        level += 1
    return level


def _warn_if_placed_off_fraction(placement, fraction):
    """Warns when a policy given `fraction` (offload_fraction and the policies built on it) placed a
    share of the params more than 0.1 away from it: a param group is placed whole, so one group (a
    model's parameters()) is offloaded all or nothing."""
    try:
        want = float(fraction)
    except (TypeError, ValueError):
        return
    total = sum(g["numel"] for g in placement)
    if not total or not 0.0 < want < 1.0:
        return
    off = [g for g in placement if g["offloaded"]]
    share = sum(g["numel"] for g in off) / total
    if abs(share - want) > 0.1:
        warnings.warn("ferry.torch.Optimizer: policy_args fraction=%s, but %.0f%% of the params are offloaded (%d of %d "
                      "param groups): a param group is placed whole; give the optimizer more groups (e.g. one per "
                      "block) for a placement nearer the fraction" % (fraction, 100 * share, len(off), len(placement)),
                      stacklevel=_caller_level())


class Optimizer(StateMixin, _buckets.BucketMixin, _attach.AttachMixin, _zero.ShardedStepMixin, _ddp.DDPMixin,
                _clip.ClipMixin, _amp.AmpMixin,
                torch.optim.Optimizer):
    """AdamW on Ferry's engine; see the module's documentation.

    Arguments as torch.optim.AdamW's (params or param groups, lr, betas, eps, weight_decay), and:
      policy, policy_args: the Lua policy (a path or a shipped policy's name, e.g. "offload_all";
        None: every group on the device) and its ctx.args (values given as text).
      loss_scale, max_grad_norm, check_finite: the defaults of step()'s options of the same names.
      transfer_chunk_bytes, cpu_threads, numa, trace_path: EngineOptions (0 / "": Ferry's defaults).
      trainer_threads: CPUs of this rank's share that CPU Adam's workers leave to the trainer when cpu_threads
        is 0. None: 2 for CUDA params (the Python thread, and autograd's device thread that runs the backward
        and its hooks while the Python thread waits in backward()), 1 for CPU params (one thread runs both).
      overlap: announce buckets of params during the last backward of a step. None (the default): on once
        a step has shown that it is safe and useful: the policy offloads a group, and a step had one
        backward outside accumulate() and nothing changed its grads before step() (clip_grad_norm_,
        GradScaler.unscale_); a later step whose grads change in place is recomputed (exact) and
        turns it off again (one warning). True: from the first backward (a step whose announced grads
        changed in place recomputes them, one warning). False: never. In both modes a second backward
        after an announcement raises RuntimeError at once (use accumulate()).
      process_group, shard, collective_timeout, checkpoint_timeout: several ranks (ferry._zero,
        ferry.distributed; bindings/python/README.md, "Several ranks"). shard=True: ZeRO-1 over the ranks of
        `process_group` (None: every rank) for replicated params; DTensor params (FSDP2) are always
        registered as their local shards. Timeouts in seconds.
      local_rank, local_world_size: this process's place among the ranks of its host, which gives its
        share of the host's CPUs and pinned budget (None: from torchrun's, Open MPI's, MPICH's or
        Slurm's environment; engine/EMBEDDING.md, "Big hosts and ranks that share a host"). stats() shows the share.
      cpu_threads_max, pin_cpu_threads, pin_trainer_threads: EngineOptions' (the most workers cpu_threads=0
        takes, 0: measured; whether the workers and this process's other threads are held to the share: None
        the engine's rule or FERRY_PIN_CPU_THREADS / FERRY_PIN_TRAINER_THREADS, True always, False never).
      spare_state: the pinned memory overlap may take for its spare state, a fraction of the offloaded
        state (0 to 1; EngineOptions::spare_state_fraction): below 1 the params that fit (spread
        over the model, whatever the param groups) speculate during the backward and the others
        update once step() knows the step (beside the next forward with attach()). stats()["spare_state_bytes"]
        shows what was taken.
      state_later: "off", "auto", or a fraction in (0, 1] of the offloaded fp32 grads' bytes
        (EngineOptions::state_later): part of each decided fp32 update writes its params first and its
        state in the CPU's idle time before the next backward. None: FERRY_STATE_LATER, else off.
      bucket_mb: MiB of grads per bucket, the unit of overlap (announced together, waited for together
        by attach()'s forward pre-hooks). The buckets follow the order in which the first backward
        finished the grads (before it: the reverse of the params' order).
    """

    _node_hooks = None  # tests: True forces the AccumulateGrad-node hooks of torch < 2.1

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *, policy=None,
                 policy_args=None, loss_scale=1.0, max_grad_norm=0.0, check_finite=True, transfer_chunk_bytes=0,
                 cpu_threads=0, numa="", trace_path="", overlap=None, process_group=None, shard=False,
                 collective_timeout=300.0, checkpoint_timeout=3600.0, local_rank=None, local_world_size=None,
                 bucket_mb=BUCKET_MB, spare_state=1.0, trainer_threads=None, state_later=None, cpu_threads_max=0,
                 pin_cpu_threads=None, pin_trainer_threads=None):
        _checks.check_arguments(lr, betas, eps, weight_decay, cpu_threads, transfer_chunk_bytes, overlap, numa,
                                trace_path)
        self._bucket_bytes, spare_state, state_later = _checks.overlap_arguments(bucket_mb, spare_state, state_later)
        host = _checks.host_arguments(cpu_threads_max, pin_cpu_threads, pin_trainer_threads)
        self._engine = None
        self._ddp = None  # attach_ddp(): the DDP comm hook's bridge (ferry._ddp)
        self._engine_lock = threading.RLock()  # engine calls from DDP's comm threads (attach_ddp) and hooks
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        for gi, group in enumerate(self.param_groups):
            _checks.check_group(gi, group)
        self._step_defaults = dict(loss_scale=float(loss_scale), max_grad_norm=float(max_grad_norm),
                                   check_finite=bool(check_finite))
        self._params = []
        self._where = []
        group_of = []
        for gi, group in enumerate(self.param_groups):
            for k, p in enumerate(group["params"]):
                self._where.append(_checks.where(len(self._params), gi, k))
                self._params.append(p)
                group_of.append(gi)
        device = _checks.check_params(self._params, self._where)
        self._cuda = device.type == "cuda"
        if trainer_threads is None:
            trainer_threads = 2 if self._cuda else 1
        if not isinstance(trainer_threads, numbers.Integral) or isinstance(trainer_threads, bool) or trainer_threads < 0:
            raise ValueError("trainer_threads must be an int >= 0 (CPUs left to the trainer's threads) or None, "
                             "got %r" % (trainer_threads,))
        self._device = device
        # ---- several ranks (ferry._zero): the engine's comm and each param's range ----
        self._zero = None
        if process_group is None:
            process_group = _zero.process_group_of(self._params, self._where)
        if shard or process_group is not None:
            self._zero = _zero.Sharding(self._params, self._where, process_group, shard, collective_timeout, device,
                                        unit_bytes=self._bucket_bytes)
        dist_args = {} if self._zero is None else dict(
            comm=self._zero.comm, rank=self._zero.rank, world_size=self._zero.world,
            collective_timeout=float(collective_timeout), checkpoint_timeout=float(checkpoint_timeout))
        engine = ferry.Engine(policy=ferry.policy_path(policy),
                              policy_args={str(k): str(v) for k, v in (policy_args or {}).items()},
                              lr=float(lr), beta1=float(betas[0]), beta2=float(betas[1]), eps=float(eps),
                              weight_decay=float(weight_decay), adamw=True, device="cuda" if self._cuda else "host",
                              device_ordinal=device.index or 0, transfer_chunk_bytes=int(transfer_chunk_bytes),
                              cpu_threads=int(cpu_threads), numa=numa, trace_path=trace_path,
                              local_rank=-1 if local_rank is None else int(local_rank),
                              local_world_size=-1 if local_world_size is None else int(local_world_size),
                              spare_state_fraction=spare_state, trainer_threads=int(trainer_threads),
                              state_later=state_later, **host, **dist_args)
        try:
            self._register(engine, group_of)
        except BaseException as e:
            if self._zero is not None:  # the other ranks' Finalize then fails naming this rank
                self._zero.abort(e)
            raise
        for p, buf in zip(self._params, self._grads):
            # a DTensor's grads come from FSDP2 and are copied at step()
            if p.grad is None and p.requires_grad and not _zero.is_dtensor(p):
                p.grad = buf
        self._zeroed = [buf._version for buf in self._grads]
        self._signature = [self._signature_of(p) for p in self._params]
        self._group_sizes = [len(g["params"]) for g in self.param_groups]
        self._group_start = [sum(self._group_sizes[:gi]) for gi in range(len(self._group_sizes))]
        self._group_of = group_of
        placement = engine.placement()
        self._offloaded = any(g["offloaded"] for g in placement)
        _warn_if_placed_off_fraction(placement, (policy_args or {}).get("fraction"))
        self._overlap = overlap
        self._overlap_off = False  # overlap=None: turned off for good by a step that was not safe
        self._warned = set()
        self._step_options = None  # the per-group lrs and betas of this step's announcements (checked once)
        self._by_hand = set()  # param groups grads_ready() announced in this step
        self._waits = None  # attach(): the forward pre-hooks
        self._pending = set()  # attach(): buckets whose new params no stream waited for yet
        self._left_to_forward = False  # attach(): the last step's params are left to the forward's hooks
        self._zero_pending = set()  # of those, buckets whose grads zero_grad() left for _wait_units
        self._step_versions = []  # the grad buffers' versions when _pending was set (_wait_units checks them)
        # Params the trainer writes in place (model.load_state_dict) refresh their masters at the next
        # step (_state.py); FSDP2 writes its DTensors' shards itself: sync_from_model() there.
        self._watch_params = not any(_zero.is_dtensor(p) for p in self._params)
        self._params_synced = 0
        self._record_param_versions()
        self._names = ["p%d" % k for k in range(len(self._params))]
        self._order_learned = False
        self._set_units(range(len(self._params) - 1, -1, -1), tracker=False)
        self._tracker = _hooks.GradTracker(self._params, self._where, self._unit_of, len(self._units),
                                           self._announce_from_hook, node_hooks=self._node_hooks)
        self._tracker.announcing = overlap is True
        self._engine = engine
        _state.finish_saves_at_exit_of(self)

    def _register(self, engine, group_of):
        """Adds the groups and params (on several ranks: each param's range) to `engine`, finalizes it."""
        self._groups = ["group%d" % gi for gi in range(len(self.param_groups))]
        self._fixed = []
        self._betas, self._wd = [], []  # each group's betas and weight decay at construction (the engine's)
        for gi, group in enumerate(self.param_groups):
            b1, b2 = group["betas"]
            engine.add_group(self._groups[gi], weight_decay=float(group["weight_decay"]), beta1=float(b1),
                             beta2=float(b2), eps=float(group["eps"]))
            self._fixed.append({k: group[k] for k in FIXED})
            self._betas.append((float(b1), float(b2)))
            self._wd.append(float(group["weight_decay"]))
        # The grad buffers the engine reads: p.grad of each param that requires grad points at its
        # buffer once the engine is built (nothing changes when building it fails).
        self._grads = []
        with torch.no_grad():
            for k, p in enumerate(self._params):
                if self._zero is not None:  # several ranks: this rank's range of the param
                    buf = self._zero.grad_buffer(k, p)
                    self._grads.append(buf)
                    self._zero.register(engine, "p%d" % k, self._groups[group_of[k]], k, p, buf,
                                        _checks.DTYPES[p.dtype])
                    continue
                buf = torch.zeros_like(p, memory_format=torch.contiguous_format)
                self._grads.append(buf)
                engine.add_param("p%d" % k, self._groups[group_of[k]], list(p.shape) or [1], _checks.DTYPES[p.dtype],
                                 p.data_ptr(), buf.data_ptr())
        engine.finalize()

    # ---- construction checks; copies ---------------------------------------------------------------

    @staticmethod
    def _signature_of(p):
        return (_zero.local(p).data_ptr(), tuple(p.shape), p.dtype, p.device)

    def add_param_group(self, param_group):
        if getattr(self, "_engine", None) is not None:
            raise RuntimeError("ferry.torch.Optimizer: add_param_group after construction is not supported (the "
                               "engine's groups are fixed); construct the optimizer with every group")
        super().add_param_group(param_group)

    def __getstate__(self):
        raise TypeError("ferry.torch.Optimizer cannot be copied or pickled (copy.deepcopy, torch.save of the "
                        "optimizer object): it owns Ferry's engine and the params' registered memory. Save "
                        "opt.state_dict() (torch.save works on it) or use opt.save_checkpoint(); to copy, build a "
                        "new ferry.torch.Optimizer over the other params and load_state_dict() into it")

    def __deepcopy__(self, memo):
        self.__getstate__()

    def _check_unchanged(self):
        """This step's per-group options for the engine, once the params and fixed settings are checked
        unchanged since construction (_checks.unchanged)."""
        return _checks.unchanged(self)

    def _grad_range(self, k):
        """[begin, end) of param k's flattened elements that this rank's engine reads from its grad buffer."""
        return self._zero.range(k) if self._zero is not None else (0, self._params[k].numel())

    def _stream(self):
        return torch.cuda.current_stream(self._device).cuda_stream if self._cuda else 0

    def _sync_torch(self):
        """Waits for torch's queued work on the device, and for every upload of the last step (before
        the engine reads or writes tensors outside a step)."""
        self._wait_params()
        if self._cuda:
            torch.cuda.current_stream(self._device).synchronize()

    def _warn_once(self, key, message):
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn("ferry.torch.Optimizer: " + message, stacklevel=_caller_level())

    def _options(self, loss_scale, max_grad_norm, check_finite):
        options = dict(self._step_defaults)
        given = (("loss_scale", loss_scale), ("max_grad_norm", max_grad_norm), ("check_finite", check_finite))
        for key, value in given:
            if value is not None:
                options[key] = value
        return {"loss_scale": float(options["loss_scale"]), "max_grad_norm": float(options["max_grad_norm"]),
                "check_finite": bool(options["check_finite"])}

    # ---- which params have a grad --------------------------------------------------------------------

    def _has_grad(self, k):
        """A grad was produced for param k since the last zero_grad(): by a backward (the hooks saw
        it) or by assigning p.grad (a tensor that is not the optimizer's buffer)."""
        g = self._params[k].grad
        return g is not None and (self._tracker.got[k] or g is not self._grads[k])

    def _take_grads(self, ks):
        """Makes the buffers hold the grads of params ks (copied on the current stream where p.grad
        is another tensor, all in one foreach launch where torch has it) and each p.grad point at its
        buffer (FSDP2's DTensor grads stay: their local rows are copied). A grad of the wrong shape
        raises before anything changed."""
        dsts, srcs, taken, moved = [], [], [], []
        for k in ks:
            p, buf = self._params[k], self._grads[k]
            g = p.grad
            if self._zero is not None and _zero.is_dtensor(p):  # FSDP2's grad: its local rows; p.grad stays
                g = _zero.local(g)
            elif g is buf:
                continue
            elif g.shape != p.shape:
                raise ValueError("%s: its grad has shape %s, the param %s" % (self._where[k], tuple(g.shape),
                                                                               tuple(p.shape)))
            else:
                moved.append(k)
            taken.append(k)
            if g.data_ptr() != buf.data_ptr():
                dsts.append(buf)
                srcs.append(g)  # the list keeps g alive until its copy is enqueued
        _buckets.copy_all(dsts, srcs)
        for k in moved:
            self._params[k].grad = self._grads[k]
        for k in taken:
            self._tracker.got[k] = True  # an assigned grad stays this step's grad in the buffer

    # ---- the step ----------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None, *, loss_scale=None, max_grad_norm=None, check_finite=None, grad_scaler=None):
        """One AdamW step of every param that has a grad (see the module's documentation); returns
        the closure's loss (if any).

        loss_scale: the grads carry it and are divided by it; max_grad_norm (> 0): clip the global
        norm of the unscaled grads; check_finite: a NaN/Inf grad skips the whole step (stats()
        reports it; warns once). Each defaults to the constructor's value.
        grad_scaler: passed by torch's GradScaler.step(opt) (ferry/_amp.py): the engine unscales by the
        scaler's scale and skips on a NaN/Inf, no grad changes in place, and scaler.update() gets the
        found-inf result.

        Several ranks: collective (every rank of the process group calls it). An exception on one rank
        makes every other rank's step raise a FerryError naming it (ferry.distributed)."""
        if grad_scaler is not None or self._amp_called():
            return self._scaled_step(grad_scaler, closure, loss_scale, max_grad_norm, check_finite)
        self._amp_plain()
        return self._step_ranks(closure, loss_scale, max_grad_norm, check_finite)

    def _step(self, closure, loss_scale, max_grad_norm, check_finite):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        tracker = self._tracker
        # attach(): the last forward waited for its params (its modules' pre-hooks ran): this step's
        # may be left to the next forward's hooks (_attach.py).
        self._left_to_forward = self._waits is not None and self._forward_waits()
        per_step = self._check_unchanged()
        options = self._clip_options(self._options(loss_scale, max_grad_norm, check_finite))
        n = len(self._params)
        has = [self._has_grad(k) for k in range(n)]
        # Grads changed after their backward (before any copy below changes p.grad): announced ones
        # make the step recompute them; any one keeps overlap=None from turning on.
        announced_ks = sorted(tracker.announced)
        late = tracker.late
        if late is None:
            changed = tracker.changed_since_backward(announced_ks)
            if changed is not None:
                late = ("an in-place change (clip_grad_norm_? GradScaler.unscale_?)", changed)
        # overlap=None learns from this step whether the loop keeps the rule (see _end_step).
        learning = self._overlap is None and not self._overlap_off
        unsafe = learning and (late is not None or tracker.backwards > 1 or
                               tracker.changed_since_backward(range(n)) is not None)
        skipped = [k for k in range(n) if not has[k]]
        if skipped and tracker.announced:
            bad = [self._where[k] for k in skipped if k in tracker.announced]
            if bad:
                raise RuntimeError("%s: no grad at step(), but it was announced by grads_ready()"
                                   % ", ".join(bad))
        self._wait_params()  # the last step's uploads, before anything here reads or writes a param
        if not announced_ks:  # else the first announcement did (the engine's state is refused now)
            self._sync_changed_params()
        if len(skipped) == n:
            if any(self._params[k].grad is self._grads[k] and self._grads[k]._version != self._zeroed[k]
                   for k in range(n)):
                self._warn_once("in place", "step() found no grad produced since zero_grad(), but grads were "
                                "written into p.grad in place: those are not seen (no backward ran); assign "
                                "p.grad = g instead")
            self._end_step(unsafe=False)
            return loss
        # The grads of announced groups were taken at the announcement (attach_ddp: copied from DDP's
        # reduced bucket); copying them again would write what the engine may be reading. Changed
        # since (late): taken again, and the step recomputes those groups.
        taken = set() if late is not None else set(announced_ks)
        self._take_grads([k for k in range(n) if has[k] and k not in taken])
        saved = self._save_skipped(skipped) if skipped else None
        if late is not None and self._overlap is True:
            self._warn_once("late", "the grad of %s changed after it was announced (%s): the step "
                            "recomputed the announced groups (exact, but nothing overlapped). Wrap every backward "
                            "but the last of a step in `with opt.accumulate():`, clip with "
                            "opt.clip_grad_norm_(max_norm) (or max_grad_norm=) and pass loss_scale= instead of "
                            "changing grads in place, or construct it with overlap=False" % (self._where[late[1]], late[0]))
        if late is not None:
            options["discard_early"] = True
        deferred = self._left_to_forward or self._gathering()
        skipped_step, _ = self._engine.step(**per_step, **options, wait_for_params=not deferred,
                                            stream=self._stream())
        self._end_step(unsafe=unsafe)
        if deferred:
            self._pending = set(range(len(self._units)))
            self._step_versions = [buf._version for buf in self._grads]
        if self._waits is not None:
            self._waits.deferred = self._left_to_forward
        if self._left_to_forward:
            orphans = [u for u, ks in enumerate(self._units) if not any(k in self._waits.owned for k in ks)]
            if orphans:
                self._wait_units(orphans)
        if saved is not None:
            self._wait_units(sorted({self._unit_of[k] for k in skipped}))
            self._restore_skipped(saved)
        if skipped_step:
            self._warn_once("nonfinite", "a step was skipped because a grad was NaN or Inf (nothing changed; "
                            "stats()['skipped_steps'] counts such steps). This warning is shown once")
        return loss

    def _end_step(self, unsafe):
        tracker = self._tracker
        if self._overlap is None and not self._overlap_off:
            if unsafe:
                if self._offloaded:
                    self._warn_once("auto", "overlap (announcing params during backward) is off: a step had "
                                    "%d backward passes outside accumulate(), or grads changed between the "
                                    "backward and step() (clip_grad_norm_? GradScaler.unscale_?). Every step stayed "
                                    "exact. To overlap, wrap every backward but the last of a step in `with "
                                    "opt.accumulate():`, clip with opt.clip_grad_norm_(max_norm) instead of "
                                    "torch.nn.utils.clip_grad_norm_, and pass loss_scale= to the optimizer "
                                    "(overlap=False silences this)" % tracker.backwards)
                self._overlap_off = True
                tracker.announcing = False
            elif tracker.backwards == 1 and self._offloaded:
                tracker.announcing = True
        if not self._order_learned and tracker.backwards == 1 and tracker.order:
            # The buckets follow the order in which this backward finished the grads (once; this
            # step's announcements are complete, and the engine waits by param, not by bucket).
            self._order_learned = True
            self._set_units(tracker.order)
        tracker.end_step()
        self._by_hand = set()
        tracker.hook_missing()  # params unfrozen since
        self._step_options = None

    def zero_grad(self, set_to_none=False):
        """Zeroes the grads in place (the default here, unlike torch 2.x's): the engine reads the
        buffers registered at construction, so keeping them saves a copy per param per step. Either
        way a param steps again only once it has a new grad (as with torch's None grads).
        set_to_none=True sets every p.grad to None as torch does: fresh grads are copied into the
        buffers at step()."""
        self._tracker.hook_missing()
        self._tracker.clear_grads()
        if set_to_none:
            for p in self._params:
                p.grad = None
            return
        for p, buf in zip(self._params, self._grads):
            if _zero.is_dtensor(p):
                p.grad = None  # FSDP2 assigns a new DTensor grad at the next backward
            elif p.grad is not buf and (p.grad is not None or p.requires_grad):
                p.grad = buf
        # After a deferred step (attach()), the engine may still read the grads of a bucket whose new
        # params no stream waited for yet: those are zeroed when the stream waits for that bucket
        # (its forward pre-hook, or wait_params()), in _wait_units.
        self._zero_pending = set(self._pending)
        ready = [buf for k, buf in enumerate(self._grads) if self._unit_of[k] not in self._zero_pending]
        if ready:
            torch._foreach_zero_(ready)
        self._zeroed = [buf._version for buf in self._grads]

    # ---- introspection -------------------------------------------------------------------------------

    @property
    def engine(self):
        """The ferry.Engine underneath (params "p<k>", groups "group<i>")."""
        return self._engine

    @property
    def overlapping(self):
        """Whether the hooks announce param groups now (see `overlap`)."""
        return self._tracker.announcing

    def stats(self):
        """EngineStats as a dict: step, skipped_steps, last_step_skipped, last_grad_norm, pinned_bytes,
        gpu_state_bytes, early_groups_kept, early_groups_recomputed, deferred_steps (steps that returned
        before their offloaded update finished: attach() with overlap), cpu_adam_busy_seconds and
        cpu_adam_bytes (the offloaded update's CPU Adam over all steps: the time it ran, the bytes it
        moved), cpu_adam_spare_bytes (of those, the bytes updated out of place into the spare state),
        cpu_adam_later_bytes (of those, the state written after its params: state_later=),
        state_later_kept_bytes and state_later_limit_bytes (its buffer, and what a step may stage), ...,
        last_step_seconds (the host wall time of the engine's last step call), params_synced (params
        whose masters were refreshed because the trainer wrote them: model.load_state_dict) and, on
        several ranks, last_gather_seconds (ZeRO-1's all-gather after it)."""
        stats = self._engine.stats()
        stats["params_synced"] = self._params_synced
        if self._zero is not None:
            stats["last_gather_seconds"] = self._zero.last_gather_seconds
        return stats

    @property
    def sharding(self):
        """None on one rank; else a dict: rank, world_size, all_gather (how ZeRO-1's all-gather of
        the updated params runs: its backend and group), grad_check ("gloo", or the device of the
        trainer's NCCL group the step's gradient-check all-reduce runs on), replicated / dtensor (how many params of
        each kind), local_numel (the elements this rank's engine steps), gather_units (ZeRO-1's
        all-gather units), gather_units_in_place (those NCCL gathers in place, without copies) and
        gather_coalesced (whether NCCL gathers a run of units as one group)."""
        z = self._zero
        if z is None:
            return None
        return {"rank": z.rank, "world_size": z.world, "all_gather": z.gather_via if z.units else None,
                "grad_check": z.comm.reduces_on,
                "gather_units": len(z.units), "gather_units_in_place": z.units_in_place(),
                "gather_coalesced": bool(z.coalesce),
                "replicated": z.kind.count("replica"), "dtensor": z.kind.count("dtensor"),
                "local_numel": sum(z.local_numel(k) for k in range(len(self._params)))}

    def placement(self):
        """One dict per param group: group (Ferry's name), param_group (the index), offloaded, numel,
        num_params, options (the group's optimizer settings)."""
        out = self._engine.placement()
        for d in out:
            d["param_group"] = self._groups.index(d["group"])
        return out
