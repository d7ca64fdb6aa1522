"""What a run writes names the ddpkit version that wrote it: the doctor's report, each checkpoint, the
logged hyperparameters; resuming another version's checkpoint says so. One version names one state of the
library: every change to it comes with a new version and a changelog entry."""

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import ddpkit
from ddpkit.run.cli import check_checkpoint
from ddpkit.scaling.record import DoctorRecord
from ddpkit.testing import toy

HERE = Path(__file__).resolve().parent
LIBRARY = HERE.parents[1] / "{{cookiecutter.project_slug}}" / "vendor" / "ddpkit"  # this template's copy
VERSION = ddpkit.__version__

MAIN = """
import sys
from pathlib import Path

from ddpkit.run.cli import main

main(Path(__file__).with_name("config.yaml"), sys.argv[1:])
"""
# One short 1-process fit: 8 training steps (the doctor reports the 5 after its 3 warm-up steps).
CONFIG = """
seed_everything: 42
trainer:
  accelerator: cpu
  strategy: ddp
  devices: 1
  max_epochs: 1
  limit_train_batches: 8
  limit_val_batches: 2
  enable_progress_bar: false
  logger:
    - class_path: lightning.pytorch.loggers.TensorBoardLogger
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, str]:
    """The run directory and the printed output of one fit of the toy model."""
    root = tmp_path_factory.mktemp("version")
    (root / "main.py").write_text(MAIN)
    (root / "config.yaml").write_text(CONFIG)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    # The toy's whole config, then this short fit's settings over it.
    cmd = [sys.executable, "main.py", "fit", "--config", str(toy.CONFIG), "--config", "config.yaml",
           "--trainer.default_root_dir", "."]  # fmt: skip
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300, check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    return root / "lightning_logs" / "version_0", out


def test_package_version_is_the_modules():
    """The installed distribution's version is read from `ddpkit.__version__` (one source)."""
    assert importlib.metadata.version("ddpkit") == VERSION


def test_every_change_to_the_library_comes_with_a_new_version():
    """The changelog's first release is the version, and the last commit that changed the library (its source or
    its requirements) is the last one that set the version. (A shallow clone of one commit passes: that commit
    is both.)"""
    first = re.search(r"^## (\S+) \(", (LIBRARY / "CHANGELOG.md").read_text(), flags=re.MULTILINE)
    assert first is not None and first.group(1) == VERSION
    if shutil.which("git") is None or not (HERE.parents[1] / ".git").exists():
        pytest.skip("not a git checkout of the template: no history to compare")

    def last(*args: str) -> str:
        cmd = ["git", "log", "-1", "--format=%h %s", *args]
        done = subprocess.run(cmd, cwd=LIBRARY, capture_output=True, text=True, check=False, timeout=60)
        if done.returncode != 0:  # e.g. a checkout owned by another user, which git refuses to read
            pytest.skip(f"git cannot read this checkout's history: {done.stderr.strip()[:300]}")
        return done.stdout.strip()

    changed, versioned = last("--", "src", "pyproject.toml"), last("-G^__version__ = ", "--", "src/ddpkit/__init__.py")
    assert changed == versioned, (
        f"ddpkit changed in '{changed[:100]}' after its version was set in '{versioned[:100]}': give it a new "
        f"version in src/ddpkit/__init__.py and CHANGELOG.md in the commit that changes it"
    )


def test_doctor_report_names_the_version(run):
    """doctor.json holds the version and the printed report's first line ends with it."""
    run_dir, out = run
    assert DoctorRecord.from_dict(json.loads((run_dir / "doctor.json").read_text())).ddpkit_version == VERSION
    heads = [line for line in out.splitlines() if line.startswith("Scaling doctor: 1 x cpu, 5 steps")]
    assert len(heads) == 1 and heads[0].endswith(f" (ddpkit {VERSION})"), out[-2000:]


def test_checkpoints_record_the_version(run):
    """Every checkpoint the run wrote, last and best, holds the version."""
    run_dir, _ = run
    paths = sorted((run_dir / "checkpoints").glob("*.ckpt"))
    assert [p.name for p in paths] == ["best-epoch00-step8.ckpt", "last.ckpt"]
    assert [torch.load(p, weights_only=True)["ddpkit_version"] for p in paths] == [VERSION, VERSION]


def test_logged_hyperparameters_record_the_version(run):
    """The loggers get the version beside the run's config (TensorBoard: hparams.yaml)."""
    run_dir, _ = run
    hparams = yaml.safe_load((run_dir / "hparams.yaml").read_text())
    assert hparams["ddpkit_version"] == VERSION and "model:" in hparams["config"]


def test_resuming_another_versions_checkpoint_warns(run, tmp_path, capsys):
    """A checkpoint of another ddpkit version gets one warning naming both versions; this version's gets none."""
    run_dir, _ = run
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    check_checkpoint(str(run_dir / "checkpoints" / "last.ckpt"), None)
    assert "ddpkit" not in capsys.readouterr().err
    checkpoint["ddpkit_version"] = "0.0.1"
    torch.save(checkpoint, tmp_path / "old.ckpt")
    check_checkpoint(str(tmp_path / "old.ckpt"), None)
    warnings = [line for line in capsys.readouterr().err.splitlines() if "ddpkit" in line]
    assert len(warnings) == 1 and f"written by ddpkit 0.0.1; this is ddpkit {VERSION}" in warnings[0]
