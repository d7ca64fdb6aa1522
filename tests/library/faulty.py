"""A classifier that misbehaves on purpose, for the fault tests and `faults.py` (test-only).

Selected with `--config tests/toy.yaml --model faulty.FaultyClassifier` and `tests/` on PYTHONPATH.
"""

import os
import time
from pathlib import Path

import torch
from toy import ToyClassifier


class FaultyClassifier(ToyClassifier):
    """ToyClassifier that fails on one rank at one step, or just trains slowly.

    Args:
        fault: "none", "raise" (an exception), "exit" (os._exit(3)) or "hang" (sleeps for an hour).
        fault_rank: The global rank that misbehaves.
        fault_step: The optimizer step at which it misbehaves; from then on every rank also
            touches `marker` (so a test knows training is under way).
        step_sleep: Seconds each training step sleeps, to leave time to send a signal.
        marker: A file created once `fault_step` is reached (empty: none).
        ballast_mb: Size of an extra saved buffer, to make checkpoint writes slow.
    """

    def __init__(
        self,
        fault: str = "none",
        fault_rank: int = 1,
        fault_step: int = 3,
        step_sleep: float = 0.0,
        marker: str = "",
        ballast_mb: int = 0,
    ) -> None:
        super().__init__()
        self.fault, self.fault_rank, self.fault_step = fault, fault_rank, fault_step
        self.step_sleep, self.marker = step_sleep, marker
        self.register_buffer("ballast", torch.zeros(ballast_mb * 2**18))  # float32: 2**18 per MB

    def training_step(self, batch, batch_idx):
        if self.global_step >= self.fault_step:
            if self.marker:
                Path(self.marker).touch()
            if self.global_rank == self.fault_rank and self.global_step == self.fault_step:
                if self.fault == "raise":
                    raise RuntimeError(f"injected fault on rank {self.global_rank}")
                if self.fault == "exit":
                    os._exit(3)
                if self.fault == "hang":
                    time.sleep(3600)
        time.sleep(self.step_sleep)
        return super().training_step(batch, batch_idx)
