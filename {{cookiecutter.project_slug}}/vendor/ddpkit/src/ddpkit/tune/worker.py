"""The worker of `python -m ddpkit.tune` at work: it asks the study for trials whose values are new, runs up to
`slots` of them at once (each in a thread of its own, on devices it claimed: ddpkit/tune/devices.py), tells the
study how each ended, and waits for the other workers' last trials; on Ctrl-C, SIGTERM or a trial's bad input it
kills its running trials, fails them and queues their values again.
"""

import math
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpkit.tune.devices import Claim, claim, cpu_threads
from ddpkit.tune.report import fmt, progress, time_left, values_text, write_results
from ddpkit.tune.run import Outcome, failure_line, resume_point, run_folder, run_trial, tidy_checkpoints, trial_command
from ddpkit.tune.space import configurations, suggest
from ddpkit.tune.study import (
    DIVERGED,
    NOTE,
    REPEAT,
    RETRY_OF,
    WORKER,
    BadInput,
    Heartbeat,
    Space,
    distinct_values,
    fail_stale,
    repeated,
    surplus,
    tell,
)

FAILURES_IN_A_ROW = 3  # a worker whose own trials fail this often in a row stops: they would all fail
REPEATS_IN_A_ROW = 20  # proposals in a row that repeat a trial's values before a worker gives up on its sampler
POLL = 2.0  # seconds between a waiting worker's looks at the study: it ends within this of the study's end


@dataclass
class Worker:
    """One worker's settings (from the command line and the checks before any trial), and its running trials."""

    main: list[str]
    devices: int
    out: Path
    fit_args: list[str]
    space: Space
    metric: str
    total: int
    heartbeat: float
    timeout: float | None
    paths: dict[str, list[str]]
    gpus: list[str] = field(default_factory=list)  # the GPUs it gives its trials (none: CPU trials)
    slots: int = 1  # trials at once
    keep: str = "best"  # --checkpoints
    repeats: bool = False  # --allow-repeats
    proposing: bool = True  # False once the sampler has nothing left (a GridSampler's grid is done)
    stopping: threading.Event = field(default_factory=threading.Event)  # Ctrl-C, SIGTERM, or a trial's bad input
    wake: threading.Event = field(default_factory=threading.Event)  # a trial of this worker ended
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)  # trial number: its fit
    errors: list[BaseException] = field(default_factory=list)  # what stopped a trial's thread and so the worker
    failures: int = 0  # this worker's trials that failed in a row
    lock: threading.Lock = field(default_factory=threading.Lock)

    def status(self, study: Any) -> str:
        """'2/20 finished, about 4 min left'."""
        from optuna.trial import TrialState

        finished = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))
        left = time_left(study, self.total)
        return f"{finished}/{self.total} finished" + (f", {left}" if left else "")


def run_one(study: Any, w: Worker, trial: Any, devices: Claim) -> bool:
    """Run `trial` to its end on `devices` and tell the study; False when its fit failed (a crash, a timeout) or
    another worker failed the trial. Killed by the worker (stopping): failed, and its values queued again."""
    from optuna.trial import TrialState

    name = f"trial_{trial.number:04d}"
    root, log = run_folder(w.out, trial.number), w.out / f"{name}.log"
    trial.set_user_attr(WORKER, f"{socket.gethostname()}:{os.getpid()}")
    ckpt = resume_point(study, w.out, trial)
    copied = []  # the curve of the run it continues, so that the pruner sees all of it
    if RETRY_OF in trial.user_attrs:
        for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,)):
            if t.number == trial.user_attrs[RETRY_OF]:
                copied = sorted(t.intermediate_values.items())
        for at, value in copied:
            trial.report(value, at)
    where = f" on GPUs {','.join(devices.gpus)}" if devices.gpus else ""
    resumes = f", resuming {ckpt}" if ckpt else ""
    print(
        f"trial {trial.number}: {values_text(trial.params)}{resumes}, {w.devices} device(s){where} (log: {log})",
        flush=True,
    )
    start = time.monotonic()
    env = {**devices.env(), "OMP_NUM_THREADS": cpu_threads(w.slots, w.devices)}

    def started(proc: subprocess.Popen) -> None:
        with w.lock:
            w.procs[trial.number] = proc
        if w.stopping.is_set():  # the worker stopped while this trial was starting
            os.killpg(proc.pid, signal.SIGKILL)

    with Heartbeat(trial, w.heartbeat):
        cmd = trial_command(w.main, w.devices, root, trial.params, w.fit_args, w.space, ckpt)
        outcome = run_trial(
            cmd,
            log,
            trial,
            w.metric,
            w.space.clock,
            w.timeout,
            env,
            tuple(devices.fds),
            started,
            lambda line: print(f"{line} (study: {w.status(study)})", flush=True),
        )
    with w.lock:
        w.procs.pop(trial.number, None)
    if w.stopping.is_set() and outcome.code != 0:
        trial.set_user_attr(NOTE, "interrupted")
        tell(study, trial, state=TrialState.FAIL)
        study.enqueue_trial(trial.params, user_attrs={RETRY_OF: trial.number})
        print(f"trial {trial.number}: interrupted: failed; its values run again when a worker starts", flush=True)
        return False
    if ckpt and not outcome.reports and outcome.missing is None and outcome.code == 0 and copied:
        outcome.reports = copied[-1:]  # resumed from a checkpoint with nothing left to train: its last value holds
    return told(study, w, trial, outcome, log, f"{time.monotonic() - start:.0f} s")


def told(study: Any, w: Worker, trial: Any, outcome: Outcome, log: Path, seconds: str) -> bool:
    """Tell the study how the trial's fit ended (`run_one`'s result)."""
    from optuna.trial import TrialState

    if outcome.lost:
        print(f"trial {trial.number}: failed by another worker (this worker's heartbeat was late); run stopped")
        return False
    if outcome.code != 0:
        why = f"timed out after {w.timeout:g} s" if outcome.code is None else f"fit exited {outcome.code}"
        trial.set_user_attr(NOTE, why)
        w.proposing &= tell(study, trial, state=TrialState.FAIL)
        print(f"trial {trial.number}: FAIL, {why} ({seconds}): {failure_line(log)}", flush=True)
        if outcome.code == 2:  # main.py's bad input, refused before any rank started: every trial would be too
            raise BadInput(f"trial {trial.number}: {failure_line(log).removeprefix('error: ')} (see {log})")
        return False
    if outcome.missing is not None or not outcome.reports:
        trial.set_user_attr(NOTE, f"{w.metric} not logged")
        tell(study, trial, state=TrialState.FAIL)
        why = (
            f"is not logged in validation (it logs {', '.join(outcome.missing) or 'nothing'})"
            if outcome.missing is not None
            else "has no value: the fit ran no validation"
        )
        raise BadInput(
            f"trial {trial.number}: the metric {w.metric} {why}: set metric: in the space file to a metric that "
            "the model logs in validation"
        )
    at, value = outcome.reports[-1]
    clock = "samples" if w.space.clock == "samples" else "step"
    if not math.isfinite(value) and not outcome.pruned:  # a diverged run has no value to compare
        trial.set_user_attr(NOTE, f"{DIVERGED}: {w.metric} {value}")
        w.proposing &= tell(study, trial, state=TrialState.FAIL)
        print(f"trial {trial.number}: FAIL, {w.metric} {value} at {clock} {at} ({seconds})", flush=True)
        return True  # the fit ran: a search meets diverging values, that is no reason to stop
    if outcome.pruned:
        w.proposing &= tell(study, trial, state=TrialState.PRUNED)
        result = f"PRUNED at {clock} {at}, {w.metric} {fmt(value)}"
    else:
        w.proposing &= tell(study, trial, value)
        result = f"COMPLETE, {w.metric} {fmt(value)} at {clock} {at}"
    finished = progress(study, w.total, w.metric)
    left = time_left(study, w.total)
    print(
        f"[{finished.split()[0]}] trial {trial.number}: {result} ({seconds}); study: {finished}"
        + (f"; {left}" if left else ""),
        flush=True,
    )
    return True


def slot(study: Any, w: Worker, trial: Any, devices: Claim) -> None:
    """A trial's thread: run it, count this worker's failures in a row, tidy the checkpoints, rewrite the results;
    what stops it (a trial's bad input, too many failures) stops the worker."""
    try:
        ok = run_one(study, w, trial, devices)
        with w.lock:
            w.failures = 0 if ok else w.failures + 1
            failures = w.failures
        if failures >= FAILURES_IN_A_ROW and not w.stopping.is_set():
            raise SystemExit(f"error: {failures} trials of this worker failed in a row; see their logs in {w.out}")
        tidy_checkpoints(study, w.out, w.keep)
        write_results(study, w.space, w.metric, w.total, w.paths, w.fit_args, w.out)
    except BaseException as error:
        w.errors.append(error)
    finally:
        devices.release()
        w.wake.set()


def propose(study: Any, w: Worker) -> Any:
    """A new trial with values that no trial has run or runs (unless --allow-repeats): a proposal that repeats one
    is failed unrun and the sampler asked again, REPEATS_IN_A_ROW times at most. None when this worker must not
    run one: the study's last slot went to another worker, or the sampler has nothing new."""
    from optuna.trial import TrialState

    for _ in range(REPEATS_IN_A_ROW):
        trial = study.ask()
        suggest(trial, w.space)
        if surplus(study, trial, w.total):
            trial.set_user_attr(NOTE, "not run: another worker took the study's last trial")
            tell(study, trial, state=TrialState.FAIL)
            return None
        twin = None if w.repeats else repeated(study, trial)
        if twin is None:
            return trial
        trial.set_user_attr(NOTE, f"{REPEAT} {twin}")
        w.proposing &= tell(study, trial, state=TrialState.FAIL)
        if not w.proposing:
            return None
    print(f"study: the sampler proposed values that trials have {REPEATS_IN_A_ROW} times in a row", flush=True)
    w.proposing = False
    return None


def work(study: Any, w: Worker) -> None:
    """Run trials, up to `w.slots` at once, until the study has `w.total` finished ones."""
    from optuna.trial import TrialState

    threads: list[threading.Thread] = []
    said = ""
    size = configurations(w.space)

    def say_once(line: str) -> None:
        nonlocal said
        if line != said:
            print(line, flush=True)
            said = line

    while True:
        if w.errors:
            raise w.errors[0]
        threads = [t for t in threads if t.is_alive()]
        fail_stale(study, 2 * w.heartbeat)
        trials = study.get_trials(deepcopy=False)
        finished = sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)
        running = sum(t.state == TrialState.RUNNING for t in trials)
        if not w.repeats and w.proposing and distinct_values(study) >= size:
            say_once(f"study: all {size} configurations of the space have run or are running ({finished} finished)")
            w.proposing = False
        if finished >= w.total or not w.proposing:
            if not threads:
                if finished < w.total and not running and "configurations" not in said:
                    print(f"study: the sampler has proposed all it can ({finished}/{w.total} finished)", flush=True)
                return
        elif len(threads) >= w.slots:
            pass  # every slot busy: wait for one of this worker's trials
        elif finished + running >= w.total:  # the last trials run elsewhere: wait for them (or their workers' end)
            if running > len(threads):
                others = running - len(threads)
                say_once(f"study: {finished}/{w.total} finished, {others} running in other workers: waiting")
        else:
            devices = claim(w.gpus, w.devices if w.gpus else 0)
            if devices is None:
                say_once(f"waiting for {w.devices} free GPU(s): other trials on this node hold them")
            else:
                threads += start(study, w, devices)
                continue
        w.wake.wait(POLL)
        w.wake.clear()


def start(study: Any, w: Worker, devices: Claim) -> list[threading.Thread]:
    """Ask for a trial and start its thread on `devices`; none when there is nothing to run."""
    trial = None
    try:
        trial = propose(study, w)
        if trial is None:
            devices.release()
            return []
        thread = threading.Thread(target=slot, args=(study, w, trial, devices), name=f"trial-{trial.number}")
        thread.start()
        return [thread]
    except BaseException:  # Ctrl-C between the ask and the thread: the trial never ran
        devices.release()
        if trial is not None and not any(t.name == f"trial-{trial.number}" for t in threading.enumerate()):
            from optuna.trial import TrialState

            trial.set_user_attr(NOTE, "interrupted")
            tell(study, trial, state=TrialState.FAIL)
            study.enqueue_trial(trial.params, user_attrs={RETRY_OF: trial.number})
        raise


def stop(w: Worker) -> None:
    """Kill the worker's running trials (each thread then fails its trial and queues its values) and wait for
    their threads. A second Ctrl-C meanwhile is ignored: the trials must be told."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    w.stopping.set()
    with w.lock:
        procs = list(w.procs.values())
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for thread in threading.enumerate():
        if thread.name.startswith("trial-"):
            thread.join()
