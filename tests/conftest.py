"""Bake the template into temporary directories."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cookiecutter.main import cookiecutter

TEMPLATE = Path(__file__).resolve().parents[1]


def bake(out_dir: Path, **context: str) -> Path:
    """Generate a project with `context` overriding cookiecutter.json; return its directory."""
    return Path(cookiecutter(str(TEMPLATE), no_input=True, output_dir=str(out_dir), extra_context=context))


@pytest.fixture(scope="session")
def default_project(tmp_path_factory) -> Path:
    """The project baked with every default, shared by the tests that only read it."""
    return bake(tmp_path_factory.mktemp("default"))


@pytest.fixture(scope="session")
def lm_project(tmp_path_factory) -> Path:
    """The project baked with the language-model example too."""
    return bake(tmp_path_factory.mktemp("lm"), lm_example="yes")


def fresh_env(venv: Path) -> dict[str, str]:
    """A new, empty virtual environment at `venv`, and the environment variables that put it first on PATH.

    Nothing from the environment running the tests leaks in (no PYTHONPATH, no system site packages):
    a baked project's commands run with exactly what its own install steps put there.
    """
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    return env


def torch_pin() -> str:
    """The torch requirement a baked project pins (`torch==X.Y.Z`), from the template's pyproject.toml."""
    text = (TEMPLATE / "{{cookiecutter.project_slug}}" / "pyproject.toml").read_text()
    return re.search(r'"(torch==[^"]+)"', text).group(1)


@pytest.fixture(scope="session")
def baked_env(tmp_path_factory) -> dict[str, str]:
    """A new virtual environment holding only the pinned torch (this machine's CPU wheel; it is installed
    first, as every install instruction says), shared by the tests that then install a baked project into
    it with that project's own install step. Returns the environment variables that select it."""
    env = fresh_env(tmp_path_factory.mktemp("venv") / "venv")
    cmd = ["python", "-m", "pip", "install", "-q", torch_pin()]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return env
