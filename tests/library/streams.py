"""Local shards of unequal sizes and a float64 regressor that records what each rank trains, for
test_streaming.py; a slow shard reader for the doctor (test_doctor.py). This folder must be on PYTHONPATH."""

import json
import os
import signal
import time
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from ddpkit.streaming import LocalShard, StreamingDataModule, shard_files
from ddpkit.toy import blobs

# 385 samples: 12 global batches of 32 and 1 left over. 12 shards for 8 streams, from 5 to 70 samples.
SIZES = [37, 5, 60, 23, 41, 18, 70, 9, 33, 50, 12, 27]


def write_shards(directory: Path, sizes: list[int] = SIZES) -> None:
    """One .pt file per shard: {"x": (n, 4) float64, "y": (n, 1), "id": (n,) int64}, ids 0..sum(sizes)-1."""
    directory.mkdir(parents=True, exist_ok=True)
    weights = torch.tensor([[1.0], [-2.0], [0.5], [3.0]], dtype=torch.float64)
    first = 0
    for i, size in enumerate(sizes):
        x = torch.randn(size, 4, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
        ids = torch.arange(first, first + size)
        torch.save({"x": x, "y": x @ weights, "id": ids}, directory / f"shard{i:02d}.pt")
        first += size


class UnevenShards(StreamingDataModule):
    """The shards of `write_shards` in `root`.

    Args:
        root: Folder of the shards.
        global_batch_size: Samples per optimizer step over all devices.
        micro_batch_size: Samples per forward pass on one device.
        num_workers: Loader workers per device.
        streams: Read positions per epoch.
    """

    def __init__(
        self,
        root: str = "",
        global_batch_size: int = 32,
        micro_batch_size: int | None = None,
        num_workers: int = 0,
        streams: int = 8,
    ) -> None:
        super().__init__(global_batch_size, micro_batch_size, num_workers, streams)
        self.root = root

    def train_shards(self) -> list[LocalShard]:
        return shard_files(self.root)


class RecordingRegressor(L.LightningModule):
    """Linear regression with SGD; every training step appends {epoch, step, ids} to `record`/rank<r>.jsonl.

    Args:
        record: Folder of the per-rank records.
        kill_at_step: Rank 0 kills its whole process group with SIGKILL when this step starts (-1: never).
    """

    def __init__(self, record: str = "", kill_at_step: int = -1) -> None:
        super().__init__()
        self.record, self.kill_at_step = record, kill_at_step
        self.net = nn.Linear(4, 1)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        if self.global_step == self.kill_at_step and self.global_rank == 0:
            os.killpg(os.getpgrp(), signal.SIGKILL)  # kill -9 of the job: every rank and worker, no clean-up
        entry = {"epoch": self.current_epoch, "step": self.global_step, "ids": batch["id"].tolist()}
        with (Path(self.record) / f"rank{self.global_rank}.jsonl").open("a") as f:
            f.write(json.dumps(entry) + "\n")
        return F.mse_loss(self.net(batch["x"]), batch["y"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class _SlowShard:
    """A shard of toy blobs whose reader sleeps `delay_s` per sample, like a slow disk or decoder."""

    def __init__(self, name: str, samples: list, delay_s: float) -> None:
        self.name, self.samples, self.delay_s = name, samples, delay_s

    def __len__(self) -> int:
        return len(self.samples)

    def read(self, start: int = 0):
        for sample in self.samples[start:]:
            time.sleep(self.delay_s)
            yield sample


class SlowShards(StreamingDataModule):
    """The toy's 1,079 training blobs in 16 shards whose reader sleeps `sample_delay_ms` per sample (data-bound).

    Args:
        sample_delay_ms: Sleep per training sample, in the reading process (a loader worker).
        global_batch_size: Samples per optimizer step over all devices.
        num_workers: Loader workers per device.
    """

    def __init__(self, sample_delay_ms: float = 8.0, global_batch_size: int = 16, num_workers: int = 2) -> None:
        super().__init__(global_batch_size, num_workers=num_workers, streams=8)
        self.sample_delay_ms = sample_delay_ms

    def train_shards(self) -> list[_SlowShard]:
        samples = list(blobs(1079, seed=0))
        return [_SlowShard(f"blobs{i}", samples[i::16], self.sample_delay_ms / 1000) for i in range(16)]


class _BlobStream(IterableDataset):
    """The toy's training blobs as a stream that knows nothing of ranks, as users first write one."""

    def __iter__(self):
        yield from blobs(1079, seed=0)


class PlainStream(L.LightningDataModule):
    """The stream in a plain LightningDataModule: every rank reads all of it.

    Args:
        batch_size: Samples per device and step.
    """

    def __init__(self, batch_size: int = 32) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_BlobStream(), self.batch_size)
