"""Models and data written from scratch the way users write them, for the guarantee suite's handling of data and
parameters (test_suite_on_data.py): an LSTM classifier over variable-length token sequences, batched by a collate
that pads each batch to its longest sequence and read with `pack_padded_sequence`; the same data built differently
in each process (a vocabulary numbered by iterating a `set` of strings, a shuffle from an unseeded generator); the
same data masked per batch in the collate function; and a module with a head used only in validation, whose
parameters get no gradient in training.
"""

import random

import lightning as L
import torch
import torch.nn.functional as F
from ddpkit import GlobalBatchDataModule
from ddpkit.testing.toy import ToyClassifier
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_sequence
from torch.utils.data import Dataset
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from families import SmallToyData

CLASSES = 4
# 48 words: a class prefers its own 12 of them. Strings, so that a `set` of them iterates in an order that depends on
# the process's hash seed (PYTHONHASHSEED).
WORDS = [
    f"{a}{b}" for a in ("ka", "lo", "mi", "nu", "pe", "ro") for b in ("ba", "de", "fi", "go", "hu", "ju", "ke", "ly")
]
VOCAB = len(WORDS) + 1  # id 0 pads


def sentences(n: int, seed: int) -> list[tuple[list[str], int]]:
    """`n` (words, label) pairs of 3 to 24 words: each word is one of the label's own 12 with probability 0.6."""
    draw = random.Random(seed)
    out = []
    for _ in range(n):
        label = draw.randrange(CLASSES)
        own = WORDS[label * 12 : (label + 1) * 12]
        words = [draw.choice(own) if draw.random() < 0.6 else draw.choice(WORDS) for _ in range(draw.randint(3, 24))]
        out.append((words, label))
    return out


def sorted_vocabulary(corpus: list[tuple[list[str], int]]) -> dict[str, int]:
    """Word -> id (from 1) for every word of `corpus`, in sorted order: the same in every process."""
    return {word: i + 1 for i, word in enumerate(sorted({w for words, _ in corpus for w in words}))}


class Tokenized(Dataset):
    """Sentences as samples of unequal length: (ids (L,) int64, label () int64)."""

    def __init__(self, corpus: list[tuple[list[str], int]], vocabulary: dict[str, int]) -> None:
        self.samples = [(torch.tensor([vocabulary[w] for w in words]), torch.tensor(label)) for words, label in corpus]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.samples[i]


def pad_to_longest(samples: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor, Tensor]:
    """A batch padded to its longest sentence: ids (B, T) with 0 after each sentence's end, lengths (B,), labels."""
    ids, labels = zip(*samples, strict=True)
    lengths = torch.tensor([len(s) for s in ids])
    return pad_sequence(list(ids), batch_first=True), lengths, torch.stack(labels)


class TextData(GlobalBatchDataModule):
    """Sentences to classify, `train_size` for training and 37 each for validation and test, batched by a collate
    that pads each batch to its longest sentence.

    Args:
        global_batch_size: Samples per optimizer step summed over all devices.
        micro_batch_size: Samples per forward pass on one device (None: its whole share).
        num_workers: DataLoader worker processes per device.
        train_size: Training sentences.
    """

    def __init__(
        self,
        global_batch_size: int = 32,
        micro_batch_size: int | None = None,
        num_workers: int = 0,
        train_size: int = 128,
    ) -> None:
        super().__init__(global_batch_size, micro_batch_size, num_workers)
        self.train_size = train_size

    def vocabulary(self, corpus: list[tuple[list[str], int]]) -> dict[str, int]:
        """Word -> id of every word in `corpus` (all splits)."""
        return sorted_vocabulary(corpus)

    def split(self, n: int, seed: int) -> Dataset:
        everything = sentences(self.train_size, 0) + sentences(37, 1) + sentences(37, 2)
        return Tokenized(sentences(n, seed), self.vocabulary(everything))

    def train_dataset(self) -> Dataset:
        return self.split(self.train_size, 0)

    def val_dataset(self) -> Dataset:
        return self.split(37, 1)

    def test_dataset(self) -> Dataset:
        return self.split(37, 2)

    def loader_kwargs(self) -> dict:
        return super().loader_kwargs() | {"collate_fn": pad_to_longest}


class LSTMClassifier(L.LightningModule):
    """An embedding, a 2-layer LSTM over the packed sentences (padding never enters it), a linear head on the last
    layer's final state; dropout on the embeddings, between the LSTM's layers and before the head.

    Args:
        embed_dim: Embedding size.
        hidden_dim: LSTM state size.
        num_layers: LSTM layers.
        dropout: Dropout rate (embeddings, between LSTM layers, before the head).
        noise: Standard deviation of Gaussian noise added to the embeddings in training, drawn in the step (0: none).
        lr: AdamW learning rate.
    """

    def __init__(
        self,
        embed_dim: int = 16,
        hidden_dim: int = 32,
        num_layers: int = 2,
        dropout: float = 0.2,
        noise: float = 0.0,
        lr: float = 3e-3,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embedding = nn.Embedding(VOCAB, embed_dim, padding_idx=0)
        self.lstm = nn.LSTM(embed_dim, hidden_dim, num_layers, batch_first=True, dropout=dropout)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(hidden_dim, CLASSES)
        self.losses = nn.ModuleDict({stage: MeanMetric() for stage in ("val", "test")})
        self.accs = nn.ModuleDict({stage: MulticlassAccuracy(CLASSES, average="micro") for stage in ("val", "test")})

    def forward(self, ids: Tensor, lengths: Tensor) -> Tensor:
        x = self.dropout(self.embedding(ids))  # (B, T, E)
        if self.training and self.hparams.noise:
            x = x + self.hparams.noise * torch.randn_like(x)
        packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
        _, (state, _) = self.lstm(packed)  # (layers, B, H)
        return self.head(self.dropout(state[-1]))  # (B, classes)

    def training_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> Tensor:
        ids, lengths, labels = batch
        loss = F.cross_entropy(self(ids, lengths), labels)
        self.log("train/loss", loss.detach(), sync_dist=True)
        return loss

    def _evaluate(self, batch: tuple[Tensor, Tensor, Tensor], stage: str) -> None:
        ids, lengths, labels = batch
        logits = self(ids, lengths)
        self.losses[stage].update(F.cross_entropy(logits, labels, reduction="none"))
        self.accs[stage].update(logits, labels)
        self.log(f"{stage}/loss", self.losses[stage])
        self.log(f"{stage}/acc", self.accs[stage])

    def validation_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def predict_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> Tensor:
        ids, lengths, _ = batch
        return self(ids, lengths).argmax(dim=-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


# --- Data built differently in each process: every rank trains on other samples than rank 0 believes --------------


class SetVocabularyData(TextData):
    """TextData whose vocabulary is numbered by iterating a `set` of words: the order, and so every id, depends on
    the process's string hash seed."""

    def vocabulary(self, corpus: list[tuple[list[str], int]]) -> dict[str, int]:
        return {word: i + 1 for i, word in enumerate({w for words, _ in corpus for w in words})}


class UnseededShuffleData(TextData):
    """TextData whose training sentences are shuffled once, in the dataset's construction, by a generator that no
    seed reaches (`random.Random()` draws its seed from the operating system)."""

    def train_dataset(self) -> Dataset:
        dataset = super().train_dataset()
        random.Random().shuffle(dataset.samples)
        return dataset


class GlobalShuffleData(TextData):
    """TextData whose training sentences are shuffled by `random.shuffle`, Python's global stream, when the set is
    built: Lightning seeds that stream (seed_everything) in every process before `setup`, so every rank and run
    builds the same order. It takes TextData's arguments as `**kwargs`, as many data modules do: the CLI (and so
    `--data.micro_batch_size`) follows them to the parent.

    Args:
        shuffle: Shuffle the training sentences.
    """

    def __init__(self, shuffle: bool = True, **kwargs) -> None:
        super().__init__(**kwargs)
        self.shuffle = shuffle

    def train_dataset(self) -> Dataset:
        dataset = super().train_dataset()
        if self.shuffle:
            random.shuffle(dataset.samples)
        return dataset


def mask_tokens(samples: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor, Tensor]:
    """pad_to_longest, then 15 % of the tokens replaced by the padding id, drawn for the batch: the pattern of a
    masked language model's collator (Hugging Face's DataCollatorForLanguageModeling)."""
    ids, lengths, labels = pad_to_longest(samples)
    return ids.masked_fill(torch.rand(ids.shape) < 0.15, 0), lengths, labels


class MaskingCollateData(TextData):
    """TextData whose training batches are masked in the collate function: each rank would mask its own share of
    the global batch with draws of its own."""

    def loader_kwargs(self) -> dict:
        return super().loader_kwargs() | {"collate_fn": mask_tokens}


class UnpackedLSTMClassifier(LSTMClassifier):
    """LSTMClassifier with the LSTM run over the padded batch, unpacked, and the head on its state after the last
    padded step: a sentence's output depends on how far its batch is padded (the classic bug the packing avoids)."""

    def forward(self, ids: Tensor, lengths: Tensor) -> Tensor:
        _, (state, _) = self.lstm(self.dropout(self.embedding(ids)))
        return self.head(self.dropout(state[-1]))


# --- A parameter that gets no gradient in training ------------------------------------------------------------------


class ValidationHeadClassifier(ToyClassifier):
    """The toy classifier with a second head used only in `validation_step` (a probe of the features, logged as
    val/probe_loss): its parameters get no gradient in training, so DDP needs find_unused_parameters.

    Args:
        hidden_dim: Width of the hidden layers.
        lr: AdamW learning rate.
    """

    def __init__(self, hidden_dim: int = 32, lr: float = 3e-3) -> None:
        super().__init__(hidden_dim=hidden_dim, lr=lr)
        self.probe_head = nn.Linear(hidden_dim, 10)
        self.probe_loss = MeanMetric()

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        super().validation_step(batch, batch_idx)
        x, y = batch
        features = self.net[:-1](x)  # (B, hidden)
        self.probe_loss.update(F.cross_entropy(self.probe_head(features), y, reduction="none"))
        self.log("val/probe_loss", self.probe_loss)


__all__ = [
    "GlobalShuffleData",
    "LSTMClassifier",
    "MaskingCollateData",
    "SetVocabularyData",
    "SmallToyData",
    "TextData",
    "UnseededShuffleData",
    "ValidationHeadClassifier",
]
