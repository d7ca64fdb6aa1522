"""The GPU defaults and their switches, checked on CPU with torch.cuda faked (nothing runs on a GPU here): TF32
matmuls for float32 and mixed-precision runs on GPUs (`--float32_matmul_precision`), pinned memory on GPUs
(`--data.pin_memory`), Lightning's non-blocking copy to the device, and persistent loader workers
(`--data.persistent_workers`), but not in the streaming training loader, which starts its workers every epoch."""

import pytest
import torch
from lightning.pytorch import LightningModule
from streams import write_shards

from ddpkit.data import streaming
from ddpkit.data.streaming import StreamingDataModule, shard_files
from ddpkit.testing.toy import main


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch.cuda reports 1 GPU; torch's float32 matmul precision is put back after the test."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


def built(*args: str):
    """The toy CLI's model, data module and trainer (nothing run), the data module attached as fit attaches it."""
    cli = main(["--trainer.devices", "1", "--trainer.logger", "false", *args], run=False)
    cli.datamodule.trainer = cli.trainer
    return cli


@pytest.mark.parametrize(
    ("accelerator", "precision", "flag", "expected"),
    [
        ("gpu", "32-true", [], "high"),
        ("gpu", "bf16-mixed", [], "high"),
        ("gpu", "64-true", [], "highest"),
        ("cpu", "32-true", [], "highest"),
        ("gpu", "32-true", ["--float32_matmul_precision", "highest"], "highest"),
        ("cpu", "64-true", ["--float32_matmul_precision", "medium"], "medium"),
    ],
)
def test_float32_matmul_precision(fake_gpu, accelerator, precision, flag, expected):
    """auto gives TF32 ("high") to float32 and mixed-precision runs on a GPU, leaves float64 and CPU runs at torch's
    "highest"; a value given is set as given."""
    torch.set_float32_matmul_precision("highest")
    built("--trainer.accelerator", accelerator, "--trainer.precision", precision, *flag)
    assert torch.get_float32_matmul_precision() == expected


def test_unknown_matmul_precision_is_refused(fake_gpu, capsys):
    """A value torch does not know is one error line and status 2, before anything is built."""
    with pytest.raises(SystemExit) as stop:
        built("--float32_matmul_precision", "tf32")
    assert stop.value.code == 2 and "invalid choice: 'tf32'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("accelerator", "flags", "pinned", "persistent"),
    [
        ("gpu", [], True, True),
        ("cpu", [], False, True),
        ("gpu", ["--data.pin_memory", "false", "--data.persistent_workers", "false"], False, False),
        ("cpu", ["--data.pin_memory", "true"], True, True),
    ],
)
def test_loaders_pin_memory_on_gpus_and_keep_their_workers(fake_gpu, accelerator, flags, pinned, persistent):
    """With workers, the training and validation loaders pin memory when the run's device is a GPU and keep their
    workers between epochs; each switch turns its default off (or pinning on, on a CPU)."""
    data = built("--trainer.accelerator", accelerator, "--data.num_workers", "2", *flags).datamodule
    data.setup("fit")
    for loader in (data.train_dataloader(), data.val_dataloader()):
        assert (loader.pin_memory, loader.persistent_workers) == (pinned, persistent)


def test_no_persistent_workers_without_workers(fake_gpu):
    """Without workers there is nothing to keep (torch refuses persistent_workers with num_workers 0)."""
    data = built("--trainer.accelerator", "gpu").datamodule
    data.setup("fit")
    assert (data.train_dataloader().persistent_workers, data.train_dataloader().pin_memory) == (False, True)


def test_lightning_copies_batches_to_a_gpu_without_blocking():
    """Lightning's batch transfer asks for `non_blocking=True` on a CUDA device (asynchronous from pinned memory),
    for every tensor of a nested batch."""
    calls = []

    class Recorded(torch.Tensor):
        def to(self, *args, **kwargs):
            calls.append((args, kwargs))
            return self

    batch = {"x": torch.zeros(2).as_subclass(Recorded), "y": [torch.ones(2).as_subclass(Recorded)]}
    LightningModule().transfer_batch_to_device(batch, torch.device("cuda", 0), 0)
    assert calls == [((torch.device("cuda", 0),), {"non_blocking": True})] * 2


class Shards(StreamingDataModule):
    def __init__(self, folder: str, **kwargs) -> None:
        super().__init__(global_batch_size=32, **kwargs)
        self.folder = folder

    def train_shards(self):
        return shard_files(self.folder, "*.pt")


def test_streaming_training_loader_pins_its_batches_and_starts_workers_every_epoch(fake_gpu, tmp_path, monkeypatch):
    """On a GPU the streaming module's training loader pins every tensor of the batches it puts together (in the
    training process); each epoch it reads through a new torch loader whose workers are not kept, whatever
    persistent_workers says (they read that epoch's order); its switch turns pinning off."""
    write_shards(tmp_path)
    pinned, loaders = [], []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: pinned.append(tuple(t.shape)) or t)  # no CUDA here

    class Recorded(streaming.DataLoader):
        def __init__(self, *args, **kwargs):
            loaders.append(kwargs.get("persistent_workers", False))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(streaming, "DataLoader", Recorded)
    data = Shards(str(tmp_path), num_workers=1, persistent_workers=True)
    data.trainer = built("--trainer.accelerator", "gpu").trainer
    data.setup("fit")
    loader = data.train_dataloader()
    first = [next(iter(loader)) for _ in range(2)][0]  # two epochs' iterators
    assert pinned[:3] == [(32, 4), (32, 1), (32,)] and len(pinned) == 6 and first["x"].shape == (32, 4)
    assert loaders == [False, False]
    off = Shards(str(tmp_path), pin_memory=False)
    off.trainer = data.trainer
    off.setup("fit")
    pinned.clear()
    next(iter(off.train_dataloader()))
    assert pinned == []
