"""The oldest releases ddpkit supports (tests/oldest.txt: torch's floor, a PyPI CUDA build that runs on CPU, with
the oldest Lightning & co.), installed before a default bake: `pip install -e ".[dev]"` keeps them (the library
declares ranges, not pins), and the project's own `pytest` (its example's tests and the guarantee suite) and the
library's unit tests pass on them (releases.story). The newest set is the rest of this repository's CI."""

import sys
import warnings
from pathlib import Path

import pytest
from bakes import TEMPLATE, pinned_versions
from packaging.version import Version
from releases import CONSTRAINTS, INSTALLS, RAN_AGAIN, download, kept, run_step, story, with_releases

OLDEST = TEMPLATE / "tests" / "oldest.txt"
# The suite's one skip on CPU that is not a GPU test's: FSDP2 needs CUDA before torch 2.6 (ddpkit.model.sharding).
SHARDED_SKIP = "FSDP2 runs on CPU processes from torch 2.6"


def oldest_releases() -> list[str]:
    return [line.split("#")[0].strip() for line in OLDEST.read_text().splitlines() if "==" in line.split("#")[0]]


def oldest_wheels(base: Path) -> None:
    """Download the oldest torch (PyPI's CUDA build: 2.74 GB) into base/wheels; conftest.py runs it as the job's
    preparation, outside the job slots, as soon as the jobs start."""
    download(oldest_releases(), base / "wheels")


def oldest_story(base: Path) -> dict:
    """Bake, install the oldest set (torch first, from the wheels `oldest_wheels` downloaded: here, unless done
    ahead), then the project; run its pytest and the units."""
    if not (base / "wheels").is_dir():
        oldest_wheels(base)
    return story(base, oldest_releases(), wheels=base / "wheels")


@pytest.fixture(scope="module")
def oldest(oldest_run) -> dict:
    return oldest_run.result(timeout=3600)


def test_project_install_keeps_the_oldest_supported_releases(oldest):
    """After the oldest set, `pip install -e ".[dev]"` installs the project and leaves each of them as it was, torch
    2.4.0 included."""
    for step in INSTALLS:
        code, out, seconds = oldest[step]
        assert code == 0, f"{step} ({seconds:.0f} s): {out[-3000:]}"
    assert "torch" in pinned_versions(OLDEST)
    assert not kept(oldest, oldest_releases()), kept(oldest, oldest_releases())


@pytest.mark.parametrize("step", ["pytest", "units"])
def test_project_pytest_and_library_units_pass_on_the_oldest_releases(oldest, step):
    """The default bake's own pytest, and the library's unit tests, pass on torch 2.4.0 with Lightning 2.5.1 & co.,
    with no warning that torch.load's default is unsafe; only GPU tests skip, and the sharded check where torch
    runs FSDP2 on CPU processes only from 2.6."""
    code, out, _ = oldest[step]
    if out.startswith(RAN_AGAIN):  # said in the session's warnings summary, with the first try's failures
        warnings.warn(out[:3000], stacklevel=1)
    summary = out.strip().splitlines()[-1]
    assert code == 0 and " passed" in summary and "failed" not in summary and "error" not in summary, out[-6000:]
    assert "You are using `torch.load` with `weights_only=False`" not in out, out[-6000:]
    skips = [line for line in out.splitlines() if line.startswith("SKIPPED ")]
    sharded = [s for s in skips if SHARDED_SKIP in s]
    floor = Version(pinned_versions(OLDEST)["torch"])
    assert len(sharded) == (step == "pytest" and floor < Version("2.6")), skips
    assert all("GPU" in s for s in skips if s not in sharded), skips


def test_a_release_replaced_or_missing_is_reported_and_a_local_label_is_not():
    """kept() names each wanted release that `pip list` shows at another version or not at all (extras and case
    ignored), and accepts a CUDA build's local label (2.4.0+cu121 is torch 2.4.0)."""
    record = {"versions": (0, "torch==2.4.0+cu121\nLightning==2.6.6\nPyYAML==6.0.2\n", 1.0)}
    wanted = ["torch==2.4.0", "lightning==2.5.1", "jsonargparse[signatures]==4.36.0", "PyYAML==6.0.2"]
    assert kept(record, wanted) == ["lightning: 2.5.1 wanted, 2.6.6 found", "jsonargparse: 4.36.0 wanted, None found"]


def test_a_new_release_replaces_its_pin_in_the_newest_set(tmp_path):
    """with_releases() writes constraints.txt's pins with the named package at the given release and the others
    as they were."""
    newest = pinned_versions(CONSTRAINTS)
    written = pinned_versions(with_releases(["torch==2.15.0"], tmp_path))
    assert written == {**newest, "torch": "2.15.0"} and newest["torch"] != "2.15.0"


def test_a_step_that_timed_out_runs_once_more_and_says_so(tmp_path):
    """A test step whose first try failed on a process timing out (torch 2.4's hang at exit) runs once more: its
    record opens with RAN_AGAIN and the first try's failures and ends with the second try's summary. Any other
    failure, and an install's, runs once."""
    script = tmp_path / "step.py"
    script.write_text(
        "import pathlib, sys\n"
        "tries = pathlib.Path('tries'); tries.write_text(tries.read_text() + 'x' if tries.exists() else 'x')\n"
        "if len(tries.read_text()) == 1:\n"
        "    print(sys.argv[1] + '\\nFAILED t.py::a - AssertionError\\n1 failed'); sys.exit(1)\n"
        "print('1 passed')\n"
    )
    tries = tmp_path / "tries"
    for name, says, runs, code in (("units", "x timed out after 180s", 2, 0), ("units", "assert 1 == 2", 1, 1),
                                   ("torch", "x timed out after 180s", 1, 1)):  # fmt: skip
        tries.unlink(missing_ok=True)
        got, out = run_step(name, [sys.executable, str(script), says], tmp_path, {})
        assert (got, len(tries.read_text())) == (code, runs), out
        if runs == 2:
            assert out.startswith(f"{RAN_AGAIN}\nFAILED t.py::a - AssertionError\n") and out.strip().endswith(
                "1 passed"
            )
