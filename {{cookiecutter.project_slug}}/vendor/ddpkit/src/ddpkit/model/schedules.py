"""Learning-rate schedules that count optimizer steps, and the glue from a module's callables to Lightning.

A schedule that advances once per optimizer step (not per sample, nor per batch of one rank) is the
same on any number of devices: step k has the same global batch everywhere (the promise of
`GlobalBatchDataModule`), so it gets the same learning rate. `ddpkit.testing`'s parity suite checks it on
1 vs 2 devices.
"""

import math
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.optim.lr_scheduler import LambdaLR


class WarmupCosine(LambdaLR):
    """Linear warmup, then cosine decay, one step per optimizer step (Lightning `interval: step`).

    Step s of `warmup_steps` uses `(s + 1) / warmup_steps` of each parameter group's lr, so the last warmup
    step reaches the full lr; from there the factor falls along a half cosine to `min_lr_ratio` at
    `total_steps` and stays there.

    Args:
        optimizer: Passed by the module (LightningCLI's `LRSchedulerCallable`), not configured.
        warmup_steps: Optimizer steps of linear warmup (0: start at the full lr).
        total_steps: Optimizer step where the decay ends. None: the trainer's estimate for the whole fit
            (`trainer.estimated_stepping_batches`, from max_epochs/max_steps), filled in by `optimization`.
            A resumed run keeps the value in its checkpoint.
        min_lr_ratio: Fraction of the lr left at the end of the decay.
    """

    interval = "step"  # read by `optimization`: Lightning steps it after every optimizer step

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_steps: int = 0,
        total_steps: int | None = None,
        min_lr_ratio: float = 0.1,
    ) -> None:
        if warmup_steps < 0 or not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"need warmup_steps >= 0 and 0 <= min_lr_ratio <= 1, got {warmup_steps}, {min_lr_ratio}")
        self.warmup_steps, self.total_steps, self.min_lr_ratio = warmup_steps, total_steps, min_lr_ratio
        # A lambda, not a bound method: LambdaLR's state_dict skips plain functions, and the state it does
        # save (step count, total_steps) is what a resumed run needs.
        super().__init__(optimizer, lambda step: self.factor(step))

    def factor(self, step: int) -> float:
        """The multiplier of each group's base lr at optimizer step `step` (0-based)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if step == self.warmup_steps:  # the top of the cosine: known before total_steps is
            return 1.0
        if self.total_steps is None:
            raise ValueError("WarmupCosine.total_steps is not set: give it, or build the schedule with optimization()")
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def optimization(
    module: Any, optimizer: torch.optim.Optimizer, scheduler: Callable[[torch.optim.Optimizer], Any] | None
) -> torch.optim.Optimizer | dict:
    """What `module.configure_optimizers` returns for an optimizer and an optional scheduler callable.

    The schedule steps per optimizer step if its class says so (`interval = "step"`, as `WarmupCosine`),
    else per epoch (Lightning's default). A schedule with `total_steps = None` gets the trainer's
    estimate of the fit's optimizer steps, which counts global batches, so it is the same on any
    device count.
    """
    if scheduler is None:
        return optimizer
    schedule = scheduler(optimizer)
    if getattr(schedule, "total_steps", 0) is None:
        total = module.trainer.estimated_stepping_batches  # counts global batches: any device count
        if not math.isfinite(total):
            raise ValueError(
                f"{type(schedule).__name__} needs total_steps: set it, or bound the fit with "
                "--trainer.max_epochs or --trainer.max_steps."
            )
        schedule.total_steps = int(total)
    warmup, total = getattr(schedule, "warmup_steps", None), getattr(schedule, "total_steps", None)
    if warmup is not None and total is not None and warmup >= total:  # e.g. configs/debug.yaml's 5 batches
        rank_zero_warn(
            f"{type(schedule).__name__}: warmup_steps={warmup} is not below total_steps={total} (the fit's "
            "optimizer steps): the learning rate never reaches its full value."
        )
    interval = getattr(schedule, "interval", "epoch")
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": interval}}
