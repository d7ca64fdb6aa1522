"""The library's own tests (faults, the doctor, the scaling gap, bad input, units) run on its toy model
(`ddpkit.testing.toy`) against the installed ddpkit, without baking a project."""

import early
import pytest


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: needs CUDA GPUs (skips, saying how many it needs, where fewer are visible)"
    )


@pytest.fixture(scope="module", autouse=True)
def _early_after_timing(request):
    """The early jobs start with the first module that times nothing (before its module fixtures, which may read
    them): the timing tests run before it, alone, then the environ ones (tests/conftest.py)."""
    if not early.before_jobs(request.node):
        request.getfixturevalue("early_runs")


@pytest.fixture(scope="session")
def early_runs(request, tmp_path_factory):
    """Start the early jobs (early.py) that the selected tests use (by a fixture of the job's name), those that the
    top level's `background` has not started already; at the end of the session wait for them."""
    used = {name for item in request.session.items for name in getattr(item, "fixturenames", ())}
    early.start({name: job for name, job in early.JOBS.items() if name in used}, tmp_path_factory.mktemp)
    yield
    early.quiet()
