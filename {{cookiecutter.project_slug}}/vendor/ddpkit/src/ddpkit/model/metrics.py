"""`Mean`: a (weighted) mean to log a loss with, torchmetrics' `MeanMetric` without its NaN check.

`MeanMetric` checks every update for NaN, a device-to-host sync that also drops or replaces a NaN loss, unless
`nan_strategy="disable"`, which in torchmetrics 1.9.0 also drops `weight=` (torchmetrics issue #3434, open):
`update(1.0, weight=3); update(2.0, weight=1)` gives 1.5, not 1.25, and a per-batch mean weighted by the batch's
size then differs between 1 and 2 devices. `Mean` sums value x weight and the weights, checks nothing (a NaN loss
shows as NaN), and sums both over the ranks at `compute()`: each sample counts once on any number of devices.
"""

import torch
from torch import Tensor
from torchmetrics import Metric


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
