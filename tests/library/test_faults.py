"""Faults in a 2-process job: it ends non-zero, names the rank, leaves no process behind, and keeps its checkpoints;
a hang says where each rank was.

The scenarios are the ones `python -m ddpkit.faults` runs (ddpkit.testing.toy.FaultyClassifier injects them); the
process-group timeout is 20 s here instead of 300 s, 10 s for the hangs (all they do is wait for it).
"""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import early
import pytest
import torch
from procs import concurrently, toy_ok

from ddpkit.parity import max_abs
from ddpkit.run.faults import checkpoint_ok, run_scenario
from ddpkit.run.hang import RankDump
from ddpkit.testing import toy

TIMEOUT = 20  # --dist_timeout of the runs
HANG_TIMEOUT = 10  # of the hangs; a step of the toy takes milliseconds, far below it even on a loaded runner
# Seconds from the fault to the job's end past its timeout. Generous: start-up of a rank on a loaded 2-core machine
# takes seconds. The hangs end 0.4-2.9 s after their timeout, the report's dumps 0.06-0.07 s of it (6 runs at load
# 8-13, docs/measurements.md, hang report).
MARGIN = 40
SCENARIOS = ["raise", "exit", "hang", "hang0", "sigterm", "sigterm-rank1", "sigint", "kill9", "kill9-epoch1"]
STEPS = 48  # 3 epochs of 16 steps: the uninterrupted run ends on an epoch end, where last.ckpt is written


@early.early("faults")
def fault_runs(base: Path) -> tuple[dict, dict]:
    """Each scenario once, two at a time (most of a hang is waiting), plus kill -9 during writes 3 times; then
    the resumed runs (`resume`). Started with the session (early.py): nothing here is a timing."""
    jobs = [(name, base / name) for name in SCENARIOS] + [("kill9-save", base / f"save{i}") for i in range(3)]
    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(lambda job: run_scenario(*job, dist_timeout=timeout(job[0]), max_steps=STEPS), jobs))
    results = {result.workdir.name: result for result in done}  # keyed by scenario, save0..save2
    return results, resume(results, base / "resumed")


def timeout(scenario: str) -> int:
    return HANG_TIMEOUT if scenario.startswith("hang") else TIMEOUT


@pytest.fixture(scope="module")
def faults() -> tuple[dict, dict]:
    return early.result("faults")


@pytest.fixture(scope="module")
def results(faults) -> dict:
    """{scenario (save0..save2 for kill9-save): faults.Result}."""
    return faults[0]


@pytest.fixture(scope="module")
def resumed(faults) -> dict:
    """{name: (last.ckpt, output)} of `resume`."""
    return faults[1]


@pytest.mark.parametrize("name", SCENARIOS)
def test_job_ends_nonzero_in_bounded_time_without_orphans(results, name):
    """Every fault ends the whole job with a non-zero status, within the timeout plus start-up, no process left."""
    result = results[name]
    assert result.returncode not in (0, None), result.output[-3000:]
    assert result.seconds < timeout(name) + MARGIN and result.orphans == 0, result.output[-3000:]


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("raise", "error: rank 1 failed: RuntimeError: injected fault on rank 1"),
        ("exit", "error: rank 1 exited with code 3"),
        ("hang", "killed ranks [1], still running (hung?)"),
    ],
)
def test_failure_message_names_the_rank(results, name, message):
    """The last words of a failed job say which rank failed, or which one hung."""
    assert message in results[name].output, results[name].output[-3000:]


def injected_sleep() -> str:
    """file:line of the toy's injected hang."""
    path = Path(toy.__file__).resolve()
    lines = [n for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip() == "time.sleep(3600)"]
    assert len(lines) == 1
    return f"{path}:{lines[0]}"


@pytest.mark.parametrize(("name", "hung", "waiter"), [("hang", 1, 0), ("hang0", 0, 1)])
def test_hang_report_names_the_rank_behind_its_collective_and_line(results, name, hung, waiter):
    """When rank 1, or rank 0 (the launcher), hangs, hang/report.txt (also printed) names it, the collective the
    other rank waits in (DDP's gradient all-reduce, one past the hung rank's last) and the line of the sleep;
    each rank's dump holds every thread's stack."""
    result = results[name]
    directory = result.workdir / "hang"
    dumps = {rank: RankDump.load(directory / f"rank{rank}.json") for rank in (0, 1)}
    waited, last = dumps[waiter].collectives[-1], dumps[hung].collectives[-1]
    assert (dumps[waiter].timed_out, dumps[hung].timed_out) == (True, False), result.output[-3000:]
    assert waited.kind == "gloo:all_reduce" and waited.seq == last.seq + 1, (waited, last)
    report = (directory / "report.txt").read_text()
    behind = f"rank {hung} was behind: it never started collective #{waited.seq} gloo:all_reduce, which rank {waiter}"
    assert f"{behind} waits in; it was at {injected_sleep()} in training_step" in report, report
    assert report in result.output
    stacks = (directory / f"rank{hung}.stacks.txt").read_text()
    path, line = injected_sleep().rsplit(":", 1)
    assert f'File "{path}", line {line} in training_step' in stacks and stacks.count("hread 0x") >= 2, stacks


@pytest.mark.parametrize(("name", "code"), [("sigterm", 143), ("sigterm-rank1", 143), ("sigint", 130)])
def test_signal_saves_a_checkpoint_and_says_how_to_resume(results, name, code):
    """SIGTERM to the launcher or to rank 1 alone, or Ctrl-C: every rank stops at one step, last.ckpt is saved
    mid-training and the job exits 128+signal. (Lightning's own check only hears rank 0's SIGTERM.)"""
    result = results[name]
    assert result.returncode == code, result.output[-3000:]
    assert not result.checkpoint_lost and "Resume with: --ckpt_path" in result.output
    step = torch.load(result.workdir / "checkpoints/last.ckpt", weights_only=True)["global_step"]
    assert 3 <= step < STEPS


def test_kill_during_checkpoint_writes_keeps_last_loadable(results):
    """kill -9 while a 64 MB last.ckpt is being rewritten: last.ckpt, the previous complete version, loads after
    each of three kills. The kill is aimed at a write in progress (a partial temporary file is left behind); on a
    busy machine one aim in ten CI runs came late (the write had finished), so at least two of three must land
    mid-write for the check to have tested what it names."""
    saves = [results[f"save{i}"] for i in range(3)]
    tails = [r.output[-2000:] for r in saves]
    assert [r.returncode for r in saves] == [-9] * 3, tails
    assert sum(r.killed_mid_write for r in saves) >= 2, [(r.partial_bytes, r.output[-500:]) for r in saves]
    assert all(checkpoint_ok(r.workdir / "checkpoints/last.ckpt") for r in saves), tails


def resume(results: dict, base: Path) -> dict:
    """The run stopped by SIGTERM mid-epoch resumed from the file it named, the run killed in epoch 1 resumed
    with `--ckpt_path last` in its own directory, and a run never stopped: {name: (last.ckpt, output)}."""
    base.mkdir()
    common = ["fit", "--model", "ddpkit.testing.toy.FaultyClassifier"]
    common += ["--trainer.accelerator", "cpu", "--trainer.devices", "2"]
    common += ["--trainer.max_steps", str(STEPS)]
    common += ["--trainer.logger", "false", "--trainer.enable_progress_bar", "false"]
    roots = {"sigterm": base / "sigterm", "kill9-epoch1": results["kill9-epoch1"].workdir}
    roots["straight"] = base / "straight"
    runs = {
        "sigterm": ["--ckpt_path", str(results["sigterm"].workdir / "checkpoints/last.ckpt")],
        "kill9-epoch1": ["--ckpt_path", "last"],  # the newest last.ckpt under the killed run's directory
        "straight": [],
    }
    outputs = concurrently(
        lambda name: toy_ok(
            *common, *runs[name], "--trainer.default_root_dir", str(roots[name]), cwd=base, timeout=240
        ),
        runs,
    )
    return {name: (roots[name] / "checkpoints/last.ckpt", outputs[name]) for name in runs}


@pytest.mark.parametrize("name", ["sigterm", "kill9-epoch1"])
def test_resumed_run_matches_uninterrupted(resumed, name):
    """Stopped by SIGTERM mid-epoch and resumed from the named file, or killed (-9) in epoch 1 and resumed with
    `--ckpt_path last`, a run ends with the weights of one never stopped."""
    (path, out), (straight, _) = resumed[name], resumed["straight"]
    if name == "kill9-epoch1":
        assert f"fit: --ckpt_path last is {path}\n" in out, out[-3000:]
    a, b = torch.load(path, weights_only=True), torch.load(straight, weights_only=True)
    assert a["global_step"] == b["global_step"] == STEPS
    # Bit for bit: the same float32 operations in the same order (0.0 in both, docs/measurements.md, faults).
    assert max_abs(a["state_dict"], b["state_dict"]) == 0.0


GPUS = torch.cuda.device_count()


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason=f"the NCCL hang path needs 2 visible GPUs, found {GPUS}")
def test_hang_under_nccl_ends_the_job_without_orphans(tmp_path):
    """On 2 GPUs a hung rank 1 ends the job as the manual (faults.md) says: rank 0's NCCL watchdog times the
    all-reduce out after --dist_timeout and takes rank 0 (the launcher) down; rank 1 follows its launcher; no
    process is left."""
    result = run_scenario("hang", tmp_path / "hang", TIMEOUT, deadline=400, max_steps=STEPS, accelerator="gpu")
    assert result.returncode not in (0, None) and result.orphans == 0, result.output[-3000:]
    assert "Watchdog caught collective operation timeout" in result.output, result.output[-3000:]
    assert "the launcher (pid" in result.output and result.seconds < TIMEOUT + 300, result.output[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason=f"the NCCL stop path needs 2 visible GPUs, found {GPUS}")
@pytest.mark.parametrize("name", ["sigterm", "sigterm-rank1"])
def test_signal_stops_both_gpu_ranks_with_a_checkpoint(tmp_path, name):
    """On 2 GPUs (NCCL) the background exchange goes through pinned memory and an event; same outcome as on CPU."""
    result = run_scenario(name, tmp_path / name, dist_timeout=TIMEOUT, max_steps=STEPS, accelerator="gpu")
    assert result.returncode == 143 and result.orphans == 0, result.output[-3000:]
    assert not result.checkpoint_lost and "Resume with: --ckpt_path" in result.output
    step = torch.load(result.workdir / "checkpoints/last.ckpt", weights_only=True)["global_step"]
    assert 3 <= step < STEPS
