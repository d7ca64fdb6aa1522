"""The doctor's parts measured independently: the same work timed alone, outside any training, and how far
the doctor's number may be from it. Used by test_scaling_gap.py (the tests' sleeping model) and
test_doctor_numbers.py (the configured model)."""

import json
import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
THREADS = {"OMP_NUM_THREADS": "1"}  # as scaling.py gives 2 ranks on 2 cores

# How far a part of the doctor's step may be from the same work timed alone (ms, given the time alone).
# Both sides leave out the time threads waited for a CPU: that is host contention (on 2 ranks on 2 cores
# gloo's threads waited ~14 of the ~37 ms of a 32 MB all-reduce alone, ~2 of the ~3 ms of the digits
# example's 0.1 MB in the step). Measured on the 2-core host, in-step minus alone, over 6 runs of the
# digits example (4 idle, 2 beside two CPU hogs) and 5 of the sleeping model's cases (4 idle, 1 with hogs):
# comm 0.1 MB +0.13 to +0.67 ms (alone 0.33-0.75), 0.25 MB -0.36 to +1.09 (alone 0.61-1.17; +1.09 on the
# straggler case once, +0.27 at most otherwise), 32 MB -2.6 to +1.4 (idle, alone 22.6-30.4) and -10.2 ms
# (hogs: alone 41.6, -24%); data +0.27 to +0.83 ms on loaders of 0.3-0.8 ms (Lightning's fetch around the
# loader's own time), within 1.5 ms at 120 ms. The bounds leave room above the worst of these and still
# catch what the comm part held before it left out the threads' wait and the ranks' turns at being last
# (digits: 3.5 ms against 0.85 alone, 2.65 ms over where the bound allows 1.8).
TOLERANCE = {
    "comm": lambda alone: 0.35 * alone + 1.5,
    "data": lambda alone: 0.05 * alone + 1.5,
}


def waited_s(all_threads: bool = False) -> float:
    """Seconds the calling thread (or all of this process's threads, summed) spent ready to run but without
    a CPU (Linux schedstat; 0 without it): both sides of a comparison leave this out, as the doctor does."""
    paths = [f"/proc/self/task/{t}/schedstat" for t in os.listdir("/proc/self/task")] if all_threads else []
    total = 0
    for path in paths or ["/proc/thread-self/schedstat"]:
        try:
            with open(path) as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError):
            pass  # a thread that ended, or no schedstat: counts 0
    return total / 1e9


def _last_json(cmd: list[str]) -> dict:
    from helpers import finish, start  # not at the top: the measuring scripts import this module too

    result = finish(start(cmd, TESTS, THREADS), timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def allreduce_ms(sizes_mb: list[float]) -> dict[float, float]:
    """Median ms of a gloo all-reduce of each size on 2 processes, outside any training (allreduce_alone.py)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    out = _last_json([*cmd, str(TESTS / "allreduce_alone.py"), *map(str, sizes_mb)])
    return {float(mb): ms for mb, ms in out.items()}


def loader_ms(devices: int, epochs: int = 2) -> float:
    """ms per batch of the configured training loader, as rank 0 of `devices` gets it (loader_alone.py)."""
    return _last_json([sys.executable, str(TESTS / "loader_alone.py"), str(devices), str(epochs)])["ms_per_batch"]
