"""The real runs of the project's `main.py` the guarantee tests share, made once per session (`cpu_runs`).

Whatever config.yaml selects (your model and data once you point it at them) trains 2 epochs on CPU, in
three waves; the runs of a wave start at once (each run is mostly start-up, which overlaps):
1. 1 and 2 devices in float64, which the others are compared with; they add a CSV logger to the configured
   ones, and record each parameter element's largest gradient. And 1 device x 4 micro-batches (or, for BatchNorm
   or without micro-batches, 1 device with every batch reversed): summation order alone, the rounding the float64
   bounds start from. The 1-device run saves its state after global batches 1, n and n + 1 (n an epoch's).
2. The one-step runs: from those states, single steps on 1 and 2 devices in float32 and in bf16-mixed, and on 1
   device in float64 (check_onestep.py); `torchrun`, gradient accumulation on 2 devices x 2
   micro-batches (not for a module that optimizes manually), two torchrun "nodes", sharded training when the
   module shards (the library's model_parallel preset, compared with 1 device in float32), and, when the model
   takes one, 1 and 2 devices with a warmup + cosine learning-rate schedule.
3. From the first wave's checkpoints: mid-epoch resumes on the other device count (2 -> 1 from a copy of
   the checkpoint tagged as written on GPUs), `validate`, `test` and `predict` on 1 and 2 devices (those the
   module defines a step for), `fit --ckpt_path last` continuing a finished run, and a 2-node SLURM job that
   is signalled, requeued and resumed.
And, only when a float64 comparison is over its bound by no more than rounding, the 2-device float64 run again
(`2dev-fp64-again`): how far two identical runs end apart (check_parity.run_to_run).
A run starts when a test first asks for it, together with the runs of its wave that the session's selected tests
read (their `reads` declarations), so `pytest -k ...` starts only the runs it reads.
The sizes and steps come from the configured data module and model (configured.py); steps are counted in global
batches, and Lightning's global_step is `steps_per_batch` times that (a GAN stepping two optimizers: 2).

Add arguments to every run (another model, a smaller set):
    PARITY_ARGS="--model my_model.MyModel" pytest tests/test_guarantees.py
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from .. import presets
from ..model.sharding import shards_on_cpu
from ..parity import load_weights
from .fake_cluster import SlurmJob, slurm_requeue_job, torchrun_nodes_job
from .fake_cuda import save_as_cuda
from .helpers import finish, headline, main_py, run_main, start


@dataclass
class Run:
    """One finished run of main.py under its own root directory; its console output in `log`."""

    root: Path
    log: Path

    @property
    def version(self) -> Path:
        return self.root / "lightning_logs" / "version_0"

    def output(self) -> str:
        return self.log.read_text()

    def checkpoint(self, name: str = "last.ckpt") -> Path:
        return self.version / "checkpoints" / name

    def weights(self) -> dict[str, torch.Tensor]:
        return load_weights(self.checkpoint())

    def global_step(self) -> int:
        return torch.load(self.checkpoint(), map_location="cpu", weights_only=False)["global_step"]

    def probe(self, stage: str = "fit", rank: int = 0) -> dict:
        return json.loads((self.root / "probe" / f"{stage}-rank{rank}.json").read_text())

    def mid_checkpoint(self, step: int) -> Path:
        """The checkpoint the probe saved after `step` (parity_probe.Probe's save_at_steps)."""
        return self.root / "probe" / f"step{step}.ckpt"


def plan(configured: dict) -> dict:
    """Steps of the shared runs: resume 2 -> 1 from 3/4 into epoch 0, 1 -> 2 from 1/4 into epoch 1 (with
    fewer than 4 steps per epoch the resume points fall on epoch ends), counted in global batches; accumulate
    with micro-batches of a quarter of the global batch when the data module takes a micro_batch_size that
    divides it, the module optimizes automatically (the CLI refuses micro-batches with manual optimization) and
    has no BatchNorm (micro-batches would change its statistics). `steps_per_batch`: optimizer steps per global
    batch, which Lightning's global_step counts (several for a module that steps several optimizers itself);
    `random_step`: why numbers cannot match (configured.probe_training_step)."""
    n, batch = configured["steps_per_epoch"], configured["global_batch_size"]
    batchnorm = configured.get("batchnorm", False)
    accumulates = configured["takes_micro_batch_size"] and not configured.get("manual_optimization")
    micro = batch // 4 if accumulates and batch % 4 == 0 and not batchnorm else None
    return {
        "steps_per_epoch": n,
        "two_to_one": max(1, 3 * n // 4),
        "one_to_two": n + max(1, n // 4),
        "micro_batch_size": micro,
        "takes_scheduler": configured.get("takes_scheduler", False),
        "shards": configured.get("shards_layers", False) and shards_on_cpu(),
        "manual_optimization": configured.get("manual_optimization", False),
        "steps_per_batch": configured.get("steps_per_batch", 1),
        "random_step": configured.get("random_step", ""),
        "stages": configured.get("stages", ["validate", "test", "predict"]),
        # Samples of each evaluation set (0: none); a stage's runs need its set as well as its step.
        "sizes": {stage: configured.get(f"{key}_size", 1) for stage, key in STAGE_SETS.items()},
        "batchnorm": batchnorm,
        # The one-step check's points: global batches 1, n and n + 1 (0 is each run's own initialization), and the
        # global batches its runs train in each of their 2 epochs: 0 and 1 (0 alone with a 1-batch epoch).
        "step_points": sorted({1, n, n + 1}),
        "step_batches": min(2, n),
    }


def reference_run(steps: dict, precision: str = "fp64") -> str:
    """The run that differs from 1 device by summation order alone: 4 micro-batches, else reversed batches."""
    return f"1dev-{'acc4' if steps['micro_batch_size'] else 'reversed'}-{precision}"


def global_step(steps: dict, batches: int) -> int:
    """Lightning's global_step after `batches` global batches of training."""
    return batches * steps["steps_per_batch"]


def comparable(steps: dict) -> None:
    """Fail with the reason, instead of on a number, where the runs cannot train the same weights (a training
    step that draws random numbers: configured.probe_training_step)."""
    if steps.get("random_step"):
        pytest.fail(steps["random_step"], pytrace=False)


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
    rank_weights: bool = False,
    saves: tuple[int, ...] = (),
    fingerprints: bool = False,
) -> list[str]:
    """The suite's arguments to every run: 2 epochs, every step logged, the probe. A run writes what the checks read,
    no more: its checkpoints hold the weights and the loops' state, not the optimizer's (which doubles or triples
    their size), unless other runs resume from it at global batch `resumed_at` (or start one-step runs from it after
    the global batches `saves`): then they are complete, the probe saves one at each of those steps, an extra
    checkpoint per epoch is written (only their names are checked), and each parameter element's largest gradient is
    recorded (parity_probe.GradientPeaks). Each rank's final weights only with `rank_weights`; each rank's
    fingerprints of its datasets, compared before training, only with `fingerprints`."""
    args = [
        *("--trainer.max_epochs", "2", "--trainer.log_every_n_steps", "1"),  # every step's loss reaches the logger
        *("--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"),
        "--trainer.callbacks+=ddpkit.testing.parity_probe.Probe",
    ]
    if rank_weights:
        args.append("--trainer.callbacks.rank_weights=true")
    if fingerprints:
        args.append("--trainer.callbacks.fingerprint_data=true")
    if resumed_at is not None:
        at = ",".join(str(global_step(steps, k)) for k in sorted({resumed_at, *saves}))
        args += ["--trainer.callbacks.resumable=true", f"--trainer.callbacks.save_at_steps=[{at}]"]
        args += ["--trainer.callbacks+=ddpkit.testing.parity_probe.GradientPeaks"]
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
        *("--doctor.enabled", "false", "--trainer.callbacks+=ddpkit.testing.parity_probe.OneStep"),
        *(f"--trainer.callbacks.states={states}", f"--trainer.callbacks.steps_per_epoch={steps['steps_per_epoch']}"),
        f"--trainer.callbacks.steps_per_batch={steps['steps_per_batch']}",
        f"--trainer.callbacks.batches={steps['step_batches']}",
        *extra,
        *parity_args(),
    ]


STEP_PRECISIONS = {"fp32": "32-true", "bf16": "bf16-mixed"}


def evaluate(steps: dict, command: str, devices: int, ckpt_path: str) -> list[str]:
    """`validate`, `test` or `predict` in float64 from `ckpt_path`, without a logger (predictions.pt and the
    probe's records go to the run's root)."""
    return [
        command,
        *("--trainer.accelerator", "cpu", "--trainer.devices", str(devices), "--trainer.precision", "64-true"),
        *("--ckpt_path", ckpt_path, "--trainer.logger", "false", *run_args(steps), *parity_args()),
    ]


# A rank that could not listen on its port: another run took the free port it was given in between (the runs start
# together). Not the project's failure: the run starts again, in a clean folder, at most PORT_RETRIES times.
PORT_TAKEN = re.compile(r"EADDRINUSE|address already in use", re.IGNORECASE)
PORT_RETRIES = 2


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


def link_checkpoints(source: str, destination: str) -> None:
    """copytree's copy function: a hard link for a checkpoint (written anew, never in place, by a later run), a copy
    for any other file."""
    os.link(source, destination) if source.endswith(".ckpt") else shutil.copy2(source, destination)


def failed(error: AssertionError) -> Callable[[], Run]:
    """A job of a later wave that cannot start: the run it starts from failed with `error`."""

    def job() -> Run:
        raise AssertionError(f"starts from a run that failed: {error}")

    return job


def as_cuda(run: Run, steps: dict) -> Path:
    """`run`'s checkpoint 3/4 into epoch 0, saved again with every tensor tagged as stored on cuda:0."""
    path = run.mid_checkpoint(global_step(steps, steps["two_to_one"]))
    cuda = path.with_name(f"{path.stem}-cuda.ckpt")
    if not cuda.exists():
        save_as_cuda(torch.load(path, map_location="cpu", weights_only=False), cuda)
    return cuda


@dataclass
class Wave:
    names: tuple[str, ...]
    jobs: Callable  # (Waves) -> {name: job}; may read the runs of an earlier wave
    started: bool = False  # its jobs are built (the runs themselves start as they are asked for)


class Waves:
    """The runs by name. A run starts when it is first asked for, together with the other runs of its wave that the
    session's selected tests read (`want`; every run of the wave when nothing was declared), so that a selection of
    tests (`pytest -k ...`) starts only the runs it reads. The runs started together start at once; a run that fails
    fails the tests that read it, with its own error, and no other (a run of a later wave that starts from it fails
    with that error too). `gate`, asked once the runs that fingerprint the datasets (GATED_BY) have run, may give a
    reason no run can be compared (check_data.data_gate: the ranks hold different data): then every test that asks
    for a run skips with it, and no run starts after it."""

    def __init__(self, base: Path, waves: list[Wave], gate: Callable[["Waves"], str] | None = None) -> None:
        self.base, self.waves, self.done, self.failed, self.gate = base, waves, {}, {}, gate
        self.wanted: set[str] | None = None
        self.jobs: dict[str, Callable] = {}  # built, not yet started
        self.started: list[str] = []  # in the order they started
        self.stopped = ""  # the gate's reason
        self.gated = gate is None  # the gate has been asked

    def want(self, names: set[str] | None) -> None:
        """The runs the session's tests read (None: unknown, start every run of a wave)."""
        self.wanted = names

    def __getitem__(self, name: str):
        self.folder(name)
        if self.stopped:
            pytest.skip(self.stopped)
        if name in self.failed:
            raise AssertionError(self.failed[name])
        return self.done[name]

    def folder(self, name: str) -> Path:
        """The folder of run `name`, once it has run, whether it succeeded or failed (for a check that reads what a
        failed run left)."""
        if name not in self.done and name not in self.failed and not self.stopped:
            (wave,) = [w for w in self.waves if name in w.names]
            if not wave.started:
                wave.started = True
                try:
                    self.jobs |= wave.jobs(self)  # may read an earlier wave's run, which may have failed
                except AssertionError as error:
                    self.failed |= dict.fromkeys(wave.names, str(error))
            if name in self.jobs:
                self._start([n for n in wave.names if n in self.jobs and (n == name or self._wanted(n))])
        return self.base / name

    def _wanted(self, name: str) -> bool:
        return self.wanted is None or name in self.wanted

    def _start(self, names: list[str]) -> None:
        jobs = {n: self.jobs.pop(n) for n in names}
        self.started += names
        with ThreadPoolExecutor(len(jobs)) as pool:
            futures = {n: pool.submit(jobs[n]) for n in jobs}
        for n, future in futures.items():
            error = future.exception()
            if error is None:
                self.done[n] = future.result()
            else:  # a failed run, or the suite's own error making it: the tests that read it say which
                said = "".join(traceback.format_exception(error)[-3:])
                self.failed[n] = str(error) if isinstance(error, AssertionError) else f"run {n}: {said}"
        if not self.gated and all(n in self.done or n in self.failed for n in GATED_BY):
            self.gated, self.stopped = True, self.gate(self)


def reads(*names: str, **by_parameter: dict[str, tuple[str, ...]]) -> Callable:
    """Declares the shared runs a check reads, so that a selection of tests starts only those (`runs_read`). A name
    may hold `{reference}` (the float64 rounding reference's run), `{<parameter>}` (the test's parameter) or be
    `{evaluations}` (the evaluation runs the module and data allow); `by_parameter` adds runs by a parameter's value
    ({parameter: {value: names}})."""

    def declare(check: Callable) -> Callable:
        check.ddpkit_reads = (names, by_parameter)
        return check

    return declare


def runs_read(items: list, steps: dict) -> set[str] | None:
    """The runs the selected tests (pytest items) read, from their `reads` declarations; None when a test that uses
    the runs declares nothing (then every run of a wave starts with it)."""
    wanted: set[str] = set()
    for item in items:
        if "cpu_runs" not in getattr(item, "fixturenames", ()):
            continue
        declared = getattr(getattr(item, "function", None), "ddpkit_reads", None)
        if declared is None:
            return None
        names, by_parameter = declared
        params = getattr(getattr(item, "callspec", None), "params", {})
        names = [*names, *(n for key, runs in by_parameter.items() for n in runs.get(params.get(key), ()))]
        for name in names:
            if name == "{evaluations}":
                wanted |= set(evaluation_runs(steps))
            else:
                wanted.add(name.format(reference=reference_run(steps, "fp64"), **params))
    return wanted


# Stands for the project's own config.yaml in the directory the runs without a logger start from.
PROJECT_CONFIG = "# the project's config.yaml\n"


def shared_runs(base: Path, steps: dict, gate: Callable[[Waves], str] | None = None) -> Waves:
    """Every CPU run the suite reads (see the module's docstring), under `base`, with the steps they follow in
    steps.json (what the suite measured of the configured model and data); `gate`: see Waves."""
    (base / "steps.json").write_text(json.dumps(steps, indent=1))

    def run(name: str, cmd: list[str], root: Path | None = None, ranks: int = 1) -> Callable[[], Run]:
        return command(cmd, root or base / name, base / f"{name}.log", ranks=ranks)

    # 2-device runs other than 2dev-fp64 (Lightning's launcher, as users run it: starting rank 1 as a fresh process)
    # have both ranks forked (~5 CPU-s of imports less each; the ranks then train as torchrun's would).
    forked = 2

    csv = "--trainer.logger+=CSVLogger"  # a second logger, at full float64 precision
    # The runs the third wave resumes (1 device from 1/4 into epoch 1, 2 devices from 3/4 into epoch 0).
    saves = tuple(steps["step_points"])  # the one-step runs' states
    first = {
        "1dev-fp64": run(
            "1dev-fp64",
            main_cmd(
                *fit(steps, "cpu", 1, "64-true", csv, resumed_at=steps["one_to_two"], saves=saves, fingerprints=True)
            ),
        ),
        "2dev-fp64": run(
            "2dev-fp64",
            main_cmd(*fit(steps, "cpu", 2, "64-true", csv, resumed_at=steps["two_to_one"], fingerprints=True)),
        ),
    }
    # Summation order alone, the rounding reference of the weights bounds: 4 micro-batches, else reversed batches.
    micro = ("--data.micro_batch_size", str(steps["micro_batch_size"]))
    reorder = (
        micro if steps["micro_batch_size"] else ("--trainer.callbacks+=ddpkit.testing.parity_probe.ReversedBatches",)
    )
    reference = reference_run(steps, "fp64")
    first[reference] = run(reference, main_cmd(*fit(steps, "cpu", 1, "64-true", *reorder)))

    def first_again() -> Callable[[], Run]:
        two = fit(steps, "cpu", 2, "64-true", csv, resumed_at=steps["two_to_one"])
        return run("2dev-fp64-again", main_cmd(*two))

    def second(runs: Waves) -> dict:
        jobs = {
            "torchrun-fp64": run("torchrun-fp64", torchrun_cmd(*fit(steps, "cpu", 2, "64-true"))),
            "torchrun-nodes": lambda: torchrun_nodes_job(base / "torchrun-nodes", cluster_args(steps)),
        }
        try:  # from the states the 1-device float64 run saved; float64's step is the exact one
            states = runs["1dev-fp64"].root / "probe"
            for name in ONE_STEP:
                devices = 2 if "-2dev-" in name else 1
                precision = {**STEP_PRECISIONS, "fp64": "64-true"}[name.split("-")[-1]]
                jobs[name] = run(name, main_cmd(*one_step(steps, devices, precision, states)), ranks=devices)
        except AssertionError as error:
            jobs |= dict.fromkeys(ONE_STEP, failed(error))
        if steps["micro_batch_size"]:  # else the data module takes none, or the global batch has no quarter
            jobs["2dev-acc2-fp64"] = run(
                "2dev-acc2-fp64", main_cmd(*fit(steps, "cpu", 2, "64-true", *micro)), ranks=forked
            )
        if steps["shards"]:  # and its reference: 1 device in float32 (ModelParallelStrategy has no float64)
            jobs["sharded"] = lambda: sharded_job(base / "sharded", steps)
            jobs["1dev-fp32"] = run("1dev-fp32", main_cmd(*fit(steps, "cpu", 1, "32-true")))
        if steps["takes_scheduler"]:  # with the CSV logger too: its learning rates at full precision
            lr = (*schedule_args(steps), csv)
            for n in (1, 2):
                cmd = main_cmd(*fit(steps, "cpu", n, "64-true", *lr))
                jobs[f"{n}dev-lr-fp64"] = run(f"{n}dev-lr-fp64", cmd, ranks=n)
        return jobs

    def third(runs: Waves) -> dict:
        jobs = {
            "slurm-requeue": lambda: slurm_requeue_job(base / "slurm", cluster_args(steps), steps["steps_per_epoch"])
        }
        try:  # from 2 devices' checkpoint with its tensors tagged cuda:0, as one written on GPUs
            ckpt = as_cuda(runs["2dev-fp64"], steps)
            jobs["resume-2to1"] = run(
                "resume-2to1", main_cmd(*fit(steps, "cpu", 1, "64-true", "--ckpt_path", str(ckpt)))
            )
        except AssertionError as error:
            jobs["resume-2to1"] = failed(error)
        from_one = ("resume-1to2", *evaluation_runs(steps), "continue")
        try:
            one = runs["1dev-fp64"]
        except AssertionError as error:
            return jobs | dict.fromkeys(from_one, failed(error))
        # validate, test and predict on 1 device start from a copy of the 1-device run (`--ckpt_path last` and
        # `best` look for its last.ckpt there) that holds a config.yaml, as the project directory would. The copies'
        # checkpoints are hard links, no space taken, except the last.ckpt that `continue` writes again; the logs,
        # which Lightning rewrites in place (hparams.yaml), are copies.
        for copy in ("eval", "continue"):
            shutil.copytree(one.root / "lightning_logs", base / copy / "lightning_logs", copy_function=link_checkpoints)
        continued = base / "continue" / one.checkpoint().relative_to(one.root)
        continued.unlink()
        shutil.copy2(one.checkpoint(), continued)
        (base / "eval" / "config.yaml").write_text(PROJECT_CONFIG)
        best, last = best_checkpoint(one), str(one.checkpoint())
        resume_at = str(one.mid_checkpoint(global_step(steps, steps["one_to_two"])))
        evaluations = {
            "validate-1dev": run("validate-1dev", main_cmd(*evaluate(steps, "validate", 1, "last")), base / "eval"),
            "test-1dev": run("test-1dev", main_cmd(*evaluate(steps, "test", 1, "best")), base / "eval"),
            "predict-1dev": run("predict-1dev", main_cmd(*evaluate(steps, "predict", 1, last)), base / "eval"),
            "test-2dev": run("test-2dev", main_cmd(*evaluate(steps, "test", 2, str(best))), ranks=forked),
            "predict-2dev": run("predict-2dev", main_cmd(*evaluate(steps, "predict", 2, last)), ranks=forked),
        }
        return jobs | {
            "resume-1to2": run(
                "resume-1to2", main_cmd(*fit(steps, "cpu", 2, "64-true", "--ckpt_path", resume_at)), ranks=forked
            ),
            **{name: job for name, job in evaluations.items() if name in evaluation_runs(steps)},
            # A finished run continued for one more epoch (fit's own arguments, in a copy of it).
            "continue": run(
                "continue",
                main_cmd(*fit(steps, "cpu", 1, "64-true", "--trainer.max_epochs", "3", "--ckpt_path", "last")),
            ),
        }

    waves = [
        Wave(tuple(first), lambda runs: first),
        Wave(
            (
                *ONE_STEP,
                "torchrun-fp64",
                "torchrun-nodes",
                "2dev-acc2-fp64",
                "sharded",
                "1dev-fp32",
                "1dev-lr-fp64",
                "2dev-lr-fp64",
            ),
            second,
        ),  # fmt: skip
        Wave(
            ("resume-2to1", "resume-1to2", *EVALUATIONS, "continue", "slurm-requeue"),
            third,
        ),  # fmt: skip
        # The 2-device float64 run again, only when a comparison asks how far two identical runs end apart.
        Wave(("2dev-fp64-again",), lambda runs: {"2dev-fp64-again": first_again()}),
    ]
    return Waves(base, waves, gate)


def remove_checkpoints(base: Path, delete: bool = True) -> tuple[int, int]:
    """Delete every checkpoint and weights file under `base` (a sharded checkpoint is a folder), keeping the logs
    and the probe's records; return how many files there were and their bytes (a hard-linked file once). The
    suite's runs write dozens (a ResNet-18's are 90 MB each in float64), and pytest keeps the temporary folders of
    three sessions. `delete=False` only counts them."""
    heavy = [p for p in base.rglob("*") if p.suffix in (".ckpt", ".pt")]
    inside = (f for p in heavy for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file())
    files = {f.stat().st_ino: f.stat().st_size for f in inside}
    for path in heavy if delete else []:
        if path.exists():  # not inside a sharded checkpoint removed before
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    return len(files), sum(files.values())


# The runs whose ranks fingerprint their datasets (run_args' `fingerprints`), after which Waves' gate is asked.
GATED_BY = ("1dev-fp64", "2dev-fp64")
EVALUATIONS = ("validate-1dev", "test-1dev", "predict-1dev", "test-2dev", "predict-2dev")
# The one-step runs (check_onestep.py): 1 and 2 devices in float32 and bf16-mixed, 1 device in float64 (the exact step).
ONE_STEP = ("step-1dev-fp32", "step-2dev-fp32", "step-1dev-bf16", "step-2dev-bf16", "step-1dev-fp64")


# The set each evaluation stage reads (configured.py's `<set>_size`).
STAGE_SETS = {"validate": "val", "test": "test", "predict": "predict"}


def evaluation_runs(steps: dict) -> list[str]:
    """The third wave's runs of validate, test and predict for which the module defines a step and the data module
    a set."""
    stage = lambda name: name.split("-")[0]  # noqa: E731
    return [name for name in EVALUATIONS if stage(name) in steps["stages"] and steps["sizes"][stage(name)]]


def best_checkpoint(run: Run) -> Path:
    """The best checkpoint the configured checkpoint callback kept (recorded in last.ckpt)."""
    states = torch.load(run.checkpoint(), map_location="cpu", weights_only=False)["callbacks"].values()
    (best,) = {s["best_model_path"] for s in states if isinstance(s, dict) and "best-" in s.get("best_model_path", "")}
    return Path(best)


def cluster_args(steps: dict) -> list[str]:
    """The float64 fit of the first wave, without its probes and logger changes: the cluster launchers' runs
    must end with its weights (2 epochs; dropout off, as the probe turns it off there)."""
    return [
        *("--trainer.accelerator", "cpu", "--trainer.precision", "64-true", "--trainer.max_epochs", "2"),
        *("--trainer.log_every_n_steps", "1"),  # as the first wave's: the parity command compares their logged steps
        *("--trainer.enable_progress_bar", "false", "--trainer.callbacks+=ddpkit.testing.parity_probe.NoDropout"),
        *parity_args(),
        "--trainer.callbacks+=ddpkit.testing.rank_probe.RankProbe",  # last: `--trainer.callbacks.*` may follow
    ]


def sharded_job(root: Path, steps: dict) -> dict:
    """Epoch 1 sharded over 2 processes (the library's model_parallel preset, float32: ModelParallelStrategy has
    no float64), epoch 2 resumed from its sharded checkpoint on 1; the weights at the end, gathered."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    # The library's copy, not the project's configs/model_parallel.yaml: a project may lack it (baked before it
    # existed, or deleted) or have set it for its cluster (8 devices), and the check needs 2 processes.
    args = ["--config", str(presets.path("model_parallel")), "--trainer.accelerator", "cpu"]
    args += ["--trainer.precision", "32-true", "--trainer.enable_progress_bar", "false"]
    args += ["--trainer.callbacks+=ddpkit.testing.parity_probe.NoDropout", *parity_args()]
    two, one = root / "two", root / "one"
    root.mkdir()
    command(main_cmd("fit", *args, "--trainer.max_epochs", "1"), two, root / "two.log")()
    sharded = two / "lightning_logs/version_0/checkpoints/last.ckpt"
    one_device = ("--trainer.devices", "1", "--trainer.strategy.data_parallel_size", "1")
    resume = ("--trainer.max_epochs", "2", "--ckpt_path", str(sharded))
    command(main_cmd("fit", *args, *one_device, *resume), one, root / "one.log")()
    dcp_to_torch_save(one / "lightning_logs/version_0/checkpoints/last.ckpt", root / "full.pt")
    weights = torch.load(root / "full.pt", weights_only=True)["state_dict"]
    return {"files": sorted(p.name for p in sharded.glob("*.distcp")), "weights": weights}


__all__ = [
    "PROJECT_CONFIG",
    "Run",
    "SlurmJob",
    "Waves",
    "as_cuda",
    "comparable",
    "evaluation_runs",
    "fit",
    "global_step",
    "main_cmd",
    "plan",
    "reads",
    "remove_checkpoints",
    "runs_read",
    "shared_runs",
]
