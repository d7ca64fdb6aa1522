"""Sharded training: ModelParallelStrategy + fully_shard on CPU matches DDP and resumes on another device count."""

import pytest
import torch
from fake_cluster import last_weights, max_abs_diff
from helpers import PROJECT, run_ok
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from {{ cookiecutter.package_name }}.gpt import Block
from {{ cookiecutter.package_name }}.sharding import LayerFSDPStrategy

# ModelParallelStrategy has no float64; float32 on CPU, 2 epochs (32 steps).
CPU = ["--trainer.accelerator", "cpu", "--trainer.precision", "32-true", "--trainer.enable_progress_bar", "false"]
SHARDED = ["--config", "configs/model_parallel.yaml", *CPU]


@pytest.fixture(scope="module")
def ddp_weights(tmp_path_factory):
    """Weights after 2 epochs of DDP on 1 device."""
    root = tmp_path_factory.mktemp("ddp")
    run_ok("fit", *CPU, "--trainer.max_epochs", "2", "--trainer.default_root_dir", str(root), cwd=root, timeout=240)
    return last_weights(root, 32)


def test_sharded_on_two_then_resumed_on_one_device_matches_ddp(ddp_weights, tmp_path):
    """Epoch 1 sharded over 2 processes, epoch 2 resumed from its sharded checkpoint on 1: DDP's weights."""
    two, one = tmp_path / "two", tmp_path / "one"
    run_ok(
        "fit", *SHARDED, "--trainer.max_epochs", "1", "--trainer.default_root_dir", str(two), cwd=PROJECT, timeout=300
    )
    sharded = two / "lightning_logs/version_0/checkpoints/last.ckpt"
    assert sorted(p.name for p in sharded.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]  # one per rank
    run_ok(
        "fit",
        *SHARDED,
        "--trainer.devices",
        "1",
        "--trainer.strategy.data_parallel_size",
        "1",
        "--trainer.max_epochs",
        "2",
        "--ckpt_path",
        str(sharded),
        "--trainer.default_root_dir",
        str(one),
        cwd=PROJECT,
        timeout=300,
    )
    dcp_to_torch_save(one / "lightning_logs/version_0/checkpoints/last.ckpt", tmp_path / "full.pt")
    weights = torch.load(tmp_path / "full.pt", weights_only=True)["state_dict"]
    # Without fully_shard in configure_model the ranks' gradients are not synced and this fails.
    assert max_abs_diff(weights, ddp_weights) < 1e-6


def test_fsdp_preset_wraps_and_checkpoints_the_transformer_blocks():
    """configs/fsdp.yaml's strategy shards each Block, optionally recomputes its activations, saves shards."""
    strategy = LayerFSDPStrategy(["{{ cookiecutter.package_name }}.gpt.Block"], activation_checkpointing=True)
    assert strategy.kwargs["auto_wrap_policy"]._module_classes == {Block}
    assert strategy._activation_checkpointing_kwargs["auto_wrap_policy"]._module_classes == {Block}
    assert strategy._state_dict_type == "sharded"


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
