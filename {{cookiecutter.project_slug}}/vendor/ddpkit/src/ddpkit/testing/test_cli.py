"""`python main.py` end to end on whatever config.yaml selects: what a run writes, the other subcommands."""

import importlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import yaml
from helpers import PROJECT, concurrently, run_ok
from jsonargparse import Namespace

from ddpkit.cli import place_loggers
from ddpkit.parity import read_csv_scalars, read_scalars


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """One 3-epoch fit of the configured model and data on 1 CPU process, with a CSV logger added to
    config.yaml's TensorBoard, shared by the tests below."""
    root = tmp_path_factory.mktemp("fit")
    out = run_ok(
        "fit",
        "--trainer.accelerator",
        "cpu",
        "--trainer.max_epochs",
        "3",
        "--trainer.logger+=CSVLogger",
        "--trainer.default_root_dir",
        str(root),
        cwd=root,
    )
    return root, out


def test_fit_writes_logs_config_and_checkpoints_under_root(fitted):
    """One version dir with TensorBoard events, config.yaml, hparams.yaml, best and last checkpoints."""
    root, _ = fitted
    version = root / "lightning_logs" / "version_0"
    assert sorted(p.name for p in (root / "lightning_logs").iterdir()) == ["version_0"]
    assert len(list(version.glob("events.out.tfevents.*"))) == 1
    assert (version / "config.yaml").is_file() and (version / "hparams.yaml").is_file()
    ckpts = sorted(p.name for p in (version / "checkpoints").iterdir())
    assert len(ckpts) == 2 and ckpts[1] == "last.ckpt" and ckpts[0].startswith("best-epoch")


def test_an_added_logger_writes_into_the_same_run_directory(fitted):
    """`--trainer.logger+=CSVLogger` adds to config.yaml's TensorBoard, not replaces it: both write every tag into
    the one version_0 (a logger without save_dir writes under --trainer.default_root_dir)."""
    root, _ = fitted
    version = root / "lightning_logs" / "version_0"
    tensorboard, csv = read_scalars(version), read_csv_scalars(version)
    assert csv and csv.keys() == tensorboard.keys() - {"hp_metric"}  # TensorBoard's placeholder for its hparams tab
    assert all(csv[tag].keys() == tensorboard[tag].keys() for tag in csv)


def tensorboard_hparams(version) -> list[dict]:
    """The hyperparameters of each hparams session written into the TensorBoard files of `version`."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.hparams import plugin_data_pb2

    sessions = []
    for path in version.glob("events.out.tfevents.*"):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name == "hparams" and value.tag == "_hparams_/session_start_info":
                    data = plugin_data_pb2.HParamsPluginData.FromString(value.metadata.plugin_data.content)
                    hparams = data.session_start_info.hparams
                    sessions.append({k: v.string_value or v.number_value for k, v in hparams.items()})
    return sessions


def test_the_run_config_reaches_every_logger(fitted):
    """The run's whole configuration, as saved in config.yaml, is logged to TensorBoard (its hparams) and to the
    CSV logger (hparams.yaml) under "config", next to the model's own arguments."""
    root, _ = fitted
    version = root / "lightning_logs" / "version_0"
    saved = (version / "config.yaml").read_text()
    assert yaml.safe_load((version / "hparams.yaml").read_text())["config"] == saved
    assert saved in [session.get("config") for session in tensorboard_hparams(version)]


def test_learning_rate_is_logged_at_every_step_the_logger_writes(fitted, global_batch):
    """The CLI adds a LearningRateMonitor to fit: an lr-<optimizer> tag at each of the logger's steps."""
    root, _ = fitted
    logged = {t: v for t, v in read_csv_scalars(root / "lightning_logs/version_0").items() if t.startswith("lr-")}
    every = 10  # config.yaml's log_every_n_steps
    steps = {s for s in range(3 * global_batch["steps_per_epoch"]) if (s + 1) % every == 0}
    assert logged and all(values.keys() == steps for values in logged.values())


@pytest.fixture(scope="module")
def subcommands(fitted) -> dict[str, str]:
    """validate from `--ckpt_path last`, test from `best`, predict from a file, all at once (each is one process,
    mostly start-up); no logger, so that the concurrent runs do not race for a version directory."""
    root, _ = fitted
    ckpt = {"validate": "last", "test": "best", "predict": str(root / "lightning_logs/version_0/checkpoints/last.ckpt")}

    def run(command: str) -> str:
        args = ("--trainer.accelerator", "cpu", "--ckpt_path", ckpt[command], "--trainer.logger", "false")
        return run_ok(command, *args, "--trainer.default_root_dir", str(root), cwd=root)

    (root / "config.yaml").write_text(PROJECT_CONFIG)
    return concurrently(run, COMMANDS)


# Stands for the project's own config.yaml in the directory the runs without a logger start from.
PROJECT_CONFIG = "# the project's config.yaml\n"


def test_a_run_without_logger_leaves_the_projects_config_alone(fitted, subcommands):
    """With `--trainer.logger false` Lightning would save the run's config as <default_root_dir>/config.yaml,
    over the project's own when run from the project directory: nothing is saved without a logger."""
    root, _ = fitted
    assert (root / "config.yaml").read_text() == PROJECT_CONFIG


COMMANDS = ("validate", "test", "predict")


@pytest.mark.parametrize("command", COMMANDS)
def test_other_subcommands_run_from_a_checkpoint(subcommands, command):
    """validate, test and predict load the trained weights and finish."""
    out = subcommands[command]
    if command != "predict":  # Lightning's table of the metrics the module logged
        assert f"{'Test' if command == 'test' else 'Validate'} metric" in out


def test_ckpt_path_last_and_best_name_the_file_they_load(fitted, subcommands):
    """`--ckpt_path last` is the run's last.ckpt and `best` the best one its checkpoint callback kept; each
    command says which file it loaded."""
    root, _ = fitted
    checkpoints = root / "lightning_logs/version_0/checkpoints"
    assert f"validate: --ckpt_path last is {checkpoints / 'last.ckpt'}\n" in subcommands["validate"]
    (best,) = checkpoints.glob("best-*.ckpt")
    assert f"test: --ckpt_path best is {best}\n" in subcommands["test"]


def test_fit_ckpt_path_last_continues_the_newest_run_in_its_directory(fitted, tmp_path):
    """After a finished 3-epoch run, `fit --ckpt_path last --trainer.max_epochs 4` trains one more epoch from it,
    logging and checkpointing into the same version directory (Lightning's own `last` would start from scratch
    in a new one). The run is a copy, as after moving it: last.ckpt is still overwritten, not versioned."""
    root, _ = fitted
    shutil.copytree(root / "lightning_logs", tmp_path / "lightning_logs")
    last = tmp_path / "lightning_logs/version_0/checkpoints/last.ckpt"
    before = torch.load(last, weights_only=True)["global_step"]
    out = run_ok(
        "fit", "--trainer.accelerator", "cpu", "--trainer.max_epochs", "4", "--ckpt_path", "last",
        "--trainer.default_root_dir", str(tmp_path), cwd=tmp_path,
    )  # fmt: skip
    assert f"fit: --ckpt_path last is {last}\n" in out
    assert [p.name for p in (tmp_path / "lightning_logs").iterdir()] == ["version_0"]
    assert len(list((tmp_path / "lightning_logs/version_0").glob("events.out.tfevents.*"))) == 2
    assert torch.load(last, weights_only=True)["global_step"] == before * 4 // 3


def test_tqdm_bar_redraws_every_10th_step_unless_the_user_says_otherwise(monkeypatch):
    """main.py defaults TQDM_MINITERS to 10 (Lightning's TQDM bar reads it) and keeps a value already set."""
    import main  # here, not at the top: importing it sets the variable

    monkeypatch.delenv("TQDM_MINITERS", raising=False)
    importlib.reload(main)
    assert os.environ["TQDM_MINITERS"] == "10"
    monkeypatch.setenv("TQDM_MINITERS", "1")
    importlib.reload(main)
    assert os.environ["TQDM_MINITERS"] == "1"


def test_doctor_reports_by_default_without_timing_the_all_reduce(fitted):
    """The default fit ends with the doctor's report; the costly comm hook is off unless asked for."""
    root, out = fitted
    summary = json.loads((root / "lightning_logs/version_0/doctor.json").read_text())
    assert "Scaling doctor: 1 x cpu" in out and "comm not timed" in out
    assert summary["comm_measured"] is False and summary["steps"] > 0


# Builds the trainer (run=False) for three ways of naming the strategy; prints each one's collective timeout.
TIMEOUTS = """
from main import main
from ddpkit.lightning_internals import ddp_timeout

cpu = ["--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.logger", "false", "--dist_timeout", "20"]
ddp = ["--trainer.strategy", "lightning.pytorch.strategies.DDPStrategy"]
for extra in ([], [*ddp, "--trainer.strategy.bucket_cap_mb", "50"], [*ddp, "--trainer.strategy.timeout", "0:00:45"]):
    strategy = main([*cpu, *extra], run=False).trainer.strategy
    print("TIMEOUT", type(strategy).__name__, ddp_timeout(strategy).total_seconds())
"""


def test_dist_timeout_reaches_a_strategy_given_as_a_class_path():
    """--dist_timeout 20 applies to "ddp" and to a DDPStrategy class path with arguments (bucket_cap_mb, which
    the doctor recommends; torch's 30-minute default used to come back there); a timeout set there is kept."""
    result = subprocess.run([sys.executable, "-c", TIMEOUTS], cwd=PROJECT, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("TIMEOUT")]
    assert lines == ["TIMEOUT TimedDDPStrategy 20.0", "TIMEOUT DDPStrategy 20.0", "TIMEOUT DDPStrategy 45.0"]


def logger_config(save_dir: str | None, version: int | None = None) -> Namespace:
    return Namespace(class_path="L", init_args=Namespace(save_dir=save_dir, name="lightning_logs", version=version))


def test_loggers_sharing_a_directory_share_the_next_version(tmp_path, monkeypatch):
    """Two loggers under default_root_dir get the same version (the one after the highest there); a logger
    elsewhere, or with its own version, keeps what it had."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    (tmp_path / "lightning_logs/version_4").mkdir(parents=True)
    loggers = [logger_config(str(tmp_path)), logger_config(str(tmp_path)), logger_config("elsewhere")]
    loggers.append(logger_config(str(tmp_path), version=9))
    place_loggers(Namespace(default_root_dir=str(tmp_path), logger=loggers), None)
    assert [entry.init_args.version for entry in loggers] == [5, 5, None, 9]


def test_loggers_take_the_slurm_job_id_as_version(tmp_path, monkeypatch):
    """Under SLURM every logger without a version logs into version_<job id>, as Lightning's `logger: true` did,
    so a requeued job (same id) continues its directory."""
    monkeypatch.setenv("SLURM_JOB_ID", "1234")
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    loggers = [logger_config(str(tmp_path))]
    place_loggers(Namespace(default_root_dir=str(tmp_path), logger=loggers), None)
    assert loggers[0].init_args.version == 1234
