"""The data: what must hold before any two runs can be compared (every rank holds the same data, and DDP can train
the module), and what the runs read of it (each rank half of every epoch, global batches as 1 device's, each
evaluation sample counted once, predictions in dataset order).

Each fails one test with one line that names the cause, and the tests that compare runs skip with a pointer to it
instead of failing on a number:
- a parameter that gets no gradient in training stops DDP at its first step unless the strategy looks for unused
  parameters: found in one step on 1 device before any run (configured.py), so no run starts (plugin.py's `steps`);
- a dataset built differently in each process (a vocabulary numbered in a set's order, an unseeded shuffle): each
  rank of the first 2-device run fingerprints its train and val sets before training (fingerprints.py), and the run
  stops there when they differ; the later waves do not start (runs.Waves' gate).
The samples a run read are recognised by the dataset's own sample at each index its sampler handed out
(fingerprints.py), before the collate function.
"""

import json
from collections import Counter

import pytest
import torch

from ..run.predictions import sample_count
from .bounds import METRIC_STATE_ROUNDING
from .fingerprints import first_difference, rank_difference
from .runs import GATED_BY, Waves, comparable, reads

UNUSED_TEST = "test_every_parameter_gets_a_gradient_or_ddp_looks_for_unused_ones"
DATA_TEST = "test_every_rank_holds_the_same_datasets"
# The runs whose ranks fingerprint their datasets (commands.run_args' `fingerprints`).
ONE, TWO = "1dev-fp64", "2dev-fp64"


def same_samples(configured: dict) -> None:
    """Fail with the reason, instead of on a sample count, where the runs cannot see the same samples: a dataset that
    draws from a generator of its own (data/draws.own_draws), a train_dataloader() with a sampler of the user's
    (data/sampling.replaced_sampler). runs.comparable fails with them too, before a training step's draws."""
    for cause in ("dataset_draws", "replaced_sampler"):
        if configured.get(cause):
            pytest.fail(configured[cause], pytrace=False)


def unused_skip(configured: dict) -> str:
    """Why the runs are not started ("" if they can be): a parameter gets no gradient and DDP does not look for it."""
    if not configured.get("unused_parameters"):
        return ""
    return f"not run: DDP would stop at the first step on a parameter without a gradient ({UNUSED_TEST} says which)"


def run_fingerprints(runs: Waves, name: str, ranks: int) -> list[dict] | None:
    """The fingerprints each rank of run `name` wrote (parity_probe.Probe.compare_data), once its wave has run; None
    where a rank wrote none (the run failed before it got there)."""
    probe = runs.folder(name) / "probe"
    files = [probe / f"data-rank{r}.json" for r in range(ranks)]
    return [json.loads(f.read_text()) for f in files] if all(f.exists() for f in files) else None


def data_difference(runs: Waves) -> str:
    """The first place where a rank's datasets depart from rank 0's in the 2-device run, or the 2-device run's from
    the 1-device run's, as one line; "" where they agree or were not fingerprinted (a run failed before)."""
    two, one = run_fingerprints(runs, TWO, 2), run_fingerprints(runs, ONE, 1)
    if two is None:
        return ""
    differs = rank_difference(two)
    if differs or one is None:
        return differs
    for name, first in one[0].items():
        where = first_difference(first, two[0].get(name, {"length": 0}))
        if where:
            return (
                f"the 2-device run's {name} dataset differs from the 1-device run's {where}: built differently per "
                "run (from the device count, the time, a seed of its own?)"
            )
    return ""


def data_gate(runs: Waves) -> str:
    """runs.Waves' gate: the reason every comparison skips where the first wave's ranks or runs hold different data."""
    if not data_difference(runs):
        return ""
    return f"not compared: the runs' ranks hold different datasets ({DATA_TEST} says which and where)"


def test_every_parameter_gets_a_gradient_or_ddp_looks_for_unused_ones(global_batch):
    """Every parameter that requires a gradient gets one in each backward of a training step, or the configured DDP
    strategy looks for unused parameters: otherwise DDP stops at the first step. Found in one step on 1 device
    (configured.py); the line names the parameters and the setting, and the tests that need runs skip."""
    if global_batch.get("unused_parameters"):
        pytest.fail(global_batch["unused_parameters"], pytrace=False)


@reads(*GATED_BY)
def test_every_rank_holds_the_same_datasets(cpu_runs):
    """Before training, each rank of the 2-device float64 run fingerprints the data module's train and val sets (the
    length and a hash of each sample as the dataset returns it; of evenly spaced ones in a large set), as the
    1-device run does: every rank holds rank 0's datasets, and rank 0 the 1-device run's."""
    differs = data_difference(cpu_runs)
    if differs:
        pytest.fail(differs, pytrace=False)
    missing = [name for name, ranks in ((ONE, 1), (TWO, 2)) if run_fingerprints(cpu_runs, name, ranks) is None]
    assert not missing, "\n".join(cpu_runs.failed.get(name, f"run {name} wrote no fingerprints") for name in missing)


@reads("predict-1dev", "predict-2dev")
def test_predictions_are_one_file_in_dataset_order_the_same_on_1_and_2_devices(cpu_runs, global_batch):
    """`predict` writes predictions.pt into the run's directory: one prediction per sample of the predict set,
    and the file's bytes on 2 processes (each sample predicted on one rank, gathered) are 1 device's."""
    size = global_batch["predict_size"]
    if not size:
        pytest.skip("the configured data module has no predict set")
    if "predict" not in global_batch["stages"]:
        pytest.skip(f"{global_batch['model']} defines no predict_step")
    one, two = (cpu_runs[f"predict-{n}dev"].root / "predictions.pt" for n in (1, 2))
    assert sample_count(torch.load(one, weights_only=True)) == size  # ragged outputs are lists, one entry a sample
    assert one.read_bytes() == two.read_bytes()


def eval_records(cpu_runs: Waves, stage: str) -> tuple[dict, list[dict]]:
    """A stage's metrics on 1 device and on each of 2 ranks: the last validation of the fits, or the test runs."""
    if stage == "val":
        one, two = cpu_runs["1dev-fp64"], cpu_runs["2dev-fp64"]
        return one.probe()["val"][-1], [two.probe(rank=r)["val"][-1] for r in (0, 1)]
    one, two = cpu_runs["test-1dev"], cpu_runs["test-2dev"]
    return one.probe("test")["test"], [two.probe("test", rank=r)["test"] for r in (0, 1)]


@pytest.mark.parametrize("stage", ["val", "test"])
@reads(stage={"val": ("1dev-fp64", "2dev-fp64"), "test": ("test-1dev", "test-2dev")})
def test_eval_metrics_count_each_sample_once(cpu_runs, global_batch, stage):
    """N samples split ceil(N/2) + floor(N/2) over 2 ranks, no padding: both ranks report 1 device's metrics."""
    size = global_batch[f"{stage}_size"]
    if not size:
        pytest.skip(f"the configured data module has no {stage} set")
    command, step = {"val": ("validate", "validation_step"), "test": ("test", "test_step")}[stage]
    if command not in global_batch["stages"]:
        pytest.skip(f"{global_batch['model']} defines no {step}")
    if stage == "val":  # validated during the fits
        comparable(global_batch)
    one, ranks = eval_records(cpu_runs, stage)
    assert one["samples"] == size and [r["samples"] for r in ranks] == [(size + 1) // 2, size // 2]
    assert ranks[0] | {"samples": 0} == ranks[1] | {"samples": 0}  # synced: equal on every rank
    metrics = one.keys() - {"samples", "epoch"}
    assert metrics and metrics == ranks[0].keys() - {"samples", "epoch"}
    for key in metrics:  # a duplicated or dropped sample would change them
        assert abs(ranks[0][key] - one[key]) <= METRIC_STATE_ROUNDING * max(abs(one[key]), 1.0), key


@reads("1dev-fp64", "2dev-fp64")
def test_each_rank_gets_half_of_every_epoch_and_nothing_twice(cpu_runs, global_batch):
    """Per epoch, rank 0 and rank 1 each receive half of steps x global batch samples, together exactly the
    samples 1 device trains on in that epoch (samples are compared by content, so any batch type works)."""
    same_samples(global_batch)  # the dataset's own draws, a sampler of the user's: their sentence first
    one, two = cpu_runs["1dev-fp64"], cpu_runs["2dev-fp64"]
    per_epoch = global_batch["steps_per_epoch"] * global_batch["global_batch_size"]
    for epoch in ("0", "1"):
        shards = [sum(two.probe(rank=r)["batches"][epoch], []) for r in (0, 1)]
        assert len(shards[0]) == len(shards[1]) == per_epoch // 2
        assert Counter(shards[0]) + Counter(shards[1]) == Counter(sum(one.probe()["batches"][epoch], []))


@reads("1dev-fp64", "2dev-fp64")
def test_global_batches_equal_1_device_and_reshuffle_each_epoch(cpu_runs, global_batch):
    """Step k's samples on 2 ranks, put together, are step k's samples on 1 device; epoch 2 has a new order."""
    same_samples(global_batch)
    one = cpu_runs["1dev-fp64"].probe()["batches"]
    two = [cpu_runs["2dev-fp64"].probe(rank=r)["batches"] for r in (0, 1)]
    for epoch in ("0", "1"):
        assert all(one[epoch]), f"epoch {epoch}: a global batch of no samples the probe could name"
        joined = [Counter(a + b) for a, b in zip(two[0][epoch], two[1][epoch], strict=True)]
        assert joined == [Counter(batch) for batch in one[epoch]]
        assert len(joined) == global_batch["steps_per_epoch"]
    assert two[0]["0"] != two[0]["1"] and two[1]["0"] != two[1]["1"]  # set_epoch reached the sampler
    same = [k for k, (a, b) in enumerate(zip(one["0"], one["1"], strict=True)) if Counter(a) == Counter(b)]
    assert len(same) < len(one["0"]), (
        "every global batch k holds the same samples in epoch 0 and 1 on 1 device: the training data is not "
        "reshuffled between epochs, only within batches (a StreamingDataModule whose streams each read one whole "
        "shard, or one part of one: give each stream at least 2 shards; a sampler that ignores set_epoch)"
    )
