"""Fixtures of the template's tests: baked projects and a fresh virtual environment."""

import subprocess
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from bakes import bake, fresh_env, torch_pin


@pytest.fixture(scope="session")
def default_project(tmp_path_factory) -> Path:
    """The project baked with every default, shared by the tests that only read it."""
    return bake(tmp_path_factory.mktemp("default"))


@pytest.fixture(scope="session")
def lm_project(tmp_path_factory) -> Path:
    """The project baked with the language-model example too."""
    return bake(tmp_path_factory.mktemp("lm"), lm_example="yes")


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


@pytest.fixture(scope="session")
def own_project_story(tmp_path_factory) -> Future:
    """The user's-project story (tests/own_project.py), started in the background the first time a test asks:
    the docs tests ask first, so the two overlap (neither asserts a duration). Its tests wait for the record."""
    from own_project import story

    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(story, tmp_path_factory.mktemp("own"))
