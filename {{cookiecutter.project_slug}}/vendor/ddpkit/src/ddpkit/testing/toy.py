"""The library's own toy model and data: what its tests and `python -m ddpkit.faults` train, whatever a project's
config.yaml selects, so that deleting or replacing a project's example breaks neither.

    python -m ddpkit.toy fit --trainer.accelerator cpu --trainer.devices 2

runs the toy through the project CLI (`ddpkit.run.cli.main`) over its own config (`toy.yaml` beside this file):
synthetic data (10 Gaussian blobs in 64 dimensions, from a fixed seed) sized like the digits example, 1,079
training samples (16 global batches of 64), 359 validation, 359 test. `FaultyClassifier` misbehaves on request.
"""

import os
import time
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from ..data.global_batch import GlobalBatchDataModule

CONFIG = Path(__file__).with_name("toy.yaml")
FEATURES, CLASSES = 64, 10


def blobs(n: int, seed: int) -> TensorDataset:
    """`n` samples: a class's fixed center plus unit noise; features (n, 64) float32, labels (n,) int64."""
    generator = torch.Generator().manual_seed(seed)
    centers = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(1234)) * 0.5
    labels = torch.randint(0, CLASSES, (n,), generator=generator)
    return TensorDataset(centers[labels] + torch.randn(n, FEATURES, generator=generator), labels)


class ToyData(GlobalBatchDataModule):
    """Blobs split 1,079 / 359 / 359.

    Args:
        global_batch_size: Samples per optimizer step summed over all devices.
        micro_batch_size: Samples per forward pass on one device (None: its whole share).
        num_workers: DataLoader worker processes per device.
        train_size: Training samples.
        pin_memory: Batches in pinned memory (None: on GPUs only).
        persistent_workers: Keep loader workers from one epoch to the next (with num_workers > 0).
    """

    def __init__(
        self,
        global_batch_size: int = 64,
        micro_batch_size: int | None = None,
        num_workers: int = 0,
        train_size: int = 1079,
        pin_memory: bool | None = None,
        persistent_workers: bool = True,
    ) -> None:
        super().__init__(global_batch_size, micro_batch_size, num_workers, pin_memory, persistent_workers)
        self.train_size = train_size

    def train_dataset(self) -> Dataset:
        return blobs(self.train_size, seed=0)

    def val_dataset(self) -> Dataset:
        return blobs(359, seed=1)

    def test_dataset(self) -> Dataset:
        return blobs(359, seed=2)


class PlainToyData(L.LightningDataModule):
    """The same blobs as a plain LightningDataModule (per-device batch size, shuffled loader), as users write them.

    Args:
        batch_size: Samples per device and step.
        num_workers: DataLoader worker processes per device.
    """

    def __init__(self, batch_size: int = 32, num_workers: int = 0) -> None:
        super().__init__()
        self.batch_size, self.num_workers = batch_size, num_workers

    def train_dataloader(self) -> DataLoader:
        return DataLoader(blobs(1079, seed=0), self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(blobs(359, seed=1), self.batch_size, num_workers=self.num_workers)


class ToyClassifier(L.LightningModule):
    """An MLP with AdamW; logs train/loss, val/loss and val/acc (test/* likewise).

    Args:
        hidden_dim: Width of the hidden layers.
        num_layers: Hidden layers.
        lr: AdamW learning rate.
    """

    def __init__(self, hidden_dim: int = 128, num_layers: int = 2, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lr = lr
        widths = [FEATURES] + [hidden_dim] * num_layers
        layers: list[nn.Module] = []
        for a, b in zip(widths, widths[1:], strict=False):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(widths[-1], CLASSES))
        # One metric object per stage: torchmetrics sums their states over ranks, so each sample counts once.
        self.losses = nn.ModuleDict({stage: MeanMetric() for stage in ("val", "test")})
        self.accs = nn.ModuleDict({stage: MulticlassAccuracy(CLASSES, average="micro") for stage in ("val", "test")})

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)  # (B, 64) -> (B, 10) logits

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        # Epoch-level, so the sync over ranks runs once per epoch: an all-reduce in every step would absorb a
        # slow rank's lag there, where the doctor counts it as compute rather than waiting (its straggler test).
        self.log("train/loss", loss.detach(), on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def _evaluate(self, batch: tuple[Tensor, Tensor], stage: str) -> None:
        x, y = batch
        logits = self(x)
        self.losses[stage].update(F.cross_entropy(logits, y, reduction="none"))
        self.accs[stage].update(logits, y)
        self.log(f"{stage}/loss", self.losses[stage])
        self.log(f"{stage}/acc", self.accs[stage])

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self(batch[0]).argmax(dim=-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class FaultyClassifier(ToyClassifier):
    """ToyClassifier that fails on one rank at one step, or just trains slowly (`python -m ddpkit.faults`).

    Args:
        fault: "none", "raise" (an exception), "exit" (os._exit(3)) or "hang" (sleeps for an hour).
        fault_rank: The global rank that misbehaves.
        fault_step: The optimizer step at which it misbehaves; from then on every rank also
            touches `marker` (so the caller knows training is under way).
        step_sleep: Seconds each training step sleeps, to leave time to send a signal.
        marker: A file created once `fault_step` is reached (empty: none).
        ballast_mb: Size of an extra saved buffer, to make checkpoint writes slow.
    """

    def __init__(
        self,
        fault: str = "none",
        fault_rank: int = 1,
        fault_step: int = 3,
        step_sleep: float = 0.0,
        marker: str = "",
        ballast_mb: int = 0,
    ) -> None:
        super().__init__()
        self.fault, self.fault_rank, self.fault_step = fault, fault_rank, fault_step
        self.step_sleep, self.marker = step_sleep, marker
        self.register_buffer("ballast", torch.zeros(ballast_mb * 2**18))  # float32: 2**18 per MB

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        if self.global_step >= self.fault_step:
            if self.marker:
                Path(self.marker).touch()
            if self.global_rank == self.fault_rank and self.global_step == self.fault_step:
                if self.fault == "raise":
                    raise RuntimeError(f"injected fault on rank {self.global_rank}")
                if self.fault == "exit":
                    os._exit(3)
                if self.fault == "hang":
                    time.sleep(3600)
        time.sleep(self.step_sleep)
        return super().training_step(batch, batch_idx)


def main(args: list[str] | None = None, run: bool = True):
    """`main.py` for the toy: the project CLI over toy.yaml."""
    from ..run.cli import main as run_cli  # not at the top: the CLI imports far more than the model needs

    return run_cli(CONFIG, args, run)


if __name__ == "__main__":
    main()
