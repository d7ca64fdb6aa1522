"""Fixtures of the template's tests (baked projects, the jobs that run in the background) and the order the
tests run in.

The order: tests marked `timing` (the doctor's and the scaling gap's, which assert how long things took) run
first, while nothing else of ours runs. The first test after them queues the long jobs that time nothing, those
its session will read: the generated README's commands (readme_commands.py), the own project's story
(own_project.py), the oldest releases (test_oldest.py), the benchmarks' tiny runs (test_benchmarks.py) and
the GPU check's dry run (test_gpu_check.py), with tests/library's early jobs, in one queue (tests/library/early.py: a
few at a time, the longest first). The other tests run meanwhile; the ones that read a job wait for its result.
From then on, the processes the tests start let idle OpenMP threads sleep (`idle_threads_sleep`).

Tests marked `environ` (tests/library/test_environment.py: units whose input is a variable they set in this process)
run after the timing tests and before the jobs start: a job's processes inherit this process's environment
whenever they start, so a variable set by a test meanwhile reaches them (a BERT's session, started while
test_model_families.py had PARITY_ARGS set, ran that module's ResNet: CI of 2026-12-04). Once jobs have started,
setting or removing a variable here fails (`_no_environment_changes_under_jobs`).

The cores are busy from the jobs' start until the jobs end; then only the tests here run, one after another, each
with a process or two: in a CI run of 2026-12-06 the last 230 s had the cores 10-84% idle. So the modules that read
no job run first; then those marked `many_processes` (test_model_families.py: the first waves of 10 models at once),
about when the jobs end, so that their runs fill the cores the jobs leave; then the modules that read a job (a test
waiting for its job holds up every test after it).
"""

import inspect
import os
import signal
import subprocess
import sys
from collections.abc import Callable, MutableMapping
from concurrent.futures import Future
from pathlib import Path

import pytest
from bakes import bake, fresh_env, torch_pin

sys.path.insert(0, str(Path(__file__).parent / "library"))  # early.py, the one queue of both levels' jobs
import early  # noqa: E402

# Session fixtures that start a background job, started by the first test that is not a timing one.
BACKGROUND = ("readme_runs", "own_project_story", "benchmark_run", "oldest_run", "gpu_check_dry")


MAIN_PID = os.getpid()
TESTS = Path(__file__).resolve().parent
# Where os.environ's methods and monkeypatch's setenv run, as the hook below sees their frames.
ENVIRON_CODE = {
    f.__code__.co_filename for f in (type(os.environ).__setitem__, MutableMapping.setdefault, pytest.MonkeyPatch.setenv)
}
# A shell's background job (`bash .ci/run &`, nohup) starts with SIGINT ignored, and every process it starts inherits
# that: Python then never raises KeyboardInterrupt, and the tune worker that test_tune_schedule stops with Ctrl-C ran
# its study to the end, or waited on a held trial until the test's timeout (runs of .ci/run in the background on this
# machine, 2026-12-06). The session and the processes it starts get Ctrl-C's default action, as from a terminal.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# No test reaches a dataset or model hub (this machine has no network): every job's runs inherit it from the start.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# The suite's processes at once over every session here (ddpkit/testing/slots.py), inherited by every job's processes:
# with 4 runs (ddpkit < 0.10 counted runs, not processes), one family session held all 4 slots while the other
# sessions' runs waited, beside jobs that take none (the README's chains, pip); unlimited, test_model_families' first
# waves alone started 40 processes (load 48, runs timing out). Both on 2026-12-06, docs/measurements.md. 6: the same
# work costs more CPU the more processes share the cores (8 two-process toy fits: 43-44 CPU-s 8 at once, 37-38 2 at
# once), and with 6 (and 3 job slots, early.py) against 12 (and 4) a CI run sampled 1979 CPU-s against 2105, pytest
# 1136 s against 1189, the cores still never idle from minute 4 to 17 (2026-12-07, docs/measurements.md).
os.environ.setdefault("DDPKIT_SUITE_RUNS", "6")


def pytest_configure(config):
    # Where a slow CI run's time went, in its record: the 40 slowest setups and calls (a module fixture that starts
    # runs counts in its first test's setup), beside the background jobs' times (pytest_terminal_summary).
    if config.option.durations is None:
        config.option.durations = 40
    config.addinivalue_line("markers", "timing: asserts durations; runs first, before any background job starts")
    config.addinivalue_line("markers", "environ: sets environment variables; runs before any background job starts")
    config.addinivalue_line(
        "markers", "many_processes: starts more runs at once than the cores; runs after the library's other tests"
    )


def pytest_collection_modifyitems(items):
    # stable: timing tests first, then those that set variables, then the rest (with the jobs): the modules that read no
    # job, then the `many_processes` ones, then those that read a job (whole modules: a module fixture set up once)
    jobs = {*early.JOBS, *BACKGROUND}
    readers = {item.path for item in items if jobs & set(getattr(item, "fixturenames", ()))}

    def key(item) -> tuple:
        late = 2 if item.path in readers else item.get_closest_marker("many_processes") is not None
        return (*(item.get_closest_marker(name) is None for name in early.BEFORE_JOBS), late)

    items.sort(key=key)


def _no_environment_changes_under_jobs(event: str, args: tuple) -> None:
    """Audit hook: a variable that a test (code under tests/) sets or removes in this process once the jobs have
    started fails the test. os.environ's writes go through os.putenv and os.unsetenv, which raise these events.
    Writes by the libraries a test calls (Lightning's PL_GLOBAL_SEED, pytest's PYTEST_CURRENT_TEST, ddpkit.run.cli's
    TQDM_MINITERS) are theirs, the same in every process that runs that code, and pass."""
    if event not in ("os.putenv", "os.unsetenv") or not early.started() or os.getpid() != MAIN_PID:
        return
    frame = inspect.currentframe().f_back
    while frame is not None and frame.f_code.co_filename in ENVIRON_CODE:
        frame = frame.f_back  # os.environ's methods, and monkeypatch's setenv on behalf of its caller
    if frame is not None and Path(frame.f_code.co_filename).is_relative_to(TESTS):
        raise RuntimeError(
            f"{os.fsdecode(args[0])} set or removed by a test while background jobs run: their processes would "
            "inherit it. Mark the test `environ` (tests/library/test_environment.py) or give its process an env."
        )


sys.addaudithook(_no_environment_changes_under_jobs)


# Skips other than a GPU test's, which fail the session: here every optional library is installed (requirements.txt)
# and every check can run, so a skip means something is missing (an adapter's library, a module importorskip'ed
# away) or a check that no longer applies, and a green run would hide it.
UNEXPECTED_SKIPS: list[str] = []


def pytest_collectreport(report):
    if report.skipped:  # a whole module skipped at import (pytest.importorskip)
        UNEXPECTED_SKIPS.append(f"{report.nodeid}: {report.longrepr[2] if isinstance(report.longrepr, tuple) else ''}")


def pytest_runtest_logreport(report):
    if report.skipped and "gpu" not in report.keywords:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        UNEXPECTED_SKIPS.append(f"{report.nodeid}: {reason}")


def pytest_sessionfinish(session, exitstatus):
    if UNEXPECTED_SKIPS and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if early.TIMES:  # where a session's time went, and what a slow one waited for
        terminalreporter.section(f"background jobs (at most {early.SLOTS} at once): seconds queued, seconds run")
        for name, (queued, ran) in sorted(early.TIMES.items(), key=lambda item: sum(item[1])):
            terminalreporter.write_line(f"{name:20} {queued:7.0f} {ran:7.0f}")
    if UNEXPECTED_SKIPS:
        terminalreporter.section("skips that fail this session (only a GPU test may skip here)")
        for line in UNEXPECTED_SKIPS:
            terminalreporter.write_line(line)


@pytest.fixture(scope="module", autouse=True)
def _background_after_timing(request):
    if not early.before_jobs(request.node):
        request.getfixturevalue("idle_threads_sleep")
        request.getfixturevalue("background")


@pytest.fixture(scope="session")
def idle_threads_sleep() -> None:
    """After the timing tests, every process the suite starts lets an idle OpenMP thread sleep at once instead of
    spinning first (libgomp's default): with a dozen processes on 2 cores, spinning threads take CPU from the ones
    with work. test_batchnorm alone: 46.4 and 48.4 CPU-s before, 39.1 and 41.0 after (docs/measurements.md). No
    result depends on it; the timing tests run before it, with the default, as a user's runs do."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="session")
def background(request, tmp_path_factory) -> None:
    """Start the background jobs that the selected tests read (by fixture name): this level's and tests/library's
    early jobs together, so that early.py takes them all in its order."""
    used = {name for item in request.session.items for name in getattr(item, "fixturenames", ())}
    jobs = {name: job for name, job in early.JOBS.items() if name in used}
    for name in BACKGROUND:
        if name in used:
            jobs[name] = globals()[f"_{name}"](request)
    prepare = {}
    if "oldest_run" in jobs:  # the oldest torch's download (network, not CPU) outside the slots
        from test_oldest import oldest_wheels

        prepare["oldest_run"] = oldest_wheels
    early.start(jobs, tmp_path_factory.mktemp, prepare)


@pytest.fixture(scope="session")
def default_project(tmp_path_factory) -> Path:
    """The project baked with every default, shared by the tests that only read it."""
    return bake(tmp_path_factory.mktemp("default"))


@pytest.fixture(scope="session")
def lm_project(tmp_path_factory) -> Path:
    """The project baked with the language-model example too."""
    return bake(tmp_path_factory.mktemp("lm"), lm_example="yes")


@pytest.fixture(scope="session")
def readme_project(tmp_path_factory) -> Path:
    """The project the generated README's commands run in (with the language-model and streaming examples)."""
    return bake(tmp_path_factory.mktemp("docs"), lm_example="yes", streaming_example="yes")


def torch_env(venv: Path) -> dict[str, str]:
    """A new virtual environment holding only the pinned torch (this machine's CPU wheel; it is installed first,
    as every install instruction says); the environment variables that select it."""
    env = fresh_env(venv)
    cmd = ["python", "-m", "pip", "install", "-q", torch_pin()]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return env


# The background jobs: each a function of a fresh folder (early.start), whose Future the fixture of its name gives.
def _readme_runs(request) -> Callable[[Path], dict]:
    """The generated README's commands (readme_commands.run_readme) in a new virtual environment that its own
    install commands fill; test_docs.py waits for the result."""
    from readme_commands import run_readme

    project = request.getfixturevalue("readme_project")

    def job(folder: Path) -> dict:
        (folder / "bin").mkdir()
        return run_readme(project, torch_env(folder / "venv"), folder / "bin")

    return job


def _benchmark_run(request) -> Callable[[Path], dict]:
    """The benchmarks' tiny runs, the MLP's and the language model's (test_benchmarks.run_benchmarks); their tests
    wait for the reports."""
    from test_benchmarks import run_benchmarks

    return run_benchmarks


def _gpu_check_dry(request) -> Callable[[Path], tuple]:
    """The GPU check's dry run in this environment (test_gpu_check.dry_run); its tests wait for the record."""
    from test_gpu_check import dry_run

    return dry_run


def _oldest_run(request) -> Callable[[Path], dict]:
    """The oldest supported releases under a default bake (test_oldest.oldest_story)."""
    from test_oldest import oldest_story

    return oldest_story


def _own_project_story(request) -> Callable[[Path], dict]:
    """The user's-project story (tests/own_project.py); its tests wait for the record."""
    from own_project import story

    return story


# Each job's fixture depends on the jobs' start: session fixtures are set up before the modules' autouse one, so a run
# of one of these tests alone (test_benchmarks.py, say) would ask for its job before anything started it.
@pytest.fixture(scope="session")
def readme_runs(idle_threads_sleep, background) -> Future:
    return early.future("readme_runs")


@pytest.fixture(scope="session")
def benchmark_run(idle_threads_sleep, background) -> Future:
    return early.future("benchmark_run")


@pytest.fixture(scope="session")
def gpu_check_dry(idle_threads_sleep, background) -> Future:
    return early.future("gpu_check_dry")


@pytest.fixture(scope="session")
def oldest_run(idle_threads_sleep, background) -> Future:
    return early.future("oldest_run")


@pytest.fixture(scope="session")
def own_project_story(idle_threads_sleep, background) -> Future:
    return early.future("own_project_story")
