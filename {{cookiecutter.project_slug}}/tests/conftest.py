"""Shared fixtures: what config.yaml selects, so the guarantee tests follow your model and data."""

import pytest
from configured import describe
from fake_cuda import fake_env
from runs import cpu_runs, steps  # noqa: F401  (session fixtures: the shared real runs)


@pytest.fixture(scope="session")
def configured() -> dict:
    """Sizes and steps of the data module config.yaml selects (tests/configured.py)."""
    return describe()


@pytest.fixture(scope="session")
def global_batch(configured) -> dict:
    """`configured`, for tests of guarantees that only a GlobalBatchDataModule gives; others skip."""
    if not configured["global_batch_data"]:
        pytest.skip(
            f"{configured['data']} is not a GlobalBatchDataModule: 1-vs-N parity, exact resume and exactly-once "
            "evaluation are not guaranteed for it (README, 'Your own model and data')"
        )
    return configured


@pytest.fixture(scope="session")
def fake_gpus(tmp_path_factory):
    """`fake_gpus(n)`: environment in which a subprocess's torch.cuda reports n GPUs (tests/fake_cuda.py), so
    checks that only ask torch.cuda take the branch a machine with n GPUs takes, on any machine."""
    site = tmp_path_factory.mktemp("fake-cuda-site")
    return lambda gpus: fake_env(site, gpus)
