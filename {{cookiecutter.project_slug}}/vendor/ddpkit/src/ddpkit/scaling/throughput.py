"""MFU (model FLOPs utilisation) on GPUs whose peak Lightning's table gets wrong or does not know.

Lightning 2.6's `get_available_flops` does not recognise a plain "NVIDIA H200"
(what `torch.cuda.get_device_name` reports for the SXM part; its table knows
"h200 sxm1" and "h200 nvl1"), so `ThroughputMonitor` logs no MFU there. Its H200
figures are also the datasheet's *with sparsity*, twice the dense peak that MFU
is quoted against. `MFUThroughputMonitor` takes the dense peak from the table
below when the device is in it, and Lightning's figure otherwise.
"""

import warnings
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ThroughputMonitor

from ..lightning_internals import set_throughput_peak

# Dense peak FLOP/s per GPU by compute dtype, from NVIDIA's datasheets; "fp32" is the plain
# (non-tensor-core) rate. Matched against the lower-cased device name: first match wins, so
# specific names come first.
PEAK_FLOPS: list[tuple[str, dict[str, float]]] = [
    ("h200 nvl", {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12}),
    ("h200", {"bf16": 989.5e12, "fp16": 989.5e12, "tf32": 494.7e12, "fp32": 67e12}),  # "NVIDIA H200": SXM
    ("h100 nvl", {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12}),
    ("h100 pcie", {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51.2e12}),
    ("h100", {"bf16": 989.5e12, "fp16": 989.5e12, "tf32": 494.7e12, "fp32": 66.9e12}),  # SXM, "80GB HBM3"
    ("a100", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    ("l40s", {"bf16": 362e12, "fp16": 362e12, "tf32": 183e12, "fp32": 91.6e12}),
    ("l4", {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12}),
]


def peak_flops(device_name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of one device, e.g. ("NVIDIA H200", "bf16"); None when unknown."""
    name = device_name.lower()
    for key, by_dtype in PEAK_FLOPS:
        if key in name:
            return by_dtype.get(dtype)
    return None


def compute_dtype(precision: str) -> str:
    """The dtype the matmuls run in for a Trainer `precision` ("bf16-mixed" -> "bf16")."""
    if precision.startswith("bf16"):
        return "bf16"
    if precision.startswith("16"):
        return "fp16"
    if precision.startswith("64"):
        return "fp64"
    # float32 matmuls use TF32 tensor cores unless the precision is left at "highest" (torch's default).
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def device_peak_flops(device: torch.device, precision: str) -> float | None:
    """Dense peak FLOP/s of a CUDA device for this precision; None on other devices or unknown GPUs."""
    if device.type != "cuda":
        return None
    return peak_flops(torch.cuda.get_device_name(device), compute_dtype(precision))


class MFUThroughputMonitor(ThroughputMonitor):
    """Lightning's `ThroughputMonitor` (samples, tokens, FLOPs per second; MFU on GPUs) with dense GPU peaks.

    Args:
        batch_size_fn: Samples in a batch.
        length_fn: Items (e.g. tokens) in a batch; None when samples have no length.
        window_size: Batches the rates are averaged over.
        separator: Between the parts of the logged names (`train/device/mfu`).
    """

    def __init__(
        self,
        batch_size_fn: Callable[[Any], int],
        length_fn: Callable[[Any], int] | None = None,
        window_size: int = 100,
        separator: str = "/",
    ) -> None:
        super().__init__(batch_size_fn, length_fn, window_size=window_size, separator=separator)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        peak = device_peak_flops(trainer.strategy.root_device, str(trainer.precision))
        with warnings.catch_warnings():
            if peak is not None:  # Lightning would warn that it has no figure for a device that has one here
                warnings.filterwarnings("ignore", message="FLOPs not found")
            super().setup(trainer, pl_module, stage)
        if peak is not None:
            set_throughput_peak(self, peak)
