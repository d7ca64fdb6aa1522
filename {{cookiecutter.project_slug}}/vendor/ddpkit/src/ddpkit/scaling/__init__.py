"""Measuring: the scaling doctor (doctor.py: the callback; measure.py: a step's parts; diagnosis.py: the verdict;
record.py: doctor.json), the gap between two runs (gap.py), MFU and throughput (throughput.py), and the sweep
(`python -m ddpkit.scaling`: sweeper.py, its preflight ranks.py).

`ddpkit.scaling` was the sweep's module until 0.4.0: its names are still found here, loaded on first use (the
package itself imports nothing: the sweep's driver starts without torch or Lightning).
"""

import importlib

_OLD_NAMES = {
    **dict.fromkeys(
        ["PART_HEADS", "SWEEP_MARKER", "explain_runs", "load_summary", "main", "main_command", "mark_sweep"],
        "sweeper",
    ),
    **dict.fromkeys(
        ["markdown", "plot", "predictions", "run_fit", "sweep", "table_rows", "threads_per_process"], "sweeper"
    ),
    **dict.fromkeys(["preflight", "visible_cores"], "ranks"),
}


def __getattr__(name: str):
    if name not in _OLD_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_OLD_NAMES[name]}", __name__), name)
