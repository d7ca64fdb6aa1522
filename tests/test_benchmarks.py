"""The benchmark in benchmarks/: it runs and reports, and its MFU arithmetic. No timing is asserted."""

import importlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
mfu_module = importlib.import_module("mfu")  # benchmarks/mfu.py
run_module = importlib.import_module("run")  # benchmarks/run.py
mfu, mlp_train_flops = mfu_module.mfu, mfu_module.mlp_train_flops


@pytest.fixture(scope="module")
def report(benchmark_run) -> tuple[dict, str]:
    return benchmark_run.result(timeout=3600)  # queued, then bounded by its own timeouts


def run_benchmark(out: Path) -> tuple[dict, str]:
    """One tiny benchmark: the small config, 2 processes, one raw/bare/template round, 2 epochs (epoch 0 untimed).
    Started in the background (tests/conftest.py, `benchmark_run`): nothing here is asserted about its times."""
    cmd = [sys.executable, str(BENCH / "run.py"), "--configs", "small", "--procs", "2", "--repeats", "1",
           "--epochs", "2", "--json", str(out)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        # SIGTERM first: run.py then kills the training processes it started in their own sessions.
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            text, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            text, _ = proc.communicate()
        raise AssertionError(f"benchmark timed out:\n{text[-4000:]}") from None
    assert proc.returncode == 0, text[-4000:]
    return json.loads(out.read_text()), text


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
    throughput = importlib.import_module("ddpkit.throughput")
    assert throughput.peak_flops("NVIDIA H200", "bf16") == 989.5e12


def test_mlp_flops_count_matmuls_only():
    """64-128-128-10 MLP, batch 2: 6 FLOPs per weight and sample, 4 for the first layer."""
    weights = [64 * 128, 128 * 128, 128 * 10]
    assert mlp_train_flops(2, 64, 128, 2, 10) == 2 * (6 * sum(weights) - 2 * weights[0]) == 277504


def test_mfu_divides_by_every_device():
    """1 TFLOP per 0.5 s step on 4 devices of 1 TFLOP/s each is 50%."""
    assert mfu(1e12, 0.5, 1e12, 4) == pytest.approx(0.5)
