"""The scaling doctor's analysis (ddp/diagnosis.py): its summary and verdicts on plain numbers."""

import json

import pytest

from ddpkit.scaling.diagnosis import FIELDS, Thresholds, covered_seconds, diagnose, summarize
from ddpkit.scaling.gap import EFFICIENCY_LINE, PARTS, explain, predict, ring_allreduce_ms
from ddpkit.scaling.record import DoctorRecord, SchemaError


def rank(
    step_ms=50.0,
    data_ms=2.0,
    busy_ms=40.0,
    comm_ms=5.0,
    peak_mb=500.0,
    steps=100,
    batch=32,
    wait_ms=0.0,
    data_wait_ms=0.0,
    busy_wait_ms=0.0,
    comm_wait_ms=0.0,
    node=0,
    device=-1,
    micro=1,
) -> list[float]:
    """One rank's gathered row (FIELDS) for `steps` timed steps of the given per-step times (wait: for a CPU), each
    of `micro` micro-batches."""
    per = {"data_s": data_ms, "busy_s": busy_ms, "comm_s": comm_ms, "step_s": step_ms, "cpu_wait_s": wait_ms}
    per.update({"data_cpu_wait_s": data_wait_ms, "busy_cpu_wait_s": busy_wait_ms, "gc_s": 0.0})
    per["comm_cpu_wait_s"] = comm_wait_ms
    row = {"steps": steps, "wall_s": steps * step_ms / 1000, "samples": steps * batch, "timed_steps": steps}
    row["micro_batches"] = steps * micro
    row.update({k: steps * v / 1000 for k, v in per.items()})
    row["node_rank"], row["device_index"], row["peak_mem_bytes"] = node, device, peak_mb * 2**20
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
    assert s.samples_per_s == pytest.approx(2 * 32 / 0.05)
    assert s.step_ms == pytest.approx(50) and s.data_wait_pct == pytest.approx(4)
    assert s.comm_pct == pytest.approx(10) and s.memory_imbalance == pytest.approx(1.5)
    assert s.ranks[0].compute_ms == pytest.approx(35) and s.ranks[0].other_ms == pytest.approx(8)


def test_data_wait_share_is_data_bound():
    """A quarter of each step waiting for batches is data-bound, with the worker count in the fix."""
    s = summarize([rank(data_ms=12.5, busy_ms=30)] * 2, {"num_workers": 2, "pin_memory": False, "grad_mb": 1.0})
    (finding,) = diagnose(s, Thresholds())
    assert finding["cause"] == "data-bound" and "now 2" in finding["fix"] and finding["fix"].startswith("25%")
    assert "pin_memory=True (now False) and persistent_workers=True" in finding["fix"]
    # A streaming loader has neither setting (a new worker set per epoch): no advice on them.
    s = summarize([rank(data_ms=12.5, busy_ms=30)] * 2, {"num_workers": 2, "pin_memory": None, "grad_mb": 1.0})
    (finding,) = diagnose(s, Thresholds())
    assert "now 2" in finding["fix"] and "pin_memory" not in finding["fix"] and "persistent" not in finding["fix"]


def test_comm_share_uses_the_rank_that_waits_least():
    """A slow rank makes the others wait in the all-reduce: straggler, not communication-bound."""
    fast = rank(data_ms=2, busy_ms=45, comm_ms=35)  # own work 12 ms, 35 ms in the all-reduce
    slow = rank(data_ms=2, busy_ms=45, comm_ms=3)  # own work 44 ms
    assert verdicts(fast, slow) == ["straggler"]
    assert verdicts(rank(comm_ms=20), rank(comm_ms=18)) == ["communication-bound"]


def test_communication_fix_keeps_the_global_batch():
    """The advice keeps the global batch: fewer devices holding their share in micro-batches, compression,
    buckets; never more samples per step, nor Lightning's accumulate_grad_batches."""
    s = summarize([rank(comm_ms=20)] * 2, {})
    (finding,) = diagnose(s, Thresholds())
    assert "fewer devices for the same global batch" in finding["fix"] and "--data.micro_batch_size" in finding["fix"]
    assert "global_batch_size" not in finding["fix"] and "accumulate_grad_batches" not in finding["fix"]


def test_data_wait_spent_waiting_for_a_cpu_is_host_contention():
    """A 12.5 ms data wait of which 10 ms the loading thread waited for a CPU is not data-bound but
    host-contention (the case where more loader workers made things worse)."""
    row = rank(data_ms=12.5, busy_ms=30, wait_ms=11, data_wait_ms=10)
    s = summarize([row] * 2, {"num_workers": 0, "pin_memory": False})
    assert s.data_wait_pct == pytest.approx(25) and s.loader_wait_pct == pytest.approx(100 * 2.5 / 39)
    assert [f["cause"] for f in diagnose(s, Thresholds())] == ["host-contention"]


def test_more_threads_than_cores_is_oversubscribed():
    """2 ranks x 2 threads on 2 cores is named; 2 x 1 is not."""
    ctx = {"device": "cpu", "cpu_threads_per_rank": 2, "cpu_cores_visible": 2, "num_workers": 0}
    assert summarize([rank()] * 2, ctx).oversubscribed == "2 rank(s) x (2 thread(s)) > 2 CPU core(s)"
    assert summarize([rank()] * 2, {**ctx, "cpu_threads_per_rank": 1}).oversubscribed == ""


def test_ranks_on_one_gpu_are_oversubscribed():
    """Two ranks on cuda:0 of one machine share it; cuda:0 on two machines, or cuda:0 and 1, do not."""
    ctx = {"device": "cuda"}
    assert summarize([rank(device=0), rank(device=0)], ctx).oversubscribed == "ranks share GPU(s) 0"
    rows = [rank(device=0), rank(device=0, node=1), rank(device=1, node=1), rank(device=1, node=1)]
    assert summarize(rows, ctx).oversubscribed == "ranks share GPU(s) 1 on node 1"
    assert summarize([rank(device=0), rank(device=0, node=1)], ctx).oversubscribed == ""
    assert summarize([rank(device=0), rank(device=1)], ctx).oversubscribed == ""


def test_too_little_work_fix_keeps_the_global_batch():
    """Short steps are fixed with fewer devices or more work per sample, not a larger per-device batch."""
    short = rank(step_ms=4, data_ms=0.2, busy_ms=3, comm_ms=0.5)
    (finding,) = diagnose(summarize([short] * 2, {}), Thresholds())
    assert "fewer devices for this global batch" in finding["fix"] and "global batch stays" in finding["fix"]


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


# ---- the gap between N devices and 1 (ddp/gap.py) --------------------------------------------------------
def run(*rows: list[float], **context) -> DoctorRecord:
    s = summarize(list(rows), {"device": "cpu", "cpu_threads_per_rank": 1, "cpu_cores_visible": 8, **context})
    s.verdict = "healthy"
    return s


def one_device(compute_ms=80.0, data_ms=4.0, other_ms=4.0) -> DoctorRecord:
    """A 1-device run of 64 samples per step: data + compute + other (no all-reduce)."""
    step = data_ms + compute_ms + other_ms
    return run(rank(step_ms=step, data_ms=data_ms, busy_ms=compute_ms, comm_ms=0.0, batch=64))


def test_gap_parts_add_up_and_name_the_all_reduce():
    """2 devices, compute halved, a 30 ms all-reduce: the gap (30 ms + the fixed costs' halves) is the sum of
    its parts, the all-reduce is the largest, and nothing is left unexplained."""
    two = rank(step_ms=4 + 40 + 30 + 4, data_ms=4, busy_ms=40 + 30, comm_ms=30)
    e = explain(one_device(), run(two, two))
    assert e["gap_ms"] == pytest.approx(78 - 44) and e["unexplained_ms"] == pytest.approx(0, abs=1e-9)
    assert e["parts_ms"] == pytest.approx(
        {"compute": 0, "comm": 30, "data": 2, "straggler": 0, "other": 2, "cpu_wait": 0}
    )
    assert e["largest"] == "comm" and e["verdict"] == "communication-bound" and e["efficiency"] < EFFICIENCY_LINE


def test_gap_puts_a_straggler_apart():
    """Rank 1 computes 30 ms more; rank 0 waits for it in the all-reduce: the straggler part is its whole
    extra work, not half of it in compute."""
    fast = rank(step_ms=4 + 40 + 32 + 4, data_ms=4, busy_ms=40 + 32, comm_ms=32)
    slow = rank(step_ms=4 + 70 + 2 + 4, data_ms=4, busy_ms=70 + 2, comm_ms=2)
    e = explain(one_device(), run(fast, slow))
    assert e["parts_ms"]["straggler"] == pytest.approx(30) and e["parts_ms"]["comm"] == pytest.approx(2)
    assert e["verdict"] == "straggler" and "rank 1" in e["fix"]


def test_gap_takes_the_wait_for_a_cpu_out_of_the_part_it_fell_in():
    """20 of the 60 ms of compute on 2 devices were spent waiting for a CPU: compute shrank as it should,
    the gap is host contention."""
    two = rank(step_ms=4 + 60 + 2 + 4, data_ms=4, busy_ms=62, comm_ms=2, wait_ms=20, busy_wait_ms=20)
    e = explain(one_device(), run(two, two))
    assert e["parts_ms"]["compute"] == pytest.approx(0) and e["parts_ms"]["cpu_wait"] == pytest.approx(20)
    assert e["verdict"] == "host-contention" and e["unexplained_ms"] == pytest.approx(0, abs=1e-9)


def test_gap_takes_the_all_reduce_threads_wait_out_of_comm():
    """Of a 30 ms all-reduce, gloo's threads waited 20 ms for a CPU: the comm part is the 10 ms transfer, the
    20 ms are host contention, named as gloo's, and the parts still add up."""
    two = rank(step_ms=4 + 40 + 30 + 4, data_ms=4, busy_ms=40 + 30, comm_ms=30, comm_wait_ms=20)
    e = explain(one_device(), run(two, two))
    assert e["parts_ms"]["comm"] == pytest.approx(10) and e["parts_ms"]["cpu_wait"] == pytest.approx(20)
    assert e["unexplained_ms"] == pytest.approx(0, abs=1e-9)
    assert e["verdict"] == "host-contention" and "gloo" in e["fix"]


def test_gap_counts_waiting_for_the_step_s_last_rank_as_straggler():
    """Both ranks average 12 ms in the all-reduce, but each step's least was 4 ms (the ranks took turns at
    arriving last): the comm part is the 4 ms transfer, the other 8 ms are waiting for the slower rank of
    each step, and the parts still add up; comm's share of the step is the transfer's."""
    two = rank(step_ms=4 + 40 + 12 + 4, data_ms=4, busy_ms=40 + 12, comm_ms=12)
    s = run(two, two, comm_step_min_ms=4.0)
    e = explain(one_device(), s)
    assert e["parts_ms"]["comm"] == pytest.approx(4) and e["parts_ms"]["straggler"] == pytest.approx(8)
    assert e["unexplained_ms"] == pytest.approx(0, abs=1e-9) and s.comm_pct == pytest.approx(100 * 4 / 60)


def test_all_reduce_waiting_for_a_cpu_is_not_communication_bound():
    """A 20 ms all-reduce of a 50 ms step (40%) of which 15 ms its threads waited for a CPU: comm is 10% of
    the step, the wait counts as the rank's cpu wait (host contention, 30%)."""
    s = summarize([rank(comm_ms=20, comm_wait_ms=15)] * 2, {"num_workers": 0, "pin_memory": False})
    assert s.comm_pct == pytest.approx(10) and s.cpu_wait_pct == pytest.approx(30)
    assert [f["cause"] for f in diagnose(s, Thresholds())] == ["host-contention"]


def test_low_efficiency_is_never_healthy():
    """However the doctor judged the run alone, a point below the efficiency line gets the gap's verdict."""
    for compute in (41, 50, 60, 80):  # efficiency from ~0.97 down to ~0.52
        two = rank(step_ms=4 + compute + 2 + 4, data_ms=4, busy_ms=compute + 2, comm_ms=2)
        e = explain(one_device(), run(two, two))
        assert (e["verdict"] == "healthy") == (e["efficiency"] >= EFFICIENCY_LINE), (compute, e["efficiency"])
    assert set(PARTS) == set(e["parts_ms"])


def test_gap_refuses_runs_with_different_global_batches():
    """Runs that do not train the same global batch do not compare."""
    two = rank(batch=64)
    with pytest.raises(ValueError, match="not the same global batch"):
        explain(one_device(), run(two, two))


def test_prediction_follows_the_fitted_compute_and_the_ring():
    """Compute 8 + 1 ms/sample fitted through 1 and 2 devices, a 10 ms all-reduce of which 2 ms latency:
    on 4 devices 8 + 16 ms of compute, 4 ms of other, 3 x 2 + 1.5 x 8 ms of ring."""
    one = run(rank(step_ms=72 + 4, data_ms=0, busy_ms=72, comm_ms=0, batch=64))
    two_rank = rank(step_ms=40 + 10 + 4, data_ms=0, busy_ms=50, comm_ms=10)
    two = run(two_rank, two_rank)
    two.allreduce_latency_ms = 2.0
    assert ring_allreduce_ms(2, 2.0, 8.0) == pytest.approx(10.0)
    p = predict(one, two, 4)
    assert p["step_ms"] == pytest.approx(8 + 16 + 4 + 6 + 12)
    assert p["speedup"] == pytest.approx(76 / p["step_ms"])


def test_loader_share_is_of_the_step_without_the_wait_for_a_cpu():
    """A 16 ms loader in a step stretched from 40 to 100 ms by waiting for a CPU is still data-bound (40%),
    and the wait is listed after it."""
    row = rank(step_ms=100, data_ms=16, busy_ms=80, comm_ms=2, wait_ms=60, busy_wait_ms=60)
    s = summarize([row] * 2, {"num_workers": 0, "pin_memory": False})
    assert s.loader_wait_pct == pytest.approx(40)
    assert [f["cause"] for f in diagnose(s, Thresholds())] == ["data-bound", "host-contention"]


# ---- the record (ddpkit/scaling/record.py) -------------------------------------------------------------------
def test_record_round_trips_through_its_dict():
    """A record written as doctor.json's dict reads back equal, ranks typed, under schema 3."""
    s = run(rank(peak_mb=500), rank(peak_mb=750, comm_wait_ms=2), comm_step_min_ms=4.0)
    d = json.loads(json.dumps(s.to_dict()))
    assert d["schema"] == 3 and d["ranks"][1]["comm_cpu_wait_ms"] == pytest.approx(2)
    back = DoctorRecord.from_dict(d)
    assert back == s and back.ranks[1].peak_mem_mb == pytest.approx(750)


def test_record_keys_name_the_wait_for_a_cpu_once():
    """Every key of the wait for a CPU is a `cpu_wait` one: no key keeps another name for it."""
    d = run(rank(), rank()).to_dict()
    keys = set(d) | set(d["ranks"][0])
    assert {"cpu_wait_pct", "cpu_wait_ms", "data_cpu_wait_ms", "busy_cpu_wait_ms", "comm_cpu_wait_ms"} <= keys
    assert not [k for k in keys if "contention" in k]


def test_record_of_another_schema_is_refused_in_one_line():
    """A dict of schema 2, or without a schema (1), is refused with the loader's line naming its source."""
    d = run(rank(), rank()).to_dict()
    for schema, old in ((2, {**d, "schema": 2}), (1, {k: v for k, v in d.items() if k != "schema"})):
        with pytest.raises(SchemaError, match=rf"^x.json has schema {schema}, this ddpkit reads schema 3: fit"):
            DoctorRecord.from_dict(old, "x.json")
