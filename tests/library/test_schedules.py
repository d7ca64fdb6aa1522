"""The learning-rate schedule and the glue from a module's optimizer and scheduler arguments to Lightning."""

import io
from types import SimpleNamespace

import pytest
import torch

from ddpkit.model.schedules import WarmupCosine, optimization


def lrs(warmup: int, total: int | None, steps: int, min_lr_ratio: float = 0.1) -> list[float]:
    """The lr of SGD(lr=1) before each of `steps` optimizer steps under WarmupCosine."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = WarmupCosine(optimizer, warmup_steps=warmup, total_steps=total, min_lr_ratio=min_lr_ratio)
    seen = [optimizer.param_groups[0]["lr"]]
    for _ in range(steps - 1):
        optimizer.step()
        schedule.step()
        seen.append(optimizer.param_groups[0]["lr"])
    return seen


def test_warmup_rises_linearly_to_the_full_lr():
    """Step 0 of a 4-step warmup runs at 1/4 of the lr, step 3 (the warmup's last) and step 4 at the full lr."""
    assert lrs(warmup=4, total=20, steps=5) == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])


def test_cosine_falls_to_min_lr_ratio_at_total_steps_and_stays():
    """Halfway through the decay the lr is (1 + min) / 2; at total_steps and after it is min_lr_ratio x lr."""
    seen = lrs(warmup=4, total=20, steps=26)
    assert seen[12] == pytest.approx(0.55)  # (12 - 4) / (20 - 4) = halfway
    assert seen[20] == pytest.approx(0.1) and seen[25] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(seen[4:], seen[5:], strict=False))  # never rises after the warmup


def test_no_warmup_starts_at_the_full_lr():
    """warmup_steps=0: step 0 runs at the full lr, known before total_steps is (the trainer fills it later)."""
    assert lrs(warmup=0, total=10, steps=1) == [1.0]
    assert lrs(warmup=0, total=None, steps=1) == [1.0]


def test_state_dict_keeps_total_steps_and_loads_weights_only():
    """A checkpoint holds the schedule's position and total_steps as plain data (weights_only=True loads it)."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = WarmupCosine(optimizer, warmup_steps=2, total_steps=30)
    for _ in range(7):
        optimizer.step()
        schedule.step()
    buffer = io.BytesIO()
    torch.save(schedule.state_dict(), buffer)
    restored = WarmupCosine(optimizer, warmup_steps=2, total_steps=None)
    restored.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    assert (restored.total_steps, restored.last_epoch) == (30, 7)
    assert restored.get_last_lr() == schedule.get_last_lr()


def test_optimization_fills_total_steps_from_the_trainer_and_steps_per_optimizer_step():
    """With total_steps=None the schedule gets trainer.estimated_stepping_batches, and Lightning steps it per step."""
    module = SimpleNamespace(trainer=SimpleNamespace(estimated_stepping_batches=50))
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    config = optimization(module, optimizer, lambda opt: WarmupCosine(opt, warmup_steps=5))
    assert config["optimizer"] is optimizer and config["lr_scheduler"]["interval"] == "step"
    assert config["lr_scheduler"]["scheduler"].total_steps == 50


def test_optimization_without_schedule_returns_the_optimizer_and_refuses_an_unbounded_fit():
    """No scheduler: the optimizer alone. A fit without max_epochs/max_steps has no end to decay towards."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    assert optimization(None, optimizer, None) is optimizer
    unbounded = SimpleNamespace(trainer=SimpleNamespace(estimated_stepping_batches=float("inf")))
    with pytest.raises(ValueError, match="max_epochs or --trainer.max_steps"):
        optimization(unbounded, optimizer, WarmupCosine)


def test_optimization_warns_of_a_warmup_as_long_as_the_fit():
    """A warmup that does not end before the fit does (a debug run of 4 steps) never reaches the configured lr:
    it says so."""
    short = SimpleNamespace(trainer=SimpleNamespace(estimated_stepping_batches=4))
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.warns(UserWarning, match="warmup_steps=20 is not below total_steps=4"):
        optimization(short, optimizer, lambda opt: WarmupCosine(opt, warmup_steps=20))
