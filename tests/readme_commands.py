"""How each shell command of the root README and of a baked project's docs is checked, and `run_readme`,
which runs the baked project's documented commands for tests/test_docs.py (started in the background by
tests/conftest.py, beside the other tests).

A baked project's docs are its README.md and the library's manual, `vendor/ddpkit/docs/*.md` (`doc_files`: the
README first, then the pages in the order `index.md` links them). `GENERATED` and `ROOT` say how each command is
checked, keyed by the command exactly as the page writes it (without a trailing `# comment`). A command in the
docs that these tables do not list fails the test, and so does a listed command that no page has any more: docs
and tables stay in step. A command that moves from the README to a manual page keeps its check.

The checks:
- `Run`: run in the baked project (with the language-model and streaming examples), in a virtual environment that the
  docs' own install commands fill; it must exit 0 and print every `expect` string (and none of `absent`).
  Where a page shows output (a block opening with `$ command`), each `expect` string must also be in
  the output the page shows. The command runs as written or with one of these substitutions for a 2-core
  CPU machine, each visible in the table: fewer steps (`FEW`), 2 CPU processes where the docs have 4 or 8
  GPUs, this machine for the other node of a rendezvous, a run folder outside the project (`aside`) for the
  commands of chains 3 and 4 that train.
- `NeedsGPU`: without a GPU the command stops at once with one `error:` line and exit 2, like other bad
  input; with `--print_config` added it must parse (exit 0).
- `Scheduler`: `sbatch` becomes `bash` under the variables SLURM sets, with a stand-in `srun` that runs its
  command with `--print_config` added: the command the script composes parses and holds `expect`.
- `Elsewhere`: another test runs this command (named, and checked to exist).

`run_readme` runs the install commands first, then the rest in four chains at once, each in the docs' order (a
later command may use what an earlier one trained; a command documented twice runs once, where it first
appears): `CHAINS` says which command runs in which, and why.

How a command starts: one that is `python main.py ARGS` (variable assignments before it aside, no other shell syntax)
is forked from a server that has imported main.py once in the docs' environment (ddpkit/testing/forkserver.py): the
same code from `main.main()` on, with the variables set, its output and exit status, less the ~4 CPU-s of imports
that every fresh interpreter pays (about 25 commands here). The README's `python main.py fit`, the wandb run
(`FRESH`) and every other command start as the docs write them, under bash.
"""

import re
import shlex
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from bakes import TEMPLATE, run

from ddpkit.testing.helpers import ForkServer, run_main

FEW = " --trainer.max_steps 20"  # fewer steps: enough for a validation pass, a checkpoint and the doctor
FEW_LM = " --trainer.max_steps 4"  # the language model's steps are ~0.4 s on this machine


def aside(name: str) -> str:
    """A run folder outside the project (ASIDE, for chains 3 and 4): `--ckpt_path last`, `best` and `auto` in the
    first chain take the newest checkpoint anywhere under the project, which must be the first chain's."""
    return f" --trainer.default_root_dir ASIDE/{name}"


@dataclass
class Run:
    command: str | None = None  # what runs here, when it differs from the docs'
    expect: list[str] = field(default_factory=list)
    absent: list[str] = field(default_factory=list)
    # A hang guard: at 300 s the README's 20-step sweep ran out on a slowed host (2026-12-06) and the job's error
    # failed every test of test_docs.py that reads it.
    timeout: float = 600


@dataclass
class NeedsGPU:
    error: str  # the one `error:` line without a GPU


@dataclass
class Scheduler:
    nodes: int  # SLURM_NNODES that sbatch would set
    expect: list[str]


@dataclass
class Elsewhere:
    test: str  # file::function of the test that runs the command


OWN_PROJECT = "tests/test_own_project.py::test_own_model_and_data_keep_the_guarantees"
UPDATE = "tests/test_own_project.py::test_update_keeps_the_users_files_and_brings_the_new_library"
PRESETS = "tests/test_own_project.py::test_update_brings_the_new_manual_and_the_presets_the_project_lacks"
NO_GPU = "--trainer.accelerator gpu but no CUDA GPU is visible: use --trainer.accelerator cpu."
DOCTOR_LINES = [
    "Scaling doctor: 2 x cpu, ",
    "rank | samples/s | step ms | data ms | compute ms | comm ms | other ms | cpu wait ms | gc ms | peak MB",
    "data wait ",
    "verdict: ",
]
TUNE_TESTS = "tests/library/test_tune.py::"
LR_FINDER_TESTS = "tests/library/test_lr_finder.py::"
TUNE_SCHEDULE = "tests/library/test_tune_schedule.py::"
SWEEP_HEADER = "| devices | samples/s | speed-up | efficiency | step ms | ideal ms | gap ms | compute | comm | data |"

GENERATED = {
    "pip install torch==2.13.0": Run(),
    'pip install -e ".[dev]" -c constraints.txt': Run(),
    "python main.py fit": Run(expect=["Scaling doctor: 1 x cpu", "verdict: "]),
    "python main.py fit --trainer.devices 2": Run(
        "python main.py fit --trainer.devices 2" + FEW + aside("devices-2"), ["2 x cpu"]
    ),
    "python main.py fit --trainer.accelerator cpu --trainer.devices 2": Run(
        "python main.py fit --trainer.accelerator cpu --trainer.devices 2" + FEW + aside("cpu-2"),
        ["Scaling doctor: 2 x cpu"],
    ),
    "python main.py fit --print_config": Run(expect=["class_path: ddp_digits.digits.module.DigitsClassifier"]),
    "python main.py fit --help": Run(expect=["--trainer.devices", "--doctor.comm_share", "--model.help CLASS"]),
    "python main.py fit --model.help DigitsClassifier": Run(expect=["--model.hidden_dim", "--model.optimizer"]),
    "python main.py fit --data.help DigitsDataModule": Run(expect=["--data.global_batch_size"]),
    "python main.py fit --config configs/debug.yaml": Run(
        expect=["FIT Profiler Report", "Scaling doctor: 1 x cpu, 2 steps"]  # 5 batches, 3 of them warm-up
    ),
    "pytest tests/test_guarantees.py": Elsewhere(OWN_PROJECT),
    "python main.py fit --trainer.devices 1 --trainer.default_root_dir runs/one": Run(
        "python main.py fit --trainer.devices 1 --trainer.default_root_dir runs/one" + FEW
    ),
    "python main.py fit --trainer.devices 8 --trainer.default_root_dir runs/eight": Run(
        "python main.py fit --trainer.devices 2 --trainer.default_root_dir runs/eight" + FEW, ["2 x cpu"]
    ),
    "python -m ddpkit.parity runs/one/lightning_logs/version_0 runs/eight/lightning_logs/version_0": Run(
        expect=["PASS: worst max_rel"]
    ),
    # The rounding reference of runs/one: the same training, 1 device x 4 micro-batches of 16 (the example's global
    # batch is 64), as few steps as the runs it judges.
    "python main.py fit --trainer.devices 1 --data.micro_batch_size 16 --trainer.default_root_dir runs/reordered": Run(
        "python main.py fit --trainer.devices 1 --data.micro_batch_size 16 --trainer.default_root_dir runs/reordered"
        + FEW
    ),
    (
        "python -m ddpkit.parity runs/one/lightning_logs/version_0 runs/eight/lightning_logs/version_0 "
        "--reference runs/reordered/lightning_logs/version_0"
    ): Run(expect=["reference: reordering moved weights by max_rel ", "PASS: worst max_rel", " (weights), "]),
    # In the docs' project every preset is as shipped; copying one (refused here: it exists) is the own project's.
    "python -m ddpkit.presets": Run(
        expect=["presets (use: python main.py fit --config configs/NAME.yaml):", "  mlflow          in configs/"],
        absent=["missing", "changed"],
    ),
    "python -m ddpkit.presets mlflow": Elsewhere(PRESETS),
    "ruff check --fix .": Run(expect=["All checks passed!"]),
    "python main.py fit --ckpt_path auto": Run("python main.py fit --ckpt_path auto" + FEW, ["fit: --ckpt_path auto"]),
    "kubectl apply -f cluster/trainjob.yaml": Elsewhere(
        "tests/library/test_cluster_restarts.py::test_trainjob_command_on_two_nodes_trains_one_device_weights"
    ),
    "sbatch cluster/slurm.sbatch": Scheduler(2, ["num_nodes: 2", "devices: '4'", "slurm_requeue: true"]),
    "sbatch --nodes 4 cluster/slurm.sbatch --config configs/model_parallel.yaml": Scheduler(
        4, ["num_nodes: 4", "slurm_requeue: true", "ModelParallelStrategy", "default_root_dir: runs/slurm-4242"]
    ),
    "NNODES=2 GPUS_PER_NODE=8 RDZV_ENDPOINT=node0:29400 bash cluster/torchrun.sh": Run(
        "NNODES=1 GPUS_PER_NODE=2 RDZV_ENDPOINT=localhost:PORT bash cluster/torchrun.sh --trainer.accelerator cpu"
        + FEW
        + aside("torchrun"),
        ["Scaling doctor: 2 x cpu"],
    ),
    "python main.py fit --config configs/lm.yaml": Run(
        "python main.py fit --config configs/lm.yaml" + FEW_LM + aside("lm")
    ),
    "python main.py fit --config configs/lm.yaml --config configs/model_parallel.yaml": Run(
        "python main.py fit --config configs/lm.yaml --config configs/model_parallel.yaml" + FEW_LM + aside("lm-mp"),
        ["2 x cpu"],
    ),
    "python main.py fit --config configs/lm.yaml --config configs/fsdp.yaml": NeedsGPU(NO_GPU),
    "python main.py fit --config configs/stream.yaml": Run(
        "python main.py fit --config configs/stream.yaml" + FEW + aside("stream"), ["Scaling doctor: 1 x cpu"]
    ),
    "python main.py fit --config configs/stream.yaml --trainer.devices 2": Run(
        "python main.py fit --config configs/stream.yaml --trainer.devices 2" + FEW + aside("stream-2"),
        ["Scaling doctor: 2 x cpu"],
    ),
    (
        "python main.py fit --trainer.accelerator cpu --trainer.devices 2 --trainer.max_steps 100 "
        "--doctor.measure_comm true"
    ): Run(
        "python main.py fit --trainer.accelerator cpu --trainer.devices 2 --trainer.max_steps 20 "
        "--doctor.measure_comm true" + aside("comm"),
        DOCTOR_LINES,
        absent=["comm not timed"],
    ),
    "python main.py fit --doctor.report_every_n_steps 100": Run(
        "python main.py fit --doctor.report_every_n_steps 100" + FEW + aside("every"), ["Scaling doctor"]
    ),
    "python main.py fit --doctor.comm_share 0.5": Run(
        "python main.py fit --doctor.comm_share 0.5" + FEW + aside("share")
    ),
    "python main.py fit --doctor.enabled false": Run(
        "python main.py fit --doctor.enabled false" + FEW + aside("off"), absent=["Scaling doctor"]
    ),
    'pip install -e ".[scaling]" -c constraints.txt': Run(),
    'pip install -e ".[trackers]" -c constraints.txt': Run(),
    "python main.py fit --config configs/mlflow.yaml": Run(
        "python main.py fit --config configs/mlflow.yaml" + FEW, ["Experiment with name lightning_logs not found"]
    ),
    "WANDB_MODE=offline python main.py fit --config configs/wandb.yaml": Run(
        "WANDB_MODE=offline python main.py fit --config configs/wandb.yaml" + FEW, ["wandb sync wandb/offline-run-"]
    ),
    "python -m ddpkit.scaling --devices 1 2 4 --max-steps 300": Run(
        "python -m ddpkit.scaling --devices 1 2 --max-steps 20", [SWEEP_HEADER, "written: "]
    ),
    "python -m ddpkit.scaling --devices 1 2 -- --trainer.accelerator cpu": Run(
        expect=[SWEEP_HEADER, "written: scaling/scaling.md, scaling.json, scaling.png"]
    ),
    "python -m ddpkit.scaling --explain scaling/devices_1 scaling/devices_2": Run(
        expect=["2 device(s) against 1: ", "  unexplained ", "verdict: "]
    ),
    "python -m ddpkit.scaling --preflight --devices 2 -- --trainer.accelerator cpu": Run(
        expect=[
            "backend: gloo",
            "rank | device | current_device | name | cores visible | all_reduce(1)",
            "ok: 2 processes joined one gloo group and all-reduced correctly",
        ]
    ),
    'pip install -e ".[tune]" -c constraints.txt': Run(),
    # One trial of the study, on 2 CPU processes, 20 steps; then its best values (in a folder outside the project).
    "python -m ddpkit.tune --space configs/tune.yaml --trials 20 --devices 2": Run(
        "python -m ddpkit.tune --space configs/tune.yaml --trials 1 --devices 2 --" + FEW,
        ["[1/1] trial 0: COMPLETE, val/loss ", "written: tune/trials.md, best.yaml"],
    ),
    "python main.py fit --config config.yaml --config tune/best.yaml": Run(
        "python main.py fit --config config.yaml --config tune/best.yaml" + FEW + aside("best"),
        ["Scaling doctor: 1 x cpu"],
    ),
    (
        "python -m ddpkit.tune --space configs/tune.yaml --trials 40 --devices 1 "
        "--storage postgresql://tuner:PASSWORD@db-host/tune"
    ): Elsewhere(TUNE_TESTS + "test_pruned_trial_stops_every_rank_after_the_same_step_and_exits_cleanly"),
    (
        "python -m ddpkit.tune --space configs/tune.yaml --trials 40 --devices 1 "
        "--storage journal:/shared/tune/study.journal"
    ): Elsewhere(TUNE_TESTS + "test_workers_share_the_study_and_never_run_a_trial_twice"),
    "sbatch --array=0-3 cluster/tune.sbatch --space configs/tune.yaml --trials 40": Elsewhere(
        TUNE_TESTS + "test_killed_worker_leaves_no_process_and_its_trial_runs_again"
    ),
    # The finder's runs are the library's tests' (on the example, float64): a run in the docs' environment would
    # start the same ranks again.
    "python -m ddpkit.lr_finder": Elsewhere(
        LR_FINDER_TESTS + "test_the_suggestion_is_printed_and_written_as_the_optimizer_argument"
    ),
    "python -m ddpkit.lr_finder --devices 2 -- --trainer.accelerator cpu": Elsewhere(
        LR_FINDER_TESTS + "test_one_and_two_devices_sweep_the_same_curve"
    ),
    "python main.py fit --config config.yaml --config lr_find/lr.yaml": Elsewhere(
        LR_FINDER_TESTS + "test_the_suggestion_is_printed_and_written_as_the_optimizer_argument"
    ),
    # An 8-GPU node: two workers on 8 faked GPUs, 2 per trial, on fits that train nothing.
    "python -m ddpkit.tune --space configs/tune.yaml --trials 40 --devices 2": Elsewhere(
        TUNE_SCHEDULE + "test_packed_trials_get_disjoint_gpus_and_ports_and_fill_the_node"
    ),
    "python -m ddpkit.tune --space configs/tune.yaml --trials 8 --parallel 2 -- --trainer.accelerator cpu": Elsewhere(
        TUNE_TESTS + "test_a_worker_runs_its_trials_at_once"
    ),
    "python main.py validate --ckpt_path last": Run(expect=["validate: --ckpt_path last is ", "Validate metric"]),
    "python main.py test     --ckpt_path best": Run(expect=["test: --ckpt_path best is ", "Test metric"]),
    "python main.py predict  --ckpt_path last": Run(expect=["predict: --ckpt_path last is ", "predictions to "]),
    "python main.py fit && python main.py test --ckpt_path best": Run(
        "python main.py fit" + FEW + " && python main.py test --ckpt_path best", ["Test metric"]
    ),
    'cruft update -y && pip install -e ".[dev]" -c constraints.txt && pytest': Elsewhere(UPDATE),
    "pytest": Elsewhere(OWN_PROJECT),
    "pytest tests/examples": Run(expect=[" passed"], absent=[" failed", " error"], timeout=900),
    # Here (no GPU) every GPU test skips with its reason: the marker selects them and nothing else runs.
    "pytest -m gpu": Run(expect=[" skipped"], absent=["passed", "failed", "error"]),
}

ROOT = {
    (
        "pip install torch==2.13.0 && pip install -r requirements.txt && cookiecutter --no-input . && cd ddp-digits "
        "&& python main.py fit"
    ): Run(
        # The two installs are how .ci/run built the environment these tests run in (the README's test command
        # starts with the same two); the rest runs here as written, with the template for `.` and fewer steps
        # (the generated README's `python main.py fit` runs in full and its accuracy is checked).
        f"cookiecutter --no-input {shlex.quote(str(TEMPLATE))} && cd ddp-digits && python main.py fit" + FEW,
        ["Baked ddp-digits/. Next", "Scaling doctor: 1 x cpu"],
    ),
    (
        "pip install torch==2.13.0 && pip install -r requirements.txt && pip install --no-deps litdata==0.2.76 "
        "&& python -m pytest tests"
    ): Elsewhere("tests/test_bake.py::test_ci_runs_the_readme_test_command"),
    "python .ci/gpu_check.py": NeedsGPU(
        "no CUDA GPU is visible: .ci/gpu_check.py runs what needs one (--dry-run: its steps on CPU); CI runs the rest"
    ),
}


def doc_files(project: Path) -> list[Path]:
    """A baked project's docs in reading order: README.md, then the manual's pages as vendor/ddpkit/docs/index.md
    links them (tests/test_docs.py checks that it links every page), index.md last."""
    manual = project / "vendor" / "ddpkit" / "docs"
    linked = re.findall(r"\]\(([\w-]+\.md)\)", (manual / "index.md").read_text())
    return [project / "README.md", *(manual / name for name in dict.fromkeys(linked)), manual / "index.md"]


def documented_commands(project: Path) -> list[tuple[str, str]]:
    """(command, shown output) of every shell command in the project's docs (doc_files), in reading order."""
    return [found for path in doc_files(project) for found in shell_commands(path.read_text())]


def shell_commands(markdown: str) -> list[tuple[str, str]]:
    """(command, shown output) for each shell command in the fenced code blocks of `markdown`: each line of a
    ```bash block (a trailing `# comment` removed), and the `$ ` line that opens a plain block of output."""
    found = []
    for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", markdown, flags=re.DOTALL | re.MULTILINE):
        lines = body.splitlines()
        if lang == "bash":
            for line in lines:
                command = re.split(r"\s+#\s", line, maxsplit=1)[0].strip()
                if command and not command.startswith("#"):
                    found.append((command, ""))
        elif lang == "" and lines and lines[0].startswith("$ "):
            found.append((lines[0][2:].strip(), "\n".join(lines[1:])))
    return found


FAKE_SRUN = """#!/bin/sh
# Stand-in for srun: drop srun's own options, run the task once and only print its configuration.
while [ "${1#-}" != "$1" ]; do shift; done
exec "$@" --print_config
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


# The chains beside the first (which holds every command not listed here: those that write or read lightning_logs/
# or runs/ in the project, in the docs' order). Chain 2 neither writes nor reads those (the sweeps write scaling/, in
# the docs' order: `--explain` reads the second; the study writes tune/, marked as scaling/ is, and its best values
# train in a folder outside the project; the examples' tests use temporary folders; the presets' listing and ruff
# only read). Chains 3 and 4 read no
# earlier run, and a command of theirs that trains does so in a folder of its own outside the project (`aside`),
# so that none of their checkpoints is the newest one `--ckpt_path last`, `best` or `auto` finds in the first chain
# (the sweeps' folder is marked and skipped: test_docs.py checks it). The job alone, with nothing
# else running: 342 s in 2 chains, 314 s in 3, 260 s in these 4 (docs/measurements.md).
CHAINS = {
    2: {
        "python main.py fit --print_config",
        "python main.py fit --help",
        "python main.py fit --model.help DigitsClassifier",
        "python main.py fit --data.help DigitsDataModule",
        "sbatch cluster/slurm.sbatch",
        "sbatch --nodes 4 cluster/slurm.sbatch --config configs/model_parallel.yaml",
        "python -m ddpkit.scaling --devices 1 2 4 --max-steps 300",
        "python -m ddpkit.scaling --devices 1 2 -- --trainer.accelerator cpu",
        "python -m ddpkit.scaling --explain scaling/devices_1 scaling/devices_2",
        "python -m ddpkit.tune --space configs/tune.yaml --trials 20 --devices 2",
        "python main.py fit --config config.yaml --config tune/best.yaml",
        "python -m ddpkit.presets",
        "ruff check --fix .",
    },
    3: {
        "NNODES=2 GPUS_PER_NODE=8 RDZV_ENDPOINT=node0:29400 bash cluster/torchrun.sh",
        "python main.py fit --config configs/lm.yaml",
        "python main.py fit --config configs/lm.yaml --config configs/model_parallel.yaml",
        "python main.py fit --config configs/lm.yaml --config configs/fsdp.yaml",
        "python main.py fit --config configs/stream.yaml",
        "python main.py fit --config configs/stream.yaml --trainer.devices 2",
        "python -m ddpkit.scaling --preflight --devices 2 -- --trainer.accelerator cpu",
    },
    4: {
        "python main.py fit --trainer.devices 2",
        "python main.py fit --trainer.accelerator cpu --trainer.devices 2",
        (
            "python main.py fit --trainer.accelerator cpu --trainer.devices 2 --trainer.max_steps 100 "
            "--doctor.measure_comm true"
        ),
        "python main.py fit --doctor.report_every_n_steps 100",
        "python main.py fit --doctor.comm_share 0.5",
        "python main.py fit --doctor.enabled false",
        "pytest tests/examples",
        "pytest -m gpu",
    },
}
ASIDE_CHAINS = (3, 4)


def chain_of(command: str) -> int:
    return next((number for number, commands in CHAINS.items() if command in commands), 1)


# Started as a user starts them, not forked: the README's main job, and the run whose logger finishes in an exit
# hook (wandb prints its `wandb sync` line there), which a forked run skips: it ends with os._exit.
FRESH = {"python main.py fit", "WANDB_MODE=offline python main.py fit --config configs/wandb.yaml" + FEW}
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=\S*$")


def forked_args(command: str) -> tuple[dict, list[str]] | None:
    """(variables, arguments) of a command that runs forked (module docstring), else None."""
    if command in FRESH or re.search(r"[^\w\s.=/:,-]", command):  # quoting, globs, redirection, `&&`, `$`
        return None
    words, variables = command.split(), {}
    while words and ASSIGNMENT.match(words[0]):
        name, value = words.pop(0).split("=", 1)
        variables[name] = value
    return (variables, words[2:]) if words[:2] == ["python", "main.py"] else None


def execute(command: str, project: Path, timeout: float, env: dict, server: ForkServer) -> subprocess.CompletedProcess:
    """Run `command` in the project: forked from `server` where `forked_args` allows, else under bash with `env`."""
    found = forked_args(command)
    if found is None:
        return run(["bash", "-c", command], project, timeout, env)
    variables, args = found
    return run_main(*args, cwd=project, timeout=timeout, env=variables, server=server)


def run_command(command: str, project: Path, env: dict, bin_dir: Path, server: ForkServer) -> dict:
    """Run one documented command of the baked project as its check says: {command: (what ran, exit status, output)}
    (and the `--print_config` run of a NeedsGPU command)."""
    check, env = GENERATED[command], dict(env)
    if isinstance(check, Run):
        ran = (
            (check.command or command).replace("PORT", str(free_port())).replace("ASIDE", str(project.parent / "aside"))
        )
    elif isinstance(check, NeedsGPU):
        ran = command
    else:  # Scheduler
        ran = re.sub(r"^sbatch( --nodes \d+)? ", "bash ", command)
        env |= {"SLURM_NNODES": str(check.nodes), "SLURM_NTASKS_PER_NODE": "4", "SLURM_JOB_ID": "4242"}
        env["PATH"] = f"{bin_dir}:{env['PATH']}"
    start = time.monotonic()
    result = execute(ran, project, getattr(check, "timeout", 300), env, server)
    # Shown with -s: the commands' run times. To the process's own stdout, not sys.stdout: this runs in a thread
    # beside other tests, and a test's capsys would catch the line as that test's output.
    print(f"{time.monotonic() - start:6.1f} s  $ {ran}", file=sys.__stdout__, flush=True)
    done = {command: (ran, result.returncode, result.stdout)}
    if isinstance(check, NeedsGPU):
        parsed = execute(f"{command} --print_config", project, 120, env, server)
        done[command + " --print_config"] = (command, parsed.returncode, parsed.stdout)
    return done


def run_readme(project: Path, env: dict, bin_dir: Path) -> dict:
    """Every documented command of the baked project that runs here: the installs in the docs' order, then the four
    chains at once. Returns {command: (what ran, exit status, output)} and the project's config.yaml before."""
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    results = {"config.yaml before": (project / "config.yaml").read_text()}
    commands = [
        c for c in dict.fromkeys(c for c, _ in documented_commands(project)) if not isinstance(GENERATED[c], Elsewhere)
    ]
    installs = [c for c in commands if c.startswith("pip install")]
    # Started at its first run, after the installs: it imports main.py with everything they installed.
    server = ForkServer(python=str(Path(env["VIRTUAL_ENV"]) / "bin" / "python"), root=project, env=env)
    for command in installs:
        results |= run_command(command, project, env, bin_dir, server)

    def chain(number: int) -> dict:
        done = {}
        for command in commands:
            if command not in installs and chain_of(command) == number:
                done |= run_command(command, project, env, bin_dir, server)
        return done

    try:
        with ThreadPoolExecutor(1 + len(CHAINS)) as pool:
            for done in pool.map(chain, [1, *CHAINS]):
                results |= done
    finally:
        server.close()
    return results
