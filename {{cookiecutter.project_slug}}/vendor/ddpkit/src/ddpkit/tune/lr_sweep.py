"""The learning-rate range test inside a fit: the callback that `python -m ddpkit.lr_finder` adds to the fit it runs.

Step k of the sweep trains with lr_k = min_lr x (max_lr / min_lr) ^ (k / (steps - 1)) and records the loss of that
step's global batch: the mean over every micro-batch of every rank (all-reduced), which is the loss 1 device
computes on the same samples. `GlobalBatchDataModule` gives step k the same global batch on any device count and
DDP averages the gradient over it, so 1 or N devices sweep the same curve (up to float rounding). The sweep stops
early when the loss diverges. The fit it runs in is not a training: it ends with the sweep and the callback removes
the checkpoint callbacks, so the swept weights are never saved.
"""

import json
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, Checkpoint

from ..model.losses import step_mean
from .lr_curve import diverged, sweep_lr


class SweepError(Exception):
    """The module cannot be swept (no single optimizer with an lr, no loss returned): the finder's `error:` line."""


class LRSweep(Callback):
    """Sets every parameter group's lr before each optimizer step, on an exponential schedule, and records the
    global loss of each step; rank 0 writes the curve to `out` (JSON) when the fit ends.

    Args:
        min_lr: The lr of the first step.
        max_lr: The lr of the last step.
        steps: Optimizer steps of the sweep; the fit stops after them.
        stop_factor: Stop early once the smoothed loss exceeds this many times its lowest value so far (or is not
            finite): beyond that point the curve says nothing more.
        out: The JSON file rank 0 writes.
        progress_every: Steps between the progress lines rank 0 prints.
    """

    def __init__(
        self,
        min_lr: float = 1e-6,
        max_lr: float = 1.0,
        steps: int = 100,
        stop_factor: float = 4.0,
        out: str = "lr_find.json",
        progress_every: int = 10,
    ) -> None:
        if not 0 < min_lr < max_lr or steps < 2 or stop_factor <= 1:
            raise ValueError(f"need 0 < min_lr < max_lr, steps >= 2, stop_factor > 1: {min_lr}, {max_lr}, {steps}")
        self.min_lr, self.max_lr, self.steps, self.stop_factor = min_lr, max_lr, steps, stop_factor
        self.out, self.progress_every = Path(out), progress_every
        self.lrs: list[float] = []
        self.losses: list[float] = []
        self.stopped = ""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Checkpoints of swept weights would be what `--ckpt_path last` resumes from a folder above: none are written.
        trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, Checkpoint)]

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        try:
            if len(trainer.optimizers) != 1:
                raise SweepError(
                    f"{type(pl_module).__name__}.configure_optimizers gives {len(trainer.optimizers)} optimizers: the "
                    "finder sweeps the lr of exactly one"
                )
            optimizer = trainer.optimizers[0]
            base = optimizer.defaults.get("lr")
            if not isinstance(base, (int, float)) or isinstance(base, bool) or base <= 0:
                raise SweepError(f"{type(optimizer).__name__} has no positive lr among its defaults ({base!r})")
        except SweepError as error:
            self.write(trainer, {"error": str(error)})
            raise
        # A group's own lr keeps its ratio to the optimizer's lr argument, the one the suggestion is for; a schedule
        # built in configure_optimizers has already scaled `lr`, `initial_lr` is what the group was given.
        self.ratios = [group.get("initial_lr", group["lr"]) / base for group in optimizer.param_groups]
        self.optimizer_lr, self.optimizer_class = (
            float(base),
            f"{type(optimizer).__module__}.{type(optimizer).__name__}",
        )
        self.start = trainer.global_step
        self.pending = torch.zeros((), dtype=torch.float64, device=pl_module.device)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        # The last moment before the step: whatever a schedule set since the previous step is overwritten.
        lr = sweep_lr(self.min_lr, self.max_lr, self.steps, trainer.global_step - self.start)
        for group, ratio in zip(optimizer.param_groups, self.ratios, strict=True):
            group["lr"] = lr * ratio

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not isinstance(loss, torch.Tensor):
            error = SweepError(f"{type(pl_module).__name__}.training_step returns no loss: the finder records it")
            self.write(trainer, {"error": str(error)})
            raise error
        # Lightning divides each micro-batch's loss by the micro-batches per step: their sum is this rank's mean.
        self.pending += loss.detach().double()
        k = len(self.losses)
        if trainer.global_step - self.start == k:  # no optimizer step yet: more micro-batches to come
            return
        # A loss of ddpkit.global_mean is already the step's global mean (its value is, on every rank). Otherwise every
        # rank holds the same number of samples: the mean of the ranks' means is the global batch's loss.
        total = trainer.strategy.reduce(self.pending.clone(), reduce_op="sum")
        self.pending.zero_()
        self.lrs.append(sweep_lr(self.min_lr, self.max_lr, self.steps, k))
        step = step_mean(pl_module, trainer.global_step - 1)
        self.losses.append(total.item() / trainer.world_size if step is None else step)
        # The loss is all-reduced, so every rank decides alike; agreeing makes sure they stop after the same step.
        if trainer.strategy.reduce_boolean_decision(diverged(self.losses, self.stop_factor), all=False):
            self.stopped = f"diverged at step {k} (lr {self.lrs[-1]:.3g})"
        elif k + 1 == self.steps:
            self.stopped = f"done: {self.steps} steps"
        if self.stopped:
            trainer.should_stop = True
        if trainer.is_global_zero and (self.stopped or (k + 1) % self.progress_every == 0):
            print(f"lr_find: step {k + 1}/{self.steps}, lr {self.lrs[-1]:.3g}, loss {self.losses[-1]:.4g}", flush=True)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        data = trainer.datamodule
        self.write(
            trainer,
            {
                "lr": self.lrs,
                "loss": self.losses,
                "stopped": self.stopped or f"the fit ended after {len(self.losses)} steps",
                "min_lr": self.min_lr,
                "max_lr": self.max_lr,
                "steps": self.steps,
                "stop_factor": self.stop_factor,
                "world_size": trainer.world_size,
                "global_batch_size": getattr(data, "global_batch_size", None),
                "accumulation": trainer.accumulate_grad_batches,
                "precision": str(trainer.precision),
                "optimizer": self.optimizer_class,
                "optimizer_lr": self.optimizer_lr,
            },
        )

    def write(self, trainer: Trainer, record: dict) -> None:
        if trainer.is_global_zero:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.out.write_text(json.dumps(record, indent=1) + "\n")
