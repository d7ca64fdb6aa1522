"""The library's own tests (faults, the doctor, the scaling gap, bad input, units) run on its toy model
(`ddpkit.toy`) against the installed ddpkit, without baking a project."""

import early
import pytest


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: needs CUDA GPUs (skips, saying how many it needs, where fewer are visible)"
    )


@pytest.fixture(scope="session", autouse=True)
def early_runs(request, tmp_path_factory):
    """Start the early jobs (early.py) that the selected tests use (by a fixture of the job's name); at the end of
    the session wait for them."""
    used = {name for item in request.session.items for name in getattr(item, "fixturenames", ())}
    names = [name for name in early.JOBS if name in used]
    pool = early.start(names, lambda name: tmp_path_factory.mktemp(name))
    yield
    if pool is not None:
        pool.shutdown(wait=True)
