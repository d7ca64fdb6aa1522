"""Real processes for the library's tests: the toy model through the project CLI (`python -m ddpkit.toy`, or forked
from a server that imported it: `toy`), each run in its own session with a hard timeout, so a hung DDP job ends with
all its ranks killed."""

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ddpkit.testing import fake_cuda
from ddpkit.testing.helpers import ForkServer, run_main

TESTS = Path(__file__).resolve().parent
TOY = [sys.executable, "-m", "ddpkit.testing.toy"]  # a project's `python main.py`, on the library's own toy model
# The test-only models (doctor_cases.py, sleepy.py) are selected by class path from this folder.
ON_PATH = {"PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}


def start(cmd: list[str], cwd: Path, env: dict | None = None, **popen) -> subprocess.Popen:
    """Start `cmd` in its own session (one process group with every rank it launches); output to a pipe."""
    popen.setdefault("stdout", subprocess.PIPE)
    full_env = {**os.environ, **ON_PATH, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.Popen(
        cmd, cwd=cwd, env=full_env, stderr=subprocess.STDOUT, text=True, start_new_session=True, **popen
    )


def kill(proc: subprocess.Popen) -> None:
    """Kill the process group of a process from `start`: the process and any rank it left behind."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the whole group has already exited


def finish(proc: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    """Wait for a process from `start`; on timeout kill its whole group, then fail with its output."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill(proc)
        out, _ = proc.communicate()
        # out is None when the output went to a file (the tune workers'): the caller's file holds it
        raise AssertionError(f"{' '.join(proc.args)} timed out after {timeout}s:\n{(out or '')[-4000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, None)


def run(cmd: list[str], cwd: Path, timeout: float = 180, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `cmd` to the end (see `finish`)."""
    return finish(start(cmd, cwd, env), timeout)


# A run of the toy is forked from a server that imported the toy's CLI once (ddpkit/testing/forkserver.py, as the
# suite's runs are): the same CLI from `main()` on, less the ~5 CPU-s of imports a fresh interpreter pays. A run given
# a variable that acts when an interpreter starts (PYTHON*, OpenMP's, the fake GPUs' sitecustomize) starts as
# `python -m ddpkit.testing.toy`; so do the tests' own `TOY` commands. Rank 1 of a 2-device run is Lightning's
# launcher's fresh `python main.py`, as in a project.
AT_START = ("PYTHON", "OMP_", "MKL_", "FAKE_CUDA")
TOY_MAIN = """import ddpkit.run.cli  # noqa: F401  the CLI's imports, once in the server
from ddpkit.testing.toy import main

if __name__ == "__main__":
    main()
"""
_toy_server: list[ForkServer] = []
_toy_lock = threading.Lock()


def toy_server() -> ForkServer:
    """The fork server of the toy's main.py (one per session, started at its first run)."""
    with _toy_lock:
        if not _toy_server:
            root = Path(tempfile.mkdtemp(prefix="toy-main-"))
            (root / "main.py").write_text(TOY_MAIN)
            _toy_server.append(ForkServer(root=root, env={**os.environ, **ON_PATH}))
            atexit.register(shutil.rmtree, root, ignore_errors=True)
        return _toy_server[0]


def forks(env: dict | None) -> bool:
    """Whether a toy run given the variables `env` is forked (none of them acts at an interpreter's start)."""
    return not any(name.startswith(AT_START) and name != "PYTHONUNBUFFERED" for name in env or {})


def toy(*args: str, cwd: Path, timeout: float = 180, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m ddpkit.toy *args`: the project CLI on the toy model (forked where it can be, above)."""
    if not forks(env):
        return run([*TOY, *args], cwd, timeout, env)
    # The whole environment as it is now: the server's is the one it started with.
    env = {**os.environ, **ON_PATH, **(env or {})}
    return run_main(*args, cwd=cwd, timeout=timeout, env=env, server=toy_server())


def toy_ok(*args: str, cwd: Path, timeout: float = 180, env: dict | None = None) -> str:
    """Like `toy`, but fail with the tail of the output unless it exits 0; return the output."""
    result = toy(*args, cwd=cwd, timeout=timeout, env=env)
    assert result.returncode == 0, (
        f"ddpkit.testing.toy {' '.join(args)} exited {result.returncode}:\n{result.stdout[-4000:]}"
    )
    return result.stdout


def concurrently(job: Callable, names: Iterable[str], workers: int | None = None) -> dict:
    """`job(name)` for every name, `workers` at a time (default all), as {name: result}: most of a short run
    is start-up, which overlaps. The first job that raises fails the call (after the others have ended)."""
    names = list(names)
    with ThreadPoolExecutor(workers or len(names)) as pool:
        return dict(zip(names, pool.map(job, names), strict=True))


# Run at the start-up of every interpreter of a test's run (a `sitecustomize` on its PYTHONPATH): the guarantee
# suite's hook, which reports FAKE_CUDA_DEVICES GPUs to code that only asks torch.cuda whether and how many, so
# the CLI's and the preflight's GPU branches are taken on any machine; nothing can run on them.
FAKE_CUDA = fake_cuda.SITECUSTOMIZE


def fake_gpus_env(site: Path, gpus: int, extra_startup: str = "") -> dict[str, str]:
    """Environment for a process that sees `gpus` GPUs; `site` is a fresh folder for the start-up hook."""
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(extra_startup + FAKE_CUDA)
    return {"FAKE_CUDA_DEVICES": str(gpus), "PYTHONPATH": os.pathsep.join([str(site), ON_PATH["PYTHONPATH"]])}
