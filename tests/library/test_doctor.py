"""The scaling doctor (ddpkit.scaling.doctor) in real 2-process runs of the toy model whose cause of poor scaling is
known (doctor_cases.py); the sweep (`python -m ddpkit.scaling`), the overhead. The preflight: test_preflight.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import early
import pytest
from netns import two_hosts
from procs import ON_PATH, TESTS, concurrently, kill, toy_ok

from ddpkit.scaling.diagnosis import Thresholds
from ddpkit.scaling.record import DoctorRecord, RankRecord
from ddpkit.scaling.sweeper import SWEEP_MARKER

# Every test here times runs (the doctor's verdicts rest on timings): they run first, alone (tests/conftest.py).
pytestmark = pytest.mark.timing

SCALING = [sys.executable, "-m", "ddpkit.scaling", "--main", "ddpkit.testing.toy"]
# Two CPU processes, a few steps, nothing printed or checked that the doctor does not need.
FIT = (
    "fit",
    "--trainer.accelerator",
    "cpu",
    "--trainer.devices",
    "2",
    "--trainer.max_steps",
    "20",
    "--trainer.enable_progress_bar",
    "false",
    "--trainer.enable_model_summary",
    "false",
    "--trainer.num_sanity_val_steps",
    "0",
    "--doctor.measure_comm",  # off by default (its cost); the diagnoses below need it
    "true",
)


def doctor_fit(root: Path, *args: str) -> tuple[DoctorRecord | None, str]:
    """Fit on 2 CPU processes; return the doctor's JSON summary (None if it wrote none) and the printed output."""
    out = toy_ok(*FIT, *args, "--trainer.default_root_dir", str(root), cwd=root, timeout=300)
    summaries = list(root.rglob("doctor.json"))
    return (DoctorRecord.from_dict(json.loads(summaries[0].read_text())) if summaries else None), out


CAUSES = {
    # 2 ms of loading per sample, 8 samples per device and step: ~16 ms waiting per step.
    "data-bound": ("--data", "doctor_cases.SlowData"),
    # 4.3 M parameters (17 MB of gradients) and 1 sample per device: the all-reduce dominates (with 2 per
    # device it came near the 30% threshold, and under it once: docs/measurements.md, the scaling doctor).
    "comm-bound": ("--model", "doctor_cases.WideModel", "--data.global_batch_size", "2"),
    # Rank 1 keeps an extra 400 MB tensor.
    "memory": ("--model", "doctor_cases.MemoryHog"),
    # Rank 1 sleeps 100 ms in every training step; the doctor also reports every 10 batches.
    "straggler": ("--model", "doctor_cases.Straggler", "--doctor.report_every_n_steps", "10"),
    # No cause: the doctor switched off.
    "off": ("--doctor.enabled", "false"),
}


@pytest.fixture(scope="module")
def causes(tmp_path_factory) -> dict[str, tuple[dict, str]]:
    """The runs at once (10 processes on this machine's cores): each cause is large enough to stand
    out on a busy machine, and most of a short run is start-up that would otherwise run one at a time."""
    early.quiet()  # timings: nothing else of ours on the cores
    base = tmp_path_factory.mktemp("causes")

    def fit(name: str) -> tuple[dict, str]:
        (base / name).mkdir()
        return doctor_fit(base / name, *CAUSES[name])

    return concurrently(fit, CAUSES)


# A streaming loader (ddpkit.data.streaming) whose shard reader sleeps 8 ms per sample, in 2 workers per rank: each
# worker reads 2 streams x 2 samples per step, ~32 ms of reading against a step of a few ms.
STREAM = ("--data", "streams.SlowShards", "--data.global_batch_size", "16", "--data.num_workers", "2")


@pytest.fixture(scope="module")
def stream_cause(causes, tmp_path_factory) -> tuple[dict, str]:
    """The streaming case, after the others: its 4 loader workers starting beside them cost the wide model's
    all-reduce its lead over the other cases' (one CI run of two: 0.58 vs 1.26 ms)."""
    return doctor_fit(tmp_path_factory.mktemp("stream-cause"), *STREAM)


def test_report_is_printed_once_with_a_row_per_rank(causes):
    """Rank 0 alone prints the report; it has one table row per rank and the verdict."""
    for name, (summary, _) in causes.items():  # for docs/measurements.md
        print(name, summary and [round(r.peak_mem_mb) for r in summary.ranks])
    summary, out = causes["data-bound"]
    assert out.count("Scaling doctor: 2 x cpu, 17 steps") == 1  # 20 steps minus 3 warm-up
    assert [r.rank for r in summary.ranks] == [0, 1]
    assert out.count("verdict: data-bound: ") == 1


def test_sleepy_dataset_is_data_bound(causes):
    """Loading sleeps make the verdict data-bound, with most of each step waiting for data on both ranks."""
    summary, _ = causes["data-bound"]
    assert summary.verdict == "data-bound"
    # The loader's share of the step without the wait for a CPU: on a loaded host the whole data wait has been
    # under 50% of the stretched step (docs/measurements.md, the scaling doctor).
    assert summary.loader_wait_pct > 50 and all(r.data_ms >= 16 for r in summary.ranks)


def own_parts(rank: RankRecord) -> dict[str, float]:
    """A rank's parts of the step (ms), each without the time its threads waited for a CPU."""
    other_wait = rank.cpu_wait_ms - rank.comm_cpu_wait_ms - rank.data_cpu_wait_ms
    other_wait -= rank.busy_cpu_wait_ms
    return {
        "data": rank.data_ms - rank.data_cpu_wait_ms,
        "compute": rank.compute_ms - rank.busy_cpu_wait_ms,
        "comm": rank.comm_ms - rank.comm_cpu_wait_ms,
        "other": rank.other_ms - other_wait,
    }


def test_slow_shard_reader_is_data_bound(stream_cause):
    """A slow shard reader behind a streaming loader with 2 workers is named data-bound, with its workers counted.

    A finding rather than the verdict: the workers' reads compete for the cores, so on a loaded host one rank's
    wait can exceed the other's enough to be named a straggler first (seen once at load 13)."""
    summary, _ = stream_cause
    data_bound = [f["fix"] for f in summary.findings if f["cause"] == "data-bound"]
    assert summary.num_workers == 2 and data_bound and "--data.num_workers (now 2)" in data_bound[0]
    # Each worker reads ~32 ms per step; measured 28 and 38 ms of wait per step (docs/measurements.md). The ranks
    # meet at every all-reduce, so the rank whose workers are behind waits for data and the other for it (run
    # alone: 2.4 and 27 ms): the slower rank's wait is the figure.
    assert max(r.data_ms for r in summary.ranks) >= 8, [r.data_ms for r in summary.ranks]


# The least share of each rank's step the wide model's all-reduce (without its CPU wait) may take: half the
# doctor's 30% threshold. Seen 0.25-0.82 (once 0.25, in CI on a slow host; 0.35-0.42 run alone, 0.50-0.82 in the
# batch), docs/measurements.md: the compute of 1 sample through 4.3 M parameters is memory-bound and stretches
# with the host (5 to 21 ms), while a broken comm measurement gives next to nothing.
COMM_SHARE = 0.5 * Thresholds().comm_share


def test_wide_model_all_reduce_is_timed_apart_from_its_wait_for_a_cpu(causes):
    """The all-reduce of 17 MB of gradients, without its threads' wait for a CPU, is a large share of every rank's
    step (COMM_SHARE), the wait measured as part of its span. (Which verdict follows is not asserted here: on 2
    cores gloo's threads wait for a CPU longer than the transfer takes, 14 of 23 ms idle, so the verdict is
    communication-bound or host contention by the host's load; the network case below decides it. Its transfer
    is not compared with the other cases' 0.1 MB all-reduce either: on 2 CPU cores that sub-millisecond estimate
    came out below theirs in 2 of about 8 CI runs, docs/measurements.md.)"""
    summary, _ = causes["comm-bound"]
    assert summary.comm_measured and summary.grad_mb == pytest.approx(16.6, abs=0.1)
    for rank in summary.ranks:
        parts = own_parts(rank)
        assert parts["comm"] >= COMM_SHARE * sum(parts.values()), parts
        assert 0 < rank.comm_cpu_wait_ms < rank.comm_ms  # part of the span, measured
    assert summary.data_wait_pct < 10


# Two "nodes" (network namespaces) joined by a link of RATE each way, one rank each, launched by torchrun as on a
# cluster: the 2.5 MB all-reduce of a 650k-parameter model then waits ~90 ms for the network, with ~5 ms of compute
# for 1 sample; the gloo threads sleep on their sockets instead of waiting for a core (idle: comm 75% of a 116 ms
# step, CPU wait 19%; 2026-12-03, docs/measurements.md).
RATE = "200mbit"
NETWORKED = ("--model", "doctor_cases.WideModel", "--model.width", "768", "--data.global_batch_size", "2")


@pytest.fixture(scope="module")
def networked(causes, tmp_path_factory) -> tuple[DoctorRecord, str]:
    """The wide model's fit on 2 ranks over a rate-limited link (netns.two_hosts), after the other cases."""
    base = tmp_path_factory.mktemp("networked")
    port = "29517"
    with two_hosts(RATE) as hosts:
        agents = []
        for rank, host in enumerate(hosts):
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1"]
            torchrun += ["--node_rank", str(rank), "--master_addr", hosts[0].address, "--master_port", port]
            cmd = ["ip", "netns", "exec", host.netns, *torchrun, "-m", "ddpkit.testing.toy", *FIT, *NETWORKED]
            cmd += ["--trainer.num_nodes", "2", "--trainer.devices", "1", "--trainer.default_root_dir", str(base)]
            env = {**os.environ, **ON_PATH, "GLOO_SOCKET_IFNAME": host.interface, "OMP_NUM_THREADS": "1"}
            log = (base / f"node{rank}.log").open("w")
            agents.append(subprocess.Popen(cmd, cwd=base, env=env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True))  # fmt: skip
        try:
            codes = [agent.wait(timeout=300) for agent in agents]
        finally:
            for agent in agents:
                kill(agent)
    out = (base / "node0.log").read_text()
    assert codes == [0, 0], out[-3000:] + (base / "node1.log").read_text()[-3000:]
    (summary,) = base.rglob("doctor.json")
    return DoctorRecord.from_dict(json.loads(summary.read_text())), out


def test_all_reduce_over_a_slow_link_is_communication_bound(networked):
    """Two ranks on two hosts whose link is slow: the all-reduce, without its wait for a CPU, is most of every step,
    and the verdict is communication-bound (not host contention, which 2 ranks on 2 cores give over loopback)."""
    summary, out = networked
    assert summary.world_size == 2 and summary.comm_measured
    for rank in summary.ranks:
        parts = own_parts(rank)
        assert parts["comm"] >= 0.5 * sum(parts.values()), parts
    assert summary.verdict == "communication-bound", (summary.verdict, summary.findings)
    assert "verdict: communication-bound: " in out


def test_extra_tensor_on_one_rank_is_memory_imbalance(causes):
    """Rank 1's peak RSS is ~400 MB above rank 0's, and the verdict says so first."""
    summary, _ = causes["memory"]
    mem = [r.peak_mem_mb for r in summary.ranks]
    assert summary.verdict == "memory-imbalance" and mem[1] - mem[0] > 350
    assert summary.findings[0]["fix"].startswith("rank 1 peaks at")


def test_sleeping_rank_is_a_straggler(causes):
    """Rank 1's own work is ~100 ms longer; rank 0 spends that time waiting in the all-reduce."""
    summary, _ = causes["straggler"]
    fast, slow = summary.ranks
    assert summary.verdict == "straggler" and summary.findings[0]["fix"].startswith("rank 1 is a straggler")
    # Own work without the wait for a CPU, which can differ between the ranks by tens of ms on a loaded host.
    slow_own, fast_own = ((r.work_ms - r.data_cpu_wait_ms - r.busy_cpu_wait_ms) for r in (slow, fast))
    assert slow_own - fast_own > 80 and fast.comm_ms - slow.comm_ms > 80


def test_periodic_reports_cover_their_window(causes):
    """Every 10 batches a report of those batches (7 after the 3 warm-up ones, then 10), then the whole fit."""
    _, out = causes["straggler"]
    heads = [line.split(" steps")[0] for line in out.splitlines() if line.startswith("Scaling doctor: ")]
    assert heads == [f"Scaling doctor: 2 x cpu, {n}" for n in (7, 10, 17)]


def test_doctor_can_be_switched_off(causes):
    """`--doctor.enabled false` gives no report and no summary file."""
    summary, out = causes["off"]
    assert summary is None and "Scaling doctor" not in out


# ---- the sweep, a healthy run, the preflight, the overhead -------------------------------------------------
@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """`python -m ddpkit.scaling --devices 1 2` on a compute-heavy model with a large global batch."""
    early.quiet()  # timings: nothing else of ours on the cores
    out = tmp_path_factory.mktemp("sweep")
    cmd = [*SCALING, "--devices", "1", "2", "--max-steps", "30", "--out", str(out)]
    cmd += ["--", "--model", "doctor_cases.Balanced", "--data", "doctor_cases.ManyBlobs"]
    # 1,024 samples per device: at 512 the timed all-reduce reached the 30% threshold (docs/measurements.md).
    cmd += ["--data.global_batch_size", "2048", "--data.repeat", "16"]
    cmd += ["--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false"]
    # No OMP_NUM_THREADS here: the sweep must give every run the same threads per process by itself.
    env = {k: v for k, v in {**os.environ, **ON_PATH}.items() if k != "OMP_NUM_THREADS"}
    result = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def test_sweep_writes_table_json_and_plot(sweep):
    """scaling.md/json have a row per device count with speed-up and efficiency; scaling.png is a PNG; the folder
    is marked as a sweep's."""
    rows = json.loads((sweep / "scaling.json").read_text())["rows"]
    assert [r["devices"] for r in rows] == [1, 2] and rows[0]["speedup"] == 1.0
    assert rows[1]["efficiency"] == pytest.approx(rows[1]["speedup"] / 2, abs=1e-3)
    assert len(rows[1]["peak_mem_mb"]) == 2 and rows[1]["samples_per_s"] > 0
    table = (sweep / "scaling.md").read_text().splitlines()
    assert [line[:4] for line in table[:5]] == ["| de", "|---", "| 1 ", "| 2 ", ""]  # header, rule, 2 rows
    assert [line[:4] for line in table[-2:]] == ["| 4 ", "| 8 "]  # predictions from the 1- and 2-device runs
    assert (sweep / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (sweep / SWEEP_MARKER).is_file()  # `--ckpt_path last` from the project skips these runs


def test_sweep_gives_every_run_the_same_threads_per_process(sweep):
    """cores // the most devices (2 here) threads in the 1-device run too, as the doctor measured in each rank."""
    cores = len(os.sched_getaffinity(0))
    assert json.loads((sweep / "scaling.json").read_text())["threads_per_process"] == max(1, cores // 2)
    for n in (1, 2):
        summary = DoctorRecord.from_dict(json.loads(next((sweep / f"devices_{n}").rglob("doctor.json")).read_text()))
        assert summary.cpu_threads_per_rank == max(1, cores // 2)


def test_healthy_run_has_no_finding_but_host_contention(sweep):
    """1,024 samples per device through a 1024-wide MLP: compute dominates and nothing is flagged but the
    time the ranks waited for a CPU, flagged exactly when it is above its threshold."""
    summary = DoctorRecord.from_dict(json.loads(next((sweep / "devices_2").rglob("doctor.json")).read_text()))
    causes = [f["cause"] for f in summary.findings]
    # Accepted: host-contention. Another process on a 2-core host makes the ranks wait for a CPU (the doctor
    # must say so); with that wait left out the run is healthy.
    assert causes in ([], ["host-contention"]) and ("host-contention" in causes) == (summary.cpu_wait_pct >= 20)
    assert summary.step_ms > 10 and summary.comm_pct < 30 and summary.data_wait_pct < 20


def test_numbers_reach_the_logger(sweep):
    """TensorBoard holds the doctor's scalars, per run and per rank."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = (sweep / "devices_2").rglob("events.out.tfevents.*")
    tags = EventAccumulator(str(events)).Reload().Tags()["scalars"]
    assert {"doctor/samples_per_s", "doctor/comm_pct", "doctor/rank1/peak_mem_mb"} <= set(tags)
    assert {"doctor/cpu_wait_pct", "doctor/rank1/cpu_wait_ms"} <= set(tags)  # one name for the wait for a CPU


def test_overhead_is_small():
    """Doctor on vs off over alternating 1-process fits: print the overhead, assert only a generous bound."""
    early.quiet()  # timings: nothing else of ours on the cores
    cmd = [sys.executable, str(TESTS / "doctor_overhead.py"), "--reps", "3", "--steps", "60"]
    result = subprocess.run(cmd, cwd=TESTS, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    print(f"doctor overhead: {measured}")
    # The target is < 2% of a step. Asserted: the doctor's own per-step code stays under 10% of the toy's
    # step (the A/B figure is printed only: it swings too much on a shared machine, docs/measurements.md).
    assert measured["hooks_pct_of_step"] < 10


def test_sweep_runs_the_projects_main_or_the_one_named(tmp_path, monkeypatch):
    """`python -m ddpkit.scaling` runs ./main.py from the project's root, a `--main` file, or a `--main` module
    with `python -m`; without a main.py it stops with one error line before any run."""
    from ddpkit.scaling.sweeper import main_command

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="^error: no main.py here: run from the project's root"):
        main_command("main.py")
    (tmp_path / "main.py").touch()
    assert main_command("main.py") == [sys.executable, str(tmp_path / "main.py")]
    assert main_command("ddpkit.testing.toy") == [sys.executable, "-m", "ddpkit.testing.toy"]
