"""The pytest plugin of the guarantee suite: the project it tests, and the fixtures the suite's tests read.

A project selects it in `tests/conftest.py` (`pytest_plugins = ["ddpkit.testing.plugin"]`); see
`ddpkit.testing` for the two files that make up a project's suite.
"""

import json
import os

import pytest

# The suite's modules hold plain asserts; have pytest show the values in them, as in a test file. Before they
# are imported: rewriting happens at import.
pytest.register_assert_rewrite(
    *(f"ddpkit.testing.{m}" for m in ("bounds", "check_cli", "check_data", "check_multinode", "check_onestep")),
    *(f"ddpkit.testing.{m}" for m in ("check_parity", "check_sharded")),
    *(f"ddpkit.testing.{m}" for m in ("configured", "fake_cluster", "helpers", "runs")),
)

from .check_data import data_gate, unused_skip  # noqa: E402
from .commands import fit, main_cmd, parity_args  # noqa: E402
from .configured import describe  # noqa: E402
from .fake_cuda import fake_env  # noqa: E402
from .float64 import summary  # noqa: E402
from .footprint import KEEP_CHECKPOINTS, Footprint, remove_checkpoints  # noqa: E402
from .helpers import set_project  # noqa: E402
from .runs import Run, Waves, plan, runs_read  # noqa: E402
from .waves import shared_runs  # noqa: E402

# What the runs wrote, for the session's summary: (checkpoint files, their bytes, the most bytes on disk at once, the
# model's float64 weights' bytes).
FOOTPRINT: list[tuple[int, int, int, int]] = []
# The session's runs while its tests run, with their steps: each test's teardown frees what no later test reads.
SESSION_RUNS: list[tuple[Waves, dict, Footprint]] = []
# Where the model cast float64 down and the float64 runs kept float64 instead (float64.py), for the summary.
KEPT_FLOAT64: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    # The project is pytest's rootdir: the directory of the pyproject.toml that configures pytest, where
    # main.py and config.yaml are, wherever pytest is started from.
    set_project(config.rootpath)
    config.addinivalue_line(
        "markers",
        "gpu: needs CUDA GPUs (skips, saying how many it needs, where fewer are visible); `pytest -m gpu` runs them",
    )


@pytest.fixture(scope="session")
def configured() -> dict:
    """Sizes and steps of the model and data config.yaml selects, with PARITY_ARGS (configured.py)."""
    return describe(*parity_args())


# The one place a project says that its data module is plain on purpose: [tool.pytest.ini_options] in pyproject.toml.
PLAIN_DATA_OK = "ddpkit_plain_data_ok"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        PLAIN_DATA_OK,
        type="bool",
        default=False,
        help="ddpkit: the configured data module is a plain LightningDataModule on purpose; skip the guarantee "
        "tests it cannot pass instead of failing them",
    )


@pytest.fixture(scope="session")
def global_batch(configured, pytestconfig) -> dict:
    """`configured`, for tests of guarantees that only a GlobalBatchDataModule gives. Another data module fails
    them with the reason (a green run that checked nothing would read as a pass), unless the project's pytest
    configuration says `ddpkit_plain_data_ok = true`: then they skip."""
    if not configured["global_batch_data"]:
        reason = (
            f"{configured['data']} is not a GlobalBatchDataModule: 1-vs-N parity, exact resume and exactly-once "
            "evaluation are not guaranteed for it (the manual: vendor/ddpkit/docs/your-model.md)"
        )
        if pytestconfig.getini(PLAIN_DATA_OK):
            pytest.skip(f"{reason}; {PLAIN_DATA_OK} = true in pyproject.toml")
        pytest.fail(
            f"{reason}. Subclass GlobalBatchDataModule, or set {PLAIN_DATA_OK} = true under "
            "[tool.pytest.ini_options] in pyproject.toml to skip these tests",
            pytrace=False,
        )
    return configured


@pytest.fixture(scope="session")
def steps(global_batch) -> dict:
    """The steps of the shared runs: resume points, micro-batch size, whether a schedule is added (runs.plan). Every
    test that needs runs skips, pointing at the check that says why, where DDP would stop at its first step, and
    fails with the sentence where the training set draws from a generator of its own (data/draws.own_draws) or the
    loader draws per batch (data/draws.batch_draws)."""
    reason = unused_skip(global_batch)
    if reason:
        pytest.skip(reason)
    # With draws of the dataset's own, each rank and run would read other samples at the same index (the first run
    # would stop at its data check and every comparison then skip on "different datasets"); with draws per batch,
    # each rank would mix its share by its own draws (every comparison would fail on its numbers). The cause
    # instead, in every test that needs runs, and none started.
    for cause in ("dataset_draws", "batch_draws"):
        if global_batch.get(cause):
            pytest.fail(global_batch[cause], pytrace=False)
    return plan(global_batch)


@pytest.fixture(scope="session")
def cpu_runs(request, tmp_path_factory, steps) -> Waves:
    """Every CPU run the suite reads, by name, each started on first use with the runs of its wave that the session's
    selected tests read (runs.py); none after the first wave's ranks turn out to hold different data (check_data.py).
    A run's checkpoints are deleted once no test still to run reads it (after each test: Footprint.release), the rest
    at the end of the session (the logs stay), and the summary says how much they were."""
    runs, footprint = shared_runs(tmp_path_factory.mktemp("runs"), steps, data_gate), Footprint()
    runs.want(runs_read(request.session.items, steps))
    runs.before_start = footprint.measure  # before resume-2to1 deletes the state it starts from, too
    SESSION_RUNS.append((runs, steps, footprint))
    yield runs
    SESSION_RUNS.clear()
    footprint.measure(runs)
    casts = runs.base / "1dev-fp64" / "probe" / "float64-casts.json"
    KEPT_FLOAT64.extend(summary(json.loads(casts.read_text())) if casts.is_file() else [])
    remove_checkpoints(runs.base, delete=not os.environ.get(KEEP_CHECKPOINTS))
    FOOTPRINT.append((*footprint.written(), footprint.peak, footprint.model_bytes))


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After each test, delete the checkpoints of the runs that no later test reads (unless they are kept): a large
    model's session then holds a few runs' checkpoints at a time, not all of them."""
    if not SESSION_RUNS or os.environ.get(KEEP_CHECKPOINTS):
        return
    runs, steps, footprint = SESSION_RUNS[-1]
    items = item.session.items
    footprint.release(runs, runs_read(items[items.index(item) + 1 :], steps), steps)


def pytest_terminal_summary(terminalreporter) -> None:
    kept = f"kept ({KEEP_CHECKPOINTS} is set)"
    deleted = f"each run's deleted once no test left reads it, the logs kept ({KEEP_CHECKPOINTS}=1 keeps them)"
    for line in KEPT_FLOAT64:
        terminalreporter.write_line(f"ddpkit: {line}")
    for count, size, peak, model in FOOTPRINT:
        times = f" ({size / model:.0f} x the model's {model / 1e6:.1f} MB of float64 weights)" if model else ""
        at_once = f" ({peak / model:.1f} x)" if model else ""
        terminalreporter.write_line(
            f"ddpkit: the suite's runs wrote {count} checkpoint files, {size / 1e6:.0f} MB{times}, at most "
            f"{peak / 1e6:.0f} MB{at_once} on disk at once; {kept if os.environ.get(KEEP_CHECKPOINTS) else deleted}"
        )


GPU_PRECISIONS = ["64-true", "32-true", "bf16-mixed"]  # float64 first: the strict check


@pytest.fixture(scope="session")
def gpu_runs(tmp_path_factory, steps) -> dict[str, Run]:
    """1-GPU and 2-GPU runs per precision, one after another (they share the GPUs)."""
    from .commands import command

    base = tmp_path_factory.mktemp("parity-gpu")
    runs = {}
    for precision in GPU_PRECISIONS:
        for devices in (1, 2):
            name = f"{devices}gpu-{precision}"
            runs[name] = command(main_cmd(*fit(steps, "gpu", devices, precision)), base / name, base / f"{name}.log")()
    return runs


@pytest.fixture(scope="session")
def fake_gpus(tmp_path_factory):
    """`fake_gpus(n)`: environment in which a subprocess's torch.cuda reports n GPUs (fake_cuda.py), so
    checks that only ask torch.cuda take the branch a machine with n GPUs takes, on any machine."""
    site = tmp_path_factory.mktemp("fake-cuda-site")
    return lambda gpus: fake_env(site, gpus)
