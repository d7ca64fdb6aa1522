"""Baking the template: the files it writes, the names it refuses, and the project's own tests."""

import os
import py_compile
import re
import shlex
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from conftest import TEMPLATE, bake
from cookiecutter.exceptions import FailedHookException

COMMON = {
    ".gitignore",
    "LICENSE",
    "README.md",
    "cluster/slurm.sbatch",
    "cluster/torchrun.sh",
    "config.yaml",
    "configs/debug.yaml",
    "configs/model_parallel.yaml",
    "docs/scaling-2cpu.png",
    "faults.py",
    "main.py",
    "pyproject.toml",
    "scaling.py",
    "ddp_digits/__init__.py",
    "ddp_digits/digits/__init__.py",
    "ddp_digits/digits/data.py",
    "ddp_digits/digits/digits.csv.gz",
    "ddp_digits/digits/model.py",
    "ddp_digits/digits/module.py",
    "ddp_digits/ddp/__init__.py",
    "ddp_digits/ddp/checkpoints.py",
    "ddp_digits/ddp/compiling.py",
    "ddp_digits/ddp/cli.py",
    "ddp_digits/ddp/data.py",
    "ddp_digits/ddp/diagnosis.py",
    "ddp_digits/ddp/doctor.py",
    "ddp_digits/ddp/gap.py",
    "ddp_digits/ddp/lightning_internals.py",
    "ddp_digits/ddp/parity.py",
    "ddp_digits/ddp/predictions.py",
    "ddp_digits/ddp/processes.py",
    "ddp_digits/ddp/requeue.py",
    "ddp_digits/ddp/sampling.py",
    "ddp_digits/ddp/schedules.py",
    "ddp_digits/ddp/sharding.py",
    "ddp_digits/ddp/stop.py",
    "ddp_digits/ddp/strategy.py",
    "ddp_digits/ddp/throughput.py",
    "tests/conftest.py",
    "tests/configured.py",
    "tests/doctor_cases.py",
    "tests/allreduce_alone.py",
    "tests/alone.py",
    "tests/loader_alone.py",
    "tests/doctor_overhead.py",
    "tests/fake_cluster.py",
    "tests/fake_cuda.py",
    "tests/faulty.py",
    "tests/helpers.py",
    "tests/parity_probe.py",
    "tests/rank_probe.py",
    "tests/toy.py",
    "tests/toy.yaml",
    "tests/test_bad_input.py",
    "tests/test_cli.py",
    "tests/test_diagnosis.py",
    "tests/test_doctor.py",
    "tests/test_doctor_numbers.py",
    "tests/test_faults.py",
    "tests/test_lightning_internals.py",
    "tests/test_multinode.py",
    "tests/test_parity.py",
    "tests/runs.py",
    "tests/sleepy.py",
    "tests/test_sampling.py",
    "tests/test_scaling_gap.py",
    "tests/test_schedules.py",
    "tests/test_sharded.py",
    "tests/examples/digits.yaml",
    "tests/examples/test_digits_cli.py",
    "tests/examples/test_digits_data.py",
    "tests/examples/test_digits_module.py",
}
LM_EXAMPLE = {
    "configs/lm.yaml",
    "configs/fsdp.yaml",
    "ddp_digits/lm/__init__.py",
    "ddp_digits/lm/data.py",
    "ddp_digits/lm/ecclesiastes.txt",
    "ddp_digits/lm/gpt.py",
    "ddp_digits/lm/module.py",
    "tests/examples/test_lm.py",
    "tests/examples/test_lm_sharded.py",
}
WORKFLOW = ".github/workflows/tests.yml"


def files(project: Path) -> set[str]:
    return {str(p.relative_to(project)) for p in project.rglob("*") if p.is_file()}


def run(cmd: list[str], cwd: Path, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a command in its own process group; kill the whole group on timeout."""
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{cmd} timed out after {timeout}s:\n{out[-4000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out)


def test_default_bake_writes_exactly_the_expected_files(default_project):
    """Defaults give the slug directory with the package, tests, data and CI workflow, and no LM example."""
    assert default_project.name == "ddp-digits"
    assert files(default_project) == COMMON | {WORKFLOW}


def test_lm_example_is_baked_only_when_asked(lm_project):
    """lm_example=yes adds the language model, its data, presets and tests, and nothing else."""
    assert files(lm_project) == COMMON | LM_EXAMPLE | {WORKFLOW}
    assert "## A second example: a small language model" in (lm_project / "README.md").read_text()


def test_without_github_actions_the_workflow_is_removed(tmp_path):
    """github_actions=no leaves no .github directory and nothing else missing."""
    project = bake(tmp_path, github_actions="no")
    assert files(project) == COMMON
    assert not (project / ".github").exists()


@pytest.mark.parametrize(
    ("license", "first_line"),
    [("MIT", "MIT License"), ("Apache-2.0", "Apache License"), ("BSD-3-Clause", "BSD 3-Clause License"), ("none", None)],
)
def test_license_prompt_writes_the_license_and_declares_it(tmp_path, license, first_line):
    """The chosen license is the LICENSE file (with the author and year in its copyright line) and the SPDX
    `license` of pyproject.toml; `none` leaves neither."""
    project = bake(tmp_path, license=license, author_name="Ada Lovelace")
    meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    if first_line is None:
        assert not (project / "LICENSE").exists() and "license" not in meta
        return
    text = (project / "LICENSE").read_text()
    assert text.strip().splitlines()[0].strip() == first_line and meta["license"] == license
    assert re.search(r"Copyright (\(c\) )?20\d\d,? Ada Lovelace\n", text), text[-800:]


def test_custom_names_reach_paths_and_imports(tmp_path):
    """A custom slug and package name rename the directory, the package and its imports."""
    project = bake(tmp_path, project_name="Fancy Net", package_name="fancy")
    assert project.name == "fancy-net"
    assert (project / "fancy" / "digits" / "module.py").is_file()
    assert "class_path: fancy.digits.module.DigitsClassifier" in (project / "config.yaml").read_text()
    assert "from fancy.ddp.sampling import" in (project / "tests/test_sampling.py").read_text()


def test_no_template_syntax_left(default_project):
    """No `{{`, `{%` or `cookiecutter` remains in any generated text file."""
    for path in default_project.rglob("*"):
        if path.is_file() and path.suffix not in (".gz", ".png"):
            text = path.read_text()
            assert "{{" not in text and "{%" not in text and "cookiecutter" not in text, path


def test_every_python_file_compiles(default_project, tmp_path):
    """Each generated .py file is valid Python."""
    for path in default_project.rglob("*.py"):
        py_compile.compile(str(path), cfile=str(tmp_path / "x.pyc"), doraise=True)


@pytest.mark.parametrize("name", ["Ddp Digits", "Zz Top"])
def test_generated_project_passes_ruff(tmp_path, name):
    """ruff check and ruff format --check find nothing, with the project's own config, also when the package's
    name sorts after the scripts beside it (import order must not depend on the name)."""
    project = bake(tmp_path, project_name=name, lm_example="yes")
    for cmd in (["ruff", "check", "."], ["ruff", "format", "--check", "."]):
        result = run([sys.executable, "-m", *cmd], project, timeout=60)
        assert result.returncode == 0, result.stdout


def test_pyproject_declares_dependencies(default_project):
    """pyproject.toml pins the five runtime packages and the dev tools to the versions CI tests."""
    meta = tomllib.loads((default_project / "pyproject.toml").read_text())["project"]
    pins = dict(d.split("==") for d in meta["dependencies"] + meta["optional-dependencies"]["dev"])
    assert set(pins) == {
        "torch", "lightning", "torchmetrics", "tensorboard", "jsonargparse[signatures]", "pytest", "ruff", "matplotlib"
    }  # fmt: skip
    # Exactly the versions the template's own requirements.txt (its CI) installs.
    tested = dict(line.split("==") for line in (TEMPLATE / "requirements.txt").read_text().splitlines() if "==" in line)
    assert all(pins[name] == version for name, version in tested.items() if name in pins), (pins, tested)


BAD_NAMES = [
    ({"project_slug": "1project"}, "project_slug '1project' is not a valid distribution name"),
    ({"project_slug": "my project"}, "project_slug 'my project' is not a valid distribution name"),
    ({"package_name": "my-pkg"}, "package_name 'my-pkg' is not an importable name"),
    ({"package_name": "9lives"}, "package_name '9lives' is not an importable name"),
    ({"package_name": "class"}, "package_name 'class' is a Python keyword"),
    ({"package_name": "torch"}, "package_name 'torch' would shadow"),
    ({"package_name": "lightning"}, "package_name 'lightning' would shadow"),
    ({"package_name": "json"}, "package_name 'json' would shadow"),
]


@pytest.mark.parametrize(("context", "message"), BAD_NAMES)
def test_bad_names_are_refused_and_nothing_is_written(tmp_path, capfd, context, message):
    """An invalid name stops the bake with a one-line message and leaves no files behind."""
    with pytest.raises(FailedHookException):
        bake(tmp_path, **context)
    err = capfd.readouterr().err
    assert f"ERROR: {message}" in err and err.strip().count("\n") == 0
    assert list(tmp_path.iterdir()) == []


HOSTILE = 'Evil "quotes" \'\'\' """ \\ {% raw %}{{ 7*7 }} {% endraw %}\nsecond line'


def test_hostile_answers_stay_data(tmp_path):
    """Quotes, backslashes, triple quotes, braces and newlines reach the files verbatim, never as code."""
    literal = HOSTILE.replace("{% raw %}", "").replace("{% endraw %}", "")
    project = bake(
        tmp_path,
        project_name=HOSTILE,
        project_slug="evil",
        package_name="evil",
        description=HOSTILE,
        author_name=HOSTILE,
    )
    meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    assert meta["description"] == literal and meta["authors"] == [{"name": literal}]
    assert (project / "README.md").read_text().startswith(f"# {literal}\n")
    for path in project.rglob("*.py"):
        py_compile.compile(str(path), cfile=str(tmp_path / "x.pyc"), doraise=True)


def test_cookiecutter_command_line_no_input(tmp_path):
    """The real `cookiecutter --no-input` command bakes with key=value overrides."""
    result = run(
        ["cookiecutter", "--no-input", str(TEMPLATE), "-o", str(tmp_path), "project_name=Cli Made"],
        tmp_path,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout
    assert (tmp_path / "cli-made" / "cli_made" / "digits" / "module.py").is_file()
    # Then the next steps, with the torch that the project pins.
    pins = tomllib.loads((tmp_path / "cli-made" / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_pin,) = [d for d in pins if d.startswith("torch==")]
    assert "Baked cli-made/. Next" in result.stdout and "\n  cd cli-made\n" in result.stdout
    assert f"pip install {torch_pin} " in result.stdout and "python main.py fit" in result.stdout


def workflow_steps(project: Path) -> list[str]:
    """The `run:` commands of the baked GitHub Actions workflow, in order."""
    steps = yaml.safe_load((project / WORKFLOW).read_text())["jobs"]["cpu"]["steps"]
    return [step["run"] for step in steps if "run" in step]


def test_workflow_installs_the_torch_that_the_project_pins(default_project):
    """The workflow's first step is the CPU wheel of exactly the torch version pyproject.toml pins."""
    pins = tomllib.loads((default_project / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_pin,) = [d for d in pins if d.startswith("torch==")]
    assert workflow_steps(default_project)[0] == (
        f"pip install {torch_pin} --index-url https://download.pytorch.org/whl/cpu"
    )


def test_ci_runs_the_readme_test_command():
    """.ci/run runs, inside its own new virtual environment, the test command the README gives."""
    readme = (TEMPLATE / "README.md").read_text()
    ci = (TEMPLATE / ".ci" / "run").read_text()
    command = "pip install torch==2.13.0 && pip install -r requirements.txt && python -m pytest tests"
    assert f"\n{command}\n" in readme and f"\n{command}\n" in ci
    assert ci.index("python3 -m venv") < ci.index("source") < ci.index(command)


OWN_DATA = '''
"""A data module written from scratch: noisy samples of a wave, as dict batches."""

import math

import torch
from torch.utils.data import Dataset

from my_project.ddp import GlobalBatchDataModule


class Wave(Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.rand(n, 8, generator=g) * 2 * math.pi
        self.y = torch.sin(self.x).sum(dim=1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.y[i]}


class WaveData(GlobalBatchDataModule):
    """Noisy sums of sines.

    Args:
        global_batch_size: Samples per optimizer step over all devices.
        micro_batch_size: Samples per forward pass on one device.
        num_workers: Loader workers per device.
        n_train: Training samples.
    """

    def __init__(
        self, global_batch_size: int = 32, micro_batch_size: int | None = None, num_workers: int = 0, n_train: int = 400
    ) -> None:
        super().__init__(global_batch_size, micro_batch_size, num_workers)
        self.n_train = n_train

    def train_dataset(self) -> Dataset:
        return Wave(self.n_train, seed=0)

    def val_dataset(self) -> Dataset:
        return Wave(101, seed=1)

    def test_dataset(self) -> Dataset:
        return Wave(99, seed=2)
'''

OWN_MODEL = '''
"""A LightningModule written from scratch: an MLP regressor with dropout, logging val_loss."""

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric


class WaveRegressor(L.LightningModule):
    """Regresses the wave.

    Args:
        width: Hidden width.
        lr: Learning rate.
    """

    def __init__(self, width: int = 32, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Dropout(0.1), nn.Linear(width, 1))
        self.val_mse, self.test_mse = MeanMetric(), MeanMetric()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = F.mse_loss(self(batch["x"]), batch["y"])
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.val_mse.update(F.mse_loss(self(batch["x"]), batch["y"], reduction="none"))
        self.log("val_loss", self.val_mse)

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self.test_mse.update(F.mse_loss(self(batch["x"]), batch["y"], reduction="none"))
        self.log("test_loss", self.test_mse)

    def predict_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self(batch["x"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
'''


BUGGY = '''
"""Classic DDP bugs in the user's module: each trains fine on 1 device and differently on 2."""

import torch
import torch.nn.functional as F
from torch import nn

from my_project.wave_model import WaveRegressor


class SumLoss(WaveRegressor):
    """Sums the loss over the batch: DDP averages gradients over ranks, so 2 devices take half the step."""

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = F.mse_loss(self(batch["x"]), batch["y"], reduction="sum")
        self.log("train_loss", loss, sync_dist=True)
        return loss


class UnsyncedBatchNorm(WaveRegressor):
    """BatchNorm without SyncBatchNorm: each rank normalizes with its own half of the batch."""

    def __init__(self, width: int = 32, lr: float = 1e-2) -> None:
        super().__init__(width, lr)
        self.net = nn.Sequential(nn.Linear(8, width), nn.BatchNorm1d(width), nn.Tanh(), nn.Linear(width, 1))


class UnsyncedMetric(WaveRegressor):
    """Logs each batch's validation loss without sync_dist: every rank reports the loss of its own half."""

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.log("val_loss", F.mse_loss(self(batch["x"]), batch["y"]))
'''


def point_config_at(project: Path, model: str, data: str, monitor: str, mode: str) -> None:
    """Edit config.yaml as a user would: another model and data class, another monitored metric."""
    config = (project / "config.yaml").read_text()
    head = config[: config.index("\nmodel:")]
    head = head.replace("monitor: val/acc", f"monitor: {monitor}").replace("mode: max", f"mode: {mode}")
    (project / "config.yaml").write_text(f"{head}\nmodel:\n  class_path: {model}\n\ndata:\n  class_path: {data}\n")


@pytest.fixture(scope="module")
def own_project(tmp_path_factory, baked_env) -> tuple[Path, dict, list[str]]:
    """A project baked with the LM example, a model and a data module of the user's own written from scratch
    in new files (dict batches, dropout, val_loss; the data module subclasses the base, nothing subclasses
    the example) and config.yaml pointed at them, installed by the baked workflow's own install steps in a
    new virtual environment. Returns the project, that environment, and the workflow's remaining steps.

    Only the torch step changes: this machine installs the same torch==2.13.0 CPU wheel from its own disk
    instead of downloading it. Everything else must come from `pip install -e ".[dev]"`.
    """
    base = tmp_path_factory.mktemp("own")
    project = bake(base, project_name="My Project", lm_example="yes")
    (project / "my_project" / "wave_data.py").write_text(OWN_DATA.lstrip())
    (project / "my_project" / "wave_model.py").write_text(OWN_MODEL.lstrip())
    (project / "my_project" / "buggy.py").write_text(BUGGY.lstrip())
    point_config_at(
        project, "my_project.wave_model.WaveRegressor", "my_project.wave_data.WaveData", "val_loss", "min"
    )
    env = baked_env
    steps = workflow_steps(project)
    assert steps[1] == 'pip install -e ".[dev]"'
    local_torch = steps[0].split(" --index-url")[0]  # the same pin, from this machine's own wheel
    for step in [local_torch, steps[1]]:
        result = run(["bash", "-c", step], project, timeout=600, env=env)
        assert result.returncode == 0, f"{step} exited {result.returncode}:\n{result.stdout[-6000:]}"
    return project, env, steps[2:]


def test_own_model_and_data_keep_the_guarantees(own_project):
    """The workflow's remaining steps as written (ruff, the project's whole suite, unedited) pass on the user's
    classes; only GPU tests, sharding (the module does not shard its layers) and the lr-schedule parity (it takes
    no scheduler argument) skip."""
    project, env, steps = own_project
    assert steps == ["ruff check .", "pytest", "pytest -m machinery"]
    skips = []
    before = {p.name for p in project.iterdir()}
    for step in steps:
        result = run(["bash", "-c", step], project, timeout=1200, env=env)
        print(f"$ {step}\n{result.stdout[-3000:]}")
        assert result.returncode == 0, f"{step} exited {result.returncode}:\n{result.stdout[-6000:]}"
        if step != "ruff check .":
            assert " passed" in result.stdout and " failed" not in result.stdout
            skips += [line for line in result.stdout.splitlines() if line.startswith("SKIPPED")]
    allowed = ("GPU", "CUDA", "does not shard its layers", "takes no scheduler argument")
    assert skips and all(any(reason in s for reason in allowed) for s in skips), skips
    # The suites write into temporary directories only (no doctor.json, runs/ or lightning_logs/ left here).
    assert {p.name for p in project.iterdir()} - before <= {".pytest_cache", ".ruff_cache"}


# The parity tests that read only the first wave of runs (tests/runs.py: 1 and 2 devices in float64), so that
# each bug below costs 2 runs, not the suite's 17: enough to catch each of them.
PARITY_FIRST_WAVE = [
    "tests/test_parity.py::test_weights_match_1_vs_2_devices[fp64]",
    "tests/test_parity.py::test_logged_scalars_match_every_step[fp64]",
    "tests/test_parity.py::test_logged_training_values_are_global",
    "tests/test_parity.py::test_eval_metrics_count_each_sample_once[val]",
]


@pytest.mark.parametrize(
    ("bug", "caught_by"),
    [
        ("SumLoss", ["test_logged_scalars_match_every_step[fp64]", "test_weights_match_1_vs_2_devices[fp64]"]),
        ("UnsyncedBatchNorm", ["test_weights_match_1_vs_2_devices[fp64]"]),
        ("UnsyncedMetric", ["test_eval_metrics_count_each_sample_once[val]"]),
    ],
)
def test_parity_suite_fails_on_classic_ddp_bugs(own_project, bug, caught_by):
    """The project's parity tests, run on the user's module with one classic DDP bug, fail on that bug."""
    project, env, _ = own_project
    env = {**env, "PARITY_ARGS": f"--model my_project.buggy.{bug}"}
    cmd = ["python", "-m", "pytest", *PARITY_FIRST_WAVE, "-q", "-rf", "-p", "no:cacheprovider"]
    result = run(["bash", "-c", shlex.join(cmd)], project, 900, env)
    print(result.stdout[-3000:])
    failed = [line.split()[1] for line in result.stdout.splitlines() if line.startswith("FAILED ")]
    assert result.returncode == 1 and failed, result.stdout[-6000:]
    for name in caught_by:
        assert any(name in f for f in failed), (name, failed)
