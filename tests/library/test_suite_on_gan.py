"""The guarantee suite (ddpkit.testing) on a module it was not written around: a two-optimizer GAN with manual
optimization (gan.py) trained on 1 and 2 CPU processes. Steps are counted as the module steps (two a batch),
checks that cannot hold skip with their reason, micro-batches are refused before training, a training step that
draws random numbers is named with the switch that turns it off, and stages the module does not define skip.

Only the suite's first wave runs (the 1- and 2-device float64 fits); the skips are checked with runs that fail
the test when read, so a check that should skip but does not costs nothing and says so.
"""

import inspect
import shutil
import tempfile
from pathlib import Path

import pytest

import ddpkit.testing.plugin  # noqa: F401  first: it has pytest rewrite the asserts of the checks imported below
from ddpkit.testing import check_cli, check_data, check_parity, helpers
from ddpkit.testing.configured import describe
from ddpkit.testing.runs import comparable, evaluation_runs, plan
from ddpkit.testing.waves import shared_runs

HERE = Path(__file__).resolve().parent

MAIN = """\
from pathlib import Path

from ddpkit.run.cli import main as run_cli


def main(args=None, run=True):
    return run_cli(Path(__file__).with_name("config.yaml"), args, run)


if __name__ == "__main__":
    main()
"""
# A baked project's config.yaml, on the GAN. Lightning's DDP needs find_unused_parameters for it: the
# discriminator's step leaves the generator without gradients.
CONFIG = """\
seed_everything: 42
dist_timeout: 120
trainer:
  accelerator: cpu
  strategy: ddp_find_unused_parameters_true
  devices: 1
  max_epochs: 20
  logger:
    - class_path: lightning.pytorch.loggers.TensorBoardLogger
  callbacks:
    - class_path: ddpkit.run.checkpoints.CurrentModelCheckpoint
      init_args:
        monitor: val/d_loss
        mode: min
        save_top_k: 1
        save_last: true
        filename: "best-epoch{epoch:02d}-step{step}"
        auto_insert_metric_name: false
model:
  class_path: gan.TinyGAN
data:
  class_path: gan.GanData
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A project directory (main.py, config.yaml, gan.py) that the suite's helpers and fork server run; the fork
    server started for it is stopped at the end, so that no later test forks this project."""
    root = tmp_path_factory.mktemp("gan-project")
    (root / "main.py").write_text(MAIN)
    (root / "config.yaml").write_text(CONFIG)
    shutil.copy(HERE / "gan.py", root / "gan.py")
    before = helpers.project()
    helpers.set_project(root)
    yield root
    helpers.FORK_SERVER.close()
    helpers.set_project(before)


@pytest.fixture(scope="module")
def configured(project):
    return describe()


@pytest.fixture(scope="module")
def steps(configured):
    return plan(configured)


@pytest.fixture(scope="module")
def cpu_runs(tmp_path_factory, steps):
    return shared_runs(tmp_path_factory.mktemp("gan-runs"), steps)


class NoRuns:
    """In place of the runs for checks that must skip (or fail) before reading any."""

    def __getitem__(self, name):
        raise AssertionError(f"the check read the run {name}")


def call(check, **fixtures):
    """A suite check called as pytest would, with the fixtures it names."""
    return check(**{name: fixtures[name] for name in inspect.signature(check).parameters})


def test_configured_counts_two_optimizer_steps_a_batch(configured, steps):
    """configured.py sees manual optimization, 2 optimizer steps per batch (Lightning's global_step counts each),
    a deterministic step, only a validation step; the shared runs then skip accumulation and test/predict."""
    assert configured["manual_optimization"] is True and configured["steps_per_batch"] == 2
    assert configured["random_step"] == "" and configured["stages"] == ["validate"]
    assert steps["micro_batch_size"] is None and steps["steps_per_epoch"] == 8
    assert evaluation_runs(steps) == ["validate-1dev"]


# The first wave's checks, each as the suite runs it (parameters as in its parametrize).
FIRST_WAVE = {
    "weights fp64": (check_parity.test_weights_match_1_vs_2_devices, {}),
    "scalars fp64": (check_parity.test_logged_scalars_match_every_step, {}),
    "training values": (check_parity.test_logged_training_values_are_global, {}),
    "val metrics": (check_data.test_eval_metrics_count_each_sample_once, {"stage": "val"}),
    "shards": (check_data.test_each_rank_gets_half_of_every_epoch_and_nothing_twice, {}),
    "global batches": (check_data.test_global_batches_equal_1_device_and_reshuffle_each_epoch, {}),
    "files": (check_parity.test_2_devices_write_one_set_of_files, {}),
    "loader position": (check_parity.test_mid_epoch_checkpoint_records_loader_position, {}),
    "csv": (check_parity.test_csv_logger_is_added_and_its_scalars_match_1_vs_2_devices, {}),
    "fit files": (check_cli.test_fit_writes_logs_config_and_checkpoints_under_root, {}),
    "learning rate": (check_cli.test_learning_rate_is_logged_at_every_step_the_logger_writes, {}),
    "added logger": (check_cli.test_an_added_logger_writes_into_the_same_run_directory, {}),
    "run config": (check_cli.test_the_run_config_reaches_every_logger, {}),
    "doctor": (check_cli.test_doctor_reports_by_default_without_timing_the_all_reduce, {}),
}


@pytest.mark.parametrize("name", FIRST_WAVE)
def test_first_wave_guarantees_hold_for_the_gan(cpu_runs, steps, configured, name):
    """1 vs 2 devices in float64: weights, logged values, samples, files, checkpoints (named by global_step: 2 a
    batch) and the loader position of the mid-epoch checkpoint, each checked by the suite's own test."""
    check, params = FIRST_WAVE[name]
    call(check, cpu_runs=cpu_runs, steps=steps, global_batch=configured, configured=configured, **params)


# name: (check, parameters, the reason it skips with)
SKIPS = {
    "accumulation 1dev": (
        check_parity.test_gradient_accumulation_keeps_the_global_batch,
        {"run": "1dev-acc4-fp64"},
        "the module optimizes manually: Lightning does not accumulate for it (refused by the CLI)",
    ),
    "test metrics": (check_data.test_eval_metrics_count_each_sample_once, {"stage": "test"}, "defines no test_step"),
    "predictions": (
        check_data.test_predictions_are_one_file_in_dataset_order_the_same_on_1_and_2_devices,
        {},
        "defines no predict_step",
    ),
    "test command": (check_cli.test_other_subcommands_run_from_a_checkpoint, {"command": "test"}, "no test_step"),
    "predict command": (
        check_cli.test_other_subcommands_run_from_a_checkpoint,
        {"command": "predict"},
        "defines no predict_step",
    ),
}


@pytest.mark.parametrize("name", SKIPS)
def test_checks_that_cannot_hold_skip_with_the_reason(steps, configured, name):
    """Accumulation (manual optimization) and the stages the GAN defines no step for skip, naming why, before
    reading any run."""
    check, params, reason = SKIPS[name]
    with pytest.raises(pytest.skip.Exception, match=reason.replace("(", r"\(").replace(")", r"\)")):
        call(check, cpu_runs=NoRuns(), steps=steps, global_batch=configured, configured=configured, **params)


def test_micro_batches_with_manual_optimization_are_refused_before_training(project, tmp_path):
    """--data.micro_batch_size 8 on 2 devices (4 a device would make 2 micro-batches of each device's 16): exit
    2 with one `error:` line naming the shrunk global batch, and nothing written."""
    args = ["--trainer.devices", "2", "--data.micro_batch_size", "8", "--trainer.default_root_dir", str(tmp_path)]
    result = helpers.run_main("fit", *args, cwd=tmp_path, timeout=120, log=tmp_path.parent / "refused.log")
    errors = [line for line in result.stdout.splitlines() if "error:" in line]
    assert result.returncode == 2, result.stdout[-3000:]
    assert errors == [
        "error: --data.micro_batch_size 8 would split each device's 16 samples into 2 micro-batches, but TinyGAN "
        "optimizes manually (automatic_optimization = False), which Lightning does not accumulate for: every "
        "micro-batch would be an optimizer step on 16 samples instead of the global batch of 32. Leave "
        "micro_batch_size unset."
    ]
    assert list(tmp_path.iterdir()) == []


def test_a_run_without_a_log_file_leaves_nothing_in_the_temporary_folder(project, tmp_path, monkeypatch):
    """run_main without `log` (configured.py's measurement, a project's own checks) returns the output and removes
    the temporary file it went to, and its exit status file: a user's suite left two files in /tmp per call."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    result = helpers.run_main("fit", "--print_config", cwd=project, timeout=120)
    assert result.returncode == 0 and "class_path: gan.GanData" in result.stdout, result.stdout[-3000:]
    assert list(tmp_path.iterdir()) == []


def test_a_training_step_drawing_random_numbers_is_named_instead_of_failing_on_a_number(project):
    """Instance noise drawn in the training step (--model.noise_std 0.1): configured.py finds that one step from the
    same weights and batch ends differently under two seeds, and the parity checks fail with that sentence and the
    switch (PARITY_ARGS='--model.noise_std 0') before comparing any number."""
    noisy = describe("--model.noise_std", "0.1")
    assert noisy["random_step"].startswith("TinyGAN's training step draws random numbers (one step from the same")
    assert "changes 8 of 8 tensors differently" in noisy["random_step"]
    assert "PARITY_ARGS='--model.noise_std 0'" in noisy["random_step"]
    with pytest.raises(pytest.fail.Exception, match="^TinyGAN's training step draws random numbers"):
        comparable(plan(noisy))
    with pytest.raises(pytest.fail.Exception, match="PARITY_ARGS='--model.noise_std 0'"):
        check_parity.test_weights_match_1_vs_2_devices(NoRuns(), plan(noisy))


def test_a_run_that_ends_through_os_exit_is_reported_at_once_with_its_error(project, tmp_path):
    """A forked run that fails on ddpkit's error path (an exception in the training step: one `error:` line, then
    os._exit) ends with its status, 1, and its error as the headline, instead of being waited out to the timeout
    and reported as "timed out" (it wrote no status before the waiter did)."""
    fault = ["--model", "ddpkit.testing.toy.FaultyClassifier", "--model.fault", "raise", "--model.fault_rank", "0"]
    fault += ["--model.fault_step", "0", "--data", "ddpkit.testing.toy.ToyData", "--trainer.max_steps", "2"]
    fault += ["--trainer.num_sanity_val_steps", "0"]  # the GAN project monitors a metric the toy does not log
    args = ["fit", *fault, "--trainer.default_root_dir", str(tmp_path), "--trainer.enable_progress_bar", "false"]
    result = helpers.run_main(*args, cwd=tmp_path, timeout=120, log=tmp_path / "crash.log")
    assert result.returncode == 1, result.stdout[-3000:]
    assert helpers.headline(result.stdout) == "error: rank 0 failed: RuntimeError: injected fault on rank 0"
