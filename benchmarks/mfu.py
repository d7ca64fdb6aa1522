"""Model FLOPs utilisation: achieved training FLOP/s over the hardware's dense peak.

Lightning's `get_available_flops` does not recognise a plain "NVIDIA H200"
device name (it only knows "h200 sxm1"/"h200 nvl1"), and its H200 figures are the
datasheet's with-sparsity numbers, twice the dense peak. The table below holds
dense tensor-core peaks per GPU from NVIDIA's datasheets; MFU is conventionally
quoted against the dense figure.
"""

import itertools

# Dense peak FLOP/s per GPU by compute dtype. "fp32" is the plain (non-tensor-core) rate.
# Matched against the lower-cased device name, first match wins: specific names first.
PEAK_FLOPS: list[tuple[str, dict[str, float]]] = [
    ("h200 nvl", {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12}),
    ("h200", {"bf16": 989.5e12, "fp16": 989.5e12, "tf32": 494.7e12, "fp32": 67e12}),  # "NVIDIA H200" is the SXM part
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


def mlp_train_flops(batch: int, in_features: int, hidden_dim: int, num_layers: int, num_classes: int) -> float:
    """FLOPs of one training step of the template's MLP, counting only the matrix multiplies.

    Per weight and sample: 2 forward, 2 for its gradient, 2 for the input's gradient,
    which the first layer skips (the data needs none). Bias adds, ReLU and the
    optimizer are a rounding error.
    """
    widths = [in_features] + [hidden_dim] * num_layers + [num_classes]
    weights = [a * b for a, b in itertools.pairwise(widths)]
    return batch * (6.0 * sum(weights) - 2.0 * weights[0])


def mfu(flops_per_step: float, step_seconds: float, peak_per_device: float, devices: int) -> float:
    """Achieved FLOP/s of the whole job over the summed peak of its devices (0..1)."""
    return flops_per_step / step_seconds / (peak_per_device * devices)
