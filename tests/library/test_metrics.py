"""`ddpkit.Mean`, the examples' loss metric: a weighted mean that keeps `weight=` and shows a NaN loss as NaN."""

import math

import torch
from torchmetrics import MeanMetric

from ddpkit import Mean


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
