"""ferry.torch.Optimizer: AdamW through Ferry's engine, a drop-in for torch.optim.AdamW.

    import ferry.torch
    opt = ferry.torch.Optimizer(model.parameters(), lr=3e-4, weight_decay=0.1, policy="offload_all")
    for x, y in data:
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()          # the engine's step on the current CUDA stream (CPU tensors: host backend)
        opt.zero_grad()     # zeroes the grads in place (see zero_grad)

Each torch param group is a Ferry group ("group<i>"); each param is a Ferry param ("p<k>", k its
index across the groups in order, as in torch's state_dict). The Lua policy (`policy=`: a file or a
shipped policy's name) places each group's fp32 master and moments on the device or in pinned host
memory. The math is AdamW's (decoupled weight decay, bias correction) in fp32 on the masters.

What differs from torch.optim.AdamW, on purpose:
  * Grads live in buffers the optimizer owns: at construction every p.grad is set to one, so backward
    accumulates into it, and zero_grad() zeroes them in place (set_to_none=False is the default). With
    zero_grad(set_to_none=True), or code that replaces p.grad, the new grad is copied into the buffer at
    step() (one extra copy per param; correct, slower).
  * A param whose .grad is None at step() is skipped as torch skips it: its value, master and moments
    are kept (saved before the engine's step and restored after it). Its bias-correction step is its
    group's, so when only part of a group is skipped, that param's later steps use a step count one
    higher than torch's per-param count would be (a whole group skipped keeps its count).
  * betas, eps and weight_decay of a group are fixed at construction (the engine's group settings);
    changing them in param_groups raises ValueError at step(). lr may change at every step (schedulers).
  * state_dict() holds fp32 CPU tensors: 'exp_avg', 'exp_avg_sq', 'step' (a float tensor), and
    'master' for params that are not fp32. self.state stays empty: the state lives in the engine.
"""
import warnings

import torch

import ferry
from ferry import _zero

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_FIXED = ("betas", "eps", "weight_decay")


def _where(param_index, group_index, in_group):
    return "param %d (param_groups[%d]['params'][%d])" % (param_index, group_index, in_group)


class Optimizer(torch.optim.Optimizer):
    """AdamW on Ferry's engine; see the module's documentation.

    Arguments as torch.optim.AdamW's (params or param groups, lr, betas, eps, weight_decay), and:
      policy, policy_args: the Lua policy (a path or a shipped policy's name, e.g. "offload_all";
        None: every group on the device) and its ctx.args (values given as text).
      loss_scale, max_grad_norm, check_finite: the defaults of step()'s options of the same names.
      transfer_chunk_bytes, cpu_threads, numa, trace_path: EngineOptions (0 / "": Ferry's defaults).
      process_group, shard, collective_timeout, checkpoint_timeout: several ranks (ferry._zero,
        ferry.distributed; README "PyTorch on several ranks"). shard=True: ZeRO-1 over the ranks of
        `process_group` (None: every rank) for replicated params; DTensor params (FSDP2) are always
        registered as their local shards. Timeouts in seconds.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *, policy=None,
                 policy_args=None, loss_scale=1.0, max_grad_norm=0.0, check_finite=True, transfer_chunk_bytes=0,
                 cpu_threads=0, numa="", trace_path="", process_group=None, shard=False, collective_timeout=300.0,
                 checkpoint_timeout=3600.0):
        if not 0.0 <= lr:
            raise ValueError("Invalid learning rate: {}".format(lr))
        if not 0.0 <= eps:
            raise ValueError("Invalid epsilon value: {}".format(eps))
        for i, b in enumerate(betas):
            if not 0.0 <= b < 1.0:
                raise ValueError("Invalid beta parameter at index {}: {}".format(i, b))
        if not 0.0 <= weight_decay:
            raise ValueError("Invalid weight_decay value: {}".format(weight_decay))
        self._engine = None
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self._step_defaults = dict(loss_scale=float(loss_scale), max_grad_norm=float(max_grad_norm),
                                   check_finite=bool(check_finite))
        self._params = []
        self._where = []
        for gi, group in enumerate(self.param_groups):
            for k, p in enumerate(group["params"]):
                self._where.append(_where(len(self._params), gi, k))
                self._params.append(p)
        device = self._check_params()
        self._cuda = device.type == "cuda"
        self._device = device
        # ---- several ranks (ferry._zero): the engine's comm and each param's range ----
        self._zero = None
        if process_group is None:
            process_group = _zero.process_group_of(self._params, self._where)
        if shard or process_group is not None:
            self._zero = _zero.Sharding(self._params, self._where, process_group, shard, collective_timeout, device)
        dist_args = {} if self._zero is None else dict(
            comm=self._zero.comm, rank=self._zero.rank, world_size=self._zero.world,
            collective_timeout=float(collective_timeout), checkpoint_timeout=float(checkpoint_timeout))
        engine = ferry.Engine(policy=ferry.policy_path(policy),
                              policy_args={str(k): str(v) for k, v in (policy_args or {}).items()},
                              lr=float(lr), beta1=float(betas[0]), beta2=float(betas[1]), eps=float(eps),
                              weight_decay=float(weight_decay), adamw=True, device="cuda" if self._cuda else "host",
                              device_ordinal=device.index or 0, transfer_chunk_bytes=int(transfer_chunk_bytes),
                              cpu_threads=int(cpu_threads), numa=numa, trace_path=trace_path, **dist_args)
        try:
            self._register(engine)
        except BaseException as e:
            if self._zero is not None:  # the other ranks' Finalize then fails naming this rank
                self._zero.abort(e)
            raise
        for p, buf in zip(self._params, self._grads):
            if not _zero.is_dtensor(p):  # a DTensor's grads come from FSDP2 and are copied at step()
                p.grad = buf
        self._signature = [self._signature_of(p) for p in self._params]
        self._group_sizes = [len(g["params"]) for g in self.param_groups]
        self._group_start = [sum(self._group_sizes[:gi]) for gi in range(len(self._group_sizes))]
        self._group_of = [self._groups[gi] for gi, n in enumerate(self._group_sizes) for _ in range(n)]
        self._announced = set()  # groups given to grads_ready() since the last step()
        self._engine = engine

    def _register(self, engine):
        """Adds the groups and params (on several ranks: each param's range) to `engine`, finalizes it."""
        self._groups = ["group%d" % gi for gi in range(len(self.param_groups))]
        self._fixed = []
        for gi, group in enumerate(self.param_groups):
            b1, b2 = group["betas"]
            engine.add_group(self._groups[gi], weight_decay=float(group["weight_decay"]), beta1=float(b1),
                             beta2=float(b2), eps=float(group["eps"]))
            self._fixed.append({k: group[k] for k in _FIXED})
        # The grad buffers the engine reads: p.grad points at them once the engine is built (nothing
        # changes when building it fails).
        self._grads = []
        k = 0
        with torch.no_grad():
            for gi, group in enumerate(self.param_groups):
                for p in group["params"]:
                    if self._zero is not None:  # several ranks: this rank's range of the param
                        buf = self._zero.grad_buffer(k, p)
                        if p.grad is not None:
                            buf.copy_(self._zero.grad_of(k, p.grad))
                        self._zero.register(engine, "p%d" % k, self._groups[gi], k, p, buf, _DTYPES[p.dtype])
                        self._grads.append(buf)
                        k += 1
                        continue
                    buf = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    if p.grad is not None:
                        buf.copy_(p.grad)
                    self._grads.append(buf)
                    engine.add_param("p%d" % k, self._groups[gi], list(p.shape) or [1], _DTYPES[p.dtype],
                                     p.data_ptr(), buf.data_ptr())
                    k += 1
        engine.finalize()

    # ---- construction checks ------------------------------------------------------------------------

    def _check_params(self):
        """The one device of every param; errors name the first param at fault."""
        if not self._params:
            raise ValueError("ferry.torch.Optimizer got an empty parameter list")
        first = None
        seen = []
        for p, where in zip(self._params, self._where):
            if not isinstance(p, torch.Tensor):
                raise TypeError("%s is a %s, not a torch.Tensor" % (where, type(p).__name__))
            if p.device.type not in ("cpu", "cuda"):
                raise ValueError("%s is on %s: Ferry takes CPU tensors (host backend) or CUDA tensors" % (where, p.device))
            if first is None:
                first = (p.device, where)
            elif p.device != first[0]:
                raise ValueError("%s is on %s, but %s is on %s: every param of one optimizer must be on one device"
                                 % (where, p.device, first[1], first[0]))
            if p.dtype not in _DTYPES:
                raise TypeError("%s has dtype %s: Ferry's params are torch.float32, torch.bfloat16 or torch.float16"
                                % (where, p.dtype))
            p = _zero.local(p)  # a DTensor's local shard holds its memory
            if p.is_sparse or p.layout != torch.strided:
                raise ValueError("%s is not a dense (strided) tensor" % where)
            if not p.is_contiguous():
                raise ValueError("%s is not contiguous (strides %s): Ferry updates params as flat memory; pass "
                                 "contiguous tensors" % (where, tuple(p.stride())))
            if p.numel() == 0 and not _zero.is_dtensor(self._params[len(seen)]):
                raise ValueError("%s has no elements (shape %s)" % (where, tuple(p.shape)))
            seen.append(where)
        return first[0]

    @staticmethod
    def _signature_of(p):
        return (_zero.local(p).data_ptr(), tuple(p.shape), p.dtype, p.device)

    def add_param_group(self, param_group):
        if getattr(self, "_engine", None) is not None:
            raise RuntimeError("ferry.torch.Optimizer: add_param_group after construction is not supported (the "
                               "engine's groups are fixed); construct the optimizer with every group")
        super().add_param_group(param_group)

    def _check_unchanged(self):
        """RuntimeError when the params changed since construction; ValueError when a group's fixed
        settings did. Returns [(group name, lr)] of this step."""
        groups = self.param_groups
        if len(groups) != len(self._group_sizes):
            raise RuntimeError("ferry.torch.Optimizer: param_groups has %d groups, the optimizer was built with %d"
                               % (len(groups), len(self._group_sizes)))
        lrs = []
        k = 0
        for gi, group in enumerate(groups):
            ps = group["params"]
            if len(ps) != self._group_sizes[gi]:
                raise RuntimeError("ferry.torch.Optimizer: param_groups[%d] has %d params, the optimizer was built "
                                   "with %d" % (gi, len(ps), self._group_sizes[gi]))
            for p in ps:
                sig = self._signature[k]
                if p is not self._params[k] or _zero.local(p).data_ptr() != sig[0] or p.shape != sig[1] or \
                        p.dtype != sig[2]:
                    raise RuntimeError(
                        "%s changed after the optimizer was constructed (now %s %s at 0x%x; registered %s %s at "
                        "0x%x): Ferry registered its memory; build a new optimizer after replacing, moving or "
                        "resizing params" % (self._where[k], tuple(p.shape), p.dtype, _zero.local(p).data_ptr(), sig[1], sig[2],
                                             sig[0]))
                k += 1
            for key in _FIXED:
                if group[key] != self._fixed[gi][key]:
                    raise ValueError("param_groups[%d]['%s'] changed from %r to %r after construction: Ferry fixes "
                                     "a group's betas, eps and weight_decay when the optimizer is built (only lr "
                                     "may change per step)" % (gi, key, self._fixed[gi][key], group[key]))
            lrs.append((self._groups[gi], float(group["lr"])))
        return lrs

    def _stream(self):
        return torch.cuda.current_stream(self._device).cuda_stream if self._cuda else 0

    def _sync_torch(self):
        """Waits for torch's queued work on the device (before the engine reads or writes tensors
        outside a step)."""
        if self._cuda:
            torch.cuda.current_stream(self._device).synchronize()

    # ---- the step ----------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None, *, loss_scale=None, max_grad_norm=None, check_finite=None):
        """One AdamW step of every param that has a grad; returns the closure's loss (if any).

        loss_scale: the grads carry it and are divided by it; max_grad_norm (> 0): clip the global
        norm of the unscaled grads; check_finite: a NaN/Inf grad skips the whole step (stats()
        reports it). Each defaults to the constructor's value.

        Several ranks: collective (every rank of the process group calls it). An exception on one rank
        makes every other rank's step raise a FerryError naming it (ferry.distributed)."""
        if self._zero is None:
            return self._step(closure, loss_scale, max_grad_norm, check_finite)
        try:
            loss = self._step(closure, loss_scale, max_grad_norm, check_finite)
            self._zero.gather_params()  # ZeRO-1: every rank's updated range into every replica
            return loss
        except BaseException as e:
            self._zero.abort(e)
            raise

    def _step(self, closure, loss_scale, max_grad_norm, check_finite):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        lrs = self._check_unchanged()
        options = dict(self._step_defaults)
        for key, value in (("loss_scale", loss_scale), ("max_grad_norm", max_grad_norm), ("check_finite", check_finite)):
            if value is not None:
                options[key] = value
        skipped = []
        for k, p in enumerate(self._params):
            g = p.grad
            buf = self._grads[k]
            if g is None:
                skipped.append(k)
            elif self._zero is not None and _zero.is_dtensor(p):  # FSDP2's grad: its local rows
                g = g.to_local()
                if g.data_ptr() != buf.data_ptr():
                    buf.copy_(g)
            elif g is not buf:
                if g.shape != p.shape:
                    raise ValueError("%s: its grad has shape %s, the param %s" % (self._where[k], tuple(g.shape),
                                                                                   tuple(p.shape)))
                if g.data_ptr() != buf.data_ptr():
                    buf.copy_(g)
                p.grad = buf
        if len(skipped) == len(self._params):
            return loss
        if skipped and self._announced:
            announced = [self._where[k] for k in skipped if self._group_of[k] in self._announced]
            if announced:
                raise RuntimeError("%s: no grad at step(), but its group was announced by grads_ready()"
                                   % ", ".join(announced))
        saved = self._save_skipped(skipped) if skipped else None
        self._engine.step(group_lr=lrs, **self._engine_options(options), stream=self._stream())
        self._announced = set()
        if saved is not None:
            self._restore_skipped(saved)
        return loss

    @staticmethod
    def _engine_options(options):
        return {"loss_scale": float(options["loss_scale"]), "max_grad_norm": float(options["max_grad_norm"]),
                "check_finite": bool(options["check_finite"])}

    @torch.no_grad()
    def grads_ready(self, groups=None, *, loss_scale=None, max_grad_norm=None, check_finite=None):
        """Starts the coming step of param groups whose grads are final (indices into param_groups;
        None: every group not announced yet), during backward: call it after the last backward that
        accumulates into them (for example from a hook), with the options step() will get. Offloaded
        groups then copy their grads down, run CPU Adam and upload new params in the background, on
        the current stream's order; step() completes the step and keeps that work only when it is
        exact (no clipping triggered, the same lr and options), so the result is the same bits as
        without this call. Until step(), do not change these grads or read these params. Every param
        of an announced group must have a grad."""
        if groups is None:
            groups = [gi for gi in range(len(self._groups)) if self._groups[gi] not in self._announced]
        elif isinstance(groups, int):
            groups = [groups]
        lrs = self._check_unchanged()
        options = dict(self._step_defaults)
        for key, value in (("loss_scale", loss_scale), ("max_grad_norm", max_grad_norm), ("check_finite", check_finite)):
            if value is not None:
                options[key] = value
        names = []
        for gi in groups:
            if not 0 <= gi < len(self._groups):
                raise IndexError("grads_ready: no param group %d (%d groups)" % (gi, len(self._groups)))
            names.append(self._groups[gi])
            for k in range(self._group_start[gi], self._group_start[gi] + self._group_sizes[gi]):
                p, buf = self._params[k], self._grads[k]
                if p.grad is None:
                    raise RuntimeError("grads_ready: %s has no grad" % self._where[k])
                if p.grad is not buf:
                    buf.copy_(p.grad)  # on the current stream, before the announcement
                    p.grad = buf
        self._engine.grads_ready(names, group_lr=lrs, **self._engine_options(options), stream=self._stream())
        self._announced.update(names)

    def _save_skipped(self, skipped):
        """What a step would change of the params without grads: values, state, and the step count of
        groups with no grad at all. Their grad buffers are zeroed (the step reads them)."""
        self._sync_torch()
        saved = {"params": [], "steps": {}}
        for k in skipped:
            p = self._params[k]
            self._grads[k].zero_()
            state = {kind: self._read(k, kind) for kind in ("master", "exp_avg", "exp_avg_sq")}
            saved["params"].append((k, p.detach().clone(), state))
        k = 0
        skipped_set = set(skipped)
        for gi, n in enumerate(self._group_sizes):
            if all(j in skipped_set for j in range(k, k + n)):
                saved["steps"][self._groups[gi]] = self._engine.group_step(self._groups[gi])
            k += n
        return saved

    def _restore_skipped(self, saved):
        for k, value, state in saved["params"]:
            for kind, t in state.items():
                self._engine.write_state("p%d" % k, kind, t.data_ptr())
            self._params[k].copy_(value)
        for group, step in saved["steps"].items():
            self._engine.set_group_step(group, step)

    def zero_grad(self, set_to_none=False):
        """Zeroes the grads in place (the default here, unlike torch 2.x's): the engine reads the
        buffers registered at construction, so keeping them saves a copy per param per step.
        set_to_none=True sets every p.grad to None as torch does: params whose grad stays None are
        skipped at step(), and fresh grads are copied into the buffers there."""
        if set_to_none:
            for p in self._params:
                p.grad = None
            return
        for p, buf in zip(self._params, self._grads):
            if _zero.is_dtensor(p):
                p.grad = None  # FSDP2 assigns a new DTensor grad at the next backward
            elif p.grad is not buf:
                p.grad = buf
        torch._foreach_zero_(self._grads)

    # ---- state: torch's state_dict, Ferry's checkpoints ----------------------------------------------

    def _read(self, k, kind):
        if self._zero is not None:  # this rank's range, flattened
            t = torch.empty(self._zero.local_numel(k), dtype=torch.float32)
            self._engine.read_state("p%d" % k, kind, t.data_ptr())
            return t
        t = torch.empty(self._params[k].shape, dtype=torch.float32)
        self._engine.read_state("p%d" % k, kind, t.data_ptr())
        return t

    def state_dict(self):
        """torch.optim.AdamW's layout: {'state': {index: {'step', 'exp_avg', 'exp_avg_sq'[, 'master']}},
        'param_groups': [{..., 'params': [indices]}]}; fp32 CPU tensors, 'master' for params that are not
        fp32. Params of groups that never stepped have no state, as in torch.

        Several ranks: collective; every rank gets the whole state (each param's full tensors, gathered
        from the ranks' ranges), the same dict as one rank would have: it loads with any world size and
        into torch.optim.AdamW. Ferry checkpoints (save_checkpoint) are the scalable per-rank form."""
        self._sync_torch()
        if self._zero is not None:
            full = {kind: self._zero.gather_state(lambda k, kind=kind: self._read(k, kind))
                    for kind in ("exp_avg", "exp_avg_sq", "master")}
        state = {}
        groups = []
        k = 0
        for gi, group in enumerate(self.param_groups):
            packed = {key: value for key, value in group.items() if key != "params"}
            packed["params"] = list(range(k, k + len(group["params"])))
            groups.append(packed)
            step = self._engine.group_step(self._groups[gi])
            for p in group["params"]:
                if step > 0:
                    read = (lambda kind: full[kind][k]) if self._zero is not None else (lambda kind: self._read(k, kind))
                    entry = {"step": torch.tensor(float(step)), "exp_avg": read("exp_avg"),
                             "exp_avg_sq": read("exp_avg_sq")}
                    if p.dtype != torch.float32:
                        entry["master"] = read("master")
                    state[k] = entry
                k += 1
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        """Loads a state dict of this class or of torch.optim.AdamW (or Adam) over the same params.
        The masters come from the params (load the model's weights first), or from 'master' where the
        state dict has it. Everything is checked before anything changes (ValueError)."""
        saved_groups = state_dict["param_groups"]
        saved_state = state_dict["state"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups (%d, this optimizer %d)"
                             % (len(saved_groups), len(self.param_groups)))
        plan = []  # (k, entry or None)
        steps = []
        k = 0
        for gi, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError("loaded state dict's param_groups[%d] has %d params, this optimizer's %d"
                                 % (gi, len(saved["params"]), len(group["params"])))
            for key in _FIXED:
                if key in saved and tuple(_aslist(saved[key])) != tuple(_aslist(group[key])):
                    raise ValueError("loaded state dict's param_groups[%d]['%s'] is %r, this optimizer's %r: Ferry "
                                     "fixes betas, eps and weight_decay at construction; build the optimizer with "
                                     "the checkpoint's settings" % (gi, key, saved[key], group[key]))
            group_steps = []
            for index, p in zip(saved["params"], group["params"]):
                entry = saved_state.get(index)
                if entry is not None:
                    for kind in ("exp_avg", "exp_avg_sq", "master"):
                        if kind in entry and entry[kind].numel() != p.numel():
                            raise ValueError("loaded state dict's state[%r]['%s'] has %d elements, %s has %d"
                                             % (index, kind, entry[kind].numel(), self._where[k], p.numel()))
                    for kind in ("exp_avg", "exp_avg_sq"):
                        if kind not in entry:
                            raise ValueError("loaded state dict's state[%r] has no '%s' (not Adam's state?)"
                                             % (index, kind))
                    group_steps.append(int(float(entry.get("step", 0))))
                plan.append((k, entry))
                k += 1
            if group_steps and any(s != group_steps[0] for s in group_steps):
                warnings.warn("loaded state dict: the params of param_groups[%d] have different step counts %s; "
                              "Ferry keeps one per group and takes %d" % (gi, sorted(set(group_steps)), max(group_steps)))
            steps.append(max(group_steps) if group_steps else 0)
        self._sync_torch()
        self._engine.sync_from_model(reset_optimizer=False)
        for k, entry in plan:
            numel = self._params[k].numel()
            for kind in ("exp_avg", "exp_avg_sq", "master"):
                if kind == "master" and (entry is None or kind not in entry):
                    continue  # the master synced from the param above
                t = torch.zeros(numel, dtype=torch.float32) if entry is None else \
                    _full_state(entry[kind]).detach().to(device="cpu", dtype=torch.float32).contiguous()
                if self._zero is not None:  # this rank's range of the whole state
                    t = self._zero.local_slice(k, t).contiguous()
                self._engine.write_state("p%d" % k, kind, t.data_ptr())
        for gi, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            self._engine.set_group_step(self._groups[gi], steps[gi])
            for key, value in saved.items():
                if key != "params" and key not in _FIXED:
                    group[key] = value

    def save_checkpoint(self, root, step):
        """Ferry's checkpoint of params, masters and moments as <root>/step-<step>/ (the policy's
        checkpoint() hook decides async and retention); returns the directory. Asynchronous saves
        are committed once wait_checkpoint() returns."""
        self._sync_torch()
        return self._engine.save_checkpoint(str(root), int(step))

    def wait_checkpoint(self):
        self._engine.wait_checkpoint()

    def load_checkpoint(self, path, fall_back_to_previous=False):
        """Loads a Ferry checkpoint (a directory, or the `latest` of a root) into the params and the
        engine, bit-identical to the run that saved it. Returns the directory loaded."""
        self._sync_torch()
        self._engine.load_checkpoint(str(path), fall_back_to_previous=fall_back_to_previous)
        if self._zero is not None:
            self._zero.gather_params()  # each rank loaded its range of the params
        return self._engine.last_load()["dir"]

    def sync_from_model(self, groups=None, reset_optimizer=False):
        """Refreshes the fp32 masters from the params after the trainer changed them itself (e.g.
        model.load_state_dict); `groups`: param group indices (None: all); with reset_optimizer the
        moments and steps restart too."""
        self._sync_torch()
        names = [] if groups is None else [self._groups[gi] for gi in groups]
        self._engine.sync_from_model(names, reset_optimizer)

    # ---- introspection -------------------------------------------------------------------------------

    @property
    def engine(self):
        """The ferry.Engine underneath (params "p<k>", groups "group<i>")."""
        return self._engine

    def stats(self):
        """EngineStats as a dict: step, skipped_steps, last_step_skipped, last_grad_norm, pinned_bytes,
        gpu_state_bytes, ..."""
        return self._engine.stats()

    def placement(self):
        """One dict per param group: group (Ferry's name), param_group (the index), offloaded, numel,
        num_params, options (the group's optimizer settings)."""
        out = self._engine.placement()
        for d in out:
            d["param_group"] = self._groups.index(d["group"])
        return out


def _full_state(t):
    """A state tensor of a loaded state dict as a plain whole tensor (a DTensor's full_tensor(),
    collective on its mesh)."""
    return t.full_tensor() if _zero.is_dtensor(t) else t


def _aslist(v):
    return list(v) if isinstance(v, (list, tuple)) else [v]
