"""The bundled 8x8 handwritten-digits set: datasets only; `GlobalBatchDataModule` does the loading."""

import csv
import gzip
import os
from pathlib import Path

import torch
from ddpkit import GlobalBatchDataModule
from torch.utils.data import Dataset, TensorDataset, random_split

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


class DigitsDataModule(GlobalBatchDataModule):
    """Train/val/test splits of the bundled digits set.

    Args:
        global_batch_size: Samples per optimizer step summed over all devices. Each of
            the N processes loads global_batch_size / N; it must divide evenly.
        micro_batch_size: Samples per forward pass on one device (None: its whole share);
            gradient accumulation makes up the rest of the global batch.
        num_workers: DataLoader worker processes per device. 0 loads in the training
            process, which is fastest for this small in-memory set.
        pin_memory: Batches in pinned memory, for asynchronous copies to the GPU (None: on GPUs only).
        persistent_workers: Keep loader workers from one epoch to the next (with num_workers > 0).
        val_size: Samples held out for validation (odd by default, to prove no padding).
        test_size: Samples held out for testing.
        split_seed: Seed of the train/val/test split; independent of the training seed.
        data_path: A CSV (optionally .gz) with 64 pixel columns and a label; the
            bundled file when None.
    """

    def __init__(
        self,
        global_batch_size: int = 64,
        micro_batch_size: int | None = None,
        num_workers: int = 0,
        pin_memory: bool | None = None,
        persistent_workers: bool = True,
        val_size: int = 359,
        test_size: int = 359,
        split_seed: int = 0,
        data_path: str | None = None,
    ) -> None:
        super().__init__(global_batch_size, micro_batch_size, num_workers, pin_memory, persistent_workers)
        self.save_hyperparameters()  # stored in checkpoints; the code reads the attributes below
        self.val_size, self.test_size, self.split_seed = val_size, test_size, split_seed
        self.data_path = Path(data_path) if data_path else DIGITS_CSV
        self._splits: list[Dataset] | None = None

    def prepare_data(self) -> None:
        # Runs once per node before any process touches the data: fail here, not in N copies.
        if not self.data_path.is_file():
            raise FileNotFoundError(f"data_path {str(self.data_path)!r} does not exist: pass --data.data_path FILE.")

    def splits(self) -> list[Dataset]:
        """Train, val and test, read and split once per process."""
        if self._splits is None:
            full = load_digits(self.data_path)
            sizes = [len(full) - self.val_size - self.test_size, self.val_size, self.test_size]
            if min(sizes) <= 0:
                raise ValueError(f"val_size + test_size must leave training samples; the set has {len(full)}.")
            self._splits = random_split(full, sizes, generator=torch.Generator().manual_seed(self.split_seed))
        return self._splits

    def train_dataset(self) -> Dataset:
        return self.splits()[0]

    def val_dataset(self) -> Dataset:
        return self.splits()[1]

    def test_dataset(self) -> Dataset:
        return self.splits()[2]
