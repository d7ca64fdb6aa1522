"""Unit tests of library code the guarantee suite relies on, on no user model: the parity measures, logger
versions, the collective timeout, the progress bar's default, the requeue checkpoint's name."""

import functools
import inspect
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddpkit.parity import diff, max_abs, over_bound, report, scalar_diffs
from ddpkit.parity import main as compare_main
from ddpkit.run.requeue import next_hpc_checkpoint
from ddpkit.testing import plugin  # noqa: F401  first: it registers the suite's modules for assert rewriting
from ddpkit.parity import ROUNDING_CEILING, ROUNDING_FACTOR
from ddpkit.testing.bounds import BOUNDS, Bound, Noise, assert_within, fp64_bound, judge, logged_bound
from ddpkit.testing.check_onestep import ONE_STEP_FACTOR, StepVerdict, different_starts, over_twice, step_verdicts
from ddpkit.testing import fake_cluster
from ddpkit.testing.configured import switch_off
from ddpkit.testing.gradient_peaks import NO_GRADIENT as NO_GRADIENT_OF_TOP
from ddpkit.testing.gradient_peaks import NO_GRADIENT_FILE as MASKS
from ddpkit.testing.parity_probe import digests, nudged
from ddpkit.testing.footprint import Footprint, remove_checkpoints, stored_bytes
from ddpkit.testing.runs import (
    FP64_BOUND,
    MID_CHECKPOINT,
    STEP_RECORDS,
    Run,
    Wave,
    Waves,
    evaluation_runs,
)
from ddpkit.testing.commands import command, failed
from ddpkit.testing.runs import plan, runs_read
from ddpkit.testing.slim import NAME_ONLY

LIBRARY_TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def _own_slots(tmp_path_factory, monkeypatch):
    """The Waves these tests build take slots of their own, not the machine's (slots.py), which real runs of other
    sessions may hold meanwhile."""
    from ddpkit.testing import slots

    folder = tmp_path_factory.mktemp("slots")
    monkeypatch.setattr(slots, "folder", lambda: folder)


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


# Builds the trainer (run=False) of the library's toy config (ddpkit/testing/toy.yaml) for three ways of naming the
# strategy; prints each one's collective timeout. In a subprocess: building a Trainer sets up its environment.
TIMEOUTS = """
from ddpkit.run.cli import main
from ddpkit.lightning_internals import ddp_timeout
from ddpkit.testing.toy import CONFIG

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


def test_next_hpc_checkpoint_follows_the_highest_number(tmp_path):
    """Lightning resumes from the highest hpc_ckpt_N.ckpt, so a new save takes N + 1 (1 in an empty dir)."""
    assert next_hpc_checkpoint(tmp_path) == tmp_path / "hpc_ckpt_1.ckpt"
    for name in ("hpc_ckpt_2.ckpt", "hpc_ckpt_10.ckpt", "hpc_ckpt_x.ckpt"):
        (tmp_path / name).touch()
    assert next_hpc_checkpoint(tmp_path) == tmp_path / "hpc_ckpt_11.ckpt"


def test_over_bound_leaves_out_tensors_at_rounding_level_and_nan_never_passes():
    """A tensor fails on max_rel above the bound unless its max_abs is within `at_rounding`; NaN fails either way.
    A report lists the tensors over the bound first and those at rounding level last."""
    f64 = functools.partial(torch.tensor, dtype=torch.float64)
    diffs = [
        diff("key.bias", f64([1e-16, -2e-16]), f64([3e-16, -1e-16])),  # max_rel 1.0, at rounding level
        diff("weight", f64([1.0, 2.0]), f64([1.0, 2.0 + 1e-9])),  # max_rel 5e-10
        diff("nan", f64([1.0, 1.0]), f64([1.0, float("nan")])),
    ]
    assert [d.name for d in over_bound(diffs, 1e-12)] == ["key.bias", "weight", "nan"]
    assert [d.name for d in over_bound(diffs, 1e-12, at_rounding=1e-15)] == ["weight", "nan"]
    assert [d.name for d in over_bound(diffs, 1e-9, at_rounding=1e-15)] == ["nan"]
    lines = report(diffs, at_rounding=1e-15, max_rel=1e-12).splitlines()  # over the bound first, rounding last
    assert lines == [
        "  weight: max_abs 1e-09, max_rel 5e-10 (over 1e-12)",
        "  nan: max_abs nan, max_rel nan (over 1e-12)",
        "  key.bias: max_abs 2e-16, max_rel 1 (at rounding level)",
    ]
    assert "rounding" not in report(diffs)  # no level given: nothing is marked


class Weights:
    """A finished run as fp64_bound reads it: its final weights (w, and a bias that holds only rounding) and its
    folder, where the gradients' peaks may be (none: no element is left out)."""

    def __init__(self, w: list[float], bias: float, root: Path = Path("/nonexistent")) -> None:
        self.w, self.bias, self.root = w, bias, root

    def weights(self) -> dict[str, torch.Tensor]:
        return {"w": torch.tensor(self.w, dtype=torch.float64), "bias": torch.tensor([self.bias], dtype=torch.float64)}


@pytest.mark.parametrize("micro_batch_size", [8, None])  # the reference: 4 micro-batches, or reversed batches
@pytest.mark.parametrize(
    ("reference", "max_rel", "at_rounding"),
    [
        (2e-10, ROUNDING_FACTOR * 1e-10, ROUNDING_FACTOR * 2e-10),  # the model's rounding, above the fixed bound
        (2e-14, 1e-12, ROUNDING_FACTOR * 2e-14),  # below it: the fixed bound
        (2e-6, 1e-12, 0.0),  # not rounding (broken accumulation): not used
        (0.5, 1e-12, 0.0),  # nor when the bias, as every tensor, would be within 4 x its max_abs
    ],
)
def test_fp64_bound_is_a_factor_of_the_models_rounding_at_least_the_fixed_one(
    micro_batch_size, reference, max_rel, at_rounding
):
    """1 device with 4 micro-batches (or reversed batches) vs without sets the bound: w moves from 2.0 by
    `reference`; the bias, 1e-16 moved by 1e-16, holds only rounding and does not count; each tensor may also differ
    by ROUNDING_FACTOR x how far the reference moved it. A reference above ROUNDING_CEILING leaves the fixed bound."""
    other = "1dev-acc4-fp64" if micro_batch_size else "1dev-reversed-fp64"
    runs = {
        "1dev-fp64": Weights([2.0, 0.5], 1e-16),
        "2dev-fp64": Weights([2.0, 0.5], 1e-16),
        other: Weights([2.0 + reference, 0.5], 2e-16),
    }
    bound = fp64_bound(runs, {"micro_batch_size": micro_batch_size})
    assert bound.max_rel == pytest.approx(max_rel, rel=1e-6)
    assert bound.at_rounding == pytest.approx(at_rounding, rel=1e-6)
    own = {"w": ROUNDING_FACTOR * reference, "bias": ROUNDING_FACTOR * 1e-16} if at_rounding else {}
    assert bound.own == pytest.approx(own, rel=1e-6)
    assert BOUNDS["cpu", "64-true"] == 1e-12 and ROUNDING_CEILING < 2e-6


F64 = functools.partial(torch.tensor, dtype=torch.float64)


def test_elements_without_gradient_are_left_out_and_each_tensor_has_its_own_reference(tmp_path):
    """A fused query-key-value bias whose key slice got no gradient (its peak 1e-20 of the model's largest) is judged
    on its query and value slices: the key slice's rounding, 1e-12 apart, passes; a difference in the query slice
    fails. A tensor that got no gradient at all passes as rounding; a tensor may differ by ROUNDING_FACTOR x how far
    the reference moved it, above the model's max_rel bound."""
    (tmp_path / "one" / "probe").mkdir(parents=True)
    (tmp_path / "two" / "probe").mkdir(parents=True)
    peaks = {"qkv.bias": F64([0.5, 0.4, 1e-21, 2e-21, 0.3, 0.2]), "k.bias": F64([1e-22]), "w": F64([1.0, 1.0])}
    top = max(t.max().item() for t in peaks.values())
    for run in ("one", "two"):  # what gradient_peaks.GradientPeaks writes of such peaks
        torch.save({n: t <= NO_GRADIENT_OF_TOP * top for n, t in peaks.items()}, tmp_path / run / "probe" / MASKS)

    class Run:
        def __init__(self, root, weights):
            self.root, self._weights = root, weights

        def weights(self):
            return self._weights

    one = {"qkv.bias": F64([0.1, 0.2, 1e-13, 0, 0.3, 0.4]), "k.bias": F64([1e-13]), "w": F64([2.0, 1.0])}
    reordered = {**one, "w": F64([2.0, 1.0 + 4e-13])}  # the model's rounding: max_rel 2e-13, w's own 4e-13
    runs = {
        "1dev-fp64": Run(tmp_path / "one", one),
        "2dev-fp64": Run(tmp_path / "two", one),
        "1dev-acc4-fp64": Run(tmp_path / "ref", reordered),
        "2dev-fp64-again": Run(tmp_path / "again", one),  # identical runs, bit-identical: no allowance
    }
    bound = fp64_bound(runs, {"micro_batch_size": 8})
    assert bound.no_gradient["qkv.bias"].tolist() == [False, False, True, True, False, False]
    assert bound.max_rel == 1e-12 and bound.own["w"] == pytest.approx(ROUNDING_FACTOR * 4e-13)
    key_rounding = {**one, "qkv.bias": F64([0.1, 0.2, 2e-12, -1e-12, 0.3, 0.4]), "k.bias": F64([3e-13])}
    assert_within(one, key_rounding, bound, "key slice")
    assert_within(one, {**one, "w": F64([2.0, 1.0 + 1.9e-12])}, bound, "w within 5 x its own reference")
    with pytest.raises(AssertionError, match=r"qkv.bias: max_abs 1e-09, .*OVER.*2 of 6 elements without gradient"):
        assert_within(one, {**one, "qkv.bias": F64([0.1 + 1e-9, 0.2, 0, 0, 0.3, 0.4])}, bound, "query slice")
    with pytest.raises(AssertionError, match=r"w: max_abs 2.1e-12"):
        assert_within(one, {**one, "w": F64([2.0, 1.0 + 2.1e-12])}, bound, "w over its own")
    verdicts = {v.diff.name: v for v in judge(one, key_rounding, bound)}
    assert verdicts["k.bias"].rounding.startswith("no gradient") and not verdicts["k.bias"].over


def test_a_float64_failure_at_rounding_scale_asks_how_far_identical_runs_end_apart():
    """Over the bound by no more than rounding (max_rel <= ROUNDING_CEILING), the check measures how far two identical
    runs end apart (`noise`) and allows ROUNDING_FACTOR x that per tensor; a larger difference fails at once, without
    starting that run; bit-identical runs add nothing."""
    one = {"w": F64([1.0, 2.0]), "b": F64([0.5])}
    asked = []

    def noise(per_tensor):
        return lambda: asked.append(1) or Noise(per_tensor, "2dev-fp64 run again: ...")

    apart = {**one, "w": F64([1.0, 2.0 + 4e-12])}  # max_rel 2e-12: over the fixed 1e-12
    assert_within(one, apart, Bound(1e-12, noise=noise({"w": 1e-12, "b": 0.0})), "noisy runs")
    assert asked == [1]
    with pytest.raises(AssertionError, match=r"run to run: 2dev-fp64 run again"):
        assert_within(one, apart, Bound(1e-12, noise=noise({"w": 0.0, "b": 0.0})), "bit-identical runs")
    with pytest.raises(AssertionError, match=r"w: max_abs 0.002"):
        assert_within(one, {**one, "w": F64([1.0, 2.002])}, Bound(1e-12, noise=lambda: pytest.fail("asked")), "bug")


def test_compare_command_passes_tensors_at_rounding_level_with_abs_tol(tmp_path, capsys):
    """`python -m ddpkit.parity A B --abs-tol X` leaves out tensors whose max_abs is at most X, and says which."""
    for run, bias in (("a", 1e-16), ("b", 3e-16)):  # a bias that holds only rounding: max_rel 2, max_abs 2e-16
        (tmp_path / run / "checkpoints").mkdir(parents=True)
        weights = {
            "w": torch.tensor([1.0, 2.0], dtype=torch.float64),
            "bias": torch.tensor([bias], dtype=torch.float64),
        }
        torch.save({"state_dict": weights}, tmp_path / run / "checkpoints" / "last.ckpt")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert compare_main([a, b, "--rel-tol", "1e-12"]) == 1
    assert compare_main([a, b, "--rel-tol", "1e-12", "--abs-tol", "1e-15"]) == 0
    out = capsys.readouterr().out
    assert "bias: max_abs 2e-16, max_rel 2 (at rounding level)" in out and "PASS: worst max_rel 0 " in out


def write_run(root: Path, tensorboard: dict[str, float] | None = None, csv: dict[str, float] | None = None) -> str:
    """A run folder as the parity command reads it: equal weights, and logged values at steps 0 and 1 (the second
    value given) in a TensorBoard file (stored as float32) and/or a metrics.csv (as written)."""
    (root / "checkpoints").mkdir(parents=True)
    torch.save({"state_dict": {"w": torch.tensor([1.0, 2.0], dtype=torch.float64)}}, root / "checkpoints" / "last.ckpt")
    if tensorboard:
        from torch.utils.tensorboard import SummaryWriter

        with SummaryWriter(str(root)) as writer:
            for tag, value in tensorboard.items():
                writer.add_scalar(tag, 1.0, 0)
                writer.add_scalar(tag, value, 1)
    if csv:
        rows = [f"{step},{value!r}" for step, value in ((0, 1.0), (1, next(iter(csv.values()))))]
        (root / "metrics.csv").write_text(f"step,{next(iter(csv))}\n" + "\n".join(rows) + "\n")
    return str(root)


def test_compare_command_judges_tensorboard_values_at_float32s_resolution(tmp_path, capsys):
    """TensorBoard stores float32: two float64 runs whose epoch loss is one float32 step apart (issue 43: 1.19e-7 at
    a value near 2) pass at --rel-tol 1e-12; a value 1e-4 apart fails. metrics.csv, when both runs have the tag
    there, is read instead, at full precision: 1e-10 apart fails at 1e-12; the output says where each came from."""
    step = 2.0 - 1.1920928955078125e-07  # the float32 just below 2
    one = write_run(tmp_path / "one", tensorboard={"train/loss_epoch": 2.0})
    two = write_run(tmp_path / "two", tensorboard={"train/loss_epoch": step})
    far = write_run(tmp_path / "far", tensorboard={"train/loss_epoch": 2.0001})
    assert compare_main([one, two, "--rel-tol", "1e-12"]) == 0
    assert "(0 from metrics.csv, 1 from TensorBoard; float32 values" in capsys.readouterr().out
    assert compare_main([one, far, "--rel-tol", "1e-12"]) == 1
    assert "train/loss_epoch: max_abs 9.99e-05, max_rel 4.99e-05 (OVER" in capsys.readouterr().out
    full = write_run(tmp_path / "full", tensorboard={"val/loss": 2.0}, csv={"val/loss": 1.5})
    near = write_run(tmp_path / "near", tensorboard={"val/loss": 2.0}, csv={"val/loss": 1.5 + 1e-10})
    assert compare_main([full, near, "--rel-tol", "1e-12"]) == 1
    assert "(1 from metrics.csv, 0 from TensorBoard;" in capsys.readouterr().out


def test_compare_command_ends_runs_that_cannot_be_compared_with_one_error_line(tmp_path, capsys):
    """Runs whose logged tags differ, or a folder without the checkpoint, end in one `error:` line and exit 2, not a
    traceback."""
    one = write_run(tmp_path / "one", tensorboard={"train_loss": 2.0, "val_loss": 1.0})
    other = write_run(tmp_path / "other", tensorboard={"train/loss": 2.0})
    assert compare_main([one, other]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: the runs logged different tags: only in a ['train_loss'")
    assert compare_main([one, str(tmp_path / "nothing")]) == 2
    assert (
        capsys.readouterr().err
        == f"error: {tmp_path / 'nothing'} is not a directory (a run's lightning_logs/version_N)\n"
    )


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ({"noise_std": 0.1, "width": 8}, "PARITY_ARGS='--model.noise_std 0'"),
        ({"dropout": 0.1, "use_noise": True}, "PARITY_ARGS='--model.dropout 0 --model.use_noise false'"),
        ({"noise": "data", "dropout": 0.0}, "set --model.noise (now 'data') to the value that draws nothing"),
        ({"width": 8, "drop_path": 0.0}, "none of the model's arguments is a dropout, noise, masking or mixing rate"),
        ({"mixup_alpha": 0.4, "cutmix_alpha": 0.0}, "PARITY_ARGS='--model.mixup_alpha 0'"),
        # Hugging Face's speech models mask time steps at random in forward (SpecAugment), by a probability.
        ({"layerdrop": 0.1, "mask_time_prob": 0.05, "mask_time_length": 10}, "layerdrop 0 --model.mask_time_prob 0'"),
        ({"stochastic_depth_prob": 0.2, "apply_spec_augment": True}, "prob 0 --model.apply_spec_augment false'"),
        ({"mask_ratio": 0.75}, "none of the model's arguments"),  # MAE's: 0 leaves its loss no patch to be over
        ({"problem_type": "regression"}, "none of the model's arguments"),  # Hugging Face's, not a probability
    ],
)
def test_random_step_message_names_the_real_switch(given, says):
    """The random-step failure names each rate-like argument that is on with the value that turns it off (0 for a
    number, false for a bool), names a string switch with its value, and says when no such argument is on: never
    a `--model.<its rate> 0` placeholder."""
    message = switch_off(given)
    assert says in message and "<its rate>" not in message


def test_remove_checkpoints_counts_each_file_once_and_keeps_the_logs(tmp_path):
    """Checkpoints (files and sharded folders) and weights files go, logs and records stay; a hard-linked checkpoint
    counts once; delete=False only counts."""
    run = tmp_path / "run" / "lightning_logs" / "version_0"
    (run / "checkpoints" / "sharded.ckpt").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"x" * 100)
    (run / "checkpoints" / "sharded.ckpt" / "__0_0.distcp").write_bytes(b"x" * 30)
    (run / "metrics.csv").write_text("step\n")
    (tmp_path / "run" / "probe").mkdir()
    (tmp_path / "run" / "probe" / "fit-rank0.pt").write_bytes(b"x" * 7)
    (tmp_path / "run" / "probe" / "fit-rank0.json").write_text("{}")
    (tmp_path / "copy").mkdir()
    os.link(run / "checkpoints" / "last.ckpt", tmp_path / "copy" / "last.ckpt")
    assert remove_checkpoints(tmp_path, delete=False) == (3, 137)
    assert remove_checkpoints(tmp_path) == (3, 137)
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert left == ["run/lightning_logs/version_0/metrics.csv", "run/probe/fit-rank0.json"]


def test_a_runs_checkpoints_go_once_no_later_test_reads_it_nor_a_run_that_starts_from_them(tmp_path):
    """Footprint.release after a test, given what the later tests read: a run no one reads loses its checkpoints (its
    logs stay); the 1-device float64 run keeps them while a one-step run reads it (its nudged second look starts from
    them) and both first-wave runs while a run of FROM_FIRST has not run (it starts from them), as does the folder that
    run shares with a finished one (the evaluations' copy). Of a run still read: the one-step states go with the last
    one-step reader, the resume's state (one of them) once resume-1to2 and `continue` have run too; the 2-device resume
    state once resume-2to1 and its checks (MID_CHECKPOINT) are done; a precision's one-step records with its check
    (STEP_RECORDS), the float64 run's with both. Nothing goes when a later test declares nothing. The footprint counts
    each file once, a hard link too, and the most bytes at once."""
    runs, footprint = Waves(tmp_path, []), Footprint()
    steps = {"one_to_two": 5, "two_to_one": 3, "step_points": [1, 4, 5], "steps_per_batch": 1, "steps_per_epoch": 4}
    steps["manual_optimization"] = True  # no state kept as weights alone (the next test)
    folders = {"1dev-fp64": "1dev-fp64", "2dev-fp64": "2dev-fp64", "torchrun-fp64": "torchrun-fp64",
               "validate-1dev": "eval", "slurm-requeue": "slurm"}  # fmt: skip
    for name, folder in folders.items():
        checkpoints = tmp_path / folder / "lightning_logs" / "version_0" / "checkpoints"
        checkpoints.mkdir(parents=True, exist_ok=True)
        if name != "validate-1dev":
            torch.save({"state_dict": {"w": torch.zeros(4, dtype=torch.float64)}}, checkpoints / "last.ckpt")
        (checkpoints.parent / "metrics.csv").write_text("step\n")
        runs.done[name] = Run(tmp_path / folder, tmp_path / f"{name}.log")
    os.link(tmp_path / "1dev-fp64/lightning_logs/version_0/checkpoints/last.ckpt", tmp_path / "eval/last.ckpt")
    one_file = (tmp_path / "eval/last.ckpt").stat().st_size
    for step in ("step-1dev-fp32", "step-1dev-bf16", "step-1dev-fp64"):  # a one-step run: its record and its logs
        (tmp_path / step / "probe").mkdir(parents=True)
        (tmp_path / step / "probe" / "onestep.pt").write_bytes(b"x" * 10)
        (tmp_path / step / "probe" / "onestep-rank0.json").write_text("{}")
        runs.done[step] = Run(tmp_path / step, tmp_path / f"{step}.log")
    for state in ("1dev-fp64/probe/step1.ckpt", "1dev-fp64/probe/step4.ckpt", "1dev-fp64/probe/step5.ckpt",
                  "2dev-fp64/probe/step3.ckpt"):  # fmt: skip
        (tmp_path / state).parent.mkdir(exist_ok=True)
        (tmp_path / state).write_bytes(b"x" * 10)

    def kept() -> list[str]:  # the checkpoints left, by folder (a run's last.ckpt) or name (a state)
        named = lambda p: p.parent.name == "probe"  # noqa: E731
        return sorted(p.name if named(p) else p.relative_to(tmp_path).parts[0] for p in tmp_path.rglob("*.ckpt"))

    def records() -> list[str]:
        return sorted(p.parent.parent.name for p in tmp_path.rglob("onestep.pt"))

    states = ["step1.ckpt", "step3.ckpt", "step4.ckpt", "step5.ckpt"]
    assert stored_bytes({"w": (tied := torch.zeros(4, dtype=torch.float64)), "out.w": tied, "b": torch.zeros(2)}) == 40
    assert footprint.release(runs, None, steps) == [] and len(kept()) == 9 and len(records()) == 3
    step_checks = {STEP_RECORDS.format(precision=p) for p in ("fp32", "bf16")}
    later = {"step-1dev-fp32", "step-1dev-bf16", "step-1dev-fp64", "test-1dev", "resume-2to1"}
    assert footprint.release(runs, later | step_checks, steps) == ["slurm", "torchrun-fp64"]
    assert footprint.peak == 4 * one_file + 70 and footprint.model_bytes == 32  # the link counted once
    assert kept() == ["1dev-fp64", "2dev-fp64", "eval", *states]
    assert records() == ["step-1dev-bf16", "step-1dev-fp32", "step-1dev-fp64"]
    later |= {STEP_RECORDS.format(precision="bf16")}  # float32's check has run
    assert footprint.release(runs, later, steps) == [] and records() == ["step-1dev-bf16", "step-1dev-fp64"]
    assert kept() == ["1dev-fp64", "2dev-fp64", "eval", *states]
    runs.done |= {"test-1dev": Run(tmp_path / "eval", tmp_path / "t.log"), "resume-2to1": Run(tmp_path / "r", tmp_path)}
    runs.done["resume-1to2"] = Run(tmp_path / "r12", tmp_path)
    later = {"step-1dev-fp32", "2dev-fp64", MID_CHECKPOINT, "resume-1to2"}
    freed = ["eval", "resume-2to1", "step-1dev-bf16", "step-1dev-fp64"]
    assert footprint.release(runs, later, steps) == freed
    assert kept() == ["1dev-fp64", "2dev-fp64", *states] and records() == []
    runs.done["continue"] = Run(tmp_path / "continue", tmp_path)  # from a copy holding the resume state as last.ckpt
    freed = ["2dev-fp64", "resume-1to2", "step-1dev-fp32"]
    assert footprint.release(runs, {"1dev-fp64", "continue"}, steps) == freed and kept() == ["1dev-fp64", "step5.ckpt"]
    assert footprint.release(runs, {"1dev-fp64"}, steps) == ["continue"] and kept() == ["1dev-fp64"]
    assert footprint.release(runs, set(), steps) == ["1dev-fp64"] and kept() == []
    assert footprint.written() == (11, 4 * one_file + 70) and footprint.peak == 4 * one_file + 70
    assert len(list(tmp_path.rglob("metrics.csv"))) == 5 and len(list(tmp_path.rglob("onestep-rank0.json"))) == 3


@pytest.mark.parametrize("steps_per_batch", [1, 2])
def test_a_complete_state_keeps_its_weights_alone_once_no_run_resumes_from_it(tmp_path, steps_per_batch):
    """Footprint.release saves the 1-device float64 run's resume state again without the optimizer's state, its weights
    in float32, once resume-1to2 and `continue` (from a copy holding it as last.ckpt, a hard link that keeps the
    complete file) have run, while it is still a one-step state, unless a global batch takes several optimizer steps
    (then the one-step runs load the optimizer's state); and its best checkpoint with its epoch and step alone once
    neither evaluation that loads it is left (test-1dev, test-2dev). Mutations: stripping before `continue` or
    resume-1to2 has run, or with 2 steps a batch, or the best before test-2dev has run, fail here."""
    runs, footprint = Waves(tmp_path, []), Footprint()
    steps = {"one_to_two": 5, "two_to_one": 3, "step_points": [1, 4, 5], "steps_per_epoch": 4}
    steps |= {"steps_per_batch": steps_per_batch, "manual_optimization": False}
    one = runs.done["1dev-fp64"] = Run(tmp_path / "1dev-fp64", tmp_path / "1dev.log")
    loops = {"epoch": 1, "global_step": 5 * steps_per_batch}
    weights = {"state_dict": {"w": torch.arange(4, dtype=torch.float64)}, **loops}
    resume, best = one.mid_checkpoint(5 * steps_per_batch), one.checkpoint().with_name("best-epoch01-step8.ckpt")
    for path, state in ((resume, {**weights, "optimizer_states": [{"m": torch.ones(4)}], "lr_schedulers": [{}]}),
                        (best, weights), (one.checkpoint(), weights)):  # fmt: skip
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path)
    os.link(resume, tmp_path / "copy.ckpt")

    def keys() -> list[list[str]]:
        return [sorted(torch.load(p, weights_only=False)) for p in (resume, tmp_path / "copy.ckpt", best)]

    light = ["epoch", "global_step", "state_dict"]
    full, name = sorted([*light, "lr_schedulers", "optimizer_states"]), sorted([*light[:2], NAME_ONLY])
    footprint.release(runs, {"1dev-fp64", "resume-1to2", "test-2dev", "step-1dev-fp32"}, steps)
    assert keys() == [full, full, light]
    footprint.release(runs, {"1dev-fp64", "continue", "step-1dev-fp32"}, steps)
    assert keys() == [full, full, name]
    footprint.release(runs, {"1dev-fp64", "step-1dev-fp32"}, steps)
    assert keys() == [light if steps_per_batch == 1 else full, full, name]
    assert torch.load(resume, weights_only=True)["state_dict"]["w"].tolist() == [0, 1, 2, 3]
    # A one-step state in float32 (slim.one_step_state; mutation: without_resume_state alone), the copy untouched.
    single = torch.float32 if steps_per_batch == 1 else torch.float64
    assert torch.load(resume, weights_only=True)["state_dict"]["w"].dtype == single
    assert torch.load(tmp_path / "copy.ckpt", weights_only=True)["state_dict"]["w"].dtype == torch.float64
    assert torch.load(best, weights_only=True)["global_step"] == 5 * steps_per_batch
    assert sorted(torch.load(one.checkpoint(), weights_only=False)) == light  # the weights the checks compare
    assert not list(tmp_path.rglob("*.part"))


def test_a_failed_run_fails_only_the_tests_that_read_it():
    """In a wave one run fails: its error (its first `error:` line first) is what reading it raises, the wave's other
    runs are there, and a later wave's run that starts from it fails with that error while its other runs do not."""

    def failing() -> None:
        raise AssertionError("run bad exited 1: error: rank 1 failed: boom")

    def second(runs: Waves) -> dict:
        try:
            start = runs["bad"]
            jobs = {"from-bad": lambda: start}
        except AssertionError as error:
            jobs = {"from-bad": failed(error)}
        return jobs | {"from-good": lambda: runs["good"] + 1}

    runs = Waves(Path("."), [Wave(("good", "bad"), lambda runs: {"good": lambda: 1, "bad": failing}),
                             Wave(("from-bad", "from-good"), second)])  # fmt: skip
    with pytest.raises(AssertionError, match="^run bad exited 1: error: rank 1 failed: boom$"):
        runs["bad"]
    assert runs["good"] == 1 and runs["from-good"] == 2
    with pytest.raises(AssertionError, match="^starts from a run that failed: run bad exited 1"):
        runs["from-bad"]


def test_a_run_starts_with_the_runs_of_its_wave_the_selected_tests_read():
    """Asking for a run starts it with the runs of its wave the session's tests declared (`want`), not the whole
    wave; a run of a later wave that reads an earlier one starts that one first; a run asked for later starts then."""
    started: list[str] = []

    def job(name: str):
        return lambda: started.append(name) or name

    first = Wave(("a1", "a2", "a3"), lambda runs: {n: job(n) for n in ("a1", "a2", "a3")})

    def second_jobs(runs: Waves) -> dict:
        runs["a1"]  # the jobs start from it, as the one-step runs from the 1-device float64 run's states
        return {"b1": job("b1"), "b2": job("b2")}

    second = Wave(("b1", "b2"), second_jobs)
    runs = Waves(Path("."), [first, second])
    runs.want({"a1", "b2"})
    runs["b2"]
    assert started == ["a1", "b2"] and runs.started == ["a1", "b2"]
    assert runs["a2"] == "a2" and started == ["a1", "b2", "a2"]  # not declared: started when asked for, alone
    everything = Waves(Path("."), [Wave(("c1", "c2"), lambda runs: {"c1": job("c1"), "c2": job("c2")})])
    everything["c1"]  # nothing declared: the whole wave
    assert everything.started == ["c1", "c2"]


def test_the_footprint_counts_a_file_a_run_deletes_as_it_starts(tmp_path):
    """The plugin's Footprint measures before each wave's runs start (Waves.before_start), so that a state a run
    deletes once restored (resume-2to1's `consume`) is counted at its most: here a 10-byte state beside 4 bytes,
    then deleted by the next wave's run as it writes 2 (mutation: no measure before a wave starts: 6 at most)."""

    def write(name: str, size: int, delete: str = ""):
        def job():
            (tmp_path / delete).unlink() if delete else None
            (tmp_path / name).write_bytes(b"x" * size)
            return name

        return job

    first = Wave(("a", "b"), lambda runs: {"a": write("a.ckpt", 10), "b": write("b.ckpt", 4)})
    second = Wave(("c",), lambda runs: {"c": write("c.ckpt", 2, delete="a.ckpt")})
    runs, footprint = Waves(tmp_path, [first, second]), Footprint()
    runs.before_start = footprint.measure
    assert runs["a"] == "a.ckpt" and runs["c"] == "c.ckpt"
    footprint.measure(runs)
    assert footprint.peak == 14 and footprint.written() == (3, 16)


def test_every_guarantee_that_reads_runs_declares_them():
    """Each test of the suite that reads the shared runs declares which (runs.reads), so that selecting it starts
    those alone; the schedule's test, selected alone, reads its 2 runs and the first wave's 3, not the 14 of every
    wave it used to start."""
    from ddpkit.testing import guarantees

    class Item:
        def __init__(self, function, params=None):
            self.function, self.fixturenames = function, list(inspect.signature(function).parameters)
            self.callspec = type("CallSpec", (), {"params": params or {}})()

    checks = [getattr(guarantees, name) for name in guarantees.__all__]
    undeclared = [
        c.__name__ for c in checks if "cpu_runs" in inspect.signature(c).parameters and not hasattr(c, "ddpkit_reads")
    ]
    assert not undeclared
    steps = plan({"steps_per_epoch": 4, "global_batch_size": 32, "takes_micro_batch_size": True, "stages": []})
    schedule = Item(guarantees.test_lr_schedule_is_the_same_on_1_and_2_devices)
    assert runs_read([schedule], steps) == {"1dev-lr-fp64", "2dev-lr-fp64", "1dev-fp64", "2dev-fp64", FP64_BOUND}
    accumulation = Item(guarantees.test_gradient_accumulation_keeps_the_global_batch, {"run": "2dev-acc2-fp64"})
    eval_test = Item(guarantees.test_eval_metrics_count_each_sample_once, {"stage": "test"})
    assert runs_read([accumulation, eval_test], steps) == {
        "2dev-acc2-fp64", "1dev-fp64", "2dev-fp64", FP64_BOUND, "test-1dev", "test-2dev"
    }  # fmt: skip
    assert runs_read([Item(lambda cpu_runs: None)], steps) is None  # undeclared: whole waves


def step(
    grad: list[float], before: list[float], after: list[float], loss: float, bias_grad: float = 0.0, mean=(0.1, 0.2)
) -> dict:
    """One one-step record: a weight `w` (float32, as in float32 and bf16-mixed runs; float64 for the exact step is
    the same numbers), a `bias` that gets no gradient, a buffer `running_mean` (0 before the step, `mean` after) and
    the logged loss."""
    f32 = functools.partial(torch.tensor, dtype=torch.float32)
    return {
        "before": {"w": f32(before), "bias": f32([0.0]), "running_mean": f32([0.0, 0.0])},
        "grads": [{"w": f32(grad), "bias": f32([bias_grad])}],
        "after": {"w": f32(after), "bias": f32([bias_grad]), "running_mean": f32(mean)},
        "logged": {"train/loss": loss},
    }


NO_GRADIENT = {"bias": torch.tensor([True]), "w": torch.tensor([False, False, False])}


def test_one_step_bounds_come_from_the_exact_step_at_least_one_unit_of_the_precision():
    """2 devices' gradient is judged against how far 1 device's is from the float64 step's (at least bf16's eps x its
    norm): bf16's own rounding passes, half the gradient (a summed loss) fails; a tensor without gradient in float64
    is rounding; a logged value is allowed at least one unit of the precision of itself, and fails past it; the
    first step, from each run's own initialization, is not judged."""
    exact = {k: step([1.0, 0.5, 1e-6], [0.0] * 3, [-1e-3, -1e-3, -1e-3], 2.0) for k in (0, 1)}
    one = {k: step([1.0, 0.5, 2e-6], [0.0] * 3, [-1e-3, -1e-3, -1e-3], 2.0, bias_grad=1e-9) for k in (0, 1)}
    rounded = {
        k: step([1.0 + 2**-8, 0.5, -2e-6], [0.0] * 3, [-1e-3, -1e-3, 1e-3], 2.0, bias_grad=-3e-9) for k in (0, 1)
    }
    halved = {k: step([0.5, 0.25, 1e-6], [0.0] * 3, [-1e-3, -1e-3, -1e-3], 2.0) for k in (0, 1)}

    def verdicts(two, precision="bf16"):
        judged = step_verdicts(one, two, exact, precision, NO_GRADIENT)
        assert {k for k, _, _ in judged} == {1}
        return {(what, v.name): v for _, what, v in judged}

    passed = verdicts(rounded)
    assert not any(v.over for v in passed.values())
    bf16 = torch.finfo(torch.bfloat16).eps
    assert passed["gradient", "w"].bound == pytest.approx(ONE_STEP_FACTOR * bf16 * (1 + 0.25 + 4e-12) ** 0.5)
    assert passed["gradient", "bias"].rounding == "no gradient in float64"
    assert verdicts(halved)["gradient", "w"].over and verdicts(rounded, "fp32")["gradient", "w"].over
    # A logged value: 1 device's distance from float64 (here 0) is one draw of its rounding, not its scale.
    assert passed["logged", "train/loss"].bound == pytest.approx(ONE_STEP_FACTOR * bf16 * 2.0)
    for precision, near, far in (("bf16", 2.1, 2.5), ("fp32", 2.0 + 4e-7, 2.01)):
        logged = {v: verdicts({1: {**rounded[1], "logged": {"train/loss": v}}}, precision) for v in (near, far)}
        assert not logged[near]["logged", "train/loss"].over and logged[far]["logged", "train/loss"].over, precision


def test_after_the_step_buffers_are_judged_and_trained_weights_are_not():
    """The buffers a step writes (BatchNorm's running statistics) are judged against the rounding of their change
    (float64's against this precision's, at least one unit of it); a trained weight is not judged after the step
    (the shared optimizer state's function of the judged gradient: AdamW can turn a gradient's rounding into any
    size of update), so 2 devices' weight half an update away passes, and a buffer as far fails."""
    exact, one = ({k: step([1.0, 0.5, 0.05], [0.0] * 3, [-1e-3] * 3, 2.0) for k in (0, 1)} for _ in range(2))

    def after(w: list[float], mean: tuple[float, float]) -> dict:
        two = {k: step([1.0, 0.5, 0.05], [0.0] * 3, w, 2.0, mean=mean) for k in (0, 1)}
        return {v.name: v for _, what, v in step_verdicts(one, two, exact, "bf16", NO_GRADIENT) if what == "after"}

    near = after([-1e-3, -1e-3, -0.5e-3], (0.1, 0.21))
    assert set(near) == {"running_mean"} and not near["running_mean"].over
    bf16 = torch.finfo(torch.bfloat16).eps
    assert near["running_mean"].bound == pytest.approx(ONE_STEP_FACTOR * bf16 * (0.1**2 + 0.2**2) ** 0.5, rel=1e-6)
    assert after([-1e-3] * 3, (0.1, 0.25))["running_mean"].over


def test_a_slim_record_is_judged_by_its_untrained_tensors_and_the_digests_of_its_start():
    """A record keeps whole only the tensors its step gave no gradient (parity_probe.OneStep): one that 2 devices
    trained and 1 device did not is over (no after-step value to compare); two starts are the same when every
    tensor's digest is, a record without digests falls back on its "before" tensors."""
    w = torch.tensor([1.0, 2.0])
    one = {1: {"before": {"w": w}, "grads": [{}], "after": {"w": w}, "logged": {}, "started_from": digests({"w": w})}}
    two = {1: {"before": {}, "grads": [{"w": w}], "after": {}, "logged": {}, "started_from": digests({"w": w})}}
    (verdict,) = [v for _, what, v in step_verdicts(one, two, one, "fp32") if what == "after"]
    assert verdict.over and verdict.note == "trained on 2 devices alone"
    assert different_starts(one[1], two[1]) == []
    assert different_starts(one[1], {**two[1], "started_from": digests({"w": w + 2**-20})}) == ["w"]
    assert different_starts({"before": {"w": w}}, {"before": {"w": w.clone()}}) == []
    assert different_starts({"before": {"w": w}}, {"before": {"w": -w}}) == ["w"]


def test_a_tensor_over_its_one_step_bound_fails_only_if_over_again_from_the_nudged_states():
    """The one-step check's second look (over_twice): nothing over, the nudged runs are not asked for; a tensor over
    its bound in the first look and within it from the nudged states (a ReLU's kink drawn again) passes; over in
    both looks (a bug) fails, and one over only at another global batch or tensor in the second look passes."""

    def v(name: str, apart: float) -> StepVerdict:
        return StepVerdict(name, apart, apart, 1.0)

    first = [(1, "gradient", v("w", 40.0)), (1, "gradient", v("b", 0.5)), (4, "gradient", v("w", 0.5))]
    asked = []

    def again(*second):
        return lambda: asked.append(1) or list(second)

    assert over_twice([(1, "gradient", v("w", 0.5))], again()) == ([], []) and not asked
    kink, second = over_twice(first, again((1, "gradient", v("w", 0.9)), (1, "gradient", v("b", 0.5))))
    assert kink == [] and len(second) == 2 and asked == [1]
    bug, _ = over_twice(first, again((1, "gradient", v("w", 30.0))))
    assert [(k, what, x.name) for k, what, x in bug] == [(1, "gradient", "w")]
    elsewhere = again((4, "gradient", v("w", 30.0)), (1, "gradient", v("b", 30.0)), (1, "after", v("w", 30.0)))
    assert over_twice(first, elsewhere)[0] == []


def test_nudged_states_move_each_weight_by_the_nudge_alike_in_every_run():
    """A nudged state: each weight (not a buffer) x (1 + nudge) or (1 - nudge), both signs drawn, in the stored
    float64; the same pattern for the same global batch in every run (so 1 and 2 devices and float64 start from the
    same numbers), another for another global batch; nudge 0 is the state itself."""
    g = torch.Generator().manual_seed(0)
    state = {
        "w": torch.randn(64, 8, generator=g, dtype=torch.float64),
        "running_mean": torch.ones(8, dtype=torch.float64),
    }
    a, b, c = nudged(state, {"w"}, 1e-4, 1), nudged(state, {"w"}, 1e-4, 1), nudged(state, {"w"}, 1e-4, 4)
    ratio = a["w"] / state["w"] - 1
    assert torch.allclose(ratio.abs(), torch.full_like(ratio, 1e-4), rtol=1e-9, atol=0)
    assert (ratio > 0).any() and (ratio < 0).any()
    assert torch.equal(a["w"], b["w"]) and not torch.equal(a["w"], c["w"])
    assert a["running_mean"] is state["running_mean"] and nudged(state, {"w"}, 0.0, 1) is state


def test_a_run_whose_port_was_taken_starts_again(tmp_path):
    """A run that exits on EADDRINUSE (another run took its port) starts again in its folder, cleared of what the
    try wrote; a run that fails otherwise is reported at once."""
    tries = tmp_path / "tries"
    script = (
        "import pathlib, sys; t = pathlib.Path(sys.argv[1]); n = len(t.read_text()) if t.exists() else 0; "
        "t.write_text('x' * (n + 1)); pathlib.Path(sys.argv[4], f'try{n}').touch(); "
        "print('EADDRINUSE' if n < int(sys.argv[2]) else 'trained'); sys.exit(1 if n < int(sys.argv[2]) else 0)"
    )
    (tmp_path / "run").mkdir()
    job = command([sys.executable, "-c", script, str(tries), "1"], tmp_path / "run", tmp_path / "run.log")
    assert job().root == tmp_path / "run" and len(tries.read_text()) == 2
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["try1"]  # the first try's file cleared
    other = command(
        [sys.executable, "-c", "import sys; print('error: no'); sys.exit(2)"], tmp_path / "o", tmp_path / "o.log"
    )
    with pytest.raises(AssertionError, match="^run o exited 2: error: no"):
        other()


@pytest.mark.parametrize("kind", ["slurm", "torchrun"])
def test_a_cluster_job_whose_port_was_taken_starts_again_in_a_clean_folder(tmp_path, monkeypatch, kind):
    """A SLURM or torchrun-nodes job that failed on EADDRINUSE (another run took the free port it was given: CI of
    2026-12-08, the oldest releases' SLURM job) starts again in a clean folder, at most PORT_RETRIES times more; a
    job that fails otherwise is returned at once. The job itself is a stand-in here: the retries are what is tested
    (the real jobs run in every suite session). Mutation: no retry (the first job's failure is returned)."""
    tries: list[list[str]] = []

    def job(folder: Path, outputs: list[str], code: int):
        tries.append(sorted(p.name for p in folder.iterdir()) if folder.exists() else [])
        folder.mkdir()
        (folder / f"try{len(tries)}").touch()
        if kind == "slurm":
            return fake_cluster.SlurmJob(folder, [code], outputs, [], "")
        return fake_cluster.ClusterRun(folder, [code, code], outputs)

    def run(outputs_by_try: list[str]):
        tries.clear()
        codes = iter([1] * (len(outputs_by_try) - 1) + [0])
        texts = iter(outputs_by_try)
        if kind == "slurm":
            monkeypatch.setattr(
                fake_cluster, "_slurm_requeue_job", lambda tmp, *_: job(tmp, [next(texts)], next(codes))
            )
            return fake_cluster.slurm_requeue_job(tmp_path / "job", [], 4)
        monkeypatch.setattr(fake_cluster, "_torchrun_nodes_job", lambda root, _: job(root, [next(texts)], next(codes)))
        return fake_cluster.torchrun_nodes_job(tmp_path / "job", [])

    taken = "RuntimeError: The server socket has failed to listen ... EADDRINUSE, message: address already in use"
    result = run([taken, taken, "trained"])
    assert result.codes[0] == 0 and tries == [[], [], []]  # 3 tries, each in an empty folder
    shutil.rmtree(tmp_path / "job")
    result = run(["error: rank 0 failed: ValueError: no", "trained"])
    assert result.codes[0] == 1 and len(tries) == 1


def test_evaluation_runs_only_for_the_stages_with_a_step_and_a_set():
    """validate, test and predict run for a stage the module defines a step for and the data module a set for."""
    sizes = {"train_size": 64, "global_batch_size": 32, "steps_per_epoch": 2, "takes_micro_batch_size": True}
    configured = sizes | {"stages": ["validate", "test", "predict"], "val_size": 8, "test_size": 8, "predict_size": 0}
    assert evaluation_runs(plan(configured)) == ["validate-1dev", "test-1dev", "test-2dev"]
    configured |= {"stages": ["validate"], "predict_size": 8}
    assert evaluation_runs(plan(configured)) == ["validate-1dev"]


def test_logged_values_bound_leaves_out_what_the_reference_logs_as_another_quantity():
    """The digits example's shape: the accumulation reference logs each step's train/loss of its last micro-batch
    (7.9% apart) and moves val/loss by rounding (1e-7). The bound is 5 x that rounding, not 5 x 7.9% (0.395, which
    passed an unsynchronised val/acc 3.1% off on 2 devices): that val/acc now fails, the rounding-level run passes."""
    one = {"train/loss": {9: 1.0, 19: 0.5}, "val/loss": {15: 0.4, 31: 0.2}, "val/acc": {15: 0.9, 31: 0.95}}
    reference = one | {"train/loss": {9: 1.079, 19: 0.5}, "val/loss": {15: 0.4 * (1 + 1e-7), 31: 0.2}}
    bound = logged_bound(one, reference, "1dev-acc4-fp64 vs 1dev-fp64")
    assert bound.max_rel == pytest.approx(ROUNDING_FACTOR * 1e-7) and "left out: train/loss" in bound.why
    unsynced = one | {"val/acc": {15: 0.9, 31: 0.95 * 1.031}}
    assert [d.name for d in over_bound(scalar_diffs(one, unsynced), bound.max_rel)] == ["val/acc"]
    rounded = one | {"train/loss": {9: 1.0 * (1 + 2e-7), 19: 0.5}, "val/loss": {15: 0.4 * (1 - 3e-7), 31: 0.2}}
    assert over_bound(scalar_diffs(one, rounded), bound.max_rel) == []


def test_suite_runs_take_slots_that_a_killed_holder_frees(tmp_path):
    """With 2 slots: two holders take slots 0 and 1, a third waits until one of them is done and then gets its slot;
    a process that holds a slot and is killed (-9) frees it, with nothing to clean up."""
    import threading
    import time

    from ddpkit.testing.slots import run_slot

    folder, taken, release = tmp_path / "slots", [], threading.Event()

    def hold() -> None:
        with run_slot(folder, 2) as (number,):
            taken.append(number)
            release.wait(60)

    holders = [threading.Thread(target=hold) for _ in range(2)]
    for thread in holders:
        thread.start()
    deadline = time.monotonic() + 60
    while len(taken) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    third = threading.Thread(target=hold)
    third.start()
    third.join(1.0)
    assert sorted(taken) == [0, 1] and third.is_alive()  # waiting: both slots held
    release.set()
    for thread in [*holders, third]:
        thread.join(60)
    assert len(taken) == 3 and taken[2] in (0, 1)
    code = "import sys, time; from pathlib import Path; from ddpkit.testing.slots import run_slot\n"
    code += "with run_slot(Path(sys.argv[1]), 1) as (n,): print(n, flush=True); time.sleep(600)\n"
    holder = subprocess.Popen([sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "0"

        def take() -> None:
            with run_slot(folder, 1) as (number,):
                taken.append(number)

        waiting = threading.Thread(target=take)
        waiting.start()
        waiting.join(1.0)
        assert waiting.is_alive()  # the process holds the only slot
        holder.kill()
        waiting.join(30)
        assert not waiting.is_alive() and taken[-1] == 0
    finally:
        holder.kill()


def test_a_run_of_two_processes_takes_two_slots_at_once_or_none(tmp_path):
    """With 3 slots, a run of 1 process holds one: a run of 2 takes the other 2 together; a second run of 2 waits,
    holding none (a run of 1 still gets a freed slot meanwhile), until 2 are free; a run of more processes than there
    are slots takes them all. Mutations: one slot a run, or slots taken one by one as they free (two runs of 2 each
    holding one on 2 slots wait for each other), fail here."""
    import threading

    from ddpkit.testing.slots import run_slot

    folder, events = tmp_path / "slots", []

    def hold(name: str, processes: int, started: threading.Event, done: threading.Event) -> None:
        with run_slot(folder, 3, processes) as numbers:
            events.append((name, len(numbers)))
            started.set()
            done.wait(60)

    flags = {name: (threading.Event(), threading.Event()) for name in ("one", "two", "again", "single")}
    threads = {name: threading.Thread(target=hold, args=(name, 1 if name in ("one", "single") else 2, *flags[name]))
               for name in flags}  # fmt: skip
    for name in ("one", "two"):
        threads[name].start()
        assert flags[name][0].wait(30)
    threads["again"].start()
    assert not flags["again"][0].wait(0.5)  # 1 slot free, 2 needed
    flags["one"][1].set()
    threads["one"].join(30)
    assert not flags["again"][0].wait(0.5)  # still 1 free: it holds none, so the run of 1 below takes it
    threads["single"].start()
    assert flags["single"][0].wait(30) and not flags["again"][0].is_set()
    flags["two"][1].set()
    assert flags["again"][0].wait(30)
    for name in ("again", "single"):
        flags[name][1].set()
    for thread in threads.values():
        thread.join(30)
    assert events == [("one", 1), ("two", 2), ("single", 1), ("again", 2)]
    with run_slot(folder, 3, 5) as numbers:
        assert numbers == [0, 1, 2]


def test_suite_runs_at_once_default_to_four_processes_a_core_and_a_bad_count_is_refused():
    """DDPKIT_SUITE_RUNS gives the number of slots (processes); unset, 4 x the visible cores (at least 4); anything but
    a whole number >= 1 is refused with the variable named."""
    from ddpkit.scaling.ranks import visible_cores
    from ddpkit.testing.slots import limit

    assert limit({}) == max(4, 4 * visible_cores()) and limit({"DDPKIT_SUITE_RUNS": "3"}) == 3
    for bad in ("0", "two", "-1", "1.5"):
        with pytest.raises(ValueError, match="DDPKIT_SUITE_RUNS="):
            limit({"DDPKIT_SUITE_RUNS": bad})


def test_a_waves_runs_wait_for_the_machines_slots(tmp_path, monkeypatch):
    """The runs a wave starts together each hold a slot per process while they run: with 1 slot, 6 runs of one wave
    run one at a time, all 6, in the wave's order (resume-2to1 deletes its state before the 1-device run can write
    its own: waves.py; mutation: submitting them all at once, whose order is the lock's); with 2 slots, the 2 runs of
    1 process run together, and the run of 2 alone."""
    import threading
    import time

    from ddpkit.testing import slots

    monkeypatch.setattr(slots, "folder", lambda: tmp_path / "slots")
    monkeypatch.setattr(slots, "limit", lambda: 1)
    lock, running, most, order = threading.Lock(), [0], [0], []

    def job(name: str, seconds: float = 0.2):
        def run() -> str:
            with lock:
                order.append(name)
                running[0] += 1
                most[0] = max(most[0], running[0])
            time.sleep(seconds)
            with lock:
                running[0] -= 1
            return name

        return run

    runs = Waves(Path("."), [Wave(tuple("abcdef"), lambda runs: {n: job(n, 0.15) for n in "abcdef"})])
    assert [runs[n] for n in "abcdef"] == list("abcdef") and most[0] == 1 and order == list("abcdef")
    monkeypatch.setattr(slots, "limit", lambda: 2)
    alone, most[0] = [], 0

    def two() -> str:
        alone.append(running[0] == 0)  # nothing else runs beside it
        return "c"

    waves = [Wave(("a", "b", "c"), lambda runs: {"a": job("a", 1.0), "b": job("b", 1.0), "c": two})]
    runs = Waves(Path("."), waves, processes=lambda name: 2 if name == "c" else 1)
    assert [runs[n] for n in "abc"] == ["a", "b", "c"] and most[0] == 2 and alone == [True]


@pytest.mark.parametrize(
    ("full", "best", "last_at_end", "files", "with_optimizer"),
    [
        ([], True, False, ["best.ckpt", "last.ckpt"], []),
        (["last.ckpt"], False, True, ["last.ckpt"], ["last.ckpt"]),
        (["best*.ckpt"], True, True, ["best.ckpt", "last.ckpt"], ["best.ckpt"]),
    ],
)
def test_a_slim_run_keeps_the_optimizer_only_where_a_run_resumes_and_no_unread_best(
    tmp_path, full, best, last_at_end, files, with_optimizer
):
    """slim.slim on a 2-epoch fit with a best-and-last CurrentModelCheckpoint (the suite's runs' callback): the
    optimizer's state only in the files matching `full` (every checkpoint holds the weights), no best checkpoint with
    `best` False, and with `last_at_end` no last.ckpt after epoch 0, one after epoch 1. Lightning's own
    ModelCheckpoint writes last.ckpt only beside a top-k save, so where the unseeded model's epoch 1 did not improve
    there was none: this test failed for 7 of 68 seeds (2026-12-07). Mutations: ignoring `full`, keeping top-k, or
    writing last.ckpt at every epoch, fail here."""
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel

    from ddpkit.run.checkpoints import CurrentModelCheckpoint
    from ddpkit.testing.slim import slim

    class Slimmed(L.Callback):
        def setup(self, trainer, pl_module, stage):
            slim(trainer, full, best, last_at_end)

        def on_train_epoch_start(self, trainer, pl_module):
            if trainer.current_epoch == 1:
                self.last_after_epoch_0 = (tmp_path / "last.ckpt").is_file()

    class Logged(BoringModel):
        def validation_step(self, batch, batch_idx):
            loss = super().validation_step(batch, batch_idx)["x"]
            self.log("val_loss", loss)

    saver = CurrentModelCheckpoint(tmp_path, filename="best", monitor="val_loss", save_top_k=1, save_last=True)
    trainer = L.Trainer(
        default_root_dir=tmp_path, max_epochs=2, limit_train_batches=2, limit_val_batches=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[saver, slimmed := Slimmed()],
    )  # fmt: skip
    trainer.fit(Logged())
    assert slimmed.last_after_epoch_0 is not last_at_end
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == files
    for name in files:
        checkpoint = torch.load(tmp_path / name, weights_only=False)
        assert ("optimizer_states" in checkpoint) == (name in with_optimizer), name
        assert checkpoint["state_dict"].keys() == Logged().state_dict().keys()


def test_a_slim_save_replaces_the_file_tags_the_gpu_resume_state_and_names_alone(tmp_path):
    """SlimIO writes a new file and renames it over the old, so that a hard link to the old (the continued copy's
    last.ckpt, waves.py) keeps its bytes, whatever the CheckpointIO it wraps does (here one that writes in place;
    mutation: SlimIO writing to the path itself); it tags every tensor of a file matching `cuda` as stored on
    cuda:0, no other file's (mutation: ignoring `cuda`), and writes a file matching `names` with its epoch and step
    alone (mutation: ignoring `names`), and a file matching `single` with its float64 tensors as float32, its
    integer ones as they are (mutation: ignoring `single`)."""
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    from ddpkit.testing.slim import SlimIO

    class InPlace(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            torch.save(checkpoint, path)

    io = SlimIO(InPlace(), full=["step*.ckpt"], cuda=["step3.ckpt"], names=["epoch=*.ckpt"], single=["step4.ckpt"])
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}}, tmp_path / "last.ckpt")
    os.link(tmp_path / "last.ckpt", tmp_path / "copy.ckpt")
    io.save_checkpoint({"state_dict": {"w": torch.zeros(2)}}, tmp_path / "last.ckpt")
    assert torch.load(tmp_path / "copy.ckpt", weights_only=True)["state_dict"]["w"].tolist() == [1, 1]
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["state_dict"]["w"].tolist() == [0, 0]
    locations = {"step3.ckpt": [], "step4.ckpt": []}
    for name, seen in locations.items():
        weights = {"w": torch.ones(2, dtype=torch.float64), "n": torch.tensor(3)}
        io.save_checkpoint({"state_dict": weights, "optimizer_states": [{"m": torch.ones(1)}]}, tmp_path / name)
        torch.load(
            tmp_path / name, map_location=lambda storage, at, seen=seen: seen.append(at) or storage, weights_only=True
        )
    assert locations == {"step3.ckpt": ["cuda:0"] * 3, "step4.ckpt": ["cpu"] * 3}
    saved = {name: torch.load(tmp_path / name, map_location="cpu", weights_only=True) for name in locations}
    dtypes = {name: {k: t.dtype for k, t in state["state_dict"].items()} for name, state in saved.items()}
    assert dtypes == {
        "step3.ckpt": {"w": torch.float64, "n": torch.int64},
        "step4.ckpt": {"w": torch.float32, "n": torch.int64},
    }
    io.save_checkpoint({"epoch": 1, "global_step": 8, "state_dict": {"w": torch.ones(2)}}, tmp_path / "epoch=1.ckpt")
    assert torch.load(tmp_path / "epoch=1.ckpt", weights_only=True) == {"epoch": 1, "global_step": 8, NAME_ONLY: 1}
    files = ["copy.ckpt", "epoch=1.ckpt", "last.ckpt", "step3.ckpt", "step4.ckpt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == files


def test_a_tied_weights_gradient_is_recorded_once_under_each_name():
    """OneStep's record holds a tied weight's gradient under each of its names as one tensor, which torch.save
    writes once (mutation: a copy per name doubles GPT-2's embedding in every one-step record); a float64 gradient
    (the exact step's) as the float32 nearest it (mutation: kept in float64)."""
    import io

    from ddpkit.testing.parity_probe import OneStep

    embed, head = torch.nn.Embedding(5000, 8), torch.nn.Linear(8, 5000, bias=False)
    head.weight = embed.weight
    module = torch.nn.ModuleDict({"embed": embed, "head": head})
    head(embed(torch.tensor([1, 2]))).sum().backward()
    probe = OneStep()
    probe.current = {"grads": []}
    probe.on_before_optimizer_step(None, module, None)
    (grads,) = probe.current["grads"]
    assert grads.keys() == {"embed.weight", "head.weight"} and grads["embed.weight"] is grads["head.weight"]
    assert torch.equal(grads["head.weight"], embed.weight.grad)
    saved = io.BytesIO()
    torch.save(grads, saved)
    assert saved.getbuffer().nbytes < 2 * embed.weight.nbytes
    module.double()
    head(embed(torch.tensor([1, 2]))).sum().backward()
    probe.on_before_optimizer_step(None, module, None)
    exact = probe.current["grads"][-1]["head.weight"]
    assert exact.dtype == torch.float32 and torch.equal(exact, embed.weight.grad.float())


def test_each_probe_fit_starts_with_the_earlier_ones_freed(monkeypatch):
    """The configured-model probes' 4 one-step fits (probe_training_step's 2, batch_mean_line's 2) each start with no
    earlier probe Trainer alive: one fit's model, gradients and optimizer state in memory at a time (a 124M-parameter
    float64 GPT-2's 4 held 23.8 GB together; mutations: no `del` of the fit's trainer, or no collection of the
    cycles, leave 1 alive here)."""
    import weakref

    import lightning as L

    from ddpkit.testing.configured import probe_training_step
    from ddpkit.testing.toy import ToyClassifier, ToyData

    made, alive = weakref.WeakSet(), []

    class Counted(L.Trainer):
        def __init__(self, *args, **kwargs) -> None:
            alive.append(len(made))
            super().__init__(*args, **kwargs)
            made.add(self)

    monkeypatch.setattr(L, "Trainer", Counted)
    data = ToyData(global_batch_size=16, micro_batch_size=None)
    data.setup("fit")
    probe = probe_training_step(ToyClassifier(hidden_dim=16), data, {})
    assert probe["random_step"] == probe["batch_mean"] == "" and alive == [0, 0, 0, 0]


@pytest.mark.parametrize("consume", [True, False])
def test_a_consuming_run_deletes_the_checkpoint_it_resumed_from_once_restored(tmp_path, consume):
    """Probe(consume=True) deletes the file fit resumed from once Lightning has restored it (resume-2to1: the 2-device
    resume state, read by nothing after), and the run still trains from its step on; without `consume` the file
    stays. Mutation: ignoring `consume` fails here."""
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel

    from ddpkit.testing.parity_probe import Probe

    def trainer(root: Path, *callbacks) -> L.Trainer:
        return L.Trainer(
            default_root_dir=root, max_epochs=2, limit_train_batches=2, limit_val_batches=0, logger=False,
            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
            callbacks=list(callbacks),
        )  # fmt: skip

    first = trainer(tmp_path / "first")
    first.fit_loop.max_epochs = 1
    first.fit(BoringModel())
    state = tmp_path / "state.ckpt"
    first.save_checkpoint(state)
    resumed = trainer(tmp_path / "resumed", Probe(consume=consume))
    resumed.fit(BoringModel(), ckpt_path=state)
    trained = json.loads((tmp_path / "resumed" / "probe" / "fit-rank0.json").read_text())["train"]
    assert resumed.global_step == 4 and [step["step"] for step in trained] == [3, 4]  # epoch 1's, from the state
    assert state.is_file() is not consume


def test_the_one_step_states_hold_float32_weights_and_a_resume_state_all_of_float64(tmp_path):
    """Probe(resumable=True) in a float64 fit writes its states at `weights_at` (the one-step check's) without the
    optimizer's state and with float32 weights, and the others (which runs resume from) complete, in float64.
    Mutation: a Probe that does not pass its `single` patterns to SlimIO fails here."""
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel

    from ddpkit.testing.parity_probe import Probe

    trainer = L.Trainer(
        default_root_dir=tmp_path, max_epochs=1, limit_train_batches=3, limit_val_batches=0, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, precision="64-true",
        callbacks=[Probe(save_at_steps=[1, 2, 3], resumable=True, weights_at=[1, 3])],
    )  # fmt: skip
    trainer.fit(BoringModel())
    saved = {k: torch.load(tmp_path / "probe" / f"step{k}.ckpt", weights_only=False) for k in (1, 2, 3)}
    dtypes = {k: {t.dtype for t in state["state_dict"].values()} for k, state in saved.items()}
    assert dtypes == {1: {torch.float32}, 2: {torch.float64}, 3: {torch.float32}}
    assert ["optimizer_states" in state for state in saved.values()] == [False, True, False]


def test_a_last_checkpoint_of_the_step_just_saved_is_a_hard_link_to_that_file(tmp_path):
    """SlimIO writes last.ckpt as a hard link to the checkpoint it saved just before, where that holds the same step
    and the same kinds of state (Lightning saves the top-k checkpoint, then last.ckpt, from the same state: the
    1-device run's best and last were two copies of its weights); not where the step or what is kept differs (a
    last.ckpt that keeps the optimizer's state beside a best without). Mutation: no link fails here."""
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    from ddpkit.testing.slim import SlimIO

    def state(step: int) -> dict:
        return {
            "epoch": 1,
            "global_step": step,
            "state_dict": {"w": torch.full((2,), float(step))},
            "optimizer_states": [{}],
        }

    inode = lambda name: (tmp_path / name).stat().st_ino  # noqa: E731
    io = SlimIO(TorchCheckpointIO(), full=[])
    io.save_checkpoint(state(8), tmp_path / "best.ckpt")
    io.save_checkpoint(state(8), tmp_path / "last.ckpt")
    assert inode("last.ckpt") == inode("best.ckpt")
    io.save_checkpoint(state(9), tmp_path / "last.ckpt")  # another step: a file of its own, the best as it was
    assert inode("last.ckpt") != inode("best.ckpt")
    loaded = {
        n: torch.load(tmp_path / n, weights_only=True)["state_dict"]["w"].tolist() for n in ("best.ckpt", "last.ckpt")
    }
    assert loaded == {"best.ckpt": [8.0, 8.0], "last.ckpt": [9.0, 9.0]}
    (tmp_path / "keep").mkdir()
    io = SlimIO(TorchCheckpointIO(), full=["last.ckpt"])
    io.save_checkpoint(state(10), tmp_path / "keep" / "best.ckpt")
    io.save_checkpoint(state(10), tmp_path / "keep" / "last.ckpt")  # keeps the optimizer's state, the best does not
    assert inode("keep/last.ckpt") != inode("keep/best.ckpt")
    assert "optimizer_states" in torch.load(tmp_path / "keep" / "last.ckpt", weights_only=True)


def test_the_float64_bound_is_worked_out_once_and_the_reference_kept_until_then(tmp_path):
    """fp64_bound keeps the bound for the session (Waves.cache): asked again once the reference's weights are gone,
    it gives the same bound (mutation: no cache fails); Footprint.release keeps the reference's checkpoints while a
    test left reads the bound and it is not worked out yet, and deletes them after, unless a test left reads the
    reference's files (`{reference}`: the parity command's tests; mutation: no such rule frees them too early); and a
    session that reads only the bound starts the reference with the first wave (Waves.wants)."""
    runs, footprint, steps = Waves(tmp_path, []), Footprint(), {"micro_batch_size": 8}
    steps |= {"one_to_two": 5, "two_to_one": 3, "step_points": [1, 4, 5], "steps_per_epoch": 4}
    steps |= {"steps_per_batch": 1, "manual_optimization": False}
    for name, w in (("1dev-fp64", [2.0, 0.5]), ("2dev-fp64", [2.0, 0.5]), ("1dev-acc4-fp64", [2.0 + 1e-13, 0.5])):
        runs.done[name] = Run(tmp_path / name, tmp_path / f"{name}.log")
        runs.done[name].checkpoint().parent.mkdir(parents=True)
        torch.save({"state_dict": {"w": torch.tensor(w, dtype=torch.float64)}}, runs.done[name].checkpoint())
    reference = runs.done["1dev-acc4-fp64"].checkpoint()
    footprint.release(runs, {"1dev-fp64", "2dev-fp64", FP64_BOUND}, steps)
    assert reference.is_file()  # the bound is not worked out yet
    bound = fp64_bound(runs, steps)
    footprint.release(runs, {"1dev-fp64", "2dev-fp64", FP64_BOUND, "1dev-acc4-fp64"}, steps)
    assert reference.is_file()  # its files still read
    footprint.release(runs, {"1dev-fp64", "2dev-fp64", FP64_BOUND}, steps)
    assert not reference.exists() and runs.done["1dev-fp64"].checkpoint().is_file()
    del runs.done["1dev-acc4-fp64"]
    assert fp64_bound(runs, steps) is bound and bound.max_rel == pytest.approx(ROUNDING_FACTOR * 0.5e-13)
    runs.want({"1dev-fp64", FP64_BOUND})
    runs.rounding_reference = "1dev-acc4-fp64"
    assert runs.wants("1dev-acc4-fp64") and not runs.wants("2dev-fp64")


def test_the_first_wave_runs_the_2_device_run_alone_then_the_1_device_runs_beside_resume_2to1(tmp_path):
    """The 2-device float64 run's wave holds it alone, and resume-2to1 (which deletes that run's resume state once
    restored) is first in the wave of the 1-device runs, which take their slots after it (Waves: in the wave's order)
    and write their own states after it starts; the FROM_FIRST runs
    from the 1-device run's states come after, resume-1to2 alone. Mutation: the first wave's three runs together
    again (the default bake's disk at once: 10.6 x its float64 weights instead of 8.6, docs/measurements.md)."""
    from ddpkit.testing.waves import shared_runs

    configured = {"steps_per_epoch": 4, "global_batch_size": 32, "takes_micro_batch_size": True, "stages": []}
    names = [wave.names for wave in shared_runs(tmp_path, plan(configured)).waves]
    assert names[:3] == [("2dev-fp64",), ("resume-2to1", "1dev-fp64", "1dev-acc4-fp64"), ("resume-1to2",)]


def test_a_tied_weight_of_a_one_step_state_is_saved_once_in_float32():
    """slim.in_float32 casts a weight tied under two names (GPT-2's embedding and output layer: 31% of its
    parameters) once, so torch.save writes it once (mutation: a cast per name made GPT-2 small's one-step states 0.66
    x its float64 weights instead of 0.5, docs/measurements.md)."""
    import io

    from ddpkit.testing.slim import in_float32

    embedding = torch.randn(5000, 8, dtype=torch.float64)
    state = {
        "state_dict": {"wte.weight": embedding.detach(), "lm_head.weight": embedding.detach(), "n": torch.tensor(1)}
    }
    light = in_float32(state)["state_dict"]
    assert light["wte.weight"] is light["lm_head.weight"] and light["wte.weight"].dtype == torch.float32
    assert torch.equal(light["wte.weight"], embedding.float()) and light["n"].dtype == torch.int64
    saved = io.BytesIO()
    torch.save(light, saved)
    assert saved.getbuffer().nbytes < 1.5 * embedding.float().nbytes


# A module that shards its layers, and global-batch data: what the sharded check asks of the configured model.
SHARDS = {"model": "net.Net", "shards_layers": True, "global_batch_data": True}


@pytest.fixture
def sharded_check(monkeypatch):
    """The suite's sharded check, past its skip before torch 2.6 (the oldest set)."""
    from ddpkit.testing import check_sharded

    monkeypatch.setattr(check_sharded, "shards_on_cpu", lambda: True)
    return check_sharded.test_sharded_on_two_then_resumed_on_one_device_matches_ddp


class FailingRuns(dict):
    """`cpu_runs` where asking for any run fails with `error` (`{name}`: the run asked for), as a failed run does."""

    def __init__(self, error: str) -> None:
        super().__init__()
        self.error = error

    def __getitem__(self, name):
        raise AssertionError(self.error.replace("{name}", name))


def test_sharded_check_says_why_a_batchnorm_model_differs(tmp_path, sharded_check):
    """Sharded weights over the bound fail, for a model with BatchNorm, with the sentence that says why (each rank's
    own statistics under ModelParallelStrategy) and what to change; without BatchNorm, on the number; within the
    bound, a BatchNorm model passes."""
    from types import SimpleNamespace

    last = tmp_path / "lightning_logs/version_0/checkpoints/last.ckpt"
    last.parent.mkdir(parents=True)
    torch.save({"global_step": 4, "state_dict": {"bn.weight": torch.ones(3)}}, last)
    configured = {**SHARDS, "batchnorm": True, "steps_per_epoch": 2, "steps_per_batch": 1}
    sharded = {"files": ["__0_0.distcp", "__1_0.distcp"], "weights": {"bn.weight": torch.full((3,), 1.5)}}
    runs = {"1dev-fp32": SimpleNamespace(root=tmp_path), "sharded": sharded}
    check = sharded_check
    with pytest.raises(pytest.fail.Exception, match="net.Net has BatchNorm layers: sharded under ModelParallel"):
        check(configured, runs)
    with pytest.raises(AssertionError, match="max_abs=0.5"):
        check({**configured, "batchnorm": False}, runs)
    sharded["weights"] = {"bn.weight": torch.ones(3)}
    check(configured, runs)


def fsdp_copy_error() -> str:
    """What torch raises on copy.deepcopy of a module sharded with fully_shard, in a 1-process gloo group here."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ddpkit.lightning_internals import fully_shard_function

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        module = torch.nn.Linear(2, 2)
        fully_shard_function()(module, mesh=init_device_mesh("cpu", (1,)))
        with pytest.raises(AssertionError) as raised:
            copy.deepcopy(module)
        return str(raised.value)
    finally:
        dist.destroy_process_group()


def test_sharded_check_says_why_a_run_that_copies_the_module_fails(sharded_check):
    """A sharded run that failed on torch's refusal to copy a sharded module (timm's ModelEma in a module copies the
    module it averages) fails the check with the sentence that says why and what to change; a run that failed on
    anything else fails with its own error."""
    from ddpkit.model.sharding import shards_on_cpu
    from ddpkit.testing import check_sharded

    failed_run = "run two exited 1: error: rank 1 failed: {error}\n(log: two.log)"
    # torch's own words where it shards on CPU; before 2.6 (the oldest set) the sentence the check looks for
    error = f"AssertionError: {fsdp_copy_error() if shards_on_cpu() else check_sharded.NO_DEEPCOPY}"
    with pytest.raises(pytest.fail.Exception) as failed:
        sharded_check(SHARDS, FailingRuns(failed_run.format(error=error)))
    said = "net.Net's sharded run copies the module to average its weights (run two exited 1: error: rank 1 failed: "
    assert str(failed.value).startswith(f"{said}{error}), which a sharded module does not allow")
    with pytest.raises(AssertionError, match="out of memory"):
        sharded_check(SHARDS, FailingRuns(failed_run.format(error="RuntimeError: out of memory")))


def test_the_callbacks_that_change_the_checks_are_named():
    """configured.callback_facts names Lightning's weight-averaging callbacks (subclasses too) and no other, says
    whether one is SWA (a subclass too), and gives a GradientAccumulationScheduler's factor in the runs' 2 epochs."""
    from lightning.pytorch import callbacks

    from ddpkit.testing.configured import callback_facts

    class MySWA(callbacks.StochasticWeightAveraging):
        pass

    given = [callbacks.ModelCheckpoint(), callbacks.StochasticWeightAveraging(swa_lrs=0.01), MySWA(swa_lrs=0.1)]
    named = ["StochasticWeightAveraging", "MySWA"]
    ema = []
    if hasattr(callbacks, "EMAWeightAveraging"):  # Lightning 2.6 on; the oldest set has SWA only
        given.append(callbacks.EMAWeightAveraging())
        named.append("EMAWeightAveraging")
        ema = [callbacks.EMAWeightAveraging()]
    facts = callback_facts([callbacks.LearningRateMonitor(), *given])
    assert facts == {"averaging": named, "swa": True, "accumulation": []}
    assert callback_facts([MySWA(swa_lrs=0.1)])["swa"] and not callback_facts(ema)["swa"]
    scheduled = callback_facts([callbacks.GradientAccumulationScheduler({1: 2, 3: 4})])
    assert scheduled == {"averaging": [], "swa": False, "accumulation": [1, 2]}
    assert callback_facts([callbacks.GradientAccumulationScheduler({0: 3})])["accumulation"] == [3, 3]
    assert callback_facts([callbacks.GradientAccumulationScheduler({4: 2})])["accumulation"] == [1, 1]  # not []


def test_the_runs_steps_follow_a_gradient_accumulation_schedule():
    """With a GradientAccumulationScheduler (1 batch a step in epoch 0, 2 in epoch 1) the plan counts Lightning's
    optimizer steps: one after each pair of batches and one after an epoch's last, its resume and one-step points fall
    where a step ends, and the suite's own accumulation runs are off (Lightning refuses both)."""
    from ddpkit.testing.runs import global_step, plan, total_steps

    configured = {"steps_per_epoch": 8, "global_batch_size": 64, "takes_micro_batch_size": True}
    plain = plan(configured)
    assert [global_step(plain, b) for b in (1, 8, 9, 16)] == [1, 8, 9, 16] and total_steps(plain) == 16
    assert (plain["two_to_one"], plain["one_to_two"], plain["step_points"]) == (6, 9, [1, 8, 9])
    assert (plain["micro_batch_size"], plain["epoch_steps"], plain["step_batches"]) == (16, 8, 2)
    scheduled = plan({**configured, "accumulation": [1, 2]})
    assert [global_step(scheduled, b) for b in (1, 8, 9, 10, 11, 16)] == [1, 8, 8, 9, 9, 12]
    assert total_steps(scheduled) == 12 and total_steps({**configured, "accumulation": [1, 2]}) == 12
    assert (scheduled["two_to_one"], scheduled["one_to_two"], scheduled["step_points"]) == (6, 10, [1, 8, 10])
    assert (scheduled["micro_batch_size"], scheduled["epoch_steps"], scheduled["step_batches"]) == (None, 8, 2)
    later = plan({**configured, "accumulation": [1, 1]})  # {4: 2}: no accumulation yet, but the callback is there
    assert later["micro_batch_size"] is None and [global_step(later, b) for b in (8, 9, 16)] == [8, 9, 16]
    odd = plan({**configured, "steps_per_epoch": 5, "accumulation": [2, 2], "steps_per_batch": 2})
    assert [global_step(odd, b) for b in (1, 2, 5, 7, 10)] == [0, 2, 6, 8, 12]  # a step after epoch 0's 5th batch
    assert (odd["two_to_one"], odd["one_to_two"], odd["step_points"], odd["epoch_steps"]) == (2, 7, [2, 5, 7], 3)


def test_sharded_check_names_a_weight_averaging_callback_without_starting_the_run(sharded_check):
    """A config with a weight-averaging callback fails the sharded check with the sentence naming it, before the
    sharded run starts (it would fail on the copy)."""
    with pytest.raises(pytest.fail.Exception, match=r"\(StochasticWeightAveraging in the config's callbacks\), wh"):
        sharded_check({**SHARDS, "averaging": ["StochasticWeightAveraging"]}, FailingRuns("started {name}"))
    with pytest.raises(AssertionError, match="started sharded"):
        sharded_check({**SHARDS, "averaging": []}, FailingRuns("started {name}"))


def test_a_resume_under_swa_that_differs_names_swa(monkeypatch):
    """A resumed run over the bound fails with the SWA sentence where the config has StochasticWeightAveraging, with
    the numbers alone where it has not; the learning-rate check accepts SWA's flat schedule only under SWA."""
    from types import SimpleNamespace

    from ddpkit.testing import check_parity

    def over(one, two, bound):
        raise AssertionError("resume-2to1 vs 1dev-fp64, bound 1e-12:\n    w: max_rel 0.09 (OVER bound)")

    monkeypatch.setattr(check_parity, "fp64_bound", lambda runs, steps: 1e-12)
    monkeypatch.setattr(check_parity, "assert_weights_close", over)
    runs = {"1dev-fp64": None, "resume-2to1": None}
    with pytest.raises(pytest.fail.Exception) as failed:
        check_parity.assert_resumed_close(runs, {"swa": True}, "resume-2to1")
    assert str(failed.value).startswith("resume-2to1 resumed mid-epoch under Lightning's StochasticWeightAveraging")
    assert str(failed.value).endswith("(resume-2to1 vs 1dev-fp64, bound 1e-12:)")
    for steps in ({}, {"averaging": ["EMAWeightAveraging"], "swa": False}):
        with pytest.raises(AssertionError, match="OVER bound"):
            check_parity.assert_resumed_close(runs, steps, "resume-2to1")

    monkeypatch.setattr(check_parity, "assert_weights_close", lambda one, two, bound: None)
    monkeypatch.setattr(check_parity, "read_csv_scalars", lambda version: {"lr-AdamW": {0: 1e-4, 1: 3e-4, 2: 3e-4}})
    lr_runs = {"1dev-lr-fp64": SimpleNamespace(version=None), "2dev-lr-fp64": SimpleNamespace(version=None)}
    check = check_parity.test_lr_schedule_is_the_same_on_1_and_2_devices
    steps = {"takes_scheduler": True, "swa": True}
    check(lr_runs, steps)  # warmup, then SWA's constant rate
    with pytest.raises(AssertionError):
        check(lr_runs, {**steps, "swa": False})  # a warmup + cosine schedule that does not fall


def test_a_module_shards_where_its_configure_model_names_a_way_to_shard():
    """The sharded check runs for a module whose configure_model (or a method of the module it calls) shards, and not
    for one that builds its layers there (Lightning's advice for large models) or compiles them, nor without one."""
    import lightning as L
    from torch import nn

    from ddpkit import shard_layers
    from ddpkit.testing.configured import shards_in_configure_model

    class Template(L.LightningModule):  # the digits example's pattern
        def configure_model(self):
            if self.device_mesh is not None:
                shard_layers(self, [m for m in self.modules() if isinstance(m, nn.Linear)], self.device_mesh)

    class ThroughAMethod(L.LightningModule):
        def configure_model(self):
            self.shard()

        def shard(self):
            torch.distributed.fsdp.fully_shard(self)

    class BuildsLayers(L.LightningModule):
        def configure_model(self):
            if getattr(self, "net", None) is None:
                self.net = nn.Linear(4, 4)
            self.print("built")  # a LightningModule method: not the module's own, not read

    class Compiles(L.LightningModule):
        def configure_model(self):
            self.net = torch.compile(nn.Linear(4, 4))

    assert [shards_in_configure_model(m) for m in (Template, type("Sub", (Template,), {}), ThroughAMethod)] == [1, 1, 1]
    assert [shards_in_configure_model(m) for m in (BuildsLayers, Compiles, L.LightningModule)] == [0, 0, 0]


def test_the_slurm_job_runs_with_the_projects_callbacks(tmp_path, monkeypatch):
    """Cost: < 1 s. The SLURM requeue job's command adds to the project's config, as the other cluster runs' do, and
    brings no config of the suite's own: one that listed callbacks replaced the project's, and a project that trains
    with Lightning's EMAWeightAveraging got a job without it, 0.17 apart from its 1-device run. Mutation: the
    suite's callbacks file given with `--config` again."""
    seen = []

    def no_job(cmd, env, log):
        seen.append(cmd)
        raise RuntimeError("not started")

    monkeypatch.setattr(fake_cluster, "start", no_job)
    with pytest.raises(RuntimeError, match="not started"):
        fake_cluster.slurm_requeue_job(tmp_path / "slurm", ["--trainer.max_epochs", "2"], 4)
    (cmd,) = seen
    assert cmd[:4] == ["bash", "cluster/slurm.sbatch", "--trainer.max_epochs", "2"] and "--config" not in cmd
