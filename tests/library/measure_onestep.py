"""Measure one optimizer step from the same saved state on 1 and 2 devices against its rounding (not a test).

    python tests/library/measure_onestep.py MODEL DATA SEEDS... [-- main.py arguments]
    python tests/library/measure_onestep.py --report FOLDER...

For each seed: a float64 1-device fit of test_model_families.py's data (4 global batches of 32 an epoch) that saves its
state after global batches 1, 4 and 5 (as the suite's: weights alone, in float32) and its gradients' peaks, then the
one-step runs (parity_probe.OneStep) of global batches 0 (trained, not judged), 1, 4 and 5: in float32 and in bf16-mixed
on 1 and on 2 devices, and on 1 device in float64 (each step's own rounding). Prints, per precision and kind (gradient,
after the step, logged), the factor over that rounding which 2 devices needed (check_onestep.step_verdicts; the worst
tensor of any point): the numbers behind ONE_STEP_FACTOR (docs/measurements.md, "The one-step check"). --report prints
them again for the folders of earlier runs.
"""

import math
import sys
import tempfile
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from procs import TESTS, finish, start

from ddpkit.testing.check_onestep import ONE_STEP_FACTOR, step_verdicts
from ddpkit.testing.gradient_peaks import NO_GRADIENT_FILE

SIZES = ["--data.global_batch_size", "32", "--data.train_size", "128"]
N = 4  # global batches an epoch
RUNS = {"fp32-1": ("32-true", 1), "fp32-2": ("32-true", 2), "bf16-1": ("bf16-mixed", 1), "bf16-2": ("bf16-mixed", 2),
        "exact": ("64-true", 1)}  # fmt: skip


def fit(root: Path, model: str, data: str, seed: int, devices: int, precision: str, extra: list[str]) -> Path:
    cmd = [sys.executable, "-m", "ddpkit.testing.toy", "fit", "--model", model, "--data", data, *SIZES]
    cmd += ["--seed_everything", str(seed), "--trainer.devices", str(devices), "--trainer.accelerator", "cpu"]
    cmd += ["--trainer.precision", precision, "--trainer.max_epochs", "2", "--trainer.enable_progress_bar", "false"]
    cmd += ["--doctor.enabled", "false", "--trainer.default_root_dir", str(root), *extra]
    result = finish(start(cmd, TESTS, {"OMP_NUM_THREADS": "1"}), timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:]
    return root


def measure(model: str, data: str, seeds: list[int], extra: list[str]) -> Path:
    base = Path(tempfile.mkdtemp(prefix=f"onestep-{model.split('.')[-1]}-"))
    for seed in seeds:
        saving = ["--trainer.callbacks+=ddpkit.testing.parity_probe.Probe", "--trainer.callbacks.resumable=true",
                  f"--trainer.callbacks.save_at_steps=[1,{N},{N + 1}]",
                  f"--trainer.callbacks.weights_at=[1,{N},{N + 1}]",
                  "--trainer.callbacks+=ddpkit.testing.gradient_peaks.GradientPeaks", *extra]  # fmt: skip
        states = fit(base / f"{seed}-fp64", model, data, seed, 1, "64-true", saving) / "probe"
        replay = ["--trainer.callbacks+=ddpkit.testing.parity_probe.OneStep", f"--trainer.callbacks.states={states}",
                  f"--trainer.callbacks.steps_per_epoch={N}", "--trainer.limit_val_batches", "0", *extra]  # fmt: skip
        with ThreadPoolExecutor(2) as pool:
            runs = [pool.submit(fit, base / f"{seed}-{n}", model, data, seed, *RUNS[n][::-1], replay) for n in RUNS]
        for run in runs:
            run.result()  # a failed run says so
    return base


def report(bases: list[Path]) -> None:
    worst: dict = defaultdict(lambda: (0.0, ""))
    for base in bases:
        model = base.name.split("-")[1]
        for seed in sorted(p.name.split("-")[0] for p in base.glob("*-fp64")):
            masks = torch.load(base / f"{seed}-fp64" / "probe" / NO_GRADIENT_FILE)  # the 1-device run's alone
            exact = torch.load(base / f"{seed}-exact" / "probe" / "onestep.pt", weights_only=False)
            for tag in ("fp32", "bf16"):
                one, two = (torch.load(base / f"{seed}-{tag}-{n}" / "probe" / "onestep.pt", weights_only=False)
                            for n in (1, 2))  # fmt: skip
                # With the check's own masks (elements without gradient), the factor each needed.
                for k, what, v in step_verdicts(one, two, exact, tag, masks):
                    if v.rounding:
                        continue
                    needed = ONE_STEP_FACTOR * v.apart / v.bound if v.bound else (math.inf if v.apart else 0.0)
                    if not needed <= worst[model, tag, what][0]:
                        worst[model, tag, what] = (needed, f"seed {seed}, global batch {k}: {v}")
    for (model, tag, what), (needed, where) in sorted(worst.items()):
        print(f"{model:20} {tag} {what:9} needed {needed:7.3g}  ({where})")


def main() -> None:
    args = sys.argv[1:]
    if args[0] == "--report":
        report([Path(a) for a in args[1:]])
        return
    extra = args[args.index("--") + 1 :] if "--" in args else []
    args = args[: args.index("--")] if "--" in args else args
    base = measure(args[0], args[1], [int(s) for s in args[2:]], extra)
    print(f"runs: {base}")
    report([base])


if __name__ == "__main__":
    main()
