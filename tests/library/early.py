"""Runs that time nothing (faults, the preflight) start together with the first test that times nothing, so that
their waits (a hung rank's timeout, sleeping steps) overlap with other tests' start-ups. The tests whose timings
are asserted (marked `timing`: the doctor's, the gap's) run before that, alone (tests/conftest.py); their runs
still wait for any early job that is running (`quiet`), so that nothing of ours competes with them for the cores.

A test module registers a job with `@early("name")` (a function of a fresh folder) and a fixture of the same
name that returns `result("name")`; conftest.py starts the jobs whose fixture a selected test uses.
"""

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

JOBS: dict[str, Callable[[Path], Any]] = {}
_started: dict[str, Future] = {}


def early(name: str) -> Callable:
    """Register the decorated function (folder -> result) as the early job `name`."""

    def register(job: Callable[[Path], Any]) -> Callable[[Path], Any]:
        JOBS[name] = job
        return job

    return register


def start(names: list[str], folder: Callable[[str], Path]) -> ThreadPoolExecutor | None:
    """Start the jobs `names` at once, each in a thread, each given `folder(name)`."""
    if not names:
        return None
    pool = ThreadPoolExecutor(len(names), thread_name_prefix="early")
    for name in names:
        _started[name] = pool.submit(JOBS[name], folder(name))
    return pool


def result(name: str) -> Any:
    """The job's result, once it has ended (its exception, if it raised)."""
    return _started[name].result()


def quiet() -> None:
    """Wait until every early job has ended (failed ones too: their tests report them)."""
    wait(list(_started.values()))
