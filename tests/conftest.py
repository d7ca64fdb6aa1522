"""Bake the template into temporary directories."""

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
