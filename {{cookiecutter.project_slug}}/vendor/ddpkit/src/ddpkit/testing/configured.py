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
from types import SimpleNamespace

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler, StochasticWeightAveraging
from lightning.pytorch.strategies import DDPStrategy

from ..data.draws import batch_draws, own_draws
from ..data.sampling import replaced_sampler
from ..lightning_internals import BatchNormBase, ddp_kwargs
from ..model.losses import spans_global_batch
from ..run.init_args import init_arguments
from .helpers import project, run_main
from .loss_probe import batch_mean_line, probe_trainer, router_aux
from .parity_probe import NoDropout, sample_keys


def describe(*args: str) -> dict:
    """Sizes and steps of the configured data module, and what the configured model overrides."""
    result = run_main(*args, cwd=project(), timeout=180, entry="configured")
    assert result.returncode == 0, result.stdout[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _measure(args: list[str]) -> dict:
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
        "takes_micro_batch_size": "micro_batch_size" in init_arguments(cli.config["data"], data),
        # Sharding needs the module to shard its own layers (ModelParallelStrategy does not do it for it).
        "shards_layers": shards_in_configure_model(type(model)),
        # The schedule parity runs set --model.scheduler, which exists only if the model takes it.
        "takes_scheduler": "scheduler" in init_arguments(cli.config["model"], model),
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
        # A loss over the global batch's gathered rows: no micro-batch runs either (the CLI refuses them).
        "spans_batch": spans_global_batch(model),
        # A Hugging Face MoE's router balance over each rank's tokens, in words: the one-step check's failure names it.
        "router_aux": router_aux(model),
        **callback_facts(cli.trainer.callbacks),
    }
    if info["global_batch_data"]:
        data.prepare_data()  # as Lightning calls it before setup: a module may write its data there (shards)
        data.trainer = cli.trainer  # as fit attaches it: a train_dataloader() of the user's may read it
        data.setup("fit")
        info |= {
            "train_size": len(data.train_set),
            "global_batch_size": data.global_batch_size,
            "steps_per_epoch": data.train_sampler().num_global_batches,  # of train_order's epoch, if given
            "val_size": len(data.val_set) if data.val_set is not None else 0,
            # The causes that stop the runs from seeing the same samples, one sentence each (plugin's `steps`).
            "dataset_draws": own_draws(data.train_set) if data.seeded_draws else "",
            "replaced_sampler": (replaced := replaced_sampler(data, loader := data.train_dataloader())),
            # A sampler of the user's draws its order per pass, which reads as a draw per batch: its line comes first.
            "batch_draws": batch_draws(loader) if data.seeded_draws and not replaced else "",
        }
        data.setup("test")
        info["test_size"] = len(data.test_set) if data.test_set is not None else 0
        data.setup("predict")
        info["predict_size"] = len(data.predict_set) if data.predict_set is not None else 0
        strategy = cli.trainer.strategy
        unused_ok = (
            ddp_kwargs(strategy).get("find_unused_parameters", False) if isinstance(strategy, DDPStrategy) else None
        )
        strategy_config = cli.config["trainer"].get("strategy")
        if not info["batch_draws"]:  # with draws per batch the step's probes would blame the step or the loss
            info |= probe_training_step(model, data, cli.config["model"], unused_ok, strategy_config)
    return info


def callback_facts(callbacks: list) -> dict:
    """What the config's callbacks change for the checks. `averaging`: the class names of those that average the
    module's weights, Lightning's StochasticWeightAveraging and WeightAveraging (EMAWeightAveraging's base, from
    Lightning 2.6), subclasses too: they copy the module, which a sharded one refuses (check_sharded); `swa`: one of
    them is SWA, which swaps the schedule (check_parity); `accumulation`: the batches a GradientAccumulationScheduler
    accumulates per optimizer step in epoch 0 and 1 of the runs ([] without one): it sets the steps (runs.plan)."""
    from lightning.pytorch import callbacks as lightning_callbacks

    kinds = tuple(getattr(lightning_callbacks, name, None) for name in ("StochasticWeightAveraging", "WeightAveraging"))
    averaging = [c for c in callbacks if isinstance(c, tuple(k for k in kinds if k is not None))]
    schedules = [c for c in callbacks if isinstance(c, GradientAccumulationScheduler)]
    return {
        "averaging": [type(c).__name__ for c in averaging],
        "swa": any(isinstance(c, StochasticWeightAveraging) for c in averaging),
        "accumulation": [schedules[0].get_accumulate_grad_batches(epoch) for epoch in (0, 1)] if schedules else [],
    }


# What a configure_model that shards names: ddpkit's shard_layers, torch's fully_shard or parallelize_module (tensor
# parallel), or the device mesh they take.
SHARDING_NAMES = {"shard_layers", "fully_shard", "parallelize_module", "device_mesh"}


def shards_in_configure_model(module: type) -> bool:
    """Whether the module's configure_model, or a method of the module it calls, names a way to shard
    (SHARDING_NAMES). Lightning also recommends configure_model for building large layers in place, which shards
    nothing: under ModelParallelStrategy such a module then fails to save ("Could not find a distributed model")."""
    if module.configure_model is L.LightningModule.configure_model:
        return False
    seen, todo = set(), [inspect.unwrap(module.configure_model).__code__]
    while todo:
        code = todo.pop()
        if code in seen:
            continue
        seen.add(code)
        if SHARDING_NAMES & set(code.co_names):
            return True
        todo += [const for const in code.co_consts if inspect.iscode(const)]  # comprehensions, lambdas
        for name in code.co_names:
            method = getattr(module, name, None)
            if inspect.isfunction(method) and method is not getattr(L.LightningModule, name, None):  # the module's own
                todo.append(inspect.unwrap(method).__code__)
    return False


# Init arguments whose name says they set a random draw's size or chance (a dropout rate, a noise level, MixUp's or
# CutMix's alpha as timm's Mixup takes it, a masking probability as Hugging Face's speech models take it
# (`mask_time_prob`), torchvision's `stochastic_depth_prob`): 0 switches it off. Not MAE's `mask_ratio`: its loss is
# over the masked patches, and 0 masks none (Hugging Face's ViTMAE then divides by 0); its draw belongs in the data
# set, per sample (ViTMAE's forward takes the `noise`).
RATE_NAMES = re.compile(r"drop|noise|mix|prob(?!lem)|stochastic|augment", re.IGNORECASE)


def probe_training_step(model, data, model_config, unused_ok: bool | None = None, strategy_config=None) -> dict:
    """Train one batch twice from the same weights, no dropout modules (as in the suite's runs): the data module set
    up and the batch loaded under the same seeds both times, then torch's, Python's and NumPy's random streams seeded
    0 for the step of the first and 1 for the step of the second.

    - `steps_per_batch`: optimizer steps the batch made (the trainer's global_step: one per optimizer.step()
      call, so 2 for a GAN stepping two optimizers);
    - `random_step`: "" when the two ends are equal bit for bit, or when the two batches differ (then the data, not
      the step, changed: the ranks' data is checked by check_data.py), else why 1 and N devices cannot train the same
      weights (functional dropout, noise drawn in the step: each rank draws its own) and how to switch it off;
    - `batch_mean`: "" unless the loss of the batch is not the mean of its samples' losses (a count the batch works
      out: loss_probe.py), else the line that says so and the fix;
    - `unused_parameters`: "" unless a backward of the step leaves a parameter that requires a gradient without one
      while `unused_ok` is False (the configured DDP does not look for unused parameters; None: not DDP): then
      DDP's runs would stop at their first step, and the line says which parameters and the setting.
    """
    ends, attached = [], getattr(data, "trainer", None)
    for seed in (0, 1):
        seed_streams(0)
        trained = copy.deepcopy(model)
        step = OneStep(seed)
        with tempfile.TemporaryDirectory() as root:
            trainer = probe_trainer(root, step, max_epochs=1, limit_train_batches=1)
            trainer.fit(trained, datamodule=data)
        # What the step saw, without the callback: Lightning gives each callback the module's `log`, and so the
        # module and its trainer with the optimizer's state. Fit attached its trainer to the data module too, which
        # the next probes deep-copy: put back. The fit's objects are then left to the collector (probe_trainer).
        seen = SimpleNamespace(batch=step.batch, unused=step.unused, trainable=step.trainable)
        ends.append((trainer.global_step, trained.state_dict(), seen))
        data.trainer = attached
        del trainer, trained, step
    (steps, first, one), (_, second, other) = ends
    changed = [k for k in first if not torch.equal(first[k], second[k])]
    random_step = ""
    if changed and one.batch == other.batch:
        given = model_config.get("init_args") if hasattr(model_config, "get") else None
        given = given.as_dict() if hasattr(given, "as_dict") else {}
        random_step = (
            f"{type(model).__name__}'s training step draws random numbers (one step from the same weights and batch "
            f"under seeds 0 and 1 changes {len(changed)} of {len(first)} tensors differently, e.g. {changed[0]}), "
            f"so 1 and N devices cannot train the same weights: {switch_off(given)}, or draw it in the data set, "
            "per sample (MixUp and CutMix: ddpkit.MixSamples; the manual: vendor/ddpkit/docs/your-model.md, step 2)"
        )
    unused = "" if unused_ok in (True, None) or not one.unused else unused_line(model, one, strategy_config)
    # A step that draws random numbers differs in micro-batches anyway: that line comes first. A loss declared over
    # the global batch differs in micro-batches by design, and is compared on 1 and N devices without them.
    batch_mean = "" if random_step or unused or spans_global_batch(model) else batch_mean_line(model, data)
    return {"steps_per_batch": steps, "random_step": random_step, "unused_parameters": unused, "batch_mean": batch_mean}


def seed_streams(seed: int) -> None:
    """Seed torch's, Python's and NumPy's global random streams."""
    torch.manual_seed(seed), random.seed(seed), np.random.seed(seed)


class OneStep(NoDropout):
    """What probe_training_step watches in its one-batch fit: the batch's samples (the collated rows: one process,
    one collate function), the random streams seeded `seed` when the step begins, and the parameters that require a
    gradient but got none in some backward (a hook on each, counted from a backward's start to its end: a GAN's
    discriminator step leaves the generator out, as DDP sees it)."""

    def __init__(self, seed: int) -> None:
        self.seed, self.batch, self.trainable, self.unused, self.got, self.hooks = seed, None, [], [], set(), []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        named = [(name, p) for name, p in pl_module.named_parameters() if p.requires_grad]
        self.trainable = [name for name, _ in named]
        self.hooks = [p.register_post_accumulate_grad_hook(lambda _, n=name: self.got.add(n)) for name, p in named]

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        self.batch = sample_keys(batch)
        seed_streams(self.seed)

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss) -> None:
        self.got = set()

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.unused += [name for name in self.trainable if name not in self.got and name not in self.unused]

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for hook in self.hooks:
            hook.remove()


def unused_line(model, step, strategy_config) -> str:
    """The one line that says which parameters get no gradient and how to have DDP look for them: the strategy alias
    where config.yaml names the strategy by a name (`ddp`), the argument where it gives a class."""
    names = step.unused
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    if isinstance(strategy_config, str) or strategy_config is None:
        setting = (
            "set `strategy: ddp_find_unused_parameters_true` under `trainer:` in config.yaml "
            "(--trainer.strategy ddp_find_unused_parameters_true)"
        )
    else:
        setting = (
            "set `find_unused_parameters: true` in the strategy's init_args in config.yaml "
            "(--trainer.strategy.find_unused_parameters true)"
        )
    return (
        f"{type(model).__name__}'s training step leaves {len(names)} of {len(step.trainable)} parameter tensors "
        f'without a gradient ({shown}), and DDP then stops at the first step (Lightning: "parameters that were not '
        f'used in producing the loss"): {setting}; it costs a pass over the graph every step (the manual: '
        "vendor/ddpkit/docs/your-model.md, step 2)"
    )


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
        "none of the model's arguments is a dropout, noise, masking or mixing rate or probability that is on: give "
        "the draw a switch and set it off for the checks in PARITY_ARGS"
    )


def cli() -> None:
    args, sys.argv = sys.argv[1:], sys.argv[:1]  # LightningCLI reads sys.argv too when given args
    print(json.dumps(_measure(args)))


if __name__ == "__main__":
    cli()
