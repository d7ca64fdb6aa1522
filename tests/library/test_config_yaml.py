"""The baked config.yaml's model block suits a module of the user's own that takes an optimizer and no scheduler:
the README's step "point config.yaml's model at them" then changes the class_path alone."""

from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.cli import LightningArgumentParser, OptimizerCallable

CONFIG = Path(__file__).resolve().parents[2] / "{{cookiecutter.project_slug}}" / "config.yaml"


class OptimizerOnly(L.LightningModule):
    """A user's module with the example's `optimizer` argument and no `scheduler`.

    Args:
        optimizer: The optimizer, called with the parameters.
    """

    def __init__(self, optimizer: OptimizerCallable = torch.optim.AdamW) -> None:
        super().__init__()
        self.optimizer = optimizer


def parse_model(block: dict):
    parser = LightningArgumentParser(exit_on_error=False)
    parser.add_lightning_class_args(L.LightningModule, "model", subclass_mode=True)
    return parser.parse_object({"model": block})


def test_the_baked_model_block_parses_for_a_module_without_a_scheduler():
    """config.yaml's model with only its class_path changed parses, the example's optimizer and lr kept; a
    `scheduler: null` left in it (0.5.2's config) would stop the parse naming the key."""
    model = yaml.safe_load(CONFIG.read_text().replace("{{ cookiecutter.package_name }}", "pkg"))["model"]
    model["class_path"] = f"{__name__}.OptimizerOnly"
    parsed = parse_model(model)
    assert parsed.model.init_args.optimizer.init_args.lr == 0.003
    model["init_args"]["scheduler"] = None
    with pytest.raises(Exception, match="scheduler"):
        parse_model(model)
