"""BatchNorm whose training statistics cover the global batch, on CPU (gloo) as on GPU (NCCL).

With DDP each rank normalizes by the statistics of its own share of the batch, so N devices do not train
what 1 device trains on the same global batch. torch's `SyncBatchNorm` fixes that on CUDA only (on CPU:
"SyncBatchNorm layers only work with GPU modules"). `SyncBatchNormAnyDevice` is a Lightning `LayerSync`
plugin that uses torch's on NCCL and `GlobalBatchNorm` (below) on any other backend:

    python main.py fit --trainer.plugins ddpkit.model.batchnorm.SyncBatchNormAnyDevice

It subclasses Lightning's `TorchSyncBatchNorm`, so `--trainer.sync_batchnorm true` may be given with it
(Lightning refuses that flag next to any other `LayerSync`). Statistics are synchronized in training only:
evaluation uses the running statistics (identical on every rank), and evaluation shards may differ in size.
"""

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
from torch import Tensor, nn

from ..lightning_internals import AnyDimBatchNorm, BatchNormBase, check_batchnorm_input


class _GlobalBatchNormFunction(torch.autograd.Function):
    """Batch normalization of this rank's share by statistics over every rank's, with the matching backward."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, group) -> tuple:
        dims = [0, *range(2, x.dim())]  # every dimension but the channels
        shape = [1, -1] + [1] * (x.dim() - 2)  # a (C,) vector broadcast over x
        compute = torch.promote_types(x.dtype, torch.float32)  # half-precision inputs: statistics in float32
        xc = x.to(compute)
        count = xc.numel() // xc.size(1)
        # Each rank's count, mean and sum of squared deviations from its own mean (torch's var_mean, not
        # sum(x^2) - sum(x)^2/n, which cancels catastrophically in float32 when |mean| >> std), gathered rather
        # than summed so that Chan's formula can combine them; every rank combines the same gathered tensor in
        # the same order, so every rank gets the same bits. An empty share counts 0 and adds nothing.
        if count:
            var, mean = torch.var_mean(xc, dims, correction=0)
        else:
            var = mean = xc.new_zeros(xc.size(1))
        local = torch.stack([torch.full_like(mean, count), mean, var * count])  # (3, C)
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, local, group=group)
        counts, means, m2s = torch.stack(gathered).unbind(1)  # each (world, C)
        n = counts.sum(0)
        if n[0] < 2:  # as nn.BatchNorm: a variance needs two values
            raise ValueError(f"Expected more than 1 value per channel when training, got {int(n[0])} over all ranks")
        global_mean = (counts * means).sum(0) / n
        global_m2 = (m2s + counts * (means - global_mean).square()).sum(0)
        invstd = torch.rsqrt(global_m2 / n + eps)  # normalization uses the biased variance, as nn.BatchNorm
        xhat = (xc - global_mean.view(shape)) * invstd.view(shape)
        y = xhat if weight is None else xhat * weight.to(compute).view(shape) + bias.to(compute).view(shape)
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.n, ctx.group, ctx.has_bias = n, group, bias is not None
        unbiased = global_m2 / (n - 1)  # what the running variance averages, as nn.BatchNorm
        ctx.mark_non_differentiable(global_mean, unbiased)
        return y.to(x.dtype), global_mean, unbiased

    @staticmethod
    def backward(ctx, dy: Tensor, _mean: Tensor, _var: Tensor) -> tuple:
        xhat, invstd, weight = ctx.saved_tensors
        dims = [0, *range(2, xhat.dim())]
        shape = [1, -1] + [1] * (xhat.dim() - 2)
        dyc = dy.to(xhat.dtype)
        sums = torch.stack([dyc.sum(dims), (dyc * xhat).sum(dims)])  # this rank's (sum dy, sum dy*xhat), (2, C)
        # The parameters' gradients stay this rank's own sums: DDP averages them over ranks as for any parameter.
        grad_weight = sums[1].to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = sums[0].to(weight.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        grad_x = None
        if ctx.needs_input_grad[0]:  # the same on every rank (same model), so all ranks join the all-reduce or none
            # Every rank's outputs depend on this rank's x through the global mean and variance:
            # dL/dx = gamma * invstd * (dy - mean(dy) - xhat * mean(dy * xhat)), means over the global batch.
            totals = sums.clone()
            dist.all_reduce(totals, group=ctx.group)
            mean_dy, mean_dy_xhat = (totals / ctx.n).unbind(0)
            scale = invstd if weight is None else invstd * weight.to(xhat.dtype)
            grad_x = (dyc - mean_dy.view(shape) - xhat * mean_dy_xhat.view(shape)) * scale.view(shape)
            grad_x = grad_x.to(dy.dtype)
        return grad_x, grad_weight, grad_bias, None, None


class GlobalBatchNorm(AnyDimBatchNorm):
    """A BatchNorm layer whose training statistics are those of the batch summed over all ranks (any backend).

    Built from an existing BatchNorm layer, it shares that layer's parameters and buffers, under the same
    names (checkpoints load either way); `plain()` gives the original layer back. In eval mode, and when
    only one process runs, it is exactly the layer it was built from.
    """

    def __init__(self, layer: BatchNormBase, process_group=None) -> None:
        super().__init__(layer.num_features, layer.eps, layer.momentum, layer.affine, layer.track_running_stats)
        self.weight, self.bias = layer.weight, layer.bias
        self.running_mean, self.running_var = layer.running_mean, layer.running_var
        self.num_batches_tracked = layer.num_batches_tracked
        self.process_group = process_group
        self.train(layer.training)
        # Not a submodule: it would be a second copy of the weights in the state dict.
        object.__setattr__(self, "_layer", layer)

    def forward(self, x: Tensor) -> Tensor:
        world = dist.get_world_size(self.process_group) if dist.is_available() and dist.is_initialized() else 1
        if not self.training or world == 1:
            return super().forward(x)  # nn.BatchNorm's own path: running stats in eval, local batch alone
        check_batchnorm_input(x)  # one class for 1d/2d/3d: the layer it replaces checked the rest
        factor = 0.0
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            # momentum None: the cumulative average of all batches so far, as nn.BatchNorm
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        y, mean, var = _GlobalBatchNormFunction.apply(x, self.weight, self.bias, self.eps, self.process_group)
        if self.track_running_stats:
            with torch.no_grad():
                self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
                self.running_var.mul_(1 - factor).add_(var.to(self.running_var.dtype), alpha=factor)
        return y

    def plain(self) -> BatchNormBase:
        """The layer this was built from, holding this layer's current parameters, buffers and mode."""
        layer = self._layer
        # Moving or converting the model (.to, .double) replaced this layer's buffers and parameter data.
        layer.weight, layer.bias = self.weight, self.bias
        layer.running_mean, layer.running_var = self.running_mean, self.running_var
        layer.num_batches_tracked = self.num_batches_tracked
        return layer.train(self.training)


class SyncBatchNormAnyDevice(TorchSyncBatchNorm):
    """Lightning's `sync_batchnorm`, also on CPU: torch's `SyncBatchNorm` on NCCL, `GlobalBatchNorm` otherwise.

    Lightning calls `apply` when fitting starts (after the process group forms, before the model moves to
    its device) and `revert` when it ends.
    """

    def apply(self, model: nn.Module) -> nn.Module:
        if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
            return super().apply(model)  # torch's fused CUDA kernels
        return self._convert(model)

    def _convert(self, module: nn.Module) -> nn.Module:
        if isinstance(module, GlobalBatchNorm):
            return module
        if isinstance(module, BatchNormBase):  # torch's SyncBatchNorm too: it cannot run on CPU
            return GlobalBatchNorm(module)
        for name, child in module.named_children():
            module.add_module(name, self._convert(child))
        return module

    def revert(self, model: nn.Module) -> nn.Module:
        if isinstance(model, GlobalBatchNorm):
            return model.plain()
        if isinstance(model, nn.SyncBatchNorm):
            return super().revert(model)  # from torch's conversion on NCCL, undone as Lightning does
        for name, child in model.named_children():
            model.add_module(name, self.revert(child))
        return model


def unsynced_batchnorm_warning(model: nn.Module, world_size: int, synced: bool) -> str | None:
    """One line when `model`'s BatchNorm layers would train on `world_size` > 1 processes unsynchronized, else None."""
    layers = [name for name, module in model.named_modules() if isinstance(module, BatchNormBase)]
    if synced or world_size < 2 or not layers:
        return None
    return (
        f"warning: {type(model).__name__} has {len(layers)} BatchNorm layer{'s' if len(layers) > 1 else ''} "
        f"({layers[0]}{', ...' if len(layers) > 1 else ''}) and {world_size} processes: each would normalize by its "
        f"own share of the batch, so {world_size} devices would not train what 1 device trains; add "
        "--trainer.sync_batchnorm true (statistics over the whole batch, on CPU as on GPU)."
    )
