"""Run the project's `main.py` in a subprocess with a hard timeout, as the suite and users' own checks do.

The project is the directory pytest runs in (its rootdir, where pyproject.toml is): the plugin sets it
with `set_project` before any test runs; outside pytest it is the working directory.
"""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
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


class ForkServer:
    """The client of forkserver.py: runs of main.py forked from one process that has imported it. By default the
    server is this interpreter's and serves `project()`; `python`, `root` and `env` give another environment's (the
    template's tests run a baked project's documented commands in the project's own virtual environment)."""

    def __init__(self, python: str | None = None, root: Path | None = None, env: dict | None = None) -> None:
        self.lock, self.server, self.root = threading.Lock(), None, None
        self.python, self.fixed_root, self.env = python or sys.executable, root, env

    def fork(self, args: list[str], cwd: Path, env: dict, log: Path, entry: str, ranks: int = 1) -> int:
        """Start `python main.py *args` (forked; `ranks` > 1: every rank of a 1-node DDP run forked); return its pid,
        which is also its process group."""
        root = self.fixed_root or project()
        with self.lock:
            if self.server is not None and self.root != root:  # imported another project's main.py
                self.close()
            if self.server is None or self.server.poll() is not None:
                self.root = root
                server = [self.python, str(Path(__file__).with_name("forkserver.py")), str(root)]
                # One thread per process, as each run gets: torch reads it when the server imports it.
                server_env = {**(self.env or os.environ), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
                self.server = subprocess.Popen(server, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                               env=server_env, start_new_session=True)  # fmt: skip
            request = {"args": [str(a) for a in args], "cwd": str(cwd), "env": env, "log": str(log), "entry": entry}
            request["ranks"] = ranks
            self.server.stdin.write(json.dumps(request) + "\n")
            self.server.stdin.flush()
            line = self.server.stdout.readline()
        assert line.strip().isdigit(), f"the fork server did not start the run: {line!r}"
        return int(line)

    def close(self) -> None:
        """End the server (a run it forked goes on to its end)."""
        if self.server is not None:
            kill(self.server)
            self.server.wait()
            self.server = None


FORK_SERVER = ForkServer()


def alive(group: int) -> bool:
    """Whether any process of the process group `group` is still running."""
    try:
        os.killpg(group, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # a member that is not ours: still running
        return True


def exit_status(log: Path) -> int | None:
    """The exit status of a run forked with output `log`, which its waiter writes beside the output once the run has
    ended (forkserver.py); None until then."""
    try:
        return int(Path(f"{log}.rc").read_text())
    except FileNotFoundError:
        return None


def run_main(
    *args: str,
    cwd: Path,
    timeout: float = 180,
    env: dict | None = None,
    log: Path | None = None,
    entry: str = "main",
    ranks: int = 1,
    server: ForkServer = FORK_SERVER,
) -> subprocess.CompletedProcess:
    """Run `python main.py *args` (forked from a process that has imported main.py once, forkserver.py; with `ranks`
    > 1 every rank of a 1-node DDP run is forked, as torchrun would start them, instead of Lightning's launcher
    starting ranks 1.. as fresh processes); on timeout kill every process it started, then fail. Returns a
    CompletedProcess with the output.

    The run gets its own session, so the DDP ranks it launches share one process group, and the run has
    finished when the whole group has: a hang ends with all of them killed instead of blocking the suite.
    """
    temporary = log is None  # then the output is only returned: nothing is left in the temporary folder
    if temporary:
        log = Path(tempfile.mkstemp(prefix="main-", suffix=".log")[1])
    rc = Path(f"{log}.rc")
    rc.unlink(missing_ok=True)
    env = {"PYTHONUNBUFFERED": "1", **(env or {})}
    try:
        pid = server.fork(list(args), cwd, env, log, entry, ranks)
        deadline = time.monotonic() + timeout
        while (code := exit_status(log)) is None or alive(pid):  # its status, and the end of every rank it started
            if code is not None and deadline > time.monotonic() + RANKS_GRACE:
                deadline = time.monotonic() + RANKS_GRACE  # it has ended: its ranks get a few seconds, no more
            if time.monotonic() > deadline:
                if alive(pid):
                    os.killpg(pid, signal.SIGKILL)
                if code is not None:  # ended, but a rank it started did not: report the run's own end
                    break
                out = log.read_text()
                raise AssertionError(f"main.py {' '.join(args)} timed out after {timeout}s:\n{out[-4000:]}")
            time.sleep(0.05)
        return subprocess.CompletedProcess(["main.py", *args], code, log.read_text(), None)
    finally:
        if temporary:
            log.unlink(missing_ok=True)
            rc.unlink(missing_ok=True)


# A rank that could not listen on its port: another run took the free port it was given in between (the runs start
# together). Not the project's failure: the run (commands.command) or the cluster job (fake_cluster) starts again,
# in a clean folder, at most PORT_RETRIES times.
PORT_TAKEN = re.compile(r"EADDRINUSE|address already in use", re.IGNORECASE)
PORT_RETRIES = 2

# Seconds a run's ranks may outlive it before they are killed: ddpkit's ranks exit within 1 s of their launcher.
RANKS_GRACE = 10.0

# The last line of a raised exception's traceback.
ERROR_LINE = re.compile(r"^(\w+\.)*\w*(Error|Exception|Interrupt|Exit)\b.*$")


def headline(output: str) -> str:
    """The line of a run's output that says why it failed: its first `error:` line (a rank's own comes before the
    launcher's "rank 1 exited"), else its last exception line, else its last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    exceptions = [line for line in lines if ERROR_LINE.match(line)]
    return errors[0] if errors else (exceptions or lines or ["(no output)"])[-1]


def run_ok(*args: str, cwd: Path, timeout: float = 180, env: dict | None = None) -> str:
    """Like `run_main`, but fail with the tail of the output unless it exits 0; return the output."""
    result = run_main(*args, cwd=cwd, timeout=timeout, env=env)
    assert result.returncode == 0, (
        f"main.py {' '.join(args)} exited {result.returncode}: {headline(result.stdout)}\n{result.stdout[-4000:]}"
    )
    return result.stdout


def concurrently(job: Callable, names: Iterable[str]) -> dict:
    """`job(name)` for every name at once, as {name: result}: most of a short run is start-up, which
    overlaps. The first job that raises fails the call (after the others have ended)."""
    names = list(names)
    with ThreadPoolExecutor(len(names)) as pool:
        return dict(zip(names, pool.map(job, names), strict=True))
