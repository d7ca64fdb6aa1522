"""`Mean`: a (weighted) mean to log a loss with, torchmetrics' `MeanMetric` without its NaN check.

`MeanMetric` checks every update for NaN, a device-to-host sync that also drops or replaces a NaN loss, unless
`nan_strategy="disable"`, which in torchmetrics 1.9.0 also drops `weight=` (torchmetrics issue #3434, open):
`update(1.0, weight=3); update(2.0, weight=1)` gives 1.5, not 1.25, and a per-batch mean weighted by the batch's
size then differs between 1 and 2 devices. `Mean` sums value x weight and the weights, checks nothing (a NaN loss
shows as NaN), and sums both over the ranks at `compute()`: each sample counts once on any number of devices.

`UnevenListSync`, which the CLI adds to every run: a metric that keeps an entry per sample or per update
(torchmetrics' MeanAveragePrecision, the retrieval metrics) syncs when the ranks hold different numbers of samples.
"""

from typing import Any

import torch
from lightning.pytorch import Callback
from torch import Tensor
from torchmetrics import Metric

from ..lightning_internals import gather_uneven_lists


class Mean(Metric):
    """The mean of every value given since the last reset, each counted `weight` times; synced over ranks."""

    full_state_update = False  # update() needs only its own input, not the state computed so far

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        # In the default dtype at creation, as MeanMetric: float64 under 64-true precision.
        zero = torch.tensor(0.0, dtype=torch.get_default_dtype())
        self.add_state("total", default=zero.clone(), dist_reduce_fx="sum")
        self.add_state("weight", default=zero.clone(), dist_reduce_fx="sum")

    def update(self, value: float | Tensor, weight: float | Tensor = 1.0) -> None:
        """Add `value` (a number or a tensor of them, e.g. per-sample losses), each element `weight` times."""
        value = torch.as_tensor(value, dtype=self.dtype, device=self.device)
        weight = torch.broadcast_to(torch.as_tensor(weight, dtype=self.dtype, device=self.device), value.shape)
        self.total += (value * weight).sum()
        self.weight += weight.sum()

    def compute(self) -> Tensor:
        return self.total / self.weight


class UnevenListSync(Callback):
    """Lets every torchmetrics metric of the module that keeps an entry per sample or per update (MeanAveragePrecision's
    boxes of each image, the retrieval metrics' batches, SSIM's per-image scores) sync when the ranks hold different
    numbers of them, as they do whenever an evaluation set does not divide by the device count: ddpkit deals its
    samples without repeats. torchmetrics gathers such a list an entry at a time and, with a rank short of one, fails
    under gloo or hangs under NCCL (torchmetrics issue #3199); here the list is gathered whole, in the 1-device order
    (lightning_internals.gather_uneven_lists). The metrics are looked up when each loop starts, after the module's
    `setup` and `configure_model` have made them."""

    def _prepare(self, pl_module: Any) -> None:
        for module in pl_module.modules():
            if isinstance(module, Metric):
                gather_uneven_lists(module)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._prepare(pl_module)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._prepare(pl_module)

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        self._prepare(pl_module)
