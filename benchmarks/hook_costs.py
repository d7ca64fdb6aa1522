"""CPU time per training step of every Lightning hook in the baked project's `fit` (rank 0).

    python benchmarks/hook_costs.py                       # small config, 1 process, 10 epochs
    python benchmarks/hook_costs.py --config realistic -- --trainer.devices=2

Runs `main.py fit` with its default config and `steptimer.CPUTimeProfiler` (the
thread's CPU time per hook, so other load on the machine does not count) and
prints the hooks that run at every training step, costliest first, in
microseconds per step (mean over steps, epoch 0 excluded).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from run import CONFIGS, GLOBAL_BATCH, HERE, bake, run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="small", choices=sorted(CONFIGS))
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("fit_args", nargs="*", help="extra `main.py fit` arguments after --")
    args = p.parse_args()
    hidden, layers, _ = CONFIGS[args.config]
    with tempfile.TemporaryDirectory(prefix="ddp-hooks-") as tmp:
        project = bake(Path(tmp) / "baked")
        out = Path(tmp) / "hooks.json"
        cmd = [sys.executable, str(project / "main.py"), "fit", "--trainer.accelerator=cpu", "--trainer.devices=1",
               f"--trainer.max_epochs={args.epochs}", f"--trainer.default_root_dir={tmp}",
               f"--model.hidden_dim={hidden}", f"--model.num_layers={layers}",
               f"--data.global_batch_size={GLOBAL_BATCH}", "--trainer.profiler=steptimer.CPUTimeProfiler",
               *args.fit_args]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "BENCH_HOOKS": str(out),
               "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
        run(cmd, Path(tmp), env, timeout=600)
        durations = json.loads(out.read_text())
    steps = len(durations["run_training_batch"])
    skip = steps // args.epochs  # epoch 0
    per_step = {
        name: statistics.fmean(values[skip:]) * 1e6
        for name, values in durations.items()
        if len(values) == steps  # once per training step
    }
    print(f"config {args.config}, rank 0, {steps - skip} steps; CPU microseconds per step (mean: periodic work counts)")
    print("| hook | us/step |\n|---|---|")
    for name, us in sorted(per_step.items(), key=lambda kv: -kv[1])[: args.top]:
        if "{" in name:  # ModelCheckpoint{...its arguments...}.hook
            name = name.split("{")[0] + "." + name.rsplit(".", 1)[1]
        print(f"| {name} | {us:.0f} |")
    # Start-up and once-per-fit work: what runs before the first step besides imports.
    once = {name: sum(values) * 1e3 for name, values in durations.items() if len(values) <= 2}
    print("\nhooks run once or twice per fit; CPU milliseconds in total")
    print("| hook | ms |\n|---|---|")
    for name, ms in sorted(once.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"| {name.split('{')[0]} | {ms:.1f} |")


if __name__ == "__main__":
    main()
