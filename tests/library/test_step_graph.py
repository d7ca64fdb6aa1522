"""No training step keeps the previous step's autograd graph alive, and DDP is built on the stream the steps run on.

Every GPU fit on torch 2.11 warned that "The AccumulateGrad node's stream does not match the stream of the node that
produced the incoming gradient ... caused by an AccumulateGrad node created prior to the current iteration being kept
alive". The cause was Lightning's `DDPStrategy._setup_model`, which builds DDP (and so the AccumulateGrad nodes that
its reducer keeps) on a new side stream (`lightning_internals.CurrentStreamDDPStrategy`). The other way to get it,
a graph kept from one step into the next by a callback, is what the probe runs check, with every callback that
config.yaml and the CLI add (graph_probe.py).
"""

import contextlib
import json
import re
import sys
from pathlib import Path

import lightning
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from procs import TESTS, run, toy

from ddpkit import lightning_internals
from ddpkit.run.strategy import TimedDDPStrategy

# What `python main.py fit` runs with: config.yaml's checkpoint callback, the doctor, the CLI's own (toy.yaml has
# config.yaml's shape), and Lightning's progress bar and model summary (Rich's or TQDM's, whichever is installed).
DEFAULT_CALLBACKS = {
    "CurrentModelCheckpoint",
    "GracefulStop",
    "HangDump",
    "LearningRateMonitor",
    "RecordVersion",
    "ResumeLoaderPosition",
    "RunConfigSaver",
    "SaveTrackerRuns",
    "ScalingDoctor",
    "UnevenListSync",
}
LIGHTNINGS = ("ProgressBar", "ModelSummary")
# 256 samples: 4 steps an epoch, 2 epochs, so a batch starts after an epoch's end (validation, checkpoint); every
# step logged.
FIT = ["fit", "--data.train_size", "256", "--trainer.max_epochs", "2", "--trainer.log_every_n_steps", "1"]
ACCUMULATE_GRAD_WARNING = "AccumulateGrad node's stream does not match"


@pytest.fixture(scope="module")
def probed(tmp_path_factory) -> dict:
    """Two CPU fits of the toy with the probe, in one interpreter (one_interpreter.py): with every default callback
    ("defaults"), and with a callback that keeps the loss as well ("keep"). {name: (exit status, output, record)}."""
    base = tmp_path_factory.mktemp("graph")
    cases = {}
    for name, extra in (("defaults", []), ("keep", ["--trainer.callbacks+=graph_probe.KeepLoss"])):
        (base / name).mkdir()
        args = [*FIT, "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.default_root_dir", "."]
        cases[name] = {
            "args": [*args, "--trainer.callbacks+=graph_probe.GraphProbe", *extra],
            "cwd": str(base / name),
            "gpus": None,
            "env": {"GRAPH_PROBE_OUT": str(base / f"{name}.json")},
            "out": str(base / f"{name}.log"),
        }
    (base / "cases.json").write_text(json.dumps(list(cases.values())))
    interpreter = run([sys.executable, str(TESTS / "one_interpreter.py"), str(base / "cases.json")], base, 240)
    outcomes = {}
    for name in cases:
        out = (base / f"{name}.log").read_text() if (base / f"{name}.log").exists() else interpreter.stdout
        ended = re.search(r"\nexit status (-?\d+)\n$", out)
        record = base / f"{name}.json"
        outcomes[name] = (
            int(ended[1]) if ended else None,
            out,
            json.loads(record.read_text()) if record.exists() else {},
        )
    return outcomes


def test_no_graph_survives_into_the_next_step_with_every_default_callback(probed):
    """With every callback config.yaml and the CLI add, not one node of a step's autograd graph is alive when the
    next batch starts (across an epoch's end too) or when training ends."""
    code, out, record = probed["defaults"]
    assert code == 0, out[-3000:]
    assert DEFAULT_CALLBACKS <= set(record["callbacks"]), record["callbacks"]
    assert all(any(c.endswith(kind) for c in record["callbacks"]) for kind in LIGHTNINGS), record["callbacks"]
    records = record["records"]
    assert len(records) == 8 and records[3]["when"] == "epoch 1 batch 0 start", records  # 7 next batches + the end
    assert all(r["nodes"] >= 5 for r in records), records  # the toy's graph: loss, 3 linear layers, 2 ReLUs, ...
    assert [r["alive"] for r in records] == [0] * 8, records


def test_a_callback_that_keeps_the_loss_is_caught(probed):
    """The probe sees a kept graph: with a callback that holds each step's loss until the next, the loss's whole
    graph is alive at every next batch's start."""
    code, out, record = probed["keep"]
    assert code == 0, out[-3000:]
    records = record["records"]
    assert len(records) == 8 and all(r["alive"] == r["nodes"] >= 5 for r in records), records


@contextlib.contextmanager
def recorded_streams(monkeypatch):
    """torch.cuda's streams and DistributedDataParallel replaced by recorders (there is no GPU here): yields the
    list of what happened, ("ddp", device_ids, the stream current then: None, "default" or "side")."""
    events: list = []
    current: list = [None]

    class SideStream:  # what `torch.cuda.Stream()` makes: a new stream
        name = "side"

    class DefaultStream:
        name = "default"

    @contextlib.contextmanager
    def stream(s):
        current.append(s.name)
        try:
            yield
        finally:
            current.pop()

    def ddp(module, device_ids=None, **kwargs):
        events.append(("ddp", device_ids, current[-1]))
        return module

    monkeypatch.setattr(torch.cuda, "Stream", SideStream)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "default_stream", lambda *a, **k: DefaultStream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: DefaultStream())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr("lightning.pytorch.strategies.ddp.DistributedDataParallel", ddp)
    monkeypatch.setattr(lightning_internals, "DistributedDataParallel", ddp)
    yield events


def on_gpu(strategy: DDPStrategy) -> DDPStrategy:
    strategy.parallel_devices = [torch.device("cuda", 0)]  # rank 0 on cuda:0: DDP gets device_ids [0]
    return strategy


def test_ddp_is_built_on_the_current_stream(monkeypatch):
    """ddpkit's strategy wraps a GPU model in DDP with no stream entered (the current one, where the steps run), and
    passes DDP's arguments through; on CPU, no device ids, as Lightning."""
    with recorded_streams(monkeypatch) as events:
        on_gpu(TimedDDPStrategy(find_unused_parameters=True))._setup_model(torch.nn.Linear(2, 2))
        TimedDDPStrategy(parallel_devices=[torch.device("cpu")])._setup_model(torch.nn.Linear(2, 2))
    assert events == [("ddp", [0], None), ("ddp", None, None)]


def test_lightnings_own_ddp_strategy_still_builds_on_a_side_stream(monkeypatch):
    """Why CurrentStreamDDPStrategy exists: this Lightning wraps a GPU model in DDP inside a new side stream. When
    it fails, Lightning builds on the current stream itself (its fix, PR #21746) and the override can go."""
    with recorded_streams(monkeypatch) as events:
        on_gpu(DDPStrategy())._setup_model(torch.nn.Linear(2, 2))
    assert events == [("ddp", [0], "side")], f"{events}: Lightning {lightning.__version__}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs 1 visible GPU")
def test_gpu_fit_keeps_no_graph_and_warns_nothing_about_streams(tmp_path):
    """On a GPU, with every default callback: no node of a step's graph alive at the next batch, and no
    AccumulateGrad stream warning from torch."""
    out = tmp_path / "probe.json"
    args = [*FIT, "--trainer.accelerator", "gpu", "--trainer.devices", "1", "--trainer.default_root_dir", "."]
    result = toy(*args, "--trainer.callbacks+=graph_probe.GraphProbe", cwd=tmp_path, env={"GRAPH_PROBE_OUT": str(out)})
    assert result.returncode == 0, result.stdout[-3000:]
    assert ACCUMULATE_GRAD_WARNING not in result.stdout, result.stdout[-3000:]
    assert [r["alive"] for r in json.loads(Path(out).read_text())["records"]] == [0] * 8
