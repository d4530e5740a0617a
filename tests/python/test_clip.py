"""opt.clip_grad_norm_: the drop-in for torch.nn.utils.clip_grad_norm_ that keeps overlap.

Against torch.optim.AdamW + torch.nn.utils.clip_grad_norm_ on a small net with fresh random batches,
the clip reached on some steps and not on others, one param group and two (decay / no decay) and a
group per layer: the returned norms equal torch's (float32 rounding of a sum in another order), the
params stay within test_adamw_match's bound, no grad changes in place, and overlap turns on and stays
on (no warning), each step that did not clip keeping its early work.
"""
import warnings

import pytest
import torch

import ferry.torch
from nets import FP32_ULPS, ulps

STEPS = 12


def make_net(device, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 1)).to(device)


def groupings(net, how):
    if how == "one":
        return net.parameters()
    if how == "decay":  # nanoGPT's configure_optimizers: 2-D weights decay, the rest does not
        decay = [p for p in net.parameters() if p.dim() >= 2]
        rest = [p for p in net.parameters() if p.dim() < 2]
        return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    return [{"params": list(m.parameters())} for m in net if list(m.parameters())]


def batch(device, step):
    gen = torch.Generator().manual_seed(500 + step)
    x = torch.randn(64, 16, generator=gen)
    # Large targets every fourth step: their grads exceed max_norm and the clip is reached.
    y = torch.randn(64, 1, generator=gen) * (40.0 if step % 4 == 0 else 0.05)
    return x.to(device), y.to(device)


@pytest.mark.parametrize("how", ["one", "decay", "block"])
def test_clip_grad_norm_matches_torch_and_keeps_overlap(device, how):
    max_norm = 1.0
    ref_net, net = make_net(device), make_net(device)
    ref = torch.optim.AdamW(groupings(ref_net, how), lr=1e-2, weight_decay=0.1)
    opt = ferry.torch.Optimizer(groupings(net, how), lr=1e-2, weight_decay=0.1, policy="offload_all")
    clipped = kept_before = 0
    last_clipped = True
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # overlap turning itself off would warn
        for step in range(STEPS):
            x, y = batch(device, step)
            torch.nn.functional.mse_loss(ref_net(x), y).backward()
            ref_norm = torch.nn.utils.clip_grad_norm_(ref_net.parameters(), max_norm)
            ref.step()
            ref.zero_grad()

            torch.nn.functional.mse_loss(net(x), y).backward()
            before = [p.grad.detach().clone() for p in net.parameters()]
            norm = opt.clip_grad_norm_(max_norm)
            assert isinstance(norm, torch.Tensor) and norm.dim() == 0
            for p, b in zip(net.parameters(), before):
                assert torch.equal(p.grad, b), "clip_grad_norm_ changed a grad in place"
            assert torch.allclose(norm.cpu(), ref_norm.cpu(), rtol=1e-5), (step, norm, ref_norm)
            clipped += int(ref_norm.item() > max_norm)
            kept_before = opt.stats()["early_groups_kept"]
            opt.step()
            opt.zero_grad()
            # Speculation runs after a step that did not clip: such a step, not clipping either, keeps it.
            now_clipped = ref_norm.item() > max_norm
            if step >= 2 and not now_clipped and not last_clipped:
                assert opt.stats()["early_groups_kept"] > kept_before, "step %d did not clip but kept nothing" % step
            last_clipped = now_clipped
            for p, q in zip(net.parameters(), ref_net.parameters()):
                assert ulps(p, q) <= FP32_ULPS, (step, ulps(p, q).item())
    assert 0 < clipped < STEPS, "the test must clip on some steps and not on others"
    assert opt.overlapping, "clip_grad_norm_ must keep overlap on"
    assert opt.stats()["last_grad_norm"] > 0


def test_clip_grad_norm_arguments(device):
    net = make_net(device)
    opt = ferry.torch.Optimizer(net.parameters(), lr=1e-2, policy="offload_all")
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        opt.clip_grad_norm_(0.0)
    assert float(opt.clip_grad_norm_(1.0)) == 0.0  # no grad yet: a zero norm, as torch's
    x, y = batch(device, 0)
    torch.nn.functional.mse_loss(net(x), y).backward()
    grads = [p.grad.detach().clone() for p in net.parameters()]
    ref = torch.nn.utils.get_total_norm(grads, float("inf")) if hasattr(torch.nn.utils, "get_total_norm") else \
        max(g.abs().max() for g in grads)
    inf_norm = opt.clip_grad_norm_(0.5, norm_type=float("inf"))  # torch's own, in place
    assert torch.allclose(inf_norm.cpu(), torch.as_tensor(ref).cpu())
    assert any(not torch.equal(p.grad, g) for p, g in zip(net.parameters(), grads)), "inf-norm clips in place"
    for p in net.parameters():
        p.grad.fill_(float("nan"))
    with pytest.raises(RuntimeError, match="non-finite"):
        opt.clip_grad_norm_(1.0, error_if_nonfinite=True)
