"""samples/python/bench_bounds.py's FirstGradsWait: the least time of an iteration in which an
overlapped, CPU-bound loop leaves CPU Adam nothing to do, from the forward of the module whose param a
backward finishes first to that grad. On the CPU it times the host's clock, on CUDA events (the GPU
idle between the host's launches, so they follow the host's sleeps); a model with known sleeps says
whether it measures that span and not the iteration, and its tail (on to the pass's end, the bound of a
loop whose clip is reached at every step) likewise."""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "samples", "python"))
import bench_bounds  # noqa: E402

BEFORE_S, FORWARD_S, BACKWARD_S, AFTER_S = 0.15, 0.03, 0.03, 0.04


class Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        time.sleep(FORWARD_S)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(BACKWARD_S)
        return grad


class Slow(torch.nn.Module):
    """Sleeps in its forward: time before the head that the wait must not count."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        time.sleep(BEFORE_S)
        return self.lin(x)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = Slow()
        self.head = torch.nn.Linear(8, 8)

    def forward(self, x):
        return Sleep.apply(self.head(self.body(x))).square().sum()


def test_it_times_the_head_forward_to_its_grads_and_not_the_iteration(device):
    torch.manual_seed(0)
    net, x = Net().to(device), torch.randn(4, 8, device=device)
    wait = bench_bounds.FirstGradsWait(net, cuda=device.type == "cuda")
    net(x).backward()
    assert wait.first is net.head.weight or wait.first is net.head.bias
    wait.arm()
    assert wait.owner is net.head
    for _ in range(3):
        net(x).backward()
        time.sleep(AFTER_S)  # the rest of the backward, after the head's grads
        wait.pass_done()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = wait.finish()
    assert len(wait.starts) == len(wait.ends) == len(wait.pass_ends) == 3
    # Both sleeps lie between the head's forward and its grads; the body's forward does not.
    assert FORWARD_S + BACKWARD_S <= seconds < FORWARD_S + BACKWARD_S + BEFORE_S / 2
    # The tail runs on to the pass's end: the sleep after the backward too, still not the body's forward.
    assert FORWARD_S + BACKWARD_S + AFTER_S <= wait.tail < FORWARD_S + BACKWARD_S + AFTER_S + BEFORE_S / 2
    net(x).backward()  # the hooks are gone after finish()
    assert len(wait.starts) == len(wait.ends) == 3


def test_nothing_timed_without_a_backward_before_arm(device):
    net = Net().to(device)
    wait = bench_bounds.FirstGradsWait(net, cuda=device.type == "cuda")
    wait.arm()
    net(torch.randn(2, 8, device=device)).backward()
    assert wait.owner is None
    wait.pass_done()
    assert wait.finish() is None and wait.tail is None
