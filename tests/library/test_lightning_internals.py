"""The private Lightning and torch names the template relies on still exist and still do what it expects.

When one of these fails after an upgrade, ddp/lightning_internals.py is the one file to mend.
"""

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.constants import default_pg_timeout

from ddpkit import lightning_internals as internals

VERSIONS = f"Lightning {L.__version__}, torch {torch.__version__} (the template was measured on 2.6.6 / 2.13.0)"


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


def test_sigterm_broadcast_is_skipped_then_restored():
    """The loop's per-step broadcast is replaced by a no-op and comes back as the class's method."""
    t = trainer()
    loop = t.fit_loop.epoch_loop
    internals.skip_sigterm_broadcast(t)
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
