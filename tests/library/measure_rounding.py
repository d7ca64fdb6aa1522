"""Measure how far summation order alone moves a model's float64 weights, beside 1 vs 2 devices (not a test).

    python tests/library/measure_rounding.py families.ResNet18 0 1 2 [--fp32] [--model.norm group --data families.ImageData ...]

For each seed: 1 device, 1 device x 4 micro-batches and 1 device with reversed batches (the suite's rounding
references), 2 devices, all float64 (float32 with --fp32), 2 epochs of test_model_families.py's data; prints per seed 1 vs 2 devices,
each rounding reference (bounds.rounding), the factor 1 vs 2 needs over it, and the tensors that pass only
at rounding level.
The numbers behind ROUNDING_FACTOR in ddpkit/testing/check_parity.py (docs/measurements.md).
"""

import math
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ddpkit.parity import ROUNDING_FACTOR, load_weights, weight_diffs
from ddpkit.testing.bounds import rounding
from ddpkit.testing.helpers import finish, start

HERE = Path(__file__).resolve().parent
# test_model_families.py's data: 4 global batches of 32 per epoch (the suite's micro-batches: 8).
DATA = ["--data", "families.SmallToyData", "--data.global_batch_size", "32", "--data.train_size", "128"]


def fit(root: Path, model: str, seed: int, devices: int, extra: list[str], precision: str = "64-true") -> Path:
    """One fit of `model` under `root` in `precision`; returns its last checkpoint."""
    cmd = [sys.executable, "-m", "ddpkit.testing.toy", "fit", "--model", model, *DATA]
    cmd += ["--seed_everything", str(seed), "--trainer.devices", str(devices), "--trainer.accelerator", "cpu"]
    cmd += ["--trainer.precision", precision, "--trainer.max_epochs", "2", "--trainer.enable_progress_bar", "false"]
    cmd += ["--doctor.enabled", "false", "--trainer.default_root_dir", str(root), *extra]
    result = finish(start(cmd, HERE, {"PYTHONPATH": str(HERE), "OMP_NUM_THREADS": "1"}), timeout=900)
    assert result.returncode == 0, result.stdout[-3000:]
    return root / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"


def ratio(a: float, b: float) -> float:
    return a / b if b else (0.0 if a == 0 else math.inf)


class Checkpoint:
    """A finished run as bounds.rounding reads it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def weights(self) -> dict:
        return load_weights(self.path)


def main() -> None:
    args = sys.argv[1:]
    tag, precision = ("fp32", "32-true") if "--fp32" in args else ("fp64", "64-true")
    model, seeds, extra = args[0], [], []
    for arg in (a for a in args[1:] if a != "--fp32"):
        (seeds if arg.isdigit() and not extra else extra).append(arg)
    base = Path(tempfile.mkdtemp(prefix="rounding-"))
    for seed in map(int, seeds):
        runs = {
            f"1dev-{tag}": (1, extra),
            f"1dev-acc4-{tag}": (1, [*extra, "--data.micro_batch_size", "8"]),
            f"1dev-reversed-{tag}": (1, [*extra, "--trainer.callbacks+=ddpkit.testing.parity_probe.ReversedBatches"]),
            "2": (2, extra),
        }
        with ThreadPoolExecutor(len(runs)) as pool:
            paths = {n: pool.submit(fit, base / f"{seed}-{n}", model, seed, *runs[n], precision) for n in runs}
        runs = {name: Checkpoint(path.result()) for name, path in paths.items()}
        ddp = weight_diffs(runs[f"1dev-{tag}"].weights(), runs["2"].weights())
        print(
            f"{model} seed {seed}: 1 vs 2 worst max_rel {ddp[0].max_rel:.3g}, max_abs {max(d.max_abs for d in ddp):.3g}"
        )
        for how, micro in (("4 micro-batches", 8), ("reversed batches", None)):
            ref = rounding(runs, {"micro_batch_size": micro}, tag)
            # The factor each tensor needs to pass on max_rel or at rounding level (fixed bound ignored); the worst.
            needed = max(min(ratio(d.max_rel, ref.max_rel), ratio(d.max_abs, ref.max_abs)) for d in ddp)
            level = ROUNDING_FACTOR * ref.max_abs
            by_abs = [
                d.name for d in ddp if d.max_rel > max(ROUNDING_FACTOR * ref.max_rel, 1e-12) and d.max_abs <= level
            ]
            print(f"  {how}: max_rel {ref.max_rel:.3g}, max_abs {ref.max_abs:.3g}; factor needed {needed:.3g};")
            print(f"    over the max_rel bound, passing at rounding level only: {by_abs}")
        print("  worst 1 vs 2:", ", ".join(str(d) for d in ddp[:3]))


if __name__ == "__main__":
    main()
