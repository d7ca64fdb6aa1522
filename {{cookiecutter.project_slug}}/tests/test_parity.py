"""1 device and 2 devices train the same model: weights, logged losses, metrics, data shards, files, resumes.

Every test reads one session-scoped set of real `main.py` runs (`cpu_runs`): the
default config, shuffling on, seed 42, global batch 64, 2 epochs = 32 optimizer
steps across an epoch boundary. DDP runs on CPU processes over gloo; the CUDA/NCCL
variants at the end run only where 2 GPUs are visible.

Run the same checks on your own model or data by appending arguments to every run:
    PARITY_ARGS="--model my_model.MyModel" pytest tests/test_parity.py
"""

import json
import os
import re
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import MAIN, finish, kill, start

from {{ cookiecutter.package_name }}.parity import diff, load_weights, read_scalars, report, scalar_diffs, weight_diffs
from {{ cookiecutter.package_name }}.parity import main as compare_main

TESTS = Path(__file__).resolve().parent
# The bundled digits: 1,079 training samples give 16 global batches of 64 per epoch (the tail is dropped);
# validation and test hold 359 samples each. With your own data module, set these four numbers.
TRAIN_SIZE, GLOBAL_BATCH, STEPS_PER_EPOCH, EVAL_SIZE = 1079, 64, 16, 359
STEPS = 2 * STEPS_PER_EPOCH  # every run trains 2 epochs
# Bounds on max |a - b| / max |a| per weight tensor and per logged tag, 1 device vs 2 devices after
# STEPS steps. Measured on CPU (README): float64 ~1e-15, float32 ~2e-6 (AdamW turns rounding-level
# gradient differences into slightly larger weight differences). The GPU bounds are not measured here.
BOUNDS = {
    ("cpu", "64-true"): 1e-12,
    ("cpu", "32-true"): 1e-5,
    ("gpu", "32-true"): 1e-4,
    ("gpu", "bf16-mixed"): 5e-2,
}
# torchmetrics keeps its sums in float32 even in a float64 run; adding 359 losses in two parts and
# adding them at once may round apart (measured: equal in float64 runs, 8e-8 in float32 runs).
METRIC_STATE_ROUNDING = 1e-6
FLOAT32_STORAGE = 2.5e-7  # TensorBoard stores float32: two equal-up-to-1e-15 doubles may round 1 ulp apart
RUN_ARGS = (
    "--trainer.max_epochs",
    "2",
    "--trainer.log_every_n_steps",
    "1",  # every step's loss reaches the logger
    "--trainer.enable_progress_bar",
    "false",
    "--trainer.enable_model_summary",
    "false",
    "--trainer.callbacks+=parity_probe.Probe",
    # An epoch-end checkpoint of every epoch, for the resume tests.
    "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
    "--trainer.callbacks.save_top_k=-1",
    *shlex.split(os.environ.get("PARITY_ARGS", "")),
)
EPOCH_0_CKPT = f"epoch=0-step={STEPS_PER_EPOCH}.ckpt"


@dataclass
class Run:
    """One finished run of main.py under its own root directory."""

    root: Path

    @property
    def version(self) -> Path:
        return self.root / "lightning_logs" / "version_0"

    def checkpoint(self, name: str = "last.ckpt") -> Path:
        return self.version / "checkpoints" / name

    def weights(self) -> dict[str, torch.Tensor]:
        return load_weights(self.checkpoint())

    def probe(self, stage: str = "fit", rank: int = 0) -> dict:
        return json.loads((self.root / "probe" / f"{stage}-rank{rank}.json").read_text())


def main_cmd(*args: str) -> list[str]:
    return [sys.executable, str(MAIN), *args]


def torchrun_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(MAIN), *args]


def fit(accelerator: str, devices: int, precision: str, *extra: str) -> list[str]:
    return [
        "fit",
        *("--trainer.accelerator", accelerator, "--trainer.devices", str(devices)),
        *("--trainer.precision", precision, *RUN_ARGS, *extra),
    ]


def run_all(commands: dict[str, list[str]], base: Path, timeout: float = 420) -> dict[str, Run]:
    """Run the commands at once, each in base/<name>, within `timeout` seconds for all; fail (and kill
    the rest) on any non-zero exit."""
    # PYTHONPATH: main.py imports the probe from tests/. One thread per process: runs share the cores.
    path = [str(TESTS), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {"PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": "1"}
    procs = {}
    try:
        for name, cmd in commands.items():
            root = base / name
            root.mkdir()
            procs[name] = start([*cmd, "--trainer.default_root_dir", str(root)], root, env)
        deadline = time.monotonic() + timeout
        for name, proc in procs.items():
            result = finish(proc, max(1.0, deadline - time.monotonic()))
            assert result.returncode == 0, f"run {name} exited {result.returncode}:\n{result.stdout[-4000:]}"
    finally:
        for proc in procs.values():
            kill(proc)
    return {name: Run(base / name) for name in commands}


@pytest.fixture(scope="session")
def cpu_runs(tmp_path_factory) -> dict[str, Run]:
    """Every CPU run the tests compare, in two waves: the second starts from the first's checkpoints."""
    base = tmp_path_factory.mktemp("parity")
    runs = run_all(
        {
            "1dev-fp64": main_cmd(*fit("cpu", 1, "64-true")),
            "2dev-fp64": main_cmd(*fit("cpu", 2, "64-true")),  # Lightning's own launcher
            "1dev-fp32": main_cmd(*fit("cpu", 1, "32-true")),
            "2dev-fp32": main_cmd(*fit("cpu", 2, "32-true")),
            "torchrun-fp64": torchrun_cmd(*fit("cpu", 2, "64-true")),
        },
        base,
    )
    one, two = runs["1dev-fp64"], runs["2dev-fp64"]
    test = ("test", "--trainer.accelerator", "cpu", "--trainer.precision", "64-true", *RUN_ARGS)
    runs |= run_all(
        {
            "resume-2to1": main_cmd(*fit("cpu", 1, "64-true", "--ckpt_path", str(two.checkpoint(EPOCH_0_CKPT)))),
            "resume-1to2": main_cmd(*fit("cpu", 2, "64-true", "--ckpt_path", str(one.checkpoint(EPOCH_0_CKPT)))),
            "test-1dev": main_cmd(*test, "--trainer.devices", "1", "--ckpt_path", str(one.checkpoint())),
            "test-2dev": main_cmd(*test, "--trainer.devices", "2", "--ckpt_path", str(one.checkpoint())),
        },
        base,
    )
    return runs


def assert_weights_close(a: Run, b: Run, bound: float) -> None:
    diffs = weight_diffs(a.weights(), b.weights())
    assert diffs[0].max_rel <= bound, f"{b.root.name} vs {a.root.name}, bound {bound:g}:\n{report(diffs)}"


def assert_scalars_close(a: Run, b: Run, bound: float) -> None:
    diffs = scalar_diffs(read_scalars(a.version), read_scalars(b.version))
    assert diffs[0].max_rel <= bound, f"{b.root.name} vs {a.root.name}, bound {bound:g}:\n{report(diffs)}"


@pytest.mark.parametrize("precision", ["fp64", "fp32"])
def test_weights_match_1_vs_2_devices(cpu_runs, precision):
    """After 32 steps over an epoch boundary every parameter matches within the precision's bound."""
    one, two = cpu_runs[f"1dev-{precision}"], cpu_runs[f"2dev-{precision}"]
    for run in (one, two):
        assert torch.load(run.checkpoint(), weights_only=False)["global_step"] == STEPS
    assert_weights_close(one, two, BOUNDS["cpu", "64-true" if precision == "fp64" else "32-true"])


def test_both_ranks_end_bit_identical(cpu_runs):
    """DDP keeps the replicas identical: rank 0 and rank 1 hold the same float32 weights, bit for bit."""
    probe = cpu_runs["2dev-fp32"].root / "probe"
    rank0, rank1 = (torch.load(probe / f"fit-rank{r}.pt") for r in (0, 1))
    assert rank0.keys() == rank1.keys() and all(torch.equal(rank0[k], rank1[k]) for k in rank0)


@pytest.mark.parametrize("precision", ["fp64", "fp32"])
def test_logged_scalars_match_every_step(cpu_runs, precision):
    """Every TensorBoard tag at every step (train/loss x 32, val metrics x 2) matches 1 device."""
    one, two = cpu_runs[f"1dev-{precision}"], cpu_runs[f"2dev-{precision}"]
    logged = read_scalars(two.version)
    assert sorted(logged["train/loss"]) == list(range(STEPS)) and len(logged["val/acc"]) == 2
    bound = BOUNDS["cpu", "64-true" if precision == "fp64" else "32-true"]
    assert_scalars_close(one, two, max(bound, FLOAT32_STORAGE))


def test_logged_train_loss_is_the_global_loss(cpu_runs):
    """Both ranks log the synced loss, equal to 1 device's at full float64 precision on every step."""
    one, two = cpu_runs["1dev-fp64"], cpu_runs["2dev-fp64"]
    reference = one.probe()["train"]
    rank0, rank1 = two.probe(rank=0)["train"], two.probe(rank=1)["train"]
    assert rank0 == rank1  # synced: the same value on each rank, not each rank's own batch loss
    assert [r["step"] for r in rank0] == [r["step"] for r in reference] == list(range(1, STEPS + 1))
    pairs = zip(reference, rank0, strict=True)
    worst = max(abs(a["train/loss"] - b["train/loss"]) / abs(a["train/loss"]) for a, b in pairs)
    assert worst <= BOUNDS["cpu", "64-true"]


def eval_records(cpu_runs: dict[str, Run], stage: str) -> tuple[dict, list[dict]]:
    """A stage's metrics on 1 device and on each of 2 ranks: the last validation of the fits, or the test runs."""
    if stage == "val":
        one, two = cpu_runs["1dev-fp64"], cpu_runs["2dev-fp64"]
        return one.probe()["val"][-1], [two.probe(rank=r)["val"][-1] for r in (0, 1)]
    one, two = cpu_runs["test-1dev"], cpu_runs["test-2dev"]
    return one.probe("test")["test"], [two.probe("test", rank=r)["test"] for r in (0, 1)]


@pytest.mark.parametrize("stage", ["val", "test"])
def test_eval_metrics_count_each_sample_once(cpu_runs, stage):
    """359 samples split 180 + 179 over 2 ranks, no padding: both ranks report 1 device's metrics."""
    one, ranks = eval_records(cpu_runs, stage)
    assert one["samples"] == EVAL_SIZE and [r["samples"] for r in ranks] == [(EVAL_SIZE + 1) // 2, EVAL_SIZE // 2]
    acc, loss = f"{stage}/acc", f"{stage}/loss"
    assert ranks[0] | {"samples": 0} == ranks[1] | {"samples": 0}  # synced: equal on every rank
    assert ranks[0][acc] == one[acc]  # a duplicated or dropped sample would change the count
    assert abs(ranks[0][loss] - one[loss]) <= METRIC_STATE_ROUNDING * one[loss]


def test_each_sample_once_per_epoch_in_disjoint_shards(cpu_runs):
    """Per epoch, rank 0 and rank 1 receive disjoint halves of 16 x 64 distinct training samples."""
    two = cpu_runs["2dev-fp64"]
    for epoch in ("0", "1"):
        shards = [sum(two.probe(rank=r)["batches"][epoch], []) for r in (0, 1)]
        assert len(shards[0]) == len(shards[1]) == STEPS_PER_EPOCH * GLOBAL_BATCH // 2
        assert not set(shards[0]) & set(shards[1])
        seen = set(shards[0] + shards[1])
        assert len(seen) == STEPS_PER_EPOCH * GLOBAL_BATCH and seen <= set(range(TRAIN_SIZE))


def test_global_batches_equal_1_device_and_reshuffle_each_epoch(cpu_runs):
    """Step k's samples on 2 ranks, put together, are step k's samples on 1 device; epoch 2 has a new order."""
    one = cpu_runs["1dev-fp64"].probe()["batches"]
    two = [cpu_runs["2dev-fp64"].probe(rank=r)["batches"] for r in (0, 1)]
    for epoch in ("0", "1"):
        joined = [set(a + b) for a, b in zip(two[0][epoch], two[1][epoch], strict=True)]
        assert joined == [set(batch) for batch in one[epoch]] and len(joined) == STEPS_PER_EPOCH
    assert two[0]["0"] != two[0]["1"] and two[1]["0"] != two[1]["1"]  # set_epoch reached the sampler
    assert [set(b) for b in one["0"]] != [set(b) for b in one["1"]]


def files_written(run: Run) -> list[str]:
    """Every file a run wrote outside the probe's, with the run-specific parts of the names cut
    (TensorBoard's time, host and process; the best checkpoint's epoch and score)."""
    names = (str(p.relative_to(run.root)) for p in run.root.rglob("*") if p.is_file())
    cut = (re.sub(r"best-.*", "best-*", re.sub(r"tfevents\..*", "tfevents", n)) for n in names)
    return sorted(n for n in cut if not n.startswith("probe"))


def test_2_devices_write_one_set_of_files(cpu_runs):
    """2 ranks write exactly one log dir, one config.yaml and one set of checkpoints, like 1 device."""
    one, two = cpu_runs["1dev-fp64"], cpu_runs["2dev-fp64"]
    written = files_written(two)
    assert written == files_written(one)
    checkpoints = [n for n in written if "/checkpoints/" in n]
    names = [n.rsplit("/", 1)[1] for n in checkpoints]
    assert names == ["best-*", EPOCH_0_CKPT, f"epoch=1-step={STEPS}.ckpt", "last.ckpt"]
    assert set(written) - set(checkpoints) == {
        f"lightning_logs/version_0/{n}"
        for n in ("config.yaml", "hparams.yaml", "events.out.tfevents", "doctor.json")  # doctor: rank 0 only
    }
    # TensorBoard names its file after the writing process: rank 0.
    (events,) = two.version.glob("events.out.tfevents.*")
    assert events.name.split(".")[-2] == str(two.probe(rank=0)["pid"])


@pytest.mark.parametrize("run", ["resume-2to1", "resume-1to2"])
def test_epoch_end_checkpoint_resumes_on_other_device_count(cpu_runs, run):
    """The epoch-1 checkpoint of 1 (2) devices, resumed on 2 (1), trains epoch 2 to the uninterrupted weights."""
    resumed = cpu_runs[run]
    assert torch.load(resumed.checkpoint(), weights_only=False)["global_step"] == STEPS
    assert len(resumed.probe()["train"]) == STEPS // 2  # only the second epoch was trained
    assert_weights_close(cpu_runs["1dev-fp64"], resumed, BOUNDS["cpu", "64-true"])


def test_torchrun_matches_lightning_launcher_and_1_device(cpu_runs):
    """`torchrun --nproc_per_node=2 main.py fit` runs 2 ranks and trains the same weights and logs."""
    torchrun = cpu_runs["torchrun-fp64"]
    assert [torchrun.probe(rank=r)["world_size"] for r in (0, 1)] == [2, 2]
    assert_weights_close(cpu_runs["1dev-fp64"], torchrun, BOUNDS["cpu", "64-true"])
    assert_weights_close(cpu_runs["2dev-fp64"], torchrun, BOUNDS["cpu", "64-true"])
    assert_scalars_close(cpu_runs["1dev-fp64"], torchrun, FLOAT32_STORAGE)


def test_diff_is_relative_to_the_tensor_scale_and_nan_never_passes():
    """max_rel divides by the reference's largest entry, so a near-zero entry cannot inflate it."""
    d = diff("w", torch.tensor([2.0, 1e-9]), torch.tensor([2.0, 2e-9]))
    assert d.max_abs == pytest.approx(1e-9) and d.max_rel == pytest.approx(5e-10)
    assert not diff("w", torch.ones(2), torch.tensor([1.0, float("nan")])).max_rel <= 1.0
    with pytest.raises(ValueError, match=r"shape \(2,\) vs \(3,\)"):
        diff("w", torch.ones(2), torch.ones(3))


def test_compare_command_passes_and_fails_on_its_bound(cpu_runs, capsys):
    """`python -m <package>.parity A B` prints the worst tensors and tags and exits 1 above --rel-tol."""
    fp32, fp64 = (str(cpu_runs[n].version) for n in ("1dev-fp32", "1dev-fp64"))
    assert compare_main([fp32, fp32, "--rel-tol", "0"]) == 0
    assert compare_main([fp64, fp32, "--rel-tol", "1e-9"]) == 1  # float32 vs float64 training: ~1e-6 apart
    out = capsys.readouterr().out
    worst = weight_diffs(cpu_runs["1dev-fp64"].weights(), cpu_runs["1dev-fp32"].weights())[0]
    assert f"  {worst}\n" in out and "train/loss" in out and out.count("FAIL") == 1


GPUS = torch.cuda.device_count()
needs_2_gpus = pytest.mark.skipif(GPUS < 2, reason=f"CUDA/NCCL parity needs 2 visible GPUs, found {GPUS}")
GPU_PRECISIONS = ["32-true", "bf16-mixed"]


@pytest.fixture(scope="session")
def gpu_runs(tmp_path_factory) -> dict[str, Run]:
    """1-GPU and 2-GPU runs per precision, one after another (they share the GPUs)."""
    base = tmp_path_factory.mktemp("parity-gpu")
    runs = {}
    for precision in GPU_PRECISIONS:
        for devices in (1, 2):
            name = f"{devices}gpu-{precision}"
            runs |= run_all({name: main_cmd(*fit("gpu", devices, precision))}, base)
    return runs


@needs_2_gpus
@pytest.mark.parametrize("precision", GPU_PRECISIONS)
def test_gpu_weights_match_1_vs_2_gpus(gpu_runs, precision):
    """On CUDA/NCCL, 1 and 2 GPUs end within the precision's bound on every parameter."""
    assert_weights_close(gpu_runs[f"1gpu-{precision}"], gpu_runs[f"2gpu-{precision}"], BOUNDS["gpu", precision])


@needs_2_gpus
@pytest.mark.parametrize("precision", GPU_PRECISIONS)
def test_gpu_logged_scalars_match_1_vs_2_gpus(gpu_runs, precision):
    """On CUDA/NCCL, every logged tag at every step matches within the precision's bound."""
    one, two = gpu_runs[f"1gpu-{precision}"], gpu_runs[f"2gpu-{precision}"]
    assert_scalars_close(one, two, max(BOUNDS["gpu", precision], FLOAT32_STORAGE))
