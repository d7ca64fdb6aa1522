"""`python main.py ...` without paying for its imports again: a server that has imported main.py once forks a
child per run.

Nearly all of a small run's cost is start-up (about 5 CPU-seconds to import torch and Lightning, 1 to train
the example 2 epochs), and the suite makes dozens of runs. The server (`python forkserver.py PROJECT`, with
stdin a pipe) imports the project's main.py as `python main.py` would, then reads one JSON request a line
({"args", "cwd", "env", "log", "entry", "ranks"}) and answers with the pid of a forked waiter, the leader of a new
session, which forks the run (or each of its `ranks`): `main.main()` (or, for entry "configured", configured.py's
measurement) with `sys.argv = [main.py, *args]`, its output in `log`. The waiter writes the run's exit status to
`log`.rc however the run ended: a return, an exception, ddpkit's `os._exit` on a failure path, a signal (128 + its
number). A run that wrote its own status could not do so from `os._exit`, and the suite then waited out its whole
timeout. Everything a run starts itself is a fresh process as usual: the second rank of Lightning's launcher runs
`python main.py <same argv>` (sys.argv and `__main__.__spec__ is None` say so, as for a script). A run asked with
`ranks` 2 is started the way torchrun starts one, both ranks forked here with LOCAL_RANK and MASTER_PORT set, so that
rank 1 does not import torch and Lightning again (~5 CPU-s).

The server is a plain script so that its `__main__` has no module spec (else Lightning would start rank 1 as
`python -m <server>`); nothing in it has touched CUDA or started a thread, so forking it is safe.
"""

import json
import os
import signal
import socket
import sys
import traceback


def waiter(request: dict, main) -> None:
    """In the forked waiter: a new session (a timeout kills it, the run and every rank the run starts), the run
    forked below it, and the run's exit status in `log`.rc once it has ended. With `ranks` N > 1 it forks every rank
    of a 1-node DDP run itself, as torchrun would start them (LOCAL_RANK, MASTER_ADDR, MASTER_PORT: Lightning then
    launches none), so that no rank pays the imports again; the first rank to fail ends the others."""
    code = 1
    try:
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the server ignores it; the waiter and the launcher wait
        ranks = request.get("ranks", 1)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)  # shared by the ranks
        port = free_port() if ranks > 1 else None
        pids = []
        for rank in range(ranks):
            pid = os.fork()
            if pid == 0:
                env = {"LOCAL_RANK": str(rank), "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
                child({**request, "env": {**request["env"], **(env if port else {})}}, main, log)
            pids.append(pid)
        code = 0
        while pids:
            pid, status = os.wait()
            pids.remove(pid)
            exited = os.waitstatus_to_exitcode(status)
            exited = 128 - exited if exited < 0 else exited  # killed by a signal: as a shell reports it
            if exited and not code:
                code = exited
                for other in pids:  # a rank that failed leaves the others waiting in a collective
                    os.kill(other, signal.SIGKILL)
    finally:
        # Written aside and renamed: a reader polling for the file never finds it empty (helpers.exit_status).
        with open(request["log"] + ".rc.part", "w") as rc:
            rc.write(str(code))
        os.replace(request["log"] + ".rc.part", request["log"] + ".rc")
        os._exit(0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child(request: dict, main, log: int) -> None:
    """In the run's process: become `python main.py *args` in `cwd` with `env`, run it, exit with its status."""
    code = 1
    try:
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.chdir(request["cwd"])
        os.environ.update(request["env"])
        extra_path = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[1:1] = extra_path  # PYTHONPATH comes after the script's directory, as at start-up
        sys.argv = [main.__file__, *request["args"]]
        if request.get("entry") == "configured":
            from ddpkit.testing.configured import cli as entry
        else:
            entry = main.main
        try:
            entry()
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            if not isinstance(stop.code, int | None):
                print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(project: str) -> None:
    sys.path[0] = project  # as `python main.py` puts main.py's directory first
    os.chdir(project)
    import main  # the project's main.py: torch, Lightning and ddpkit, imported once

    import ddpkit.testing.gradient_peaks  # noqa: F401  the callbacks the suite adds to its runs
    import ddpkit.testing.parity_probe  # noqa: F401
    import ddpkit.testing.rank_probe  # noqa: F401

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # waiters are reaped by the kernel; status goes to .rc
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            waiter(request, main)
        print(pid, flush=True)


if __name__ == "__main__":
    serve(sys.argv[1])
