"""What each template default costs per step: the baked project with one default changed at a time.

    python benchmarks/ablate.py                       # small config, 1 process, 5 rounds (about 4 minutes)
    python benchmarks/ablate.py --config realistic --procs 2

Each round runs every variant once (raw DDP first as the floor), so machine
noise is spread over all of them; the table gives medians over rounds of each
run's median step time (wall and rank 0's CPU time), and their difference to
the template's defaults.
"""

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from run import CONFIGS, bake, run_raw, run_template

# Lightning's progress bar without rich installed; with a refresh every 10 steps.
TQDM = "lightning.pytorch.callbacks.TQDMProgressBar"
VARIANTS = {
    "template defaults": [],
    "no progress bar": ["--trainer.enable_progress_bar=false"],
    "TQDMProgressBar refresh 1": [f"--trainer.callbacks+={TQDM}"],
    "TQDMProgressBar refresh 10": [
        f'--trainer.callbacks+={{"class_path": "{TQDM}", "init_args": {{"refresh_rate": 10}}}}'
    ],
    "no logger": ["--trainer.logger=false"],
    "no scaling doctor": ["--doctor.enabled=false"],
    "no checkpointing": ["--trainer.callbacks=[]", "--trainer.enable_checkpointing=false"],
    "bare Trainer (no bar/logger/checkpoints)": [
        "--trainer.callbacks=[]",
        "--trainer.enable_checkpointing=false",
        "--trainer.logger=false",
        "--trainer.enable_progress_bar=false",
    ],
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="small", choices=sorted(CONFIGS))
    p.add_argument("--procs", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--epochs", type=int)
    p.add_argument("--variants", help="comma-separated subset of: " + ", ".join(VARIANTS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--precision", choices=["32-true", "bf16-mixed"], default="32-true")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--launcher", choices=["lightning", "torchrun"], default="lightning")
    p.add_argument("--no-fixed-malloc", dest="fixed_malloc", action="store_false")
    p.add_argument(
        "--before", type=Path, help="another baked project (e.g. of an older commit): its defaults as a variant"
    )
    args = p.parse_args()
    names = args.variants.split(",") if args.variants else list(VARIANTS)
    if unknown := set(names) - set(VARIANTS):
        p.error(f"unknown variants {sorted(unknown)}; choose from {list(VARIANTS)}")

    before = f"before: {args.before}" if args.before else None
    results: dict[str, list[dict]] = {name: [] for name in ["raw DDP", *([before] if before else []), *names]}
    with tempfile.TemporaryDirectory(prefix="ddp-ablate-") as tmp:
        project = bake(Path(tmp) / "baked")
        for i in range(args.rounds):
            for j, (name, runs) in enumerate(results.items()):
                run_dir = Path(tmp) / f"round{i}-variant{j}"
                run_dir.mkdir()
                if name == "raw DDP":
                    runs.append(run_raw(project, run_dir, args.config, args.procs, args))
                elif name == before:
                    runs.append(run_template(args.before, run_dir, args.config, args.procs, args, []))
                else:
                    runs.append(run_template(project, run_dir, args.config, args.procs, args, VARIANTS[name]))
            print(f"round {i + 1}/{args.rounds} done", file=sys.stderr, flush=True)

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    base = "template defaults"
    print(f"config {args.config}, {args.procs} process(es), {args.rounds} rounds; ms/step medians over rounds")
    print("| variant | ms/step | CPU ms/step | vs defaults ms/step | vs defaults CPU ms/step | first step s |")
    print("|---|---|---|---|---|---|")
    for name in results:
        wall, cpu = med(name, "step_ms"), med(name, "cpu_ms")
        d_wall = f"{wall - med(base, 'step_ms'):+.2f}" if base in results else "-"
        d_cpu = f"{cpu - med(base, 'cpu_ms'):+.2f}" if base in results else "-"
        print(f"| {name} | {wall:.2f} | {cpu:.2f} | {d_wall} | {d_cpu} | {med(name, 'first_step_s'):.1f} |")


if __name__ == "__main__":
    main()
