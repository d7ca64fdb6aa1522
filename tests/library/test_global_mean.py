"""`ddpkit.global_mean`: a loss divided by a count its batch works out trains 1 device's weights on 2 CPU processes
and in micro-batches, and logs and sweeps 1 device's loss; the same loss divided by each rank's or each micro-batch's
own count does not.

Two launches of global_mean_fit.py run together (one job: 30 CPU-s, 110 s of wall time on 2 cores shared with
other work, 2026-12-05): 1 device (the loss over the whole global batch: the reference; global_mean in 4 micro-batches;
each micro-batch's own count in 4) and 2 processes over gloo (global_mean in 2 micro-batches a rank; each rank's own
count), each for a per-token cross-entropy over padded sequences, a class-weighted cross-entropy and a masked mean
squared error, in float64.
"""

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lightning as L
import pytest
import torch
from ddpkit.model.losses import MicroBatchesRefused
from ddpkit.run.checks import BadInput, check_micro_batches
from ddpkit.testing.check_onestep import SPANS_HINT, step_cause
from ddpkit.testing.configured import probe_training_step
from ddpkit.testing.loss_probe import batch_mean_line
from ddpkit.testing.runs import comparable, plan
from data_families import LSTMClassifier, TextData, UnpackedLSTMClassifier
from global_mean_fit import FEATURES, RaggedSequences, Sequences, Tagger, loader
from procs import TESTS, finish, start

LOSSES = ["tokens", "weighted", "masked"]
# float64: global_mean's weights, logged losses and swept losses were 1.3e-16 to 5.1e-16 of the reference's (the
# three losses, measured 2026-12-05, docs/measurements.md); a rounding of float64 sums, with room.
EXACT = 1e-12
# A count of the rank's or the micro-batch's own samples moved the weights by 0.085 to 0.38 of their size (the three
# losses): 1e-4 is far below what a wrong count does and far above rounding.
WRONG = 1e-4


@pytest.fixture(scope="module")
def fits(tmp_path_factory) -> dict[str, dict]:
    """Every variant's record (global_mean_fit.py), by `{devices}dev-{loss}-{count}-{micro-batches}`."""
    out = tmp_path_factory.mktemp("global_mean")
    one = [f"{loss}-{variant}" for loss in LOSSES for variant in ("batch-1", "global-4", "batch-4")]
    two = [f"{loss}-{variant}" for loss in LOSSES for variant in ("global-2", "batch-1")]
    one += ["contrastive-batch-1", "contrastive-batch-4"]
    two += [f"contrastive-{count}-1" for count in ("gathered", "everywhere", "batch")]
    one, two = [*one, "router-batch-1"], [*two, "router-global-1", "router-batch-1"]
    script = str(TESTS / "global_mean_fit.py")
    procs = [
        start([sys.executable, script, str(out), str(n), *names], out, {"OMP_NUM_THREADS": "1"})
        for n, names in ((1, one), (2, two))
    ]
    with ThreadPoolExecutor(2) as pool:
        # A hang guard: with 300 s this fixture errored beside CI's jobs at load 15 (2026-12-06).
        results = list(pool.map(lambda p: finish(p, 600), procs))
    for result in results:
        assert result.returncode == 0, result.stdout[-3000:]
    return {path.stem: torch.load(path) for path in Path(out).glob("*.pt")}


def relative(a: dict, b: dict) -> float:
    """The largest difference of a weight tensor, relative to the largest value in the reference's tensor."""
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in b)


def relative_values(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == 4
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("loss", LOSSES)
def test_global_mean_trains_1_devices_weights_on_2_processes_and_in_micro_batches(fits, loss):
    """Divided by the step's count over every rank and micro-batch, 2 processes x 2 micro-batches and 1 device x 4
    train the weights of 1 device given the whole global batch, with clipping on."""
    reference = fits[f"1dev-{loss}-batch-1"]["weights"]
    assert relative(fits[f"2dev-{loss}-global-2"]["weights"], reference) <= EXACT
    assert relative(fits[f"1dev-{loss}-global-4"]["weights"], reference) <= EXACT


@pytest.mark.parametrize("loss", LOSSES)
def test_global_mean_logs_and_sweeps_the_global_batchs_loss(fits, loss):
    """The train/loss logged at each step and the learning-rate finder's loss of each step are the global batch's
    mean, on 2 processes and in micro-batches alike."""
    reference = fits[f"1dev-{loss}-batch-1"]
    for name in (f"2dev-{loss}-global-2", f"1dev-{loss}-global-4"):
        assert relative_values(fits[name]["logged"], reference["logged"]) <= EXACT, name
        assert relative_values(fits[name]["swept"], reference["swept"]) <= EXACT, name


@pytest.mark.parametrize("loss", LOSSES)
def test_a_count_per_rank_or_per_micro_batch_trains_other_weights(fits, loss):
    """The same loss divided by each rank's own count (2 processes) or each micro-batch's (1 device x 4) trains
    other weights than the global batch's mean: what global_mean is for, and what the suite names."""
    reference = fits[f"1dev-{loss}-batch-1"]["weights"]
    assert relative(fits[f"2dev-{loss}-batch-1"]["weights"], reference) > WRONG
    assert relative(fits[f"1dev-{loss}-batch-4"]["weights"], reference) > WRONG


@pytest.mark.parametrize("loss", LOSSES)
def test_the_suite_names_a_per_batch_count_and_the_fix_before_any_run(loss):
    """The configured-model probe (one float64 step on 1 device, the global batch whole and in 2 micro-batches) gives
    the line that names the count and global_mean for the loss as usually written, and nothing with global_mean; the
    suite's comparisons then fail with that line first (runs.comparable)."""
    written = batch_mean_line(Tagger(loss, "batch"), Sequences(global_batch_size=16))
    assert written.startswith("Tagger's loss of a batch is not the mean of its samples' losses: it divides by a count")
    assert "return `ddpkit.global_mean(loss_sum, count, self)` from training_step" in written
    assert "vendor/ddpkit/docs/losses.md" in written
    assert batch_mean_line(Tagger(loss, "global"), Sequences(global_batch_size=16)) == ""
    steps = plan({"steps_per_epoch": 4, "global_batch_size": 16, "takes_micro_batch_size": True, "batch_mean": written})
    with pytest.raises(pytest.fail.Exception, match="^Tagger's loss of a batch is not the mean"):
        comparable(steps)
    # Summed, not divided at all: 2 micro-batches give half the whole batch's gradient, in the same direction (as
    # Hugging Face's CTC models do by default). Mutation: the ratio not looked at (no line).
    summed = batch_mean_line(Tagger(loss, "sum"), Sequences(global_batch_size=16))
    assert summed.startswith(
        "Tagger's loss of a batch is not the mean of its samples' losses: the global batch in 2 micro-batches gives "
        "0.5 x the whole batch's gradient, in the same direction"
    ), summed


@pytest.mark.parametrize("loss", LOSSES)
def test_a_count_over_batches_padded_to_their_longest_is_named_as_a_count(loss):
    """The same losses over sequences of their own lengths, each batch padded to its longest: the count as usually
    written still gets the count's line (the probe's split keeps both micro-batches padded as the whole batch), and
    global_mean no line, the padding included (the tagger never sees it). Mutation: the padding looked at first (the
    count named as padding)."""
    written = batch_mean_line(Tagger(loss, "batch"), RaggedSequences(global_batch_size=16))
    assert written.startswith("Tagger's loss of a batch is not the mean of its samples' losses: it divides by a count")
    assert batch_mean_line(Tagger(loss, "global"), RaggedSequences(global_batch_size=16)) == ""


def test_a_model_that_sees_its_batchs_padding_is_named_before_any_run():
    """Sentences of 3 to 24 words padded to their batch's longest: the LSTM over the packed sentences gets no line
    (its split batch agrees in any order), the same LSTM run over the padded batch gets the padding line, which the
    probe finds by sorting the first global batch by size (in the sampler's order both micro-batches held a sentence
    of the batch's longest length, padded alike, and the probe saw nothing). Mutation: no sorted look (no line)."""
    packed = batch_mean_line(LSTMClassifier(dropout=0.0), TextData(global_batch_size=32))
    assert packed == "", packed
    unpacked = batch_mean_line(UnpackedLSTMClassifier(dropout=0.0), TextData(global_batch_size=32))
    assert unpacked.startswith(
        "UnpackedLSTMClassifier's loss of a sample changes with the length its batch is padded to (one float64 step"
    ), unpacked
    assert "the model must not see the padding" in unpacked and "`pack_padded_sequence`" in unpacked, unpacked


class ScaledInFloat32(Tagger):
    """Tagger whose features pass through float32 around a scale its micro-batch works out: the same in exact
    arithmetic, but rounded otherwise when the batch is split, as a Hugging Face model that casts to float32 inside
    (an RMSNorm) rounds otherwise in a batch padded to another longest sequence."""

    def training_step(self, batch, batch_idx):
        x, y, target = batch
        scale = x.abs().amax()
        x = ((x / scale).float() * scale.float()).to(x.dtype)
        return super().training_step((x, y, target), batch_idx)


@pytest.mark.parametrize("loss", LOSSES)
def test_the_count_probe_runs_a_model_that_casts_to_float32_in_float64(loss):
    """The probe's step keeps such a model in float64, as the suite's float64 runs do (Float64Throughout): a
    global_mean loss gets no line (without it, its split batch's gradient read 1e-8 apart and the suite told a Qwen2
    with losses.md's fix to use global_mean), and the loss as usually written still gets it."""
    assert batch_mean_line(ScaledInFloat32(loss, "global"), Sequences(global_batch_size=16)) == ""
    written = batch_mean_line(ScaledInFloat32(loss, "batch"), Sequences(global_batch_size=16))
    assert written.startswith("ScaledInFloat32's loss of a batch is not the mean of its samples' losses")


class NormalizedTagger(Tagger):
    """Tagger whose features pass a BatchNorm layer first (a segmentation model's BatchNorm, in miniature)."""

    def __init__(self, loss: str = "tokens", count: str = "batch") -> None:
        super().__init__(loss, count)
        self.norm = torch.nn.BatchNorm1d(FEATURES, dtype=torch.float64)

    def training_step(self, batch, batch_idx):
        x, y, target = batch
        return super().training_step((self.norm(x.transpose(1, 2)).transpose(1, 2), y, target), batch_idx)


@pytest.mark.parametrize("loss", LOSSES)
def test_the_count_probe_looks_at_a_batchnorm_model_too(loss):
    """A BatchNorm model's loss is probed with the layers at their running statistics: global_mean gets no line,
    the loss as usually written gets it (it had been skipped, so a U-Net with a batch-level Dice failed on numbers
    alone). Mutation: the layers left on the batch's statistics (every BatchNorm model gets the line)."""
    assert batch_mean_line(NormalizedTagger(loss, "global"), Sequences(global_batch_size=16)) == ""
    written = batch_mean_line(NormalizedTagger(loss, "batch"), Sequences(global_batch_size=16))
    assert written.startswith("NormalizedTagger's loss of a batch is not the mean of its samples' losses")
    # Without running statistics the layers normalize by the batch in eval mode too: not looked at.
    batch_only = NormalizedTagger(loss, "global")
    batch_only.norm.track_running_stats, batch_only.norm.running_mean, batch_only.norm.running_var = False, None, None
    assert batch_mean_line(batch_only, Sequences(global_batch_size=16)) == ""


def test_a_contrastive_loss_over_gathered_rows_trains_1_devices_weights_on_2_processes(fits):
    """A CLIP-style loss with ddpkit.gather_batch, each rank's rows against every rank's or the global batch's loss on
    every rank, trains on 2 processes the weights of 1 device given the whole global batch, and logs its loss; against
    a rank's own rows (as usually written, and in micro-batches) it trains other weights. Mutations: gather_batch's
    backward without its all-reduce, or the ranks' rows gathered in another order (both measured off by > 1e-2)."""
    reference = fits["1dev-contrastive-batch-1"]
    for count in ("gathered", "everywhere"):
        gathered = fits[f"2dev-contrastive-{count}-1"]
        assert relative(gathered["weights"], reference["weights"]) <= EXACT, count
        assert relative_values(gathered["logged"], reference["logged"]) <= EXACT, count
    assert relative(fits["2dev-contrastive-batch-1"]["weights"], reference["weights"]) > WRONG
    assert relative(fits["1dev-contrastive-batch-4"]["weights"], reference["weights"]) > WRONG


def test_a_routers_balance_over_the_global_batch_trains_1_devices_weights_on_2_processes(fits):
    """A mixture of experts' load-balancing loss (two layers' router logits, padding left out) from
    ddpkit.router_balance_loss trains on 2 processes, whose ranks hold different numbers of tokens, the weights of 1
    device given the whole global batch with Hugging Face's formula, and logs its loss; the formula over each rank's
    own tokens, as Hugging Face's models compute it, trains other weights. Mutations: no all-reduce of the shares
    (each rank's own), the ranks' probabilities over their own token count (measured 2026-12-08: 0.39 and 0.0067 of
    the reference apart; the per-rank formula 0.050)."""
    reference = fits["1dev-router-batch-1"]
    balanced = fits["2dev-router-global-1"]
    assert relative(balanced["weights"], reference["weights"]) <= EXACT
    assert relative_values(balanced["logged"], reference["logged"]) <= EXACT
    assert relative(fits["2dev-router-batch-1"]["weights"], reference["weights"]) > WRONG


class Declared(Tagger):
    """Tagger whose contrastive loss over gathered rows is declared to span the global batch."""

    loss_spans_global_batch = True


def test_a_loss_over_the_global_batch_is_named_until_declared_then_compared_without_micro_batches():
    """Undeclared, a contrastive loss gets the count probe's line, which names gather_batch and the declaration (one
    that calls gather_batch, whose split step stops, a line that names the declaration); declared, the probe gives
    no line, the suite plans no micro-batch runs (its accumulation test skips, the rounding reference reverses the
    batches) and the CLI refuses micro-batches with one line. Mutations: the probe ignoring the declaration (the
    line), the plan ignoring it (micro-batches of 4)."""
    data = Sequences(global_batch_size=16)
    written = batch_mean_line(Tagger("contrastive", "batch"), data)
    assert written.startswith("Tagger's loss of a batch is not the mean of its samples' losses")
    assert "`ddpkit.gather_batch(z, self)`" in written and "`loss_spans_global_batch = True`" in written
    gathers = batch_mean_line(Tagger("contrastive", "gathered"), data)
    assert gathers.startswith("Tagger's loss reads every rank's batch (ddpkit.gather_batch) but does not say so")
    probed = probe_training_step(Declared("contrastive", "gathered"), data, {})
    assert probed["batch_mean"] == "" and probed["random_step"] == ""
    facts = {"steps_per_epoch": 4, "global_batch_size": 16, "takes_micro_batch_size": True}
    assert plan(facts)["micro_batch_size"] == 4
    assert plan({**facts, "spans_batch": True})["micro_batch_size"] is None
    check_micro_batches(Declared("contrastive", "gathered"), Sequences(global_batch_size=16), 2)
    check_micro_batches(Tagger("contrastive", "gathered"), Sequences(global_batch_size=16, micro_batch_size=4), 2)
    with pytest.raises(BadInput, match=r"into 2 micro-batches, but Declared's loss spans the global batch"):
        check_micro_batches(Declared("contrastive", "gathered"), Sequences(global_batch_size=16, micro_batch_size=4), 2)


def test_a_routers_balance_per_batch_is_named_with_both_fixes_and_the_global_one_once_declared_is_compared():
    """A Hugging Face-style model whose loss adds the routers' balance over its own batch (its config's
    output_router_logits and router_aux_loss_coef) gets the router's line, with router_balance_loss and PARITY_ARGS;
    router_balance_loss undeclared gets the declaration's line; declared, no line. Mutation: router_aux not asked (the
    count's line, whose global_mean cannot fix a product of means)."""
    data = Sequences(global_batch_size=16)
    written = batch_mean_line(Tagger("router", "batch"), data)
    assert written.startswith(
        "Tagger's loss adds Tagger's router load-balancing loss (output_router_logits=True, router_aux_loss_coef=0.5), "
        "which multiplies two means over the batch's tokens"
    ), written
    assert "`coef * ddpkit.router_balance_loss(out.router_logits, top_k, self, attention_mask)`" in written
    assert "set router_aux_loss_coef to 0 for the checks in PARITY_ARGS" in written
    undeclared = batch_mean_line(Tagger("router", "global"), data)
    assert undeclared.startswith("Tagger's loss reads every rank's batch (ddpkit.router_balance_loss) but does not")
    assert probe_training_step(Declared("router", "global"), data, {})["batch_mean"] == ""


def test_gather_batch_refuses_micro_batches(tmp_path):
    """Under Lightning's accumulation (a fit without the CLI's check) gather_batch stops the first step: a micro-batch
    would see only its own rows. Mutation: the check removed (the fit trains)."""
    trainer = L.Trainer(
        accelerator="cpu", devices=1, precision="64-true", max_steps=1, accumulate_grad_batches=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    with pytest.raises(MicroBatchesRefused, match="gather_batch in Tagger: with 2 micro-batches per step"):
        trainer.fit(Tagger("contrastive", "gathered"), train_dataloaders=loader(1, 0, 2))


def steps_of(*grads: list[float]) -> dict:
    """One-step records (global batches 0, 1, 2) whose gradient of global batch k is grads[k]."""
    return {k: {"grads": [{"w": torch.tensor(g, dtype=torch.float64)}]} for k, g in enumerate(grads)}


def test_a_failed_one_step_check_is_headed_by_the_gradients_scale_or_the_declared_losss_usual_cause():
    """2 devices' gradient a multiple of 1 device's at every judged global batch (0 is not judged) names the factor;
    a turned gradient names the usual cause only where the module declares a loss over the global batch; a step
    whose 1-device gradient is no gradient of its state (overflowed, far from float64's) is not read. Mutations: the
    direction test dropped (the turned gradient reads as a scale), the declaration ignored."""
    one = exact = steps_of([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [3.0, 1.0, 2.0])
    halved = steps_of([9.0, 9.0, 9.0], [0.5, 1.0, 1.5], [1.5, 0.5, 1.0])
    assert step_cause(one, halved, exact, {}).startswith(
        "2 devices' gradient is 0.5 x 1 device's, in the same direction"
    )
    turned = steps_of([1.0, 2.0, 3.0], [1.0, 2.0, 3.2], [3.0, 1.2, 2.0])
    assert step_cause(one, turned, exact, {}) == ""
    assert step_cause(one, turned, exact, {"spans_batch": True}) == SPANS_HINT
    # Declared, with a Hugging Face MoE that still balances each rank's tokens (configured.py's router_aux, through
    # the plan): that.
    aux = "MixtralForCausalLM's router load-balancing loss (output_router_logits=True, router_aux_loss_coef=0.02)"
    facts = {"steps_per_epoch": 4, "global_batch_size": 16, "takes_micro_batch_size": True, "spans_batch": True}
    assert step_cause(one, turned, exact, plan({**facts, "router_aux": aux})).startswith(
        "The module declares a loss over the global batch (loss_spans_global_batch) and 2 devices' step differs from "
        f"1 device's: its model still adds {aux}, over each rank's own tokens; set router_aux_loss_coef=0"
    )
    overflowed = steps_of([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [3e30, 1.0, 2.0])
    assert step_cause(overflowed, halved, exact, {}).startswith("2 devices' gradient is 0.5 x")
