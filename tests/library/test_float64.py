"""The suite's float64 runs compute in float64 where a model casts down (ddpkit.testing.float64): each spelling of a
cast of a float64 tensor to a lower type in a model's code gives float64, the values of a float64 computation, as a
new tensor, and is recorded under its module; casts of other dtypes, bit views and the suite's own casts are left as
they are; the callback acts in "64-true" runs only, and every float64 command of the suite carries it."""

import copy
import json

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ddpkit.testing import commands as suite_commands
from ddpkit.lightning_internals import grouped_mm_operator
from ddpkit.testing.float64 import Float64Throughout, KeepFloat64, KeepFloat64Dispatch, summary
from ddpkit.testing.parity_probe import sample_keys


class CastingNorm(nn.Module):
    """Hugging Face's T5LayerNorm: the variance taken in float32 whatever the input's dtype."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + 1e-6))


def exact_norm(x: Tensor, weight: Tensor) -> Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_a_float32_cast_inside_a_float64_model_computes_in_float64_and_is_recorded():
    """A T5LayerNorm-like module in float64: without the mode its output carries float32's rounding (over 1e-9 of
    float64's), under it output and gradient equal the float64 computation bit for bit, and the cast is recorded
    under the module's class (mutation: a mode that lets `.to` through fails the equality)."""
    torch.manual_seed(0)
    norm = CastingNorm(64).double()
    x = torch.randn(8, 64, dtype=torch.float64, requires_grad=True)
    exact = exact_norm(x, norm.weight)
    plain = norm(x)
    assert ((plain - exact).abs().max() / exact.abs().max()).item() > 1e-9
    with KeepFloat64() as mode:
        kept = norm(x)
        (grad,) = torch.autograd.grad(kept.pow(2).sum(), x)
    (exact_grad,) = torch.autograd.grad(exact.pow(2).sum(), x)
    assert kept.dtype == torch.float64 and torch.equal(kept, exact) and torch.equal(grad, exact_grad)
    assert mode.casts == {"CastingNorm": {"float32": 1}}  # the forward's (its backward is float64 by itself)
    (line,) = summary(mode.casts)
    assert line == (
        "CastingNorm casts float64 to float32 inside the float64 runs: the suite keeps it in float64 (Float64Throughout)"
    )


SPELLINGS = {
    "to(dtype)": lambda x, f32: x.to(torch.float32),
    "to(dtype=)": lambda x, f32: x.to(dtype=torch.float16),
    "to(device, dtype)": lambda x, f32: x.to("cpu", torch.bfloat16),
    "to(tensor)": lambda x, f32: x.to(f32),
    "float()": lambda x, f32: x.float(),
    "half()": lambda x, f32: x.half(),
    "bfloat16()": lambda x, f32: x.bfloat16(),
    "type(dtype)": lambda x, f32: x.type(torch.float32),
    "type_as": lambda x, f32: x.type_as(f32),
    "softmax(dtype=)": lambda x, f32: F.softmax(x, dim=-1, dtype=torch.float32),
    "sum(dtype=)": lambda x, f32: x.sum(-1, dtype=torch.float32),
}
EXACT = {"softmax(dtype=)": lambda x: F.softmax(x, dim=-1), "sum(dtype=)": lambda x: x.sum(-1)}


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_each_spelling_of_a_cast_down_keeps_float64_in_a_new_tensor(spelling):
    """Each way a model casts a float64 tensor down gives float64, the float64 computation's values, and a new tensor:
    writing into it leaves the input as it was (mutation: returning the input itself for `.float()` aliases it)."""
    x = torch.randn(4, 8, dtype=torch.float64) / 3
    before = x.clone()
    with KeepFloat64() as mode:
        out = SPELLINGS[spelling](x, torch.zeros(1))
    assert out.dtype == torch.float64 and torch.equal(out, EXACT.get(spelling, lambda t: t)(before))
    out.zero_()
    assert torch.equal(x, before) and len(mode.casts) == 1


def test_other_casts_bit_views_and_the_suites_own_casts_are_left_as_they_are():
    """float32 to float16, float64 to int64 and float64 to float64 are not casts down from float64; `view(float32)`
    reinterprets bits; the probe's hash of a sample as float32 (ddpkit's own code) stays float32's. None is recorded."""
    x = torch.randn(4, 8, dtype=torch.float64)
    outside = sample_keys(x)
    with KeepFloat64() as mode:
        assert x.float().to(torch.float32).half().dtype == torch.float64  # the model's: kept
        mode.casts.clear()
        assert torch.ones(2).to(torch.float16).dtype == torch.float16
        assert x.to(torch.int64).dtype == torch.int64 and x.to(torch.float64) is x
        assert x.view(torch.float32).shape == (4, 16)
        assert sample_keys(x) == outside
    assert mode.casts == {}


class Tiny(L.LightningModule):
    """A CastingNorm and a linear layer, regressing random targets: one step is enough to see the callback act."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.out = CastingNorm(8), nn.Linear(8, 1)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self.out(self.norm(x)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(8, 8), torch.randn(8, 1))
        return torch.utils.data.DataLoader(data, batch_size=4)


@pytest.mark.parametrize("precision", ["64-true", "32-true"])
def test_the_callback_acts_in_float64_runs_only_and_writes_where_it_kept_float64(tmp_path, precision):
    """A 2-step fit with Float64Throughout: in "64-true" rank 0 writes probe/float64-casts.json naming the module (2
    forwards); in "32-true" there is nothing to keep and no file. Afterwards no mode is left active
    (mutation: a teardown that does not exit the mode leaves it on the stack)."""
    trainer = L.Trainer(
        accelerator="cpu", devices=1, precision=precision, max_epochs=1, default_root_dir=tmp_path, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[Float64Throughout()],
    )  # fmt: skip
    trainer.fit(Tiny())
    written = tmp_path / "probe" / "float64-casts.json"
    if precision == "64-true":
        assert json.loads(written.read_text()) == {"CastingNorm": {"float32": 2}}
    else:
        assert not written.exists()
    assert torch.randn(2, dtype=torch.float64).float().dtype == torch.float32


class Raises(Tiny):
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        super().training_step(batch, batch_idx)
        raise ValueError("the user's step failed")


def test_a_fit_that_raises_leaves_no_mode_active(tmp_path):
    """Lightning calls no teardown hook after an exception; the suite's probes fit in the pytest process, so the
    callback leaves on the exception too: afterwards a cast of float64 gives float32 again (mutation: without
    `on_exception` the mode stays on the stack)."""
    trainer = L.Trainer(
        accelerator="cpu", devices=1, precision="64-true", max_epochs=1, default_root_dir=tmp_path, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[Float64Throughout()],
    )  # fmt: skip
    with pytest.raises(ValueError, match="the user's step failed"):
        trainer.fit(Raises())
    assert torch.randn(2, dtype=torch.float64).float().dtype == torch.float32


def test_every_float64_command_of_the_suite_carries_the_callback():
    """fit, the one-step runs, validate/test/predict and the cluster launchers' runs all add Float64Throughout: a run
    without it would round where its reference does not (mutation: dropping it from cluster_args fails here)."""
    steps = {"steps_per_epoch": 4, "steps_per_batch": 1, "step_batches": 2, "epoch_steps": 4}
    commands = {
        "fit": suite_commands.fit(steps, "cpu", 2, "64-true"),
        "one_step": suite_commands.one_step(steps, 1, "64-true", suite_commands.Path("states")),
        "evaluate": suite_commands.evaluate(steps, "test", 1, "last"),
        "cluster": suite_commands.cluster_args(steps),
    }
    for name, cmd in commands.items():
        assert suite_commands.FLOAT64_THROUGHOUT in cmd, name


class Experts(nn.Module):
    """A mixture of experts' expert layer as transformers 5 writes it (`grouped_mm` experts): the tokens sorted by
    expert, one grouped matrix product over every expert's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 8, 4, dtype=torch.float64))

    def forward(self, x: Tensor, ends: Tensor) -> Tensor:
        return torch._grouped_mm(x, self.weight, offs=ends)


def test_a_grouped_product_with_no_float64_kernel_computes_in_float64_and_is_recorded():
    """torch._grouped_mm has no float64 kernel (it raises on float64, which stopped a Hugging Face Mixtral's first
    float64 run); under the modes it gives each token's product with its expert's weight in float64, and the
    gradients (torch's derivative calls the product again, in two other layouts), within float64's rounding, what
    torch's float32 kernel gives within float32's, rows past the last group 0; recorded under the module. Expert 1
    gets no token. Mutations: the kernel not intercepted (the float64 error), a group's rows shifted by one."""
    if not hasattr(torch, "_grouped_mm"):  # torch 2.4: no grouped product for a model to call, nothing to keep
        assert grouped_mm_operator() is None
        return
    torch.manual_seed(0)
    experts, x, ends = Experts(), torch.randn(10, 8, dtype=torch.float64, requires_grad=True), torch.tensor([3, 3, 9])
    with pytest.raises(RuntimeError, match="got Double"):
        experts(x, ends.int())
    with KeepFloat64() as mode, KeepFloat64Dispatch(mode):
        out = experts(x, ends.int())
        recorded = copy.deepcopy(mode.casts)  # the forward's
        got = torch.autograd.grad(out[:9].pow(2).sum(), (x, experts.weight))  # torch's derivative: 2 more products
    group = [0, 0, 0, 2, 2, 2, 2, 2, 2]
    each = torch.stack([x[t] @ experts.weight[g] for t, g in enumerate(group)])
    assert out.dtype == torch.float64 and (out[:9] - each).abs().max() <= 1e-12 * each.abs().max()
    assert torch.equal(out[9], torch.zeros(4, dtype=torch.float64))
    float32 = torch._grouped_mm(x.detach().float(), experts.weight.detach().float(), offs=ends.int())
    assert (out[:9] - float32[:9]).abs().max() <= 1e-5 * each.abs().max()
    want = torch.autograd.grad(each.pow(2).sum(), (x, experts.weight))
    assert all((g - w).abs().max() <= 1e-12 * w.abs().max() for g, w in zip(got, want, strict=True))
    assert recorded == {"Experts": {"_grouped_mm": 1}}
    assert summary(recorded) == [
        "Experts calls torch._grouped_mm, which has no float64 kernel: the suite's float64 runs compute it in float64, "
        "one matrix product per group (Float64Throughout)"
    ]


class Checkpointed(nn.Module):
    """A CastingNorm and, where torch has one, the grouped product, run under activation checkpointing (Hugging
    Face's `gradient_checkpointing`): torch recomputes the forward during the backward pass."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.norm, self.experts, self.reentrant = CastingNorm(8), Experts(), reentrant

    def block(self, x: Tensor) -> Tensor:
        x = self.norm(x)
        if hasattr(torch, "_grouped_mm"):
            x = self.experts(x, torch.tensor([3, 3, 10], dtype=torch.int32))
        return x.tanh()

    def forward(self, x: Tensor, checkpointed: bool) -> Tensor:
        if not checkpointed:
            return self.block(x)
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_forward_recomputed_by_activation_checkpointing_casts_and_multiplies_as_the_forward_did(reentrant):
    """Under activation checkpointing torch recomputes the forward in the backward pass, where no function mode is
    active: the recomputation keeps float64 where the forward did (KeepFloat64Dispatch), so checkpoint finds the
    tensors it saved and the gradients equal those of the same float64 step without checkpointing, bit for bit.
    Mutations: KeepFloat64Dispatch without its casts (CheckpointError: different metadata), the grouped product
    kept at the function level only (CheckpointError: a different number of tensors saved)."""
    torch.manual_seed(0)
    model, x = Checkpointed(reentrant).double(), torch.randn(10, 8, dtype=torch.float64, requires_grad=True)
    grads = []
    for checkpointed in (False, True):
        model.zero_grad(), setattr(x, "grad", None)
        with KeepFloat64() as mode, KeepFloat64Dispatch(mode):
            model(x, checkpointed).pow(2).sum().backward()  # reentrant checkpointing takes no autograd.grad
        grads.append([x.grad.clone(), *(p.grad.clone() for p in model.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    assert mode.casts["CastingNorm"] == {"float32": 2}  # the forward's and the recomputation's
