"""What config.yaml selects, measured the way main.py builds it: the guarantee tests follow these numbers.

`python -m ddpkit.testing.configured [main.py arguments]`, run in the project's directory, prints one JSON
line; `describe()` runs it in a process forked from the fork server (building a Trainer in the test process
would set up its environment there).
"""

import inspect
import json
import sys
from pathlib import Path

from ..lightning_internals import BatchNormBase
from .helpers import project, run_main


def describe(*args: str) -> dict:
    """Sizes and steps of the configured data module, and what the configured model overrides."""
    result = run_main(*args, cwd=project(), timeout=180, entry="configured")
    assert result.returncode == 0, result.stdout[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _measure(args: list[str]) -> dict:
    import lightning as L

    sys.path.insert(0, str(Path.cwd()))  # the project, as `python main.py` puts main.py's directory first
    from main import main

    from ddpkit import GlobalBatchDataModule

    cpu = ["--trainer.logger", "false", "--trainer.accelerator", "cpu", "--trainer.devices", "1"]
    cli = main([*args, *cpu], run=False)
    model, data = cli.model, cli.datamodule
    info = {
        "model": f"{type(model).__module__}.{type(model).__qualname__}",
        "data": f"{type(data).__module__}.{type(data).__qualname__}",
        "global_batch_data": isinstance(data, GlobalBatchDataModule),
        # The accumulation runs set --data.micro_batch_size, which exists only if the class takes it.
        "takes_micro_batch_size": "micro_batch_size" in inspect.signature(type(data).__init__).parameters,
        # Sharding needs the module to shard its own layers (ModelParallelStrategy does not do it for it).
        "shards_layers": type(model).configure_model is not L.LightningModule.configure_model,
        # The schedule parity runs set --model.scheduler, which exists only if the model takes it.
        "takes_scheduler": "scheduler" in inspect.signature(type(model).__init__).parameters,
        # Micro-batches change BatchNorm's statistics: no accumulation runs, no rounding reference from them.
        "batchnorm": any(isinstance(m, BatchNormBase) for m in model.modules()),
    }
    if info["global_batch_data"]:
        data.setup("fit")
        info |= {
            "train_size": len(data.train_set),
            "global_batch_size": data.global_batch_size,
            "steps_per_epoch": len(data.train_set) // data.global_batch_size,
            "val_size": len(data.val_set) if data.val_set is not None else 0,
        }
        data.setup("test")
        info["test_size"] = len(data.test_set) if data.test_set is not None else 0
        data.setup("predict")
        info["predict_size"] = len(data.predict_set) if data.predict_set is not None else 0
    return info


def cli() -> None:
    args, sys.argv = sys.argv[1:], sys.argv[:1]  # LightningCLI reads sys.argv too when given args
    print(json.dumps(_measure(args)))


if __name__ == "__main__":
    cli()
