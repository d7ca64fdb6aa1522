"""float32 and bf16-mixed, judged one optimizer step at a time: 1 and 2 devices take the same step from the same state.

Over a whole training, rounding differences grow with every step (AdamW divides by the root of tiny squared gradients;
reordering alone moved a BatchNorm CNN's float32 weights by 0.16-0.24 in 8 steps), so a bound loose enough for every
model would pass bugs, and one tight enough to catch them fails correct models by chance. In one step rounding cannot
compound. The first wave's 1-device float64 run saves its state (weights, buffers such as BatchNorm's statistics,
optimizer, schedule) after global batches 1, n and n + 1 (n an epoch's); in float32 and in bf16-mixed, runs on 1
device, on 2 devices and on 1 device with every batch reversed load each state and train the next global batch, the
same samples on any device count (parity_probe.OneStep): global batches 0 (each run's own initialization), 1, n and
n + 1. At each, per tensor:
- the gradient each optimizer step sees, after the all-reduce: 2 devices within ONE_STEP_FACTOR x that step's own
  rounding, the larger of how far the reversed batch moved it and one unit of the precision (its eps) times the
  tensor's largest entry. The second term is bf16's: 2 ranks each round their half of a weight's gradient to bf16
  before the all-reduce adds them, which no reordering on 1 device reproduces (the reversed batch's gradient is often
  the same bits there);
- the weights and buffers after the step, within the factor x the larger of the reversed batch's difference, one
  unit of the precision of the update and one of the stored value. Elements whose gradient is within its bound of
  zero in both runs are left out: their sign is rounding's, and AdamW steps by the sign;
- every value the module logged in the step: the same on both ranks, bit for bit, and within the factor x the
  larger of the reversed batch's difference and one unit of the precision of the value.
Both ranks hold the same weights and buffers after every step, bit for bit. The long runs of float32 and bf16 are
not compared: rounding compounds there (docs/measurements.md of the template, "The one-step check").
"""

import json
import math

import pytest
import torch

from ..parity import Verdict, diff, verdict_report
from .runs import ONE_STEP, STEP_PRECISIONS, Run, Waves, comparable, reads

# 2 devices' difference over the step's own rounding (the larger of the reversed batch's and one unit of the
# precision), worst tensor of any point: measured at most MEASURED over 7 models and seeds 0-4 in float32 and bf16
# (docs/measurements.md, "The one-step check"); the factor leaves MARGIN.
ONE_STEP_FACTOR = 5.0
EPS = {"fp32": torch.finfo(torch.float32).eps, "bf16": torch.finfo(torch.bfloat16).eps}


def records(run: Run) -> dict[int, dict]:
    """The steps a one-step run took: {global batch: {"before", "grads", "after", "logged"}} (rank 0's)."""
    return torch.load(run.root / "probe" / "onestep.pt", weights_only=False)


def largest(t: torch.Tensor) -> float:
    return t.detach().double().abs().max().item() if t.numel() else 0.0


def step_verdicts(one: dict, two: dict, reordered: dict, precision: str, factor: float = ONE_STEP_FACTOR) -> list:
    """The verdicts of 2 devices' steps (`two`) against 1 device's (`one`), each tensor, gradient and logged value
    with the bound from its own rounding (`reordered`: the reversed batches' steps) as (global batch, what, Verdict),
    what being "gradient", "after" or "logged"."""
    eps, out = EPS[precision], []
    for k in sorted(one):
        a, b, r = one[k], two[k], reordered[k]
        level: dict[str, float] = {}  # per parameter: its gradient's bound, within which an element is rounding
        rounding_level: dict[str, torch.Tensor] = {}
        for ga, gb, gr in zip(a["grads"], b["grads"], r["grads"], strict=True):
            for name, x in ga.items():
                y, z = gb[name], gr[name]
                bound = factor * max(diff(name, x, z).max_abs, eps * largest(x))
                out.append((k, "gradient", Verdict(diff(name, x, y), bound)))
                small = (x.abs() <= bound) & (y.abs() <= bound)
                rounding_level[name] = rounding_level[name] & small if name in rounding_level else small
                level[name] = max(level.get(name, 0.0), bound)
        for name, x in a["after"].items():
            y, z, before = b["after"][name], r["after"][name], a["before"][name]
            if not x.is_floating_point():  # a count (num_batches_tracked): exact
                out.append((k, "after", Verdict(diff(name, x, y), 0.0)))
                continue
            keep = ~rounding_level[name] if name in rounding_level else torch.ones_like(x, dtype=torch.bool)
            if not keep.any():
                reason = f"no gradient: every element within its gradient's bound {level[name]:.3g} of zero"
                out.append((k, "after", Verdict(diff(name, x, y), math.inf, reason)))
                continue
            xs, ys, zs = x[keep], y[keep], z[keep]
            update, stored = eps * largest(xs - before[keep]), torch.finfo(x.dtype).eps * largest(xs)
            note = f"{int((~keep).sum())} of {keep.numel()} elements with rounding-level gradients left out"
            bound = factor * max(diff(name, xs, zs).max_abs, update, stored)
            out.append((k, "after", Verdict(diff(name, xs, ys), bound, note=note if not keep.all() else "")))
        for tag, value in a["logged"].items():
            x, y, z = (torch.tensor([v], dtype=torch.float64) for v in (value, b["logged"][tag], r["logged"][tag]))
            bound = factor * max(diff(tag, x, z).max_abs, eps * abs(value))
            out.append((k, "logged", Verdict(diff(tag, x, y), bound)))
    return out


def step_runs(cpu_runs: Waves, tag: str) -> tuple[Run, ...]:
    return tuple(cpu_runs[f"step-{name}-{tag}"] for name in ONE_STEP)


@pytest.mark.parametrize("precision", list(STEP_PRECISIONS))
@reads("1dev-fp64", *(f"step-{name}-{{precision}}" for name in ONE_STEP))
def test_one_step_from_the_same_state_matches_1_vs_2_devices(cpu_runs, steps, precision):
    """From the same states (global batches 0, 1, n and n + 1), one step on 2 devices gives 1 device's all-reduced
    gradient, weights, buffers and logged values within ONE_STEP_FACTOR x that step's own rounding, per tensor
    (the reversed batch's difference, one unit of the precision), in float32 and in bf16-mixed."""
    comparable(steps)
    one, two, reordered = (records(run) for run in step_runs(cpu_runs, precision))
    expected = sorted({0, 1, steps["steps_per_epoch"], steps["steps_per_epoch"] + 1} - {2 * steps["steps_per_epoch"]})
    assert sorted(one) == sorted(two) == sorted(reordered) == expected[: 2 * steps["step_batches"]]
    for k in one:  # the same state before each step, bit for bit: else the steps cannot be compared
        started = [name for name, t in one[k]["before"].items() if not torch.equal(t, two[k]["before"][name])]
        assert not started, f"global batch {k}: 1 and 2 devices started from different {started[:3]}"
    verdicts = step_verdicts(one, two, reordered, precision)
    over = [(k, what, v) for k, what, v in verdicts if v.over]
    by_point = sorted({(k, what) for k, what, _ in over})
    assert not over, f"step-2dev-{precision} vs step-1dev-{precision}, bound {ONE_STEP_FACTOR:g} x the step's own " + (
        "rounding (the reversed batch's difference, at least one unit of the precision):\n"
        + "\n".join(
            f"global batch {k}, {what}:\n" + verdict_report([v for kk, w, v in verdicts if (kk, w) == (k, what)])
            for k, what in by_point
        )
    )


@reads(*(f"step-2dev-{tag}" for tag in STEP_PRECISIONS))
def test_both_ranks_end_bit_identical(cpu_runs, steps):
    """DDP keeps the replicas identical: after every one-step run's step, in float32 and in bf16-mixed, rank 0 and
    rank 1 hold the same weights and buffers, bit for bit, and logged the same values."""
    for tag in STEP_PRECISIONS:
        probe = cpu_runs[f"step-2dev-{tag}"].root / "probe"
        rank0, rank1 = (json.loads((probe / f"onestep-rank{r}.json").read_text()) for r in (0, 1))
        assert rank0.keys() == rank1.keys() and len(rank0) == 2 * steps["step_batches"], tag
        for k in rank0:
            differ = [n for n in rank0[k]["weights"] if rank0[k]["weights"][n] != rank1[k]["weights"][n]]
            assert not differ, f"{tag}, global batch {k}: the ranks hold different {differ[:3]}"
            assert rank0[k]["logged"] == rank1[k]["logged"], f"{tag}, global batch {k}: a value logged without sync"
