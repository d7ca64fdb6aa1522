"""Shards from the sources people already have: LitData, WebDataset and Hugging Face `datasets`.

Each function returns a `list` of shards for `StreamingDataModule.train_shards()` (streaming.py): objects with
a `name`, a `len()` known before reading and `read(start)`, the samples from index `start` on in the same order
on every call. The streaming module's promises rest on two properties of the shards, and on nothing else:
- exact lengths, before reading: the epoch is cut into equal steps from them, so every sample of an epoch is
  seen once over the ranks (exactly-once) and every rank takes the same steps (equal steps);
- `read(start)` is the tail of `read(0)`: a resume continues at the sample where it stopped, on the same or
  another device count (exact resume), and a stream can start inside a shard.
Each source below has both, so each keeps all four promises; what differs is what they cost:

| source                          | lengths                                   | read(start)                      |
|---------------------------------|-------------------------------------------|----------------------------------|
| `litdata_shards`                | exact, from the dataset's index.json      | random access within the chunk   |
| `webdataset_shards`             | counted once (one pass per file), or given | reads through the first `start`  |
| `hf_shards`, `Dataset`          | exact                                     | random access (memory-mapped)    |
| `hf_shards`, `IterableDataset`  | given, or counted once; else refused      | reads through the first `start`  |

"Reads through": a resume, or a stream that starts inside such a shard (at most one per stream and epoch), is
exact but costs reading that part of the shard. A source whose lengths cannot be known keeps none of the
promises (the epoch cannot be cut into equal steps before reading: a rank runs out first and the others hang
in a collective, or samples repeat), so `hf_shards` refuses such a streaming dataset rather than guess.

The libraries are imported inside the functions: ddpkit imports without them (`pip install ddpkit[sources]`
installs the pinned three).
"""

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import closing
from pathlib import Path
from typing import Any


def litdata_shards(input_dir: str | Path) -> list["LitDataChunk"]:
    """One shard per chunk file of a directory written by `litdata.optimize`, in the index's order.

    Keeps every promise: each chunk's length is in the dataset's index.json (read by LitData before any
    sample), and LitData reads any sample of a chunk directly, so `read(start)` seeks and a resume on
    another device count costs nothing extra.
    """
    from litdata import StreamingDataset

    reader = _LitDataReader(str(input_dir))
    # `subsampled_files` and `region_of_interest` are the chunks LitData reads and each one's sample range,
    # in the order of its global index (the whole chunk: no `subsample` is passed).
    dataset = StreamingDataset(reader.input_dir)
    shards, first = [], 0
    for name, (begin, end) in zip(dataset.subsampled_files, dataset.region_of_interest, strict=True):
        shards.append(LitDataChunk(name, reader, chunk=len(shards), first=first, length=end - begin))
        first += end - begin
    return shards


class _LitDataReader:
    """One LitData `StreamingDataset` for the chunks of a directory, made on first read in the process that
    reads: a spawned DataLoader worker gets the directory's name, not the parent's open reader."""

    def __init__(self, input_dir: str) -> None:
        self.input_dir = input_dir
        self._dataset = None

    def __getstate__(self) -> dict:
        return {"input_dir": self.input_dir, "_dataset": None}

    def __getitem__(self, position: tuple[int, int]) -> Any:
        from litdata.streaming.sampler import ChunkedIndex

        if self._dataset is None:
            from litdata import StreamingDataset

            self._dataset = StreamingDataset(self.input_dir)
        index, chunk = position
        # With the chunk named, LitData goes straight to it; an int index would search every chunk's range.
        return self._dataset[ChunkedIndex(index=index, chunk_index=chunk)]


class LitDataChunk:
    """One chunk of a LitData dataset: samples `first` .. `first + length - 1` of its global index."""

    def __init__(self, name: str, reader: _LitDataReader, chunk: int, first: int, length: int) -> None:
        self.name, self.reader, self.chunk, self.first, self.length = name, reader, chunk, first, length

    def __len__(self) -> int:
        return self.length

    def read(self, start: int = 0) -> Iterator[Any]:
        for index in range(self.first + start, self.first + self.length):
            yield self.reader[index, self.chunk]

    def __repr__(self) -> str:
        return f"LitDataChunk({self.reader.input_dir!r}, {self.name!r}, {self.length} samples)"


def webdataset_shards(
    urls: str | Path | Sequence[str | Path],
    lengths: Mapping[str, int] | None = None,
    transform: Callable[[dict], Any] | None = None,
) -> list["TarShard"]:
    """One shard per WebDataset tar file, in the given order (a pattern such as "data-{000..009}.tar" expands
    as WebDataset expands it).

    A sample is what WebDataset yields before decoding: a dict of the member files' bytes by extension, with
    `__key__` and `__url__`; `transform` (e.g. `webdataset.autodecode.Decoder(...)` or your own function) is
    applied to each.

    Keeps every promise once the lengths are known. A tar file does not say how many samples it holds:
    without `lengths` (samples by shard name, the file name) each file is read through once, here, to count
    them (on every rank: for many large shards, count once and pass the saved counts,
    `{s.name: len(s) for s in shards}`). A tar file is read in order only, so `read(start)` reads through the
    first `start` samples without keeping them: a resume, or a stream that starts inside the shard, is exact
    but costs the read of that part of the file.

    Args:
        urls: Tar files: paths, URLs WebDataset opens ("pipe:..." commands too), or one pattern.
        lengths: Samples in each shard, by shard name; counted when not given.
        transform: Applied to each sample dict.
    """
    from webdataset.shardlists import expand_urls

    if isinstance(urls, (str, Path)):
        urls = expand_urls(str(urls))  # as `webdataset.WebDataset(urls)` expands them
    shards = [TarShard(str(url), transform=transform) for url in urls]
    for shard in shards:
        shard.length = lengths[shard.name] if lengths is not None else shard.count()
    return shards


class TarShard:
    """One WebDataset tar file. Members are grouped into samples by WebDataset itself; only where one sample
    ends and the next begins (a new key) is followed here, to count and to skip without reading the data."""

    def __init__(self, url: str, transform: Callable[[dict], Any] | None = None) -> None:
        self.url, self.transform = url, transform
        self.name = url.rsplit("/", 1)[-1]
        self.length: int | None = None

    def __len__(self) -> int:
        return self.length

    def count(self) -> int:
        """The samples in the file: one read through it, keeping none of the data."""
        keys = _SampleKeys(start=None)
        for _ in self._members(keys):
            pass
        return keys.index + 1

    def read(self, start: int = 0) -> Iterator[Any]:
        from webdataset.tariterators import group_by_keys

        read = start
        for sample in group_by_keys(self._members(_SampleKeys(start))):
            if read == self.length:
                raise ValueError(f"shard {self.name} holds more samples than its length {self.length}")
            yield self.transform(sample) if self.transform else sample
            read += 1
        if read < self.length:
            raise ValueError(f"shard {self.name} says it holds {self.length} samples, but its read ended at {read}")

    def _members(self, select: "_SampleKeys") -> Iterator[dict]:
        """The tar's member files as WebDataset reads them (its filters for metadata and directories), the
        data read only of those `select` keeps."""
        from webdataset.gopen import gopen
        from webdataset.tariterators import tar_file_expander

        with closing(gopen(self.url)) as stream:
            yield from tar_file_expander([{"url": self.url, "stream": stream}], select_files=select)

    def __repr__(self) -> str:
        return f"TarShard({self.url!r}, {self.length} samples)"


class _SampleKeys:
    """WebDataset's `select_files` hook: sees every member's name in order, numbers the samples as
    `group_by_keys` does (a new sample where the key, the name before its extensions, changes; a name without
    an extension belongs to none), and keeps the members of samples `start` on (none when `start` is None)."""

    def __init__(self, start: int | None) -> None:
        self.start, self.index, self.key = start, -1, None

    def __call__(self, name: str) -> bool:
        from webdataset.tariterators import base_plus_ext

        key, _ = base_plus_ext(name)
        if key is not None and key != self.key:
            self.index, self.key = self.index + 1, key
        return self.start is not None and self.index >= self.start


def hf_shards(
    dataset: Any,
    num_shards: int | None = None,
    lengths: Sequence[int] | str | None = None,
) -> list["HFShard"]:
    """Shards of a Hugging Face `datasets` dataset, in order.

    - A `Dataset` (map-style: `load_from_disk`, `load_dataset` without streaming): `num_shards` contiguous
      pieces (default: one per file it is stored in, e.g. `save_to_disk(..., num_shards=k)`). Keeps every
      promise: lengths are exact and rows are read at any index (memory-mapped Arrow).
    - An `IterableDataset` (`streaming=True`): its own shards (`dataset.num_shards`, usually one per data
      file). It does not record how many examples each shard holds (its split size, where the dataset has
      one, is for all shards together), and without exact lengths the streaming module cannot cut an epoch
      into equal steps before reading: a rank would run out first and the others hang, or samples would be
      seen twice. So the lengths come from `lengths` (a list, one per shard: e.g. Parquet files' row counts
      from their footers, `pyarrow.parquet.ParquetFile(f).metadata.num_rows`), or `lengths="count"` (every
      shard read through once, now, on every rank), or the split's size when there is one shard; otherwise
      this fails saying so. Then every promise holds; `read(start)` reads through the first `start` rows.
      Give the dataset before `split_dataset_by_node` and without `shuffle` (the module shuffles shards).

    Rows come as `dataset` yields them (its format and `map`s are kept). `with_format("torch")` (and "numpy")
    makes float64 columns float32; to keep float64, convert in a `dataset.map(...)` instead.
    """
    import datasets

    if isinstance(dataset, datasets.Dataset):
        count = num_shards or max(1, len(dataset.cache_files))
        pieces = [dataset.shard(count, i, contiguous=True) for i in range(count)]
        return [HFShard(_piece_name(dataset, i, count), piece, len(piece)) for i, piece in enumerate(pieces)]
    if not isinstance(dataset, datasets.IterableDataset):
        raise TypeError(f"hf_shards takes a datasets.Dataset or datasets.IterableDataset, not {type(dataset)}")
    count = dataset.num_shards
    if num_shards not in (None, count):
        raise ValueError(f"a streaming dataset is read in its own {count} shards, not {num_shards}")
    pieces = [dataset.shard(count, i) for i in range(count)]
    if lengths == "count":
        lengths = [sum(_rows(batch) for batch in piece.iter(batch_size=_BATCH)) for piece in pieces]
    elif lengths is None:
        lengths = _split_size(dataset, count)
    if len(lengths) != count:
        raise ValueError(f"{len(lengths)} lengths for a streaming dataset of {count} shards")
    names = [_piece_name(dataset, i, count) for i in range(count)]
    return [HFShard(name, piece, n) for name, piece, n in zip(names, pieces, lengths, strict=True)]


_BATCH = 256  # rows per Arrow batch read; any size gives the same rows


def _piece_name(dataset: Any, index: int, count: int) -> str:
    return f"{dataset.split or 'data'}-{index:05d}-of-{count:05d}"


def _split_size(dataset: Any, count: int) -> list[int]:
    splits = dataset.info.splits
    if count == 1 and splits and dataset.split in splits and splits[dataset.split].num_examples:
        return [splits[dataset.split].num_examples]
    raise ValueError(
        f"this streaming dataset does not record how many examples each of its {count} shards holds, so an "
        "epoch cannot be cut into equal steps before reading (ranks would hang or see samples twice): "
        "pass hf_shards(..., lengths=[one count per shard]) or lengths='count' (reads every shard once, now)"
    )


def _rows(batch: Mapping[str, Any]) -> int:
    """The rows in a batch from `.iter`: a dict of columns."""
    return len(next(iter(batch.values())))


class HFShard:
    """One piece of a `datasets` dataset."""

    def __init__(self, name: str, dataset: Any, length: int) -> None:
        self.name, self.dataset, self.length = name, dataset, length

    def __len__(self) -> int:
        return self.length

    def read(self, start: int = 0) -> Iterator[Any]:
        import datasets

        if start == self.length:
            return  # `select` refuses an empty range at the end
        if isinstance(self.dataset, datasets.Dataset):
            rows = self.dataset.select(range(start, self.length))  # a contiguous range: a slice, not a copy
        else:
            rows = self.dataset.skip(start)
        # `.iter` in batches, not `for row in rows`: an IterableDataset iterated inside a DataLoader worker
        # keeps only the worker's share of its shards, and the streaming module already gave this worker
        # the whole shard.
        read = start
        for batch in rows.iter(batch_size=_BATCH):
            for i in range(_rows(batch)):
                yield {column: values[i] for column, values in batch.items()}
            read += _rows(batch)
        if read != self.length:
            raise ValueError(f"shard {self.name} says it holds {self.length} rows, but {read} were read")

    def __repr__(self) -> str:
        return f"HFShard({self.name!r}, {self.length} rows)"
