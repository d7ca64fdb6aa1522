"""How `python -m ddpkit.tune` schedules a study's trials: which values (never twice), how many at once and on which
devices, what a restart does, what it says, what it keeps. The fits are stub_fit.py's, which train nothing and speak
the worker's protocol as a trial's rank 0 does (test_tune.py runs real DDP trials); everything else is as a user
runs it: the shipped configs/tune.yaml, the manual's Job and spaces, cluster/tune.sbatch, Ctrl-C and kill -9.

One job starts with the session (early.py), "tune_schedule", four studies at once (their fits mostly sleep):
- restart: the shipped tune.yaml, 6 trials, stopped by Ctrl-C mid-trial, started again and killed (-9) mid-trial,
  started again;
- job: the manual's Kubernetes Job as 2 pods started together on a PostgreSQL study (a real server);
- array: cluster/tune.sbatch as 2 tasks of a job array (a journal file), with a heartbeat of 10 minutes;
- pack: two workers on one node of 8 (faked) GPUs, 2 per trial; the first killed (-9) while it holds 4 trials.
The other studies run in the test process (`run_worker`), on the same stub.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import early
import optuna
import pytest
import yaml
from optuna.trial import TrialState
from postgres import server
from procs import finish, start

from ddpkit.testing.fake_cluster import slurm_array_env
from ddpkit.tune import search as tune
from ddpkit.tune.devices import CLAIMS, claim, concurrent_trials, gpu_uuids, visible_gpus
from ddpkit.tune.report import best_yaml
from ddpkit.tune.run import tidy_checkpoints
from ddpkit.tune.space import check_sets, configurations, load_space, suggest
from ddpkit.tune.study import NOTE, REPEAT, RETRY_OF, WORKER, BadInput, open_storage, open_study, tell

TESTS = Path(__file__).resolve().parent
PROJECT = TESTS.parents[1] / "{{cookiecutter.project_slug}}"
SHIPPED = PROJECT / "configs" / "tune.yaml"
SCRIPT = PROJECT / "cluster" / "tune.sbatch"
PAGE = PROJECT / "vendor" / "ddpkit" / "docs" / "tune.md"
STUB = TESTS / "stub_fit.py"
TUNE = [sys.executable, "-m", "ddpkit.tune", "--main", str(STUB)]
TIMEOUT = 300
LR = "model.init_args.optimizer.init_args.lr"


def prepare(folder: Path, space: Path | str = SHIPPED, **stub) -> Path:
    """A fresh folder with the space file (space.yaml) and the stub's settings; returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    text = space.read_text() if isinstance(space, Path) else space
    (folder / "space.yaml").write_text(text)
    (folder / "stub.json").write_text(json.dumps(stub))
    # Each worker would draw its plots at its end (~2.5 CPU-s); test_tune.py's study draws them.
    (folder / "no_plots" / "matplotlib").mkdir(parents=True)
    (folder / "no_plots" / "matplotlib" / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    return folder


def worker(folder: Path, *args: str, env: dict | None = None, name: str = "worker") -> subprocess.Popen:
    """`python -m ddpkit.tune --main stub_fit.py ARGS` in `folder`, its output in folder/<name>.out."""
    env = {"PYTHONPATH": os.pathsep.join([str(folder / "no_plots"), str(TESTS)]), **(env or {})}
    with open(folder / f"{name}.out", "w") as out:
        return start([*TUNE, *args], folder, env, stdout=out)


def records(folder: Path) -> list[dict]:
    """The stub trials' records (stub_fit.py), each with its trial number."""
    found = [json.loads(p.read_text()) for p in sorted((folder / "records").glob("*.json"))]
    for r in found:
        r["trial"] = int(r["root"].rpartition("trial_")[2])
    return found


def study_of(folder: Path, storage: str | None = None, name: str = "space"):
    return optuna.load_study(study_name=name, storage=open_storage(storage, folder / "tune"))


def wait_for(predicate, what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)


def running_trials(folder: Path) -> list[dict]:
    return [r for r in records(folder) if r["end"] is None]


def output(folder: Path, name: str = "worker") -> str:
    return (folder / f"{name}.out").read_text()


# ---- the job ----------------------------------------------------------------------------------------------------
def restart(folder: Path) -> dict:
    """The shipped space, --trials 6: Ctrl-C once trial 1 has a checkpoint; the same command again, killed (-9) as a
    new trial starts; the same command once more, to the end. Trial 1 waits after its first checkpoint, and the second
    run's first new trial at its start, until the test has stopped them: a trial that ended between two looks made
    the first run finish the study (CI of 2026-12-06: exit codes [0, 0, 0])."""
    prepare(folder, sleep=0.5, validations=3, pause={"trial": 1, "until": "stopped"})
    cmd = ["--space", "space.yaml", "--trials", "6", "--heartbeat", "1"]
    first = worker(folder, *cmd, name="first")
    checkpoint = folder / "tune" / "trial_0001" / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    wait_for(lambda: checkpoint.exists() or first.poll() is not None, "trial 1's first checkpoint")
    first.send_signal(signal.SIGINT)
    codes = [finish(first, TIMEOUT).returncode]
    (folder / "stub.json").write_text(json.dumps({"sleep": 0.5, "validations": 3, "hold": "killed"}))
    before = {r["trial"] for r in records(folder)}
    second = worker(folder, *cmd, name="second")
    newer = lambda: [r for r in running_trials(folder) if r["trial"] not in before and not r["resumed"]]  # noqa: E731
    wait_for(lambda: newer() or second.poll() is not None, "a new trial of the second run")
    killed = newer()[0]["trial"] if newer() else None
    second.kill()
    codes.append(finish(second, TIMEOUT).returncode)
    (folder / "killed").touch()  # the held trial, its worker gone, exits; the third run's trials go straight on
    codes.append(finish(worker(folder, *cmd, name="third"), TIMEOUT).returncode)
    return {"codes": codes, "killed": killed, "trials": study_of(folder).get_trials()}


def job(folder: Path) -> dict:
    """The manual's Kubernetes Job: its container's command and arguments as 2 pods started together, the storage
    its Secret would hold a PostgreSQL server's URL, its volume a folder; 8 trials instead of 40."""
    prepare(folder, sleep=0.2)
    (spec,) = [b for b in yaml_blocks() if isinstance(b, dict) and b.get("kind") == "Job"]
    (container,) = spec["spec"]["template"]["spec"]["containers"]
    (mount,) = container["volumeMounts"]
    (folder / "configs").mkdir()
    shutil.copy(SHIPPED, folder / "configs" / "tune.yaml")
    with server() as url:
        args = [
            a.replace("$(TUNE_STORAGE)", url).replace(mount["mountPath"], str(folder / "data"))
            for a in container["args"]
        ]
        assert container["command"] == ["python", "-m", "ddpkit.tune"]
        pods = [worker(folder, *args, "--trials", "8", name=f"pod{i}") for i in range(2)]
        codes = [finish(p, TIMEOUT).returncode for p in pods]
        trials = optuna.load_study(study_name="tune", storage=open_storage(url, folder)).get_trials()
    return {"codes": codes, "trials": trials, "args": args}


def array(folder: Path) -> dict:
    """cluster/tune.sbatch as 2 array tasks (SLURM's variables) on its journal file, --heartbeat 600: the worker
    that waits for the other's last trial must still end with the study, not a heartbeat later."""
    prepare(folder, sleep=0.5)
    cmd = ["bash", str(SCRIPT), "--main", str(STUB), "--space", "space.yaml", "--trials", "4", "--heartbeat", "600"]
    env = {"PYTHONPATH": os.pathsep.join([str(folder / "no_plots"), str(TESTS)])}
    tasks = []
    for task in range(2):
        with open(folder / f"task{task}.out", "w") as out:
            tasks.append(start(cmd, folder, {**slurm_array_env(8000, task, 2), **env}, stdout=out))
    codes = [finish(t, TIMEOUT).returncode for t in tasks]
    trials = study_of(folder, f"journal:{folder}/tune/study.journal").get_trials()
    return {"codes": codes, "trials": trials}


def pack(folder: Path) -> dict:
    """Two workers on a node of 8 GPUs (CUDA_VISIBLE_DEVICES, one claims folder), 2 GPUs per trial, 16 trials: A
    alone runs 4 trials at once; B starts and waits for GPUs; A is killed (-9) while it holds trials. A's first 4
    trials report nothing until the file `release` exists, written once A is killed: under load (16-21), B took so
    long to start that A had run all 16 trials before it, and no trial of A's was left to kill (CI of 2026-12-05).
    B's first 4 trials wait likewise (`release_b`) until all 4 run: under load B started each trial more than a
    trial's 3 s after the one before, and never ran 4 at once (CI of 2026-12-06)."""
    # No pruning: every trial takes 3 s.
    space = yaml.safe_load(SHIPPED.read_text()) | {"pruner": {"class_path": "optuna.pruners.NopPruner"}}
    prepare(folder, yaml.safe_dump(space), sleep=1.0, validations=3, hold="release")
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", CLAIMS: str(folder / "claims")}
    cmd = ["--space", "space.yaml", "--trials", "16", "--devices", "2", "--heartbeat", "1"]
    a = worker(folder, *cmd, env=env, name="a")
    wait_for(lambda: len(running_trials(folder)) == 4 or a.poll() is not None, "worker A's 4 trials")
    # Read by the trials that start from now on: B's (A's 4 hold its GPUs until it is killed).
    (folder / "stub.json").write_text(json.dumps({"sleep": 1.0, "validations": 3, "hold": "release_b"}))
    b = worker(folder, *cmd, env=env, name="b")
    wait_for(lambda: "waiting for 2 free GPU(s)" in output(folder, "b") or b.poll() is not None, "B to wait")
    a.kill()
    killed_at = time.time()
    (folder / "release").touch()
    b_trials = lambda: [r for r in running_trials(folder) if r["start"] > killed_at]  # noqa: E731
    wait_for(lambda: len(b_trials()) == 4 or b.poll() is not None, "B's 4 trials on the GPUs A held")
    (folder / "release_b").touch()
    codes = [finish(a, TIMEOUT).returncode, finish(b, TIMEOUT).returncode]
    return {"codes": codes, "killed_at": killed_at, "trials": study_of(folder).get_trials(), "b_pid": b.pid}


@early.early("tune_schedule")
def _tune_schedule(base: Path) -> dict:
    """The four studies at once, each in a folder of its own: {name: (folder, its result or what it raised)}."""
    scenarios = {"restart": restart, "job": job, "array": array, "pack": pack}
    with ThreadPoolExecutor(len(scenarios)) as pool:
        futures = {name: pool.submit(run, base / name) for name, run in scenarios.items()}
        return {name: (base / name, f.exception() or f.result()) for name, f in futures.items()}


class Scenarios:
    """The job's studies by name; one that raised fails only its own tests."""

    def __init__(self, results: dict) -> None:
        self.results = results

    def __getitem__(self, name: str) -> tuple[Path, dict]:
        folder, result = self.results[name]
        if isinstance(result, BaseException):
            raise result
        return folder, result


@pytest.fixture(scope="module")
def tune_schedule() -> Scenarios:
    return Scenarios(early.result("tune_schedule"))


def yaml_blocks() -> list:
    return [yaml.safe_load(b) for b in re.findall(r"^```yaml\n(.*?)^```", PAGE.read_text(), re.DOTALL | re.MULTILINE)]


def finished(trials: list) -> list:
    return [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]


def assert_distinct(trials: list, total: int) -> None:
    """`total` finished trials, each with values of its own, and no proposal that repeated a trial's values (the
    space has a continuous lr: only a sampler that draws again what it drew proposes a repeat)."""
    done = finished(trials)
    assert len(done) == total, [(t.number, t.state.name) for t in trials]
    assert len({json.dumps(t.params, sort_keys=True) for t in done}) == total, [t.params for t in done]
    repeats = [t.number for t in trials if str(t.user_attrs.get(NOTE, "")).startswith(REPEAT)]
    assert repeats == [], f"proposals that repeated a trial's values: {repeats}"


# ---- no configuration twice -------------------------------------------------------------------------------------
def test_restarts_of_the_shipped_seeded_study_run_only_new_values(tune_schedule):
    """The shipped tune.yaml (seed 0), stopped by Ctrl-C and by kill -9 mid-trial and started again each time: 6
    finished trials with 6 distinct sets of values, none proposed twice; the two trials that were stopped are failed
    and their values ran again as a retry each (what 'no configuration twice' allows: it was asked for)."""
    folder, r = tune_schedule["restart"]
    assert yaml.safe_load(SHIPPED.read_text())["sampler"]["init_args"]["seed"] == 0
    assert r["codes"][0] == 130 and r["codes"][1] == -signal.SIGKILL and r["codes"][2] == 0, r["codes"]
    assert_distinct(r["trials"], 6)
    failed = [t for t in r["trials"] if t.state == TrialState.FAIL]
    assert [t.number for t in failed] == [1, r["killed"]], [(t.number, t.user_attrs) for t in failed]
    for t in failed:
        (retry,) = [x for x in r["trials"] if x.user_attrs.get(RETRY_OF) == t.number]
        assert retry.state in (TrialState.COMPLETE, TrialState.PRUNED) and retry.params == t.params


def test_the_manuals_job_on_postgresql_runs_only_new_values(tune_schedule):
    """The manual's Job, 2 pods started together on one PostgreSQL study with the shipped tune.yaml (seed 0): both
    exit 0, both ran trials, and the 8 finished trials have 8 distinct sets of values, none proposed twice."""
    folder, r = tune_schedule["job"]
    assert r["codes"] == [0, 0], [output(folder, f"pod{i}")[-2000:] for i in range(2)]
    assert "configs/tune.yaml" in r["args"]
    assert_distinct(r["trials"], 8)
    assert len({t.user_attrs[WORKER] for t in finished(r["trials"])}) == 2


def test_the_array_script_runs_only_new_values_and_its_waiting_task_ends_with_the_study(tune_schedule):
    """cluster/tune.sbatch as 2 array tasks on its journal file with the shipped tune.yaml: 4 distinct finished
    trials, none proposed twice, run without SLURM's variables; the task that waited for the other's last trial
    ended with the study although its heartbeat is 10 minutes (it looks every 2 s: the job's 300 s bound)."""
    folder, r = tune_schedule["array"]
    outs = [output(folder, f"task{i}") for i in range(2)]
    assert r["codes"] == [0, 0], [o[-2000:] for o in outs]
    assert_distinct(r["trials"], 4)
    assert any(re.search(r"study: \d/4 finished, 1 running in other workers: waiting", o) for o in outs), outs
    assert all(rec["slurm"] == [] for rec in records(folder)), "a trial saw SLURM's variables"
    assert all(re.search(r"^trial \d: ", o, re.MULTILINE) for o in outs), "a task ran no trial"


def draw(study, space, n: int) -> list[dict]:
    """Ask `n` trials in turn (each told before the next), as one worker does; their values."""
    drawn = []
    for _ in range(n):
        trial = study.ask()
        drawn.append(dict(suggest(trial, space)))
        study.tell(trial, 1.0)
    return drawn


def test_a_seeded_sampler_draws_new_values_after_a_restart_and_the_same_on_a_fresh_study(tmp_path):
    """The shipped space's seeded TPE, built anew as a restarted worker builds it: 3 trials, then 3 more in a
    'restart' (a new sampler on the same study) give 6 distinct values; a fresh study draws the first 3 again
    (one worker on a fresh study is repeatable). Optuna's TPESampler(seed=0) itself, restarted, repeats them."""
    from optuna.samplers import TPESampler

    storage = open_storage(None, tmp_path)
    opened = lambda name: open_study(storage, name, load_space(SHIPPED), "val/loss", "minimize")  # noqa: E731
    space = load_space(SHIPPED)
    first = draw(opened("a"), space, 3)
    later = draw(opened("a"), space, 3)  # the restart: a new worker, a new sampler, the same study
    assert len({json.dumps(v, sort_keys=True) for v in first + later}) == 6
    assert draw(opened("b"), space, 3) == first

    def plain():  # Optuna's seeded sampler, as the space built it before: one seed for every trial
        return optuna.create_study(storage=storage, study_name="c", sampler=TPESampler(seed=0), load_if_exists=True)

    assert draw(plain(), space, 3) == draw(plain(), space, 3), "Optuna's own seeding no longer repeats: re-check"


def test_grid_sampler_keeps_its_seed_so_two_workers_share_one_grid(tmp_path):
    """A GridSampler's seed orders the grid for every trial: two workers (a sampler each, from the same space file)
    that ask in turn on one study get the grid's 4 points, each once."""
    text = (
        "params:\n  a: {choices: [1, 2]}\n  b: {choices: [x, y]}\n"
        "sampler:\n  class_path: optuna.samplers.GridSampler\n"
        "  init_args: {search_space: {a: [1, 2], b: [x, y]}, seed: 0}\n"
    )
    (tmp_path / "grid.yaml").write_text(text)
    storage = open_storage(None, tmp_path)
    studies = [open_study(storage, "g", load_space(tmp_path / "grid.yaml"), "m", "minimize") for _ in range(2)]
    drawn = []
    for i in range(4):
        study = studies[i % 2]
        trial = study.ask()
        drawn.append((trial.suggest_categorical("a", [1, 2]), trial.suggest_categorical("b", ["x", "y"])))
        tell(study, trial, 1.0)  # the grid's last point: the sampler stops the study (ddpkit.tune.study.tell)
    assert sorted(drawn) == [(1, "x"), (1, "y"), (2, "x"), (2, "y")]


def run_worker(folder: Path, capsys, monkeypatch, *args: str) -> tuple[int, str]:
    """`python -m ddpkit.tune --main stub_fit.py ARGS` in this process, in `folder` (no plots): exit status, output."""
    monkeypatch.chdir(folder)
    monkeypatch.setattr(tune, "plot", lambda *a: [])
    previous = signal.getsignal(signal.SIGTERM)
    code = 0
    try:
        tune.main(["--main", str(STUB), *args])
    except SystemExit as exit_:
        code = exit_.code
    finally:
        signal.signal(signal.SIGTERM, previous)
    out, err = capsys.readouterr()
    return code, out + err


FINITE = """
params:
  a: {choices: [1, 2]}
  b: {choices: [x, y]}
sampler: {class_path: optuna.samplers.RandomSampler, init_args: {seed: 0}}
"""


def test_a_finite_space_runs_each_configuration_once_then_says_it_is_done(tmp_path, capsys, monkeypatch):
    """2 x 2 choices and --trials 6: the 4 configurations run once each (proposals that repeat one are failed unrun,
    with a note naming the trial), the worker says the space is done and exits 0; --allow-repeats runs 6."""
    folder = prepare(tmp_path, FINITE)
    code, out = run_worker(folder, capsys, monkeypatch, "--space", "space.yaml", "--trials", "6")
    assert code == 0 and "study: all 4 configurations of the space have run or are running" in out, out
    trials = study_of(folder).get_trials()
    assert sorted(json.dumps(t.params, sort_keys=True) for t in finished(trials)) == sorted(
        json.dumps({"a": a, "b": b}) for a in (1, 2) for b in ("x", "y")
    )
    skipped = [t for t in trials if t.state == TrialState.FAIL]
    assert all(re.fullmatch(rf"{REPEAT} \d+", t.user_attrs[NOTE]) for t in skipped), [t.user_attrs for t in skipped]
    code, out = run_worker(
        folder, capsys, monkeypatch, "--space", "space.yaml", "--trials", "6", "--study", "again", "--allow-repeats"
    )
    assert code == 0 and len(finished(study_of(folder, name="again").get_trials())) == 6, out


# ---- trials packed onto the node's devices ------------------------------------------------------------------------
def overlapping(a: dict, b: dict) -> bool:
    return a["start"] < b["end"] and b["start"] < a["end"]


def full_node(recs: list[dict]) -> bool:
    """Whether at some trial's start 4 trials of `recs` ran, on all 8 GPUs between them."""
    for x in recs:
        now = [y for y in recs if y["start"] <= x["start"] < y["end"]]
        if len(now) == 4 and sorted(",".join(y["cuda"] for y in now).split(",")) == list("01234567"):
            return True
    return False


def test_packed_trials_get_disjoint_gpus_and_ports_and_fill_the_node(tune_schedule):
    """8 GPUs, 2 per trial, two workers on the node: every trial saw 2 GPUs of the 8 (CUDA_VISIBLE_DEVICES) and a
    port; any two trials that ran at the same time (their own records) had disjoint GPUs and distinct ports; worker
    A alone ran 4 trials at once on all 8; B waited while A held them, and after A was killed (-9) B's trials got
    the GPUs A's trials held then, and all 8 with 4 trials at once (A's claims died with A and its trials: B's
    trials started after the kill are the ones counted); the
    study holds 16 finished trials, each run once, A's killed trials failed and run again. Each trial's processes
    got 1/8 of the cores as threads."""
    folder, r = tune_schedule["pack"]
    assert r["codes"][1] == 0, output(folder, "b")[-3000:]
    recs = records(folder)
    assert all(len(rec["cuda"].split(",")) == 2 and set(rec["cuda"].split(",")) <= set("01234567") for rec in recs)
    for i, a in enumerate(recs):
        for b in recs[i + 1 :]:
            if overlapping(a, b):
                assert not set(a["cuda"].split(",")) & set(b["cuda"].split(",")), (a, b)
                assert a["port"] != b["port"], (a, b)
    trials = {t.number: t for t in r["trials"]}
    by = lambda pid: [rec for rec in recs if trials[rec["trial"]].user_attrs[WORKER].endswith(f":{pid}")]  # noqa: E731
    workers = {t.user_attrs[WORKER].rpartition(":")[2] for t in r["trials"] if WORKER in t.user_attrs}
    (a_pid,) = workers - {str(r["b_pid"])}
    assert full_node(by(a_pid)), by(a_pid)
    held = {gpu for rec in by(a_pid) if rec["end"] > r["killed_at"] for gpu in rec["cuda"].split(",")}
    later = [rec for rec in by(r["b_pid"]) if rec["start"] > r["killed_at"]]
    assert held and held <= {gpu for rec in later for gpu in rec["cuda"].split(",")}, (held, later)
    assert full_node(later), later
    assert "waiting for 2 free GPU(s): other trials on this node hold them" in output(folder, "b")
    assert len(finished(r["trials"])) == 16 and len({rec["root"] for rec in recs}) == len(recs)
    for t in r["trials"]:
        if t.state == TrialState.FAIL:
            assert [x.state for x in r["trials"] if x.user_attrs.get(RETRY_OF) == t.number] in (
                [TrialState.COMPLETE],
                [TrialState.PRUNED],
            )
    assert {rec["threads"] for rec in recs} == {str(max(1, len(os.sched_getaffinity(0)) // 8))}


def test_claims_keep_gpus_apart_and_die_with_their_holder(tmp_path):
    """A claim per GPU pair: 8 GPUs hold 4 claims of 2, the 5th waits (None); a released pair is claimed again; a
    process that holds a pair and is killed (-9) frees it, with no file to clean up; each claim has its own port."""
    folder = tmp_path / "claims"
    code = (
        "import sys, time; from pathlib import Path; from ddpkit.tune.devices import claim\n"
        "held = claim(['a', 'b'], 2, Path(sys.argv[1])); print(held.gpus, flush=True); time.sleep(600)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "['a', 'b']"
        gpus = ["a", "b", *"cdefgh"]
        held = [claim(gpus, 2, folder) for _ in range(3)]
        assert [c.gpus for c in held] == [["c", "d"], ["e", "f"], ["g", "h"]] and claim(gpus, 2, folder) is None
        assert len({c.port for c in held}) == 3
        held[1].release()
        assert claim(gpus, 2, folder).gpus == ["e", "f"]
        holder.kill()
        holder.wait(timeout=30)
        assert claim(gpus, 2, folder).gpus == ["a", "b"]
    finally:
        holder.kill()


def test_visible_gpus_are_named_as_nvidia_smi_names_them(tmp_path):
    """CUDA_VISIBLE_DEVICES=0,1 in two cgroups names different GPUs: indices become nvidia-smi's UUIDs (claims then
    never collide); no CUDA_VISIBLE_DEVICES: every GPU nvidia-smi lists; entries up to the first invalid one; the
    entries as they are without nvidia-smi."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '0, GPU-aaaa'\necho '1, GPU-bbbb'\n")
    smi.chmod(0o755)
    uuids = gpu_uuids(str(smi))
    assert uuids == {"0": "GPU-aaaa", "1": "GPU-bbbb"}
    assert visible_gpus(None, uuids) == ["GPU-aaaa", "GPU-bbbb"]
    assert visible_gpus("1,-1,0", uuids) == ["GPU-bbbb"]
    assert gpu_uuids(str(tmp_path / "absent")) == {} and visible_gpus("3,5", {}) == ["3", "5"]


@pytest.mark.parametrize(
    ("gpus", "devices", "parallel", "expected"),
    [(8, 2, None, 4), (8, 2, 2, 2), (7, 2, None, 3), (0, 2, None, 1), (0, 1, 3, 3)],
)
def test_a_worker_runs_as_many_trials_as_its_gpus_hold(gpus, devices, parallel, expected):
    """floor(GPUs / devices) trials at once, --parallel fewer; on CPU 1, or --parallel."""
    assert concurrent_trials([str(i) for i in range(gpus)], devices, parallel) == expected


@pytest.mark.parametrize(("gpus", "devices", "parallel"), [(1, 2, None), (8, 2, 5)])
def test_more_devices_than_the_worker_sees_are_refused(gpus, devices, parallel):
    with pytest.raises(BadInput, match=r"--(devices|parallel) \d+: "):
        concurrent_trials([str(i) for i in range(gpus)], devices, parallel)


# ---- checkpoints and resume -----------------------------------------------------------------------------------------
def test_a_trial_stopped_by_ctrl_c_resumes_from_its_last_checkpoint(tune_schedule):
    """Ctrl-C stopped trial 1 after a validation: its values ran again, as the next run's first trial, from its
    last.ckpt (the fit was given it: --ckpt_path), at the samples after it, with trial 1's curve copied first."""
    folder, r = tune_schedule["restart"]
    trials = {t.number: t for t in r["trials"]}
    (retry,) = [t for t in r["trials"] if t.user_attrs.get(RETRY_OF) == 1]
    (rec,) = [x for x in records(folder) if x["trial"] == retry.number]
    ckpt = (folder / "tune" / "trial_0001" / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt").resolve()
    assert rec["resumed"] == str(ckpt), rec
    assert rec["first_samples"] == max(trials[1].intermediate_values) + 1024, (rec, trials[1].intermediate_values)
    assert {k: retry.intermediate_values[k] for k in trials[1].intermediate_values} == trials[1].intermediate_values
    assert f"trial {retry.number}: " in output(folder, "second") and f", resuming {ckpt}, " in output(folder, "second")
    assert "trial 1: interrupted: failed; its values run again when a worker starts" in output(folder, "first")


def test_a_retry_resumed_at_its_end_keeps_the_value_it_had(tmp_path, capsys, monkeypatch):
    """A trial stopped after its last checkpoint (its fit done, its worker killed before telling): the retry resumes
    there, trains and validates nothing more, and completes with the stopped run's last value (not: 'the fit ran no
    validation', which would stop the worker)."""
    folder = prepare(tmp_path, FINITE)
    (folder / "tune").mkdir()
    space = load_space(folder / "space.yaml")
    study = open_study(open_storage(None, folder / "tune"), "space", space, "val/loss", "minimize")
    params, curve = {"a": 1, "b": "x"}, {1024: 0.8, 2048: 0.6}
    stopped = optuna.trial.create_trial(
        state=TrialState.FAIL, params=params, distributions=space.params, intermediate_values=curve
    )
    study.add_trial(stopped)
    study.enqueue_trial(params, user_attrs={RETRY_OF: 0})
    ckpt = folder / "tune" / "trial_0000" / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_text(json.dumps({"samples": 2048}))  # the stub's checkpoint after its 2 validations
    code, out = run_worker(folder, capsys, monkeypatch, "--space", "space.yaml", "--trials", "1")
    retry = study_of(folder).get_trials()[1]
    assert code == 0 and retry.state == TrialState.COMPLETE and retry.value == 0.6, out
    assert retry.intermediate_values == curve and not VALIDATION.search(out)


def test_a_study_leaves_only_the_best_trials_checkpoints(tune_schedule):
    """--checkpoints best (the default): of the trials' checkpoints (every trial wrote 2, and 2 stopped trials kept
    theirs until their values had run again), the study leaves the best trial's two."""
    folder, r = tune_schedule["restart"]
    best = min((t for t in r["trials"] if t.state == TrialState.COMPLETE), key=lambda t: t.value)
    left = sorted(str(p.relative_to(folder / "tune")) for p in (folder / "tune").rglob("*.ckpt"))
    run = f"trial_{best.number:04d}/lightning_logs/version_0/checkpoints"
    assert left == [f"{run}/best-0.ckpt", f"{run}/last.ckpt"], left


def test_checkpoint_policy_keeps_what_running_and_retried_trials_need(tmp_path):
    """tidy_checkpoints: 'all' removes nothing; 'best' leaves the best complete trial's, a running trial's, and those
    of every earlier run that a queued retry continues (its whole chain); 'none' leaves only the last two."""
    dists = {"x": optuna.distributions.FloatDistribution(0.0, 1.0)}
    study = optuna.create_study(storage=open_storage(None, tmp_path), study_name="s")
    for value in (0.5, 0.2, 0.9):  # trials 0, 1 (the best), 2
        study.add_trial(optuna.trial.create_trial(params={"x": value}, distributions=dists, value=value))
    study.tell(study.ask(dists), state=TrialState.FAIL)  # 3: killed
    study.enqueue_trial({"x": 0.3}, user_attrs={RETRY_OF: 3})
    study.tell(study.ask(dists), state=TrialState.FAIL)  # 4: 3's retry, killed too
    running = study.ask(dists)  # 5
    study.enqueue_trial({"x": 0.3}, user_attrs={RETRY_OF: 4})  # 6: queued, continues 4 (which continued 3)
    assert running.number == 5 and [t.state for t in study.get_trials()][-1] == TrialState.WAITING
    for n in range(6):
        path = tmp_path / f"trial_{n:04d}" / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
        path.parent.mkdir(parents=True)
        path.write_text("")

    def left() -> list[int]:
        return sorted(int(p.parts[-5].removeprefix("trial_")) for p in tmp_path.rglob("*.ckpt"))

    assert tidy_checkpoints(study, tmp_path, "all") == [] and left() == [0, 1, 2, 3, 4, 5]
    tidy_checkpoints(study, tmp_path, "best")
    assert left() == [1, 3, 4, 5]
    tidy_checkpoints(study, tmp_path, "none")
    assert left() == [3, 4, 5]


# ---- progress -------------------------------------------------------------------------------------------------------
VALIDATION = re.compile(
    r"^trial (\d+): step (\d+), (\d+) samples: val/loss (\S+): (go on|pruned) \(study: (.*)\)$", re.M
)


def test_a_worker_says_each_validation_and_the_time_left_and_prints_the_table(tune_schedule):
    """The last run of the restart: one line per validation of each of its trials (step, samples, the metric as the
    study holds it, the pruner's verdict: pruned only on a pruned trial's last), each with the study's progress and
    an estimate of the time left; at the end the table, as trials.md holds it."""
    folder, r = tune_schedule["restart"]
    out = output(folder, "third")
    trials = {t.number: t for t in r["trials"]}
    lines = VALIDATION.findall(out)
    assert lines, out[-3000:]
    for number in {int(line[0]) for line in lines}:
        t = trials[number]
        own = [line for line in lines if int(line[0]) == number]
        copied = len(t.intermediate_values) - len(own)  # a retry's curve starts with its earlier run's
        for i, (_, step, samples, value, verdict, study) in enumerate(own):
            assert t.intermediate_values[int(samples)] == pytest.approx(float(value), rel=1e-3)
            assert int(step) == int(samples) // 64 or int(step) == int(samples) // 128
            last = i + copied == len(t.intermediate_values) - 1
            assert verdict == ("pruned" if last and t.state == TrialState.PRUNED else "go on"), (number, own)
            assert re.fullmatch(r"\d/6 finished, about \d+ (s|min) left", study), study
    table = (folder / "tune" / "trials.md").read_text()
    assert table in out and table.count("\n| ") == 1 + len(trials), table


def test_the_start_line_says_when_plots_need_the_tune_extra(tmp_path, capsys, monkeypatch):
    """Without matplotlib the worker says at its start, not at its end, that the plots need the tune extra."""
    folder = prepare(tmp_path, FINITE)
    monkeypatch.setattr(tune, "can_plot", lambda: False)
    code, out = run_worker(folder, capsys, monkeypatch, "--space", "space.yaml", "--trials", "1")
    lines = out.splitlines()
    assert code == 0 and lines[1] == 'matplotlib is not installed: no plots at the end (pip install -e ".[tune]")'
    assert lines[0].startswith("study 'space' in sqlite:///tune/study.db: minimize val/loss, reported at samples; ")


# ---- the pruning clock, Hyperband and successive halving ------------------------------------------------------
CLOCK_SPACE = """
metric: val/loss
params:
  model.init_args.lr: {choices: [0.01, 0.012, 0.1]}
  data.init_args.global_batch_size: {choices: [64, 128]}
pruner: {class_path: optuna.pruners.MedianPruner, init_args: {n_startup_trials: 2}}
"""


@pytest.mark.parametrize("clock", ["samples", "steps"])
def test_the_pruner_compares_trials_at_the_same_samples_seen(tmp_path, capsys, monkeypatch, clock):
    """Two batch-128 trials (lr 0.01 and 0.1), then a batch-64 one (lr 0.012) whose curve over samples is just worse
    than the first's (the stub's curves depend on samples, not steps). At samples (the default clock) its first
    validation (1024 samples) is under the median of theirs at 1024: it completes. With `clock: steps` it meets
    them at step 16, where they have seen twice its samples, and is pruned: the unfair comparison the default
    avoids."""
    space = CLOCK_SPACE + ("clock: steps\n" if clock == "steps" else "")
    folder = prepare(tmp_path, space)
    (folder / "tune").mkdir()
    study = open_study(
        open_storage(None, folder / "tune"), "space", load_space(folder / "space.yaml"), "val/loss", "minimize"
    )
    for lr, batch in ((0.01, 128), (0.1, 128), (0.012, 64)):
        study.enqueue_trial({"model.init_args.lr": lr, "data.init_args.global_batch_size": batch})
    code, out = run_worker(folder, capsys, monkeypatch, "--space", "space.yaml", "--trials", "3")
    assert code == 0, out
    third = study_of(folder).get_trials()[2]
    if clock == "samples":
        assert third.state == TrialState.COMPLETE and list(third.intermediate_values) == [1024, 2048]
    else:
        assert third.state == TrialState.PRUNED and list(third.intermediate_values) == [16], third
        assert "trial 2: PRUNED at step 16, val/loss " in out


def pruner_blocks() -> dict[str, dict]:
    """The manual's pruner examples: {class name: block}."""
    return {
        b["pruner"]["class_path"].rpartition(".")[2]: b
        for b in yaml_blocks()
        if isinstance(b, dict) and set(b) == {"pruner"}
    }


@pytest.mark.parametrize("name", ["HyperbandPruner", "SuccessiveHalvingPruner"])
def test_the_manuals_hyperband_and_successive_halving_prune_at_their_rungs(tmp_path, capsys, monkeypatch, name):
    """The manual's pruner block over the shipped space, 9 trials of 20 validations of 1024 samples (20 epochs of the
    example): some trials are pruned, each at a rung (1024 x 3^k samples: the block's min_resource and
    reduction_factor, in samples seen), and the others run to the end (20480 samples)."""
    block = pruner_blocks()[name]
    space = yaml.safe_load(SHIPPED.read_text()) | block
    folder = prepare(tmp_path, yaml.safe_dump(space), validations=20)
    code, out = run_worker(folder, capsys, monkeypatch, "--space", "space.yaml", "--trials", "9")
    assert code == 0, out
    done = study_of(folder).get_trials()
    pruned = [max(t.intermediate_values) for t in done if t.state == TrialState.PRUNED]
    complete = [max(t.intermediate_values) for t in done if t.state == TrialState.COMPLETE]
    rungs = {1024 * 3**k for k in range(3)}
    assert pruned and complete and set(pruned) <= rungs and set(complete) == {20480}, (pruned, complete)


# ---- conditional spaces -------------------------------------------------------------------------------------------
def test_the_manuals_conditional_space_gives_momentum_to_sgd_only(tmp_path, capsys, monkeypatch):
    """The manual's conditional space (the optimizer's class; momentum only `when` it is SGD): 8 trials, each SGD
    trial with a momentum in its range and no AdamW trial with one; each fit got the class before its arguments
    (its command line), checked once per branch before any trial; best.yaml nests the class and its arguments as
    a config does."""
    (block,) = [b for b in yaml_blocks() if isinstance(b, dict) and "when" in str(b)]
    sampler = {"class_path": "optuna.samplers.RandomSampler", "init_args": {"seed": 0}}  # both classes in 8 trials
    folder = prepare(tmp_path, yaml.safe_dump(block | {"sampler": sampler}))
    code, out = run_worker(folder, capsys, monkeypatch, "--space", "space.yaml", "--trials", "8")
    assert code == 0, out
    optimizer, momentum = "model.init_args.optimizer", "model.init_args.optimizer.init_args.momentum"
    trials = finished(study_of(folder).get_trials())
    assert {t.params[optimizer] for t in trials} == {"torch.optim.AdamW", "torch.optim.SGD"}, [t.params for t in trials]
    for t in trials:
        sgd = t.params[optimizer] == "torch.optim.SGD"
        assert (momentum in t.params) == sgd and (not sgd or 0.0 <= t.params[momentum] <= 0.99), t.params
        (rec,) = [r for r in records(folder) if r["trial"] == t.number]
        assert next(iter(rec["values"])) == optimizer, rec["values"]  # the stub keeps its arguments' order
    best = yaml.safe_load((folder / "tune" / "best.yaml").read_text())["model"]["init_args"]["optimizer"]
    assert best["class_path"] in ("torch.optim.AdamW", "torch.optim.SGD") and "lr" in best["init_args"], best


def test_conditions_and_their_checks(tmp_path):
    """`when:` is read into conditions and orders the keys (a class before its arguments, a condition's key first);
    the checks before any trial build one fit per branch, each key at its lower end where it applies; a finite space
    counts its configurations per branch."""
    (tmp_path / "s.yaml").write_text(
        "params:\n"
        "  model.opt.momentum: {choices: [0.0, 0.9], when: {model.opt: SGD}}\n"
        "  model.opt: {choices: [AdamW, SGD]}\n"
        "  model.width: {low: 16, high: 64, step: 16}\n"
    )
    space = load_space(tmp_path / "s.yaml")
    assert list(space.params) == ["model.opt", "model.opt.momentum", "model.width"]
    assert space.conditions == {"model.opt.momentum": {"model.opt": ["SGD"]}}
    assert check_sets(space) == [
        {"model.opt": "AdamW", "model.width": 16},
        {"model.opt": "SGD", "model.opt.momentum": 0.0, "model.width": 16},
    ]
    assert configurations(space) == (1 + 2) * 4
    (tmp_path / "s.yaml").write_text("params:\n  lr: {low: 0.1, high: 1.0}\n  b: {choices: [1, 2]}\n")
    assert configurations(load_space(tmp_path / "s.yaml")) == float("inf")


@pytest.mark.parametrize(
    ("when", "expected"),
    [
        ("{nope: 1}", "params.b.when: nope is not another key of params with choices"),
        ("{a: 0.5}", "params.b.when: a is not another key of params with choices"),
        ("{c: 3}", "params.b.when: c takes [1, 2], not [3]"),
        ("[c]", "params.b.when: give {KEY: VALUE} or {KEY: [VALUES]}"),
    ],
    ids=["unknown-key", "range-parent", "value-not-a-choice", "not-a-mapping"],
)
def test_bad_conditions_are_refused(tmp_path, when, expected):
    """A condition on a key the space lacks, on a range, on a value its key never takes: one BadInput naming it."""
    (tmp_path / "s.yaml").write_text(
        f"params:\n  a: {{low: 0.1, high: 1.0}}\n  c: {{choices: [1, 2]}}\n  b: {{choices: [1], when: {when}}}\n"
    )
    with pytest.raises(BadInput) as error:
        load_space(tmp_path / "s.yaml")
    assert expected in str(error.value)


def test_conditions_that_form_a_cycle_or_contradict_are_refused(tmp_path):
    """a applies when b is 1 and b when a is 1: a cycle; c applies when a is 1 and when a is 2 (through b)."""
    (tmp_path / "s.yaml").write_text("params:\n  a: {choices: [1], when: {b: 1}}\n  b: {choices: [1], when: {a: 1}}\n")
    with pytest.raises(BadInput, match=r"the conditions \(when:\) of \['a', 'b'\] form a cycle"):
        load_space(tmp_path / "s.yaml")
    (tmp_path / "s.yaml").write_text(
        "params:\n  a: {choices: [1, 2]}\n  b: {choices: [1], when: {a: 1}}\n  c: {choices: [1], when: {a: 2, b: 1}}\n"
    )
    with pytest.raises(BadInput, match=r"params.c never applies"):
        load_space(tmp_path / "s.yaml")


def test_best_yaml_nests_a_class_and_its_arguments(tmp_path):
    """The best trial chose SGD with momentum 0.9: best.yaml holds the class as the optimizer's class_path and the
    momentum under its init_args, as config.yaml writes an optimizer."""
    dists = {
        "model.init_args.optimizer": optuna.distributions.CategoricalDistribution(
            ["torch.optim.AdamW", "torch.optim.SGD"]
        ),
        "model.init_args.optimizer.init_args.momentum": optuna.distributions.FloatDistribution(0.0, 0.99),
    }
    study = optuna.create_study(storage=open_storage(None, tmp_path), study_name="s")
    params = {"model.init_args.optimizer": "torch.optim.SGD", "model.init_args.optimizer.init_args.momentum": 0.9}
    study.add_trial(optuna.trial.create_trial(params=params, distributions=dists, value=0.1))
    paths = {
        "model.init_args.optimizer": ["model", "init_args", "optimizer", "class_path"],
        "model.init_args.optimizer.init_args.momentum": ["model", "init_args", "optimizer", "init_args", "momentum"],
    }
    text = best_yaml(study, paths, "val/loss", [], tmp_path)
    assert yaml.safe_load(text) == {
        "model": {"init_args": {"optimizer": {"class_path": "torch.optim.SGD", "init_args": {"momentum": 0.9}}}}
    }


# ---- install ---------------------------------------------------------------------------------------------------------
def test_the_tune_extra_brings_the_plots_and_the_readme_installs_it():
    """ddpkit's tune extra requires matplotlib (its plots), and the baked README's install names `.[tune]`."""
    import tomllib

    extras = tomllib.loads((PROJECT / "vendor" / "ddpkit" / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert any(req.startswith("matplotlib") for req in extras["tune"]), extras["tune"]
    install = (PROJECT / "README.md").read_text().split("## Install", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    assert 'pip install -e ".[tune]" -c constraints.txt' in install, install
