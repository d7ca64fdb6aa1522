"""The story test_own_project.py checks, run in the background while the docs tests run (tests/conftest.py
starts it): neither asserts a duration, and each is mostly waiting for processes on its own core.

A user bakes with `cruft create` (the default project, named My Project), keeps it in git, deletes the example
and writes a model and data of their own (dict batches, dropout, val_loss), and deletes configs/mlflow.yaml (as a
project baked before that preset existed would lack it); then the template releases a new library (with a changed
manual page and a new preset) and the user runs `cruft update`, installs with the baked workflow's own steps in a
new virtual environment (only the torch step changes: this machine's CPU wheel of the same pin), takes the presets
`configs/` lacks with `python -m ddpkit.presets`, runs the workflow's remaining steps, and runs the first-wave
parity tests on three classic DDP bugs; meanwhile, in the same environment, the GPU check's dry run
(.ci/gpu_check.py, tests/test_gpu_check.py). The user's model takes a learning-rate schedule and shards its layers
under ModelParallelStrategy (the model_parallel preset), so that the suite's schedule and sharded parity run. Every
outcome is recorded; the tests read the record."""

import hashlib
import json
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bakes import TEMPLATE, fresh_env, run, torch_pin, workflow_steps

VERSION_FILE = "{{cookiecutter.project_slug}}/vendor/ddpkit/src/ddpkit/__init__.py"
NEW_VERSION = "99.0.0"  # the release the update brings (the template's own version is far below)
LIBRARY = "{{cookiecutter.project_slug}}/vendor/ddpkit"
# What the release changes in the manual (a page's new last line) and the preset it adds.
MANUAL_PAGE = "docs/updating.md"
MANUAL_CHANGE = "\nRelease 99.0.0 adds the shortrun preset: `python -m ddpkit.presets shortrun`.\n"
NEW_PRESET = "shortrun"
# The preset the user deleted before the update (as a project baked before it existed would lack it).
LACKED_PRESET = "mlflow"
# The presets' commands after the update, as the manual (presets.md) gives them: the listing, the documented copy,
# the new preset's copy, and the documented copy again (now refused: the file exists).
PRESET_COMMANDS = [
    "python -m ddpkit.presets",
    f"python -m ddpkit.presets {LACKED_PRESET}",
    f"python -m ddpkit.presets {NEW_PRESET}",
    f"python -m ddpkit.presets {LACKED_PRESET}",
]
GIT = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
# What the user writes or edits: their code, their config, their README. The example is deleted on day one.
USER_FILES = ["my_project/wave_data.py", "my_project/wave_model.py", "my_project/buggy.py", "config.yaml", "README.md"]
DELETED = ["my_project/digits", "tests/examples"]

OWN_DATA = '''
"""A data module written from scratch: noisy samples of a wave, as dict batches."""

import math

import torch
from ddpkit import GlobalBatchDataModule
from torch.utils.data import Dataset


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
from ddpkit import optimization, shard_layers
from lightning.pytorch.cli import LRSchedulerCallable
from torch import nn
from torchmetrics import MeanMetric


class WaveRegressor(L.LightningModule):
    """Regresses the wave.

    Args:
        width: Hidden width.
        lr: Learning rate.
        scheduler: A learning-rate schedule called with the optimizer, or None for a constant lr.
    """

    def __init__(self, width: int = 32, lr: float = 1e-2, scheduler: LRSchedulerCallable | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.scheduler = scheduler
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

    def configure_model(self) -> None:
        if self.device_mesh is not None:  # the model_parallel preset: each linear layer sharded over the ranks
            shard_layers(self.net, [self.net[0], self.net[-1]], self.device_mesh)

    def configure_optimizers(self) -> torch.optim.Optimizer | dict:
        return optimization(self, torch.optim.AdamW(self.parameters(), lr=self.hparams.lr), self.scheduler)
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


def git(args: list[str], cwd: Path) -> str:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(cwd), **GIT}
    return subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, check=True).stdout


def template_repo(path: Path) -> str:
    """This template as it is on disk (tracked and untracked, not ignored), committed into a new repository at
    `path`: what `cruft create` clones. Returns the commit."""
    listed = git(["ls-files", "-co", "--exclude-standard", "-z"], TEMPLATE).split("\0")
    for name in filter(None, listed):
        if (TEMPLATE / name).is_file():
            (path / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(TEMPLATE / name, path / name)
    git(["init", "-q"], path)
    git(["add", "-A"], path)
    git(["commit", "-qm", "the template as baked"], path)
    return git(["rev-parse", "HEAD"], path).strip()


def release_new_library(path: Path) -> str:
    """A later commit of the template: the library's next release (its version, a manual page changed, a preset
    added) and a change to main.py, a file the template owns. Returns the commit."""
    version_file = path / VERSION_FILE
    text = version_file.read_text()
    assert '__version__ = "' in text
    version_file.write_text(text.replace(text.split('__version__ = "')[1].split('"')[0], NEW_VERSION, 1))
    page = path / LIBRARY / MANUAL_PAGE
    page.write_text(page.read_text() + MANUAL_CHANGE)
    preset = path / LIBRARY / "src" / "ddpkit" / "presets" / f"{NEW_PRESET}.yaml"
    preset.write_text("# One epoch: a preset new in release 99.0.0.\ntrainer:\n  max_epochs: 1\n")
    git(["add", str(preset.relative_to(path))], path)
    main = path / "{{cookiecutter.project_slug}}" / "main.py"
    main.write_text(main.read_text() + "# the template's next main.py\n")
    git(["commit", "-qam", "ddpkit " + NEW_VERSION], path)
    return git(["rev-parse", "HEAD"], path).strip()


def point_config_at(project: Path, model: str, data: str, monitor: str, mode: str) -> None:
    """Edit config.yaml as a user would: another model and data class, another monitored metric."""
    config = (project / "config.yaml").read_text()
    head = config[: config.index("\nmodel:")]
    head = head.replace("monitor: val/acc", f"monitor: {monitor}").replace("mode: max", f"mode: {mode}")
    (project / "config.yaml").write_text(f"{head}\nmodel:\n  class_path: {model}\n\ndata:\n  class_path: {data}\n")


def digests(root: Path, names: list[str]) -> dict[str, str]:
    return {name: hashlib.sha256((root / name).read_bytes()).hexdigest() for name in names}


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# The parity tests that read only the first wave of runs (1 and 2 devices in float64) and the one-step runs, so that
# each bug below costs those runs, not the whole suite's: enough to catch each of them, in float64 and, one step at a
# time, in float32 and bf16. The suite starts only the runs these read (runs.reads): the session's runs folder shows.
PARITY_SELECTED = [
    "tests/test_guarantees.py::test_weights_match_1_vs_2_devices",
    "tests/test_guarantees.py::test_logged_scalars_match_every_step",
    "tests/test_guarantees.py::test_logged_training_values_are_global",
    "tests/test_guarantees.py::test_eval_metrics_count_each_sample_once[val]",
    "tests/test_guarantees.py::test_one_step_from_the_same_state_matches_1_vs_2_devices",
]


BUGS = ["SumLoss", "UnsyncedBatchNorm", "UnsyncedMetric"]
# The GPU check's steps that its dry run in this environment leaves to the one in CI's (test_gpu_check.py).
GPU_CHECK_SKIPPED = ["bake-tests", "fp64-2-ranks", "lm-bench"]


def story(base: Path) -> dict:
    """Everything above, in order; returns what each step did."""
    record: dict = {"template": base / "template"}
    (base / "template").mkdir()
    record["old"] = template_repo(base / "template")
    cruft = str(Path(sys.executable).with_name("cruft"))
    context = json.dumps({"project_name": "My Project"})
    created = run([cruft, "create", "--no-input", "--output-dir", str(base), "--extra-context", context,
                   str(base / "template")], base, timeout=120)  # fmt: skip
    assert created.returncode == 0, created.stdout[-3000:]
    project = record["project"] = base / "my-project"
    git(["init", "-q"], project)
    git(["add", "-A"], project)
    git(["commit", "-qm", "baked"], project)

    for name in DELETED:
        shutil.rmtree(project / name)
    (project / "my_project" / "wave_data.py").write_text(OWN_DATA.lstrip())
    (project / "my_project" / "wave_model.py").write_text(OWN_MODEL.lstrip())
    (project / "my_project" / "buggy.py").write_text(BUGGY.lstrip())
    point_config_at(project, "my_project.wave_model.WaveRegressor", "my_project.wave_data.WaveData", "val_loss", "min")
    (project / "README.md").write_text((project / "README.md").read_text() + "\n## Our notes\n\nOurs.\n")
    (project / "configs" / f"{LACKED_PRESET}.yaml").unlink()
    git(["add", "-A"], project)
    git(["commit", "-qm", "our model and data"], project)
    record["before"] = digests(project, USER_FILES)

    record["new"] = release_new_library(base / "template")
    env = fresh_env(base / "venv")
    updated = run([cruft, "update", "-y"], project, timeout=120, env={**env, **GIT})
    assert updated.returncode == 0, updated.stdout[-3000:]
    record["after"] = digests(project, USER_FILES)

    steps = workflow_steps(project)
    assert steps[1] == 'pip install -e ".[dev]" -c constraints.txt', steps
    local_torch = steps[0].split(" --index-url")[0]  # the same pin, from this machine's own wheel
    assert local_torch == f"pip install {torch_pin()}", local_torch
    for step in [local_torch, steps[1]]:
        result = run(["bash", "-c", step], project, timeout=600, env=env)
        assert result.returncode == 0, f"{step} exited {result.returncode}:\n{result.stdout[-6000:]}"
    version = run(["python", "-c", "import ddpkit; print(ddpkit.__version__)"], project, timeout=60, env=env)
    record["installed_version"] = version.stdout.strip()

    # The presets configs/ lacks after the update (cruft never touches configs/), from the installed library.
    record["lacked_after_update"] = sorted(
        name for name in (LACKED_PRESET, NEW_PRESET) if not (project / "configs" / f"{name}.yaml").exists()
    )
    record["presets"] = []
    for command in PRESET_COMMANDS:
        result = run(["bash", "-c", command], project, timeout=60, env=env)
        record["presets"].append((command, result.returncode, result.stdout))

    record["steps"] = []
    before = {p.name for p in project.iterdir()}
    for step in steps[2:]:
        result = run(["bash", "-c", step], project, timeout=900, env=env)
        record["steps"].append((step, result.returncode, result.stdout))
    record["left_behind"] = {p.name for p in project.iterdir()} - before

    def bug_run(bug: str) -> tuple[int, str, list[str]]:
        temporary = base / f"bug-{bug}"
        cmd = ["python", "-m", "pytest", *PARITY_SELECTED, "-q", "-rf", "-p", "no:cacheprovider"]
        cmd += ["--basetemp", str(temporary)]
        bug_env = {**env, "PARITY_ARGS": f"--model my_project.buggy.{bug}"}
        result = run(["bash", "-c", shlex.join(cmd)], project, 900, bug_env)
        started = sorted(p.stem for p in (temporary / "runs0").glob("*.log"))  # a log a run started
        return result.returncode, result.stdout, started

    # The GPU check's dry run in this environment, which holds only what `.[dev]` installs (test_gpu_check.py).
    find = "import importlib.util as u; print(' '.join(m for m in ('optuna', 'mlflow', 'wandb') if u.find_spec(m)))"
    record["optional_installed"] = run(["python", "-c", find], project, timeout=60, env=env).stdout.split()
    from test_gpu_check import dry_run

    python = str(base / "venv" / "bin" / "python")
    (base / "gpu-check").mkdir()
    with ThreadPoolExecutor(len(BUGS) + 1) as pool:  # independent pytest sessions, each in its own temporary dirs
        gpu_check = pool.submit(dry_run, base / "gpu-check", python, GPU_CHECK_SKIPPED, env)
        record["bugs"] = dict(zip(BUGS, pool.map(bug_run, BUGS), strict=True))
        record["gpu_check"] = gpu_check.result()
    return record
