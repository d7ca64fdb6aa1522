"""Measure where a short fit of a baked project's example learns, beside what the lr finder suggests (not a test).

    python tests/library/measure_lr_finder.py PROJECT [--seeds 0 1 2] [--steps 32] [--finder]
    python tests/library/measure_lr_finder.py PROJECT --parity [--seeds 0 1 2] [--batches 64 128]

In PROJECT (a baked project, its root), for each seed: a fit of --steps optimizer steps at each lr of a grid
(10^-4 .. 10^0.5 in quarter decades), printing the validation loss it ends with; with --finder, also
`python -m ddpkit.lr_finder` on 1 device in float64, printing its suggestion. Fits run in this process, one after
the other (1 device: Lightning launches nothing). The numbers behind test_lr_finder.py's SENSIBLE range.
With --parity, for each seed and global batch: the finder on 1 device and on 2 devices x 2 micro-batches in
float64, printing the largest relative difference of their losses and both suggestions: the numbers behind
test_lr_finder.py's CURVE_BOUND (docs/measurements.md).
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

GRID = [10 ** (e / 4) for e in range(-16, 3)]


def short_fit(project: Path, root: Path, lr: float, seed: int, steps: int) -> float:
    """val/loss after `steps` optimizer steps at `lr` (float64, 1 device)."""
    sys.path.insert(0, str(project))
    from main import main as project_main  # the project's own main.py

    args = ["fit", "--seed_everything", str(seed), "--trainer.max_steps", str(steps), "--trainer.accelerator", "cpu"]
    args += ["--trainer.precision", "64-true", "--model.optimizer.lr", repr(lr), "--doctor.enabled", "false"]
    args += ["--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(root)]
    args += ["--trainer.enable_model_summary", "false"]
    cli = project_main(args)
    return float(cli.trainer.callback_metrics["val/loss"])


def finder(project: Path, out: Path, seed: int, devices: int = 1, fit_args: tuple[str, ...] = ()) -> dict:
    """The curve of `python -m ddpkit.lr_finder` on `devices` devices in float64 (lr_find.json)."""
    cmd = [sys.executable, "-m", "ddpkit.tune.lr_finder", "--devices", str(devices), "--out", str(out), "--"]
    cmd += ["--seed_everything", str(seed), "--trainer.precision", "64-true", "--trainer.accelerator", "cpu"]
    cmd += ["--trainer.enable_progress_bar", "false", *fit_args]
    subprocess.run(cmd, cwd=project, check=True, capture_output=True, timeout=900)
    return json.loads((out / "lr_find.json").read_text())


def parity(project: Path, tmp: Path, seed: int, batch: int) -> None:
    data = ("--data.global_batch_size", str(batch))
    one = finder(project, tmp / f"one{seed}-{batch}", seed, 1, data)
    two = finder(project, tmp / f"two{seed}-{batch}", seed, 2, (*data, "--data.micro_batch_size", str(batch // 4)))
    worst = max(abs(a - b) / abs(a) for a, b in zip(one["loss"], two["loss"], strict=True))
    print(
        f"seed {seed} batch {batch}: {len(one['loss'])} steps ({one['stopped']}); 1 vs 2x2 max rel {worst:.2e}; "
        f"suggestions {one['suggestion']:.4g} {two['suggestion']:.4g}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("project", type=Path)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--finder", action="store_true")
    parser.add_argument("--parity", action="store_true")
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 128])
    args = parser.parse_args()
    project = args.project.resolve()
    os.chdir(project)
    sys.argv[1:] = []  # LightningCLI warns when it is given args beside a command line
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            if args.parity:
                for batch in args.batches:
                    parity(project, Path(tmp), seed, batch)
                continue
            if args.finder:
                suggested = finder(project, Path(tmp) / f"find{seed}", seed)["suggestion"]
                print(f"seed {seed}: finder suggests {suggested:.4g}", flush=True)
            for lr in GRID:
                loss = short_fit(project, Path(tmp) / f"fit{seed}-{lr}", lr, seed, args.steps)
                print(f"seed {seed} lr {lr:.3g} (10^{math.log10(lr):.2f}): val/loss {loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
