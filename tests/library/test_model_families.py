"""The guarantee suite's checks catch the classic DDP bugs in the models users bring (families.py): a loss summed over
the batch, BatchNorm without synchronized statistics and values logged without syncing (the training loss, the
validation loss), injected into the toy's MLP (the digits example's network and optimizer), a ResNet-18 (BatchNorm,
GroupNorm), a GPT-2, a small BatchNorm CNN and a MobileNetV3-small; each fails the float64 checks of whole trainings
and the one-step check in float32 and in bf16-mixed (check_onestep.py), by the stated margins. The toy's MLP on a
streaming data module passes the first wave's checks. The checks are the suite's own functions, given the runs the
suite's fixtures would make (the first wave, and the one-step runs). The correct models' whole suites:
test_suite_on_families.py."""

import inspect
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pytest
from families import write_toy_shards

from ddpkit.testing import check_onestep, check_parity
from ddpkit.testing import runs as suite_runs
from ddpkit.testing.configured import describe
from ddpkit.testing.helpers import set_project
from ddpkit.testing.runs import ONE_STEP, Waves, plan, reference_run, shared_runs

HERE = Path(__file__).resolve().parent
# 4 global batches of 32 an epoch, 37 validation samples (the ranks' shares differ); no doctor (it times nothing here).
SIZES = ["--data.global_batch_size", "32", "--data.train_size", "128"]
COMMON = ["--doctor.enabled", "false", "--seed_everything", "0"]
RESNET = ["--data", "families.ImageData", *SIZES, "--model.width", "16"]  # test_suite_on_families.py's width
SYNC = ["--trainer.sync_batchnorm", "true"]
# A project's main.py over the toy's config: the fork server imports the CLI once, not every run.
MAIN = """from ddpkit.cli import main as run_cli
from ddpkit.toy import CONFIG


def main(args=None, run=True):
    return run_cli(CONFIG, args, run)


if __name__ == "__main__":
    main()
"""
GPT2 = ["--data", "families.ByteData", *SIZES]
MOBILENET = ["--data", "families.LargeImageData", *SIZES]
SMALL_CNN = ["--data", "families.ImageData", *SIZES]
# Each model's bugs: "summed" (a loss summed over the batch), "batchnorm" (BatchNorm without synchronized statistics),
# "logs" (the training and validation losses logged unsynced: families.UnsyncedLogs).
MODELS = {
    "toy": (["--model", "families.BuggyToy", "--data", "families.SmallToyData", *SIZES], {"summed", "logs"}),
    "resnet18-groupnorm": (["--model", "families.BuggyResNet18", *RESNET, "--model.norm", "group"], {"summed", "logs"}),
    "gpt2": (["--model", "families.BuggyGPT2", *GPT2], {"summed", "logs"}),
    "resnet18-batchnorm-unsynced": (
        ["--model", "families.UnsyncedLogsResNet18", *RESNET, "--model.norm", "batch"], {"batchnorm", "logs"}
    ),
    "resnet18-batchnorm-summed-loss": (
        ["--model", "families.SummedLossResNet18", *RESNET, "--model.norm", "batch", *SYNC], {"summed"}
    ),
    "small-cnn-unsynced": (["--model", "families.UnsyncedLogsSmallBatchNormCNN", *SMALL_CNN], {"batchnorm", "logs"}),
    "small-cnn-summed-loss": (["--model", "families.SummedLossSmallBatchNormCNN", *SMALL_CNN, *SYNC], {"summed"}),
    "mobilenet-unsynced": (["--model", "families.UnsyncedLogsMobileNetV3Small", *MOBILENET], {"batchnorm", "logs"}),
    "mobilenet-summed-loss": (["--model", "families.SummedLossMobileNetV3Small", *MOBILENET, *SYNC], {"summed"}),
    # The toy's MLP on the same samples as shards (families.SHARD_SIZES), streamed; the folder is the fixture's.
    "streaming": (["--data", "families.StreamingToyData", "--data.global_batch_size", "32"], set()),
}  # fmt: skip


class Suite(NamedTuple):
    runs: Waves  # the plugin's cpu_runs
    steps: dict  # its steps
    configured: dict  # its global_batch


@pytest.fixture(scope="module")
def suites(tmp_path_factory) -> dict[str, Suite]:
    """Per model, the suite's first wave (1 and 2 devices in float64, and the rounding reference) and, for the buggy
    ones, its one-step runs, with its steps: the first waves all at once, then the one-step runs of 4 models at a
    time, from one fork server of the toy's main.py."""
    base = tmp_path_factory.mktemp("families")
    (base / "main.py").write_text(MAIN)
    shutil.copy(HERE / "families.py", base)  # beside main.py, as a project's own module
    set_project(base)
    suites = {}
    write_toy_shards(base / "shards")
    models = {name: args for name, (args, _) in MODELS.items()}
    models["streaming"] = [*models["streaming"], "--data.shard_dir", str(base / "shards")]
    with pytest.MonkeyPatch.context() as patch:
        for name, args in models.items():
            configured = describe(*COMMON, *args)
            # What the suite's commands append (a user's PARITY_ARGS), given to runs.py itself: a variable set in
            # this process would reach the background jobs' processes too (tests/conftest.py).
            patch.setattr(suite_runs, "parity_args", lambda args=args: [*COMMON, *args])
            (base / name).mkdir()
            steps = plan(configured)
            runs = shared_runs(base / name, steps)
            one_step = ONE_STEP if MODELS[name][1] else ()
            runs.want({"1dev-fp64", "2dev-fp64", reference_run(steps, "fp64"), *one_step})
            suites[name] = Suite(runs, steps, configured)
        with ThreadPoolExecutor(len(suites)) as pool:  # every first wave at once (each mostly start-up)
            list(pool.map(lambda name: started(suites[name], "1dev-fp64"), suites))
        with ThreadPoolExecutor(4) as pool:  # 5 runs each, 2 of them of 2 processes
            list(pool.map(lambda name: started(suites[name], ONE_STEP[0]), [n for n in suites if MODELS[n][1]]))
    return suites


def started(suite: Suite, run: str) -> None:
    try:
        suite.runs[run]
    except AssertionError:
        pass  # the run keeps its error: each test that reads it fails with it


def call(check, suite: Suite, **params) -> None:
    """A suite check called as pytest would, with the fixtures it names."""
    fixtures = {"cpu_runs": suite.runs, "steps": suite.steps, "global_batch": suite.configured}
    check(**{name: fixtures[name] for name in inspect.signature(check).parameters if name in fixtures}, **params)


def test_streaming_data_module_passes_like_a_map_style_one(suites):
    """The suite's checks on a StreamingDataModule (128 samples in shards of 5 to 41, 8 streams): 1 vs 2 devices'
    float64 weights and logged values, each training sample once per epoch over the ranks, evaluation once, and
    4 micro-batches, as for map-style data."""
    suite = suites["streaming"]
    assert (suite.steps["steps_per_epoch"], suite.steps["micro_batch_size"]) == (4, 8)
    call(check_parity.test_weights_match_1_vs_2_devices, suite)
    call(check_parity.test_logged_scalars_match_every_step, suite)
    call(check_parity.test_logged_training_values_are_global, suite)
    call(check_parity.test_eval_metrics_count_each_sample_once, suite, stage="val")
    call(check_parity.test_each_rank_gets_half_of_every_epoch_and_nothing_twice, suite)
    call(check_parity.test_gradient_accumulation_keeps_the_global_batch, suite, run="1dev-acc4-fp64")


def weights_margin(suite: Suite) -> float:
    """How far outside the float64 weights bound 1 vs 2 devices are: the worst tensor's max_abs over its bound (a
    tensor at rounding level does not count)."""
    bound = check_parity.fp64_bound(suite.runs, suite.steps)
    verdicts = check_parity.judge(suite.runs["1dev-fp64"].weights(), suite.runs["2dev-fp64"].weights(), bound)
    return max(v.diff.max_abs / v.bound for v in verdicts if not v.rounding and v.bound)


# The least factor by which each bug lands outside its check's bound, a tenth of what was measured (seed 0,
# 2026-12-04, docs/measurements.md "Model families"): far outside, however each model's rounding sets the bound.
WEIGHTS_MARGIN = {
    "toy": 1.0,
    "resnet18-groupnorm": 1.0,
    "gpt2": 1.0,
    "resnet18-batchnorm-unsynced": 1.0,
    "resnet18-batchnorm-summed-loss": 1.0,
    "small-cnn-unsynced": 1.0,
    "small-cnn-summed-loss": 1.0,
    "mobilenet-unsynced": 1.0,
    "mobilenet-summed-loss": 1.0,
}


@pytest.mark.parametrize("name", WEIGHTS_MARGIN)
def test_weights_check_fails_on_a_summed_loss_and_unsynced_batchnorm(suites, name):
    """The float64 weights check fails for each bug in each family, naming the worst tensor first and the bound's
    origin, by at least WEIGHTS_MARGIN[name] times its bound."""
    suite = suites[name]
    with pytest.raises(AssertionError, match=r"2dev-fp64 vs 1dev-fp64, bound .* \((fixed|\d+ x rounding)") as failed:
        call(check_parity.test_weights_match_1_vs_2_devices, suite)
    print(f"{name}: 1 vs 2 devices at {weights_margin(suite):.3g} x the float64 bound")  # docs/measurements.md
    assert weights_margin(suite) >= WEIGHTS_MARGIN[name]
    assert "(OVER bound" in str(failed.value).splitlines()[1]  # the tensors over their bound first


@pytest.mark.parametrize("name", [name for name, (_, bugs) in MODELS.items() if "logs" in bugs])
def test_evaluation_check_fails_on_an_unsynced_metric(suites, name):
    """A validation loss logged without syncing: the ranks report different values (each its own share's mean), and
    the evaluation check fails on it, by at least 1e3 x its bound (METRIC_STATE_ROUNDING)."""
    suite = suites[name]
    with pytest.raises(AssertionError):
        call(check_parity.test_eval_metrics_count_each_sample_once, suite, stage="val")
    ranks = [suite.runs["2dev-fp64"].probe(rank=r)["val"][-1]["val/loss"] for r in (0, 1)]
    apart = abs(ranks[0] - ranks[1]) / abs(ranks[0])
    print(f"{name}: the ranks' val/loss {apart:.3g} apart")  # docs/measurements.md
    assert apart >= 1e3 * check_parity.METRIC_STATE_ROUNDING


def one_step_margin(suite: Suite, precision: str) -> float:
    """How far outside the one-step check's bound 2 devices' gradients are: the worst gradient over its bound."""
    records = [check_onestep.records(run) for run in check_onestep.step_runs(suite.runs, precision)]
    verdicts = check_onestep.step_verdicts(*records, precision, check_parity.no_gradient(suite.runs))
    return max(v.apart / v.bound for _, what, v in verdicts if what == "gradient" and not v.rounding)


# The least factor by which the gradient of a summed loss or of unsynchronized BatchNorm lands outside the one-step
# check's bound, a tenth of what was measured (seed 0, 2026-12-04, docs/measurements.md "Model families").
ONE_STEP_MARGIN = {name: 1.0 for name in WEIGHTS_MARGIN}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", WEIGHTS_MARGIN)
def test_one_step_check_fails_on_a_summed_loss_and_unsynced_batchnorm(suites, name, precision):
    """The one-step check fails for each bug in each family in float32 and in bf16-mixed, the gradients over their
    bound first, by at least ONE_STEP_MARGIN[name] times the bound."""
    suite = suites[name]
    with pytest.raises(AssertionError, match=r"global batch \d+, gradient:\n .*\(OVER bound"):
        call(check_onestep.test_one_step_from_the_same_state_matches_1_vs_2_devices, suite, precision=precision)
    margin = one_step_margin(suite, precision)
    print(f"{name} {precision}: 2 devices' gradients at {margin:.3g} x the one-step bound")  # docs/measurements.md
    assert margin >= ONE_STEP_MARGIN[name]


@pytest.mark.parametrize("name", [name for name, (_, bugs) in MODELS.items() if "logs" in bugs])
def test_one_step_check_fails_on_an_unsynced_logged_value(suites, name):
    """A training loss logged without syncing: after the one-step runs' steps, in float32 and in bf16-mixed, the
    ranks logged different values, and the ranks check says so."""
    with pytest.raises(AssertionError, match=r"global batch \d+: a value logged without sync"):
        call(check_onestep.test_both_ranks_end_bit_identical, suites[name])
