"""MixUp and CutMix per sample, in the dataset: the same training on 1 and N devices.

The usual recipes mix a batch with itself: torchvision's reference scripts call `v2.MixUp`/`v2.CutMix` in the
collate function, timm's `Mixup` runs on the batch in the training loop. Under DDP each rank mixes its own share of
the global batch, with its own draws: a sample's partner and weight depend on the device count, so 1 and N devices
train other weights (the suite names it: draws.batch_draws, or the step's draws). Here a sample is mixed with a
partner drawn from the whole training set, with its own weight, inside `__getitem__`: GlobalBatchDataModule seeds
those draws from (seed, epoch, index), so sample 17 is mixed alike on any number of devices and workers, and
differently every epoch. That is timm's per-sample mode (`mode="elem"`), with the partner from the set rather than
from the flipped batch.
"""

from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset


class MixSamples(Dataset):
    """`dataset`'s (input, class index) samples, each mixed with another sample of it: (mixed input, soft target).

    Args:
        dataset: Gives (input, class index); the input a tensor, (..., H, W) for CutMix.
        num_classes: The length of the soft target.
        mixup_alpha: MixUp's weight ~ Beta(alpha, alpha); 0: no MixUp.
        cutmix_alpha: CutMix's pasted box covers 1 - Beta(alpha, alpha) of the image; 0: no CutMix.
        prob: The share of samples mixed; the others keep their input and a one-hot target.
        switch_prob: With both on, the share of mixed samples that get CutMix rather than MixUp.
        label_smoothing: Taken from the one-hot targets before they are mixed, as timm's Mixup does.
    """

    def __init__(
        self,
        dataset: Dataset,
        num_classes: int,
        mixup_alpha: float = 1.0,
        cutmix_alpha: float = 0.0,
        prob: float = 1.0,
        switch_prob: float = 0.5,
        label_smoothing: float = 0.0,
    ) -> None:
        if mixup_alpha < 0 or cutmix_alpha < 0 or mixup_alpha == cutmix_alpha == 0:
            raise ValueError(
                f"MixSamples: mixup_alpha={mixup_alpha}, cutmix_alpha={cutmix_alpha}: give one or both > 0"
            )
        self.dataset, self.num_classes = dataset, num_classes
        self.mixup_alpha, self.cutmix_alpha, self.prob, self.switch_prob = mixup_alpha, cutmix_alpha, prob, switch_prob
        self.label_smoothing = label_smoothing

    def __len__(self) -> int:
        return len(self.dataset)

    def target(self, label: Any) -> Tensor:
        off = self.label_smoothing / self.num_classes
        target = torch.full((self.num_classes,), off)
        target[int(label)] += 1.0 - self.label_smoothing
        return target

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        # Every draw from torch's global generator, in a fixed order: the data module's seeding reaches them all.
        x, label = self.dataset[index]
        target = self.target(label)
        if torch.rand(()).item() >= self.prob:
            return x, target
        other_x, other_label = self.dataset[int(torch.randint(len(self.dataset), ()))]
        other = self.target(other_label)
        cutmix = self.cutmix_alpha > 0 and (self.mixup_alpha == 0 or torch.rand(()).item() < self.switch_prob)
        alpha = self.cutmix_alpha if cutmix else self.mixup_alpha
        lam = float(torch.distributions.Beta(alpha, alpha).sample())
        if cutmix:
            x, lam = paste_box(x, other_x, lam)
        else:
            x = lam * x + (1.0 - lam) * other_x
        return x, lam * target + (1.0 - lam) * other


def paste_box(x: Tensor, other: Tensor, lam: float) -> tuple[Tensor, float]:
    """`x` with a box of `other` pasted in, the box's sides sqrt(1 - lam) of the image's around a random centre,
    clipped at the edges; and the share of `x` left, which weighs the targets (timm's `correct_lam`)."""
    h, w = x.shape[-2:]
    cut = (1.0 - lam) ** 0.5
    cy, cx = int(torch.randint(h, ())), int(torch.randint(w, ()))
    top, bottom = max(cy - int(h * cut) // 2, 0), min(cy + int(h * cut) // 2, h)
    left, right = max(cx - int(w * cut) // 2, 0), min(cx + int(w * cut) // 2, w)
    x = x.clone()
    x[..., top:bottom, left:right] = other[..., top:bottom, left:right]
    return x, 1.0 - (bottom - top) * (right - left) / (h * w)
