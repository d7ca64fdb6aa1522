"""The study of `python -m ddpkit.tune`, as every worker sees it through its storage: opening it, the trials'
heartbeats and the failing of those whose worker is gone, and what the workers write about it (trials.md,
best.yaml, plots). Optuna's own heartbeat exists only for its SQL storages and its `optimize` loop; this one is
a trial attribute, so a journal file (SLURM arrays) gets it too.
"""

import os
import random
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

# Trial user attributes: the last heartbeat (time.time() of the worker), who runs it, why it failed, which trial
# it retries.
HEARTBEAT, WORKER, NOTE, RETRY_OF = "heartbeat", "worker", "note", "retry_of"


@dataclass
class Space:
    """A search space file: the distributions by dotted config key, and the study's settings."""

    params: dict[str, Any]
    metric: str | None = None
    direction: str | None = None
    sampler: Any = None
    pruner: Any = None


class BadInput(Exception):
    """Input that cannot work; one `error:` line, status 2, before any rank starts."""


def short_key(key: str) -> str:
    """A config key without its `init_args` parts (`model.init_args.lr` and `model.lr` are one option)."""
    return ".".join(part for part in key.lstrip("-").split("=")[0].split(".") if part != "init_args")


def config_path(config: dict, key: str) -> list[str]:
    """The full path of a dotted key in the merged config: `model.lr` is model -> init_args -> lr."""
    node, path = config, []
    for part in key.split("."):
        if isinstance(node, dict) and part not in node and isinstance(node.get("init_args"), dict):
            node, path = node["init_args"], [*path, "init_args"]
        if not isinstance(node, dict) or part not in node:
            raise BadInput(f"params.{key} is not a key of the fit's config (python main.py fit --print_config)")
        node, path = node[part], [*path, part]
    return path


def shown_url(url: str) -> str:
    """The storage URL without its password, for messages."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return url


def open_storage(url: str | None, out: Path) -> Any:
    """The Optuna storage `--storage` names (module docstring); one BadInput when it cannot be opened."""
    import optuna

    url = url or f"sqlite:///{(out / 'study.db').resolve()}"
    try:
        if url.startswith("journal:"):
            from optuna.storages.journal import JournalFileBackend

            path = Path(url.removeprefix("journal:"))
            path.parent.mkdir(parents=True, exist_ok=True)
            return optuna.storages.JournalStorage(JournalFileBackend(str(path)))
        if url.startswith("postgresql://"):  # SQLAlchemy's default driver for it is psycopg2; ours is psycopg (3)
            url = "postgresql+psycopg://" + url.removeprefix("postgresql://")
        # Give up on an unreachable server after 10 s (psycopg's default: forever); SQLite: wait up to 60 s for
        # another worker's write lock instead of failing at once.
        connect = {"connect_timeout": 10} if url.startswith("postgresql") else {"timeout": 60}
        kwargs = {"connect_args": connect} if url.startswith(("postgresql", "sqlite")) else {}
        return _rdb_storage(url, kwargs)
    except Exception as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise BadInput(f"--storage {shown_url(url)}: cannot open it: {first}") from None


def _rdb_storage(url: str, engine_kwargs: dict, tries: int = 5) -> Any:
    """Optuna's RDBStorage, retried when workers that start together race to create its tables in a new database:
    on PostgreSQL the losers failed with a duplicate key or table (12 of 20 workers, 4 started at once on each of 5
    new databases, 2026-12-04), and find the tables made on their next try."""
    import optuna
    from sqlalchemy.exc import IntegrityError, ProgrammingError

    for attempt in range(tries):
        try:
            return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs)
        except (IntegrityError, ProgrammingError):
            if attempt == tries - 1:
                raise
            time.sleep(0.2 + random.random())  # apart, so that two losers do not race again


def open_study(storage: Any, name: str, space: Space, metric: str, direction: str) -> Any:
    """Create the study, or load it (another worker's, or a restart's) after checking that it has this space."""
    import optuna
    from optuna.distributions import distribution_to_json

    study = optuna.create_study(
        storage=storage,
        study_name=name,
        direction=direction,
        sampler=space.sampler,
        pruner=space.pruner,
        load_if_exists=True,
    )
    record = {"metric": metric, "params": {k: distribution_to_json(d) for k, d in space.params.items()}}
    if study.direction.name.lower() != direction:
        raise BadInput(f"study {name!r} {study.direction.name.lower()}s its metric, this space {direction}s it")
    recorded = study.user_attrs.get("space")
    if recorded is None:
        study.set_user_attr("space", record)
    elif recorded != record:
        raise BadInput(
            f"study {name!r} was started with another metric or space ({recorded}); use --study NAME for a new one"
        )
    return study


def tell(study: Any, trial: Any, *args: Any, **kwargs: Any) -> bool:
    """`study.tell`; False when the sampler has nothing left to propose. GridSampler and BruteForceSampler then call
    `study.stop()`, which Optuna allows only inside `study.optimize` (it raises here, after the trial is stored)."""
    try:
        study.tell(trial, *args, **kwargs)
    except RuntimeError as error:
        if "Study.stop" not in str(error):
            raise
        return False
    return True


def fail_stale(study: Any, grace: float) -> None:
    """Fail every RUNNING trial whose heartbeat is older than `grace` s (its worker is gone) and enqueue its values
    as a new trial. Of two workers that try at once, one fails it and enqueues; the other's tell raises."""
    import optuna
    from optuna.trial import TrialState

    now = time.time()
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        start = trial.datetime_start.timestamp() if trial.datetime_start else now
        silent = now - trial.user_attrs.get(HEARTBEAT, start)
        if silent <= grace:
            continue
        try:
            tell(study, trial.number, state=TrialState.FAIL)
        except (ValueError, optuna.exceptions.UpdateFinishedTrialError):
            continue  # finished meanwhile: failed by another worker first (tell's check, or the storage's)
        study.enqueue_trial(trial.params, user_attrs={RETRY_OF: trial.number})
        worker = trial.user_attrs.get(WORKER, "?")
        print(
            f"trial {trial.number}: its worker ({worker}) sent no heartbeat for {silent:.0f} s: failed; its "
            "values run again as a new trial",
            flush=True,
        )


class Heartbeat:
    """While a trial runs: its HEARTBEAT attribute set to now every `interval` s, in a thread."""

    def __init__(self, trial: Any, interval: float) -> None:
        self.trial, self.interval, self.done = trial, interval, threading.Event()
        self.thread = threading.Thread(target=self._beat, name="tune-heartbeat", daemon=True)

    def _beat(self) -> None:
        while not self.done.wait(self.interval):
            try:
                self.trial.set_user_attr(HEARTBEAT, time.time())
            except Exception as error:  # a storage hiccup: the next beat tries again (a finished trial: stopped)
                print(f"warning: trial {self.trial.number}: heartbeat not recorded: {error}", file=sys.stderr)

    def __enter__(self) -> "Heartbeat":
        self.trial.set_user_attr(HEARTBEAT, time.time())
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.done.set()
        self.thread.join()


def surplus(study: Any, trial: Any, total: int) -> bool:
    """Two workers that asked at once for the study's last slot: the later trial number yields."""
    from optuna.trial import TrialState

    counted = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
    return sum(1 for t in study.get_trials(deepcopy=False, states=counted) if t.number < trial.number) >= total


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


def atomic_write(path: Path, text: str) -> None:
    """Workers on a shared filesystem write the same files: each replaces it whole."""
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def table(study: Any, space: Space, metric: str, total: int) -> str:
    """trials.md: one row per trial, the best marked."""
    trials = study.get_trials(deepcopy=False)
    retried = {t.user_attrs[RETRY_OF]: t.number for t in trials if RETRY_OF in t.user_attrs}
    best = best_trial(study)
    keys = [short_key(k) for k in space.params]
    head = f"Study {study.study_name!r}, {study.direction.name.lower()} {metric}: {progress(study, total, metric)}.\n\n"
    lines = [f"| trial | state | {metric} | last step | " + " | ".join(keys) + " | seconds | worker | note |"]
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


def best_yaml(study: Any, config: dict, metric: str, fit_args: list[str], out: Path) -> str | None:
    """best.yaml: the best trial's values, nested as config.yaml nests them, for `--config <out>/best.yaml`."""
    best = best_trial(study)
    if best is None:
        return None
    nested: dict = {}
    for key, value in best.params.items():
        *parents, leaf = config_path(config, key)
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
        print('matplotlib is not installed: no plots (pip install -e ".[scaling]")')
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
    study: Any, space: Space, metric: str, total: int, config: dict, fit_args: list[str], out: Path
) -> None:
    atomic_write(out / "trials.md", table(study, space, metric, total))
    best = best_yaml(study, config, metric, fit_args, out)
    if best is not None:
        atomic_write(out / "best.yaml", best)
