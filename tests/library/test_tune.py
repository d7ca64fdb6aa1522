"""`python -m ddpkit.tune` on the library's toy: trials that are real DDP runs, pruning that stops every rank at one
step, workers that share a study and survive a kill, bad input refused before any rank starts, and the best values
trained again on another device count.

Three jobs start with the session (early.py): most of their time is process start-up and sleeping steps.
- "tune_ddp": a study (journal storage) of 4 trials on 2 CPU processes in float64. A GridSampler gives two trials
  lr 3 (they diverge: the ThresholdPruner prunes them at their first validation) and two lr 0.003 (complete), at
  hidden_dim 16 and 32; each rank prints the values it trains with (value_probe.py). Then best.yaml is trained on
  1 device. Beside it, a study of a conditional space (AdamW, or SGD with its momentum) whose pruner prunes every
  trial at its first report, keeping every trial's checkpoints.
- "tune_workers": cluster/tune.sbatch as 2 tasks of a SLURM job array on a PostgreSQL study (a real server,
  started for it), 4 trials of 1 process whose steps sleep, task 1 running 2 trials at once; task 0's worker is
  killed (-9) after its first trial's first checkpoint, then started again.
- "tune_metric": a study (the default SQLite storage) whose metric the model never logs.
How the workers schedule trials (values, devices, restarts) is tested on fits that train nothing:
test_tune_schedule.py.
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import early
import optuna
import pytest
import torch
import yaml
from optuna.trial import TrialState
from postgres import server
from procs import finish, start, toy_ok

import ddpkit.testing.plugin  # noqa: F401  first: it has pytest rewrite the asserts of bounds, imported below
from ddpkit.parity import over_bound, read_csv_scalars, report, scalar_diffs, weight_diffs
from ddpkit.run.cli import newest_last_checkpoint
from ddpkit.scaling.sweeper import SWEEP_MARKER
from ddpkit.testing.bounds import BOUNDS
from ddpkit.testing.fake_cluster import free_port, sbatch_options, slurm_array_env
from ddpkit.tune import search as tune
from ddpkit.tune.devices import Claim
from ddpkit.tune.report import fmt
from ddpkit.tune.space import argument
from ddpkit.tune.study import HEARTBEAT, NOTE, RETRY_OF, BadInput, Space, fail_stale, open_storage, open_study, surplus
from ddpkit.tune.worker import Worker, run_one, stop, work

SCRIPT = Path(__file__).resolve().parents[2] / "{{cookiecutter.project_slug}}" / "cluster" / "tune.sbatch"
TUNE = [sys.executable, "-m", "ddpkit.tune", "--main", "ddpkit.testing.toy"]
# A whole study's bound, for a hang to fail rather than block: the 4-trial DDP study ran 242 s in CI of 2026-12-04 and
# 509-623 s on a machine shared by several sessions (docs/measurements.md); 600 s leaves CI twice its figure.
TIMEOUT = 600
# 256 training samples in global batches of 64: 4 steps an epoch, a validation after each.
DDP_FIT = [
    *("--trainer.accelerator", "cpu", "--trainer.precision", "64-true", "--trainer.max_epochs", "2"),
    *("--data.train_size", "256", "--trainer.enable_progress_bar", "false", "--doctor.enabled", "false"),
    # A rank that missed the decision would wait in its next collective: fail in 30 s, not 300.
    *(
        "--dist_timeout",
        "30",
        "--trainer.logger+=CSVLogger",
        "--trainer.callbacks+=ddpkit.testing.rank_probe.RankProbe",
        "--trainer.callbacks+=value_probe.ValueProbe",
    ),
]
# val/loss at the first validation (step 4; float64, so the same on every run): lr 0.003 2.25 and 2.28 (chance is
# ln 10 = 2.30), lr 3 6545 (hidden_dim 32) and 55.3 (16). The pruner's bound of 5 is over 2 x the first, 11 x
# under the second (2026-12-04).
GRID = "{model.init_args.lr: [0.003, 3.0], model.init_args.hidden_dim: [16, 32]}"
DDP_SPACE = f"""
metric: val/loss
params:
  model.init_args.lr: {{choices: [0.003, 3.0]}}
  model.init_args.hidden_dim: {{choices: [16, 32]}}
sampler:
  class_path: optuna.samplers.GridSampler
  init_args: {{search_space: {GRID}, seed: 0}}
pruner: {{class_path: optuna.pruners.ThresholdPruner, init_args: {{upper: 5.0}}}}
"""
# The optimizer's class and, for SGD only, its momentum: two trials (the brute-force sampler tries each branch once).
# Every val/loss is over 0: this pruner prunes each trial at its first report.
CONDITIONAL_SPACE = """
metric: val/loss
params:
  model.init_args.optimizer: {choices: [torch.optim.AdamW, torch.optim.SGD]}
  model.init_args.optimizer.init_args.momentum: {choices: [0.9], when: {model.init_args.optimizer: torch.optim.SGD}}
sampler: {class_path: optuna.samplers.BruteForceSampler}
pruner: {class_path: optuna.pruners.ThresholdPruner, init_args: {upper: 0.0}}
"""
DDP_JOURNAL = "journal:tune/study.journal"
# 12 steps of 32 samples that sleep 0.4 s each (4.8 s of training per trial), a validation and a checkpoint every 4.
# A worker is killed once its trial has a checkpoint: the trial's rank 0 notices within a second (it watches the
# worker), or at its next validation, where it finds the worker's pipe closed before the checkpoint is written.
WORKERS_FIT = [
    *("--trainer.accelerator", "cpu", "--trainer.max_epochs", "1", "--data.train_size", "384"),
    *("--data.global_batch_size", "32", "--trainer.enable_progress_bar", "false", "--doctor.enabled", "false"),
    *("--trainer.callbacks+=ddpkit.testing.rank_probe.RankProbe", "--trainer.callbacks.sleep_per_step", "0.4"),
    *("--trainer.val_check_interval", "4", "--trainer.callbacks+=value_probe.TimeProbe"),
]
# No seed: workers seeded alike would propose the same values.
WORKERS_SPACE = """
metric: val/acc
direction: maximize
params:
  model.init_args.lr: {low: 1.0e-3, high: 1.0e-2, log: true}
  model.init_args.hidden_dim: {choices: [16, 32]}
"""
STARTED = re.compile(r"^trial (\d+): .* \(log: (\S+)\)$", flags=re.MULTILINE)


def processes_in(folder: Path, text: str = "") -> list[int]:
    """Processes running in `folder` (their working directory) whose command line holds `text`."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and Path(os.readlink(proc / "cwd")) == folder:
                if text in (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                    found.append(int(proc.name))
        except OSError:  # gone meanwhile, or not ours to read
            pass
    return found


def wait_for(predicate, what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)


def load(url: str, name: str):
    return optuna.load_study(study_name=name, storage=open_storage(url, Path(".")))


def trial_log(folder: Path, number: int) -> str:
    return (folder / "tune" / f"trial_{number:04d}.log").read_text()


def last_ckpt(run: Path) -> dict:
    (path,) = run.glob("lightning_logs/version_*/checkpoints/last.ckpt")
    return torch.load(path, weights_only=True)


# ---- one study of DDP trials on PostgreSQL ------------------------------------------------------------------
@early.early("tune_ddp")
def _tune_ddp(base: Path) -> dict:
    """The study's worker (output, exit status, its processes left after it ended), the trials as the study holds
    them, and best.yaml trained on 1 device; the same of the conditional study whose every trial is pruned (key
    "pruned")."""
    (base / "space.yaml").write_text(DDP_SPACE)
    (base / "pruned").mkdir()
    (base / "pruned" / "space.yaml").write_text(CONDITIONAL_SPACE)
    env = {"OMP_NUM_THREADS": "1"}
    cmd = [*TUNE, "--space", "space.yaml", "--devices", "2", "--storage", DDP_JOURNAL]
    studies = (  # started together: most of a trial is start-up
        (["--trials", "4", "--", *DDP_FIT], base),
        (
            ["--trials", "2", "--checkpoints", "all", "--", *DDP_FIT, "--model", "value_probe.OptimizerToy"],
            base / "pruned",
        ),
    )
    procs = [start([*cmd, *args], folder, env) for args, folder in studies]
    (done, pruned_done) = (finish(proc, TIMEOUT) for proc in procs)
    left = processes_in(base) + processes_in(base / "pruned")
    trials = load(DDP_JOURNAL.replace("journal:", f"journal:{base}/"), "space").get_trials()
    pruned = load(DDP_JOURNAL.replace("journal:", f"journal:{base}/pruned/"), "space").get_trials()
    one = base / "one"
    args = [
        "fit",
        "--config",
        "tune/best.yaml",
        *DDP_FIT,
        "--trainer.devices",
        "1",
        "--trainer.default_root_dir",
        "one",
    ]
    toy_ok(*args, cwd=base, timeout=TIMEOUT, env=env)
    return {
        "base": base,
        "code": done.returncode,
        "out": done.stdout,
        "left": left,
        "trials": trials,
        "one": one,
        "pruned": {"code": pruned_done.returncode, "out": pruned_done.stdout, "trials": pruned},
    }


@pytest.fixture(scope="module")
def tune_ddp() -> dict:
    return early.result("tune_ddp")


def by_lr(trials: list, lr: float) -> list:
    return [t for t in trials if t.params["model.init_args.lr"] == lr]


def values(trial) -> tuple[float, int]:
    return trial.params["model.init_args.lr"], trial.params["model.init_args.hidden_dim"]


def test_study_holds_4_finished_trials_none_failed_or_running(tune_ddp):
    """--trials 4 on 2 devices: the grid's 4 values, each once; 2 complete, 2 pruned, nothing failed or running."""
    assert tune_ddp["code"] == 0, tune_ddp["out"][-4000:]
    trials = tune_ddp["trials"]
    assert sorted(values(t) for t in trials) == [(0.003, 16), (0.003, 32), (3.0, 16), (3.0, 32)]
    assert sorted(t.state.name for t in trials) == ["COMPLETE", "COMPLETE", "PRUNED", "PRUNED"]
    assert (tune_ddp["base"] / "tune" / "study.journal").is_file()


def test_each_rank_trains_the_trials_values(tune_ddp):
    """Every rank of every trial trains with the values the study chose, as the model and its optimizer hold them
    (value_probe.py); the run's saved config agrees, and both ranks end at one step. A rank that drew its own lr
    would train on silently (the shapes match); its probe line would show it."""
    assert tune_ddp["code"] == 0, tune_ddp["out"][-4000:]
    for trial in tune_ddp["trials"]:
        lr, width = values(trial)
        log = trial_log(tune_ddp["base"], trial.number)
        probes = re.findall(r"VALUE_PROBE global=(\d) lr=(\S+) hidden_dim=(\d+)", log)
        assert sorted(probes) == [(str(r), repr(lr), str(width)) for r in (0, 1)], (trial.number, probes)
        run = tune_ddp["base"] / "tune" / f"trial_{trial.number:04d}" / "lightning_logs" / "version_0"
        saved = yaml.safe_load((run / "config.yaml").read_text())["model"]["init_args"]
        assert (saved["lr"], saved["hidden_dim"]) == (lr, width)
        ends = re.findall(r"RANK_PROBE_END global=(\d) step=(\d+)", log)
        assert sorted(ends) == [("0", ends[0][1]), ("1", ends[0][1])], ends


def test_a_study_keeps_the_best_trials_checkpoints_only(tune_ddp):
    """The default --checkpoints best: of the 4 trials' checkpoints (each wrote best and last), the study leaves the
    best trial's two, with its weights (hidden_dim wide); the conditional study with --checkpoints all leaves both
    files of each of its 2 trials."""
    assert tune_ddp["code"] == 0, tune_ddp["out"][-4000:]
    best = min(by_lr(tune_ddp["trials"], 0.003), key=lambda t: t.value)
    tune_dir = tune_ddp["base"] / "tune"
    left = sorted(str(p.relative_to(tune_dir)) for p in tune_dir.rglob("*.ckpt"))
    run = f"trial_{best.number:04d}/lightning_logs/version_0/checkpoints"
    assert len(left) == 2 and left[1] == f"{run}/last.ckpt" and left[0].startswith(f"{run}/best-"), left
    assert last_ckpt(tune_dir / f"trial_{best.number:04d}")["state_dict"]["net.0.weight"].shape == (values(best)[1], 64)
    kept = sorted(p.parent.parent.parent.parent.name for p in (tune_ddp["base"] / "pruned" / "tune").rglob("*.ckpt"))
    assert kept == sorted(2 * [f"trial_{t.number:04d}" for t in tune_ddp["pruned"]["trials"]]), kept


def test_pruned_trial_stops_every_rank_after_the_same_step_and_exits_cleanly(tune_ddp):
    """lr 3 diverges: its first validation (step 4: 256 samples, the clock the pruner compares at) is over the
    pruner's threshold, every rank stops after that step (the decision broadcast from rank 0), the fit ends as a
    finished one (exit 0), no rank reports a hang or an error, and the trial is PRUNED; lr 0.003 completes with its
    last validation's value. The worker says one line per validation."""
    assert tune_ddp["code"] == 0, tune_ddp["out"][-4000:]
    for pruned in by_lr(tune_ddp["trials"], 3.0):
        assert_pruned_at_first_validation(tune_ddp["base"], pruned, tune_ddp["out"])
        assert pruned.intermediate_values[256] > 5.0
    for complete in by_lr(tune_ddp["trials"], 0.003):
        assert complete.state == TrialState.COMPLETE and list(complete.intermediate_values) == [256, 512]
        assert complete.value == complete.intermediate_values[512]
        for step, samples in ((4, 256), (8, 512)):
            value = fmt(complete.intermediate_values[samples])
            line = f"trial {complete.number}: step {step}, {samples} samples: val/loss {value}: go on"
            assert line in tune_ddp["out"]
    assert tune_ddp["left"] == [], "processes left behind by the studies"


def assert_pruned_at_first_validation(base: Path, trial, out: str, kept: bool = False) -> None:
    assert trial.state == TrialState.PRUNED and list(trial.intermediate_values) == [256]
    log = trial_log(base, trial.number)
    stops = sorted(line for line in log.splitlines() if "stopping after step" in line)
    assert stops == [f"rank {r}: pruned: stopping after step 4" for r in (0, 1)], log[-3000:]
    assert sorted(re.findall(r"RANK_PROBE_END global=(\d) step=(\d+)", log)) == [("0", "4"), ("1", "4")]
    assert "error" not in log.lower() and "Traceback" not in log and "hang" not in log.lower(), log[-3000:]
    if kept:  # --checkpoints all
        assert last_ckpt(base / "tune" / f"trial_{trial.number:04d}")["global_step"] == 4
    assert f"trial {trial.number}: PRUNED at samples 256, val/loss " in out
    value = fmt(trial.intermediate_values[256])
    assert f"trial {trial.number}: step 4, 256 samples: val/loss {value}: pruned" in out


def test_a_pruner_that_prunes_every_first_report_ends_every_trial_pruned(tune_ddp):
    """Pruned at the first validation, both trials end PRUNED with both ranks stopped after step 4, the command
    returns 0 with the study's 2 trials finished, and no process of the study is left (checked above)."""
    pruned = tune_ddp["pruned"]
    assert pruned["code"] == 0, pruned["out"][-4000:]
    assert len(pruned["trials"]) == 2
    for trial in pruned["trials"]:
        assert_pruned_at_first_validation(tune_ddp["base"] / "pruned", trial, pruned["out"], kept=True)


def test_conditional_space_gives_sgd_its_momentum_and_adamw_none(tune_ddp):
    """The optimizer's class and an SGD-only momentum (`when:`): the two trials are AdamW without momentum and SGD
    with 0.9, each checked before any trial in a fit of its own (a momentum for AdamW would be refused), and every
    rank trains with that optimizer and momentum, as the optimizer holds them (value_probe.py)."""
    pruned = tune_ddp["pruned"]
    assert pruned["code"] == 0, pruned["out"][-4000:]
    adamw, sgd = "torch.optim.AdamW", "torch.optim.SGD"
    optimizer, momentum = "model.init_args.optimizer", "model.init_args.optimizer.init_args.momentum"
    params = sorted((t.params for t in pruned["trials"]), key=lambda p: p[optimizer])
    assert params == [{optimizer: adamw}, {optimizer: sgd, momentum: 0.9}], params
    for trial in pruned["trials"]:
        log = trial_log(tune_ddp["base"] / "pruned", trial.number)
        probes = sorted(re.findall(r"VALUE_PROBE global=(\d) .* optimizer=(\w+) momentum=(None|[\d.]+)", log))
        name = trial.params[optimizer].rpartition(".")[2]
        assert probes == [(str(r), name, str(trial.params.get(momentum))) for r in (0, 1)], probes


def test_best_values_train_on_1_device_what_the_trial_trained_on_2(tune_ddp):
    """best.yaml over the toy's config, with the trials' fit args, on 1 device in float64: the same weights and the
    same logged values (metrics.csv, at full precision) as the best trial on 2 devices, within the parity suite's
    float64 bound. The values found on 2 devices mean the same on 1 (the batch is global)."""
    best = min(by_lr(tune_ddp["trials"], 0.003), key=lambda t: t.value)
    two = tune_ddp["base"] / "tune" / f"trial_{best.number:04d}"
    bound = BOUNDS["cpu", "64-true"]
    weights = weight_diffs(last_ckpt(two)["state_dict"], last_ckpt(tune_ddp["one"])["state_dict"])
    assert not over_bound(weights, bound), report(weights)
    scalars = scalar_diffs(*(read_csv_scalars(run / "lightning_logs" / "version_0") for run in (two, tune_ddp["one"])))
    assert {"val/loss", "val/acc", "train/loss"} <= {d.name for d in scalars}
    assert not over_bound(scalars, bound), report(scalars)


def test_study_writes_its_table_the_best_values_and_plots(tune_ddp):
    """trials.md has a row per trial (the best marked); best.yaml nests the best values as the config does and says
    how to train them; history.png is drawn."""
    base, best = tune_ddp["base"], min(by_lr(tune_ddp["trials"], 0.003), key=lambda t: t.value)
    rows = [line for line in (base / "tune" / "trials.md").read_text().splitlines() if line.startswith("| ")][1:]
    assert sorted(row.split(" | ")[1] for row in rows) == ["COMPLETE", "COMPLETE", "PRUNED", "PRUNED"], rows
    assert [row for row in rows if row.startswith(f"| {best.number} (best) | COMPLETE | ")], rows
    text = (base / "tune" / "best.yaml").read_text()
    assert yaml.safe_load(text) == {"model": {"init_args": {"lr": 0.003, "hidden_dim": values(best)[1]}}}
    assert "\n# python main.py fit --config config.yaml --config tune/best.yaml --trainer.accelerator cpu " in text
    assert (base / "tune" / "history.png").stat().st_size > 0


def test_ckpt_path_last_skips_the_trials_runs(tune_ddp):
    """The study's folder carries the sweep's marker: `--ckpt_path last/best/auto` from the project find the user's
    training (here the 1-device run), even when a trial's last.ckpt is newer."""
    base = tune_ddp["base"]
    assert (base / "tune" / SWEEP_MARKER).is_file()
    future = time.time() + 3600
    for path in (base / "tune").rglob("last.ckpt"):
        os.utime(path, (future, future))
    assert newest_last_checkpoint(base) == next((base / "one").rglob("last.ckpt"))


# ---- workers of a SLURM array on one PostgreSQL study, one of them killed ---------------------------------------
ARRAY_JOB = 7000
JOURNAL = "journal:tune/study.journal"  # cluster/tune.sbatch's storage, relative to the project


def array_task(base: Path, task: int, name: str, storage: str, *options: str):
    """cluster/tune.sbatch as task `task` of a 2-task array on `storage` (its output in base/<name>.out)."""
    cmd = [
        "bash",
        str(SCRIPT),
        *TUNE[3:],
        "--storage",  # after the script's journal: the user's options win
        storage,
        *("--space", "space.yaml", "--trials", "4", "--heartbeat", "1", *options),
        "--",
        *WORKERS_FIT,
    ]
    with open(base / f"{name}.out", "w") as out:
        return start(cmd, base, slurm_array_env(ARRAY_JOB, task, 2), stdout=out)


def worker_pid(proc) -> int:
    """The worker's python process: the script's shell, or its child when the shell did not exec it."""
    cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
    if b"ddpkit.tune" in cmdline:
        return proc.pid
    children = [int(c) for t in Path(f"/proc/{proc.pid}/task").iterdir() for c in (t / "children").read_text().split()]
    (child,) = children
    return child


@early.early("tune_workers")
def _tune_workers(base: Path) -> dict:
    """Task 0 and task 1 (2 trials at once) together on a PostgreSQL server started for them; task 0's worker killed
    (-9) once its first trial has a checkpoint, the processes that trial left right after the kill (and 15 s later)
    and the step of that checkpoint, then task 0 started again; every worker's output."""
    (base / "space.yaml").write_text(WORKERS_SPACE)
    with server() as url:
        return _kill_a_worker(base, url)


def _kill_a_worker(base: Path, url: str) -> dict:
    first, other = array_task(base, 0, "task0", url), array_task(base, 1, "task1", url, "--parallel", "2")
    procs = [first, other]

    def checkpointed() -> list[int]:
        """Task 0's trials that wrote a checkpoint (the worker names a trial before its folder exists)."""
        started = [int(n) for n, _ in STARTED.findall((base / "task0.out").read_text())]
        return [n for n in started if list((base / "tune" / f"trial_{n:04d}").rglob("last.ckpt"))]

    try:
        wait_for(lambda: checkpointed() or first.poll() is not None, "task 0's first trial's first checkpoint")
        killed, *_ = checkpointed()
        alive = processes_in(base, f"trial_{killed:04d}")
        pid = worker_pid(first)
        os.kill(pid, signal.SIGKILL)
        first.wait(timeout=30)
        deadline = time.monotonic() + 15
        while processes_in(base, f"trial_{killed:04d}") and time.monotonic() < deadline:
            time.sleep(0.05)
        left = processes_in(base, f"trial_{killed:04d}")
        step = last_ckpt(base / "tune" / f"trial_{killed:04d}")["global_step"]  # nothing writes it any more
        again = array_task(base, 0, "task0-again", url)
        procs.append(again)
        codes = [finish(p, TIMEOUT).returncode for p in (other, again)]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    outs = {name: (base / f"{name}.out").read_text() for name in ("task0", "task1", "task0-again")}
    trials = load(url, "space").get_trials()
    return {
        "base": base,
        "pid": pid,
        "killed": killed,
        "step": step,
        "alive": alive,
        "left": left,
        "codes": codes,
        "outs": outs,
        "trials": trials,
        "after": processes_in(base),
    }


@pytest.fixture(scope="module")
def tune_workers() -> dict:
    return early.result("tune_workers")


def test_killed_worker_leaves_no_process_and_its_trial_runs_again(tune_workers):
    """kill -9 of a worker mid-trial: the trial's process (rank 0, which watches its worker, or finds its pipe closed
    at its next validation) is gone within seconds, the trial stops beating and is failed by a worker, and its
    values run again as a new trial; task 1 and task 0 started again finish the study: 4 finished trials, and both
    exit 0."""
    w = tune_workers
    assert w["alive"], "the killed worker's trial was not running: the kill did not land mid-trial"
    assert w["left"] == [], f"the killed worker's trial left processes {w['left']}"
    log = trial_log(w["base"], w["killed"]).rstrip()
    watched = log.endswith(f"rank 0: the tuning worker (pid {w['pid']}) is gone; exiting")
    assert watched or log.endswith("rank 0: the tuning worker is gone; stopping the trial's ranks"), log[-2000:]
    assert w["codes"] == [0, 0], w["outs"]
    trials = {t.number: t for t in w["trials"]}
    killed = trials[w["killed"]]
    assert killed.state == TrialState.FAIL
    (retry,) = [t for t in w["trials"] if t.user_attrs.get(RETRY_OF) == killed.number]
    assert retry.state == TrialState.COMPLETE and retry.params == killed.params
    assert sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in w["trials"]) == 4
    assert w["after"] == [], "processes left behind by the workers"


def test_killed_trial_resumes_from_its_last_checkpoint(tune_workers):
    """The killed trial's values run again from its last.ckpt (written at a validation, every 4 steps): the retry's
    fit restores it and starts training at its step, and the retry's curve is the killed trial's (copied: 128
    samples a validation of 4 steps of 32) continued to the end (step 12, 384 samples)."""
    w = tune_workers
    trials = {t.number: t for t in w["trials"]}
    killed = trials[w["killed"]]
    (retry,) = [t for t in w["trials"] if t.user_attrs.get(RETRY_OF) == killed.number]
    assert w["step"] in (4, 8) and 32 * w["step"] in killed.intermediate_values, (w["step"], killed)
    log = trial_log(w["base"], retry.number)
    ckpt = w["base"] / "tune" / f"trial_{killed.number:04d}" / "lightning_logs" / "version_0" / "checkpoints"
    assert f"Restoring states from the checkpoint path at {(ckpt / 'last.ckpt').resolve()}" in log, log[-3000:]
    assert re.findall(r"RANK_PROBE global=0 .* step=(\d+)", log) == [str(w["step"])], log[-3000:]
    assert list(retry.intermediate_values) == [128, 256, 384], retry.intermediate_values
    assert {k: retry.intermediate_values[k] for k in killed.intermediate_values} == killed.intermediate_values


def test_a_worker_runs_its_trials_at_once(tune_workers):
    """Task 1 (--parallel 2, on CPU) ran 2 trials at the same time: their own records (rank 0's time at its training's
    start and end) overlap, while the study stays exact (4 finished trials, none run twice: above)."""
    w = tune_workers
    spans = []
    for n, _ in STARTED.findall(w["outs"]["task1"]):
        times = dict(re.findall(r"TIME_PROBE (start|end)=(\S+)", trial_log(w["base"], int(n))))
        if len(times) == 2:
            spans.append((float(times["start"]), float(times["end"])))
    overlapping = [(a, b) for a in spans for b in spans if a < b and a[0] < b[1] and b[0] < a[1]]
    assert len(spans) >= 2 and overlapping, spans
    assert "1 trial(s) at once" not in w["outs"]["task1"] and "2 trial(s) at once" in w["outs"]["task1"]


def test_workers_share_the_study_and_never_run_a_trial_twice(tune_workers):
    """Each trial number was run by one worker only (one run in its folder); both tasks ran trials, on the
    PostgreSQL study (--storage after the script wins: no journal file); each worker ended saying the study has 4
    finished trials."""
    w = tune_workers
    ran = {name: [int(n) for n, _ in STARTED.findall(out)] for name, out in w["outs"].items()}
    numbers = [n for runs in ran.values() for n in runs]
    assert len(numbers) == len(set(numbers)) and ran["task0"] and ran["task1"], ran
    for n in numbers:
        assert [p.name for p in (w["base"] / "tune" / f"trial_{n:04d}" / "lightning_logs").iterdir()] == ["version_0"]
    assert not (w["base"] / "tune" / "study.journal").exists()
    for name in ("task1", "task0-again"):
        assert "study 'space': 4/4 finished" in w["outs"][name], w["outs"][name][-3000:]


def test_array_script_is_one_worker_per_task():
    """cluster/tune.sbatch asks for a job array of 1 node and 1 task each (the worker; Lightning starts the ranks)
    and gives every task the same journal storage and folder, so they share one study."""
    options = sbatch_options(SCRIPT)
    assert options["array"] and options["nodes"] == "1" and options["ntasks"] == "1", options
    assert f"--storage {JOURNAL}" in SCRIPT.read_text() and "--out tune" in SCRIPT.read_text()


# ---- bad input: one error line, status 2, before any rank starts -------------------------------------------------
def refused(tmp_path: Path, capsys, argv: list[str], space: str = WORKERS_SPACE) -> str:
    """Run the worker in this process with `argv` in `tmp_path`; its exit status must be 2, its output one
    `error:` line, which is returned."""
    (tmp_path / "space.yaml").write_text(space)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(SystemExit) as exit_:
            tune.main(["--main", "ddpkit.testing.toy", "--space", "space.yaml", "--trials", "2", *argv])
    finally:
        os.chdir(cwd)
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == "" and err.count("\n") == 1 and err.startswith("error: "), (out, err)
    return err.strip()


@pytest.mark.parametrize(
    ("param", "expected"),
    [
        ("{low: 0.1, high: 0.01}", "params.model.init_args.lr: empty range, low 0.1 > high 0.01"),
        ("{choices: []}", "params.model.init_args.lr: choices must be a non-empty list"),
        ("{low: 1e-4, high: 0.1}", "(YAML reads 1e-4 as text: write 1.0e-4)"),
        ("{low: 0.0, high: 0.1, log: true}", "a log range needs low > 0"),
        ("{low: 0.1, high: 1.0, scale: 2}", "unknown keys ['scale']"),
    ],
    ids=["empty-range", "no-choices", "text-number", "log-zero", "unknown-key"],
)
def test_bad_range_is_refused(tmp_path, capsys, param, expected):
    """A range or a choice list that cannot be sampled: one line, nothing written."""
    error = refused(tmp_path, capsys, [], f"params:\n  model.init_args.lr: {param}\n")
    assert expected in error and not (tmp_path / "tune").exists(), error


def test_fit_args_may_not_set_what_the_worker_sets(tmp_path, capsys):
    """--trainer.devices in the fit args (the worker's --devices) and a space key (here in its short form)."""
    assert "the fit args set --trainer.devices, which the worker sets (--devices)" in refused(
        tmp_path, capsys, ["--", "--trainer.devices", "2"]
    )
    assert "the fit args set --model.lr, which the worker sets (params.model.init_args.lr in --space)" in refused(
        tmp_path, capsys, ["--", "--model.lr", "0.1"]
    )


def test_unknown_config_key_is_refused_before_any_trial(tmp_path, capsys):
    """A key main.py fit does not take: the fit's parser says so (`--print_config`, no rank started), no study."""
    space = WORKERS_SPACE + "  model.init_args.nope: {choices: [1]}\n"
    error = refused(tmp_path, capsys, [], space)
    assert "main.py fit refuses the fit args with the space's values" in error and "'nope' is not accepted" in error
    assert optuna.get_all_study_names(open_storage(None, tmp_path / "tune")) == []


def test_fit_options_the_trainer_refuses_are_refused_before_any_trial(tmp_path, capsys):
    """`--trainer.enable_checkpointing false` beside the config's checkpoint callback parses, but Lightning refuses it
    when it builds the Trainer: the check before any trial builds the fit (model, data, Trainer; nothing trains) and
    says so in one line, naming the values it checked; no trial, no study."""
    error = refused(tmp_path, capsys, ["--", "--trainer.enable_checkpointing", "false"])
    assert error == (
        "error: main.py fit refuses the fit args with the space's values (--model.init_args.lr 0.001 "
        "--model.init_args.hidden_dim 16): MisconfigurationException: Trainer was configured with "
        "`enable_checkpointing=False` but found `ModelCheckpoint` in callbacks list."
    )
    assert optuna.get_all_study_names(open_storage(None, tmp_path / "tune")) == []


def test_unreachable_storage_is_refused(tmp_path, capsys):
    """A PostgreSQL URL with no server behind it: one line that names it (without its password)."""
    url = f"postgresql://tuner:secret@127.0.0.1:{free_port()}/study"
    error = refused(tmp_path, capsys, ["--storage", url])
    assert error.startswith(f"error: --storage postgresql+psycopg://tuner:***@127.0.0.1:{url.split(':')[-1]}")
    assert "cannot open it: " in error and "secret" not in error


def test_without_optuna_the_worker_names_the_extra(tmp_path):
    """In an environment without Optuna (here hidden by a module that fails to import): one line, status 2."""
    (tmp_path / "optuna").mkdir()
    (tmp_path / "optuna" / "__init__.py").write_text("raise ImportError('No module named optuna')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    cmd = [*TUNE, "--space", "space.yaml", "--trials", "1"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == 'error: python -m ddpkit.tune needs Optuna: pip install -e ".[tune]" (ddpkit[tune])\n'


@early.early("tune_metric")
def _tune_metric(base: Path) -> dict:
    """A study whose metric the toy does not log, on the default storage (SQLite), with a heartbeat every 0.5 s."""
    (base / "space.yaml").write_text(WORKERS_SPACE.replace("metric: val/acc", "metric: val/nope"))
    cmd = [*TUNE, "--space", "space.yaml", "--trials", "3", "--heartbeat", "0.5", "--", *WORKERS_FIT[:12]]
    done = finish(start(cmd, base, {"OMP_NUM_THREADS": "1"}), TIMEOUT)
    storage = open_storage(None, base / "tune")
    return {"base": base, "done": done, "trials": optuna.load_study(study_name="space", storage=storage).get_trials()}


@pytest.fixture(scope="module")
def tune_metric() -> dict:
    return early.result("tune_metric")


def test_metric_never_logged_stops_the_first_trial_at_its_sanity_check(tune_metric):
    """What a model logs is known only by running it: the first trial's sanity check finds the metric missing, its
    ranks stop before training (step 0), the trial fails and the worker exits 2 with one error line naming what
    validation logs; no second trial starts."""
    done = tune_metric["done"]
    assert done.returncode == 2, done.stdout[-3000:]
    errors = [line for line in done.stdout.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: trial 0: the metric val/nope is not logged in validation (it logs val/acc, val/loss): set metric: in "
        "the space file to a metric that the model logs in validation"
    ], done.stdout[-3000:]
    assert [(t.number, t.state) for t in tune_metric["trials"]] == [(0, TrialState.FAIL)]
    assert "rank 0: the metric val/nope is not logged: stopping after step 0" in trial_log(tune_metric["base"], 0)
    assert "Traceback" not in done.stdout


# ---- units -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [1e-05, 0.003, 3.0, 64, True, None, "64", "torch.optim.SGD", "null"])
def test_values_reach_the_fit_unchanged(value):
    """A value on main.py's command line reads back (as YAML) as the same value of the same type: 1e-05 would be the
    text '1e-05', the text '64' the number 64."""
    read = yaml.safe_load(argument(value))
    assert read == value and type(read) is type(value)


def test_stale_trial_is_failed_once_and_its_values_enqueued(tmp_path):
    """Two workers that saw the same trial silent for longer than the grace period: one fails it and enqueues its
    values; the other, whose view is older, finds it failed and enqueues nothing. A trial that beats is left alone."""
    study = optuna.create_study(storage=open_storage(None, tmp_path), study_name="s")
    dists = {"x": optuna.distributions.FloatDistribution(0.0, 1.0)}
    stale, alive = study.ask(dists), study.ask(dists)
    stale.set_user_attr(HEARTBEAT, time.time() - 100)
    alive.set_user_attr(HEARTBEAT, time.time())
    other = optuna.load_study(study_name="s", storage=open_storage(None, tmp_path))
    seen = other.get_trials(states=(TrialState.RUNNING,))  # the other worker's view, before the first one acts
    fail_stale(study, grace=10)
    other.get_trials = lambda **kwargs: seen
    fail_stale(other, grace=10)
    states = {t.number: t.state for t in study.get_trials()}
    assert states == {stale.number: TrialState.FAIL, alive.number: TrialState.RUNNING, 2: TrialState.WAITING}
    (queued,) = study.get_trials(states=(TrialState.WAITING,))
    assert queued.user_attrs[RETRY_OF] == stale.number and queued.system_attrs["fixed_params"] == stale.params


def test_two_workers_asking_for_the_last_trial_run_one(tmp_path):
    """A study of 1 trial: of two trials asked at once, the later one yields."""
    study = optuna.create_study(storage=open_storage(None, tmp_path), study_name="s")
    first, second = study.ask(), study.ask()
    assert not surplus(study, first, 1) and surplus(study, second, 1)


# Each waits for the same moment, then opens the storage: workers of an array start within milliseconds.
RACE = """
import sys, time
from pathlib import Path
from ddpkit.tune.study import open_storage
while time.time() < float(sys.argv[2]):
    pass
open_storage(sys.argv[1], Path("."))
print("opened")
"""


def test_workers_starting_together_on_a_new_postgresql_database_all_open_it(tmp_path):
    """4 workers open one new PostgreSQL database at the same moment: each opens it (without the retry in
    study._rdb_storage 12 of 20 such workers failed on Optuna's table creation, a duplicate key or table)."""
    import psycopg

    with server() as url:
        with psycopg.connect(url, autocommit=True) as connection:
            connection.execute("CREATE DATABASE race")
        fresh, moment = url.rsplit("/", 1)[0] + "/race", str(time.time() + 3)
        procs = [start([sys.executable, "-c", RACE, fresh, moment], tmp_path) for _ in range(4)]
        done = [finish(proc, 60) for proc in procs]
    assert [(d.returncode, d.stdout.strip().splitlines()[-1:]) for d in done] == [(0, ["opened"])] * 4, [
        d.stdout[-1000:] for d in done
    ]


def test_a_study_started_with_another_space_is_refused(tmp_path):
    """A worker whose space differs from the study's (another range, another metric) would mix two searches in one
    study: refused, naming --study; the same space loads the study."""
    space = Space({"x": optuna.distributions.FloatDistribution(0.0, 1.0)})
    storage = open_storage(None, tmp_path)
    first = open_study(storage, "s", space, "val/loss", "minimize")
    assert open_study(storage, "s", space, "val/loss", "minimize").study_name == first.study_name
    with pytest.raises(BadInput, match="was started with another metric or space.*--study NAME"):
        open_study(storage, "s", Space({"x": optuna.distributions.FloatDistribution(0.0, 2.0)}), "val/loss", "minimize")
    with pytest.raises(BadInput, match="was started with another metric or space"):
        open_study(storage, "s", space, "val/acc", "minimize")
    with pytest.raises(BadInput, match="minimizes its metric, this space maximizes it"):
        open_study(storage, "s", space, "val/loss", "maximize")


# ---- the manual's page on tuning (vendor/ddpkit/docs/tune.md) ------------------------------------------------------
PAGE = SCRIPT.parents[1] / "vendor" / "ddpkit" / "docs" / "tune.md"


def yaml_blocks() -> list:
    return [yaml.safe_load(b) for b in re.findall(r"^```yaml\n(.*?)^```", PAGE.read_text(), re.DOTALL | re.MULTILINE)]


def test_manual_shows_the_space_file_as_it_is():
    """The first space the manual shows is configs/tune.yaml's (comments aside); the other is the conditional one."""
    shown = [b for b in yaml_blocks() if isinstance(b, dict) and "params" in b]
    assert shown[0] == yaml.safe_load((SCRIPT.parents[1] / "configs" / "tune.yaml").read_text())
    assert len(shown) == 2 and "when" in str(shown[1])


def test_manual_kubernetes_job_runs_the_workers_command():
    """The Job runs K pods at once of `python -m ddpkit.tune` with arguments the worker accepts, sharing a
    PostgreSQL study (from a Secret) and an output folder on the volume it mounts."""
    (job,) = [b for b in yaml_blocks() if isinstance(b, dict) and b.get("kind") == "Job"]
    spec = job["spec"]
    assert spec["parallelism"] == spec["completions"] > 1
    (container,) = spec["template"]["spec"]["containers"]
    assert container["command"] == ["python", "-m", "ddpkit.tune"]
    args, fit_args = tune.parse(container["args"])
    assert args.storage == "$(TUNE_STORAGE)" and fit_args == []
    assert [e["name"] for e in container["env"]] == ["TUNE_STORAGE"] and "secretKeyRef" in container["env"][0][
        "valueFrom"
    ]
    (mount,) = container["volumeMounts"]
    assert str(args.out).startswith(mount["mountPath"] + "/")


def sleeping_worker(tmp_path: Path, timeout: float | None = None) -> tuple:
    """A study of 1 trial and a worker whose 'fit' sleeps for two minutes (a python that ignores its arguments), and
    the marker in that process's command line."""
    marker = f"# {tmp_path}"
    space = Space({"x": optuna.distributions.FloatDistribution(0.0, 1.0)})
    main = [sys.executable, "-c", f"import time; time.sleep(120)  {marker}"]
    worker = Worker(main, 1, tmp_path, [], space, "val/loss", 1, 60.0, timeout, {})
    study = open_study(open_storage(None, tmp_path), "s", space, "val/loss", "minimize")
    return study, worker, marker


def running(marker: str) -> list[int]:
    """Processes whose command line holds `marker`."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            found += [int(proc.name)] if marker.encode() in (proc / "cmdline").read_bytes() else []
        except OSError:  # gone meanwhile
            pass
    return found


def test_sigterm_fails_the_running_trial_kills_its_processes_and_enqueues_its_values(tmp_path):
    """SIGTERM to the worker (a scheduler's stop) while a trial runs: its processes are killed, it is failed
    ("interrupted") and its values wait for the next worker; the worker stops (KeyboardInterrupt, then 143)."""
    study, worker, marker = sleeping_worker(tmp_path)
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGTERM, tune.interrupt)
    try:
        threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
        with pytest.raises(KeyboardInterrupt):
            work(study, worker)
        stop(worker)  # as tune.main does: kill the trials, and each thread tells its trial
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    assert running(marker) == []
    failed, queued = study.get_trials()
    assert failed.state == TrialState.FAIL and failed.user_attrs[NOTE] == "interrupted"
    assert queued.state == TrialState.WAITING and queued.user_attrs[RETRY_OF] == failed.number
    assert queued.system_attrs["fixed_params"] == failed.params


def test_trial_past_its_timeout_is_killed_and_failed(tmp_path):
    """--timeout: the trial's processes are killed and it fails with that reason; the worker goes on."""
    study, worker, marker = sleeping_worker(tmp_path, timeout=1.0)
    trial = study.ask(worker.space.params)
    assert run_one(study, worker, trial, Claim([], 29600)) is False
    assert running(marker) == []
    (failed,) = study.get_trials()
    assert failed.state == TrialState.FAIL and failed.user_attrs[NOTE] == "timed out after 1 s"
