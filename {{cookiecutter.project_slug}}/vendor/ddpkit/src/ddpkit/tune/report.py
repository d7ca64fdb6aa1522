"""What the workers of `python -m ddpkit.tune` say and write about their study: the progress line and the estimate
of the time left, trials.md (every trial), best.yaml (the best values, nested as the config nests them) and the
plots. Every worker writes the same files after each trial: each replaces them whole.
"""

import os
import socket
import threading
from pathlib import Path
from typing import Any

import yaml

from ddpkit.tune.study import NOTE, RETRY_OF, WORKER, Space, short_key


def fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def values_text(params: dict) -> str:
    return ", ".join(f"{short_key(k)}={fmt(v)}" for k, v in params.items())


def best_trial(study: Any) -> Any:
    """The best COMPLETE trial, or None."""
    from optuna.trial import TrialState

    return study.best_trial if study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) else None


def progress(study: Any, total: int, metric: str) -> str:
    """'3/10 finished, best val/loss 0.2 (trial 2)'."""
    from optuna.trial import TrialState

    finished = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))
    best = best_trial(study)
    return f"{finished}/{total} finished" + (f", best {metric} {fmt(best.value)} (trial {best.number})" if best else "")


def duration(seconds: float) -> str:
    if seconds < 90:
        return f"{max(1, round(seconds))} s"
    return f"{seconds / 60:.0f} min" if seconds < 90 * 60 else f"{seconds / 3600:.1f} h"


def time_left(study: Any, total: int) -> str:
    """'about 4 min left': the trials still to finish x the finished ones' mean time, over the trials running now
    (every worker's). Empty before a trial has finished, or when none is left."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    done = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    timed = [(t.datetime_complete - t.datetime_start).total_seconds() for t in done if t.datetime_start]
    left = total - len(done)
    if not timed or left <= 0:
        return ""
    running = sum(t.state == TrialState.RUNNING for t in trials)
    return f"about {duration(left * sum(timed) / len(timed) / max(1, running))} left"


def atomic_write(path: Path, text: str) -> None:
    """Workers on a shared filesystem write the same files, and so do a worker's trials at once: each replaces it
    whole (a temporary file of its own, renamed)."""
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def table(study: Any, space: Space, metric: str, total: int) -> str:
    """trials.md: one row per trial, the best marked."""
    trials = study.get_trials(deepcopy=False)
    retried = {t.user_attrs[RETRY_OF]: t.number for t in trials if RETRY_OF in t.user_attrs}
    best = best_trial(study)
    keys = [short_key(k) for k in space.params]
    head = f"Study {study.study_name!r}, {study.direction.name.lower()} {metric}: {progress(study, total, metric)}.\n\n"
    clock = "last samples" if space.clock == "samples" else "last step"
    lines = [f"| trial | state | {metric} | {clock} | " + " | ".join(keys) + " | seconds | worker | note |"]
    lines.append("|" + "---|" * (7 + len(keys)))
    for t in trials:
        last = max(t.intermediate_values, default=None)
        value = t.value if t.value is not None else t.intermediate_values.get(last) if last is not None else None
        notes = [t.user_attrs.get(NOTE, "")]
        notes.append(f"values run again as trial {retried[t.number]}" if t.number in retried else "")
        notes.append(f"retries trial {t.user_attrs[RETRY_OF]}" if RETRY_OF in t.user_attrs else "")
        seconds = (
            (t.datetime_complete - t.datetime_start).total_seconds()
            if t.datetime_complete and t.datetime_start
            else None
        )
        cells = [
            str(t.number) + (" (best)" if best and t.number == best.number else ""),
            t.state.name,
            "" if value is None else fmt(value),
            "" if last is None else str(last),
            *(fmt(t.params[k]) if k in t.params else "" for k in space.params),
            "" if seconds is None else f"{seconds:.0f}",
            t.user_attrs.get(WORKER, ""),
            "; ".join(note for note in notes if note),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return head + "\n".join(lines) + "\n"


def best_yaml(study: Any, paths: dict[str, list[str]], metric: str, fit_args: list[str], out: Path) -> str | None:
    """best.yaml: the best trial's values nested as config.yaml nests them (`paths`: each key's place in the merged
    config, from the checks), for `--config <out>/best.yaml`. A key that chooses a class (an optimizer) is its
    `class_path`, so that the class's own arguments nest beside it."""
    best = best_trial(study)
    if best is None:
        return None
    nested: dict = {}
    for key, value in best.params.items():
        *parents, leaf = paths[key]
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    head = (
        f"# The best trial of study {study.study_name!r} (python -m ddpkit.tune): trial {best.number}, {metric} "
        f"{fmt(best.value)} ({study.direction.name.lower()}). Train it (with the trials' fit args):\n"
        f"# {train_command(out, fit_args)}\n"
    )
    return head + yaml.safe_dump(nested, sort_keys=False)


def train_command(out: Path, fit_args: list[str]) -> str:
    """The command that trains the best values as the trials trained them."""
    return " ".join(["python main.py fit --config config.yaml --config", str(out / "best.yaml"), *fit_args])


NO_PLOTS = 'matplotlib is not installed: no plots at the end (pip install -e ".[tune]")'


def can_plot() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def plot(study: Any, metric: str, out: Path) -> list[str]:
    """history.png (the metric per trial, the best so far) and importances.png; the names written."""
    import warnings

    try:
        import matplotlib

        matplotlib.use("Agg")  # files only
        import matplotlib.pyplot as plt
        from optuna.importance import PedAnovaImportanceEvaluator
        from optuna.visualization import matplotlib as optuna_plots
    except ImportError:
        print(NO_PLOTS)
        return []

    if best_trial(study) is None:
        print("no plots: no trial is complete")
        return []
    written = []
    # PED-ANOVA needs no scikit-learn (Optuna's default importance, fANOVA, does).
    plots = {
        "history.png": lambda: optuna_plots.plot_optimization_history(study, target_name=metric),
        "importances.png": lambda: optuna_plots.plot_param_importances(study, evaluator=PedAnovaImportanceEvaluator()),
    }
    for name, draw in plots.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Optuna marks its matplotlib plots experimental
            try:
                axes = draw()
            except (ValueError, RuntimeError, ZeroDivisionError) as error:  # e.g. importances of 1 finished trial
                print(f"no {name}: {str(error).splitlines()[0] if str(error) else type(error).__name__}")
                continue
        tmp = out / f".{name}.{os.getpid()}.png"
        axes.figure.savefig(tmp, dpi=100, bbox_inches="tight")  # the legend sits outside the axes
        os.replace(tmp, out / name)
        plt.close(axes.figure)
        written.append(name)
    return written


def write_results(
    study: Any, space: Space, metric: str, total: int, paths: dict[str, list[str]], fit_args: list[str], out: Path
) -> str:
    """trials.md and best.yaml, written whole; the table's text."""
    text = table(study, space, metric, total)
    atomic_write(out / "trials.md", text)
    best = best_yaml(study, paths, metric, fit_args, out)
    if best is not None:
        atomic_write(out / "best.yaml", best)
    return text
