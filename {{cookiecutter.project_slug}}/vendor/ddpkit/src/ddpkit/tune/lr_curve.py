"""The learning-rate finder's curve (lr_finder.py runs the sweep): the lr of each step, the smoothed loss, when
the sweep has diverged, the suggestion, and which keys of the fit's config hold the lr the suggestion replaces.
Pure functions of numbers and dicts: the sweep's callback (lr_sweep.py) runs them inside the fit."""

import math
from typing import Any

# Steps on each side of a step in the smoothed loss: a centered mean of 7 steps, which has no lag (a trailing mean or
# an exponential average lags the lr it is plotted at; over 100 steps from 1e-6 to 1 an average of the last 10 steps
# moved the suggestion up by 1.5x on the digits example, docs/measurements.md).
HALF_WINDOW = 3


def sweep_lr(min_lr: float, max_lr: float, steps: int, k: int) -> float:
    """The lr of step k (0-based) of a sweep from `min_lr` (step 0) to `max_lr` (step steps - 1)."""
    return min_lr * (max_lr / min_lr) ** (k / (steps - 1))


def smooth(losses: list[float], half: int = HALF_WINDOW) -> list[float]:
    """Each loss replaced by the mean of the losses `half` steps on each side of it (fewer at the ends)."""
    return [mean(losses[max(0, i - half) : i + half + 1]) for i in range(len(losses))]


def diverged(losses: list[float], factor: float, half: int = HALF_WINDOW) -> bool:
    """Whether the mean of the last 2 x `half` + 1 losses is not finite or exceeds `factor` times the lowest such
    mean so far: the smoothed loss, known online (`smooth`'s value `half` steps back)."""
    window = 2 * half + 1
    trailing = [mean(losses[max(0, i - window + 1) : i + 1]) for i in range(len(losses))]
    return not math.isfinite(trailing[-1]) or trailing[-1] > factor * min(trailing)


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def suggestion(lrs: list[float], losses: list[float], half: int = HALF_WINDOW) -> float | None:
    """The lr where the smoothed loss falls fastest per unit of log(lr), before its lowest point; None when it
    never falls (the sweep started too high or is too short)."""
    smoothed = smooth(losses, half)
    finite = [i for i, s in enumerate(smoothed) if math.isfinite(s)]
    if len(finite) < 3:
        return None
    lowest = min(finite, key=lambda i: smoothed[i])
    # Central differences: the sweep's steps are equal in log(lr), the differences in its units all the same.
    slopes = {
        i: (smoothed[i + 1] - smoothed[i - 1]) / (math.log(lrs[i + 1]) - math.log(lrs[i - 1])) for i in range(1, lowest)
    }
    if not slopes or min(slopes.values()) >= 0:
        return None
    return lrs[min(slopes, key=slopes.get)]


# ---- where the lr is configured -----------------------------------------------------------------------------
def lr_keys(config: dict, optimizer_lr: float) -> list[str]:
    """The dotted keys of the model's config that hold the optimizer's lr: an optimizer argument's `lr`
    (`model.init_args.optimizer.init_args.lr`) or the module's own `lr`/`learning_rate`, whose value is the lr
    the optimizer was built with."""
    model = config.get("model") or {}
    args = model.get("init_args") if isinstance(model.get("init_args"), dict) else model
    keys = []
    prefix = "model.init_args" if "init_args" in model else "model"
    for name, value in (args or {}).items():
        if isinstance(value, dict) and isinstance(value.get("init_args"), dict) and "lr" in value["init_args"]:
            if _same(value["init_args"]["lr"], optimizer_lr):
                keys.append(f"{prefix}.{name}.init_args.lr")
        elif name in ("lr", "learning_rate") and _same(value, optimizer_lr):
            keys.append(f"{prefix}.{name}")
    return keys


def _same(value: Any, lr: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isclose(value, lr, rel_tol=1e-12)


def short_option(key: str) -> str:
    """The command-line option of a dotted config key, without `init_args` (`--model.optimizer.lr`)."""
    return "--" + ".".join(part for part in key.split(".") if part != "init_args")


def nested(key: str, value: Any) -> dict:
    """{"a": {"b": value}} for "a.b"."""
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def yaml_float(value: float) -> str:
    """`value` as YAML reads it back as the same float (YAML reads 1e-06 as text, 1.0e-06 as a number)."""
    mantissa, e, exponent = repr(float(value)).partition("e")
    return f"{mantissa}.0e{exponent}" if e and "." not in mantissa else mantissa + e + exponent


def shown(lr: float) -> str:
    """A suggested lr as printed and written: 3 significant digits, in YAML's float syntax."""
    return yaml_float(float(f"{lr:.3g}"))
