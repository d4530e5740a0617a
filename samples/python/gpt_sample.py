#!/usr/bin/env python3
"""A small GPT in plain torch, trained twice from the same initial weights: with ferry.torch.Optimizer
(optimizer state placed by a shipped offload policy) and with torch.optim.AdamW. Prints both loss
curves side by side.

    PYTHONPATH=build/python python3 samples/python/gpt_sample.py --tiny            # CPU, seconds
    PYTHONPATH=build/python python3 samples/python/gpt_sample.py --device cuda     # GPU, bf16 autocast

Both runs use the same param groups (weight decay on the matmul weights only), the same warm-up +
cosine schedule (LambdaLR) and the same batches. --check exits non-zero unless both losses fell and
the curves agree (final losses within 2%).
"""
import argparse
import math
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import ferry
import ferry.torch

TEXT = ("Ferry moves the optimizer state of a model between the GPU and pinned host memory, as a Lua "
        "policy decides, and runs the AdamW update where the state lives. ") * 4 + \
       "".join("%d plus %d is %d. " % (a, b, a + b) for a in range(12) for b in range(12))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab, dim, layers, heads, context):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def param_groups(model, weight_decay):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "tok" not in n and "pos" not in n]
    ids = {id(p) for p in decay}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tiny", action="store_true", help="a model of ~30k params, for CPU and CI")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--policy", default="offload_all", help="a shipped policy's name or a Lua file")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--check", action="store_true", help="exit 1 unless the losses fell and agree")
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.tiny:
        dim, layers, heads, context, batch, steps, lr = 32, 2, 4, 32, 16, 150, 3e-3
    else:
        dim, layers, heads, context, batch, steps, lr = 384, 6, 6, 128, 32, 400, 1e-3
    steps = args.steps or steps
    lr = args.lr or lr
    chars = sorted(set(TEXT))
    data = torch.tensor([chars.index(c) for c in TEXT], dtype=torch.long)

    torch.manual_seed(0)
    models = [GPT(len(chars), dim, layers, heads, context).to(device) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    warmup = max(1, steps // 10)

    def schedule(s):
        return (s + 1) / warmup if s < warmup else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - warmup) / (steps - warmup)))

    opt_ferry = ferry.torch.Optimizer(param_groups(models[0], 0.1), lr=lr, betas=(0.9, 0.95), policy=args.policy,
                                      max_grad_norm=1.0)
    opt_torch = torch.optim.AdamW(param_groups(models[1], 0.1), lr=lr, betas=(0.9, 0.95))
    opts = [opt_ferry, opt_torch]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in opts]
    numel = sum(p.numel() for p in models[0].parameters())
    offloaded = sum(g["numel"] for g in opt_ferry.placement() if g["offloaded"])
    print("GPT: %d params, %d layers, dim %d, on %s; Ferry %s (%s), policy %s: %d of %d params' state offloaded"
          % (numel, layers, dim, device, ferry.__version__, opt_ferry.engine.device_name, args.policy, offloaded, numel))
    print("%6s  %12s  %12s" % ("step", "ferry.torch", "torch AdamW"))
    gen = torch.Generator().manual_seed(1)
    amp = device.type == "cuda"
    losses = [[], []]
    seconds = [0.0, 0.0]
    for step in range(steps):
        starts = torch.randint(0, len(data) - context - 1, (batch,), generator=gen)
        x = torch.stack([data[s:s + context] for s in starts]).to(device)
        y = torch.stack([data[s + 1:s + 1 + context] for s in starts]).to(device)
        for i, (model, opt, sched) in enumerate(zip(models, opts, scheds)):
            t0 = time.perf_counter()
            opt.zero_grad()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                loss = F.cross_entropy(model(x).float().view(-1, len(chars)), y.view(-1))
            loss.backward()
            if opt is opt_torch:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses[i].append(loss.item())
            seconds[i] += time.perf_counter() - t0
        if step % max(1, steps // 15) == 0 or step == steps - 1:
            print("%6d  %12.4f  %12.4f" % (step, losses[0][-1], losses[1][-1]))
    avg = [sum(l[-10:]) / 10 for l in losses]
    print("last 10 steps' mean loss: ferry.torch %.4f, torch AdamW %.4f (first %.4f); %.1f ms vs %.1f ms per step"
          % (avg[0], avg[1], losses[0][0], 1e3 * seconds[0] / steps, 1e3 * seconds[1] / steps))
    print("ferry stats:", {k: v for k, v in opt_ferry.stats().items() if k in ("step", "skipped_steps", "pinned_bytes",
                                                                                  "gpu_state_bytes")})
    if args.check:
        fell = all(a < 0.6 * l[0] for a, l in zip(avg, losses))
        agree = abs(avg[0] - avg[1]) <= 0.02 * avg[1]
        if not (fell and agree):
            print("CHECK FAILED: losses fell: %s, curves agree within 2%%: %s" % (fell, agree))
            return 1
        print("check passed: both losses fell below 60% of the first and agree within 2%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
