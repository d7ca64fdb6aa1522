"""The guarantee suite on a project whose data module is a plain LightningDataModule: every guarantee test fails with
the reason (a green run that checked nothing would read as a pass), unless pyproject.toml opts out, in one line."""

import sys
from pathlib import Path

import pytest
from procs import run

MAIN = """from pathlib import Path
from ddpkit.run.cli import main as run_cli


def main(args=None, run=True):
    return run_cli(Path(__file__).with_name("config.yaml"), args, run)
"""
CONFIG = """seed_everything: 42
trainer: {accelerator: cpu, strategy: ddp, devices: 1, logger: false}
model: {class_path: ddpkit.testing.toy.ToyClassifier}
data: {class_path: ddpkit.testing.toy.PlainToyData}
"""
PYTEST = '[tool.pytest.ini_options]\ntestpaths = ["tests"]\npythonpath = ["."]\n'


@pytest.fixture(scope="module")
def sessions(tmp_path_factory) -> dict[str, tuple[int, str]]:
    """The project's `pytest -rfEs` without and with `ddpkit_plain_data_ok = true`: {how: (status, output)}."""
    out = {}
    for how, extra in (("default", ""), ("opted out", "ddpkit_plain_data_ok = true\n")):
        project = tmp_path_factory.mktemp("plain")
        (project / "tests").mkdir()
        (project / "main.py").write_text(MAIN)
        (project / "config.yaml").write_text(CONFIG)
        (project / "pyproject.toml").write_text(PYTEST + extra)
        (project / "tests" / "conftest.py").write_text('pytest_plugins = ["ddpkit.testing.plugin"]\n')
        (project / "tests" / "test_guarantees.py").write_text("from ddpkit.testing.guarantees import *  # noqa\n")
        cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "-k", "not gpu"]
        result = run(cmd, Path(project), timeout=300, env={"COLUMNS": "400"})  # summary lines whole
        out[how] = (result.returncode, result.stdout)
    return out


def test_plain_data_module_fails_the_guarantees_with_the_reason(sessions):
    """Without the opt-out: a failing session, no test passed, each one says why and the line that opts out."""
    code, out = sessions["default"]
    assert code == 1 and " passed" not in out, out[-3000:]
    said = [line for line in out.splitlines() if line.startswith(("ERROR ", "FAILED "))]
    assert len(said) >= 30 and all("PlainToyData is not a GlobalBatchDataModule" in line for line in said), said[:3]
    assert "set ddpkit_plain_data_ok = true under [tool.pytest.ini_options] in pyproject.toml" in out


def test_opting_out_in_pyproject_skips_them_saying_so(sessions):
    """With `ddpkit_plain_data_ok = true`: a passing session in which those tests skip, naming the switch."""
    code, out = sessions["opted out"]
    assert code == 0 and " failed" not in out and " error" not in out, out[-3000:]
    skipped = [line for line in out.splitlines() if line.startswith("SKIPPED ")]
    assert any("ddpkit_plain_data_ok = true in pyproject.toml" in line for line in skipped), skipped
