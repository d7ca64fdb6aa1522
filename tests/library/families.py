"""Models of the families users bring, written from scratch (no torchvision, no transformers), for the guarantee
suite's runs (test_suite_on_families.py, test_model_families.py): a ResNet-18 with BatchNorm or GroupNorm on small
images (ImageData), a BERT on dict batches of token ids (SentenceData), each the toy classifier (its logging,
metrics and AdamW) with another network; mixins that inject the classic DDP bugs into them; and the data that does
not fit in memory, the toy's blobs as shards, streamed (StreamingToyData).
"""

from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset, TensorDataset
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from ddpkit.data.streaming import LocalShard, StreamingDataModule, shard_files
from ddpkit.testing.parity_probe import batch_len
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


# --- A GPT-2 (fused QKV, tied embeddings, default dropouts), a small BatchNorm CNN, a MobileNetV3-small ----------

TEXT_WORDS = ("the", "of", "and", "to", "in", "is", "was", "that", "for", "on", "with", "as", "by", "at", "from",
              "river", "stone", "light", "morning", "garden", "window", "silver", "quiet", "north",
              "letter")  # fmt: skip
BLOCK = 32  # bytes a sequence


class ByteText(Dataset):
    """`n` windows of BLOCK + 1 bytes of a made-up English-like text (seeded words, sentences of 4-12): for each,
    the input bytes (BLOCK,) int64 and the next bytes (BLOCK,), as a byte-level language model trains on."""

    def __init__(self, n: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        words: list[str] = []
        while sum(len(w) + 1 for w in words) < n * BLOCK + 1:
            length = int(torch.randint(4, 13, (1,), generator=generator))
            picks = torch.randint(0, len(TEXT_WORDS), (length,), generator=generator).tolist()
            sentence = " ".join(TEXT_WORDS[i] for i in picks)
            words.append(sentence[0].upper() + sentence[1:] + ".")
        data = torch.tensor(list(" ".join(words).encode()), dtype=torch.long)
        self.windows = data[: n * BLOCK + 1]

    def __len__(self) -> int:
        return (len(self.windows) - 1) // BLOCK

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        chunk = self.windows[i * BLOCK : (i + 1) * BLOCK + 1]
        return chunk[:-1], chunk[1:]


class ByteData(SmallToyData):
    """SmallToyData's sizes as windows of bytes (the GPT-2's input)."""

    def train_dataset(self) -> Dataset:
        return ByteText(self.train_size, seed=0)

    def val_dataset(self) -> Dataset:
        return ByteText(self.val_size, seed=1)

    def test_dataset(self) -> Dataset:
        return ByteText(self.val_size, seed=2)


class GPT2Attention(nn.Module):
    """GPT-2's causal self-attention: query, key and value from one fused projection (`c_attn`, as Hugging Face's
    GPT-2 has it), so the key's bias, which gets no gradient, is a slice of a tensor whose other slices do."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn, self.c_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.attn_dropout, self.resid_dropout = nn.Dropout(dropout), nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = (p.view(b, t, self.heads, d // self.heads).transpose(1, 2) for p in self.c_attn(x).split(d, dim=2))
        # The attention dropout's rate read from its module, as Hugging Face's SDPA path does (NoDropout reaches it).
        p = self.attn_dropout.p if self.training else 0.0
        attended = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # (B, heads, T, hs)
        return self.resid_dropout(self.c_proj(attended.transpose(1, 2).reshape(b, t, d)))


class GPT2Block(nn.Module):
    """GPT-2's pre-norm block: x + attention(ln_1(x)), then x + MLP(ln_2(x)) with tanh-approximated GELU."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(dim), GPT2Attention(dim, heads, dropout), nn.LayerNorm(dim)
        self.c_fc, self.c_proj, self.dropout = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim), nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.dropout(self.c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh")))


class GPT2(L.LightningModule):
    """A GPT-2 language model on bytes (Radford et al. 2019; Hugging Face's GPT2LMHeadModel's layout): token and
    position embeddings, pre-norm blocks with fused QKV attention, a final LayerNorm, the output layer tied to the
    token embedding; GPT-2's initialization and its default dropouts (0.1 each). Logs train/loss every step
    (synced), val/loss and val/acc (next-byte accuracy) as torchmetrics objects; AdamW with torch's defaults.

    Args:
        dim: Embedding size (n_embd).
        heads: Attention heads.
        layers: Blocks.
        dropout: Embedding, attention and residual dropout rate.
        lr: AdamW learning rate.
    """

    def __init__(self, dim: int = 64, heads: int = 2, layers: int = 2, dropout: float = 0.1, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lr = lr
        self.wte, self.wpe, self.drop = nn.Embedding(256, dim), nn.Embedding(BLOCK, dim), nn.Dropout(dropout)
        self.h = nn.ModuleList(GPT2Block(dim, heads, dropout) for _ in range(layers))
        self.ln_f, self.lm_head = nn.LayerNorm(dim), nn.Linear(dim, 256, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        for name, module in self.named_modules():  # GPT-2's: N(0, 0.02), zero biases, residual outputs scaled
            if isinstance(module, nn.Linear | nn.Embedding):
                std = 0.02 / (2 * layers) ** 0.5 if name.endswith("c_proj") else 0.02
                nn.init.normal_(module.weight, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        self.losses = nn.ModuleDict({stage: MeanMetric() for stage in ("val", "test")})
        self.accs = nn.ModuleDict({stage: MulticlassAccuracy(256, average="micro") for stage in ("val", "test")})

    def forward(self, ids: Tensor) -> Tensor:
        x = self.drop(self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device)))  # (B, T, dim)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, 256)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        ids, targets = batch
        loss = F.cross_entropy(self(ids).flatten(0, 1), targets.flatten())
        self.log("train/loss", loss.detach(), sync_dist=True)
        return loss

    def _evaluate(self, batch: tuple[Tensor, Tensor], stage: str) -> None:
        ids, targets = batch
        logits = self(ids).flatten(0, 1)
        self.losses[stage].update(F.cross_entropy(logits, targets.flatten(), reduction="none"))
        self.accs[stage].update(logits, targets.flatten())
        self.log(f"{stage}/loss", self.losses[stage])
        self.log(f"{stage}/acc", self.accs[stage])

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self(batch[0]).argmax(dim=-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class SmallBatchNormCNN(ToyClassifier):
    """2 convolutions with BatchNorm on ImageData's 16 x 16 images, trained by SGD with momentum 0.9.

    Args:
        width: Channels of the first convolution (the second has twice as many).
        lr: SGD learning rate.
    """

    def __init__(self, width: int = 16, lr: float = 0.05) -> None:
        super().__init__(lr=lr)
        self.net = nn.Sequential(
            nn.Conv2d(IMAGE[0], width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(2),  # (B, w, 8, 8)
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, CLASSES),
        )  # fmt: skip

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def divisible(channels: float, by: int = 8) -> int:
    """MobileNet's channel rounding: the nearest multiple of `by`, never below 90% of `channels`."""
    rounded = max(by, int(channels + by / 2) // by * by)
    return rounded + by if rounded < 0.9 * channels else rounded


class ConvNormAct(nn.Sequential):
    """Convolution (no bias), BatchNorm (MobileNetV3's eps 1e-3, momentum 0.01), then an activation or none."""

    def __init__(self, a: int, b: int, kernel: int, stride: int = 1, groups: int = 1, act: type | None = nn.Hardswish):
        layers = [nn.Conv2d(a, b, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False)]
        layers += [nn.BatchNorm2d(b, eps=1e-3, momentum=0.01), *([act()] if act else [])]
        super().__init__(*layers)


class SqueezeExcite(nn.Module):
    """Channel attention: the map's mean through a bottleneck (a quarter of the channels), hard-sigmoid scaled."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        squeezed = divisible(channels // 4)
        self.fc1, self.fc2 = nn.Conv2d(channels, squeezed, 1), nn.Conv2d(squeezed, channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        scale = F.hardsigmoid(self.fc2(F.relu(self.fc1(F.adaptive_avg_pool2d(x, 1)))))  # (B, C, 1, 1)
        return x * scale


class InvertedResidual(nn.Module):
    """MobileNetV3's block: 1 x 1 expansion, depthwise k x k, squeeze-excitation, 1 x 1 projection; a shortcut
    where the shape is kept."""

    def __init__(self, a: int, kernel: int, expanded: int, b: int, se: bool, act: type, stride: int) -> None:
        super().__init__()
        layers = [ConvNormAct(a, expanded, 1, act=act)] if expanded != a else []
        layers += [ConvNormAct(expanded, expanded, kernel, stride, groups=expanded, act=act)]
        layers += [SqueezeExcite(expanded)] if se else []
        self.block = nn.Sequential(*layers, ConvNormAct(expanded, b, 1, act=None))
        self.shortcut = stride == 1 and a == b

    def forward(self, x: Tensor) -> Tensor:
        return x + self.block(x) if self.shortcut else self.block(x)


# MobileNetV3-small's blocks (Howard et al. 2019, table 2): in, kernel, expanded, out, squeeze-excite, activation,
# stride.
MOBILENET_V3_SMALL = [
    (16, 3, 16, 16, True, nn.ReLU, 2), (16, 3, 72, 24, False, nn.ReLU, 2), (24, 3, 88, 24, False, nn.ReLU, 1),
    (24, 5, 96, 40, True, nn.Hardswish, 2), (40, 5, 240, 40, True, nn.Hardswish, 1),
    (40, 5, 240, 40, True, nn.Hardswish, 1), (40, 5, 120, 48, True, nn.Hardswish, 1),
    (48, 5, 144, 48, True, nn.Hardswish, 1), (48, 5, 288, 96, True, nn.Hardswish, 2),
    (96, 5, 576, 96, True, nn.Hardswish, 1), (96, 5, 576, 96, True, nn.Hardswish, 1),
]  # fmt: skip


class MobileNetV3Small(ToyClassifier):
    """MobileNetV3-small (torchvision's layout: a strided 3 x 3 stem, 11 inverted residual blocks with
    squeeze-excitation and hard-swish, a 1 x 1 convolution to 576 channels, a 1024-wide head with dropout 0.2),
    1.5M parameters for 10 classes, on 32 x 32 images (LargeImageData); AdamW as the toy's.

    Args:
        lr: AdamW learning rate.
    """

    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__(lr=lr)
        layers = [ConvNormAct(3, 16, 3, stride=2)]
        layers += [InvertedResidual(*block) for block in MOBILENET_V3_SMALL]
        layers += [ConvNormAct(96, 576, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        head = [nn.Linear(576, 1024), nn.Hardswish(), nn.Dropout(0.2), nn.Linear(1024, CLASSES)]
        self.net = nn.Sequential(*layers, *head)
        for module in self.modules():  # torchvision's initialization
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out")
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0, 0.01)
                nn.init.zeros_(module.bias)


LARGE_IMAGE = (3, 32, 32)


class LargeImageData(SmallToyData):
    """SmallToyData's sizes as 3 x 32 x 32 images (MobileNetV3's input): a class's fixed pattern plus unit noise."""

    @staticmethod
    def images(n: int, seed: int) -> TensorDataset:
        generator = torch.Generator().manual_seed(seed)
        patterns = torch.randn(CLASSES, *LARGE_IMAGE, generator=torch.Generator().manual_seed(4321)) * 0.5
        labels = torch.randint(0, CLASSES, (n,), generator=generator)
        return TensorDataset(patterns[labels] + torch.randn(n, *LARGE_IMAGE, generator=generator), labels)

    def train_dataset(self) -> Dataset:
        return self.images(self.train_size, seed=0)

    def val_dataset(self) -> Dataset:
        return self.images(self.val_size, seed=1)

    def test_dataset(self) -> Dataset:
        return self.images(self.val_size, seed=2)


# --- Classic DDP bugs, each a mixin put before a family's class: trains fine on 1 device, differently on 2 ----------


def split(batch) -> tuple:
    """(inputs, labels) of a family's batch: a (x, y) pair, or a dict with `labels`."""
    return (batch, batch["labels"]) if isinstance(batch, dict) else batch


class SummedLoss:
    """The loss summed over the batch (the family's mean loss times the samples): DDP averages gradients over ranks,
    so 2 devices take half the step."""

    def training_step(self, batch, batch_idx: int) -> Tensor:
        return super().training_step(batch, batch_idx) * batch_len(batch)


class UnsyncedMetric:
    """The validation loss logged as each batch's mean without syncing: every rank reports its own share's (the
    accuracy, which the checkpoint monitors, stays a synced metric)."""

    def validation_step(self, batch, batch_idx: int) -> None:
        x, y = split(batch)
        logits = self(x)
        self.accs["val"].update(logits, y)
        self.log("val/acc", self.accs["val"])
        self.log("val/loss", F.cross_entropy(logits, y))


class UnsyncedLogs:
    """The training loss logged every step and the validation loss as each batch's mean, neither synced: each rank
    logs its own share's (the accuracy, which the checkpoint monitors, stays a synced metric)."""

    def training_step(self, batch, batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train/loss_unsynced", loss.detach(), on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        x, y = split(batch)
        logits = self(x)
        if logits.dim() == 3:  # a language model's (B, T, vocabulary): one prediction a token
            logits, y = logits.flatten(0, 1), y.flatten()
        self.accs["val"].update(logits, y)
        self.log("val/acc", self.accs["val"])
        self.log("val/loss", F.cross_entropy(logits, y))


class SummedLossBert(SummedLoss, TinyBert):
    """TinyBert with a summed loss."""


class UnsyncedMetricResNet18(UnsyncedMetric, ResNet18):
    """ResNet18 with an unsynced validation loss."""


class UnsyncedMetricBert(UnsyncedMetric, TinyBert):
    """TinyBert with an unsynced validation loss."""


# Two bugs in one model where each fails its own checks: a summed loss (the gradient, the weights) and unsynced logs
# (the values logged, on the ranks and in validation); BatchNorm left unsynchronized is the config's.
class BuggyToy(UnsyncedLogs, SummedLoss, ToyClassifier):
    """The toy's MLP (the digits example's network and optimizer) with a summed loss and unsynced logs."""


class BuggyResNet18(UnsyncedLogs, SummedLoss, ResNet18):
    """ResNet18 with a summed loss and unsynced logs."""


class BuggyGPT2(UnsyncedLogs, SummedLoss, GPT2):
    """GPT2 with a summed loss and unsynced logs."""


class UnsyncedLogsSmallBatchNormCNN(UnsyncedLogs, SmallBatchNormCNN):
    """SmallBatchNormCNN with unsynced logs (and, without --trainer.sync_batchnorm, unsynchronized BatchNorm)."""


class UnsyncedLogsMobileNetV3Small(UnsyncedLogs, MobileNetV3Small):
    """MobileNetV3Small with unsynced logs (and, without --trainer.sync_batchnorm, unsynchronized BatchNorm)."""


class SummedLossSmallBatchNormCNN(SummedLoss, SmallBatchNormCNN):
    """SmallBatchNormCNN with a summed loss."""
