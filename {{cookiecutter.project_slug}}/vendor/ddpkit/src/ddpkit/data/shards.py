"""Shards, what the streaming data module (streaming.py) reads: the `Shard` protocol (a `name`, a `len()` known
before reading, `read(start)`), local files as shards (`LocalShard`, `shard_files`), and shards read as one
map-style dataset (`ShardSequence`: evaluation, predict, and sizes). sources.py makes shards of other libraries'
formats."""

import bisect
import itertools
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch.utils.data import Dataset


@runtime_checkable
class Shard(Protocol):
    """What the streaming data module reads: one piece of a source (a file, a tar, a chunk)."""

    name: str  # stable id (file name / url), for errors; the shuffle permutes places in the list, not names

    def __len__(self) -> int:  # number of samples in the shard, known before reading it
        ...

    def read(self, start: int = 0) -> Iterator[Any]:
        """The shard's samples from index `start` to the end, in a fixed order (same order every call).
        Sources with random access seek; sequential ones (tar) read through and discard the first `start`."""
        ...


class LocalShard:
    """One local file of samples. By suffix:
    - `.pt`: `torch.save` of a tensor, or a tuple/list/dict of tensors, samples along the first dimension
      (loaded memory-mapped: reading from `start` touches only what it reads);
    - `.npy`: an array, samples along the first dimension (memory-mapped);
    - `.jsonl`: one JSON value per line.
    """

    SUFFIXES = (".pt", ".npy", ".jsonl")

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if self.path.suffix not in self.SUFFIXES:
            raise ValueError(f"{self.path}: a local shard is one of {', '.join(self.SUFFIXES)}")
        self.name = self.path.name
        self._len: int | None = None

    def _load(self) -> Any:
        if self.path.suffix == ".pt":
            return torch.load(self.path, mmap=True, weights_only=True)
        import numpy as np  # a dependency of torch's own numpy bridge; only .npy shards need it

        return np.load(self.path, mmap_mode="r")

    def __len__(self) -> int:
        if self._len is None:
            if self.path.suffix == ".jsonl":
                with self.path.open("rb") as f:
                    self._len = sum(1 for _ in f)
            else:
                data = self._load()
                self._len = len(next(iter(data.values())) if isinstance(data, dict) else _first(data))
        return self._len

    def read(self, start: int = 0) -> Iterator[Any]:
        if self.path.suffix == ".jsonl":
            with self.path.open() as f:
                yield from (json.loads(line) for line in itertools.islice(f, start, None))
            return
        data = self._load()
        for i in range(start, len(self)):
            if isinstance(data, dict):
                yield {key: value[i].clone() for key, value in data.items()}
            elif isinstance(data, (tuple, list)):
                yield tuple(value[i].clone() for value in data)
            elif isinstance(data, torch.Tensor):
                yield data[i].clone()  # a copy: the memory map stays read-only and can close
            else:
                yield torch.from_numpy(data[i].copy())

    def __repr__(self) -> str:
        return f"LocalShard({str(self.path)!r})"


def _first(data: Any) -> Any:
    return data[0] if isinstance(data, (tuple, list)) else data


def shard_files(paths: str | Path | Sequence[str | Path], pattern: str = "*") -> list[LocalShard]:
    """Local shards, sorted by name: the files of a directory that match `pattern` (suffixes .pt/.npy/.jsonl),
    or the given files."""
    if isinstance(paths, (str, Path)) and Path(paths).is_dir():
        files = [p for p in Path(paths).glob(pattern) if p.suffix in LocalShard.SUFFIXES]
        if not files:
            raise FileNotFoundError(f"no {'/'.join(LocalShard.SUFFIXES)} shards matching {pattern!r} in {paths}")
    else:
        files = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
        missing = [str(p) for p in files if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"no shard folder or file {missing[0]} (write shards before setup: prepare_data)")
    return [LocalShard(p) for p in sorted(files, key=lambda p: p.name)]


class ShardSequence(Dataset):
    """Shards read as one map-style dataset, in the given order (evaluation, predict, and sizes).

    Indexing is cheap for increasing indices, which is how the evaluation samplers of each rank or worker ask:
    the open shard is read on from the last index; another shard, or an earlier index, opens it again.
    """

    def __init__(self, shards: Sequence[Shard]) -> None:
        self.shards = list(shards)
        if not self.shards:
            raise ValueError("no shards: the source is empty")
        self.starts = [0, *itertools.accumulate(len(s) for s in self.shards)]
        self._open: tuple[int, int, Iterator[Any]] | None = None  # (shard, index of its next sample, reader)

    def __len__(self) -> int:
        return self.starts[-1]

    def __getstate__(self) -> dict:
        return {**vars(self), "_open": None}  # a reader does not pickle (workers started by spawn)

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} samples")
        shard = bisect.bisect_right(self.starts, index) - 1
        offset = index - self.starts[shard]
        if self._open is None or self._open[0] != shard or self._open[1] > offset:
            self._open = (shard, offset, self.shards[shard].read(offset))
        _, position, reader = self._open
        sample = next(itertools.islice(reader, offset - position, None), _END)
        if sample is _END:
            raise ValueError(_short_shard(self.shards[shard], offset))
        self._open = (shard, offset + 1, reader)
        return sample


_END = object()


def _short_shard(shard: Shard, read: int) -> str:
    return f"shard {shard.name} says it holds {len(shard)} samples, but its read() ended after {read}"
