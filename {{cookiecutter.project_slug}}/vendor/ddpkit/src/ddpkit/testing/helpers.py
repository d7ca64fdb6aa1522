"""Run `main.py` in a subprocess with a hard timeout, as the tests and users' own checks do."""

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ddpkit.parity import load_weights

PROJECT = Path(__file__).resolve().parents[1]
MAIN = PROJECT / "main.py"


def start(cmd: list[str], cwd: Path, env: dict | None = None) -> subprocess.Popen:
    """Start `cmd` in its own session, so the DDP ranks it launches share one process group to kill."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.Popen(
        cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def finish(proc: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    """Wait for a process from `start`; on timeout kill every process it started, then fail."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill(proc)
        out, _ = proc.communicate()
        raise AssertionError(f"{' '.join(proc.args)} timed out after {timeout}s:\n{out[-4000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, None)


def kill(proc: subprocess.Popen) -> None:
    """Kill the process group of a process from `start`: the process and any rank it left behind."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the whole group has already exited


def run_main(*args: str, cwd: Path, timeout: float = 180, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python main.py *args`; on timeout kill every process it started, then fail.

    The run gets its own session, so the DDP ranks it launches share one process
    group and a hang ends with all of them killed instead of blocking the suite.
    """
    return finish(start([sys.executable, str(MAIN), *args], cwd, env), timeout)


def run_ok(*args: str, cwd: Path, timeout: float = 180, env: dict | None = None) -> str:
    """Like `run_main`, but fail with the tail of the output unless it exits 0; return the output."""
    result = run_main(*args, cwd=cwd, timeout=timeout, env=env)
    assert result.returncode == 0, f"main.py {' '.join(args)} exited {result.returncode}:\n{result.stdout[-4000:]}"
    return result.stdout


def concurrently(job: Callable, names: Iterable[str]) -> dict:
    """`job(name)` for every name at once, as {name: result}: most of a short run is start-up, which
    overlaps. The first job that raises fails the call (after the others have ended)."""
    names = list(names)
    with ThreadPoolExecutor(len(names)) as pool:
        return dict(zip(names, pool.map(job, names), strict=True))


# torch.compile on CPU writes C++ and builds it with the system's compiler (CXX, else g++ / c++ / clang++).
needs_compiler = pytest.mark.skipif(
    not any(shutil.which(c) for c in (os.environ.get("CXX"), "g++", "c++", "clang++") if c),
    reason="torch.compile on CPU needs a C++ compiler (set CXX or install g++)",
)


def fit_eager_and_compiled(root: Path, *args: str, timeout: float = 600) -> tuple[dict, dict]:
    """`main.py fit *args` twice at once on 1 CPU process in float64, as written and with `--model.compile
    true` (a module that takes a `compile` argument, like the examples); the weights of each run's last
    checkpoint. The compiled run's first steps wait for torch.compile (tens of seconds on CPU)."""
    common = ("--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.precision", "64-true")
    common += ("--trainer.enable_progress_bar", "false", "--doctor.enabled", "false")

    def fit(name: str) -> dict:
        compiled = ("--model.compile", "true") if name == "compiled" else ()
        out = ("--trainer.default_root_dir", str(root / name))
        run_ok("fit", *args, *common, *compiled, *out, cwd=root, timeout=timeout)
        return load_weights(root / name / "lightning_logs/version_0/checkpoints/last.ckpt")

    runs = concurrently(fit, ("eager", "compiled"))
    return runs["eager"], runs["compiled"]
