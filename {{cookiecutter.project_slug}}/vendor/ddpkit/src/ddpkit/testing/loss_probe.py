"""Whether the configured training step's loss of a batch is the mean of its samples' losses, found before any run
(configured.py): one float64 optimizer step on 1 device from the same weights, the global batch whole and in 2
micro-batches. DDP averages the ranks' gradients and Lightning the micro-batches', so only a loss that is a mean
over samples trains on N devices what it trains on 1. A loss divided by a count its batch works out (non-padding
tokens, a mask, class weights) gives the two steps gradients that differ in direction, not just size: then every
comparison of the suite fails with one line that names the cause and the fix (runs.comparable). A loss summed over
the batch (Hugging Face's CTC models by default: `ctc_loss_reduction="sum"`) halves the gradient in 2 micro-batches
without changing its direction: its own line, the same way.
"""

import copy
import gc
import tempfile

import lightning as L
import torch

from ..data.global_batch import GlobalBatchDataModule
from ..data.sampling import GlobalBatchSampler
from ..lightning_internals import BatchNormBase
from ..model.losses import MicroBatchesRefused
from .float64 import Float64Throughout
from .parity_probe import NoDropout

# float64, the same weights and samples: the gradient in 2 micro-batches was 1.9e-16 to 4.4e-16 of the whole batch's
# apart where the loss is a mean over samples (the toy, the padded LSTM, GPT-2, TinyBert, a GroupNorm ResNet-18;
# global_mean's three losses), and 0.011 to 0.049 with a per-batch token, mask or class-weight count (the template's
# docs/measurements.md, "Per-batch counts").
APART = 1e-9


class Gradients(NoDropout):
    """Seeds the random streams at every micro-batch, holds BatchNorm layers at their running statistics and keeps
    the gradient the optimizer step is given."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        torch.manual_seed(0)
        # Normalized by the batch's own statistics, a micro-batch's samples would come out otherwise than in the
        # whole batch whatever the loss. At their running statistics (fixed here: not updated in eval mode) the
        # layers act on each sample alone, so what is left to differ is the loss.
        for module in pl_module.modules():
            if isinstance(module, BatchNormBase):
                module.eval()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grads = {n: p.grad.detach().clone() for n, p in pl_module.named_parameters() if p.grad is not None}


def one_step(model, data, micro_batch_size: int | None, order: list[int] | None = None) -> dict[str, torch.Tensor]:
    """The gradient of the first global batch's optimizer step, float64, on 1 device, in micro-batches of
    `micro_batch_size` (None: the whole batch); the global batch `order`'s indices in that order where given."""
    torch.manual_seed(0)
    model, data = copy.deepcopy(model), copy.deepcopy(data)
    data.micro_batch_size = micro_batch_size
    if order is not None:  # this copy's class, with the order: its sampler asks the class (global_batch.py)
        data.__class__ = type(type(data).__name__, (type(data),), {"train_order": lambda self, seed, epoch: order})
    grads = Gradients()
    with tempfile.TemporaryDirectory() as root:
        probe_trainer(root, grads, max_steps=1).fit(model, datamodule=data)
    return grads.grads


def probe_trainer(root: str, callback: L.Callback, **stop) -> L.Trainer:
    """A quiet 1-device float64 Trainer in `root` that trains until `stop` (Lightning's max_steps, ...) with
    `callback`, no validation, logger or checkpoint: the probes' one step (here and configured.py). Under
    Float64Throughout, as the suite's float64 runs: a model that casts to float32 inside (Hugging Face's RMSNorms)
    rounds otherwise in a batch padded to other lengths, and its split batch's gradient then read as 1.4e-08 apart
    with a correct global_mean loss (docs/measurements.md, "Per-batch counts"). The earlier probe
    fits' trainers, modules and optimizer states hold each other in reference cycles, which Python frees only when its
    cycle collector runs: collected first, so that one fit's memory is held at a time (unreferenced, the 4 probe fits
    of a 124M-parameter float64 GPT-2 held 23.8 GB together and the process was killed: docs/measurements.md)."""
    gc.collect()
    return L.Trainer(
        accelerator="cpu", devices=1, precision="64-true", limit_val_batches=0, num_sanity_val_steps=0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[callback, Float64Throughout()], default_root_dir=root, **stop,
    )  # fmt: skip


def multiple_of(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """`b` as a multiple of `a` plus a rest across `a`'s direction: the multiple, and the rest's norm over `a`'s (also
    the one-step check's gradient_scale)."""
    ratio = (torch.dot(a, b) / torch.dot(a, a)).item()
    return ratio, ((b - ratio * a).norm() / a.norm()).item()


def batch_mean_line(model, data) -> str:
    """ "" where the global batch's gradient in 2 micro-batches points where the whole batch's does, else the line
    that says the loss is not a mean over samples, how far the two are apart, and the fix. BatchNorm layers are held
    at their running statistics for both steps (Gradients). Not looked at ("") where the step cannot be split:
    manual optimization (no micro-batches), BatchNorm without running statistics (`track_running_stats=False`
    normalizes by the batch in eval mode too), a data module without micro-batches or an odd global batch."""
    splits = (
        model.automatic_optimization
        and all(m.track_running_stats for m in model.modules() if isinstance(m, BatchNormBase))
        and hasattr(data, "micro_batch_size")
        and data.global_batch_size % 2 == 0
    )
    if not splits:
        return ""
    order = by_size(data)
    try:
        split = split_step(model, data, padded_alike(order))
    except MicroBatchesRefused as refused:
        return (
            f"{type(model).__name__}'s loss reads every rank's batch (ddpkit.{refused.function}) but does not "
            "say so: set `loss_spans_global_batch = True` on the module, and micro-batches are refused and the suite "
            "compares 1 and N devices without them (the manual: vendor/ddpkit/docs/losses.md)"
        )
    if split is None:
        return ""
    # The part of the micro-batches' gradient that is not a multiple of the whole batch's: a summed loss's halving
    # is a multiple, a count's is not. A mean's is 1 x, within float64's rounding.
    ratio, apart, worst = split
    if apart <= APART:
        if abs(ratio - 1) > APART:
            return summed_line(model, ratio)
        return padding_line(model, data, order)
    if aux := router_aux(model):
        return (
            f"{type(model).__name__}'s loss adds {aux}, which multiplies two means over the batch's tokens (the share "
            "routed to each expert, its mean probability), so each rank balances only its own tokens and N devices "
            "cannot train 1 device's weights (one float64 step on 1 device from the same weights: the global batch "
            f"in 2 micro-batches gives a gradient {apart:.2g} of the whole batch's apart in direction, most in "
            f"{worst}): to balance the global batch, {ROUTER_FIX} and set "
            "`loss_spans_global_batch = True` on the module; to keep each device's own balance, as Hugging Face's "
            "Trainer does, only the rest can be checked: set router_aux_loss_coef to 0 for the checks in PARITY_ARGS "
            "(the manual: vendor/ddpkit/docs/losses.md)"
        )
    return (
        f"{type(model).__name__}'s loss of a batch is not the mean of its samples' losses: it divides by a count the "
        f"batch works out (tokens, a mask, class weights) or is a ratio over the batch (a Dice), so each rank and each "
        f"micro-batch divides by its own "
        f"(one float64 step on 1 device from the same weights: the global batch in 2 micro-batches gives a gradient "
        f"{apart:.2g} of the whole batch's apart in direction, most in {worst}), and N devices cannot train 1 "
        "device's weights: sum the loss and return `ddpkit.global_mean(loss_sum, count, self)` from training_step; "
        "a Dice needs a per-sample form; a loss that compares each sample with the batch's others (contrastive: CLIP, "
        "SimCLR) must see every rank's rows, `ddpkit.gather_batch(z, self)` (open_clip's ClipLoss: "
        "gather_with_grad=True), and then declares it with `loss_spans_global_batch = True` on the module "
        "(the manual: vendor/ddpkit/docs/losses.md)"
    )


# How to balance a Hugging Face MoE's routers over the global batch (this line and the one-step check's ROUTER_HINT).
ROUTER_FIX = (
    "set router_aux_loss_coef=0 in the model's config and add "
    "`coef * ddpkit.router_balance_loss(out.router_logits, top_k, self, attention_mask)` to the loss"
)


def router_aux(model) -> str:
    """The router load-balancing loss a Hugging Face mixture of experts inside `model` adds to its loss (its config's
    `output_router_logits` on and `router_aux_loss_coef` above 0), in words; "" where there is none."""
    for module in model.modules():
        config = getattr(module, "config", None)
        coef = getattr(config, "router_aux_loss_coef", None)
        if getattr(config, "output_router_logits", False) is True and isinstance(coef, int | float) and coef > 0:
            return (
                f"{type(module).__name__}'s router load-balancing loss (output_router_logits=True, "
                f"router_aux_loss_coef={coef:g})"
            )
    return ""


def summed_line(model, ratio: float) -> str:
    """The line for a loss whose gradient in 2 micro-batches is `ratio` x the whole batch's, in the same direction."""
    return (
        f"{type(model).__name__}'s loss of a batch is not the mean of its samples' losses: the global batch in 2 "
        f"micro-batches gives {ratio:.3g} x the whole batch's gradient, in the same direction (one float64 step on 1 "
        "device from the same weights), as a loss summed over the batch does, so N devices would train with 1/N of 1 "
        "device's gradient (DDP and the micro-batches average theirs): return the mean over the batch's samples "
        '(`reduction="mean"`; Hugging Face\'s CTC models: `ctc_loss_reduction="mean"`), or '
        "`ddpkit.global_mean(loss_sum, count, self)` for a mean over a count the batch works out (the manual: "
        "vendor/ddpkit/docs/losses.md)"
    )


def split_step(model, data, order: list[int] | None = None) -> tuple[float, float, str] | None:
    """The first global batch's gradient in 2 micro-batches as a multiple of the whole batch's (multiple_of), and the
    tensor most apart; None where the step gives no gradient."""
    whole = one_step(model, data, None, order)
    halves = one_step(model, data, data.global_batch_size // 2, order)
    names = [n for n in whole if n in halves]
    a = torch.cat([whole[n].flatten() for n in names])
    b = torch.cat([halves[n].flatten() for n in names])
    if not a.norm() > 0:
        return None
    ratio, apart = multiple_of(a, b)
    worst = max(names, key=lambda n: (halves[n] - ratio * whole[n]).norm().item())  # where most of the rest lies
    return ratio, apart, worst


def sample_size(sample) -> int:
    """The numbers a sample holds: its tensors' and arrays' elements, in any nesting of tuples, lists and dicts."""
    if isinstance(sample, dict):
        return sum(sample_size(v) for v in sample.values())
    if isinstance(sample, list | tuple):
        return sum(sample_size(v) for v in sample)
    if isinstance(sample, torch.Tensor):
        return sample.numel()
    size = getattr(sample, "size", 0)  # a NumPy array's; a PIL image's is its (width, height): not counted
    return size if isinstance(size, int) else 0


def by_size(data) -> list[int] | None:
    """The first global batch's indices, its largest samples first; None where they are all of one size, or the
    training set is not a map-style dataset sampled by a GlobalBatchSampler."""
    if not isinstance(data, GlobalBatchDataModule):
        return None
    if data.train_set is None:
        data = copy.deepcopy(data)
        data.setup("fit")
    sampler = data.train_sampler()
    if not isinstance(sampler, GlobalBatchSampler):  # a stream's: it takes no `train_order`
        return None
    first = sampler.global_order()[0].tolist()
    sizes = [sample_size(data.train_set[i]) for i in first]
    if len(set(sizes)) < 2:
        return None
    return [i for _, i in sorted(zip(sizes, first, strict=True), key=lambda pair: -pair[0])]


def padded_alike(order: list[int] | None) -> list[int] | None:
    """A global batch of `order`'s samples (largest first) whose 2 micro-batches each begin with the largest, so that
    each is padded to the length the whole batch is: the larger half of the others in the first, the smaller in the
    second (a count the loss divides by then differs between them; the smallest is left out for the largest's second
    place). Only the loss's arithmetic can tell this split from the whole batch."""
    if order is None:
        return None
    half = len(order) // 2
    return [*order[:half], order[0], *order[half:-1]]


def padding_line(model, data, order: list[int] | None) -> str:
    """ "" unless a sample's gradient changes with the length its batch is padded to: the first global batch sorted by
    size (`order`), its largest samples in one micro-batch and its smallest in the other (padded shorter), against
    the whole batch; not looked at where its samples are all of one size (None)."""
    split = split_step(model, data, order) if order is not None else None
    if split is None or split[1] <= APART:
        return ""
    _, apart, worst = split
    return (
        f"{type(model).__name__}'s loss of a sample changes with the length its batch is padded to (one float64 step "
        f"on 1 device from the same weights: the first global batch sorted by size, its longest samples in one "
        f"micro-batch and its shortest, padded shorter, in the other, gives a gradient {apart:.2g} of the whole "
        f"batch's apart in direction, most in {worst}), and a rank pads its share to its own longest sample, so N "
        "devices cannot train 1 device's weights: the model must not see the padding: give it the attention mask "
        "(Hugging Face's `attention_mask`), pack an RNN's sequences (`pack_padded_sequence`), leave the padded steps "
        "out of means, pools and norms over time (a model without a mask, as wav2vec2-base's GroupNorm feature "
        "encoder, needs samples of one length) (the manual: vendor/ddpkit/docs/your-model.md, step 1)"
    )
