"""The LightningModule of the language-model example: next-token loss, optimizer, sharding, FLOPs.

Select it with `--config configs/lm.yaml`. Under DDP every device holds the whole
model; under `ModelParallelStrategy` (configs/model_parallel.yaml) `configure_model`
shards each transformer block over the devices; under `FSDPStrategy`
(configs/fsdp.yaml) the strategy wraps the blocks itself.
"""

import lightning as L
import torch
import torch.nn.functional as F
from ddpkit import Mean, compile_layers, optimization, shard_layers
from lightning.fabric.utilities.throughput import measure_flops
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor

from .gpt import GPT

VOCAB_SIZE = 256  # bytes, the default vocabulary


class LanguageModel(L.LightningModule):
    """A GPT-style language model, over bytes unless given another vocabulary.

    Args:
        n_layers: Transformer blocks.
        d_model: Width of the residual stream.
        n_heads: Attention heads per block (d_model must be a multiple).
        block_size: Longest context in tokens (learned positions).
        vocab_size: Token ids the model embeds and predicts: 256 for bytes (the bundled text); a tokenizer's
            size for pre-tokenized data (`--data.token_format uint16`), e.g. GPT-2's 50,257.
        activation_checkpointing: Under ModelParallelStrategy, recompute each block's activations
            during backward instead of storing them (less memory, ~1/3 more compute).
        optimizer: The optimizer class, called with two parameter groups: the weight matrices, which get
            the optimizer's weight_decay, and biases, norms and the position table, which get none.
            configs/lm.yaml: AdamW, lr 3e-3 (for the global batch), weight decay 0.1, betas (0.9, 0.95).
        scheduler: A learning-rate schedule called with the optimizer, or None for a constant lr.
            configs/lm.yaml: WarmupCosine, 20 warmup steps, then cosine decay to 0.1 x lr at the end of fit.
        compile: Compile each transformer block with torch.compile (identical blocks share the compiled code).
    """

    def __init__(
        self,
        n_layers: int = 4,
        d_model: int = 128,
        n_heads: int = 4,
        block_size: int = 128,
        vocab_size: int = VOCAB_SIZE,
        activation_checkpointing: bool = False,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        scheduler: LRSchedulerCallable | None = None,
        compile: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.activation_checkpointing, self.compile_blocks = activation_checkpointing, compile
        self.optimizer, self.scheduler = optimizer, scheduler
        self.model = GPT(vocab_size, block_size, n_layers, d_model, n_heads)
        self.train_loss, self.val_loss = Mean(), Mean()  # keeps weight=, unlike MeanMetric(nan_strategy="disable")
        # Training FLOPs (forward + backward) of one sequence of block_size tokens, counted on a
        # meta-device copy (no memory, no compute). ThroughputMonitor reads flops_per_batch.
        with torch.device("meta"):
            meta, x = GPT(vocab_size, block_size, n_layers, d_model, n_heads), torch.zeros(1, block_size).long()
        self.flops_per_sequence = measure_flops(meta, lambda: meta(x), lambda y: y.sum())
        self.flops_per_batch = 0

    def configure_model(self) -> None:
        if self.compile_blocks:  # before sharding, as torchtitan does: fully_shard then wraps compiled blocks
            compile_layers(self.model.blocks)
        if self.device_mesh is not None:
            shard_layers(self.model, self.model.blocks, self.device_mesh, self.activation_checkpointing)

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(idx)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        logits = self(x)  # (B, T, vocab)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())  # mean over the B*T next-token predictions

    def on_train_batch_start(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        # This device's batch; sequences shorter than block_size cost proportionally less.
        self.flops_per_batch = self.flops_per_sequence * batch[0].numel() // self.hparams.block_size

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.train_loss.update(loss.detach())  # every batch has the same number of tokens
        self.log("train/loss", self.train_loss, on_step=False, on_epoch=True, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        # weight = sequences, so batches of different sizes average to the per-token mean over the set.
        self.val_loss.update(self._loss(batch), weight=batch[0].shape[0])
        self.log("val/loss", self.val_loss, on_step=False, on_epoch=True, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer | dict:
        # No weight decay on biases, norms and the position table: the usual GPT recipe. The first group
        # takes the optimizer's own weight_decay.
        decay = [p for n, p in self.named_parameters() if p.dim() >= 2 and "pos_emb" not in n]
        other = [p for n, p in self.named_parameters() if not (p.dim() >= 2 and "pos_emb" not in n)]
        groups = [{"params": decay}, {"params": other, "weight_decay": 0.0}]
        return optimization(self, self.optimizer(groups), self.scheduler)
