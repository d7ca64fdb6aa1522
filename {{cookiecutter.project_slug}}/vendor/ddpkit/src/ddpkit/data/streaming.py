"""The data module for data that does not fit in memory: you give shards, it streams them with the promises of
`GlobalBatchDataModule` (data.py).

    class MyData(StreamingDataModule):
        def train_shards(self) -> Sequence[Shard]: ...
        def val_shards(self) -> Sequence[Shard] | None: ...   # optional, like test_shards and predict_shards

A shard is any object with a `name`, a `len()` known before reading it and `read(start)`, which yields its
samples from index `start` on, in the same order every time (`Shard`). `shard_files` makes them from local
files; `ddpkit.data.sources` from LitData, WebDataset and `datasets` shards.

How training reads them. Every epoch the shards are put in a seeded order (`--seed_everything` + epoch; a
permutation of their places in the list, so shards of several sources mix) and seen as one sequence of N
samples. It is cut into `streams` contiguous pieces of equal length, S = `streams`; global batch k is the
next B/S samples of every stream, in stream order (B = `global_batch_size`). Rank r of W reads streams
r*S/W .. (r+1)*S/W - 1, so its share of global batch k is the r-th contiguous slice of the batch 1 device
trains, as with the map-style sampler. Hence:
- global batch k is the same on any device count whose count divides S;
- each sample of an epoch is in at most one global batch; the tail of N mod B samples (under one global
  batch, at a different place every epoch) is not trained, as in data.py;
- every rank takes N // B steps every epoch, whatever the shards' sizes: no rank runs out first and hangs;
- a checkpoint holds the epoch and the global batches done; resuming finds each stream's shard and offset
  and calls `shard.read(offset)`, on the same or any other device count that divides S. A sequential shard
  (a tar file) reads through the skipped part; it still resumes exactly, only slower.
A stream starts where the previous one ended, often inside a shard: that shard is then read by two streams,
each its own part. Samples within a shard keep their order (shuffling is by shard): write shards whose
samples are already mixed.

Workers (`num_workers` > 0) each read some of the rank's streams (at most one worker per stream) and hand
over each step's samples; the loader puts them back in stream order and collates the micro-batches, so the
batches are the same with any number of workers. Validation, test and predict read the shards as one
map-style sequence (`ShardSequence`) through data.py's exactly-once loaders.
"""

import bisect
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning_utilities import apply_to_collection
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate, get_worker_info

from .global_batch import GlobalBatchDataModule

# The shard types are this module's API too (users import them from here); they are defined in shards.py
from .shards import LocalShard as LocalShard
from .shards import Shard, ShardSequence, _short_shard
from .shards import shard_files as shard_files


class _StepReader(IterableDataset):
    """One rank's streams, step by step: yields (step, {stream: its B/S samples of that step}). In a worker,
    only the worker's own streams."""

    def __init__(self, shards: list[Shard], streams: Sequence[int], chunk: int, steps: int, start: int) -> None:
        self.shards, self.streams, self.chunk, self.steps, self.start = shards, list(streams), chunk, steps, start
        self.starts = [0, *itertools.accumulate(len(s) for s in shards)]

    def __iter__(self) -> Iterator[tuple[int, dict[int, list]]]:
        worker = get_worker_info()
        mine = self.streams[worker.id :: worker.num_workers] if worker else self.streams
        readers = {s: self.stream(s) for s in mine}
        for step in range(self.start, self.steps):
            yield step, {s: list(itertools.islice(reader, self.chunk)) for s, reader in readers.items()}

    def stream(self, s: int) -> Iterator[Any]:
        """Stream s from the start step on: positions [(s * steps + start) * chunk, (s + 1) * steps * chunk)."""
        position, end = (s * self.steps + self.start) * self.chunk, (s + 1) * self.steps * self.chunk
        shard = bisect.bisect_right(self.starts, position) - 1
        while position < end:
            offset = position - self.starts[shard]
            read = 0
            for sample in self.shards[shard].read(offset):
                yield sample
                read, position = read + 1, position + 1
                if position == end:
                    return
            if offset + read != len(self.shards[shard]):
                raise ValueError(_short_shard(self.shards[shard], offset + read))
            shard += 1


def shard_order(shards: int, seed: int, epoch: int) -> list[int]:
    """The positions of the shards in the order of `epoch`."""
    return torch.randperm(shards, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def same_batches_every_epoch(lengths: list[int], streams: int, global_batch_size: int, seed: int) -> bool:
    """Whether global batch k holds the same samples in epochs 0 and 1 (the first 4 batches, by shard and offset):
    so when each stream reads one whole shard, or one part of one, whatever the order (shards of one length, as
    many as streams or fewer)."""
    steps, chunk = sum(lengths) // global_batch_size, global_batch_size // streams
    if not steps:
        return False

    def batch(order: list[int], k: int) -> set[tuple[int, int]]:
        starts = list(itertools.accumulate((lengths[i] for i in order), initial=0))
        positions = (s * steps * chunk + k * chunk + j for s in range(streams) for j in range(chunk))
        at = ((p, bisect.bisect_right(starts, p) - 1) for p in positions)
        return {(order[i], p - starts[i]) for p, i in at}

    epochs = [shard_order(len(lengths), seed, epoch) for epoch in (0, 1)]
    return all(batch(epochs[0], k) == batch(epochs[1], k) for k in range(min(steps, 4)))


def _as_is(item: Any) -> Any:
    return item


class StreamLoader:
    """The training loader of a `StreamingDataModule` on one rank: micro-batches, `len()` of them per epoch.

    Lightning saves `state_dict()` in checkpoints and calls `load_state_dict` when it resumes (it treats any
    loader with both as resumable). The position counts completed global batches, as `ResumableLoader` does
    (sampling.py): with accumulation, a checkpoint between the micro-batches of a step resumes at that step.
    """

    def __init__(
        self,
        shards: list[Shard],
        *,
        streams: int,
        global_batch_size: int,
        world_size: int,
        rank: int,
        micro_batch_size: int,
        seed: int,
        num_workers: int = 0,
        collate_fn: Callable[[list], Any] = default_collate,
        current_epoch: Callable[[], int] | None = None,
        pin_memory: bool = False,
    ) -> None:
        self.shards, self.streams, self.seed = shards, streams, seed
        self.chunk = global_batch_size // streams  # samples of one stream in one global batch
        self.steps = sum(len(s) for s in shards) // global_batch_size  # the same on every rank and epoch
        per_rank = streams // world_size
        self.mine = range(rank * per_rank, (rank + 1) * per_rank)
        self.micro, self.accumulation = micro_batch_size, global_batch_size // world_size // micro_batch_size
        self.num_workers = min(num_workers, per_rank)  # a worker reads whole streams
        self.collate_fn, self.current_epoch, self.pin_memory = collate_fn, current_epoch, pin_memory
        self.epoch = 0
        self._resume: tuple[int, int] | None = None  # (epoch, global batches to skip), used once
        self._position = (0, 0)  # (epoch, global batches of that epoch completed)

    def __len__(self) -> int:
        return self.steps * self.accumulation

    def epoch_order(self, epoch: int) -> list[Shard]:
        """The shards in the order of `epoch`: the same on every rank (seeded by --seed_everything)."""
        return [self.shards[i] for i in shard_order(len(self.shards), self.seed, epoch)]

    def __iter__(self) -> Iterator[Any]:
        if self.current_epoch is not None:
            self.epoch = self.current_epoch()
        resume, self._resume = self._resume, None
        start = resume[1] if resume and resume[0] == self.epoch else 0
        reader = _StepReader(self.epoch_order(self.epoch), self.mine, self.chunk, self.steps, start)
        # A new loader each epoch: its workers read that epoch's order (persistent ones would keep the first).
        steps = DataLoader(reader, batch_size=None, collate_fn=_as_is, num_workers=self.num_workers)
        pending: dict[int, dict[int, list]] = {}
        for step, part in steps:  # workers' parts of one step arrive one after another
            pending.setdefault(step, {}).update(part)
            if len(pending[step]) < len(self.mine):
                continue
            parts = pending.pop(step)
            share = [sample for s in self.mine for sample in parts[s]]  # (B / W samples), in stream order
            for i in range(self.accumulation):
                # Counted before the batch is trained, as in ResumableLoader.
                self._position = (self.epoch, step + (i + 1) // self.accumulation)
                batch = self.collate_fn(share[i * self.micro : (i + 1) * self.micro])
                # Collated here, in the training process: pinned here too, a host copy that spares the GPU copy's
                # wait for the device (from pageable memory it waits for the stream's earlier work).
                yield apply_to_collection(batch, torch.Tensor, torch.Tensor.pin_memory) if self.pin_memory else batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._position[0], "global_batches_done": self._position[1]}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        epoch, done = state_dict["epoch"], state_dict["global_batches_done"]
        self._resume = (epoch + 1, 0) if done >= self.steps else (epoch, done)


class StreamingDataModule(GlobalBatchDataModule):
    """Streams the shards that a subclass returns, with a global batch size, exact resume and exactly-once
    evaluation (see the module's docstring for how).

    Args:
        global_batch_size: Samples per optimizer step summed over all devices and micro-batches. A multiple
            of `streams`.
        micro_batch_size: Samples one device holds in one forward/backward pass (None: its whole share);
            gradient accumulation makes up the rest, as in GlobalBatchDataModule.
        num_workers: DataLoader worker processes per device, each reading whole streams: at most
            streams / devices of them are used.
        streams: Parallel read positions in each epoch's order of the shards. Every device count you train
            or resume on must divide it; global batch k is the same on all of them. More streams mix more
            shards into each batch and open more shards at once.
        pin_memory: Put batches in pinned host memory (as GlobalBatchDataModule). None: when the run's device is a
            GPU.
        persistent_workers: Keep the evaluation loaders' workers from one epoch to the next. The training loader
            starts its workers every epoch whatever this says: they read that epoch's order of the shards.
    """

    def __init__(
        self,
        global_batch_size: int = 64,
        micro_batch_size: int | None = None,
        num_workers: int = 0,
        streams: int = 8,
        pin_memory: bool | None = None,
        persistent_workers: bool = True,
    ) -> None:
        super().__init__(global_batch_size, micro_batch_size, num_workers, pin_memory, persistent_workers)
        if streams < 1 or global_batch_size % streams:
            raise ValueError(
                f"global_batch_size={global_batch_size} is not a multiple of streams={streams}: every stream "
                "gives each global batch the same number of samples"
            )
        self.streams = streams

    # --- what a subclass provides ---------------------------------------------------------------------

    def train_shards(self) -> Sequence[Shard]:
        """The training shards. Called on every rank in `setup`: return descriptions (names, lengths), not data."""
        raise NotImplementedError(f"{type(self).__name__} must define train_shards() to be used with fit")

    def val_shards(self) -> Sequence[Shard] | None:
        """The validation shards, or None for no validation."""
        return None

    def test_shards(self) -> Sequence[Shard] | None:
        """The test shards, or None."""
        return None

    def predict_shards(self) -> Sequence[Shard] | None:
        """The shards `predict` runs on; the test shards by default."""
        return self.test_shards()

    # --- as datasets, for data.py's evaluation loaders and the sizes -------------------------------------

    def train_dataset(self) -> Dataset:
        return ShardSequence(self.train_shards())

    def val_dataset(self) -> Dataset | None:
        return _sequence(self.val_shards())

    def test_dataset(self) -> Dataset | None:
        return _sequence(self.test_shards())

    def predict_dataset(self) -> Dataset | None:
        return _sequence(self.predict_shards())

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if stage == "fit":
            lengths = [len(shard) for shard in self.train_set.shards]
            seed = self.train_sampler().seed
            if same_batches_every_epoch(lengths, self.streams, self.global_batch_size, seed):
                rank_zero_warn(
                    f"{type(self).__name__}: {len(lengths)} training shards of equal length for {self.streams} "
                    "streams: each stream reads the same part of a shard in step k whatever the epoch's order, so "
                    "global batch k holds the same samples in every epoch (only their place in it changes). Give "
                    f"each stream at least 2 shards: --data.streams {max(1, len(lengths) // 2)} or fewer, or more, "
                    "smaller shards."
                )

    def train_sampler(self) -> Any:
        # setup() calls it to check the global batch before any step; the streams' own condition is checked here.
        if self.streams % self.world_size:
            raise ValueError(
                f"streams={self.streams} is not a multiple of {self.world_size} processes: each rank reads whole "
                f"streams; set --data.streams to a multiple of every device count you use (e.g. "
                f"{self.streams * self.world_size})"
            )
        return super().train_sampler()

    def train_dataloader(self) -> StreamLoader:
        collate = self.loader_kwargs().get("collate_fn", default_collate)
        return StreamLoader(
            self.train_set.shards,
            streams=self.streams,
            global_batch_size=self.global_batch_size,
            world_size=self.world_size,
            rank=self.trainer.global_rank if self.trainer else 0,
            micro_batch_size=self.micro_batch(),
            seed=self.train_sampler().seed,
            num_workers=self.num_workers,
            collate_fn=collate,
            current_epoch=(lambda: self.trainer.current_epoch) if self.trainer is not None else None,
            pin_memory=self.pins_memory(),
        )


def _sequence(shards: Sequence[Shard] | None) -> ShardSequence | None:
    return None if shards is None else ShardSequence(shards)
