"""The training sampler gives N devices the same global batches as 1 device."""

from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import TensorDataset

from ddpkit.data.sampling import (
    BlockSampler,
    GlobalBatchSampler,
    ResumableLoader,
    eval_sampler,
)
from ddpkit.testing.toy import ToyData

DATA = TensorDataset(torch.arange(103))


def global_batches(world: int, global_batch: int = 8, epoch: int = 0, seed: int = 7) -> list[list[int]]:
    """The epoch's global batches, assembled from what each of `world` ranks yields."""
    per_rank = []
    for rank in range(world):
        sampler = GlobalBatchSampler(DATA, global_batch, num_replicas=world, rank=rank, seed=seed)
        sampler.set_epoch(epoch)
        per_rank.append(list(sampler))
    per_device = global_batch // world
    steps = len(per_rank[0]) // per_device
    return [sum((r[s * per_device : (s + 1) * per_device] for r in per_rank), []) for s in range(steps)]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_global_batches_equal_one_device(world):
    """Step k's samples on N ranks, put together, are step k's samples on 1 device."""
    assert global_batches(world) == global_batches(1)


def test_epoch_covers_each_sample_at_most_once_and_drops_only_the_tail():
    """An epoch has 103 // 8 = 12 full global batches of distinct samples."""
    batches = global_batches(2)
    flat = sum(batches, [])
    assert len(batches) == 12 and all(len(b) == 8 for b in batches)
    assert len(set(flat)) == 96


def test_ranks_get_disjoint_shards():
    """No sample goes to two ranks in the same epoch."""
    shards = [set(GlobalBatchSampler(DATA, 8, num_replicas=2, rank=r, seed=7)) for r in range(2)]
    assert len(shards[0]) == len(shards[1]) == 48 and not shards[0] & shards[1]


def test_set_epoch_reshuffles_and_seed_reproduces():
    """A new epoch gives a new order; the same seed and epoch give the same order."""
    assert global_batches(2, epoch=0) != global_batches(2, epoch=1)
    assert global_batches(2, epoch=1) == global_batches(2, epoch=1)
    assert global_batches(2, seed=1) != global_batches(2, seed=2)


def test_indivisible_global_batch_is_refused():
    """A global batch that does not split evenly over the ranks fails with a usable message."""
    with pytest.raises(ValueError, match="global_batch_size=10 does not divide evenly over 4 processes"):
        GlobalBatchSampler(DATA, 10, num_replicas=4, rank=0)


def test_global_batch_larger_than_dataset_is_refused():
    """A global batch with no full step in an epoch fails instead of training on nothing."""
    with pytest.raises(ValueError, match="larger than the dataset"):
        GlobalBatchSampler(DATA, 128, num_replicas=1, rank=0)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_eval_sampler_sees_every_sample_once(world):
    """Evaluation shards cover the set exactly, with no padded duplicates (359 is odd)."""
    data = TensorDataset(torch.arange(359))
    shards = [list(eval_sampler(data, world, rank)) for rank in range(world)]
    assert sorted(sum(shards, [])) == list(range(359))


def loader(world: int, rank: int) -> ResumableLoader:
    sampler = GlobalBatchSampler(DATA, 8, num_replicas=world, rank=rank, seed=7)
    return ResumableLoader(DATA, batch_size=8 // world, sampler=sampler)


def test_resumable_loader_continues_on_another_world_size():
    """Stopped after 5 global batches on 1 device, 2 restored ranks yield exactly global batches 5..11."""
    one = loader(1, 0)
    one.sampler.set_epoch(3)
    batches = iter(one)
    for _ in range(5):
        next(batches)
    state = one.state_dict()
    assert state == {"epoch": 3, "global_batches_done": 5}
    rest = []
    for rank in range(2):
        restored = loader(2, rank)
        restored.load_state_dict(state)
        restored.sampler.set_epoch(3)  # what Lightning does after restoring
        rest.append([b[0].tolist() for b in restored])
    assert [a + b for a, b in zip(*rest, strict=True)] == [b[0].tolist() for b in batches]
    assert restored.state_dict() == {"epoch": 3, "global_batches_done": 12}


def test_completed_epoch_resumes_at_the_next_one():
    """A position at the end of an epoch restores to the start of the next epoch, nothing skipped."""
    restored = loader(1, 0)
    restored.load_state_dict({"epoch": 3, "global_batches_done": 12})
    assert restored.sampler.epoch == 4 and len(list(restored)) == 12


@pytest.mark.parametrize(("n", "batch", "world"), [(10, 4, 1), (10, 4, 2), (10, 4, 3), (9, 3, 2), (2, 4, 2)])
def test_block_sampler_deals_the_1_device_batches_whole(n, batch, world):
    """Each rank gets whole batches of the 1-device order (batches r, r + N, ...): together every sample once,
    and every batch is a batch of 1 device, so batch-dependent rounding cannot differ."""
    one = [list(range(i, min(i + batch, n))) for i in range(0, n, batch)]
    dealt = []
    for rank in range(world):
        indices = list(BlockSampler(list(range(n)), batch, world, rank))
        dealt += [indices[i : i + batch] for i in range(0, len(indices), batch)]
    assert sorted(dealt) == one


@pytest.mark.parametrize(("device", "pinned"), [("cpu", False), ("cuda:1", True)])
def test_loaders_pin_memory_only_when_the_run_is_on_a_gpu(device, pinned):
    """pin_memory follows the trainer's device, not torch.cuda.is_available(): CPU ranks on a GPU host pin
    nothing (pinning opens a CUDA context on GPU 0 in every CPU rank)."""
    data = ToyData()
    data.trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device(device)))
    assert data.loader_kwargs()["pin_memory"] is pinned
