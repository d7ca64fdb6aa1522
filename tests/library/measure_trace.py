"""Trace where 2 devices depart from 1 over a whole training (not a test): every step's weights and buffers.

    python tests/library/measure_trace.py MODEL DATA PRECISION SEEDS... [-- main.py arguments]

For each seed, fits on 1 and on 2 devices (2 epochs of test_model_families.py's data) record every tensor after
every optimizer step (StepTrace); prints, per step, the worst max_rel between them among the weights and among the
buffers (BatchNorm's running statistics), and the worst tensor at the end (docs/measurements.md, "The BatchNorm CNN
in bf16").
"""

import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lightning as L
import torch
from procs import TESTS, finish, start

from ddpkit.parity import weight_diffs


class StepTrace(L.Callback):
    """Rank 0 records every tensor of the module after every optimizer step, to probe/trace.pt."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.steps.append({n: t.detach().double().clone() for n, t in pl_module.state_dict().items()})

    def teardown(self, trainer, pl_module, stage) -> None:
        if trainer.global_rank == 0:
            out = Path(trainer.default_root_dir) / "probe"
            out.mkdir(parents=True, exist_ok=True)
            torch.save(self.steps, out / "trace.pt")


def fit(root: Path, args: list[str]) -> Path:
    cmd = [sys.executable, "-m", "ddpkit.testing.toy", "fit", *args, "--trainer.default_root_dir", str(root)]
    result = finish(start(cmd, TESTS, {"OMP_NUM_THREADS": "1"}), timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:]
    return root / "probe" / "trace.pt"


def main() -> None:
    args = sys.argv[1:]
    extra = args[args.index("--") + 1 :] if "--" in args else []
    args = args[: args.index("--")] if "--" in args else args
    model, data, precision, seeds = args[0], args[1], args[2], [int(s) for s in args[3:]]
    base = Path(tempfile.mkdtemp(prefix="trace-"))
    for seed in seeds:
        common = ["--model", model, "--data", data, "--data.global_batch_size", "32", "--data.train_size", "128"]
        common += ["--seed_everything", str(seed), "--trainer.accelerator", "cpu", "--trainer.precision", precision]
        common += ["--trainer.max_epochs", "2", "--trainer.enable_progress_bar", "false", "--doctor.enabled", "false"]
        common += ["--trainer.callbacks+=measure_trace.StepTrace"]
        common += ["--trainer.callbacks+=ddpkit.testing.parity_probe.NoDropout"]
        with ThreadPoolExecutor(2) as pool:
            traces = [pool.submit(fit, base / f"{seed}-{n}", [*common, "--trainer.devices", str(n), *extra])
                      for n in (1, 2)]  # fmt: skip
        one, two = (torch.load(t.result()) for t in traces)
        print(f"{model} {precision} seed {seed}: step, worst max_rel of the weights, of the buffers (1 vs 2 devices)")
        for step, (a, b) in enumerate(zip(one, two, strict=True), 1):
            diffs = weight_diffs(a, b)
            buffers = [d for d in diffs if "running" in d.name]
            weights = [d for d in diffs if "running" not in d.name and "num_batches" not in d.name]
            print(f"  {step:3d} {weights[0]}   {buffers[0] if buffers else ''}")
    print(f"runs: {base}")


if __name__ == "__main__":
    main()
