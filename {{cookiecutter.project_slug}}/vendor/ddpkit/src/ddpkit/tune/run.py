"""One trial of `python -m ddpkit.tune`, as its worker runs it: the fit's command line and environment, the
exchange with its rank 0 after each validation (ddpkit/run/trial.py is the other side), and the trials' checkpoints:
where an interrupted trial resumes, and which checkpoints the study no longer needs.
"""

import json
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpkit.tune.report import best_trial, fmt
from ddpkit.tune.space import value_args
from ddpkit.tune.study import RETRY_OF, Space

# The environment of a trial's processes: the metric, the pipes of rank 0 to the worker ("W,R" file descriptors),
# and the worker's pid, which rank 0 watches (ddpkit.run.cli, ddpkit.run.trial). TRIAL_CHECK makes main.py build the fit
# (model, data, Trainer), print its config and stop: the checks before any trial.
TRIAL_METRIC = "DDPKIT_TUNE_METRIC"
TRIAL_CHANNEL = "DDPKIT_TUNE_CHANNEL"
TRIAL_WORKER = "DDPKIT_TUNE_WORKER"
TRIAL_CHECK = "DDPKIT_TUNE_CHECK"
KEEP = ("best", "all", "none")  # --checkpoints: whose checkpoints a study keeps once its trials have ended


@dataclass
class Outcome:
    """How a trial's fit ended, as the worker saw it."""

    code: int | None = None  # exit status; None: killed at the trial timeout
    reports: list[tuple[int, float]] = field(default_factory=list)  # (clock, value) after each validation
    pruned: bool = False
    missing: list[str] | None = None  # the metrics logged in validation, when the study's metric was not
    lost: bool = False  # another worker failed the trial (its heartbeat was late): the run was stopped


def trial_command(
    main: list[str], devices: int, root: Path, values: dict, fit_args: list[str], space: Space, ckpt: Path | None
) -> list[str]:
    """The trial's fit: the user's arguments, then the worker's (check_fit_args refused any overlap)."""
    resume = ["--ckpt_path", str(ckpt)] if ckpt else []
    return [
        *main,
        "fit",
        *fit_args,
        *("--trainer.devices", str(devices), "--trainer.default_root_dir", str(root)),
        *value_args(values, space),
        *resume,
    ]


def trial_env(**extra: str) -> dict[str, str]:
    """The environment of a trial's processes: the worker's, without SLURM's variables. A trial is one machine's
    job whose ranks Lightning's launcher starts; with SLURM's variables (a worker in an array task) Lightning
    would take its ranks from srun, which started only the worker."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, **extra}


def run_trial(
    cmd: list[str],
    log: Path,
    trial: Any,
    metric: str,
    clock: str,
    timeout: float | None,
    env: dict[str, str],
    keep_fds: tuple[int, ...] = (),
    started: Callable[[subprocess.Popen], None] = lambda proc: None,
    say: Callable[[str], None] = print,
) -> Outcome:
    """Run the trial's fit (its own session, output to `log`) and answer rank 0 after each validation: report the
    value to the study at `clock` (samples seen, or optimizer steps), ask the pruner, say one line. Killed with
    all its processes on timeout or when this raises; `keep_fds` (its claims) are inherited by rank 0."""
    import optuna

    outcome = Outcome()
    from_rank0, to_worker = os.pipe()  # (read end, write end)
    to_rank0_read, to_rank0 = os.pipe()
    channel = f"{to_worker},{to_rank0_read}"
    env = trial_env(**env, **{TRIAL_METRIC: metric, TRIAL_CHANNEL: channel, TRIAL_WORKER: str(os.getpid())})
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            pass_fds=(to_worker, to_rank0_read, *keep_fds),
        )
    os.close(to_worker)
    os.close(to_rank0_read)
    started(proc)
    timed_out = threading.Event()

    def time_out() -> None:
        timed_out.set()
        kill_group(proc)

    timer = threading.Timer(timeout, time_out) if timeout else None
    if timer:
        timer.start()
    try:
        with os.fdopen(from_rank0) as inbox, os.fdopen(to_rank0, "w") as outbox:
            for line in inbox:  # until rank 0 exits (the pipe's end of file)
                message = json.loads(line)
                if "missing" in message:
                    outcome.missing, answer = message["missing"], f"the metric {metric} is not logged"
                else:
                    # A data module without a global batch sends no samples: its trials' clock is the step.
                    at = message["samples"] if clock == "samples" and message.get("samples") else message["step"]
                    outcome.reports.append((at, message["value"]))
                    try:
                        trial.report(message["value"], at)
                        outcome.pruned = trial.should_prune()
                        answer = "pruned" if outcome.pruned else None
                    except optuna.exceptions.UpdateFinishedTrialError:
                        outcome.lost, answer = True, "failed by another worker"
                try:
                    outbox.write(json.dumps({"stop": answer}) + "\n")
                    outbox.flush()
                except BrokenPipeError:
                    break
                say(validation_line(trial.number, message, metric, answer))
        code = proc.wait()
    except BaseException:
        kill_group(proc)
        raise
    finally:
        if timer:
            timer.cancel()
    outcome.code = None if timed_out.is_set() else code
    return outcome


def validation_line(number: int, message: dict, metric: str, answer: str | None) -> str:
    """'trial 3: step 16, 1024 samples: val/loss 1.814: go on' (or the pruner's stop)."""
    if "missing" in message:
        return f"trial {number}: {metric} is not logged in validation (it logs {', '.join(message['missing'])})"
    samples = f", {message['samples']} samples" if message.get("samples") else ""
    return f"trial {number}: step {message['step']}{samples}: {metric} {fmt(message['value'])}: {answer or 'go on'}"


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the trial's session: rank 0 and every rank it started."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def failure_line(log: Path) -> str:
    """The line that says why a fit failed: its last `error:` line, else its last line."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    return (errors or lines or ["(no output)"])[-1]


# ---- checkpoints ------------------------------------------------------------------------------------------------
def run_folder(out: Path, number: int) -> Path:
    return out / f"trial_{number:04d}"


def retried(trials: dict[int, Any], number: int) -> list[int]:
    """The trials whose values trial `number` runs again, the latest first (a retry of a retry: both)."""
    chain = []
    while RETRY_OF in trials[number].user_attrs and trials[number].user_attrs[RETRY_OF] in trials:
        number = trials[number].user_attrs[RETRY_OF]
        chain.append(number)
    return chain


def resume_point(study: Any, out: Path, trial: Any) -> Path | None:
    """The last.ckpt a retried trial resumes from: the newest of the latest earlier run of its values that wrote
    one; None for a trial that runs its values for the first time."""
    trials = {t.number: t for t in study.get_trials(deepcopy=False)}
    for number in retried(trials, trial.number):
        found = sorted(run_folder(out, number).rglob("last.ckpt"), key=lambda p: p.stat().st_mtime)
        if found:
            return found[-1].resolve()
    return None


def tidy_checkpoints(study: Any, out: Path, keep: str) -> list[Path]:
    """Delete the checkpoints no trial needs any more (--checkpoints best: all but the best trial's; none: all);
    a running trial's and those a queued or running retry resumes from stay. Each worker tidies after each of its
    trials: what one misses (a trial that stopped being the best), the next one removes. The paths removed."""
    from optuna.trial import TrialState

    if keep == "all":
        return []
    trials = {t.number: t for t in study.get_trials(deepcopy=False)}
    best = best_trial(study) if keep == "best" else None
    needed = {best.number} if best else set()
    for t in trials.values():
        if t.state in (TrialState.RUNNING, TrialState.WAITING):
            needed |= {t.number, *retried(trials, t.number)}
    removed = []
    for number in set(trials) - needed:
        for path in sorted(run_folder(out, number).rglob("*.ckpt")):
            if path.is_dir():  # a sharded checkpoint
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path)
    return removed
