"""Learning-rate finder at the global batch: a range test on 1 or N devices that gives the same curve on both.

    python -m ddpkit.lr_finder [--devices N] [--min-lr 1e-6] [--max-lr 1] [--steps 100] [-- MAIN.PY FIT ARGS]

Run it from the project's root (or name the CLI with `--main`, as for `python -m ddpkit.scaling`). It runs
`python main.py fit <fit args>` on N devices for at most --steps optimizer steps, with `ddpkit.tune.lr_sweep.LRSweep`
added: step k trains with an lr that grows exponentially from --min-lr to --max-lr and records the loss of that
step's global batch, the mean over every rank and micro-batch. The batch is global (config.yaml's
global_batch_size, split over the devices), so the curve and the suggestion are the same on 1 or N devices, and
the suggested lr is the lr of the optimizer's argument (`--model.optimizer.init_args.lr` for a module that takes
an OptimizerCallable, as the example's does). The sweep stops early once the smoothed loss exceeds
--stop-factor times its lowest value.

The suggestion: the lr where the smoothed loss falls fastest against log(lr), among the steps before the lowest
smoothed loss. The sweep's fit is not a training: it validates nothing, writes no checkpoint and ends with the
sweep (its folder is marked as a sweep's, so `--ckpt_path last/best/auto` skip it); train afterwards with the
suggestion.

<out>/ (default ./lr_find) holds lr_find.json (the curve, the suggestion and how it was swept), lr.yaml (the
suggestion as a config: `python main.py fit --config config.yaml --config lr_find/lr.yaml`), lr_find.png (with
matplotlib, the `scaling` extra), fit.log (the fit's output) and run/ (its logs).
"""

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, NoReturn

import yaml

from ddpkit.scaling.sweeper import main_command, mark_sweep

from .lr_curve import HALF_WINDOW, lr_keys, nested, short_option, shown, smooth, suggestion, yaml_float

# What the finder sets itself; fit args that set them are refused.
OWNED = {
    "trainer.devices": "--devices",
    "trainer.max_steps": "--steps",
    "trainer.max_epochs": "--steps",
    "trainer.default_root_dir": "--out",
    "trainer.limit_val_batches": "the sweep (it validates nothing)",
    "ckpt_path": "the sweep (it starts from the module's initial weights)",
}
PREFIX = "lr_find: "  # the fit's lines this command shows (the rest go to fit.log)


class BadInput(Exception):
    """Refused before or by the sweep: one `error:` line, exit status 2."""


# ---- the sweep's fit ----------------------------------------------------------------------------------------
def fit_command(main: list[str], args: argparse.Namespace, fit_args: list[str]) -> list[str]:
    """The sweep's fit: the user's arguments, then the finder's (check_fit_args refused any overlap)."""
    settings = {
        "min_lr": yaml_float(args.min_lr),
        "max_lr": yaml_float(args.max_lr),
        "steps": str(args.steps),
        "stop_factor": yaml_float(args.stop_factor),
        "out": str((args.out / "curve.json").resolve()),
    }
    return [
        *main,
        "fit",
        *fit_args,
        *("--trainer.devices", str(args.devices), "--trainer.max_steps", str(args.steps)),
        *("--trainer.max_epochs", "-1", "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0"),
        *("--trainer.default_root_dir", str(args.out / "run"), "--doctor.enabled", "false"),
        "--trainer.callbacks+=ddpkit.tune.lr_sweep.LRSweep",
        *(text for name, value in settings.items() for text in (f"--trainer.callbacks.{name}", value)),
    ]


def check_fit_args(fit_args: list[str]) -> None:
    for arg in fit_args:
        key = arg[2:].split("=")[0].replace(".init_args.", ".") if arg.startswith("--") else ""
        if key in OWNED:
            raise BadInput(f"the fit args set --{key}, which the finder sets ({OWNED[key]})")


def run_fit(cmd: list[str], log: Path, timeout: float) -> int | None:
    """Run the fit in its own session, its output to `log` and its progress lines to the screen; kill every rank
    on timeout or when this process is stopped. Its exit status, None when it timed out."""
    timed_out = threading.Event()

    def time_out() -> None:
        timed_out.set()
        kill_group(proc)

    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, bufsize=1
        )
        timer = threading.Timer(timeout, time_out)
        timer.start()
        try:
            for line in proc.stdout:
                out.write(line)
                if line.startswith(PREFIX):
                    print(line[len(PREFIX) :], end="", flush=True)
            code = proc.wait()
        except BaseException:
            kill_group(proc)
            raise
        finally:
            timer.cancel()
    return None if timed_out.is_set() else code


def interrupt(signum: int, frame: Any) -> None:
    """SIGTERM as Ctrl-C: the fit's ranks are killed with it."""
    raise KeyboardInterrupt


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def failure_line(log: Path) -> str:
    """The line that says why the fit failed: its last `error:` line, else its last line."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    return (errors or lines or ["(no output)"])[-1]


def run_config(run: Path) -> dict:
    """The config the sweep's fit saved (with a logger), else {}."""
    found = sorted(run.glob("lightning_logs/*/config.yaml"), key=lambda p: p.stat().st_mtime)
    return yaml.safe_load(found[-1].read_text()) if found else {}


# ---- results ------------------------------------------------------------------------------------------------
def plot(curve: dict, path: Path) -> bool:
    """The loss (raw and smoothed) against the lr on a log axis, the suggestion marked. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('matplotlib is not installed: no plot (pip install -e ".[scaling]")')
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(curve["lr"], curve["loss"], color="lightgray", label="loss of the step's global batch")
    ax.plot(curve["lr"], curve["smoothed"], label=f"mean of {2 * HALF_WINDOW + 1} steps")
    if curve["suggestion"] is not None:
        ax.axvline(curve["suggestion"], color="red", linestyle="--", label=f"suggestion {curve['suggestion']:.3g}")
    ax.set_xscale("log")
    top = max(curve["smoothed"][:1] + [min(curve["smoothed"]) * curve["stop_factor"]])
    ax.set_ylim(min(curve["loss"]) * 0.9 if min(curve["loss"]) > 0 else None, top * 1.1)
    batch = f"global batch {curve['global_batch_size']}, " if curve["global_batch_size"] else ""
    ax.set(xlabel="learning rate", ylabel="training loss")
    ax.set_title(f"{curve['optimizer'].rsplit('.', 1)[-1]}, {batch}{curve['world_size']} device(s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def cli_command(main: str) -> str:
    """How the user runs the project CLI that `--main` names."""
    return f"python {main}" if main.endswith(".py") or Path(main).exists() else f"python -m {main}"


def report(curve: dict, keys: list[str], out: Path, main: str) -> list[str]:
    """Write lr.yaml when the lr's key is known; return the lines to print."""
    finite = [i for i, s in enumerate(curve["smoothed"]) if math.isfinite(s)]
    lowest = min(finite, key=lambda i: curve["smoothed"][i])
    batch = f", global batch {curve['global_batch_size']}" if curve["global_batch_size"] else ""
    lines = [
        f"swept {len(curve['lr'])} steps on {curve['world_size']} device(s){batch}: {curve['stopped']}; lowest "
        f"smoothed loss {curve['smoothed'][lowest]:.4g} at lr {curve['lr'][lowest]:.3g}"
    ]
    if curve["suggestion"] is None:
        return [*lines, "no suggestion: the loss never fell; start lower (--min-lr) or sweep longer (--steps)"]
    lr = shown(curve["suggestion"])
    lines.append(f"suggested lr: {lr} (where the smoothed loss falls fastest)")
    if len(keys) != 1:  # none matched the optimizer's lr, or several did
        where = f"one of {', '.join(keys)}" if keys else f"the lr of {curve['optimizer']} where the module builds it"
        return [*lines, f"set {where} to {lr}"]
    cli = cli_command(main)
    header = f"# Suggested by python -m ddpkit.lr_finder: {cli} fit --config config.yaml --config {out / 'lr.yaml'}\n"
    (out / "lr.yaml").write_text(header + yaml.safe_dump(nested(keys[0], float(lr)), sort_keys=False))
    return [*lines, f"train with it: {cli} fit {short_option(keys[0])} {lr}  (or --config {out / 'lr.yaml'})"]


def results(curve: dict, config: dict, out: Path, main: str) -> None:
    """From the sweep's curve and the fit's config: the suggestion, lr_find.json, lr.yaml, the plot, the report."""
    curve["smoothed"] = smooth(curve["loss"])
    curve["suggestion"] = suggestion(curve["lr"], curve["loss"])
    curve["lr_keys"] = keys = lr_keys(config, curve["optimizer_lr"])
    (out / "lr_find.json").write_text(json.dumps(curve, indent=1) + "\n")
    (out / "curve.json").unlink(missing_ok=True)
    lines = report(curve, keys, out, main)
    plotted = plot(curve, out / "lr_find.png")
    print("\n".join(lines))
    written = ["lr.yaml"] if (out / "lr.yaml").exists() else []
    written += ["lr_find.png"] if plotted else []
    print(f"written: {out / 'lr_find.json'}" + "".join(f", {name}" for name in written), flush=True)


# ---- the command --------------------------------------------------------------------------------------------
class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, as every bad input of ddpkit's
        self.exit(2, f"error: {message}\n")


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ours, fit_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = Parser(
        prog="python -m ddpkit.lr_finder", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--devices", type=int, default=1, help="devices (GPUs or CPU processes) of the fit (default 1)")
    parser.add_argument("--min-lr", type=float, default=1e-6, help="the lr of the first step (default 1e-6)")
    parser.add_argument("--max-lr", type=float, default=1.0, help="the lr of the last step (default 1)")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps of the sweep (default 100)")
    parser.add_argument(
        "--stop-factor",
        type=float,
        default=4.0,
        help="stop once the smoothed loss exceeds this many times its lowest (default 4)",
    )
    parser.add_argument("--out", type=Path, default=Path("lr_find"), help="output folder (default ./lr_find)")
    parser.add_argument(
        "--main", default="main.py", help="the project CLI: a file (default ./main.py) or a module name"
    )
    parser.add_argument("--timeout", type=float, default=3600, help="seconds before the fit is killed (default 3600)")
    args = parser.parse_args(ours)
    if not 0 < args.min_lr < args.max_lr:
        parser.error(f"need 0 < --min-lr < --max-lr, got {args.min_lr:g} and {args.max_lr:g}")
    if args.steps < 10 or args.devices < 1 or args.stop_factor <= 1:
        parser.error("--steps must be >= 10, --devices >= 1, --stop-factor > 1")
    return args, fit_args


def main(argv: list[str] | None = None) -> None:
    args, fit_args = parse(sys.argv[1:] if argv is None else argv)
    try:
        check_fit_args(fit_args)
        if args.out.resolve() == Path.cwd().resolve():
            raise BadInput("--out must be a folder of its own: --ckpt_path last/best/auto skip it, and so its run")
        try:
            main_cmd = main_command(args.main)
        except SystemExit as error:
            raise BadInput(str(error).removeprefix("error: ")) from None
    except BadInput as error:
        sys.stderr.write(f"error: {error}\n")
        sys.exit(2)
    args.out.mkdir(parents=True, exist_ok=True)
    mark_sweep(args.out, "python -m ddpkit.lr_finder")
    shutil.rmtree(args.out / "run", ignore_errors=True)
    for name in ("curve.json", "lr_find.json", "lr.yaml", "lr_find.png"):  # nothing of an earlier sweep is left
        (args.out / name).unlink(missing_ok=True)
    log = args.out / "fit.log"
    print(
        f"lr sweep from {args.min_lr:.3g} to {args.max_lr:.3g} in {args.steps} steps on {args.devices} device(s) "
        f"(log: {log})",
        flush=True,
    )
    signal.signal(signal.SIGTERM, interrupt)
    try:
        code = run_fit(fit_command(main_cmd, args, fit_args), log, args.timeout)
    except KeyboardInterrupt:
        sys.stderr.write(f"stopped: the sweep's fit and its ranks were killed; its output: {log}\n")
        sys.exit(130)
    if code is None:
        sys.stderr.write(f"error: the sweep's fit timed out after {args.timeout:g} s and was killed (see {log})\n")
        sys.exit(1)
    curve_file = args.out / "curve.json"
    curve = json.loads(curve_file.read_text()) if curve_file.exists() else None
    if curve is not None and "error" in curve:
        sys.stderr.write(f"error: {curve['error']}\n")
        sys.exit(2)
    if code != 0 or curve is None or not curve["loss"]:
        sys.stderr.write(f"error: the sweep's fit exited {code} without a curve: {failure_line(log)} (see {log})\n")
        sys.exit(1)
    results(curve, run_config(args.out / "run"), args.out, args.main)


if __name__ == "__main__":
    main()
