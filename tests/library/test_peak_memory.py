"""The doctor's host memory column is the rank's own peak, not the peak of the process that started it."""

import subprocess
import sys

CHILD = "from ddpkit.scaling.doctor import host_peak_rss; print(host_peak_rss())"


def test_a_process_started_by_a_large_one_reports_its_own_peak():
    """A child exec'd by a process that touched 1.5 GiB reports its own peak (importing ddpkit, torch and
    Lightning: ~350 MB here), not the parent's (getrusage's maxrss survives fork and exec: 1.5 GiB and more)."""
    parent = (
        "import subprocess, sys\n"
        "ballast = bytearray(1536 * 2**20)\n"
        "for i in range(0, len(ballast), 4096): ballast[i] = 1\n"
        f"print(subprocess.run([sys.executable, '-c', {CHILD!r}], capture_output=True, text=True).stdout)\n"
    )
    out = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=120, check=True)
    child_peak = int(out.stdout.split()[0])
    assert 50 * 2**20 < child_peak < 1024 * 2**20, child_peak
