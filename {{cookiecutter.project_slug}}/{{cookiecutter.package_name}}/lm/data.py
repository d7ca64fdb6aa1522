"""A bundled public-domain text as byte-level language-modelling datasets (or a file of token ids);
`GlobalBatchDataModule` loads them.

ecclesiastes.txt: the Book of Ecclesiastes, King James Version (1611), 28,583
characters, from the Debian package bible-kjv-text (Chip Chapin's Bible Retrieval
System text, "unrestricted use"). The translation is in the public domain
(in the UK the Crown's letters patent still cover the KJV).
"""

from pathlib import Path
from typing import Literal

import torch
from ddpkit import GlobalBatchDataModule
from torch import Tensor
from torch.utils.data import Dataset, TensorDataset

TEXT = Path(__file__).with_name("ecclesiastes.txt")


def chunks(ids: Tensor, block_size: int) -> TensorDataset:
    """Non-overlapping (input, target) pairs: block_size ids and the same shifted by one."""
    n = (len(ids) - 1) // block_size
    x = ids[: n * block_size].view(n, block_size)
    y = ids[1 : n * block_size + 1].view(n, block_size)
    return TensorDataset(x, y)


def sequences_in(batch: tuple[Tensor, Tensor]) -> int:
    """Samples in a batch, for `ThroughputMonitor(batch_size_fn=...)`."""
    return batch[0].shape[0]


def tokens_in(batch: tuple[Tensor, Tensor]) -> int:
    """Tokens in a batch, for `ThroughputMonitor(length_fn=...)`."""
    return batch[0].numel()


class TextDataModule(GlobalBatchDataModule):
    """The bytes of a text file as token ids (vocabulary: 256); the last `val_fraction` is the validation set.

    Bytes need no tokenizer and give every text the same vocabulary, so the model's size does not
    depend on the data. A file of a tokenizer's ids (`token_format: uint16`) trains with that vocabulary.

    Args:
        global_batch_size: Sequences per optimizer step summed over all devices (split evenly over them).
        micro_batch_size: Sequences per forward pass on one device (None: its whole share); gradient
            accumulation makes up the rest of the global batch.
        num_workers: DataLoader worker processes per device.
        pin_memory: Batches in pinned memory, for asynchronous copies to the GPU (None: on GPUs only).
        persistent_workers: Keep loader workers from one epoch to the next (with num_workers > 0).
        block_size: Tokens (bytes) per training sequence (at most the model's context length).
        val_fraction: Fraction of the text, taken from its end, held out for validation.
        text_path: Any text file (read as bytes); the bundled Ecclesiastes when None.
        token_format: How text_path stores token ids: bytes = each byte is one id (vocabulary 256); uint16 = a
            tokenizer's ids, two bytes each (nanoGPT's train.bin, as numpy's `tofile` writes them; GPT-2's 50,257
            ids fit), for a model whose --model.vocab_size is the tokenizer's.
    """

    def __init__(
        self,
        global_batch_size: int = 32,
        micro_batch_size: int | None = None,
        num_workers: int = 0,
        pin_memory: bool | None = None,
        persistent_workers: bool = True,
        block_size: int = 128,
        val_fraction: float = 0.1,
        text_path: str | None = None,
        token_format: Literal["bytes", "uint16"] = "bytes",
    ) -> None:
        super().__init__(global_batch_size, micro_batch_size, num_workers, pin_memory, persistent_workers)
        self.save_hyperparameters()
        self.block_size, self.val_fraction = block_size, val_fraction
        self.text_path = Path(text_path) if text_path else TEXT
        self.token_dtype = torch.uint8 if token_format == "bytes" else torch.uint16

    def prepare_data(self) -> None:
        if not self.text_path.is_file():
            raise FileNotFoundError(f"text_path {str(self.text_path)!r} does not exist: pass --data.text_path FILE.")

    def text_ids(self) -> Tensor:
        return torch.frombuffer(bytearray(self.text_path.read_bytes()), dtype=self.token_dtype).long()

    def train_dataset(self) -> Dataset:
        ids = self.text_ids()
        return chunks(ids[: int(len(ids) * (1 - self.val_fraction))], self.block_size)

    def val_dataset(self) -> Dataset:
        ids = self.text_ids()
        return chunks(ids[int(len(ids) * (1 - self.val_fraction)) :], self.block_size)
