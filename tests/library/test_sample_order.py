"""The user's own order of samples (`GlobalBatchDataModule.train_order`), cut into the same global batches on any
device count, resumed mid-epoch; length buckets; and what a loader with a sampler of the user's gives up."""

import pytest
import torch
from own_orders import OwnSampler, Weighted
from procs import toy_ok
from torch.utils.data import TensorDataset

from ddpkit.data.draws import batch_draws
from ddpkit.data.order import bucketed_order, weighted_order
from ddpkit.data.sampling import GlobalBatchSampler, ResumableLoader, replaced_sampler
from ddpkit.testing.runs import comparable, plan

DATA = TensorDataset(torch.arange(50))
WEIGHTS = torch.tensor([10.0 if i < 5 else 1.0 for i in range(50)])


def order(seed: int, epoch: int) -> torch.Tensor:
    return weighted_order(WEIGHTS, 48, seed, epoch)


def epoch_batches(world: int, epoch: int = 1, resume: int | None = None) -> list[list[int]]:
    """The global batches the ranks' samplers hand out in `epoch` (from global batch `resume`), put together."""
    per_rank = []
    for rank in range(world):
        sampler = GlobalBatchSampler(DATA, 8, num_replicas=world, rank=rank, seed=3, order=order)
        sampler.resume(epoch, resume) if resume is not None else sampler.set_epoch(epoch)
        per_rank.append(list(sampler))
    share = 8 // world
    steps = len(per_rank[0]) // share
    return [sum((r[k * share : (k + 1) * share] for r in per_rank), []) for k in range(steps)]


def test_an_order_is_cut_into_the_same_global_batches_on_any_device_count_and_resumes():
    """Cost: < 1 s. A weighted order (48 draws with replacement, 5 samples 10 x as likely) is epoch 1's global
    batches as given, on 1, 2 and 4 ranks; resumed after 2 of its 6 global batches, the other 4. Mutations: the
    order ignored (a permutation), dealt round-robin, the resume skipping from the start of the order."""
    whole = epoch_batches(1)
    assert sum(whole, []) == order(3, 1).tolist() and len(whole) == 6
    assert sum(i < 5 for i in sum(whole, [])) > 48 * 5 / 50 * 3  # drawn as weighted: ~24 of 48, not ~5
    for world in (2, 4):
        assert epoch_batches(world) == whole
        assert epoch_batches(world, resume=2) == whole[2:]
    assert epoch_batches(1, epoch=2) != whole


def test_an_order_of_another_length_or_outside_the_dataset_is_refused():
    """Cost: < 1 s. An epoch whose order has another length than epoch 0's (Lightning counts an epoch's steps
    once) and an index past the dataset fail with what is wrong. Mutation: no check (a short epoch, an IndexError
    in a worker)."""
    sampler = GlobalBatchSampler(DATA, 8, 1, 0, order=lambda seed, epoch: list(range(48 - 8 * epoch)))
    sampler.set_epoch(1)
    with pytest.raises(ValueError, match="the order of epoch 1 has 40 indices, epoch 0's 48"):
        list(sampler)
    with pytest.raises(ValueError, match="outside the dataset's 0..49"):
        GlobalBatchSampler(DATA, 8, 1, 0, order=lambda seed, epoch: [50] * 8)


def test_length_buckets_pad_less_than_random_batches_and_keep_every_sample():
    """Cost: < 1 s. 4,000 lengths 1..512 (uniform), global batch 32 cut over 4 ranks: bucketed batches hold every
    index once an epoch, in a new order each epoch, and pad each rank's share to its longest with under 5 % of the
    tokens padding, where random batches pad ~44 % (measured 2026-12-05, seeds 0-2: 0.5 % vs 43.5-43.9 %). Mutation: no sort within
    the window (random batches' padding)."""
    lengths = torch.randint(1, 513, (4000,), generator=torch.Generator().manual_seed(0))

    def padding(order: torch.Tensor) -> float:
        shares = order[: len(order) // 8 * 8].view(-1, 8)  # each rank's share of a global batch of 32 on 4
        longest = lengths[shares].max(dim=1).values
        return 1 - lengths[shares].sum().item() / (longest.sum().item() * 8)

    epoch0, epoch1 = bucketed_order(lengths, 32, 0, 0), bucketed_order(lengths, 32, 0, 1)
    assert sorted(epoch0.tolist()) == list(range(4000)) and not torch.equal(epoch0, epoch1)
    assert padding(epoch0) < 0.05 and padding(torch.randperm(4000)) > 0.35


def test_a_loader_with_a_sampler_of_the_users_is_named_with_what_it_gives_up():
    """Cost: < 1 s. The sentence names the data module, the loader and sampler, the resume and the global batch;
    the data module's own loader gives none. Mutation: a check on the sampler only (a GlobalBatchSampler in a plain
    DataLoader passes)."""
    data = OwnSampler(global_batch_size=32)
    data.setup("fit")
    line = replaced_sampler(data, data.train_dataloader())
    assert line.startswith("OwnSampler.train_dataloader() returns a DataLoader over a RandomSampler, not the data ")
    assert "exact mid-epoch resume" in line and "and the global batch" in line and "\n" not in line
    assert replaced_sampler(data, super(OwnSampler, data).train_dataloader()) == ""
    mine = torch.utils.data.DataLoader(DATA, sampler=GlobalBatchSampler(DATA, 8, 1, 0))
    assert "exact mid-epoch resume" in replaced_sampler(data, mine) and "global batch" not in replaced_sampler(
        data, mine
    )
    weighted = Weighted(global_batch_size=32)
    weighted.setup("fit")
    assert isinstance(weighted.train_dataloader(), ResumableLoader)  # an order of one's own keeps the loader


def test_a_sampler_of_the_users_is_named_before_a_draw_per_batch():
    """Cost: < 1 s. A RandomSampler of the user's draws its order at each pass, so its loader's first batch also
    changes with the global seed (draws.batch_draws): the sampler's sentence is the one the suite fails with.
    Mutation: runs.comparable looking at batch_draws first."""
    data = OwnSampler(global_batch_size=32)
    data.setup("fit")
    assert batch_draws(data.train_dataloader()).startswith("the train loader's batches change")
    steps = plan({"steps_per_epoch": 4, "global_batch_size": 32, "takes_micro_batch_size": True,
                  "replaced_sampler": "SAMPLER", "batch_draws": "BATCH"})  # fmt: skip
    with pytest.raises(pytest.fail.Exception, match="^SAMPLER$"):
        comparable(steps)


def test_the_resume_test_fails_with_the_sentence_not_a_key_error():
    """Cost: < 1 s. The suite's loader-position test, given a configuration whose loader is the user's, fails with
    that sentence before it opens a checkpoint (it raised KeyError: 'combined_loader'). Mutation: the check after
    the read."""
    from ddpkit.testing import plugin  # noqa: F401  first: it registers the suite's modules for assert rewriting
    from ddpkit.testing.check_parity import test_mid_epoch_checkpoint_records_loader_position as position_test

    steps = {"steps_per_epoch": 8, "two_to_one": 6, "steps_per_batch": 1, "replaced_sampler": "SENTENCE"}
    with pytest.raises(pytest.fail.Exception, match="^SENTENCE$"):
        position_test(None, steps)


def test_fit_with_a_sampler_of_the_users_warns_once_at_the_start(tmp_path):
    """Cost: one 1-device fit of 2 steps through the CLI, ~15 s. The warning is printed once, before training.
    Mutation: no warning, or one per epoch."""
    cpu = ("--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.max_steps", "2")
    out = toy_ok("fit", "--data", "own_orders.OwnSampler", *cpu, "--trainer.default_root_dir", str(tmp_path),
                 cwd=tmp_path)  # fmt: skip
    lines = [line for line in out.splitlines() if "train_dataloader() returns a DataLoader over a" in line]
    assert len(lines) == 1 and "OwnSampler" in lines[0]


def test_a_streaming_data_modules_own_loader_gives_up_nothing(tmp_path):
    """Cost: < 2 s. A StreamingDataModule's StreamLoader (it counts its own position) is the library's loader, not a
    replaced one: no sentence, so the suite runs its checks on streamed data. Mutation: only ResumableLoader
    accepted (the families' streaming suite failed every comparison with the sentence)."""
    from families import StreamingToyData, write_toy_shards

    write_toy_shards(tmp_path)
    data = StreamingToyData(shard_dir=str(tmp_path), global_batch_size=32)
    data.setup("fit")
    loader = data.train_dataloader()
    assert not isinstance(loader, ResumableLoader) and replaced_sampler(data, loader) == ""
