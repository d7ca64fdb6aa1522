"""Template vs hand-written PyTorch DDP: step time, start-up and final weights.

    python benchmarks/run.py                      # the full CPU table (about 7 minutes on 2 cores)
    python benchmarks/run.py --accelerator gpu --precision bf16-mixed

Bakes the template into a temporary directory, then for each configuration and
process count alternates A = `torchrun benchmarks/raw_ddp.py`, L =
`benchmarks/bare_lightning.py` (the same training in a bare Trainer: Lightning's
own cost) and B = the baked project's own `python main.py fit` with its default
config (logger, progress bar, checkpoints on), changing only the model size,
epochs and device flags, and adding the `StepTimer` callback. All record rank
0's clock at the start of every training batch. See benchmarks/README.md for
what each figure means.
"""

import argparse
import contextlib
import importlib
import itertools
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import torch
from mfu import mfu, mlp_train_flops  # benchmarks/ is on sys.path as the script's directory

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# name: (hidden_dim, num_layers, epochs). The template's digits set gives 16 steps per epoch at
# global batch 64; epoch 0 is warm-up and not timed. About 1 ms and 30 ms steps on one thread here.
CONFIGS = {"small": (128, 2, 10), "realistic": (1024, 3, 4)}
GLOBAL_BATCH = 64


def stop(proc: subprocess.Popen) -> None:
    """End a run and every rank it started.

    SIGTERM first, to the run's process group: torchrun starts its workers in
    sessions of their own and only takes them down itself. SIGKILL if that takes
    more than 15 s.
    """
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def run(cmd: list[str], cwd: Path, env: dict, timeout: float) -> tuple[float, str]:
    """Run in its own session (all ranks killed on timeout); return the wall time and the output."""
    start = time.time()
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(proc)
        out, _ = proc.communicate()
        raise SystemExit(f"{' '.join(cmd)} timed out after {timeout}s:\n{out[-3000:]}") from None
    except BaseException:  # Ctrl-C or SIGTERM: take the ranks down too
        stop(proc)
        raise
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{out[-3000:]}")
    return start, out


def step_stats(record: dict, launch: float, end: float) -> dict:
    """Per-run figures from rank 0's batch-start clock (see README: what is timed)."""
    starts = record["starts"]
    pairs = list(itertools.pairwise(starts))
    # Steps: consecutive batch starts in the same epoch, epoch 0 excluded (warm-up).
    same = [(a, b) for a, b in pairs if a[0] == b[0] and a[0] >= 1]
    steps = [(b[1] - a[1]) * 1e3 for a, b in same]
    # CPU time of rank 0's process per step (all its threads): less sensitive to other load than wall time.
    cpu = [(b[2] - a[2]) * 1e3 for a, b in same]
    # Epoch boundaries: the last step, validation, epoch-end hooks and checkpointing.
    boundaries = [(b[1] - a[1]) * 1e3 for a, b in pairs if a[0] != b[0] and a[0] >= 1]
    return {
        "step_ms": statistics.median(steps),
        # The fastest tenth: steps that other processes did not interrupt, on a busy machine.
        "p10_step_ms": statistics.quantiles(steps, n=10)[0] if len(steps) > 1 else steps[0],
        "cpu_ms": statistics.median(cpu),
        "mean_step_ms": statistics.fmean(steps),
        "timed_steps": len(steps),
        "boundary_ms": statistics.median(boundaries) if boundaries else None,
        "first_step_s": record["first_step_wall"] - launch,
        "wall_s": end - launch,
    }


def max_weight_diff(template_weights: Path, raw_weights: Path) -> float:
    lightning_state = torch.load(template_weights, map_location="cpu")
    raw_state = torch.load(raw_weights, map_location="cpu")
    return max((lightning_state[f"model.{k}"].float() - v.float()).abs().max().item() for k, v in raw_state.items())


def run_env(procs: int, args) -> dict:
    # The same thread count for both sides. Lightning alone would pick cores // processes.
    threads = args.threads or max(1, (os.cpu_count() or 1) // procs)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    if args.fixed_malloc:
        # glibc otherwise decides per process, from its allocation history, whether freed multi-MB
        # buffers go back to the OS: a process that does pays ~300-1200 page faults per realistic step
        # (~2 ms here), which favoured whichever side happened not to. Fixed thresholds for both sides.
        env["GLIBC_TUNABLES"] = "glibc.malloc.trim_threshold=268435456:glibc.malloc.mmap_threshold=268435456"
    return env


def matmul_precision(args) -> str:
    """The float32 matmul precision the template's `--float32_matmul_precision auto` gives these runs: the other
    two sides get the same, so that all three do the same math (TF32 on GPUs)."""
    matmul = importlib.import_module("ddpkit.model.matmul")
    device = torch.device("cuda" if args.accelerator == "gpu" else "cpu")
    return matmul.float32_matmul_precision("auto", args.precision, device) or torch.get_float32_matmul_precision()


def loop_flags(project: Path, name: str, args, extra: dict) -> list[str]:
    """The command-line flags of `raw_ddp.py` (and `bare_lightning.py`, which takes the same) for a config."""
    hidden, layers, epochs = CONFIGS[name]
    flags = {
        "project": project, "hidden-dim": hidden, "num-layers": layers, "global-batch-size": GLOBAL_BATCH,
        "epochs": args.epochs or epochs, "accelerator": args.accelerator, "precision": args.precision,
        "matmul-precision": matmul_precision(args), **extra,
    }  # fmt: skip
    return [f"--{k}={v}" for k, v in flags.items()]


def run_raw(project: Path, run_dir: Path, name: str, procs: int, args) -> dict:
    """One `torchrun raw_ddp.py` run; its figures, and its final weights in run_dir/raw.pt."""
    outputs = {"out": run_dir / "raw.json", "weights": run_dir / "raw.pt", "ckpt-dir": run_dir / "raw_ckpt"}
    flags = loop_flags(project, name, args, outputs)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}",
           str(HERE / "raw_ddp.py"), *flags]  # fmt: skip
    launch, _ = run(cmd, run_dir, run_env(procs, args), args.timeout)
    return step_stats(json.loads((run_dir / "raw.json").read_text()), launch, time.time())


def run_template(project: Path, run_dir: Path, name: str, procs: int, args, extra: list[str]) -> dict:
    """One `python main.py fit` run of the baked project with its default config plus `extra` arguments."""
    hidden, layers, epochs = CONFIGS[name]
    flags = {
        "trainer.accelerator": args.accelerator, "trainer.devices": procs, "trainer.precision": args.precision,
        "trainer.max_epochs": args.epochs or epochs, "trainer.default_root_dir": run_dir,
        "model.hidden_dim": hidden, "model.num_layers": layers, "data.global_batch_size": GLOBAL_BATCH,
    }  # fmt: skip
    # Lightning's launcher starts rank 1 once rank 0 reaches fit(); torchrun starts every rank at once.
    launcher = [] if args.launcher == "lightning" else ["-m", "torch.distributed.run", "--standalone",
                                                        f"--nproc_per_node={procs}"]  # fmt: skip
    cmd = [sys.executable, *launcher, str(project / "main.py"), "fit", *(f"--{k}={v}" for k, v in flags.items()),
           *extra, "--trainer.callbacks+=steptimer.StepTimer"]  # fmt: skip
    env = run_env(procs, args)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    env["BENCH_TIMES"] = str(run_dir / "template.json")
    launch, _ = run(cmd, run_dir, env, args.timeout)
    return step_stats(json.loads((run_dir / "template.json").read_text()), launch, time.time())


def run_bare(project: Path, run_dir: Path, name: str, procs: int, args) -> dict:
    """One `bare_lightning.py` run (Lightning's launcher): the raw loop's training in a bare Trainer."""
    flags = loop_flags(project, name, args, {"out": run_dir / "bare.json", "devices": procs})
    cmd = [sys.executable, str(HERE / "bare_lightning.py"), *flags]
    env = {**run_env(procs, args), "BENCH_TIMES": str(run_dir / "bare.json")}
    launch, _ = run(cmd, run_dir, env, args.timeout)
    return step_stats(json.loads((run_dir / "bare.json").read_text()), launch, time.time())


def bench_pair(project: Path, work: Path, name: str, procs: int, repeat: int, args) -> dict:
    """A, L, B in a fresh directory: their figures, the step-time ratios and the final-weight differences."""
    run_dir = work / f"{name}-{procs}p-{repeat}"
    run_dir.mkdir()
    raw = run_raw(project, run_dir, name, procs, args)
    bare = run_bare(project, run_dir, name, procs, args)
    template = run_template(project, run_dir, name, procs, args, args.template_args)
    return {
        "raw": raw,
        "bare": bare,
        "template": template,
        "weight_diff": max_weight_diff(run_dir / "template.json.weights.pt", run_dir / "raw.pt"),
        "bare_weight_diff": max_weight_diff(run_dir / "bare.json.weights.pt", run_dir / "raw.pt"),
    }


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(name: str, procs: int, pairs: list[dict], args, project: Path) -> dict:
    row = {"config": name, "procs": procs, "repeats": len(pairs)}
    for side in ("raw", "bare", "template"):
        for key in ("step_ms", "p10_step_ms", "cpu_ms", "mean_step_ms", "boundary_ms", "first_step_s", "wall_s"):
            values = [p[side][key] for p in pairs if p[side][key] is not None]
            row[f"{side}_{key}"] = spread(values) if values else None

    def per_round(a: str, b: str) -> tuple[dict, dict]:
        """Ratio and difference of a's and b's step time, per round (back to back: shared noise cancels)."""
        steps = [(p[a]["step_ms"], p[b]["step_ms"]) for p in pairs]
        return spread([x / y for x, y in steps]), spread([x - y for x, y in steps])

    row["ratio"], row["overhead_ms"] = per_round("template", "raw")
    # Split of the overhead: Lightning's own loop (bare Trainer vs raw) and the template's (template vs bare).
    row["bare_ratio"], row["bare_overhead_ms"] = per_round("bare", "raw")
    row["template_vs_bare"], row["template_over_bare_ms"] = per_round("template", "bare")
    row["cpu_ratio"] = spread([p["template"]["cpu_ms"] / p["raw"]["cpu_ms"] for p in pairs])
    row["weight_diff"] = max(p["weight_diff"] for p in pairs)
    row["bare_weight_diff"] = max(p["bare_weight_diff"] for p in pairs)
    row["timed_steps"] = pairs[0]["template"]["timed_steps"]
    if args.accelerator == "gpu":
        hidden, layers, _ = CONFIGS[name]
        # 32-true: TF32 matmuls on all three sides (matmul_precision), whose peak is the tensor cores' TF32 one.
        tf32 = matmul_precision(args) != "highest"
        dtype = "bf16" if args.precision.startswith("bf16") else "tf32" if tf32 else "fp32"
        peak = importlib.import_module("ddpkit.scaling.throughput").peak_flops(torch.cuda.get_device_name(0), dtype)
        flops = mlp_train_flops(GLOBAL_BATCH, 64, hidden, layers, 10)
        for side in ("raw", "bare", "template"):
            # The mean, not the median: on a GPU the host runs ahead of the device between syncs.
            step_s = row[f"{side}_mean_step_ms"]["median"] / 1e3
            row[f"{side}_mfu"] = mfu(flops, step_s, peak, procs) if peak else None
    return row


def fmt(s: dict | None, digits: int = 2) -> str:
    if s is None:
        return "-"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def table(rows: list[dict]) -> str:
    """Two markdown tables: step time and where the overhead goes; then CPU time, start-up and wall time."""
    columns = [
        "config", "procs", "raw ms/step", "bare Lightning ms/step", "template ms/step", "ratio", "overhead ms/step",
        "of which Lightning ms", "of which template ms", "template / bare Lightning", "max weight diff template / bare",
    ]  # fmt: skip
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['procs']} | {fmt(r['raw_step_ms'])} | {fmt(r['bare_step_ms'])} | "
            f"{fmt(r['template_step_ms'])} | {fmt(r['ratio'], 3)} | {fmt(r['overhead_ms'])} | "
            f"{fmt(r['bare_overhead_ms'])} | {fmt(r['template_over_bare_ms'])} | {fmt(r['template_vs_bare'], 3)} | "
            f"{r['weight_diff']:.1e} / {r['bare_weight_diff']:.1e} |"
        )
    columns = [
        "config", "procs", "CPU ms/step raw / bare / template", "CPU ratio", "epoch boundary ms raw / template",
        "first step s raw / bare / template", "wall s raw / bare / template",
    ]  # fmt: skip
    with_mfu = any("raw_mfu" in r for r in rows)  # GPU runs with a known peak
    columns += ["MFU raw / bare / template"] if with_mfu else []
    lines += ["", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        sides = ("raw", "bare", "template")
        lines.append(
            f"| {r['config']} | {r['procs']} | {' / '.join(fmt(r[f'{s}_cpu_ms']) for s in sides)} | "
            f"{fmt(r['cpu_ratio'], 3)} | {fmt(r['raw_boundary_ms'], 0)} / {fmt(r['template_boundary_ms'], 0)} | "
            f"{' / '.join(fmt(r[f'{s}_first_step_s'], 1) for s in sides)} | "
            f"{' / '.join(fmt(r[f'{s}_wall_s'], 1) for s in sides)} |"
        )
        if with_mfu:
            mfus = [r.get(f"{side}_mfu") for side in ("raw", "bare", "template")]
            lines[-1] += " " + " / ".join("-" if m is None else f"{m:.1%}" for m in mfus) + " |"
    return "\n".join(lines)


def bake(out_dir: Path) -> Path:
    from cookiecutter.main import cookiecutter

    return Path(cookiecutter(str(REPO), no_input=True, output_dir=str(out_dir)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="small,realistic", help=f"comma-separated, from {sorted(CONFIGS)}")
    p.add_argument("--procs", default="1,2", help="comma-separated process (device) counts")
    p.add_argument("--repeats", type=int, default=3, help="A/B pairs per configuration")
    p.add_argument("--epochs", type=int, help="override every configuration's epochs (>= 2: epoch 0 is warm-up)")
    p.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--precision", choices=["32-true", "bf16-mixed"], default="32-true")
    p.add_argument(
        "--launcher",
        choices=["lightning", "torchrun"],
        default="lightning",
        help="how the template's ranks start: `python main.py` (users' default) or `torchrun main.py`",
    )
    p.add_argument("--project", type=Path, help="an already baked project (default: bake this repository)")
    p.add_argument("--json", type=Path, help="also write every figure here")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="OpenMP threads per process for both sides; 0 = "
        "Lightning's choice (cores // processes). 1 keeps a shared machine's noise from turning into "
        "OpenMP spin-waits",
    )
    p.add_argument(
        "--no-fixed-malloc",
        dest="fixed_malloc",
        action="store_false",
        help="leave glibc's malloc thresholds to each process (see run_env)",
    )
    p.add_argument("--timeout", type=float, default=300, help="seconds per run before it is killed")
    p.add_argument(
        "template_args",
        nargs="*",
        help="extra `main.py fit` arguments after --, e.g. -- --trainer.enable_progress_bar false",
    )
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `run` can clean up on kill

    started = time.time()
    with tempfile.TemporaryDirectory(prefix="ddp-bench-") as tmp:
        work = Path(tmp)
        project = args.project.resolve() if args.project else bake(work / "baked")
        rows = []
        for name in args.configs.split(","):
            for procs in map(int, args.procs.split(",")):
                pairs = [bench_pair(project, work, name, procs, i, args) for i in range(args.repeats)]
                rows.append(summarise(name, procs, pairs, args, project))
                print(f"{name} x{procs}: ratio {fmt(rows[-1]['ratio'], 3)}", file=sys.stderr, flush=True)
    machine = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "lightning": version("lightning"),
        "accelerator": args.accelerator,
        "device": torch.cuda.get_device_name(0) if args.accelerator == "gpu" else "cpu",
        "precision": args.precision,
        "total_s": round(time.time() - started, 1),
    }
    print(json.dumps(machine))
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
