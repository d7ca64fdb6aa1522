"""Train, evaluate or predict: `python main.py {fit,validate,test,predict} --help`.

Model and data are chosen by class path in config.yaml or on the command line
(`--model my_model.MyModule`, `--data my_data.MyData`), so your own modules live
in their own files and this one never changes.
"""

from pathlib import Path

import lightning as L

from {{ cookiecutter.package_name }}.cli import CLI

DEFAULT_CONFIG = str(Path(__file__).with_name("config.yaml"))


def main(args: list[str] | None = None) -> None:
    CLI(  # LightningCLI plus checks before anything starts, and fault handling (see cli.py)
        L.LightningModule,
        L.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        parser_kwargs={
            cmd: {"default_config_files": [DEFAULT_CONFIG]} for cmd in ("fit", "validate", "test", "predict")
        },
        args=args,
    )


if __name__ == "__main__":
    main()
