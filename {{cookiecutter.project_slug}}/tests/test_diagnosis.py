"""The scaling doctor's analysis (ddp/diagnosis.py): its summary and verdicts on plain numbers."""

import pytest

from {{ cookiecutter.package_name }}.ddp.diagnosis import FIELDS, Thresholds, covered_seconds, diagnose, summarize


def rank(step_ms=50.0, data_ms=2.0, busy_ms=40.0, comm_ms=5.0, peak_mb=500.0, steps=100, batch=32) -> list[float]:
    """One rank's gathered row (FIELDS) for `steps` timed steps of the given per-step times."""
    per = {"data_s": data_ms, "busy_s": busy_ms, "comm_s": comm_ms, "step_s": step_ms}
    row = {"steps": steps, "wall_s": steps * step_ms / 1000, "samples": steps * batch, "timed_steps": steps}
    row.update({k: steps * v / 1000 for k, v in per.items()})
    row["peak_mem_bytes"] = peak_mb * 2**20
    return [row[f] for f in FIELDS]


def verdicts(*rows: list[float]) -> list[str]:
    s = summarize(list(rows), {"num_workers": 0, "pin_memory": False, "grad_mb": 1.0})
    return [f["cause"] for f in diagnose(s, Thresholds())]


def test_balanced_numbers_are_healthy():
    """Compute-dominated, balanced ranks: no finding at all."""
    assert verdicts(rank(), rank()) == []


def test_summary_numbers():
    """Throughput adds over ranks; shares are of the step; spread and imbalance are max/min."""
    s = summarize([rank(peak_mb=500), rank(peak_mb=750)], {})
    assert s["samples_per_s"] == pytest.approx(2 * 32 / 0.05)
    assert s["step_ms"] == pytest.approx(50) and s["data_wait_pct"] == pytest.approx(4)
    assert s["comm_pct"] == pytest.approx(10) and s["memory_imbalance"] == pytest.approx(1.5)
    assert s["ranks"][0]["compute_ms"] == pytest.approx(35) and s["ranks"][0]["other_ms"] == pytest.approx(8)


def test_data_wait_share_is_data_bound():
    """A quarter of each step waiting for batches is data-bound, with the worker count in the fix."""
    s = summarize([rank(data_ms=12.5, busy_ms=30)] * 2, {"num_workers": 2, "pin_memory": False, "grad_mb": 1.0})
    (finding,) = diagnose(s, Thresholds())
    assert finding["cause"] == "data-bound" and "now 2" in finding["fix"] and finding["fix"].startswith("25%")


def test_comm_share_uses_the_rank_that_waits_least():
    """A slow rank makes the others wait in the all-reduce: straggler, not communication-bound."""
    fast = rank(data_ms=2, busy_ms=45, comm_ms=35)  # own work 12 ms, 35 ms in the all-reduce
    slow = rank(data_ms=2, busy_ms=45, comm_ms=3)  # own work 44 ms
    assert verdicts(fast, slow) == ["straggler"]
    assert verdicts(rank(comm_ms=20), rank(comm_ms=18)) == ["communication-bound"]


def test_communication_fix_keeps_the_global_batch_promise():
    """The advice grows the global batch (micro-batches for memory), never Lightning's accumulate_grad_batches,
    which GlobalBatchDataModule refuses because it would change the global batch behind the user's back."""
    s = summarize([rank(comm_ms=20)] * 2, {})
    (finding,) = diagnose(s, Thresholds())
    assert "a larger --data.global_batch_size (now 32 per device and batch" in finding["fix"]
    assert "with --data.micro_batch_size" in finding["fix"]


def test_short_steps_are_too_little_work():
    """4 ms steps are flagged before anything else they cause."""
    short = rank(step_ms=4, data_ms=0.2, busy_ms=3, comm_ms=1.5)
    assert verdicts(short, short) == ["too-little-work", "communication-bound"]


def test_memory_imbalance_names_the_ranks():
    """1.8x the memory on rank 1 is reported first, naming rank 1 and rank 0."""
    s = summarize([rank(peak_mb=500), rank(peak_mb=900)], {})
    (finding,) = diagnose(s, Thresholds())
    assert finding["cause"] == "memory-imbalance"
    assert finding["fix"].startswith("rank 1 peaks at 1.8x the memory of rank 0")


def test_no_timed_step_is_unmeasured():
    """A fit that ended inside the warm-up has no numbers to judge, and says so instead of guessing."""
    assert verdicts(rank(steps=0), rank(steps=0)) == ["unmeasured"]


def test_thresholds_decide():
    """The same numbers pass or fail with the threshold moved."""
    s = summarize([rank(comm_ms=12)] * 2, {})
    assert diagnose(s, Thresholds()) == []
    assert [f["cause"] for f in diagnose(s, Thresholds(comm_share=0.2))] == ["communication-bound"]


def test_overlapping_all_reduces_count_once():
    """Bucket intervals are merged: (0,2) + (1,3) + (5,6) cover 4 s."""
    assert covered_seconds([(5.0, 6.0), (0.0, 2.0), (1.0, 3.0)]) == pytest.approx(4.0)
