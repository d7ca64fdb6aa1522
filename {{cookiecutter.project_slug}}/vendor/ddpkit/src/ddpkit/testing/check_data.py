"""What must hold before any two runs can be compared: every rank holds the same data, and DDP can train the module.

Each fails one test with one line that names the cause, and the tests that compare runs skip with a pointer to it
instead of failing on a number:
- a parameter that gets no gradient in training stops DDP at its first step unless the strategy looks for unused
  parameters: found in one step on 1 device before any run (configured.py), so no run starts (plugin.py's `steps`);
- a dataset built differently in each process (a vocabulary numbered in a set's order, an unseeded shuffle): each
  rank of the first 2-device run fingerprints its train and val sets before training (fingerprints.py), and the run
  stops there when they differ; the later waves do not start (runs.Waves' gate).
"""

import json

import pytest

from .fingerprints import first_difference, rank_difference
from .runs import GATED_BY, Waves, reads

UNUSED_TEST = "test_every_parameter_gets_a_gradient_or_ddp_looks_for_unused_ones"
DATA_TEST = "test_every_rank_holds_the_same_datasets"
# The runs whose ranks fingerprint their datasets (runs.run_args' `fingerprints`).
ONE, TWO = "1dev-fp64", "2dev-fp64"


def unused_skip(configured: dict) -> str:
    """Why the runs are not started ("" if they can be): a parameter gets no gradient and DDP does not look for it."""
    if not configured.get("unused_parameters"):
        return ""
    return f"not run: DDP would stop at the first step on a parameter without a gradient ({UNUSED_TEST} says which)"


def run_fingerprints(runs: Waves, name: str, ranks: int) -> list[dict] | None:
    """The fingerprints each rank of run `name` wrote (parity_probe.Probe.compare_data), once its wave has run; None
    where a rank wrote none (the run failed before it got there)."""
    probe = runs.folder(name) / "probe"
    files = [probe / f"data-rank{r}.json" for r in range(ranks)]
    return [json.loads(f.read_text()) for f in files] if all(f.exists() for f in files) else None


def data_difference(runs: Waves) -> str:
    """The first place where a rank's datasets depart from rank 0's in the 2-device run, or the 2-device run's from
    the 1-device run's, as one line; "" where they agree or were not fingerprinted (a run failed before)."""
    two, one = run_fingerprints(runs, TWO, 2), run_fingerprints(runs, ONE, 1)
    if two is None:
        return ""
    differs = rank_difference(two)
    if differs or one is None:
        return differs
    for name, first in one[0].items():
        where = first_difference(first, two[0].get(name, {"length": 0}))
        if where:
            return (
                f"the 2-device run's {name} dataset differs from the 1-device run's {where}: built differently per "
                "run (from the device count, the time, a seed of its own?)"
            )
    return ""


def data_gate(runs: Waves) -> str:
    """runs.Waves' gate: the reason every comparison skips where the first wave's ranks or runs hold different data."""
    if not data_difference(runs):
        return ""
    return f"not compared: the runs' ranks hold different datasets ({DATA_TEST} says which and where)"


def test_every_parameter_gets_a_gradient_or_ddp_looks_for_unused_ones(global_batch):
    """Every parameter that requires a gradient gets one in each backward of a training step, or the configured DDP
    strategy looks for unused parameters: otherwise DDP stops at the first step. Found in one step on 1 device
    (configured.py); the line names the parameters and the setting, and the tests that need runs skip."""
    if global_batch.get("unused_parameters"):
        pytest.fail(global_batch["unused_parameters"], pytrace=False)


@reads(*GATED_BY)
def test_every_rank_holds_the_same_datasets(cpu_runs):
    """Before training, each rank of the 2-device float64 run fingerprints the data module's train and val sets (the
    length and a hash of each sample as the dataset returns it; of evenly spaced ones in a large set), as the
    1-device run does: every rank holds rank 0's datasets, and rank 0 the 1-device run's."""
    differs = data_difference(cpu_runs)
    if differs:
        pytest.fail(differs, pytrace=False)
    missing = [name for name, ranks in ((ONE, 1), (TWO, 2)) if run_fingerprints(cpu_runs, name, ranks) is None]
    assert not missing, "\n".join(cpu_runs.failed.get(name, f"run {name} wrote no fingerprints") for name in missing)
