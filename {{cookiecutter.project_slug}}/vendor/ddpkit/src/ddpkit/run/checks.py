"""Checks that refuse a configuration, or warn about it, before training starts and mostly before any rank starts:
one line that says what to change, not a failure after ranks start or files are written (`cli.CLI` runs them).

- Right after parsing, before any model, rank or file exists: `match_torchrun`, `check_config` (GPUs asked vs
  visible, the global batch over the processes, `check_checkpoint`, sharding on CPU before torch 2.6),
  `init_args.warn_carried_init_args` (a class switch that keeps config.yaml's values).
- Once the model and the data module are built, still before any rank starts: `check_optimizer_flags`,
  `check_micro_batches`, `check_state_dict_fits`, `plain_datamodule_warning`.
- Once fit has built the training loaders, before the first step: `IterableDataCheck` (`iterable_data_warning`).

A refusal raises `BadInput` (as `ckpt_paths.resolve_ckpt_path` does); the CLI prints its message as one `error:`
line and exits with status 2.
"""

import os
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from torch.utils.data import IterableDataset

from .. import __version__
from ..data.global_batch import GlobalBatchDataModule
from ..model.losses import spans_global_batch
from ..model.sharding import shards_on_cpu
from .checkpoints import VERSION_KEY
from .init_args import init_arguments
from .processes import rank_label

# `--ckpt_path` values that name a checkpoint Lightning finds itself rather than a file (SLURM requeue's).
LIGHTNING_CKPT_PATHS = {"hpc"}


class BadInput(Exception):
    """A configuration that cannot work; the message says what to change."""


# --- right after parsing: before any model, rank or file exists -----------------------------------------------


def match_torchrun(trainer: Any) -> None:
    """Under torchrun, `devices: auto` means the processes torchrun started on this node (and `num_nodes: 1`
    all its nodes); a shape that contradicts torchrun's is refused before any process group forms."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not hasattr(trainer, "get"):
        return
    local, world = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["WORLD_SIZE"])
    if str(trainer.get("devices", "auto")) in ("auto", "-1"):
        trainer["devices"] = local
    if int(trainer.get("num_nodes") or 1) == 1 and world > local:
        trainer["num_nodes"] = world // local
    devices, nodes = str(trainer["devices"]), int(trainer.get("num_nodes") or 1)
    devices = int(devices) if devices.isdigit() else None  # a list of device ids is Lightning's to check
    if devices is not None and devices * nodes != world:
        raise BadInput(
            f"torchrun started {world} processes ({local} per node), but --trainer.devices {devices} "
            f"--trainer.num_nodes {nodes} makes {devices * nodes}: set --trainer.devices {local} and "
            f"--trainer.num_nodes {world // local}, or leave devices at auto."
        )


def check_config(config: Any) -> None:
    """Refuse configurations that would fail only after ranks start or files are written."""
    trainer, data = config.get("trainer") or {}, config.get("data") or {}
    world = world_size(trainer)
    init_args = (data.get("init_args") or {}) if hasattr(data, "get") else {}
    batch = init_args.get("global_batch_size")
    if world and isinstance(batch, int) and batch % world:
        suggestion = batch - batch % world or world
        raise BadInput(
            f"global_batch_size={batch} does not divide evenly over {world} processes: set "
            f"--data.global_batch_size to a multiple of {world} (e.g. {suggestion}) or change --trainer.devices."
        )
    ckpt_path = config.get("ckpt_path")
    if ckpt_path and str(ckpt_path) not in LIGHTNING_CKPT_PATHS and "://" not in str(ckpt_path):
        check_checkpoint(str(ckpt_path), config.get("model"))
    check_sharding_device(trainer)


def check_sharding_device(trainer: Any) -> None:
    """Refuse sharded training (FSDP2) on CPU processes where torch runs it only on GPUs (before 2.6), instead of
    the CUDA error every rank would raise."""
    strategy = trainer.get("strategy") if hasattr(trainer, "get") else None
    path = strategy.get("class_path") if hasattr(strategy, "get") else strategy
    accelerator = str(trainer.get("accelerator", "auto")) if hasattr(trainer, "get") else "auto"
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    if str(path).endswith("ModelParallelStrategy") and on_cpu and not shards_on_cpu():
        raise BadInput(
            f"ModelParallelStrategy (FSDP2) runs on CPU processes from torch 2.6; this is torch {torch.__version__}: "
            "train it on GPUs, or use DDP on CPU (vendor/ddpkit/docs/versions.md)."
        )


def world_size(trainer: Any) -> int | None:
    """Processes the trainer config asks for; refuses more GPUs than are visible. None when unknown."""
    accelerator, devices = str(trainer.get("accelerator", "auto")), trainer.get("devices", "auto")
    num_nodes = int(trainer.get("num_nodes") or 1)
    gpus = torch.cuda.device_count()
    wants_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and gpus > 0)
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    if isinstance(devices, (list, tuple)) or (isinstance(devices, str) and "," in devices):
        count = len([d for d in (devices if isinstance(devices, (list, tuple)) else devices.split(",")) if str(d)])
    elif isinstance(devices, int) and devices > 0:
        count = devices
    elif devices == "auto" or devices == -1:
        count = gpus if wants_gpu else 1 if accelerator in ("cpu", "auto") else None
    else:
        return None
    if wants_gpu and (count and count > gpus or not gpus):
        visible = f"only {gpus} GPU{'s' if gpus != 1 else ''} visible" if gpus else "no CUDA GPU is visible"
        fix = f"use --trainer.devices {gpus} or fewer" if gpus else "use --trainer.accelerator cpu"
        asked = f"--trainer.devices asks for {count} GPUs" if count else f"--trainer.accelerator {accelerator}"
        raise BadInput(f"{asked} but {visible}: {fix}.")
    return count * num_nodes if count else None


def load_lazily(ckpt_path: str) -> Any:
    """The checkpoint, weights-only, with tensors memory-mapped: the checks read names, shapes and
    hyperparameters, so a multi-GB file costs them next to nothing (Lightning reads it once more to resume)."""
    try:
        return torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as error:
        if "mmap" not in str(error):  # only the legacy (pre-zip) format cannot be mapped
            raise
        return torch.load(ckpt_path, map_location="cpu", weights_only=True)


def check_checkpoint(ckpt_path: str, model_config: Any) -> None:
    """The checkpoint exists, loads without running code, and was saved by the configured model class."""
    if Path(ckpt_path).is_dir():
        # A sharded (distributed) checkpoint, e.g. from configs/model_parallel.yaml: torch's loader checks
        # it shard by shard, so only its index is checked here.
        if not (Path(ckpt_path) / ".metadata").is_file():
            raise BadInput(f"--ckpt_path {ckpt_path} is a directory without a sharded checkpoint's .metadata.")
        return
    if not Path(ckpt_path).is_file():
        raise BadInput(f"--ckpt_path {ckpt_path} does not exist: pass an existing .ckpt file (or 'last').")
    try:
        checkpoint = load_lazily(ckpt_path)
    except Exception as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise BadInput(
            f"--ckpt_path {ckpt_path} is not a checkpoint that loads as plain weights ({first}). "
            "Use a checkpoint written by this project; see vendor/ddpkit/docs/faults.md, 'Untrusted files'."
        ) from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise BadInput(f"--ckpt_path {ckpt_path} is not a Lightning checkpoint (no 'state_dict').")
    hparams = dict(checkpoint.get("hyper_parameters") or {})
    saved_class = hparams.pop("_class_path", None)
    hparams.pop("_instantiator", None)
    configured = model_config.get("class_path") if hasattr(model_config, "get") else None
    saved_version = checkpoint.get(VERSION_KEY)
    if saved_version and saved_version != __version__ and rank_label() == "0":
        # Defaults, checkpoint contents or the resume logic may have changed between the two versions.
        sys.stderr.write(
            f"warning: --ckpt_path {ckpt_path} was written by ddpkit {saved_version}; this is ddpkit {__version__}: "
            "compare the two versions' changes before trusting a resumed run to match an uninterrupted one\n"
        )
    if saved_class and configured and saved_class != configured:
        raise BadInput(
            f"--ckpt_path {ckpt_path} was saved by model {saved_class}, but the model is {configured}: "
            f"pass --model {saved_class} or another checkpoint."
        )
    # LightningCLI replaces the configured model arguments by the checkpoint's: say so when they differ.
    init_args = (model_config.get("init_args") or {}) if hasattr(model_config, "get") else {}
    init_args = {k: v.as_dict() if hasattr(v, "as_dict") else v for k, v in init_args.items()}  # e.g. an optimizer
    changed = [f"{k}={hparams[k]!r} (configured {v!r})" for k, v in init_args.items() if hparams.get(k, v) != v]
    if changed:
        sys.stderr.write(
            f"warning: --ckpt_path restores the model arguments saved in the checkpoint: {', '.join(changed)}\n"
        )


# --- once the model and the data module exist, before any rank starts -----------------------------------------


def check_optimizer_flags(config: Any, model: Any) -> None:
    """LightningCLI's `--optimizer`/`--lr_scheduler` replace the module's `configure_optimizers`; a module that
    takes its optimizer and schedule as arguments would silently lose them (and its parameter groups), also where
    it takes them through `**kwargs` from a parent class."""
    given = [flag for flag in ("optimizer", "lr_scheduler") if config.get(flag)]
    takes = init_arguments(config.get("model"), model) & {"optimizer", "scheduler"}
    if given and takes:
        raise BadInput(
            f"--{given[0]} would replace {type(model).__name__}.configure_optimizers: this model takes its "
            "optimizer and schedule as arguments, so use --model.optimizer CLASS (--model.optimizer.lr ...) and "
            "--model.scheduler CLASS; see python main.py fit --model.help " + type(model).__name__ + "."
        )


def check_micro_batches(model: Any, datamodule: Any, world: int) -> None:
    """Micro-batches that would not train the global batch: Lightning does not accumulate for a module that optimizes
    manually, and a loss over the global batch (`gather_batch`'s rows) would compare a micro-batch's samples only."""
    micro = datamodule.micro_batch_size if isinstance(datamodule, GlobalBatchDataModule) else None
    if not micro or micro >= (share := datamodule.global_batch_size // world):
        return
    split = f"--data.micro_batch_size {micro} would split each device's {share} samples into {share // micro}"
    if not model.automatic_optimization:
        raise BadInput(
            f"{split} micro-batches, but {type(model).__name__} optimizes manually (automatic_optimization = False), "
            f"which Lightning does not accumulate for: every micro-batch would be an optimizer step on {micro * world} "
            f"samples instead of the global batch of {datamodule.global_batch_size}. Leave micro_batch_size unset."
        )
    if spans_global_batch(model):
        raise BadInput(
            f"{split} micro-batches, but {type(model).__name__}'s loss spans the global batch (loss_spans_global_batch"
            f" = True): it would compare each sample with {micro * world} rows, not the global batch's "
            f"{datamodule.global_batch_size}. Leave micro_batch_size unset (or lower global_batch_size to fit memory)."
        )


def check_state_dict_fits(model: torch.nn.Module, ckpt_path: str) -> None:
    """The checkpoint's weights have the names and shapes of the model's, whatever saved it. A module that defines
    configure_model may build layers there (Lightning's advice for large models), after this check: the checkpoint's
    weights under a submodule it has not built yet are not counted (Lightning's own load still refuses any that do
    not fit)."""
    saved = load_lazily(ckpt_path)["state_dict"]
    mine = model.state_dict()
    missing, unexpected = sorted(mine.keys() - saved.keys()), sorted(saved.keys() - mine.keys())
    if type(model).configure_model is not LightningModule.configure_model:
        unexpected = [key for key in unexpected if not _not_built_yet(model, key)]
    reshaped = sorted(k for k in mine.keys() & saved.keys() if tuple(mine[k].shape) != tuple(saved[k].shape))
    if missing or unexpected or reshaped:
        names = (missing or unexpected or reshaped)[:3]
        raise BadInput(
            f"--ckpt_path {ckpt_path} holds weights of a different model ({len(missing)} missing, "
            f"{len(unexpected)} unexpected, {len(reshaped)} of another shape, e.g. {', '.join(names)}): "
            f"select the model it was trained with (--model ...)."
        )


def _not_built_yet(model: torch.nn.Module, key: str) -> bool:
    """Whether the weight `key` lies under a submodule that `model` has not built: one set to None, or an attribute
    of the module itself that it lacks. An index or name missing inside a container it has built (a layer more in
    the checkpoint) is another model's."""
    owner: Any = model
    for part in key.split(".")[:-1]:
        if not hasattr(owner, part):
            return owner is model
        owner = getattr(owner, part)
        if owner is None:
            return True
    return False


def plain_datamodule_warning(datamodule: Any) -> str:
    """One line: what a data module that is not a GlobalBatchDataModule loses, and how to get it back."""
    base = f"ddpkit.{GlobalBatchDataModule.__name__}"  # the public name (ddpkit/__init__.py), not its module's
    return (
        f"warning: {type(datamodule).__name__} is a plain LightningDataModule: its batch size is per device "
        "(the global batch grows with --trainer.devices), and 1-vs-N device parity, exact mid-epoch resume and "
        f"exactly-once evaluation are not guaranteed; subclass {base} and return datasets to keep them "
        "(ddpkit.StreamingDataModule for shards or streams)."
    )


def iterable_data_warning(loaders: Any, world_size: int) -> str | None:
    """One line when a training loader of a plain data module reads an IterableDataset on several processes."""
    loaders = list(loaders.values()) if isinstance(loaders, dict) else loaders
    loaders = loaders if isinstance(loaders, (list, tuple)) else [loaders]
    iterable = [dl.dataset for dl in loaders if isinstance(getattr(dl, "dataset", None), IterableDataset)]
    if not iterable or world_size < 2:
        return None
    return (
        f"warning: the training data ({type(iterable[0]).__name__}) is an IterableDataset that Lightning does not "
        f"split over the {world_size} processes: unless it splits itself by rank, every rank reads the whole "
        f"stream (each sample {world_size} times per epoch) and a rank whose stream ends first leaves the others "
        "waiting at the epoch's end; ddpkit.data.streaming.StreamingDataModule reads shards once over all ranks."
    )


class IterableDataCheck(Callback):
    """Says, before the first training step, what an iterable dataset in a plain data module gets wrong."""

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        warning = iterable_data_warning(trainer.train_dataloader, trainer.world_size)
        if warning and trainer.is_global_zero:
            sys.stderr.write(warning + "\n")
