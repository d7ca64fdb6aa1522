"""The guarantee suite's checks catch the classic DDP bugs in the models users bring (families.py): a loss summed over
the batch, BatchNorm without synchronized statistics and values logged without syncing (the training loss, the
validation loss), injected into the toy's MLP (the digits example's network and optimizer), a GroupNorm ResNet-18, a
GPT-2, a small BatchNorm CNN and a MobileNetV3-small; each fails the float64 checks of whole trainings and the
one-step check in float32 and in bf16-mixed (check_onestep.py), by the stated margins. A summed loss is injected into
one BatchNorm net (the small CNN; the loss is the same bug whatever the net) and unsynchronized BatchNorm into two
(the small CNN, the MobileNet). The ResNet-18's BatchNorm pair and the MobileNet's summed loss, which CI ran until
2026-12-06, added 24 runs to this module's 89 and no case the others lack (their margins: docs/measurements.md,
"Model families"). The toy's MLP on a streaming data module passes the first wave's checks. An LSTM over sentences
padded to each batch's longest passes them and the one-step check (data_families.py), and the same sentences built
differently in each process (a vocabulary in a set's order, an unseeded shuffle) fail the check that the ranks hold
the same data, at the index where they first differ. The checks are the suite's own functions, given the runs the
suite's fixtures would make (the first wave, and the one-step runs). The correct models' whole suites:
test_suite_on_families.py."""

import inspect
import json
import math
import os
import re
import shutil
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pytest
from families import write_toy_shards

import ddpkit.testing.plugin  # noqa: F401  first: it has pytest rewrite the asserts of the checks imported below
from ddpkit.testing import bounds, check_data, check_onestep, check_parity
from ddpkit.testing import commands as suite_commands
from ddpkit.testing.configured import describe
from ddpkit.testing import helpers
from ddpkit.testing.runs import ONE_STEP, ONE_STEP_WAVES, Waves, plan, reference_run
from ddpkit.testing.waves import shared_runs

pytestmark = pytest.mark.many_processes  # after the library's other tests, when the jobs end (tests/conftest.py)

HERE = Path(__file__).resolve().parent
# 4 global batches of 32 an epoch, 37 validation samples (the ranks' shares differ); no doctor (it times nothing here).
SIZES = ["--data.global_batch_size", "32", "--data.train_size", "128"]
COMMON = ["--doctor.enabled", "false", "--seed_everything", "0"]
RESNET = ["--data", "families.ImageData", *SIZES, "--model.width", "16"]  # test_suite_on_families.py's width
SYNC = ["--trainer.sync_batchnorm", "true"]
# A project's main.py over the toy's config: the fork server imports the CLI once, not every run.
MAIN = """from ddpkit.run.cli import main as run_cli
from ddpkit.testing.toy import CONFIG


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
    "small-cnn-unsynced": (["--model", "families.UnsyncedLogsSmallBatchNormCNN", *SMALL_CNN], {"batchnorm", "logs"}),
    "small-cnn-summed-loss": (["--model", "families.SummedLossSmallBatchNormCNN", *SMALL_CNN, *SYNC], {"summed"}),
    "mobilenet-unsynced": (["--model", "families.UnsyncedLogsMobileNetV3Small", *MOBILENET], {"batchnorm", "logs"}),
    # The toy's MLP on the same samples as shards (families.SHARD_SIZES), streamed; the folder is the fixture's.
    "streaming": (["--data", "families.StreamingToyData", "--data.global_batch_size", "32"], set()),
    # Sentences of 3 to 24 words, each batch padded to its longest (data_families.py): correct, and built per process.
    "lstm": (["--model", "data_families.LSTMClassifier", "--data", "data_families.TextData"], set()),
    "lstm-set-vocabulary": (
        ["--model", "data_families.LSTMClassifier", "--data", "data_families.SetVocabularyData"], set()
    ),
    "lstm-unseeded-shuffle": (
        ["--model", "data_families.LSTMClassifier", "--data", "data_families.UnseededShuffleData"], set()
    ),
}  # fmt: skip
PER_PROCESS = ["lstm-set-vocabulary", "lstm-unseeded-shuffle"]
# The models whose one-step runs are made: every buggy one, and the LSTM (correct, judged green).
ONE_STEP_MODELS = [name for name, (_, bugs) in MODELS.items() if bugs] + ["lstm"]


class Suite(NamedTuple):
    runs: Waves  # the plugin's cpu_runs
    steps: dict  # its steps
    configured: dict  # its global_batch
    args: list[str]  # what its runs append (a user's PARITY_ARGS)


# The arguments of the model whose runs this thread builds: waves.py asks for them (parity_args) when it builds a
# wave's commands, which is when a run of the wave is first asked for, in the asking thread: in the fixture for the
# runs it starts, in a test for a run a check starts then (2dev-fp64-again). One value per process would give every
# model's later runs the last model's arguments.
BUILDING = threading.local()


@pytest.fixture(scope="module")
def suites(tmp_path_factory) -> Iterator[dict[str, Suite]]:
    """Per model, the suite's first wave (1 and 2 devices in float64, and the rounding reference) and, for the buggy
    ones and the LSTM, its one-step runs, with its steps: the first waves all at once, then the one-step runs of 4
    models at a time, from one fork server of the toy's main.py."""
    base = tmp_path_factory.mktemp("families")
    (base / "main.py").write_text(MAIN)
    for module in ("families.py", "data_families.py"):  # beside main.py, as a project's own modules
        shutil.copy(HERE / module, base)
    before = helpers.project()
    helpers.set_project(base)
    # A set of strings iterates in an order of the process's own hash seed only if no fixed seed is inherited.
    assert os.environ.get("PYTHONHASHSEED", "random") == "random", "unset PYTHONHASHSEED: lstm-set-vocabulary needs it"
    suites = {}
    write_toy_shards(base / "shards")
    models = {name: args for name, (args, _) in MODELS.items()}
    models["streaming"] = [*models["streaming"], "--data.shard_dir", str(base / "shards")]
    with pytest.MonkeyPatch.context() as patch:
        # What the suite's commands append (a user's PARITY_ARGS), given to runs.py itself: a variable set in this
        # process would reach the background jobs' processes too (tests/conftest.py).
        patch.setattr(suite_commands, "parity_args", lambda: list(BUILDING.args))
        for name, args in models.items():
            configured = describe(*COMMON, *args)
            assert configured["router_aux"] == "", name  # no family holds a Hugging Face MoE's config
            if "summed" in MODELS[name][1]:
                # The probe names a summed loss before any run, and every comparison would fail with its line
                # (runs.comparable): asserted here, then left out, so that the checks below are asked about the
                # numbers they fail on where the probe cannot look (a module that optimizes manually).
                assert configured["batch_mean"].startswith(f"{args[1].rpartition('.')[2]}'s loss of a batch is not the")
                assert " 0.5 x the whole batch's gradient, in the same direction" in configured["batch_mean"]
                configured = {**configured, "batch_mean": ""}
            BUILDING.args = [*COMMON, *args]
            (base / name).mkdir()
            steps = plan(configured)
            # Rank 1 a fresh process (Lightning's launcher) only where the bug is one: forked ranks share the hash
            # seed and the random state, and would build the same data.
            runs = shared_runs(base / name, steps, launcher=name in PER_PROCESS)
            one_step = ONE_STEP if name in ONE_STEP_MODELS else ()
            runs.want({"1dev-fp64", "2dev-fp64", reference_run(steps, "fp64"), *one_step})
            suites[name] = Suite(runs, steps, configured, BUILDING.args)
        with ThreadPoolExecutor(len(suites)) as pool:  # every first wave at once (each mostly start-up)
            list(pool.map(lambda name: started(suites[name], "1dev-fp64"), suites))
        for wave in ONE_STEP_WAVES:  # 3 runs, then 2, each 1 of them of 2 processes
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda name, wave=wave: started(suites[name], wave[0]), ONE_STEP_MODELS))
        yield suites
    helpers.set_project(before)  # the modules after this one (tests/conftest.py's order) run the project they had


def started(suite: Suite, run: str) -> None:
    BUILDING.args = suite.args
    try:
        suite.runs[run]
    except AssertionError:
        pass  # the run keeps its error: each test that reads it fails with it


def call(check, suite: Suite, **params) -> None:
    """A suite check called as pytest would, with the fixtures it names."""
    BUILDING.args = suite.args
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
    call(check_data.test_eval_metrics_count_each_sample_once, suite, stage="val")
    call(check_data.test_each_rank_gets_half_of_every_epoch_and_nothing_twice, suite)
    call(check_parity.test_gradient_accumulation_keeps_the_global_batch, suite, run="1dev-acc4-fp64")


def weights_margin(suite: Suite) -> float:
    """How far outside the float64 weights bound 1 vs 2 devices are: the worst tensor's max_abs over its bound (a
    tensor at rounding level does not count)."""
    bound = bounds.fp64_bound(suite.runs, suite.steps)
    verdicts = bounds.judge(suite.runs["1dev-fp64"].weights(), suite.runs["2dev-fp64"].weights(), bound)
    return max(v.diff.max_abs / v.bound for v in verdicts if not v.rounding and v.bound)


# The least factor by which each bug lands outside its check's bound, a tenth of what was measured (seed 0,
# 2026-12-04, docs/measurements.md "Model families"): far outside, however each model's rounding sets the bound.
WEIGHTS_MARGIN = {
    "toy": 1.0,
    "resnet18-groupnorm": 1.0,
    "gpt2": 1.0,
    "small-cnn-unsynced": 1.0,
    "small-cnn-summed-loss": 1.0,
    "mobilenet-unsynced": 1.0,
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


# The ranks' unsynced val/loss apart, over the bound: 235 x for the MobileNetV3-small at seed 0 (its untrained
# classifier near uniform on both halves of the set), the least of the families (2026-12-04, docs/measurements.md).
UNSYNCED_METRIC_MARGIN = 100


@pytest.mark.parametrize("name", [name for name, (_, bugs) in MODELS.items() if "logs" in bugs])
def test_evaluation_check_fails_on_an_unsynced_metric(suites, name):
    """A validation loss logged without syncing: the ranks report different values (each its own share's mean), and
    the evaluation check fails on it, by at least UNSYNCED_METRIC_MARGIN x its bound (METRIC_STATE_ROUNDING)."""
    suite = suites[name]
    with pytest.raises(AssertionError):
        call(check_data.test_eval_metrics_count_each_sample_once, suite, stage="val")
    ranks = [suite.runs["2dev-fp64"].probe(rank=r)["val"][-1]["val/loss"] for r in (0, 1)]
    apart = abs(ranks[0] - ranks[1]) / abs(ranks[0])
    print(f"{name}: the ranks' val/loss {apart:.3g} apart")  # docs/measurements.md
    assert apart >= UNSYNCED_METRIC_MARGIN * bounds.METRIC_STATE_ROUNDING


def one_step_margin(suite: Suite, precision: str) -> float:
    """How far outside the one-step check's bound 2 devices' steps are: the worst gradient or buffer over its
    bound (unsynchronized BatchNorm shows in the running statistics after the step where bf16 hides it in the
    gradient: the small CNN's, 2026-12-04)."""
    records = [check_onestep.records(run) for run in check_onestep.step_runs(suite.runs, precision)]
    verdicts = check_onestep.step_verdicts(*records, precision, bounds.no_gradient(suite.runs))
    judged = [v for _, what, v in verdicts if what in ("gradient", "after") and not v.rounding]
    return max(v.apart / v.bound if v.bound else math.inf * (v.apart > 0) for v in judged)  # a count: exact


# The one-step check must fail: over its bound. Measured at seed 0 (2026-12-05, ONE_STEP_FACTOR 12,
# docs/measurements.md "Model families"): float32 3.3e4 to 3.7e5 x, bf16 5.1 to 18.4 x, but 1.97 x for the small
# CNN's unsynchronized BatchNorm in bf16 (in its running statistics after the step); the ranks check names that bug
# bit for bit first (test_one_step_check_fails_on_an_unsynced_logged_value).
ONE_STEP_MARGIN = {name: 1.0 for name in WEIGHTS_MARGIN}


# The check itself (whose failure takes a second look: its 5 runs again from nudged states) on the bug nearest its
# bound (the small CNN's unsynchronized BatchNorm, 1.97 x in bf16) and the toy's summed loss; the other families'
# bugs by their first look's margin, which is what the second look is asked about. That a bug stays over in the
# nudged look is also test_onestep_kinks.py's (a halved loss). The second look for all 9 models added 45 runs to CI.
WHOLE_CHECK = ("toy", "small-cnn-unsynced")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", WEIGHTS_MARGIN)
def test_one_step_check_fails_on_a_summed_loss_and_unsynced_batchnorm(suites, name, precision):
    """The one-step check fails for each bug in each family in float32 and in bf16-mixed, a gradient or a buffer
    after the step over its bound (listed first), by at least ONE_STEP_MARGIN[name] times the bound; the whole check,
    its second look included, for the WHOLE_CHECK families. Its message names a summed loss's gradient, 0.5 x 1
    device's in the same direction, and no unsynchronized BatchNorm's that way."""
    suite = suites[name]
    if name in WHOLE_CHECK:
        with pytest.raises(AssertionError, match=r"global batch \d+, (gradient|after):\n .*\(OVER bound") as failed:
            call(check_onestep.test_one_step_from_the_same_state_matches_1_vs_2_devices, suite, precision=precision)
    margin = one_step_margin(suite, precision)
    print(f"{name} {precision}: 2 devices' gradients at {margin:.3g} x the one-step bound")  # docs/measurements.md
    assert margin >= ONE_STEP_MARGIN[name]
    # A summed loss halves 2 devices' gradient without turning it, and the check's message says so; unsynchronized
    # BatchNorm turns it. The ResNet's bf16 steps with a summed loss overflow at random (NaN or 1e30 on 1 or 2
    # devices at some global batch, in 4 of 4 sessions, 2026-12-07): no line is promised there. Mutation:
    # gradient_scale's direction test dropped (the BatchNorm models get the line).
    scale = check_onestep.gradient_scale(*map(check_onestep.records, check_onestep.step_runs(suite.runs, precision)))
    if "summed" in MODELS[name][1] and (name, precision) != ("resnet18-groupnorm", "bf16"):
        factors = [float(f) for f in re.findall(r"[\d.]+", scale.partition(" x 1 device's")[0].partition(" is ")[2])]
        assert factors and all(abs(f - 0.5) <= 0.01 for f in factors), scale
    elif "summed" not in MODELS[name][1]:
        assert scale == ""
    if name in WHOLE_CHECK:
        assert str(failed.value).startswith(scale)


@pytest.mark.parametrize("name", [name for name, (_, bugs) in MODELS.items() if "logs" in bugs])
def test_one_step_check_fails_on_an_unsynced_logged_value(suites, name):
    """A training loss logged without syncing: after the one-step runs' steps, in float32 and in bf16-mixed, the
    ranks logged different values, and the ranks check says so; with unsynchronized BatchNorm too, the ranks'
    running statistics differ first, and it names those and the setting. Mutation: the reason left out."""
    batchnorm = r"the ranks hold different \['[^']*running_mean.*: BatchNorm's running statistics.*sync_batchnorm: true"
    unsynced = batchnorm if "batchnorm" in MODELS[name][1] else "a value logged"
    with pytest.raises(AssertionError, match=rf"global batch \d+: {unsynced}"):
        call(check_onestep.test_both_ranks_end_bit_identical, suites[name])


def test_batches_padded_to_their_longest_sentence_pass_the_sample_and_parity_checks(suites):
    """An LSTM over sentences of 3 to 24 words, each batch padded to its own longest (a sentence is padded to 24 on 1
    device and to 20 on a rank) and packed: the samples are recognised as the dataset returns them, so each rank gets
    half of every epoch and global batch k is 1 device's; the ranks and runs hold the same datasets; 1 vs 2 devices'
    float64 weights and logged values agree (the LSTM's dropout between layers is off in the runs, as nn.Dropout's),
    and so do their single steps in float32 and bf16-mixed."""
    suite = suites["lstm"]
    assert suite.configured["random_step"] == "" and suite.configured["unused_parameters"] == ""
    assert suite.configured["batch_mean"] == ""  # its split batches sorted by size too: packed, it never sees padding
    assert [suite.runs[n].probe(rank=r)["samples_read"] for n, r in (("1dev-fp64", 0), ("2dev-fp64", 1))] == [
        "dataset",
        "dataset",
    ]
    call(check_data.test_every_rank_holds_the_same_datasets, suite)
    call(check_data.test_each_rank_gets_half_of_every_epoch_and_nothing_twice, suite)
    call(check_data.test_global_batches_equal_1_device_and_reshuffle_each_epoch, suite)
    call(check_parity.test_weights_match_1_vs_2_devices, suite)
    call(check_parity.test_logged_scalars_match_every_step, suite)
    for precision in check_onestep.STEP_PRECISIONS:  # one step at a time in float32 and bf16-mixed: green too
        call(check_onestep.test_one_step_from_the_same_state_matches_1_vs_2_devices, suite, precision=precision)
    call(check_onestep.test_both_ranks_end_bit_identical, suite)


# The one line the data check fails with: which rank, dataset and index, both samples' fingerprints, and why.
DIFFERS = re.compile(
    r"rank 1's train dataset differs from rank 0's at index (\d+) \(sample fingerprints ([0-9a-f]{16}) vs "
    r"([0-9a-f]{16})\): built differently per process \(a set's order, an unseeded shuffle\?\)"
)


@pytest.mark.parametrize("name", PER_PROCESS)
def test_data_built_differently_per_process_fails_the_data_check_at_its_index(suites, name):
    """A vocabulary numbered by iterating a set of strings, or a shuffle by an unseeded generator: each rank of the 2
    device run builds other samples. Its ranks compare their datasets' fingerprints before training and the run stops
    there with one line, which the data check fails with: the dataset, the first index whose samples differ and both
    samples' fingerprints (as each rank wrote them); the later waves would not start (the gate says why)."""
    suite = suites[name]
    assert suite.configured["random_step"] == ""  # one process builds one order: no random step is claimed
    with pytest.raises(pytest.fail.Exception) as failed:
        call(check_data.test_every_rank_holds_the_same_datasets, suite)
    line = str(failed.value)
    found = DIFFERS.fullmatch(line)
    assert found, line
    ranks = [json.loads((suite.runs.base / "2dev-fp64/probe" / f"data-rank{r}.json").read_text()) for r in (0, 1)]
    index, one, zero = int(found[1]), found[2], found[3]
    assert (ranks[1]["train"]["keys"][index], ranks[0]["train"]["keys"][index]) == (one, zero)
    assert ranks[1]["train"]["keys"][:index] == ranks[0]["train"]["keys"][:index]
    assert line in suite.runs.failed["2dev-fp64"]  # the run stopped on it, before training
    assert not (suite.runs.base / "2dev-fp64/probe/fit-rank0.json").exists()
    assert check_data.data_gate(suite.runs).endswith("(test_every_rank_holds_the_same_datasets says which and where)")


def test_a_head_used_only_in_validation_is_named_with_the_setting_before_any_run(suites):
    """A second head used only in validation_step gets no gradient in training: configured.py's one step on 1 device
    finds it and says, in one line, which parameters and the strategy alias that has DDP look for unused ones (the
    toy's config names its strategy `ddp`); with the alias configured nothing is said."""
    head = ["--model", "data_families.ValidationHeadClassifier", "--data", "families.SmallToyData"]
    line = describe(*COMMON, *head)["unused_parameters"]
    assert line.startswith(
        "ValidationHeadClassifier's training step leaves 2 of 8 parameter tensors without a gradient "
        "(probe_head.weight, probe_head.bias), and DDP then stops at the first step"
    ), line
    assert "set `strategy: ddp_find_unused_parameters_true` under `trainer:` in config.yaml" in line, line
    assert describe(*COMMON, *head, "--trainer.strategy", "ddp_find_unused_parameters_true")["unused_parameters"] == ""


def test_a_shuffle_drawn_from_the_seeded_global_stream_is_no_random_step(suites):
    """A training set shuffled by `random.shuffle` when it is built: configured.py sets the data up under the same
    seed for both of its one-batch steps, so the two steps see the same batch and end equal (the step draws nothing);
    it used to build the data under seeds 0 and 1 and call the step random. Every rank seeds that stream alike. Noise
    drawn in the step is still named, with its switch. The data module takes its parent's arguments as `**kwargs`:
    the suite still finds `micro_batch_size` there (a signature shows only `kwargs`) and plans the accumulation runs."""
    lstm = ["--model", "data_families.LSTMClassifier", "--data", "data_families.GlobalShuffleData"]
    shuffled = describe(*COMMON, *lstm)
    assert shuffled["random_step"] == "" and shuffled["unused_parameters"] == ""
    assert shuffled["takes_micro_batch_size"] is True
    # Noise drawn in the step is still seen with such data: the same batch, two seeds, two ends.
    noisy = describe(*COMMON, *lstm, "--model.noise", "0.1")["random_step"]
    assert noisy.startswith("LSTMClassifier's training step draws random numbers") and "--model.noise 0" in noisy


def test_a_collate_function_that_masks_per_batch_is_named_before_any_step(suites):
    """Tokens masked in the collate function (an MLM collator's pattern) are drawn per batch: each rank would mask
    its share with its own draws. The suite names that, and not the step or a count (the training-step probes,
    which would blame one of them, do not run). Mutation: batch_draws reading the batch once (no line)."""
    masked = describe(*COMMON, "--model", "data_families.LSTMClassifier", "--data", "data_families.MaskingCollateData")
    assert masked["batch_draws"].startswith("the train loader's batches change with the random state outside the")
    assert "ddpkit.MixSamples" in masked["batch_draws"] and "random_step" not in masked
    # The same data unmasked, and every family's: no line (the dataset's own draws are seeded per sample).
    assert all(suite.configured["batch_draws"] == "" for suite in suites.values())
