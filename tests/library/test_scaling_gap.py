"""The scaling gap (ddpkit.scaling.gap, `python -m ddpkit.scaling --explain`) on runs whose cause is known: the sleeping
model of sleepy.py on 1, 2, 4 and 8 CPU processes, each cause injected on its own; and the doctor's parts
against the same work timed alone, on those runs and on a 2-rank run of the toy model (real compute)."""

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import early
import pytest
import torch
from alone import TOLERANCE as ALONE
from alone import allreduce_ms, waited_s
from procs import ON_PATH, TOY, toy_server
from sleepy import SleepyData

from ddpkit.scaling.gap import (
    EFFICIENCY_LINE,
    components,
    explain,
    measured_without_cpu_wait,
    predict,
)
from ddpkit.scaling.record import DoctorRecord
from ddpkit.testing.helpers import exit_status
from ddpkit.testing.toy import ToyData

pytestmark = pytest.mark.timing  # they run first, alone (tests/conftest.py)

STEPS = 20  # 3 warm-up + 17 timed
FIT = [
    "fit",
    *("--trainer.accelerator", "cpu", "--trainer.max_steps", str(STEPS), "--trainer.num_sanity_val_steps", "0"),
    *("--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"),
    *("--doctor.measure_comm", "true"),
    # The other ranks wait at a barrier while rank 0 waits for its run's turn (sleepy.py): start-up of all the
    # cases on 2 cores has taken longer than the 300 s default (docs/measurements.md, the scaling gap).
    *("--dist_timeout", "1800"),
]
# The ranks of a multi-device case are forked from the process that launches them (Lightning's ddp_fork), not
# started as new interpreters: what the doctor times (steps, and the waits inside them) does not depend on how a
# rank began, and 15 imports of torch and Lightning fewer take the module from ~127 to ~72 s of the timing phase,
# where nothing else runs (docs/measurements.md, the scaling gap). Every other test runs the launcher users get.
FORKED = ("--trainer.strategy", "ddp_fork")
# The sleeping model with 40 ms of fixed compute + 1.5 ms per sample, 64 samples per step: 136 ms on 1
# device, 52 ms on 8 (ideal 17 ms): the more devices, the more the fixed cost dominates (a per-device batch
# too small for it). Each cause below is sized to stand out on a loaded 2-core host.
SLEEPING = ("--model", "sleepy.Sleepy", "--data", "sleepy.SleepyData")
SLEEPY = (*SLEEPING, "--model.fixed_ms", "40", "--model.per_sample_ms", "1.5")
CASES = {  # name: (devices, extra args, pinned to one core)
    "clean-1": (1, SLEEPY, False),
    "clean-2": (2, SLEEPY, False),
    "clean-4": (4, SLEEPY, False),
    "clean-8": (8, SLEEPY, False),
    # 120 ms of loading per batch, whatever its size: 60 ms per step above the ideal on 2 devices.
    "data-1": (1, (*SLEEPY, "--data.batch_delay_ms", "120"), False),
    "data-2": (2, (*SLEEPY, "--data.batch_delay_ms", "120"), False),
    # 32 MB of gradients all-reduced over gloo every step, without the fixed compute (which would add a gap of
    # its own). What is left of the compute gap is the gradient's CPU work, which does not shrink (accumulation,
    # DDP's bucket copies); sizes in docs/measurements.md (the scaling gap).
    "grad-1": (1, (*SLEEPING, "--model.fixed_ms", "0", "--model.per_sample_ms", "2", "--model.grad_mb", "32"), False),
    "grad-2": (2, (*SLEEPING, "--model.fixed_ms", "0", "--model.per_sample_ms", "2", "--model.grad_mb", "32"), False),
    # Rank 1 computes 60 ms longer; compared with clean-1 (there is no rank 1 there).
    "straggler-2": (2, (*SLEEPY, "--model.straggler_ms", "60"), False),
    # Real CPU work (spinning), 2 ranks on 1 core.
    "oversub-1": (1, (*SLEEPY, "--model.spin", "true"), True),
    "oversub-2": (2, (*SLEEPY, "--model.spin", "true"), True),
    # The toy model's real compute (a 0.1 MB gradient, steps of a few ms) in its turn, for the checks against
    # the work timed alone; 57 timed steps, to average 2 cores' jitter over steps this short.
    "toy-2": (2, ("--model", "sleepy.ToyInTurn", "--trainer.max_steps", "60"), False),
}
# Each cause's run on 2 devices (4 for the small batch), the 1-device run it is compared with, the part
# of the gap it must be.
CAUSES = {
    "slow data": ("data-1", "data-2", "data"),
    "large gradient": ("grad-1", "grad-2", "comm"),
    "straggler": ("clean-1", "straggler-2", "straggler"),
    "oversubscription": ("oversub-1", "oversub-2", "cpu_wait"),
    "small per-device batch": ("clean-1", "clean-4", "compute"),
}
# How far the predicted speed-up may be from the measured one without the ranks' wait for a CPU (relative). Idle,
# as these timing tests run (first, alone): 4 devices +1.5 to +6%, 8 devices +10 to +23% (9 runs, 2026-12-02 and
# 2026-12-03); beside other work (loads 14-28, which the test order now keeps away) up to +29% and +55%
# (docs/measurements.md, the scaling gap). 4 devices' bound is about 3 x the worst idle error; 8 ranks on 2 cores
# stay the ring model's blind spot (their gloo threads wait for a CPU at once), so theirs keeps the loaded margin.
TOLERANCE = {4: 0.2, 8: 0.75}


def pin_to_one_core() -> None:
    """Run in the child before exec: it and every rank it starts (affinity is inherited) get one core."""
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def run_cases(base: Path, cases: dict, timeout: float = 900) -> dict[str, DoctorRecord]:
    """Start every case at once (start-up overlaps), let them train one at a time (sleepy.TURNS); return
    each case's doctor summary. A case that fails ends them all at once: the others would wait for its turn.
    A case is forked from the toy's fork server (procs.toy_server: 10 imports of torch and Lightning fewer in the
    timing phase, where nothing else runs; what the doctor times does not depend on how a run began), except a
    pinned one: its affinity is set before a fresh interpreter starts, and every rank inherits it."""
    turns = base / "turns"
    turns.mkdir()
    env = {**os.environ, **ON_PATH, "OMP_NUM_THREADS": "1", "SLEEPY_TURNS": f"{turns},{len(cases)}"}
    codes, groups, logs = {}, {}, {}  # per case: its exit status (None while it runs), its process group, its output
    popens = []  # the pinned cases', to reap
    try:
        for name, (devices, args, pinned) in cases.items():
            root = base / name
            root.mkdir()
            fit = [*FIT, "--trainer.devices", str(devices), *(FORKED if devices > 1 else ()), *args]
            fit += ["--trainer.default_root_dir", str(root)]
            logs[name] = root / "output.txt"
            if pinned:
                with logs[name].open("w") as out:  # a file, not a pipe that nobody reads while the others run
                    proc = subprocess.Popen(
                        [*TOY, *fit],
                        cwd=root,
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        preexec_fn=pin_to_one_core,
                    )
                codes[name], groups[name] = proc.poll, proc.pid
                popens.append(proc)
            else:
                groups[name] = toy_server().fork(fit, root, env, logs[name], "main")
                codes[name] = partial(exit_status, logs[name])
        deadline = time.monotonic() + timeout
        while any(code() is None for code in codes.values()) and time.monotonic() < deadline:
            if any(code() for code in codes.values()):
                break
            time.sleep(1)
        ended = {name: code() for name, code in codes.items()}
        failed = [n for n, c in ended.items() if c] or [n for n, c in ended.items() if c is None]  # failed first
        for name in failed[:1]:
            outcome = "timed out" if ended[name] is None else f"exited {ended[name]}"
            raise AssertionError(f"{name} {outcome}:\n{logs[name].read_text()[-4000:]}")
    finally:
        for group in groups.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        for proc in popens:
            proc.wait()
    return {
        name: DoctorRecord.from_dict(json.loads(next((base / name).rglob("doctor.json")).read_text())) for name in cases
    }


@pytest.fixture(scope="module")
def gap_dir(tmp_path_factory) -> Path:
    """The cases' run directories, one per case name."""
    return tmp_path_factory.mktemp("gap")


@pytest.fixture(scope="module")
def runs(gap_dir) -> dict[str, DoctorRecord]:
    early.quiet()  # timings: nothing else of ours on the cores
    return run_cases(gap_dir, CASES)


def gap(runs: dict, base: str, run: str) -> dict:
    e = explain(runs[base], runs[run])
    print(base, run, {k: round(v, 1) for k, v in e["parts_ms"].items()}, round(e["gap_ms"], 1), e["verdict"])
    return e


def comm_wait_ms(run: DoctorRecord) -> float:
    """The ranks' mean wait for a CPU in their all-reduce's threads (ms per step)."""
    return sum(r.comm_cpu_wait_ms for r in run.ranks) / len(run.ranks)


@pytest.mark.parametrize("cause", CAUSES)
def test_injected_cause_is_the_largest_part_of_the_gap(runs, cause):
    """Each cause, injected alone, is the largest part of the gap and the verdict names it. A large gradient
    on 2 cores costs its transfer and its gloo threads' wait for a CPU (in cpu wait), of similar sizes
    (docs/measurements.md): one of the two is the largest part, the transfer outweighs every other part, and
    most of the added wait is the all-reduce threads'."""
    base, run, part = CAUSES[cause]
    e = gap(runs, base, run)
    assert e["efficiency"] < EFFICIENCY_LINE and e["verdict"] != "healthy"
    if cause != "large gradient" or e["largest"] == part:
        assert e["largest"] == part
    else:
        parts = e["parts_ms"]
        assert e["largest"] == "cpu_wait" and parts["comm"] == max(v for k, v in parts.items() if k != "cpu_wait")
        n0, n = runs[base].world_size, runs[run].world_size
        assert comm_wait_ms(runs[run]) - comm_wait_ms(runs[base]) * n0 / n >= 0.5 * parts["cpu_wait"]


@pytest.mark.parametrize("pair", [*[c[:2] for c in CAUSES.values()], ("clean-1", "clean-2"), ("clean-1", "clean-8")])
def test_parts_add_up_to_the_measured_gap(runs, pair):
    """The timed steps are the steps the throughput counts: what no part holds (the throughput's step against
    the last rank's timed step) is under 5% of the gap (about twice the worst measured: docs/measurements.md,
    the scaling gap). The parts tile the timed step by construction, so this says nothing of which part holds
    what (the checks against the same work timed alone, below, do); it fails when the doctor times less than
    the whole step (its step clock started at the batch instead of at the previous step's end leaves the
    120 ms data wait out) or counts steps otherwise than the throughput."""
    e = gap(runs, *pair)
    assert abs(e["unexplained_ms"]) <= 0.05 * e["gap_ms"]


def test_oversubscription_is_named(runs):
    """2 ranks on 1 core are oversubscribed, and the verdict's fix says why; 2 sleeping ranks on 2 are not."""
    e = gap(runs, "oversub-1", "oversub-2")
    assert e["oversubscribed"] == "2 rank(s) x (1 thread(s)) > 1 CPU core(s)" and e["oversubscribed"] in e["fix"]
    cores = runs["clean-2"].cpu_cores_visible
    assert (runs["clean-2"].oversubscribed == "") == (cores >= 2)


def test_prediction_from_1_and_2_devices(runs):
    """The speed-up predicted on 4 and 8 devices from the 1- and 2-device runs is within TOLERANCE of the
    measured one (without the ranks' wait for a CPU, which the prediction assumes away)."""
    for n in (4, 8):
        predicted = predict(runs["clean-1"], runs["clean-2"], n)["speedup"]
        measured = measured_without_cpu_wait(runs["clean-1"], runs[f"clean-{n}"])
        print(f"{n} devices: predicted {predicted:.2f}, measured {measured:.2f}")
        assert abs(predicted / measured - 1) <= TOLERANCE[n]


def test_explain_command(runs, gap_dir, tmp_path):
    """`python -m ddpkit.scaling --explain RUN_1 RUN_N` on two run directories prints the parts and the verdict."""
    cmd = [sys.executable, "-m", "ddpkit.scaling", "--explain", str(gap_dir / "clean-1"), str(gap_dir / "straggler-2")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "2 device(s) against 1: " in out.stdout and "verdict: straggler: the ranks waited" in out.stdout
    assert "  waiting for the slowest rank " in out.stdout and "predicted on 8 devices: " in out.stdout


# ---- each part against an independent measurement ---------------------------------------------------------
# The 2-rank runs whose all-reduce part is checked: gradients of 32 MB, 0.25 MB (with and without a straggler:
# the last rank's all-reduce holds no waiting) and the toy's 0.1 MB under real compute.
COMM_CHECKED = ("grad-2", "clean-2", "straggler-2", "toy-2")


@pytest.fixture(scope="module")
def allreduce_alone(runs) -> dict[float, float]:
    """ms of each checked run's gradient all-reduced alone (2 gloo processes, no training), one launch for all
    sizes; after the runs, which it would otherwise slow."""
    return allreduce_ms(sorted({runs[name].grad_mb for name in COMM_CHECKED}))


@pytest.mark.parametrize("name", COMM_CHECKED)
def test_comm_part_matches_the_allreduce_alone(runs, allreduce_alone, name):
    """The all-reduce part of the step (as the gap counts it: the last rank's, without its threads' wait for a
    CPU) is an all-reduce of the run's gradient size timed alone, within alone.TOLERANCE."""
    mb, in_step = runs[name].grad_mb, components(runs[name])["comm"]
    alone = allreduce_alone[mb]
    print(f"{name}, {mb:.3g} MB: in the step {in_step:.2f} ms, alone {alone:.2f} ms")
    if name == "grad-2":
        assert alone > 0 and 1 / BANDWIDTH_FACTOR <= in_step / alone <= BANDWIDTH_FACTOR
        return
    assert abs(in_step - alone) <= ALONE["comm"](alone) + (PEER_WAKE_UP_MS if name == "straggler-2" else 0.0)


# A 32 MB all-reduce is a copy bound by memory bandwidth, which a shared 2-core host (CI's background jobs run
# beside these tests) gives the step and the timing alone unequally, either way: in the step over alone 1.50, 0.57
# and 2.21 in three CI runs of 2026-12-04/05, 0.9-1.05 idle (docs/measurements.md). It is held to its size: within
# BANDWIDTH_FACTOR either way, which a comm part that misses the all-reduce (near 0) fails; the 0.1 and 0.25 MB
# runs carry alone.TOLERANCE, and with it the mutation that bound is for (the CPU wait left in the comm part).
BANDWIDTH_FACTOR = 3.0


# With a straggler, the last rank's all-reduce also waits for its peer, blocked in gloo for 60 ms, to be woken
# and scheduled, which no counter of the last rank holds: measured +1.09 ms (idle) and +1.98 ms (CI) over the
# 0.25 MB all-reduce alone (docs/measurements.md). Still an order below the 60 ms wait the part must not hold.
PEER_WAKE_UP_MS = 3.0


def loader_alone_ms(data: ToyData, devices: int, batches: int) -> float:
    """ms per batch of `data`'s training loader as rank 0 of `devices` gets it, iterated in this process without
    training (after a first batch), less this thread's wait for a CPU, as the doctor counts its data part: the
    median batch, so that one stall of the host (the VM itself off the CPU, which no wait counter of ours sees)
    does not move it. With the mean of 5, the 120 ms loader once took 129.7 ms alone against 121.3 in the step."""
    cpu = SimpleNamespace(root_device=torch.device("cpu"))
    data.trainer = SimpleNamespace(
        world_size=devices, global_rank=0, current_epoch=0, accumulate_grad_batches=1, strategy=cpu
    )
    data.setup("fit")
    loader = iter(data.train_dataloader())
    next(loader)
    times = []
    for _ in range(batches):
        start_s, waited = time.perf_counter(), waited_s()
        next(loader)
        times.append(1000 * (time.perf_counter() - start_s - (waited_s() - waited)))
    return statistics.median(times)


# Each run whose data part is checked: its data module, as the run built it, and the batches to time alone
# (a 120 ms loader: 7; the in-memory ones: the rest of rank 0's 16-batch epoch).
DATA_CHECKED = {
    "data-1": (lambda: SleepyData(batch_delay_ms=120), 1, 7),
    "data-2": (lambda: SleepyData(batch_delay_ms=120), 2, 7),
    "clean-2": (lambda: SleepyData(batch_delay_ms=0), 2, 15),
    "toy-2": (ToyData, 2, 15),
}


@pytest.mark.parametrize("name", DATA_CHECKED)
def test_data_part_matches_the_loader_alone(runs, name):
    """Each rank's data part (its wait for a CPU taken out) is the run's training loader's time per batch
    iterated alone, without training, within alone.TOLERANCE: a slow loader (120 ms per batch) and in-memory ones."""
    make, devices, batches = DATA_CHECKED[name]
    alone = loader_alone_ms(make(), devices, batches)
    for rank in runs[name].ranks:
        in_step = rank.data_ms - rank.data_cpu_wait_ms
        print(f"{name} rank {rank.rank}: data in the step {in_step:.2f} ms, loader alone {alone:.2f} ms")
        assert abs(in_step - alone) <= ALONE["data"](alone)
