"""The digits as a sharded source: the example of a data set that does not fit in memory.

`prepare_data` writes the bundled digits' train/val/test splits (the same as DigitsDataModule's) as `.pt`
shards of unequal sizes into `shard_dir`, once; a real project's shards come from its own pipeline, or from
`ddpkit.data.sources` (LitData, WebDataset, `datasets`). Training then streams them: `StreamingDataModule` reads
each epoch's shards in a seeded order, the same global batches on any device count that divides `streams`,
the same number of steps on every rank, and resumes mid-epoch where it stopped.
"""

import os
import shutil
from pathlib import Path

import torch
from ddpkit.data.streaming import LocalShard, StreamingDataModule, shard_files

from ..digits.data import DigitsDataModule

SPLITS = ("train", "val", "test")
# The project's folder (this file is <project>/<package>/stream/data.py): every run finds the same shards,
# whatever its working directory (the guarantee suite runs each in its own).
PROJECT = Path(__file__).resolve().parents[2]


def write_shards(samples, directory: Path, mean_size: int, seed: int = 0) -> None:
    """`samples` ((x, y) pairs) as shards of mean_size / 2 to 3 x mean_size / 2 samples, named in order."""
    directory.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    sizes = torch.randint(mean_size // 2, mean_size * 3 // 2 + 1, (len(samples),), generator=generator)
    start, index = 0, 0
    while start < len(samples):
        part = [samples[i] for i in range(start, min(start + int(sizes[index]), len(samples)))]
        x, y = torch.stack([p[0] for p in part]), torch.stack([p[1] for p in part])
        torch.save((x, y), directory / f"{index:05d}.pt")  # (n, 64) float32 pixels, (n,) int64 labels
        start, index = start + len(part), index + 1


class DigitShards(StreamingDataModule):
    """The digits, streamed from shards on disk.

    Args:
        global_batch_size: Samples per optimizer step summed over all devices; a multiple of `streams`.
        micro_batch_size: Samples per forward pass on one device (None: its whole share).
        num_workers: Loader worker processes per device, each reading whole streams.
        streams: Read positions in each epoch's shard order; every device count you use must divide it.
        pin_memory: Batches in pinned memory, for asynchronous copies to the GPU (None: on GPUs only).
        persistent_workers: Keep the evaluation loaders' workers from one epoch to the next (training starts its
            workers every epoch: they read that epoch's shard order).
        shard_dir: Where the shards are written (once) and read from; None: data/digit-shards in the project.
        shard_size: Mean samples per shard (sizes vary from half to 1.5 times it).
    """

    def __init__(
        self,
        global_batch_size: int = 64,
        micro_batch_size: int | None = None,
        num_workers: int = 0,
        streams: int = 8,
        pin_memory: bool | None = None,
        persistent_workers: bool = True,
        shard_dir: str | None = None,
        shard_size: int = 100,
    ) -> None:
        super().__init__(global_batch_size, micro_batch_size, num_workers, streams, pin_memory, persistent_workers)
        self.save_hyperparameters()
        self.shard_dir = Path(shard_dir) if shard_dir else PROJECT / "data" / "digit-shards"
        self.shard_size = shard_size

    def prepare_data(self) -> None:
        # Once per node, before any process reads: written beside the final folder and renamed, so that a run
        # killed while writing leaves no half set of shards.
        if self.shard_dir.is_dir():
            return
        partial = self.shard_dir.with_name(f"{self.shard_dir.name}.partial-{os.getpid()}")
        digits = DigitsDataModule()
        for split, samples in zip(SPLITS, digits.splits(), strict=True):
            write_shards(samples, partial / split, self.shard_size)
        try:
            partial.rename(self.shard_dir)
        except OSError:  # another run wrote the same shards first
            shutil.rmtree(partial)
            if not self.shard_dir.is_dir():
                raise

    def train_shards(self) -> list[LocalShard]:
        return shard_files(self.shard_dir / "train")

    def val_shards(self) -> list[LocalShard]:
        return shard_files(self.shard_dir / "val")

    def test_shards(self) -> list[LocalShard]:
        return shard_files(self.shard_dir / "test")
