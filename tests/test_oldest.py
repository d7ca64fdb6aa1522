"""The oldest releases ddpkit supports, installed before a default bake: `pip install -e ".[dev]"` keeps them (the
library declares ranges, not pins), and the project's own `pytest` (its example's tests and the guarantee suite)
and the library's unit tests pass on them. The newest set is the rest of this repository's CI."""

import re
from pathlib import Path

import pytest
from bakes import TEMPLATE, bake, fresh_env, pinned_versions, run, torch_pin

OLDEST = TEMPLATE / "tests" / "oldest.txt"
# The library's unit tests that need nothing but the library and pytest (the others need this repository's
# requirements: the trackers, the adapters, the template's own helpers).
UNITS = [
    "test_lightning_internals.py",
    "test_private_names.py",
    "test_suite_units.py",
    "test_sampling.py",
    "test_schedules.py",
    "test_diagnosis.py",
    "test_doctor_steps.py",
    "test_presets.py",
]


def oldest_story(base: Path) -> dict:
    """Bake, install the oldest set, then the project; run its pytest and the units. {step: (status, output)}."""
    project = bake(base)
    env = fresh_env(base / "venv")
    record = {}
    for name, cmd in (
        ("torch", ["python", "-m", "pip", "install", "-q", torch_pin()]),
        ("oldest", ["python", "-m", "pip", "install", "-q", "-r", str(OLDEST)]),
        ("project", ["python", "-m", "pip", "install", "-q", "-e", ".[dev]"]),
        ("versions", ["python", "-m", "pip", "list", "--format=freeze"]),
        ("pytest", ["python", "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]),
        (
            "units",
            ["python", "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--confcutdir",
             str(TEMPLATE / "tests" / "library"), *(str(TEMPLATE / "tests" / "library" / u) for u in UNITS)],
        ),
    ):  # fmt: skip
        result = run(cmd, project, timeout=1200, env={**env, "COLUMNS": "300"})
        record[name] = (result.returncode, result.stdout)
        if result.returncode and name in ("torch", "oldest", "project"):
            break
    return record


@pytest.fixture(scope="module")
def oldest(oldest_run) -> dict:
    return oldest_run.result(timeout=3600)


def test_project_install_keeps_the_oldest_supported_releases(oldest):
    """After the oldest set, `pip install -e ".[dev]"` installs the project and leaves each of them as it was."""
    for step in ("torch", "oldest", "project"):
        code, out = oldest[step]
        assert code == 0, f"{step}: {out[-3000:]}"
    installed = {
        line.split("==")[0].lower(): line.split("==")[1] for line in oldest["versions"][1].split() if "==" in line
    }
    wanted = pinned_versions(OLDEST) | {"torch": torch_pin().split("==")[1]}
    for name, version in wanted.items():
        assert installed[re.sub(r"\[.*\]", "", name).lower()].split("+")[0] == version, (name, installed)


@pytest.mark.parametrize("step", ["pytest", "units"])
def test_project_pytest_and_library_units_pass_on_the_oldest_releases(oldest, step):
    """The default bake's own pytest, and the library's unit tests, pass on Lightning 2.5.1 & co.; only GPU tests
    skip."""
    code, out = oldest[step]
    summary = out.strip().splitlines()[-1]
    assert code == 0 and " passed" in summary and "failed" not in summary and "error" not in summary, out[-6000:]
    skips = [line for line in out.splitlines() if line.startswith("SKIPPED ")]
    assert all("GPU" in s for s in skips), skips
