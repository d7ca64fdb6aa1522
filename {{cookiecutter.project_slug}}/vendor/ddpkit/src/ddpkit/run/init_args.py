"""The init arguments of a config's `model:` and `data:` sections as LightningCLI (jsonargparse) takes them, which a
class's signature alone does not show:

- a class that hands `**kwargs` on to its parent takes the parent's arguments too (`init_arguments`): the CLI's
  `--optimizer` check (checks.py) and the guarantee suite's plan (testing/configured.py) ask this, not the signature;
- a `--model`/`--data`/`--config` that switches a section's class keeps the arguments of the same name from the
  default config (`warn_carried_init_args`, one warning line, run by cli.py right after parsing).
"""

import importlib
import inspect
import re
import sys
from pathlib import Path
from typing import Any

import yaml

SECTIONS = ("model", "data")


def init_arguments(section, instance) -> set[str]:
    """The init arguments the CLI takes for a `model:` or `data:` section: the class's own and those its `**kwargs`
    hands on to a parent (jsonargparse follows `super().__init__(**kwargs)`; the signature alone shows `kwargs`)."""
    own = set(inspect.signature(type(instance).__init__).parameters)
    parsed = section.get("init_args") if hasattr(section, "get") else None
    return own | ({key.split(".")[0] for key in parsed.keys()} if parsed is not None else set())


def warn_carried_init_args(config: Any, argv: list[str], default_config: Path) -> None:
    """One warning line per section whose class a `--config` or `--model`/`--data` changed while arguments of the
    same name kept the default config's values (`carried_init_args`)."""
    try:
        defaults = yaml.safe_load(default_config.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return
    for section in SECTIONS:
        final, default = config.get(section), defaults.get(section)
        if not isinstance(default, dict) or not hasattr(final, "get"):
            continue
        final = final.as_dict() if hasattr(final, "as_dict") else dict(final)
        line = carried_init_args(section, final, default, given_keys(argv, section), default_config.name)
        if line:
            sys.stderr.write(line + "\n")


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
