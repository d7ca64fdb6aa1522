"""The scaling doctor's step is one optimizer step: micro-batches of gradient accumulation add up into it, a
manual-optimization step over two optimizers is one step, and so `python -m ddpkit.scaling --explain` compares a
1-device and a 2-device run of the same global batch with `--data.micro_batch_size` set."""

import json
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from procs import concurrently, toy_ok
from torch.utils.data import DataLoader, TensorDataset

from ddpkit import GlobalBatchDataModule
from ddpkit.scaling import sweeper as scaling
from ddpkit.scaling.doctor import ScalingDoctor
from ddpkit.scaling.gap import PARTS, global_batch
from ddpkit.scaling.record import DoctorRecord

LOAD_MS, COMPUTE_MS = 10, 20  # slept per loader batch, per training_step: lower bounds whatever the host's load


def sleepy_loader(batch_size: int = 4) -> DataLoader:
    def collate(samples):
        time.sleep(LOAD_MS / 1000)
        return torch.stack([x for (x,) in samples])

    return DataLoader(TensorDataset(torch.randn(200, 8)), batch_size=batch_size, collate_fn=collate)


class Accumulating(L.LightningModule):
    """Automatic optimization; each training_step sleeps COMPUTE_MS."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        time.sleep(COMPUTE_MS / 1000)
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class TwoOptimizers(L.LightningModule):
    """Manual optimization: two optimizers, both stepped on every second batch (global_step moves by 2)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.a, self.b = torch.nn.Linear(8, 1), torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        self.manual_backward((self.a(batch) - self.b(batch)).pow(2).mean())
        if batch_idx % 2 == 1:
            for optimizer in self.optimizers():
                optimizer.step()
                optimizer.zero_grad()

    def configure_optimizers(self):
        return torch.optim.SGD(self.a.parameters(), lr=0.01), torch.optim.SGD(self.b.parameters(), lr=0.01)


def doctor_summary(module: L.LightningModule, max_steps: int, **trainer_args) -> DoctorRecord:
    """Fit in this process on one CPU device with the doctor (1 warm-up step); its summary."""
    doctor = ScalingDoctor(warmup_steps=1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[doctor],
        **trainer_args,
    )
    trainer.fit(module, sleepy_loader())
    return doctor.summary


def test_accumulated_micro_batches_make_one_step():
    """With 3 micro-batches per optimizer step, 4 steps are 4 doctor steps (3 after warm-up) of 12 samples, and
    each step's data wait and compute hold all 3 micro-batches' sleeps."""
    s = doctor_summary(Accumulating(), max_steps=4, accumulate_grad_batches=3)
    (r,) = s.ranks
    assert s.steps == 3 and s.micro_batches_per_step == 3 and s.micro_batch_size == 4
    assert r.batch == 12 and global_batch(s) == 12
    assert r.data_ms >= 3 * LOAD_MS and r.compute_ms >= 3 * COMPUTE_MS
    assert r.step_ms >= r.data_ms + r.compute_ms


def test_a_step_over_two_optimizers_is_one_step():
    """A manual-optimization step that steps two optimizers (global_step + 2) after 2 batches is one doctor step of
    2 micro-batches: max_steps 8 is 4 steps, 3 after warm-up."""
    s = doctor_summary(TwoOptimizers(), max_steps=8)
    assert s.steps == 3 and s.micro_batches_per_step == 2 and s.ranks[0].batch == 8


# The toy on CPU, 6 optimizer steps (3 warm-up + 3 counted) of 64 samples in micro-batches of 16.
FIT = (
    *("fit", "--trainer.accelerator", "cpu", "--trainer.max_steps", "6", "--trainer.num_sanity_val_steps", "0"),
    *("--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"),
    *("--data.global_batch_size", "64", "--data.micro_batch_size", "16"),
)


@pytest.fixture(scope="module")
def micro_batched(tmp_path_factory) -> dict[int, tuple[Path, DoctorRecord, str]]:
    """The toy on 1 device (4 micro-batches per step) and 2 (2 each), at once: per device count, the run's
    folder, its doctor.json and its output."""
    base = tmp_path_factory.mktemp("micro")

    def fit(devices: int) -> tuple[Path, DoctorRecord, str]:
        root = base / f"devices_{devices}"
        root.mkdir()
        out = toy_ok(*FIT, "--trainer.devices", str(devices), "--trainer.default_root_dir", str(root), cwd=root)
        (summary,) = root.rglob("doctor.json")
        return root, DoctorRecord.from_dict(json.loads(summary.read_text())), out

    return concurrently(fit, [1, 2])


def test_micro_batched_runs_count_optimizer_steps(micro_batched):
    """Both runs count 3 steps (6 optimizer steps, 3 of warm-up) of the 64-sample global batch, and the report's
    header says how many micro-batches of what size make a step."""
    for devices, micro in ((1, 4), (2, 2)):
        _, s, out = micro_batched[devices]
        assert s.steps == 3 and global_batch(s) == 64
        assert s.micro_batches_per_step == micro and s.micro_batch_size == 16
        assert f"Scaling doctor: {devices} x cpu, 3 steps, {micro} micro-batch(es) of 16 samples per step" in out


def test_explain_compares_micro_batched_runs(micro_batched, capsys):
    """`python -m ddpkit.scaling --explain RUN_1 RUN_2` (its main, in this process: a process would add an import
    of torch to CI's time) takes the two runs of one global batch and prints the gap by part."""
    one, two = (micro_batched[n][0] for n in (1, 2))
    scaling.main(["--explain", str(one), str(two)])  # a refusal raises SystemExit("error: ...")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("2 device(s) against 1: step ")
    labels = [label for label, _ in PARTS.values()] + ["unexplained"]
    assert [line[2:33].strip() for line in lines[2 : 2 + len(labels)]] == labels  # f"  {label:<31} {ms} ms"
    assert any(line.startswith("verdict: ") for line in lines[2 + len(labels) :])


def test_explain_refuses_a_summary_of_another_schema(micro_batched, tmp_path):
    """A doctor.json of the unversioned format (a step was a loader batch) is refused with one line, not compared."""
    one, two = (micro_batched[n][1].to_dict() for n in (1, 2))
    old = {k: v for k, v in one.items() if k != "schema"}
    (tmp_path / "old.json").write_text(json.dumps(old))
    (tmp_path / "new.json").write_text(json.dumps(two))
    with pytest.raises(SystemExit, match=r"old.json has schema 1, this ddpkit reads schema 3: fit that run again"):
        scaling.main(["--explain", str(tmp_path / "old.json"), str(tmp_path / "new.json")])


class ZipCollated(GlobalBatchDataModule):
    """A detector's samples (an image, a dict of targets), collated as torchvision's detection references do: a
    tuple of images and a tuple of targets."""

    def train_dataset(self):
        return [(torch.randn(3, 8, 8), {"labels": torch.zeros(1)}) for _ in range(64)]

    def loader_kwargs(self) -> dict:
        return {**super().loader_kwargs(), "collate_fn": lambda samples: tuple(zip(*samples))}


class OnImages(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3 * 8 * 8, 1)

    def training_step(self, batch, batch_idx):
        images, _ = batch
        return self.layer(torch.stack(images).flatten(1)).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_batch_of_images_in_a_tuple_counts_its_images():
    """With a GlobalBatchDataModule the doctor counts its micro-batch (8 images), not what Lightning's rule finds in
    a tuple of images, the first image's 3 channels."""
    doctor = ScalingDoctor(warmup_steps=1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[doctor],
    )
    trainer.fit(OnImages(), datamodule=ZipCollated(global_batch_size=8))
    assert doctor.summary.micro_batch_size == 8 and doctor.summary.ranks[0].batch == 8
