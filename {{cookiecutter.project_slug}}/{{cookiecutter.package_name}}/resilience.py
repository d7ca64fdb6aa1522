"""What keeps a multi-process job from hanging, orphaning ranks or losing checkpoints.

- `GracefulStop`: SIGTERM or SIGINT (Ctrl-C) makes every rank finish its current
  step, save `last.ckpt` and exit; a second signal stops at once.
- `AtomicCheckpointIO`: a checkpoint is written to a temporary file, synced to
  disk and renamed over the old one, so a kill at any moment leaves the previous
  complete file in place.
- `watch_parent` and `stop_children`: no rank outlives the job. A rank whose
  launcher is gone exits; a launcher that fails kills the ranks it started.

Lightning's launcher already kills the whole job within ~5 s when a started rank
exits non-zero; a rank that hangs is caught by the process-group timeout
(`--dist_timeout`), after which the failing rank ends the job.
"""

import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

# The launcher's pid, inherited by the ranks it starts: they exit when it is gone.
LAUNCHER_PID = "DDP_LAUNCHER_PID"


def rank_label() -> str:
    """This process's rank as Lightning's launcher or torchrun set it (0 before they do)."""
    return os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))


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
    of rank 0's SIGTERM flag that only knows rank 0's signals and was a second
    sync point per step (benchmarks/README.md).

    Args:
        check_every_n_steps: Training batches between the ranks' exchanges. Each
            cost ~0.8 ms on 2 CPU processes (gloo wakes a thread on every rank;
            not measured with NCCL); lower it when steps are long and the
            scheduler's grace period is short.
    """

    def __init__(self, check_every_n_steps: int = 10) -> None:
        if check_every_n_steps < 1:
            raise ValueError(f"check_every_n_steps must be >= 1, got {check_every_n_steps}")
        self.check_every_n_steps = check_every_n_steps
        self.signum = 0
        self._previous: dict[int, Any] = {}
        self._batches = 0  # training batches ended in this fit: the same count on every rank
        self._pending: tuple | None = None  # the all-reduce started one batch ago, and its copy's CUDA event
        self._flag: torch.Tensor | None = None  # the number the ranks all-reduce, on this rank's device
        self._host: torch.Tensor | None = None  # its host copy (pinned memory on GPUs)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.received_sigterm:  # Lightning's handler (active until now) got one during set-up
            self.signum = signal.SIGTERM
        # Replaces Lightning's SIGTERM handler, which forwards the signal and broadcasts inside the handler.
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._request)
        # An instance attribute shadows the loop's method; on_train_end removes it. With Lightning's handler
        # replaced its flag stays False, so the broadcast could only ever send "no".
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = _skip

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
        vars(trainer.fit_loop.epoch_loop).pop("_broadcast_sigterm_tensor", None)

    def _request(self, signum: int, frame: Any) -> None:
        if self.signum:  # asked twice: do not wait for the step to end
            sys.stderr.write(f"rank {rank_label()}: second {signal.Signals(signum).name}, exiting now\n")
            stop_children()
            os._exit(128 + signum)
        self.signum = signum
        sys.stderr.write(
            f"rank {rank_label()}: got {signal.Signals(signum).name}; all ranks save a checkpoint within "
            f"{self.check_every_n_steps + 1} steps (send it again to exit at once)\n"
        )

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._batches += 1
        if trainer.world_size == 1 or not torch.distributed.is_initialized():
            signum = self.signum
        else:
            signum = self._agreed_signal(pl_module.device, start=self._batches % self.check_every_n_steps == 0)
        if not signum:
            return
        _stopping.set()
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


def _skip() -> None:
    """Stands in for Lightning's per-step SIGTERM broadcast while GracefulStop runs."""


class TimedDDPStrategy(DDPStrategy):
    """DDP whose collectives fail after `timeout`, while starting ranks get `startup_timeout` to meet.

    One timeout for both would make a short hang-detection timeout fail slow
    start-ups (imports on a busy machine, many nodes), or a long one hide hangs.
    """

    def __init__(self, *args: Any, startup_timeout: timedelta = timedelta(minutes=10), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.startup_timeout = startup_timeout

    def setup_distributed(self) -> None:
        timeout = self._timeout
        set_timeout = getattr(torch.distributed.distributed_c10d, "_set_pg_timeout", None)  # private in torch 2.x
        if timeout is None or set_timeout is None:
            return super().setup_distributed()
        self._timeout = max(timeout, self.startup_timeout)
        try:
            super().setup_distributed()
        finally:
            self._timeout = timeout
        set_timeout(timeout)


class CurrentModelCheckpoint(ModelCheckpoint):
    """`ModelCheckpoint` whose `last.ckpt` is always the latest epoch, as its docs promise.

    Lightning 2.6.6 rewrites `last.ckpt` only when a top-k checkpoint was saved at
    the same step (`model_checkpoint.py`, `on_validation_end`): with a monitored
    metric that stops improving, `last.ckpt` stays at the best epoch and a resume
    from it silently goes back in training. This saves it at every checkpoint
    point where Lightning skipped it.
    """

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if self._should_save_on_train_epoch_end(trainer):
            self._save_stale_last(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if not self._should_save_on_train_epoch_end(trainer):
            self._save_stale_last(trainer)

    def _save_stale_last(self, trainer: L.Trainer) -> None:
        # Skipped when this step was already saved (by the parent, top-k and last together).
        if self.save_last and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))


def checkpoint_dir(trainer: L.Trainer) -> str:
    """Where the first ModelCheckpoint writes, else <default_root_dir>/checkpoints."""
    callback = trainer.checkpoint_callback
    if callback is not None and callback.dirpath:
        return str(callback.dirpath)
    return os.path.join(trainer.default_root_dir, "checkpoints")


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes each checkpoint to a temporary file, fsyncs it and renames it into place.

    `os.replace` is atomic on POSIX file systems: readers (and a resume after a
    crash) see the old complete file or the new complete file, never a partial
    one. A kill mid-write leaves only a `.tmp` file, which the next save in that
    directory removes. Remote paths (s3://...) use Lightning's default writer.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if "://" in str(path) and not str(path).startswith("file://"):
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        for stale in path.parent.glob(f".{path.name}.*.tmp"):
            stale.unlink(missing_ok=True)  # left by a writer that was killed
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)  # makes the rename itself durable
        finally:
            os.close(directory)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        # Tensors and plain containers only unless the caller asks otherwise: a checkpoint file
        # from elsewhere cannot run code on load (Lightning's own default is weights_only=False).
        if weights_only is None:
            weights_only = True
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        fs = get_filesystem(path)
        if fs.exists(path):
            fs.rm(path, recursive=True)


# --- no orphans -------------------------------------------------------------------------------------

_launcher: Any = None  # Lightning's launcher in this process, if it starts the other ranks of the node
_stopping = threading.Event()  # set once the ranks agreed on a graceful stop: their exits are expected


def children() -> list[Any]:
    """The rank processes the launcher started (it rebuilds its list when it starts them)."""
    return list(getattr(_launcher, "procs", []))


def child_rank(index: int) -> int:
    """Global rank of the launcher's child `index` (0-based; the launcher itself is local rank 0)."""
    return int(os.environ.get("NODE_RANK", 0)) * (len(children()) + 1) + index + 1


def register_launcher(launcher: Any) -> None:
    """Remember the launcher, to name and kill the ranks it started when something fails."""
    global _launcher
    _launcher = launcher


def stop_children() -> list[int]:
    """SIGKILL every launched rank still running (they may be stuck in a collective); return their local ranks."""
    procs = children()
    alive = [child_rank(i) for i, proc in enumerate(procs) if proc.poll() is None]
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        proc.wait()
    return alive


def failed_children(wait: float = 0.0) -> list[tuple[int, int]]:
    """(rank, exit code) of every launched rank that exited with an error, waiting up to `wait` s for one.

    A rank that crashes closes its sockets a moment before its exit status is
    visible: the wait lets the launcher blame the rank that died, not itself.
    """
    deadline = time.monotonic() + (wait if children() else 0.0)
    while True:
        failed = [(child_rank(i), proc.returncode) for i, proc in enumerate(children()) if proc.poll()]
        if failed or time.monotonic() >= deadline:
            return failed
        time.sleep(0.05)


def watch_children(period: float = 0.5) -> None:
    """In the launcher: when a rank it started exits with an error, name it and end the whole job.

    Lightning's own observer does the same every 5 s without saying which rank
    in the default log level; a NCCL job would otherwise wait for the timeout.
    """

    def watch() -> None:
        while True:
            time.sleep(period)
            failed = failed_children()
            if failed and not _stopping.is_set():
                rank, code = failed[0]
                sys.stderr.write(f"error: rank {rank} exited with code {code}; stopping the other ranks\n")
                stop_children()
                os._exit(1)

    threading.Thread(target=watch, name="watch-children", daemon=True).start()


def watch_parent(period: float = 1.0) -> None:
    """Exit this rank when the process that launched it dies (e.g. `kill -9` of the launcher).

    Without this, a rank blocked in a collective stays until the process-group
    timeout, or forever when it is stuck elsewhere.
    """
    parent = int(os.environ.get(LAUNCHER_PID) or os.getppid())  # the env var also covers a launcher already gone

    def watch() -> None:
        while True:
            time.sleep(period)
            if os.getppid() != parent:
                sys.stderr.write(f"rank {rank_label()}: the launcher (pid {parent}) is gone; exiting\n")
                os._exit(1)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()
