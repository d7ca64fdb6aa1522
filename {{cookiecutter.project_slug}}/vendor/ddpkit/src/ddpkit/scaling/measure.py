"""The scaling doctor's measurements on one rank: where each optimizer step's time goes, as running sums
(`StepMeter`, which the `ScalingDoctor` callback of doctor.py feeds from Lightning's hooks), and peak memory.

Per rank and per step it measures (host clock; CUDA events for the all-reduce on GPUs). A step is one optimizer
step: with gradient accumulation (`--data.micro_batch_size`) it spans its micro-batches, from the end of the
previous optimizer step to the end of the batch that stepped, and each part below sums over them.

- data wait: the time the training loop spends in `next()` on the train loader. Lightning's training loop
  brackets that call with its profiler hooks (`_on_before_fetch`/`_on_after_fetch`, the
  "train_dataloader_next" action of `--trainer.profiler simple`); the doctor chains a timer onto them.
- comm: wall time during which a gradient all-reduce is in flight, from a DDP communication hook that wraps
  the default all-reduce (launch until its future completes). A rank that arrives early waits for the others
  inside the all-reduce, so a straggler shows up as comm time on the *other* ranks.
- compute: `on_train_batch_start` to `on_train_batch_end` minus comm: forward, backward and optimizer.
- other: the rest of the step: copying the batch to the device and the loop's bookkeeping between steps
  (progress bar, loggers, Lightning's per-step SIGTERM broadcast). Validation and checkpointing between
  epochs are outside the measurement.
- peak memory: `torch.cuda.max_memory_allocated` on GPU, peak RSS of the process on CPU.
- cpu wait (the `cpu_wait_*` fields; too much of it is host-contention): time the training thread was ready to
  run but waited for a CPU (Linux's /proc/thread-self/schedstat run-queue delay), within the step and within
  each of its parts; and, on the CPU, the time the process's other threads (gloo's, which carry the
  all-reduce) waited for a CPU while an all-reduce was in flight. Other processes, more ranks x threads than
  cores, or loader workers competing for the cores stretch every part of the step without that part being
  slow; this says how much, so that e.g. a data wait that is really waiting for a CPU is not called
  data-bound, nor an all-reduce whose threads had no core communication-bound. 0 where the kernel offers no
  schedstat.
- garbage collection: time in Python's collector during the step (gc.callbacks).

Cost: a few `perf_counter` calls and list appends per step, in Python floats; no `self.log`, no device sync
per step. On CUDA only one step in `cuda_sample_every` is synchronised, to time its parts exactly.
"""

import os
import resource
import threading
import time
from collections import deque

import torch
from lightning.pytorch.utilities.data import extract_batch_size
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from .diagnosis import FIELDS, covered_seconds

# Timed steps whose all-reduce time every rank keeps for the per-step minimum: 32 KB gathered per rank.
STEP_SAMPLE = 4096


class Totals:
    """Running sums of one rank's measurements, as plain floats."""

    def __init__(self) -> None:
        self.steps = self.wall_s = self.samples = 0.0
        self.timed_steps = self.data_s = self.busy_s = self.comm_s = self.step_s = 0.0
        self.cpu_wait_s = self.data_cpu_wait_s = self.busy_cpu_wait_s = self.gc_s = 0.0
        self.comm_cpu_wait_s = self.micro_batches = 0.0

    def add(self, other: "Totals") -> None:
        for name in FIELDS[:-3]:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def row(self, node_rank: float, device_index: float, peak_mem_bytes: float) -> list[float]:
        return [getattr(self, name) for name in FIELDS[:-3]] + [node_rank, device_index, peak_mem_bytes]


class _RunQueue:
    """Seconds the calling thread has spent runnable but waiting for a CPU (Linux schedstat), as a clock."""

    def __init__(self) -> None:
        try:  # thread-self: the training thread opens it, in on_fit_start
            self._fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None

    def __call__(self) -> float:
        if self._fd is None:
            return 0.0
        return int(os.pread(self._fd, 80, 0).split()[1]) / 1e9  # fields: on-CPU ns, run-queue ns, slices

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class _OtherThreadsRunQueue:
    """Seconds the process's threads other than the calling one have spent runnable but waiting for a CPU,
    summed, as a clock. On CPUs gloo's threads carry the all-reduce: when the ranks take every core they wait
    for one for most of it, which the training thread (blocked meanwhile) never sees (measured: ddp-template's
    docs/measurements.md)."""

    def __init__(self) -> None:
        self._own = str(threading.get_native_id())
        self._fds: dict[str, int] = {}

    def refresh(self) -> None:
        """Follow threads that started or ended (the training thread only: __call__ may run on another)."""
        try:
            tids = set(os.listdir("/proc/self/task")) - {self._own}
        except OSError:
            return
        for tid in set(self._fds) - tids:
            os.close(self._fds.pop(tid))
        for tid in tids - set(self._fds):
            try:
                self._fds[tid] = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
            except OSError:
                pass  # ended meanwhile

    def __call__(self) -> float:
        total = 0
        for fd in list(self._fds.values()):
            try:
                total += int(os.pread(fd, 80, 0).split()[1])
            except (OSError, IndexError, ValueError):
                pass  # a thread that ended: its wait drops out, and a negative difference counts as 0
        return total / 1e9

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class StepMeter:
    """One rank's measurement of its optimizer steps through fit: the step under way, and the sums of the steps
    after `warmup_steps`, since fit started (`total`) and since the last periodic report (`window`).

    Built in `on_fit_start`, on the training thread (its run-queue clock is that thread's). The doctor calls
    `batch_start`/`batch_end`/`next_batch` from its batch hooks and hands `before_fetch`/`after_fetch` to the
    training loop, `time_gc` to gc.callbacks and `timed_allreduce` to DDP as its comm hook.
    """

    def __init__(self, device: torch.device, warmup_steps: int, cuda_sample_every: int, global_step: int) -> None:
        self.device = device
        self.warmup_steps = warmup_steps
        self._cuda = device.type == "cuda"
        self._every = cuda_sample_every if self._cuda else 1  # a sync is free on the CPU: time every step
        self.total, self.window = Totals(), Totals()
        # The optimizer step under way: its batches so far (batches that never reach a step by the end of fit
        # are left out).
        self._step = Totals()
        self.steps = 0  # optimizer steps ended, warm-up included
        self._global_step = global_step  # as it was at the first batch of the step under way
        self._last_end = time.perf_counter()  # reset at every epoch start
        self._fetch_s, self._fetch_start = 0.0, 0.0  # this batch's time in the loader's next()
        self._timing = False  # is this step timed (its batches' parts, its all-reduce)?
        self._comm: list[tuple] = []  # this step's all-reduce (start, end) pairs
        # Other threads' run-queue clock at this step's first all-reduce and at its last completion. On CUDA
        # the all-reduce runs on the device (its span is device time): no host thread to wait for.
        self._threads = _OtherThreadsRunQueue() if not self._cuda else None
        self._comm_wait: list[float] = []
        # Each timed step's all-reduce without that wait, for the per-step minimum over ranks (doctor's _report).
        self.step_comm: deque[float] = deque(maxlen=STEP_SAMPLE)
        self._runqueue = _RunQueue()
        self._wait_last = self._wait_fetch = self._wait_start = 0.0
        self._data_wait_s = self._gc_s = self._gc_start = 0.0  # this batch's run-queue wait in next(), its gc time

    def timed_allreduce(self, process_group, bucket):
        """DDP's default all-reduce, timed from launch until its future completes."""
        if not self._timing:
            return allreduce_hook(process_group, bucket)
        if self._threads is not None and not self._comm_wait:
            self._threads.refresh()
            self._comm_wait[:] = [self._threads()] * 2
        start = self._mark()

        def done(fut):
            # Runs when the all-reduce has finished (on CUDA: on a stream that waits for it; on CPU: on one of
            # gloo's threads, so its own wait so far is in the clock).
            self._comm.append((start, self._mark()))
            if self._threads is not None:
                self._comm_wait[1] = self._threads()
            return fut.value()

        return allreduce_hook(process_group, bucket).then(done)

    def time_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self._gc_s += time.perf_counter() - self._gc_start

    def _mark(self):
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _comm_seconds(self) -> float:
        spans = self._comm
        if self._cuda and spans:
            ref = spans[0][0]
            spans = [(ref.elapsed_time(a) / 1000, ref.elapsed_time(b) / 1000) for a, b in spans]
        return covered_seconds(spans)

    # ---- per step ----------------------------------------------------------------------------------------
    def epoch_start(self) -> None:
        self.restart_clock()
        self._fetch_s = self._data_wait_s = self._gc_s = 0.0

    def restart_clock(self) -> None:
        """The next batch's data wait starts now (at an epoch's start; after validation, which is not data wait)."""
        self._last_end = time.perf_counter()
        self._wait_last = self._runqueue()

    def before_fetch(self) -> None:
        self._wait_fetch = self._runqueue()
        self._fetch_start = time.perf_counter()

    def after_fetch(self) -> None:
        self._fetch_s += time.perf_counter() - self._fetch_start
        self._data_wait_s += self._runqueue() - self._wait_fetch

    def batch_start(self, global_step: int, batch, samples: int | None = None) -> None:
        """A batch starts: its samples are `samples`, else counted by Lightning's rule."""
        if not self._step.micro_batches:  # the first batch of an optimizer step
            self._global_step = global_step
            self._timing = self.steps >= self.warmup_steps and self.steps % self._every == 0
            self._comm.clear()
            self._comm_wait.clear()
        self._wait_start = self._runqueue()
        self._start = time.perf_counter()
        self._samples = samples if samples is not None else extract_batch_size(batch)

    def batch_end(self, global_step: int) -> bool:
        """Add the batch that just ended to its optimizer step; True when it ended that step."""
        if self._timing and self._cuda:
            torch.cuda.synchronize(self.device)
        end = time.perf_counter()
        wait_end = self._runqueue()
        step = self._step  # this batch's times add to its optimizer step's
        step.micro_batches += 1
        step.samples += self._samples
        step.wall_s += end - self._last_end
        if self._timing:
            step.data_s += self._fetch_s
            step.busy_s += end - self._start
            step.step_s += end - self._last_end
            step.cpu_wait_s += wait_end - self._wait_last
            step.data_cpu_wait_s += self._data_wait_s
            step.busy_cpu_wait_s += wait_end - self._wait_start
            step.gc_s += self._gc_s
        self._fetch_s = self._data_wait_s = self._gc_s = 0.0
        # A doctor step is one optimizer step: it ends with the batch in which global_step moved. Accumulating
        # batches leave it as it is; a manual-optimization step over two optimizers moves it by 2, still one step.
        if global_step == self._global_step:
            return False
        self._end_step()
        return True

    def next_batch(self, step_ended: bool) -> None:
        """Start the next batch's clock, after `batch_end` (and a report the doctor made in between)."""
        if step_ended and self._cuda and self.steps >= self.warmup_steps and self.steps % self._every == 0:
            torch.cuda.synchronize(self.device)  # the next step is timed: start it with an idle device
        self.restart_clock()

    def _end_step(self) -> None:
        """Add the optimizer step that just ended to the totals, unless it is a warm-up step."""
        step, self._step = self._step, Totals()
        if self.steps >= self.warmup_steps:
            step.steps = 1
            if self._timing:
                comm = self._comm_seconds()
                # Summed over threads: may exceed the span when two waited at once; the span bounds it.
                wait = min(max(0.0, self._comm_wait[1] - self._comm_wait[0]), comm) if self._comm_wait else 0.0
                step.timed_steps, step.comm_s, step.comm_cpu_wait_s = 1, comm, wait
                self.step_comm.append(comm - wait)
            self.total.add(step)
            self.window.add(step)
        self.steps += 1

    def take_window(self) -> Totals:
        """The sums since the last call (or since fit started), for a periodic report; starts a new window."""
        window, self.window = self.window, Totals()
        return window

    def close(self) -> None:
        """Close the run-queue clocks' files (at the end of fit)."""
        self._runqueue.close()
        if self._threads is not None:
            self._threads.close()


def peak_memory(device: torch.device) -> float:
    """This rank's peak memory in bytes: allocated on its GPU, else the process's resident memory."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    return float(host_peak_rss())


def allreduce_latency_ms(device: torch.device, reps: int = 20) -> float:
    """Median time of an all-reduce of one number over all ranks: the all-reduce's fixed cost (latency), which
    with the timed gradient all-reduce separates latency from bandwidth for scaling.py's prediction."""
    one = torch.zeros(1, device=device)
    times = []
    torch.distributed.barrier()
    for _ in range(reps):
        start = time.perf_counter()
        torch.distributed.all_reduce(one)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return 1000 * sorted(times)[reps // 2]


def host_peak_rss() -> int:
    """This process's own peak resident memory in bytes.

    Linux's `VmHWM` first: getrusage's maxrss survives fork and exec, so a rank started by a large process (a
    notebook, a test runner) would report its parent's peak as its own.
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux and BSDs report KiB
