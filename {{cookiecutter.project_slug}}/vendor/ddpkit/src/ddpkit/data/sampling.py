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

Resuming: `ResumableLoader` tells Lightning (through `state_dict`) how many global
batches of the epoch were trained; on a mid-epoch restore the sampler skips
exactly those, so the rest of the epoch sees the samples not yet seen, on any
world size.
"""

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ..lightning_internals import load_pending_train_loader_states


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
        order: Callable[[int, int], Sequence[int] | torch.Tensor] | None = None,
        with_epoch: bool = False,
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
        self.order, self.with_epoch = order, with_epoch
        # An order's length is its epoch's: the same every epoch (Lightning counts an epoch's steps once).
        self.order_length = len(self.user_order(0)) if order is not None else len(dataset)  # type: ignore[arg-type]
        self.num_global_batches = self.order_length // global_batch_size
        if self.num_global_batches == 0:
            raise ValueError(
                f"global_batch_size={global_batch_size} is larger than the dataset's epoch ({self.order_length} "
                "samples): lower it."
            )
        self._resume: tuple[int, int] | None = None  # (epoch, global batches to skip), used once
        self.start_batch = 0  # the global batch the current iteration started at

    def resume(self, epoch: int, global_batches_done: int) -> None:
        """Make the next iteration of `epoch` skip its first `global_batches_done` global batches.

        A count that completes the epoch resumes at the start of the next one.
        """
        if global_batches_done >= self.num_global_batches:
            epoch, global_batches_done = epoch + 1, 0
        self.set_epoch(epoch)
        self._resume = (epoch, global_batches_done)

    def global_order(self) -> torch.Tensor:
        """The epoch's sample indices, shaped (num_global_batches, global_batch_size)."""
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.order is not None:
            order = self.user_order(self.epoch)
        elif self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=generator)
        else:
            order = torch.arange(n)
        return order[: self.num_global_batches * self.global_batch_size].view(self.num_global_batches, -1)

    def user_order(self, epoch: int) -> torch.Tensor:
        """The order the `order` hook gives for `epoch`, checked: indices of the dataset, the same length each epoch."""
        n = len(self.dataset)  # type: ignore[arg-type]
        order = torch.as_tensor(self.order(self.seed, epoch), dtype=torch.long).reshape(-1)  # type: ignore[misc]
        if hasattr(self, "order_length") and len(order) != self.order_length:
            raise ValueError(
                f"the order of epoch {epoch} has {len(order)} indices, epoch 0's {self.order_length}: "
                "an epoch's order must have the same length every epoch"
            )
        if len(order) and (order.min() < 0 or order.max() >= n):
            raise ValueError(f"the order of epoch {epoch} holds an index outside the dataset's 0..{n - 1}")
        return order

    def __iter__(self) -> Iterator[int] | Iterator[tuple[int, int]]:
        # Skip only in the epoch that was interrupted (Lightning calls set_epoch after the restore).
        resume, self._resume = self._resume, None
        self.start_batch = resume[1] if resume and resume[0] == self.epoch else 0
        start = self.rank * self.batch_size
        mine = self.global_order()[self.start_batch :, start : start + self.batch_size]  # (steps, per-device batch)
        if self.with_epoch:  # for SeededSamples (draws.py): the epoch travels with the index, to any worker
            return ((self.epoch, i) for i in mine.reshape(-1).tolist())
        return iter(mine.reshape(-1).tolist())

    def __len__(self) -> int:
        return self.num_global_batches * self.batch_size


class ResumableLoader(DataLoader):
    """A DataLoader over a `GlobalBatchSampler` whose position Lightning saves and restores.

    Lightning stores `state_dict()` in every checkpoint (it treats loaders with
    `state_dict`/`load_state_dict` as resumable) and calls `load_state_dict` when
    it resumes, before iterating. The position counts global batches whose
    optimizer step is complete: with gradient accumulation a global batch is
    `batches_per_step` loader batches, and a checkpoint taken between them
    resumes at the start of that global batch, whose partial gradient the
    checkpoint does not hold. Batches the sampler or workers prepared ahead do
    not count.
    """

    def __init__(
        self, *args: Any, batches_per_step: int = 1, current_epoch: Callable[[], int] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.sampler, GlobalBatchSampler):
            raise TypeError("ResumableLoader needs a GlobalBatchSampler as its sampler.")
        self.batches_per_step = batches_per_step
        self.current_epoch = current_epoch
        self._position = (0, 0)  # (epoch, global batches of that epoch completed)

    def __iter__(self) -> Iterator[Any]:
        sampler = self.sampler
        if self.current_epoch is not None:
            # Lightning 2.6 calls set_epoch with its count of processed epochs, which is one ahead of
            # current_epoch after resuming a max_steps run from an epoch-end checkpoint (fit_loop.on_run_start
            # syncs the two only for epoch-based runs): every later epoch would take the next one's order.
            sampler.set_epoch(self.current_epoch())
        start = None
        for handed, batch in enumerate(super().__iter__(), start=1):
            if start is None:  # the sampler has started now, so start_batch includes a restored skip
                start = sampler.start_batch
            # Counted before the batch is trained: Lightning saves a step's checkpoint after the batch that
            # completes it, when this generator has already handed that batch out.
            self._position = (sampler.epoch, start + handed // self.batches_per_step)
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._position[0], "global_batches_done": self._position[1]}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.sampler.resume(state_dict["epoch"], state_dict["global_batches_done"])


def eval_sampler(dataset: Dataset, num_replicas: int, rank: int) -> DistributedSampler:
    """Every sample on exactly one rank, none repeated: ranks may hold one sample more or less."""
    return UnrepeatedDistributedSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=False)


class BlockSampler(DistributedSampler):
    """Rank r's share in whole batches of the 1-device order: batches r, r + N, r + 2N, ... of `batch_size`.

    Every batch holds the same samples in the same order on any number of devices. A result that depends
    on its batch only through rounding (matrix kernels chosen by the batch's size, the position of a row
    in the kernel's blocks) then has the same bits too: `predict` writes the same file on 1 and N devices,
    where round-robin sharding (`eval_sampler`) differed by one unit in the last place.
    """

    def __init__(self, dataset: Dataset, batch_size: int, num_replicas: int, rank: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False)
        n = len(dataset)  # type: ignore[arg-type]
        batches = range(rank, -(-n // batch_size), num_replicas)
        self.indices = [i for b in batches for i in range(b * batch_size, min((b + 1) * batch_size, n))]
        self.num_samples = len(self.indices)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples


def replaced_sampler(data: Any, loader: Any) -> str:
    """One sentence where a global-batch data module's train_dataloader() returns a loader of its own (not a
    `ResumableLoader` over a `GlobalBatchSampler`), saying what it gives up; "" where it does not."""
    # The library's own loaders keep both (a StreamingDataModule's StreamLoader counts its position too): only a
    # train_dataloader() defined outside ddpkit can give them up.
    if isinstance(loader, ResumableLoader) or type(data).train_dataloader.__module__.startswith("ddpkit."):
        return ""
    sampler = getattr(loader, "sampler", None)
    what = f"{type(loader).__name__} over a {type(sampler).__name__}"
    lost = (
        "the exact mid-epoch resume (its checkpoints hold no loader position: a resume starts the epoch's order over)"
    )
    if not isinstance(sampler, GlobalBatchSampler):
        lost += (
            " and the global batch (step k's samples then depend on the device count: 1 and N devices do not train "
            "the same weights)"
        )
    return (
        f"{type(data).__name__}.train_dataloader() returns a {what}, not the data module's ResumableLoader: it gives "
        f"up {lost}; override train_order(seed, epoch) for an order of your own and loader_kwargs() for loader "
        "settings instead (the manual: vendor/ddpkit/docs/sample-order.md)"
    )


class ResumeLoaderPosition(Callback):
    """A mid-epoch resume continues where it stopped also when `configure_optimizers` asked the trainer for
    `estimated_stepping_batches` (as `optimization` does for a schedule's total steps): that builds the train
    loader before Lightning restores its position, which Lightning 2.6.6 then never applies.

    It also warns once, when training starts, where a global-batch data module's train_dataloader() was replaced
    by a loader of the user's own (`replaced_sampler`)."""

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        load_pending_train_loader_states(trainer)
        from .global_batch import GlobalBatchDataModule  # it imports this module

        if isinstance(trainer.datamodule, GlobalBatchDataModule):
            line = replaced_sampler(trainer.datamodule, trainer.train_dataloader)
            if line:
                rank_zero_warn(line)
