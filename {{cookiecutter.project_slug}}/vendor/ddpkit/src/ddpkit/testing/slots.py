"""How many of the suite's processes run at once on this machine, over every pytest session that runs the suite.

A wave starts its runs together (waves.py), and a machine may hold several sessions (a CI runner's jobs, the
template's own CI with a dozen): on 2 cores that made 50 processes at once, and the runs' hang timeouts then fired
on runs that were only waiting for a core (2026-12-06, docs/measurements.md of the template). So each run first
takes one of `limit()` slots per process it starts (a 2-device run 2), each a lock file locked with `flock` in a
folder per user (tune.devices' `lock`, as the tuner's claims of GPUs): the lock dies with the process that holds it,
killed or not, so a crashed session leaves no slot taken. A run takes all its slots at once or none, and its own
timeout counts from when it has them. DDPKIT_SUITE_RUNS sets the number (default: 4 x the cores this process may run
on); a model whose processes need much memory each sets it to as many as memory holds (a float64 rank holds about 5
copies of the model's weights): a slot is a process, so the limit is one of memory and of cores alike.
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
    """DDPKIT_SUITE_RUNS, else 4 x the visible cores (at least 4)."""
    value = environ.get(VARIABLE, "").strip()
    if not value:
        return max(4, 4 * visible_cores())
    if not value.isdigit() or int(value) < 1:
        raise ValueError(
            f"{VARIABLE}={value!r}: how many of the suite's processes may run at once, a whole number >= 1"
        )
    return int(value)


def folder() -> Path:
    return Path(tempfile.gettempdir()) / f"ddpkit-suite-runs-{os.getuid()}"


@contextmanager
def run_slot(where: Path | None = None, slots: int | None = None, processes: int = 1) -> Iterator[list[int]]:
    """Hold `processes` of `slots` (default `limit()`; all of them where there are fewer) slots in `where` (default
    `folder()`) for the block, taken together: waits until that many are free at once, holding none meanwhile (two
    runs each holding part of what they need would wait for each other). Yields their numbers."""
    where, slots = where or folder(), slots or limit()
    need = min(processes, slots)
    where.mkdir(parents=True, exist_ok=True)
    while True:
        held = {}
        for number in range(slots):
            fd = lock(where, f"slot{number}")  # the tuner's claims' lock: None while another process holds it
            if fd is not None:
                held[number] = fd
                if len(held) == need:
                    break
        try:
            if len(held) == need:
                yield sorted(held)
                return
        finally:
            for fd in held.values():
                os.close(fd)  # the lock goes with its descriptor
        time.sleep(WAIT)
