"""A training loop that uses the torch idioms people combine, all at once, with overlap (attached and
not) against the same loop without overlap: decay / no-decay param groups, OneCycleLR stepping the lr
and beta1 every step (its default cycle_momentum), model.zero_grad(set_to_none=True) at the top
of each step, two micro-batches (the first in opt.accumulate()), opt.clip_grad_norm_, a layer frozen
for the first steps, an EMA of model.state_dict() after every step (as timm's ModelEmaV2 keeps it),
torch.save(model.state_dict()) and an evaluation forward every 7 steps.

Every param, EMA tensor, saved checkpoint, evaluation output and returned norm is the same bits; with
a clip that is never reached each step keeps its early work (every group, every step), and with one
reached at every step none does. And the same loop's schedule against torch.optim.AdamW: within
test_adamw_match's FP32_ULPS after every step.
"""
import io
import math

import pytest
import torch

import ferry.torch
from nets import assert_close_to

STEPS = 30


def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                               torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def run(device, overlap, attach, clip):
    model = build().to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = ferry.torch.Optimizer([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                lr=3e-3, policy="offload_all", overlap=overlap, bucket_mb=1e-3,
                                transfer_chunk_bytes=1024)
    if attach:
        opt.attach(model)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=STEPS + 1)
    ema = {k: v.detach().clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    model[0].weight.requires_grad_(False)
    out = {"saved": [], "evals": [], "norms": []}
    for step in range(STEPS):
        if step == 5:
            model[0].weight.requires_grad_(True)
        model.zero_grad(set_to_none=True)
        for micro in range(2):
            x, y = torch.randn(8, 16, generator=gen).to(device), torch.randn(8, 4, generator=gen).to(device)
            if micro == 0:
                with opt.accumulate():
                    (torch.nn.functional.mse_loss(model(x), y) / 2).backward()
            else:
                (torch.nn.functional.mse_loss(model(x), y) / 2).backward()
        out["norms"].append(opt.clip_grad_norm_(clip).item())
        opt.step()
        sched.step()
        with torch.no_grad():
            for k, v in model.state_dict().items():
                ema[k].mul_(0.9).add_(v, alpha=0.1)
        if step % 7 == 0:
            buf = io.BytesIO()
            torch.save(model.state_dict(), buf)
            buf.seek(0)
            out["saved"].append(torch.load(buf))
            with torch.no_grad():
                out["evals"].append(model(torch.ones(2, 16, device=device)).sum().item())
    opt.wait_params()
    out["params"] = [p.detach().clone() for p in model.parameters()]
    out["ema"] = ema
    out["stats"] = opt.stats()
    return out


@pytest.mark.parametrize("clip", [100.0, 0.3], ids=["clip_never_reached", "clip_always_reached"])
def test_the_idioms_together_keep_the_bits_and_the_overlap(device, clip):
    ref = run(device, overlap=False, attach=False, clip=clip)
    assert all(n < clip for n in ref["norms"]) if clip > 1 else all(n > clip for n in ref["norms"]), ref["norms"]
    for attach in (False, True):
        got = run(device, overlap=True, attach=attach, clip=clip)
        what = "attach=%s, clip %s" % (attach, clip)
        assert got["norms"] == ref["norms"], what
        assert got["evals"] == ref["evals"], what
        for a, b in zip(got["params"], ref["params"]):
            assert torch.equal(a, b), what
        for k in ref["ema"]:
            assert torch.equal(got["ema"][k], ref["ema"][k]), "%s: EMA %s" % (what, k)
        for i, (a, b) in enumerate(zip(got["saved"], ref["saved"])):
            for k in b:
                assert torch.equal(a[k], b[k]), "%s: checkpoint %d, %s" % (what, i, k)
        stats = got["stats"]
        assert stats["early_groups_kept"] == (2 * STEPS if clip > 1 else 0), (what, stats["early_groups_kept"])
        assert stats["deferred_steps"] == (STEPS if attach else 0), (what, stats["deferred_steps"])


@pytest.mark.parametrize("overlap,attach", [(False, False), (True, True)])
def test_schedules_of_lr_momentum_and_decay_match_torch_adamw(device, overlap, attach):
    """OneCycleLR changes lr and beta1 at every step, and a cosine schedule of the weight decay (as DINO
    writes it, param_groups[i]['weight_decay'] set each step) the decay: each step takes all three,
    bias corrections included."""
    model, ref = build().to(device), build().to(device)
    opt = ferry.torch.Optimizer(model.parameters(), lr=3e-3, weight_decay=0.1, policy="offload_all",
                                overlap=overlap, bucket_mb=1e-3, transfer_chunk_bytes=1024)
    if attach:
        opt.attach(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1, foreach=False)
    scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=STEPS + 1) for o in (opt, ref_opt)]
    gen = torch.Generator().manual_seed(2)
    betas = set()
    for step in range(STEPS):
        x, y = torch.randn(8, 16, generator=gen).to(device), torch.randn(8, 4, generator=gen).to(device)
        betas.add(opt.param_groups[0]["betas"])
        for o in (opt, ref_opt):
            o.param_groups[0]["weight_decay"] = 0.04 + 0.2 * (1 + math.cos(math.pi * step / STEPS))
        for m, o, sched in ((model, opt, scheds[0]), (ref, ref_opt, scheds[1])):
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad()
            sched.step()
        opt.wait_params()
        assert_close_to(model, ref, "step %d" % step)
    assert len(betas) > STEPS // 2, betas  # beta1 moved at most steps
    if overlap:  # the announcements carried each step's betas: every step kept its early work
        assert opt.stats()["early_groups_kept"] == STEPS
