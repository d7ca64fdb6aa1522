"""ddpkit: the machinery of the ddp-template's projects, as a versioned library.

A project's own code meets it through a few public names: its data module subclasses
`GlobalBatchDataModule` (global batch, micro-batches, sampling, exact resume, exactly-once evaluation), or
`StreamingDataModule` for shards that do not fit in memory (the same promises, ddpkit.data.streaming),
its training set may mix samples with `MixSamples` (MixUp, CutMix), its `configure_optimizers` may return
`optimization(...)`, it may log a loss with `Mean` (a weighted mean over
the ranks), its `configure_model` may call `compile_layers` and `shard_layers`, and its `training_step` may
divide a loss by the global batch's count (`global_mean`), compare samples with every rank's (`gather_batch`), or
balance a mixture of experts' routers over the global batch (`router_balance_loss`).
`main.py` runs `ddpkit.run.cli.main`; `tests/` runs `ddpkit.testing`.

The modules live in one subpackage per concern (docs/design.md draws them): `data` (what a fit reads), `model`
(what a model's own code calls), `run` (the CLI and what it wires into a fit), `scaling` (measuring), `tune`
(searching), `testing` (the guarantee suite and the library's toy model); `parity`, `presets` and
`lightning_internals` stay on top.
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from typing import TYPE_CHECKING

# The one place the version is written: hatchling reads it for the package ([tool.hatch.version]); a run
# records it in its checkpoints, its logged hyperparameters and the doctor's report.
__version__ = "0.15.3"

# The public names, imported on first use (PEP 562): `python -m ddpkit.scaling` (the sweep's driver, --explain)
# needs neither torch nor Lightning, and importing them for every `python -m ddpkit.<tool>` cost ~3 s of start-up.
if TYPE_CHECKING:  # what editors and type checkers read
    from .data.global_batch import GlobalBatchDataModule
    from .data.mixing import MixSamples
    from .data.streaming import StreamingDataModule
    from .model.compiling import compile_layers
    from .model.losses import gather_batch, global_mean, router_balance_loss
    from .model.metrics import Mean
    from .model.schedules import WarmupCosine, optimization
    from .model.sharding import shard_layers

_HOMES = {
    "compile_layers": "model.compiling",
    "GlobalBatchDataModule": "data.global_batch",
    "gather_batch": "model.losses",
    "global_mean": "model.losses",
    "router_balance_loss": "model.losses",
    "Mean": "model.metrics",
    "MixSamples": "data.mixing",
    "WarmupCosine": "model.schedules",
    "optimization": "model.schedules",
    "shard_layers": "model.sharding",
    "StreamingDataModule": "data.streaming",
}

__all__ = [
    "GlobalBatchDataModule",
    "Mean",
    "MixSamples",
    "StreamingDataModule",
    "WarmupCosine",
    "__version__",
    "compile_layers",
    "gather_batch",
    "global_mean",
    "optimization",
    "router_balance_loss",
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


# Every module of the flat layout (0.4.0 and before) and where it lives now. Users' code, their config.yaml's
# class_paths and pickled checkpoints name the old paths: each still imports, as the very module of the new path
# (one module object, so classes stay identical). `ddpkit.data`, `ddpkit.scaling` and `ddpkit.tune` became their
# concern's package: the package itself hands out the old module's names (its __getattr__).
MOVED = {
    f"ddpkit.{old}": f"ddpkit.{new}"
    for old, new in {
        "data": "data.global_batch",
        "sampling": "data.sampling",
        "sources": "data.sources",
        "streaming": "data.streaming",
        "batchnorm": "model.batchnorm",
        "compiling": "model.compiling",
        "matmul": "model.matmul",
        "schedules": "model.schedules",
        "sharding": "model.sharding",
        "checkpoints": "run.checkpoints",
        "checks": "run.checks",
        "ckpt_paths": "run.ckpt_paths",
        "cli": "run.cli",
        "faults": "run.faults",
        "hang": "run.hang",
        "logdirs": "run.logdirs",
        "predictions": "run.predictions",
        "processes": "run.processes",
        "requeue": "run.requeue",
        "stop": "run.stop",
        "strategy": "run.strategy",
        "trackers": "run.trackers",
        "trial": "run.trial",
        "diagnosis": "scaling.diagnosis",
        "doctor": "scaling.doctor",
        "gap": "scaling.gap",
        "measure": "scaling.measure",
        "record": "scaling.record",
        "scaling": "scaling.sweeper",
        "throughput": "scaling.throughput",
        "lr_finder": "tune.lr_finder",
        "lr_sweep": "tune.lr_sweep",
        "study": "tune.study",
        "tune": "tune.search",
        "tune_checks": "tune.checks",
        "tune_devices": "tune.devices",
        "tune_report": "tune.report",
        "tune_run": "tune.run",
        "tune_space": "tune.space",
        "tune_worker": "tune.worker",
        "toy": "testing.toy",
    }.items()
}


class _AliasSpec(importlib.machinery.ModuleSpec):
    """An old path's spec. runpy gives `python -m ddpkit.<old>` the spec's parent as __package__: the new module's,
    so that its relative imports resolve."""

    @property
    def parent(self):
        return MOVED[self.name].rpartition(".")[0]


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module path as its new module, and gives runpy (`python -m ddpkit.<old>`) the new code."""

    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None or new.startswith(fullname + "."):  # not moved, or its package answers for it
            return None
        home = importlib.util.find_spec(new)  # imports the new module's package, not the module
        spec = _AliasSpec(fullname, self, origin=home.origin)
        spec.has_location = True  # __file__ is the new module's file: toy.py finds toy.yaml beside it
        return spec

    def create_module(self, spec):
        module = importlib.import_module(MOVED[spec.name])
        spec.loader_state = module.__spec__  # the import system sets the alias's spec on it next: put back below
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state  # the module is already executed, under its new name

    # runpy: `python -m ddpkit.<old>` runs the new module's code as __main__, and imports neither name
    def get_code(self, fullname):
        return importlib.util.find_spec(MOVED[fullname]).loader.get_code(MOVED[fullname])

    def get_source(self, fullname):
        return importlib.util.find_spec(MOVED[fullname]).loader.get_source(MOVED[fullname])

    def is_package(self, fullname):
        return False


if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
    sys.meta_path.append(_Alias())
