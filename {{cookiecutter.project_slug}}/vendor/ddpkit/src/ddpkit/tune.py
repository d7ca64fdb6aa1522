"""Hyperparameter search in which every trial is a DDP run: `python main.py fit` on D devices per trial.

    python -m ddpkit.tune --space SPACE.yaml --trials N --devices D [--storage URL] [--study NAME] [--out DIR]
        [-- MAIN.PY FIT ARGS]

Run it from the project's root (or name the CLI with `--main`, as for `python -m ddpkit.scaling`). This process,
the worker, asks Optuna for a trial's values and runs `python main.py fit <fit args> --trainer.devices D
--trainer.default_root_dir <out>/trial_K --<key> <value> ...` as real processes: the values reach every rank as
command-line arguments, so all ranks train with the same ones by construction. After each validation rank 0
sends the metric to the worker, which reports it to the study and asks the pruner; the answer reaches every rank
through the strategy (a broadcast), so all of them stop after the same step and the fit ends cleanly
(ddpkit/trial.py). The batch is global, so values found on 2 devices mean the same on 8.

SPACE.yaml:

    metric: val/loss            # default: the checkpoint monitor of the fit's config
    direction: minimize         # default: that monitor's mode
    params:                     # dotted config keys, as on main.py's command line
      model.init_args.optimizer.init_args.lr: {low: 1.0e-4, high: 1.0e-1, log: true}   # float (int: int bounds)
      model.init_args.hidden_dim: {choices: [64, 128, 256]}
    sampler: {class_path: optuna.samplers.TPESampler, init_args: {seed: 0}}              # optional
    pruner: {class_path: optuna.pruners.MedianPruner, init_args: {n_startup_trials: 2}}  # optional

A trial's value is the metric at its last validation; it must be logged in validation. Intermediate values are
reported at the optimizer step (`trainer.global_step`, the same on any device count).

--storage, where the study lives (several workers share one study through it):
  (default)                         SQLite in <out>/study.db: one machine, nothing to start
  postgresql://USER:PASS@HOST/DB    PostgreSQL: workers on several machines (psycopg, the `tune` extra)
  journal:PATH                      Optuna's journal file: a filesystem that every worker mounts (SLURM arrays),
                                    no database server
Any other SQLAlchemy URL (mysql+pymysql://...) goes to Optuna's RDBStorage as it is.

--trials N is the study's total of finished (complete or pruned) trials: each worker stops when the study has N,
waiting for the other workers' last trials. Starting the same command again continues a study. A worker beats
its trial's heartbeat (a user attribute) every --heartbeat seconds; a RUNNING trial whose heartbeat is older than
twice that (its worker was killed) is failed by the next worker that looks, and its values run again as a new
trial. Workers' clocks must agree to well within that.

<out>/ holds trial_K/ (each trial's logs and checkpoints: `--ckpt_path last/best/auto` skip them, as the scaling
sweep's), trial_K.log (its output), trials.md (every trial), best.yaml (the best values as a config:
`python main.py fit --config config.yaml --config <out>/best.yaml`) and history.png, importances.png (with
matplotlib, the `scaling` extra).
"""

import argparse
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ddpkit.scaling import main_command, mark_sweep
from ddpkit.study import (
    NOTE,
    RETRY_OF,
    WORKER,
    BadInput,
    Heartbeat,
    Space,
    best_trial,
    config_path,
    fail_stale,
    fmt,
    open_storage,
    open_study,
    plot,
    progress,
    short_key,
    shown_url,
    surplus,
    tell,
    train_command,
    values_text,
    write_results,
)

# The environment of a trial's processes: the metric, the pipes of rank 0 to the worker ("W,R" file descriptors),
# and the worker's pid, which rank 0 watches (ddpkit.cli, ddpkit.trial).
TRIAL_METRIC = "DDPKIT_TUNE_METRIC"
TRIAL_CHANNEL = "DDPKIT_TUNE_CHANNEL"
TRIAL_WORKER = "DDPKIT_TUNE_WORKER"
SPACE_KEYS = {"metric", "direction", "params", "sampler", "pruner"}
RANGE_KEYS = {"low", "high", "log", "step"}
CHOICE_TYPES = (type(None), bool, int, float, str)  # what Optuna stores for a categorical choice
MODES = {"min": "minimize", "max": "maximize"}
FAILURES_IN_A_ROW = 3  # a worker whose own trials fail this often in a row stops: they would all fail


@dataclass
class Outcome:
    """How a trial's fit ended, as the worker saw it."""

    code: int | None = None  # exit status; None: killed at the trial timeout
    reports: list[tuple[int, float]] = field(default_factory=list)  # (step, value) after each validation
    pruned: bool = False
    missing: list[str] | None = None  # the metrics logged in validation, when the study's metric was not
    lost: bool = False  # another worker failed the trial (its heartbeat was late): the run was stopped


# ---- the space ----------------------------------------------------------------------------------------------
def number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        hint = " (YAML reads 1e-4 as text: write 1.0e-4)" if isinstance(value, str) else ""
        raise BadInput(f"{what} must be a number, got {value!r}{hint}")
    return value


def distribution(key: str, spec: Any) -> Any:
    """The Optuna distribution of `params.<key>`: {low, high[, log][, step]} (int when the bounds are ints) or
    {choices: [...]}."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    where = f"params.{key}"
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


def instance(spec: Any, base: type, what: str) -> Any:
    """The object a {class_path, init_args} entry names (a sampler, a pruner), checked to be a `base`."""
    import importlib

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
    try:
        return cls(**(spec.get("init_args") or {}))
    except (TypeError, ValueError) as error:
        raise BadInput(f"{what}: {spec['class_path']}: {error}") from None


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
    try:
        params = {str(key): distribution(str(key), spec) for key, spec in raw["params"].items()}
    except BadInput as error:
        raise BadInput(f"--space {path}: {error}") from None
    sampler = instance(raw.get("sampler"), optuna.samplers.BaseSampler, "sampler")
    pruner = instance(raw.get("pruner"), optuna.pruners.BasePruner, "pruner")
    metric = raw.get("metric")
    return Space(params, None if metric is None else str(metric), raw.get("direction"), sampler, pruner)


# ---- the fit's command line ---------------------------------------------------------------------------------
def argument(value: Any) -> str:
    """`value` as main.py's parser reads it back unchanged (YAML): 1e-05 would be text, 1.0e-05 is a float."""
    if isinstance(value, float):
        text = repr(value)
        mantissa, e, exponent = text.partition("e")
        return f"{mantissa}.0e{exponent}" if e and "." not in mantissa else text
    if isinstance(value, str) and yaml.safe_load(value) == value:
        return value
    return json.dumps(value)  # true, false, null, ints, and strings YAML would read as another type ("64")


def value_args(values: dict[str, Any]) -> list[str]:
    return [text for key, value in values.items() for text in (f"--{key}", argument(value))]


def trial_command(main: list[str], devices: int, root: Path, values: dict, fit_args: list[str]) -> list[str]:
    """The trial's fit: the user's arguments, then the worker's (check_fit_args refused any overlap)."""
    return [
        *main,
        "fit",
        *fit_args,
        "--trainer.devices",
        str(devices),
        "--trainer.default_root_dir",
        str(root),
        *value_args(values),
    ]


def trial_env(**extra: str) -> dict[str, str]:
    """The environment of a trial's processes: the worker's, without SLURM's variables. A trial is one machine's
    job whose ranks Lightning's launcher starts; with SLURM's variables (a worker in an array task) Lightning
    would take its ranks from srun, which started only the worker."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, **extra}


def check_fit_args(fit_args: list[str], space: Space) -> None:
    """The worker owns the devices, the run folder and the space's keys: the fit args may not set them."""
    owned = {short_key(k): f"params.{k} in --space" for k in space.params}
    owned |= {"trainer.devices": "--devices", "trainer.default_root_dir": "--out", "ckpt_path": "a fresh run per trial"}
    for arg in fit_args:
        if arg.startswith("--") and short_key(arg) in owned:
            raise BadInput(f"the fit args set {arg.split('=')[0]}, which the worker sets ({owned[short_key(arg)]})")


def fit_config(main: list[str], fit_args: list[str], devices: int, space: Space) -> dict:
    """The merged config of a trial's fit with each parameter at its lower end (first choice), from `main.py fit
    --print_config`: an unknown key or a value of the wrong type fails here, before any rank starts."""
    values = {key: d.choices[0] if hasattr(d, "choices") else d.low for key, d in space.params.items()}
    cmd = [*main, "fit", *fit_args, "--trainer.devices", str(devices), *value_args(values), "--print_config"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=trial_env(), check=False)
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("tip:")]
        errors = [line for line in lines if line.startswith("error:")] or lines[-1:] or ["(no message)"]
        # jsonargparse nests the reason under the option it belongs to: its most indented line says what.
        deepest = max(lines[lines.index(errors[0]) :], key=lambda line: len(line) - len(line.lstrip()))
        reason = errors[0].removeprefix("error:").strip() + ("" if deepest == errors[0] else f" ... {deepest.strip()}")
        shown = " ".join(value_args(values))
        raise BadInput(f"main.py fit refuses the fit args with the space's values ({shown}): {reason}")
    return yaml.safe_load(done.stdout)


def checkpoint_monitor(config: dict) -> tuple[str, str] | None:
    """(monitor, direction) of the first ModelCheckpoint in the fit's config that monitors a metric."""
    for callback in (config.get("trainer") or {}).get("callbacks") or []:
        if isinstance(callback, dict) and str(callback.get("class_path", "")).endswith("ModelCheckpoint"):
            args = callback.get("init_args") or {}
            if args.get("monitor"):
                return str(args["monitor"]), MODES.get(args.get("mode", "min"), "minimize")
    return None


# ---- one trial ----------------------------------------------------------------------------------------------
def run_trial(cmd: list[str], log: Path, trial: Any, metric: str, timeout: float | None) -> Outcome:
    """Run the trial's fit (its own session, output to `log`) and answer rank 0 after each validation: report
    the value to the study, ask the pruner. Killed with all its processes on timeout or when this raises."""
    import optuna

    outcome = Outcome()
    from_rank0, to_worker = os.pipe()  # (read end, write end)
    to_rank0_read, to_rank0 = os.pipe()
    channel = f"{to_worker},{to_rank0_read}"
    env = trial_env(**{TRIAL_METRIC: metric, TRIAL_CHANNEL: channel, TRIAL_WORKER: str(os.getpid())})
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            pass_fds=(to_worker, to_rank0_read),
        )
    os.close(to_worker)
    os.close(to_rank0_read)
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
                    outcome.reports.append((message["step"], message["value"]))
                    try:
                        trial.report(message["value"], message["step"])
                        outcome.pruned = trial.should_prune()
                        answer = "pruned" if outcome.pruned else None
                    except optuna.exceptions.UpdateFinishedTrialError:
                        outcome.lost, answer = True, "failed by another worker"
                try:
                    outbox.write(json.dumps({"stop": answer}) + "\n")
                    outbox.flush()
                except BrokenPipeError:
                    break
        code = proc.wait()
    except BaseException:
        kill_group(proc)
        raise
    finally:
        if timer:
            timer.cancel()
    outcome.code = None if timed_out.is_set() else code
    return outcome


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


# ---- the worker ---------------------------------------------------------------------------------------------
@dataclass
class Worker:
    """One worker's settings (from the command line and the checks before any trial)."""

    main: list[str]
    devices: int
    out: Path
    fit_args: list[str]
    space: Space
    metric: str
    total: int
    heartbeat: float
    timeout: float | None
    config: dict
    proposing: bool = True  # False once the sampler has nothing left (a GridSampler's grid is done)


def run_one(study: Any, w: Worker, trial: Any) -> bool:
    """Run `trial` to its end and tell the study; False when its fit failed (a crash, a timeout) or another worker
    failed the trial: this worker stops after FAILURES_IN_A_ROW of those."""
    from optuna.trial import TrialState

    name = f"trial_{trial.number:04d}"
    root, log = w.out / name, w.out / f"{name}.log"
    trial.set_user_attr(WORKER, f"{socket.gethostname()}:{os.getpid()}")
    print(f"trial {trial.number}: {values_text(trial.params)} on {w.devices} device(s) (log: {log})", flush=True)
    start = time.monotonic()
    try:
        with Heartbeat(trial, w.heartbeat):
            outcome = run_trial(
                trial_command(w.main, w.devices, root, trial.params, w.fit_args), log, trial, w.metric, w.timeout
            )
    except KeyboardInterrupt:
        trial.set_user_attr(NOTE, "interrupted")
        tell(study, trial, state=TrialState.FAIL)
        study.enqueue_trial(trial.params, user_attrs={RETRY_OF: trial.number})
        print(f"trial {trial.number}: interrupted: failed; its values run again when a worker starts", flush=True)
        raise
    seconds = f"{time.monotonic() - start:.0f} s"
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
    step, value = outcome.reports[-1]
    if not math.isfinite(value) and not outcome.pruned:  # a diverged run has no value to compare
        trial.set_user_attr(NOTE, f"{w.metric} is {value}")
        w.proposing &= tell(study, trial, state=TrialState.FAIL)
        print(f"trial {trial.number}: FAIL, {w.metric} {value} at step {step} ({seconds})", flush=True)
        return True  # the fit ran: a search meets diverging values, that is no reason to stop
    if outcome.pruned:
        w.proposing &= tell(study, trial, state=TrialState.PRUNED)
        result = f"PRUNED at step {step}, {w.metric} {fmt(value)}"
    else:
        w.proposing &= tell(study, trial, value)
        result = f"COMPLETE, {w.metric} {fmt(value)} at step {step}"
    finished = progress(study, w.total, w.metric)
    print(f"[{finished.split()[0]}] trial {trial.number}: {result} ({seconds}); study: {finished}", flush=True)
    return True


def work(study: Any, w: Worker) -> None:
    """Run trials until the study has `w.total` finished ones."""
    from optuna.trial import TrialState

    failures, waiting = 0, False
    while True:
        fail_stale(study, 2 * w.heartbeat)
        trials = study.get_trials(deepcopy=False)
        finished = sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)
        running = sum(t.state == TrialState.RUNNING for t in trials)
        if finished >= w.total:
            return
        if not w.proposing:
            print(f"study: the sampler has proposed all it can ({finished}/{w.total} finished); stopping", flush=True)
            return
        if finished + running >= w.total:  # the last trials run elsewhere: wait for them (or for their workers' end)
            if not waiting:
                print(f"study: {finished}/{w.total} finished, {running} running in other workers: waiting", flush=True)
                waiting = True
            time.sleep(w.heartbeat)
            continue
        waiting = False
        trial = study.ask(w.space.params)
        if surplus(study, trial, w.total):
            trial.set_user_attr(NOTE, "not run: another worker took the study's last trial")
            tell(study, trial, state=TrialState.FAIL)
            continue
        if run_one(study, w, trial):
            failures = 0
        else:
            failures += 1
            if failures >= FAILURES_IN_A_ROW:
                raise SystemExit(f"error: {failures} trials of this worker failed in a row; see their logs in {w.out}")
        write_results(study, w.space, w.metric, w.total, w.config, w.fit_args, w.out)


_signals = [signal.SIGINT]  # the signal that stopped the worker


def interrupt(signum: int, frame: Any) -> None:
    """SIGTERM (a scheduler's stop) as Ctrl-C: the running trial is killed, failed and enqueued again."""
    _signals.append(signum)
    raise KeyboardInterrupt


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ours, fit_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(
        prog="python -m ddpkit.tune", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--space", type=Path, required=True, help="the search space file (YAML; see above)")
    parser.add_argument(
        "--trials", type=int, required=True, help="finished trials the study needs, all workers together"
    )
    parser.add_argument("--devices", type=int, default=1, help="devices (GPUs or CPU processes) per trial (default 1)")
    parser.add_argument("--storage", help="where the study lives (default: SQLite in <out>/study.db; see above)")
    parser.add_argument("--study", help="the study's name (default: the space file's name without .yaml)")
    parser.add_argument("--out", type=Path, default=Path("tune"), help="output folder (default ./tune)")
    parser.add_argument(
        "--main", default="main.py", help="the project CLI: a file (default ./main.py) or a module name"
    )
    parser.add_argument(
        "--heartbeat",
        type=float,
        default=60.0,
        help="seconds between a running trial's heartbeats; a trial silent for twice this is failed "
        "and its values run again (default 60)",
    )
    parser.add_argument(
        "--timeout", type=float, help="seconds after which a trial is killed and failed (default: none)"
    )
    args = parser.parse_args(ours)
    if args.trials < 1 or args.devices < 1 or args.heartbeat <= 0:
        parser.error("--trials and --devices must be >= 1, --heartbeat > 0")
    return args, fit_args


def main(argv: list[str] | None = None) -> None:
    args, fit_args = parse(sys.argv[1:] if argv is None else argv)
    try:
        import optuna
    except ImportError:
        sys.stderr.write('error: python -m ddpkit.tune needs Optuna: pip install -e ".[tune]" (ddpkit[tune])\n')
        sys.exit(2)
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the worker prints its own line per trial
    try:
        if args.out.resolve() == Path.cwd().resolve():
            raise BadInput("--out must be a folder of its own: --ckpt_path last/best/auto skip it, and so its runs")
        space = load_space(args.space)
        check_fit_args(fit_args, space)
        main_cmd = main_command(args.main)
        args.out.mkdir(parents=True, exist_ok=True)
        storage = open_storage(args.storage, args.out)
        config = fit_config(main_cmd, fit_args, args.devices, space)
        for key in space.params:
            config_path(config, key)
        monitor = checkpoint_monitor(config)
        metric = space.metric or (monitor[0] if monitor else None)
        if metric is None:
            raise BadInput(f"--space {args.space}: no metric: name one (metric: val/loss); the config monitors none")
        direction = space.direction or (monitor[1] if monitor and monitor[0] == metric else "minimize")
        study = open_study(storage, args.study or args.space.stem, space, metric, direction)
    except BadInput as error:
        sys.stderr.write(f"error: {error}\n")
        sys.exit(2)
    mark_sweep(args.out, "python -m ddpkit.tune")
    where = shown_url(args.storage) if args.storage else f"sqlite:///{args.out / 'study.db'}"
    print(
        f"study {study.study_name!r} in {where}: {direction} {metric}; {progress(study, args.trials, metric)}; "
        f"{args.devices} device(s) per trial",
        flush=True,
    )
    worker = Worker(
        main_cmd, args.devices, args.out, fit_args, space, metric, args.trials, args.heartbeat, args.timeout, config
    )
    signal.signal(signal.SIGTERM, interrupt)
    try:
        work(study, worker)
    except KeyboardInterrupt:
        write_results(study, space, metric, args.trials, config, fit_args, args.out)
        sys.exit(128 + _signals[-1])
    except BadInput as error:
        write_results(study, space, metric, args.trials, config, fit_args, args.out)
        sys.stderr.write(f"error: {error}\n")
        sys.exit(2)
    write_results(study, space, metric, args.trials, config, fit_args, args.out)
    plots = plot(study, metric, args.out)
    best = best_trial(study)
    print(f"study {study.study_name!r}: {progress(study, args.trials, metric)}")
    if best is not None:
        print(f"best: trial {best.number}, {values_text(best.params)}; train it: {train_command(args.out, fit_args)}")
    print(f"written: {args.out / 'trials.md'}" + (", best.yaml" if best else "") + "".join(f", {p}" for p in plots))


if __name__ == "__main__":
    main()
