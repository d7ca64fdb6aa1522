"""The one-step check on a ReLU's kink (issue 50 item 2), torch only, in one process: a BatchNorm conv net whose one
pre-activation sits at 0 in float64, so float32 rounding puts it on either side. Two float32 computations of the
same step that differ by rounding alone (nn.BatchNorm2d's kernel and the mean-centred formula of ddpkit's
synchronized layer, as 1 and 2 devices) then disagree on whether the gradient passes that element, and the check's first look is
over its bound; from the nudged state (parity_probe.nudged, as the second look's runs load it) the element is off the
kink and the step is within it, so over_twice passes. A bug (the loss halved on one side) is over in both looks."""

import torch
from ddpkit.testing.check_onestep import over_twice, step_verdicts
from ddpkit.testing.parity_probe import nudged
from ddpkit.testing.runs import NUDGE
from torch import nn


class MeanCentred(nn.Module):
    """BatchNorm in training by another formula for the same statistics: torch.var_mean and (x - mean) x invstd, as
    ddpkit's synchronized layer computes them on each rank, where nn.BatchNorm2d's CPU kernel rounds otherwise."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(channels)), nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var, mean = torch.var_mean(x, [0, 2, 3], correction=0, keepdim=True)
        scale = torch.rsqrt(var + 1e-5) * self.weight.view(1, -1, 1, 1)
        return (x - mean) * scale + self.bias.view(1, -1, 1, 1)


def net(formula: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    norm = MeanCentred(4) if formula else nn.BatchNorm2d(4, track_running_stats=False)
    return nn.Sequential(nn.Conv2d(3, 4, 3), norm, nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 1))


BATCH = torch.randn(8, 3, 6, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def model(state: dict, dtype: torch.dtype, formula: bool) -> nn.Sequential:
    m = net(formula).to(dtype)
    m.load_state_dict(state)
    return m


def pre_activation(state: dict, dtype: torch.dtype, formula: bool = False) -> torch.Tensor:
    m = model(state, dtype, formula)
    return m[1](m[0](BATCH.to(dtype))).detach()


def record(state: dict, dtype: torch.dtype, formula: bool = False, scale: float = 1.0) -> dict:
    """One one-step record: the gradient of the mean output (x `scale`) over BATCH from `state` in `dtype`."""
    m = model(state, dtype, formula)
    (m(BATCH.to(dtype)).mean() * scale).backward()
    grads = {name: p.grad.clone() for name, p in m.named_parameters()}
    step = {"before": {n: t.to(dtype) for n, t in state.items()}, "grads": [grads], "after": {}, "logged": {}}
    return {0: step, 1: step}  # global batch 0 is not judged


def at_a_kink() -> dict:
    """A float64 state in which one pre-activation is 0 up to float64's rounding (its channel's bias shifted to
    cancel it) and float32 puts it above 0 by one formula and below by the other."""
    base = {name: t.double() for name, t in net().state_dict().items()}
    exact = pre_activation(base, torch.float64)
    errors = [pre_activation(base, torch.float32, formula).double() - exact for formula in (False, True)]
    opposite = (errors[0] * errors[1] < 0).nonzero().tolist()
    opposite.sort(key=lambda e: -min(abs(errors[0][tuple(e)]), abs(errors[1][tuple(e)])))
    for n, c, i, j in opposite[:20]:
        state = {**base, "1.bias": base["1.bias"].clone()}
        state["1.bias"][c] -= exact[n, c, i, j]
        ours, theirs = (pre_activation(state, torch.float32, formula)[n, c, i, j].item() for formula in (False, True))
        if ours * theirs < 0:
            return state
    raise AssertionError("no element that the two float32 formulas put on either side of 0")


def judged(state: dict, bug: float = 1.0) -> list:
    one, two = record(state, torch.float32), record(state, torch.float32, formula=True, scale=bug)
    return step_verdicts(one, two, record(state, torch.float64), "fp32")


def test_a_relu_kink_fails_the_first_look_and_passes_the_nudged_one():
    """At the kink the first look is over its bound (one element's whole gradient, far above rounding); from the
    nudged state the same step is within it, so the check passes; the loss halved on the 2-device side fails both."""
    state = at_a_kink()
    weights = {name for name, _ in net().named_parameters()}
    again = nudged(state, weights, NUDGE, 1)
    first = judged(state)
    worst = max(v.apart / v.bound for _, _, v in first)
    print(f"at the kink: {worst:.3g} x the one-step bound")  # docs/measurements.md, "ReLU kinks"
    assert any(v.over for _, _, v in first)
    assert not any(v.over for _, _, v in judged(again))
    assert over_twice(first, lambda: judged(again))[0] == []
    halved = over_twice(judged(state, 0.5), lambda: judged(again, 0.5))[0]
    assert {v.name for _, _, v in halved} == weights - {"0.bias"}  # a bias before BatchNorm: no gradient, rounding
