"""A mid-epoch resume continues where it stopped when `configure_optimizers` reads
`trainer.estimated_stepping_batches` (a schedule sized to the fit: OneCycleLR, WarmupCosine): Lightning 2.6.6
builds the train loader for that estimate before it restores the checkpoint, and then drops the loader's
saved position (Lightning issue #20550); `ddpkit.data.sampling.ResumeLoaderPosition`, added by the CLI, applies it.
And it accumulates as before under a GradientAccumulationScheduler, which sets each epoch's accumulation at the
epoch's start, which Lightning skips for the epoch it resumes into; `ddpkit.run.checkpoints.ResumedAccumulation`,
added by the CLI, sets it. And a stop asked between the micro-batches of a step waits for the step's end."""

import os
import signal
import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from ddpkit import GlobalBatchDataModule
from ddpkit.parity import load_weights, max_abs
from ddpkit.testing.helpers import finish, start

HERE = Path(__file__).resolve().parent
STEPS_PER_EPOCH = 8  # 256 samples / global batch 32


class Points(GlobalBatchDataModule):
    """Random regression points."""

    def train_dataset(self) -> Dataset:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(256, 4, generator=g, dtype=torch.float64)
        return TensorDataset(x, x.sum(dim=1, keepdim=True))


class OneCycleRegressor(L.LightningModule):
    """A linear regressor whose one-cycle schedule spans the whole fit, as its documentation suggests."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
        total = self.trainer.estimated_stepping_batches
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


CONFIG = """
seed_everything: 0
model: {class_path: test_resume_schedule.OneCycleRegressor}
data: {class_path: test_resume_schedule.Points, init_args: {global_batch_size: 32}}
doctor: {enabled: false}
trainer:
  accelerator: cpu
  strategy: ddp
  devices: 1
  precision: 64-true
  max_epochs: 2
  logger: false
  enable_progress_bar: false
  enable_model_summary: false
  callbacks:
    - class_path: ddpkit.run.checkpoints.CurrentModelCheckpoint
      init_args: {every_n_train_steps: 4, save_top_k: -1, monitor: null, filename: "step{step}", auto_insert_metric_name: false}
"""
MAIN = "from pathlib import Path\nfrom ddpkit.run.cli import main\nmain(Path(__file__).with_name('config.yaml'))\n"


def fit(root: Path, *args: str, code: int = 0) -> str:
    proc = start([sys.executable, "main.py", "fit", "--trainer.default_root_dir", str(root), *args],
                 root.parent, {"PYTHONPATH": str(HERE)})  # fmt: skip
    result = finish(proc, timeout=300)
    assert result.returncode == code, result.stdout[-4000:]
    return result.stdout


class SigtermAt(L.Callback):
    """Sends this process SIGTERM as training batch `batch` (counted from 1 in the fit) starts, as `kill` would."""

    def __init__(self, batch: int) -> None:
        self.batch, self.seen = batch, 0

    def on_train_batch_start(self, trainer: L.Trainer, *args) -> None:
        self.seen += 1
        if self.seen == self.batch:
            os.kill(os.getpid(), signal.SIGTERM)


def test_resume_mid_epoch_with_a_fit_sized_schedule_matches_uninterrupted(tmp_path):
    """Resumed at step 12 (4 batches into epoch 1), the fit ends with the uninterrupted run's weights."""
    (tmp_path / "config.yaml").write_text(CONFIG)
    (tmp_path / "main.py").write_text(MAIN)
    fit(tmp_path / "whole")
    mid = tmp_path / "whole" / "checkpoints" / "step12.ckpt"
    assert torch.load(mid, weights_only=True)["global_step"] == 12
    fit(tmp_path / "resumed", "--ckpt_path", str(mid))
    whole, resumed = (load_weights(tmp_path / run / "checkpoints" / "step16.ckpt") for run in ("whole", "resumed"))
    # float64, the same samples in the same order: only a different sample order or lr moves the weights.
    assert max_abs(whole, resumed) <= 1e-12


# Epoch 0 steps after each of its 8 batches, epoch 1 after each pair: 8 + 4 steps; a checkpoint every 2.
GRADIENT_ACCUMULATION_SCHEDULE = """\
    - class_path: lightning.pytorch.callbacks.GradientAccumulationScheduler
      init_args: {scheduling: {1: 2}}
"""
SCHEDULED = CONFIG.replace("every_n_train_steps: 4", "every_n_train_steps: 2") + GRADIENT_ACCUMULATION_SCHEDULE


def test_resume_mid_epoch_under_an_accumulation_schedule_matches_uninterrupted(tmp_path):
    """Resumed at step 10 (4 batches, 2 steps, into epoch 1), the fit takes epoch 1's last 2 steps of 2 batches each,
    as the uninterrupted run did, and ends with its weights at step 12 (accumulating 1 batch a step, it ended at 14)."""
    (tmp_path / "config.yaml").write_text(SCHEDULED)
    (tmp_path / "main.py").write_text(MAIN)
    fit(tmp_path / "whole")
    saved = sorted(p.name for p in (tmp_path / "whole" / "checkpoints").glob("step*.ckpt"))
    assert saved == sorted(f"step{k}.ckpt" for k in range(2, 13, 2))
    fit(tmp_path / "resumed", "--ckpt_path", str(tmp_path / "whole" / "checkpoints" / "step10.ckpt"))
    written = (tmp_path / "resumed" / "checkpoints").iterdir()
    assert max(torch.load(p, weights_only=True)["global_step"] for p in written) == 12
    whole, resumed = (load_weights(tmp_path / run / "checkpoints" / "step12.ckpt") for run in ("whole", "resumed"))
    assert max_abs(whole, resumed) <= 1e-12


def test_a_stop_between_micro_batches_waits_for_the_step_and_resumes_the_same(tmp_path):
    """2 micro-batches a step (--data.micro_batch_size 16): SIGTERM as batch 3, the first of step 2, starts. The run
    saves last.ckpt after batch 4, where step 2 ends (saved after batch 3, it held step 2's first half as trained
    by nobody: no gradients are saved), and resumed from it ends with the uninterrupted run's weights."""
    (tmp_path / "config.yaml").write_text(CONFIG)
    (tmp_path / "main.py").write_text(MAIN)
    micro = ("--data.micro_batch_size", "16")
    fit(tmp_path / "whole", *micro)
    stop = ("--trainer.callbacks+=test_resume_schedule.SigtermAt", "--trainer.callbacks.batch", "3")
    out = fit(tmp_path / "stopped", *micro, *stop, code=128 + signal.SIGTERM)
    last = tmp_path / "stopped" / "checkpoints" / "last.ckpt"
    state = torch.load(last, weights_only=False)
    assert state["global_step"] == 2 and "stopped by SIGTERM at step 2" in out
    assert state["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["processed"] == 4  # batches trained
    fit(tmp_path / "resumed", *micro, "--ckpt_path", str(last))
    whole, resumed = (load_weights(tmp_path / run / "checkpoints" / "step16.ckpt") for run in ("whole", "resumed"))
    assert max_abs(whole, resumed) <= 1e-12
