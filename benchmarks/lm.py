"""A language model at GPT-2 small's size: the template's `main.py fit` against a hand-written DDP loop on the
same devices, in tokens per second and MFU.

    python benchmarks/lm.py --accelerator gpu   # GPT-2 small (124M parameters, context 1024), bf16-mixed, compiled
    python benchmarks/lm.py --accelerator cpu   # a tiny GPT in 32-true, eager: what CI runs

Bakes the template with the language-model example (or takes --project), writes a file of random token ids
(nothing is downloaded: throughput does not depend on what the ids say), then alternates, over --rounds, the
hand-written loop (`torchrun lm_raw.py`) and the baked project's own `python main.py fit --config
configs/lm.yaml`, sized from the command line (`--model.vocab_size`, `--data.token_format uint16`, ...) and
given `steptimer.WindowTimer`. Both train the example's `GPT` on the same sequences in the same order with
configs/lm.yaml's optimizer and schedule, fused AdamW on CUDA. Epoch 0 (compilation, warm-up) is not timed;
each later epoch is one window, from its first batch's start to its last batch's end with the device idle at
both ends. It prints a table, then one line that starts with `lm-bench:` and holds every figure as key=value.
See benchmarks/README.md for what each figure means.
"""

import argparse
import importlib
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import torch
from mfu import gpt_flops_per_token, mfu  # benchmarks/ is on sys.path as the script's directory
from raw_ddp import baked_module
from run import max_weight_diff, run, run_env, spread, step_stats

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# name: (n_layers, d_model, n_heads, block_size, vocab_size)
SIZES = {
    "gpt2": (12, 768, 12, 1024, 50257),  # GPT-2 small: 124,439,808 parameters with the tied head
    "tiny": (2, 64, 4, 64, 1024),  # ids above 255, so the uint16 token file is exercised
}
# name: (sequences per device and step, steps per epoch, epochs); epoch 0 is warm-up
SCHEDULES = {"gpt2": (16, 40, 3), "tiny": (4, 8, 2)}
SIDES = ("raw", "template")


def token_file(path: Path, sequences: int, val_sequences: int, block_size: int, vocab_size: int) -> float:
    """Random ids as uint16, `sequences` training and `val_sequences` validation sequences of `block_size` once
    TextDataModule cuts them; returns the val_fraction that cuts them so."""
    # Each part needs one id more than its sequences (the last target); int(n * (1 - f)) lands there for 0 < f < 0.5.
    total = sequences + val_sequences
    ids = torch.randint(0, vocab_size, (total * block_size + 2,), generator=torch.Generator().manual_seed(0))
    path.write_bytes(ids.to(torch.uint16).numpy().tobytes())
    return val_sequences / total


def sizes(args) -> dict:
    layers, d_model, heads, block, vocab = SIZES[args.size]
    return {
        "n_layers": layers, "d_model": d_model, "n_heads": heads, "block_size": block,
        "vocab_size": args.vocab_size or vocab,
    }  # fmt: skip


def run_raw(project: Path, run_dir: Path, args, data: dict) -> dict:
    """One `torchrun lm_raw.py` run; its record, launch and end times."""
    model = sizes(args)
    flags = {
        "project": project, "tokens": data["tokens"], "val-fraction": repr(data["val_fraction"]),
        "out": run_dir / "raw.json", "weights": run_dir / "raw.pt", "ckpt-dir": run_dir / "raw_ckpt",
        "n-layers": model["n_layers"], "d-model": model["d_model"], "n-heads": model["n_heads"],
        "block-size": model["block_size"], "vocab-size": model["vocab_size"],
        "global-batch-size": args.batch, "epochs": args.epochs,
        "accelerator": args.accelerator, "precision": args.precision,
    }  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.devices}",
           str(HERE / "lm_raw.py"), *(f"--{k}={v}" for k, v in flags.items())]  # fmt: skip
    cmd += ["--compile"] if args.compile else []
    launch, _ = run(cmd, run_dir, run_env(args.devices, args), args.timeout)
    return {"record": json.loads((run_dir / "raw.json").read_text()), "launch": launch, "end": time.time()}


def run_template(project: Path, run_dir: Path, args, data: dict) -> dict:
    """One `python main.py fit --config configs/lm.yaml` run of the baked project, sized on the command line."""
    flags = {f"model.{k}": v for k, v in sizes(args).items()}
    flags |= {
        "model.compile": str(args.compile).lower(),
        "data.block_size": flags["model.block_size"], "data.text_path": data["tokens"],
        "data.token_format": "uint16", "data.val_fraction": repr(data["val_fraction"]),
        "data.global_batch_size": args.batch,
        "trainer.accelerator": args.accelerator, "trainer.devices": args.devices,
        "trainer.precision": args.precision, "trainer.max_epochs": args.epochs,
        "trainer.default_root_dir": run_dir,
    }  # fmt: skip
    if args.accelerator == "gpu":
        flags["model.optimizer.init_args.fused"] = "true"
    cmd = [sys.executable, str(project / "main.py"), "fit", "--config", str(project / "configs" / "lm.yaml"),
           *(f"--{k}={v}" for k, v in flags.items()), *args.template_args,
           "--trainer.callbacks+=steptimer.WindowTimer"]  # fmt: skip
    env = run_env(args.devices, args)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    env["BENCH_TIMES"], env["BENCH_WEIGHTS"] = str(run_dir / "template.json"), str(run_dir / "template.pt")
    launch, _ = run(cmd, run_dir, env, args.timeout)
    return {"record": json.loads((run_dir / "template.json").read_text()), "launch": launch, "end": time.time()}


def side_stats(result: dict, tokens_per_step: int, flops_per_token: float, peak: float | None, devices: int) -> dict:
    """One run's figures: tokens/s over its timed windows (epochs >= 1), MFU, and run.py's per-step figures."""
    windows = [w for w in result["record"]["windows"] if w[0] >= 1]
    steps, seconds = sum(w[3] for w in windows), sum(w[2] - w[1] for w in windows)
    tokens_per_s = steps * tokens_per_step / seconds
    stats = step_stats(result["record"], result["launch"], result["end"])
    stats |= {"tokens_per_s": tokens_per_s, "timed_window_steps": steps, "timed_s": seconds}
    stats["mfu"] = mfu(flops_per_token * tokens_per_s, 1.0, peak, devices) if peak else None
    return stats


def summarise(rounds: list[dict]) -> dict:
    """Medians (min-max) over rounds of each side's figures, and of the per-round ratio template / raw."""
    summary = {}
    for side in SIDES:
        for key in ("tokens_per_s", "mfu", "step_ms", "cpu_ms", "first_step_s", "wall_s"):
            values = [r[side][key] for r in rounds if r[side][key] is not None]
            summary[f"{side}_{key}"] = spread(values) if values else None
    summary["ratio"] = spread([r["template"]["tokens_per_s"] / r["raw"]["tokens_per_s"] for r in rounds])
    summary["max_weight_diff"] = max(r["weight_diff"] for r in rounds)
    return summary


def summary_line(config: dict, summary: dict) -> str:
    """One line of key=value pairs (no spaces inside a value) for scripts: `lm-bench: key=value ...`."""

    def median(key: str, fmt: str) -> str:
        return "n/a" if summary[key] is None else format(summary[key]["median"], fmt)

    fields = {
        "device": config["device"].replace(" ", "_"), "devices": config["devices"], "size": config["size"],
        "params": config["params"], "block_size": config["block_size"], "batch": config["batch"],
        "precision": config["precision"], "compile": config["compile"], "rounds": config["rounds"],
        "raw_tokens_per_s": median("raw_tokens_per_s", ".0f"),
        "template_tokens_per_s": median("template_tokens_per_s", ".0f"),
        "ratio": median("ratio", ".4f"),
        "raw_mfu": median("raw_mfu", ".4f"), "template_mfu": median("template_mfu", ".4f"),
        "max_weight_diff": f"{summary['max_weight_diff']:.3g}",
    }  # fmt: skip
    return "lm-bench: " + " ".join(f"{k}={v}" for k, v in fields.items())


def table(summary: dict) -> str:
    def fmt(s: dict | None, spec: str) -> str:
        return "n/a" if s is None else f"{s['median']:{spec}} ({s['min']:{spec}}-{s['max']:{spec}})"

    lines = ["| side | tokens/s | MFU | ms/step | CPU ms/step | first step s | wall s |", "|" + "---|" * 7]
    for side, name in zip(SIDES, ("hand-written", "template"), strict=True):
        lines.append(
            f"| {name} | {fmt(summary[f'{side}_tokens_per_s'], ',.0f')} | {fmt(summary[f'{side}_mfu'], '.1%')} | "
            f"{fmt(summary[f'{side}_step_ms'], '.2f')} | {fmt(summary[f'{side}_cpu_ms'], '.2f')} | "
            f"{fmt(summary[f'{side}_first_step_s'], '.1f')} | {fmt(summary[f'{side}_wall_s'], '.1f')} |"
        )
    lines += ["", f"template / hand-written tokens/s: {fmt(summary['ratio'], '.4f')}"]
    return "\n".join(lines)


def bake(out_dir: Path) -> Path:
    from cookiecutter.main import cookiecutter

    extra = {"lm_example": "yes"}
    return Path(cookiecutter(str(REPO), no_input=True, output_dir=str(out_dir), extra_context=extra))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--accelerator", choices=["auto", "cpu", "gpu"], default="auto", help="auto: a GPU if CUDA has one")
    p.add_argument("--devices", type=int, default=1, help="processes, one per device")
    p.add_argument("--size", choices=sorted(SIZES), help="default: gpt2 on a GPU, tiny on the CPU")
    p.add_argument("--vocab-size", type=int, help="override the size's vocabulary (e.g. 50304, a multiple of 64)")
    p.add_argument("--precision", choices=["32-true", "bf16-mixed"], help="default: bf16-mixed on a GPU, else 32-true")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, help="each block; default: on a GPU only")
    p.add_argument("--batch", type=int, help="global batch in sequences (default: the size's per device x devices)")
    p.add_argument("--steps", type=int, help="optimizer steps per epoch (default: the size's)")
    p.add_argument("--epochs", type=int, help="epochs, >= 2: epoch 0 is not timed (default: the size's)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of both sides, their order alternating")
    p.add_argument("--project", type=Path, help="a project baked with lm_example=yes (default: bake this repository)")
    p.add_argument("--json", type=Path, help="also write every figure here")
    p.add_argument(
        "--threads", type=int, default=1, help="OpenMP threads per process, both sides (0: cores // devices)"
    )
    p.add_argument("--no-fixed-malloc", dest="fixed_malloc", action="store_false", help="see run.py's run_env")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run before it is killed")
    p.add_argument("template_args", nargs="*", help="extra `main.py fit` arguments after --")
    args = p.parse_args(argv)
    if args.accelerator == "auto":
        args.accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    if args.accelerator == "gpu" and not torch.cuda.is_available():
        p.error("--accelerator gpu: torch sees no CUDA device")
    gpu = args.accelerator == "gpu"
    args.size = args.size or ("gpt2" if gpu else "tiny")
    args.precision = args.precision or ("bf16-mixed" if gpu else "32-true")
    args.compile = gpu if args.compile is None else args.compile
    per_device, steps, epochs = SCHEDULES[args.size]
    args.batch, args.steps, args.epochs = (
        args.batch or per_device * args.devices,
        args.steps or steps,
        args.epochs or epochs,
    )
    if args.epochs < 2 or args.steps < 2 or args.rounds < 1 or args.devices < 1:
        p.error("need --epochs >= 2, --steps >= 2, --rounds >= 1, --devices >= 1")
    if args.batch % args.devices:
        p.error(f"--batch {args.batch} does not divide over {args.devices} devices")
    if not 0 < sizes(args)["vocab_size"] <= 2**16:
        p.error("--vocab-size must be in 1..65536 (the token file holds uint16 ids)")
    if args.project and not (args.project / "configs" / "lm.yaml").is_file():
        p.error(f"--project {args.project}: no configs/lm.yaml (bake it with lm_example=yes)")
    return args


def main() -> None:
    args = parse()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `run` can take the ranks down on kill
    started = time.time()
    model = sizes(args)
    gpu = args.accelerator == "gpu"
    device = torch.cuda.get_device_name(0) if gpu else (platform.processor() or platform.machine())
    peak = None
    if gpu:  # the dense peak of the dtype the matmuls run in; 32-true: plain FP32 (neither side enables TF32)
        dtype = "bf16" if args.precision == "bf16-mixed" else "fp32"
        peak = importlib.import_module("ddpkit.scaling.throughput").peak_flops(device, dtype)
    flops_per_token = gpt_flops_per_token(model["n_layers"], model["d_model"], model["vocab_size"], model["block_size"])
    with tempfile.TemporaryDirectory(prefix="lm-bench-") as tmp:
        work = Path(tmp)
        project = args.project.resolve() if args.project else bake(work / "baked")
        with torch.device("meta"):
            gpt = baked_module(project, "lm.gpt").GPT(*(model[k] for k in ("vocab_size", "block_size", "n_layers",
                                                                          "d_model", "n_heads")))  # fmt: skip
        params = sum(p.numel() for p in gpt.parameters())
        data = {"tokens": work / "tokens.bin"}
        data["val_fraction"] = token_file(data["tokens"], args.batch * args.steps, args.batch, model["block_size"],
                                          model["vocab_size"])  # fmt: skip
        config = {
            "size": args.size, **model, "params": params, "flops_per_token": flops_per_token, "batch": args.batch,
            "steps_per_epoch": args.steps, "epochs": args.epochs, "devices": args.devices,
            "accelerator": args.accelerator, "device": device, "peak_flops": peak, "precision": args.precision,
            "compile": args.compile, "fused_adamw": gpu, "rounds": args.rounds,
        }  # fmt: skip
        print(f"lm-bench: {params / 1e6:.1f}M parameters, {args.rounds} rounds", file=sys.stderr, flush=True)
        tokens_per_step = args.batch * model["block_size"]
        rounds = []
        for i in range(args.rounds):
            run_dir = work / f"round-{i}"
            run_dir.mkdir()
            results = {}
            for side in SIDES if i % 2 == 0 else SIDES[::-1]:  # alternate which side runs first
                results[side] = (run_raw if side == "raw" else run_template)(project, run_dir, args, data)
                stats = side_stats(results[side], tokens_per_step, flops_per_token, peak, args.devices)
                results[side] = stats
                print(f"round {i + 1}/{args.rounds} {side}: {stats['tokens_per_s']:,.0f} tokens/s, wall "
                      f"{stats['wall_s']:.0f} s", file=sys.stderr, flush=True)  # fmt: skip
            results["weight_diff"] = max_weight_diff(run_dir / "template.pt", run_dir / "raw.pt")
            rounds.append(results)
            shutil.rmtree(run_dir)  # GPT-2 small's checkpoints take ~1.5 GB each
            if args.json:  # after every round: a run cut short keeps the rounds it finished
                write_json(args.json, config, rounds, started)
    summary = summarise(rounds)
    print(json.dumps(machine(started)))
    print(json.dumps(config))
    print(table(summary))
    print(summary_line(config, summary), flush=True)


def machine(started: float) -> dict:
    return {
        "platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
        "lightning": version("lightning"), "total_s": round(time.time() - started, 1),
    }  # fmt: skip


def write_json(path: Path, config: dict, rounds: list[dict], started: float) -> None:
    record = {"machine": machine(started), "config": config, "rounds": rounds, "summary": summarise(rounds)}
    path.write_text(json.dumps(record, indent=1, default=str))


if __name__ == "__main__":
    main()
