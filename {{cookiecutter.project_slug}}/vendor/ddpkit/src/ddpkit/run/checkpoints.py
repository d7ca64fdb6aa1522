"""Checkpoints that suit any module, and that a kill at any moment cannot corrupt.

- `CurrentModelCheckpoint`: `last.ckpt` is always the latest epoch; a monitored metric the module never
  logs fails at the sanity check, naming the metrics it does log.
- `AtomicCheckpointIO`: write to a temporary file, fsync, rename over the old one.
- `RecordVersion`: every checkpoint says which ddpkit wrote it (`checkpoint["ddpkit_version"]`).
"""

import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from .. import __version__
from ..lightning_internals import save_last_checkpoint_if_skipped, saves_on_train_epoch_end

# The checkpoint key that holds the version of ddpkit that wrote it.
VERSION_KEY = "ddpkit_version"


class RecordVersion(Callback):
    """Writes ddpkit's version into every checkpoint, so that a result can be traced to the code behind it."""

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        checkpoint[VERSION_KEY] = __version__


class ResumedAccumulation(Callback):
    """A run resumed mid-epoch accumulates as the uninterrupted run did under Lightning's
    GradientAccumulationScheduler. The scheduler sets each epoch's accumulation in on_train_epoch_start, which Lightning
    does not call for the epoch a checkpoint resumes into: without this, that epoch steps the optimizer after every
    batch (docs/measurements.md, "Gradient accumulation schedules"). Each batch, so that no callback order matters."""

    def __init__(self) -> None:
        self.schedules: list[GradientAccumulationScheduler] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.schedules = [c for c in trainer.callbacks if isinstance(c, GradientAccumulationScheduler)]

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        for schedule in self.schedules:  # none in most projects: nothing to do a batch
            trainer.accumulate_grad_batches = schedule.get_accumulate_grad_batches(trainer.current_epoch)


class CurrentModelCheckpoint(ModelCheckpoint):
    """`ModelCheckpoint` that checks its monitored metric early and keeps `last.ckpt` current.

    - A `monitor` key the module never logs fails at the end of the sanity check (seconds after the
      start, naming the keys the module does log), not after the first epoch as in Lightning 2.6.6.
      With `--trainer.num_sanity_val_steps 0` (or a metric logged only in training) Lightning's own
      check at the first save applies.
    - Lightning 2.6.6 rewrites `last.ckpt` only when a top-k checkpoint was saved at
      the same step (`model_checkpoint.py`, `on_validation_end`): with a monitored
      metric that stops improving, `last.ckpt` stays at the best epoch and a resume
      from it silently goes back in training. This saves it at every checkpoint
      point where Lightning skipped it.
    - `last.ckpt` is overwritten, never joined by `last-v1.ckpt`: Lightning versions a name it does not
      know as its own, as after resuming a run that was moved, and `--ckpt_path last` would then find the
      stale `last.ckpt` (`enable_version_counter` defaults to False here).
    """

    def __init__(self, *args: Any, enable_version_counter: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, enable_version_counter=enable_version_counter, **kwargs)

    def on_sanity_check_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        logged = trainer.callback_metrics
        if self.monitor is None or self.monitor in logged or trainer.num_sanity_val_steps == 0:
            return
        if not logged:
            return  # the module logs nothing in validation: its metrics come from training, checked later
        raise MisconfigurationException(
            f"ModelCheckpoint monitors {self.monitor!r}, which the module does not log in validation; it logs "
            f"{sorted(logged)}. Set `monitor:` (and `mode:`) of the checkpoint callback in config.yaml to one of "
            "them, or log the metric."
        )

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if saves_on_train_epoch_end(self, trainer):
            self._save_stale_last(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if not saves_on_train_epoch_end(self, trainer):
            self._save_stale_last(trainer)

    def _save_stale_last(self, trainer: L.Trainer) -> None:
        save_last_checkpoint_if_skipped(self, trainer)


def checkpoint_dir(trainer: L.Trainer) -> str:
    """Where the first ModelCheckpoint writes, else <default_root_dir>/checkpoints."""
    callback = trainer.checkpoint_callback
    if callback is not None and callback.dirpath:
        return str(callback.dirpath)
    return os.path.join(trainer.default_root_dir, "checkpoints")


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes each checkpoint to a temporary file, fsyncs it and renames it into place.

    `os.replace` is atomic on POSIX file systems: readers (and a resume after a
    crash) see the old complete file or the new complete file, never a partial
    one. A kill mid-write leaves only a `.tmp` file, which the next save in that
    directory removes. Remote paths (s3://...) use Lightning's default writer.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if "://" in str(path) and not str(path).startswith("file://"):
            return super().save_checkpoint(checkpoint, path, storage_options)
        atomic_save(checkpoint, Path(path))

    def load_checkpoint(self, path: Any, map_location: Any = "cpu", weights_only: bool | None = None) -> dict[str, Any]:
        # Tensors and plain containers only unless the caller asks otherwise: a checkpoint file
        # from elsewhere cannot run code on load (Lightning's own default is weights_only=False).
        if weights_only is None:
            weights_only = True
        # Into host memory, as Lightning's own loader does: a file written on GPUs then resumes where no GPU
        # is visible (without a map, torch restores each tensor to its saved cuda:N), and on N GPUs no rank
        # loads the whole file onto cuda:0. Lightning copies the weights into the model on the rank's own
        # device and moves the optimizer state there.
        if "://" in str(path) and not str(path).startswith("file://"):  # remote: Lightning's loader, as it loads
            return super().load_checkpoint(path, map_location=map_location or "cpu")
        local = Path(str(path).removeprefix("file://"))
        if not local.exists():
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        # torch.load itself: Lightning's loader takes `weights_only` only from 2.6 on.
        return torch.load(local, map_location=map_location or "cpu", weights_only=weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        fs = get_filesystem(path)
        if fs.exists(path):
            fs.rm(path, recursive=True)


def atomic_save(obj: Any, path: Path) -> None:
    """`torch.save` to a temporary file, fsync, rename into place: `path` is the old or the new whole file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        stale.unlink(missing_ok=True)  # left by a writer that was killed
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # makes the rename itself durable
    finally:
        os.close(directory)
