"""The private Lightning and torch names the template relies on still exist and still do what it expects.

When one of these fails after an upgrade, ddp/lightning_internals.py is the one file to mend.
"""

import copy
import os

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI, OptimizerCallable
from lightning.pytorch.strategies import DDPStrategy
from packaging.version import Version
from torch.distributed.constants import default_pg_timeout

from ddpkit import lightning_internals as internals
from ddpkit.testing.toy import ToyClassifier
from ddpkit.testing.toy import main as toy_main

VERSIONS = (
    f"Lightning {L.__version__}, torch {torch.__version__} (the library is tested on Lightning 2.5.1 with torch 2.4.0 "
    "and Lightning 2.6.6 with torch 2.13.0)"
)


@pytest.mark.parametrize(
    ("owner", "name"),
    internals.PRIVATE_NAMES,
    ids=[f"{getattr(o, '__name__', o)}.{n}" for o, n in internals.PRIVATE_NAMES],
)
def test_private_name_exists(owner, name):
    """Each private name the template uses is still there."""
    assert hasattr(owner, name), f"{getattr(owner, '__name__', owner)}.{name} is gone in {VERSIONS}"


def trainer() -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_checkpointing=False)


def lightning_at_least(version: str) -> bool:
    return Version(L.__version__) >= Version(version)


@pytest.mark.parametrize(
    ("owner", "name", "since"), internals.SINCE, ids=[f"{o.__name__}.{n}" for o, n, _ in internals.SINCE]
)
def test_private_name_exists_from_its_release_on(owner, name, since):
    """A private name that the oldest supported releases lack exists exactly from the release that added it."""
    assert hasattr(owner, name) == lightning_at_least(since), f"{owner.__name__}.{name}, since {since}: {VERSIONS}"


def test_sigterm_broadcast_is_skipped_then_restored():
    """The loop's per-step broadcast (Lightning 2.5.2 on) is replaced by a no-op and comes back as the class's
    method; before 2.5.2 there is none, and nothing is set."""
    t = trainer()
    loop = t.fit_loop.epoch_loop
    internals.skip_sigterm_broadcast(t)
    if not lightning_at_least("2.5.2"):
        assert "_broadcast_sigterm_tensor" not in vars(loop) and not hasattr(loop, "_broadcast_sigterm_tensor")
        return
    assert loop._broadcast_sigterm_tensor() is None and "_broadcast_sigterm_tensor" in vars(loop), VERSIONS
    internals.restore_sigterm_broadcast(t)
    assert "_broadcast_sigterm_tensor" not in vars(loop)


def test_fetch_hooks_call_both_the_wrapper_and_lightning():
    """The wrapped fetch hooks call ours around Lightning's own, in order."""
    t = trainer()
    calls = []
    assert internals.wrap_fetch_hooks(t, lambda: calls.append("before"), lambda: calls.append("after")), VERSIONS
    loop = t.fit_loop.epoch_loop
    loop._on_before_fetch()
    loop._on_after_fetch()
    assert calls == ["before", "after"]


def test_ddp_timeout_is_read_and_written():
    """A DDPStrategy built without a timeout has torch's default; the setter changes what it will use."""
    strategy = DDPStrategy()
    assert internals.ddp_timeout(strategy) == default_pg_timeout, VERSIONS
    internals.set_ddp_timeout(strategy, default_pg_timeout / 6)
    assert internals.ddp_timeout(strategy) == default_pg_timeout / 6


def test_launcher_check_and_processes():
    """A subprocess launcher is recognised and its started processes listed; anything else has none."""
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    launcher = _SubprocessScriptLauncher(cluster_environment=None, num_processes=2, num_nodes=1)
    assert internals.is_subprocess_launcher(launcher) and internals.launched_processes(launcher) == []
    assert not internals.is_subprocess_launcher(object()) and internals.launched_processes(None) == []


def test_save_point_follows_validation():
    """A ModelCheckpoint saves at the end of the training epoch when there is no validation to wait for,
    and after validation when it is told to."""
    t = trainer()
    assert internals.saves_on_train_epoch_end(ModelCheckpoint(), t) is True, VERSIONS
    assert internals.saves_on_train_epoch_end(ModelCheckpoint(save_on_train_epoch_end=False), t) is False


def test_ddp_comm_hook_is_read():
    """The hook a DDPStrategy was given is returned; a strategy without one, or no DDPStrategy, gives None."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    assert internals.ddp_comm_hook(DDPStrategy(ddp_comm_hook=allreduce_hook)) is allreduce_hook, VERSIONS
    assert internals.ddp_comm_hook(DDPStrategy()) is None and internals.ddp_comm_hook(object()) is None


def test_ddp_kwargs_say_whether_ddp_looks_for_unused_parameters():
    """A DDPStrategy's DDP arguments are read: find_unused_parameters as given, as the registered alias
    `ddp_find_unused_parameters_true` sets it, and absent by default."""
    from lightning.pytorch.strategies import StrategyRegistry

    assert internals.ddp_kwargs(DDPStrategy(find_unused_parameters=True)) == {"find_unused_parameters": True}, VERSIONS
    alias = StrategyRegistry["ddp_find_unused_parameters_true"]["init_params"]
    assert internals.ddp_kwargs(DDPStrategy(**alias))["find_unused_parameters"] is True
    assert "find_unused_parameters" not in internals.ddp_kwargs(DDPStrategy())


def test_throughput_peak_reaches_every_stage():
    """After setup (no peak on the CPU), the new peak is the monitor's and that of each stage's meter."""
    from lightning.pytorch.callbacks import ThroughputMonitor
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.trainer.states import RunningStage, TrainerFn

    t, model = trainer(), BoringModel()
    t.state.fn, t.state.stage = TrainerFn.FITTING, RunningStage.TRAINING
    monitor = ThroughputMonitor(batch_size_fn=len)
    monitor.setup(t, model, "fit")
    internals.set_throughput_peak(monitor, 5e12)
    meters = list(monitor._throughputs.values())
    assert meters and monitor.available_flops == 5e12, VERSIONS
    assert [m.available_flops for m in meters] == [5e12] * len(meters)


def test_activation_checkpointing_recomputes_chosen_layers_only():
    """A chosen layer runs its forward again during backward, the others once; weights keep their names."""
    calls = {"first": 0, "second": 0}

    class Counted(torch.nn.Linear):
        def __init__(self, name: str) -> None:
            super().__init__(4, 4)
            self.name = name

        def forward(self, x):
            calls[self.name] += 1
            return super().forward(x)

    model = torch.nn.Sequential(Counted("first"), torch.nn.Tanh(), Counted("second"))
    keys = list(model.state_dict())
    internals.apply_activation_checkpointing(model, check_fn=lambda m: getattr(m, "name", None) == "first")
    model(torch.randn(2, 4)).sum().backward()
    assert calls == {"first": 2, "second": 1}, VERSIONS
    assert list(model.state_dict()) == keys


def test_subcommand_hook_wraps_the_whole_run(tmp_path):
    """`run_subcommand` runs around before_fit, the fit and after_fit, in that order."""
    from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

    calls = []

    class Recording(internals.SubcommandCLI):
        def run_subcommand(self, subcommand: str) -> None:
            calls.append(f"start {subcommand}")
            super().run_subcommand(subcommand)
            calls.append(f"end {subcommand} after {self.trainer.global_step} steps")

        def before_fit(self) -> None:
            calls.append("before_fit")

        def after_fit(self) -> None:
            calls.append("after_fit")

    args = ["fit", "--trainer.fast_dev_run=2", "--trainer.accelerator=cpu", f"--trainer.default_root_dir={tmp_path}"]
    Recording(BoringModel, BoringDataModule, args=args)
    assert calls == ["start fit", "before_fit", "after_fit", "end fit after 2 steps"], VERSIONS


@pytest.mark.environ  # sets TORCH_FR_BUFFER_SIZE, as the CLI does, before its process group forms
# It sets TORCH_FR_BUFFER_SIZE where no earlier test's CLI has: before any job's processes could inherit it.
@pytest.mark.environ
def test_flight_recorder_and_store_of_a_process_group(tmp_path, monkeypatch):
    """With TORCH_FR_BUFFER_SIZE as the CLI sets it, the flight recorder lists each collective of a gloo group with
    its sequence number and kind, newest last (torch 2.8 on; before, it lists none); the default store holds what a
    rank sets (hang.py's addresses)."""
    from ddpkit.run.hang import FLIGHT_RECORDER_ENV

    if FLIGHT_RECORDER_ENV[0] not in os.environ:
        monkeypatch.setenv(*FLIGHT_RECORDER_ENV)
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        torch.distributed.all_reduce(torch.ones(3))
        torch.distributed.barrier()
        torch.distributed.broadcast(torch.ones(2), src=0)
        newest = internals.flight_recorder_entries()[-3:]
        internals.default_store().set("ddpkit/test", "host 123")
        stored = internals.default_store().get("ddpkit/test")
    finally:
        torch.distributed.destroy_process_group()
    kinds = [(e["collective_seq_id"], e["profiling_name"]) for e in newest]
    recorded = [(1, "gloo:all_reduce"), (2, "gloo:barrier"), (3, "gloo:broadcast")] if torch_at_least("2.8") else []
    assert kinds == recorded and internals.records_gloo_collectives() == torch_at_least("2.8"), (kinds, VERSIONS)
    assert stored == b"host 123"


# ---- torch's names that arrived inside the supported range (TORCH_SINCE) -----------------------------------------


def torch_at_least(version: str) -> bool:
    return Version(torch.__version__.split("+")[0]) >= Version(version)


@pytest.mark.parametrize(
    ("owner", "name", "since"), internals.TORCH_SINCE, ids=[f"{o.__name__}.{n}" for o, n, _ in internals.TORCH_SINCE]
)
def test_torch_name_exists_from_its_release_on(owner, name, since):
    """A torch name that the oldest supported torch lacks exists exactly from the release that added it."""
    assert hasattr(owner, name) == torch_at_least(since), f"{owner.__name__}.{name}, since {since}: {VERSIONS}"


def test_fully_shard_shards_on_every_supported_torch(tmp_path):
    """FSDP2's `fully_shard`, found at its path for this torch, turns a module's parameters into DTensors on a
    1-process gloo mesh; its forward on CPU gives the unsharded module's output exactly where `shards_on_cpu` says
    it runs (torch 2.6 on), and fails for want of CUDA before."""
    from torch.distributed.device_mesh import init_device_mesh

    from ddpkit.model.sharding import shards_on_cpu

    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        layer, x = torch.nn.Linear(4, 3), torch.randn(2, 4)
        expected = layer(x)
        internals.fully_shard_function()(layer, mesh=init_device_mesh("cpu", (1,)))
        kinds = {type(p).__name__ for p in layer.parameters()}
        if shards_on_cpu():
            out = layer(x)
        elif not torch.cuda.is_available():
            with pytest.raises(RuntimeError, match="CUDA"):
                layer(x)
    finally:
        torch.distributed.destroy_process_group()
    assert kinds == {"DTensor"}, (kinds, VERSIONS)
    assert shards_on_cpu() == torch_at_least("2.6")
    if shards_on_cpu():
        assert torch.equal(out, expected)


class KeepsOptimizer(ToyClassifier):
    """The toy classifier taking its optimizer as LightningCLI's docs write it, and keeping it."""

    def __init__(self, optimizer: OptimizerCallable = torch.optim.AdamW, **kwargs) -> None:
        super().__init__(**kwargs)
        self.optimizer = optimizer

    def configure_optimizers(self):
        return self.optimizer(self.parameters())


def test_a_class_argument_the_module_keeps_holds_no_cli():
    """After the CLI builds the module, the optimizer it keeps is `partial(AdamW, lr=...)`: a copy of it copies no
    CLI and no trainer (jsonargparse's partial held the CLI and through it the trainer, so Lightning's
    EMAWeightAveraging failed on rank 0 of 2 processes with "cannot pickle '_thread.lock' object"), and it still
    builds the configured optimizer. Mutation: plain_callables not called (the copy holds the CLI)."""
    cli = toy_main(
        ["--trainer.devices", "1", "--trainer.logger", "false", "--model", "test_lightning_internals.KeepsOptimizer",
         "--model.optimizer.lr", "0.05"],
        run=False,
    )  # fmt: skip
    optimizer = cli.model.optimizer
    copied: dict = {}
    copy.deepcopy(optimizer, copied)
    assert not any(isinstance(obj, L.Trainer | LightningCLI) for obj in copied.values())
    built = optimizer([torch.nn.Parameter(torch.zeros(1))])
    assert isinstance(built, torch.optim.AdamW) and built.defaults["lr"] == 0.05
