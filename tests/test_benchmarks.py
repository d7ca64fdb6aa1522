"""The benchmarks in benchmarks/ (run.py: an MLP; lm.py: a GPT): they run and report, and their MFU arithmetic.
No timing is asserted."""

import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from bakes import TEMPLATE, bake, run
from lightning.fabric.utilities.throughput import measure_flops

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
mfu_module = importlib.import_module("mfu")  # benchmarks/mfu.py
run_module = importlib.import_module("run")  # benchmarks/run.py
lm_module = importlib.import_module("lm")  # benchmarks/lm.py
lm_raw = importlib.import_module("lm_raw")  # benchmarks/lm_raw.py
steptimer = importlib.import_module("steptimer")  # benchmarks/steptimer.py
mfu, mlp_train_flops, gpt_flops_per_token = mfu_module.mfu, mfu_module.mlp_train_flops, mfu_module.gpt_flops_per_token


def run_benchmarks(folder: Path) -> dict:
    """Both benchmarks' tiny runs, one after the other on one bake with the language-model example, in one
    background job (tests/conftest.py, `benchmark_run`): {"project": the bake, "mlp": run_benchmark's result, "lm":
    run_lm_benchmark's}, or the exception a run raised (the other's tests still get theirs)."""
    results = {"project": bake(folder, lm_example="yes")}
    for name, job in (("mlp", run_benchmark), ("lm", run_lm_benchmark)):
        try:
            results[name] = job(results["project"], folder / f"{name}.json")
        except Exception as error:  # re-raised by the fixture of its tests
            results[name] = error
    return results


def result(benchmark_run, name: str):
    ran = benchmark_run.result(timeout=3600)[name]  # queued, then bounded by its own timeouts
    if isinstance(ran, Exception):
        raise ran
    return ran


@pytest.fixture(scope="module")
def report(benchmark_run) -> tuple[dict, str]:
    return result(benchmark_run, "mlp")


@pytest.fixture(scope="module")
def lm_report(benchmark_run) -> tuple[dict, str]:
    return result(benchmark_run, "lm")


def run_script(cmd: list[str], out: Path, timeout: float) -> tuple[dict, str]:
    """Run a benchmark script in its own session (its ranks too are stopped on timeout); its JSON and output."""
    # SIGTERM first on timeout: the script then kills the training processes it started in their own sessions.
    done = run(cmd, None, timeout, grace=20)
    assert done.returncode == 0, done.stdout[-4000:]
    return json.loads(out.read_text()), done.stdout


def run_benchmark(project: Path, out: Path) -> tuple[dict, str]:
    """One tiny MLP benchmark: the small config, 2 processes, one raw/bare/template round, 2 epochs (epoch 0
    untimed)."""
    cmd = [sys.executable, str(BENCH / "run.py"), "--configs", "small", "--procs", "2", "--repeats", "1",
           "--epochs", "2", "--project", str(project), "--json", str(out)]  # fmt: skip
    return run_script(cmd, out, timeout=240)


def run_lm_benchmark(project: Path, out: Path) -> tuple[dict, str]:
    """One tiny language-model benchmark on the CPU: lm.py's tiny size (2 blocks, width 64, context 64, 1,024 ids),
    32-true, eager, 1 process, one round of 2 epochs of 8 steps (epoch 0 untimed)."""
    cmd = [sys.executable, str(BENCH / "lm.py"), "--accelerator", "cpu", "--rounds", "1", "--project", str(project),
           "--json", str(out)]  # fmt: skip
    return run_script(cmd, out, timeout=240)


def test_report_has_one_row_with_every_figure(report):
    """The JSON row names its config and carries step times, ratios, start-up and wall time for all three sides."""
    data, _ = report
    (row,) = data["rows"]
    assert (row["config"], row["procs"], row["repeats"]) == ("small", 2, 1)
    for key in ("step_ms", "cpu_ms", "first_step_s", "wall_s"):
        for side in ("raw", "bare", "template"):
            assert row[f"{side}_{key}"]["median"] > 0, (side, key)
    step = {side: row[f"{side}_step_ms"]["median"] for side in ("raw", "bare", "template")}
    assert row["ratio"]["median"] == pytest.approx(step["template"] / step["raw"])
    assert row["bare_ratio"]["median"] == pytest.approx(step["bare"] / step["raw"])
    assert row["template_vs_bare"]["median"] == pytest.approx(step["template"] / step["bare"])
    # The overhead over raw DDP splits exactly into Lightning's part and the template's.
    parts = row["bare_overhead_ms"]["median"] + row["template_over_bare_ms"]["median"]
    assert parts == pytest.approx(row["overhead_ms"]["median"])
    assert row["cpu_ratio"]["median"] == pytest.approx(row["template_cpu_ms"]["median"] / row["raw_cpu_ms"]["median"])
    assert data["machine"]["cpus"] == os.cpu_count()


def test_epoch_zero_is_not_timed(report):
    """Epoch 1 alone is timed: 16 steps give 15 intervals between batch starts."""
    (row,) = report[0]["rows"]
    assert row["timed_steps"] == 15


def test_raw_loop_bare_lightning_and_template_end_with_the_same_weights(report):
    """Same model, data order, optimizer and seed: the final weights of all three are bit-identical (the READMEs
    say so; a sampler, loss or optimizer step that differed at all would show here)."""
    (row,) = report[0]["rows"]
    assert row["weight_diff"] == 0.0
    assert row["bare_weight_diff"] == 0.0


def test_markdown_table_is_printed(report):
    """stdout carries the results table with a `small` row for 2 processes."""
    _, text = report
    assert "| config | procs | raw ms/step | bare Lightning ms/step | template ms/step | ratio |" in text
    assert "| small | 2 |" in text


def test_gpu_peaks_come_from_the_library():
    """run.py takes MFU peaks from the library's throughput module, which knows a plain 'NVIDIA H200'."""
    throughput = importlib.import_module("ddpkit.scaling.throughput")
    assert throughput.peak_flops("NVIDIA H200", "bf16") == 989.5e12


def test_mlp_flops_count_matmuls_only():
    """64-128-128-10 MLP, batch 2: 6 FLOPs per weight and sample, 4 for the first layer."""
    weights = [64 * 128, 128 * 128, 128 * 10]
    assert mlp_train_flops(2, 64, 128, 2, 10) == 2 * (6 * sum(weights) - 2 * weights[0]) == 277504


def test_mfu_divides_by_every_device():
    """1 TFLOP per 0.5 s step on 4 devices of 1 TFLOP/s each is 50%."""
    assert mfu(1e12, 0.5, 1e12, 4) == pytest.approx(0.5)


# --- lm.py: the language model ------------------------------------------------------------------------------------


def template_module(name: str):
    """A module of the template's language-model example (lm/gpt.py, lm/data.py: no relative imports), loaded from
    the template's source without leaving a __pycache__ there (a bake would copy it)."""
    path = TEMPLATE / "{{cookiecutter.project_slug}}" / "{{cookiecutter.package_name}}" / "lm" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"template_lm_{name}", path)
    module = importlib.util.module_from_spec(spec)
    dont_write, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        spec.loader.exec_module(module)
    finally:
        sys.dont_write_bytecode = dont_write
    return module


def test_lm_report_has_every_figure(lm_report):
    """The JSON names the size (the tiny GPT: 169,728 parameters) and gives both sides' tokens/s, step and CPU time,
    start-up and wall time; MFU is None on the CPU; tokens/s is the timed window's tokens over its seconds, and the
    ratio is template / hand-written tokens/s."""
    data, _ = lm_report
    config, summary, (round_,) = data["config"], data["summary"], data["rounds"]
    assert (config["size"], config["params"], config["accelerator"]) == ("tiny", 169728, "cpu")
    assert (config["precision"], config["compile"], config["fused_adamw"], config["rounds"]) == (
        "32-true",
        False,
        False,
        1,
    )
    tokens_per_step = config["batch"] * config["block_size"]
    for side in ("raw", "template"):
        for key in ("tokens_per_s", "step_ms", "cpu_ms", "first_step_s", "wall_s"):
            assert summary[f"{side}_{key}"]["median"] > 0, (side, key)
        assert summary[f"{side}_mfu"] is None and round_[side]["mfu"] is None
        stats = round_[side]
        assert stats["tokens_per_s"] == pytest.approx(stats["timed_window_steps"] * tokens_per_step / stats["timed_s"])
    ratio = round_["template"]["tokens_per_s"] / round_["raw"]["tokens_per_s"]
    assert summary["ratio"]["median"] == pytest.approx(ratio)


def test_lm_summary_line_holds_every_figure(lm_report):
    """The last line printed is `lm-bench:` and key=value pairs without spaces, the JSON's figures; MFU n/a on CPU."""
    data, text = lm_report
    line = text.strip().splitlines()[-1]
    assert line.startswith("lm-bench: ")
    fields = dict(item.split("=", 1) for item in line.removeprefix("lm-bench: ").split(" "))
    assert set(fields) == {
        "device", "devices", "size", "params", "block_size", "batch", "precision", "compile", "rounds",
        "raw_tokens_per_s", "template_tokens_per_s", "ratio", "raw_mfu", "template_mfu", "max_weight_diff",
    }  # fmt: skip
    summary = data["summary"]
    assert int(fields["raw_tokens_per_s"]) == round(summary["raw_tokens_per_s"]["median"])
    assert int(fields["template_tokens_per_s"]) == round(summary["template_tokens_per_s"]["median"])
    assert float(fields["ratio"]) == pytest.approx(summary["ratio"]["median"], abs=1e-4)
    assert (fields["raw_mfu"], fields["template_mfu"], fields["params"]) == ("n/a", "n/a", "169728")


def test_lm_epoch_zero_is_not_timed(lm_report):
    """Only epoch 1 is timed: on each side one window of its 8 steps, and 7 intervals between its batch starts."""
    (round_,) = lm_report[0]["rounds"]
    for side in ("raw", "template"):
        assert (round_[side]["timed_window_steps"], round_[side]["timed_steps"]) == (8, 7), side


def test_lm_hand_written_loop_and_template_end_with_the_same_weights(lm_report):
    """Same GPT, token order, parameter groups, schedule and seed: the final weights are bit-identical (0.0 in every
    run measured, 32-true and bf16-mixed, 1 and 2 processes: docs/measurements.md); a different split, order,
    weight-decay group or learning rate would show here."""
    assert lm_report[0]["summary"]["max_weight_diff"] == 0.0


def test_lm_tokens_per_second_count_only_the_windows_after_epoch_zero():
    """tokens/s = steps x tokens per step / seconds summed over the windows of epochs >= 1; MFU = tokens/s x FLOPs
    per token / (peak x devices)."""
    record = {
        "windows": [[0, 0.0, 9.0, 4], [1, 10.0, 12.0, 4], [2, 13.0, 14.0, 4]],
        "starts": [[1, 10.0, 1.0], [1, 10.5, 1.2], [1, 11.0, 1.4]],
        "first_step_wall": 100.0,
    }
    stats = lm_module.side_stats({"record": record, "launch": 99.0, "end": 120.0}, 1000, 6.0, 1e6, 2)
    assert stats["tokens_per_s"] == pytest.approx(8 * 1000 / 3)
    assert stats["mfu"] == pytest.approx(8 * 1000 / 3 * 6.0 / 2e6)
    assert lm_module.side_stats({"record": record, "launch": 99.0, "end": 120.0}, 1000, 6.0, None, 2)["mfu"] is None


def test_window_timer_synchronizes_the_device_at_each_epochs_two_ends(monkeypatch):
    """On CUDA, WindowTimer synchronizes before it opens an epoch's window (first batch's start) and before it closes
    it (last batch's end), nowhere else; each window counts the epoch's batches."""
    log = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("sync"))
    timer, module = steptimer.WindowTimer(), SimpleNamespace(device=torch.device("cuda", 0))
    for epoch in (0, 1):
        trainer = SimpleNamespace(current_epoch=epoch, num_training_batches=3, global_rank=0)
        for i in range(3):
            timer.on_train_batch_start(trainer, module, None, i)
            log.append(f"start {i}")
            timer.on_train_batch_end(trainer, module, None, None, i)
            log.append(f"end {i}")
    assert log == 2 * ["sync", "start 0", "end 0", "start 1", "end 1", "start 2", "sync", "end 2"]
    assert [(w[0], w[3]) for w in timer.windows] == [(0, 3), (1, 3)]
    assert all(start <= end for _, start, end, _ in timer.windows)


@pytest.mark.parametrize("size", ["tiny", "gpt2"])
def test_lm_flops_per_token_are_measure_flops_count(size):
    """gpt_flops_per_token x context = Lightning's measure_flops of the example's GPT (meta device) for one sequence,
    at both sizes; the gpt2 size has GPT-2 small's 124,439,808 parameters (tied embedding and head)."""
    layers, d_model, heads, block, vocab = lm_module.SIZES[size]
    with torch.device("meta"):
        gpt, x = template_module("gpt").GPT(vocab, block, layers, d_model, heads), torch.zeros(1, block).long()
    assert gpt_flops_per_token(layers, d_model, vocab, block) * block == measure_flops(gpt, lambda: gpt(x), torch.sum)
    params = sum(p.numel() for p in gpt.parameters())
    assert params == {"tiny": 169_728, "gpt2": 124_439_808}[size]


@pytest.mark.parametrize("size", ["tiny", "gpt2"])
def test_lm_token_file_cuts_into_exactly_the_sequences_asked_for(tmp_path, size):
    """At each size's schedule, lm.py's token file and val_fraction give the hand-written loop's split exactly the
    training and validation sequences asked for, with ids below the vocabulary and above 255 (two bytes each)."""
    _, _, _, block, vocab = lm_module.SIZES[size]
    per_device, steps, _ = lm_module.SCHEDULES[size]
    fraction = lm_module.token_file(tmp_path / "tokens.bin", per_device * steps, per_device, block, vocab)
    train, val = lm_raw.splits(tmp_path / "tokens.bin", block, fraction)
    assert (len(train), len(val)) == (per_device * steps, per_device)
    ids = torch.cat([train.tensors[0].flatten(), val.tensors[1].flatten()])
    assert 255 < ids.max() < vocab and ids.min() >= 0


def test_lm_hand_written_split_is_the_example_data_modules(tmp_path):
    """The hand-written loop cuts a token file into the same (input, target) sequences as the example's
    TextDataModule with token_format uint16, training and validation."""
    fraction = lm_module.token_file(tmp_path / "tokens.bin", 32, 4, 64, 1024)
    text_data = template_module("data").TextDataModule
    dm = text_data(
        4, block_size=64, val_fraction=fraction, text_path=str(tmp_path / "tokens.bin"), token_format="uint16"
    )
    dm.setup("fit")
    train, val = lm_raw.splits(tmp_path / "tokens.bin", 64, fraction)
    for ours, theirs in ((train, dm.train_set), (val, dm.val_set)):
        assert len(ours.tensors) == len(theirs.tensors) == 2
        assert all(torch.equal(a, b) for a, b in zip(ours.tensors, theirs.tensors, strict=True))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--accelerator", "cpu", "--batch", "6", "--devices", "4"], "--batch 6 does not divide over 4 devices"),
        (["--accelerator", "cpu", "--epochs", "1"], "need --epochs >= 2, --steps >= 2, --rounds >= 1, --devices >= 1"),
        (
            ["--accelerator", "cpu", "--vocab-size", "70000"],
            "--vocab-size must be in 1..65536 (the token file holds uint16 ids)",
        ),
    ],
)
def test_lm_bad_arguments_stop_with_one_error_line(capsys, argv, message):
    """Arguments lm.py cannot run with: exit status 2 and an `error:` line saying why, before anything starts."""
    with pytest.raises(SystemExit) as stopped:
        lm_module.parse(argv)
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f"error: {message}")
