"""Sharded training: ModelParallelStrategy + fully_shard on CPU matches DDP and resumes on another device count."""

import pytest
import torch
from fake_cluster import last_weights
from helpers import PROJECT, run_ok
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from ddpkit.parity import max_abs

# ModelParallelStrategy has no float64; float32 on CPU, 2 epochs.
CPU = ["--trainer.accelerator", "cpu", "--trainer.precision", "32-true", "--trainer.enable_progress_bar", "false"]
CPU += ["--trainer.callbacks+=parity_probe.NoDropout"]  # as in the reference run (parity_probe.Probe)
TESTS_ON_PATH = {"PYTHONPATH": str(PROJECT / "tests")}
SHARDED = ["--config", "configs/model_parallel.yaml", *CPU]


@pytest.fixture(scope="module")
def ddp_weights(configured, request):
    """Weights after 2 epochs of DDP on 1 device in float32 (the parity tests' run, tests/runs.py)."""
    if not configured["shards_layers"] or not configured["global_batch_data"]:
        pytest.skip(f"{configured['model']} does not shard its layers in configure_model (see ddp/sharding.py)")
    run = request.getfixturevalue("cpu_runs")["1dev-fp32"]
    return last_weights(run.root, 2 * configured["steps_per_epoch"])


def test_sharded_on_two_then_resumed_on_one_device_matches_ddp(ddp_weights, tmp_path):
    """Epoch 1 sharded over 2 processes, epoch 2 resumed from its sharded checkpoint on 1: DDP's weights."""
    two, one = tmp_path / "two", tmp_path / "one"
    run_ok(
        "fit",
        *SHARDED,
        "--trainer.max_epochs",
        "1",
        "--trainer.default_root_dir",
        str(two),
        cwd=PROJECT,
        env=TESTS_ON_PATH,
        timeout=300,
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
        env=TESTS_ON_PATH,
        timeout=300,
    )
    dcp_to_torch_save(one / "lightning_logs/version_0/checkpoints/last.ckpt", tmp_path / "full.pt")
    weights = torch.load(tmp_path / "full.pt", weights_only=True)["state_dict"]
    # Without fully_shard in configure_model the ranks' gradients are not synced and this fails.
    assert max_abs(weights, ddp_weights) < 1e-6
