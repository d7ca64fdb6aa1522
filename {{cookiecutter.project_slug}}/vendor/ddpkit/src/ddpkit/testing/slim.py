"""Checkpoints of the suite's runs that hold what their readers need, no more (footprint.py counts what they take).

Most of the suite's checkpoints are only read for their weights; an optimizer like AdamW keeps two tensors per
weight, which triples a checkpoint (an 11M-parameter model's float64 one is 90 MB instead of 270). A run keeps the
optimizer's and schedulers' states only in the files another run resumes from (`full`: file-name patterns), keeps no
best checkpoint where no check reads one (`best=False`), and can write last.ckpt only when fit ends (`last_at_end`:
Lightning writes it at every epoch's end, and the checks read the last one). A file is written beside its name and
then renamed to it, so that a run that writes anew a checkpoint it started from (a copy of a run continued: its
last.ckpt) may hold a hard link to the original, not a copy (Lightning's own save renames a temporary file only
where it is on the same file system, and copies it in place elsewhere; another CheckpointIO may write in place). The
resume state a run writes as a GPU would (`cuda`: file-name patterns) is written so in the first place, not copied
later (fake_cuda.py). A checkpoint that the checks read for its name alone (`names`: the per-epoch ones, which show
that 2 ranks write one set of files; its saving is Lightning's, on rank 0) holds its epoch and step, no tensors. The
one-step check's states (`single`) hold float32 weights: its float32 and bf16 runs load them as float32 in any case,
and its float64 run then takes the exact step from the same numbers (half the bytes, and no rounding of the start
in what the check takes for the step's own rounding).
"""

import os
from collections.abc import Callable
from contextlib import nullcontext
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.plugins.io import CheckpointIO

from .fake_cuda import tagged_as_cuda

RESUME_STATE = ("optimizer_states", "lr_schedulers")
NAME_ONLY = "written by the guarantee suite for its file name alone (ddpkit.testing.slim)"


class SlimIO(CheckpointIO):
    """Saves through `io`, without RESUME_STATE in a checkpoint whose file name matches none of `full`, every tensor
    tagged as stored on cuda:0 in one that matches `cuda`, only the epoch and step in one that matches `names`, the
    float64 weights and buffers as float32 in one that matches `single`, to a new file renamed to `path` (a hard link
    to the file it replaces is left as it was); with `ends` (a trainer), last.ckpt only in the epoch fit ends with. A
    last checkpoint of the same step and contents as the checkpoint saved just before it (Lightning saves the top-k
    one, then last.ckpt, from the same state) is a hard link to that file: one copy of the weights on disk."""

    def __init__(
        self, io: CheckpointIO, full: list[str], ends: L.Trainer | None = None, *, cuda=(), names=(), single=()
    ) -> None:
        self.io, self.full, self.ends, self.cuda, self.names = io, full, ends, list(cuda), list(names)
        self.single = list(single)
        self.saved: tuple[tuple, Path] | None = None  # the last checkpoint saved with tensors: (what it holds, path)

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any = None) -> None:
        name = Path(path).name
        if self.ends is not None and name == "last.ckpt" and not last_epoch(self.ends):
            return
        if not matches(name, self.full):
            checkpoint = without_resume_state(checkpoint)
        if matches(name, self.names):
            checkpoint = name_alone(checkpoint)
        if matches(name, self.single):
            checkpoint = in_float32(checkpoint)
        what = (checkpoint.get("epoch"), checkpoint.get("global_step"), sorted(checkpoint), matches(name, self.cuda))
        before = self.saved[1] if self.saved and self.saved[0] == what and what[1] is not None else None
        if name.startswith("last") and before not in (None, Path(path)) and before.is_file():
            # The loops' and callbacks' states are those of the file linked to, saved a moment before in the same step
            # (ModelCheckpoint's best_model_path already the new best's): only the weights matter to the checks.
            save_beside(Path(path), lambda written: os.link(before, written))
            return
        with tagged_as_cuda() if matches(name, self.cuda) else nullcontext():
            save_beside(Path(path), lambda written: self.io.save_checkpoint(checkpoint, written, storage_options))
        self.saved = None if NAME_ONLY in checkpoint else (what, Path(path))

    def load_checkpoint(self, path, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        # Lightning's own CheckpointIO takes `weights_only` from 2.6 on, and its strategies pass none before.
        asked = {} if weights_only is None else {"weights_only": weights_only}
        return self.io.load_checkpoint(path, map_location=map_location, **asked)

    def remove_checkpoint(self, path) -> None:
        self.io.remove_checkpoint(path)

    def teardown(self) -> None:
        self.io.teardown()


def matches(name: str, patterns: list[str]) -> bool:
    return any(fnmatch(name, pattern) for pattern in patterns)


def without_resume_state(checkpoint: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in checkpoint.items() if key not in RESUME_STATE}


def name_alone(checkpoint: dict[str, Any]) -> dict[str, Any]:
    return {"epoch": checkpoint.get("epoch"), "global_step": checkpoint.get("global_step"), NAME_ONLY: 1}


def in_float32(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """`checkpoint` with its float64 weights and buffers as float32: a one-step state (check_onestep.py), which every
    one-step run loads, the float32 and bf16 runs as float32 in any case, so the float64 run's exact step starts
    from the same numbers as theirs."""
    cast: dict[tuple, torch.Tensor] = {}  # a tied weight (GPT-2's embedding and output layer) cast once, saved once
    weights = {
        k: cast.setdefault((t.data_ptr(), t.shape, t.stride()), t.float()) if t.dtype == torch.float64 else t
        for k, t in checkpoint["state_dict"].items()
    }
    return {**checkpoint, "state_dict": weights}


def one_step_state(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A complete state that no run resumes from any more, as a one-step state: no RESUME_STATE, in float32."""
    return in_float32(without_resume_state(checkpoint))


def save_beside(path: Path, save: Callable[[Path], None]) -> None:
    """`save` to a new file beside `path`, then renamed over it: a hard link to the file it replaces keeps the old."""
    written = path.with_name(f".{path.name}.part")
    save(written)
    os.replace(written, path)


def rewrite(path: Path, lighter: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """Save checkpoint `path` again as `lighter` makes it (without_resume_state once no run resumes from it,
    name_alone once it is read for its name alone: footprint.py), unless that changes nothing."""
    state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)  # the tensors read as they are saved
    light = lighter(state)
    if light.keys() != state.keys():
        save_beside(path, lambda written: torch.save(light, written))


def last_epoch(trainer: L.Trainer) -> bool:
    """Whether fit ends with this epoch (at its end, where the checkpoint callbacks save, current_epoch is still its
    own): stopped, its last epoch, or max_steps reached; with no epoch limit, every epoch may be the last."""
    if trainer.should_stop or trainer.max_epochs in (None, -1):
        return True
    steps_done = trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps
    return steps_done or trainer.current_epoch + 1 >= trainer.max_epochs


def slim(trainer: L.Trainer, full: list[str], best: bool, last_at_end: bool = False, **patterns) -> None:
    """Have `trainer` save RESUME_STATE only in the files matching `full`, and the files matching the `patterns`
    (`cuda`, `names`, `single`) as SlimIO says; with `best` False, its checkpoint callbacks keep no top-k checkpoint
    (last.ckpt still); with `last_at_end`, last.ckpt is written only when fit ends."""
    if not isinstance(trainer.strategy.checkpoint_io, SlimIO):  # setup runs once per stage
        ends = trainer if last_at_end else None
        trainer.strategy.checkpoint_io = SlimIO(trainer.strategy.checkpoint_io, full, ends, **patterns)
    for callback in trainer.checkpoint_callbacks if not best else ():
        callback.save_top_k = 0


class SlimCheckpoints(L.Callback):
    """`slim` for a run without the suite's Probe (the cluster launchers' runs; last.ckpt at every epoch's end, which
    the SLURM check waits for).

    Args:
        full: File-name patterns of the checkpoints that keep the optimizer's state (default: SLURM's hpc_ckpt_<n>.ckpt,
            which the requeued job resumes from).
        best: Keep the checkpoint callbacks' best checkpoints.
    """

    def __init__(self, full: list[str] | None = None, best: bool = False) -> None:
        self.full, self.best = ["hpc_ckpt_*.ckpt"] if full is None else full, best

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        slim(trainer, self.full, self.best)
