"""torch.compile for a module's layers, chosen by the module (`configure_model`), run by any strategy.

Each layer is compiled in place (`nn.Module.compile`): its parameters, state-dict keys and checkpoints
stay those of the eager layer, and DDP or FSDP wrap it as before. Compiling layer by layer (e.g. each
transformer block) instead of the whole model keeps graphs small and reused: identical blocks compile
once. The first steps wait for the compiler (measured on 2 CPU cores: the manual, vendor/ddpkit/docs/training.md).
"""

from collections.abc import Iterable

from torch import nn


def compile_layers(layers: Iterable[nn.Module]) -> None:
    """Compile each of `layers` in place (the compiler runs at each layer's first call)."""
    for layer in layers:
        layer.compile()
