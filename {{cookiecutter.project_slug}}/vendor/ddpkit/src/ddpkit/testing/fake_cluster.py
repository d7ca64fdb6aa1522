"""A cluster on one machine: free ports, fake `srun`/`scontrol`, a SLURM job array's variables, process groups with
timeouts, and the two cluster jobs the suite runs with the project's own launch scripts (cluster/torchrun.sh,
cluster/slurm.sbatch)."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from .helpers import PORT_RETRIES, PORT_TAKEN, project

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
    """This interpreter first on PATH (`python` in the scripts), unbuffered output, one thread per process."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "PATH": path, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **extra}


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


def slurm_array_env(array_job_id: int, task: int, tasks: int) -> dict[str, str]:
    """The variables SLURM sets in task `task` of `sbatch --array=0-<tasks - 1>` of 1-node, 1-task jobs (each task is
    a batch job of its own, with its own job id), as cluster/tune.sbatch asks for."""
    return base_env(
        SLURM_JOB_ID=str(array_job_id + task),
        SLURM_ARRAY_JOB_ID=str(array_job_id),
        SLURM_ARRAY_TASK_ID=str(task),
        SLURM_ARRAY_TASK_COUNT=str(tasks),
        SLURM_ARRAY_TASK_MIN="0",
        SLURM_ARRAY_TASK_MAX=str(tasks - 1),
        SLURM_JOB_NAME="tune",
        SLURM_NNODES="1",
        SLURM_JOB_NUM_NODES="1",
        SLURM_NTASKS="1",
        SLURM_NTASKS_PER_NODE="1",
        SLURM_TASKS_PER_NODE="1",
        SLURM_PROCID="0",
        SLURM_LOCALID="0",
        SLURM_NODEID="0",
        SLURM_NODELIST="localhost",
    )


def sbatch_options(script: Path) -> dict[str, str]:
    """The `#SBATCH --name=value` lines of a batch script, as {name: value}."""
    lines = [line.split(None, 1)[1] for line in script.read_text().splitlines() if line.startswith("#SBATCH ")]
    return dict(line.removeprefix("--").split("=", 1) for line in lines)


def start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """Start `cmd` in the project directory in its own session (so a timeout can kill all it started)."""
    return subprocess.Popen(
        cmd, cwd=project(), env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
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


Job = TypeVar("Job")  # a finished cluster job: ClusterRun or SlurmJob


@dataclass
class ClusterRun:
    """A finished cluster job: its default_root_dir, exit codes, and each process's output."""

    root: Path
    codes: list[int]
    outputs: list[str]


def port_taken(codes: list[int], outputs: list[str]) -> bool:
    """Whether a cluster job failed because another run took the free port it was given before its rendezvous
    listened on it (the runs start together): not the project's failure. Seen in CI on 2026-12-08, a SLURM job of
    the oldest releases' session; such a job starts again, with another port, at most PORT_RETRIES times."""
    return any(codes) and any(PORT_TAKEN.search(out) for out in outputs)


def again_where_port_taken(job: Callable[[], Job], folder: Path, outputs: Callable[[Job], list[str]]) -> Job:
    """`job()`, and again in a clean `folder` (which it makes) where its port was taken, at most PORT_RETRIES times."""
    for _ in range(PORT_RETRIES):
        done = job()
        if not port_taken(done.codes, outputs(done)):
            return done
        shutil.rmtree(folder)
    return job()


def torchrun_nodes_job(root: Path, args: list[str]) -> ClusterRun:
    """cluster/torchrun.sh as 2 agents x 1 process (c10d rendezvous on localhost), `fit *args`; the agents'
    outputs. Again, in a clean folder, where the rendezvous port was taken (port_taken)."""
    return again_where_port_taken(lambda: _torchrun_nodes_job(root, args), root, lambda job: job.outputs)


def _torchrun_nodes_job(root: Path, args: list[str]) -> ClusterRun:
    root.mkdir()
    port = free_port()
    env = base_env(NNODES="2", GPUS_PER_NODE="1", RDZV_ENDPOINT=f"localhost:{port}", RDZV_ID=f"test{port}")
    cmd = ["bash", "cluster/torchrun.sh", *args, "--trainer.default_root_dir", str(root)]
    agents = [start(cmd, env, root.with_name(f"{root.name}-agent{i}.log")) for i in range(2)]
    codes = finish(agents, timeout=300)
    return ClusterRun(root, codes, [root.with_name(f"{root.name}-agent{i}.log").read_text() for i in range(2)])


SLURM_JOB_ID = 4242


@dataclass
class SlurmJob:
    """A 2-node SLURM job signalled to requeue in its second epoch, and its requeued run."""

    root: Path  # --trainer.default_root_dir
    codes: list[int]  # exit code of the first job, then of the requeued one
    first: list[str]  # each task's output, first job
    second: list[str]  # each task's output, requeued job
    scontrol: str  # what the job asked scontrol


def slurm_requeue_job(tmp: Path, args: list[str], steps_per_epoch: int) -> SlurmJob:
    """cluster/slurm.sbatch under a 2-node x 1-task SLURM job's variables, `fit *args` (ending with RankProbe):
    SIGUSR1 (what `--signal=SIGUSR1@90` sends before the time limit) once epoch 1's last.ckpt is written, then
    the same job again, as `scontrol requeue` would start it. With the project's callbacks, as the other cluster
    runs: a callbacks file of the suite's own here replaced them, and a project whose training depends on one
    (Lightning's EMAWeightAveraging) got a job without it, 0.17 apart from its 1-device run. Again, in a clean
    folder, where its port was taken (port_taken)."""
    job = lambda: _slurm_requeue_job(tmp, args, steps_per_epoch)  # noqa: E731
    return again_where_port_taken(job, tmp, lambda done: [*done.first, *done.second])


def _slurm_requeue_job(tmp: Path, args: list[str], steps_per_epoch: int) -> SlurmJob:
    tmp.mkdir()
    env = slurm_env(tmp, nodes=2, tasks_per_node=1, job_id=SLURM_JOB_ID)
    root, tasks = tmp / "root", tmp / "tasks"
    args = [*args, "--trainer.default_root_dir", str(root)]
    outputs = lambda: [(tasks / f"task{r}.out").read_text() for r in range(2)]  # noqa: E731
    # Slow steps (no CPU) keep the first job in its second epoch until it is signalled: 3 s for the steps left
    # after epoch 1's checkpoint; the requeued one is not slowed. The ranks look for the signal after every step
    # (by default every 10: with 4 steps an epoch, a 2-epoch job ended before its first look).
    sleep = str(max(0.2, 3.0 / max(1, steps_per_epoch - 1)))
    slow = ["--stop_check_every_n_steps", "1", "--trainer.callbacks.sleep_per_step", sleep]
    job = start(["bash", "cluster/slurm.sbatch", *args, *slow], env, tmp / "job1.log")
    try:
        epoch_1 = lambda: any(root.glob("lightning_logs/*/checkpoints/last.ckpt"))  # noqa: E731
        wait_for(lambda: epoch_1() or job.poll() is not None, timeout=300, what="epoch 1")
        assert (tasks / "srun.pid").exists(), f"the job ended before srun started:\n{(tmp / 'job1.log').read_text()}"
        if job.poll() is None:
            os.kill(int((tasks / "srun.pid").read_text()), signal.SIGUSR1)
        codes = finish([job], timeout=120)
    finally:
        kill_group(job)
    first = outputs()
    if codes == [0]:
        codes += finish([start(["bash", "cluster/slurm.sbatch", *args], env, tmp / "job2.log")], timeout=300)
    scontrol = tmp / "scontrol.log"
    return SlurmJob(root, codes, first, outputs(), scontrol.read_text() if scontrol.exists() else "")
