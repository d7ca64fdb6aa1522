"""The guarantee suite's runs of the project's `main.py`, shared by its tests (`cpu_runs`): a finished run
(`Run`), a command that makes one (`command`), and the runs by name (`Waves`), each started when a test first asks
for it, together with the runs of its wave that the session's selected tests read (`reads`, `runs_read`). The
steps the runs follow come from the configured model and data (`plan`). Which runs there are, in which waves, and
their command lines: waves.py.
"""

import json
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ..model.sharding import shards_on_cpu
from ..parity import load_weights
from .fake_cluster import SlurmJob
from .slots import run_slot


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

    def resume_state(self, steps: dict, start: str) -> Path:
        """The state another run resumes from, saved after the global batches `steps[start]` ("two_to_one",
        "one_to_two": plan)."""
        return self.mid_checkpoint(global_step(steps, steps[start]))

    def resume_facts(self, steps: dict, start: str) -> dict:
        """What the checks read of the resume state at `start`: the train loader's position in it and where each of
        its tensors says it is stored, read once and kept beside it (a run resuming from it may delete it: consumes)."""
        path = self.resume_state(steps, start)
        facts = path.with_suffix(".json")
        if not facts.is_file():
            at: list[str] = []
            keep = lambda storage, location: at.append(location) or storage  # noqa: E731
            state = torch.load(path, map_location=keep, weights_only=False)
            position = state["loops"]["fit_loop"]["state_dict"].get("combined_loader")
            facts.write_text(json.dumps({"combined_loader": position, "locations": at}, default=repr))
        return json.loads(facts.read_text())


def plan(configured: dict) -> dict:
    """Steps of the shared runs: resume 2 -> 1 from 3/4 into epoch 0, 1 -> 2 from 1 optimizer step into epoch 1 (the
    one-step check's state there, saved once; with fewer than 4 steps per epoch 2 -> 1 falls on epoch 0's end and
    with 1, 1 -> 2 on epoch 1's), counted in global batches; accumulate
    with micro-batches of a quarter of the global batch when the data module takes a micro_batch_size that
    divides it, the module optimizes automatically (the CLI refuses micro-batches with manual optimization), has no
    BatchNorm (micro-batches would change its statistics), no loss over the global batch (`loss_spans_global_batch`:
    the CLI refuses micro-batches) and no GradientAccumulationScheduler sets the accumulation (Lightning refuses
    both). `accumulation`: global batches per optimizer step in epoch 0 and 1 (the scheduler's;
    [] without one).
    `steps_per_batch`: optimizer steps per optimizer step of the data (several for a module that steps several
    optimizers itself), which Lightning's global_step counts; `random_step`, `batch_mean`: why numbers cannot match
    (configured.probe_training_step)."""
    n, batch = configured["steps_per_epoch"], configured["global_batch_size"]
    batchnorm = configured.get("batchnorm", False)
    # A GradientAccumulationScheduler's factors ([] without one). With one, Lightning refuses the suite's micro-batch
    # runs whatever its factors in these 2 epochs ({4: 2} gives [1, 1] here).
    accumulation = configured.get("accumulation", [])
    accumulates = configured["takes_micro_batch_size"] and not configured.get("manual_optimization")
    spans = configured.get("spans_batch", False)  # a loss over the global batch: micro-batches refused (CLI)
    micro = batch // 4 if accumulates and batch % 4 == 0 and not (batchnorm or spans or accumulation) else None
    first, second = (min(a, n) for a in accumulation or [1, 1])  # global batches of each epoch's first step
    steps = {
        "steps_per_epoch": n,
        "accumulation": accumulation,
        "two_to_one": max(first, 3 * n // 4 // first * first),  # at the end of an optimizer step
        "one_to_two": n + second,
        "micro_batch_size": micro,
        "takes_scheduler": configured.get("takes_scheduler", False),
        "shards": configured.get("shards_layers", False) and shards_on_cpu(),
        "manual_optimization": configured.get("manual_optimization", False),
        "steps_per_batch": configured.get("steps_per_batch", 1),
        "random_step": configured.get("random_step", ""),
        "batch_mean": configured.get("batch_mean", ""),
        "dataset_draws": configured.get("dataset_draws", ""),
        "batch_draws": configured.get("batch_draws", ""),
        "replaced_sampler": configured.get("replaced_sampler", ""),
        "stages": configured.get("stages", ["validate", "test", "predict"]),
        # Samples of each evaluation set (0: none); a stage's runs need its set as well as its step.
        "sizes": {stage: configured.get(f"{key}_size", 1) for stage, key in STAGE_SETS.items()},
        "batchnorm": batchnorm,
        "spans_batch": spans,
        "router_aux": configured.get("router_aux", ""),
        "averaging": configured.get("averaging", []),
        "swa": configured.get("swa", False),
        # The one-step check's points, in global batches: after the first optimizer step, at epoch 0's end and after
        # epoch 1's first step (0 is each run's own initialization).
        "step_points": sorted({first, n, n + second}),
    }
    # The optimizer steps the one-step check's runs train in each of their 2 epochs: 0 and 1 (0 alone where an
    # epoch has a single step), and epoch 0's steps (where epoch 1's are numbered from).
    steps["epoch_steps"] = optimizer_steps(steps, n)
    steps["step_batches"] = min(2, steps["epoch_steps"], optimizer_steps(steps, 2 * n) - steps["epoch_steps"])
    return steps


def optimizer_steps(steps: dict, batches: int) -> int:
    """Optimizer steps (of the data: see global_step) after `batches` global batches: Lightning steps after each
    `accumulation` batches and after an epoch's last."""
    n, done = steps["steps_per_epoch"], 0
    for epoch, accumulate in enumerate(steps.get("accumulation") or [1, 1]):
        trained = min(max(batches - epoch * n, 0), n)
        done += trained // accumulate + (trained == n and n % accumulate > 0)
    return done


def reference_run(steps: dict, precision: str = "fp64") -> str:
    """The run that differs from 1 device by summation order alone: 4 micro-batches, else reversed batches."""
    return f"1dev-{'acc4' if steps['micro_batch_size'] else 'reversed'}-{precision}"


def global_step(steps: dict, batches: int) -> int:
    """Lightning's global_step after `batches` global batches of training."""
    return optimizer_steps(steps, batches) * steps.get("steps_per_batch", 1)


def total_steps(steps: dict) -> int:
    """Lightning's global_step at the end of the runs' 2 epochs (the plan or the configured model's description)."""
    return global_step(steps, 2 * steps["steps_per_epoch"])


def comparable(steps: dict) -> None:
    """Fail with the reason, instead of on a number, where the runs cannot see the same samples (check_data's
    same_samples), the loader draws per batch (data/draws.batch_draws), a training step draws random numbers or a
    loss is divided by a count of the batch it is given (configured.probe_training_step)."""
    for cause in ("dataset_draws", "replaced_sampler", "batch_draws", "random_step", "batch_mean"):
        if steps.get(cause):
            pytest.fail(steps[cause], pytrace=False)


STEP_PRECISIONS = {"fp32": "32-true", "bf16": "bf16-mixed"}


@dataclass
class Wave:
    names: tuple[str, ...]
    jobs: Callable  # (Waves) -> {name: job}; may read the runs of an earlier wave
    started: bool = False  # its jobs are built (the runs themselves start as they are asked for)


class Waves:
    """The runs by name. A run starts when it is first asked for, together with the other runs of its wave that the
    session's selected tests read (`want`; every run of the wave when nothing was declared), so that a selection of
    tests (`pytest -k ...`) starts only the runs it reads. The runs started together start at once, each as soon as it
    has a slot per process it starts (slots.py; `processes`, by name, default 1), taken in the wave's order; a run that
    fails fails the tests that read it, with its own error, and no other (a run of a later wave that starts from it
    fails with that error too). `gate`, asked once the runs that fingerprint the datasets (GATED_BY) have run, may give
    a reason no run can be compared (check_data.data_gate: the ranks hold different data): then every test that asks for
    a run skips with it, and no run starts after it."""

    def __init__(
        self,
        base: Path,
        waves: list[Wave],
        gate: Callable[["Waves"], str] | None = None,
        processes: Callable[[str], int] = lambda name: 1,
    ) -> None:
        self.base, self.waves, self.done, self.failed, self.gate = base, waves, {}, {}, gate
        self.processes = processes
        self.wanted: set[str] | None = None
        self.jobs: dict[str, Callable] = {}  # built, not yet started
        self.started: list[str] = []  # in the order they started
        self.stopped = ""  # the gate's reason
        self.gated = gate is None  # the gate has been asked
        self.cache: dict = {}  # what the checks work out of the runs once for the session (FP64_BOUND: bounds.py)
        self.rounding_reference = ""  # the run FP64_BOUND is worked out from (waves.py): wanted where it is
        # Called before runs start (the plugin's Footprint.measure): a run may delete a file it starts from (waves.py).
        self.before_start: Callable[[Waves], None] = lambda runs: None

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
                self._start([n for n in wave.names if n in self.jobs and (n == name or self.wants(n))])
        return self.base / name

    def wants(self, name: str) -> bool:
        """Whether the session's selected tests read run `name` (every run, when they declared nothing)."""
        bound = name == self.rounding_reference and FP64_BOUND in (self.wanted or ())
        return self.wanted is None or name in self.wanted or bound

    def _start(self, names: list[str]) -> None:
        self.before_start(self)
        jobs = {n: self.jobs.pop(n) for n in names}
        self.started += names
        futures = {}
        with ThreadPoolExecutor(len(jobs)) as pool:  # each run waits for its slots (slots.py), in the wave's order
            for n in jobs:
                holding = threading.Event()
                futures[n] = pool.submit(in_slot, jobs[n], self.processes(n), holding)
                holding.wait()  # resume-2to1 deletes its state before the 1-device run can write its own (waves.py)
        for n, future in futures.items():
            error = future.exception()
            if error is None:
                self.done[n] = future.result()
            else:  # a failed run, or the suite's own error making it: the tests that read it say which
                said = "".join(traceback.format_exception(error)[-3:])
                self.failed[n] = str(error) if isinstance(error, AssertionError) else f"run {n}: {said}"
        if not self.gated and all(n in self.done or n in self.failed for n in GATED_BY):
            self.gated, self.stopped = True, self.gate(self)


def in_slot(job: Callable[[], Run], processes: int = 1, holding: threading.Event | None = None) -> Run:
    """`job()` once it holds a slot per process of it (`processes`) of the machine's slots for the suite's runs;
    `holding` is set once it does (or could not)."""
    try:
        with run_slot(processes=processes):
            if holding:
                holding.set()
            return job()
    finally:
        if holding:
            holding.set()


def reads(*names: str, **by_parameter: dict[str, tuple[str, ...]]) -> Callable:
    """Declares the shared runs a check reads, so that a selection of tests starts only those (`runs_read`). A name
    may hold `{reference}` (the float64 rounding reference's run, its files read), `{bound}` (the float64 bound
    worked out from it: FP64_BOUND), `{<parameter>}` (the test's parameter) or be
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
            elif name == "{bound}":
                wanted.add(FP64_BOUND)
            else:
                wanted.add(name.format(reference=reference_run(steps, "fp64"), **params))
    return wanted


# Stands for the project's own config.yaml in the directory the runs without a logger start from.
PROJECT_CONFIG = "# the project's config.yaml\n"
# Read by the checks of the 2-device run's resume state 3/4 into epoch 0 (written tagged as on GPUs: commands.run_args),
# which resume-2to1 starts from: once neither is left, footprint.py deletes it.
MID_CHECKPOINT = "2dev-mid-checkpoint"
# Read by the checks that compare float64 runs: the bound the rounding reference's weights give (bounds.fp64_bound),
# worked out once for the session (Waves.cache); footprint.py keeps the reference's weights until it is.
FP64_BOUND = "fp64-bound"
# Read by the one-step check in a precision: the records of its one-step runs (probe/onestep.pt; the float64 run's
# by both precisions' checks), which footprint.py deletes once the check has run.
STEP_RECORDS = "step-records-{precision}"
# The runs whose ranks fingerprint their datasets (commands.run_args' `fingerprints`), after which Waves' gate is asked.
GATED_BY = ("1dev-fp64", "2dev-fp64")
EVALUATIONS = ("validate-1dev", "test-1dev", "predict-1dev", "test-2dev", "predict-2dev")
# The one-step runs (check_onestep.py): 1 and 2 devices in float32 and bf16-mixed, 1 device in float64 (the exact step);
# in two waves (waves.py), so that float32's records are deleted before bf16's are written (footprint.py).
ONE_STEP_WAVES = (("step-1dev-fp32", "step-2dev-fp32", "step-1dev-fp64"), ("step-1dev-bf16", "step-2dev-bf16"))
ONE_STEP = (*ONE_STEP_WAVES[0], *ONE_STEP_WAVES[1])
# The same steps from states nudged (parity_probe.OneStep's `nudge`: each weight x (1 +- NUDGE)), only when a tensor is
# over its bound: the second look (check_onestep.over_twice; docs/measurements.md, "ReLU kinks").
NUDGE = 1e-4
ONE_STEP_NUDGED = tuple(f"{name}-nudged" for name in ONE_STEP)
# The runs that start from the first wave's checkpoints: the 2-device run's, then the 1-device run's (waves.py).
FROM_FIRST = ("resume-2to1", "resume-1to2", *EVALUATIONS, "continue")


# The set each evaluation stage reads (configured.py's `<set>_size`).
STAGE_SETS = {"validate": "val", "test": "test", "predict": "predict"}


def evaluation_runs(steps: dict) -> list[str]:
    """The runs of validate, test and predict (of FROM_FIRST) for which the module defines a step and the data module
    a set."""
    stage = lambda name: name.split("-")[0]  # noqa: E731
    return [name for name in EVALUATIONS if stage(name) in steps["stages"] and steps["sizes"][stage(name)]]


def best_checkpoint(run: Run) -> Path:
    """The best checkpoint the configured checkpoint callback kept (recorded in last.ckpt)."""
    states = torch.load(run.checkpoint(), map_location="cpu", weights_only=False)["callbacks"].values()
    (best,) = {s["best_model_path"] for s in states if isinstance(s, dict) and "best-" in s.get("best_model_path", "")}
    return Path(best)


__all__ = ["PROJECT_CONFIG", "Run", "SlurmJob", "Waves", "comparable", "evaluation_runs", "global_step", "plan"]
__all__ += ["reads", "runs_read"]
