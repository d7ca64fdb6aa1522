"""A model whose compute holds no CPU, for scaling tests on a machine with fewer cores than ranks.

Its "compute" sleeps `fixed_ms + per_sample_ms x per-device batch`, so 1, 2, 4 and 8 ranks on 2 cores
behave like that many devices, while its gradient (`grad_mb` of zeros) is all-reduced for real by DDP
over gloo. Each cause of a scaling gap can be added on its own: a per-batch loading delay (SleepyData),
a large gradient, a straggler rank, CPU work instead of sleep (oversubscription when ranks outnumber the
cores), a large fixed cost per step (a per-device batch too small for it). This folder on PYTHONPATH.

Several runs started at once take turns to train (TURNS): they start up together, which is most of a
short run, but time their steps one run at a time, so that one run's CPU work (its steps, or its
processes tearing down after their turn) does not slow another's.
"""

import fcntl
import os
import time
from pathlib import Path

import lightning as L
import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from ddpkit.testing.toy import ToyClassifier, ToyData

# "DIR,COUNT": every run's rank 0 marks itself ready in DIR, waits until COUNT runs are (or 900 s pass),
# then holds an exclusive lock on DIR/turn from the start of training to its end. The lock holder writes
# its ranks' process ids into DIR/turn; the next holder waits until they have exited.
TURNS = "SLEEPY_TURNS"


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie has exited; its parent has not yet collected it


def _take_turn(rank: int, pids: list[int]) -> int | None:
    """Wait for this run's turn (see TURNS); the lock's file descriptor on rank 0, else None."""
    if rank != 0 or not os.environ.get(TURNS):
        return None
    folder, count = os.environ[TURNS].rsplit(",", 1)
    Path(folder, f"ready-{os.getpid()}").touch()
    deadline = time.monotonic() + 900  # a run that died before training must not hold up the others
    while len(list(Path(folder).glob("ready-*"))) < int(count) and time.monotonic() < deadline:
        time.sleep(0.2)
    fd = os.open(Path(folder, "turn"), os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    # The previous run released the lock at the end of its training; its processes then still save,
    # log and tear down (seconds of CPU each, 8 processes after the 8-device run).
    previous = [int(p) for p in os.pread(fd, 4096, 0).split()]
    deadline = time.monotonic() + 120
    while any(_running(p) for p in previous) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.ftruncate(fd, 0)
    os.pwrite(fd, " ".join(map(str, pids)).encode(), 0)
    return fd


class InTurn(L.LightningModule):
    """Trains only in its run's turn (TURNS): the turn is taken before the first step, released after the last."""

    def on_train_start(self) -> None:
        pids = self.trainer.strategy.all_gather(torch.tensor(os.getpid())).reshape(-1).tolist()
        self._turn = _take_turn(self.global_rank, pids)
        self.trainer.strategy.barrier()  # the other ranks start with rank 0

    def on_train_end(self) -> None:
        self.trainer.strategy.barrier()  # every rank has finished (the doctor has reported) before the next run
        if self._turn is not None:
            os.close(self._turn)  # releases the lock


class ToyInTurn(InTurn, ToyClassifier):
    """The toy classifier (real compute), training in its turn."""


class Sleepy(InTurn):
    """Sleeps instead of computing; its gradient is real and all-reduced.

    Args:
        fixed_ms: Compute per step that does not depend on the batch (kernel launches, optimizer).
        per_sample_ms: Compute per sample of the device's batch.
        grad_mb: Size of the gradient all-reduced every step.
        straggler_ms: Extra compute per step on `slow_rank` when there is more than one rank.
        slow_rank: The straggler.
        spin: Burn the compute time as CPU time of the training thread instead of sleeping (real CPU work:
            ranks then compete for the cores).
    """

    def __init__(
        self,
        fixed_ms: float = 4.0,
        per_sample_ms: float = 2.0,
        grad_mb: float = 0.25,
        straggler_ms: float = 0.0,
        slow_rank: int = 1,
        spin: bool = False,
    ) -> None:
        super().__init__()
        self.fixed_ms, self.per_sample_ms, self.straggler_ms = fixed_ms, per_sample_ms, straggler_ms
        self.slow_rank, self.spin = slow_rank, spin
        self.weight = nn.Parameter(torch.zeros(int(grad_mb * 2**18)))  # 2**18 float32 = 1 MB

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, _ = batch
        ms = self.fixed_ms + self.per_sample_ms * len(x)
        if self.global_rank == self.slow_rank and self.trainer.world_size > 1:
            ms += self.straggler_ms
        if self.spin:
            until = time.thread_time() + ms / 1000  # CPU time of this thread: the same work, however contended
            while time.thread_time() < until:
                pass
        else:
            time.sleep(ms / 1000)
        return self.weight.sum() * 0.0  # a gradient of zeros for every weight: DDP all-reduces all of it

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val/acc", 0.0, sync_dist=True)  # for the checkpoint callback of ddpkit/testing/toy.yaml

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)

    # The sleep stands for all of a step's compute. A real optimizer step and a fresh gradient buffer every
    # step would add CPU work that grows with `grad_mb` and does not shrink with the per-device batch (at 32 MB
    # more than the all-reduce itself: docs/measurements.md): the large-gradient case would be compute-bound.
    # The gradient is zeros and the learning rate 0, so skipping both changes nothing but that cost; DDP still
    # all-reduces the whole gradient every step.
    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        optimizer_closure()  # forward and backward (with DDP's all-reduce), no update

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer) -> None:
        pass  # zeros accumulate into the same buffer: no 32 MB allocation (page faults) per step


class _BatchDelay(Dataset):
    """Wraps a dataset; every batch costs `delay_s` to load, whatever its size (a per-request latency)."""

    def __init__(self, dataset: Dataset, delay_s: float) -> None:
        self.dataset, self.delay_s = dataset, delay_s

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int):
        return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> list:
        time.sleep(self.delay_s)  # the DataLoader asks for a whole batch at once
        return [self.dataset[i] for i in indices]


class SleepyData(ToyData):
    """The toy blobs with `batch_delay_ms` of loading per batch (a per-batch cost that does not shrink).

    Args:
        batch_delay_ms: Sleep per training batch, in the loading process.
        global_batch_size: Samples per optimizer step over all devices.
    """

    def __init__(self, batch_delay_ms: float = 0.0, global_batch_size: int = 64) -> None:
        super().__init__(global_batch_size=global_batch_size)
        self.batch_delay_ms = batch_delay_ms

    def train_dataset(self) -> Dataset:
        return _BatchDelay(super().train_dataset(), self.batch_delay_ms / 1000)
