"""torch's state_dict and Ferry's checkpoints for ferry.torch.Optimizer (a mixin of it: it uses the
optimizer's _engine, _params, _where, _groups, param_groups and _sync_torch).

Asynchronous saves at exit: the engine's writer thread calls Python (ferry.distributed's collectives
of the checkpoint protocol). Once the interpreter finalizes, a thread that takes the GIL is made to
exit on the spot, and its C++ frames then abort the process ("Fatal Python error: PyThreadState_Get"),
so an optimizer still alive at exit (a script that ends, or raises, with a save in flight) must not
leave its writer running into finalization. An atexit handler, which runs before finalization, waits
for every live optimizer's save (its result, or its error on stderr): the save commits or fails, bounded
by checkpoint_timeout, and fails at once when a rank failed (its abort note) or is gone.
"""
import atexit
import sys
import warnings
import weakref

import torch

from . import _zero
from ._checks import FIXED


class StateMixin:
    # ---- params the trainer changed in place (model.load_state_dict, a copy_ into a param) ----

    def _record_param_versions(self):
        """What Ferry last saw of each param (torch's version counter: every in-place write bumps it;
        the engine's own uploads write the memory without it)."""
        self._param_versions = [p._version for p in self._params]

    def _changed_params(self):
        if not self._watch_params:
            return []
        return [k for k, p in enumerate(self._params) if p._version != self._param_versions[k]]

    def _sync_changed_params(self):
        """Refreshes the masters of params the trainer wrote in place since Ferry last saw them: each
        element whose value is not its master rounded to the param's dtype takes the param's value as
        its master; the others keep theirs (a param restored to the same values, an EMA swapped out and
        back, loses no master bit). The moments and steps stay, as torch's AdamW keeps its state when
        the trainer writes params. Returns the params refreshed. One process or several ranks
        (_watch_params: not FSDP2's DTensors; ZeRO-1's gathers write through .data, which bumps no
        version) and this rank's range of each; under FSDP2 the trainer calls sync_from_model()."""
        changed = self._changed_params()
        if not changed:
            return []
        self._sync_torch()
        synced = []
        for k in changed:
            p = self._params[k]
            b, e = self._grad_range(k)
            if e == b:
                continue  # no elements of it on this rank
            master = self._read(k, "master").reshape(-1)
            value = p.detach().reshape(-1)[b:e].float().cpu()
            kept = value == (master if p.dtype == torch.float32 else master.to(p.dtype).float())
            if bool(kept.all()):
                continue
            new = torch.where(kept, master, value).contiguous()
            self._engine.write_state("p%d" % k, "master", new.data_ptr())
            synced.append(k)
        self._record_param_versions()
        self._params_synced += len(synced)
        return synced

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
        self._sync_changed_params()
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
            for key in FIXED:
                if key in saved and tuple(_aslist(saved[key])) != tuple(_aslist(group[key])):
                    raise ValueError("loaded state dict's param_groups[%d]['%s'] is %r, this optimizer's %r: Ferry "
                                     "fixes eps at construction; build the optimizer with the checkpoint's settings"
                                     % (gi, key, saved[key], group[key]))
            group_steps = []
            for index, p in zip(saved["params"], group["params"]):
                entry = saved_state.get(index)
                if entry is not None:
                    for kind in ("exp_avg", "exp_avg_sq", "master"):
                        if kind in entry and tuple(entry[kind].shape) != tuple(p.shape):
                            raise ValueError("loaded state dict's state[%r]['%s'] has shape %s (%d elements), %s "
                                             "has shape %s (%d elements)"
                                             % (index, kind, tuple(entry[kind].shape), entry[kind].numel(),
                                                self._where[k], tuple(p.shape), p.numel()))
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
        self._record_param_versions()
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
                if key != "params" and key not in FIXED:
                    group[key] = value

    def save_checkpoint(self, root, step):
        """Ferry's checkpoint of params, masters and moments as <root>/step-<step>/ (the policy's
        checkpoint() hook decides async and retention); returns the directory. Asynchronous saves
        are committed once wait_checkpoint() returns."""
        self._sync_torch()
        self._sync_changed_params()
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
        self._record_param_versions()
        return self._engine.last_load()["dir"]

    def sync_from_model(self, groups=None, reset_optimizer=False):
        """Refreshes the fp32 masters from the params after the trainer changed them itself (e.g.
        model.load_state_dict); `groups`: param group indices (None: all); with reset_optimizer the
        moments and steps restart too."""
        self._sync_torch()
        names = [] if groups is None else [self._groups[gi] for gi in groups]
        self._engine.sync_from_model(names, reset_optimizer)
        if groups is None:
            self._record_param_versions()

    # ---- a step that skips params without grads (torch.py's _step) ----

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
        skipped_set = set(skipped)
        for gi, n in enumerate(self._group_sizes):
            k = self._group_start[gi]
            if all(j in skipped_set for j in range(k, k + n)):
                saved["steps"][self._groups[gi]] = self._engine.group_step(self._groups[gi])
        return saved

    def _restore_skipped(self, saved):
        for k, value, state in saved["params"]:
            for kind, t in state.items():
                self._engine.write_state("p%d" % k, kind, t.data_ptr())
            self._params[k].copy_(value)
            self._param_versions[k] = self._params[k]._version
        for group, step in saved["steps"].items():
            self._engine.set_group_step(group, step)


_live = weakref.WeakSet()  # optimizers whose engine may have a save in flight


def finish_saves_at_exit_of(opt):
    """Registers `opt` for the atexit wait (see the module's documentation)."""
    _live.add(opt)


@atexit.register
def _finish_saves_at_exit():
    for opt in list(_live):
        engine = getattr(opt, "_engine", None)
        if engine is None:
            continue
        try:
            engine.wait_checkpoint()  # releases the GIL while it waits
        except Exception as e:  # noqa: BLE001 -- at exit: report, do not raise
            sys.stderr.write("ferry: at exit, the optimizer's asynchronous checkpoint save failed: %s\n" % e)


def _full_state(t):
    """A state tensor of a loaded state dict as a plain whole tensor (a DTensor's full_tensor(),
    collective on its mesh)."""
    return t.full_tensor() if _zero.is_dtensor(t) else t


def _aslist(v):
    return list(v) if isinstance(v, (list, tuple)) else [v]
