"""The digits example end to end: it learns, its help, a module of one's own built on it, a stalled metric."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from ddpkit.model.schedules import WarmupCosine
from ddpkit.testing.helpers import concurrently, run_main, run_ok

PROJECT = Path(__file__).resolve().parents[2]
DIGITS = ("--config", str(PROJECT / "tests/examples/digits.yaml"))


@pytest.fixture(scope="module")
def fits(tmp_path_factory) -> dict[str, Path]:
    """The example's three fits on 1 CPU process each, all at once (mostly start-up): plain for 3 epochs, with
    a module of the user's own built on it, and with lr=0 so that val/acc stalls."""
    base = tmp_path_factory.mktemp("fits")
    (base / "my_model.py").write_text(
        textwrap.dedent("""
        from {{ cookiecutter.package_name }}.digits.module import DigitsClassifier

        class Wide(DigitsClassifier):
            def __init__(self, width: int = 7):
                super().__init__(hidden_dim=width, num_layers=1)
    """)
    )
    cpu = ("--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false")
    jobs = {
        "plain": ("--trainer.max_epochs", "3"),
        "own": ("--model", "my_model.Wide", "--model.width", "7", "--trainer.max_epochs", "1"),
        "stalled": ("--trainer.max_epochs", "3", "--model.optimizer.lr", "0"),
    }

    def fit(name: str) -> Path:
        root = base / name
        run_ok(
            "fit",
            *DIGITS,
            *cpu,
            *jobs[name],
            "--trainer.default_root_dir",
            str(root),
            cwd=base,
            env={"PYTHONPATH": str(base)},
        )
        return root

    return concurrently(fit, jobs)


def test_fit_learns(fits):
    """Three epochs reach over 85% validation accuracy (random guessing is 10%)."""
    ckpt = torch.load(fits["plain"] / "lightning_logs/version_0/checkpoints/last.ckpt", weights_only=False)
    (state,) = [v for k, v in ckpt["callbacks"].items() if "ModelCheckpoint" in k]
    assert ckpt["epoch"] == 2 and ckpt["global_step"] == 48  # 3 epochs x 16 steps
    assert state["best_model_score"].item() > 0.85


def test_help_documents_global_batch():
    """`fit --help` of the data class shows the documented global batch size."""
    out = run_ok("fit", "--data.help", "{{ cookiecutter.package_name }}.digits.data.DigitsDataModule", cwd=PROJECT)
    assert "--data.global_batch_size" in out and "over all devices" in out


def test_user_module_selected_from_command_line(fits):
    """A LightningModule in the user's own file is chosen with --model, main.py unchanged."""
    ckpt = torch.load(fits["own"] / "lightning_logs/version_0/checkpoints/last.ckpt", weights_only=False)
    assert ckpt["hyper_parameters"]["width"] == 7
    assert ckpt["state_dict"]["model.net.0.weight"].shape == (7, 64)


def test_last_checkpoint_is_the_latest_epoch_when_the_metric_stalls(fits):
    """With lr=0 val/acc never improves after epoch 0, yet last.ckpt holds epoch 2 (stock Lightning 2.6.6: epoch 0)."""
    checkpoints = fits["stalled"] / "lightning_logs/version_0/checkpoints"
    assert [p.name for p in checkpoints.glob("best-*")][0].startswith("best-epoch00-")
    last = torch.load(checkpoints / "last.ckpt", weights_only=False)
    assert (last["epoch"], last["global_step"]) == (2, 48)


# Builds the example's module from the command line (run=False) with another optimizer and a schedule.
OPTIMIZER = """
import sys
from main import main

args = sys.argv[1:]
cli = main(args, run=False)
optimizer = cli.model.optimizer(cli.model.parameters())
schedule = cli.model.scheduler(optimizer)
print("OPTIMIZER", type(optimizer).__name__, optimizer.defaults["lr"], optimizer.defaults["weight_decay"])
print("SCHEDULE", type(schedule).__name__, schedule.warmup_steps)
"""


def test_optimizer_and_schedule_come_from_the_command_line():
    """--model.optimizer torch.optim.SGD --model.optimizer.lr 0.1 builds SGD with lr 0.1 (the weight decay of
    AdamW in the config carries over: the two classes share the argument), and --model.scheduler a schedule."""
    schedule = f"{WarmupCosine.__module__}.WarmupCosine"
    args = [*DIGITS, "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.logger", "false"]
    args += ["--model.optimizer", "torch.optim.SGD", "--model.optimizer.lr", "0.1"]
    args += ["--model.scheduler", schedule, "--model.scheduler.warmup_steps", "3"]
    result = subprocess.run(
        [sys.executable, "-c", OPTIMIZER, *args], cwd=PROJECT, capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith(("OPTIMIZER", "SCHEDULE"))]
    assert lines == ["OPTIMIZER SGD 0.1 0.0001", "SCHEDULE WarmupCosine 3"]


def test_lightnings_optimizer_flag_is_refused_for_a_module_that_takes_its_optimizer():
    """LightningCLI's --optimizer would replace the module's configure_optimizers and silently drop
    --model.optimizer: it stops with one error line naming the option to use, before anything runs."""
    result = run_main("fit", *DIGITS, "--optimizer", "torch.optim.SGD", "--trainer.accelerator", "cpu", cwd=PROJECT)
    assert result.returncode == 2
    assert "error: --optimizer would replace DigitsClassifier.configure_optimizers" in result.stdout
    assert "--model.optimizer CLASS" in result.stdout
