"""The study of `python -m ddpkit.tune`, as every worker sees it through its storage: opening it, the trials'
heartbeats and the failing of those whose worker is gone, and which values a trial may not run again. Optuna's own
heartbeat exists only for its SQL storages and its `optimize` loop; this one is a trial attribute, so a journal
file (SLURM arrays) gets it too. What the workers write about the study (trials.md, best.yaml, plots) is in
ddpkit/tune/report.py.
"""

import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Trial user attributes: the last heartbeat (time.time() of the worker), who runs it, why it failed, which trial
# it retries.
HEARTBEAT, WORKER, NOTE, RETRY_OF = "heartbeat", "worker", "note", "retry_of"
DIVERGED = "diverged"  # how the NOTE of a trial whose metric was not finite begins: its values have run
REPEAT = "not run: the values of trial"  # how the NOTE of a proposal that repeated another trial's values begins
CLOCKS = ("samples", "steps")  # what a trial's intermediate values are reported at (the pruning clock)


@dataclass
class Space:
    """A search space file: the distributions by dotted config key, and the study's settings."""

    params: dict[str, Any]  # in the order their arguments go on the command line (ddpkit.tune.space.ordered)
    metric: str | None = None
    direction: str | None = None
    sampler: Any = None
    pruner: Any = None
    # key: {parent key: the parent's values under which the key applies}; a key not here always applies.
    conditions: dict[str, dict[str, list]] = field(default_factory=dict)
    clock: str = "samples"


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
    record |= {"conditions": space.conditions} if space.conditions else {}
    record["clock"] = space.clock
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


def ran(trial: Any) -> bool:
    """Whether a trial's values have run or will: complete, pruned, diverged (its metric not finite), queued or
    running. Failed trials (killed, timed out, stopped) do not count: their values run again, or may."""
    from optuna.trial import TrialState

    diverged = trial.state == TrialState.FAIL and str(trial.user_attrs.get(NOTE, "")).startswith(DIVERGED)
    return diverged or trial.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.WAITING, TrialState.RUNNING)


def trial_values(trial: Any) -> dict[str, Any]:
    """A trial's values; a queued trial has no params yet: the values it will run are its fixed_params."""
    return trial.params or trial.system_attrs.get("fixed_params", {})


def repeated(study: Any, trial: Any) -> int | None:
    """The number of another trial whose values `trial` (just asked) has: one that ran them or will (`ran`), of a
    running one only if it has a lower number (of two workers that drew the same values at once, the later yields).
    None when the values are new, and for a trial that was queued with its values (asked for: a retry)."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    if any(t.number == trial.number and "fixed_params" in t.system_attrs for t in trials):
        return None
    for other in trials:
        if other.number == trial.number or not ran(other) or trial_values(other) != trial.params:
            continue
        if other.state != TrialState.RUNNING or other.number < trial.number:
            return other.number
    return None


def distinct_values(study: Any) -> int:
    """How many distinct sets of values the study's trials have run or will run."""
    import json

    trials = study.get_trials(deepcopy=False)
    return len({json.dumps(trial_values(t), sort_keys=True) for t in trials if ran(t)})
