"""Units whose input is the process's environment: torchrun's and SLURM's variables, the CLI's defaults. Each sets
them in this process (monkeypatch.setenv), which every process started meanwhile would inherit: a background job's run
that sees SLURM_JOB_ID or WORLD_SIZE takes its ranks from there (a BERT's whole-suite session once ran another
test's ResNet, from PARITY_ARGS set this way). So this module runs before the background jobs start, after the
timing tests (tests/conftest.py), and conftest.py fails any other test that sets a variable while jobs run."""

import json
import os
import sys

import pytest
import torch
from jsonargparse import Namespace
from torch.utils.data import TensorDataset

from ddpkit.data.global_batch import SUITE_SAMPLES, GlobalBatchDataModule
from ddpkit.run.cli import BadInput, main, match_torchrun, place_loggers, requeued_run
from ddpkit.run.trackers import RUN_IDS, continue_trackers
from ddpkit.tune.run import trial_env

pytestmark = pytest.mark.environ


def logger_config(save_dir: str | None, version: int | None = None) -> Namespace:
    return Namespace(class_path="L", init_args=Namespace(save_dir=save_dir, name="lightning_logs", version=version))


# ---- torchrun ---------------------------------------------------------------------------------------------------


AUTO = {"devices": "auto", "num_nodes": 1}
GIVEN = {"devices": "4", "num_nodes": 2}


@pytest.mark.parametrize(
    ("env", "trainer", "expected"),
    [
        ({}, {"devices": "auto", "num_nodes": 1}, {"devices": "auto", "num_nodes": 1}),  # not under torchrun
        ({"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"}, AUTO, {"devices": 2, "num_nodes": 1}),
        ({"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "8"}, AUTO, {"devices": 4, "num_nodes": 2}),
        ({"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "8"}, GIVEN, GIVEN),  # given and consistent: kept
    ],
)
def test_devices_auto_takes_torchrun_shape(monkeypatch, env, trainer, expected):
    """Under torchrun (`torchrun --nproc_per_node 2 main.py fit`, no --trainer.devices), devices and num_nodes
    follow the processes torchrun started; outside torchrun nothing changes."""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    if env:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
        for key, value in env.items():
            monkeypatch.setenv(key, value)
    trainer = dict(trainer)
    match_torchrun(trainer)
    assert trainer == expected


def test_a_shape_that_contradicts_torchrun_is_refused(monkeypatch):
    """torchrun started 2 processes but --trainer.devices 1: one line that says what to set, not Lightning's
    ValueError traceback from inside every rank."""
    for key, value in {"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    expected = "torchrun started 2 processes .* set --trainer.devices 2 and --trainer.num_nodes 1"
    with pytest.raises(BadInput, match=expected):
        match_torchrun({"devices": "1", "num_nodes": 1})


# ---- SLURM and the loggers' directories --------------------------------------------------------------------


def test_loggers_sharing_a_directory_share_the_next_version(tmp_path, monkeypatch):
    """Two loggers under default_root_dir get the same version (the one after the highest there); a logger
    elsewhere, or with its own version, keeps what it had."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    (tmp_path / "lightning_logs/version_4").mkdir(parents=True)
    loggers = [logger_config(str(tmp_path)), logger_config(str(tmp_path)), logger_config("elsewhere")]
    loggers.append(logger_config(str(tmp_path), version=9))
    place_loggers(Namespace(default_root_dir=str(tmp_path), logger=loggers), None)
    assert [entry.init_args.version for entry in loggers] == [5, 5, None, 9]


def test_loggers_take_the_slurm_job_id_as_version(tmp_path, monkeypatch):
    """Under SLURM every logger without a version logs into version_<job id>, as Lightning's `logger: true` did,
    so a requeued job (same id) continues its directory."""
    monkeypatch.setenv("SLURM_JOB_ID", "1234")
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    loggers = [logger_config(str(tmp_path))]
    place_loggers(Namespace(default_root_dir=str(tmp_path), logger=loggers), None)
    assert loggers[0].init_args.version == 1234


def test_a_requeued_slurm_job_continues_the_trackers_of_its_job_id_directory(tmp_path, monkeypatch):
    """A SLURM job requeued with `--ckpt_path auto` resumes its hpc_ckpt_N.ckpt and logs into the directory
    named after its job id (place_loggers): the tracker ids saved there are handed back; not for another
    checkpoint, nor outside SLURM."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    run = tmp_path / "lightning_logs" / "version_4242"
    run.mkdir(parents=True)
    (run / RUN_IDS).write_text(json.dumps({"mlflow": "m1"}))

    entries = [
        ("lightning.pytorch.loggers.TensorBoardLogger", {"save_dir": str(tmp_path), "name": "lightning_logs"}),
        ("ddpkit.run.trackers.MLFlowLogger", {"run_id": None}),
    ]
    requeued = Namespace(default_root_dir=str(tmp_path))
    requeued.logger = [Namespace(class_path=c, init_args=Namespace(**a, version=None)) for c, a in entries]
    place_loggers(requeued, None)  # the job id as the version
    assert requeued_run(requeued, str(tmp_path / "hpc_ckpt_2.ckpt")) == run
    continue_trackers(requeued, run)
    assert requeued.logger[1].init_args.run_id == "m1"
    assert requeued_run(requeued, str(run / "checkpoints" / "last.ckpt")) is None
    monkeypatch.delenv("SLURM_JOB_ID")
    assert requeued_run(requeued, str(tmp_path / "hpc_ckpt_2.ckpt")) is None


def test_trials_do_not_see_slurm(monkeypatch):
    """A worker in an array task keeps SLURM's variables from its trials (Lightning would take ranks from srun)."""
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    env = trial_env(X="1")
    assert not [k for k in env if k.startswith("SLURM_")] and env["X"] == "1" and env["PATH"] == os.environ["PATH"]


# ---- TQDM -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "default", "own"), [("TQDM_MINITERS", "10", "1"), ("TORCH_FR_BUFFER_SIZE", "2000", "0")]
)
def test_cli_defaults_a_variable_unless_the_user_set_it(tmp_path, monkeypatch, capsys, name, default, own):
    """The CLI defaults TQDM_MINITERS to 10 (Lightning's TQDM bar redraws every 10th step) and TORCH_FR_BUFFER_SIZE
    to 2000 (torch 2.8 records no gloo collective for the hang report without it), and keeps a value already set."""
    monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "argv", ["main.py"])  # not pytest's arguments
    for expected in (default, own):
        with pytest.raises(SystemExit):  # --help: the variable is set before anything is parsed
            main(tmp_path / "no-config.yaml", ["--help"])
        assert os.environ[name] == expected
        monkeypatch.setenv(name, own)


# ---- the guard ----------------------------------------------------------------------------------------------------
def test_a_variable_set_by_a_test_while_jobs_run_fails(monkeypatch, tmp_path):
    """Once background jobs have started (faked here: this module runs before them), a test that sets or removes a
    variable fails, naming it, and os.environ stays as it was; a variable that library code sets (ddpkit.run.cli's
    TQDM_MINITERS, as every run of the CLI does) is set."""
    import early

    monkeypatch.delenv("TQDM_MINITERS", raising=False)
    monkeypatch.setattr(sys, "argv", ["main.py"])
    monkeypatch.setattr(early, "started", lambda: True)
    with pytest.raises(RuntimeError, match="^PARITY_ARGS set or removed by a test while background jobs run"):
        os.environ["PARITY_ARGS"] = "--model families.ResNet18"
    assert "PARITY_ARGS" not in os.environ
    with pytest.raises(RuntimeError, match="^SLURM_JOB_ID set or removed by a test"):
        monkeypatch.setenv("SLURM_JOB_ID", "7")
    with pytest.raises(RuntimeError, match="^PATH set or removed by a test"):
        os.environ.pop("PATH")
    assert "SLURM_JOB_ID" not in os.environ and os.environ["PATH"]
    with pytest.raises(SystemExit):
        main(tmp_path / "no-config.yaml", ["--help"])
    assert os.environ["TQDM_MINITERS"] == "10"


# ---- the guarantee suite's sample cut ---------------------------------------------------------------------------


class Sets(GlobalBatchDataModule):
    """100 training, 30 validation, 200 test samples and no predict set, each sample its own index."""

    def train_dataset(self):
        return TensorDataset(torch.arange(100))

    def val_dataset(self):
        return TensorDataset(torch.arange(30))

    def test_dataset(self):
        return TensorDataset(torch.arange(200))


def test_suite_samples_cut_every_set_to_its_first_n(monkeypatch):
    """DDPKIT_SUITE_SAMPLES=64: each set longer than 64 is its first 64 samples (train, val at fit and at validate,
    test), a shorter one stays whole, and the global batch counts steps from the cut set; with a warning that says
    so. Unset: every sample. Not a count: refused, naming the variable."""
    monkeypatch.setenv(SUITE_SAMPLES, "64")
    data = Sets(global_batch_size=32)
    with pytest.warns(UserWarning, match="DDPKIT_SUITE_SAMPLES=64: the train set is its first 64 of 100 samples"):
        data.setup("fit")
    assert [int(x) for (x,) in data.train_set] == list(range(64)) and len(data.val_set) == 30
    assert data.train_sampler().num_global_batches == 2
    with pytest.warns(UserWarning, match="the test set is its first 64 of 200 samples"):
        data.setup("test")
    assert len(data.test_set) == 64 and int(data.test_set[63][0]) == 63
    monkeypatch.delenv(SUITE_SAMPLES)
    data.setup("fit")
    data.setup("test")
    assert (len(data.train_set), len(data.test_set)) == (100, 200)
    for bad in ("0", "-3", "many"):
        monkeypatch.setenv(SUITE_SAMPLES, bad)
        with pytest.raises(ValueError, match=f"DDPKIT_SUITE_SAMPLES='{bad}': a number of samples"):
            data.setup("fit")
