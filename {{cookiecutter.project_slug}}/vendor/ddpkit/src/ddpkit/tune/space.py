"""The search space of `python -m ddpkit.tune`: the space file read and checked, a trial's values drawn from it
(a key with `when:` only when its condition holds), the values as main.py's command line reads them, how many
configurations a finite space holds, and the sampler's seed per trial.

A seeded sampler proposes from its random state: two workers built with one seed, or a worker started again on
its study, would propose the same values again. So a seeded sampler is built anew for each trial with a seed of
that trial's own, derived from the space's seed and the trial's number: the storage gives every trial a distinct
number (restarts and other workers included), and a single worker on a fresh study draws exactly what it drew last
time. GridSampler and QMCSampler keep their seed: it fixes one sequence that every trial takes the next point of.
"""

import hashlib
import importlib
import json
import math
from pathlib import Path
from typing import Any

import yaml

from ddpkit.tune.study import CLOCKS, BadInput, Space

SPACE_KEYS = {"metric", "direction", "params", "sampler", "pruner", "clock"}
RANGE_KEYS = {"low", "high", "log", "step"}
CHOICE_TYPES = (type(None), bool, int, float, str)  # what Optuna stores for a categorical choice
# Samplers whose seed fixes a sequence (of grid points, of quasi-random points) that every trial takes the next
# point of: all of a study's trials need the same seed.
SEQUENCE_SAMPLERS = ("GridSampler", "QMCSampler")


def number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        hint = " (YAML reads 1e-4 as text: write 1.0e-4)" if isinstance(value, str) else ""
        raise BadInput(f"{what} must be a number, got {value!r}{hint}")
    return value


def distribution(key: str, spec: Any) -> Any:
    """The Optuna distribution of `params.<key>`: {low, high[, log][, step]} (int when the bounds are ints) or
    {choices: [...]}; `when` is read by `conditions`."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    where = f"params.{key}"
    spec = {k: v for k, v in spec.items() if k != "when"} if isinstance(spec, dict) else spec
    if not isinstance(spec, dict) or not spec:
        raise BadInput(f"{where}: give {{low: L, high: H}} (log: true, step: S optional) or {{choices: [...]}}")
    if "choices" in spec:
        choices = spec["choices"]
        if set(spec) != {"choices"}:
            raise BadInput(f"{where}: choices take no other keys, got {sorted(set(spec) - {'choices'})}")
        if not isinstance(choices, list) or not choices:
            raise BadInput(f"{where}: choices must be a non-empty list, got {choices!r}")
        if not all(isinstance(c, CHOICE_TYPES) for c in choices):
            raise BadInput(f"{where}: each choice must be a number, a string, true/false or null")
        return CategoricalDistribution(choices)
    if set(spec) - RANGE_KEYS:
        raise BadInput(f"{where}: unknown keys {sorted(set(spec) - RANGE_KEYS)} (a range takes low, high, log, step)")
    if "low" not in spec or "high" not in spec:
        raise BadInput(f"{where}: a range needs both low and high")
    low, high = number(spec["low"], f"{where}.low"), number(spec["high"], f"{where}.high")
    log, step = spec.get("log", False), spec.get("step")
    if not isinstance(log, bool):
        raise BadInput(f"{where}.log must be true or false, got {log!r}")
    if low > high:
        raise BadInput(f"{where}: empty range, low {low} > high {high}")
    if log and low <= 0:
        raise BadInput(f"{where}: a log range needs low > 0, got {low}")
    if step is not None and (log or number(step, f"{where}.step") <= 0):
        raise BadInput(f"{where}.step must be > 0, and a log range takes none")
    if all(isinstance(v, int) for v in (low, high, step or 1)):
        return IntDistribution(low, high, log=log, step=step or 1)
    return FloatDistribution(float(low), float(high), log=log, step=step)


def conditions(raw: dict, params: dict[str, Any]) -> dict[str, dict[str, list]]:
    """{key: {parent: values}} from each `params.<key>.when: {PARENT: VALUE or [VALUES]}`: the key applies only
    when every parent (a key of the space with choices) has one of its values."""
    found: dict[str, dict[str, list]] = {}
    for key, spec in raw.items():
        when = spec.get("when") if isinstance(spec, dict) else None
        if when is None:
            continue
        where = f"params.{key}.when"
        if not isinstance(when, dict) or not when:
            raise BadInput(f"{where}: give {{KEY: VALUE}} or {{KEY: [VALUES]}}, KEY another key of params")
        found[str(key)] = {}
        for parent, allowed in when.items():
            parent, allowed = str(parent), allowed if isinstance(allowed, list) else [allowed]
            choices = getattr(params.get(parent), "choices", None)
            if parent == key or choices is None:
                raise BadInput(f"{where}: {parent} is not another key of params with choices")
            if not allowed or any(value not in choices for value in allowed):
                raise BadInput(f"{where}: {parent} takes {list(choices)}, not {allowed}")
            found[str(key)][parent] = allowed
    return found


def ordered(params: dict[str, Any], conditions: dict[str, dict[str, list]]) -> dict[str, Any]:
    """`params` in command-line order: a key after the keys its condition names, and after a key it extends
    (`...optimizer` chooses the class whose `...optimizer.init_args.momentum` follows); otherwise as written."""
    after = {
        key: set(conditions.get(key, {})) | {other for other in params if key.startswith(other + ".")} for key in params
    }
    done: dict[str, Any] = {}
    while len(done) < len(params):
        ready = [key for key in params if key not in done and after[key] <= set(done)]
        if not ready:
            raise BadInput(f"params: the conditions (when:) of {sorted(set(params) - set(done))} form a cycle")
        done[ready[0]] = params[ready[0]]
    return done


def applies(key: str, space: Space, values: dict[str, Any]) -> bool:
    """Whether `key` is part of a trial whose values so far are `values` (its condition's parents set to one of
    the condition's values)."""
    condition = space.conditions.get(key, {})
    return all(parent in values and values[parent] in allowed for parent, allowed in condition.items())


def suggest(trial: Any, space: Space) -> dict[str, Any]:
    """Draw the trial's values from the space (Optuna's define-by-run: a key whose condition fails is not drawn)."""
    from optuna.distributions import CategoricalDistribution, IntDistribution

    for key, d in space.params.items():
        if not applies(key, space, trial.params):
            continue
        if isinstance(d, CategoricalDistribution):
            trial.suggest_categorical(key, d.choices)
        elif isinstance(d, IntDistribution):
            trial.suggest_int(key, d.low, d.high, step=d.step, log=d.log)
        else:
            trial.suggest_float(key, d.low, d.high, step=d.step, log=d.log)
    return trial.params


def points(d: Any) -> float:
    """How many values a distribution holds (math.inf for a continuous range)."""
    if hasattr(d, "choices"):
        return len(d.choices)
    if d.step is None:
        return math.inf
    return math.floor((d.high - d.low) / d.step + 1e-9) + 1


def configurations(space: Space) -> float:
    """How many distinct trials the space holds (math.inf when a range is continuous); a conditional key counts
    only where it applies."""
    keys = list(space.params)
    parents = {parent for condition in space.conditions.values() for parent in condition}

    def count(i: int, values: dict[str, Any]) -> float:
        if i == len(keys):
            return 1
        key, d = keys[i], space.params[keys[i]]
        if not applies(key, space, values):
            return count(i + 1, values)
        if key in parents:  # each of its choices leads to its own set of keys
            return sum(count(i + 1, {**values, key: choice}) for choice in d.choices)
        return points(d) * count(i + 1, values)

    return count(0, {})


def check_sets(space: Space) -> list[dict[str, Any]]:
    """Value sets for the checks before any trial: each key at its lower end (first choice) in at least one set
    where it applies; the first set has every key's default, later ones switch a condition's parent to make the
    next key apply (an SGD-only momentum gets a set with SGD)."""

    def values(chosen: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, d in space.params.items():
            if applies(key, space, out):
                out[key] = chosen.get(key, d.choices[0] if hasattr(d, "choices") else d.low)
        return out

    def choose(key: str, chosen: dict[str, Any]) -> None:
        for parent, allowed in space.conditions.get(key, {}).items():
            chosen[parent] = allowed[0]
            choose(parent, chosen)

    sets = [values({})]
    for key in space.params:
        if any(key in s for s in sets):
            continue
        chosen: dict[str, Any] = {}
        choose(key, chosen)
        sets.append(values(chosen))
        if key not in sets[-1]:
            raise BadInput(f"params.{key} never applies: the conditions (when:) on its way contradict each other")
    return sets


def argument(value: Any) -> str:
    """`value` as main.py's parser reads it back unchanged (YAML): 1e-05 would be text, 1.0e-05 is a float."""
    if isinstance(value, float):
        text = repr(value)
        mantissa, e, exponent = text.partition("e")
        return f"{mantissa}.0e{exponent}" if e and "." not in mantissa else text
    if isinstance(value, str) and yaml.safe_load(value) == value:
        return value
    return json.dumps(value)  # true, false, null, ints, and strings YAML would read as another type ("64")


def value_args(values: dict[str, Any], space: Space | None = None) -> list[str]:
    """`--key value ...`, in the space's order (a class before its arguments) when a space is given."""
    keys = [k for k in space.params if k in values] if space else list(values)
    return [text for key in keys for text in (f"--{key}", argument(values[key]))]


def trial_seed(seed: int, number: int) -> int:
    """The seed of trial `number` of a study whose sampler has `seed`: distinct per trial, the same on every run."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{number}".encode()).digest()[:4], "little")


def seeded_per_trial(cls: type, init_args: dict) -> Any:
    """A sampler that builds `cls(**init_args)` anew for each trial, with the trial's own seed (module docstring)."""
    from optuna.samplers import BaseSampler

    class SeededPerTrial(BaseSampler):
        def __init__(self) -> None:
            self.sampler = cls(**init_args)

        def __str__(self) -> str:
            return f"{cls.__name__}, seeded per trial from seed {init_args['seed']}"

        def before_trial(self, study: Any, trial: Any) -> None:
            self.sampler = cls(**{**init_args, "seed": trial_seed(init_args["seed"], trial.number)})
            self.sampler.before_trial(study, trial)

        def infer_relative_search_space(self, study: Any, trial: Any) -> Any:
            return self.sampler.infer_relative_search_space(study, trial)

        def sample_relative(self, study: Any, trial: Any, search_space: Any) -> Any:
            return self.sampler.sample_relative(study, trial, search_space)

        def sample_independent(self, study: Any, trial: Any, name: str, distribution: Any) -> Any:
            return self.sampler.sample_independent(study, trial, name, distribution)

        def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
            self.sampler.after_trial(study, trial, state, values)

        def reseed_rng(self) -> None:
            self.sampler.reseed_rng()

    return SeededPerTrial()


def instance(spec: Any, base: type, what: str) -> Any:
    """The object a {class_path, init_args} entry names (a sampler, a pruner), checked to be a `base`. A sampler
    with a seed is seeded per trial (module docstring)."""
    if spec is None:
        return None
    if (
        not isinstance(spec, dict)
        or not isinstance(spec.get("class_path"), str)
        or set(spec) - {"class_path", "init_args"}
    ):
        raise BadInput(f"{what}: give {{class_path: optuna.{what}s.Name, init_args: {{...}}}}, got {spec!r}")
    module, _, name = spec["class_path"].rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        raise BadInput(f"{what}: no class {spec['class_path']!r}") from None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise BadInput(f"{what}: {spec['class_path']} is not an Optuna {what}")
    init_args = spec.get("init_args") or {}
    try:
        made = cls(**init_args)
    except (TypeError, ValueError) as error:
        raise BadInput(f"{what}: {spec['class_path']}: {error}") from None
    if what == "sampler" and init_args.get("seed") is not None and cls.__name__ not in SEQUENCE_SAMPLERS:
        return seeded_per_trial(cls, init_args)
    return made


def load_space(path: Path) -> Space:
    """Read and check SPACE.yaml; everything wrong in it is one BadInput."""
    import optuna

    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise BadInput(f"--space {path}: {str(error).splitlines()[0]}") from None
    if not isinstance(raw, dict) or set(raw) - SPACE_KEYS:
        unknown = sorted(set(raw) - SPACE_KEYS) if isinstance(raw, dict) else raw
        raise BadInput(f"--space {path}: the keys are {sorted(SPACE_KEYS)}; unknown: {unknown}")
    if not isinstance(raw.get("params"), dict) or not raw["params"]:
        raise BadInput(f"--space {path}: params must map dotted config keys to ranges or choices")
    if raw.get("direction") not in (None, "minimize", "maximize"):
        raise BadInput(f"--space {path}: direction must be minimize or maximize, got {raw['direction']!r}")
    if raw.get("clock", "samples") not in CLOCKS:
        raise BadInput(f"--space {path}: clock must be one of {list(CLOCKS)}, got {raw['clock']!r}")
    try:
        params = {str(key): distribution(str(key), spec) for key, spec in raw["params"].items()}
        when = conditions(raw["params"], params)
        params = ordered(params, when)
    except BadInput as error:
        raise BadInput(f"--space {path}: {error}") from None
    sampler = instance(raw.get("sampler"), optuna.samplers.BaseSampler, "sampler")
    pruner = instance(raw.get("pruner"), optuna.pruners.BasePruner, "pruner")
    metric = raw.get("metric")
    metric = None if metric is None else str(metric)
    space = Space(params, metric, raw.get("direction"), sampler, pruner, when, raw.get("clock", "samples"))
    try:
        check_sets(space)
    except BadInput as error:
        raise BadInput(f"--space {path}: {error}") from None
    return space
