"""The doctor's parts measured independently: the same work timed alone, outside any training, and how far
the doctor's number may be from it (test_scaling_gap.py)."""

import json
import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

# How far a part of the doctor's step may be from the same work timed alone (ms, given the time alone), both
# sides without the time threads waited for a CPU: above the worst of 11 runs, idle and beside CPU hogs, and
# still below what the comm part held before it left that wait out (docs/measurements.md, the scaling doctor). The
# 32 MB all-reduce, bound by memory bandwidth that no wait counter sees, moved both ways in CI: +50% and -43% of
# alone (2026-12-04), so comm allows half of alone; digits' 2.65 ms over 0.85 alone still exceeds it.
TOLERANCE = {
    "comm": lambda alone: 0.5 * alone + 1.5,
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


def allreduce_ms(sizes_mb: list[float]) -> dict[float, float]:
    """Median ms of a gloo all-reduce of each size on 2 processes (1 thread each, as the runs get), outside any
    training (allreduce_alone.py)."""
    from procs import run  # not at the top: allreduce_alone.py imports this module in its ranks

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [str(TESTS / "allreduce_alone.py"), *map(str, sizes_mb)]
    result = run(cmd, TESTS, timeout=300, env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:]
    return {float(mb): ms for mb, ms in json.loads(result.stdout.strip().splitlines()[-1]).items()}
