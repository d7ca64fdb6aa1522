"""The library's own tests (faults, the doctor, the scaling gap, bad input, units) run on its toy model
(`ddpkit.toy`) against the installed ddpkit, without baking a project."""

from pathlib import Path

import early
import pytest


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: needs CUDA GPUs (skips, saying how many it needs, where fewer are visible)"
    )


@pytest.fixture(scope="session", autouse=True)
def early_runs(request, tmp_path_factory):
    """Start the early jobs (early.py) of the test modules selected in this session; at its end wait for them."""
    selected = {Path(item.path).stem for item in request.session.items}
    names = [name for name, job in early.JOBS.items() if job.__module__ in selected]
    pool = early.start(names, lambda name: tmp_path_factory.mktemp(name))
    yield
    if pool is not None:
        pool.shutdown(wait=True)
