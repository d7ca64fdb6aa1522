"""Train, evaluate or predict: `python main.py {fit,validate,test,predict} --help`.

Model and data are chosen by class path in config.yaml or on the command line
(`--model my_model.MyModule`, `--data my_data.MyData`), so your own modules live
in their own files and this one never changes.
"""

import os
from pathlib import Path

import lightning as L

from {{ cookiecutter.package_name }}.ddp.cli import CLI

DEFAULT_CONFIG = str(Path(__file__).with_name("config.yaml"))
# Lightning's progress bar when `rich` is not installed (TQDM) redraws after every step: ~0.4 ms
# of CPU per step. Every 10th step (and each epoch's last) is enough to watch; export
# TQDM_MINITERS yourself to choose another rate.
os.environ.setdefault("TQDM_MINITERS", "10")


def main(args: list[str] | None = None, run: bool = True) -> CLI:
    """Parse `args` (else sys.argv) and run the subcommand; with `run=False` only build model, data and trainer."""
    parser_kwargs = {"default_config_files": [DEFAULT_CONFIG]}
    return CLI(  # LightningCLI plus checks before anything starts, and fault handling (see ddp/cli.py)
        L.LightningModule,
        L.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        parser_kwargs={cmd: parser_kwargs for cmd in ("fit", "validate", "test", "predict")} if run else parser_kwargs,
        # A requeued SLURM job logs to the same version_<job id> directory; let it rewrite the saved config.
        save_config_kwargs={"overwrite": True},
        run=run,
        args=args,
    )


if __name__ == "__main__":
    main()
