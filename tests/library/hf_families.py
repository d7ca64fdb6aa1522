"""Hugging Face models that cast to float32 inside a float64 run, as docs/measurements.md ran the guarantee suite on
them ("Models that cast down inside a float64 run"; not a test: transformers is not in requirements.txt). A tiny T5
(equal-length targets), the same T5 with a token-level loss normalised over the global batch by hand, and a tiny
LLaMA; each also with a real DDP bug (a summed loss). To run the suite on one: `pip install transformers==5.25.0`,
bake, copy this file beside the project's main.py, and point its config.yaml at it:

    model:
      class_path: hf_families.TinyLlama     # or TinyT5, T5TokenLoss, SummedLossLlama, ...
    data:
      class_path: hf_families.ByteData
      init_args: {global_batch_size: 32, train_size: 128}   # 1024: the LLaMA's float32 rounding shows without the fix

with `monitor: val/loss` and `mode: min` for the checkpoint, then `pytest`.
"""

import lightning as L
import torch
import torch.nn.functional as F
from ddpkit import GlobalBatchDataModule
from torch import Tensor
from torch.utils.data import Dataset
from torchmetrics import MeanMetric
from transformers import LlamaConfig, LlamaForCausalLM, T5Config, T5ForConditionalGeneration

WORDS = ("the", "of", "and", "to", "in", "is", "was", "that", "for", "on", "river", "stone", "light", "garden",
         "window", "silver", "quiet", "north", "letter")  # fmt: skip
BLOCK = 32


class ByteChunks(Dataset):
    """`n` equal-length chunks of BLOCK bytes of made-up text, int64."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        words = []
        while sum(len(w) + 1 for w in words) < n * BLOCK:
            words.append(WORDS[int(torch.randint(0, len(WORDS), (1,), generator=g))])
        self.data = torch.tensor(list(" ".join(words).encode())[: n * BLOCK], dtype=torch.long).view(n, BLOCK)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> Tensor:
        return self.data[i]


class ByteData(GlobalBatchDataModule):
    def __init__(self, global_batch_size: int = 32, micro_batch_size: int | None = None, num_workers: int = 0,
                 train_size: int = 128, val_size: int = 37) -> None:  # fmt: skip
        super().__init__(global_batch_size, micro_batch_size, num_workers)
        self.train_size, self.val_size = train_size, val_size

    def train_dataset(self) -> Dataset:
        return ByteChunks(self.train_size, 0)

    def val_dataset(self) -> Dataset:
        return ByteChunks(self.val_size, 1)


class HFModule(L.LightningModule):
    """Shared: AdamW, val/loss as a MeanMetric of token losses."""

    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__()
        self.lr = lr
        self.val_loss = MeanMetric()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)

    def token_losses(self, batch: Tensor) -> Tensor:
        logits, labels = self.logits_labels(batch)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        loss = self.token_losses(batch).mean()
        self.log("train/loss", loss.detach(), sync_dist=True)
        return loss

    def validation_step(self, batch: Tensor, batch_idx: int) -> None:
        self.val_loss.update(self.token_losses(batch))
        self.log("val/loss", self.val_loss)


class TinyT5(HFModule):
    """T5ForConditionalGeneration, 2+2 layers, d_model 64, relative attention bias, tied embeddings, no dropout:
    the first half of a chunk in, the second half out (every target the same length); the model's own loss."""

    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__(lr)
        config = T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                          num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
                          tie_word_embeddings=True)  # fmt: skip
        torch.manual_seed(0)
        self.model = T5ForConditionalGeneration(config)

    def logits_labels(self, batch: Tensor) -> tuple[Tensor, Tensor]:
        x, y = batch[:, : BLOCK // 2].contiguous(), batch[:, BLOCK // 2 :].contiguous()
        return self.model(input_ids=x, labels=y).logits, y

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        x, y = batch[:, : BLOCK // 2].contiguous(), batch[:, BLOCK // 2 :].contiguous()
        loss = self.model(input_ids=x, labels=y).loss
        self.log("train/loss", loss.detach(), sync_dist=True)
        return loss


class T5TokenLoss(TinyT5):
    """TinyT5 with its loss written by hand: the sum of token losses over the global batch's token count (counted
    over the ranks, times the micro-batches of a step), scaled back for DDP's mean and Lightning's accumulation."""

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        losses = self.token_losses(batch)
        tokens = torch.tensor(float(losses.numel()), dtype=losses.dtype, device=losses.device)
        world, accumulate = self.trainer.world_size, self.trainer.accumulate_grad_batches
        total = self.all_gather(tokens).sum() * accumulate
        self.log("train/loss", losses.detach().mean(), sync_dist=True)
        return losses.sum() * world * accumulate / total


class TinyLlama(HFModule):
    """LlamaForCausalLM, 2 layers, hidden 64, 4 heads over 2 key-value heads, no dropout, eager attention: next byte
    of each chunk; the model's own (shifted) loss."""

    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__(lr)
        config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=BLOCK,
                             attention_dropout=0.0, attn_implementation="eager")  # fmt: skip
        torch.manual_seed(0)
        self.model = LlamaForCausalLM(config)

    def logits_labels(self, batch: Tensor) -> tuple[Tensor, Tensor]:
        return self.model(input_ids=batch).logits[:, :-1], batch[:, 1:]

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train/loss", loss.detach(), sync_dist=True)
        return loss


class SummedLoss:
    """A real DDP bug: the loss times the samples of the rank's batch (2 devices take half the step)."""

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return super().training_step(batch, batch_idx) * len(batch)


class SummedLossT5(SummedLoss, TinyT5):
    pass


class SummedLossT5TokenLoss(SummedLoss, T5TokenLoss):
    pass


class SummedLossLlama(SummedLoss, TinyLlama):
    pass
