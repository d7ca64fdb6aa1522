"""ddpkit: the machinery of the ddp-template's projects, as a versioned library.

A project's own code meets it through a few public names: its data module subclasses
`GlobalBatchDataModule` (global batch, micro-batches, sampling, exact resume, exactly-once evaluation), or
`StreamingDataModule` for shards that do not fit in memory (the same promises, ddpkit.streaming),
its `configure_optimizers` may return `optimization(...)`, and its `configure_model` may call
`compile_layers` and `shard_layers`. `main.py` runs `ddpkit.cli.main`; `tests/` runs `ddpkit.testing`.
"""

# The one place the version is written: hatchling reads it for the package ([tool.hatch.version]); a run
# records it in its checkpoints, its logged hyperparameters and the doctor's report. Set before the imports
# below, so that a module they load can import it.
__version__ = "0.1.0"

from .compiling import compile_layers  # noqa: E402
from .data import GlobalBatchDataModule  # noqa: E402
from .schedules import WarmupCosine, optimization  # noqa: E402
from .sharding import shard_layers  # noqa: E402
from .streaming import StreamingDataModule  # noqa: E402

__all__ = [
    "GlobalBatchDataModule",
    "StreamingDataModule",
    "WarmupCosine",
    "__version__",
    "compile_layers",
    "optimization",
    "shard_layers",
]
