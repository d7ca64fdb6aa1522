"""No rank outlives the job: a rank whose launcher is gone exits; a launcher that fails kills the ranks it started.

Lightning's launcher already kills the whole job within ~5 s when a started rank exits non-zero; a
rank that hangs is caught by the process-group timeout (`--dist_timeout`), after which the failing
rank ends the job.
"""

import os
import sys
import threading
import time
from typing import Any

from ..lightning_internals import launched_processes

# The launcher's pid, inherited by the ranks it starts: they exit when it is gone.
LAUNCHER_PID = "DDP_LAUNCHER_PID"


def rank_label() -> str:
    """This process's rank as Lightning's launcher or torchrun set it (0 before they do)."""
    return os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))


def exit_now(code: int) -> None:
    """Exit without interpreter shutdown, which can block in a broken process group's destructor."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


_launcher: Any = None  # Lightning's launcher in this process, if it starts the other ranks of the node
_stopping = threading.Event()  # set once the ranks agreed on a graceful stop: their exits are expected


def children() -> list[Any]:
    """The rank processes the launcher started (it rebuilds its list when it starts them)."""
    return launched_processes(_launcher)


def child_rank(index: int) -> int:
    """Global rank of the launcher's child `index` (0-based; the launcher itself is local rank 0)."""
    return int(os.environ.get("NODE_RANK", 0)) * (len(children()) + 1) + index + 1


def register_launcher(launcher: Any) -> None:
    """Remember the launcher, to name and kill the ranks it started when something fails, and tell those ranks
    (through their inherited environment: Lightning starts them after this) which process to watch."""
    global _launcher
    _launcher = launcher
    os.environ[LAUNCHER_PID] = str(os.getpid())


def stop_children() -> list[int]:
    """SIGKILL every launched rank still running (they may be stuck in a collective); return their local ranks."""
    procs = children()
    alive = [child_rank(i) for i, proc in enumerate(procs) if proc.poll() is None]
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        proc.wait()
    return alive


def failed_children(wait: float = 0.0) -> list[tuple[int, int]]:
    """(rank, exit code) of every launched rank that exited with an error, waiting up to `wait` s for one.

    A rank that crashes closes its sockets a moment before its exit status is
    visible: the wait lets the launcher blame the rank that died, not itself.
    """
    deadline = time.monotonic() + (wait if children() else 0.0)
    while True:
        failed = [(child_rank(i), proc.returncode) for i, proc in enumerate(children()) if proc.poll()]
        if failed or time.monotonic() >= deadline:
            return failed
        time.sleep(0.05)


def watch_children(period: float = 0.5) -> None:
    """In the launcher: when a rank it started exits with an error, name it and end the whole job.

    Lightning's own observer does the same every 5 s without saying which rank
    in the default log level; a NCCL job would otherwise wait for the timeout.
    """

    def watch() -> None:
        while True:
            time.sleep(period)
            failed = failed_children()
            if failed and not _stopping.is_set():
                rank, code = failed[0]
                sys.stderr.write(f"error: rank {rank} exited with code {code}; stopping the other ranks\n")
                stop_children()
                exit_now(1)

    threading.Thread(target=watch, name="watch-children", daemon=True).start()


def watch_parent(period: float = 1.0, parent: int | None = None, who: str = "the launcher") -> None:
    """Exit this rank when the process that started it dies (e.g. `kill -9` of the launcher).

    Without this, a rank blocked in a collective stays until the process-group
    timeout, or forever when it is stuck elsewhere. `parent`: the pid to watch (default: the launcher's); rank 0
    of a tuning trial watches its worker (`who`) and takes the ranks it started with it.
    """
    # Lightning's launcher names itself in the environment, which also covers a launcher already gone by now.
    # torchrun's ranks watch their agent: a launcher pid they inherited from whatever started torchrun (a
    # `python main.py` run in the same shell session, a test runner) is not theirs.
    named = os.environ.get(LAUNCHER_PID) if "TORCHELASTIC_RUN_ID" not in os.environ else None
    parent = parent or int(named or os.getppid())

    def watch() -> None:
        while True:
            time.sleep(period)
            if os.getppid() != parent:
                sys.stderr.write(f"rank {rank_label()}: {who} (pid {parent}) is gone; exiting\n")
                stop_children()  # the ranks this process launched, if any
                exit_now(1)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


def mark_stopping() -> None:
    """The ranks agreed to stop: their exits from now on are expected, not failures."""
    _stopping.set()
