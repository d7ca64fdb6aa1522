"""The language-model example: it learns, and its FLOP count (for throughput and MFU) is right."""

import csv
import functools
import itertools
import math
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from ddpkit.model.sharding import shards_on_cpu
from ddpkit.parity import read_scalars
from ddpkit.scaling import throughput
from ddpkit.scaling.throughput import MFUThroughputMonitor, compute_dtype, device_peak_flops, peak_flops
from ddpkit.testing.helpers import run_ok
from lightning.fabric.utilities.throughput import _CUDA_FLOPS
from lightning.pytorch.loggers import CSVLogger

from {{ cookiecutter.package_name }}.lm.data import TextDataModule, sequences_in, tokens_in
from {{ cookiecutter.package_name }}.lm.module import VOCAB_SIZE, LanguageModel

TINY = dict(n_layers=2, d_model=64, n_heads=4, block_size=64)
# configs/lm.yaml's optimizer
PROJECT = Path(__file__).resolve().parents[2]
ADAMW = functools.partial(torch.optim.AdamW, lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))


def test_bundled_text_splits_into_sequences():
    """28,583 bytes of Ecclesiastes: 401 training and 44 validation sequences of 64 (+1 shifted target)."""
    dm = TextDataModule(global_batch_size=16, block_size=64)
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set)) == (401, 44)
    x, y = dm.train_set[0]
    assert torch.equal(x[1:], y[:-1])
    assert bytes(x[:12].tolist()) == b"Ecclesiastes"


def test_token_file_of_uint16_ids_splits_into_sequences(tmp_path):
    """token_format uint16 reads two bytes per id (ids above 255 too): 41 ids give 4 training and 0 validation
    sequences of 8 at val_fraction 0.1, each target its input shifted by one."""
    ids = torch.arange(41, dtype=torch.int64) * 1000 + 7  # up to 40,007
    path = tmp_path / "train.bin"
    path.write_bytes(ids.to(torch.uint16).numpy().tobytes())
    dm = TextDataModule(global_batch_size=2, block_size=8, text_path=str(path), token_format="uint16")
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set)) == (4, 0)
    x, y = dm.train_set[3]
    assert torch.equal(x, ids[24:32]) and torch.equal(y, ids[25:33])


def test_loss_drops_in_twenty_steps():
    """From ln(256) = 5.55 (uniform over bytes) to below 3.4 in 20 AdamW steps of 16 sequences."""
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # more threads only contend on a small, shared CPU
    try:
        module, dm = LanguageModel(**TINY, optimizer=ADAMW), TextDataModule(global_batch_size=16, block_size=64)
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


def test_optimizer_gets_weight_decay_on_matrices_only():
    """The optimizer callable receives two groups: weight matrices with its own weight_decay (0.1), and biases,
    norms and the position table with none."""
    module = LanguageModel(**TINY, optimizer=ADAMW)
    decay, other = module.configure_optimizers().param_groups
    assert (decay["weight_decay"], other["weight_decay"]) == (0.1, 0.0) and decay["lr"] == other["lr"] == 3e-3
    assert all(p.dim() == 2 for p in decay["params"]) and module.model.pos_emb.weight in other["params"]
    assert len(decay["params"]) + len(other["params"]) == len(list(module.parameters()))


def test_compile_option_compiles_each_block(monkeypatch):
    """compile=True compiles each transformer block on its own (identical blocks share the compiled code)."""
    compiled = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *args, **kwargs: compiled.append(self))
    module = LanguageModel(**TINY, compile=True)
    module.configure_model()
    assert compiled == list(module.model.blocks)


@pytest.mark.parametrize("vocab_size", [VOCAB_SIZE, 1000])
def test_flops_per_sequence_matches_the_transformer_formula(vocab_size):
    """Counted FLOPs = 6 x matmul params x T + 12 x layers x T^2 x d_model (attention), exactly, for bytes and for
    another vocabulary (whose tied embedding and head have vocab_size rows)."""
    module = LanguageModel(**TINY, vocab_size=vocab_size)
    assert module.model.head.weight.shape == (vocab_size, TINY["d_model"])
    L, d, T = TINY["n_layers"], TINY["d_model"], TINY["block_size"]
    per_layer = 3 * d * d + d * d + 2 * 4 * d * d  # qkv, proj, MLP (weights only; biases are not matmuls)
    matmul_params = L * per_layer + vocab_size * d  # + the tied output head
    formula = 6 * matmul_params * T + 12 * L * T * T * d
    assert module.flops_per_sequence == formula


@pytest.mark.skipif(not shards_on_cpu(), reason=f"FSDP2 runs on CPU processes from torch 2.6, not {torch.__version__}")
def test_lm_trains_sharded_from_the_presets(tmp_path):
    """configs/lm.yaml + configs/model_parallel.yaml on 2 CPU processes: shards per rank, validation loss drops."""
    tiny = ["--model.n_layers", "2", "--model.d_model", "64", "--model.block_size", "64", "--data.block_size", "64"]
    tiny += ["--model.scheduler", "null"]  # 4 steps: within lm.yaml's 20 warmup steps the lr stays small
    run_ok(
        "fit",
        *["--config", "configs/lm.yaml", "--config", "configs/model_parallel.yaml", *tiny],
        *["--trainer.accelerator", "cpu", "--trainer.precision", "32-true", "--trainer.enable_progress_bar", "false"],
        *["--data.global_batch_size", "16", "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "4"],
        *["--trainer.default_root_dir", str(tmp_path)],
        cwd=PROJECT,
        timeout=300,
    )
    version = tmp_path / "lightning_logs/version_0"
    (best,) = (version / "checkpoints").glob("best-*.ckpt")
    assert sorted(p.name for p in best.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    (val_loss,) = read_scalars(version)["val/loss"].values()  # the one validation, after 4 steps
    assert val_loss < math.log(VOCAB_SIZE) - 0.5  # 4 steps from 5.55 (measured: 4.51)


def fit_with_monitor(tmp_path, accelerator: str) -> list[dict]:
    """A tiny LM fit for 20 steps with the MFU monitor and a CSV logger; the logged rows."""
    L.seed_everything(0)
    monitor = MFUThroughputMonitor(batch_size_fn=sequences_in, length_fn=tokens_in, window_size=5)
    trainer = L.Trainer(
        accelerator=accelerator, devices=1, max_steps=20, log_every_n_steps=5, callbacks=[monitor],
        logger=CSVLogger(tmp_path), enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(LanguageModel(**TINY), TextDataModule(global_batch_size=16, block_size=TINY["block_size"]))
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        return [row for row in csv.DictReader(f) if row.get("train/device/flops_per_sec")]


def test_monitor_reports_mfu_against_the_dense_peak(tmp_path, monkeypatch):
    """MFU = FLOP/s per device / the table's dense peak; the CPU stands in for a GPU the table knows."""
    monkeypatch.setattr(throughput, "device_peak_flops", lambda device, precision: 1e12)
    rows = fit_with_monitor(tmp_path, "cpu")
    assert len(rows) >= 2
    for row in rows:
        assert float(row["train/device/mfu"]) == pytest.approx(float(row["train/device/flops_per_sec"]) / 1e12)


def test_peak_flops_recognises_a_plain_h200():
    """'NVIDIA H200' (the SXM part) gets the dense bf16 peak; Lightning 2.6's lookup returns nothing for it."""
    assert peak_flops("NVIDIA H200", "bf16") == 989.5e12
    assert peak_flops("NVIDIA H200 NVL", "bf16") == 835.5e12
    assert "nvidia h200" not in _CUDA_FLOPS and _CUDA_FLOPS["h200 sxm1"][torch.bfloat16] == 2 * 1e15  # sparse


def test_peak_flops_tells_h100_variants_apart_and_knows_no_others():
    """The SXM (HBM3) and PCIe H100s have different peaks; no guess for devices or dtypes not in the table."""
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.5e12
    assert peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    assert peak_flops("cpu", "bf16") is None
    assert peak_flops("NVIDIA A100-SXM4-80GB", "int4") is None


def test_compute_dtype_follows_precision_and_the_tf32_setting(monkeypatch):
    """bf16-mixed -> bf16; 32-true -> fp32 at torch's default matmul precision, tf32 when it is lowered."""
    assert compute_dtype("bf16-mixed") == "bf16" and compute_dtype("16-mixed") == "fp16"
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")
    assert compute_dtype("32-true") == "fp32"
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert compute_dtype("32-true") == "tf32"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert device_peak_flops(torch.device("cuda", 0), "bf16-mixed") == 989.5e12
    assert device_peak_flops(torch.device("cpu"), "bf16-mixed") is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="MFU on a real GPU needs CUDA")
def test_monitor_reports_mfu_on_this_gpu(tmp_path):
    """On a GPU the table knows, MFU is logged and lies in (0, 1)."""
    if device_peak_flops(torch.device("cuda", 0), "32-true") is None:
        pytest.skip(f"no peak FLOPs known for {torch.cuda.get_device_name(0)}")
    rows = fit_with_monitor(tmp_path, "gpu")
    assert rows and all(0 < float(row["train/device/mfu"]) < 1 for row in rows)
