"""The bundled 8x8 handwritten-digits set as a LightningDataModule with a *global* batch size."""

import csv
import gzip
import os
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset, random_split

from .sampling import GlobalBatchSampler, ResumableLoader, eval_sampler

# 1,797 8x8 images of handwritten digits, pixels 0..16, one row = 64 pixels + label.
# UCI "Optical Recognition of Handwritten Digits" (Alpaydin & Kaynak, 1998), CC BY 4.0.
DIGITS_CSV = Path(__file__).with_name("digits.csv.gz")


def load_digits(path: str | os.PathLike = DIGITS_CSV) -> TensorDataset:
    """Read the digits CSV: features (N, 64) float32 in [0, 1], labels (N,) int64."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = [[int(v) for v in row] for row in csv.reader(f) if row]
    table = torch.tensor(rows)
    return TensorDataset(table[:, :-1].float() / 16.0, table[:, -1].long())


class DigitsDataModule(L.LightningDataModule):
    """Train/val/test splits of the bundled digits set.

    Args:
        global_batch_size: Samples per optimizer step summed over all devices. Each of
            the N processes loads global_batch_size / N; it must divide evenly.
        val_size: Samples held out for validation (odd by default, to prove no padding).
        test_size: Samples held out for testing.
        split_seed: Seed of the train/val/test split; independent of the training seed.
        num_workers: DataLoader worker processes per device. 0 loads in the training
            process, which is fastest for this small in-memory set.
        data_path: A CSV (optionally .gz) with 64 pixel columns and a label; the
            bundled file when None.
    """

    def __init__(
        self,
        global_batch_size: int = 64,
        val_size: int = 359,
        test_size: int = 359,
        split_seed: int = 0,
        num_workers: int = 0,
        data_path: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()  # stored in checkpoints; the code reads the attributes below
        self.global_batch_size, self.num_workers = global_batch_size, num_workers
        self.val_size, self.test_size, self.split_seed = val_size, test_size, split_seed
        self.data_path = Path(data_path) if data_path else DIGITS_CSV

    def prepare_data(self) -> None:
        # Runs once per node before any process touches the data: fail here, not in N copies.
        if not self.data_path.is_file():
            raise FileNotFoundError(f"data_path {str(self.data_path)!r} does not exist: pass --data.data_path FILE.")

    def setup(self, stage: str) -> None:
        full = load_digits(self.data_path)
        sizes = [len(full) - self.val_size - self.test_size, self.val_size, self.test_size]
        if min(sizes) <= 0:
            raise ValueError(f"val_size + test_size must leave training samples; the set has {len(full)}.")
        generator = torch.Generator().manual_seed(self.split_seed)
        self.train_set, self.val_set, self.test_set = random_split(full, sizes, generator=generator)
        # Fail before any step when the global batch cannot be split evenly over the processes.
        self.train_sampler()

    def train_sampler(self) -> GlobalBatchSampler:
        # Seeded by --seed_everything (Lightning exports it to every rank), like Lightning's own sampler.
        return GlobalBatchSampler(
            self.train_set,
            self.global_batch_size,
            num_replicas=self.trainer.world_size if self.trainer else 1,
            rank=self.trainer.global_rank if self.trainer else 0,
            seed=int(os.environ.get("PL_GLOBAL_SEED", 0)),
        )

    def _loader(self, dataset, sampler, batch_size: int, loader_class: type[DataLoader] = DataLoader) -> DataLoader:
        workers = self.num_workers
        return loader_class(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            num_workers=workers,
            persistent_workers=workers > 0,  # keeps worker start-up out of every epoch
            pin_memory=torch.cuda.is_available(),  # faster, asynchronous host-to-GPU copies
        )

    def train_dataloader(self) -> DataLoader:
        sampler = self.train_sampler()
        # Resumable: a mid-epoch checkpoint continues with the samples not yet seen in that epoch.
        return self._loader(self.train_set, sampler, sampler.batch_size, ResumableLoader)

    def _eval_loader(self, dataset) -> DataLoader:
        world, rank = (self.trainer.world_size, self.trainer.global_rank) if self.trainer else (1, 0)
        per_device = max(1, self.global_batch_size // world)
        return self._loader(dataset, eval_sampler(dataset, world, rank), per_device)

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader(self.val_set)

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader(self.test_set)

    def predict_dataloader(self) -> DataLoader:
        return self._eval_loader(self.test_set)
