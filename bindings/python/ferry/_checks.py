"""The argument and param checks of ferry.torch.Optimizer's construction (each error names the
argument, param group or param at fault, and is raised before anything was built), and at each step
that its params and fixed settings did not change (unchanged), with the step's per-group options."""
import math
import numbers

import torch

from . import _zero

DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def where(param_index, group_index, in_group):
    return "param %d (param_groups[%d]['params'][%d])" % (param_index, group_index, in_group)


def _real(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _count(name, value):
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
        raise ValueError("%s must be an int >= 0 (0: Ferry's default), got %r" % (name, value))


def check_betas(betas, what="betas"):
    """Two numbers in [0, 1): torch.optim.AdamW's (beta1, beta2)."""
    try:
        values = tuple(betas)
    except TypeError:
        raise ValueError("%s must be a pair (beta1, beta2), got %r" % (what, betas)) from None
    if len(values) != 2 or not all(_real(b) for b in values):
        raise ValueError("%s must be a pair of numbers (beta1, beta2), got %r" % (what, betas))
    for i, b in enumerate(values):
        if not 0.0 <= b < 1.0:
            raise ValueError("Invalid beta parameter at index {}: {} ({})".format(i, b, what))
    return values


def check_arguments(lr, betas, eps, weight_decay, cpu_threads, transfer_chunk_bytes, overlap, numa, trace_path):
    for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
        if not _real(value):
            raise ValueError("%s must be a number, got %r" % (name, value))
    if not 0.0 <= lr:
        raise ValueError("Invalid learning rate: {}".format(lr))
    if not 0.0 <= eps:
        raise ValueError("Invalid epsilon value: {}".format(eps))
    if not 0.0 <= weight_decay:
        raise ValueError("Invalid weight_decay value: {}".format(weight_decay))
    check_betas(betas)
    _count("cpu_threads", cpu_threads)
    _count("transfer_chunk_bytes", transfer_chunk_bytes)
    if overlap not in (None, True, False):
        raise ValueError("overlap must be None (automatic), True or False, got %r" % (overlap,))
    for name, value in (("numa", numa), ("trace_path", trace_path)):
        if not isinstance(value, str):
            raise ValueError("%s must be a str, got %r" % (name, value))


def host_arguments(cpu_threads_max, pin_cpu_threads, pin_trainer_threads):
    """The share's arguments as ferry.Engine takes them: pins None (the engine's rule) -> -1, False -> 0, True -> 1."""
    _count("cpu_threads_max", cpu_threads_max)
    out = {"cpu_threads_max": int(cpu_threads_max)}
    for name, value in (("pin_cpu_threads", pin_cpu_threads), ("pin_trainer_threads", pin_trainer_threads)):
        if value is not None and value not in (True, False):
            raise ValueError("%s must be None (the engine's rule), True or False, not %r" % (name, value))
        out[name] = -1 if value is None else int(bool(value))
    return out


def overlap_arguments(bucket_mb, spare_state, state_later):
    """The overlap's arguments as the engine takes them: (bytes per bucket, spare state fraction, the
    state later's text: "" for None, which leaves it to FERRY_STATE_LATER)."""
    if not (_real(bucket_mb) and bucket_mb > 0):
        raise ValueError("bucket_mb must be a number > 0 (MiB of grads per bucket), not %r" % (bucket_mb,))
    if not (_real(spare_state) and 0.0 <= spare_state <= 1.0):
        raise ValueError("spare_state must be a fraction in [0, 1] of the offloaded state, not %r" % (spare_state,))
    if state_later is None:
        later = ""
    elif state_later in ("off", "auto"):
        later = state_later
    elif _real(state_later) and 0.0 < state_later <= 1.0:
        later = repr(float(state_later))
    else:
        raise ValueError("state_later must be None, 'off', 'auto' or a fraction in (0, 1] of the offloaded fp32 "
                         "grads' bytes, not %r" % (state_later,))
    return max(1, int(float(bucket_mb) * (1 << 20))), float(spare_state), later


def check_group(gi, group, keys=("lr", "eps", "weight_decay")):
    """A param group's own settings (those given in its dict; at each step, those a scheduler may
    change: keys=("weight_decay",)). Returns its betas as a pair of floats."""
    betas = check_betas(group["betas"], "param_groups[%d]['betas']" % gi)
    for key in keys:
        if not _real(group[key]) or not group[key] >= 0 or math.isinf(group[key]):
            raise ValueError("param_groups[%d]['%s'] must be a number >= 0, got %r" % (gi, key, group[key]))
    return tuple(float(b) for b in betas)


def check_params(params, wheres):
    """The one device of every param; errors name the first param at fault. Params that share memory
    (the same tensor twice, overlapping views of one storage) are refused: they would step twice."""
    if not params:
        raise ValueError("ferry.torch.Optimizer got an empty parameter list")
    first = None
    for p, at in zip(params, wheres):
        if not isinstance(p, torch.Tensor):
            raise TypeError("%s is a %s, not a torch.Tensor" % (at, type(p).__name__))
        if p.device.type not in ("cpu", "cuda"):
            raise ValueError("%s is on %s: Ferry takes CPU tensors (host backend) or CUDA tensors" % (at, p.device))
        if first is None:
            first = (p.device, at)
        elif p.device != first[0]:
            raise ValueError("%s is on %s, but %s is on %s: every param of one optimizer must be on one device"
                             % (at, p.device, first[1], first[0]))
        if p.dtype not in DTYPES:
            raise TypeError("%s has dtype %s: Ferry's params are torch.float32, torch.bfloat16 or torch.float16"
                            % (at, p.dtype))
        dtensor = _zero.is_dtensor(p)
        p = _zero.local(p)  # a DTensor's local shard holds its memory
        if p.is_sparse or p.layout != torch.strided:
            raise ValueError("%s is not a dense (strided) tensor" % at)
        if not p.is_contiguous():
            raise ValueError("%s is not contiguous (strides %s): Ferry updates params as flat memory; pass "
                             "contiguous tensors" % (at, tuple(p.stride())))
        if p.numel() == 0 and not dtensor:  # a DTensor's shard on this rank may be empty
            raise ValueError("%s has no elements (shape %s)" % (at, tuple(p.shape)))
    _check_disjoint([_zero.local(p) for p in params], wheres)
    return first[0]


def _check_disjoint(params, wheres):
    # Contiguous params cover [data_ptr, data_ptr + bytes): sorted by start, any overlap is between
    # neighbours (or with the widest range so far).
    spans = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size(), k) for k, p in enumerate(params))
    reach = None  # (end, k) of the range that reaches furthest so far
    for begin, end, k in spans:
        if reach is not None and begin < reach[0]:
            j = reach[1]
            a, b = sorted((j, k))
            same = params[a] is params[b]
            raise ValueError("%s and %s %s: Ferry would update %s twice per step; pass each param once"
                             % (wheres[a], wheres[b], "are the same tensor" if same else
                                "share memory (overlapping views of one storage)",
                                "it" if same else "the shared elements"))
        if reach is None or end > reach[0]:
            reach = (end, k)


FIXED = ("eps",)  # lr, betas and weight_decay may change per step (schedulers)


def unchanged(opt):
    """At each step of `opt` (a ferry.torch.Optimizer): RuntimeError when its params changed since
    construction; ValueError when a group's fixed settings did, or its betas are not a pair in
    [0, 1), or its weight decay is not >= 0. Returns this step's per-group options for the engine: {"group_lr": [(group name, lr)], "group_betas":
    [(group name, (beta1, beta2))] and "group_weight_decay": [(group name, wd)] of the groups whose
    values differ from construction (schedulers: OneCycleLR's momentum, DINO's weight decay)}."""
    groups = opt.param_groups
    if len(groups) != len(opt._group_sizes):
        raise RuntimeError("ferry.torch.Optimizer: param_groups has %d groups, the optimizer was built with %d"
                           % (len(groups), len(opt._group_sizes)))
    lrs, betas, wds = [], [], []
    k = 0
    for gi, group in enumerate(groups):
        ps = group["params"]
        if len(ps) != opt._group_sizes[gi]:
            raise RuntimeError("ferry.torch.Optimizer: param_groups[%d] has %d params, the optimizer was built "
                               "with %d" % (gi, len(ps), opt._group_sizes[gi]))
        for p in ps:
            sig = opt._signature[k]
            ptr = _zero.local(p).data_ptr()
            if p is opt._params[k] and ptr != sig[0] and _zero.is_dtensor(p):
                raise RuntimeError(_zero.moved_shard_message(opt._where[k]))
            if p is not opt._params[k] or ptr != sig[0] or p.shape != sig[1] or p.dtype != sig[2]:
                raise RuntimeError(
                    "%s changed after the optimizer was constructed (now %s %s at 0x%x; registered %s %s at "
                    "0x%x): Ferry registered its memory; build a new optimizer after replacing, moving or "
                    "resizing params" % (opt._where[k], tuple(p.shape), p.dtype, ptr, sig[1], sig[2], sig[0]))
            k += 1
        for key in FIXED:
            if group[key] != opt._fixed[gi][key]:
                raise ValueError("param_groups[%d]['%s'] changed from %r to %r after construction: Ferry fixes "
                                 "a group's eps when the optimizer is built (lr, betas and weight_decay may "
                                 "change per step)" % (gi, key, opt._fixed[gi][key], group[key]))
        lrs.append((opt._groups[gi], float(group["lr"])))
        if group["betas"] != opt._betas[gi] or group["weight_decay"] != opt._wd[gi]:
            b = check_group(gi, group, keys=("weight_decay",))  # set by a scheduler
            if b != opt._betas[gi]:
                betas.append((opt._groups[gi], b))
            if float(group["weight_decay"]) != opt._wd[gi]:
                wds.append((opt._groups[gi], float(group["weight_decay"])))
    return {"group_lr": lrs, "group_betas": betas, "group_weight_decay": wds}
