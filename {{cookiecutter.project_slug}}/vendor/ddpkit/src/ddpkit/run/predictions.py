"""`python main.py predict` keeps its predictions: one file, every sample once, in dataset order.

Lightning computes predictions on every rank and, without a writer, keeps them in memory only (and with
several processes, only each rank's own share). `PredictionWriter`, which the CLI adds to `predict`, has
each rank hand its share with the dataset index of every sample to rank 0, which puts them in dataset
order and writes `predictions.pt` into the run's log directory: what `predict_step` returned for each
batch, split into samples and stacked again, so the file is the same on any number of devices. Outputs whose
samples differ in shape (token sequences, detection boxes) are kept as a list of one tensor per sample, unpadded:
the 1-device batches are dealt whole to the ranks, so each sample's tensor is the same on any number of devices.
"""

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter

from .checkpoints import atomic_save


class PredictionWriter(BasePredictionWriter):
    """Writes `<log dir>/<filename>`: `torch.save` of the predictions of the whole predict set in dataset
    order, with `predict_step`'s structure and the samples along the first dimension. `predict_step` returns
    batched outputs (a tensor, or a dict or tuple of them), or a list with one entry per sample (a tensor, or a
    dict or tuple of them, of any shape). A tensor whose samples all have one shape is stacked; else it is a list
    of one tensor per sample. Load it with `torch.load(path, weights_only=True)`.

    Args:
        filename: File name in the run's log directory (`--trainer.default_root_dir` without a logger).
    """

    def __init__(self, filename: str = "predictions.pt") -> None:
        super().__init__(write_interval="epoch")
        self.filename = filename

    def write_on_epoch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, predictions: Any, batch_indices: Any
    ) -> None:
        if len(batch_indices) != 1:  # one list per dataloader (Lightning unwraps `predictions` for one)
            raise ValueError("PredictionWriter writes one predict dataloader; this module returns several.")
        mine = [
            (index, sample)
            for batch, indices in zip(predictions, batch_indices[0], strict=True)
            for index, sample in zip(indices, unbatch(batch, len(indices)), strict=True)
        ]
        shares = [mine]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            shares = [None] * trainer.world_size
            torch.distributed.all_gather_object(shares, mine)
        log_dir = trainer.log_dir  # a collective: every rank asks
        if not trainer.is_global_zero:
            return
        rows = sorted((row for share in shares for row in share), key=lambda row: row[0])
        if not rows:
            return
        indices = [index for index, _ in rows]
        if indices != list(range(len(indices))):
            raise RuntimeError(f"predictions cover sample indices {indices[:5]}...: not each sample exactly once")
        path = Path(log_dir or trainer.default_root_dir) / self.filename
        atomic_save(stack([sample for _, sample in rows]), path)  # a reader never sees half a file
        sys.stderr.write(f"predict: wrote {len(rows)} predictions to {path}\n")


def unbatch(batch: Any, count: int) -> list[Any]:
    """A batch of `count` samples' predictions as one prediction per sample (on the CPU, for gathering)."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0 or len(batch) != count:
            raise ValueError(f"predict_step returned a tensor of shape {tuple(batch.shape)} for {count} samples")
        return list(batch.detach().cpu().unbind(0))
    if isinstance(batch, dict):
        columns = {key: unbatch(value, count) for key, value in batch.items()}
        return [dict(zip(columns, row, strict=True)) for row in zip(*columns.values(), strict=True)]
    if isinstance(batch, tuple):
        return [type(batch)(row) for row in zip(*(unbatch(value, count) for value in batch), strict=True)]
    if isinstance(batch, list):  # one entry per sample: ragged outputs cannot be batched without padding
        if len(batch) != count:
            raise ValueError(
                f"predict_step returned a list of {len(batch)} for {count} samples: a list holds one prediction "
                "per sample; return several batched outputs as a tuple or dict"
            )
        return [to_cpu(entry) for entry in batch]
    raise TypeError(
        f"predict_step returned {type(batch).__name__}: return a tensor, a dict or tuple of them, or a list of one "
        "entry per sample"
    )


def to_cpu(entry: Any) -> Any:
    """One sample's prediction with its tensors detached on the CPU."""
    if isinstance(entry, torch.Tensor):
        return entry.detach().cpu()
    if isinstance(entry, dict):
        return {key: to_cpu(value) for key, value in entry.items()}
    if isinstance(entry, (list, tuple)):
        return type(entry)(to_cpu(value) for value in entry)
    return entry


def stack(samples: list[Any]) -> Any:
    """The inverse of `unbatch`: per-sample predictions stacked along a new first dimension; a tensor whose
    samples differ in shape, and anything not a tensor, dict or tuple, as a list of the samples' entries."""
    first = samples[0]
    if isinstance(first, torch.Tensor):
        if all(sample.shape == first.shape for sample in samples):
            return torch.stack(samples)
        return list(samples)  # ragged: padding would change the values and depend on the longest sample
    if isinstance(first, dict):
        return {key: stack([sample[key] for sample in samples]) for key in first}
    if isinstance(first, tuple):
        return type(first)(stack(list(column)) for column in zip(*samples, strict=True))
    return list(samples)


def sample_count(predictions: Any) -> int:
    """How many samples a predictions file holds: the length of its first tensor or list."""
    while isinstance(predictions, (dict, tuple)):
        predictions = next(iter(predictions.values())) if isinstance(predictions, dict) else predictions[0]
    return len(predictions)
