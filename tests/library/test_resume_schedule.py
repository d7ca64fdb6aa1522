"""A mid-epoch resume continues where it stopped when `configure_optimizers` reads
`trainer.estimated_stepping_batches` (a schedule sized to the fit: OneCycleLR, WarmupCosine): Lightning 2.6.6
builds the train loader for that estimate before it restores the checkpoint, and then drops the loader's
saved position (Lightning issue #20550); `ddpkit.data.sampling.ResumeLoaderPosition`, added by the CLI, applies it."""

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


def fit(root: Path, *args: str) -> None:
    proc = start([sys.executable, "main.py", "fit", "--trainer.default_root_dir", str(root), *args],
                 root.parent, {"PYTHONPATH": str(HERE)})  # fmt: skip
    result = finish(proc, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]


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
