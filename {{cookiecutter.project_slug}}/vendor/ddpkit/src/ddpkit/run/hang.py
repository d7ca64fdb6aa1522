"""A hang says where: when a collective times out, every rank's stacks and last collectives are written next to
the run (`<log dir>/hang/`), and one report says which rank was behind, in which collective, at which line.

The rank whose collective timed out (after `--dist_timeout`) writes its own dump from the exception, signals
every other rank on its host (SIGNAL), waits up to DUMP_WAIT s for their dumps, then writes `hang/report.txt`
and prints it; the job then ends as before (processes.py). Each rank's address (host, pid) is in the process
group's store, so this works alike under Lightning's launcher and torchrun, whichever rank times out. A rank on
another host is named in the report without a dump.

A signalled rank dumps from a Python signal handler, which runs on its main thread at the next bytecode or when
a blocking call (time.sleep, a lock, a socket read) is interrupted: enough for a rank stuck in Python code, a
data loader or a sleep, which is where a rank behind the others is. A rank blocked for good in native code (a
CUDA synchronize) cannot run it and is named as "no dump". faulthandler's C-level handler would reach it, but
writes only to a file opened in advance (one per rank in every run, empty unless it hangs) and cannot read the
flight recorder; `faulthandler.dump_traceback_later` re-armed every step would fire on any step slower than
its timer and costs a call per step. Here nothing runs until a collective times out.

The last collectives come from torch's flight recorder, which records every collective a process issues
(sequence number per process group, kind); torch 2.13 keeps 2,000 entries by default (measured with gloo;
TORCH_FR_BUFFER_SIZE=0 switches it off, and the report then says so). torch 2.8 records gloo's collectives only
with that variable set, which the CLI does (FLIGHT_RECORDER_ENV); before 2.8 there is no record for gloo, and the
report has every rank's stack but no collectives, and says why. Under NCCL the watchdog aborts a timed-out rank
before Python sees an exception, so none of this runs: torch's own flight-recorder dump on the watchdog's timeout
(files named by TORCH_FR_DUMP_TEMP_FILE; before torch 2.8 TORCH_NCCL_DEBUG_INFO_TEMP_FILE) is the record there
(not tested here: no GPUs).
"""

import faulthandler
import json
import os
import re
import signal
import socket
import sysconfig
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning
import lightning_fabric
import lightning_utilities
import torch
import torchmetrics
from lightning.pytorch.callbacks import Callback

from ..lightning_internals import default_store, flight_recorder_entries, records_gloo_collectives

SIGNAL = signal.SIGUSR2  # SIGUSR1 is SLURM's warning before the time limit (requeue.py)
DUMP_WAIT = 5.0  # s for the signalled ranks' dumps: they took 0.06-0.07 s (docs/measurements.md, hang report)
KEEP = 8  # last collectives per rank in a dump
# torch 2.8.0 records gloo's collectives only with TORCH_FR_BUFFER_SIZE set (2.13.0 keeps 2,000 without it), read
# when the process group forms: the CLI sets this default first (docs/measurements.md, torch's floor).
FLIGHT_RECORDER_ENV = ("TORCH_FR_BUFFER_SIZE", "2000")
SCHEMA = 1  # of rank<N>.json, raised when a field's meaning changes
STORE_KEY = "ddpkit/hang/rank"  # + rank: "host pid"
# Frames in these directories are the framework's, not the run's code: the report points past them.
FRAMEWORK = tuple(
    str(Path(p).resolve()) + os.sep
    for p in [sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]]
    + [Path(m.__file__).parent for m in (torch, lightning, lightning_fabric, lightning_utilities, torchmetrics)]
)
# ddpkit's own frames that are on every rank's stack around the run (the CLI's entry), and this module.
ENTRY = tuple(str(Path(__file__).with_name(name).resolve()) for name in ("cli.py", "lightning_internals.py", "hang.py"))


@dataclass
class Frame:
    file: str
    line: int
    function: str
    code: str  # the source line, stripped

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.function}" + (f": {self.code}" if self.code else "")


@dataclass
class Collective:
    seq: int  # the process group's sequence number of this collective (the same on every rank)
    kind: str  # e.g. "gloo:all_reduce"
    group: str  # the process group's name ("0": the default one)

    def __str__(self) -> str:
        return f"#{self.seq} {self.kind}" + (f" (group {self.group})" if self.group != "0" else "")


@dataclass
class RankDump:
    """What one rank was doing when the job was stopped for a hang: rank<N>.json."""

    rank: int
    host: str
    pid: int
    timed_out: bool  # its own collective timed out; else it was signalled while the job hung
    error: str  # the timeout's first line ("" when signalled)
    stack: list[Frame]  # its main thread's, outermost first (all threads: rank<N>.stacks.txt)
    collectives: list[Collective]  # its last KEEP, oldest first
    schema: int = SCHEMA

    def where(self) -> Frame | None:
        """The innermost frame of the run's own code (outside the stdlib, torch, Lightning and the CLI's entry);
        the innermost frame when there is none (a rank waiting inside Lightning's backward)."""
        own = [f for f in self.stack if not f.file.startswith(FRAMEWORK) and f.file not in ENTRY]
        return (own or self.stack or [None])[-1]

    @classmethod
    def load(cls, path: Path) -> "RankDump":
        raw = json.loads(path.read_text())
        raw["stack"] = [Frame(**f) for f in raw["stack"]]
        raw["collectives"] = [Collective(**c) for c in raw["collectives"]]
        return cls(**raw)


@dataclass
class Armed:
    directory: Path
    rank: int
    world: int
    peers: dict[int, tuple[str, int]] = field(default_factory=dict)  # filled when needed


_armed: Armed | None = None
_dumped = threading.Event()  # this rank was asked for its dump: the job hung and its process group is broken


class HangDump(Callback):
    """Arms the hang dumps for a run: where they go (`<log dir>/hang/`), the signal handler, this rank's address."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # trainer.log_dir is a broadcast: every rank calls setup, in the same order.
        arm(Path(trainer.log_dir or os.getcwd()) / "hang", trainer.global_rank, trainer.world_size)


def arm(directory: Path, rank: int, world: int) -> None:
    global _armed
    _armed = Armed(directory, rank, world)
    if threading.current_thread() is threading.main_thread():
        # Stays installed to the process's end: a late signal must not kill it (the default action of SIGUSR2).
        signal.signal(SIGNAL, _on_signal)
    if world > 1 and torch.distributed.is_initialized():
        default_store().set(f"{STORE_KEY}{rank}", f"{socket.gethostname()} {os.getpid()}")


def _on_signal(signum: int, frame: Any) -> None:
    if _armed is not None:
        dump(_armed, traceback.extract_stack(frame), timed_out=False, error="")
        _dumped.set()


def job_hung() -> bool:
    """Another rank timed out and had this one dump: a graceful stop, which needs every rank, cannot happen."""
    return _dumped.is_set()


def dump(armed: Armed, stack: traceback.StackSummary, timed_out: bool, error: str) -> None:
    """Write rank<N>.stacks.txt (every thread, as faulthandler prints them) and then rank<N>.json."""
    armed.directory.mkdir(parents=True, exist_ok=True)
    with open(armed.directory / f"rank{armed.rank}.stacks.txt", "w") as stacks:
        faulthandler.dump_traceback(stacks, all_threads=True)
    record = RankDump(
        rank=armed.rank,
        host=socket.gethostname(),
        pid=os.getpid(),
        timed_out=timed_out,
        error=error,
        stack=[Frame(str(Path(f.filename).resolve()), f.lineno or 0, f.name, (f.line or "").strip()) for f in stack],
        collectives=last_collectives(),
    )
    path = armed.directory / f"rank{armed.rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(record), indent=1))
    os.replace(tmp, path)  # whole or absent: the collector waits for this name


def last_collectives() -> list[Collective]:
    entries = flight_recorder_entries()[-KEEP:]
    return [Collective(e["collective_seq_id"], e["profiling_name"], str(e["process_group"][0])) for e in entries]


def is_collective_timeout(error: BaseException) -> bool:
    """gloo's timeout ("Timed out waiting 20000ms for recv operation"); NCCL's watchdog kills the rank instead."""
    return isinstance(error, RuntimeError) and "timed out waiting" in str(error).lower()


def collect(error: BaseException) -> str | None:
    """In the rank whose collective timed out: dump this rank, have the others on this host dump, write and
    return the report (None when no run armed the dumps)."""
    armed = _armed
    if armed is None:
        return None
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    first = re.sub(r"^\[[^\]]*\]\s*", "", first)  # gloo's source location: "[.../unbound_buffer.cc:78] "
    dump(armed, traceback.extract_tb(error.__traceback__), timed_out=True, error=first)
    signalled = signal_peers(armed)
    deadline = time.monotonic() + DUMP_WAIT
    while time.monotonic() < deadline and not all((armed.directory / f"rank{r}.json").exists() for r in signalled):
        time.sleep(0.05)
    text = report(armed.directory, armed.world, armed.peers)
    tmp = armed.directory / "report.tmp"
    tmp.write_text(text)
    os.replace(tmp, armed.directory / "report.txt")
    return text


def signal_peers(armed: Armed) -> list[int]:
    """Send SIGNAL to every other rank on this host; return the ranks signalled."""
    if not torch.distributed.is_initialized():
        return []
    store, host, signalled = default_store(), socket.gethostname(), []
    for rank in range(armed.world):
        key = f"{STORE_KEY}{rank}"
        try:
            if rank == armed.rank or not store.check([key]):
                continue
            peer_host, pid = store.get(key).decode().split()
        except torch.distributed.DistError:  # the store's host is gone: the report names who is missing
            break
        armed.peers[rank] = (peer_host, int(pid))
        if peer_host == host:
            try:
                os.kill(int(pid), SIGNAL)
                signalled.append(rank)
            except ProcessLookupError:
                pass  # already gone
    return signalled


def report(directory: Path, world: int, peers: dict[int, tuple[str, int]] | None = None) -> str:
    """The summary of the dumps in `directory`: which rank was behind, in which collective, at which line."""
    paths = {r: directory / f"rank{r}.json" for r in range(world)}
    dumps = {r: RankDump.load(path) for r, path in paths.items() if path.exists()}
    last = {r: d.collectives[-1] for r, d in dumps.items() if d.collectives}
    lines = [f"hang report ({directory / 'report.txt'}):"]
    waiting = [r for r, d in dumps.items() if d.timed_out and r in last]
    if waiting:
        ahead = last[waiting[0]]
        behind = [r for r, c in last.items() if c.group == ahead.group and c.seq < ahead.seq]
        for r in behind:
            lines.append(
                f"rank {r} was behind: it never started collective {ahead}, which rank {waiting[0]} waits in; "
                f"it was at {dumps[r].where()}"
            )
        if not behind:
            kinds = sorted({f"rank {r}: {c}" for r, c in last.items()})
            lines.append(f"no rank was behind by the flight recorder: last collectives {', '.join(kinds)}")
    for r in range(world):
        d = dumps.get(r)
        if d is None:
            host = (peers or {}).get(r, ("an unknown host",))[0]
            lines.append(f"  rank {r}: no dump (on {host}, or blocked outside Python)")
            continue
        if r not in last:
            state = f"no collective recorded ({no_record_reason()})"
        elif d.timed_out:
            state = f"waits in collective {last[r]} ({d.error})"
        else:
            state = f"last collective {last[r]}"
        lines.append(f"  rank {r}: {state}; at {d.where()}")
    lines.append(f"  every thread's stack: {directory}/rank<N>.stacks.txt")
    return "\n".join(lines) + "\n"


def no_record_reason() -> str:
    """Why a dump holds no collectives: the recorder was switched off, or this torch records none for gloo."""
    if records_gloo_collectives():
        return "TORCH_FR_BUFFER_SIZE=0?"
    return f"torch {torch.__version__} does not record gloo's collectives; 2.8 and later do"
