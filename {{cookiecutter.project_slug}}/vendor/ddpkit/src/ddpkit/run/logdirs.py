"""Where a run's logs go: every logger of a run in one directory under one version, the run's `config.yaml`
there and nowhere else, and the directory that a resumed or requeued run continues. The CLI places the loggers
right after parsing (`place_loggers`), before any logger exists.
"""

import os
import re
from pathlib import Path
from typing import Any

from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Trainer
from lightning.pytorch.cli import SaveConfigCallback

from .. import __version__
from .checkpoints import VERSION_KEY


class RunConfigSaver(SaveConfigCallback):
    """Saves the run's `config.yaml` into its log directory, and nowhere else.

    Without a logger Lightning's log directory is `default_root_dir`, by default the project itself, whose
    own `config.yaml` the run's would then replace (overwrite is on, for requeued SLURM jobs).
    """

    def setup(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        if trainer.logger is not None:  # the same on every rank, so the collective inside runs on all or none
            super().setup(trainer, pl_module, stage)

    def save_config(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        # The whole resolved configuration (every class, every argument) to every logger, as one YAML text
        # under "config" (CSV: hparams.yaml; TensorBoard: its hparams tab), not only to the first one's dir.
        # With the version of ddpkit that ran it (hparams.yaml's `ddpkit_version`).
        config = self.parser.dump(self.config, skip_none=False)
        for logger in trainer.loggers:
            logger.log_hyperparams({"config": config, VERSION_KEY: __version__})


def logger_init_args(trainer: Any) -> list[Any]:
    """The `init_args` of each logger given by class path in a trainer config (none for `logger: true`)."""
    loggers = trainer.get("logger")
    loggers = loggers if isinstance(loggers, list) else [loggers]
    return [e.init_args for e in loggers if hasattr(e, "get") and hasattr(e.get("init_args"), "get")]


def place_loggers(trainer: Any, resumed_run: Path | None) -> None:
    """Put the loggers that write under `--trainer.default_root_dir` into one run directory.

    A logger without `save_dir` writes there (`ArgumentParser.validate`), like Lightning's `logger: true`.
    Loggers that share a directory and set no version share one: the SLURM job id (a requeued job continues
    it; Lightning's own choice for `logger: true`), the run that `fit --ckpt_path last` continues, or else
    the next free number, found once for all of them.
    """
    if not hasattr(trainer, "get"):
        return
    root = str(trainer.get("default_root_dir") or os.getcwd())
    entries = logger_init_args(trainer)
    if resumed_run is not None:  # `--ckpt_path last` continues a run: its logs stay in that run's directory
        for args in entries:
            if args.get("save_dir") == root and "version" in args and args.version is None:
                args.save_dir, args.name = str(resumed_run.parent.parent), resumed_run.parent.name
                args.version = resumed_run.name
        return
    groups: dict[Path, list[Any]] = {}
    for args in entries:
        if "version" in args and args.version is None and args.get("save_dir") is not None:
            groups.setdefault(Path(args.save_dir) / (args.get("name") or ""), []).append(args)
    for directory, group in groups.items():
        version = SLURMEnvironment.job_id()
        if version is None and len(group) > 1:
            version = next_version(directory)
        for args in group:
            args.version = version


def requeued_run(trainer: Any, ckpt_path: str | None) -> Path | None:
    """The log directory of a requeued SLURM job that resumes its requeue checkpoint (`hpc_ckpt_N.ckpt`, which
    `--ckpt_path auto` picks): place_loggers named it after the job id, which the requeue keeps."""
    job = SLURMEnvironment.job_id()
    if job is None or not ckpt_path or not re.fullmatch(r"hpc_ckpt_\d+\.ckpt", Path(ckpt_path).name):
        return None
    for args in logger_init_args(trainer):
        if args.get("version") == job and args.get("save_dir") is not None:
            return Path(args.save_dir) / (args.get("name") or "") / f"version_{job}"
    return None


def next_version(directory: Path) -> int:
    """The number after the highest `version_N` in `directory` (0 if none), as Lightning's loggers count."""
    numbers = [int(p.name[8:]) for p in directory.glob("version_*") if p.is_dir() and p.name[8:].isdigit()]
    return max(numbers, default=-1) + 1
