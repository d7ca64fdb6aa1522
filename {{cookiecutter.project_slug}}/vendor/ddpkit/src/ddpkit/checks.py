"""Checks of a parsed configuration that warn or refuse before any model, rank or file exists (cli.CLI runs them)."""

import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import yaml

SECTIONS = ("model", "data")


def given_keys(argv: list[str], section: str) -> set[str]:
    """The init arguments of `section` that the command line names itself: `--data.x`, `--data.init_args.x`, or a key
    of `section` in a `--config` file."""
    keys, configs = set(), []
    for i, arg in enumerate(argv):
        name = arg.split("=", 1)[0]
        if name == "--config":
            configs.append(arg.split("=", 1)[1] if "=" in arg else argv[i + 1] if i + 1 < len(argv) else "")
        elif match := re.fullmatch(rf"--{section}\.(?:init_args\.)?(\w+)", name):
            keys.add(match[1])
    for path in filter(None, configs):
        try:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError):
            continue  # the parser has reported it already
        part = loaded.get(section) if isinstance(loaded, dict) else None
        if isinstance(part, dict):
            keys |= set(part.get("init_args") or {}) | (set(part) - {"class_path", "init_args", "dict_kwargs"})
    return keys


def class_defaults(class_path: str) -> dict[str, Any] | None:
    """The defaults of a class's init arguments, or None when it cannot be imported here."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None
    parameters = inspect.signature(cls).parameters.values()
    return {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}


def carried_init_args(section: str, final: dict, default: dict, given: set[str], default_file: str) -> str | None:
    """A warning when `--config`/`--model`/`--data` switched `section` to another class than `default_file`'s and
    arguments of the same name kept that file's values (jsonargparse carries init arguments across a class switch):
    those not given for the new class that differ from its own defaults. `final` and `default` are the section's
    `{class_path, init_args}` after parsing and in the default file."""
    new, old = final.get("class_path"), default.get("class_path")
    if not new or not old or new == old or new.rpartition(".")[2] == old:
        return None
    defaults = class_defaults(new)
    if defaults is None:
        return None
    carried = {
        key: value
        for key, value in (final.get("init_args") or {}).items()
        if key not in given and key in defaults and value != defaults[key]
    }
    if not carried:
        return None
    values = ", ".join(f"{k}={v!r} (its default: {defaults[k]!r})" for k, v in carried.items())
    return (
        f"warning: --{section} {new} keeps {values} from {old} in {default_file}: arguments of the same name carry "
        f"over when the class changes. Give them for {new.rpartition('.')[2]} in your config, or point "
        f"{default_file} itself at it."
    )
