"""The command lines of the guarantee suite's runs of the project's `main.py`, and the jobs that run them (`command`;
waves.py: which runs, in which waves).

Every run gets the suite's own arguments, then PARITY_ARGS (another model, a smaller set):
    PARITY_ARGS="--model my_model.MyModel" pytest tests/test_guarantees.py
"""

import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from .. import presets
from .footprint import KEEP_CHECKPOINTS
from .helpers import PORT_RETRIES, PORT_TAKEN, finish, headline, main_py, run_main, start
from .runs import Run, global_step

# Every run's: the float64 runs compute in float64 where the model casts down (float64.py); other precisions untouched.
FLOAT64_THROUGHOUT = "--trainer.callbacks+=ddpkit.testing.float64.Float64Throughout"


def parity_args() -> list[str]:
    """PARITY_ARGS, split as a shell would: appended to every run, after the suite's own arguments."""
    return shlex.split(os.environ.get("PARITY_ARGS", ""))


def schedule_args(steps: dict) -> list[str]:
    """A warmup + cosine schedule (for a model that takes a `scheduler` argument)."""
    warmup = str(max(1, steps["steps_per_epoch"] // 2))
    return ["--model.scheduler", "ddpkit.model.schedules.WarmupCosine", "--model.scheduler.warmup_steps", warmup]


def run_args(
    steps: dict,
    resumed_at: int | None = None,
    saves: tuple[int, ...] = (),
    fingerprints: bool = False,
    consumes: bool = False,
    on_gpu: bool = False,
    best_by_name: bool = False,
) -> list[str]:
    """The suite's arguments to every run: 2 epochs, every step logged, the probe. A run writes what the checks read, no
    more (slim.py): its checkpoints hold the weights and the loops' state, not the optimizer's (which doubles or triples
    their size), and it keeps no best checkpoint, unless other runs resume from it at global batch `resumed_at` (or
    start one-step runs from it after the global batches `saves`): then the probe saves a checkpoint at each of those
    steps (complete at `resumed_at`; at the other `saves`, where a global batch is one optimizer step, the weights alone
    in float32: one-step states), the best is kept (with `best_by_name`, for its name alone: no tensors), an extra
    checkpoint per epoch is written for its name alone (the checks compare the files 1 and 2 devices write), and which
    parameter elements got no gradient is recorded (gradient_peaks.GradientPeaks); with `on_gpu`, the state at
    `resumed_at` is written with its tensors tagged as on cuda:0, as on GPUs. With `consumes`, the checkpoint the run
    resumes from is deleted once restored, unless DDPKIT_KEEP_CHECKPOINTS is set. Each rank's fingerprints of its
    datasets, compared before training, only with `fingerprints`."""
    args = [
        *("--trainer.max_epochs", "2", "--trainer.log_every_n_steps", "1"),  # every step's loss reaches the logger
        *("--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"),
        FLOAT64_THROUGHOUT,
        "--trainer.callbacks+=ddpkit.testing.parity_probe.Probe",
    ]
    if fingerprints:
        args.append("--trainer.callbacks.fingerprint_data=true")
    if consumes and not os.environ.get(KEEP_CHECKPOINTS):
        args.append("--trainer.callbacks.consume=true")
    if on_gpu:
        args.append(f"--trainer.callbacks.on_gpu_at=[{global_step(steps, resumed_at)}]")
    if resumed_at is None:  # nor the project's best checkpoint: only the 2 runs resumed from are read for theirs
        args.append("--trainer.callbacks.best=false")
    else:
        at = ",".join(str(global_step(steps, k)) for k in sorted({resumed_at, *saves}))
        args += ["--trainer.callbacks.resumable=true", f"--trainer.callbacks.save_at_steps=[{at}]"]
        names = ["epoch=*-step=*.ckpt", *(["best-*.ckpt"] if best_by_name else [])]  # Lightning's, the project's
        args.append(f"--trainer.callbacks.names_only={json.dumps(names)}")
        # The one-step check's states need no optimizer state where one step is one optimizer step: the check judges
        # the gradient it sees. With several (steps_per_batch, a module optimizing itself), a later one's gradient
        # follows the earlier one's update, from the optimizer's state.
        if steps["steps_per_batch"] == 1 and not steps["manual_optimization"]:
            light = ",".join(str(global_step(steps, k)) for k in sorted(set(saves) - {resumed_at}))
            args.append(f"--trainer.callbacks.weights_at=[{light}]")
        args += ["--trainer.callbacks+=ddpkit.testing.gradient_peaks.GradientPeaks"]
        args += ["--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint"]
        args += ["--trainer.callbacks.save_top_k=-1", "--trainer.callbacks.save_weights_only=true"]
    return args


def main_cmd(*args: str) -> list[str]:
    return [sys.executable, str(main_py()), *args]


def torchrun_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(main_py()), *args]


def fit(steps: dict, accelerator: str, devices: int, precision: str, *extra: str, **kept) -> list[str]:
    """`fit` on `devices` in `precision`, with the suite's arguments (run_args: `kept` are its options)."""
    return [
        "fit",
        *("--trainer.accelerator", accelerator, "--trainer.devices", str(devices)),
        *("--trainer.precision", precision, *run_args(steps, **kept), *extra, *parity_args()),
    ]


def one_step(steps: dict, devices: int, precision: str, states: Path, *extra: str) -> list[str]:
    """A one-step run (parity_probe.OneStep): `fit` on `devices` in `precision` training global batches 0 and 1 of
    each of 2 epochs, each from the state in `states` (the first wave's 1-device float64 run saved them), without
    validation, checkpoints or the doctor."""
    return [
        "fit",
        *("--trainer.accelerator", "cpu", "--trainer.devices", str(devices), "--trainer.precision", precision),
        *("--trainer.max_epochs", "2", "--trainer.log_every_n_steps", "1", "--trainer.limit_val_batches", "0"),
        *("--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"),
        *("--doctor.enabled", "false", FLOAT64_THROUGHOUT, "--trainer.callbacks+=ddpkit.testing.parity_probe.OneStep"),
        *(f"--trainer.callbacks.states={states}", f"--trainer.callbacks.steps_per_epoch={steps['epoch_steps']}"),
        f"--trainer.callbacks.steps_per_batch={steps['steps_per_batch']}",
        f"--trainer.callbacks.batches={steps['step_batches']}",
        *extra,
        *parity_args(),
    ]


def evaluate(steps: dict, command: str, devices: int, ckpt_path: str) -> list[str]:
    """`validate`, `test` or `predict` in float64 from `ckpt_path`, without a logger (predictions.pt and the
    probe's records go to the run's root)."""
    return [
        command,
        *("--trainer.accelerator", "cpu", "--trainer.devices", str(devices), "--trainer.precision", "64-true"),
        *("--ckpt_path", ckpt_path, "--trainer.logger", "false", *run_args(steps), *parity_args()),
    ]


def cluster_args(steps: dict) -> list[str]:
    """The float64 fit of the first wave, without its probes and logger changes: the cluster launchers' runs
    must end with its weights (2 epochs; dropout off, as the probe turns it off there)."""
    return [
        *("--trainer.accelerator", "cpu", "--trainer.precision", "64-true", "--trainer.max_epochs", "2"),
        *("--trainer.log_every_n_steps", "1"),  # as the first wave's: the parity command compares their logged steps
        *("--trainer.enable_progress_bar", "false", "--trainer.callbacks+=ddpkit.testing.parity_probe.NoDropout"),
        FLOAT64_THROUGHOUT,
        "--trainer.callbacks+=ddpkit.testing.slim.SlimCheckpoints",  # the weights alone, but where SLURM resumes
        *parity_args(),
        "--trainer.callbacks+=ddpkit.testing.rank_probe.RankProbe",  # last: `--trainer.callbacks.*` may follow
    ]


def sharded_args() -> list[str]:
    """The sharded run's (waves.sharded_job): the library's model_parallel preset on CPU, float32 (ModelParallelStrategy
    has no float64). The library's copy, not the project's configs/model_parallel.yaml: a project may lack it (baked
    before it existed, or deleted) or have set it for its cluster (8 devices), and the check needs 2 processes."""
    return [
        *("--config", str(presets.path("model_parallel")), "--trainer.accelerator", "cpu"),
        *("--trainer.precision", "32-true", "--trainer.enable_progress_bar", "false"),
        *("--trainer.callbacks+=ddpkit.testing.parity_probe.NoDropout", *parity_args()),
    ]


def command(cmd: list[str], root: Path, log: Path, timeout: float = 420, ranks: int = 1) -> Callable[[], Run]:
    """A job that runs `cmd` with `--trainer.default_root_dir root`, its output in `log`, and fails on a
    non-zero exit (its error line first) or after `timeout` seconds (killing all it started). A run of main.py is
    forked from the fork server (helpers.run_main; with `ranks` 2, both of its ranks, as torchrun would start
    them); other commands (torchrun) start as they are."""
    before: set[Path] = set()  # what the folder held before the run (a copied run to continue, a config.yaml)

    def once() -> subprocess.CompletedProcess:
        for path in set(root.iterdir()) - before:  # what an earlier try wrote; the folder's own files stay
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        full = [*cmd, "--trainer.default_root_dir", str(root)]
        if full[1] == str(main_py()):
            return run_main(*full[2:], cwd=root, timeout=timeout, log=log, ranks=ranks)
        result = finish(start(full, root, {"OMP_NUM_THREADS": "1"}), timeout)  # one thread a process: shared cores
        log.write_text(result.stdout)
        return result

    def job() -> Run:
        nonlocal before
        root.mkdir(exist_ok=True)
        before = set(root.iterdir())
        for _ in range(PORT_RETRIES):
            result = once()
            if result.returncode == 0 or not PORT_TAKEN.search(result.stdout):
                break
        else:
            result = once()
        assert result.returncode == 0, (
            f"run {log.stem} exited {result.returncode}: {headline(result.stdout)}\n(log: {log})\n"
            f"{result.stdout[-4000:]}"
        )
        return Run(root, log)

    return job


def failed(error: AssertionError) -> Callable[[], Run]:
    """A job of a later wave that cannot start: the run it starts from failed with `error`."""

    def job() -> Run:
        raise AssertionError(f"starts from a run that failed: {error}")

    return job
