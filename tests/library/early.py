"""Jobs that time nothing (faults, the preflight, the family sessions; at the top level the README's commands, the
own project's story, the oldest releases, the benchmark) start together with the first test that times nothing, so
that their waits (a hung rank's timeout, sleeping steps, pip) overlap with other tests. The tests whose timings are
asserted (marked `timing`: the doctor's, the gap's) run before that, alone (tests/conftest.py); their runs still
wait for any job that is running (`quiet`), so that nothing of ours competes with them for the cores.

At most SLOTS jobs run at once, taken in ORDER: each job starts processes of its own (ranks, pytest sessions, pip),
and with all thirteen at once on 2 cores (load 30 and more) runs that take 10 s alone timed out at 120 s and 300 s
(CI of 2026-12-03, docs/measurements.md). A job's own timeouts count from when it starts, not from when it queued.

A test module registers a job with `@early("name")` (a function of a fresh folder) and a fixture of the same
name that returns `result("name")`; conftest.py starts the jobs whose fixture a selected test uses.
"""

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

# 3: with 4 (and DDPKIT_SUITE_RUNS 12, tests/conftest.py) the load stayed at 9-15 on 2 cores, where the same work costs
# more CPU; 3 kept the cores busy and cut a CI run's CPU by 6% (2026-12-07, docs/measurements.md). Not 2: the
# README's commands and the oldest releases, first in ORDER, would hold both slots for 500 s while the first library
# tests wait for the short jobs they read.
SLOTS = 3
# In this order when slots are short: first the README's commands (4 chains of commands, the longest job) and the
# oldest releases (queued behind the short jobs, its end was the jobs' last, CI of 2026-12-06; it joins the queue once
# its preparation, the download of torch 2.4.0's CUDA wheels, 2.74 GB, has ended: 500 s and more on CI's fresh
# machines, which held a slot while it waited on the network),
# then the short ones that the first library tests read (a test waiting for its job holds up every test after it),
# then the long ones (the family sessions, the own project's story), then the rest. Every job takes a slot,
# those that mostly wait too (the fault scenarios, the tune workers): a trial or a scenario still starts
# interpreters, and the tune workers' study timed out at 300 s beside 4 others (CI of 2026-12-04).
ORDER = [
    "readme_runs",
    "oldest_run",
    "batchnorm_cli_runs",
    "cluster_jobs",
    "faults",
    "lr_finder_runs",
    "preflight",
    "trackers",
    "family_sessions",
    "own_project_story",
    "tune_ddp",
    "tune_workers",
    "tune_schedule",
    "tune_metric",
    "benchmark_run",
    "gpu_check_dry",
]

JOBS: dict[str, Callable[[Path], Any]] = {}
TIMES: dict[str, tuple[float, float]] = {}  # name: (seconds queued or preparing, seconds run), once it has ended
_started: dict[str, Future] = {}
_pool = ThreadPoolExecutor(len(ORDER) + 8, thread_name_prefix="early")
_turn = threading.Condition()
_queued: list[str] = []
_running: set[str] = set()


def early(name: str) -> Callable:
    """Register the decorated function (folder -> result) as the early job `name`."""

    def register(job: Callable[[Path], Any]) -> Callable[[Path], Any]:
        JOBS[name] = job
        return job

    return register


def start(
    jobs: dict[str, Callable[[Path], Any]],
    folder: Callable[[str], Path],
    prepare: dict[str, Callable[[Path], Any]] | None = None,
) -> None:
    """Queue the jobs {name: function of a fresh folder} not yet started, each given `folder(name)`. A job named in
    `prepare` first runs that function of its folder at once, outside the slots, and joins the queue when it is done:
    a download (the oldest releases' 2.74 GB of wheels) waits on the network, and holding a slot meanwhile kept the
    jobs queued behind it from the cores."""
    prepare = prepare or {}
    names = sorted((n for n in jobs if n not in _started), key=_rank)
    with _turn:
        _queued.extend(n for n in names if n not in prepare)
    for name in names:
        _started[name] = _pool.submit(_in_turn, name, jobs[name], folder(name), prepare.get(name))


def _rank(name: str) -> int:
    return ORDER.index(name) if name in ORDER else len(ORDER)


def _in_turn(name: str, job: Callable[[Path], Any], folder: Path, prepare: Callable[[Path], Any] | None) -> Any:
    queued = time.monotonic()
    if prepare is not None:
        prepare(folder)  # raising, it ends the job there: its tests report the error
        with _turn:
            _queued.append(name)
    with _turn:
        _turn.wait_for(lambda: len(_running) < SLOTS and min(_queued, key=_rank) == name)
        _queued.remove(name)
        _running.add(name)
        _turn.notify_all()  # a free slot may let the next one start too
    began = time.monotonic()
    try:
        return job(folder)
    finally:
        with _turn:
            _running.remove(name)
            TIMES[name] = (began - queued, time.monotonic() - began)
            _turn.notify_all()


# Markers of the tests that run before any job starts, in their order: the timing tests (nothing else of ours on the
# cores), then those that set environment variables (which a job's processes would inherit).
BEFORE_JOBS = ("timing", "environ")


def before_jobs(node) -> bool:
    """Whether the tests of `node` (a test or a module) run before the jobs start."""
    return any(node.get_closest_marker(name) is not None for name in BEFORE_JOBS)


def started() -> bool:
    """Whether any job has been queued: from then on, processes of jobs may start at any moment."""
    return bool(_started)


def future(name: str) -> Future:
    return _started[name]


def result(name: str) -> Any:
    """The job's result, once it has ended (its exception, if it raised)."""
    return _started[name].result()


def quiet() -> None:
    """Wait until every early job has ended (failed ones too: their tests report them)."""
    wait(list(_started.values()))
