"""The source adapters (ddpkit.data.sources) turn LitData, WebDataset and `datasets` data, built here, into shards whose
lengths are exact and whose `read(start)` is the tail of `read(0)`: what the streaming module's promises rest on."""

import importlib
import json
import pickle
import sys

import pytest
from streams import optimize_litdata
from torch.utils.data import DataLoader, IterableDataset

import ddpkit.data
from ddpkit.data import sources, streaming

N = 301  # samples in every source, numbered 0..N-1 in the order they are written


def check_shards(shards, sample_id, lengths):
    """Lengths as written; each sample once over the shards, in writing order; `read(start)` == the tail of
    `read(0)` for several starts; the same order on a second read and after a pickle (spawned workers)."""
    assert [len(s) for s in shards] == lengths
    full = [[sample_id(x) for x in s.read()] for s in shards]
    assert [len(ids) for ids in full] == lengths
    assert sum(full, []) == list(range(N))
    for shard, ids in zip(shards, full, strict=True):
        for start in sorted({1, 2, len(ids) // 2, len(ids) - 1, len(ids)}):
            assert [sample_id(x) for x in shard.read(start)] == ids[start:], (shard.name, start)
    assert [[sample_id(x) for x in s.read()] for s in shards] == full
    assert [[sample_id(x) for x in s.read()] for s in pickle.loads(pickle.dumps(shards))] == full


def test_imports_without_the_libraries(monkeypatch):
    """ddpkit.data.sources imports with none of the adapters' libraries installed; an adapter then says which is
    missing."""
    for name in ("litdata", "webdataset", "datasets"):
        monkeypatch.setitem(sys.modules, name, None)  # `import name` now raises ImportError
    monkeypatch.delitem(sys.modules, "ddpkit.data.sources")
    monkeypatch.setattr(ddpkit.data, "sources", sources)  # put back after the test, as the new import rebinds it
    bare = importlib.import_module("ddpkit.data.sources")
    with pytest.raises(ImportError, match="litdata"):
        bare.litdata_shards("data")


# LitData ----------------------------------------------------------------------------------------------------------


def _lit_item(i):
    """Samples of different sizes, so that chunks cut by bytes hold different counts."""
    return {"id": i, "pad": "x" * (i % 37) * 20}


@pytest.fixture(scope="module")
def lit_dir(tmp_path_factory):
    pytest.importorskip("litdata", reason="install it: pip install --no-deps litdata==0.2.76 (README)")
    out = tmp_path_factory.mktemp("litdata")
    optimize_litdata(fn=_lit_item, inputs=list(range(N)), output_dir=str(out), chunk_bytes=6000)
    return out


def test_litdata_chunks_are_shards(lit_dir):
    """One shard per chunk of `litdata.optimize`'s output, each as long as index.json says."""
    chunks = json.loads((lit_dir / "index.json").read_text())["chunks"]
    lengths = [chunk["chunk_size"] for chunk in chunks]
    assert len(set(lengths)) > 2  # unequal chunks: with equal ones a first index of chunk x size would pass
    shards = sources.litdata_shards(lit_dir)
    assert [s.name for s in shards] == [chunk["filename"] for chunk in chunks]
    check_shards(shards, lambda x: x["id"], lengths)


# WebDataset -------------------------------------------------------------------------------------------------------

TAR_SIZES = [70, 130, 1, 100]  # samples per tar file; 2 member files each


@pytest.fixture(scope="module")
def tars(tmp_path_factory):
    webdataset = pytest.importorskip("webdataset")
    out = tmp_path_factory.mktemp("webdataset")
    first, paths = 0, []
    for k, size in enumerate(TAR_SIZES):
        paths.append(out / f"data-{k:03d}.tar")
        with webdataset.TarWriter(str(paths[-1])) as tar:
            for i in range(first, first + size):
                tar.write({"__key__": f"sample{i:06d}", "cls": str(i).encode(), "json": b'{"pad": "%d"}' % i})
        first += size
    return paths


def _tar_id(sample):
    assert sample["json"] == b'{"pad": "%s"}' % sample["cls"]  # both members of one sample, none of another
    return int(sample["cls"])


def test_webdataset_tars_are_shards(tars):
    """One shard per tar file, its samples counted (not its member files), read from any sample on."""
    shards = sources.webdataset_shards(tars)
    assert [s.name for s in shards] == [p.name for p in tars]
    check_shards(shards, _tar_id, TAR_SIZES)


def test_webdataset_pattern_lengths_and_transform(tars):
    """A brace pattern of `pipe:` URLs, with lengths given (nothing counted) and a transform on each sample."""
    pattern = f"pipe:cat {tars[0].parent}/data-{{000..{len(tars) - 1:03d}}}.tar"
    lengths = {p.name: n for p, n in zip(tars, TAR_SIZES, strict=True)}
    shards = sources.webdataset_shards(pattern, lengths=lengths, transform=_tar_id)
    check_shards(shards, lambda x: x, TAR_SIZES)


def test_webdataset_wrong_length_fails_loudly(tars):
    """A length that does not match the file (a stale count) fails the read, naming the shard."""
    for wrong in (TAR_SIZES[0] - 1, TAR_SIZES[0] + 1):
        (shard,) = sources.webdataset_shards(tars[:1], lengths={tars[0].name: wrong})
        with pytest.raises(ValueError, match=tars[0].name):
            list(shard.read(5))


# Hugging Face datasets --------------------------------------------------------------------------------------------

JSONL_SIZES = [120, 31, 150]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """Three JSONL files read with `datasets` (HF_DATASETS_OFFLINE: tests/conftest.py, everything is local)."""
    datasets = pytest.importorskip("datasets")
    out = tmp_path_factory.mktemp("hf")
    datasets.disable_progress_bars()
    first = 0
    for k, size in enumerate(JSONL_SIZES):
        lines = [json.dumps({"id": i, "text": f"row {i}"}) for i in range(first, first + size)]
        (out / f"part-{k}.jsonl").write_text("\n".join(lines) + "\n")
        first += size
    return datasets, out


def test_hf_saved_dataset_shards(hf, tmp_path):
    """A map-style dataset saved in 3 files: one shard per file, read at any row."""
    datasets, _ = hf
    datasets.Dataset.from_dict({"id": list(range(N))}).save_to_disk(tmp_path, num_shards=3)
    shards = sources.hf_shards(datasets.load_from_disk(tmp_path))
    check_shards(shards, lambda x: x["id"], [101, 100, 100])


def test_hf_streaming_shards(hf):
    """A streaming dataset of 3 files: lengths given, or counted once, are the files' rows."""
    datasets, out = hf
    files = sorted(str(p) for p in out.glob("part-*.jsonl"))
    stream = datasets.load_dataset(
        "json", data_files=files, split="train", streaming=True, cache_dir=str(out / "cache")
    )
    check_shards(sources.hf_shards(stream, lengths=JSONL_SIZES), lambda x: x["id"], JSONL_SIZES)
    check_shards(sources.hf_shards(stream, lengths="count"), lambda x: x["id"], JSONL_SIZES)


def test_hf_streaming_without_lengths_fails(hf):
    """A streaming dataset of several shards whose lengths it cannot know is refused, saying what to pass."""
    datasets, out = hf
    files = sorted(str(p) for p in out.glob("part-*.jsonl"))
    stream = datasets.load_dataset(
        "json", data_files=files, split="train", streaming=True, cache_dir=str(out / "cache")
    )
    with pytest.raises(ValueError, match="lengths='count'"):
        sources.hf_shards(stream)


def test_hf_streaming_length_from_the_dataset_card(hf, tmp_path):
    """One shard whose split size the dataset's card records: that is its length, nothing is read."""
    datasets, out = hf
    (tmp_path / "data.jsonl").write_text((out / "part-1.jsonl").read_text())
    card = "---\ndataset_info:\n  splits:\n  - name: train\n    num_examples: 31\n---\n"
    (tmp_path / "README.md").write_text(card)
    stream = datasets.load_dataset(str(tmp_path), split="train", streaming=True, cache_dir=str(out / "cache"))
    (shard,) = sources.hf_shards(stream)
    assert len(shard) == 31
    assert [x["id"] for x in shard.read(30)] == [150]


class _ReadInWorkers(IterableDataset):
    def __init__(self, shard):
        self.shard = shard

    def __iter__(self):
        yield from (x["id"] for x in self.shard.read(3))


def test_hf_streaming_shard_whole_in_a_dataloader_worker(hf):
    """Inside a DataLoader worker a streaming shard still yields all its rows (datasets would give a worker
    only its share of the shards when iterated plainly)."""
    datasets, out = hf
    stream = datasets.load_dataset(
        "json", data_files=str(out / "part-1.jsonl"), split="train", streaming=True, cache_dir=str(out / "cache")
    )
    (shard,) = sources.hf_shards(stream, lengths=[31])
    loader = DataLoader(_ReadInWorkers(shard), batch_size=None, num_workers=2)
    assert sorted(loader) == sorted(2 * list(range(123, 151)))  # each of the 2 workers reads rows 3..30


# Through the streaming module -------------------------------------------------------------------------------------


def _source(name, request):
    """(shards, sample id) of one source built by the fixtures above."""
    if name == "litdata":
        return sources.litdata_shards(request.getfixturevalue("lit_dir")), lambda x: x["id"]
    if name == "webdataset":
        return sources.webdataset_shards(request.getfixturevalue("tars")), _tar_id
    datasets, out = request.getfixturevalue("hf")
    files = sorted(str(p) for p in out.glob("part-*.jsonl"))
    stream = datasets.load_dataset("json", data_files=files, split="train", streaming=True, cache_dir=str(out / "c"))
    return sources.hf_shards(stream, lengths=JSONL_SIZES), lambda x: x["id"]


@pytest.mark.parametrize("name", ["litdata", "webdataset", "datasets"])
def test_through_the_stream_loader(name, request):
    """Through the streaming module's loader, 2 ranks' shares of each step make 1 rank's global batch, every
    sample at most once, and a resume on 2 ranks from 1 rank's checkpoint continues with the same batches."""
    shards, sample_id = _source(name, request)

    def loader(world, rank):
        return streaming.StreamLoader(
            shards, streams=4, global_batch_size=8, world_size=world, rank=rank, micro_batch_size=8 // world,
            seed=3, collate_fn=lambda batch: [sample_id(x) for x in batch],
        )  # fmt: skip

    one = list(loader(1, 0))
    assert len(one) == N // 8
    assert len(set(sum(one, []))) == len(one) * 8
    assert [a + b for a, b in zip(*(list(loader(2, rank)) for rank in range(2)), strict=True)] == one
    first = loader(1, 0)
    steps = iter(first)
    for _ in range(5):
        next(steps)
    resumed = [loader(2, rank) for rank in range(2)]
    for rank_loader in resumed:
        rank_loader.load_state_dict(first.state_dict())
    assert [a + b for a, b in zip(*map(list, resumed), strict=True)] == one[5:]
