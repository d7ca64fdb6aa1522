"""The scaling gap (ddp/gap.py, `scaling.py --explain`) on runs whose cause is known: the sleeping model of
tests/sleepy.py on 1, 2, 4 and 8 CPU processes, each cause injected on its own. Machinery tests."""

import json
import sys
from pathlib import Path

import pytest
from helpers import MAIN, finish, kill, start

from {{ cookiecutter.package_name }}.ddp.gap import explain

pytestmark = pytest.mark.machinery

TESTS = Path(__file__).resolve().parent
STEPS = 20  # 3 warm-up + 17 timed
FIT = [
    "fit",
    *("--config", str(TESTS / "toy.yaml"), "--model", "sleepy.Sleepy", "--data", "sleepy.SleepyData"),
    *("--trainer.accelerator", "cpu", "--trainer.max_steps", str(STEPS), "--trainer.num_sanity_val_steps", "0"),
    *("--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"),
    *("--doctor.measure_comm", "true"),
]
# Sleepy's defaults: 20 ms fixed + 2 ms per sample of compute, 64 samples per step: 148 ms on 1 device,
# 36 ms on 8 (ideal 18.5 ms): at 8 devices the per-device batch is too small for the fixed cost.
SLEEPY = ("--model.fixed_ms", "20")
CASES = {  # name: (devices, extra args, pinned to one core)
    "clean-1": (1, SLEEPY, False),
    "clean-2": (2, SLEEPY, False),
    "clean-4": (4, SLEEPY, False),
    "clean-8": (8, SLEEPY, False),
    # 60 ms of loading per batch, whatever its size: 30 ms per step above the ideal at 2 devices.
    "data-1": (1, (*SLEEPY, "--data.batch_delay_ms", "60"), False),
    "data-2": (2, (*SLEEPY, "--data.batch_delay_ms", "60"), False),
    # 64 MB of gradients all-reduced over gloo every step.
    "grad-1": (1, (*SLEEPY, "--model.grad_mb", "64"), False),
    "grad-2": (2, (*SLEEPY, "--model.grad_mb", "64"), False),
    # Rank 1 computes 60 ms longer; compared with clean-1, where there is no rank 1.
    "straggler-2": (2, (*SLEEPY, "--model.straggler_ms", "60"), False),
    # Real CPU work, 2 ranks on 1 core.
    "oversub-1": (1, (*SLEEPY, "--model.spin", "true"), True),
    "oversub-2": (2, (*SLEEPY, "--model.spin", "true"), True),
}
PIN = "import os, runpy, sys; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); sys.argv = sys.argv[1:]; "
PIN += "runpy.run_path(sys.argv[0], run_name='__main__')"


def run_cases(base: Path, cases: dict, timeout: float = 600) -> dict[str, dict]:
    """Start every case at once (start-up overlaps), let them train one at a time (sleepy.TURNS); return
    each case's doctor summary."""
    turns = base / "turns"
    turns.mkdir()
    env = {"PYTHONPATH": str(TESTS), "OMP_NUM_THREADS": "1", "SLEEPY_TURNS": f"{turns},{len(cases)}"}
    procs = {}
    try:
        for name, (devices, args, pinned) in cases.items():
            root = base / name
            root.mkdir()
            cmd = [sys.executable, *(("-c", PIN) if pinned else ()), str(MAIN), *FIT, "--trainer.devices", str(devices)]
            procs[name] = start([*cmd, *args, "--trainer.default_root_dir", str(root)], root, env)
        for name, proc in procs.items():
            result = finish(proc, timeout)
            assert result.returncode == 0, f"{name} exited {result.returncode}:\n{result.stdout[-4000:]}"
    finally:
        for proc in procs.values():
            kill(proc)
    return {name: json.loads(next((base / name).rglob("doctor.json")).read_text()) for name in cases}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    return run_cases(tmp_path_factory.mktemp("gap"), CASES)


def gap(runs: dict, base: str, run: str) -> dict:
    e = explain(runs[base], runs[run])
    print(base, run, {k: round(v, 1) for k, v in e["parts_ms"].items()}, round(e["gap_ms"], 1), e["verdict"])
    return e
