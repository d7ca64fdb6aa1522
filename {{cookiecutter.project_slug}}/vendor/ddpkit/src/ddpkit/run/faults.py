"""Inject faults into real 2-process runs (CPU by default) and report how the job ends.

    python -m ddpkit.faults                 # every scenario once
    python -m ddpkit.faults --runs 5 raise hang sigterm
    python -m ddpkit.faults --accelerator gpu hang sigterm   # 2 GPUs: NCCL instead of gloo

Each run starts a fit on 2 processes in its own session, injects one fault, and
measures: the exit status, the seconds from the fault to the last process of the
job being gone, processes of the job still alive 5 s after the launcher exited
(orphans, then killed), and whether the newest checkpoint is missing or unreadable
where one was expected (lost). The runs train the library's own toy model through
the project CLI (`python -m ddpkit.toy fit`, whatever a project's config.yaml
selects: the fault handling is the library's); the faults come from its
`FaultyClassifier` and from signals sent to the launcher. Works from any folder;
each run's files go to a temporary one.
"""

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# Saves last.ckpt after every step; with a 64 MB ballast buffer, most of a run is spent writing.
EVERY_STEP = """
trainer:
  callbacks:
    - class_path: ddpkit.run.checkpoints.CurrentModelCheckpoint
      init_args:
        dirpath: DIRPATH
        every_n_train_steps: 1
        save_top_k: 1
        monitor: null
        save_last: true
"""


# Seconds each step of a scenario with a signal sleeps. The signal goes out once the marker exists and must land
# mid-training: 45 steps after the marker leave ~9 s for the sender to see it, where 0.05 left ~2.5 s. In one CI
# run of the template on a busy 2-core machine, a Ctrl-C run went on to its last step and exited 0 with no sign
# of the signal (a sender that late, with SIGINT ignored as in jobs a shell starts in the background, reads so).
# A signalled run stops within GracefulStop's 11 steps, so this costs ~2 s of sleep per scenario, no CPU.
STEP_SLEEP = ("--model.step_sleep", "0.2")


@dataclass
class Scenario:
    """One way a job can go wrong."""

    doc: str
    model: tuple[str, ...] = ()  # --model.* overrides of ddpkit.testing.toy.FaultyClassifier
    signal: int | None = None  # sent once the marker file exists
    to_group: bool = False  # to the whole process group (Ctrl-C), else to the launcher only
    to_rank1: bool = False  # to rank 1 only (the process Lightning's launcher started), not the launcher
    devices: int = 2
    checkpoint: bool = False  # a readable last.ckpt must exist afterwards
    every_step: bool = False  # checkpoint after every step; the signal waits for a rewrite of last.ckpt to start


SCENARIOS = {
    "raise": Scenario("rank 1 raises at step 3", ("--model.fault", "raise")),
    "exit": Scenario("rank 1 calls os._exit(3) at step 3", ("--model.fault", "exit")),
    "hang": Scenario("rank 1 sleeps forever at step 3 (rank 0 waits in the all-reduce)", ("--model.fault", "hang")),
    "hang0": Scenario("rank 0 sleeps forever at step 3", ("--model.fault", "hang", "--model.fault_rank", "0")),
    "sigterm": Scenario("SIGTERM to the launcher mid-training", STEP_SLEEP, signal.SIGTERM, checkpoint=True),
    "sigterm-rank1": Scenario(
        "SIGTERM to rank 1 only (e.g. an OOM killer or scheduler that signals one process)",
        STEP_SLEEP,
        signal.SIGTERM,
        to_rank1=True,
        checkpoint=True,
    ),
    "sigint": Scenario(
        "Ctrl-C (SIGINT to the process group)",
        STEP_SLEEP,
        signal.SIGINT,
        to_group=True,
        checkpoint=True,
    ),
    "kill9": Scenario("kill -9 of the launcher mid-training", STEP_SLEEP, signal.SIGKILL),
    "kill9-epoch1": Scenario(
        "kill -9 of the launcher in epoch 1: epoch 0's last.ckpt survives, to resume with --ckpt_path last",
        (*STEP_SLEEP, "--model.fault_step", "20"),
        signal.SIGKILL,
        checkpoint=True,
    ),
    "kill9-save": Scenario(
        "kill -9 while last.ckpt is being rewritten (part of its temporary file written; checkpoints every step)",
        ("--model.ballast_mb", "64", "--model.fault_step", "1"),
        signal.SIGKILL,
        devices=1,
        checkpoint=True,
        every_step=True,
    ),
}


@dataclass
class Result:
    scenario: str
    workdir: Path
    returncode: int | None  # None: still running at the deadline (hung), then killed
    seconds: float  # from the fault to the last process of the job gone
    orphans: int
    checkpoint_lost: bool
    partial_writes: int  # temporary files a killed checkpoint write left behind
    killed_mid_write: bool  # the kill left a partial rewrite of last.ckpt behind: it landed during that write
    partial_bytes: int  # how much of that rewrite was written
    output: str


def processes() -> list[tuple[int, str, int, int]]:
    """(pid, state, parent pid, session id) of every process, from /proc/<pid>/stat."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:  # the fields after the command name, which is in parentheses and may hold any character
                state, ppid, _, sid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:4]
            except (ProcessLookupError, PermissionError, FileNotFoundError):
                continue  # gone meanwhile
            found.append((int(entry.name), state, int(ppid), int(sid)))
    return found


def session_pids(sid: int) -> list[int]:
    """Processes still alive (not zombies) in session `sid` (the job was started as its leader)."""
    return [pid for pid, state, _, session in processes() if session == sid and state != "Z"]


def child_pids(pid: int) -> list[int]:
    """The processes `pid` started (Lightning's launcher: the other ranks)."""
    return sorted(child for child, _, parent, _ in processes() if parent == pid)


def checkpoint_ok(path: Path) -> bool:
    """The file loads as plain weights and holds a training step."""
    # Mapped, not read, where the format allows (zip, as Lightning saves): the caller's peak memory stays as it
    # was (a process it starts later inherits that peak in its getrusage maxrss, which the doctor reports).
    for mapped in (True, False):
        try:
            return "state_dict" in torch.load(path, map_location="cpu", weights_only=True, mmap=mapped)
        except Exception:
            continue
    return False


def partial_last(checkpoints: Path) -> int:
    """Bytes of the next last.ckpt written so far (checkpoints.atomic_save's temporary file), 0 if none."""
    written = 0
    for tmp in checkpoints.glob(".last.ckpt.*.tmp"):
        try:
            written += tmp.stat().st_size
        except FileNotFoundError:
            pass  # renamed into place meanwhile
    return written


def rewriting_last(checkpoints: Path) -> bool:
    """last.ckpt exists and its next version is partly written: a kill now lands in the middle of a write."""
    return (checkpoints / "last.ckpt").exists() and partial_last(checkpoints) > 0


def run_scenario(
    name: str,
    workdir: Path,
    dist_timeout: float = 20,
    deadline: float = 120,
    max_steps: int = 60,
    accelerator: str = "cpu",
) -> Result:
    """Run one scenario in `workdir` (created) and measure how the job ended."""
    sc = SCENARIOS[name]
    workdir.mkdir(parents=True, exist_ok=True)
    marker = workdir / "step_reached"
    args = [sys.executable, "-m", "ddpkit.testing.toy", "fit", "--trainer.accelerator", accelerator]
    args += ["--trainer.devices", str(sc.devices), "--trainer.default_root_dir", str(workdir)]
    args += ["--trainer.max_steps", str(max_steps), "--trainer.enable_progress_bar", "false"]
    args += ["--trainer.logger", "false", "--dist_timeout", str(dist_timeout)]
    args += ["--model", "ddpkit.testing.toy.FaultyClassifier", "--model.marker", str(marker)]
    args += list(sc.model)
    if sc.every_step:
        (workdir / "every_step.yaml").write_text(EVERY_STEP.replace("DIRPATH", str(workdir / "checkpoints")))
        args += ["--config", str(workdir / "every_step.yaml")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = open(workdir / "output.txt", "w+")  # a file, not a pipe: a full pipe would block the job
    proc = subprocess.Popen(args, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    start = time.monotonic()
    fault_time = None
    while proc.poll() is None and time.monotonic() - start < deadline:
        if fault_time is None and marker.exists():
            fault_time = time.monotonic()
            if sc.signal is not None:
                if sc.every_step:  # land inside a write of last.ckpt, over an older complete one
                    while proc.poll() is None and time.monotonic() - start < deadline:
                        if rewriting_last(workdir / "checkpoints"):
                            break
                        time.sleep(0.002)  # a 64 MB write takes far longer (docs/measurements.md)
                if sc.to_group:
                    os.killpg(proc.pid, sc.signal)
                elif sc.to_rank1:
                    os.kill(child_pids(proc.pid)[0], sc.signal)
                else:
                    os.kill(proc.pid, sc.signal)
                fault_time = time.monotonic()
        time.sleep(0.02)
    returncode = proc.poll()
    if returncode is None:  # hung: end it so the next run starts clean
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    exited = time.monotonic()
    while session_pids(proc.pid) and time.monotonic() - exited < 5:  # ranks watch their launcher every 1 s
        time.sleep(0.05)
    orphans = session_pids(proc.pid)
    for pid in orphans:
        os.kill(pid, signal.SIGKILL)
    gone = time.monotonic()
    lost = sc.checkpoint and not checkpoint_ok(workdir / "checkpoints" / "last.ckpt")
    partial = len(list((workdir / "checkpoints").glob(".*.tmp")))
    partial_bytes = partial_last(workdir / "checkpoints")
    last = workdir / "checkpoints" / "last.ckpt"
    mid_write = 0 < partial_bytes < (last.stat().st_size if last.exists() else 0)
    log.seek(0)
    seconds = gone - (fault_time or start)
    return Result(name, workdir, returncode, seconds, len(orphans), lost, partial, mid_write, partial_bytes, log.read())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenarios", nargs="*", choices=[[], *SCENARIOS], default=[], help="default: all")
    parser.add_argument("--runs", type=int, default=1, help="runs per scenario")
    parser.add_argument("--dist_timeout", type=float, default=20, help="--dist_timeout of the runs, seconds")
    parser.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu", help="gpu: NCCL (needs 2 GPUs)")
    args = parser.parse_args()
    # Under NCCL a hang ends when torch's watchdog tears a process down, after it has given the flight
    # recorder time to dump (tens of seconds past the timeout): more time before a job counts as hung.
    deadline = 120 if args.accelerator == "cpu" else args.dist_timeout + 300
    print(
        f"{'scenario':<11} {'runs':>4} {'exits non-zero':>14} {'max s to exit':>13} {'orphans left':>12} "
        f"{'ckpts lost':>10}  what"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.scenarios or SCENARIOS:
            results = [
                run_scenario(name, Path(tmp) / f"{name}{i}", args.dist_timeout, deadline, accelerator=args.accelerator)
                for i in range(args.runs)
            ]
            nonzero = sum(r.returncode not in (0, None) for r in results)
            hung = sum(r.returncode is None for r in results)
            lost = sum(r.checkpoint_lost for r in results) if SCENARIOS[name].checkpoint else "-"
            print(
                f"{name:<11} {len(results):>4} {nonzero:>14} {max(r.seconds for r in results):>13.1f} "
                f"{sum(r.orphans for r in results):>12} {lost!s:>10}  {SCENARIOS[name].doc}"
                + (f" ({hung} hung past the deadline)" if hung else "")
                + (
                    f" ({sum(r.killed_mid_write for r in results)} killed mid-write)"
                    if SCENARIOS[name].every_step
                    else ""
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
