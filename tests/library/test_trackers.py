"""MLflow (file store) and Weights & Biases (offline) beside TensorBoard on 2 CPU processes: a job stopped by
SIGTERM mid-epoch and restarted with the same command continues the same tracker run, read back from the
trackers' own local stores."""

import json
import os
import signal
import time
from pathlib import Path

import early
import pytest
import yaml
from jsonargparse import Namespace
from procs import TOY, finish, kill, start

from ddpkit.run.trackers import RUN_IDS, continue_trackers

pytest.importorskip("mlflow", reason="the trackers extra: pip install 'ddpkit[trackers]'")
pytest.importorskip("wandb", reason="the trackers extra: pip install 'ddpkit[trackers]'")

STEPS = 32  # two epochs of 16 steps; the SIGTERM lands in the first
COMMAND = [
    *TOY,
    "fit",
    "--trainer.accelerator", "cpu",
    "--trainer.devices", "2",
    "--trainer.max_steps", str(STEPS),
    "--trainer.log_every_n_steps", "1",  # LearningRateMonitor logs lr-AdamW at every step: one point per step
    "--trainer.enable_progress_bar", "false",
    "--trainer.logger+=ddpkit.run.trackers.MLFlowLogger",
    "--trainer.logger+=ddpkit.run.trackers.WandbLogger",
    "--doctor.enabled", "false",
    "--stop_check_every_n_steps", "2",
    "--model", "ddpkit.testing.toy.FaultyClassifier",
    "--model.step_sleep", "0.1",  # time for the signal to land mid-epoch
    "--model.fault_step", "6",  # from step 6 on, every step touches the marker
]  # fmt: skip
ENV = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}


@early.early("trackers")
def tracker_runs(base: Path) -> dict:
    """The job started, stopped by SIGTERM to its launcher once step 6 is reached, then restarted with the same
    command (`--ckpt_path auto`: a new run the first time, the stopped one's continuation the second). Returns both
    exit statuses and outputs."""
    marker = base / "step_reached"
    command = [*COMMAND, "--model.marker", str(marker), "--ckpt_path", "auto"]
    first = start(command, base, ENV)
    deadline = time.monotonic() + 240
    while first.poll() is None and not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    if first.poll() is None and marker.exists():
        os.kill(first.pid, signal.SIGTERM)
    try:
        stopped = finish(first, timeout=120)
    finally:
        kill(first)  # no rank outlives the stop
    restarted = finish(start(command, base, ENV), timeout=300)
    return {"base": base, "stopped": stopped, "restarted": restarted}


@pytest.fixture(scope="module")
def trackers() -> dict:
    result = early.result("trackers")
    for name in ("stopped", "restarted"):
        assert result[name].returncode == (143 if name == "stopped" else 0), result[name].stdout[-4000:]
    return result


def wandb_records(path: Path):
    """The records of a W&B run file (`run-<id>.wandb`): a 7-byte header, then LevelDB-log blocks of 32 KiB whose
    chunks (4-byte checksum, 2-byte length, 1-byte type) carry protobuf `Record`s, split over blocks if large."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, pos, payload = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B", path
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        payload += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = Record()
            record.ParseFromString(payload)
            payload = b""
            yield record


def test_stop_and_restart_continue_the_log_directory(trackers):
    """The restart resumed the stopped run's checkpoint in its own version directory, which holds the ids."""
    base = trackers["base"]
    assert [p.name for p in (base / "lightning_logs").iterdir()] == ["version_0"]
    assert "Restored all states from the checkpoint" in trackers["restarted"].stdout
    ids = json.loads((base / "lightning_logs/version_0/tracker_runs.json").read_text())
    assert sorted(ids) == ["mlflow", "wandb"]


def test_mlflow_keeps_one_run_with_every_step_once(trackers):
    """One MLflow run in the store (rank 1 made none, the restart none), its id the saved one, lr-AdamW at steps
    0..31 each once and in order, its params those of the first start, finished."""
    base = trackers["base"]
    ids = json.loads((base / "lightning_logs/version_0/tracker_runs.json").read_text())
    metas = [yaml.safe_load(p.read_text()) for p in (base / "mlruns").glob("*/*/meta.yaml")]
    assert [m["run_id"] for m in metas] == [ids["mlflow"]]
    run = next((base / "mlruns").glob(f"*/{ids['mlflow']}"))
    steps = [int(line.split()[2]) for line in (run / "metrics/lr-AdamW").read_text().splitlines()]
    assert steps == list(range(STEPS))
    stopped_at = int(trackers["stopped"].stdout.split("stopped by SIGTERM at step ")[1].split(";")[0])
    assert 6 <= stopped_at < 16  # mid-epoch: both starts logged into this run
    assert (run / "params/fault_step").read_text() == "6"
    assert metas[0]["status"] == 3  # RunStatus.FINISHED


def test_wandb_continues_one_run_id_with_steps_monotone(trackers):
    """W&B offline: one folder per start (2), all with the saved run id; lr-AdamW at trainer/global_step 0..31
    each once and in order over the two; the config only in the first (params logged once)."""
    base = trackers["base"]
    ids = json.loads((base / "lightning_logs/version_0/tracker_runs.json").read_text())
    parts = sorted((base / "wandb").glob("offline-run-*"))  # named by start time
    assert [p.name.rsplit("-", 1)[1] for p in parts] == [ids["wandb"]] * 2
    lr_steps, all_steps, configs = [], [], []
    for part in parts:
        records = list(wandb_records(part / f"run-{ids['wandb']}.wandb"))
        assert [r.run.run_id for r in records if r.WhichOneof("record_type") == "run"] == [ids["wandb"]]
        configs.append(sum(r.WhichOneof("record_type") == "config" for r in records))
        for r in records:
            if r.WhichOneof("record_type") == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
                all_steps.append(row["trainer/global_step"])
                if "lr-AdamW" in row:
                    lr_steps.append(row["trainer/global_step"])
    assert lr_steps == list(range(STEPS))
    assert all_steps == sorted(all_steps)  # never back in time, across the restart too
    assert configs[0] > 0 and configs[1] == 0


def test_restart_gives_the_saved_ids_only_to_trackers_that_name_no_run(tmp_path):
    """Parse time: ddpkit's tracker loggers without a run of their own get the saved ids; a run id given on the
    command line stays; TensorBoard and Lightning's own MLFlowLogger are left alone."""
    (tmp_path / RUN_IDS).write_text(json.dumps({"mlflow": "m1", "wandb": "w1"}))
    entries = [
        ("lightning.pytorch.loggers.TensorBoardLogger", {"version": None}),
        ("ddpkit.run.trackers.MLFlowLogger", {"run_id": None}),
        ("ddpkit.run.trackers.WandbLogger", {"id": None, "version": None}),
        ("ddpkit.run.trackers.WandbLogger", {"id": "mine", "version": None}),
        ("lightning.pytorch.loggers.MLFlowLogger", {"run_id": None}),
    ]
    trainer = Namespace(logger=[Namespace(class_path=c, init_args=Namespace(**a)) for c, a in entries])
    continue_trackers(trainer, tmp_path)
    given = [next((v for v in e.init_args.values() if v), None) for e in trainer.logger]
    assert given == [None, "m1", "w1", "mine", None]
