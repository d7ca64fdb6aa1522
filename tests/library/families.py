"""Models of the families users bring, written from scratch (no torchvision, no transformers), for the guarantee
suite's runs (test_suite_on_families.py, test_model_families.py): a ResNet-18 with BatchNorm or GroupNorm on small
images (ImageData), a BERT on dict batches of token ids (SentenceData), each the toy classifier (its logging,
metrics and AdamW) with another network; mixins that inject the classic DDP bugs into them; and the data that does
not fit in memory, the toy's blobs as shards, streamed (StreamingToyData).
"""

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset, TensorDataset

from ddpkit.data.streaming import LocalShard, StreamingDataModule, shard_files
from ddpkit.testing.toy import CLASSES, ToyClassifier, ToyData, blobs


class SmallToyData(ToyData):
    """The toy's blobs with a validation set of `val_size` samples (odd: the 2 ranks' shares differ).

    Args:
        global_batch_size: Samples per optimizer step summed over all devices.
        micro_batch_size: Samples per forward pass on one device (None: its whole share).
        num_workers: DataLoader worker processes per device.
        train_size: Training samples.
        val_size: Validation samples.
    """

    def __init__(
        self,
        global_batch_size: int = 32,
        micro_batch_size: int | None = None,
        num_workers: int = 0,
        train_size: int = 128,
        val_size: int = 37,
    ) -> None:
        super().__init__(global_batch_size, micro_batch_size, num_workers, train_size)
        self.val_size = val_size

    def val_dataset(self) -> Dataset:
        return blobs(self.val_size, seed=1)

    def test_dataset(self) -> Dataset:
        return blobs(self.val_size, seed=2)


# The streaming twin of SmallToyData: 128 training samples in shards of unequal sizes, 37 validation, 37 test.
SHARD_SIZES = {"train": [37, 5, 23, 41, 22], "val": [20, 17], "test": [30, 7]}


def write_toy_shards(directory: Path) -> None:
    """The toy's blobs (train seed 0, val 1, test 2) as `.pt` shards of SHARD_SIZES, one folder per split."""
    for seed, (split, sizes) in enumerate(SHARD_SIZES.items()):
        x, y = blobs(sum(sizes), seed=seed).tensors
        (directory / split).mkdir(parents=True)
        for i, part in enumerate(zip(x.split(sizes), y.split(sizes), strict=True)):
            torch.save(part, directory / split / f"{i:02d}.pt")


class StreamingToyData(StreamingDataModule):
    """The shards of `write_toy_shards` in `shard_dir`, streamed: the guarantee suite on a streaming data module.

    Args:
        shard_dir: The folder write_toy_shards wrote.
        global_batch_size: Samples per optimizer step summed over all devices; a multiple of `streams`.
        micro_batch_size: Samples per forward pass on one device (None: its whole share).
        num_workers: Loader worker processes per device.
        streams: Read positions in each epoch's shard order.
    """

    def __init__(
        self,
        shard_dir: str = "",
        global_batch_size: int = 32,
        micro_batch_size: int | None = None,
        num_workers: int = 0,
        streams: int = 8,
    ) -> None:
        super().__init__(global_batch_size, micro_batch_size, num_workers, streams)
        self.shard_dir = Path(shard_dir)

    def train_shards(self) -> list[LocalShard]:
        return shard_files(self.shard_dir / "train")

    def val_shards(self) -> list[LocalShard]:
        return shard_files(self.shard_dir / "val")

    def test_shards(self) -> list[LocalShard]:
        return shard_files(self.shard_dir / "test")


# --- The models users bring first: a ResNet-18 (BatchNorm or GroupNorm) and a BERT with dict batches ---------------

IMAGE = (3, 16, 16)  # (C, H, W): small enough for 2 CPU processes, large enough for every ResNet stage


def image_blobs(n: int, seed: int) -> TensorDataset:
    """`n` images of IMAGE: a class's fixed pattern plus unit noise; images (n, 3, 16, 16) float32, labels (n,)."""
    generator = torch.Generator().manual_seed(seed)
    patterns = torch.randn(CLASSES, *IMAGE, generator=torch.Generator().manual_seed(4321)) * 0.5
    labels = torch.randint(0, CLASSES, (n,), generator=generator)
    return TensorDataset(patterns[labels] + torch.randn(n, *IMAGE, generator=generator), labels)


class ImageData(SmallToyData):
    """SmallToyData's sizes as 3 x 16 x 16 images (the ResNets' input)."""

    def train_dataset(self) -> Dataset:
        return image_blobs(self.train_size, seed=0)

    def val_dataset(self) -> Dataset:
        return image_blobs(self.val_size, seed=1)

    def test_dataset(self) -> Dataset:
        return image_blobs(self.val_size, seed=2)


def norm_layer(kind: str, channels: int) -> nn.Module:
    """BatchNorm2d, or GroupNorm of 16 channels a group, at most 32 groups (32 at ResNet-18's last stage, as GroupNorm
    ResNets use). Narrower groups on the last stages' 1 x 1 maps normalize a handful of values, which turns float64
    rounding into 1e-3 (2 channels a group at width 16: 1 vs 2 devices 5e-3 apart, 4 micro-batches 7e-3)."""
    return nn.BatchNorm2d(channels) if kind == "batch" else nn.GroupNorm(min(32, max(1, channels // 16)), channels)


class BasicBlock(nn.Module):
    """ResNet's two 3x3 convolutions with a shortcut (a strided 1x1 convolution where the shape changes)."""

    def __init__(self, a: int, b: int, stride: int, norm: str) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(a, b, 3, stride, 1, bias=False), norm_layer(norm, b)
        self.conv2, self.bn2 = nn.Conv2d(b, b, 3, 1, 1, bias=False), norm_layer(norm, b)
        self.shortcut = nn.Identity()
        if stride != 1 or a != b:
            self.shortcut = nn.Sequential(nn.Conv2d(a, b, 1, stride, bias=False), norm_layer(norm, b))

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet18(ToyClassifier):
    """ResNet-18 (He et al. 2016; torchvision's layout: 7x7 stem, max-pool, 4 stages of 2 basic blocks, average
    pool, linear head), 11.2M parameters at width 64, on ImageData's images.

    Args:
        norm: "batch" (BatchNorm2d) or "group" (GroupNorm).
        width: Channels of the first stage (64 in ResNet-18; the stages have 1, 2, 4 and 8 times as many).
        lr: AdamW learning rate.
    """

    def __init__(self, norm: str = "batch", width: int = 64, lr: float = 1e-3) -> None:
        super().__init__(lr=lr)
        stem = [nn.Conv2d(IMAGE[0], width, 7, 2, 3, bias=False), norm_layer(norm, width), nn.ReLU()]
        layers, channels = [*stem, nn.MaxPool2d(3, 2, 1)], width  # (B, w, 4, 4)
        for stage, stride in enumerate((1, 2, 2, 2)):
            out = width * 2**stage
            layers += [BasicBlock(channels, out, stride, norm), BasicBlock(out, out, 1, norm)]
            channels = out
        self.net = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, CLASSES))


VOCAB, SEQUENCE = 64, 16  # token ids 0 (padding), 1 ([CLS]), 2.. (words)


class Sentences(Dataset):
    """`n` token sequences as dicts, as a tokenizer gives them: `input_ids` and `attention_mask` (SEQUENCE,) int64,
    padded after 8-16 tokens, and `labels` (): a class prefers its own 6 of the 62 words."""

    def __init__(self, n: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, CLASSES, (n,), generator=generator)
        lengths = torch.randint(8, SEQUENCE + 1, (n,), generator=generator)
        own = 2 + (self.labels[:, None] * 6 + torch.randint(0, 6, (n, SEQUENCE), generator=generator)) % (VOCAB - 2)
        other = torch.randint(2, VOCAB, (n, SEQUENCE), generator=generator)
        words = torch.where(torch.rand(n, SEQUENCE, generator=generator) < 0.5, own, other)
        self.mask = (torch.arange(SEQUENCE) < lengths[:, None]).long()
        self.ids = torch.where(self.mask.bool(), words, 0)
        self.ids[:, 0] = 1  # [CLS]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


class SentenceData(SmallToyData):
    """SmallToyData's sizes as token sequences in dict samples (the BERT's input)."""

    def train_dataset(self) -> Dataset:
        return Sentences(self.train_size, seed=0)

    def val_dataset(self) -> Dataset:
        return Sentences(self.val_size, seed=1)

    def test_dataset(self) -> Dataset:
        return Sentences(self.val_size, seed=2)


class BertLayer(nn.Module):
    """BERT's post-norm encoder layer: self-attention with biased query/key/value projections (the key bias gets no
    gradient), then a GELU feed-forward; dropout as nn.Dropout modules, as Hugging Face's eager attention has."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.attention_dropout, self.dropout = nn.Dropout(dropout), nn.Dropout(dropout)
        self.attention_out, self.attention_norm = nn.Linear(dim, dim), nn.LayerNorm(dim, eps=1e-12)
        self.intermediate, self.output = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.output_norm = nn.LayerNorm(dim, eps=1e-12)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = (
            p(x).view(b, t, self.heads, d // self.heads).transpose(1, 2) for p in (self.query, self.key, self.value)
        )
        scores = q @ k.transpose(-2, -1) / (d // self.heads) ** 0.5  # (B, heads, T, T)
        scores = scores.masked_fill(~mask.bool()[:, None, None, :], torch.finfo(scores.dtype).min)  # no padding keys
        attended = (self.attention_dropout(scores.softmax(-1)) @ v).transpose(1, 2).reshape(b, t, d)
        x = self.attention_norm(x + self.dropout(self.attention_out(attended)))
        return self.output_norm(x + self.dropout(self.output(F.gelu(self.intermediate(x)))))


class TinyBert(ToyClassifier):
    """A BERT for sequence classification (word, position and token-type embeddings, post-norm layers, a tanh
    pooler over [CLS], a linear head), reading dict batches (`input_ids`, `attention_mask`, `labels`).

    Args:
        dim: Hidden size.
        heads: Attention heads.
        layers: Encoder layers.
        dropout: Hidden and attention dropout rate (nn.Dropout modules).
        lr: AdamW learning rate.
    """

    def __init__(self, dim: int = 32, heads: int = 2, layers: int = 2, dropout: float = 0.1, lr: float = 1e-3) -> None:
        super().__init__(lr=lr)
        self.words, self.positions = nn.Embedding(VOCAB, dim), nn.Embedding(SEQUENCE, dim)
        self.token_types = nn.Embedding(2, dim)
        self.embedding_norm, self.embedding_dropout = nn.LayerNorm(dim, eps=1e-12), nn.Dropout(dropout)
        self.net = nn.ModuleList(BertLayer(dim, heads, dropout) for _ in range(layers))
        self.pooler, self.head = nn.Linear(dim, dim), nn.Linear(dim, CLASSES)
        for module in self.modules():  # BERT's initialization: N(0, 0.02), zero biases
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.words(ids) + self.positions(positions) + self.token_types(torch.zeros_like(ids))
        x = self.embedding_dropout(self.embedding_norm(x))  # (B, T, dim)
        for layer in self.net:
            x = layer(x, mask)
        return self.head(torch.tanh(self.pooler(x[:, 0])))  # (B, classes), from [CLS]

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return super().training_step((batch, batch["labels"]), batch_idx)

    def _evaluate(self, batch: dict[str, Tensor], stage: str) -> None:
        super()._evaluate((batch, batch["labels"]), stage)

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self(batch).argmax(dim=-1)


# --- Classic DDP bugs, each a mixin put before a family's class: trains fine on 1 device, differently on 2 ----------


def split(batch) -> tuple:
    """(inputs, labels) of a family's batch: a (x, y) pair, or a dict with `labels`."""
    return (batch, batch["labels"]) if isinstance(batch, dict) else batch


class SummedLoss:
    """The loss summed over the batch: DDP averages gradients over ranks, so 2 devices take half the step."""

    def training_step(self, batch, batch_idx: int) -> Tensor:
        x, y = split(batch)
        return F.cross_entropy(self(x), y, reduction="sum")


class UnsyncedMetric:
    """The validation loss logged as each batch's mean without syncing: every rank reports its own share's (the
    accuracy, which the checkpoint monitors, stays a synced metric)."""

    def validation_step(self, batch, batch_idx: int) -> None:
        x, y = split(batch)
        logits = self(x)
        self.accs["val"].update(logits, y)
        self.log("val/acc", self.accs["val"])
        self.log("val/loss", F.cross_entropy(logits, y))


class SummedLossResNet18(SummedLoss, ResNet18):
    """ResNet18 with a summed loss."""


class SummedLossBert(SummedLoss, TinyBert):
    """TinyBert with a summed loss."""


class UnsyncedMetricResNet18(UnsyncedMetric, ResNet18):
    """ResNet18 with an unsynced validation loss."""


class UnsyncedMetricBert(UnsyncedMetric, TinyBert):
    """TinyBert with an unsynced validation loss."""
