"""Searching: hyperparameter search in which every trial is a DDP run (`python -m ddpkit.tune`: search.py, its
worker, trials, space, checks, devices, report and study) and the learning-rate finder
(`python -m ddpkit.tune.lr_finder`: lr_finder.py, lr_sweep.py).

`ddpkit.tune` was the search's module until 0.4.0: its names are still found here, loaded on first use (the
package itself imports nothing: `python -m ddpkit.tune --help` pays for neither torch nor Optuna's study).
"""

import importlib

_OLD_NAMES = {"interrupt": "search", "parse": "search", "main": "search"}


def __getattr__(name: str):
    if name not in _OLD_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_OLD_NAMES[name]}", __name__), name)
