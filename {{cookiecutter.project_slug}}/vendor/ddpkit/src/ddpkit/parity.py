"""Compare two training runs: did N devices train the same model as 1 device?

A run is a Lightning log directory (`lightning_logs/version_N`): its `checkpoints/last.ckpt` holds the final weights,
its TensorBoard file and (with a CSVLogger) its `metrics.csv` the logged scalars. The guarantee suite compares its
runs with these (ddpkit.testing); compare your own from the command line:

    python -m ddpkit.parity one/lightning_logs/version_0 two/lightning_logs/version_0

Each weight tensor (and each logged tag, over its steps) gets
    max_abs = max |a - b|
    max_rel = max |a - b| / max |a|
max_rel is relative to the tensor's scale, so entries near zero do not inflate it. A tensor whose
max_abs is no more than rounding moves any weight (`--abs-tol`) is at rounding level: a tensor that gets no
gradient (a key projection's bias) holds only rounding, and its max_rel means nothing.
"""

import argparse
import csv
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

# Summation order alone moves float64 weights by a model's own amount (long sums round more): 1 device with 4
# micro-batches vs without gave max_rel up to 6.7e-11 for a 3.2M-parameter GroupNorm CNN (tests/library/families.py)
# and 9e-12 for an 11M GroupNorm ResNet (issue 27), over the fixed bound. 1 vs 2 devices needed at most 0.96 x that
# (GroupNorm CNN, transformer; seeds 0-2) and 1.95 x reversed batches, BatchNorm's reference (BatchNorm CNN, seeds
# 0-6): 5 leaves 2.5x (docs/measurements.md, "Rounding references"; tests/library/measure_rounding.py).
ROUNDING_FACTOR = 5.0
# A reference above this is not rounding (broken accumulation; its own test fails) and is not used. Between the
# largest measured, 1.4e-9 (a no-gradient bias before BatchNorm), and 1.7e-7 for a loss summed over the batch,
# which accumulation scales (AdamW hides that: 1 vs 2 devices then differ by only 5.6e-8; tests/own_project.py).
ROUNDING_CEILING = 1e-8
# float32 rounding, grown by the optimizer (AdamW divides by sqrt(v)), moves weights far more. 1 device with 4
# micro-batches (reversed batches for BatchNorm) vs without, 8 steps, seeds 0-2, max_rel: 3e-7-1.9e-6 (digits MLP),
# 6.7e-7-6.4e-5 (transformer; its key biases, ~2e-4 apart, at rounding level), 9.2e-4-7.3e-2 (GroupNorm CNN),
# 0.16-0.24 (BatchNorm CNN). Past 1e-2 a float32 comparison cannot tell a DDP bug from rounding: the check skips
# and float64 is the judge. 1 vs 2 devices needed at most 1.21 x the reference (measure_rounding.py --fp32).
FLOAT32_CEILING = 1e-2
# TensorBoard stores scalars as float32 (and torchmetrics keeps float32 states even in a float64 run): two values
# equal to 1e-15 in float64 may round one float32 step apart, up to 2^-23 of the tag's largest value, and a float32
# sum of a few values a step or two more. A float32 value is judged at no finer than this.
FLOAT32_STORAGE = 2.5e-7


@dataclass(frozen=True)
class Diff:
    """How far apart one tensor (or one logged tag) is in two runs."""

    name: str
    max_abs: float
    max_rel: float

    def __str__(self) -> str:
        return f"{self.name}: max_abs {self.max_abs:.3g}, max_rel {self.max_rel:.3g}"


def diff(name: str, a: Tensor, b: Tensor) -> Diff:
    """Compare `b` with the reference `a`; a NaN in either gives NaN, which fails every bound."""
    if a.shape != b.shape:
        raise ValueError(f"{name}: shape {tuple(a.shape)} vs {tuple(b.shape)}")
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if a.numel() == 0:
        return Diff(name, 0.0, 0.0)
    max_abs = (a - b).abs().max().item()
    scale = a.abs().max().item()
    if scale > 0 or math.isnan(scale):
        max_rel = max_abs / scale
    else:
        max_rel = 0.0 if max_abs == 0 else math.inf
    return Diff(name, max_abs, max_rel)


def _only_in(a: Mapping, b: Mapping) -> str:
    return f"only in a {sorted(a.keys() - b.keys())}, only in b {sorted(b.keys() - a.keys())}"


def worst_first(diffs: list[Diff]) -> list[Diff]:
    """Largest max_rel first, NaN before everything."""
    return sorted(diffs, key=lambda d: math.inf if math.isnan(d.max_rel) else d.max_rel, reverse=True)


def load_weights(checkpoint: str | Path) -> dict[str, Tensor]:
    """The model weights (`state_dict`) of a Lightning checkpoint, on the CPU."""
    # weights_only=False: Lightning checkpoints also hold hyperparameters; load only files you trust.
    return torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]


def weight_diffs(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> list[Diff]:
    """One `Diff` per tensor, worst first; different names or shapes are an error, not a difference."""
    if a.keys() != b.keys():
        raise ValueError(f"different tensors: {_only_in(a, b)}")
    return worst_first([diff(name, a[name], b[name]) for name in a])


def max_abs(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> float:
    """The largest absolute difference over all tensors (NaN if any is NaN): one number for a bound."""
    values = [d.max_abs for d in weight_diffs(a, b)]
    return math.nan if any(math.isnan(v) for v in values) else max(values, default=0.0)


@dataclass(frozen=True)
class Rounding:
    """How far summation order alone moved the weights: a run reordered (4 micro-batches, reversed batches) vs the
    same run as it is."""

    max_rel: float  # the worst tensor's, of those holding more than rounding (NaN: some tensor is NaN)
    max_abs: float  # the worst tensor's


def rounding_reference(one: Mapping[str, Tensor], reordered: Mapping[str, Tensor], ceiling: float) -> Rounding:
    """The rounding reference: `reordered` (the same training with its sums in another order) vs `one`. `ceiling`
    is the most rounding can move a weight in the precision (ROUNDING_CEILING, FLOAT32_CEILING)."""
    level = ROUNDING_FACTOR * max_abs(one, reordered)
    # A tensor whose every entry is within rounding (a bias that gets no gradient) has no meaningful max_rel; only
    # where that rounding is small beside the model's weights (broken accumulation moves weights by far more).
    scale = max((t.abs().max().item() for t in one.values() if t.is_floating_point() and t.numel()), default=0.0)
    small = level <= ceiling * scale

    def only_rounding(name: str) -> bool:
        return small and one[name].numel() > 0 and one[name].abs().max().item() <= level

    held = [d for d in weight_diffs(one, reordered) if not only_rounding(d.name)]
    return Rounding(held[0].max_rel if held else 0.0, level / ROUNDING_FACTOR)


def ceiling_of(weights: Mapping[str, Tensor]) -> float:
    """The rounding ceiling of a run's precision, read from its weights: float64 or lower."""
    float64 = any(t.dtype == torch.float64 for t in weights.values())
    return ROUNDING_CEILING if float64 else FLOAT32_CEILING


def read_scalars(log_dir: str | Path) -> dict[str, dict[int, float]]:
    """Every training scalar in the TensorBoard files of `log_dir`, as {tag: {step: value}} (stored as float32).

    The scaling doctor's `doctor/*` tags are left out: they measure speed and memory, which differ between
    runs by design, and a 2-device run has per-rank tags a 1-device run does not.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep every step
    events.Reload()
    tags = [tag for tag in events.Tags()["scalars"] if not tag.startswith("doctor/")]
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in tags}


def read_csv_scalars(log_dir: str | Path) -> dict[str, dict[int, float]]:
    """Every training scalar in the CSVLogger's `metrics.csv` of `log_dir`, as {tag: {step: value}}, at the
    precision it was logged (float64 in a float64 run, unlike TensorBoard's float32); no file: {}.
    The doctor's tags are left out, as in `read_scalars`."""
    path = Path(log_dir) / "metrics.csv"
    if not path.is_file():
        return {}
    scalars: dict[str, dict[int, float]] = {}
    with path.open(newline="") as file:
        for row in csv.DictReader(file):  # one row per log call; a row's other columns are empty
            step = int(row.pop("step"))
            for tag, value in row.items():
                if value != "" and not tag.startswith("doctor/"):
                    scalars.setdefault(tag, {})[step] = float(value)
    return scalars


def scalar_diffs(a: Mapping[str, Mapping[int, float]], b: Mapping[str, Mapping[int, float]]) -> list[Diff]:
    """One `Diff` per logged tag over all its steps, worst first; different tags or steps are an error."""
    if a.keys() != b.keys():
        raise ValueError(f"different tags: {_only_in(a, b)}")
    diffs = []
    for tag in a:
        if a[tag].keys() != b[tag].keys():
            raise ValueError(f"{tag}: logged at steps {sorted(a[tag])} vs {sorted(b[tag])}")
        steps = sorted(a[tag])
        values = [torch.tensor([run[tag][s] for s in steps], dtype=torch.float64) for run in (a, b)]  # as logged
        diffs.append(diff(tag, *values))
    return worst_first(diffs)


def over_bound(diffs: list[Diff], max_rel: float, at_rounding: float = 0.0) -> list[Diff]:
    """The diffs above `max_rel`, less those at rounding level (max_abs at most `at_rounding`); NaN always fails."""
    return [d for d in diffs if not d.max_rel <= max_rel and not d.max_abs <= at_rounding]


def report(diffs: list[Diff], limit: int = 5, at_rounding: float = 0.0, max_rel: float | None = None) -> str:
    """The `limit` worst differences, one a line, for an assertion message: those over `max_rel` (when given) first,
    then the others worst first, and those at rounding level (max_abs at most `at_rounding`, which pass whatever
    their max_rel) last, marked."""
    rounding = [d for d in diffs if 0 < at_rounding and d.max_abs <= at_rounding]
    over = over_bound(diffs, max_rel, at_rounding) if max_rel is not None else []
    rest = [d for d in diffs if d not in over and d not in rounding]
    lines = [f"  {d} (over {max_rel:.3g})" for d in over] + [f"  {d}" for d in rest]
    lines += [f"  {d} (at rounding level)" for d in rounding]
    if len(lines) > limit:
        lines = [*lines[:limit], f"  ... and {len(lines) - limit} more"]
    return "\n".join(lines)


@dataclass(frozen=True)
class Verdict:
    """One tensor (or logged tag) judged: how far apart it is, the largest max_abs its bound allows, and, for one
    that holds only rounding (no gradient), why it passes whatever its difference."""

    diff: Diff
    bound: float
    rounding: str = ""
    note: str = ""  # what was left out of the comparison (elements without gradient), or where the bound came from

    @property
    def over(self) -> bool:
        return not self.rounding and not self.diff.max_abs <= self.bound  # NaN is over

    def __str__(self) -> str:
        note = f"; {self.note}" if self.note else ""
        if self.rounding:
            return f"{self.diff} ({self.rounding}{note})"
        return f"{self.diff} ({'OVER ' if self.over else ''}bound max_abs {self.bound:.3g}{note})"


def verdict_report(verdicts: list[Verdict], limit: int = 8) -> str:
    """The verdicts for an assertion message, one a line: those over their bound first (furthest over first), then
    the judged ones (worst max_rel first), then those at rounding level."""

    def ratio(v: Verdict) -> float:
        return math.inf if math.isnan(v.diff.max_abs) or not v.bound else v.diff.max_abs / v.bound

    over = sorted((v for v in verdicts if v.over), key=ratio, reverse=True)
    judged = [v for v in worst_first_verdicts(verdicts) if not v.over and not v.rounding]
    rounding = [v for v in worst_first_verdicts(verdicts) if v.rounding]
    lines = [f"  {v}" for v in [*over, *judged, *rounding]]
    if len(lines) > limit:
        lines = [*lines[:limit], f"  ... and {len(lines) - limit} more"]
    return "\n".join(lines)


def worst_first_verdicts(verdicts: list[Verdict]) -> list[Verdict]:
    order = {id(d): i for i, d in enumerate(worst_first([v.diff for v in verdicts]))}
    return sorted(verdicts, key=lambda v: order[id(v.diff)])


def is_float32(values: list[float]) -> bool:
    """Whether every value is a float32 number (computed or stored in float32: a float64 result is one by chance
    about once in 2^29)."""
    return all(torch.tensor(v, dtype=torch.float64).float().double().item() == v for v in values if math.isfinite(v))


@dataclass(frozen=True)
class Logged:
    """A run pair's logged scalars, each tag from the most precise record both runs have of it."""

    diffs: list[Diff]
    source: dict[str, str]  # tag: "metrics.csv" or "TensorBoard"
    float32: set[str]  # the tags whose values are float32 (TensorBoard's, or computed in float32)


def logged_scalars(a: Path, b: Path) -> Logged:
    """Every tag the two runs logged, compared at the precision it was stored: from metrics.csv where both runs have
    the tag there (full precision), else from the TensorBoard file (float32). A tag or step in one run only is an
    error (ValueError)."""
    tb_a, tb_b, csv_a, csv_b = read_scalars(a), read_scalars(b), read_csv_scalars(a), read_csv_scalars(b)
    tags_a, tags_b = tb_a.keys() | csv_a.keys(), tb_b.keys() | csv_b.keys()
    if tags_a != tags_b:
        raise ValueError(f"the runs logged different tags: {_only_in(dict.fromkeys(tags_a), dict.fromkeys(tags_b))}")
    diffs, source, float32 = [], {}, set()
    for tag in sorted(tags_a):
        both_csv = tag in csv_a and tag in csv_b
        x, y = (csv_a[tag], csv_b[tag]) if both_csv else (tb_a.get(tag, {}), tb_b.get(tag, {}))
        if not x or not y:  # in metrics.csv in one run, in TensorBoard in the other only
            raise ValueError(f"{tag}: logged to metrics.csv in one run and to TensorBoard only in the other")
        diffs += scalar_diffs({tag: x}, {tag: y})
        source[tag] = "metrics.csv" if both_csv else "TensorBoard"
        if not both_csv or is_float32([*x.values(), *y.values()]):
            float32.add(tag)
    return Logged(worst_first(diffs), source, float32)


def check_run(run: Path, checkpoint: str) -> None:
    """A run directory with its checkpoint, else an error (ValueError) that says which is missing."""
    if not run.is_dir():
        raise ValueError(f"{run} is not a directory (a run's lightning_logs/version_N)")
    if not (run / checkpoint).is_file():
        raise ValueError(f"{run} has no {checkpoint} (--checkpoint names the checkpoint inside each run)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Compare the final weights and logged scalars of two runs.")
    parser.add_argument("a", type=Path, help="reference run: a lightning_logs/version_N directory")
    parser.add_argument("b", type=Path, help="run to compare, e.g. the same training on more devices")
    parser.add_argument("--checkpoint", default="checkpoints/last.ckpt", help="checkpoint path inside each run")
    parser.add_argument(
        "--rel-tol", type=float, default=2e-4, help="fail above this max_rel (float32 default; float64: 1e-12)"
    )
    parser.add_argument(
        "--abs-tol", type=float, default=0.0, help="tensors with max_abs at most this are at rounding level: they pass"
    )
    parser.add_argument(
        "--reference",
        type=Path,
        help="a run of A's training with its sums in another order (1 device, --data.micro_batch_size a quarter of "
        "the global batch): the bounds become at least ROUNDING_FACTOR x how far that moved A's weights and logged "
        "values, each tensor may differ by ROUNDING_FACTOR x how far it moved that tensor, and tensors within as "
        "much as it moved any are at rounding level, as the guarantee suite judges",
    )
    args = parser.parse_args(argv)
    try:
        return compare(args)
    except ValueError as error:  # runs that cannot be compared: different tensors, tags or steps; a missing file
        print(f"error: {error}", file=sys.stderr)
        return 2


def compare(args: argparse.Namespace) -> int:
    for run in (args.a, args.b, *([args.reference] if args.reference else [])):
        check_run(run, args.checkpoint)
    a = load_weights(args.a / args.checkpoint)
    weights = weight_diffs(a, load_weights(args.b / args.checkpoint))
    logged = logged_scalars(args.a, args.b)
    weights_tol, scalars_tol, abs_tol, own = args.rel_tol, args.rel_tol, args.abs_tol, {}
    if args.reference:
        reordered_weights = load_weights(args.reference / args.checkpoint)
        ref = rounding_reference(a, reordered_weights, ceiling_of(a))
        if ref.max_rel <= ceiling_of(a):
            reordered = logged_scalars(args.a, args.reference).diffs
            weights_tol = max(weights_tol, ROUNDING_FACTOR * ref.max_rel)
            scalars_tol = max(scalars_tol, ROUNDING_FACTOR * worst_first(reordered)[0].max_rel if reordered else 0.0)
            abs_tol = max(abs_tol, ROUNDING_FACTOR * ref.max_abs)
            own = {d.name: ROUNDING_FACTOR * d.max_abs for d in weight_diffs(a, reordered_weights)}
            print(f"reference: reordering moved weights by max_rel {ref.max_rel:.3g}, max_abs {ref.max_abs:.3g}")
        else:
            print(f"reference: reordering moved weights by max_rel {ref.max_rel:.3g}: not rounding, not used")
    verdicts = [
        Verdict(d, max(weights_tol * a[d.name].abs().max().item() if a[d.name].numel() else 0.0, own.get(d.name, 0)),
                "at rounding level" if 0 < abs_tol and d.max_abs <= abs_tol else "")
        for d in weights
    ]  # fmt: skip
    tags = [
        Verdict(d, (max(scalars_tol, FLOAT32_STORAGE) if d.name in logged.float32 else scalars_tol) * d.max_abs
                / d.max_rel if d.max_rel else 0.0)
        for d in logged.diffs
    ]  # fmt: skip
    print(f"weights, worst of {len(weights)} tensors:\n{verdict_report(verdicts, limit=5)}")
    counts = [sum(s == name for s in logged.source.values()) for name in ("metrics.csv", "TensorBoard")]
    sources = [f"{n} from {name}" for n, name in zip(counts, ("metrics.csv", "TensorBoard"), strict=True)]
    print(
        f"logged scalars, worst of {len(tags)} tags ({', '.join(sources)}; float32 values, TensorBoard's and those "
        f"computed in float32, judged at no less than {FLOAT32_STORAGE:g}):\n{verdict_report(tags, limit=5)}"
    )
    judged = [v for v in verdicts + tags if not v.rounding]
    over = [v for v in judged if v.over]
    worst = worst_first([v.diff for v in (over or judged)])
    ok = not over
    bounds = f"--rel-tol {args.rel_tol:g}" if not args.reference else f"bounds {weights_tol:.3g} (weights), "
    bounds += f"{scalars_tol:.3g} (logged)" if args.reference else ""
    print(f"{'PASS' if ok else 'FAIL'}: worst max_rel {worst[0].max_rel if worst else 0.0:.3g} vs {bounds}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
