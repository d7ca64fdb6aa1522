"""Sharded training: ModelParallelStrategy + fully_shard on CPU matches DDP and resumes on another device count."""

import pytest
import torch

from ..model.sharding import shards_on_cpu
from ..parity import weight_diffs
from .fake_cluster import last_weights
from .runs import comparable, reads, total_steps

# max |a - b| / max |a| of the worst tensor: ModelParallelStrategy has no float64, so this is float32's 1-vs-2
# device bound. Measured (digits, 2026-12-02): 1.95e-6, the same as 2-device DDP's float32 run against 1 device
# (sharded vs that DDP run: 6e-8 absolute); DDP float32 reached 8.4e-5 over seeds 0-7 (check_parity's BOUNDS).
SHARDED_BOUND = 2e-4
# Why a BatchNorm model's sharded run differs, and what to change: Lightning's sync_batchnorm converts the layers under
# DDP only, so under ModelParallelStrategy each rank normalizes its own samples (a timm ResNet-18 in the digits
# module: max_rel 1.91, docs/measurements.md).
BATCHNORM_SHARDED = (
    "{model} has BatchNorm layers: sharded under ModelParallelStrategy, each rank normalizes by its own samples' "
    "statistics (sync_batchnorm converts them under DDP only), so 2 ranks train other weights than 1 device. To shard, "
    "use GroupNorm or LayerNorm; to train with DDP only, take the sharding (shard_layers, the device mesh) out of "
    "configure_model and this check skips."
)
# What torch raises when a sharded module is copied (FSDP2's modules refuse copy.deepcopy), and why a run would copy it:
# Lightning's EMAWeightAveraging and StochasticWeightAveraging (and timm's ModelEma) copy the module they average, and
# Lightning's docs say sharded models do not work with weight averaging. Digits bakes (2026-12-07): with
# EMAWeightAveraging rank 1 failed on this copy; with StochasticWeightAveraging, which copies the module before
# configure_model shards it, on "aten.copy_.default got mixed torch.Tensor and DTensor" at its first average.
NO_DEEPCOPY = "FSDP does not support deepcopy"
COPIES_SHARDED = (
    "{model}'s sharded run copies the module to average its weights ({how}), which a sharded module does not allow: "
    "weight averaging and sharding do not go together. To keep the averaging, train with DDP only: take the sharding "
    "(shard_layers, the device mesh) out of configure_model and this check skips."
)


@reads("sharded", "1dev-fp32")
def test_sharded_on_two_then_resumed_on_one_device_matches_ddp(configured, cpu_runs):
    """Epoch 1 sharded over 2 processes (one checkpoint shard per rank), epoch 2 resumed from its sharded
    checkpoint on 1: DDP's float32 weights on 1 device (waves.sharded_job)."""
    if not configured["shards_layers"] or not configured["global_batch_data"]:
        pytest.skip(f"{configured['model']} does not shard its layers in configure_model (ddpkit.shard_layers)")
    if not shards_on_cpu():
        pytest.skip(f"FSDP2 runs on CPU processes from torch 2.6 (this is {torch.__version__}; on GPUs from 2.4)")
    comparable(configured)
    if configured.get("averaging"):  # without starting the run that would fail
        how = f"{configured['averaging'][0]} in the config's callbacks"
        pytest.fail(COPIES_SHARDED.format(model=configured["model"], how=how), pytrace=False)
    try:
        sharded = cpu_runs["sharded"]
    except AssertionError as error:  # a copy of the user's own (timm's ModelEma in the module)
        if NO_DEEPCOPY not in str(error):
            raise
        why = COPIES_SHARDED.format(model=configured["model"], how=str(error).splitlines()[0])
        raise pytest.fail.Exception(why, pytrace=False) from None  # the sentence alone, not the run's error again
    assert sharded["files"] == ["__0_0.distcp", "__1_0.distcp"]  # one per rank
    steps = total_steps(configured)
    # Without fully_shard in configure_model the ranks' gradients are not synced and this fails. Bound: float32
    # rounding of 2 ways to sum the gradients (SHARDED_BOUND).
    worst = weight_diffs(sharded["weights"], last_weights(cpu_runs["1dev-fp32"].root, steps))[0]
    if worst.max_rel > SHARDED_BOUND and configured["batchnorm"]:  # a BatchNorm model that matches passes
        pytest.fail(f"{BATCHNORM_SHARDED.format(model=configured['model'])} ({worst})", pytrace=False)
    assert worst.max_rel <= SHARDED_BOUND, worst
