"""Unit tests of library code the guarantee suite relies on, on no user model: the parity measures, logger
versions, the collective timeout, the progress bar's default, the requeue checkpoint's name."""

import os
import subprocess
import sys

import pytest
import torch
from ddpkit.cli import main, place_loggers
from ddpkit.parity import diff, max_abs
from ddpkit.requeue import next_hpc_checkpoint
from jsonargparse import Namespace

LIBRARY_TESTS = os.path.dirname(os.path.abspath(__file__))


def test_diff_is_relative_to_the_tensor_scale_and_nan_never_passes():
    """max_rel divides by the reference's largest entry, so a near-zero entry cannot inflate it."""
    d = diff("w", torch.tensor([2.0, 1e-9]), torch.tensor([2.0, 2e-9]))
    assert d.max_abs == pytest.approx(1e-9) and d.max_rel == pytest.approx(5e-10)
    assert not diff("w", torch.ones(2), torch.tensor([1.0, float("nan")])).max_rel <= 1.0
    with pytest.raises(ValueError, match=r"shape \(2,\) vs \(3,\)"):
        diff("w", torch.ones(2), torch.ones(3))


def test_max_abs_is_the_largest_difference_of_any_tensor_and_nan_never_passes():
    """The single number the multi-node, sharding and fault tests bound: the largest |a - b| of all tensors."""
    a = {"w": torch.zeros(2, dtype=torch.float64), "b": torch.ones(1, dtype=torch.float64)}
    b = {"w": torch.tensor([0.0, 3e-7], dtype=torch.float64), "b": torch.tensor([1.0 - 1e-6], dtype=torch.float64)}
    assert max_abs(a, b) == pytest.approx(1e-6)
    assert not max_abs(a, b | {"w": torch.tensor([0.0, float("nan")], dtype=torch.float64)}) < 1.0


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


# Builds the trainer (run=False) of the library's toy config (ddpkit/toy.yaml) for three ways of naming the strategy;
# prints each one's collective timeout. In a subprocess: building a Trainer sets up its environment.
TIMEOUTS = """
from ddpkit.cli import main
from ddpkit.lightning_internals import ddp_timeout
from ddpkit.toy import CONFIG

cpu = ["--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.logger", "false", "--dist_timeout", "20"]
ddp = ["--trainer.strategy", "lightning.pytorch.strategies.DDPStrategy"]
bucket, timeout = [*ddp, "--trainer.strategy.bucket_cap_mb", "50"], [*ddp, "--trainer.strategy.timeout", "0:00:45"]
unused = ["--trainer.strategy", "ddp_find_unused_parameters_true"]
for extra in (["--trainer.strategy", "ddp"], bucket, timeout, unused):
    strategy = main(CONFIG, [*cpu, *extra], run=False).trainer.strategy
    flag = strategy._ddp_kwargs.get("find_unused_parameters")  # what the alias means must survive
    print("TIMEOUT", type(strategy).__name__, ddp_timeout(strategy).total_seconds(), flag)
"""


def test_dist_timeout_reaches_a_strategy_given_as_a_class_path():
    """--dist_timeout 20 applies to "ddp", to its other registered names (ddp_find_unused_parameters_true, which
    Lightning's own error names for unused parameters, keeping what the name means) and to a DDPStrategy class
    path with arguments (bucket_cap_mb, which the doctor recommends; torch's 30-minute default used to come
    back there); a timeout set there is kept."""
    cmd = [sys.executable, "-c", TIMEOUTS]
    result = subprocess.run(cmd, cwd=LIBRARY_TESTS, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("TIMEOUT")]
    assert lines == [
        "TIMEOUT TimedDDPStrategy 20.0 None",
        "TIMEOUT DDPStrategy 20.0 False",
        "TIMEOUT DDPStrategy 45.0 False",
        "TIMEOUT TimedDDPStrategy 20.0 True",
    ]


def test_tqdm_bar_redraws_every_10th_step_unless_the_user_says_otherwise(tmp_path, monkeypatch, capsys):
    """The CLI defaults TQDM_MINITERS to 10 (Lightning's TQDM bar reads it) and keeps a value already set."""
    monkeypatch.delenv("TQDM_MINITERS", raising=False)
    monkeypatch.setattr(sys, "argv", ["main.py"])  # not pytest's arguments
    for expected in ("10", "1"):
        with pytest.raises(SystemExit):  # --help: the variable is set before anything is parsed
            main(tmp_path / "no-config.yaml", ["--help"])
        assert os.environ["TQDM_MINITERS"] == expected
        monkeypatch.setenv("TQDM_MINITERS", "1")


def test_next_hpc_checkpoint_follows_the_highest_number(tmp_path):
    """Lightning resumes from the highest hpc_ckpt_N.ckpt, so a new save takes N + 1 (1 in an empty dir)."""
    assert next_hpc_checkpoint(tmp_path) == tmp_path / "hpc_ckpt_1.ckpt"
    for name in ("hpc_ckpt_2.ckpt", "hpc_ckpt_10.ckpt", "hpc_ckpt_x.ckpt"):
        (tmp_path / name).touch()
    assert next_hpc_checkpoint(tmp_path) == tmp_path / "hpc_ckpt_11.ckpt"
