"""A loss that divides by a count its batch works out (non-padding tokens, a mask's ones, the sum of class weights):
`global_mean` makes the count the optimizer step's, over every rank and micro-batch, so the step trains the same
weights on any device count and micro-batch size.

`F.cross_entropy(logits, y, ignore_index=pad)` divides by the tokens of the batch it is given. Under DDP each rank
is given its share of the global batch and DDP averages the ranks' gradients; with micro-batches Lightning divides
each one's loss by their number: a mean of means, which is the global batch's mean only where every rank and
micro-batch counts the same. Written with the loss's sum and its count,

    loss = global_mean(F.cross_entropy(logits, y, ignore_index=pad, reduction="sum"), (y != pad).sum(), self)

returns, in `training_step`, a loss whose gradient, once DDP and Lightning have averaged it, is the gradient of the
global batch's sum over its global count. Each call all-reduces the micro-batch's count and loss sum (one collective
of two float64 numbers) and rescales the gradient the step's earlier micro-batches left, so that after every backward
the gradients are the global mean's so far: gradient clipping and every hook see them normalised. The returned
value is the step's global mean so far, the same on every rank, so `self.log("train/loss", loss)` logs the global
batch's mean at the step's last micro-batch. Outside training (validation, test) it returns `loss_sum / count`, the
batch's own mean.

A loss that compares each sample with the batch's others (contrastive: CLIP, SimCLR) has no count to share: each rank
must see the whole global batch's rows. `gather_batch` gives them, with their gradients, and a module whose loss needs
them says so with `loss_spans_global_batch = True`: micro-batches are then refused (a micro-batch sees only its own
rows) and the guarantee suite compares 1 and N devices without them.

A mixture of experts' load-balancing loss (Switch Transformer's; Hugging Face's MoE models add it with
`output_router_logits=True`) multiplies two means over the batch's tokens: the share routed to each expert and its
mean router probability. Each rank computes it over its own tokens, so N devices balance N smaller batches.
`router_balance_loss` counts the shares over every rank's tokens (one all-reduce of 2 x experts + 1 numbers), which
gives 1 device's gradient on N; it spans the global batch like `gather_batch`. The manual: vendor/ddpkit/docs/losses.md.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torch import Tensor

# The module attribute that declares a loss over the whole global batch (a contrastive loss over gathered rows):
# the CLI refuses micro-batches for it and the guarantee suite plans no micro-batch runs (run/checks.py, testing/).
SPANS_GLOBAL_BATCH = "loss_spans_global_batch"

# The module attribute that holds the step's sums so far; the learning-rate finder reads it (step_mean).
STATE = "_ddpkit_global_mean"


@dataclass
class StepSums:
    """The optimizer step being accumulated: the trainer's (its id), its `global_step`, how many micro-batches it
    has had, and its loss sum and count over every rank so far (float64). `denominator` is the count the gradients
    are divided by now."""

    trainer: int
    step: int
    micro_batches: int
    total: Tensor
    count: Tensor

    @property
    def denominator(self) -> Tensor:
        # A step whose samples so far count nothing (every token padding) has a zero sum too: divide by 1, not 0.
        return torch.where(self.count > 0, self.count, torch.ones_like(self.count))


def global_mean(loss_sum: Tensor, count: Tensor | float, module: LightningModule) -> Tensor:
    """`loss_sum / count` of the optimizer step's global batch (every rank's, every micro-batch's), as the loss to
    return from `training_step`: `loss_sum` is this micro-batch's summed loss, `count` what it divides by (tokens,
    masked elements, the summed class weights of its targets). Call it once per training_step: a second call would
    count as the step's next micro-batch (add the losses that share a count first)."""
    trainer = module.trainer
    if not trainer.training:
        return loss_sum / count
    count = torch.as_tensor(count, device=loss_sum.device).to(torch.float64)
    sums = trainer.strategy.reduce(torch.stack([loss_sum.detach().to(torch.float64), count]), reduce_op="sum")
    last: StepSums | None = getattr(module, STATE, None)
    # Lightning zeroes the gradients after the first micro-batch's training_step, so the gradients there are the
    # previous step's: only a later micro-batch of the same step has gradients to rescale.
    same_step = (
        last is not None
        and last.trainer == id(trainer)
        and last.step == trainer.global_step
        and last.micro_batches < trainer.accumulate_grad_batches
    )
    if same_step:
        now = StepSums(last.trainer, last.step, last.micro_batches + 1, last.total + sums[0], last.count + sums[1])
        rescale(module, last.denominator / now.denominator)
    else:
        now = StepSums(id(trainer), trainer.global_step, 1, sums[0], sums[1])
    setattr(module, STATE, now)
    # DDP averages over the ranks and Lightning divides by the micro-batches per step: undo both, divide by the count.
    scale = (trainer.world_size * trainer.accumulate_grad_batches / now.denominator).to(loss_sum.dtype)
    loss = loss_sum * scale
    # The value is the global mean so far (the same on every rank); the gradient is the scaled sum's.
    return loss + ((now.total / now.denominator).to(loss.dtype) - loss.detach())


def rescale(module: LightningModule, factor: Tensor) -> None:
    """Multiply every gradient the module holds by `factor` (the step's earlier micro-batches' share, re-divided)."""
    by_dtype: dict[torch.dtype, Tensor] = {}
    for parameter in module.parameters():
        grad = parameter.grad
        if grad is not None:
            if grad.dtype not in by_dtype:
                by_dtype[grad.dtype] = factor.to(device=grad.device, dtype=grad.dtype)
            grad.mul_(by_dtype[grad.dtype])


def step_mean(module: LightningModule, step: int) -> float | None:
    """The global mean of optimizer step `step` where the module's training_step returned `global_mean`'s loss in it,
    else None (the learning-rate finder's loss of the step)."""
    sums: StepSums | None = getattr(module, STATE, None)
    if sums is None or sums.step != step:
        return None
    return (sums.total / sums.denominator).item()


class MicroBatchesRefused(RuntimeError):
    """gather_batch or router_balance_loss under micro-batches: `function` names which (the guarantee suite's probe
    tells a module that reads every rank's batch from this)."""

    def __init__(self, function: str, module: LightningModule, sees: str) -> None:
        self.function = function
        micro_batches = module.trainer.accumulate_grad_batches
        super().__init__(
            f"{function} in {type(module).__name__}: with {micro_batches} micro-batches per step each would {sees}, "
            "not the global batch's: leave micro_batch_size unset"
        )


def refuse_micro_batches(function: str, module: LightningModule, sees: str) -> None:
    """Raise MicroBatchesRefused where the module trains in micro-batches: `function` needs the whole global batch."""
    trainer = module.trainer
    if trainer.training and trainer.accumulate_grad_batches > 1:
        raise MicroBatchesRefused(function, module, sees)


def spans_global_batch(module) -> bool:
    """Whether the module declares `loss_spans_global_batch = True`."""
    return getattr(module, SPANS_GLOBAL_BATCH, False) is True


def router_balance_loss(
    router_logits: Tensor | tuple[Tensor, ...],
    top_k: int,
    module: LightningModule,
    attention_mask: Tensor | None = None,
) -> Tensor:
    """The load-balancing loss of a mixture of experts' routers over the global batch, to add (times its
    coefficient) to the loss `training_step` returns: experts x the sum over experts of (the share of tokens routed
    to the expert: its `top_k` choices counted) x (its mean router probability), both over every layer's tokens and
    every rank's, as Hugging Face's `load_balancing_loss_func` computes them over one batch. `router_logits`: one
    (tokens, experts) tensor per layer (Hugging Face's `out.router_logits`); `attention_mask` leaves padding out.
    On 1 device, Hugging Face's value; on N, the same gradient (each rank's probabilities over the global count, the
    shares all-reduced). Refused under micro-batches, like `gather_batch`: declare `loss_spans_global_batch = True`."""
    layers = tuple(router_logits) if isinstance(router_logits, tuple | list) else (router_logits,)
    dtype = torch.promote_types(layers[0].dtype, torch.float32)
    experts = layers[0].shape[-1]
    weight = None if attention_mask is None else attention_mask.reshape(-1).to(device=layers[0].device, dtype=dtype)
    counts, probabilities, rows = layers[0].new_zeros(experts, dtype=dtype), 0, 0
    for logits in layers:
        p = torch.softmax(logits.to(dtype), dim=-1)
        w = torch.ones_like(p[:, 0]) if weight is None else weight
        counts = counts.scatter_add(0, p.topk(top_k, dim=-1).indices.reshape(-1), w.repeat_interleave(top_k))
        probabilities, rows = probabilities + (p * w[:, None]).sum(0), rows + w.sum()
    trainer = module.trainer
    if not trainer.training:
        return experts * (counts / rows * probabilities / rows).sum()
    refuse_micro_batches("router_balance_loss", module, "count only its own tokens")
    local = torch.cat([counts, probabilities.detach(), rows.detach()[None]])
    every = trainer.strategy.reduce(local.to(torch.float64), reduce_op="sum").to(dtype)
    share, total = every[:experts] / every[-1], every[-1]
    # DDP averages the ranks' gradients: each rank's probabilities over the global count, times the world size.
    loss = experts * (share * probabilities).sum() / total * trainer.world_size
    value = experts * (share * every[experts:-1]).sum() / total  # the global batch's, the same on every rank
    return loss + (value - loss.detach())


def gather_batch(tensor: Tensor, module: LightningModule) -> Tensor:
    """Every rank's `tensor` of this training step, rank 0's rows first: (global batch, ...), in the global batch's
    order (each rank holds its consecutive share), with the gradient of every rank's loss flowing back to each rank's
    rows. On 1 device, `tensor`. A rank's loss over its own rows against these, averaged over its rows, or the global
    batch's loss computed on every rank, then trains 1 device's weights under DDP's average. Every rank must give the
    same shape. Refused under micro-batches: a micro-batch would see only its own rows."""
    refuse_micro_batches("gather_batch", module, "see only its own rows")
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tensor
    return _Gathered.apply(tensor)


class _Gathered(torch.autograd.Function):
    """all_gather forward; backward sums every rank's gradient of the gathered rows (an all-reduce, which every
    backend has) and keeps this rank's rows. The ranks' losses add up to world-size times the global batch's (each
    a mean over its own rows, or each the global one), so a rank's rows get that sum's gradient and DDP's average
    divides the world size back out."""

    @staticmethod
    def forward(ctx, tensor: Tensor) -> Tensor:
        tensor = tensor.contiguous()
        ctx.rows, ctx.rank = tensor.shape[0], dist.get_rank()
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, tensor)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        grad = grad.clone(memory_format=torch.contiguous_format)  # all_reduce writes in place
        dist.all_reduce(grad)
        return grad[ctx.rank * ctx.rows : (ctx.rank + 1) * ctx.rows]
