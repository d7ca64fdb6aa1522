"""A training sample's random draws as a function of (the run's seed, the epoch, the sample's index).

Augmentation in a dataset's `__getitem__` (torchvision, albumentations, plain `torch.rand`) draws from torch's,
Python's and NumPy's global generators. Each loader worker and each rank has its own state of them, so the same
sample gets another crop on 2 devices than on 1, with 2 workers than with none. `SeededSamples` seeds the three
generators from (seed, epoch, index) before it reads a sample, and gives them back as they were after: a sample is
augmented the same on any number of devices and workers, differently every epoch, and a mid-epoch resume draws
what the uninterrupted run drew. The sampler hands the epoch over with each index (`GlobalBatchSampler(...,
with_epoch=True)`), so workers kept from epoch to epoch see it too.

`own_draws` finds a dataset that draws from a generator of its own (`np.random.default_rng()` made in `__init__`),
which no seeding here reaches: the same (epoch, index) read twice gives two samples. `batch_draws` finds a draw made
per batch (a collate function's MixUp), which mixes each rank's share of the batch by its own: mixing.MixSamples
draws it per sample instead.
"""

import contextlib
import hashlib
import random
import struct
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

# The draws a sample is recognised by (fingerprints.py): an epoch no training reaches.
IDENTITY_EPOCH = -1


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 64-bit seed from the three numbers; neighbours share no structure (a hash, not seed + index)."""
    digest = hashlib.blake2b(struct.pack("<qqq", seed, epoch, index), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@contextlib.contextmanager
def generators_kept() -> Iterator[None]:
    """torch's (CPU), Python's and NumPy's global generators as they were, after the block."""
    python, numpy, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)
        torch.set_rng_state(cpu)


def seed_generators(seed: int) -> None:
    """Seed torch's CPU generator, Python's and NumPy's from `seed` (CUDA's not: seeding it would move the training
    step's draws on a GPU, and a dataset's augmentation runs on the CPU)."""
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed >> 32)  # NumPy takes 32 bits


@contextlib.contextmanager
def seeded_draws(seed: int) -> Iterator[None]:
    """The global generators seeded from `seed` inside, as they were after."""
    with generators_kept():
        seed_generators(seed)
        yield


class SeededSamples(Dataset):
    """`dataset`, read at the `(epoch, index)` keys a `GlobalBatchSampler(with_epoch=True)` hands out, with the
    global generators seeded from (seed, epoch, index) for the read. Other attributes are the dataset's.

    With no loader workers the samples are read in the training process, whose own draws (dropout) must not depend
    on the loading: its generators are given back as they were, once per batch (NumPy's state alone takes ~0.2 ms
    to save and restore). A worker's are not (nothing else draws there): ~20 us a sample for the seeding.
    """

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset, self.seed = dataset, seed

    def __getitem__(self, key: tuple[int, int]) -> Any:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list[tuple[int, int]]) -> list[Any]:
        # The DataLoader's fetcher asks for a batch's samples in one call where a dataset defines this.
        if hasattr(self.dataset, "__getitems__"):
            # A dataset that reads whole batches itself (a store's per-request latency, Hugging Face datasets) is
            # read as it defines: read sample by sample, each request's latency would be paid per sample. Its
            # draws are not seeded per sample (docs/augmentation.md).
            return self.dataset.__getitems__([index for _, index in keys])
        with contextlib.nullcontext() if get_worker_info() is not None else generators_kept():
            samples = []
            for epoch, index in keys:
                seed_generators(sample_seed(self.seed, epoch, index))
                samples.append(self.dataset[index])
            return samples

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":  # not set yet (unpickling in a worker): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)


def read_as_identity(dataset: Any, key: Any) -> Any:
    """The sample at `key` as the suite recognises it: the user's dataset at the index, its draws seeded by the
    index alone, so that an augmented sample is one sample in every epoch, run and rank."""
    if isinstance(dataset, SeededSamples):
        dataset, key = dataset.dataset, key[1]
    with seeded_draws(sample_seed(0, IDENTITY_EPOCH, key if isinstance(key, int) else 0)):  # a user's key: any
        return dataset[key]


def own_draws(dataset: Any, name: str = "train", epoch: int = 0, indices: int = 8) -> str:
    """One line where the dataset draws from a generator that the seeding does not reach, "" where it does not:
    each of the first `indices` samples read twice under the same seeding, the global generators left in two other
    states before each read (a generator of its own, the clock, os.urandom all show)."""
    for index in range(min(indices, len(dataset))):
        reads = []
        for before in (1, 2):  # the outer seeding gives the caller's generators back
            with seeded_draws(before), seeded_draws(sample_seed(0, epoch, index)):
                reads.append(dataset[index])
        if not same(*reads):
            return (
                f"the {name} dataset ({type(dataset).__name__}) draws random numbers from a generator of its own: "
                f"index {index} read twice in epoch {epoch}, torch's, Python's and NumPy's global generators seeded "
                "the same, gave two different samples, so 1 and N devices cannot see the same samples; draw from "
                "the global generators (torch.rand, random, np.random, torchvision) instead (the manual: "
                "vendor/ddpkit/docs/augmentation.md)"
            )
    return ""


def batch_draws(loader: Any, name: str = "train") -> str:
    """One line where the loader's first batch changes with the global generators' state, "" where it does not: read
    twice, the generators seeded 1 and 2 before each. Every sample's own draws are seeded from its index alike, so a
    difference is a draw made per batch: MixUp or CutMix in a collate function, a masking collator, a dataset's
    `__getitems__`. Each rank would draw its own for its share of the global batch."""
    batches = []
    for before in (1 << 32 | 1, 2 << 32 | 2):  # other seeds for NumPy too (it takes the high 32 bits)
        with seeded_draws(before):
            batches.append(next(iter(loader)))
    if same(*batches):
        return ""
    return (
        f"the {name} loader's batches change with the random state outside the samples' own draws (its first batch "
        "read twice, torch's, Python's and NumPy's global generators seeded otherwise before each, every sample's "
        "draws seeded alike, gave two different batches): a draw per batch (MixUp or CutMix in a collate function, "
        "a masking collator, a dataset's __getitems__) mixes each rank's share of the global batch with draws of its "
        "own, so 1 and N devices cannot train the same weights; draw per sample in the dataset's __getitem__ "
        "instead, e.g. ddpkit.MixSamples for MixUp and CutMix (the manual: vendor/ddpkit/docs/augmentation.md)"
    )


def same(a: Any, b: Any) -> bool:
    """Whether two samples hold the same values: tensors and arrays (images) element for element, containers item by
    item, anything else by ==."""
    if not isinstance(a, torch.Tensor) and hasattr(a, "__array__"):  # a NumPy array, a PIL image
        a, b = torch.as_tensor(np.asarray(a)), torch.as_tensor(np.asarray(b))
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            return False
        # A NaN in a sample is the same NaN both times.
        return bool(torch.equal(a, b) if not a.is_floating_point() else torch.allclose(a, b, 0, 0, equal_nan=True))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    return bool(a == b)
