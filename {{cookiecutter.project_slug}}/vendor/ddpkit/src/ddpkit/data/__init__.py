"""What a fit reads: the global-batch data module (global_batch.py), its samplers and resumable loader
(sampling.py), and the streaming data module for shards that do not fit in memory (streaming.py, sources.py).

`ddpkit.data` was the module of `GlobalBatchDataModule` until 0.4.0: that name is still found here.
"""

import importlib

_OLD_NAMES = {"GlobalBatchDataModule": "global_batch"}  # the 0.4.0 module's names, loaded on first use


def __getattr__(name: str):
    if name not in _OLD_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_OLD_NAMES[name]}", __name__), name)
