"""A test-only callback that records, on every rank, what the rank trained on and what it logged.

The parity tests give it to main.py as `--trainer.callbacks+=parity_probe.Probe`
with `tests/` on PYTHONPATH. When a stage ends, each rank writes
`<default_root_dir>/probe/<stage>-rank<r>.json` and, after fit, its final weights
to `fit-rank<r>.pt`.
"""

import json
import os
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor


def fingerprint(x: Tensor, y: Tensor) -> bytes:
    """One sample's identity: its features and label (float32 holds both exactly, in any run precision)."""
    return torch.cat([x.flatten().float(), y.flatten().float()]).cpu().numpy().tobytes()


class Probe(L.Callback):
    """Records training sample indices per step, logged metrics and evaluation sample counts, per rank."""

    def __init__(self) -> None:
        self.record: dict = {"pid": os.getpid(), "batches": {}, "train": [], "val": [], "test": {}}
        self.eval_samples = 0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.record.update(rank=trainer.global_rank, world_size=trainer.world_size)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Batches hold samples, not indices: find each sample's index in the training set by content.
        dataset = trainer.train_dataloader.dataset
        self.index = {fingerprint(*dataset[i]): i for i in range(len(dataset))}

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        x, y = batch
        ids = [self.index[fingerprint(xi, yi)] for xi, yi in zip(x, y, strict=True)]
        self.record["batches"].setdefault(str(trainer.current_epoch), []).append(ids)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        # What this rank's module logged this step (after any sync), at full precision.
        logged = {k: v.item() for k, v in trainer.callback_metrics.items() if k.startswith("train/")}
        self.record["train"].append({"step": trainer.global_step, **logged})

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.eval_samples = 0

    def on_test_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.eval_samples = 0

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.eval_samples += len(batch[1])

    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.eval_samples += len(batch[1])

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            metrics = {k: v.item() for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
            self.record["val"].append({"epoch": trainer.current_epoch, "samples": self.eval_samples, **metrics})

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        metrics = {k: v.item() for k, v in trainer.callback_metrics.items() if k.startswith("test/")}
        self.record["test"] = {"samples": self.eval_samples, **metrics}

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        out = Path(trainer.default_root_dir) / "probe"
        out.mkdir(parents=True, exist_ok=True)
        rank, stage = trainer.global_rank, TrainerFn(stage).value  # "fit", "test", ...
        (out / f"{stage}-rank{rank}.json").write_text(json.dumps(self.record))
        if stage == "fit":
            torch.save(pl_module.state_dict(), out / f"fit-rank{rank}.pt")
