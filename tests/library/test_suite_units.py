"""Unit tests of library code the guarantee suite relies on, on no user model: the parity measures, logger
versions, the collective timeout, the progress bar's default, the requeue checkpoint's name."""

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddpkit.parity import diff, max_abs, over_bound, report
from ddpkit.parity import main as compare_main
from ddpkit.run.requeue import next_hpc_checkpoint
from ddpkit.testing import plugin  # noqa: F401  first: it registers the suite's modules for assert rewriting
from ddpkit.testing.check_parity import (
    BOUNDS,
    FLOAT32_CEILING,
    ROUNDING_CEILING,
    ROUNDING_FACTOR,
    fp64_bound,
    weights_bound,
)
from ddpkit.testing.configured import switch_off
from ddpkit.testing.runs import Wave, Waves, command, evaluation_runs, failed, plan, remove_checkpoints

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
    """A tensor fails on max_rel above the bound unless its max_abs is within `at_rounding`; NaN fails either way."""
    f64 = functools.partial(torch.tensor, dtype=torch.float64)
    diffs = [
        diff("key.bias", f64([1e-16, -2e-16]), f64([3e-16, -1e-16])),  # max_rel 1.0, at rounding level
        diff("weight", f64([1.0, 2.0]), f64([1.0, 2.0 + 1e-9])),  # max_rel 5e-10
        diff("nan", f64([1.0, 1.0]), f64([1.0, float("nan")])),
    ]
    assert [d.name for d in over_bound(diffs, 1e-12)] == ["key.bias", "weight", "nan"]
    assert [d.name for d in over_bound(diffs, 1e-12, at_rounding=1e-15)] == ["weight", "nan"]
    assert [d.name for d in over_bound(diffs, 1e-9, at_rounding=1e-15)] == ["nan"]
    lines = report(diffs, at_rounding=1e-15).splitlines()
    assert lines[0] == "  key.bias: max_abs 2e-16, max_rel 1 (at rounding level)" and "rounding" not in lines[1]
    assert "rounding" not in report(diffs)  # no level given: nothing is marked


class Weights:
    """A finished run as fp64_bound reads it: its final weights (w, and a bias that holds only rounding)."""

    def __init__(self, w: list[float], bias: float) -> None:
        self.w, self.bias = w, bias

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
    `reference`; the bias, 1e-16 moved by 1e-16, holds only rounding and does not count. A reference above
    ROUNDING_CEILING leaves the fixed bound."""
    other = "1dev-acc4-fp64" if micro_batch_size else "1dev-reversed-fp64"
    runs = {"1dev-fp64": Weights([2.0, 0.5], 1e-16), other: Weights([2.0 + reference, 0.5], 2e-16)}
    bound = fp64_bound(runs, {"micro_batch_size": micro_batch_size})
    assert bound.max_rel == pytest.approx(max_rel, rel=1e-6)
    assert bound.at_rounding == pytest.approx(at_rounding, rel=1e-6)
    assert BOUNDS["cpu", "64-true"] == 1e-12 and ROUNDING_CEILING < 2e-6


@pytest.mark.parametrize(
    ("reference", "max_rel"),
    [
        (4e-5, 2e-4),  # under the fixed float32 bound: the fixed bound
        (2e-3, ROUNDING_FACTOR * 1e-3),  # a GroupNorm CNN's float32 rounding: 5 x it
    ],
)
def test_fp32_bound_is_a_factor_of_the_models_float32_rounding(reference, max_rel):
    """The float32 check's bound comes from float32's own reference run (w moves from 2.0 by `reference`); a bias
    the optimizer moves only by rounding (AdamW turns no gradient into steps of lr) is at rounding level."""
    runs = {"1dev-fp32": Weights([2.0, 0.5], 1e-4), "1dev-acc4-fp32": Weights([2.0 + reference, 0.5], 3e-4)}
    bound = weights_bound(runs, {"micro_batch_size": 8}, "fp32")
    assert bound.max_rel == pytest.approx(max_rel, rel=1e-6)
    assert bound.at_rounding == pytest.approx(ROUNDING_FACTOR * max(reference, 2e-4), rel=1e-6)
    assert BOUNDS["cpu", "32-true"] == 2e-4


def test_fp32_check_skips_when_float32_rounding_alone_moves_weights_past_the_ceiling():
    """A transformer's float32 weights move by max_rel 1-1.7 with summation order alone: the float32 comparison
    skips, naming that figure, rather than fail on rounding or pass on a meaningless bound."""
    runs = {"1dev-fp32": Weights([2.0, 0.5], 0.3), "1dev-reversed-fp32": Weights([2.0, 0.5 * 2.2], 0.3)}
    with pytest.raises(pytest.skip.Exception, match=r"max_rel 0\.3, over 0\.01: .* float64 is the check"):
        weights_bound(runs, {"micro_batch_size": None}, "fp32")
    assert FLOAT32_CEILING == 1e-2


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


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ({"noise_std": 0.1, "width": 8}, "PARITY_ARGS='--model.noise_std 0'"),
        ({"dropout": 0.1, "use_noise": True}, "PARITY_ARGS='--model.dropout 0 --model.use_noise false'"),
        ({"noise": "data", "dropout": 0.0}, "set --model.noise (now 'data') to the value that draws nothing"),
        ({"width": 8, "drop_path": 0.0}, "none of the model's arguments is a dropout or noise rate that is on"),
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


def test_evaluation_runs_only_for_the_stages_with_a_step_and_a_set():
    """validate, test and predict run for a stage the module defines a step for and the data module a set for."""
    sizes = {"train_size": 64, "global_batch_size": 32, "steps_per_epoch": 2, "takes_micro_batch_size": True}
    configured = sizes | {"stages": ["validate", "test", "predict"], "val_size": 8, "test_size": 8, "predict_size": 0}
    assert evaluation_runs(plan(configured)) == ["validate-1dev", "test-1dev", "test-2dev"]
    configured |= {"stages": ["validate"], "predict_size": 8}
    assert evaluation_runs(plan(configured)) == ["validate-1dev"]
