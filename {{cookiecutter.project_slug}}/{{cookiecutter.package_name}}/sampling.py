"""Samplers that make N devices see exactly what 1 device sees.

Training: `GlobalBatchSampler` draws one seeded permutation of the whole
dataset per epoch, cuts it into global batches and hands rank r the r-th
contiguous slice of every global batch. Global batch k is therefore the same
set of samples on any number of devices, so the averaged gradient is the same
up to float rounding. Lightning's own `DistributedSampler` deals samples out
round-robin and pads the last batch with duplicates; it keeps the global batches
equal only when the padding happens to fall in a dropped tail.

Evaluation: `eval_sampler` gives every sample to exactly one rank with no
padding, so a metric reduced over ranks counts each sample once.

Both are `DistributedSampler`s, which tells Lightning to keep them instead of
injecting its own, and still to call `set_epoch` at every epoch.
"""

import torch
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch.utils.data import Dataset, DistributedSampler


class GlobalBatchSampler(DistributedSampler):
    """Yields this rank's share of each global batch, in the same order on any world size.

    The tail of an epoch that does not fill a whole global batch is dropped (a
    different tail every epoch when shuffling), so every optimizer step sees
    exactly `global_batch_size` samples.
    """

    def __init__(
        self,
        dataset: Dataset,
        global_batch_size: int,
        num_replicas: int,
        rank: int,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if global_batch_size % num_replicas:
            raise ValueError(
                f"global_batch_size={global_batch_size} does not divide evenly over {num_replicas} "
                f"processes: use a multiple of {num_replicas} (e.g. "
                f"{global_batch_size - global_batch_size % num_replicas or num_replicas})."
            )
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        self.global_batch_size = global_batch_size
        self.batch_size = global_batch_size // num_replicas  # per device
        self.num_global_batches = len(dataset) // global_batch_size  # type: ignore[arg-type]
        if self.num_global_batches == 0:
            raise ValueError(
                f"global_batch_size={global_batch_size} is larger than the dataset ({len(dataset)} samples): lower it."  # type: ignore[arg-type]
            )

    def global_order(self) -> torch.Tensor:
        """The epoch's sample indices, shaped (num_global_batches, global_batch_size)."""
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=generator)
        else:
            order = torch.arange(n)
        return order[: self.num_global_batches * self.global_batch_size].view(self.num_global_batches, -1)

    def __iter__(self):
        start = self.rank * self.batch_size
        mine = self.global_order()[:, start : start + self.batch_size]  # (steps, per-device batch)
        return iter(mine.reshape(-1).tolist())

    def __len__(self) -> int:
        return self.num_global_batches * self.batch_size


def eval_sampler(dataset: Dataset, num_replicas: int, rank: int) -> DistributedSampler:
    """Every sample on exactly one rank, none repeated: ranks may hold one sample more or less."""
    return UnrepeatedDistributedSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=False)
