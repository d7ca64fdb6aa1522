"""Callbacks and a model for the tune tests: each rank prints the values it trains with, read from the model and the
optimizer themselves (not from a config or the worker's log), so a rank that had drawn its own values would show
them; rank 0 prints when its training starts and ends (trials that run at once overlap); the toy with its optimizer
as an argument (a class and its own arguments, as a project's module has it)."""

import time

import lightning as L
import torch
from lightning.pytorch.cli import OptimizerCallable

from ddpkit.testing.toy import ToyClassifier


class ValueProbe(L.Callback):
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        optimizer = trainer.optimizers[0]
        lr, momentum = optimizer.param_groups[0]["lr"], optimizer.param_groups[0].get("momentum")
        width = pl_module.net[0].out_features  # the toy's first layer: hidden_dim wide
        print(
            f"VALUE_PROBE global={trainer.global_rank} lr={lr!r} hidden_dim={width} "
            f"optimizer={type(optimizer).__name__} momentum={momentum}",
            flush=True,
        )


class TimeProbe(L.Callback):
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            print(f"TIME_PROBE start={time.time()!r}", flush=True)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            print(f"TIME_PROBE end={time.time()!r}", flush=True)


class OptimizerToy(ToyClassifier):
    """The toy, its optimizer given as a class and arguments.

    Args:
        optimizer: The optimizer class, called with the parameters.
        hidden_dim: Width of the hidden layers.
    """

    def __init__(self, optimizer: OptimizerCallable = torch.optim.AdamW, hidden_dim: int = 128) -> None:
        super().__init__(hidden_dim=hidden_dim)
        self.optimizer = optimizer

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer(self.parameters())
