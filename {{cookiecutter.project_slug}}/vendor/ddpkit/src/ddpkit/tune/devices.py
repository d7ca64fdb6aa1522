"""The devices of a node, shared by the trials of `python -m ddpkit.tune`: which GPUs a worker sees, how many trials
it runs at once, and the claims that keep two trials (of this worker or of another on the node) off one GPU and
one rendezvous port.

A claim is a lock file per GPU (and per port) in a node-local folder, locked with `flock`. Every worker on the
node looks at the same files, and the kernel releases a lock when the last process holding it dies, SIGKILL
included: the worker holds its trial's claims, and so does the trial's rank 0, which inherits them (a trial whose
worker was killed keeps its GPUs until its rank 0 has stopped, within a second). No file says what to clean up.
"""

import fcntl
import os
import shutil
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from ddpkit.scaling.ranks import visible_cores
from ddpkit.tune.study import BadInput

CLAIMS = "DDPKIT_CLAIMS"  # the folder of the node's claims, when not the default below
DEFAULT_CLAIMS = "/tmp/ddpkit-claims"  # node-local on a cluster node; every user's workers share it
PORTS = range(29600, 30600)  # the trials' rendezvous ports (MASTER_PORT), clear of torch's default 29500


def gpu_uuids(smi: str = "nvidia-smi") -> dict[str, str]:
    """{index: UUID} of the GPUs `nvidia-smi` lists (the ones this container or cgroup holds); {} without it."""
    if shutil.which(smi) is None:
        return {}
    cmd = [smi, "--query-gpu=index,uuid", "--format=csv,noheader"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return {}
    rows = [line.split(",") for line in done.stdout.splitlines() if line.count(",") == 1]
    return {index.strip(): uuid.strip() for index, uuid in rows}


def visible_gpus(listed: str | None, uuids: dict[str, str]) -> list[str]:
    """The GPUs a worker may give its trials, as CUDA_VISIBLE_DEVICES entries: those its CUDA_VISIBLE_DEVICES
    (`listed`) names, up to the first invalid one as CUDA reads it, else every GPU nvidia-smi lists (`uuids`, from
    gpu_uuids); an index is written as its UUID where nvidia-smi names it, so that two workers whose
    CUDA_VISIBLE_DEVICES both say 0 (each in a cgroup of its own) claim different GPUs."""
    if listed is None:
        return list(uuids.values())
    entries = []
    for entry in (e.strip() for e in listed.split(",")):
        if not entry or entry.startswith("-"):
            break
        entries.append(uuids.get(entry, entry))
    return entries


def concurrent_trials(gpus: list[str], devices: int, parallel: int | None) -> int:
    """How many trials a worker runs at once: as many as its GPUs hold (floor(G / devices)), or `--parallel`
    (at most that on GPUs; any number of CPU trials, 1 by default)."""
    if not gpus:
        return parallel or 1
    fits = len(gpus) // devices
    if fits == 0:
        raise BadInput(f"--devices {devices}: this worker sees {len(gpus)} GPU(s) ({','.join(gpus)})")
    if parallel and parallel > fits:
        raise BadInput(f"--parallel {parallel}: {len(gpus)} GPU(s) hold {fits} trial(s) of {devices} device(s)")
    return parallel or fits


def cpu_threads(trials: int, devices: int) -> str:
    """OMP_NUM_THREADS of a trial's processes: the worker's own if set, else its cores over every process of
    every trial at once (Lightning's own default gives each rank cores / ranks, which K trials would oversubscribe
    K times)."""
    return os.environ.get("OMP_NUM_THREADS") or str(max(1, visible_cores() // (trials * devices)))


@dataclass
class Claim:
    """A trial's GPUs and rendezvous port, held while its lock files stay open (`fds`, passed to its rank 0)."""

    gpus: list[str]
    port: int
    fds: list[int] = field(default_factory=list)

    def release(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []

    def env(self) -> dict[str, str]:
        """The trial's CUDA_VISIBLE_DEVICES (when the node has GPUs) and MASTER_PORT."""
        gpus = {"CUDA_VISIBLE_DEVICES": ",".join(self.gpus)} if self.gpus else {}
        return {**gpus, "MASTER_PORT": str(self.port)}


def claims_folder() -> Path:
    folder = Path(os.environ.get(CLAIMS, DEFAULT_CLAIMS))
    return made(folder)


def made(folder: Path) -> Path:
    if not folder.is_dir():
        folder.mkdir(parents=True, exist_ok=True)
        try:
            folder.chmod(0o1777)  # every user's workers on the node claim here; each removes only its own files
        except PermissionError:  # made by another user meanwhile
            pass
    return folder


def lock(folder: Path, name: str) -> int | None:
    """The open, locked file `name` in the claims `folder`; None when another process holds it."""
    path = folder / name
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        if path.stat().st_uid == os.getuid():
            os.fchmod(fd, 0o666)  # whatever the umask: another user's worker must open it to lock it
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # BlockingIOError: held by another process
        os.close(fd)
        return None
    return fd


def free(port: int) -> bool:
    """Whether nothing listens on `port` (a process outside the claims, or a port in TIME_WAIT)."""
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def claim(gpus: list[str], count: int, folder: Path | None = None) -> Claim | None:
    """`count` of `gpus` that no other trial on the node holds, and a port; None when too few GPUs are free.
    `folder`: the claims folder (default: $DDPKIT_CLAIMS, else DEFAULT_CLAIMS)."""
    folder = made(folder) if folder else claims_folder()
    fds: list[int] = []
    taken: list[str] = []
    for gpu in gpus:
        if len(taken) == count:
            break
        fd = lock(folder, "gpu-" + "".join(c if c.isalnum() or c in "-_" else "_" for c in gpu))
        if fd is not None:
            fds.append(fd)
            taken.append(gpu)
    if len(taken) < count:
        Claim([], 0, fds).release()
        return None
    for port in PORTS:
        fd = lock(folder, f"port-{port}")
        if fd is not None and free(port):
            return Claim(taken, port, [*fds, fd])
        if fd is not None:
            os.close(fd)
    Claim([], 0, fds).release()
    raise BadInput(f"no free port in {PORTS.start}-{PORTS.stop - 1} for a trial's rendezvous")
