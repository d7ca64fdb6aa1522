"""`python main.py` end to end on whatever config.yaml selects: what a run writes, the other subcommands.

The runs are the suite's shared ones (runs.py): the 1-device float64 fit of the first wave, with a CSV logger
added to config.yaml's; `validate`, `test` and `predict` from a copy of it; `fit --ckpt_path last` on another copy,
stopped mid-epoch.
"""

import json

import pytest
import yaml

from ..parity import read_csv_scalars, read_scalars
from ..scaling.record import DoctorRecord
from .bounds import assert_weights_close, fp64_bound
from .runs import PROJECT_CONFIG, STAGE_SETS, best_checkpoint, comparable, global_step, optimizer_steps, reads


def defined(configured: dict, *commands: str) -> list[str]:
    """Those of `commands` the module defines a step for and the data module a set for (configured.py; the runs
    are made for these only: runs.evaluation_runs); skips, saying what is missing, when there is none."""
    hooks = {"validate": "validation_step", "test": "test_step", "predict": "predict_step"}
    missing = {
        c: f"{configured['model']} defines no {hooks[c]}"
        if c not in configured["stages"]
        else f"{configured['data']} has no {STAGE_SETS[c]} set"
        for c in commands
        if c not in configured["stages"] or not configured.get(f"{STAGE_SETS[c]}_size", 1)
    }
    if len(missing) == len(commands):
        pytest.skip("; ".join(missing.values()))
    return [c for c in commands if c not in missing]


@reads("1dev-fp64")
def test_fit_writes_logs_config_and_checkpoints_under_root(cpu_runs):
    """One version dir with TensorBoard events, config.yaml, hparams.yaml, best and last checkpoints (besides the
    epoch checkpoints the suite adds)."""
    root = cpu_runs["1dev-fp64"].root
    version = root / "lightning_logs" / "version_0"
    assert sorted(p.name for p in (root / "lightning_logs").iterdir()) == ["version_0"]
    assert len(list(version.glob("events.out.tfevents.*"))) == 1
    assert (version / "config.yaml").is_file() and (version / "hparams.yaml").is_file()
    ckpts = sorted(p.name for p in (version / "checkpoints").iterdir() if not p.name.startswith("epoch="))
    assert len(ckpts) == 2 and ckpts[1] == "last.ckpt" and ckpts[0].startswith("best-epoch")


@reads("1dev-fp64")
def test_an_added_logger_writes_into_the_same_run_directory(cpu_runs):
    """`--trainer.logger+=CSVLogger` adds to config.yaml's TensorBoard, not replaces it: both write every tag into
    the one version_0 (a logger without save_dir writes under --trainer.default_root_dir)."""
    version = cpu_runs["1dev-fp64"].version
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


@reads("1dev-fp64")
def test_the_run_config_reaches_every_logger(cpu_runs):
    """The run's whole configuration, as saved in config.yaml, is logged to TensorBoard (its hparams) and to the
    CSV logger (hparams.yaml) under "config", next to the model's own arguments."""
    version = cpu_runs["1dev-fp64"].version
    saved = (version / "config.yaml").read_text()
    assert yaml.safe_load((version / "hparams.yaml").read_text())["config"] == saved
    assert saved in [session.get("config") for session in tensorboard_hparams(version)]


@reads("1dev-fp64")
def test_learning_rate_is_logged_at_every_step_the_logger_writes(cpu_runs, global_batch):
    """The CLI adds a LearningRateMonitor to fit: an lr-<optimizer> tag at each of the logger's steps (every
    step: the shared runs log every step)."""
    logged = {t: v for t, v in read_csv_scalars(cpu_runs["1dev-fp64"].version).items() if t.startswith("lr-")}
    # Lightning logs at each batch that stepped (its _batches_that_stepped): one a batch whatever a module's
    # optimizers step in it (the GAN's 2), one a step under a schedule of accumulation.
    steps = set(range(optimizer_steps(global_batch, 2 * global_batch["steps_per_epoch"])))
    assert logged and all(values.keys() == steps for values in logged.values())


COMMANDS = ("validate", "test", "predict")


@reads("{evaluations}")
def test_a_run_without_logger_leaves_the_projects_config_alone(cpu_runs, configured):
    """With `--trainer.logger false` Lightning would save the run's config as <default_root_dir>/config.yaml,
    over the project's own when run from the project directory: nothing is saved without a logger."""
    (root,) = {cpu_runs[f"{command}-1dev"].root for command in defined(configured, *COMMANDS)}  # all ran there
    assert (root / "config.yaml").read_text() == PROJECT_CONFIG


@pytest.mark.parametrize("command", COMMANDS)
@reads("1dev-fp64", "{command}-1dev")
def test_other_subcommands_run_from_a_checkpoint(cpu_runs, configured, command):
    """validate, test and predict load the trained weights and finish; predict loads the file it was given and
    writes one prediction per sample of the predict set into predictions.pt in the run's directory."""
    defined(configured, command)
    run = cpu_runs[f"{command}-1dev"]
    out = run.output()
    if command != "predict":  # Lightning's table of the metrics the module logged
        assert f"{'Test' if command == 'test' else 'Validate'} metric" in out
    else:  # the predict run was given the 1-device fit's last.ckpt (runs.py)
        assert f"Loaded model weights from the checkpoint at {cpu_runs['1dev-fp64'].checkpoint()}\n" in out
        if configured.get("predict_size"):
            written = f"predict: wrote {configured['predict_size']} predictions to {run.root / 'predictions.pt'}\n"
            assert written in out and (run.root / "predictions.pt").is_file(), out[-3000:]


@reads("1dev-fp64", "{evaluations}")
def test_ckpt_path_last_and_best_name_the_file_they_load(cpu_runs, configured):
    """`--ckpt_path last` is the run's last.ckpt and `best` the best one its checkpoint callback kept (the file
    the copied run's last.ckpt records, in the run it was copied from); each command says which file it loaded
    (validate loads last, test loads best: those of the two the module defines)."""
    have = defined(configured, "validate", "test")
    if "validate" in have:
        validate = cpu_runs["validate-1dev"]
        assert f"validate: --ckpt_path last is {validate.checkpoint()}\n" in validate.output()
    if "test" in have:
        best = best_checkpoint(cpu_runs["1dev-fp64"])
        assert best.name.startswith("best-") and best.parent == cpu_runs["1dev-fp64"].checkpoint().parent
        assert f"test: --ckpt_path best is {best}\n" in cpu_runs["test-1dev"].output()


@reads("continue", "1dev-fp64", "2dev-fp64", "{bound}")
def test_fit_ckpt_path_last_continues_the_newest_run_in_its_directory(cpu_runs, steps):
    """A run stopped 1 global batch into epoch 1 (its last.ckpt that state, as a killed run's, saved every few steps,
    would be) continues with `fit --ckpt_path last`: it trains the remaining steps only, logging and checkpointing
    into the same version directory (Lightning's own `last` would start from scratch in a new one), and ends with the
    uninterrupted run's weights. The run is a copy, as after moving it: last.ckpt is overwritten, not versioned."""
    continued = cpu_runs["continue"]
    assert f"fit: --ckpt_path last is {continued.checkpoint()}\n" in continued.output()
    assert [p.name for p in (continued.root / "lightning_logs").iterdir()] == ["version_0"]
    assert len(list(continued.version.glob("events.out.tfevents.*"))) == 2
    assert continued.global_step() == cpu_runs["1dev-fp64"].global_step()
    stepped = [global_step(steps, b) for b in range(steps["one_to_two"] + 1, 2 * steps["steps_per_epoch"] + 1)]
    assert [r["step"] for r in continued.probe()["train"]] == stepped
    comparable(steps)
    assert_weights_close(cpu_runs["1dev-fp64"], continued, fp64_bound(cpu_runs, steps))


@reads("1dev-fp64")
def test_doctor_reports_by_default_without_timing_the_all_reduce(cpu_runs):
    """The default fit ends with the doctor's report; the costly comm hook is off unless asked for."""
    run = cpu_runs["1dev-fp64"]
    summary = DoctorRecord.from_dict(json.loads((run.version / "doctor.json").read_text()))
    assert "Scaling doctor: 1 x cpu" in run.output() and "comm not timed" in run.output()
    assert summary.comm_measured is False and summary.steps > 0
