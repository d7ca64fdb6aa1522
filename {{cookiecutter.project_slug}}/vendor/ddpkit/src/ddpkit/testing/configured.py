"""What config.yaml selects, measured the way main.py builds it: the guarantee tests follow these numbers.

`python -m ddpkit.testing.configured [main.py arguments]`, run in the project's directory, prints one JSON
line; `describe()` runs it in a process forked from the fork server (building a Trainer in the test process
would set up its environment there).
"""

import copy
import inspect
import json
import random
import re
import sys
import tempfile
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
        # Lightning counts a manual-optimization module's optimizer.step() calls as its steps (several a batch).
        "manual_optimization": not model.automatic_optimization,
        # The stages the module defines a step for (`validate`, `test` and `predict` fail without one; Lightning's
        # default predict_step calls forward on the whole batch, which few modules take).
        "stages": [
            stage
            for stage, hook in (("validate", "validation_step"), ("test", "test_step"), ("predict", "predict_step"))
            if getattr(type(model), hook) is not getattr(L.LightningModule, hook)
        ],
        # Micro-batches change BatchNorm's statistics: no accumulation runs, no rounding reference from them.
        "batchnorm": any(isinstance(m, BatchNormBase) for m in model.modules()),
    }
    if info["global_batch_data"]:
        data.prepare_data()  # as Lightning calls it before setup: a module may write its data there (shards)
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
        info |= probe_training_step(model, data, cli.config["model"])
    return info


# Init arguments whose name says they set a random draw's size (a dropout rate, a noise level).
RATE_NAMES = re.compile(r"drop|noise", re.IGNORECASE)


def probe_training_step(model, data, model_config) -> dict:
    """Train one batch twice from the same weights on the same batch (the sampler's seed stays fixed), with
    torch's, Python's and NumPy's random streams seeded 0 and then 1, no dropout modules (as in the suite's runs).

    - `steps_per_batch`: optimizer steps the batch made (the trainer's global_step: one per optimizer.step()
      call, so 2 for a GAN stepping two optimizers);
    - `random_step`: "" when the two ends are equal bit for bit, else why 1 and N devices cannot train the same
      weights (functional dropout, noise drawn in the step: each rank draws its own) and how to switch it off.
    """
    import lightning as L
    import numpy as np
    import torch

    from .parity_probe import NoDropout

    ends = []
    for seed in (0, 1):
        torch.manual_seed(seed), random.seed(seed), np.random.seed(seed)
        trained = copy.deepcopy(model)
        with tempfile.TemporaryDirectory() as root:
            trainer = L.Trainer(
                accelerator="cpu", devices=1, precision="64-true", max_epochs=1, limit_train_batches=1,
                limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, callbacks=[NoDropout()], default_root_dir=root,
            )  # fmt: skip
            trainer.fit(trained, datamodule=data)
        ends.append((trainer.global_step, trained.state_dict()))
    (steps, first), (_, second) = ends
    changed = [k for k in first if not torch.equal(first[k], second[k])]
    random_step = ""
    if changed:
        given = model_config.get("init_args") if hasattr(model_config, "get") else None
        given = given.as_dict() if hasattr(given, "as_dict") else {}
        random_step = (
            f"{type(model).__name__}'s training step draws random numbers (one step from the same weights and batch "
            f"under seeds 0 and 1 changes {len(changed)} of {len(first)} tensors differently, e.g. {changed[0]}), "
            f"so 1 and N devices cannot train the same weights: {switch_off(given)}, or draw it in the data set "
            "(the manual: vendor/ddpkit/docs/your-model.md, step 2)"
        )
    return {"steps_per_batch": steps, "random_step": random_step}


def switch_off(given: dict) -> str:
    """How to switch a training step's random draw off for the checks, from the model's init arguments `given`:
    those named like a rate (RATE_NAMES) that are on, each with the value that turns it off where the type says
    it (a number: 0, a bool: false), else named with its value."""
    switches, others = [], []
    for name, value in given.items():
        if not RATE_NAMES.search(name) or not value or value is None:
            continue
        if isinstance(value, bool):
            switches.append(f"--model.{name} false")
        elif isinstance(value, int | float):
            switches.append(f"--model.{name} 0")
        else:
            others.append(f"--model.{name} (now {value!r})")
    if switches:
        line = f"switch the draw off for the checks with PARITY_ARGS='{' '.join(switches)}'"
        return line + (f"; also look at {', '.join(others)}" if others else "")
    if others:
        return f"set {', '.join(others)} to the value that draws nothing, for the checks, in PARITY_ARGS"
    return (
        "none of the model's arguments is a dropout or noise rate that is on: give the draw a switch and set it "
        "off for the checks in PARITY_ARGS"
    )


def cli() -> None:
    args, sys.argv = sys.argv[1:], sys.argv[:1]  # LightningCLI reads sys.argv too when given args
    print(json.dumps(_measure(args)))


if __name__ == "__main__":
    cli()
