"""`ddpkit.Mean`, the examples' loss metric: a weighted mean that keeps `weight=` and shows a NaN loss as NaN; and
metrics that keep an entry per sample or per batch, synced over ranks that hold different numbers of them."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from procs import finish, start
from torchmetrics import MeanMetric
from torchmetrics.retrieval import RetrievalMAP

from ddpkit import Mean
from ddpkit.testing.fake_cluster import free_port


def test_weights_count_and_nan_shows():
    """1.0 three times and 2.0 once average 1.25 (MeanMetric(nan_strategy="disable") says 1.5 in torchmetrics
    1.9.0, issue #3434); per-sample losses with a batch weight; a NaN loss makes the mean NaN, not dropped."""
    mean = Mean()
    mean.update(1.0, weight=3)
    mean.update(2.0, weight=1)
    assert mean.compute().item() == 1.25
    disabled = MeanMetric(nan_strategy="disable")
    disabled.update(1.0, weight=3)
    disabled.update(2.0, weight=1)
    print(f"MeanMetric(nan_strategy='disable'): {disabled.compute().item()}")  # 1.5 while #3434 is open
    mean.reset()
    mean.update(torch.tensor([1.0, 3.0]), weight=torch.tensor([1.0, 3.0]))  # (1 + 9) / 4
    assert mean.compute().item() == 2.5
    mean.update(float("nan"))
    assert math.isnan(mean.compute().item())


def test_states_take_the_default_dtype_at_creation():
    """Under 64-true precision Lightning creates the module with float64 as the default dtype: so are the sums."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        mean = Mean()
    finally:
        torch.set_default_dtype(previous)
    mean.update(torch.tensor([1.0, 2.0], dtype=torch.float64))
    assert mean.total.dtype == mean.compute().dtype == torch.float64


def sync_on_two_ranks(tmp_path, patch: bool) -> list[subprocess.CompletedProcess]:
    cmd = [sys.executable, str(Path(__file__).with_name("list_sync.py"))]
    port = str(free_port())
    procs = [start([*cmd, str(rank), port, str(int(patch))], tmp_path) for rank in range(2)]
    return [finish(proc, timeout=120) for proc in procs]


def test_list_states_sync_when_ranks_hold_different_numbers_of_entries(tmp_path):
    """A metric keeping an entry per sample and the retrieval metric (one per batch), 5 samples and 5 batches dealt
    round-robin to 2 gloo ranks: each rank computes what 1 process computes over all of them, the samples in their
    1-device order; 4 samples (even shares) too. torchmetrics alone fails there (a collective per entry, one rank
    short): the same script without gather_uneven_lists exits non-zero on a rank."""
    from list_sync import Samples, queries

    retrieval = RetrievalMAP()
    for indexes, scores, relevant in queries(5):
        retrieval.update(scores, relevant, indexes=indexes)
    alone = {"odd": [0.0, 1.0, 2.0, 3.0, 4.0], "even": [0.0, 1.0, 2.0, 3.0], "map": retrieval.compute().item()}
    ranks = sync_on_two_ranks(tmp_path, patch=True)
    for rank in ranks:
        assert rank.returncode == 0, rank.stdout[-3000:]
        got = json.loads(rank.stdout.strip().splitlines()[-1])
        assert got["odd"] == alone["odd"] and got["even"] == alone["even"], got
        assert got["map"] == pytest.approx(alone["map"], rel=1e-6), (got, alone)
    assert Samples().__dict__.get("_sync_dist") is None  # only the metrics given to it change
    unpatched = sync_on_two_ranks(tmp_path, patch=False)
    assert any(rank.returncode != 0 for rank in unpatched), [rank.stdout[-500:] for rank in unpatched]


def test_the_callback_reaches_every_metric_that_keeps_entries():
    """UnevenListSync patches the module's metrics with a list state without a reduction (in a MetricCollection too),
    and leaves the others (Mean's sums) as torchmetrics made them."""
    from lightning.pytorch import LightningModule
    from list_sync import Samples
    from torchmetrics import MetricCollection

    from ddpkit.model.metrics import UnevenListSync

    module = LightningModule()
    module.loss, module.kept = Mean(), Samples()
    module.metrics = MetricCollection({"map": RetrievalMAP()})
    UnevenListSync().on_validation_start(None, module)
    assert "_sync_dist" not in module.loss.__dict__
    assert "_sync_dist" in module.kept.__dict__ and "_sync_dist" in module.metrics["map"].__dict__
