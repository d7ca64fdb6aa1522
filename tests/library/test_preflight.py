"""`python -m ddpkit.scaling --preflight`: the ranks, the backend and the workers a run would get, checked before
any training (GPUs faked: procs.fake_gpus_env)."""

import os
import subprocess
import sys
from pathlib import Path

import early
import pytest
from procs import concurrently, fake_gpus_env

SCALING = [sys.executable, "-m", "ddpkit.scaling", "--main", "ddpkit.testing.toy"]

PREFLIGHTS = {  # name: (GPUs visible, fit args)
    "2 GPUs, cpu": (2, ("--trainer.accelerator", "cpu", "--data.num_workers", "3")),
    "1 GPU, auto": (1, ()),
}


@early.early("preflight")
def preflights(base: Path) -> dict[str, subprocess.CompletedProcess]:
    """`--preflight --devices 2 -- ARGS` with GPUs faked (procs.FAKE_CUDA), both at once; started early
    (early.py): they time nothing."""

    def preflight(name: str) -> subprocess.CompletedProcess:
        gpus, fit_args = PREFLIGHTS[name]
        env = {**os.environ, **fake_gpus_env(base / f"site{gpus}", gpus)}
        cmd = [*SCALING, "--preflight", "--devices", "2", "--", *fit_args]
        return subprocess.run(cmd, cwd=base, env=env, capture_output=True, text=True, timeout=300)

    return concurrently(preflight, PREFLIGHTS)


@pytest.fixture(scope="module")
def preflight() -> dict[str, subprocess.CompletedProcess]:
    return early.result("preflight")


def test_preflight_reports_ranks_backend_and_workers(preflight):
    """`--preflight --devices 2 -- --trainer.accelerator cpu` where 2 GPUs are visible (faked):
    gloo, two CPU ranks that all-reduce, the configured workers."""
    result = preflight["2 GPUs, cpu"]
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "visible devices (torch.cuda.device_count()): 2" in out and "backend: gloo" in out
    assert "dataloader workers per rank (--data.num_workers): 3" in out
    assert "   0 | cpu |" in out and "   1 | cpu |" in out and "ok: 2 processes joined one gloo group" in out


def test_preflight_on_gpus_names_nccl_and_refuses_more_ranks_than_gpus(preflight):
    """With 1 GPU visible (faked) and the accelerator left to `auto`, 2 ranks: backend nccl, refused before any
    rank starts."""
    result = preflight["1 GPU, auto"]
    assert result.returncode == 1, result.stdout + result.stderr
    assert "backend: nccl" in result.stdout and "rank |" not in result.stdout
    assert result.stderr.strip().splitlines()[-1] == "2 devices requested but only 1 visible"
