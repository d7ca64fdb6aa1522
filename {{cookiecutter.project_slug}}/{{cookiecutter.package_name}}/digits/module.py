"""The LightningModule: loss, metrics and optimizer around the plain `MLP`.

Nothing here knows how many devices there are. The Trainer's strategy wraps
the model in DDP; torchmetrics states are summed over ranks when computed, so
validation and test numbers count every sample exactly once on any world size.
"""

import lightning as L
import torch
import torch.nn.functional as F
from ddpkit import Mean, compile_layers, optimization, shard_layers
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from .model import MLP


class DigitsClassifier(L.LightningModule):
    """Classifies 8x8 digit images.

    Args:
        hidden_dim: Width of each hidden layer.
        num_layers: Number of hidden layers.
        in_features: Pixels per image.
        num_classes: Number of labels.
        optimizer: The optimizer class, called with the parameters; its learning rate is for the global
            batch, so it does not change with the device count. config.yaml: AdamW, lr 3e-3, weight decay
            1e-4. Another: --model.optimizer torch.optim.SGD --model.optimizer.lr 0.1 (arguments the two
            classes share, such as weight_decay, carry over unless given).
        scheduler: A learning-rate schedule called with the optimizer, or None for a constant lr, e.g.
            --model.scheduler ddpkit.model.schedules.WarmupCosine
            --model.scheduler.warmup_steps 32 (stepped per optimizer step).
        compile: Compile the MLP with torch.compile (the first steps then wait for the compiler).
    """

    def __init__(
        self,
        hidden_dim: int = 128,
        num_layers: int = 2,
        in_features: int = 64,
        num_classes: int = 10,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        scheduler: LRSchedulerCallable | None = None,
        compile: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        # Plain attributes, not self.hparams: a subclass with its own __init__ saves only its own arguments.
        self.optimizer, self.scheduler, self.compile_model = optimizer, scheduler, compile
        self.model = MLP(in_features, hidden_dim, num_layers, num_classes)
        # One metric object per stage: their states are reset and synced independently.
        # ddpkit's Mean, not MeanMetric: a NaN loss shows as NaN, no device-to-host sync on every update
        # (MeanMetric's NaN check), and update(loss, weight=n) is kept (MeanMetric(nan_strategy="disable")
        # drops the weight in torchmetrics 1.9.0).
        self.train_loss = Mean()
        self.val_loss, self.val_acc = (
            Mean(),
            MulticlassAccuracy(num_classes, average="micro"),
        )
        self.test_loss, self.test_acc = (
            Mean(),
            MulticlassAccuracy(num_classes, average="micro"),
        )

    def configure_model(self) -> None:
        if self.compile_model:
            compile_layers([self.model])
        # Only under ModelParallelStrategy (configs/model_parallel.yaml) is there a device mesh: then each
        # Linear layer is sharded over the ranks. Under DDP this does nothing.
        if self.device_mesh is not None:
            shard_layers(self.model, [m for m in self.model.modules() if isinstance(m, nn.Linear)], self.device_mesh)

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.train_loss.update(loss.detach())  # every training batch has the same size
        if self._writes_logs_this_step():
            # Every rank holds the same number of samples, so the mean of the ranks' means is the
            # global loss. The all-reduce runs only on steps the logger writes, not on every step.
            self.log("train/loss", loss.detach(), sync_dist=True, on_step=True, on_epoch=False, prog_bar=True)
        return loss

    def on_train_epoch_end(self) -> None:
        # Lightning computes (one sync over ranks) and resets the metric: the epoch's global mean loss.
        self.log("train/loss_epoch", self.train_loss)

    def _writes_logs_this_step(self) -> bool:
        # Lightning writes step metrics when (steps so far + 1) is a multiple of log_every_n_steps.
        trainer = self.trainer
        return trainer.logger is not None and (trainer.global_step + 1) % trainer.log_every_n_steps == 0

    def _evaluate(
        self, batch: tuple[Tensor, Tensor], loss_metric: Mean, acc_metric: MulticlassAccuracy, stage: str
    ) -> None:
        x, y = batch
        logits = self(x)
        # Per-sample losses: the mean over the whole set, whatever the batch and rank sizes.
        loss_metric.update(F.cross_entropy(logits, y, reduction="none"))
        acc_metric.update(logits, y)
        # Logging the metric objects lets Lightning call compute() (one sync) at the end of the epoch.
        self.log(f"{stage}/loss", loss_metric, on_step=False, on_epoch=True)
        self.log(f"{stage}/acc", acc_metric, on_step=False, on_epoch=True, prog_bar=stage == "val")

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, self.val_loss, self.val_acc, "val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, self.test_loss, self.test_acc, "test")

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self(batch[0]).argmax(dim=-1)

    def configure_optimizers(self) -> torch.optim.Optimizer | dict:
        return optimization(self, self.optimizer(self.parameters()), self.scheduler)
