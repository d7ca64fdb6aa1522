"""Unit tests of how the guarantee suite recognises samples and datasets (ddpkit.testing.fingerprints), in this
process, on the loaders the library builds: samples by what the dataset returns, before a collate function pads
them; datasets by their length and their samples' keys; a difference said in one line. The real runs:
test_model_families.py (an LSTM over padded batches, data built per process)."""

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from data_families import TextData, UnseededShuffleData, pad_to_longest
from torch.utils.data import Dataset

import ddpkit.testing.plugin  # noqa: F401  first: it has pytest rewrite the asserts of the checks imported below
from ddpkit.data.sampling import GlobalBatchSampler, ResumableLoader
from ddpkit.data.shards import LocalShard, ShardSequence
from ddpkit.data.streaming import StreamLoader
from ddpkit.testing import fingerprints
from ddpkit.testing.check_data import data_gate
from ddpkit.testing.fingerprints import (
    TrainSamples,
    dataset_fingerprint,
    first_difference,
    rank_difference,
    sample_key,
)
from ddpkit.testing.parity_probe import ReversedBatches, batch_len, sample_keys
from ddpkit.testing.runs import Wave, Waves


def sentences() -> Dataset:
    """TextData's 128 training sentences, of 3 to 24 words."""
    return TextData().train_dataset()


def epoch_batches(world: int, workers: int = 0) -> list[tuple[list[list[str]], list[list[str]]]]:
    """Per rank, two epochs of a ResumableLoader over the sentences (global batch 32, each batch padded to its
    longest, `workers` loader processes): the keys TrainSamples gives each batch, and the keys of its collated rows."""
    dataset, out = sentences(), []
    for rank in range(world):
        sampler = GlobalBatchSampler(dataset, 32, num_replicas=world, rank=rank, seed=42)
        loader = ResumableLoader(dataset, batch_size=32 // world, sampler=sampler, collate_fn=pad_to_longest,
                                 num_workers=workers, persistent_workers=workers > 0)  # fmt: skip
        samples, batches = TrainSamples(loader), []
        for epoch in (0, 1):
            sampler.set_epoch(epoch)
            batches += [(samples.keys(epoch), sample_keys(batch)) for batch in loader]
        out.append(([keys for keys, _ in batches], [rows for _, rows in batches]))
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sample_is_recognised_before_its_batch_pads_it(workers):
    """Global batch k of 2 ranks, put together, holds 1 device's samples in both epochs, though every batch is padded
    to its own longest sentence, so that the collated rows of a sentence differ between 1 device and a rank: the
    keys are of the samples the dataset returns at the indices the sampler handed out, also when worker processes
    load them."""
    (one, one_rows), (zero, zero_rows), (first, first_rows) = epoch_batches(1, workers) + epoch_batches(2, workers)
    assert len(one) == len(zero) == len(first) == 8
    assert [sorted(a + b) for a, b in zip(zero, first, strict=True)] == [sorted(batch) for batch in one]
    dataset, sampler = sentences(), GlobalBatchSampler(sentences(), 32, num_replicas=1, rank=0, seed=42)
    sampler.set_epoch(1)
    assert one[4] == [sample_key(dataset[i]) for i in list(sampler)[:32]]  # epoch 1's first batch
    assert one[0] != one[4]
    # What the rows would have said: other padding, other rows, so the same samples did not match.
    rows = [sorted(a + b) for a, b in zip(zero_rows, first_rows, strict=True)]
    assert rows != [sorted(batch) for batch in one_rows]


def test_a_streamed_sample_is_recognised_before_its_batch_pads_it(tmp_path: Path):
    """A streaming loader's samples are keyed as they reach the collate function, which is still the one given (the
    batches it makes are unchanged): 2 ranks' batches together are 1 device's."""
    dataset = sentences()
    shards = []
    for i, part in enumerate((range(0, 50), range(50, 90), range(90, 128))):  # lists of (ids, label) samples
        ids = torch.nn.utils.rnn.pad_sequence([dataset[j][0] for j in part], batch_first=True)
        lengths, labels = torch.tensor([len(dataset[j][0]) for j in part]), torch.stack([dataset[j][1] for j in part])
        torch.save((ids, lengths, labels), tmp_path / f"{i}.pt")
        shards.append(LocalShard(tmp_path / f"{i}.pt"))

    def trim(samples: list) -> tuple:  # the shard's padded rows cut to each sentence's length, then padded again
        return pad_to_longest([(ids[:length], label) for ids, length, label in samples])

    keyed = []
    for world in (1, 2):
        for rank in range(world):
            loader = StreamLoader(shards, streams=2, global_batch_size=32, world_size=world, rank=rank,
                                  micro_batch_size=32 // world, seed=42, collate_fn=trim)  # fmt: skip
            samples = TrainSamples(loader)
            batches = list(loader)
            keyed.append([samples.keys(epoch=0) for _ in batches])
            assert samples.read == "collate input" and all(len(b[0]) == 32 // world for b in batches)
    one, zero, first = keyed
    assert [sorted(a + b) for a, b in zip(zero, first, strict=True)] == [sorted(batch) for batch in one]


def test_a_loader_of_neither_kind_leaves_the_keys_to_the_batch_rows():
    """A loader whose samples cannot be read before collation (here a user's own iterable of batches) gets None, and
    the probe keys the collated rows."""
    assert TrainSamples([torch.zeros(2, 3)]).keys(epoch=0) is None


class Augmenting(Dataset):
    """A dataset whose samples draw from torch's, Python's and NumPy's global streams (an augmentation)."""

    def __len__(self) -> int:
        return 3

    def __getitem__(self, i: int) -> tuple:
        return torch.rand(2), random.random(), np.random.rand()


def test_fingerprinting_leaves_the_runs_random_streams_where_they_were():
    """Reading samples again for their keys draws nothing the run would see: every global stream is where it was."""
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    dataset_fingerprint(Augmenting())
    after = torch.rand(1), random.random(), np.random.rand()
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    assert after == (torch.rand(1), random.random(), np.random.rand())


class Numbers(Dataset):
    """`n` samples: a dict of a tensor, a string and a number, the i-th counting its reads."""

    def __init__(self, n: int) -> None:
        self.n, self.reads = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        self.reads += 1
        return {"x": torch.tensor([i, 2 * i]), "name": f"s{i}", "weight": 0.5}


def test_a_large_dataset_is_fingerprinted_by_evenly_spaced_samples(monkeypatch):
    """A set of up to FINGERPRINT_SAMPLES is read whole; a larger one at that many evenly spaced indices, its first
    and last among them; a shard sequence larger than that by the first sample of its shards."""
    monkeypatch.setattr(fingerprints, "FINGERPRINT_SAMPLES", 10)
    small, large = Numbers(10), Numbers(1000)
    assert dataset_fingerprint(small)["indices"] == list(range(10)) and small.reads == 10
    printed = dataset_fingerprint(large)
    assert large.reads == 10 and printed["length"] == 1000 and printed["indices"][0] == 0
    assert printed["indices"][-1] == 999 and printed["indices"] == sorted(set(printed["indices"]))
    assert printed["keys"][1] == sample_key(large[printed["indices"][1]])

    class Shard:
        def __init__(self, name: str, n: int) -> None:
            self.name, self.n, self.starts = name, n, []

        def __len__(self) -> int:
            return self.n

        def read(self, start: int = 0):
            self.starts.append(start)
            yield from (torch.tensor(i) for i in range(start, self.n))

    shards = [Shard(str(k), 7) for k in range(3)]
    printed = dataset_fingerprint(ShardSequence(shards))
    assert printed["indices"] == [0, 7, 14] and [s.starts for s in shards] == [[0], [0], [0]]


def test_a_sample_key_is_its_content_and_types():
    """Equal samples have equal keys, in any container; a changed value, dtype or shape changes the key."""
    a = {"ids": torch.tensor([3, 4]), "label": 1, "text": "x"}
    assert sample_key(a) == sample_key({"text": "x", "label": 1, "ids": torch.tensor([3, 4])})
    for other in ({**a, "ids": torch.tensor([3, 5])}, {**a, "ids": torch.tensor([3.0, 4.0])},
                  {**a, "ids": torch.tensor([[3, 4]])}, {**a, "label": 2}, {**a, "text": "y"}):  # fmt: skip
        assert sample_key(other) != sample_key(a), other
    assert sample_key(np.arange(3)) == sample_key(torch.arange(3)) and len(sample_key(a)) == 16


def test_a_batch_of_sequences_of_samples_counts_and_keys_each_sample():
    """A detector's batch (torchvision's `tuple(zip(*samples))`: a tuple of 3-channel images, a tuple of target dicts)
    holds 4 samples, not the first image's 3 channels; each sample has a key of its own image and targets, the same
    in another batch; reversing such a batch leaves each image's channels as they were."""
    images = [10.0 * i + torch.arange(3.0).reshape(3, 1, 1).expand(3, 5, 5).clone() for i in range(4)]
    targets = [{"boxes": torch.tensor([[0.0, 0.0, 1.0, 1.0]]) * i, "labels": torch.tensor([i])} for i in range(4)]
    batch = (tuple(images), tuple(targets))
    assert batch_len(batch) == 4 and batch_len((torch.zeros(4, 3, 5, 5), torch.zeros(4))) == 4
    keys = sample_keys(batch)
    assert len(set(keys)) == 4 and sample_keys((tuple(images[2:]), tuple(targets[2:]))) == keys[2:]
    listed = [list(images), list(targets)]
    ReversedBatches().on_train_batch_start(None, None, listed, 0)
    assert [int(image[0, 0, 0]) for image in listed[0]] == [30, 20, 10, 0] and sample_keys(listed) == keys[::-1]
    ReversedBatches().on_train_batch_start(None, None, batch, 0)
    assert [image[:, 0, 0].tolist() for image in batch[0]] == [[10.0 * i, 10.0 * i + 1, 10.0 * i + 2] for i in range(4)]


def test_a_difference_is_one_line_with_the_dataset_the_index_and_both_keys():
    """Two ranks' fingerprints: the first dataset and index where they differ, both samples' keys, and why such data
    differs; a missing dataset or another length said as such; nothing where they agree."""
    data = TextData()
    data.setup("fit")
    shuffled = UnseededShuffleData()
    shuffled.setup("fit")
    zero = {"train": dataset_fingerprint(data.train_set), "val": dataset_fingerprint(data.val_set)}
    one = {"train": dataset_fingerprint(shuffled.train_set), "val": dataset_fingerprint(shuffled.val_set)}
    index = next(i for i, (a, b) in enumerate(zip(zero["train"]["keys"], one["train"]["keys"], strict=True)) if a != b)
    assert rank_difference([zero, one]) == (
        f"rank 1's train dataset differs from rank 0's at index {index} (sample fingerprints "
        f"{one['train']['keys'][index]} vs {zero['train']['keys'][index]}): built differently per process (a set's "
        "order, an unseeded shuffle?)"
    )
    assert rank_difference([zero, {"train": zero["train"]}]).startswith("rank 1 has no val dataset where rank 0 has")
    assert first_difference(zero["val"], zero["train"]) == "in length (128 samples vs 37)"
    assert rank_difference([zero, zero, dict(zero)]) == ""


def test_runs_skip_pointing_at_the_data_check_once_the_first_waves_ranks_differ(tmp_path: Path):
    """Once the first wave has run, the gate reads the ranks' fingerprints: where they differ every run asked for
    skips with the pointer (no later wave starts); where they agree the runs are handed out."""
    import json

    def first(runs: Waves) -> dict:
        def write(name: str, prints: list[dict]) -> str:
            (tmp_path / name / "probe").mkdir(parents=True, exist_ok=True)
            for rank, printed in enumerate(prints):
                (tmp_path / name / "probe" / f"data-rank{rank}.json").write_text(json.dumps(printed))
            return name

        same = {"train": {"length": 2, "indices": [0, 1], "keys": ["a", "b"]}}
        other = {"train": {"length": 2, "indices": [0, 1], "keys": ["a", "c"]}}
        return {"1dev-fp64": lambda: write("1dev-fp64", [same]), "2dev-fp64": lambda: write("2dev-fp64", [same, other])}

    started = []
    runs = Waves(tmp_path, [Wave(("1dev-fp64", "2dev-fp64"), first), Wave(("later",), lambda r: started.append(1))],
                 data_gate)  # fmt: skip
    with pytest.raises(pytest.skip.Exception, match=r"test_every_rank_holds_the_same_datasets says which and where"):
        runs["1dev-fp64"]
    with pytest.raises(pytest.skip.Exception):
        runs["later"]
    assert started == [] and runs.folder("2dev-fp64") == tmp_path / "2dev-fp64"
    nothing = {"1dev-fp64": lambda: 1, "2dev-fp64": lambda: 2}  # runs that wrote no fingerprints: nothing to gate on
    agreeing = Waves(tmp_path / "b", [Wave(("1dev-fp64", "2dev-fp64"), lambda r: nothing)], data_gate)
    assert agreeing["1dev-fp64"] == 1
