"""ddpkit: the machinery of the ddp-template's projects, as a versioned library.

A project's own code meets it through a few public names: its data module subclasses
`GlobalBatchDataModule` (global batch, micro-batches, sampling, exact resume, exactly-once evaluation),
its `configure_optimizers` may return `optimization(...)`, and its `configure_model` may call
`compile_layers` and `shard_layers`. `main.py` runs `ddpkit.cli.main`; `tests/` runs `ddpkit.testing`.
"""

from .compiling import compile_layers
from .data import GlobalBatchDataModule
from .schedules import WarmupCosine, optimization
from .sharding import shard_layers

__version__ = "0.1.0"

__all__ = ["GlobalBatchDataModule", "WarmupCosine", "__version__", "compile_layers", "optimization", "shard_layers"]
