"""Every private name of Lightning, torch or torchmetrics that ddpkit relies on, in one place.

Each is a debt: a new release may rename or remove it. ddpkit's own tests check every name in `PRIVATE_NAMES`
(and the behaviour of the helpers below) and fail naming the Lightning and torch versions, so an upgrade says
at once what moved; they also fail when any other module of ddpkit uses a private name of Lightning or torch.
Tested at the supported ranges' ends: Lightning 2.5.1 with torch 2.4.0, Lightning 2.6.6 with torch 2.13.0. Names
that the oldest releases lack are in SINCE (Lightning's) and TORCH_SINCE (torch's), with the release that added each.
"""

import functools
import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as checkpoint_wrapper
import torch.distributed.fsdp
from lightning.pytorch.callbacks import ModelCheckpoint, ThroughputMonitor
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loops.fit_loop import _FitLoop
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from torch.nn.modules.batchnorm import _BatchNorm as BatchNormBase  # every BatchNorm*d, and SyncBatchNorm
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401 (testing/float64.py's base class)
from torchmetrics import Metric

# (owner, attribute): what must exist for the helpers below to work. Instance attributes (a DDPStrategy's
# `_timeout`, `_ddp_comm_hook` and `_ddp_kwargs`, a ThroughputMonitor's `_throughputs`) are tested through their
# helpers.
PRIVATE_NAMES: list[tuple[Any, str]] = [
    (LightningCLI, "_run_subcommand"),
    (_TrainingEpochLoop, "_on_before_fetch"),
    (_TrainingEpochLoop, "_on_after_fetch"),
    (ModelCheckpoint, "_should_save_on_train_epoch_end"),
    (ModelCheckpoint, "_should_skip_saving_checkpoint"),
    (ModelCheckpoint, "_save_last_checkpoint"),
    (ModelCheckpoint, "_monitor_candidates"),
    (torch.distributed.distributed_c10d, "_set_pg_timeout"),
    (checkpoint_wrapper, "apply_activation_checkpointing"),
    (_FitLoop, "_load_combined_loader_states"),
    (torch.nn.modules.batchnorm, "_BatchNorm"),
    (BatchNormBase, "_check_input_dim"),
    (torch.distributed.distributed_c10d, "_get_default_store"),
    (DDPStrategy, "_setup_model"),  # CurrentStreamDDPStrategy
    (Metric, "_sync_dist"),  # gather_uneven_lists; a metric's `_reductions` and `_defaults` are tested through it
    # The base class of a mode that sees every operator, in backward passes too; public in the docs, private by path.
    (torch.utils._python_dispatch, "TorchDispatchMode"),
]


# (owner, attribute, the Lightning release that added it): names that the oldest supported release (2.5.1) lacks;
# the helper that uses one does without it there.
SINCE: list[tuple[Any, str, str]] = [
    (_TrainingEpochLoop, "_broadcast_sigterm_tensor", "2.5.2"),
]


class SubcommandCLI(LightningCLI):
    """`LightningCLI` with a public method around the whole run of a subcommand, which Lightning lacks.

    Lightning runs `before_fit`, `trainer.fit` and `after_fit` from its private `_run_subcommand`; a failure in
    any of them is seen only by overriding it. Override `run_subcommand` instead.
    """

    def _run_subcommand(self, subcommand: str) -> None:
        self.run_subcommand(subcommand)

    def run_subcommand(self, subcommand: str) -> None:
        """Run `before_<subcommand>`, the trainer's `<subcommand>` and `after_<subcommand>`."""
        super()._run_subcommand(subcommand)


def plain_callables(module: Any) -> None:
    """Each class argument a module keeps as jsonargparse built it (an `OptimizerCallable`, `LRSchedulerCallable`:
    `partial(call_without_instantiate_context, instantiator, cls, **kwargs)`, jsonargparse 4.53) becomes
    `partial(cls, **kwargs)`, which makes the same object. jsonargparse's instantiator holds the CLI, and through it
    the trainer: a copy of a module that keeps one (`self.optimizer`, as LightningCLI's docs write it) copied the
    whole CLI, and on rank 0 of a multi-process run failed on the launcher's processes ("cannot pickle
    '_thread.lock' object": Lightning's EMAWeightAveraging). Other forms are left as they are."""
    for name, value in list(vars(module).items()):
        if (
            isinstance(value, functools.partial)
            and getattr(value.func, "__name__", "") == "call_without_instantiate_context"
            and len(value.args) >= 2
            and isinstance(value.args[1], type)
        ):
            setattr(module, name, functools.partial(value.args[1], *value.args[2:], **value.keywords))


def is_subprocess_launcher(launcher: Any) -> bool:
    """Lightning's launcher that starts ranks 1..N-1 as `python main.py ...` (CPU and GPU DDP)."""
    return isinstance(launcher, _SubprocessScriptLauncher)


def launched_processes(launcher: Any) -> list[Any]:
    """The `subprocess.Popen`s of the ranks a subprocess launcher started (it rebuilds the list per launch)."""
    return list(getattr(launcher, "procs", []))


def ddp_timeout(strategy: DDPStrategy) -> timedelta | None:
    """The collective timeout a DDPStrategy will give its process group."""
    return strategy._timeout


def set_ddp_timeout(strategy: DDPStrategy, timeout: timedelta) -> None:
    strategy._timeout = timeout


def ddp_kwargs(strategy: DDPStrategy) -> dict[str, Any]:
    """The arguments a DDPStrategy passes on to torch's DistributedDataParallel (`find_unused_parameters`, ...), as
    given to it or by the registered name it was built from (`ddp_find_unused_parameters_true`)."""
    return dict(strategy._ddp_kwargs)


def ddp_comm_hook(strategy: Any) -> Callable | None:
    """The DDP communication hook a DDPStrategy was given (`ddp_comm_hook=`, registered by Lightning on CUDA);
    None for other strategies."""
    return getattr(strategy, "_ddp_comm_hook", None)


def set_throughput_peak(monitor: ThroughputMonitor, peak_flops: float) -> None:
    """Make a ThroughputMonitor compute MFU against `peak_flops`, after its `setup` chose its own figure."""
    monitor.available_flops = peak_flops
    for throughput in monitor._throughputs.values():  # one per stage, built by setup with the old figure
        throughput.available_flops = peak_flops


def apply_activation_checkpointing(model: torch.nn.Module, check_fn: Callable[[torch.nn.Module], bool]) -> None:
    """Recompute the activations of each submodule for which `check_fn` is true during backward (in place).

    torch's own module wrapper (non-reentrant); state-dict keys stay unchanged. torch 2.13 has no public
    equivalent for modules (`torch.utils.checkpoint` wraps a function call).
    """
    checkpoint_wrapper.apply_activation_checkpointing(model, check_fn=check_fn)


def set_process_group_timeout(timeout: timedelta) -> None:
    """Change the default process group's collective timeout after it was created with another one."""
    torch.distributed.distributed_c10d._set_pg_timeout(timeout)


def skip_sigterm_broadcast(trainer: Any) -> None:
    """Switch off Lightning's per-step broadcast of rank 0's SIGTERM flag (a blocking collective; from 2.5.2 on,
    before which there is none to switch off).

    An instance attribute shadows the loop's method; `restore_sigterm_broadcast` removes it.
    """
    if hasattr(type(trainer.fit_loop.epoch_loop), "_broadcast_sigterm_tensor"):
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = _no_broadcast


def restore_sigterm_broadcast(trainer: Any) -> None:
    vars(trainer.fit_loop.epoch_loop).pop("_broadcast_sigterm_tensor", None)


def _no_broadcast() -> None:
    """Stands in for Lightning's per-step SIGTERM broadcast."""


def wrap_fetch_hooks(trainer: Any, before: Callable[[], None], after: Callable[[], None]) -> bool:
    """Call `before`/`after` around the training loop's `next(loader)`; False when the loop has no such hooks.

    The loop hands its `_on_before_fetch`/`_on_after_fetch` (profiler hooks) to each epoch's data
    fetcher; instance attributes chained onto them are called on every fetch.
    """
    loop = trainer.fit_loop.epoch_loop
    old_before, old_after = getattr(loop, "_on_before_fetch", None), getattr(loop, "_on_after_fetch", None)
    if old_before is None or old_after is None:
        return False

    def before_fetch() -> None:
        old_before()
        before()

    def after_fetch() -> None:
        after()
        old_after()

    loop._on_before_fetch, loop._on_after_fetch = before_fetch, after_fetch
    return True


def save_last_checkpoint_if_skipped(callback: ModelCheckpoint, trainer: Any) -> None:
    """Write `last.ckpt` now unless this step was already saved (Lightning 2.6.6 skips it when no top-k
    checkpoint was written at the same step)."""
    if callback.save_last and not callback._should_skip_saving_checkpoint(trainer):
        callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))


def saves_on_train_epoch_end(callback: ModelCheckpoint, trainer: Any) -> bool:
    """Whether the callback saves at the end of the training epoch (else after validation)."""
    return callback._should_save_on_train_epoch_end(trainer)


def load_pending_train_loader_states(trainer: Any) -> None:
    """Give the train loaders the positions a resumed fit restored, when Lightning would drop them.

    Lightning 2.6 loads a checkpoint's loader states while it builds the train loader in `setup_data`. A
    `configure_optimizers` that reads `trainer.estimated_stepping_batches` (a schedule's total steps) builds
    the loader before the checkpoint is restored, so `setup_data` returns early and a mid-epoch resume
    replays the epoch from its start (Lightning issue #20550, open in 2.6.6). Called once training starts,
    before the first epoch's loader iterator exists; a no-op when nothing is pending.
    """
    trainer.fit_loop._load_combined_loader_states()


def check_batchnorm_input(input: torch.Tensor) -> None:
    """What a BatchNorm layer of any dimension accepts: (N, C, ...)."""
    if input.dim() < 2:
        raise ValueError(f"expected an input of 2 or more dimensions (N, C, ...), got {input.dim()}")


class AnyDimBatchNorm(BatchNormBase):
    """A BatchNorm layer for 1d, 2d and 3d inputs alike: torch's BatchNorm1d/2d/3d differ only in the input
    check, a private method; one class can stand in for all three."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        check_batchnorm_input(input)


def default_store() -> Any:
    """The key-value store the default process group was created with (`init_process_group`'s rendezvous), which
    stays reachable when a collective hangs; torch 2.13 has no public accessor for it."""
    return torch.distributed.distributed_c10d._get_default_store()


# ---- torch: names that arrived inside the supported range (torch 2.4 on) ----------------------------------------
# (owner, attribute, the torch release that added it): names that the oldest supported torch (2.4.0) lacks; the
# helper that uses one takes the older name, or does without it, there.
TORCH_SINCE: list[tuple[Any, str, str]] = [
    (torch.distributed.fsdp, "fully_shard", "2.6"),  # before: torch.distributed._composable.fsdp (still there)
    (torch._C._distributed_c10d, "_dump_fr_trace_json", "2.8"),  # before: NCCL's recorder only, nothing for gloo
]


def fully_shard_function() -> Callable:
    """FSDP2's `fully_shard`: public in `torch.distributed.fsdp` from torch 2.6, in the private
    `torch.distributed._composable.fsdp` from 2.4 (where 2.6 on keeps the same function)."""
    if hasattr(torch.distributed.fsdp, "fully_shard"):
        return torch.distributed.fsdp.fully_shard
    from torch.distributed._composable.fsdp import fully_shard

    return fully_shard


def records_gloo_collectives() -> bool:
    """Whether this torch's flight recorder records gloo's collectives (2.8 on; before, only NCCL had one)."""
    return hasattr(torch._C._distributed_c10d, "_dump_fr_trace_json")


def flight_recorder_entries() -> list[dict]:
    """This process's flight-recorder entries, oldest first: one per collective it issued, in every process group
    (`collective_seq_id`, `profiling_name` like "gloo:all_reduce", `process_group`); [] when the recorder is off
    (TORCH_FR_BUFFER_SIZE=0) or this torch has none for gloo (before 2.8). torch's only accessor is private; its
    `fr_trace` tool reads the same records."""
    if not records_gloo_collectives():
        return []
    return json.loads(torch._C._distributed_c10d._dump_fr_trace_json(True, False)).get("entries", [])


# --- DDP built on the stream the steps run on ----------------------------------------------------------------------


class CurrentStreamDDPStrategy(DDPStrategy):
    """`DDPStrategy` that wraps the model in `DistributedDataParallel` on the current CUDA stream, as plain torch does.

    Lightning up to 2.6.6 builds it inside `torch.cuda.stream(torch.cuda.Stream())`, a new side stream, in its private
    `_setup_model`. DDP's reducer creates the parameters' AccumulateGrad nodes there and keeps them for the whole
    fit, while every forward and backward runs on the default stream: each backward then joins the two streams, and
    torch (2.11 on an H200) warns on every GPU fit that "The AccumulateGrad node's stream does not match the stream
    of the node that produced the incoming gradient". Lightning issue #21567; fixed on its master after 2.6.6 (PR
    #21746). On CPU nothing changes: Lightning uses no stream there either.
    """

    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        return DistributedDataParallel(module=model, device_ids=self.determine_ddp_device_ids(), **self._ddp_kwargs)


def gather_uneven_lists(metric: Metric) -> bool:
    """Let `metric` sync its list states without a reduction (`dist_reduce_fx=None`: an entry per update or per sample,
    as MeanAveragePrecision's boxes of each image, the retrieval metrics' batches) when the ranks hold different
    numbers of entries. torchmetrics gathers such a list one entry at a time, a collective per entry: a rank holding
    fewer leaves the others in a collective it never joins, and gloo fails ("Received data size doesn't match
    expected size") where NCCL waits out the timeout (torchmetrics issue #3199, open). ddpkit's evaluation deals the
    samples round-robin without repeats, so ranks hold a sample less whenever the set does not divide by the device
    count. Such a list is then gathered whole, entry by entry across the ranks: the 1-device order of round-robin
    shares. Lists of even length, and the other states, sync as torchmetrics syncs them. Returns whether the metric
    has such a state."""
    if not _uneven_candidates(metric):
        return False
    if not isinstance(metric.__dict__.get("_sync_dist"), functools.partial):  # once per metric
        metric._sync_dist = functools.partial(_sync_uneven_lists, metric)
    return True


def _uneven_candidates(metric: Metric) -> list[str]:
    return [name for name, fx in metric._reductions.items() if fx is None and isinstance(metric._defaults[name], list)]


def _sync_uneven_lists(metric: Metric, dist_sync_fn: Callable | None = None, process_group: Any = None) -> None:
    group = process_group or metric.process_group
    names = _uneven_candidates(metric)
    mine = [(len(getattr(metric, n)), all(isinstance(e, torch.Tensor) for e in getattr(metric, n))) for n in names]
    every = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(every, mine, group=group)
    # Lists of tensors on every rank (MeanAveragePrecision's segmentation masks, tuples, it gathers itself).
    uneven = [n for i, n in enumerate(names) if len({r[i][0] for r in every}) > 1 and all(r[i][1] for r in every)]
    if uneven:
        shares = [None] * len(every)
        local = [[entry.cpu() for entry in getattr(metric, name)] for name in uneven]
        torch.distributed.all_gather_object(shares, local, group=group)
        for i, name in enumerate(uneven):
            longest = max(len(share[i]) for share in shares)
            merged = [share[i][k] for k in range(longest) for share in shares if k < len(share[i])]
            setattr(metric, name, [entry.to(metric.device) for entry in merged])
    reductions = metric._reductions
    metric._reductions = {name: fx for name, fx in reductions.items() if name not in uneven}
    try:
        type(metric)._sync_dist(metric, dist_sync_fn, process_group=process_group)
    finally:
        metric._reductions = reductions


def grouped_mm_operator() -> Any:
    """The dispatcher's grouped matrix product (`aten::_grouped_mm`, what `torch._grouped_mm` and, from torch 2.10,
    `torch.nn.functional.grouped_mm` call), or None where this torch has none (2.4 has none; it landed in 2025)."""
    op = getattr(torch.ops.aten, "_grouped_mm", None)
    return None if op is None else op.default
