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

from ddpkit.data.draws import SeededSamples, batch_draws, own_draws, read_as_identity, seeded_draws
from ddpkit.data.mixing import MixSamples
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


def loader(dataset: Dataset, world: int = 1, rank: int = 0, epoch: int = 1, collate_fn=None) -> ResumableLoader:
    """Rank `rank`'s loader of `dataset` in global batches of 4, the draws seeded (seed 3), at `epoch`."""
    sampler = GlobalBatchSampler(dataset, 4, num_replicas=world, rank=rank, seed=3, with_epoch=True)
    sampler.set_epoch(epoch)
    return ResumableLoader(SeededSamples(dataset, 3), batch_size=4 // world, sampler=sampler, collate_fn=collate_fn)


def samples(world: int, rank: int, resume: int | None = None) -> list[torch.Tensor]:
    drawn = loader(Drawing(), world, rank)
    if resume is not None:
        drawn.load_state_dict({"epoch": 1, "global_batches_done": resume})
    return [row for batch in drawn for row in batch]


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


class Images(Dataset):
    """20 one-channel 8x8 images, sample i filled with its class i % 3 (so an image's mean says its classes' shares)
    plus a draw from torch's generator (an augmentation)."""

    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int):
        return torch.full((1, 8, 8), float(i % 3)) + 1e-3 * torch.rand(()), i % 3


def mix_in_collate(draw):
    """A collate function that mixes the batch with itself flipped, its weight from `draw()`."""

    def collate(samples):
        x, y = torch.utils.data.default_collate(samples)
        lam = draw()
        return lam * x + (1 - lam) * x.flip(0), y

    return collate


@pytest.mark.parametrize(
    "draw",
    [lambda: torch.rand(()).item(), lambda: float(np.random.beta(0.4, 0.4)), random.random],
    ids=["torch", "numpy", "python"],
)
def test_a_draw_per_batch_is_named_and_draws_per_sample_are_not(draw):
    """Cost: < 1 s. MixUp in the collate function, its weight drawn from each global generator: the first batch read
    twice under other seeds differs, one line that names the fix; the same data augmented or mixed per sample
    (MixSamples) passes. Mutation: the seeds 1 and 2 (NumPy takes their high 32 bits: the numpy case passes)."""
    line = batch_draws(loader(Images(), collate_fn=mix_in_collate(draw)))
    assert line.startswith("the train loader's batches change with the random state outside the samples' own draws")
    assert "ddpkit.MixSamples" in line and "\n" not in line
    assert batch_draws(loader(Images())) == ""
    assert batch_draws(loader(MixSamples(Images(), 3, mixup_alpha=1.0, cutmix_alpha=1.0))) == ""


def rows(world: int, epoch: int) -> list[tuple]:
    mixed = MixSamples(Images(), 3, mixup_alpha=1.0, cutmix_alpha=1.0)
    out = []
    for rank in range(world):
        for x, target in loader(mixed, world, rank, epoch):
            out += [(tuple(a.flatten().tolist()), tuple(t.tolist())) for a, t in zip(x, target, strict=True)]
    return sorted(out)


def test_mixed_samples_are_the_same_on_1_and_2_ranks_and_new_each_epoch():
    """Cost: < 1 s. MixUp and CutMix per sample: epoch 1's mixed samples and targets on 2 ranks are 1 rank's, and
    epoch 2's are others. Mutation: a partner drawn from a generator of MixSamples' own."""
    assert rows(2, 1) == rows(1, 1)
    assert rows(1, 2) != rows(1, 1)


@pytest.mark.parametrize("alphas", [(1.0, 0.0), (0.0, 1.0), (1.0, 1.0)], ids=["mixup", "cutmix", "both"])
def test_a_mixed_targets_weights_are_the_shares_of_the_mixed_images(alphas):
    """Cost: < 1 s. Image i is filled with its class (i % 3): a mixed image's mean is the sum of each class times its
    weight in the soft target, for MixUp (the weight) and CutMix (the pasted box's share, corrected at the edges);
    targets sum to 1; some samples mixed across classes. Mutation: CutMix's target weighted by the drawn weight, not
    the pasted share."""
    mixed = MixSamples(Images(), 3, *alphas)
    across = 0
    for index in range(20):
        with seeded_draws(index):
            x, target = mixed[index]
        assert target.sum().item() == pytest.approx(1.0)
        assert x.mean().item() == pytest.approx((target * torch.arange(3.0)).sum().item(), abs=2e-3)
        across += int((target > 0).sum()) > 1
    assert across >= 5


def test_unmixed_samples_keep_their_input_and_a_smoothed_one_hot_target():
    """Cost: < 1 s. `prob=0` mixes nothing: the input as read and the one-hot target less the smoothing; no alpha
    is refused."""
    with seeded_draws(0):
        x, target = MixSamples(Images(), 3, prob=0.0, label_smoothing=0.3)[4]
    with seeded_draws(0):
        assert torch.equal(x, Images()[4][0])
    assert target.tolist() == pytest.approx([0.1, 0.8, 0.1])
    with pytest.raises(ValueError, match="give one or both > 0"):
        MixSamples(Images(), 3, mixup_alpha=0.0, cutmix_alpha=0.0)
