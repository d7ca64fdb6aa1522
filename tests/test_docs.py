"""Docs as tests: every shell command in the code blocks of the root README and of a baked project's README
runs here and does what the README says.

`GENERATED` and `ROOT` say how each command is checked, keyed by the command exactly as its README writes
it (without a trailing `# comment`). A command in a README that these tables do not list fails the test, and
so does a listed command that the README no longer has: README and tables stay in step.

The checks:
- `Run`: run in the baked project (with the language-model example), in a virtual environment that the
  README's own install commands fill; it must exit 0 and print every `expect` string (and none of `absent`).
  Where the README shows output (a block opening with `$ command`), each `expect` string must also be in
  the output the README shows. The command runs as written or with one of these substitutions for a 2-core
  CPU machine, each visible in the table: fewer steps (`FEW`), 2 CPU processes where the README has 4 or 8
  GPUs, this machine for the other node of a rendezvous.
- `NeedsGPU`: without a GPU the command stops at once with one `error:` line and exit 2, like other bad
  input; with `--print_config` added it must parse (exit 0).
- `Scheduler`: `sbatch` becomes `bash` under the variables SLURM sets, with a stand-in `srun` that runs its
  command with `--print_config` added: the command the script composes parses and holds `expect`.
- `Elsewhere`: another test runs this command (named, and checked to exist).

Commands run one after another in README order (a later one may use what an earlier one trained), so
that the timings of the scaling sweep are not disturbed by another run.
"""

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from bakes import TEMPLATE, bake, run, torch_pin

FEW = " --trainer.max_steps 20"  # fewer steps: enough for a validation pass, a checkpoint and the doctor
FEW_LM = " --trainer.max_steps 4"  # the language model's steps are ~0.4 s on this machine


@dataclass
class Run:
    command: str | None = None  # what runs here, when it differs from the README's
    expect: list[str] = field(default_factory=list)
    absent: list[str] = field(default_factory=list)
    timeout: float = 300


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
NO_GPU = "--trainer.accelerator gpu but no CUDA GPU is visible: use --trainer.accelerator cpu."
DOCTOR_LINES = [
    "Scaling doctor: 2 x cpu, ",
    "rank | samples/s | step ms | data ms | compute ms | comm ms | other ms | cpu wait ms | gc ms | peak MB",
    "data wait ",
    "verdict: ",
]
SWEEP_HEADER = "| devices | samples/s | speed-up | efficiency | step ms | ideal ms | gap ms | compute | comm | data |"

GENERATED = {
    "pip install torch==2.13.0": Run(),
    'pip install -e ".[dev]"': Run(),
    "python main.py fit": Run(expect=["Scaling doctor: 1 x cpu", "verdict: "]),
    "python main.py fit --trainer.devices 2": Run("python main.py fit --trainer.devices 2" + FEW, ["2 x cpu"]),
    "python main.py fit --trainer.accelerator cpu --trainer.devices 2": Run(
        "python main.py fit --trainer.accelerator cpu --trainer.devices 2" + FEW, ["Scaling doctor: 2 x cpu"]
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
    "sbatch cluster/slurm.sbatch": Scheduler(2, ["num_nodes: 2", "devices: '4'", "slurm_requeue: true"]),
    "sbatch --nodes 4 cluster/slurm.sbatch --config configs/model_parallel.yaml": Scheduler(
        4, ["num_nodes: 4", "slurm_requeue: true", "ModelParallelStrategy", "default_root_dir: runs/slurm-4242"]
    ),
    "NNODES=2 GPUS_PER_NODE=8 RDZV_ENDPOINT=node0:29400 bash cluster/torchrun.sh": Run(
        "NNODES=1 GPUS_PER_NODE=2 RDZV_ENDPOINT=localhost:PORT bash cluster/torchrun.sh --trainer.accelerator cpu"
        + FEW,
        ["Scaling doctor: 2 x cpu"],
    ),
    "python main.py fit --config configs/lm.yaml": Run("python main.py fit --config configs/lm.yaml" + FEW_LM),
    "python main.py fit --config configs/lm.yaml --config configs/model_parallel.yaml": Run(
        "python main.py fit --config configs/lm.yaml --config configs/model_parallel.yaml" + FEW_LM, ["2 x cpu"]
    ),
    "python main.py fit --config configs/lm.yaml --config configs/fsdp.yaml": NeedsGPU(NO_GPU),
    (
        "python main.py fit --trainer.accelerator cpu --trainer.devices 2 --trainer.max_steps 100 "
        "--doctor.measure_comm true"
    ): Run(expect=DOCTOR_LINES, absent=["comm not timed"]),
    "python main.py fit --doctor.report_every_n_steps 100": Run(
        "python main.py fit --doctor.report_every_n_steps 100" + FEW, ["Scaling doctor"]
    ),
    "python main.py fit --doctor.comm_share 0.5": Run("python main.py fit --doctor.comm_share 0.5" + FEW),
    "python main.py fit --doctor.enabled false": Run(
        "python main.py fit --doctor.enabled false" + FEW, absent=["Scaling doctor"]
    ),
    'pip install -e ".[scaling]"': Run(),
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
    "python main.py validate --ckpt_path last": Run(expect=["validate: --ckpt_path last is ", "Validate metric"]),
    "python main.py test     --ckpt_path best": Run(expect=["test: --ckpt_path best is ", "Test metric"]),
    "python main.py predict  --ckpt_path last": Run(expect=["predict: --ckpt_path last is ", "predictions to "]),
    "python main.py fit && python main.py test --ckpt_path best": Run(
        "python main.py fit" + FEW + " && python main.py test --ckpt_path best", ["Test metric"]
    ),
    'cruft update -y && pip install -e ".[dev]" && pytest': Elsewhere(UPDATE),
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
    "pip install torch==2.13.0 && pip install -r requirements.txt && python -m pytest tests": Elsewhere(
        "tests/test_bake.py::test_ci_runs_the_readme_test_command"
    ),
    "python .ci/gpu_check.py": NeedsGPU(
        "no CUDA GPU is visible: .ci/gpu_check.py runs what needs one; CI runs the rest"
    ),
}


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


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return bake(tmp_path_factory.mktemp("docs"), lm_example="yes")


def test_pin_in_readme_install_is_the_projects():
    """The README's `pip install torch==...` is the version pyproject.toml pins."""
    assert f"pip install {torch_pin()}" in GENERATED and f"pip install {torch_pin()}" in next(iter(ROOT))


@pytest.mark.parametrize("readme", ["generated", "root"])
def test_every_readme_command_is_listed(project, readme):
    """The tables list exactly the commands of the README's code blocks: a new command needs a check."""
    path, table = (project / "README.md", GENERATED) if readme == "generated" else (TEMPLATE / "README.md", ROOT)
    documented = [command for command, _ in shell_commands(path.read_text())]
    assert sorted(set(documented) - set(table)) == [], "add these to the table in tests/test_docs.py"
    assert sorted(set(table) - set(documented)) == [], "these are no longer in the README"


FAKE_SRUN = """#!/bin/sh
# Stand-in for srun: drop srun's own options, run the task once and only print its configuration.
while [ "${1#-}" != "$1" ]; do shift; done
exec "$@" --print_config
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def outcomes(project, baked_env, tmp_path_factory, own_project_story) -> dict:
    """Every command of the generated README, in order: {command: (what ran, exit status, output)}. The own
    project's story (tests/own_project.py) runs meanwhile, in the background."""
    bin_dir = tmp_path_factory.mktemp("bin")
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    results = {"config.yaml before": (project / "config.yaml").read_text()}
    for command, _ in shell_commands((project / "README.md").read_text()):
        check, env = GENERATED[command], dict(baked_env)
        if isinstance(check, Elsewhere):
            continue
        if isinstance(check, Run):
            ran = (check.command or command).replace("PORT", str(free_port()))
        elif isinstance(check, NeedsGPU):
            ran = command
        else:  # Scheduler
            ran = re.sub(r"^sbatch( --nodes \d+)? ", "bash ", command)
            env |= {"SLURM_NNODES": str(check.nodes), "SLURM_NTASKS_PER_NODE": "4", "SLURM_JOB_ID": "4242"}
            env["PATH"] = f"{bin_dir}:{env['PATH']}"
        start = time.monotonic()
        result = run(["bash", "-c", ran], project, getattr(check, "timeout", 300), env)
        results[command] = (ran, result.returncode, result.stdout)
        print(f"{time.monotonic() - start:6.1f} s  $ {ran}")  # shown with -s: the README's run times
        if isinstance(check, NeedsGPU):
            parsed = run(["bash", "-c", f"{command} --print_config"], project, 120, env)
            results[command + " --print_config"] = (command, parsed.returncode, parsed.stdout)
    return results


def test_commands_leave_the_projects_config_alone(project, outcomes):
    """No documented command rewrites the project's config.yaml (the debug preset runs without a logger, and
    Lightning would otherwise save the run's config over it)."""
    assert (project / "config.yaml").read_text() == outcomes["config.yaml before"]


@pytest.mark.parametrize("command", list(GENERATED))
def test_generated_readme_command_works(project, outcomes, command):
    """Each command of the generated README does what its check says (see the module docstring)."""
    check = GENERATED[command]
    if isinstance(check, Elsewhere):
        where = check.test.split("::")
        if where[0].startswith("tests/"):  # a test of this suite: it must exist
            assert f"def {where[1]}(" in (TEMPLATE / where[0]).read_text()
        return
    ran, code, out = outcomes[command]
    if isinstance(check, NeedsGPU):
        if torch.cuda.is_available():
            pytest.skip("a GPU is visible: the command is not refused here")
        errors = [line for line in out.splitlines() if "error:" in line]
        assert code == 2 and errors == [f"error: {check.error}"], out[-3000:]
        assert outcomes[command + " --print_config"][1] == 0, outcomes[command + " --print_config"][2][-3000:]
        return
    assert code == 0, f"$ {ran}\n{out[-5000:]}"
    for text in check.expect:
        assert text in out, f"{text!r} not in the output of $ {ran}:\n{out[-5000:]}"
    for text in getattr(check, "absent", []):
        assert text not in out, f"{text!r} in the output of $ {ran}:\n{out[-5000:]}"


def test_shown_output_matches_what_runs(project):
    """Where the README shows a command's output, the lines the tests check are in what it shows."""
    shown = {command: output for command, output in shell_commands((project / "README.md").read_text()) if output}
    assert len(shown) == 2
    for command, output in shown.items():
        for text in GENERATED[command].expect:
            assert text in output, (command, text)


def test_default_fit_reaches_the_documented_accuracy(project, outcomes):
    """`python main.py fit` reaches "about 97% validation accuracy" (the README's claim), in its first run."""
    last = torch.load(project / "lightning_logs/version_0/checkpoints/last.ckpt", weights_only=True)
    (state,) = [s for s in last["callbacks"].values() if "best_model_score" in s]
    assert float(state["best_model_score"]) >= 0.96


def test_cpu_sweep_compares_like_with_like(project, outcomes):
    """`python -m ddpkit.scaling --devices 1 2 -- --trainer.accelerator cpu` as written gives each process 1 thread on
    this 2-core machine, and 2 processes are not faster per process than 1: efficiency at most ~1. (It was
    4.2 when the 1-process run got 2 threads that fought each other; 1.25 leaves room for timing noise.)"""
    record = json.loads((project / "scaling/scaling.json").read_text())
    rows = {row["devices"]: row for row in record["rows"]}
    assert record["threads_per_process"] == 1 and sorted(rows) == [1, 2]
    assert rows[2]["efficiency"] <= 1.25, rows


def test_root_readme_main_job_works(tmp_path):
    """The root README's first command bakes the default project and trains it, in this environment (built by
    .ci/run with the README's two install commands)."""
    (command,) = [c for c, check in ROOT.items() if isinstance(check, Run)]
    assert command.startswith("pip install torch==2.13.0 && pip install -r requirements.txt && ")
    check = ROOT[command]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = run(["bash", "-c", check.command], tmp_path, 300, env)
    assert result.returncode == 0, result.stdout[-5000:]
    assert all(text in result.stdout for text in check.expect), result.stdout[-5000:]


def test_root_readme_gpu_check_refuses_without_a_gpu():
    """`python .ci/gpu_check.py` on this GPU-less machine: one `error:` line and status 2, nothing baked or run."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the check would run (for an hour), not refuse")
    (command,) = [c for c, check in ROOT.items() if isinstance(check, NeedsGPU)]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = run(["bash", "-c", command], TEMPLATE, 120, env)
    assert result.returncode == 2 and result.stdout.strip() == f"error: {ROOT[command].error}", result.stdout


def test_root_readme_test_command_is_what_ci_runs():
    (command,) = [c for c, check in ROOT.items() if isinstance(check, Elsewhere)]
    assert command in (TEMPLATE / ".ci" / "run").read_text()


def layout_names(block: str) -> set[str]:
    """The first word of each line of a layout block, without a trailing slash."""
    return {line.split()[0].rstrip("/") for line in block.splitlines() if line.strip()}


def test_generated_readme_layout_lists_every_top_level_entry(lm_project):
    """Every file and directory at the top of a baked project appears in the README's Layout section."""
    project = lm_project  # untouched: no runs, caches or installs beside the baked files
    text = (project / "README.md").read_text()
    layout = text[text.index("## Layout") : text.index("## Test")]
    named = set()
    for block in re.findall(r"^```\n(.*?)^```", layout, flags=re.DOTALL | re.MULTILINE):
        named |= layout_names(block)
    top = {p.name for p in project.iterdir()} - {"README.md", ".gitignore"}
    assert sorted(name for name in top if not any(n == name or n.startswith(name + "/") for n in named)) == []


def test_root_readme_tree_lists_every_top_level_entry():
    """Every tracked file and directory at the top of this repository appears in the README's tree."""
    text = (TEMPLATE / "README.md").read_text()
    tree = text[text.index("## This repository") :]
    named = layout_names(re.search(r"^```\n(.*?)^```", tree, flags=re.DOTALL | re.MULTILINE).group(1))
    tracked = subprocess.run(["git", "ls-files"], cwd=TEMPLATE, capture_output=True, text=True, check=True).stdout
    top = {line.split("/")[0] for line in tracked.splitlines()} - {"README.md", ".gitignore"}
    assert sorted(top - {n.split("/")[0] for n in named}) == []
