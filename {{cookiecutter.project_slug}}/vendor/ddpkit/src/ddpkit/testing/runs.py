"""The real `main.py` runs the guarantee tests share, made once per session (`cpu_runs`).

Whatever config.yaml selects (your model and data once you point it at them) trains 2 epochs on CPU:
1 and 2 devices in float64, float32 and bf16-mixed (and in float64 with a CSV logger added and, if the
model takes one, a warmup + cosine learning-rate schedule), `torchrun`, gradient accumulation (1 device x 4
micro-batches, 2 devices x 2), runs resumed mid-epoch on the other device count (2 -> 1 from a copy of the
checkpoint tagged as written on GPUs), and `test` and `predict` on 1 and 2 devices.
test_parity, test_multinode and test_sharded read them; the sizes and steps come from the configured
data module (tests/configured.py).

Add arguments to every run (another model, a smaller set):
    PARITY_ARGS="--model my_model.MyModel" pytest tests/test_parity.py
"""

import json
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from fake_cuda import save_as_cuda
from helpers import MAIN, finish, kill, start

from ddpkit.parity import load_weights
from ddpkit.schedules import WarmupCosine

TESTS = Path(__file__).resolve().parent


@dataclass
class Run:
    """One finished run of main.py under its own root directory."""

    root: Path

    @property
    def version(self) -> Path:
        return self.root / "lightning_logs" / "version_0"

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
    fewer than 4 steps per epoch the resume points fall on epoch ends); accumulate with micro-batches of
    a quarter of the global batch when the data module takes a micro_batch_size that divides it."""
    n, batch = configured["steps_per_epoch"], configured["global_batch_size"]
    micro = batch // 4 if configured["takes_micro_batch_size"] and batch % 4 == 0 else None
    return {
        "steps_per_epoch": n,
        "two_to_one": max(1, 3 * n // 4),
        "one_to_two": n + max(1, n // 4),
        "micro_batch_size": micro,
        "takes_scheduler": configured.get("takes_scheduler", False),
    }


def run_args(steps: dict) -> list[str]:
    return [
        "--trainer.max_epochs",
        "2",
        "--trainer.log_every_n_steps",
        "1",  # every step's loss reaches the logger
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.enable_model_summary",
        "false",
        "--trainer.callbacks+=parity_probe.Probe",
        f"--trainer.callbacks.save_at_steps=[{steps['two_to_one']}, {steps['one_to_two']}]",
        # An epoch-end checkpoint of every epoch, besides the configured checkpoint callback.
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        "--trainer.callbacks.save_top_k=-1",
        *shlex.split(os.environ.get("PARITY_ARGS", "")),
    ]


def main_cmd(*args: str) -> list[str]:
    return [sys.executable, str(MAIN), *args]


def torchrun_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(MAIN), *args]


def fit(steps: dict, accelerator: str, devices: int, precision: str, *extra: str) -> list[str]:
    return [
        "fit",
        *("--trainer.accelerator", accelerator, "--trainer.devices", str(devices)),
        *("--trainer.precision", precision, *run_args(steps), *extra),
    ]


def run_all(commands: dict[str, list[str]], base: Path, timeout: float = 420) -> dict[str, Run]:
    """Run the commands at once, each in base/<name>, within `timeout` seconds for all; fail (and kill
    the rest) on any non-zero exit."""
    # PYTHONPATH: main.py imports the probe from tests/. One thread per process: runs share the cores.
    path = [str(TESTS), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {"PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": "1"}
    procs = {}
    try:
        for name, cmd in commands.items():
            root = base / name
            root.mkdir()
            procs[name] = start([*cmd, "--trainer.default_root_dir", str(root)], root, env)
        deadline = time.monotonic() + timeout
        for name, proc in procs.items():
            result = finish(proc, max(1.0, deadline - time.monotonic()))
            assert result.returncode == 0, f"run {name} exited {result.returncode}:\n{result.stdout[-4000:]}"
    finally:
        for proc in procs.values():
            kill(proc)
    return {name: Run(base / name) for name in commands}


@pytest.fixture(scope="session")
def steps(global_batch) -> dict:
    return plan(global_batch)


class Waves:
    """The runs by name, started a wave at a time when one of the wave's runs is first asked for, so that a
    selection of tests (`pytest -k ...`) starts only the runs it reads. A wave that fails fails every
    test that asks for it."""

    def __init__(self, base: Path, waves: list) -> None:
        self.base, self.waves, self.done = base, waves, {}

    def __getitem__(self, name: str) -> Run:
        if name not in self.done:
            (wave,) = [w for w in self.waves if name in w.names]
            if wave.error:  # started once and failed: not again
                raise AssertionError(wave.error)
            try:
                self.done |= run_all(wave.commands(self), self.base)
            except AssertionError as error:
                wave.error = str(error)
                raise
        return self.done[name]


@dataclass
class Wave:
    names: tuple[str, ...]
    commands: object  # (Waves) -> {name: command}; may read the runs of an earlier wave
    error: str = ""


def as_cuda(run: Run, steps: dict) -> Path:
    """`run`'s checkpoint 3/4 into epoch 0, saved again with every tensor tagged as stored on cuda:0."""
    path = run.mid_checkpoint(steps["two_to_one"])
    cuda = path.with_name(f"{path.stem}-cuda.ckpt")
    if not cuda.exists():
        save_as_cuda(torch.load(path, map_location="cpu", weights_only=False), cuda)
    return cuda


@pytest.fixture(scope="session")
def cpu_runs(tmp_path_factory, steps) -> Waves:
    """Every CPU run the tests compare, in three waves: 1 and 2 devices in float64, which the others are
    compared with (alone, so that a selection of the tests that read only these two starts only them); the
    other fits; the resumes and evaluations from the first wave's checkpoints."""
    micro = ("--data.micro_batch_size", str(steps["micro_batch_size"]))
    first = {
        "1dev-fp64": main_cmd(*fit(steps, "cpu", 1, "64-true")),
        "2dev-fp64": main_cmd(*fit(steps, "cpu", 2, "64-true")),  # Lightning's own launcher
    }
    more = {
        "1dev-fp32": main_cmd(*fit(steps, "cpu", 1, "32-true")),
        "2dev-fp32": main_cmd(*fit(steps, "cpu", 2, "32-true")),
        "torchrun-fp64": torchrun_cmd(*fit(steps, "cpu", 2, "64-true")),
        "1dev-acc4-fp64": main_cmd(*fit(steps, "cpu", 1, "64-true", *micro)),
        "2dev-acc2-fp64": main_cmd(*fit(steps, "cpu", 2, "64-true", *micro)),
        "1dev-bf16": main_cmd(*fit(steps, "cpu", 1, "bf16-mixed")),
        "2dev-bf16": main_cmd(*fit(steps, "cpu", 2, "bf16-mixed")),
    }
    # A second logger (CSV, full float64 precision) and, when the model takes one, a warmup + cosine schedule.
    lr_csv = ["--trainer.logger+=CSVLogger"]
    if steps["takes_scheduler"]:
        schedule = f"{WarmupCosine.__module__}.WarmupCosine"
        warmup = str(max(1, steps["steps_per_epoch"] // 2))
        lr_csv += ["--model.scheduler", schedule, "--model.scheduler.warmup_steps", warmup]
    more |= {f"{n}dev-lr-csv": main_cmd(*fit(steps, "cpu", n, "64-true", *lr_csv)) for n in (1, 2)}
    if not steps["micro_batch_size"]:  # the data module takes none, or the global batch has no quarter
        more = {name: cmd for name, cmd in more.items() if "-acc" not in name}
    test = ("test", "--trainer.accelerator", "cpu", "--trainer.precision", "64-true", *run_args(steps))
    predict = ("predict", *test[1:])

    def second(runs: Waves) -> dict[str, list[str]]:
        one, two = runs["1dev-fp64"], runs["2dev-fp64"]
        return {
            # From 2 devices' checkpoint with its tensors tagged cuda:0, as one written on GPUs.
            "resume-2to1": main_cmd(*fit(steps, "cpu", 1, "64-true", "--ckpt_path", str(as_cuda(two, steps)))),
            "resume-1to2": main_cmd(
                *fit(steps, "cpu", 2, "64-true", "--ckpt_path", str(one.mid_checkpoint(steps["one_to_two"])))
            ),
            "test-1dev": main_cmd(*test, "--trainer.devices", "1", "--ckpt_path", str(one.checkpoint())),
            "test-2dev": main_cmd(*test, "--trainer.devices", "2", "--ckpt_path", str(one.checkpoint())),
            "predict-1dev": main_cmd(*predict, "--trainer.devices", "1", "--ckpt_path", str(one.checkpoint())),
            "predict-2dev": main_cmd(*predict, "--trainer.devices", "2", "--ckpt_path", str(one.checkpoint())),
        }

    waves = [
        Wave(tuple(first), lambda runs: first),
        Wave(tuple(more), lambda runs: more),
        Wave(("resume-2to1", "resume-1to2", "test-1dev", "test-2dev", "predict-1dev", "predict-2dev"), second),
    ]
    return Waves(tmp_path_factory.mktemp("runs"), waves)
