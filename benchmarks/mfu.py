"""Model FLOPs utilisation of the benchmark's MLP: achieved training FLOP/s over the devices' dense peak.

The peaks come from the library's `ddpkit.throughput` (`peak_flops`), the
table its language-model example uses because Lightning's lookup does not know a
plain "NVIDIA H200" and counts H200s with sparsity.
"""

import itertools


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
