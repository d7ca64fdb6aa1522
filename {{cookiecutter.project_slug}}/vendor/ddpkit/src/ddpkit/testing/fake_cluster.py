"""Stand-ins for a cluster on one machine: free ports, fake `srun`/`scontrol`, process groups with timeouts."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch

PROJECT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent

# srun stand-in: starts SLURM_NNODES x SLURM_NTASKS_PER_NODE copies of its command with the per-task
# variables real srun sets, each task's output in $FAKE_SRUN_LOGS/task<rank>.out, and forwards
# SIGUSR1/SIGTERM to every task (as SLURM signals every task of the job).
FAKE_SRUN = """\
    import os, signal, subprocess, sys
    args = sys.argv[1:]
    while args and args[0].startswith("-"):
        args = args[1:]  # srun's own options
    nodes, per_node = int(os.environ["SLURM_NNODES"]), int(os.environ["SLURM_NTASKS_PER_NODE"])
    logs = os.environ["FAKE_SRUN_LOGS"]
    os.makedirs(logs, exist_ok=True)
    open(os.path.join(logs, "srun.pid"), "w").write(str(os.getpid()))
    tasks = []
    for rank in range(nodes * per_node):
        env = {**os.environ, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % per_node),
               "SLURM_NODEID": str(rank // per_node)}
        out = open(os.path.join(logs, f"task{rank}.out"), "w")
        tasks.append(subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT))
    def forward(signum, frame):
        for t in tasks:
            t.send_signal(signum)
    signal.signal(signal.SIGUSR1, forward)
    signal.signal(signal.SIGTERM, forward)
    sys.exit(max(t.wait() for t in tasks))
"""
# scontrol stand-in: records its arguments; Lightning calls `scontrol requeue <job id>`.
FAKE_SCONTROL = 'echo "$@" >> "$FAKE_SCONTROL_LOG"\n'


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(**extra: str) -> dict[str, str]:
    """This interpreter first on PATH (`python` in the scripts), tests/ importable, unbuffered output."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    pythonpath = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PATH": path, "PYTHONPATH": pythonpath, "PYTHONUNBUFFERED": "1", **extra}


def slurm_env(tmp: Path, nodes: int, tasks_per_node: int, job_id: int) -> dict[str, str]:
    """The variables SLURM sets for a batch job of `nodes` x `tasks_per_node`, with fake srun/scontrol first on PATH."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(f"#!{sys.executable}\n" + textwrap.dedent(FAKE_SRUN))
    (bin_dir / "scontrol").write_text("#!/bin/sh\n" + FAKE_SCONTROL)
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    env = base_env(
        SLURM_JOB_ID=str(job_id),
        SLURM_JOB_NAME="train",  # not "bash"/"interactive", which Lightning treats as "not SLURM"
        SLURM_NNODES=str(nodes),
        SLURM_JOB_NUM_NODES=str(nodes),
        SLURM_NTASKS=str(nodes * tasks_per_node),
        SLURM_NTASKS_PER_NODE=str(tasks_per_node),
        SLURM_TASKS_PER_NODE=f"{tasks_per_node}(x{nodes})",
        SLURM_NODELIST="localhost",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        FAKE_SRUN_LOGS=str(tmp / "tasks"),
        FAKE_SCONTROL_LOG=str(tmp / "scontrol.log"),
    )
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    return env


def start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """Start `cmd` in the project directory in its own session (so a timeout can kill all it started)."""
    return subprocess.Popen(
        cmd, cwd=PROJECT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def finish(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """Wait for all; past `timeout` seconds kill every process they started and fail."""
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            kill_group(p)
        raise AssertionError(f"{[p.args for p in procs]} timed out after {timeout}s") from None


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL every process `proc` started (no-op when they are gone)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def last_checkpoint(root: Path) -> Path:
    """The run's last.ckpt (the log directory is version_<job id> under SLURM, version_0 otherwise)."""
    (path,) = root.glob("lightning_logs/version_*/checkpoints/last.ckpt")
    return path


def last_weights(root: Path, global_step: int) -> dict[str, torch.Tensor]:
    """The weights in last.ckpt, checked to be from `global_step`."""
    ckpt = torch.load(last_checkpoint(root), weights_only=True)
    assert ckpt["global_step"] == global_step
    return ckpt["state_dict"]
