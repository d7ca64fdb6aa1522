"""The scaling doctor: the Lightning callback that measures, on every rank, where each training step goes, and
says why N devices are not N times faster.

`ScalingDoctor` wires Lightning's hooks to the per-step measurement of measure.py (`StepMeter`: data wait,
compute, comm, other, cpu wait, garbage collection per optimizer step; what each part is, there) and reports.
At the end of fit (and every `report_every_n_steps` steps when set) every rank contributes its numbers to one
`all_gather`; rank 0 prints the report, writes `doctor.json` (a `record.DoctorRecord`) into the run's log
directory (with a logger), and the loggers get the same numbers as `doctor/*` scalars. The verdict follows the
thresholds of `Thresholds`.
"""

import gc
import json
import os
from dataclasses import asdict
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn
from torch.nn.parallel import DistributedDataParallel

from .. import __version__
from ..lightning_internals import ddp_comm_hook, wrap_fetch_hooks
from .diagnosis import Thresholds, diagnose, format_report, summarize
from .measure import STEP_SAMPLE, StepMeter, Totals, allreduce_latency_ms, peak_memory
from .record import DoctorRecord


class ScalingDoctor(L.Callback):
    """Measures data wait, compute, gradient all-reduce, throughput and peak memory on every rank and reports
    why N devices are not N times faster. Turn it off with `--doctor.enabled false`
    (the manual: vendor/ddpkit/docs/doctor.md), or `enabled: false` under `doctor:` in a config file.

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
        self._meter = StepMeter(self._device, self.warmup_steps, self.cuda_sample_every, trainer.global_step)
        # A GlobalBatchDataModule's training batches all hold its micro-batch; otherwise Lightning's rule (the first
        # tensor's length) counts each batch, which for a detector's batch (a tuple of images of their own sizes,
        # torchvision's `tuple(zip(*samples))`) is the first image's channels.
        micro_batch = getattr(trainer.datamodule, "micro_batch", None)
        self._samples = micro_batch() if callable(micro_batch) else None
        self._comm_measured = False
        gc.callbacks.append(self._meter.time_gc)
        self._latency_ms: float | None = None
        # The training loop's `next(loader)`, timed; False if Lightning offers no hooks around it.
        self._data_measured = wrap_fetch_hooks(trainer, self._meter.before_fetch, self._meter.after_fetch)
        if not self._data_measured:
            rank_zero_warn("ScalingDoctor: cannot time the data fetch with this Lightning version; data wait is 0.")
        model = trainer.strategy.model
        # The strategy has wrapped the model by now and no backward has run yet: the last moment to add a hook.
        if self.measure_comm and isinstance(model, DistributedDataParallel):
            if ddp_comm_hook(trainer.strategy) is not None:
                rank_zero_warn("ScalingDoctor: a DDP comm hook is already registered; all-reduce time not measured.")
            else:
                model.register_comm_hook(model.process_group, self._meter.timed_allreduce)
                self._comm_measured = True

    # ---- per step ----------------------------------------------------------------------------------------
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.enabled:
            return
        self._meter.epoch_start()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Only inside fit (`validate` alone also ends here, with nothing started) and after the sanity check.
        if self.enabled and trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._meter.restart_clock()  # mid-epoch validation is not data wait

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if not self.enabled:
            return
        self._meter.batch_start(trainer.global_step, batch, self._samples)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if not self.enabled:
            return
        meter = self._meter
        ended = meter.batch_end(trainer.global_step)  # an optimizer step ended with this batch
        if ended and self.report_every_n_steps and meter.steps % self.report_every_n_steps == 0:
            self._report(trainer, pl_module, meter.take_window())
        meter.next_batch(ended)

    # ---- report ------------------------------------------------------------------------------------------
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.enabled:
            return
        gc.callbacks.remove(self._meter.time_gc)
        self._meter.close()
        if self._comm_measured:
            self._latency_ms = allreduce_latency_ms(self._device)
        summary = self._report(trainer, pl_module, self._meter.total)
        log_dir = trainer.log_dir  # a collective: every rank asks
        # Without a logger log_dir is default_root_dir (often the project itself): no run directory to write to.
        if self.summary_file and log_dir and trainer.logger is not None:
            _write_json(Path(log_dir) / self.summary_file, summary.to_dict())

    def _report(self, trainer: L.Trainer, pl_module: L.LightningModule, totals: Totals) -> DoctorRecord:
        """Gather every rank's numbers (all ranks must call this), print and log them on rank 0."""
        index = float(self._device.index if self._device.index is not None else -1)
        row = totals.row(float(trainer.node_rank), index, peak_memory(self._device))
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
        own = list(self._meter.step_comm)[-steps:] if steps else []
        tail = torch.full((STEP_SAMPLE,), float("nan"), dtype=torch.float64)
        if own:
            tail[-len(own) :] = torch.tensor(own, dtype=torch.float64)
        every = trainer.strategy.all_gather(tail.to(self._device)).reshape(trainer.world_size, -1).cpu()
        steps_all_timed = ~torch.isnan(every).any(dim=0)  # aligned at the end: the same last steps
        if not steps_all_timed.any():
            return None
        return 1000 * every[:, steps_all_timed].min(dim=0).values.mean().item()

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


@rank_zero_only
def _write_json(path: Path, summary: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2) + "\n")


# Defined in this module before measure.py held it: tests import it from the doctor, so it stays importable here.
from .measure import host_peak_rss  # noqa: E402,F401
