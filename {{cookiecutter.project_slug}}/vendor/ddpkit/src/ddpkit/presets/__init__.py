"""Config presets the library ships: `--config` files that fit any project (a few batches with a profiler, sharded
training, MLflow, Weights & Biases), as package data beside this module.

A baked project gets a copy of each in its `configs/` (the template copies them from here), and `configs/` is the
user's: `cruft update` never touches it. So a preset that a newer library brings, or one the project deleted,
reaches the project only from the installed library:

    python -m ddpkit.presets               # the presets, and which ones configs/ lacks or holds changed
    python -m ddpkit.presets mlflow wandb  # copy those into configs/

A file already in `configs/` is never overwritten (it may hold the user's edits): that preset is not copied, the
others are, and the exit status is 1. An unknown name is one `error:` line and status 2, before anything is
copied, like other bad input. Only the standard library is imported: no torch start-up for a file copy.
"""

import argparse
import filecmp
import shutil
import sys
from pathlib import Path

from .. import __version__

HERE = Path(__file__).resolve().parent
CONFIGS = Path("configs")  # a project's presets, relative to its root (where main.py is run)


def names() -> list[str]:
    """The library's presets, by name (the file name without `.yaml`)."""
    return sorted(p.stem for p in HERE.glob("*.yaml"))


def path(name: str) -> Path:
    """The library's file of preset `name` (`mlflow` or `mlflow.yaml`); ValueError for a name it does not ship."""
    stem = name.removesuffix(".yaml")
    if stem not in names():
        raise ValueError(f"no preset {name!r}: the library's presets are {', '.join(names())}")
    return HERE / f"{stem}.yaml"


def summary(name: str) -> str:
    """The first line of the preset's opening comment: what it is for."""
    first = path(name).read_text().splitlines()[0]
    return first.removeprefix("#").strip()


def state(name: str, configs: Path = CONFIGS) -> str:
    """`missing`, `same` (byte for byte the library's) or `changed` (edited, or from another release) in `configs`."""
    own = configs / f"{name}.yaml"
    if not own.is_file():
        return "missing"
    return "same" if filecmp.cmp(own, path(name), shallow=False) else "changed"


def copy_command(name: str, configs: Path = CONFIGS) -> str:
    """The command that copies preset `name` into `configs`."""
    where = "" if Path(configs) == CONFIGS else f" --configs {configs}"
    return f"python -m ddpkit.presets {name}{where}"


def hint(missing: str | Path) -> str | None:
    """For a config file that does not exist: how to get it, when it is one of the library's presets (for the
    CLI's error), else None."""
    missing = Path(missing)
    if missing.suffix != ".yaml" or missing.stem not in names() or missing.exists():
        return None
    configs = missing.parent
    if configs.is_absolute():  # as the parser reports it; the command is shorter from the project's root
        try:
            configs = configs.relative_to(Path.cwd())
        except ValueError:
            pass
    return f"{missing.stem} is a ddpkit preset: `{copy_command(missing.stem, configs)}` copies it there"


def listing(configs: Path = CONFIGS) -> str:
    """One line per preset: its name, its state in `configs`, what it is for; then the command that copies the
    missing ones, and how to compare a changed one."""
    width = max(len(n) for n in names())
    states = {name: state(name, configs) for name in names()}
    shown = {"same": f"in {configs}/", "missing": "missing", "changed": "changed"}
    lines = [f"ddpkit {__version__} presets (use: python main.py fit --config {configs}/NAME.yaml):"]
    lines += [f"  {n:<{width}}  {shown[s]:<{len(str(configs)) + 4}}  {summary(n)}" for n, s in states.items()]
    missing = [n for n, s in states.items() if s == "missing"]
    if missing:
        lines.append(f"copy the missing ones: {copy_command(' '.join(missing), configs)}")
    for name in (n for n, s in states.items() if s == "changed"):
        lines.append(f"{configs}/{name}.yaml differs from the library's: diff {configs}/{name}.yaml {path(name)}")
    return "\n".join(lines)


def copy(name: str, configs: Path = CONFIGS) -> bool:
    """Copy preset `name` into `configs` (created if needed); False, copying nothing, when the file exists there."""
    target = configs / f"{name.removesuffix('.yaml')}.yaml"
    if target.exists():
        return False
    configs.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path(name), target)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ddpkit.presets",
        description="List the config presets ddpkit ships, or copy some into the project's configs/ (never over "
        "an existing file). Exit status: 0 done; 1 a preset not copied because the file exists; 2 an unknown name.",
    )
    parser.add_argument("names", nargs="*", help="presets to copy (none: list them and their state in configs/)")
    parser.add_argument("--configs", type=Path, default=CONFIGS, help="the project's presets folder")
    args = parser.parse_args(argv)
    if not args.names:
        print(listing(args.configs))
        return 0
    try:
        for name in args.names:  # every name checked before anything is copied
            path(name)
    except ValueError as error:
        sys.stderr.write(f"error: {error}\n")
        return 2
    refused = 0
    for name in dict.fromkeys(n.removesuffix(".yaml") for n in args.names):
        target = args.configs / f"{name}.yaml"
        if copy(name, args.configs):
            print(f"copied {target} (python main.py fit --config {target})")
        else:
            refused += 1
            print(f"not copied: {target} exists, and stays as it is ({state(name, args.configs)}; the library's: "
                  f"{path(name)})")  # fmt: skip
    return 1 if refused else 0
