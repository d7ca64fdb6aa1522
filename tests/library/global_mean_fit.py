"""Fits for test_global_mean.py: `python global_mean_fit.py OUT DEVICES NAME...` trains each named variant, one fit
after another in the same processes (Lightning launches rank 1 at the first fit), and rank 0 writes
OUT/{DEVICES}dev-NAME.pt: the trained weights, the `train/loss` logged at each step and the learning-rate sweep's
losses. `Tagger` and `Sequences` are also the model and data of the suite's probe tests.

NAME is LOSS-COUNT-ACCUMULATION, e.g. tokens-global-2:
- LOSS: `tokens` (a per-token cross-entropy over padded sequences of 1 to 8 tokens), `weighted` (a class-weighted
  cross-entropy, one label a sequence), `masked` (a masked mean squared error), `contrastive` (a CLIP-style loss:
  each sequence's first token and its other tokens' mean are two views, each matched against the batch's others);
- COUNT: `global` (ddpkit.global_mean: the step's count over every rank and micro-batch) or `batch` (the mean over the
  batch the step is given: the loss as usually written, which divides by each rank's, each micro-batch's count); for
  `contrastive`: `batch` (each rank's own rows, as usually written), `gathered` (each rank's rows against every
  rank's, ddpkit.gather_batch) or `everywhere` (the global batch's loss on every rank, open_clip's local_loss=False);
  for `router` (a cross-entropy of each sequence's first token plus a mixture of experts' load-balancing loss over
  every non-padding token's router logits): `batch` (the balance of the batch the step is given, as Hugging Face's
  MoE models compute it, who then hold `config.output_router_logits`) or `global` (ddpkit.router_balance_loss);
- ACCUMULATION: micro-batches per optimizer step.
Each fit: float64, 4 optimizer steps of a global batch of 16 sequences, SGD, gradient clipping at norm 0.8 and the
learning-rate finder's sweep (ddpkit.tune.lr_sweep.LRSweep, lr 0.1 to 1). The gradient's norm is 0.3 to 1.4 (0.33 to
0.43 for `tokens`): the clipping cuts some steps and not others, so both a gradient of the wrong scale and a clipping
that saw one change the weights; the sweep records what it takes for the step's loss.
"""

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import torch
import torch.nn.functional as F
from ddpkit import GlobalBatchDataModule, gather_batch, global_mean, router_balance_loss
from ddpkit.tune.lr_sweep import LRSweep
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

GLOBAL_BATCH, STEPS, TOKENS, FEATURES, CLASSES, EXPERTS, TOP_K = 16, 4, 8, 6, 5, 4, 2
PAD = -100
CLASS_WEIGHTS = torch.tensor([0.2, 1.0, 3.0, 0.5, 2.0], dtype=torch.float64)


def dataset() -> TensorDataset:
    """Sequences of 1 to TOKENS tokens padded to TOKENS: features, labels (PAD where padded), regression targets."""
    g = torch.Generator().manual_seed(0)
    n = GLOBAL_BATCH * STEPS
    x = torch.randn(n, TOKENS, FEATURES, generator=g, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (n, TOKENS), generator=g)
    lengths = torch.randint(1, TOKENS + 1, (n,), generator=g)
    padded = torch.arange(TOKENS)[None, :] >= lengths[:, None]
    y[padded] = PAD
    target = torch.randn(n, TOKENS, generator=g, dtype=torch.float64)
    return TensorDataset(x, y, target)


class Sequences(GlobalBatchDataModule):
    """dataset() as a GlobalBatchDataModule, for the suite's probe (test_global_mean.py)."""

    def train_dataset(self) -> TensorDataset:
        return dataset()


class Trimmed(Dataset):
    """dataset()'s sequences cut to their own length."""

    def __init__(self) -> None:
        self.padded = dataset()

    def __len__(self) -> int:
        return len(self.padded)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, y, target = self.padded[i]
        n = int((y != PAD).sum())
        return x[:n], y[:n], target[:n]


def pad_to_longest(samples: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch of Trimmed sequences padded to its longest: features 0, labels PAD, targets 0 after each one's end."""
    longest = max(len(y) for _, y, _ in samples)
    x = torch.zeros(len(samples), longest, FEATURES, dtype=torch.float64)
    y = torch.full((len(samples), longest), PAD)
    target = torch.zeros(len(samples), longest, dtype=torch.float64)
    for i, (xi, yi, ti) in enumerate(samples):
        x[i, : len(yi)], y[i, : len(yi)], target[i, : len(yi)] = xi, yi, ti
    return x, y, target


class RaggedSequences(Sequences):
    """Sequences of their own lengths, each batch padded to its longest (a rank's to its own)."""

    def train_dataset(self) -> Dataset:
        return Trimmed()

    def loader_kwargs(self) -> dict:
        return super().loader_kwargs() | {"collate_fn": pad_to_longest}


class Tagger(L.LightningModule):
    """A linear tagger trained with one of the four losses (`loss`), divided by the step's global count (`count`
    "global") or by the batch's own ("batch"), or not divided ("sum"); the contrastive one over the batch's own rows
    ("batch") or every rank's ("gathered", "everywhere")."""

    def __init__(self, loss: str = "tokens", count: str = "batch") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(FEATURES, CLASSES, dtype=torch.float64)
        self.loss, self.count = loss, count
        if loss == "router":  # only here: DDP stops at a parameter that gets no gradient
            self.router = nn.Linear(FEATURES, EXPERTS, dtype=torch.float64)
        if loss == "router" and count == "batch":  # what the suite reads of a Hugging Face MoE model
            self.config = SimpleNamespace(output_router_logits=True, router_aux_loss_coef=0.5)

    def training_step(self, batch, batch_idx):
        x, y, target = batch
        if self.loss in ("contrastive", "router"):
            loss = self.contrastive(x) if self.loss == "contrastive" else self.routed(x, y)
            self.log("train/loss", loss, sync_dist=True)
            return loss
        logits = self.layer(x)  # (B, T, C)
        if self.loss == "tokens":
            summed = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=PAD, reduction="sum")
            count = (y != PAD).sum()
        elif self.loss == "weighted":
            first = y[:, 0]  # every sequence has its first token
            weights = CLASS_WEIGHTS.to(logits.device)
            summed = F.cross_entropy(logits[:, 0], first, weight=weights, reduction="sum")
            count = weights[first].sum()
        else:
            mask = (y != PAD).to(logits.dtype)
            summed = ((logits[..., 0] - target) ** 2 * mask).sum()
            count = mask.sum()
        if self.count == "global":
            loss = global_mean(summed, count, self)
        elif self.count == "sum":
            loss = summed
        else:
            loss = summed / count
        self.log("train/loss", loss, sync_dist=True)
        return loss

    def contrastive(self, x: torch.Tensor) -> torch.Tensor:
        a = F.normalize(self.layer(x[:, 0]), dim=-1)
        b = F.normalize(self.layer(x[:, 1:].mean(1)), dim=-1)
        if self.count == "batch":  # a rank's own rows only
            return matched(a, b, a, b, torch.arange(len(a)))
        every_a, every_b = gather_batch(a, self), gather_batch(b, self)
        if self.count == "everywhere":
            return matched(every_a, every_b, every_a, every_b, torch.arange(len(every_a)))
        return matched(a, b, every_a, every_b, torch.arange(len(a)) + self.global_rank * len(a))

    def routed(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        main = F.cross_entropy(self.layer(x[:, 0]), y[:, 0])  # a mean over sequences: the same on any devices
        # Two layers' router logits for the same tokens, as a model of 2 MoE blocks gives them.
        layers, mask = (self.router(x).flatten(0, 1), self.router(torch.tanh(x)).flatten(0, 1)), (y != PAD).flatten()
        if self.count == "global":
            return main + 0.5 * router_balance_loss(layers, TOP_K, self, mask)
        return main + 0.5 * balance_of_batch(layers, mask)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def balance_of_batch(layers: tuple[torch.Tensor, ...], mask: torch.Tensor) -> torch.Tensor:
    """The load-balancing loss over one batch's non-padding tokens, as transformers 5.25's
    `load_balancing_loss_func` computes it: experts x sum over experts of (top-k choices of it / tokens) x (its summed
    router probability / tokens), both summed over the layers."""
    chosen = torch.zeros(EXPERTS, dtype=torch.float64)
    summed = torch.zeros(EXPERTS, dtype=torch.float64)
    tokens = 0
    for logits in layers:
        p = torch.softmax(logits, dim=-1)[mask]
        for choice in p.topk(TOP_K, dim=-1).indices.flatten().tolist():
            chosen[choice] += 1
        summed, tokens = summed + p.sum(0), tokens + len(p)
    return EXPERTS * (chosen / tokens * summed / tokens).sum()


def matched(a, b, every_a, every_b, mine) -> torch.Tensor:
    """CLIP's symmetric loss of the rows `a`, `b` against the candidates `every_b`, `every_a` (row i's match:
    `mine[i]`), averaged over the rows."""
    return (F.cross_entropy(a @ every_b.T / 0.2, mine) + F.cross_entropy(b @ every_a.T / 0.2, mine)) / 2


class Record(L.Callback):
    """The logged train/loss after each optimizer step."""

    def __init__(self) -> None:
        self.logged: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if len(self.logged) < trainer.global_step:
            self.logged.append(trainer.callback_metrics["train/loss"].item())


def loader(devices: int, rank: int, accumulate: int) -> DataLoader:
    """Rank `rank`'s micro-batches: optimizer step k trains on global batch k (samples k x 16 to k x 16 + 15) on any
    device count and accumulation."""
    micro = GLOBAL_BATCH // (devices * accumulate)
    indices = [
        k * GLOBAL_BATCH + (rank * accumulate + m) * micro + i
        for k in range(STEPS)
        for m in range(accumulate)
        for i in range(micro)
    ]
    return DataLoader(Subset(dataset(), indices), batch_size=micro, shuffle=False)


def fit(out: Path, devices: int, name: str) -> None:
    loss, count, accumulate = name.split("-")
    module, record = Tagger(loss, count), Record()
    sweep = LRSweep(
        min_lr=0.1, max_lr=1.0, steps=STEPS, stop_factor=1e6, out=str(out / f"{devices}dev-{name}-sweep.json")
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy="ddp", precision="64-true", max_steps=STEPS,
        accumulate_grad_batches=int(accumulate), gradient_clip_val=0.8, use_distributed_sampler=False,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[record, sweep], default_root_dir=out,
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=loader(devices, int(os.environ.get("LOCAL_RANK", "0")), int(accumulate)))
    if trainer.is_global_zero:
        torch.save(
            {"weights": module.state_dict(), "logged": record.logged, "swept": sweep.losses},
            out / f"{devices}dev-{name}.pt",
        )


if __name__ == "__main__":
    out, devices, names = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    for variant in names:
        fit(out, devices, variant)
