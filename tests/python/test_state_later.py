"""ferry.torch.Optimizer(state_later=...) (EngineOptions::state_later): part of each decided fp32
update writes its params first and its state later, in the CPU's idle time. The same bits as without
it, through a clipped and a skipped step, with and without attach(), and in state_dict(); stats() show
that it ran; a bad value is refused naming the argument."""
import pytest
import torch

import ferry.torch
from nets import Net, assert_same_bits, batches, loss_of, net_groups

STEPS = 6
D = 32  # 1024-element weights: with 1 KiB chunks every param comes in pieces the buffer can keep
CLIPPED, SKIPPED = 3, 4


def make(device, state_later, spare_state, attach):
    net = Net(d=D, seed=0).to(device)
    opt = ferry.torch.Optimizer(net_groups(net), lr=1e-2, weight_decay=0.1, policy="offload_all", overlap=True,
                                transfer_chunk_bytes=1024, bucket_mb=1e-3, spare_state=spare_state,
                                state_later=state_later)
    if attach:
        opt.attach(net)
    return net, opt


def train_step(net, opt, step):
    (x, y), = batches(next(net.parameters()).device, step, d=D)
    loss = loss_of(net, x, y, step)
    if step == SKIPPED:
        loss = loss * float("inf")  # every grad Inf or NaN: the step is skipped
    loss.backward()
    if step == CLIPPED:
        opt.clip_grad_norm_(1e-3)  # reached: the step's scalars differ from the speculated ones
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("attach", [False, True])
@pytest.mark.parametrize("spare_state", [0.0, 1.0])
@pytest.mark.parametrize("state_later", ["auto", 0.5])
def test_state_later_gives_the_same_bits(device, state_later, spare_state, attach):
    """With attach() (deferred steps) and spare_state=0 nothing speculates: every update runs in place
    beside the next forward once step() has decided, and the state later takes its share of each;
    with 1.0 the speculated updates are never split, those begun after step() kept the speculation
    are. Without attach() and spare state step() runs the update itself and nothing is split."""
    net, opt = make(device, state_later, spare_state, attach)
    plain_net, plain = make(device, "off", spare_state, attach)
    for step in range(1, STEPS + 1):
        train_step(net, opt, step)
        train_step(plain_net, plain, step)
        opt.engine.synchronize()
        plain.engine.synchronize()
        assert_same_bits(net, plain_net, "step %d" % step)
    s, p = opt.stats(), plain.stats()
    assert s["skipped_steps"] == p["skipped_steps"] == 1
    assert p["cpu_adam_later_bytes"] == 0 and p["state_later_kept_bytes"] == 0 and p["state_later_limit_bytes"] == 0
    if attach:  # deferred steps: the early pass runs the decided updates, and splits some
        assert 0 < s["state_later_limit_bytes"] <= s["state_later_kept_bytes"]
        assert s["cpu_adam_later_bytes"] > 0  # the state's rounds ran
        assert s["cpu_adam_later_bytes"] % 28 == 0  # 24 B of state read and written, the kept fp32 grad read
    elif spare_state == 0.0:  # step() runs the whole update in its own pipeline, which splits nothing
        assert s["cpu_adam_later_bytes"] == 0
    a, b = opt.state_dict(), plain.state_dict()  # reads the state: what is left of it is written first
    for k in b["state"]:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch.as_tensor(a["state"][k][name]), torch.as_tensor(b["state"][k][name])), (k, name)


@pytest.mark.parametrize("bad", ["half", "Auto", "0.5", 0, 1.5, -0.25, True, float("nan")])
def test_a_bad_state_later_is_refused(device, bad):
    net = Net(d=D, seed=0).to(device)
    with pytest.raises(ValueError, match="state_later must be None, 'off', 'auto' or a fraction"):
        ferry.torch.Optimizer(net.parameters(), policy="offload_all", state_later=bad)


def test_state_later_is_off_unless_asked(device, monkeypatch):
    """None leaves it to FERRY_STATE_LATER, else off; 'off' wins over the environment."""
    monkeypatch.delenv("FERRY_STATE_LATER", raising=False)
    for state_later, env, on in ((None, None, False), (None, "auto", True), ("off", "auto", False),
                                 ("auto", None, True)):
        if env is None:
            monkeypatch.delenv("FERRY_STATE_LATER", raising=False)
        else:
            monkeypatch.setenv("FERRY_STATE_LATER", env)
        net, opt = make(device, state_later, 0.0, True)
        for step in range(1, 3):
            train_step(net, opt, step)
        assert (opt.stats()["state_later_kept_bytes"] > 0) == on, (state_later, env)
