"""The scaling gap (ddp/gap.py, `scaling.py --explain`) on runs whose cause is known: the sleeping model of
tests/sleepy.py on 1, 2, 4 and 8 CPU processes, each cause injected on its own. Machinery tests."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from alone import TOLERANCE as ALONE
from alone import allreduce_ms, waited_s
from helpers import MAIN, PROJECT, kill
from sleepy import SleepyData

from ddpkit.gap import (
    EFFICIENCY_LINE,
    components,
    explain,
    measured_without_contention,
    predict,
)

pytestmark = pytest.mark.machinery

TESTS = Path(__file__).resolve().parent
STEPS = 20  # 3 warm-up + 17 timed
FIT = [
    "fit",
    *("--config", str(TESTS / "toy.yaml"), "--model", "sleepy.Sleepy", "--data", "sleepy.SleepyData"),
    *("--trainer.accelerator", "cpu", "--trainer.max_steps", str(STEPS), "--trainer.num_sanity_val_steps", "0"),
    *("--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"),
    *("--doctor.measure_comm", "true"),
    # The other ranks wait at a barrier while rank 0 waits for its run's turn (tests/sleepy.py): longer than
    # the 300 s default collective timeout when 26 processes start up on 2 cores (setup took 404 s once).
    *("--dist_timeout", "1800"),
]
# The sleeping model with 40 ms of fixed compute + 1.5 ms per sample, 64 samples per step: 136 ms on 1
# device, 52 ms on 8 (ideal 17 ms): the more devices, the more the fixed cost dominates (a per-device batch
# too small for it). Each cause below is sized to stand out on a loaded 2-core host.
SLEEPY = ("--model.fixed_ms", "40", "--model.per_sample_ms", "1.5")
CASES = {  # name: (devices, extra args, pinned to one core)
    "clean-1": (1, SLEEPY, False),
    "clean-2": (2, SLEEPY, False),
    "clean-4": (4, SLEEPY, False),
    "clean-8": (8, SLEEPY, False),
    # 120 ms of loading per batch, whatever its size: 60 ms per step above the ideal on 2 devices.
    "data-1": (1, (*SLEEPY, "--data.batch_delay_ms", "120"), False),
    "data-2": (2, (*SLEEPY, "--data.batch_delay_ms", "120"), False),
    # 32 MB of gradients all-reduced over gloo every step (39-48 ms at 2 ranks on the idle host), without the
    # fixed compute (which would add a gap of its own: 20 ms on 2 devices). What is left of the compute gap is
    # the gradient's CPU work, which does not shrink (accumulation, DDP's bucket copies: 14-16 ms).
    "grad-1": (1, ("--model.fixed_ms", "0", "--model.per_sample_ms", "2", "--model.grad_mb", "32"), False),
    "grad-2": (2, ("--model.fixed_ms", "0", "--model.per_sample_ms", "2", "--model.grad_mb", "32"), False),
    # Rank 1 computes 60 ms longer; compared with clean-1 (there is no rank 1 there).
    "straggler-2": (2, (*SLEEPY, "--model.straggler_ms", "60"), False),
    # Real CPU work (spinning), 2 ranks on 1 core.
    "oversub-1": (1, (*SLEEPY, "--model.spin", "true"), True),
    "oversub-2": (2, (*SLEEPY, "--model.spin", "true"), True),
}
# Each cause's run on 2 devices (4 for the small batch), the 1-device run it is compared with, the part
# of the gap it must be.
CAUSES = {
    "slow data": ("data-1", "data-2", "data"),
    "large gradient": ("grad-1", "grad-2", "comm"),
    "straggler": ("clean-1", "straggler-2", "straggler"),
    "oversubscription": ("oversub-1", "oversub-2", "contention"),
    "small per-device batch": ("clean-1", "clean-4", "compute"),
}
# How far the predicted speed-up may be from the measured one (relative). Measured (predicted / measured
# without the wait for a CPU - 1) over 4 runs of the clean cases (3 of these, 1 with 20 ms fixed + 2 ms per
# sample) on the shared 2-core host at load 14-20: 4 devices -1 to +21%, 8 devices +18 to +82%, too
# optimistic at 8 in every run: 8 ranks on 2 loaded cores all do
# their step's CPU work (optimizer, DDP's bucket copies, the all-reduce's hops) at the same moment, and the
# hops of the ring wait for a CPU in gloo's own threads, which the ring model (latency measured at 2 ranks)
# cannot know. Since the doctor takes that wait out of the all-reduce (and out of the measured speed-up it
# is compared with): 4 devices -5 to +4%, 8 devices +10 to +20% (3 idle runs, 1 beside two CPU hogs). The
# bounds, set before, leave room above the worst run seen.
TOLERANCE = {4: 0.35, 8: 1.0}
# `python main.py` pinned to one core; main.py's folder first on sys.path as `python main.py` puts it (not
# the case folder that `-c` puts there: the package would then come from wherever pip installed it).
PIN = "import os, runpy, sys; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); sys.argv = sys.argv[1:]; "
PIN += "sys.path[0] = os.path.dirname(sys.argv[0]); runpy.run_path(sys.argv[0], run_name='__main__')"


def run_cases(base: Path, cases: dict, timeout: float = 900) -> dict[str, dict]:
    """Start every case at once (start-up overlaps), let them train one at a time (sleepy.TURNS); return
    each case's doctor summary. A case that fails ends them all at once: the others would wait for its turn."""
    turns = base / "turns"
    turns.mkdir()
    env = {**os.environ, "PYTHONPATH": str(TESTS), "OMP_NUM_THREADS": "1", "SLEEPY_TURNS": f"{turns},{len(cases)}"}
    procs, logs = {}, {}
    try:
        for name, (devices, args, pinned) in cases.items():
            root = base / name
            root.mkdir()
            cmd = [sys.executable, *(("-c", PIN) if pinned else ()), str(MAIN), *FIT, "--trainer.devices", str(devices)]
            logs[name] = root / "output.txt"
            with logs[name].open("w") as out:  # a file, not a pipe that nobody reads while the others run
                cmd += [*args, "--trainer.default_root_dir", str(root)]
                procs[name] = subprocess.Popen(
                    cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
            if any(p.poll() for p in procs.values()):
                break
            time.sleep(1)
        codes = {name: proc.poll() for name, proc in procs.items()}
        failed = [n for n, c in codes.items() if c] or [n for n, c in codes.items() if c is None]  # failed first
        for name in failed[:1]:
            outcome = "timed out" if codes[name] is None else f"exited {codes[name]}"
            raise AssertionError(f"{name} {outcome}:\n{logs[name].read_text()[-4000:]}")
    finally:
        for proc in procs.values():
            kill(proc)
            proc.wait()
    summaries = {name: json.loads(next((base / name).rglob("doctor.json")).read_text()) for name in cases}
    return {name: {**s, "dir": str(base / name)} for name, s in summaries.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    return run_cases(tmp_path_factory.mktemp("gap"), CASES)


def gap(runs: dict, base: str, run: str) -> dict:
    e = explain(runs[base], runs[run])
    print(base, run, {k: round(v, 1) for k, v in e["parts_ms"].items()}, round(e["gap_ms"], 1), e["verdict"])
    return e


def comm_wait_ms(run: dict) -> float:
    """The ranks' mean wait for a CPU in their all-reduce's threads (ms per step)."""
    return sum(r.get("comm_contention_ms", 0.0) for r in run["ranks"]) / len(run["ranks"])


@pytest.mark.parametrize("cause", CAUSES)
def test_injected_cause_is_the_largest_part_of_the_gap(runs, cause):
    """Each cause, injected alone, is the largest part of the gap and the verdict names it. A large gradient
    on 2 cores costs its transfer and its gloo threads' wait for a CPU (in cpu wait; idle host: transfer
    22-29 ms, wait 18-19 ms; beside two CPU hogs 28 and 32 ms): one of the two is the largest part, the
    transfer outweighs every other part, and most of the added wait is the all-reduce threads'."""
    base, run, part = CAUSES[cause]
    e = gap(runs, base, run)
    assert e["efficiency"] < EFFICIENCY_LINE and e["verdict"] != "healthy"
    if cause != "large gradient" or e["largest"] == part:
        assert e["largest"] == part
    else:
        parts = e["parts_ms"]
        assert e["largest"] == "contention" and parts["comm"] == max(v for k, v in parts.items() if k != "contention")
        n0, n = runs[base]["world_size"], runs[run]["world_size"]
        assert comm_wait_ms(runs[run]) - comm_wait_ms(runs[base]) * n0 / n >= 0.5 * parts["contention"]


@pytest.mark.parametrize("pair", [*[c[:2] for c in CAUSES.values()], ("clean-1", "clean-2"), ("clean-1", "clean-8")])
def test_parts_add_up_to_the_measured_gap(runs, pair):
    """What no part holds (the throughput's step against the last rank's timed step) is under 5% of the gap.
    (Measured: at most 2.6% over the cases of two runs on the 2-core host at load 14-20.)"""
    e = gap(runs, *pair)
    assert abs(e["unexplained_ms"]) <= 0.05 * e["gap_ms"]


def test_oversubscription_is_named(runs):
    """2 ranks on 1 core are oversubscribed, and the verdict's fix says why; 2 sleeping ranks on 2 are not."""
    e = gap(runs, "oversub-1", "oversub-2")
    assert e["oversubscribed"] == "2 rank(s) x (1 thread(s)) > 1 CPU core(s)" and e["oversubscribed"] in e["fix"]
    cores = runs["clean-2"]["cpu_cores_visible"]
    assert (runs["clean-2"]["oversubscribed"] == "") == (cores >= 2)


def test_prediction_from_1_and_2_devices(runs):
    """The speed-up predicted on 4 and 8 devices from the 1- and 2-device runs is within TOLERANCE of the
    measured one (without the ranks' wait for a CPU, which the prediction assumes away)."""
    for n in (4, 8):
        predicted = predict(runs["clean-1"], runs["clean-2"], n)["speedup"]
        measured = measured_without_contention(runs["clean-1"], runs[f"clean-{n}"])
        print(f"{n} devices: predicted {predicted:.2f}, measured {measured:.2f}")
        assert abs(predicted / measured - 1) <= TOLERANCE[n]


def test_explain_command(runs, tmp_path):
    """`scaling.py --explain RUN_1 RUN_N` on two run directories prints the parts and the verdict."""
    cmd = [sys.executable, str(PROJECT / "scaling.py"), "--explain", runs["clean-1"]["dir"], runs["straggler-2"]["dir"]]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "2 device(s) against 1: " in out.stdout and "verdict: straggler: the ranks waited" in out.stdout
    assert "  waiting for the slowest rank " in out.stdout and "predicted on 8 devices: " in out.stdout


# ---- each part against an independent measurement ---------------------------------------------------------
def test_comm_part_matches_the_allreduce_alone(runs):
    """The all-reduce time in the step, for a 32 MB and a 0.25 MB gradient, is that all-reduce timed alone
    (the same size, 2 gloo processes, no training), within alone.TOLERANCE; with a straggler too (the last
    rank's all-reduce holds no waiting)."""
    names = ("grad-2", "clean-2", "straggler-2")
    alone = allreduce_ms(sorted({runs[name]["grad_mb"] for name in names}))
    for name in names:
        mb, in_step = runs[name]["grad_mb"], components(runs[name])["comm"]  # as the gap counts it
        print(f"{name}, {mb:g} MB: in the step {in_step:.2f} ms, alone {alone[mb]:.2f} ms")
        assert abs(in_step - alone[mb]) <= ALONE["comm"](alone[mb])


def loader_alone_ms(batch_delay_ms: float, batches: int = 5) -> float:
    """ms per batch of SleepyData's training loader iterated in this process (after a first batch)."""
    data = SleepyData(batch_delay_ms=batch_delay_ms, global_batch_size=64)
    data.setup("fit")
    loader = iter(data.train_dataloader())
    next(loader)
    start_s, waited = time.perf_counter(), waited_s()
    for _ in range(batches):
        next(loader)
    return 1000 * (time.perf_counter() - start_s - (waited_s() - waited)) / batches


def test_data_part_matches_the_loader_alone(runs):
    """The data part of the slow-data runs (its wait for a CPU taken out) is the loader's time per batch
    iterated alone, without training, within alone.TOLERANCE; the clean runs' is that of their loader."""
    alone_ms = {delay: loader_alone_ms(delay) for delay in (120, 0)}
    for name, delay in (("data-1", 120), ("data-2", 120), ("clean-2", 0)):
        alone = alone_ms[delay]
        for rank in runs[name]["ranks"]:
            in_step = rank["data_ms"] - rank.get("data_contention_ms", 0.0)
            print(f"{name} rank {rank['rank']}: data in the step {in_step:.2f} ms, loader alone {alone:.2f} ms")
            assert abs(in_step - alone) <= ALONE["data"](alone)
