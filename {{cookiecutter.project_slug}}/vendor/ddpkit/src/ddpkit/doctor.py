"""The scaling doctor: measures, on every rank, where each training step goes, and says why N devices are
not N times faster.

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

At the end of fit (and every `report_every_n_steps` steps when set) every rank contributes its numbers to one
`all_gather`; rank 0 prints the report, writes `doctor.json` (a `record.DoctorRecord`) into the run's log
directory (with a logger), and the loggers get the same numbers as `doctor/*` scalars. The verdict follows the
thresholds of `Thresholds`.

Cost: a few `perf_counter` calls and list appends per step, in Python floats; no `self.log`, no device sync
per step. On CUDA only one step in `cuda_sample_every` is synchronised, to time its parts exactly.
"""

import gc
import json
import os
import resource
import threading
import time
from collections import deque
from dataclasses import asdict
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning.pytorch.utilities.data import extract_batch_size
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from . import __version__
from .diagnosis import FIELDS, Thresholds, covered_seconds, diagnose, format_report, summarize
from .lightning_internals import ddp_comm_hook, wrap_fetch_hooks
from .record import DoctorRecord


class _Totals:
    """Running sums of one rank's measurements, as plain floats."""

    def __init__(self) -> None:
        self.steps = self.wall_s = self.samples = 0.0
        self.timed_steps = self.data_s = self.busy_s = self.comm_s = self.step_s = 0.0
        self.cpu_wait_s = self.data_cpu_wait_s = self.busy_cpu_wait_s = self.gc_s = 0.0
        self.comm_cpu_wait_s = self.micro_batches = 0.0

    def add(self, other: "_Totals") -> None:
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


class ScalingDoctor(L.Callback):
    """Measures data wait, compute, gradient all-reduce, throughput and peak memory on every rank and reports
    why N devices are not N times faster. Turn it off with `--doctor.enabled false`
    (see README), or `enabled: false` under `doctor:` in a config file.

    Args:
        enabled: Measure and report; False makes every hook return at once.
        report_every_n_steps: Also report (and log) the numbers of the last N optimizer steps every N
            steps; 0 reports only at the end of fit.
        warmup_steps: Optimizer steps at the start of fit left out of the numbers (first-step allocations,
            JIT).
        cuda_sample_every: On GPUs, time every N-th optimizer step exactly (a device sync after each of its
            batches and before it); the other steps count only towards throughput.
        summary_file: Name of the JSON summary written into the run's log directory; empty for none.
        measure_comm: Time the gradient all-reduce with a DDP comm hook. Off by default: a Python comm
            hook replaces DDP's built-in C++ all-reduce, about 1-2 ms more per step on CPU processes
            (ddp-template's docs/measurements.md); without it the all-reduce counts as compute. scaling.py
            turns it on.
        min_step_ms: See `Thresholds`.
        straggler_wait_share: See `Thresholds`.
        data_wait_share: See `Thresholds`.
        comm_share: See `Thresholds`.
        memory_imbalance: See `Thresholds`.
        cpu_wait_share: See `Thresholds`.
    """

    def __init__(
        self,
        enabled: bool = True,
        report_every_n_steps: int = 0,
        warmup_steps: int = 3,
        cuda_sample_every: int = 10,
        summary_file: str = "doctor.json",
        measure_comm: bool = False,
        min_step_ms: float = Thresholds.min_step_ms,
        straggler_wait_share: float = Thresholds.straggler_wait_share,
        data_wait_share: float = Thresholds.data_wait_share,
        comm_share: float = Thresholds.comm_share,
        memory_imbalance: float = Thresholds.memory_imbalance,
        cpu_wait_share: float = Thresholds.cpu_wait_share,
    ) -> None:
        self.enabled, self.report_every_n_steps, self.warmup_steps = enabled, report_every_n_steps, warmup_steps
        self.cuda_sample_every, self.summary_file = cuda_sample_every, summary_file
        self.measure_comm = measure_comm
        self.thresholds = Thresholds(
            min_step_ms, straggler_wait_share, data_wait_share, comm_share, memory_imbalance, cpu_wait_share
        )
        self.summary: DoctorRecord | None = None  # the last report's numbers, on every rank

    # ---- set-up -------------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.enabled:
            return
        self._device = pl_module.device
        self._cuda = self._device.type == "cuda"
        self._every = self.cuda_sample_every if self._cuda else 1  # a sync is free on the CPU: time every step
        self._total, self._window = _Totals(), _Totals()
        # The optimizer step under way: its batches so far (batches that never reach a step by the end of fit
        # are left out).
        self._step = _Totals()
        self._steps = 0  # optimizer steps ended, warm-up included
        self._global_step = trainer.global_step  # as it was at the first batch of the step under way
        self._last_end = time.perf_counter()  # reset at every epoch start
        self._fetch_s, self._fetch_start = 0.0, 0.0  # this batch's time in the loader's next()
        self._timing = False  # is this step timed (its batches' parts, its all-reduce)?
        self._comm: list[tuple] = []  # this step's all-reduce (start, end) pairs
        self._comm_measured = False
        # Other threads' run-queue clock at this step's first all-reduce and at its last completion. On CUDA
        # the all-reduce runs on the device (its span is device time): no host thread to wait for.
        self._threads = _OtherThreadsRunQueue() if not self._cuda else None
        self._comm_wait: list[float] = []
        # Each timed step's all-reduce without that wait, for the per-step minimum over ranks (_report).
        self._step_comm: deque[float] = deque(maxlen=STEP_SAMPLE)
        self._runqueue = _RunQueue()
        self._wait_last = self._wait_fetch = self._wait_start = 0.0
        self._data_wait_s = self._gc_s = self._gc_start = 0.0  # this batch's run-queue wait in next(), its gc time
        gc.callbacks.append(self._time_gc)
        self._latency_ms: float | None = None
        self._data_measured = self._time_fetches(trainer)
        if not self._data_measured:
            rank_zero_warn("ScalingDoctor: cannot time the data fetch with this Lightning version; data wait is 0.")
        model = trainer.strategy.model
        # The strategy has wrapped the model by now and no backward has run yet: the last moment to add a hook.
        if self.measure_comm and isinstance(model, DistributedDataParallel):
            if ddp_comm_hook(trainer.strategy) is not None:
                rank_zero_warn("ScalingDoctor: a DDP comm hook is already registered; all-reduce time not measured.")
            else:
                model.register_comm_hook(model.process_group, self._timed_allreduce)
                self._comm_measured = True

    def _timed_allreduce(self, process_group, bucket):
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

    def _time_gc(self, phase: str, info: dict) -> None:
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
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.enabled:
            return
        self._last_end = time.perf_counter()
        self._wait_last = self._runqueue()
        self._fetch_s = self._data_wait_s = self._gc_s = 0.0

    def _time_fetches(self, trainer: L.Trainer) -> bool:
        """Time the training loop's `next(loader)`; False if Lightning offers no hooks around it."""

        def before_fetch() -> None:
            self._wait_fetch = self._runqueue()
            self._fetch_start = time.perf_counter()

        def after_fetch() -> None:
            self._fetch_s += time.perf_counter() - self._fetch_start
            self._data_wait_s += self._runqueue() - self._wait_fetch

        return wrap_fetch_hooks(trainer, before_fetch, after_fetch)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Only inside fit (`validate` alone also ends here, with nothing started) and after the sanity check.
        if self.enabled and trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._last_end = time.perf_counter()  # mid-epoch validation is not data wait
            self._wait_last = self._runqueue()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if not self.enabled:
            return
        if not self._step.micro_batches:  # the first batch of an optimizer step
            self._global_step = trainer.global_step
            self._timing = self._steps >= self.warmup_steps and self._steps % self._every == 0
            self._comm.clear()
            self._comm_wait.clear()
        self._wait_start = self._runqueue()
        self._start = time.perf_counter()
        self._samples = extract_batch_size(batch)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if not self.enabled:
            return
        if self._timing and self._cuda:
            torch.cuda.synchronize(self._device)
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
        if trainer.global_step != self._global_step:
            self._end_step()
            if self.report_every_n_steps and self._steps % self.report_every_n_steps == 0:
                self._report(trainer, pl_module, self._window)
                self._window = _Totals()
            if self._cuda and self._steps >= self.warmup_steps and self._steps % self._every == 0:
                torch.cuda.synchronize(self._device)  # the next step is timed: start it with an idle device
        self._last_end = time.perf_counter()
        self._wait_last = self._runqueue()

    def _end_step(self) -> None:
        """Add the optimizer step that just ended to the totals, unless it is a warm-up step."""
        step, self._step = self._step, _Totals()
        if self._steps >= self.warmup_steps:
            step.steps = 1
            if self._timing:
                comm = self._comm_seconds()
                # Summed over threads: may exceed the span when two waited at once; the span bounds it.
                wait = min(max(0.0, self._comm_wait[1] - self._comm_wait[0]), comm) if self._comm_wait else 0.0
                step.timed_steps, step.comm_s, step.comm_cpu_wait_s = 1, comm, wait
                self._step_comm.append(comm - wait)
            self._total.add(step)
            self._window.add(step)
        self._steps += 1

    # ---- report ------------------------------------------------------------------------------------------
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.enabled:
            return
        gc.callbacks.remove(self._time_gc)
        self._runqueue.close()
        if self._threads is not None:
            self._threads.close()
        if self._comm_measured:
            self._latency_ms = _allreduce_latency_ms(self._device)
        summary = self._report(trainer, pl_module, self._total)
        log_dir = trainer.log_dir  # a collective: every rank asks
        # Without a logger log_dir is default_root_dir (often the project itself): no run directory to write to.
        if self.summary_file and log_dir and trainer.logger is not None:
            _write_json(Path(log_dir) / self.summary_file, summary.to_dict())

    def _report(self, trainer: L.Trainer, pl_module: L.LightningModule, totals: _Totals) -> DoctorRecord:
        """Gather every rank's numbers (all ranks must call this), print and log them on rank 0."""
        index = float(self._device.index if self._device.index is not None else -1)
        row = totals.row(float(trainer.node_rank), index, self._peak_memory())
        row = torch.tensor(row, dtype=torch.float64, device=self._device)
        rows = trainer.strategy.all_gather(row).reshape(trainer.world_size, -1).tolist()
        context = self._context(trainer, pl_module)
        if self._comm_measured:
            context["comm_step_min_ms"] = self._step_min_comm_ms(trainer, int(totals.timed_steps))
        s = summarize(rows, context)
        s.findings = diagnose(s, self.thresholds)
        s.verdict = s.findings[0]["cause"] if s.findings else "healthy"
        s.thresholds = asdict(self.thresholds)
        rank_zero_info(format_report(s))
        metrics = {f"doctor/{k}": float(getattr(s, k)) for k in _SCALARS}
        for r in s.ranks:
            metrics.update({f"doctor/rank{r.rank}/{k}": float(getattr(r, k)) for k in _RANK_SCALARS})
        for logger in trainer.loggers:  # loggers write on rank 0 only
            logger.log_metrics(metrics, step=trainer.global_step)
        self.summary = s
        return s

    def _step_min_comm_ms(self, trainer: L.Trainer, steps: int) -> float | None:
        """Mean over the report's last timed steps (at most STEP_SAMPLE) of the least all-reduce time of any
        rank in that step: the transfer itself. The rank that waits least on average still waited on the
        steps where another rank came later (ranks take turns at being last), which is jitter, not transfer
        (about a fifth of that rank's mean on 2 CPU processes: ddp-template's docs/measurements.md)."""
        own = list(self._step_comm)[-steps:] if steps else []
        tail = torch.full((STEP_SAMPLE,), float("nan"), dtype=torch.float64)
        if own:
            tail[-len(own) :] = torch.tensor(own, dtype=torch.float64)
        every = trainer.strategy.all_gather(tail.to(self._device)).reshape(trainer.world_size, -1).cpu()
        steps_all_timed = ~torch.isnan(every).any(dim=0)  # aligned at the end: the same last steps
        if not steps_all_timed.any():
            return None
        return 1000 * every[:, steps_all_timed].min(dim=0).values.mean().item()

    def _peak_memory(self) -> float:
        if self._cuda:
            return float(torch.cuda.max_memory_allocated(self._device))
        return float(host_peak_rss())

    def _context(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict:
        loader = trainer.train_dataloader
        grads = sum(p.numel() * p.element_size() for p in pl_module.parameters() if p.requires_grad)
        return {
            "ddpkit_version": __version__,  # the code behind these numbers and this verdict
            "device": self._device.type,
            "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
            "comm_measured": self._comm_measured,
            "allreduce_latency_ms": self._latency_ms,
            "data_measured": self._data_measured,
            "grad_mb": grads / 2**20,
            "num_workers": getattr(loader, "num_workers", None),
            "pin_memory": getattr(loader, "pin_memory", None),
            "cpu_threads_per_rank": torch.get_num_threads(),
            "cpu_cores_visible": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            # Other processes competing for the CPU slow every rank alike; no verdict sees that, so print it.
            "host_load_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        }


# Timed steps whose all-reduce time every rank keeps for the per-step minimum: 32 KB gathered per rank.
STEP_SAMPLE = 4096

_SCALARS = (
    "samples_per_s",
    "samples_per_s_per_device",
    "steps_per_s",
    "step_ms",
    "data_wait_pct",
    "comm_pct",
    "cpu_wait_pct",
    "straggler_spread",
    "straggler_wait_pct",
    "memory_imbalance",
)
_RANK_SCALARS = ("samples_per_s", "step_ms", "data_ms", "compute_ms", "comm_ms", "cpu_wait_ms", "peak_mem_mb")


def _allreduce_latency_ms(device: torch.device, reps: int = 20) -> float:
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


@rank_zero_only
def _write_json(path: Path, summary: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2) + "\n")


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
