"""Train, evaluate or predict: `python main.py {fit,validate,test,predict} --help`.

Model and data are chosen by class path in config.yaml or on the command line
(`--model my_model.MyModule`, `--data my_data.MyData`), so your own modules live
in their own files and this one never changes. The CLI, its checks and fault
handling are the ddpkit library's (vendor/ddpkit).
"""

from pathlib import Path

from ddpkit.run.cli import CLI
from ddpkit.run.cli import main as run_cli


def main(args: list[str] | None = None, run: bool = True) -> CLI:
    """Parse `args` (else sys.argv) and run the subcommand; with `run=False` only build model, data and trainer."""
    return run_cli(Path(__file__).with_name("config.yaml"), args, run)


if __name__ == "__main__":
    main()
