"""The data module to subclass: you give datasets, it loads them so that N devices train what 1 device trains.

    class MyData(GlobalBatchDataModule):
        def train_dataset(self) -> Dataset: ...
        def val_dataset(self) -> Dataset | None: ...   # optional, like test_dataset and predict_dataset

What the base class brings, for any map-style dataset:
- `global_batch_size` is the batch of one optimizer step summed over all devices; the learning rate
  belongs to it, so adding devices changes the speed, not the training math;
- `micro_batch_size` is what one device holds in one forward pass: gradient accumulation makes up the
  rest (global = devices x micro x accumulation steps), so 1 device x 4 micro-batches and 2 devices x 2
  train the same model;
- the training sampler gives global batch k the same samples on any number of devices, reshuffles every
  epoch from --seed_everything (or follows `train_order`), and resumes mid-epoch where the checkpoint stopped
  (sampling.py);
- each training sample's random draws (augmentation) are seeded from (seed, epoch, index): the same on any number
  of devices and workers (draws.py);
- validation, test and predict give every sample to exactly one rank, so metrics count it once;
- on a GPU, batches in pinned memory, so that Lightning's non-blocking copy to the device is asynchronous (a copy
  from pageable memory makes the host wait for the GPU every step); loader workers kept from epoch to epoch.
"""

import os
from collections.abc import Sequence
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset

from .draws import SeededSamples, own_draws
from .sampling import BlockSampler, GlobalBatchSampler, ResumableLoader, eval_sampler

# The guarantee suite's switch for a large model (docs/testing.md): every set cut to its first N samples, in every
# process the suite starts (they inherit it), with a warning wherever it is set.
SUITE_SAMPLES = "DDPKIT_SUITE_SAMPLES"


def _suite_samples() -> int | None:
    """DDPKIT_SUITE_SAMPLES as a count of samples, None when it is not set."""
    given = os.environ.get(SUITE_SAMPLES, "")
    if not given:
        return None
    if not given.isdigit() or int(given) < 1:
        raise ValueError(f"{SUITE_SAMPLES}={given!r}: a number of samples (at least 1), or unset for every sample")
    return int(given)


def _first_samples(dataset: Dataset | None, name: str) -> Dataset | None:
    """`dataset` cut to its first DDPKIT_SUITE_SAMPLES samples, when that is set and the set is longer."""
    n = _suite_samples()
    if dataset is None or n is None or len(dataset) <= n:
        return dataset
    rank_zero_warn(f"{SUITE_SAMPLES}={n}: the {name} set is its first {n} of {len(dataset)} samples")
    return Subset(dataset, range(n))


class GlobalBatchDataModule(L.LightningDataModule):
    """Loads the datasets that a subclass returns, with a global batch size and exactly-once evaluation.

    Args:
        global_batch_size: Samples per optimizer step summed over all devices and micro-batches. It must
            divide evenly over the devices (and over their micro-batches).
        micro_batch_size: Samples one device holds in one forward/backward pass; the rest of its share
            is made up by gradient accumulation (steps = global / (devices x micro)). None: the whole
            per-device share at once, no accumulation. Evaluation loads this many per device as well.
        num_workers: DataLoader worker processes per device; 0 loads in the training process.
        pin_memory: Put batches in pinned (page-locked) host memory, from which Lightning's copy to the GPU
            (`non_blocking=True`) does not make the host wait for the device. None: when the run's device is a
            GPU; on a CPU it would only cost.
        persistent_workers: Keep the loader workers (with `num_workers` > 0) from one epoch to the next instead of
            starting them again every epoch.
        seeded_draws: Seed torch's, Python's and NumPy's global generators from (seed, epoch, index) for each
            training sample's read (draws.py): augmentation is the same on any number of devices and workers, and
            differs every epoch. False: the generators as they are in each process (a sample's crop then depends on
            the rank and the worker that reads it).
    """

    def __init__(
        self,
        global_batch_size: int = 64,
        micro_batch_size: int | None = None,
        num_workers: int = 0,
        pin_memory: bool | None = None,
        persistent_workers: bool = True,
        seeded_draws: bool = True,
    ) -> None:
        super().__init__()
        if global_batch_size < 1 or (micro_batch_size is not None and micro_batch_size < 1):
            raise ValueError(f"batch sizes must be positive: global {global_batch_size}, micro {micro_batch_size}")
        self.global_batch_size, self.micro_batch_size, self.num_workers = (
            global_batch_size,
            micro_batch_size,
            num_workers,
        )
        self.pin_memory, self.persistent_workers, self.seeded_draws = pin_memory, persistent_workers, seeded_draws
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.test_set: Dataset | None = None
        self.predict_set: Dataset | None = None

    # --- what a subclass provides ---------------------------------------------------------------------

    def train_dataset(self) -> Dataset:
        """The training set (map-style: `len` and integer indexing). Called on every rank in `setup`."""
        raise NotImplementedError(f"{type(self).__name__} must define train_dataset() to be used with fit")

    def val_dataset(self) -> Dataset | None:
        """The validation set, or None for no validation."""
        return None

    def test_dataset(self) -> Dataset | None:
        """The test set, or None."""
        return None

    def predict_dataset(self) -> Dataset | None:
        """The samples `predict` runs on; the test set by default."""
        return self.test_dataset()

    def train_order(self, seed: int, epoch: int) -> Sequence[int] | Tensor:
        """An epoch's order of training indices, as a function of (seed, epoch) only: override it for weighted
        draws with replacement, buckets of similar length, a curriculum (order.py has the first two). The library
        cuts it into global batches of `global_batch_size` (a tail that fills none is dropped) and gives rank r the
        r-th slice of each: the same global batches on any device count, and a mid-epoch resume continues in it.
        Its length must be the same every epoch. Not overridden: a new random permutation of the whole set each
        epoch."""
        raise NotImplementedError  # never called unless overridden: train_sampler() asks

    # --- the batch arithmetic ---------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.trainer.world_size if self.trainer else 1

    def per_device_batch_size(self) -> int:
        """This device's share of a global batch: global_batch_size / devices."""
        world = self.world_size
        if self.global_batch_size % world:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} does not divide evenly over {world} processes: use a "
                f"multiple of {world} (e.g. {self.global_batch_size - self.global_batch_size % world or world})."
            )
        return self.global_batch_size // world

    def micro_batch(self) -> int:
        """Samples per forward pass on one device."""
        share = self.per_device_batch_size()
        micro = self.micro_batch_size or share
        if share % micro:
            raise ValueError(
                f"micro_batch_size={micro} does not divide this device's share of the global batch "
                f"({self.global_batch_size} / {self.world_size} devices = {share}): pick a divisor of {share}."
            )
        return micro

    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step on each device."""
        return self.per_device_batch_size() // self.micro_batch()

    # --- Lightning's hooks --------------------------------------------------------------------------------

    def setup(self, stage: str) -> None:
        if stage == "fit":
            self.train_set, self.val_set = self.train_dataset(), self.val_dataset()
            # An iterable dataset has no indexing, with or without a length (many define one for progress bars).
            if isinstance(self.train_set, IterableDataset) or not hasattr(self.train_set, "__len__"):
                raise TypeError(
                    f"{type(self).__name__}.train_dataset() returned {type(self.train_set).__name__}, an iterable "
                    "dataset: GlobalBatchDataModule samples map-style datasets; for a stream or shards, subclass "
                    "ddpkit.data.streaming.StreamingDataModule and return train_shards()"
                )
            self.train_set = _first_samples(self.train_set, "train")
            self.train_sampler()  # fail now, before any step, if the global batch does not fit
            if self.seeded_draws:  # 8 samples read twice: a generator of the dataset's own, which no seed reaches
                own = own_draws(self.train_set)
                if own:
                    rank_zero_warn(own)
            if self.trainer is not None:
                if self.trainer.accumulate_grad_batches not in (1, self.accumulation_steps()):
                    raise ValueError(
                        f"--trainer.accumulate_grad_batches {self.trainer.accumulate_grad_batches} would change the "
                        f"global batch of {type(self).__name__}: set --data.micro_batch_size instead."
                    )
                # Lightning reads this attribute in its loop (its own SWA callback sets it the same way).
                self.trainer.accumulate_grad_batches = self.accumulation_steps()
        elif stage == "validate":
            self.val_set = self.val_dataset()
        elif stage == "test":
            self.test_set = _first_samples(self.test_dataset(), "test")
        elif stage == "predict":
            self.predict_set = _first_samples(self.predict_dataset(), "predict")
        if stage in ("fit", "validate"):
            self.val_set = _first_samples(self.val_set, "val")

    def train_sampler(self) -> GlobalBatchSampler:
        # Seeded by --seed_everything (Lightning exports it to every rank), like Lightning's own sampler.
        overridden = type(self).train_order is not GlobalBatchDataModule.train_order
        return GlobalBatchSampler(
            self.train_set,
            self.global_batch_size,
            num_replicas=self.world_size,
            rank=self.trainer.global_rank if self.trainer else 0,
            seed=self.seed(),
            order=self.train_order if overridden else None,
            with_epoch=self.seeded_draws,
        )

    def seed(self) -> int:
        """The run's seed: --seed_everything, which Lightning exports to every rank."""
        return int(os.environ.get("PL_GLOBAL_SEED", 0))

    def pins_memory(self) -> bool:
        """Whether the loaders pin their batches: `pin_memory`, or when it is None, whether the run's device is a
        GPU."""
        if self.pin_memory is not None:
            return self.pin_memory
        return self.trainer is not None and self.trainer.strategy.root_device.type == "cuda"

    def loader_kwargs(self) -> dict[str, Any]:
        """Settings shared by every loader; override to add e.g. a collate_fn."""
        return {
            "num_workers": self.num_workers,
            "persistent_workers": self.persistent_workers and self.num_workers > 0,  # torch refuses it without workers
            "pin_memory": self.pins_memory(),
        }

    def train_dataloader(self) -> DataLoader:
        sampler = self.train_sampler()
        # Resumable: a mid-epoch checkpoint continues with the samples not yet seen in that epoch.
        # Read at the (epoch, index) keys the sampler hands out, the draws seeded from them (draws.py).
        dataset = SeededSamples(self.train_set, self.seed()) if self.seeded_draws else self.train_set
        return ResumableLoader(
            dataset,
            batch_size=self.micro_batch(),
            sampler=sampler,
            batches_per_step=self.accumulation_steps(),
            current_epoch=(lambda: self.trainer.current_epoch) if self.trainer is not None else None,
            **self.loader_kwargs(),
        )

    def _eval_loader(self, dataset: Dataset | None, name: str) -> DataLoader:
        if dataset is None:
            raise ValueError(f"{type(self).__name__}.{name}_dataset() returned None: there is no {name} set")
        sampler = eval_sampler(dataset, self.world_size, self.trainer.global_rank if self.trainer else 0)
        return DataLoader(dataset, batch_size=self.micro_batch(), sampler=sampler, **self.loader_kwargs())

    def val_dataloader(self) -> DataLoader:
        if self.val_set is None:
            return []  # Lightning skips validation for an empty list
        return self._eval_loader(self.val_set, "val")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader(self.test_set, "test")

    def predict_dataloader(self) -> DataLoader:
        if self.predict_set is None:
            raise ValueError(f"{type(self).__name__}.predict_dataset() returned None: there is no predict set")
        # The 1-device batches (micro-batches if set), dealt whole to the ranks: predictions are the same
        # bits on any number of devices (sampling.BlockSampler).
        batch = self.micro_batch_size or self.global_batch_size
        rank = self.trainer.global_rank if self.trainer else 0
        sampler = BlockSampler(self.predict_set, batch, self.world_size, rank)
        return DataLoader(self.predict_set, batch_size=batch, sampler=sampler, **self.loader_kwargs())
