"""LightningCLI with fail-fast checks and fault handling, used by `main.py`.

Everything that can be checked from the configuration is checked right after
parsing: before any model is built, any rank process is started or any file is
written. A failure prints one `error:` line that says what to change and exits
with status 2, like an unknown flag does.

The checks are in `checks.py` (and `init_args.py`), what `--ckpt_path last/best/auto` name in
`ckpt_paths.py`, where the loggers write in `logdirs.py`; this module wires
them into LightningCLI's steps.
"""

import os
import re
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
from jsonargparse.typing import PositiveInt
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter, Callback, LearningRateMonitor
from lightning.pytorch.cli import LightningArgumentParser
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.plugins.layer_sync import LayerSync
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.constants import default_pg_timeout

from ..data.global_batch import GlobalBatchDataModule
from ..data.sampling import ResumeLoaderPosition
from ..lightning_internals import SubcommandCLI, ddp_timeout, is_subprocess_launcher, plain_callables, set_ddp_timeout
from ..model.batchnorm import SyncBatchNormAnyDevice, unsynced_batchnorm_warning
from ..model.matmul import CHOICES as MATMUL_CHOICES
from ..model.matmul import float32_matmul_precision
from ..model.metrics import UnevenListSync
from ..presets import hint as preset_hint
from ..scaling.doctor import ScalingDoctor
from ..tune.run import TRIAL_CHANNEL, TRIAL_CHECK, TRIAL_METRIC, TRIAL_WORKER
from .checkpoints import AtomicCheckpointIO, RecordVersion, ResumedAccumulation
from .checks import (
    BadInput,
    IterableDataCheck,
    check_config,
    check_micro_batches,
    check_optimizer_flags,
    check_state_dict_fits,
    match_torchrun,
    plain_datamodule_warning,
)
from .ckpt_paths import resolve_ckpt_path
from .hang import FLIGHT_RECORDER_ENV, HangDump, collect, is_collective_timeout
from .init_args import warn_carried_init_args
from .logdirs import RunConfigSaver, logger_init_args, place_loggers, requeued_run
from .predictions import PredictionWriter
from .processes import (
    exit_now,
    failed_children,
    rank_label,
    register_launcher,
    stop_children,
    watch_children,
    watch_parent,
)
from .requeue import SlurmRequeue
from .stop import GracefulStop, StopRequested
from .strategy import TimedDDPStrategy, ddp_alias
from .trackers import SaveTrackerRuns, continue_trackers
from .trial import TrialReport


class ArgumentParser(LightningArgumentParser):
    """Reports a bad argument without first printing the usage of every option (hundreds of lines)."""

    def print_usage(self, file: Any = None) -> None:  # argparse calls it only on errors
        pass

    def error(self, message: str, *args: Any, **kwargs: Any) -> NoReturn:
        # A --config file that is missing and is one of the library's presets: the project was baked before the
        # preset existed, or deleted it, and `cruft update` never touches configs/. Say the command that copies it.
        tips = filter(None, map(preset_hint, re.findall(r"[^\s'\"]+\.yaml", message)))
        tip = next(tips, None)
        super().error(f"{message} ({tip})" if tip else message, *args, **kwargs)

    def validate(self, cfg: Any, *args: Any, **kwargs: Any) -> None:
        # Before the check that a logger's required save_dir is set: a logger without one writes under
        # --trainer.default_root_dir, as Lightning's `logger: true` does (`--trainer.logger+=CSVLogger` then works).
        for trainer in (cfg.get("trainer"), cfg.get(f"{cfg.get('subcommand')}.trainer")):
            if hasattr(trainer, "get"):
                for args_ in logger_init_args(trainer):
                    if "save_dir" in args_ and args_.save_dir is None:
                        args_.save_dir = str(trainer.get("default_root_dir") or os.getcwd())
        super().validate(cfg, *args, **kwargs)


class CLI(SubcommandCLI):
    """`LightningCLI` plus checks before anything starts, a collective timeout, graceful stop, atomic checkpoints."""

    def __init__(self, *args: Any, default_config: str | Path | None = None, **kwargs: Any) -> None:
        if os.environ.get("LOCAL_RANK", "0") != "0":  # a rank started by a launcher: die with it
            watch_parent()
        elif TRIAL_WORKER in os.environ:  # rank 0 of a tuning trial: die with the worker that started it
            watch_parent(parent=int(os.environ[TRIAL_WORKER]), who="the tuning worker")
        self.default_config = default_config
        kwargs.setdefault("parser_class", ArgumentParser)
        kwargs.setdefault("save_config_callback", RunConfigSaver)
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # Its own section (--doctor.*), not an entry of trainer.callbacks: switching it off or moving a
        # threshold then never depends on where it sits in a list the user also appends to.
        parser.add_lightning_class_args(ScalingDoctor, "doctor")
        # LightningCLI lists a model's and a data module's own options only under --model.help / --data.help.
        parser.epilog = (
            "Options of the model and the data module: --model.help CLASS and --data.help CLASS, with the class "
            "named in config.yaml (its class name alone is enough)."
        )
        parser.add_argument(
            "--dist_timeout",
            type=float,
            default=300.0,
            help="Seconds a rank waits in a collective (all-reduce, barrier) before the job fails, for "
            "strategy 'ddp' or a DDPStrategy class path that sets no timeout of its own. Bounds how long a "
            "hung or dead rank can stall the others; raise it when one "
            "rank legitimately works alone for longer (a big checkpoint on a slow disk, a first compile).",
        )

        parser.add_argument(
            "--stop_check_every_n_steps",
            type=PositiveInt,
            default=10,
            help="Training steps between the ranks' checks for SIGTERM/Ctrl-C (a one-number all-reduce in "
            "the background) and, with --slurm_requeue, for SLURM's requeue signal. A signal stops every rank, "
            "with a checkpoint, within this many steps + 1; lower it when steps are long and the scheduler's "
            "grace period is short.",
        )
        parser.add_argument(
            "--float32_matmul_precision",
            choices=MATMUL_CHOICES,
            default="auto",
            help="torch.set_float32_matmul_precision for this run. auto: 'high' (TF32 matmuls on GPUs that have "
            "them, Ampere and later) when training in 32-true or a mixed precision on a GPU; torch's own setting "
            "otherwise (CPU runs, and 64-true, the parity checks' reference, stay exact). 'highest' keeps full "
            "float32 matmuls on GPUs; 'medium' allows bfloat16 ones.",
        )
        parser.add_argument(
            "--slurm_requeue",
            type=bool,
            default=False,
            help="Add the SlurmRequeue callback (requeue.py): on SLURM's warning signal all ranks save "
            "hpc_ckpt_N.ckpt at one step and the job requeues itself. A flag, not a trainer.callbacks entry, so "
            "a config that lists its own callbacks cannot drop it (cluster/slurm.sbatch sets it).",
        )

    # --- checks before anything starts ---------------------------------------------------------------

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        super().parse_arguments(parser, args)
        self.resumed_run: Path | None = None
        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else self.config
        if self.default_config and rank_label() == "0":
            warn_carried_init_args(config, list(sys.argv[1:] if args is None else args), Path(self.default_config))
        if subcommand is None:
            return
        try:
            match_torchrun(config.get("trainer") or {})
            self.resumed_run = resolve_ckpt_path(config, subcommand)
            place_loggers(config.get("trainer") or {}, self.resumed_run)
            run = self.resumed_run or requeued_run(config.get("trainer") or {}, config.get("ckpt_path"))
            if run is not None:  # its MLflow / W&B runs continue too
                continue_trackers(config.get("trainer") or {}, run)
            check_config(config)
        except BadInput as error:
            if rank_label() == "0":  # under torchrun every rank parses: one line is enough
                sys.stderr.write(f"error: {error}\n")
            sys.exit(2)

    def after_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        if self.datamodule is not None and not isinstance(self.datamodule, GlobalBatchDataModule):
            if rank_label() == "0" and self.subcommand:
                sys.stderr.write(plain_datamodule_warning(self.datamodule) + "\n")
            if self.subcommand == "fit" and self.trainer.world_size > 1:
                self.trainer.callbacks.append(IterableDataCheck())  # its loaders exist only once fit builds them
        batchnorm = unsynced_batchnorm_warning(self.model, self.trainer.world_size, self.batchnorm_synced)
        if batchnorm and self.subcommand == "fit" and rank_label() == "0":
            sys.stderr.write(batchnorm + "\n")
        ckpt_path = config.get("ckpt_path")
        try:
            check_optimizer_flags(config, self.model)
            if self.subcommand in (None, "fit"):  # evaluation takes micro-batches as they are
                check_micro_batches(self.model, self.datamodule, self.trainer.world_size)
            if ckpt_path and Path(ckpt_path).is_file():
                check_state_dict_fits(self.model, ckpt_path)
        except BadInput as error:
            if rank_label() == "0":
                sys.stderr.write(f"error: {error}\n")
            sys.exit(2)
        plain_callables(self.model)  # a copy of the module (EMA, SWA, the suite's probes) must not copy the CLI
        if self.trainer.precision == "64-true":
            # Lightning loads checkpoint weights before the precision plugin converts the model, which
            # would round float64 weights to float32 on resume. Converting first keeps them exact.
            self.model.double()

    # --- strategy timeout, graceful stop, atomic checkpoints ------------------------------------------

    def setting(self, key: str) -> Any:
        """A top-level option of this run (`--dist_timeout`), under the subcommand when there is one."""
        return (self.config[self.subcommand] if self.subcommand else self.config)[key]

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        trainer = {**config.get("trainer", {}), **kwargs}
        timeout = timedelta(seconds=self.setting("dist_timeout"))
        strategy = trainer.get("strategy")
        alias = ddp_alias(strategy) if isinstance(strategy, str) else None
        if alias is not None:
            # The registry's "ddp", "ddp_find_unused_parameters_true", ... build DDPStrategy with a 30-minute timeout.
            kwargs["strategy"] = TimedDDPStrategy(timeout=timeout, **alias)
        elif isinstance(strategy, DDPStrategy) and ddp_timeout(strategy) in (None, default_pg_timeout):
            # A DDPStrategy built from a class path gets torch's 30-minute default, never None.
            set_ddp_timeout(strategy, timeout)
        plugins = trainer.get("plugins") or []
        plugins = plugins if isinstance(plugins, list) else [plugins]
        if trainer.get("sync_batchnorm") and not any(isinstance(p, LayerSync) for p in plugins):
            # Lightning's plugin for the flag, torch's SyncBatchNorm, fails on CPU; this one runs on any device.
            plugins = kwargs["plugins"] = [*plugins, SyncBatchNormAnyDevice()]
        self.batchnorm_synced = any(isinstance(p, LayerSync) for p in plugins)
        if not any(isinstance(p, CheckpointIO) for p in plugins):
            kwargs["plugins"] = [*plugins, AtomicCheckpointIO()]
        # The trainer's callbacks and those given as top-level options of their own (--doctor.*).
        own = [v for v in vars(config).values() if isinstance(v, Callback)]
        configured = [*(trainer.get("callbacks") or []), *own]
        stop = GracefulStop(self.setting("stop_check_every_n_steps"))
        requeue = [SlurmRequeue(check_every_n_steps=self.setting("stop_check_every_n_steps"))]
        requeue = requeue if self.setting("slurm_requeue") else []
        writes = self.subcommand == "predict" and not any(isinstance(c, BasePredictionWriter) for c in configured)
        writer = [PredictionWriter()] if writes else []  # else predictions stay in memory, per rank
        # The learning rate of each parameter group, at every logged step, to every logger (fit only; it needs one).
        monitors = trainer.get("logger") and not any(isinstance(c, LearningRateMonitor) for c in configured)
        lr = [LearningRateMonitor(logging_interval="step")] if self.subcommand == "fit" and monitors else []
        # Lightning appends `trainer_defaults["callbacks"]` after the configured ones, the documented place for
        # callbacks a CLI always adds (after --doctor's: the doctor's step ends before the stop check's all-reduce).
        defaults = self.trainer_defaults
        given = defaults.get("callbacks") or []
        given = given if isinstance(given, list) else [given]
        trackers = [SaveTrackerRuns()] if self.subcommand == "fit" else []  # their run ids, for a restart
        # A trial of `python -m ddpkit.tune`: the metric to its worker, the worker's pruning decision to every rank.
        tuning = self.subcommand == "fit" and TRIAL_CHANNEL in os.environ
        trial = [TrialReport(os.environ[TRIAL_METRIC], os.environ[TRIAL_CHANNEL])] if tuning else []
        resumes = [RecordVersion(), ResumeLoaderPosition(), ResumedAccumulation()]
        added = [stop, *requeue, *writer, *lr, *trackers, *trial, *resumes, HangDump(), UnevenListSync()]
        self.trainer_defaults = {**defaults, "callbacks": [*given, *added]}
        try:
            built = super().instantiate_trainer(**kwargs)
        finally:  # for this trainer only: another call must not add them twice
            self.trainer_defaults = defaults
        # Before fit: Lightning's tensor-core advice is printed when the device is set up, unless it is set by then.
        # Every rank runs this CLI (Lightning's launcher, torchrun, srun), each for its own device.
        matmul = float32_matmul_precision(
            self.setting("float32_matmul_precision"), built.precision, built.strategy.root_device
        )
        if matmul is not None:
            torch.set_float32_matmul_precision(matmul)
        return built

    # --- failures end the whole job, with the rank named ---------------------------------------------

    def run_subcommand(self, subcommand: str) -> None:
        if TRIAL_CHECK in os.environ:  # python -m ddpkit.tune's check: model, data and Trainer built; train nothing
            Path(os.environ[TRIAL_CHECK]).write_text(self.parser.dump(self.config, skip_none=False))
            return
        launcher = self.trainer.strategy.launcher
        try:
            if is_subprocess_launcher(launcher):
                register_launcher(launcher)
                watch_children()
            super().run_subcommand(subcommand)
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                # Lightning keeps the process group to the end; gloo's destructor at interpreter exit then
                # aborted a finished job now and then ("terminate called without an active exception").
                # Leave together and tear it down while every rank is still alive.
                torch.distributed.barrier()
                torch.distributed.destroy_process_group()
        except StopRequested as stop:
            stop_children()
            sys.stderr.write(
                f"rank {rank_label()}: {stop}. Resume with: --ckpt_path {stop.path}\n" if rank_label() == "0" else ""
            )
            exit_now(128 + stop.signum)
        except BaseException as error:
            if isinstance(error, SystemExit) and not error.code:
                raise
            traceback.print_exc()
            # Before anything is killed: where every rank was (hang.py). Takes up to hang.DUMP_WAIT s.
            report = collect(error) if is_collective_timeout(error) else None
            if report:
                sys.stderr.write(report)
            failed = failed_children(wait=2.0)  # a rank that died first explains this rank's failure
            stuck = stop_children()
            reason = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
            if failed:
                message = f"rank {failed[0][0]} exited with code {failed[0][1]} (then rank {rank_label()}: {reason})"
            else:
                message = f"rank {rank_label()} failed: {reason}"
            if stuck:
                message += f"; killed ranks {stuck}, still running (hung?)"
            sys.stderr.write(f"error: {message}\n")
            exit_now(1)


def main(default_config: str | Path, args: list[str] | None = None, run: bool = True) -> CLI:
    """A project's `main.py`: parse `args` (else sys.argv) over `default_config` and run the subcommand;
    with `run=False` only build model, data and trainer. Model and data classes come from the config."""
    # Lightning's progress bar when `rich` is not installed (TQDM) redraws after every step, a few tenths of a
    # ms of CPU each (measured: ddp-template's docs/measurements.md). Every 10th step (and each epoch's last)
    # is enough to watch; export TQDM_MINITERS to change it.
    os.environ.setdefault("TQDM_MINITERS", "10")
    # The hang report's record of each rank's collectives: torch 2.8 keeps none for gloo unless this is set.
    os.environ.setdefault(*FLIGHT_RECORDER_ENV)
    parser_kwargs = {"default_config_files": [str(default_config)]}
    return CLI(
        LightningModule,
        LightningDataModule,
        default_config=default_config,
        subclass_mode_model=True,
        subclass_mode_data=True,
        parser_kwargs={cmd: parser_kwargs for cmd in ("fit", "validate", "test", "predict")} if run else parser_kwargs,
        # A requeued SLURM job logs to the same version_<job id> directory; let it rewrite the saved config.
        save_config_kwargs={"overwrite": True},
        run=run,
        args=args,
    )


# Defined in this module before checks.py, ckpt_paths.py and logdirs.py held them: projects and tests import them
# from ddpkit.run.cli, so they stay importable from here (at the end: the import block above is what the CLI uses).
from .checks import LIGHTNING_CKPT_PATHS, check_checkpoint, iterable_data_warning, load_lazily, world_size  # noqa: E402,F401
from .ckpt_paths import SKIP_DIRS, best_checkpoint, further, newest_hpc_checkpoint, newest_last_checkpoint  # noqa: E402,F401
from .logdirs import next_version  # noqa: E402,F401
