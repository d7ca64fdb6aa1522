"""`python main.py` end to end on whatever config.yaml selects: what a run writes, the other subcommands."""

import importlib
import json
import os

import pytest
from helpers import run_main, run_ok


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """One 3-epoch fit of the configured model and data on 1 CPU process, shared by the tests below."""
    root = tmp_path_factory.mktemp("fit")
    out = run_ok(
        "fit",
        "--trainer.accelerator",
        "cpu",
        "--trainer.max_epochs",
        "3",
        "--trainer.default_root_dir",
        str(root),
        cwd=root,
    )
    return root, out


def test_fit_writes_logs_config_and_checkpoints_under_root(fitted):
    """One version dir with TensorBoard events, config.yaml, hparams.yaml, best and last checkpoints."""
    root, _ = fitted
    version = root / "lightning_logs" / "version_0"
    assert sorted(p.name for p in (root / "lightning_logs").iterdir()) == ["version_0"]
    assert len(list(version.glob("events.out.tfevents.*"))) == 1
    assert (version / "config.yaml").is_file() and (version / "hparams.yaml").is_file()
    ckpts = sorted(p.name for p in (version / "checkpoints").iterdir())
    assert len(ckpts) == 2 and ckpts[1] == "last.ckpt" and ckpts[0].startswith("best-epoch")


@pytest.mark.parametrize("command", ["validate", "test", "predict"])
def test_other_subcommands_run_from_a_checkpoint(fitted, command):
    """validate, test and predict load the trained weights and finish."""
    root, _ = fitted
    ckpt = root / "lightning_logs/version_0/checkpoints/last.ckpt"
    out = run_ok(
        command,
        "--trainer.accelerator",
        "cpu",
        "--ckpt_path",
        str(ckpt),
        "--trainer.default_root_dir",
        str(root / command),
        cwd=root,
    )
    if command != "predict":  # Lightning's table of the metrics the module logged
        assert f"{'Test' if command == 'test' else 'Validate'} metric" in out


def test_indivisible_global_batch_fails_with_message(global_batch, tmp_path):
    """2 processes cannot share a global batch of 63: exit non-zero and say what to use."""
    result = run_main(
        "fit",
        "--trainer.accelerator",
        "cpu",
        "--trainer.devices",
        "2",
        "--data.global_batch_size",
        "63",
        "--trainer.default_root_dir",
        str(tmp_path),
        cwd=tmp_path,
    )
    assert result.returncode != 0
    assert "global_batch_size=63 does not divide evenly over 2 processes" in result.stdout


def test_tqdm_bar_redraws_every_10th_step_unless_the_user_says_otherwise(monkeypatch):
    """main.py defaults TQDM_MINITERS to 10 (Lightning's TQDM bar reads it) and keeps a value already set."""
    import main  # here, not at the top: importing it sets the variable

    monkeypatch.delenv("TQDM_MINITERS", raising=False)
    importlib.reload(main)
    assert os.environ["TQDM_MINITERS"] == "10"
    monkeypatch.setenv("TQDM_MINITERS", "1")
    importlib.reload(main)
    assert os.environ["TQDM_MINITERS"] == "1"


def test_doctor_reports_by_default_without_timing_the_all_reduce(fitted):
    """The default fit ends with the doctor's report; the costly comm hook is off unless asked for."""
    root, out = fitted
    summary = json.loads((root / "lightning_logs/version_0/doctor.json").read_text())
    assert "Scaling doctor: 1 x cpu" in out and "comm not timed" in out
    assert summary["comm_measured"] is False and summary["steps"] > 0
