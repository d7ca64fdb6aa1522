"""float32 and bf16-mixed, judged one optimizer step at a time: 1 and 2 devices take the same step from the same state.

Over a whole training, rounding differences grow with every step (AdamW divides by the root of tiny squared gradients;
reordering alone moved a BatchNorm CNN's float32 weights by 0.16-0.24 in 8 steps), so a bound loose enough for every
model would pass bugs, and one tight enough to catch them fails correct models by chance. In one step rounding cannot
compound. The first wave's 1-device float64 run saves its state (weights, buffers such as BatchNorm's statistics; the
optimizer's and schedule's only where a global batch takes several optimizer steps, whose later gradients follow the
earlier updates) after global batches 1, n and n + 1 (n an epoch's); runs on 1 and on 2 devices in float32 and in
bf16-mixed, and one on 1 device in float64, train global batches 0 and 1 of each of 2 epochs, loading before each the
state saved there (parity_probe.OneStep): the same samples on any device count. The states hold float32 weights, but
where they keep the optimizer's (the float32 and bf16 runs would load no other numbers), so the float64 run's step is
the exact one from the same state; its gradient is recorded as the float32 nearest it, and how far the 1-device step in
float32 (bf16) is from that is the step's own rounding (half the bytes on disk; a float32 tensor's bound moves by a
factor within [2/3, 3/2] for it, since that rounding is at most half the floor below, and bf16's by less than 1/2^16).
At global batches 1, n and n + 1, per tensor, 2 devices are within ONE_STEP_FACTOR x that rounding (at least one unit of
the precision) of 1 device, as the norm of the difference over the tensor's elements:
- the gradient each optimizer step sees, after the all-reduce;
- the buffers after the step (BatchNorm's statistics and counts; and any parameter nothing trained), against the
  rounding of what the step changed (float64's change of the same state against this precision's; at least one
  unit of the stored value). A trained parameter after the step is not judged: it is the shared optimizer state's
  function of the gradient judged above, and AdamW can make any size of update of a gradient's rounding (its
  momentum nearly cancelled, a small change of the gradient is a large one of the update); the float64 runs judge
  the optimizer over a whole training, to ~1e-12;
- every value the module logged in the step (at least one unit of the precision of itself: a single number's
  distance from float64 is one draw of its rounding, no measure of its scale), which is also the same on both
  ranks, bit for bit.
Elements that got no gradient in the float64 runs (bounds.no_gradient) are left out: their gradient is a
cancelled sum's rounding, at a scale the tensor itself does not show. A tensor over its bound is judged again in the
same steps from the states nudged (each weight x (1 +- runs.NUDGE), the same numbers in all three runs), and fails
only if over there too (over_twice): where a ReLU's input sits within rounding of 0, one run can pass a gradient
through it and the other not, which moves a gradient by far more than rounding (a U-Net's decoder weight, 2x2
activations: 40 x the step's rounding); the nudge draws those inputs again, and a bug stays. Both ranks hold the
same weights and buffers after every step, bit for bit.

Measured (the template's docs/measurements.md, "The one-step check"): the norm, because where an activation has a
kink (ReLU) an element at it can switch on one run and not the other, and a tensor's largest difference jumped to 5 x
1 device's where its norm stayed within 2 x; the float64 step, because a batch reordered on 1 device reproduces
neither bf16's rounding of each rank's half of a gradient before the all-reduce nor synchronized BatchNorm's other
formula for 2 ranks' statistics (2 devices differed by up to 38 x what reordering moved); global batch 0 (each run's
own initialization) is trained, not judged: a MobileNetV3-small's float32 gradient there differed on 2 devices by up
to a tenth of a tensor's norm in 3 of 4 runs, at no later step, while its float64 gradients agreed to 3e-14.
"""

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import pytest
import torch

from .bounds import no_gradient
from .loss_probe import ROUTER_FIX, multiple_of
from .parity_probe import digests
from .runs import NUDGE, STEP_PRECISIONS, STEP_RECORDS, Run, Waves, comparable, optimizer_steps, reads

# 2 devices' difference over the step's own rounding, worst tensor of any point: gradients at most 2.12 x (GPT-2,
# small BatchNorm CNN, ResNet-18, TinyBert; seeds 0-4, float32 and bf16), 5.13 x for a MobileNetV3-small's
# squeeze-excitation weight (bf16, seed 6; seeds 0-7 and 42); buffers after the step 3.01 x; logged values 0.1 x
# (docs/measurements.md, "The one-step check"; the same worst cases within 3% with float32 states, 0.12.0). 12 leaves
# 2.3 x over the worst seen; the bugs of test_model_families stay over it.
ONE_STEP_FACTOR = 12.0
EPS = {"fp32": torch.finfo(torch.float32).eps, "bf16": torch.finfo(torch.bfloat16).eps}


# The buffers a BatchNorm layer updates from its batch, and why the ranks' differ (the Faster R-CNN of
# docs/measurements.md named them without the reason).
BATCHNORM_BUFFERS = (".running_mean", ".running_var")
BATCHNORM_STATS = (
    ": BatchNorm's running statistics, which each rank computes from its own share of the batch unless the layers "
    "are synchronized (`trainer: sync_batchnorm: true` in config.yaml; the manual: vendor/ddpkit/docs/batchnorm.md)"
)


def records(run: Run) -> dict[int, dict]:
    """The steps a one-step run took: {global batch: {"before", "grads", "after", "logged", "started_from"}} (rank
    0's; "before" and "after" hold the tensors the step gave no gradient, "started_from" every tensor's digest)."""
    return torch.load(run.root / "probe" / "onestep.pt", weights_only=False)


def different_starts(one: dict, two: dict) -> list[str]:
    """The tensors whose bits differ between the states two steps' records started from (their digests; a record
    without them: of its "before" tensors)."""
    ones, twos = (record.get("started_from") or digests(record["before"]) for record in (one, two))
    return [name for name, digest in ones.items() if digest != twos.get(name)]


def norm(t: torch.Tensor) -> float:
    return t.detach().double().norm().item() if t.numel() else 0.0


@dataclass(frozen=True)
class StepVerdict:
    """One tensor (or logged value) of one step judged: the norm of 2 devices' difference from 1 device's, its norm
    relative to 1 device's value, and the largest difference the step's own rounding allows."""

    name: str
    apart: float  # ||two - one||
    relative: float  # apart / ||one||
    bound: float
    rounding: str = ""  # why it is not judged (no gradient)
    note: str = ""

    @property
    def over(self) -> bool:
        return not self.rounding and not self.apart <= self.bound  # NaN is over

    def __str__(self) -> str:
        head = f"{self.name}: {self.apart:.3g} apart ({self.relative:.3g} of its norm)"
        note = f"; {self.note}" if self.note else ""
        if self.rounding:
            return f"{head} ({self.rounding}{note})"
        return f"{head} ({'OVER ' if self.over else ''}bound {self.bound:.3g}{note})"


def judged(name: str, one: torch.Tensor, two: torch.Tensor, rounding: float, factor: float, note: str = ""):
    """2 devices' tensor `two` against 1 device's `one`, allowed `factor` x `rounding` (a norm) apart."""
    apart, size = norm(one.double() - two.double()), norm(one)
    relative = apart / size if size else (0.0 if not apart else math.inf)
    return StepVerdict(name, apart, relative, factor * rounding, note=note)


def step_verdicts(
    one: dict,
    two: dict,
    exact: dict,
    precision: str,
    no_gradient: Mapping[str, torch.Tensor] | None = None,
    factor: float = ONE_STEP_FACTOR,
) -> list:
    """The verdicts of 2 devices' steps (`two`) against 1 device's (`one`) in `precision`, at every global batch but
    the first (from each run's own initialization; see the module's docstring): each gradient, buffer after the step
    and logged value, as the norm of the difference (all its elements' at once: a single element's rounding can
    jump where an activation has a kink) against that step's own rounding, how far 1 device's is from the same step
    in float64 (`exact`), at least one unit of the precision; as (global batch, what, StepVerdict), what being
    "gradient", "after" or "logged". The elements of `no_gradient` (bounds.no_gradient: no gradient in the
    float64 runs; a cancelled sum's rounding, at no scale the tensor itself shows) are left out."""
    eps, out, no_gradient = EPS[precision], [], no_gradient or {}
    for k in sorted(one):
        if not k:
            continue
        a, b, e = one[k], two[k], exact[k]
        trained = set()
        for ga, gb, ge in zip(a["grads"], b["grads"], e["grads"], strict=True):
            for name, x in ga.items():
                trained.add(name)
                none = no_gradient.get(name, torch.zeros_like(x, dtype=torch.bool)).reshape(x.shape)
                y, z = gb[name], ge[name]
                if none.all():
                    verdict = StepVerdict(name, norm(x - y), math.nan, math.inf, "no gradient in float64")
                    out.append((k, "gradient", verdict))
                    continue
                xs, ys, zs = x[~none], y[~none], z[~none]
                rounding = max(norm(xs.double() - zs.double()), eps * norm(xs))
                note = f"{int(none.sum())} of {none.numel()} elements without gradient left out" if none.any() else ""
                out.append((k, "gradient", judged(name, xs, ys, rounding, factor, note)))
        # What the step wrote besides the optimizer's update: buffers (BatchNorm's statistics and counts) and
        # parameters nothing trained. A trained parameter is not judged after the step: it is the shared optimizer
        # state's function of the judged gradient, and AdamW can turn a gradient's rounding into any size of update
        # (docs/measurements.md, "The one-step check"); the float64 runs judge the optimizer over a whole training.
        for name, x in a["after"].items():
            if name in trained:
                continue
            y = b["after"].get(name)
            if y is None:  # 2 devices gave it a gradient, 1 device none
                out.append((k, "after", StepVerdict(name, math.inf, math.inf, 0.0, note="trained on 2 devices alone")))
                continue
            if not x.is_floating_point():  # a count (num_batches_tracked): exact
                out.append((k, "after", judged(name, x, y, 0.0, factor)))
                continue
            # The update's rounding: float64's update of the same state against this precision's.
            step = x - a["before"][name].to(x.dtype)
            exact_step = e["after"][name] - e["before"][name] if name in e["after"] else step.double()
            update = max(norm(exact_step - step.double()), eps * norm(step))
            stored = torch.finfo(x.dtype).eps * norm(x)
            out.append((k, "after", judged(name, x, y, max(update, stored), factor)))
        for tag, value in a["logged"].items():
            x, y, z = (torch.tensor([v], dtype=torch.float64) for v in (value, b["logged"][tag], e["logged"][tag]))
            rounding = max(norm(z - x), eps * abs(value))
            out.append((k, "logged", judged(tag, x, y, rounding, factor)))
    return out


def gradient_scale(one: dict, two: dict, exact: dict) -> str:
    """ "" unless 2 devices' gradient is 1 device's times a number other than 1 (what is left across 1 device's
    direction at most a tenth of the scale's difference from 1) at every judged global batch where both steps are
    gradients of their state (1 device's within half its norm of the float64 step's, 2 devices' finite: a summed loss
    overflowed a ResNet's bf16 steps), and there is one: then the line that names the factor and what scales a
    gradient with the device count. Each step's whole gradient, every tensor at once (docs/measurements.md, "The
    one-step check")."""
    ratios = []
    for k in sorted(k for k in one if k):  # global batch 0 is not judged (step_verdicts)
        a, b, e = (
            torch.cat([g[n].double().flatten() for g in r[k]["grads"] for n in sorted(g)]) for r in (one, two, exact)
        )
        if not ((a - e).norm() <= 0.5 * e.norm() and b.isfinite().all()):
            continue
        ratio, across = multiple_of(a, b)
        if not abs(ratio - 1) >= max(10 * across, 1e-3):
            return ""
        ratios.append(ratio)
    if not ratios:
        return ""
    low, high = f"{min(ratios):.3g}", f"{max(ratios):.3g}"
    return (
        f"2 devices' gradient is {low if low == high else f'{low} to {high}'} x 1 device's, "
        "in the same direction: something scales it with the device count, such as a loss summed over the batch "
        "instead of averaged over it, or rows gathered from the other ranks without their gradients (all_gather "
        "without sync_grads, open_clip's gather_with_grad=False; ddpkit.gather_batch keeps them)\n"
    )


# Where a module declares a loss over the global batch and 2 devices' step turns: its usual cause (the SimCLR of
# docs/measurements.md, "Contrastive losses", compared its rows with its own rank's only).
SPANS_HINT = (
    "The module declares a loss over the global batch (loss_spans_global_batch) and 2 devices' step differs from 1 "
    "device's: a rank that compares its rows with its own rows only, not every rank's, does that; compare them with "
    "`ddpkit.gather_batch(z, self)` (the manual: vendor/ddpkit/docs/losses.md)\n"
)


# The same where the model also adds a Hugging Face MoE's router balance over each rank's own tokens.
ROUTER_HINT = (
    "The module declares a loss over the global batch (loss_spans_global_batch) and 2 devices' step differs from 1 "
    f"device's: its model still adds {{aux}}, over each rank's own tokens; {ROUTER_FIX} (the manual: "
    "vendor/ddpkit/docs/losses.md)\n"
)


def step_cause(one: dict, two: dict, exact: dict, steps: dict) -> str:
    """The line that heads a failed one-step check: the gradient's scale (gradient_scale), else, for a module that
    declares a loss over the global batch, ROUTER_HINT where its model adds a router balance of its own (the
    configured facts' `router_aux`), else SPANS_HINT; else ""."""
    if cause := gradient_scale(one, two, exact):
        return cause
    if not steps.get("spans_batch"):
        return ""
    return ROUTER_HINT.format(aux=steps["router_aux"]) if steps.get("router_aux") else SPANS_HINT


def step_report(verdicts: list, limit: int = 8) -> str:
    """The verdicts of one step and kind, one a line: those over their bound first (furthest first), then the
    others (largest relative difference first), those not judged last."""
    ratio = lambda v: math.inf if not v.bound or math.isnan(v.apart) else v.apart / v.bound  # noqa: E731
    over = sorted((v for v in verdicts if v.over), key=ratio, reverse=True)
    rest = sorted((v for v in verdicts if not v.over and not v.rounding), key=lambda v: -v.relative)
    lines = [f"  {v}" for v in [*over, *rest, *(v for v in verdicts if v.rounding)]]
    if len(lines) > limit:
        lines = [*lines[:limit], f"  ... and {len(lines) - limit} more"]
    return "\n".join(lines)


def step_runs(cpu_runs: Waves, tag: str, nudged: bool = False) -> tuple[Run, ...]:
    """1 device's and 2 devices' one-step runs in the precision, and the exact (float64) one; `nudged`: those from
    the nudged states (the second look)."""
    end = "-nudged" if nudged else ""
    return tuple(cpu_runs[f"step-{name}{end}"] for name in (f"1dev-{tag}", f"2dev-{tag}", "1dev-fp64"))


def over_twice(verdicts: list, again: Callable[[], list]) -> tuple[list, list]:
    """The verdicts (global batch, what, StepVerdict) over their bound in both looks: in `verdicts`, and in those of
    the same steps from the nudged states (`again()`, asked only when one is over) for the same global batch and
    tensor; and the second look's verdicts ([] when not asked). A value at a ReLU's kink that rounding puts on the
    other side on one run is drawn again by the nudge (runs.NUDGE); a bug is over in both looks."""
    over = [(k, what, v) for k, what, v in verdicts if v.over]
    if not over:
        return [], []
    second = again()
    still = {(k, what, v.name) for k, what, v in second if v.over}
    return [(k, what, v) for k, what, v in over if (k, what, v.name) in still], second


def look(cpu_runs: Waves, steps: dict, precision: str, nudged: bool = False) -> list:
    """The verdicts of the one-step runs in `precision` (step_verdicts), after checking that they took the expected
    global batches and that 1 and 2 devices started each from the same state, bit for bit."""
    one, two, exact = (records(run) for run in step_runs(cpu_runs, precision, nudged))
    first, last = steps["epoch_steps"], optimizer_steps(steps, 2 * steps["steps_per_epoch"])
    expected = sorted({0, 1, first, first + 1} - {last})
    assert sorted(one) == sorted(two) == sorted(exact) == expected[: 2 * steps["step_batches"]]
    for k in one:  # the same state before each step, bit for bit: else the steps cannot be compared
        started = different_starts(one[k], two[k])
        assert not started, f"global batch {k}: 1 and 2 devices started from different {started[:3]}"
    return step_verdicts(one, two, exact, precision, no_gradient(cpu_runs))


@pytest.mark.parametrize("precision", list(STEP_PRECISIONS))
@reads(
    *("1dev-fp64", "2dev-fp64", "step-1dev-{precision}", "step-2dev-{precision}", "step-1dev-fp64"),
    *("step-1dev-{precision}-nudged", "step-2dev-{precision}-nudged", "step-1dev-fp64-nudged"),
    STEP_RECORDS,
)
def test_one_step_from_the_same_state_matches_1_vs_2_devices(cpu_runs, steps, precision):
    """From the same states (global batches 0, 1, n and n + 1), one step on 2 devices gives 1 device's all-reduced
    gradient, buffers and logged values within ONE_STEP_FACTOR x that step's own rounding, per tensor (how far the
    same step in float64 is from 1 device's, at least one unit of the precision), in float32 and bf16-mixed; a tensor
    over its bound is over again in the same steps from nudged states (over_twice: a ReLU's kink is not)."""
    comparable(steps)
    verdicts = look(cpu_runs, steps, precision)
    over, second = over_twice(verdicts, lambda: look(cpu_runs, steps, precision, nudged=True))
    by_point = sorted({(k, what) for k, what, _ in over})

    def report(judged: list) -> str:
        return "\n".join(
            f"global batch {k}, {what}:\n" + step_report([v for kk, w, v in judged if (kk, w) == (k, what)])
            for k, what in by_point
        )

    cause = step_cause(*(records(run) for run in step_runs(cpu_runs, precision)), steps) if over else ""
    assert not over, (
        cause
        + f"step-2dev-{precision} vs step-1dev-{precision}, bound {ONE_STEP_FACTOR:g} x the step's own "
        + (
            "rounding: 1 device's difference from the same step in float64, at least one unit of the precision:\n"
            + report(verdicts)
            + f"\nand again from the states nudged by {NUDGE:g} (not a ReLU's kink):\n"
            + report(second)
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
            assert not differ, f"{tag}, global batch {k}: the ranks hold different {differ[:3]}" + (
                BATCHNORM_STATS if all(n.endswith(BATCHNORM_BUFFERS) for n in differ) else ""
            )
            assert rank0[k]["logged"] == rank1[k]["logged"], f"{tag}, global batch {k}: a value logged without sync"
