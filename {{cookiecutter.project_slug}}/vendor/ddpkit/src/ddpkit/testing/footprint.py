"""The suite's checkpoints on disk (the plugin's): a run's are deleted once no test still to run reads it, nor a run
that starts from them (`Footprint.release`, after each test), the rest at the end of the session, a complete state
that no run resumes from any more keeps its weights alone, and a best checkpoint no run loads any more its name
alone; what the runs wrote and the most bytes on disk at once, for the session's summary.
"""

import shutil
from pathlib import Path

import torch

from .runs import (
    FP64_BOUND,
    FROM_FIRST,
    MID_CHECKPOINT,
    ONE_STEP,
    ONE_STEP_NUDGED,
    STEP_PRECISIONS,
    STEP_RECORDS,
    Waves,
    global_step,
    reference_run,
)
from .slim import name_alone, one_step_state, rewrite

# Set (to anything) to keep the runs' checkpoints after the session, and every one they write, to look into a failure.
KEEP_CHECKPOINTS = "DDPKIT_KEEP_CHECKPOINTS"

# The runs whose files a run starts from (waves.py): the one-step runs from the 1-device float64 run's saved states,
# FROM_FIRST from both first-wave float64 runs' checkpoints (building it links the 1-device run's into copies of
# its folder), each kept until the run has run.
STARTS_FROM = {
    **dict.fromkeys((*ONE_STEP, *ONE_STEP_NUDGED), ("1dev-fp64",)),
    **dict.fromkeys(FROM_FIRST, ("1dev-fp64", "2dev-fp64")),
}
# The runs that resume from the 1-device float64 run's resume state (`continue` from its copy as last.ckpt), and the
# evaluations that load its best checkpoint (waves.py).
RESUMED_ONE = {"resume-1to2", "continue"}
LOADS_BEST = {"test-1dev", "test-2dev"}
# Runs whose folder is not their name (waves.py): the evaluations on 1 device share a copy of the 1-device run.
FOLDERS = {"validate-1dev": "eval", "test-1dev": "eval", "predict-1dev": "eval", "slurm-requeue": "slurm"}


class Footprint:
    """The checkpoint and weights files of a session's runs, each counted once (a hard link too): how many, their bytes,
    and the most bytes on disk at once. `measure` before each deletion, before runs start (Waves.before_start) and at
    the end: between two of these the runs only add files (but for a checkpoint a run replaces, which Lightning writes
    before it removes the old, and the state resume-2to1 deletes once restored, before it writes any and before the runs
    of its wave that take their slots after it write theirs)."""

    def __init__(self) -> None:
        self.files: dict[tuple[int, int], int] = {}  # (inode, modification time) -> bytes; an inode can be reused
        self.peak = 0
        self.freed: set[str] = set()  # the folders whose checkpoints are deleted
        self.model_bytes = 0  # the model's float64 weights, read from the 1-device float64 run before its deletion
        self.rewritten: set[Path] = set()

    def measure(self, runs: Waves) -> None:
        now = {}
        for path in heavy_files(runs.base):
            stat = path.stat()
            now[stat.st_ino, stat.st_mtime_ns] = stat.st_size
        self.files |= now
        self.peak = max(self.peak, sum(now.values()))
        if "1dev-fp64" in runs.done and not self.model_bytes and runs.done["1dev-fp64"].checkpoint().is_file():
            self.model_bytes = stored_bytes(runs.done["1dev-fp64"].weights())

    def written(self) -> tuple[int, int]:
        return len(self.files), sum(self.files.values())

    def release(self, runs: Waves, still_read: set[str] | None, steps: dict) -> list[str]:
        """Delete the checkpoints of the runs that have run and that no test still to run reads (`still_read`, from
        their `reads`), directly or through a run that starts from their files and has not run yet (STARTS_FROM; a
        one-step run may run again from nudged states in a test that reads it); the logs and records stay. Of a run
        still read, the files that only other runs needed (`parts`), the complete states no run resumes from any more
        (`resumed_no_more`: then one-step states, slim.one_step_state), and the tensors of the best checkpoint no run
        loads any more (`loaded_no_more`). Return the folders freed. None (a test that uses the runs declares nothing):
        nothing is freed."""
        if still_read is None:
            return []
        kept = set(still_read)
        if FP64_BOUND in kept and FP64_BOUND not in runs.cache:  # the reference's weights until it is worked out
            kept.add(reference_run(steps))
        for name in still_read:
            if name not in runs.done or name in ONE_STEP:
                kept |= set(STARTS_FROM.get(name, ()))
        kept_folders = {FOLDERS.get(name, name) for name in kept}  # a folder's runs still to run need its files too
        ran = {FOLDERS.get(name, name) for name in [*runs.done, *runs.failed]}
        freed = sorted(ran - kept_folders - self.freed)
        files = [f for f in parts(runs, kept, steps) if f.is_file()]
        if freed or files:
            self.measure(runs)  # before deleting: files are only added between two releases
            for folder in freed:
                remove_checkpoints(runs.base / folder)
            for file in files:
                file.unlink(missing_ok=True)
            self.freed |= set(freed)
        lighter = {f: one_step_state for f in resumed_no_more(runs, kept, steps)}
        lighter |= {f: name_alone for f in loaded_no_more(runs, kept)}
        lighter = {f: make for f, make in lighter.items() if f not in self.rewritten and f.is_file()}
        if lighter:
            self.measure(runs)
            for file, make in lighter.items():
                rewrite(file, make)
            self.rewritten |= set(lighter)
        return freed


def stored_bytes(weights: dict[str, torch.Tensor]) -> int:
    """The bytes of the tensors' storages, each once: a tied weight (GPT-2's embedding and output layer) is one
    storage under two names, saved once in a checkpoint."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in weights.values()}
    return sum(storages.values())


def parts(runs: Waves, kept: set[str], steps: dict) -> list[Path]:
    """The files of a run still read that only other runs start from, or one check reads, once none of those is read
    any more:
    - the 1-device float64 run's states at the one-step points, once no one-step run is left (the resume's, 1 global
      batch into epoch 1, once resume-1to2 and `continue` have run too);
    - the 2-device run's resume state, once resume-2to1 has run and its checks are done (MID_CHECKPOINT);
    - the one-step runs' records of a precision once its check has run (STEP_RECORDS; the float64 run's once both
      have), while the runs' logs are still read (check_onestep's bit-identical ranks)."""
    found = []
    one, two = runs.done.get("1dev-fp64"), runs.done.get("2dev-fp64")
    if one and not kept & {*ONE_STEP, *ONE_STEP_NUDGED}:
        resume = global_step(steps, steps["one_to_two"])
        points = {global_step(steps, k) for k in steps["step_points"]} - ({resume} if kept & RESUMED_ONE else set())
        found += [one.mid_checkpoint(step) for step in sorted(points)]
    if two and not kept & {MID_CHECKPOINT, "resume-2to1"}:
        found.append(two.resume_state(steps, "two_to_one"))
    records = {tag: STEP_RECORDS.format(precision=tag) not in kept for tag in STEP_PRECISIONS}
    records["fp64"] = all(records.values())
    for name in [*ONE_STEP, *ONE_STEP_NUDGED]:
        if name in runs.done and records[name.split("-")[2]]:
            found.append(runs.done[name].root / "probe" / "onestep.pt")
    return found


def resumed_no_more(runs: Waves, kept: set[str], steps: dict) -> list[Path]:
    """The 1-device float64 run's resume state (still read for its weights by the one-step runs, which load them as
    float32 or from float32: slim.in_float32) once no run resumes from it any more (RESUMED_ONE), where the one-step
    runs do not load its optimizer's state (a global batch is one optimizer step: commands.run_args)."""
    one = runs.done.get("1dev-fp64")
    if one is None or kept & RESUMED_ONE or steps["steps_per_batch"] != 1 or steps["manual_optimization"]:
        return []
    return [one.resume_state(steps, "one_to_two")]


def loaded_no_more(runs: Waves, kept: set[str]) -> list[Path]:
    """The 1-device float64 run's best checkpoint once no evaluation that loads it is left (LOADS_BEST): the checks
    read its name alone after."""
    one = runs.done.get("1dev-fp64")
    return [] if one is None or kept & LOADS_BEST else sorted(one.checkpoint().parent.glob("best-*.ckpt"))


def remove_checkpoints(base: Path, delete: bool = True) -> tuple[int, int]:
    """Delete every checkpoint and weights file under `base` (a sharded checkpoint is a folder), keeping the logs
    and the probe's records; return how many files there were and their bytes (a hard-linked file once). The
    suite's runs write dozens (a ResNet-18's are 90 MB each in float64), and pytest keeps the temporary folders of
    three sessions. `delete=False` only counts them."""
    files = {f.stat().st_ino: f.stat().st_size for f in heavy_files(base)}
    for path in heavy(base) if delete else []:
        if path.exists():  # not inside a sharded checkpoint removed before
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    return len(files), sum(files.values())


def heavy(base: Path) -> list[Path]:
    """The checkpoints (a sharded one is a folder) and weights files under `base`."""
    return [p for p in base.rglob("*") if p.suffix in (".ckpt", ".pt")]


def heavy_files(base: Path) -> list[Path]:
    """The files of `heavy`, a sharded checkpoint's included."""
    return [f for p in heavy(base) for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file()]
