"""Measure what the scaling doctor costs per step: alternating fits with and without it, in one process.

    python tests/library/doctor_overhead.py --reps 5 --steps 300

One process with one thread (strategy ddp on 1 CPU device, so the comm hook is in the path; more threads
would spin against other processes on a shared machine), no logger, bar or checkpoints: the run is the
Trainer's own loop plus the doctor. Each fit's step time is the median of its batch-to-batch
intervals; the overhead is the median over repetitions of (with / without - 1). On a shared machine that
A/B figure is noisy, so the time spent inside the doctor's per-step hooks is also measured directly.
Prints one JSON line.
"""

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: one thread, as one DDP rank per core gets

import lightning as L  # noqa: E402

from ddpkit.scaling.doctor import ScalingDoctor  # noqa: E402
from ddpkit.testing.toy import ToyClassifier, ToyData  # noqa: E402


class StepClock(L.Callback):
    """Records the end time of every training batch."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, *args) -> None:
        self.ends.append(time.perf_counter())

    def median_step_ms(self, skip: int = 5) -> float:
        gaps = [b - a for a, b in zip(self.ends[skip:], self.ends[skip + 1 :], strict=False)]
        return 1000 * statistics.median(gaps)


class TimedDoctor(ScalingDoctor):
    """The doctor, with the time spent in its per-step hooks added up."""

    hook_s = 0.0

    def on_train_batch_start(self, *args) -> None:
        start = time.perf_counter()
        super().on_train_batch_start(*args)
        TimedDoctor.hook_s += time.perf_counter() - start

    def on_train_batch_end(self, *args) -> None:
        start = time.perf_counter()
        super().on_train_batch_end(*args)
        TimedDoctor.hook_s += time.perf_counter() - start


def step_ms(doctor: bool, steps: int, global_batch_size: int) -> float:
    clock = StepClock()
    callbacks = [clock, TimedDoctor()] if doctor else [clock]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy="ddp",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
    )
    trainer.fit(ToyClassifier(), ToyData(global_batch_size=global_batch_size))
    return clock.median_step_ms()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5, help="pairs of fits, without and with the doctor")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per fit")
    parser.add_argument("--global-batch-size", type=int, default=64, help="64: the default ~1-3 ms step")
    args = parser.parse_args()
    L.seed_everything(0, verbose=False)
    off, on = [], []
    for rep in range(args.reps):
        # Alternate which goes first, so a drift in the host's load does not favour one side.
        for doctor in (False, True) if rep % 2 == 0 else (True, False):
            (on if doctor else off).append(step_ms(doctor, args.steps, args.global_batch_size))
    ratios = [b / a for a, b in zip(off, on, strict=True)]
    hook_us = 1e6 * TimedDoctor.hook_s / (args.reps * args.steps)
    result = {
        "hooks_us_per_step": round(hook_us, 1),
        "hooks_pct_of_step": round(100 * hook_us / 1000 / statistics.median(off), 2),
        "step_ms_off": round(statistics.median(off), 3),
        "step_ms_on": round(statistics.median(on), 3),
        "overhead_pct": round(100 * (statistics.median(ratios) - 1), 2),
        "overhead_us_per_step": round(1000 * (statistics.median(on) - statistics.median(off)), 1),
    }
    print(json.dumps(result), flush=True)
    # Leave without the interpreter's teardown: after the in-process fits, gloo's threads sometimes abort it
    # ("terminate called without an active exception", exit -6, once in a CI run) after the figures were printed.
    # The project's CLI leaves the same way.
    os._exit(0)


if __name__ == "__main__":
    main()
