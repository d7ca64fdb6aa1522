"""A fit whose dataset augments with torch's, Python's and NumPy's global generators in `__getitem__`, for
test_augmentation.py: each rank writes, per epoch, every sample it trained as {index: its three draws}.

    python augmented.py OUT DEVICES WORKERS [--unseeded] [--order weighted]

2 epochs of 32 samples, global batch 8, CPU (gloo with 2 devices), --seed_everything 5.
"""

import json
import random
import sys
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import Dataset

from ddpkit.data.global_batch import GlobalBatchDataModule


class Augmenting(Dataset):
    """Sample i: its index and three draws, one from each global generator (what an augmentation pipeline does)."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int):
        draws = [torch.rand(()).item(), random.random(), float(np.random.rand())]
        return torch.tensor(i), torch.tensor(draws, dtype=torch.float64)


class Data(GlobalBatchDataModule):
    def __init__(self, order: str = "", **kwargs) -> None:
        super().__init__(**kwargs)
        self.order = order

    def train_dataset(self) -> Dataset:
        return Augmenting()

    def train_order(self, seed: int, epoch: int):
        if self.order != "weighted":
            return torch.randperm(32, generator=torch.Generator().manual_seed(seed + epoch))
        from ddpkit.data.order import weighted_order

        return weighted_order(torch.linspace(0.1, 1.0, 32), 32, seed, epoch)


class Model(L.LightningModule):
    def __init__(self, out: Path) -> None:
        super().__init__()
        self.layer, self.out, self.seen = torch.nn.Linear(3, 1), out, {}

    def training_step(self, batch, batch_idx):
        index, draws = batch
        epoch = self.seen.setdefault(str(self.current_epoch), {})
        for i, d in zip(index.tolist(), draws.tolist(), strict=True):
            epoch.setdefault(str(i), []).append(d)
        return self.layer(draws.float()).pow(2).mean()

    def on_train_end(self) -> None:
        (self.out / f"rank{self.global_rank}.json").write_text(json.dumps(self.seen))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    out, devices, workers = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    order = sys.argv[sys.argv.index("--order") + 1] if "--order" in sys.argv else ""
    L.seed_everything(5)
    data = Data(order=order, global_batch_size=8, num_workers=workers, seeded_draws="--unseeded" not in sys.argv)
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", max_epochs=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Model(out), datamodule=data)


if __name__ == "__main__":
    main()
