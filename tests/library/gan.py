"""A tiny GAN with manual optimization (two optimizers, both stepped every batch), written for the guarantee
suite's tests of modules that step more than once per batch, draw random numbers, and define no test or predict
step. It learns 2-D points from 4 Gaussian blobs; the latent codes come with the data, so 1 and 2 devices see
the same ones."""

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset, TensorDataset
from torchmetrics import MeanMetric

from ddpkit import GlobalBatchDataModule

LATENT = 4


def points(n: int, seed: int) -> TensorDataset:
    """`n` (point (n, 2), latent code (n, 4)) pairs: points around 4 centers, codes standard normal."""
    generator = torch.Generator().manual_seed(seed)
    centers = torch.tensor([[2.0, 0.0], [-2.0, 0.0], [0.0, 2.0], [0.0, -2.0]])
    which = torch.randint(0, 4, (n,), generator=generator)
    real = centers[which] + 0.3 * torch.randn(n, 2, generator=generator)
    return TensorDataset(real, torch.randn(n, LATENT, generator=generator))


class GanData(GlobalBatchDataModule):
    """256 training, 64 validation and 64 test pairs (the module defines no test or predict step).

    Args:
        global_batch_size: Samples per training step summed over all devices.
        micro_batch_size: Samples per forward pass on one device (None: its whole share).
    """

    def __init__(self, global_batch_size: int = 32, micro_batch_size: int | None = None) -> None:
        super().__init__(global_batch_size, micro_batch_size)

    def train_dataset(self) -> Dataset:
        return points(256, seed=0)

    def val_dataset(self) -> Dataset:
        return points(64, seed=1)

    def test_dataset(self) -> Dataset:
        return points(64, seed=2)


def mlp(inputs: int, outputs: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(inputs, 16), nn.LeakyReLU(0.2), nn.Linear(16, outputs))


class TinyGAN(L.LightningModule):
    """Generator (4 -> 2) and discriminator (2 -> 1), each with its own Adam, stepped once per batch each.

    Args:
        lr: Adam learning rate of both networks.
        noise_std: Standard deviation of noise added to the discriminator's inputs in training ("instance noise"),
            drawn in the training step: a functional random draw that 1 and 2 devices draw differently.
    """

    def __init__(self, lr: float = 1e-2, noise_std: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.lr, self.noise_std = lr, noise_std
        self.generator, self.discriminator = mlp(LATENT, 2), mlp(2, 1)
        self.val_loss = MeanMetric()

    def judge(self, points: Tensor) -> Tensor:
        if self.training and self.noise_std:
            points = points + self.noise_std * torch.randn_like(points)
        return self.discriminator(points).squeeze(-1)  # (B,) logits: real vs generated

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        real, latent = batch
        g_opt, d_opt = self.optimizers()
        fake = self.generator(latent)
        ones, zeros = torch.ones(len(real), dtype=real.dtype), torch.zeros(len(real), dtype=real.dtype)
        d_loss = F.binary_cross_entropy_with_logits(self.judge(real), ones)
        d_loss = d_loss + F.binary_cross_entropy_with_logits(self.judge(fake.detach()), zeros)
        d_opt.zero_grad()
        self.manual_backward(d_loss)
        d_opt.step()
        g_loss = F.binary_cross_entropy_with_logits(self.judge(fake), ones)
        g_opt.zero_grad()
        self.manual_backward(g_loss)
        g_opt.step()
        self.log_dict({"train/d_loss": d_loss.detach(), "train/g_loss": g_loss.detach()}, sync_dist=True)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        real, latent = batch
        ones = torch.ones(len(real), dtype=real.dtype)
        # The discriminator's loss on real points and on generated ones, per sample: each counted once on any ranks.
        self.val_loss.update(F.binary_cross_entropy_with_logits(self.judge(real), ones, reduction="none"))
        self.val_loss.update(F.binary_cross_entropy_with_logits(self(latent), 1 - ones, reduction="none"))
        self.log("val/d_loss", self.val_loss)

    def forward(self, latent: Tensor) -> Tensor:
        return self.discriminator(self.generator(latent)).squeeze(-1)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.Adam(self.generator.parameters(), lr=self.lr, betas=(0.5, 0.9)),
            torch.optim.Adam(self.discriminator.parameters(), lr=self.lr, betas=(0.5, 0.9)),
        ]
