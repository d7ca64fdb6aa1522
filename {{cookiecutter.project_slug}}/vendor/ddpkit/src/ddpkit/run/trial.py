"""The ranks' side of a trial of `python -m ddpkit.tune` (ddpkit/tune/search.py, the worker): the metric goes to the
worker after each validation, and its answer (go on, or stop: pruned) reaches every rank at the same step.

Optuna's own Lightning callback decides in each rank (pruning raises there, and the other ranks wait in their
next collective until a deadlock report); here only rank 0 talks to the study, through its worker, and the
decision is broadcast through the strategy, so every rank stops after the same step and the fit ends as a
finished one does: checkpoints saved, exit 0.
"""

import json
import os
import sys
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

from .processes import exit_now, stop_children


class TrialReport(Callback):
    """Added by the CLI to `fit` when its environment says it is a trial (the TRIAL_* variables of ddpkit.tune.run).

    After each validation rank 0 sends {step, samples, value} (the metric at `trainer.global_step`, an optimizer
    step, and the samples trained on, steps x the data module's global batch: both the same on any device count)
    to the worker and reads its answer; a metric missing from what validation logged is
    sent as such (at the end of the sanity check when it runs, so within seconds). The answer is broadcast from
    rank 0 to every rank; a stop sets `trainer.should_stop` on all of them at once.

    Args:
        metric: The logged metric the study optimizes.
        channel: "W,R": rank 0's file descriptors of the pipes to and from the worker (inherited from it).
    """

    def __init__(self, metric: str, channel: str) -> None:
        self.metric, self.channel = metric, channel
        self._pipes: tuple[Any, Any] | None = None

    def on_sanity_check_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        logged = trainer.callback_metrics
        if logged and self.metric not in logged:  # nothing logged: validation logs through other hooks; wait
            self._exchange(trainer, {"missing": sorted(logged)})

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        value = trainer.callback_metrics.get(self.metric)
        if value is None:
            self._exchange(trainer, {"missing": sorted(trainer.callback_metrics)})
            return
        # Samples trained on: the pruner compares trials of different global batches at the same data seen.
        batch = getattr(trainer.datamodule, "global_batch_size", None)
        samples = trainer.global_step * batch if isinstance(batch, int) else None
        self._exchange(trainer, {"step": trainer.global_step, "samples": samples, "value": float(value)})

    def _exchange(self, trainer: L.Trainer, message: dict) -> None:
        answer = self._ask(message) if trainer.is_global_zero else None
        answer = trainer.strategy.broadcast(answer, src=0)  # every rank the same answer, or none stops
        if answer:
            sys.stderr.write(f"rank {trainer.global_rank}: {answer}: stopping after step {trainer.global_step}\n")
            trainer.should_stop = True

    def _ask(self, message: dict) -> str | None:
        """Rank 0: send `message` to the worker, return its answer (None: go on)."""
        if self._pipes is None:
            to_worker, from_worker = (int(fd) for fd in self.channel.split(","))
            self._pipes = (os.fdopen(to_worker, "w"), os.fdopen(from_worker))
        out, inbox = self._pipes
        try:
            out.write(json.dumps(message) + "\n")
            out.flush()
            line = inbox.readline()
        except BrokenPipeError:
            line = ""
        if not line:  # the worker is gone (killed): its trial is over, leave no rank behind
            sys.stderr.write("rank 0: the tuning worker is gone; stopping the trial's ranks\n")
            stop_children()
            exit_now(1)
        return json.loads(line)["stop"]
