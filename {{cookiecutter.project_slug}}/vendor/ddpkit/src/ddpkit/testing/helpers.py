"""Run the project's `main.py` in a subprocess with a hard timeout, as the suite and users' own checks do.

The project is the directory pytest runs in (its rootdir, where pyproject.toml is): the plugin sets it
with `set_project` before any test runs; outside pytest it is the working directory.
"""

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_project = Path.cwd()


def set_project(root: Path) -> None:
    global _project
    _project = Path(root).resolve()


def project() -> Path:
    """The project's root directory: where its main.py, config.yaml and cluster/ scripts are."""
    return _project


def main_py() -> Path:
    return _project / "main.py"


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
        raise AssertionError(f"{' '.join(map(str, proc.args))} timed out after {timeout}s:\n{out[-4000:]}") from None
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
    return finish(start([sys.executable, str(main_py()), *args], cwd, env), timeout)


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
