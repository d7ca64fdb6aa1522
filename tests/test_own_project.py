"""A user's project over time: baked with cruft, the example replaced by a model and data of the user's own,
then a newer template (a new library release) taken with `cruft update`. The user's files stay as they are,
the library is the new one, and the baked workflow's steps (the guarantee suite on the user's classes) pass.
The update also brings the new release's manual (vendor/ddpkit/docs), and the presets the project's configs/ lacks
come from the installed library with `python -m ddpkit.presets`. The story runs once (tests/own_project.py,
started by tests/conftest.py); these tests read its record."""

import json
import re

import pytest
from own_project import (
    DELETED,
    GPU_CHECK_SKIPPED,
    LACKED_PRESET,
    LIBRARY,
    MANUAL_CHANGE,
    MANUAL_PAGE,
    NEW_PRESET,
    NEW_VERSION,
    PRESET_COMMANDS,
    tree,
)
from test_gpu_check import gpu_check


@pytest.fixture(scope="module")
def own_project(own_project_story) -> dict:
    return own_project_story.result(timeout=3600)  # queued, then bounded by its own timeouts


def test_update_keeps_the_users_files_and_brings_the_new_library(own_project):
    """After `cruft update`, the user's files are byte for byte what they wrote, the deleted example stays
    deleted, vendor/ddpkit is the new release's (installed by `pip install -e ".[dev]"`), and the template's
    own files (main.py) follow the template."""
    project, template = own_project["project"], own_project["template"] / "{{cookiecutter.project_slug}}"
    assert own_project["old"] != own_project["new"]
    assert json.loads((project / ".cruft.json").read_text())["commit"] == own_project["new"]
    assert own_project["after"] == own_project["before"]
    assert not any((project / name).exists() for name in DELETED)
    assert tree(project / "vendor" / "ddpkit") == tree(template / "vendor" / "ddpkit")
    assert own_project["installed_version"] == NEW_VERSION
    assert (project / "main.py").read_text().endswith("# the template's next main.py\n")


def test_update_brings_the_new_manual_and_the_presets_the_project_lacks(own_project):
    """After `cruft update` the manual is the new release's (its changed page included), while configs/, the user's,
    still lacks the preset they deleted and the one the release added; `python -m ddpkit.presets` lists both as
    missing with the command that copies them, the manual's copy command brings each, byte for byte the installed
    library's, and the same copy again keeps the file and exits 1."""
    project, template = own_project["project"], own_project["template"]
    assert (project / "vendor" / "ddpkit" / MANUAL_PAGE).read_text().endswith(MANUAL_CHANGE)
    assert tree(project / "vendor" / "ddpkit" / "docs") == tree(template / LIBRARY / "docs")
    assert own_project["lacked_after_update"] == sorted([LACKED_PRESET, NEW_PRESET])
    ran = own_project["presets"]
    assert [command for command, _, _ in ran] == PRESET_COMMANDS
    (_, listed, listing), (_, first, _), (_, new, _), (_, again, refused) = ran
    states = {line.split()[0]: line.split()[1] for line in listing.splitlines()[1:] if line.startswith("  ")}
    assert listed == 0 and states[LACKED_PRESET] == states[NEW_PRESET] == "missing", listing
    assert f"copy the missing ones: python -m ddpkit.presets {LACKED_PRESET} {NEW_PRESET}" in listing, listing
    assert (first, new, again) == (0, 0, 1), ran
    for name in (LACKED_PRESET, NEW_PRESET):
        shipped = template / LIBRARY / "src" / "ddpkit" / "presets" / f"{name}.yaml"
        assert (project / "configs" / f"{name}.yaml").read_bytes() == shipped.read_bytes(), name
    assert refused.startswith(f"not copied: configs/{LACKED_PRESET}.yaml exists"), refused


def test_own_model_and_data_keep_the_guarantees(own_project):
    """The workflow's remaining steps as written (ruff, the project's suite, unedited) pass on the user's classes
    after the update, the schedule and sharded parity among them (the module takes a scheduler and shards its
    layers); only GPU tests skip."""
    steps = own_project["steps"]
    assert [step for step, _, _ in steps] == ["ruff check .", "pytest"]
    skips = []
    for step, code, out in steps:
        print(f"$ {step}\n{out[-3000:]}")
        assert code == 0, f"{step} exited {code}:\n{out[-6000:]}"
        if step != "ruff check .":
            assert " passed" in out and " failed" not in out
            skips += [line for line in out.splitlines() if line.startswith("SKIPPED")]
    # Skips name their reason (-rs): not "does not shard its layers", not "takes no scheduler argument".
    assert skips and all("GPU" in s or "CUDA" in s for s in skips), skips
    # A run's checkpoints went once no later test read it: fewer on disk at once than the session wrote.
    (footprint,) = [line for line in out.splitlines() if line.startswith("ddpkit: the suite's runs wrote")]
    written, at_once = re.search(
        r"\((\d+) x the model's .* at most \d+ MB \(([\d.]+) x\) on disk at once", footprint
    ).groups()
    assert 0 < float(at_once) < int(written), footprint
    # The suite writes into temporary directories only (no doctor.json, runs/ or lightning_logs/ left here).
    assert own_project["left_behind"] <= {".pytest_cache", ".ruff_cache"}


ONE_STEP = "test_one_step_from_the_same_state_matches_1_vs_2_devices"


@pytest.mark.parametrize(
    ("bug", "caught_by"),
    [
        ("SumLoss", ["test_logged_scalars_match_every_step", "test_weights_match_1_vs_2_devices",
                     f"{ONE_STEP}[fp32]", f"{ONE_STEP}[bf16]"]),
        ("UnsyncedBatchNorm", ["test_weights_match_1_vs_2_devices", f"{ONE_STEP}[fp32]", f"{ONE_STEP}[bf16]"]),
        ("UnsyncedMetric", ["test_eval_metrics_count_each_sample_once[val]"]),
    ],
)  # fmt: skip
def test_parity_suite_fails_on_classic_ddp_bugs(own_project, bug, caught_by):
    """The project's parity tests, run on the user's module with one classic DDP bug, fail on that bug: in float64
    and, one step at a time, in float32 and bf16 (a validation metric is judged in float64 alone)."""
    code, out, _ = own_project["bugs"][bug]
    print(out[-3000:])
    failed = [line.split()[1] for line in out.splitlines() if line.startswith("FAILED ")]
    assert code == 1 and failed, out[-6000:]
    for name in caught_by:
        assert any(f.endswith(f"::{name}") for f in failed), (name, failed)
    # The summed loss is named before any run, with its fix, in each test's failure (the count probe's line).
    summed = "SumLoss's loss of a batch is not the mean of its samples' losses: the global batch in 2 micro-batches"
    assert (out.count(summed) >= len(caught_by)) == (bug == "SumLoss"), out[-6000:]


def test_selected_tests_start_only_the_runs_they_read(own_project):
    """The bug sessions select 5 of the suite's tests (own_project.PARITY_SELECTED): the suite started their runs
    alone, the first wave's 3 (the user's model takes micro-batches: the reference is 4 of them; for BatchNorm,
    reversed batches) and the 5 one-step runs, and their 5 again from nudged states where the one-step check failed
    (its second look), none of the others' 20 (torchrun, resumes, evaluation, SLURM...). The summed loss, named
    before any run, starts only the first wave, which the evaluation check reads (it compares no training)."""
    one_step = ["step-1dev-bf16", "step-1dev-fp32", "step-1dev-fp64", "step-2dev-bf16", "step-2dev-fp32"]
    for bug, (_, out, started) in own_project["bugs"].items():
        steps = [] if bug == "SumLoss" else one_step
        reference = "1dev-reversed-fp64" if bug == "UnsyncedBatchNorm" else "1dev-acc4-fp64"
        failed = [line for line in out.splitlines() if line.startswith("FAILED ")]
        looked_again = any("test_one_step_from_the_same_state" in line for line in failed)
        second_look = [f"{run}-nudged" for run in steps] if looked_again else []
        assert started == sorted(["1dev-fp64", "2dev-fp64", reference, *steps, *second_look]), (bug, started)


def test_gpu_check_dry_run_needs_nothing_beyond_the_projects_dev_install(own_project):
    """In the project's own environment (`pip install -e ".[dev]"`: no optuna, MLflow or W&B) the GPU check's dry
    run passes the steps that CI's own dry run leaves to it: the library's GPU-marked tests collect (only the files
    that hold one) and skip without GPUs, the benchmark runs on CPU, the comparisons and the doctor read their fit."""
    assert own_project["optional_installed"] == []
    code, out, steps = own_project["gpu_check"]
    assert code == 0, out[-4000:]
    skipped = [s.name for s in gpu_check.STEPS if s.key in GPU_CHECK_SKIPPED]
    assert sorted(steps) == sorted(s.name for s in gpu_check.STEPS if s.name not in skipped), out[-4000:]
    verdict, detail, _ = steps["the library's GPU-marked tests"]
    assert verdict == "PASS" and re.match(r"\d+ skipped, \d+ deselected", detail), detail
    verdict, detail, _ = steps["the benchmark: template / bare Lightning, template / raw DDP"]
    assert verdict == "PASS" and "max weight diff 0.0e+00" in detail, detail
