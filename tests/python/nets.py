"""Small torch models and training loops shared by the overlap and drop-in suites."""
import math

import torch
from torch import nn

from test_adamw_match import FP32_ULPS, ulps

__all__ = ["FP32_ULPS", "Net", "assert_close_to", "assert_same_bits", "batches", "loss_of", "net_groups", "ulps"]


class Block(nn.Module):
    """tanh(fc(x)); with `shared` (a Parameter other blocks hold too, as tied weights are) added to
    its input ("in") or multiplied into its output ("out")."""

    def __init__(self, d, shared=None, where=None):
        super().__init__()
        self.fc = nn.Linear(d, d)
        if shared is not None:
            self.shared = shared
        self.where = where

    def forward(self, x):
        if self.where == "in":
            x = x + self.shared
        y = torch.tanh(self.fc(x))
        return y * self.shared if self.where == "out" else y


class Net(nn.Module):
    """Every case of the announcing rule in one model:
      blocks[0], blocks[2]: plain layers;
      `shared`: one Parameter held by blocks 1 and 2 (both modules own it; it gets two contributions);
      blocks[3]: a module run twice in one forward;
      frozen: requires_grad=False (weight and bias);
      spare: reached only on odd steps (no grad on even steps);
      head: the output layer."""

    def __init__(self, d=12, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        shared = nn.Parameter(torch.randn(d))
        self.blocks = nn.ModuleList([Block(d), Block(d, shared, "out"), Block(d, shared, "in"), Block(d)])
        self.frozen = nn.Linear(d, d).requires_grad_(False)
        self.spare = nn.Linear(d, d)
        self.head = nn.Linear(d, 1)

    def forward(self, x, step):
        for block in self.blocks[:3]:
            x = block(x)
        x = self.blocks[3](self.blocks[3](x))
        x = self.frozen(x)
        if step % 2 == 1:
            x = x + self.spare(x)
        return self.head(x)


def net_groups(net, lr=1e-2, weight_decay=0.1):
    """One param group per layer, as the overlap wants, and the rule's cases:
      0: blocks[0]   1: blocks[1] + shared   2: blocks[2]   3: blocks[3] (run twice)
      4: frozen.weight (all frozen)   5: spare (no grad on even steps)   6: head + frozen.bias (mixed)."""
    b = net.blocks
    return [
        {"params": list(b[0].parameters())},
        {"params": list(b[1].fc.parameters()) + [b[1].shared]},
        {"params": list(b[2].fc.parameters())},
        {"params": list(b[3].parameters())},
        {"params": [net.frozen.weight]},
        {"params": list(net.spare.parameters()), "lr": lr * 0.5},
        {"params": list(net.head.parameters()) + [net.frozen.bias], "weight_decay": 0.0},
    ]


def batches(device, step, micro=1, d=12, n=8):
    gen = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(n, d, generator=gen).to(device), torch.randn(n, 1, generator=gen).to(device))
            for _ in range(micro)]


def loss_of(net, x, y, step):
    return torch.nn.functional.mse_loss(net(x, step), y)


def params_of(net):
    return [p.detach().cpu().clone() for p in net.parameters()]


def assert_same_bits(a, b, what=""):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p.detach().cpu(), q.detach().cpu()), "%s %s" % (what, name)


def assert_close_to(a, ref, what="", scale=0.0):
    """Within FP32_ULPS units in the last place at the tensor's scale, or at `scale` when larger: a
    step's update is rounded at its own size (about lr), which can exceed a small tensor's values."""
    for (name, p), q in zip(a.named_parameters(), ref.parameters()):
        x, y = p.detach().double().cpu(), q.detach().double().cpu()
        mag = max(x.abs().max().item(), y.abs().max().item(), scale)
        ulp = math.ulp(torch.tensor(mag, dtype=torch.float32).item()) * 2.0 ** 29  # fp32's ulp at mag
        assert (x - y).abs().max().item() <= FP32_ULPS * ulp, "%s %s: %s" % (what, name, (x - y).abs().max())
