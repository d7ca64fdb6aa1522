"""The config presets the library ships (ddpkit.presets): listed with their state in a project's configs/, copied
there on request and never over a file the project has; a missing `--config` that is a preset names the command."""

import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit import presets
from ddpkit.run.cli import main as cli_main
from ddpkit.testing import toy


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    """A project root (the working directory) whose configs/ holds debug as shipped and wandb edited."""
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "debug.yaml").write_bytes(presets.path("debug").read_bytes())
    (tmp_path / "configs" / "wandb.yaml").write_text("# ours\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_library_ships_the_generic_presets_only():
    """The generic presets are package data; the examples' presets (lm, fsdp, stream, tune) are the project's."""
    assert presets.names() == ["debug", "mlflow", "model_parallel", "wandb"]
    assert all("cookiecutter" not in presets.path(n).read_text() for n in presets.names())


def test_listing_says_which_presets_configs_lacks_or_holds_changed(project, capsys):
    """One line per preset with its state (as shipped, changed, missing), then the command that copies the missing."""
    assert presets.main([]) == 0
    lines = capsys.readouterr().out.splitlines()
    states = {line.split()[0]: line.split()[1] for line in lines[1:5]}
    assert states == {"debug": "in", "mlflow": "missing", "model_parallel": "missing", "wandb": "changed"}
    assert "copy the missing ones: python -m ddpkit.presets mlflow model_parallel" in lines
    assert f"configs/wandb.yaml differs from the library's: diff configs/wandb.yaml {presets.path('wandb')}" in lines


def test_copy_brings_the_librarys_file(project, capsys):
    """`python -m ddpkit.presets mlflow` writes configs/mlflow.yaml, byte for byte the library's, and exits 0."""
    assert presets.main(["mlflow"]) == 0
    assert (project / "configs" / "mlflow.yaml").read_bytes() == presets.path("mlflow").read_bytes()
    assert capsys.readouterr().out == "copied configs/mlflow.yaml (python main.py fit --config configs/mlflow.yaml)\n"
    assert presets.state("mlflow") == "same"


def test_copy_never_overwrites_and_exits_1(project, capsys):
    """A preset whose file exists is not copied (the project's stays byte for byte), the others are, and the
    exit status is 1."""
    assert presets.main(["wandb", "model_parallel", "debug"]) == 1
    assert (project / "configs" / "wandb.yaml").read_text() == "# ours\n"
    assert (project / "configs" / "model_parallel.yaml").read_bytes() == presets.path("model_parallel").read_bytes()
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out] == [
        "not copied",
        "copied configs/model_parallel.yaml (python main.py fit --config configs/model_parallel.yaml)",
        "not copied",
    ]
    assert out[0].startswith("not copied: configs/wandb.yaml exists, and stays as it is (changed;")


def test_unknown_name_is_one_error_line_and_copies_nothing(project, capsys):
    """An unknown name exits 2 with one `error:` line naming the presets, before any preset is copied."""
    assert presets.main(["mlflow", "lm"]) == 2
    out, err = capsys.readouterr()
    assert (
        out == "" and err == "error: no preset 'lm': the library's presets are debug, mlflow, model_parallel, wandb\n"
    )
    assert not (project / "configs" / "mlflow.yaml").exists()


def test_the_module_runs_as_a_command(project):
    """`python -m ddpkit.presets NAME` exits with main's status (1: a file was kept)."""
    cmd = [sys.executable, "-m", "ddpkit.presets", "debug"]
    done = subprocess.run(cmd, cwd=project, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1 and done.stdout.startswith("not copied: configs/debug.yaml exists"), done


@pytest.mark.parametrize(
    ("config", "tip"),
    [
        ("configs/mlflow.yaml", " (mlflow is a ddpkit preset: `python -m ddpkit.presets mlflow` copies it there)"),
        ("configs/lm.yaml", ""),
    ],  # fmt: skip
)
def test_missing_preset_config_error_names_the_copy_command(project, capsys, config, tip):
    """`--config configs/mlflow.yaml` where the project lacks it: the CLI's one `error:` line (status 2) ends with the
    command that copies the preset; a missing config that is no preset gets the parser's message alone."""
    with pytest.raises(SystemExit) as stop:
        cli_main(toy.CONFIG, ["--config", config], run=False)
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert stop.value.code == 2 and len(errors) == 1, errors
    assert errors[0].endswith(f"{config}'{tip}"), errors[0]
