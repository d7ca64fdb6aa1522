"""The language-model example: it learns, and its FLOP count (for throughput and MFU) is right."""

import itertools
import math

import torch
import torch.nn.functional as F
from helpers import PROJECT, run_ok

from {{ cookiecutter.package_name }}.lm import VOCAB_SIZE, LanguageModel
from {{ cookiecutter.package_name }}.text import TextDataModule

TINY = dict(n_layers=2, d_model=64, n_heads=4, block_size=64)


def test_bundled_text_splits_into_sequences():
    """28,583 bytes of Ecclesiastes: 401 training and 44 validation sequences of 64 (+1 shifted target)."""
    dm = TextDataModule(global_batch_size=16, block_size=64)
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set)) == (401, 44)
    x, y = dm.train_set[0]
    assert torch.equal(x[1:], y[:-1])
    assert bytes(x[:12].tolist()) == b"Ecclesiastes"


def test_loss_drops_in_twenty_steps():
    """From ln(256) = 5.55 (uniform over bytes) to below 3.4 in 20 AdamW steps of 16 sequences."""
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # more threads only contend on a small, shared CPU
    try:
        module, dm = LanguageModel(**TINY), TextDataModule(global_batch_size=16, block_size=64)
        dm.setup("fit")
        optimizer = module.configure_optimizers()
        losses = []
        for x, y in itertools.islice(dm.train_dataloader(), 20):
            loss = F.cross_entropy(module(x).flatten(0, 1), y.flatten())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    assert abs(losses[0] - math.log(VOCAB_SIZE)) < 0.3
    assert losses[-1] < 3.4


def test_flops_per_sequence_matches_the_transformer_formula():
    """Counted FLOPs = 6 x matmul params x T + 12 x layers x T^2 x d_model (attention), exactly."""
    module = LanguageModel(**TINY)
    L, d, T = TINY["n_layers"], TINY["d_model"], TINY["block_size"]
    per_layer = 3 * d * d + d * d + 2 * 4 * d * d  # qkv, proj, MLP (weights only; biases are not matmuls)
    matmul_params = L * per_layer + VOCAB_SIZE * d  # + the tied output head
    formula = 6 * matmul_params * T + 12 * L * T * T * d
    assert module.flops_per_sequence == formula


def test_lm_trains_sharded_from_the_presets(tmp_path):
    """configs/lm.yaml + configs/model_parallel.yaml on 2 CPU processes: shards per rank, validation loss drops."""
    tiny = ["--model.n_layers", "2", "--model.d_model", "64", "--model.block_size", "64", "--data.block_size", "64"]
    run_ok(
        "fit",
        *["--config", "configs/lm.yaml", "--config", "configs/model_parallel.yaml", *tiny],
        *["--trainer.accelerator", "cpu", "--trainer.precision", "32-true", "--trainer.enable_progress_bar", "false"],
        *["--data.global_batch_size", "16", "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "4"],
        *["--trainer.default_root_dir", str(tmp_path)],
        cwd=PROJECT,
        timeout=300,
    )
    (best,) = (tmp_path / "lightning_logs/version_0/checkpoints").glob("best-*.ckpt")
    assert sorted(p.name for p in best.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    val_loss = float(best.name.removesuffix(".ckpt").split("loss")[1])
    assert val_loss < math.log(VOCAB_SIZE) - 0.5  # 4 steps from 5.55 (measured: 4.51)
