"""The LightningModule's math, without any Trainer or devices."""

import functools

import torch

from {{ cookiecutter.package_name }}.digits.data import load_digits
from {{ cookiecutter.package_name }}.digits.module import DigitsClassifier


def test_forward_shape_and_hparams():
    """Logits are (batch, 10); constructor arguments are saved for checkpoints."""
    module = DigitsClassifier(hidden_dim=32, num_layers=3)
    assert module(torch.zeros(5, 64)).shape == (5, 10)
    assert module.hparams.hidden_dim == 32 and module.hparams.num_layers == 3
    assert sum(isinstance(m, torch.nn.Linear) for m in module.modules()) == 4


def test_loss_metrics_keep_weights():
    """The logged losses' metrics count update(v, weight=w) w times: 1.0 x 3 and 2.0 x 1 average 1.25
    (MeanMetric(nan_strategy="disable") drops the weight in torchmetrics 1.9.0 and says 1.5)."""
    module = DigitsClassifier()
    for metric in (module.train_loss, module.val_loss, module.test_loss):
        metric.update(1.0, weight=3)
        metric.update(2.0, weight=1)
        assert metric.compute().item() == 1.25


def test_model_learns_a_batch():
    """Plain optimizer steps on 128 digits bring the loss from ~2.3 below 0.05."""
    torch.manual_seed(0)
    adamw = functools.partial(torch.optim.AdamW, lr=3e-3, weight_decay=1e-4)  # config.yaml's
    module = DigitsClassifier(optimizer=adamw)
    x, y = load_digits().tensors
    x, y = x[:128], y[:128]
    optimizer = module.configure_optimizers()
    first = None
    for _ in range(200):
        loss = torch.nn.functional.cross_entropy(module(x), y)
        first = first if first is not None else loss.item()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert 2.0 < first < 2.6
    assert loss.item() < 0.05


def test_compile_option_compiles_the_mlp_in_configure_model(monkeypatch):
    """compile=True compiles the MLP (in place: same parameters and state-dict keys) when Lightning calls
    configure_model; compile=False compiles nothing."""
    compiled = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *args, **kwargs: compiled.append(self))
    module = DigitsClassifier(compile=True)
    module.configure_model()
    assert compiled == [module.model]
    DigitsClassifier().configure_model()
    assert compiled == [module.model]
