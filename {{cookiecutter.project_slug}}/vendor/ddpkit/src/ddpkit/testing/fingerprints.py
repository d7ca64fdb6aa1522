"""How the guarantee suite recognises a sample and a dataset: by a hash of what the dataset returns, before any
collate function pads, stacks or packs it.

A sentence padded to the longest of 32 on 1 device and to the longest of 16 on a rank is one sample: hashing the
collated batch's rows would count it twice. So the probe (parity_probe.py) takes a training batch's samples where
they are still whole: a map-style loader's indices, recorded as its sampler hands them out (in the training
process, also when workers load), read back from its dataset with its random draws seeded by the index alone (an
augmented sample is one sample in every epoch and run: data/draws.py); a streaming loader's samples as they reach its
collate function. The user's collate function itself is never replaced. Only a loader of neither kind falls back to
the rows of the collated batch.
"""

import contextlib
import hashlib
import pickle
import random
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import BatchSampler, DataLoader

from ..data.draws import read_as_identity
from ..data.shards import ShardSequence
from ..data.streaming import StreamLoader

# Samples a dataset's fingerprint reads at most: every sample of a smaller set, evenly spaced ones of a larger (for
# shards, the first sample of evenly spaced shards: reading a shard from its start never reads through it).
FINGERPRINT_SAMPLES = 1000


def sample_key(sample: Any) -> str:
    """A hash of one sample as the dataset returns it: tensors by dtype, shape and bytes, containers item by item,
    plain values by their repr, arrays (numpy, images) as tensors, anything else pickled. 64 bits, as hex."""
    digest = hashlib.sha1()
    _feed(digest, sample)
    return digest.hexdigest()[:16]


def _feed(digest: Any, item: Any) -> None:
    if isinstance(item, Tensor):
        tensor = item.detach().cpu().contiguous().reshape(-1)
        digest.update(f"tensor {item.dtype} {tuple(item.shape)}:".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())  # any dtype, bf16 too, bit for bit
    elif isinstance(item, dict):
        digest.update(f"dict {len(item)}:".encode())
        for key in sorted(item, key=str):
            digest.update(f"{key!r}=".encode())
            _feed(digest, item[key])
    elif isinstance(item, (list, tuple)):
        digest.update(f"{type(item).__name__} {len(item)}:".encode())
        for value in item:
            _feed(digest, value)
    elif item is None or isinstance(item, (str, bytes, int, float, bool, complex)):
        digest.update(f"{type(item).__name__} {item!r};".encode())
    elif hasattr(item, "__array__"):  # a numpy array or scalar, a PIL image
        import numpy as np  # torch's numpy bridge needs it; only such samples reach here

        _feed(digest, torch.from_numpy(np.ascontiguousarray(np.asarray(item))))
    else:
        digest.update(pickle.dumps(item, protocol=4))


@contextlib.contextmanager
def random_state_kept() -> Iterator[None]:
    """Reading a sample again must not move the run's random streams (a dataset that augments draws from them)."""
    import numpy as np

    python, numpy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy)


def fingerprint_indices(dataset: Any) -> list[int]:
    """The indices a dataset's fingerprint reads (FINGERPRINT_SAMPLES)."""
    n = len(dataset)
    if n > FINGERPRINT_SAMPLES and isinstance(dataset, ShardSequence):
        return sorted({dataset.starts[i] for i in spread(len(dataset.shards))})
    return spread(n)


def spread(n: int) -> list[int]:
    """At most FINGERPRINT_SAMPLES of range(n), evenly spaced, first and last included."""
    if n <= FINGERPRINT_SAMPLES:
        return list(range(n))
    return sorted({round(k * (n - 1) / (FINGERPRINT_SAMPLES - 1)) for k in range(FINGERPRINT_SAMPLES)})


def dataset_fingerprint(dataset: Any) -> dict:
    """{"length", "indices", "keys"}: the dataset's length and the sample_key of each sample it reads."""
    indices = fingerprint_indices(dataset)
    with random_state_kept():
        keys = [sample_key(read_as_identity(dataset, i)) for i in indices]
    return {"length": len(dataset), "indices": indices, "keys": keys}


def first_difference(a: dict, b: dict) -> str:
    """Where fingerprint `b` of a dataset first departs from `a`, as words ("" where they agree): the lengths, else
    the first index read whose samples differ, with both samples' keys."""
    if a["length"] != b["length"]:
        return f"in length ({b['length']} samples vs {a['length']})"
    for i, key_a, key_b in zip(a["indices"], a["keys"], b["keys"], strict=True):
        if key_a != key_b:
            return f"at index {i} (sample fingerprints {key_b} vs {key_a})"
    return ""


class IndexRecorder:
    """Stands in for a map-style loader's sampler inside its batch sampler: yields the same indices and keeps those of
    the current pass. The loader draws indices in the training process also when workers load the samples, so the
    k-th batch of a pass holds indices [k * batch_size, (k + 1) * batch_size) of it. Anything else is the sampler's
    (`set_epoch`, `seed`, ...)."""

    def __init__(self, sampler: Any) -> None:
        self.sampler, self.indices, self.passes = sampler, [], 0

    def __iter__(self) -> Iterator[int]:
        self.passes += 1  # here, not in the generator: a pass has begun when the loader asks for its iterator
        self.indices = []
        return self._record(iter(self.sampler))

    def _record(self, indices: Iterator[int]) -> Iterator[int]:
        for index in indices:
            self.indices.append(index)
            yield index

    def __len__(self) -> int:
        return len(self.sampler)

    def __getattr__(self, name: str) -> Any:
        if name == "sampler":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.sampler, name)


class TrainSamples:
    """The keys of the samples in each training batch of a fit, in the order the loop receives the batches; built
    when training starts, on the loader Lightning will iterate."""

    def __init__(self, loader: Any) -> None:
        self.loader, self.pending, self.position = loader, [], (0, 0)
        # torch's own batch sampler cuts its sampler's indices in order; a user's (buckets by length) may not.
        if isinstance(loader, DataLoader) and type(loader.batch_sampler) is BatchSampler:
            self.recorder = loader.batch_sampler.sampler = IndexRecorder(loader.batch_sampler.sampler)
            self.read = "dataset"
        elif isinstance(loader, StreamLoader):
            collate = loader.collate_fn

            def keyed(samples: list) -> Any:  # the user's collate, called as before, on the same samples
                self.pending.append((loader.epoch, [sample_key(s) for s in samples]))
                return collate(samples)

            loader.collate_fn = keyed
            self.read = "collate input"
        else:
            self.read = "batch rows"

    def keys(self, epoch: int) -> list[str] | None:
        """The keys of the samples of the next training batch the loop received, in epoch `epoch`; None for a loader
        of neither kind (then the collated batch's rows are all there is: parity_probe.sample_keys)."""
        if self.read == "dataset":
            passes, k = self.position
            k = 0 if passes != self.recorder.passes else k
            self.position = (self.recorder.passes, k + 1)
            size = self.loader.batch_sampler.batch_size
            with random_state_kept():
                chosen = self.recorder.indices[k * size : (k + 1) * size]
                return [sample_key(read_as_identity(self.loader.dataset, i)) for i in chosen]
        if self.read == "collate input":
            while self.pending and self.pending[0][0] < epoch:  # prefetched, never trained (a loop cut short)
                self.pending.pop(0)
            return self.pending.pop(0)[1]
        return None


# Why datasets that differ between processes or runs do: what builds them differently in each.
PER_PROCESS = "built differently per process (a set's order, an unseeded shuffle?)"


def rank_difference(prints: list[dict[str, dict]]) -> str:
    """The first dataset in which a rank's fingerprints (one {dataset name: fingerprint} per rank) depart from rank
    0's, as one line; "" where every rank holds rank 0's datasets."""
    for name, first in prints[0].items():
        for rank, other in enumerate(prints[1:], start=1):
            if name not in other:
                return f"rank {rank} has no {name} dataset where rank 0 has one: {PER_PROCESS}"
            where = first_difference(first, other[name])
            if where:
                return f"rank {rank}'s {name} dataset differs from rank 0's {where}: {PER_PROCESS}"
    return ""
