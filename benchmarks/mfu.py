"""Model FLOPs utilisation of the benchmarks' MLP (run.py) and GPT (lm.py): achieved training FLOP/s over the
devices' dense peak.

The peaks come from the library's `ddpkit.scaling.throughput` (`peak_flops`), the
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


def gpt_flops_per_token(n_layers: int, d_model: int, vocab_size: int, block_size: int) -> float:
    """Training FLOPs per token of the example's GPT at full context: 6 per matmul weight, plus attention.

    Matmul weights: per block 12 d^2 (qkv 3 d^2, output projection d^2, MLP 8 d^2), and the tied output head
    V d. Attention's two matmuls (q k^T and the weighted sum of v) add 12 L T d per token, counted over the
    whole T x T score matrix as `measure_flops` counts `scaled_dot_product_attention` (and PaLM's MFU, nanoGPT's
    `estimate_mfu` count it). Equal to the example module's `flops_per_sequence / block_size`
    (tests/test_benchmarks.py).
    """
    matmul_weights = n_layers * 12 * d_model**2 + vocab_size * d_model
    return 6.0 * matmul_weights + 12.0 * n_layers * block_size * d_model
