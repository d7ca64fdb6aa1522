"""Callbacks and a model for the tune tests: each rank prints the values it trains with, read from the model and the
optimizer themselves (not from a config or the worker's log), so a rank that had drawn its own values would show
them; rank 0 prints when its training starts and ends (trials that run at once overlap); the toy with its optimizer
as an argument (a class and its own arguments, as a project's module has it)."""

import sys
import time

import lightning as L
import torch
from lightning.pytorch.cli import OptimizerCallable

from ddpkit.testing.toy import ToyClassifier


def say(line: str) -> None:
    """Print `line` in one write, its newline in it: print's text and end are two writes when output is unbuffered
    (PYTHONUNBUFFERED), and another rank's line, in the same file, once landed between them (CI of 2026-12-06:
    "momentum=NoneRANK_PROBE ...")."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class ValueProbe(L.Callback):
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        optimizer = trainer.optimizers[0]
        lr, momentum = optimizer.param_groups[0]["lr"], optimizer.param_groups[0].get("momentum")
        width = pl_module.net[0].out_features  # the toy's first layer: hidden_dim wide
        line = f"VALUE_PROBE global={trainer.global_rank} lr={lr!r} hidden_dim={width} "
        line += f"optimizer={type(optimizer).__name__} momentum={momentum}"
        say(line)


class TimeProbe(L.Callback):
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            say(f"TIME_PROBE start={time.time()!r}")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            say(f"TIME_PROBE end={time.time()!r}")


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
