"""A training sample's augmentation is a function of (seed, epoch, index): the same on 1 and 2 devices and with 0
and 2 loader workers, different every epoch, the same after a mid-epoch resume (ddpkit.data.draws)."""

import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from procs import concurrently, run
from torch.utils.data import Dataset

from ddpkit.data.draws import SeededSamples, own_draws, read_as_identity, seeded_draws
from ddpkit.data.sampling import GlobalBatchSampler, ResumableLoader

SCRIPT = Path(__file__).with_name("augmented.py")
RUNS = {"1dev-0w": (1, 0), "2dev-2w": (2, 2)}  # a change of either would show: one pair of runs for both


def fit(tmp: Path, name: str, devices: int, workers: int, *extra: str) -> dict[str, dict[str, list]]:
    """{epoch: {index: [draws, ...]}} of a fit of augmented.py, the ranks' records merged."""
    import json

    out = tmp / name
    out.mkdir()
    result = run([sys.executable, str(SCRIPT), str(out), str(devices), str(workers), *extra], out, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:]
    merged: dict[str, dict[str, list]] = {}
    for rank in range(devices):
        for epoch, samples in json.loads((out / f"rank{rank}.json").read_text()).items():
            for index, draws in samples.items():
                merged.setdefault(epoch, {}).setdefault(index, []).extend(draws)
    return merged


@pytest.fixture(scope="module")
def fits(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("augmented")
    return concurrently(lambda name: fit(tmp, name, *RUNS[name]), RUNS)


def test_a_samples_draws_are_the_same_on_any_devices_and_workers_and_new_each_epoch(fits):
    """Cost: 2 fits of 2 epochs x 4 steps at once, ~60 s on 2 shared cores. Every sample trained in an epoch has
    the same three draws (torch, random, numpy) on 1 device with no workers and on 2 devices with 2 persistent
    workers each (the epoch reaches them with the index); no sample's draws repeat between epoch 0 and 1.
    Mutations: the sampler not handing over the epoch (epochs equal), seeding=False or seeding without the index
    (the runs differ: measured with 2 devices x 2 workers unseeded)."""
    reference = fits["1dev-0w"]
    assert set(reference) == {"0", "1"} and all(len(s) == 32 for s in reference.values())
    assert fits["2dev-2w"] == reference
    assert all(reference["0"][i] != reference["1"][i] for i in reference["0"])
    drawn = [d for samples in reference["0"].values() for d in samples]
    assert len({tuple(d) for d in drawn}) == 32  # each sample its own draws


def test_seeded_draws_false_reads_the_users_dataset_with_plain_indices():
    """Cost: < 1 s. The switch: `seeded_draws=False` gives the loader the user's dataset and a sampler of plain
    indices (the draws each process's own); on by default. Mutation: the switch ignored."""
    from augmented import Data

    for seeded in (True, False):
        data = Data(global_batch_size=8, seeded_draws=seeded)
        data.setup("fit")
        loader = data.train_dataloader()
        assert isinstance(loader.dataset, SeededSamples) is seeded
        assert isinstance(next(iter(loader.sampler)), tuple) is seeded
    assert Data().seeded_draws


class Drawing(Dataset):
    """Draws from the three global generators; `own=True` also from a generator of its own, made in __init__."""

    def __init__(self, own: bool = False) -> None:
        self.rng = np.random.default_rng() if own else None

    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int):
        own = self.rng.random() if self.rng is not None else 0.0
        return torch.tensor([i, torch.rand(()).item(), random.random(), np.random.rand(), own])


def samples(world: int, rank: int, resume: int | None = None) -> list[torch.Tensor]:
    sampler = GlobalBatchSampler(Drawing(), 4, num_replicas=world, rank=rank, seed=3, with_epoch=True)
    loader = ResumableLoader(SeededSamples(Drawing(), 3), batch_size=4 // world, sampler=sampler)
    if resume is not None:
        loader.load_state_dict({"epoch": 1, "global_batches_done": resume})
    else:
        sampler.set_epoch(1)
    return [row for batch in loader for row in batch]


def test_a_mid_epoch_resume_draws_what_the_uninterrupted_epoch_drew():
    """Cost: < 1 s. Resumed after 2 of epoch 1's 5 global batches, on 1 or 2 ranks, the rest of the epoch holds
    the uninterrupted epoch's samples with the same draws. Mutation: the resumed sampler handing its own epoch."""
    whole = samples(1, 0)
    for world in (1, 2):
        resumed = [row for rank in range(world) for row in samples(world, rank, resume=2)]
        assert sorted(map(tuple, map(torch.Tensor.tolist, resumed))) == sorted(
            map(tuple, map(torch.Tensor.tolist, whole[8:]))
        )


def test_a_read_leaves_the_training_processes_generators_where_they_were():
    """Cost: < 1 s. With no workers the sample is read in the training process: its generators (dropout's) are
    where they were before the read. Mutation: seeding without giving the states back."""
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    SeededSamples(Drawing(), 0)[(0, 3)]
    after = torch.rand(()).item(), random.random(), np.random.rand()
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    assert after == (torch.rand(()).item(), random.random(), np.random.rand())


def test_a_sample_read_as_its_identity_is_the_same_in_every_state():
    """Cost: < 1 s. The suite recognises an augmented sample by its draws seeded from the index alone: the same
    sample whatever the generators' state, through the wrapper or not. Mutation: reading it unseeded."""
    first = read_as_identity(Drawing(), 5)
    with seeded_draws(99):
        assert torch.equal(read_as_identity(SeededSamples(Drawing(), 7), (3, 5)), first)


def test_a_dataset_with_a_generator_of_its_own_is_named_with_the_index():
    """Cost: < 1 s. `np.random.default_rng()` made in __init__: found in the first index read twice, one line
    that names the dataset and the index; a dataset drawing from the global generators only passes. Mutation: the
    two reads under different seeds (every augmenting dataset flagged) or one read (none flagged)."""
    assert own_draws(Drawing()) == ""
    line = own_draws(Drawing(own=True))
    assert line.startswith("the train dataset (Drawing) draws random numbers from a generator of its own: index 0")
    assert "\n" not in line


def test_a_dataset_that_reads_whole_batches_is_read_through_its_own_call():
    """Cost: < 1 s. A dataset defining `__getitems__` (a per-request latency: the scaling gap's slow data) gets one
    call per batch with the batch's indices, not one read per sample. Mutation: reading sample by sample (the gap
    test's injected 120 ms per batch vanished and its slow-data case named compute)."""
    class Batched(Dataset):
        def __init__(self):
            self.calls = []

        def __len__(self):
            return 10

        def __getitem__(self, index):
            raise AssertionError("read one by one")

        def __getitems__(self, indices):
            self.calls.append(list(indices))
            return [i * 2 for i in indices]

    data = Batched()
    assert SeededSamples(data, seed=0).__getitems__([(0, 3), (0, 5), (0, 7)]) == [6, 10, 14]
    assert data.calls == [[3, 5, 7]]
