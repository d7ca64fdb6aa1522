"""The shared runs of the project's `main.py` (runs.py: how they start and are read) and their command lines.

Whatever config.yaml selects (your model and data once you point it at them) trains 2 epochs on CPU, in
waves; the runs of a wave start at once, as many as the machine's slots allow (slots.py), and each wave's files
are deleted once its checks have read them, before a later wave writes its own (footprint.py):
1. 1 and 2 devices in float64, which the others are compared with; they add a CSV logger to the configured ones,
   and record each parameter element's largest gradient. And 1 device x 4 micro-batches (or, for BatchNorm or
   without micro-batches, 1 device with every batch reversed): summation order alone, the rounding the float64
   bounds start from. The 1-device run saves its state after global batches 1, n and n + 1 (n an epoch's). In two
   steps: the 2-device run alone, then the 1-device runs beside the resume 2 -> 1 (FROM_FIRST's first) from the
   state the 2-device run wrote 3/4 into epoch 0, tagged as on GPUs, which it deletes once restored.
2. From the 1-device run's states (the rest of FROM_FIRST): the resume 1 -> 2 from 1 global batch into epoch 1; then
   `validate`, `test` and `predict` on 1 and 2 devices (those the module defines a step for), and `fit --ckpt_path
   last` continuing a copy of the 1-device run stopped where 1 -> 2 starts (its last.ckpt that state).
3. The others whose checks read the rounding reference's files, in two waves: two torchrun "nodes" and, when the
   model takes one, 1 and 2 devices with a warmup + cosine learning-rate schedule; then `torchrun`, gradient
   accumulation on 2 devices x 2 micro-batches (not for a module that optimizes manually) and sharded training when
   the module shards (the library's model_parallel preset, compared with 1 device in float32).
4. The one-step runs (check_onestep.py): from the 1-device run's states, single steps on 1 and 2 devices in float32
   and on 1 device in float64, then, once float32's records are gone, on 1 and 2 devices in bf16-mixed.
5. A 2-node SLURM job that is signalled, requeued and resumed.
And, only when a float64 comparison is over its bound by no more than rounding, the 2-device float64 run again
(`2dev-fp64-again`): how far two identical runs end apart (bounds.run_to_run); only when a one-step check is over
its bound, the one-step runs again from nudged states (`step-...-nudged`: its second look, check_onestep.py).
A run starts when a test first asks for it, together with the runs of its wave that the session's selected tests
read (their `reads` declarations), so `pytest -k ...` starts only the runs it reads.
The sizes and steps come from the configured data module and model (configured.py); steps are counted in global
batches, and Lightning's global_step is `steps_per_batch` times that (a GAN stepping two optimizers: 2).

The runs' command lines, and the arguments a user adds to every run (PARITY_ARGS): commands.py.
"""

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from .commands import (
    cluster_args,
    command,
    evaluate,
    failed,
    fit,
    main_cmd,
    one_step,
    schedule_args,
    sharded_args,
    torchrun_cmd,
)
from .fake_cluster import SlurmJob, slurm_requeue_job, torchrun_nodes_job
from .footprint import remove_checkpoints
from .runs import (
    FROM_FIRST,
    NUDGE,
    ONE_STEP,
    ONE_STEP_NUDGED,
    ONE_STEP_WAVES,
    PROJECT_CONFIG,
    STEP_PRECISIONS,
    Run,
    Wave,
    Waves,
    best_checkpoint,
    evaluation_runs,
    reference_run,
)

SCHEDULED = ("1dev-lr-fp64", "2dev-lr-fp64")  # 1 and 2 devices with a warmup + cosine schedule
# The others, in three waves (fewer runs' weights at once): those whose checks read the rounding reference's files
# (the parity command's, the accumulation check's), in two waves before the one-step runs; then the SLURM job, which
# holds a complete state (its requeue checkpoint) besides its weights.
OTHERS_WAVES = (
    ("torchrun-nodes", *SCHEDULED),
    ("torchrun-fp64", "2dev-acc2-fp64", "sharded", "1dev-fp32"),
    ("slurm-requeue",),
)
# The runs of 2 processes whose name says no "2dev" (each takes 2 of the machine's slots: slots.py).
TWO_PROCESSES = {"resume-1to2", "torchrun-fp64", "torchrun-nodes", "sharded", "slurm-requeue"}


def shared_runs(base: Path, steps: dict, gate: Callable[[Waves], str] | None = None, launcher: bool = True) -> Waves:
    """Every CPU run the suite reads (see the module's docstring), under `base`, with the steps they follow in
    steps.json (what the suite measured of the configured model and data); `gate`: see Waves. `launcher` False:
    2dev-fp64 too has both ranks forked, sharing the hash seed and random state a fresh rank 1 would not (the
    library's tests of the checks, on models whose bug does not need a fresh process)."""
    (base / "steps.json").write_text(json.dumps(steps, indent=1))

    def run(name: str, cmd: list[str], root: Path | None = None, ranks: int = 1) -> Callable[[], Run]:
        return command(cmd, root or base / name, base / f"{name}.log", ranks=ranks)

    # 2-device runs other than 2dev-fp64 (Lightning's launcher, as users run it: starting rank 1 as a fresh process)
    # have both ranks forked (~5 CPU-s of imports less each; the ranks then train as torchrun's would).
    forked = 2

    csv = "--trainer.logger+=CSVLogger"  # a second logger, at full float64 precision
    # The runs FROM_FIRST resumes (1 device from 1 global batch into epoch 1, 2 devices from 3/4 into epoch 0, a
    # state written as on GPUs); the 1-device run saves the one-step runs' states too.
    one = dict(resumed_at=steps["one_to_two"], saves=tuple(steps["step_points"]), fingerprints=True)
    two = dict(resumed_at=steps["two_to_one"], fingerprints=True, on_gpu=True, best_by_name=True)
    first_cmd = main_cmd(*fit(steps, "cpu", 2, "64-true", csv, **two))
    first_two = {"2dev-fp64": run("2dev-fp64", first_cmd, ranks=1 if launcher else forked)}
    first = {"1dev-fp64": run("1dev-fp64", main_cmd(*fit(steps, "cpu", 1, "64-true", csv, **one)))}
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

    def step_jobs(runs: Waves, plains: tuple[str, ...], nudge: float = 0.0) -> dict:
        names = [f"{plain}-nudged" if nudge else plain for plain in plains]
        try:  # from the states the 1-device float64 run saved; float64's step is the exact one
            states = runs["1dev-fp64"].root / "probe"
        except AssertionError as error:
            return dict.fromkeys(names, failed(error))
        jobs = {}
        for name, plain in zip(names, plains, strict=True):
            devices = 2 if "-2dev-" in plain else 1
            precision = {**STEP_PRECISIONS, "fp64": "64-true"}[plain.split("-")[-1]]
            nudging = (f"--trainer.callbacks.nudge={nudge}",) if nudge else ()
            cmd = main_cmd(*one_step(steps, devices, precision, states, *nudging))
            jobs[name] = run(name, cmd, ranks=devices)
        return jobs

    def others(runs: Waves, names: tuple[str, ...]) -> dict:
        jobs = {
            "torchrun-fp64": run("torchrun-fp64", torchrun_cmd(*fit(steps, "cpu", 2, "64-true"))),
            "torchrun-nodes": lambda: torchrun_nodes_job(base / "torchrun-nodes", cluster_args(steps)),
            "slurm-requeue": lambda: slurm_requeue_job(base / "slurm", cluster_args(steps), steps["steps_per_epoch"]),
        }
        if steps["micro_batch_size"]:  # else the data module takes none, or the global batch has no quarter
            jobs["2dev-acc2-fp64"] = run(
                "2dev-acc2-fp64", main_cmd(*fit(steps, "cpu", 2, "64-true", *micro)), ranks=forked
            )
        if steps["shards"]:  # and its reference: 1 device in float32 (ModelParallelStrategy has no float64)
            jobs["sharded"] = lambda: sharded_job(base / "sharded", steps)
            jobs["1dev-fp32"] = run("1dev-fp32", main_cmd(*fit(steps, "cpu", 1, "32-true")))
        if steps["takes_scheduler"]:  # with the CSV logger too: its learning rates at full precision
            lr = (*schedule_args(steps), csv)
            for n, name in enumerate(SCHEDULED, start=1):
                jobs[name] = run(name, main_cmd(*fit(steps, "cpu", n, "64-true", *lr)), ranks=n)
        return {name: job for name, job in jobs.items() if name in names}

    def from_two(runs: Waves) -> dict:
        try:  # from 2 devices' checkpoint with its tensors tagged cuda:0, as one written on GPUs, read by nothing after
            ckpt = runs["2dev-fp64"].resume_state(steps, "two_to_one")
            runs["2dev-fp64"].resume_facts(steps, "two_to_one")  # what the checks read of it, before it is deleted
        except AssertionError as error:
            return {"resume-2to1": failed(error)}
        resume = fit(steps, "cpu", 1, "64-true", "--ckpt_path", str(ckpt), consumes=True)
        return {"resume-2to1": run("resume-2to1", main_cmd(*resume))}

    def first_one(runs: Waves) -> dict:
        # The 2-device run runs first, alone (its wave), where it is read: resume-2to1 then starts beside the 1-device
        # runs and deletes the state it resumes from before they write theirs (footprint.py).
        if runs.wants("resume-2to1"):
            return {**first, **from_two(runs)}
        if runs.wants("2dev-fp64"):
            runs.folder("2dev-fp64")  # run, or failed: its own tests say which
        return first

    def resume_one(runs: Waves) -> dict:
        try:
            resume_at = str(runs["1dev-fp64"].resume_state(steps, "one_to_two"))
        except AssertionError as error:
            return {"resume-1to2": failed(error)}
        resume = fit(steps, "cpu", 2, "64-true", "--ckpt_path", resume_at)
        return {"resume-1to2": run("resume-1to2", main_cmd(*resume), ranks=forked)}

    def from_one(runs: Waves) -> dict:
        try:
            one = runs["1dev-fp64"]
        except AssertionError as error:
            return dict.fromkeys(FROM_FIRST[2:], failed(error))
        # validate, test and predict on 1 device start from a copy of the 1-device run (`--ckpt_path last` and
        # `best` look for its last.ckpt there) that holds a config.yaml, as the project directory would; `continue`
        # from a copy whose last.ckpt is the state 1 -> 2 resumes from, as a run stopped there would have left it.
        # The copies' checkpoints are hard links, no space taken (`continue` writes its last.ckpt anew, a new file
        # renamed over the link: slim.SlimIO); the logs, which Lightning rewrites in place (hparams.yaml), are copies.
        for copy in ("eval", "continue"):
            shutil.copytree(one.root / "lightning_logs", base / copy / "lightning_logs", copy_function=link_checkpoints)
        (base / "eval" / "config.yaml").write_text(PROJECT_CONFIG)
        best, last = best_checkpoint(one), str(one.checkpoint())
        resume_at = str(one.resume_state(steps, "one_to_two"))
        stopped = base / "continue" / one.checkpoint().relative_to(one.root)
        stopped.unlink()
        os.link(resume_at, stopped)
        evaluations = {
            "validate-1dev": run("validate-1dev", main_cmd(*evaluate(steps, "validate", 1, "last")), base / "eval"),
            "test-1dev": run("test-1dev", main_cmd(*evaluate(steps, "test", 1, "best")), base / "eval"),
            "predict-1dev": run("predict-1dev", main_cmd(*evaluate(steps, "predict", 1, last)), base / "eval"),
            "test-2dev": run("test-2dev", main_cmd(*evaluate(steps, "test", 2, str(best))), ranks=forked),
            "predict-2dev": run("predict-2dev", main_cmd(*evaluate(steps, "predict", 2, last)), ranks=forked),
        }
        return {
            **{name: job for name, job in evaluations.items() if name in evaluation_runs(steps)},
            # A run stopped 1 global batch into epoch 1 continued to its end (fit's own arguments, in a copy of it).
            "continue": run("continue", main_cmd(*fit(steps, "cpu", 1, "64-true", "--ckpt_path", "last"))),
        }

    waves = [  # in the order their checks come (guarantees.__all__)
        # The first wave in two steps: the 2-device run; then the 1-device runs, and resume-2to1 from the 2-device
        # run's resume state, deleted once read.
        Wave(tuple(first_two), lambda runs: first_two),
        Wave((FROM_FIRST[0], *first), first_one),  # resume-2to1 takes its slot first (Waves: in the wave's order)
        # From the 1-device run's checkpoints (whose complete states then keep their weights alone: footprint.py):
        # resume-1to2, then the evaluations and `continue` (one run's weights at a time beside that state).
        Wave(FROM_FIRST[1:2], resume_one),
        Wave(FROM_FIRST[2:], from_one),
        # The others that read the rounding reference's weights, whose checks then leave none to read them: 2 waves.
        *(Wave(names, lambda runs, names=names: others(runs, names)) for names in OTHERS_WAVES[:2]),
        # The one-step runs, float32 and the exact step, then bf16-mixed.
        *(Wave(names, lambda runs, names=names: step_jobs(runs, names)) for names in ONE_STEP_WAVES),
        *(Wave(names, lambda runs, names=names: others(runs, names)) for names in OTHERS_WAVES[2:]),
        # The 2-device float64 run again, only when a comparison asks how far two identical runs end apart.
        Wave(("2dev-fp64-again",), lambda runs: {"2dev-fp64-again": first_again()}),
        # The one-step runs from nudged states, only when a one-step check is over its bound (its second look).
        Wave(ONE_STEP_NUDGED, lambda runs: step_jobs(runs, ONE_STEP, NUDGE)),
    ]
    runs = Waves(base, waves, gate, processes)
    runs.rounding_reference = reference
    return runs


def processes(name: str) -> int:
    """How many processes the run `name` starts at once (its ranks, a torchrun's or SLURM's nodes)."""
    return 2 if "2dev" in name or name in TWO_PROCESSES else 1


def sharded_job(root: Path, steps: dict) -> dict:
    """Epoch 1 sharded over 2 processes (the library's model_parallel preset, float32: ModelParallelStrategy has
    no float64), epoch 2 resumed from its sharded checkpoint on 1; the weights at the end, gathered."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    args = sharded_args()
    two, one = root / "two", root / "one"
    root.mkdir()
    command(main_cmd("fit", *args, "--trainer.max_epochs", "1"), two, root / "two.log")()
    sharded = two / "lightning_logs/version_0/checkpoints/last.ckpt"
    one_device = ("--trainer.devices", "1", "--trainer.strategy.data_parallel_size", "1")
    resume = ("--trainer.max_epochs", "2", "--ckpt_path", str(sharded))
    files = sorted(p.name for p in sharded.glob("*.distcp"))
    command(main_cmd("fit", *args, *one_device, *resume), one, root / "one.log")()
    dcp_to_torch_save(one / "lightning_logs/version_0/checkpoints/last.ckpt", root / "full.pt")
    weights = torch.load(root / "full.pt", weights_only=True)["state_dict"]
    remove_checkpoints(root)  # read: what the check compares is returned
    return {"files": files, "weights": weights}


def link_checkpoints(source: str, destination: str) -> None:
    """copytree's copy function: a hard link for a checkpoint (written anew, never in place, by a later run), a copy
    for any other file."""
    os.link(source, destination) if source.endswith(".ckpt") else shutil.copy2(source, destination)


__all__ = ["SlurmJob", "shared_runs"]
