"""`Optimizer.clip_grad_norm_`: the drop-in for `torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`
that changes no grad in place, so the offloaded update can still start during the backward.

torch's clip scales every grad in place between the backward and step(); the groups Ferry announced
during the backward would then have been started on grads that changed, and step() recomputes them
(exact, but nothing overlapped). Here the clip is done by the engine inside the step, with the exact
global norm it computes anyway (the same formula as torch: max_norm / (norm + 1e-6), when below 1),
and the norm is returned as a tensor for logging, as torch returns it. The announcements of the next
steps carry the same max_norm, so a step whose clip is not reached keeps its early work.
"""
import math

import torch


def _total_norm(grads):
    """The L2 norm of `grads` together, as a 0-dim float32 tensor on their device (DTensor grads:
    the global norm, through torch's own get_total_norm where it exists)."""
    if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6: DTensor-aware, foreach kernels
        total = torch.nn.utils.get_total_norm(grads, 2.0)
        return total.full_tensor() if hasattr(total, "full_tensor") else total
    norms = [torch.linalg.vector_norm(g.detach(), 2, dtype=torch.float32) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms), 2)


class ClipMixin:
    _clip_next = None   # the max_norm of the coming step() (set by clip_grad_norm_, used once)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        """Clips the global norm of this optimizer's grads to `max_norm` in the coming step() and
        returns that norm (of the unscaled grads, as a tensor), like
        `torch.nn.utils.clip_grad_norm_(params, max_norm)` over every param of the optimizer.

        No grad changes in place: the step clips inside the engine (StepOptions::max_grad_norm, the
        same formula as torch's), so the announcements made during the backward stay valid and the
        overlap is kept. Call it between the last backward of a step and step(), as torch's.
        norm_type other than 2: torch's clip_grad_norm_ on the grads (in place; that step recomputes
        its announced groups, and overlap=None turns off). `foreach` is accepted for compatibility.
        Several ranks: the norm of the grads as this rank holds them (DDP's all-reduced grads, or
        FSDP2's sharded DTensor grads, whose global norm torch computes)."""
        max_norm = float(max_norm)
        norm_type = float(norm_type)
        if not (max_norm > 0.0) or math.isinf(max_norm):
            raise ValueError("clip_grad_norm_: max_norm must be > 0 and finite, got %r" % max_norm)
        grads = [self._params[k].grad for k in range(len(self._params)) if self._has_grad(k)]
        if norm_type != 2.0:
            return torch.nn.utils.clip_grad_norm_([self._params[k] for k in range(len(self._params))
                                                   if self._has_grad(k)], max_norm, norm_type,
                                                  error_if_nonfinite=error_if_nonfinite)
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=self._device)
        total = _total_norm(grads) / self._amp_loss_scale()
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError("The total norm of order 2.0 for gradients from `parameters` is non-finite, so it "
                               "cannot be clipped. To disable this error and scale the gradients by the "
                               "non-finite norm anyway, set `error_if_nonfinite=False`")
        self._clip_next = max_norm
        return total

    def _clip_options(self, options):
        """`options` (step()'s, from _options) with this step's clip_grad_norm_ call, if any (an explicit
        max_grad_norm wins); the call is used once."""
        if self._clip_next is not None and options.get("max_grad_norm", 0.0) == 0.0:
            options["max_grad_norm"] = self._clip_next
        self._clip_next = None
        return options
