"""Shards of unequal sizes, as local files or through the source adapters, and a float64 regressor that records
what each rank trains, for test_streaming.py; a slow shard reader for the doctor (test_doctor.py). This folder
must be on PYTHONPATH."""

import importlib
import io
import json
import multiprocessing
import os
import signal
import time
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from ddpkit.data import sources
from ddpkit.data.streaming import LocalShard, Shard, StreamingDataModule
from ddpkit.testing.toy import blobs

# 385 samples: 12 global batches of 32 and 1 left over. 12 shards for 8 streams, from 5 to 70 samples.
SIZES = [37, 5, 60, 23, 41, 18, 70, 9, 33, 50, 12, 27]


# Shard i of a mixed set is read by READERS[i % 4]: every adapter reads shards of several sizes and places.
READERS = ("pt", "tar", "parquet", "litdata")
LIBRARIES = {"tar": "webdataset", "parquet": "datasets", "litdata": "litdata"}  # what each reader needs


def write_shards(directory: Path, readers: tuple[str, ...] = ("pt",), sizes: list[int] = SIZES) -> dict[str, str]:
    """The same samples whatever the readers: shard i holds {"x": (n, 4) float64, "y": (n, 1), "id": (n,) int64},
    ids from 0 on, written for reader readers[i % len(readers)]: a .pt file, a WebDataset tar, a Parquet file
    (read as a streaming `datasets` dataset) or a chunk of one LitData dataset (`litdata.optimize`, appended in
    shard order). A reader whose library is not installed gets .pt files instead; readers.json names each
    shard's reader. Returns {reader: its missing library} for those."""
    directory.mkdir(parents=True, exist_ok=True)
    weights = torch.tensor([[1.0], [-2.0], [0.5], [3.0]], dtype=torch.float64)
    missing = {r: LIBRARIES[r] for r in set(readers) if r in LIBRARIES and not _importable(LIBRARIES[r])}
    chosen, first = [], 0
    for i, size in enumerate(sizes):
        x = torch.randn(size, 4, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
        columns = {"x": x, "y": x @ weights, "id": torch.arange(first, first + size)}
        reader = readers[i % len(readers)]
        chosen.append("pt" if reader in missing else reader)
        _WRITERS[chosen[-1]](directory, f"shard{i:02d}", columns)
        first += size
    (directory / "readers.json").write_text(json.dumps(chosen))
    return missing


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def _rows(columns: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    # Copies: a view would save its whole shard's storage.
    return [{key: value[j].clone() for key, value in columns.items()} for j in range(len(columns["id"]))]


def _write_pt(directory: Path, name: str, columns: dict) -> None:
    torch.save(columns, directory / f"{name}.pt")


def _write_tar(directory: Path, name: str, columns: dict) -> None:
    import webdataset

    with webdataset.TarWriter(str(directory / f"{name}.tar")) as tar:
        for row in _rows(columns):
            data = io.BytesIO()
            torch.save(row, data)
            tar.write({"__key__": f"{row['id'].item():06d}", "pth": data.getvalue()})


def _tar_sample(sample: dict) -> dict[str, torch.Tensor]:
    return torch.load(io.BytesIO(sample["pth"]), weights_only=True)


def _write_parquet(directory: Path, name: str, columns: dict) -> None:
    import pyarrow as pa  # installed with datasets
    import pyarrow.parquet as pq

    (directory / "parquet").mkdir(exist_ok=True)
    table = pa.table({key: value.tolist() for key, value in columns.items()})  # Python floats: exact float64
    pq.write_table(table, directory / "parquet" / f"{name}.parquet")


def _as_tensors(row: dict) -> dict[str, torch.Tensor]:
    # Not with_format("torch"): datasets casts float64 columns to float32 there.
    return {"x": torch.tensor(row["x"], dtype=torch.float64), "y": torch.tensor(row["y"], dtype=torch.float64),
            "id": torch.tensor(row["id"])}  # fmt: skip


def optimize_litdata(**kwargs) -> None:
    """`litdata.optimize(**kwargs)` with one forked worker (it imports nothing), then the start method the process
    had: optimize sets it for good (force=True), and later tests' loader workers and processes must start as
    before."""
    import litdata

    method = multiprocessing.get_start_method(allow_none=True)
    try:
        litdata.optimize(num_workers=1, start_method="fork", **kwargs)
    finally:
        multiprocessing.set_start_method(method, force=True)


def _write_litdata(directory: Path, name: str, columns: dict) -> None:
    out = directory / "litdata"
    # One chunk per call (chunk_bytes far above a shard), appended: chunk-0-0.bin, chunk-0-1.bin, ... in order.
    optimize_litdata(
        fn=_as_is, inputs=_rows(columns), output_dir=str(out), chunk_bytes="64MB",
        mode="append" if (out / "index.json").exists() else None,
    )  # fmt: skip


def _as_is(row: dict) -> dict:
    return row


_WRITERS = {"pt": _write_pt, "tar": _write_tar, "parquet": _write_parquet, "litdata": _write_litdata}


def read_shards(directory: Path) -> list[Shard]:
    """The shards of `write_shards` in `directory`, in shard order, each through its reader (ddpkit.data.sources for
    all but .pt). The streaming module orders shards by their place in this list, not by name."""
    readers = json.loads((directory / "readers.json").read_text())
    opened = {r: iter(_open(directory, r, [i for i, s in enumerate(readers) if s == r])) for r in set(readers)}
    return [next(opened[r]) for r in readers]


def _open(directory: Path, reader: str, indices: list[int]) -> list[Shard]:
    names = [f"shard{i:02d}" for i in indices]
    if reader == "pt":
        return [LocalShard(directory / f"{name}.pt") for name in names]
    if reader == "tar":
        return sources.webdataset_shards([str(directory / f"{name}.tar") for name in names], transform=_tar_sample)
    if reader == "litdata":
        return sources.litdata_shards(directory / "litdata")
    import datasets
    import pyarrow.parquet as pq

    files = [str(directory / "parquet" / f"{name}.parquet") for name in names]
    stream = datasets.load_dataset(
        "parquet", data_files=files, split="train", streaming=True, cache_dir=str(directory / "hf-cache")
    )
    # Parquet files hold their row counts in their footers: exact lengths without reading the rows.
    lengths = [pq.ParquetFile(f).metadata.num_rows for f in files]
    return sources.hf_shards(stream.map(_as_tensors), lengths=lengths)


class UnevenShards(StreamingDataModule):
    """The shards of `write_shards` in `root`, each through its reader.

    Args:
        root: Folder of the shards.
        global_batch_size: Samples per optimizer step over all devices.
        micro_batch_size: Samples per forward pass on one device.
        num_workers: Loader workers per device.
        streams: Read positions per epoch.
    """

    def __init__(
        self,
        root: str = "",
        global_batch_size: int = 32,
        micro_batch_size: int | None = None,
        num_workers: int = 0,
        streams: int = 8,
    ) -> None:
        super().__init__(global_batch_size, micro_batch_size, num_workers, streams)
        self.root = root

    def train_shards(self) -> list[Shard]:
        return read_shards(Path(self.root))


class RecordingRegressor(L.LightningModule):
    """Linear regression with SGD; every training step appends {epoch, step, ids} to `record`/rank<r>.jsonl.

    Args:
        record: Folder of the per-rank records.
        kill_at_step: Rank 0 kills its whole process group with SIGKILL when this step starts (-1: never).
    """

    def __init__(self, record: str = "", kill_at_step: int = -1) -> None:
        super().__init__()
        self.record, self.kill_at_step = record, kill_at_step
        self.net = nn.Linear(4, 1)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        if self.global_step == self.kill_at_step and self.global_rank == 0:
            os.killpg(os.getpgrp(), signal.SIGKILL)  # kill -9 of the job: every rank and worker, no clean-up
        entry = {"epoch": self.current_epoch, "step": self.global_step, "ids": batch["id"].tolist()}
        with (Path(self.record) / f"rank{self.global_rank}.jsonl").open("a") as f:
            f.write(json.dumps(entry) + "\n")
        return F.mse_loss(self.net(batch["x"]), batch["y"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class _SlowShard:
    """A shard of toy blobs whose reader sleeps `delay_s` per sample, like a slow disk or decoder."""

    def __init__(self, name: str, samples: list, delay_s: float) -> None:
        self.name, self.samples, self.delay_s = name, samples, delay_s

    def __len__(self) -> int:
        return len(self.samples)

    def read(self, start: int = 0):
        for sample in self.samples[start:]:
            time.sleep(self.delay_s)
            yield sample


class SlowShards(StreamingDataModule):
    """The toy's 1,079 training blobs in 16 shards whose reader sleeps `sample_delay_ms` per sample (data-bound).

    Args:
        sample_delay_ms: Sleep per training sample, in the reading process (a loader worker).
        global_batch_size: Samples per optimizer step over all devices.
        num_workers: Loader workers per device.
    """

    def __init__(self, sample_delay_ms: float = 8.0, global_batch_size: int = 16, num_workers: int = 2) -> None:
        super().__init__(global_batch_size, num_workers=num_workers, streams=8)
        self.sample_delay_ms = sample_delay_ms

    def train_shards(self) -> list[_SlowShard]:
        samples = list(blobs(1079, seed=0))
        return [_SlowShard(f"blobs{i}", samples[i::16], self.sample_delay_ms / 1000) for i in range(16)]


class _BlobStream(IterableDataset):
    """The toy's training blobs as a stream that knows nothing of ranks, as users first write one."""

    def __iter__(self):
        yield from blobs(1079, seed=0)


class PlainStream(L.LightningDataModule):
    """The stream in a plain LightningDataModule: every rank reads all of it.

    Args:
        batch_size: Samples per device and step.
    """

    def __init__(self, batch_size: int = 32) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_BlobStream(), self.batch_size)
