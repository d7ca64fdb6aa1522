"""How many of the suite's runs run at once on this machine, over every pytest session that runs the suite.

A wave starts its runs together (waves.py), and a machine may hold several sessions (a CI runner's jobs, the
template's own CI with a dozen): on 2 cores that made 50 processes at once, and the runs' hang timeouts then fired
on runs that were only waiting for a core (2026-12-06, docs/measurements.md of the template). So each run first
takes one of `limit()` slots, a lock file locked with `flock` in a folder per user (tune.devices' `lock`, as the
tuner's claims of GPUs): the lock dies with the process that holds it, killed or not, so a crashed session leaves no
slot taken. A run's own timeout counts from when it has its slot. DDPKIT_SUITE_RUNS sets the number (default: twice
the cores this process may run on); a model whose runs need much memory each sets it to as many as memory holds.
"""

import os
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from ..scaling.ranks import visible_cores
from ..tune.devices import lock

VARIABLE = "DDPKIT_SUITE_RUNS"
WAIT = 0.1  # seconds between two looks for a free slot


def limit(environ: Mapping[str, str] = os.environ) -> int:
    """DDPKIT_SUITE_RUNS, else twice the visible cores (at least 2)."""
    value = environ.get(VARIABLE, "").strip()
    if not value:
        return max(2, 2 * visible_cores())
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{VARIABLE}={value!r}: how many of the suite's runs may run at once, a whole number >= 1")
    return int(value)


def folder() -> Path:
    return Path(tempfile.gettempdir()) / f"ddpkit-suite-runs-{os.getuid()}"


@contextmanager
def run_slot(where: Path | None = None, slots: int | None = None) -> Iterator[int]:
    """Hold one of `slots` (default `limit()`) slots in `where` (default `folder()`) for the block; waits for one to be
    free. Yields its number."""
    where, slots = where or folder(), slots or limit()
    where.mkdir(parents=True, exist_ok=True)
    while True:
        for number in range(slots):
            fd = lock(where, f"slot{number}")  # the tuner's claims' lock: None while another process holds it
            if fd is None:
                continue
            try:
                yield number
            finally:
                os.close(fd)  # the lock goes with its descriptor
            return
        time.sleep(WAIT)
