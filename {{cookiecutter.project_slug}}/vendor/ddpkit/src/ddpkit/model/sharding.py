"""Sharded data parallel: FSDP2 `fully_shard` for `ModelParallelStrategy`, and an FSDP strategy for YAML.

Each rank keeps 1/N of every parameter, gradient and optimizer state instead of a
full copy. A sharded layer gathers its full weights just before its forward (and
again for backward) and frees them after; gradients are reduce-scattered, which
averages them over ranks like DDP's all-reduce, so the training math is DDP's.
Sharding layer by layer bounds the gathered memory to about one layer at a time.
Mixed precision comes from the Trainer (`precision: bf16-mixed`), as with DDP.
FSDP2 runs on GPUs from torch 2.4 and on CPU processes (gloo) from torch 2.6 (`shards_on_cpu`).
"""

import importlib
from collections.abc import Iterable
from typing import Literal

import torch
from lightning.pytorch.strategies import FSDPStrategy
from torch import nn

from ..lightning_internals import apply_activation_checkpointing, fully_shard_function


def shard_layers(model: nn.Module, layers: Iterable[nn.Module], device_mesh, activation_checkpointing: bool = False):
    """Shard each of `layers`, then the rest of `model`, over the data-parallel dimension of `device_mesh`.

    Args:
        model: The module to shard in place (its parameters become DTensors).
        layers: Submodules of `model` that each get their own shard group (e.g. transformer blocks).
        device_mesh: `LightningModule.device_mesh` under `ModelParallelStrategy`
            (dimensions "data_parallel" and "tensor_parallel").
        activation_checkpointing: Recompute each layer's activations during backward instead of
            keeping them: less memory, about one more forward pass of compute.
    """
    fully_shard = fully_shard_function()  # its import path moved in torch 2.6
    layers = list(layers)
    if activation_checkpointing:
        chosen = {id(layer) for layer in layers}
        apply_activation_checkpointing(model, check_fn=lambda module: id(module) in chosen)
    mesh = device_mesh["data_parallel"]
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def shards_on_cpu() -> bool:
    """Whether FSDP2 runs on CPU processes: from torch 2.6 on; 2.4 and 2.5 create CUDA streams for it."""
    return torch.__version__ >= "2.6"


class LayerFSDPStrategy(FSDPStrategy):
    """Lightning's `FSDPStrategy` (GPUs only) with its wrapping chosen by layer class path, so YAML can set it.

    (`FSDPStrategy`'s own `auto_wrap_policy` has a type the command line cannot parse and is dropped
    from config files without a word.)

    Args:
        layers: Import paths of the layer classes to shard one by one, e.g. a transformer block.
        activation_checkpointing: Recompute those layers' activations during backward instead of
            keeping them: less memory, about one more forward pass of compute.
        sharding_strategy: FULL_SHARD (parameters, gradients, optimizer state), SHARD_GRAD_OP
            (gradients and optimizer state), HYBRID_SHARD (shard within a node, replicate across nodes).
        state_dict_type: "sharded": every rank writes its shard into a checkpoint directory (resumes on
            any device count); "full": rank 0 gathers and writes one file (needs the whole model in memory).
    """

    def __init__(
        self,
        layers: list[str],
        activation_checkpointing: bool = False,
        sharding_strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"] = "FULL_SHARD",
        state_dict_type: Literal["full", "sharded"] = "sharded",
    ) -> None:
        classes = {_import(path) for path in layers}
        super().__init__(
            auto_wrap_policy=classes,
            activation_checkpointing_policy=classes if activation_checkpointing else None,
            sharding_strategy=sharding_strategy,
            state_dict_type=state_dict_type,
        )


def _import(path: str) -> type[nn.Module]:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)
