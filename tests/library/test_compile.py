"""compile_layers: a module's layers compiled in place train the eager weights, under the same names."""

import os
import shutil

import lightning as L
import pytest
import torch
from ddpkit import compile_layers
from torch import nn

# torch.compile on CPU writes C++ and builds it with the system's compiler (CXX, else g++ / c++ / clang++).
needs_compiler = pytest.mark.skipif(
    not any(shutil.which(c) for c in (os.environ.get("CXX"), "g++", "c++", "clang++") if c),
    reason="torch.compile on CPU needs a C++ compiler (set CXX or install g++)",
)


class Small(L.LightningModule):
    """Two linear layers; with compile=True configure_model compiles each (as the examples do)."""

    def __init__(self, compile: bool) -> None:
        super().__init__()
        self.compile_model = compile
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def configure_model(self) -> None:
        if self.compile_model:
            compile_layers([self.net[0], self.net[2]])

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(compile: bool) -> Small:
    """8 float64 steps of 16 fixed samples on 1 CPU process, in this process (no DDP)."""
    L.seed_everything(0)
    data = torch.utils.data.TensorDataset(torch.randn(128, 8), torch.randint(0, 4, (128,)))
    module = Small(compile)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, precision="64-true", max_steps=8, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=16))
    return module


@needs_compiler
def test_compiled_fit_matches_eager():
    """compile_layers compiles each layer given (in place: same state-dict keys) and the compiled fit ends with
    the eager weights. Bound 1e-12: the compiler may fuse and reorder float64 sums (measured 0.0 on seeds 0-4:
    docs/measurements.md, "Parity and the guarantee suite")."""
    eager, compiled = fit(compile=False), fit(compile=True)
    assert all(layer._compiled_call_impl is not None for layer in (compiled.net[0], compiled.net[2]))
    assert eager.net[0]._compiled_call_impl is None
    a, b = eager.state_dict(), compiled.state_dict()
    assert a.keys() == b.keys()
    worst = max(((a[k] - b[k]).abs().max() / a[k].abs().max()).item() for k in a)
    assert worst <= 1e-12
