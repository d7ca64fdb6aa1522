"""Orders of an epoch's training indices to return from `GlobalBatchDataModule.train_order(seed, epoch)`.

Each is a function of (seed, epoch) and of the data alone, never of the rank or the device count: the data module
cuts it into global batches, so every device count trains the same batches and a mid-epoch resume continues in it.
"""

from collections.abc import Sequence

import torch


def _generator(seed: int, epoch: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + epoch)


def weighted_order(weights: Sequence[float] | torch.Tensor, num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """`num_samples` indices drawn with replacement, index i with probability weights[i] / sum(weights) (a rare
    class seen more often). A sample may appear twice in an epoch, in a global batch, on two ranks: as drawn."""
    weights = torch.as_tensor(weights, dtype=torch.float64)
    return torch.multinomial(weights, num_samples, replacement=True, generator=_generator(seed, epoch))


def bucketed_order(
    lengths: Sequence[int] | torch.Tensor, global_batch_size: int, seed: int, epoch: int
) -> torch.Tensor:
    """Every index once, global batches of similar length: the indices shuffled, sorted by length within windows of
    `window` global batches (50, or the whole set if smaller), cut into global batches, and the batches shuffled.
    Within a global batch the samples go longest first, so each rank's contiguous share (and each micro-batch) holds
    neighbours in length too: padding to the longest in a batch pads little. The order of the batches is random,
    so no epoch trains all its short sequences first; which samples share a batch changes every epoch."""
    lengths = torch.as_tensor(lengths)
    n, window = len(lengths), 50 * global_batch_size
    generator = _generator(seed, epoch)
    shuffled = torch.randperm(n, generator=generator)
    chunks = []
    for start in range(0, n, window):
        part = shuffled[start : start + window]
        chunks.append(part[torch.argsort(lengths[part], descending=True, stable=True)])
    order = torch.cat(chunks)
    full = n // global_batch_size * global_batch_size
    batches = order[:full].view(-1, global_batch_size)
    batches = batches[torch.randperm(len(batches), generator=generator)]
    return torch.cat([batches.reshape(-1), order[full:]])  # the tail that fills no global batch, dropped later
