"""The scaling doctor: measures, on every rank, where each training step goes, and says why N devices are
not N times faster.

Per rank and per step it measures (host clock; CUDA events for the all-reduce on GPUs):

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

At the end of fit (and every `report_every_n_steps` batches when set) every rank contributes its numbers to
one `all_gather`; rank 0 prints the report, writes `doctor.json` into the run's log directory, and the
loggers get the same numbers as `doctor/*` scalars. The verdict follows the thresholds of `Thresholds`.

Cost: a few `perf_counter` calls and list appends per step, in Python floats; no `self.log`, no device sync
per step. On CUDA only one batch in `cuda_sample_every` is synchronised, to time its parts exactly.
"""

import json
import os
import resource
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning.pytorch.utilities.data import extract_batch_size
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

# Per-rank numbers, gathered as one float64 row per rank, in this order.
FIELDS = ("steps", "wall_s", "samples", "timed_steps", "data_s", "busy_s", "comm_s", "step_s", "peak_mem_bytes")


@dataclass
class Thresholds:
    """When the doctor calls something a problem. Shares are of the mean step time.

    Args:
        min_step_ms: Steps shorter than this do too little work: fixed per-step costs (Python, kernel
            launches, all-reduce latency) dominate and more devices cannot help.
        straggler_wait_share: Flag a straggler when the fastest rank waits this share of each step for the
            slowest: the difference of their own work (data wait + compute), which the fast rank spends
            waiting in the all-reduce. (A ratio of work alone misfires when work is a small part of the step.)
        data_wait_share: Flag data-bound when the ranks wait this share of each step for the next batch.
        comm_share: Flag communication-bound when the all-reduce takes this share of the step on the rank
            that waits least for it (the last to arrive sees the transfer, not the others' lateness).
        memory_imbalance: Flag when the largest per-rank peak memory is this many times the smallest.
    """

    min_step_ms: float = 10.0
    straggler_wait_share: float = 0.25
    data_wait_share: float = 0.2
    comm_share: float = 0.3
    memory_imbalance: float = 1.3


def covered_seconds(spans: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals: all-reduces of buckets that overlap count once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def summarize(rows: list[list[float]], context: dict) -> dict:
    """Turn the gathered per-rank rows (FIELDS) into the report's numbers, per rank and overall."""
    ranks = []
    for rank, row in enumerate(rows):
        r = dict(zip(FIELDS, row, strict=True))
        timed = max(r["timed_steps"], 1.0)
        step_ms = 1000 * r["step_s"] / timed
        data_ms, busy_ms, comm_ms = (1000 * r[k] / timed for k in ("data_s", "busy_s", "comm_s"))
        ranks.append(
            {
                "rank": rank,
                "samples_per_s": r["samples"] / r["wall_s"] if r["wall_s"] else 0.0,
                "batch": r["samples"] / r["steps"] if r["steps"] else 0.0,
                "step_ms": step_ms,
                "data_ms": data_ms,
                "compute_ms": busy_ms - comm_ms,
                "comm_ms": comm_ms,
                "other_ms": step_ms - data_ms - busy_ms,
                "work_ms": data_ms + busy_ms - comm_ms,  # the rank's own work; comm includes waiting for others
                "peak_mem_mb": r["peak_mem_bytes"] / 2**20,
            }
        )
    step_ms = sum(r["step_ms"] for r in ranks) / len(ranks)
    total = sum(r["samples_per_s"] for r in ranks)
    work = [r["work_ms"] for r in ranks]
    mem = [r["peak_mem_mb"] for r in ranks]
    return {
        **context,
        "world_size": len(ranks),
        "steps": int(min(row[0] for row in rows)),
        "samples_per_s": total,
        "samples_per_s_per_device": total / len(ranks),
        "steps_per_s": 1000 / step_ms if step_ms else 0.0,
        "step_ms": step_ms,
        "data_wait_pct": 100 * sum(r["data_ms"] for r in ranks) / len(ranks) / step_ms if step_ms else 0.0,
        "comm_pct": 100 * min(r["comm_ms"] / r["step_ms"] if r["step_ms"] else 0.0 for r in ranks),
        "straggler_spread": max(work) / min(work) if min(work) > 0 else 1.0,
        "straggler_wait_pct": 100 * (max(work) - min(work)) / step_ms if step_ms else 0.0,
        "memory_imbalance": max(mem) / min(mem) if min(mem) > 0 else 1.0,
        "ranks": ranks,
    }


def diagnose(s: dict, t: Thresholds) -> list[dict]:
    """Findings with their fix, most fundamental first; an empty list means healthy."""
    ranks = s["ranks"]
    if not s["step_ms"]:
        return [{"cause": "unmeasured", "fix": "no step after the warm-up steps was timed → train for more steps"}]
    found = []
    batch = round(ranks[0]["batch"])
    if s["memory_imbalance"] >= t.memory_imbalance:
        hi = max(ranks, key=lambda r: r["peak_mem_mb"])
        lo = min(ranks, key=lambda r: r["peak_mem_mb"])
        found.append(
            {
                "cause": "memory-imbalance",
                "fix": f"rank {hi['rank']} peaks at {s['memory_imbalance']:.1f}x the memory of rank {lo['rank']} "
                f"({hi['peak_mem_mb']:.0f} vs {lo['peak_mem_mb']:.0f} MB) → a tensor is pinned to one device or "
                "kept on one rank only (rank-0-only state, torch.device('cuda') instead of the rank's own device)",
            }
        )
    if s["step_ms"] < t.min_step_ms:
        found.append(
            {
                "cause": "too-little-work",
                "fix": f"steps take {s['step_ms']:.1f} ms (< {t.min_step_ms:g} ms): fixed per-step costs (Python, "
                "kernel launches, all-reduce latency) outweigh the work, so more devices cannot speed this up "
                f"→ raise the per-device batch (now {batch}) or the model size per step, or use fewer devices",
            }
        )
    if s["straggler_wait_pct"] >= 100 * t.straggler_wait_share:
        slow = max(ranks, key=lambda r: r["work_ms"])
        fast = min(ranks, key=lambda r: r["work_ms"])
        found.append(
            {
                "cause": "straggler",
                "fix": f"rank {slow['rank']} is a straggler: its own work takes {s['straggler_spread']:.1f}x "
                f"rank {fast['rank']}'s ({slow['work_ms']:.1f} vs {fast['work_ms']:.1f} ms per step), so the "
                f"others wait {s['straggler_wait_pct']:.0f}% of each step for it → check that rank's data shard and "
                "loader, its CPU cores (cores per rank), and other jobs or throttling on its device",
            }
        )
    if s["data_wait_pct"] >= 100 * t.data_wait_share:
        workers, pin = s.get("num_workers"), s.get("pin_memory")
        found.append(
            {
                "cause": "data-bound",
                "fix": f"{s['data_wait_pct']:.0f}% of each step waits for data → raise "
                f"--data.num_workers (now {workers}), set pin_memory=True (now {pin}) and "
                "persistent_workers=True, or make loading cheaper (decode/augment once, cache, faster disk)",
            }
        )
    if s["comm_pct"] >= 100 * t.comm_share:
        comm_ms = min(r["comm_ms"] for r in ranks)
        found.append(
            {
                "cause": "communication-bound",
                "fix": f"the gradient all-reduce is {s['comm_pct']:.0f}% of the step "
                f"({comm_ms:.1f} ms for {s.get('grad_mb', 0):.1f} MB of gradients) → larger per-device batch "
                f"(now {batch}), gradient accumulation (--trainer.accumulate_grad_batches), a larger DDP "
                "bucket_cap_mb, or a compressing comm hook (fp16/bf16)",
            }
        )
    return found


def format_report(s: dict) -> str:
    """The printed report: totals, one line per rank, the verdict and the fixes."""
    lines = [
        f"Scaling doctor: {s['world_size']} x {s['device']}, {s['steps']} steps, "
        f"{s['samples_per_s']:.0f} samples/s ({s['samples_per_s_per_device']:.0f} per device), "
        f"{s['steps_per_s']:.1f} steps/s",
        f"host: {s.get('cpu_cores_visible')} CPU cores, load {s.get('host_load_1min') or 0:.1f}, "
        f"{s.get('cpu_threads_per_rank')} torch threads per rank, {s.get('num_workers')} loader workers per rank",
        "rank | samples/s | step ms | data ms | compute ms | comm ms | other ms | peak MB",
    ]
    if not s.get("comm_measured", True):
        lines.append("comm not timed, counted in compute: --doctor.measure_comm true times it (costs ~1-2 ms/step)")
    for r in s["ranks"]:
        lines.append(
            f"{r['rank']:>4} | {r['samples_per_s']:>9.0f} | {r['step_ms']:>7.2f} | {r['data_ms']:>7.2f} | "
            f"{r['compute_ms']:>10.2f} | {r['comm_ms']:>7.2f} | {r['other_ms']:>8.2f} | {r['peak_mem_mb']:>7.0f}"
        )
    lines.append(
        f"data wait {s['data_wait_pct']:.0f}% | comm {s['comm_pct']:.0f}% | straggler spread "
        f"{s['straggler_spread']:.2f}x (fastest rank waits {s['straggler_wait_pct']:.0f}%) | "
        f"memory imbalance {s['memory_imbalance']:.2f}x"
    )
    load, cores = s.get("host_load_1min"), s.get("cpu_cores_visible")
    if load and cores and load > cores:
        lines.append(
            f"note: host load {load:.1f} > {cores} cores: other processes compete with the ranks for the CPU, "
            "so every time above is inflated (no verdict accounts for this)"
        )
    if not s["findings"]:
        lines.append("verdict: healthy (no bottleneck above the thresholds)")
    for f in s["findings"]:
        lines.append(f"verdict: {f['cause']}: {f['fix']}")
    return "\n".join(lines)


class _Totals:
    """Running sums of one rank's measurements, as plain floats."""

    def __init__(self) -> None:
        self.steps = self.wall_s = self.samples = 0.0
        self.timed_steps = self.data_s = self.busy_s = self.comm_s = self.step_s = 0.0

    def row(self, peak_mem_bytes: float) -> list[float]:
        return [getattr(self, name) for name in FIELDS[:-1]] + [peak_mem_bytes]


class ScalingDoctor(L.Callback):
    """Measures data wait, compute, gradient all-reduce, throughput and peak memory on every rank and reports
    why N devices are not N times faster. Turn it off with `--doctor.enabled false`
    (see README), or `enabled: false` under `doctor:` in a config file.

    Args:
        enabled: Measure and report; False makes every hook return at once.
        report_every_n_steps: Also report (and log) the numbers of the last N batches every N batches;
            0 reports only at the end of fit.
        warmup_steps: Batches at the start of fit left out of the numbers (first-step allocations, JIT).
        cuda_sample_every: On GPUs, time every N-th batch exactly (two device syncs per sample); the
            other batches count only towards throughput.
        summary_file: Name of the JSON summary written into the run's log directory; empty for none.
        measure_comm: Time the gradient all-reduce with a DDP comm hook. Off by default: a Python comm
            hook replaces DDP's built-in C++ all-reduce, which cost 1-2 ms per step on the benchmark's CPU
            steps (benchmarks/README.md); without it the all-reduce counts as compute. scaling.py turns
            it on.
        min_step_ms: See `Thresholds`.
        straggler_wait_share: See `Thresholds`.
        data_wait_share: See `Thresholds`.
        comm_share: See `Thresholds`.
        memory_imbalance: See `Thresholds`.
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
    ) -> None:
        self.enabled, self.report_every_n_steps, self.warmup_steps = enabled, report_every_n_steps, warmup_steps
        self.cuda_sample_every, self.summary_file = cuda_sample_every, summary_file
        self.measure_comm = measure_comm
        self.thresholds = Thresholds(min_step_ms, straggler_wait_share, data_wait_share, comm_share, memory_imbalance)
        self.summary: dict | None = None  # the last report's numbers, on every rank

    # ---- set-up -------------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.enabled:
            return
        self._device = pl_module.device
        self._cuda = self._device.type == "cuda"
        self._every = self.cuda_sample_every if self._cuda else 1  # a sync is free on the CPU: time every step
        self._total, self._window = _Totals(), _Totals()
        self._batches = 0
        self._last_end: float | None = None
        self._fetch_s, self._fetch_start = 0.0, 0.0  # this batch's time in the loader's next()
        self._timing = False  # is this batch's all-reduce timed?
        self._comm: list[tuple] = []  # this batch's all-reduce (start, end) pairs
        self._comm_measured = False
        self._data_measured = self._time_fetches(trainer)
        if not self._data_measured:
            rank_zero_warn("ScalingDoctor: cannot time the data fetch with this Lightning version; data wait is 0.")
        model = trainer.strategy.model
        # The strategy has wrapped the model by now and no backward has run yet: the last moment to add a hook.
        if self.measure_comm and isinstance(model, DistributedDataParallel):
            if getattr(trainer.strategy, "_ddp_comm_hook", None) is not None:
                rank_zero_warn("ScalingDoctor: a DDP comm hook is already registered; all-reduce time not measured.")
            else:
                model.register_comm_hook(model.process_group, self._timed_allreduce)
                self._comm_measured = True

    def _timed_allreduce(self, process_group, bucket):
        """DDP's default all-reduce, timed from launch until its future completes."""
        if not self._timing:
            return allreduce_hook(process_group, bucket)
        start = self._mark()

        def done(fut):
            # Runs when the all-reduce has finished (on CUDA: on a stream that waits for it).
            self._comm.append((start, self._mark()))
            return fut.value()

        return allreduce_hook(process_group, bucket).then(done)

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
        self._fetch_s = 0.0

    def _time_fetches(self, trainer: L.Trainer) -> bool:
        """Chain a timer onto the hooks around the training loop's `next(loader)`; False if there are none."""
        loop = trainer.fit_loop.epoch_loop
        before, after = getattr(loop, "_on_before_fetch", None), getattr(loop, "_on_after_fetch", None)
        if before is None or after is None:
            return False

        def before_fetch() -> None:
            before()
            self._fetch_start = time.perf_counter()

        def after_fetch() -> None:
            self._fetch_s += time.perf_counter() - self._fetch_start
            after()

        # Instance attributes: the loop hands these to each epoch's data fetcher.
        loop._on_before_fetch, loop._on_after_fetch = before_fetch, after_fetch
        return True

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.enabled and not trainer.sanity_checking:
            self._last_end = time.perf_counter()  # mid-epoch validation is not data wait

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if not self.enabled:
            return
        self._start = time.perf_counter()
        self._timing = self._batches >= self.warmup_steps and self._batches % self._every == 0
        self._comm.clear()
        self._samples = extract_batch_size(batch)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if not self.enabled:
            return
        if self._timing and self._cuda:
            torch.cuda.synchronize(self._device)
        end = time.perf_counter()
        if self._batches >= self.warmup_steps and self._last_end is not None:
            comm = self._comm_seconds() if self._timing else 0.0
            for t in (self._total, self._window):
                t.steps += 1
                t.wall_s += end - self._last_end
                t.samples += self._samples
                if self._timing:
                    t.timed_steps += 1
                    t.data_s += self._fetch_s
                    t.busy_s += end - self._start
                    t.comm_s += comm
                    t.step_s += end - self._last_end
        self._batches += 1
        self._fetch_s = 0.0
        if self.report_every_n_steps and self._batches % self.report_every_n_steps == 0:
            self._report(trainer, pl_module, self._window)
            self._window = _Totals()
        if self._cuda and self._batches >= self.warmup_steps and self._batches % self._every == 0:
            torch.cuda.synchronize(self._device)  # the next batch is timed: start it with an idle device
        self._last_end = time.perf_counter()

    # ---- report ------------------------------------------------------------------------------------------
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.enabled:
            return
        summary = self._report(trainer, pl_module, self._total)
        log_dir = trainer.log_dir  # a collective: every rank asks
        if self.summary_file and log_dir:
            _write_json(Path(log_dir) / self.summary_file, summary)

    def _report(self, trainer: L.Trainer, pl_module: L.LightningModule, totals: _Totals) -> dict:
        """Gather every rank's numbers (all ranks must call this), print and log them on rank 0."""
        row = torch.tensor(totals.row(self._peak_memory()), dtype=torch.float64, device=self._device)
        rows = trainer.strategy.all_gather(row).reshape(trainer.world_size, -1).tolist()
        s = summarize(rows, self._context(trainer, pl_module))
        s["findings"] = diagnose(s, self.thresholds)
        s["verdict"] = s["findings"][0]["cause"] if s["findings"] else "healthy"
        s["thresholds"] = asdict(self.thresholds)
        rank_zero_info(format_report(s))
        metrics = {f"doctor/{k}": float(s[k]) for k in _SCALARS}
        for r in s["ranks"]:
            metrics.update({f"doctor/rank{r['rank']}/{k}": float(r[k]) for k in _RANK_SCALARS})
        for logger in trainer.loggers:  # loggers write on rank 0 only
            logger.log_metrics(metrics, step=trainer.global_step)
        self.summary = s
        return s

    def _peak_memory(self) -> float:
        if self._cuda:
            return float(torch.cuda.max_memory_allocated(self._device))
        return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # Linux reports KiB

    def _context(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict:
        loader = trainer.train_dataloader
        grads = sum(p.numel() * p.element_size() for p in pl_module.parameters() if p.requires_grad)
        return {
            "device": self._device.type,
            "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
            "comm_measured": self._comm_measured,
            "data_measured": self._data_measured,
            "grad_mb": grads / 2**20,
            "num_workers": getattr(loader, "num_workers", None),
            "pin_memory": getattr(loader, "pin_memory", None),
            "cpu_threads_per_rank": torch.get_num_threads(),
            "cpu_cores_visible": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            # Other processes competing for the CPU slow every rank alike; no verdict sees that, so print it.
            "host_load_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        }


_SCALARS = (
    "samples_per_s",
    "samples_per_s_per_device",
    "steps_per_s",
    "step_ms",
    "data_wait_pct",
    "comm_pct",
    "straggler_spread",
    "straggler_wait_pct",
    "memory_imbalance",
)
_RANK_SCALARS = ("samples_per_s", "step_ms", "data_ms", "compute_ms", "comm_ms", "peak_mem_mb")


@rank_zero_only
def _write_json(path: Path, summary: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2) + "\n")
