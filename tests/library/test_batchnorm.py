"""BatchNorm synchronized over gloo (ddpkit.model.batchnorm): 2 CPU processes, each holding part of a batch, compute
what 1 process holding the whole batch computes with plain nn.BatchNorm, in training, in eval and through the CLI."""

import copy
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import early
import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset, TensorDataset

from ddpkit import GlobalBatchDataModule
from ddpkit.model.batchnorm import GlobalBatchNorm, SyncBatchNormAnyDevice, unsynced_batchnorm_warning
from ddpkit.parity import diff, load_weights, max_abs
from ddpkit.testing.helpers import ForkServer, concurrently, finish, run_main, start

HERE = Path(__file__).resolve().parent
# float64: the worst max_rel measured over these cases x 3 seeds x 3 steps is 8.8e-15, and 6.2e-15 max_abs for the
# CLI fit at 2 seeds; without synchronization > 5e-2 and 0.5 (docs/measurements.md, "BatchNorm synchronized on CPU").
BOUND = 1e-12

# name: (shape of the global batch, rank 0's share of dim 0, BatchNorm arguments, dtype)
CASES = {
    "2d": ((16, 3, 5, 4), 8, {}, torch.float64),
    "2d unequal shares": ((16, 3, 5, 4), 5, {}, torch.float64),
    "2d momentum None": ((16, 3, 5, 4), 6, {"momentum": None}, torch.float64),
    "2d no affine": ((16, 3, 5, 4), 9, {"affine": False}, torch.float64),
    "2d no running stats": ((16, 3, 5, 4), 7, {"track_running_stats": False}, torch.float64),
    "1d (N, C)": ((12, 6), 7, {}, torch.float64),
    "1d (N, C, L)": ((10, 4, 9), 3, {}, torch.float64),
    "3d": ((6, 2, 3, 4, 5), 2, {}, torch.float64),
    "2d float32, mean 1000": ((32, 4, 6, 6), 13, {}, torch.float32),
}
# float32 inputs at mean 1000, std 2: worst max_rel 9.7e-5 (plain float32 BatchNorm's own output: 6.9e-6); statistics
# from sum(x^2) - sum(x)^2/n would be 3.2e-2 off (docs/measurements.md).
F32_BOUND = 1e-3
SEEDS, STEPS = (0, 1, 2), 3
PLAIN = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}


# --- one case on the ranks (run by `ranks_compare`, in 2 processes) -------------------------------------------


def compare_case(shape: tuple, share: int, kwargs: dict, dtype: torch.dtype, seed: int, synced: bool) -> dict:
    """max_rel per quantity between this rank (its share of each batch) and plain BatchNorm on the whole batch."""
    torch.manual_seed(seed)  # the same batches and initial weights on every rank
    rank = dist.get_rank()
    part = slice(0, share) if rank == 0 else slice(share, shape[0])
    whole = PLAIN[len(shape)](shape[1], **kwargs).double()
    if whole.affine:
        with torch.no_grad():
            whole.weight.uniform_(0.5, 1.5), whole.bias.uniform_(-1, 1)
    # The mutation: a plain per-rank BatchNorm, i.e. DDP without synchronized statistics.
    mine = copy.deepcopy(whole).to(dtype)
    mine = GlobalBatchNorm(mine) if synced else mine
    worst: dict[str, float] = {}
    center = 3 if dtype == torch.float64 else 1000  # float32: where sum(x^2) - sum(x)^2/n would cancel

    def note(name: str, reference: Tensor, value: Tensor) -> None:
        worst[name] = max(worst.get(name, 0.0), diff(name, reference, value).max_rel)

    for step in range(STEPS):
        # Not centered, moving: running stats matter. Rounded to `dtype` on both sides: the same values.
        x = (torch.randn(shape, dtype=torch.float64) * 2 + center + step).to(dtype)
        cotangent = torch.randn(shape, dtype=dtype)  # loss = sum(y * cotangent): any dL/dy
        x_whole, x_mine = x.double().clone().requires_grad_(), x[part].clone().requires_grad_()
        y_whole, y_mine = whole(x_whole), mine(x_mine)
        (y_whole * cotangent.double()).sum().backward()
        (y_mine * cotangent[part]).sum().backward()
        note("output", y_whole[part], y_mine)
        note("input grad", x_whole.grad[part], x_mine.grad)
        for p_whole, p_mine, name in ((whole.weight, mine.weight, "weight grad"), (whole.bias, mine.bias, "bias grad")):
            if p_whole is not None:
                dist.all_reduce(p_mine.grad)  # the global batch's gradient (DDP averages; the sum is exact)
                note(name, p_whole.grad, p_mine.grad)
                with torch.no_grad():  # a training step, so later steps see other weights
                    p_whole -= 0.1 * p_whole.grad
                    p_mine -= 0.1 * p_mine.grad
                p_whole.grad = p_mine.grad = None
        if whole.track_running_stats:
            note("running_mean", whole.running_mean, mine.running_mean)
            note("running_var", whole.running_var, mine.running_var)
    whole.eval(), mine.eval()
    x = (torch.randn(shape, dtype=torch.float64)[part] * 2 + center).to(dtype)
    note("eval output", whole(x.double()), mine(x))  # by running stats, or this share's own without them
    return worst


def ranks_compare(rank: int, port: int, out: str) -> None:
    """Every case and seed on this rank of 2; rank 0 writes {variant: {case: {quantity: worst max_rel}}} to `out`."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results: dict = {}
    for variant in ("synced", "per rank"):
        for name, (shape, share, kwargs, dtype) in CASES.items():
            runs = [compare_case(shape, share, kwargs, dtype, seed, variant == "synced") for seed in SEEDS]
            worst = {q: max(r[q] for r in runs) for q in runs[0]}
            values = torch.tensor(list(worst.values()), dtype=torch.float64)
            dist.all_reduce(values, op=dist.ReduceOp.MAX)  # the worse of the two ranks' shares
            results.setdefault(variant, {})[name] = dict(zip(worst, values.tolist(), strict=True))
    if rank == 0:
        Path(out).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    """The worst differences of every case, from one launch of 2 gloo processes."""
    out, port = tmp_path_factory.mktemp("bn") / "worst.json", free_port()
    code = f"from test_batchnorm import ranks_compare; ranks_compare({{}}, {port}, {str(out)!r})"
    procs = [start([sys.executable, "-c", code.format(rank)], HERE, {"PYTHONPATH": str(HERE)}) for rank in (0, 1)]
    results = [finish(p, timeout=300) for p in procs]  # 95 s measured at load average 12 on 2 cores
    assert all(r.returncode == 0 for r in results), "\n".join(r.stdout[-3000:] for r in results)
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_equal_one_process_holding_the_whole_batch(measured, case):
    """Output, input and parameter gradients, running stats and eval output match plain BatchNorm on the whole batch."""
    worst = measured["synced"][case]
    expected = {"output", "input grad", "eval output"}
    expected |= set() if "no affine" in case else {"weight grad", "bias grad"}
    expected |= set() if "no running stats" in case else {"running_mean", "running_var"}
    assert worst.keys() == expected
    assert max(worst.values()) <= (BOUND if CASES[case][3] == torch.float64 else F32_BOUND), worst


@pytest.mark.parametrize("case", CASES)
def test_per_rank_batchnorm_is_far_outside_the_bound(measured, case):
    """Without the all-reduce (a plain BatchNorm on each rank) the output differs by far more than the bound."""
    assert measured["per rank"][case]["output"] > 1e6 * BOUND, measured["per rank"][case]


def test_eval_uses_the_running_stats(measured):
    """In eval mode each rank normalizes by the synchronized running stats, as plain BatchNorm on one process."""
    assert measured["synced"]["2d unequal shares"]["eval output"] <= BOUND
    # Per-rank running stats drift apart from the whole batch's: eval outputs then differ visibly.
    assert measured["per rank"]["2d unequal shares"]["eval output"] > 1e6 * BOUND


# --- one process, no launch ------------------------------------------------------------------------------------


def model_with_batchnorm() -> nn.Sequential:
    """Conv + BatchNorm2d + Linear + BatchNorm1d, with running stats moved away from their initial values."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.Flatten(), nn.Linear(12, 5), nn.BatchNorm1d(5))
    model(torch.randn(8, 1, 4, 4))
    return model


@pytest.mark.parametrize("group", ["no process group", "1-process group"])
def test_one_process_is_exactly_plain_batchnorm(tmp_path, group):
    """With one process the layer is nn.BatchNorm bit for bit: output, gradients, running stats."""
    if group == "1-process group":
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        plain = model_with_batchnorm()
        synced = SyncBatchNormAnyDevice().apply(copy.deepcopy(plain))
        assert isinstance(synced[1], GlobalBatchNorm) and isinstance(synced[4], GlobalBatchNorm)
        x = torch.randn(6, 1, 4, 4)
        outputs = [m(x) for m in (plain, synced)]
        for out in outputs:
            out.square().sum().backward()
        assert torch.equal(outputs[0], outputs[1])
        for (name, a), b in zip(plain.state_dict().items(), synced.state_dict().values(), strict=True):
            assert torch.equal(a, b), name
        for (name, a), b in zip(plain.named_parameters(), synced.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad), name
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_apply_and_revert_keep_names_values_and_classes():
    """apply keeps every state_dict key and value; revert gives back the model's own BatchNorm layers, converted."""
    model = model_with_batchnorm()
    layers, before = (model[1], model[4]), copy.deepcopy(model.state_dict())
    plugin = SyncBatchNormAnyDevice()
    synced = plugin.apply(model)
    assert [type(m) for m in synced.modules()].count(GlobalBatchNorm) == 2
    after = synced.state_dict()
    assert list(after) == list(before) and all(torch.equal(before[k], after[k]) for k in before)
    synced.double()  # as Lightning's precision plugin does after apply: new buffers, new parameter data
    synced[1].running_mean += 1  # a change made while synced must survive the revert
    converted = copy.deepcopy(synced.state_dict())
    reverted = plugin.revert(synced)
    assert (reverted[1], reverted[4]) == layers  # the very same objects
    assert type(reverted[1]) is nn.BatchNorm2d and type(reverted[4]) is nn.BatchNorm1d
    final = reverted.state_dict()
    assert list(final) == list(converted) and all(torch.equal(converted[k], final[k]) for k in final)
    assert final["1.running_mean"].dtype == torch.float64
    fresh = plugin.apply(model_with_batchnorm()).double()
    fresh.load_state_dict(final)  # strict: a plain checkpoint loads into the synced model, and back
    reverted.load_state_dict(fresh.state_dict())


def test_nccl_uses_torchs_sync_batchnorm(monkeypatch):
    """On an NCCL process group the plugin converts to torch's SyncBatchNorm (CUDA kernels), as Lightning's does."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    plugin = SyncBatchNormAnyDevice()
    synced = plugin.apply(model_with_batchnorm())
    assert type(synced[1]) is nn.SyncBatchNorm and type(synced[4]) is nn.SyncBatchNorm
    reverted = plugin.revert(synced)
    assert not any(isinstance(m, nn.SyncBatchNorm) for m in reverted.modules())


# --- through the CLI: a BatchNorm CNN fitted on 1 and on 2 processes -------------------------------------------


def images(n: int, seed: int) -> TensorDataset:
    """`n` 8x8 one-channel images of 4 classes (a class's fixed pattern plus noise), float32, labels int64."""
    generator = torch.Generator().manual_seed(seed)
    patterns = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(1234))
    labels = torch.randint(0, 4, (n,), generator=generator)
    return TensorDataset(patterns[labels] + 0.5 * torch.randn(n, 1, 8, 8, generator=generator) + 1, labels)


class Images(GlobalBatchDataModule):
    """256 training images (8 global batches of 32), 37 validation images (shards of unequal size)."""

    def train_dataset(self) -> Dataset:
        return images(256, seed=0)

    def val_dataset(self) -> Dataset:
        return images(37, seed=1)


class BatchNormCNN(L.LightningModule):
    """Two conv blocks with BatchNorm2d and a hidden layer with BatchNorm1d; SGD with momentum.

    Args:
        lr: SGD learning rate.
    """

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),  # (B, 8, 8, 8)
            nn.Conv2d(8, 8, 3, padding=1, stride=2), nn.BatchNorm2d(8), nn.ReLU(),  # (B, 8, 4, 4)
            nn.Flatten(), nn.Linear(128, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4),
        )  # fmt: skip

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val/loss", F.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


CONFIG = """
seed_everything: 0
model: {class_path: test_batchnorm.BatchNormCNN}
data: {class_path: test_batchnorm.Images, init_args: {global_batch_size: 32}}
doctor: {enabled: false}
trainer:
  accelerator: cpu
  strategy: ddp
  precision: 64-true
  max_epochs: 2
  logger: false
  enable_progress_bar: false
  enable_model_summary: false
"""
MAIN = """from pathlib import Path
from ddpkit.run.cli import main as run_cli


def main(args=None, run=True):
    return run_cli(Path(__file__).with_name("config.yaml"), args, run)


if __name__ == "__main__":
    main()
"""


@early.early("batchnorm_cli_runs")
def _cli_runs(base: Path) -> tuple[Path, dict]:
    """The four CLI runs of the test below, at once: their folder and {run: result}. Started with the session
    (early.py): they time nothing. Forked from one process that imported main.py, every rank too (as torchrun starts
    ranks: what is checked is the synchronisation, not the launcher), so that 7 processes skip ~5 CPU-s of imports."""
    (base / "config.yaml").write_text(CONFIG)
    (base / "main.py").write_text(MAIN)
    runs = {
        "1": ["--trainer.devices", "1"],
        "2": ["--trainer.devices", "2", "--trainer.sync_batchnorm", "true"],
        "plugin": ["--trainer.devices", "2", "--trainer.plugins", "ddpkit.model.batchnorm.SyncBatchNormAnyDevice"],
        "unsynced": ["--trainer.devices", "2", "--trainer.max_steps", "1"],
    }
    server = ForkServer(root=base, env={**os.environ, "PYTHONPATH": str(HERE)})

    def fit(name: str) -> subprocess.CompletedProcess:
        args = [*runs[name], "--trainer.default_root_dir", str(base / name)]
        return run_main("fit", *args, cwd=base, timeout=300, ranks=int(runs[name][1]), server=server)

    try:
        return base, concurrently(fit, runs)
    finally:
        server.close()


@pytest.fixture(scope="module")
def batchnorm_cli_runs() -> tuple[Path, dict]:
    return early.result("batchnorm_cli_runs")


def test_cli_fit_on_two_processes_equals_one(batchnorm_cli_runs):
    """`fit --trainer.sync_batchnorm true` on 2 CPU processes (the plugin given by name does the same) trains a
    BatchNorm CNN's weights and running stats as 1 process; without the switch, rank 0 warns once, naming it,
    before training starts, and a synced run does not warn."""
    root, results = batchnorm_cli_runs
    for name, result in results.items():
        assert result.returncode == 0, f"{name}:\n{result.stdout[-4000:]}"
    warned = {
        name: [line for line in r.stdout.splitlines() if "BatchNorm layers" in line] for name, r in results.items()
    }
    assert len(warned["unsynced"]) == 1 and "--trainer.sync_batchnorm true" in warned["unsynced"][0]
    assert warned["1"] == warned["2"] == warned["plugin"] == []
    weights = {name: load_weights(next((root / name / "checkpoints").glob("*.ckpt"))) for name in ("1", "2", "plugin")}
    one = weights["1"]
    assert {k for k in one if "running_var" in k} == {"net.1.running_var", "net.4.running_var", "net.8.running_var"}
    assert one["net.1.num_batches_tracked"].item() == weights["2"]["net.1.num_batches_tracked"].item() == 16
    assert max_abs(one, weights["2"]) <= BOUND
    assert max_abs(weights["2"], weights["plugin"]) == 0.0


def test_warning_names_the_switch_only_when_batchnorm_runs_unsynced_on_several_processes():
    """A BatchNorm model on 2 processes without sync gets one line naming the switch; otherwise nothing."""
    model = model_with_batchnorm()
    line = unsynced_batchnorm_warning(model, world_size=2, synced=False)
    assert line is not None and "\n" not in line
    assert "2 BatchNorm layers (1, ...)" in line and "--trainer.sync_batchnorm true" in line
    assert unsynced_batchnorm_warning(model, world_size=2, synced=True) is None
    assert unsynced_batchnorm_warning(model, world_size=1, synced=False) is None
    assert unsynced_batchnorm_warning(nn.Sequential(nn.Linear(2, 2)), world_size=2, synced=False) is None
