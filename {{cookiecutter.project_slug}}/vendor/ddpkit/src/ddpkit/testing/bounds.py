"""How far apart 1 and 2 devices' runs may end (check_parity.py's bounds): a fixed bound per accelerator and
precision, the model's own rounding (`fp64_bound`: how far summation order alone moves the float64 weights, each
tensor against itself too), the elements that got no gradient (`no_gradient`), two identical runs' noise
(`run_to_run`), and the asserts that judge weights and logged values against them.
"""

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from ..parity import (
    FLOAT32_STORAGE,
    ROUNDING_CEILING,
    ROUNDING_FACTOR,
    Rounding,
    Verdict,
    diff,
    read_scalars,
    report,
    rounding_reference,
    scalar_diffs,
    verdict_report,
)
from .gradient_peaks import NO_GRADIENT_FILE
from .runs import FP64_BOUND, Run, Waves, reference_run

# Bounds on max |a - b| / max |a| per weight tensor and per logged tag, 1 device vs 2 devices after
# 2 epochs. Measured on CPU with the digits example (AdamW, 32 steps), seeds 0-7: float64 at most
# 1.2e-13, float32 at most 8.4e-5 (seed 7; 5 of 8 seeds exceed 1e-5: AdamW divides by sqrt(v), so
# parameters with tiny gradients turn rounding into visible update differences). float64 is the strict
# check; float32 is judged one step at a time on CPU (check_onestep.py) and by these on GPUs.
# GPU bounds are CPU's, not measured on GPUs (.ci/gpu_check.py in the template runs them).
BOUNDS = {
    ("cpu", "64-true"): 1e-12,
    ("gpu", "64-true"): 1e-12,
    ("gpu", "32-true"): 1e-4,
}


@dataclass(frozen=True)
class Bound:
    """A weights bound. Each tensor passes when its max_abs is within `max_rel` x its largest entry, or within its
    own allowance (`own`: ROUNDING_FACTOR x how far the rounding reference, and any run-to-run difference, moved that
    tensor), or within `at_rounding` (as far as rounding moved any tensor). The elements of `no_gradient` (True:
    no gradient in the 1- and 2-device runs) are left out; a tensor of such elements alone holds only rounding.
    `noise`, if given, measures the run-to-run difference when a tensor is over (float64: a second 2-device run)."""

    max_rel: float
    at_rounding: float = 0.0
    why: str = "fixed"
    own: Mapping[str, float] = field(default_factory=dict)
    no_gradient: Mapping[str, torch.Tensor] = field(default_factory=dict)
    noise: Callable[[], "Noise"] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Noise:
    """How far apart two identical runs ended, per tensor (max_abs over the elements that got a gradient)."""

    per_tensor: dict[str, float]
    why: str


def kept(name: str, tensor: torch.Tensor, no_gradient: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The entries of `tensor` that got a gradient (all of them for a buffer or a tensor not in `no_gradient`)."""
    mask = no_gradient.get(name)
    return tensor if mask is None else tensor.detach().reshape(-1)[~mask.reshape(-1)]


def judge(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], bound: Bound) -> list[Verdict]:
    """Each tensor of `b` against the reference `a` (same names and shapes, else ValueError), under `bound`."""
    if a.keys() != b.keys():
        only = f"only in a {sorted(a.keys() - b.keys())}, only in b {sorted(b.keys() - a.keys())}"
        raise ValueError(f"different tensors: {only}")
    verdicts = []
    for name in a:
        if a[name].shape != b[name].shape:
            raise ValueError(f"{name}: shape {tuple(a[name].shape)} vs {tuple(b[name].shape)}")
        x, y = kept(name, a[name], bound.no_gradient), kept(name, b[name], bound.no_gradient)
        mask = bound.no_gradient.get(name)
        left_out = int(mask.sum()) if mask is not None else 0
        d = diff(name, x, y)
        if left_out and not x.numel():
            verdicts.append(Verdict(d, math.inf, "no gradient: holds only rounding"))
            continue
        note = f"{left_out} of {mask.numel()} elements without gradient left out" if left_out else ""
        scale = x.detach().double().abs().max().item() if x.numel() else 0.0
        limit = max(bound.max_rel * scale, bound.own.get(name, 0.0))
        rounding = "at rounding level" if 0 < bound.at_rounding and d.max_abs <= bound.at_rounding else ""
        verdicts.append(Verdict(d, limit, rounding, note))
    return verdicts


def no_gradient(cpu_runs: Waves) -> dict[str, torch.Tensor]:
    """Per parameter, its elements that got no gradient (their peak |gradient| at most NO_GRADIENT of the model's
    largest) in both the 1- and the 2-device float64 runs (gradient_peaks.GradientPeaks)."""
    masks = []
    for name in ("1dev-fp64", "2dev-fp64"):
        path = cpu_runs[name].root / "probe" / NO_GRADIENT_FILE
        masks.append(torch.load(path, weights_only=True) if path.is_file() else {})
    one, two = masks
    return {name: one[name] & two[name] for name in one.keys() & two.keys()}


def rounding(cpu_runs: Waves, steps: dict, masks: Mapping[str, torch.Tensor] | None = None) -> Rounding:
    """The float64 rounding reference of the configured model: its weights after 1 device with 4 micro-batches (or,
    for a BatchNorm model or a data module without micro-batches, with every batch reversed) vs 1 device, over the
    elements that got a gradient (`masks`: no_gradient's)."""
    one, reordered = cpu_runs["1dev-fp64"].weights(), cpu_runs[reference_run(steps, "fp64")].weights()
    masks = masks or {}
    one, reordered = ({n: kept(n, t, masks) for n, t in w.items()} for w in (one, reordered))
    return rounding_reference(one, reordered, ROUNDING_CEILING)


def run_to_run(cpu_runs: Waves, masks: Mapping[str, torch.Tensor]) -> Noise:
    """How far two identical 2-device float64 runs (2dev-fp64 and 2dev-fp64-again, started only when asked for)
    ended apart, per tensor: threads and the collectives' order may make them differ (measured bit-identical on
    every model here: docs/measurements.md, "Run to run")."""
    two, again = cpu_runs["2dev-fp64"].weights(), cpu_runs["2dev-fp64-again"].weights()
    per_tensor = {n: diff(n, kept(n, two[n], masks), kept(n, again[n], masks)).max_abs for n in two}
    worst = max(per_tensor.items(), key=lambda item: item[1], default=("", 0.0))
    return Noise(per_tensor, f"2dev-fp64 run again: max_abs {worst[1]:.3g} ({worst[0]})")


def weights_bound(cpu_runs: Waves, steps: dict) -> Bound:
    """The float64 weights bound for the configured model: ROUNDING_FACTOR x its rounding reference's max_rel, at
    least the fixed bound; each tensor also within ROUNDING_FACTOR x how far the reference moved it; tensors within
    ROUNDING_FACTOR x the reference's max_abs at rounding level; elements without gradient left out. A reference
    above ROUNDING_CEILING is not rounding: the fixed bound alone."""
    fixed = BOUNDS["cpu", "64-true"]
    masks = no_gradient(cpu_runs)
    ref = rounding(cpu_runs, steps, masks)
    how = "4 micro-batches" if steps["micro_batch_size"] else "every batch reversed"
    if not ref.max_rel <= ROUNDING_CEILING:
        why = f"fixed {fixed:g}: 1 device with {how} moved weights by {ref.max_rel:.3g}: not rounding"
        return Bound(fixed, why=why, no_gradient=masks, noise=lambda: run_to_run(cpu_runs, masks))
    one, reordered = cpu_runs["1dev-fp64"].weights(), cpu_runs[reference_run(steps, "fp64")].weights()
    own = {n: ROUNDING_FACTOR * diff(n, kept(n, one[n], masks), kept(n, reordered[n], masks)).max_abs for n in one}
    level = ROUNDING_FACTOR * ref.max_abs
    why = f"{ROUNDING_FACTOR:g} x rounding, at least {fixed:g}; rounding: 1 device with {how} vs without"
    why += f" max_rel {ref.max_rel:.3g}, max_abs {ref.max_abs:.3g}; each tensor also within {ROUNDING_FACTOR:g} x"
    why += f" its own; max_abs <= {level:.3g} is at rounding level"
    noise = lambda: run_to_run(cpu_runs, masks)  # noqa: E731
    return Bound(max(fixed, ROUNDING_FACTOR * ref.max_rel), level, why, own, masks, noise)


def fp64_bound(cpu_runs: Waves, steps: dict) -> Bound:
    """The float64 weights bound (weights_bound), which every float64 comparison of the suite uses, worked out once
    for the session: the rounding reference's weights are deleted after (footprint.py)."""
    cache = getattr(cpu_runs, "cache", {})  # a plain mapping of runs keeps nothing
    if FP64_BOUND not in cache:
        cache[FP64_BOUND] = weights_bound(cpu_runs, steps)
    return cache[FP64_BOUND]


# torchmetrics keeps its sums in float32 even in a float64 run; adding 359 losses in two parts and
# adding them at once may round apart (measured: equal in float64 runs, 8e-8 in float32 runs).
METRIC_STATE_ROUNDING = 1e-6


def assert_weights_close(a: Run, b: Run, bound: float | Bound) -> None:
    assert_within(a.weights(), b.weights(), bound, f"{b.root.name} vs {a.root.name}")


def assert_within(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], bound: float | Bound, label: str) -> None:
    """Weights `b` within `bound` of the reference `a`, else fail with the tensors over their bound first, the others
    after, and the bound's origin. A failure at rounding's scale (max_rel at most ROUNDING_CEILING) asks the bound's
    `noise`: where two identical runs differ, each tensor may differ by ROUNDING_FACTOR x as much."""
    bound = bound if isinstance(bound, Bound) else Bound(bound)
    verdicts = judge(a, b, bound)
    over = [v for v in verdicts if v.over]
    if over and bound.noise is not None and all(v.diff.max_rel <= ROUNDING_CEILING for v in over):
        noise = bound.noise()
        own = {n: max(bound.own.get(n, 0.0), ROUNDING_FACTOR * noise.per_tensor.get(n, 0.0)) for n in a}
        bound = Bound(bound.max_rel, bound.at_rounding, f"{bound.why}; run to run: {noise.why}", own, bound.no_gradient)
        verdicts = judge(a, b, bound)
    assert not any(v.over for v in verdicts), (
        f"{label}, bound {bound.max_rel:.3g} ({bound.why}):\n{verdict_report(verdicts)}"
    )


def assert_scalars_close(a: Run, b: Run, bound: float | Bound) -> None:
    bound = bound if isinstance(bound, Bound) else Bound(bound)
    diffs = scalar_diffs(read_scalars(a.version), read_scalars(b.version))
    assert diffs[0].max_rel <= bound.max_rel, (
        f"{b.root.name} vs {a.root.name}, bound {bound.max_rel:.3g} ({bound.why}):\n"
        f"{report(diffs, max_rel=bound.max_rel)}"
    )


def scalars_bound(cpu_runs: Waves, steps: dict) -> Bound:
    """The bound on every logged value of the configured model in float64, 1 vs 2 devices: `logged_bound` of its
    rounding reference (the weights bound's). A reference that is not rounding leaves the fixed bound."""
    fixed = max(BOUNDS["cpu", "64-true"], FLOAT32_STORAGE)
    weights = fp64_bound(cpu_runs, steps)
    if not weights.at_rounding:
        return Bound(fixed, why=f"fixed {fixed:g}: {weights.why}")
    one, reordered = cpu_runs["1dev-fp64"], cpu_runs[reference_run(steps, "fp64")]
    label = f"{reordered.root.name} vs {one.root.name}"
    return logged_bound(read_scalars(one.version), read_scalars(reordered.version), label)


# A logged tag that the float64 rounding reference moves by more than this is another quantity there, not rounding:
# with micro-batches, a value logged at each training step is the last micro-batch's. The digits example, seeds 0-4:
# its train/loss 6.6e-2 to 0.22 apart, the other tags at most 3.5e-7 (float32 storage); 1 vs 2 devices at most 0.2
# of the resulting bound (docs/measurements.md, "The logged values' bound").
LOGGED_CEILING = 1e-5


def logged_bound(one: dict, reordered: dict, label: str) -> Bound:
    """ROUNDING_FACTOR x how far the rounding reference `reordered` moved the logged values of `one` ({tag: {step:
    value}}), over the tags it moved by at most LOGGED_CEILING, at least the fixed bound and TensorBoard's float32
    storage. Taken over every tag, a micro-batch's training loss (7.9% apart) allowed 0.395: an unsynchronised
    val/acc, 3.1% off on 2 devices, passed."""
    fixed = max(BOUNDS["cpu", "64-true"], FLOAT32_STORAGE)
    diffs = scalar_diffs(one, reordered)
    other = [d.name for d in diffs if not d.max_rel <= LOGGED_CEILING]
    held = [d for d in diffs if d.max_rel <= LOGGED_CEILING]
    why = f"{ROUNDING_FACTOR:g} x rounding, at least {fixed:g}; rounding: {label}"
    why += f" {held[0]}" if held else " moved no tag by rounding alone"
    if other:
        why += f"; not rounding there, left out: {', '.join(other)} (moved past {LOGGED_CEILING:g})"
    return Bound(max([fixed] + [ROUNDING_FACTOR * d.max_rel for d in held[:1]]), why=why)


# bf16-mixed on GPUs (CPU's is one step at a time: check_onestep.py): 1 vs 2 GPUs may differ in every logged value
# by at most BF16_FACTOR times bf16's own effect on 1 GPU (bf16 vs float32): CPU's criterion before the one-step
# check, measured on CPU MLPs and BatchNorm CNNs (2026-12-01, 2026-12-03: at most 1.67 x, docs/measurements.md);
# not measured on GPUs.
BF16_FACTOR = 3.0


def assert_bf16_close(one: Run, two: Run, *references: Run) -> None:
    """1 vs 2 devices in bf16-mixed: every logged value within BF16_FACTOR x what bf16 changes on 1 device, the
    largest of its differences from `references` (float32, bf16 reordered)."""
    draws = [scalar_diffs(read_scalars(r.version), read_scalars(one.version))[0] for r in references]
    largest = max(draws, key=lambda d: d.max_rel)
    why = f"{BF16_FACTOR:g} x bf16's own effect on 1 device, the largest of " + ", ".join(
        f"{r.root.name} {d.max_rel:.3g} ({d.name})" for r, d in zip(references, draws, strict=True)
    )
    assert_scalars_close(one, two, Bound(BF16_FACTOR * max(largest.max_rel, FLOAT32_STORAGE), why=why))
