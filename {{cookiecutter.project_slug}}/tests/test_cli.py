"""`python main.py` end to end: what a run writes, and that users can plug in their own modules."""

import importlib
import json
import os
import textwrap

import pytest
import torch
from helpers import run_main, run_ok


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """One 3-epoch fit on 1 CPU process, shared by the tests below."""
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


def test_fit_learns(fitted):
    """Three epochs reach over 85% validation accuracy (random guessing is 10%)."""
    root, _ = fitted
    ckpt = torch.load(root / "lightning_logs/version_0/checkpoints/last.ckpt", weights_only=False)
    (state,) = [v for k, v in ckpt["callbacks"].items() if "ModelCheckpoint" in k]
    assert ckpt["epoch"] == 2 and ckpt["global_step"] == 48  # 3 epochs x 16 steps
    assert state["best_model_score"].item() > 0.85


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
    if command != "predict":
        assert f"{command if command == 'test' else 'val'}/acc" in out


def test_help_documents_global_batch():
    """`fit --help` of the data class shows the documented global batch size."""
    out = run_ok("fit", "--data.help", "{{ cookiecutter.package_name }}.data.DigitsDataModule", cwd=".")
    assert "--data.global_batch_size" in out and "over all devices" in out


def test_user_module_selected_from_command_line(tmp_path):
    """A LightningModule in the user's own file is chosen with --model, main.py unchanged."""
    (tmp_path / "my_model.py").write_text(
        textwrap.dedent("""
        from {{ cookiecutter.package_name }}.module import DigitsClassifier

        class Wide(DigitsClassifier):
            def __init__(self, width: int = 7):
                super().__init__(hidden_dim=width, num_layers=1)
    """)
    )
    run_ok(
        "fit",
        "--model",
        "my_model.Wide",
        "--model.width",
        "7",
        "--trainer.accelerator",
        "cpu",
        "--trainer.max_epochs",
        "1",
        "--trainer.default_root_dir",
        str(tmp_path),
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path)},
    )
    ckpt = torch.load(tmp_path / "lightning_logs/version_0/checkpoints/last.ckpt", weights_only=False)
    assert ckpt["hyper_parameters"]["width"] == 7
    assert ckpt["state_dict"]["model.net.0.weight"].shape == (7, 64)


def test_indivisible_global_batch_fails_with_message(tmp_path):
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


def test_last_checkpoint_is_the_latest_epoch_when_the_metric_stalls(tmp_path):
    """With lr=0 val/acc never improves after epoch 0, yet last.ckpt holds epoch 2 (stock Lightning 2.6.6: epoch 0)."""
    run_ok(
        "fit",
        "--trainer.accelerator",
        "cpu",
        "--trainer.max_epochs",
        "3",
        "--model.lr",
        "0",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.default_root_dir",
        str(tmp_path),
        cwd=tmp_path,
    )
    checkpoints = tmp_path / "lightning_logs/version_0/checkpoints"
    assert [p.name for p in checkpoints.glob("best-*")][0].startswith("best-epoch00-")
    last = torch.load(checkpoints / "last.ckpt", weights_only=False)
    assert (last["epoch"], last["global_step"]) == (2, 48)


def test_doctor_reports_by_default_without_timing_the_all_reduce(fitted):
    """The default fit ends with the doctor's report; the costly comm hook is off unless asked for."""
    root, out = fitted
    summary = json.loads((root / "lightning_logs/version_0/doctor.json").read_text())
    assert "Scaling doctor: 1 x cpu" in out and "comm not timed" in out
    assert summary["comm_measured"] is False and summary["steps"] > 0
