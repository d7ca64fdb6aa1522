"""ddpkit: the machinery of the ddp-template's projects, as a versioned library.

A project's own code meets it through a few public names: its data module subclasses
`GlobalBatchDataModule` (global batch, micro-batches, sampling, exact resume, exactly-once evaluation), or
`StreamingDataModule` for shards that do not fit in memory (the same promises, ddpkit.streaming),
its `configure_optimizers` may return `optimization(...)`, and its `configure_model` may call
`compile_layers` and `shard_layers`. `main.py` runs `ddpkit.cli.main`; `tests/` runs `ddpkit.testing`.
"""

import importlib
from typing import TYPE_CHECKING

# The one place the version is written: hatchling reads it for the package ([tool.hatch.version]); a run
# records it in its checkpoints, its logged hyperparameters and the doctor's report.
__version__ = "0.4.0"

# The public names, imported on first use (PEP 562): `python -m ddpkit.scaling` (the sweep's driver, --explain)
# needs neither torch nor Lightning, and importing them for every `python -m ddpkit.<tool>` cost ~3 s of start-up.
if TYPE_CHECKING:  # what editors and type checkers read
    from .compiling import compile_layers
    from .data import GlobalBatchDataModule
    from .schedules import WarmupCosine, optimization
    from .sharding import shard_layers
    from .streaming import StreamingDataModule

_HOMES = {
    "compile_layers": "compiling",
    "GlobalBatchDataModule": "data",
    "WarmupCosine": "schedules",
    "optimization": "schedules",
    "shard_layers": "sharding",
    "StreamingDataModule": "streaming",
}

__all__ = [
    "GlobalBatchDataModule",
    "StreamingDataModule",
    "WarmupCosine",
    "__version__",
    "compile_layers",
    "optimization",
    "shard_layers",
]


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'ddpkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
