"""MLflow and Weights & Biases loggers whose run continues when a stopped job restarts.

A tracker gives each run an id of its own; Lightning's loggers start a new one at every start, so a job
stopped by SIGTERM and restarted with `--ckpt_path auto` would leave one tracker run per restart. Here rank 0
writes the trackers' run ids next to the run's checkpoints (`tracker_runs.json`, `SaveTrackerRuns`), and the
CLI hands them back to these loggers when it continues that run (`continue_trackers`): one tracker run,
its steps going on from the checkpoint's. Only rank 0 logs (Lightning gives the other ranks a dummy).

Both add to TensorBoard (config.yaml's logger list; configs/mlflow.yaml, configs/wandb.yaml). They need
their packages: `pip install "ddpkit[trackers]"`.
"""

import importlib
import json
import os
from pathlib import Path
from typing import Any

import lightning as L
from jsonargparse import Namespace
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import MLFlowLogger as LightningMLFlowLogger
from lightning.pytorch.loggers import WandbLogger as LightningWandbLogger

from .checkpoints import checkpoint_dir

# Beside the run's checkpoints/ directory: {"mlflow": run id, "wandb": run id}.
RUN_IDS = "tracker_runs.json"


class MLFlowLogger(LightningMLFlowLogger):
    """Lightning's MLFlowLogger; given `run_id` it continues that run and leaves the params of its first start.

    The default store is MLflow's file store, `./mlruns` (`mlflow ui --backend-store-uri ./mlruns`); MLflow 3.x
    refuses it unless MLFLOW_ALLOW_FILE_STORE is set, so this sets it. Any other `tracking_uri` (a server; a
    database, which needs packages that mlflow-skinny leaves out) is MLflow's as usual.
    """

    kind, run_id_argument = "mlflow", "run_id"

    def __init__(self, *args: Any, run_id: str | None = None, **kwargs: Any) -> None:
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # before the client opens the store; others ignore it
        super().__init__(*args, run_id=run_id, **kwargs)
        self.continues = run_id is not None

    def log_hyperparams(self, params: Any) -> None:
        # A continued run keeps its first start's params: MLflow refuses to change one (a restart may differ
        # in --ckpt_path or --trainer.max_epochs); the restart's whole config is in its run directory.
        if not self.continues:
            super().log_hyperparams(params)

    def tracker_run_id(self) -> str | None:
        return self.run_id


class WandbLogger(LightningWandbLogger):
    """Lightning's WandbLogger; given `id` it continues that run and leaves the config of its first start.

    Offline (`offline: true` or WANDB_MODE=offline) each start writes `./wandb/offline-run-<time>-<id>/`; the
    parts of one run share its id and `wandb sync` uploads them in order as that one run.
    """

    kind, run_id_argument = "wandb", "id"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.continues = self.version is not None  # `id` or `version` given (no run is started yet)

    def log_hyperparams(self, params: Any) -> None:
        if not self.continues:  # as MLFlowLogger's: the run's config is that of its first start
            super().log_hyperparams(params)

    def finalize(self, status: str) -> None:
        super().finalize(status)
        import wandb

        if status != "success" and wandb.run is not None:  # rank 0's run, once started
            # A stopped job exits without interpreter shutdown (cli.py), which would skip wandb's own finish
            # and lose the records still in flight.
            wandb.run.finish(exit_code=1)

    def tracker_run_id(self) -> str | None:
        return self.experiment.id


TRACKERS = (MLFlowLogger, WandbLogger)


def tracker_class(class_path: Any) -> type | None:
    """MLFlowLogger or WandbLogger (of this module) for a logger class path that is one of them or a subclass."""
    module, _, name = str(class_path).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None  # Lightning reports a bad class path itself
    return next((t for t in TRACKERS if isinstance(cls, type) and issubclass(cls, t)), None)


def continue_trackers(trainer: Any, run: Path) -> None:
    """Parse time, for a fit that continues `run` (a log directory): give each tracker logger of the trainer
    config that names no run of its own the run id saved in `run`."""
    path = run / RUN_IDS
    saved = json.loads(path.read_text()) if path.is_file() else {}
    loggers = trainer.get("logger") if hasattr(trainer, "get") else None
    for entry in loggers if isinstance(loggers, list) else [loggers]:
        cls = tracker_class(entry.get("class_path")) if isinstance(entry, Namespace) else None
        if cls is None or cls.kind not in saved:
            continue
        init_args = entry.get("init_args") or Namespace()
        if not init_args.get(cls.run_id_argument) and not init_args.get("version"):
            init_args[cls.run_id_argument] = saved[cls.kind]
            entry["init_args"] = init_args


class SaveTrackerRuns(Callback):
    """Rank 0 writes the run id of each tracker logger beside the checkpoints directory when fit starts (after
    every callback's setup: the checkpoint callback finds its directory there)."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trackers = [logger for logger in trainer.loggers if isinstance(logger, TRACKERS)]
        if not trackers or not trainer.is_global_zero:
            return
        run = Path(checkpoint_dir(trainer)).parent
        run.mkdir(parents=True, exist_ok=True)
        ids = {logger.kind: logger.tracker_run_id() for logger in trackers}
        tmp = run / f".{RUN_IDS}.tmp"
        tmp.write_text(json.dumps(ids, indent=1) + "\n")
        os.replace(tmp, run / RUN_IDS)  # whole or absent, like the checkpoints
