"""Graceful stop: SIGTERM or SIGINT (Ctrl-C) makes every rank finish its step, save `last.ckpt` and exit.

A second signal stops at once. See `GracefulStop` for how the ranks agree without waiting on each other.
"""

import signal
import sys
import threading
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from ..lightning_internals import restore_sigterm_broadcast, skip_sigterm_broadcast
from .checkpoints import checkpoint_dir
from .hang import job_hung
from .processes import exit_now, mark_stopping, rank_label, stop_children


class StopRequested(Exception):
    """Raised on every rank, at the same step, after the graceful-stop checkpoint is saved."""

    def __init__(self, signum: int, step: int, path: str) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} at step {step}; saved {path}")
        self.signum, self.step, self.path = signum, step, path


class GracefulStop(Callback):
    """SIGTERM/SIGINT during `fit`: all ranks finish the step, save `last.ckpt`, then raise `StopRequested`.

    The signal handler only records the signal. The ranks then agree whether any
    of them got one, so they all stop after the same step, even when only the
    launcher was signalled (`kill PID`) rather than the whole process group
    (Ctrl-C). The checkpoint is saved where Lightning's ModelCheckpoint saves it
    at that point, so resuming with `--ckpt_path .../last.ckpt` continues with the
    next step's samples. A second signal while stopping (or one outside the
    training loop) exits at once.

    Agreeing does not make any rank wait: every `check_every_n_steps` steps the
    ranks start a one-number all-reduce in the background and read its result
    one step later, when it has long finished, and no GPU is synchronised. A
    signal therefore stops training within `check_every_n_steps` + 1 steps. With
    one process there is nothing to agree on and the flag is read every step.
    This also takes over Lightning 2.6's own per-step check, a blocking broadcast
    of rank 0's SIGTERM flag that only knows rank 0's signals and is a second
    sync point per step.

    Args:
        check_every_n_steps: Training batches between the ranks' exchanges. Each
            costs about 0.8 ms on 2 CPU processes (gloo wakes a thread on every
            rank; ddp-template's docs/measurements.md); lower it when steps are
            long and the scheduler's grace period is short.
    """

    def __init__(self, check_every_n_steps: int = 10) -> None:
        if check_every_n_steps < 1:
            raise ValueError(f"check_every_n_steps must be >= 1, got {check_every_n_steps}")
        self.check_every_n_steps = check_every_n_steps
        self.signum = 0
        self._previous: dict[int, Any] = {}
        self._batches = 0  # training batches ended in this fit: the same count on every rank
        self._step = 0  # global_step at the last batch's end
        self._agreed = 0  # the signal the ranks agreed on, kept until an optimizer step ends
        self._pending: tuple | None = None  # the all-reduce started one batch ago, and its copy's CUDA event
        self._flag: torch.Tensor | None = None  # the number the ranks all-reduce, on this rank's device
        self._host: torch.Tensor | None = None  # its host copy (pinned memory on GPUs)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._step = trainer.global_step
        if trainer.received_sigterm:  # Lightning's handler (active until now) got one during set-up
            self.signum = signal.SIGTERM
        # Replaces Lightning's SIGTERM handler, which forwards the signal and broadcasts inside the handler.
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._request)
        # With Lightning's handler replaced its flag stays False, so the broadcast could only ever send "no".
        skip_sigterm_broadcast(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._pending is not None:
            self._pending[0].wait()  # every rank started it: leave no collective half done
            self._pending = None
        self._restore(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._pending = None  # another rank may be gone: do not wait for it
        self._restore(trainer)

    def _restore(self, trainer: L.Trainer) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
        restore_sigterm_broadcast(trainer)

    def _request(self, signum: int, frame: Any) -> None:
        # Asked twice, or after a hang (torchrun's agent stops the other ranks with SIGTERM, then waits 30 s
        # before SIGKILL): do not wait for a step to end.
        if self.signum or job_hung():
            which = "second" if self.signum else "after the hang report,"
            sys.stderr.write(f"rank {rank_label()}: {which} {signal.Signals(signum).name}, exiting now\n")
            stop_children()
            exit_now(128 + signum)
        self.signum = signum
        sys.stderr.write(
            f"rank {rank_label()}: got {signal.Signals(signum).name}; all ranks save a checkpoint within "
            f"{self.check_every_n_steps + 1} steps (send it again to exit at once)\n"
        )

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._batches += 1
        stepped, self._step = trainer.global_step != self._step, trainer.global_step
        if trainer.world_size == 1 or not torch.distributed.is_initialized():
            signum = self.signum
        else:
            signum = self._agreed_signal(pl_module.device, start=self._batches % self.check_every_n_steps == 0)
        signum = self._agreed = self._agreed or signum
        # Only where an optimizer step ended: a checkpoint saved between the micro-batches of a step (gradient
        # accumulation) holds no gradients, and the resumed run would step on the step's remaining batches alone.
        if not signum or not stepped:
            return
        mark_stopping()
        path = str(Path(checkpoint_dir(trainer)) / f"{ModelCheckpoint.CHECKPOINT_NAME_LAST}.ckpt")
        trainer.save_checkpoint(path)  # every rank calls it; rank 0 writes
        raise StopRequested(signum, trainer.global_step, path)

    def _agreed_signal(self, device: torch.device, start: bool) -> int:
        """The largest signal any rank had at the exchange started one batch ago (0: none, or no exchange);
        with `start`, starts the next exchange."""
        agreed = 0
        if self._pending is not None:
            work, event = self._pending
            self._pending = None
            work.wait()  # gloo: done long ago; NCCL: only orders the device stream
            if event is not None:
                event.synchronize()  # the host copy of that result, queued a whole step before this one
            agreed = int(self._host)
        if agreed or not start:
            return agreed
        if self._flag is None or self._flag.device != device:
            # Made once: building a GPU tensor from a Python number would wait for the GPU every time.
            self._flag = torch.zeros(1, dtype=torch.int32, device=device)
            self._host = torch.zeros(1, dtype=torch.int32, pin_memory=True) if device.type == "cuda" else self._flag
        self._flag.fill_(self.signum)  # on a GPU a queued kernel, not a copy from the host
        work = torch.distributed.all_reduce(self._flag, op=torch.distributed.ReduceOp.MAX, async_op=True)
        event = None
        if device.type == "cuda":
            work.wait()
            self._host.copy_(self._flag, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self._pending = (work, event)
        return 0
