"""A Lightning callback that records when each training batch starts, for `run.py`.

Injected into the generated project's own `main.py` with
`--trainer.callbacks+=steptimer.StepTimer` and `benchmarks/` on PYTHONPATH, so
the project runs with its default config otherwise. It writes rank 0's record to
the JSON file named by the environment variable BENCH_TIMES (every rank gets the
same environment; only rank 0 writes) and the final weights to BENCH_TIMES.weights.pt. `WindowTimer`, for
`lm.py`, adds device-synchronized windows.
"""

import json
import os
import time

import lightning as L
import torch
from lightning.pytorch.profilers import SimpleProfiler


class StepTimer(L.Callback):
    """Records (epoch, perf_counter, process_time) at every `on_train_batch_start`; wall clock of the first."""

    def __init__(self) -> None:
        self.starts: list[tuple[int, float, float]] = []
        self.first_step_wall: float | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # The same point as the raw loop's timestamp: the batch is fetched, the step is about to run.
        if self.first_step_wall is None:
            self.first_step_wall = time.time()
        self.starts.append((trainer.current_epoch, time.perf_counter(), time.process_time()))

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0 and os.environ.get("BENCH_TIMES"):
            record = {
                "starts": self.starts,
                "first_step_wall": self.first_step_wall,
                "train_end_wall": time.time(),
                "world_size": trainer.world_size,
            }
            with open(os.environ["BENCH_TIMES"], "w") as f:
                json.dump(record, f)
            # The final weights, saved here because Lightning 2.6's last.ckpt is only rewritten when a
            # top-k checkpoint is saved at the same step: with save_top_k=1 it holds the best epoch.
            torch.save(pl_module.state_dict(), os.environ["BENCH_TIMES"] + ".weights.pt")


class WindowTimer(StepTimer):
    """StepTimer plus one window per epoch, from its first batch's start to its last batch's end, with the device
    idle at both ends (CUDA synchronized there), for `lm.py`: on a GPU the host runs ahead of the device, so
    only such a window measures the device's throughput. Saves the final weights only when BENCH_WEIGHTS names
    a file."""

    def __init__(self) -> None:
        super().__init__()
        self.windows: list[list] = []  # [epoch, start, end, batches]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 0:
            sync(pl_module.device)
            self.windows.append([trainer.current_epoch, time.perf_counter(), None, 0])
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.windows[-1][3] += 1
        if batch_idx == trainer.num_training_batches - 1:
            sync(pl_module.device)
            self.windows[-1][2] = time.perf_counter()

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0 and os.environ.get("BENCH_TIMES"):
            record = {
                "starts": self.starts,
                "windows": self.windows,
                "first_step_wall": self.first_step_wall,
                "world_size": trainer.world_size,
            }
            with open(os.environ["BENCH_TIMES"], "w") as f:
                json.dump(record, f)
            if os.environ.get("BENCH_WEIGHTS"):
                torch.save(pl_module.state_dict(), os.environ["BENCH_WEIGHTS"])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class CPUTimeProfiler(SimpleProfiler):
    """Lightning's SimpleProfiler timing each hook with the thread's CPU time instead of the wall clock.

    Time spent descheduled by other processes does not count, so per-hook costs
    stay readable on a busy machine. Writes {action: [seconds, ...]} to the JSON
    file named by BENCH_HOOKS (rank 0).
    """

    def start(self, action_name: str) -> None:
        self.current_actions[action_name] = time.thread_time()

    def stop(self, action_name: str) -> None:
        self.recorded_durations[action_name].append(time.thread_time() - self.current_actions.pop(action_name))

    def teardown(self, stage: str | None) -> None:
        if os.environ.get("BENCH_HOOKS") and self.local_rank in (None, 0) and self.recorded_durations:
            with open(os.environ["BENCH_HOOKS"], "w") as f:
                json.dump(dict(self.recorded_durations), f)
        super().teardown(stage)
