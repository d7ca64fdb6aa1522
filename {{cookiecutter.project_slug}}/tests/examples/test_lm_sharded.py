"""The language-model example's sharding presets: FSDP wraps its transformer blocks (configs/fsdp.yaml)."""

from pathlib import Path

import pytest
import torch
from ddpkit.model.sharding import LayerFSDPStrategy
from ddpkit.testing.helpers import run_ok

from {{ cookiecutter.package_name }}.lm.gpt import Block

PROJECT = Path(__file__).resolve().parents[2]


def test_fsdp_preset_wraps_and_checkpoints_the_transformer_blocks():
    """configs/fsdp.yaml's strategy shards each Block, optionally recomputes its activations, saves shards."""
    strategy = LayerFSDPStrategy(["{{ cookiecutter.package_name }}.lm.gpt.Block"], activation_checkpointing=True)
    assert strategy.kwargs["auto_wrap_policy"]._module_classes == {Block}
    assert strategy._activation_checkpointing_kwargs["auto_wrap_policy"]._module_classes == {Block}
    assert strategy._state_dict_type == "sharded"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="FSDP needs GPUs; this test needs 2")
def test_fsdp_on_two_gpus_resumes_on_one(tmp_path):
    """GPU only: the LM under configs/fsdp.yaml on 2 GPUs, its sharded checkpoint resumed on 1 GPU."""
    lm = ["--config", "configs/lm.yaml", "--config", "configs/fsdp.yaml", "--trainer.enable_progress_bar", "false"]
    run_ok(
        "fit",
        *lm,
        "--trainer.devices",
        "2",
        "--trainer.max_epochs",
        "1",
        "--trainer.default_root_dir",
        str(tmp_path / "two"),
        cwd=PROJECT,
        timeout=600,
    )
    ckpt = tmp_path / "two/lightning_logs/version_0/checkpoints/last.ckpt"
    assert ckpt.is_dir()
    out = run_ok(
        "fit",
        *lm,
        "--trainer.devices",
        "1",
        "--trainer.max_epochs",
        "2",
        "--ckpt_path",
        str(ckpt),
        "--trainer.default_root_dir",
        str(tmp_path / "one"),
        cwd=PROJECT,
        timeout=600,
    )
    assert "Restored all states" in out
