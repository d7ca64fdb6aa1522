"""Scaling sweep and preflight: how fast this project trains on 1, 2, ... devices, and why.

    python -m ddpkit.scaling --devices 1 2 4 -- --trainer.max_steps 300   # one short fit per device count
    python -m ddpkit.scaling --explain RUN_1 RUN_N                        # why RUN_N is not N times faster
    python -m ddpkit.scaling --preflight --devices 4                      # what each process will see

Run it from the project's root: it runs the project's `main.py` there, or the one `--main PATH` names
(`--main ddpkit.toy`, a module name, runs `python -m ddpkit.toy`: the library's own toy model). The sweep
runs `python main.py fit --trainer.devices N <your fit args>` once per device count, as real processes,
with the same *global* batch (config.yaml's global_batch_size is split over the devices), so rows compare
like with like. The scaling doctor of each run writes doctor.json; this script collects them into
<out>/scaling.md, <out>/scaling.json and <out>/scaling.png (speed-up against the ideal line and the gap by
cause; the plot needs matplotlib: `pip install -e ".[scaling]"`). Each run's full output is in
<out>/devices_N.log.

How to read the decomposition. The ideal step on N devices is the fewest-device run's step x its devices
/ N. The gap (measured step - ideal, ms per step) is split into parts that add up to it, each the part's
time at N minus its ideal share of the base run's:
  compute     compute that did not shrink with the per-device batch (fixed per-step costs)
  comm        the gradient all-reduce itself: each step's least all-reduce time of any rank (the last to
              arrive waits for nobody), without its threads' wait for a CPU
  data        waiting for the loader, without the loader thread's own wait for a CPU
  straggler   the last rank's extra work over a typical rank's: what the others wait for; and what it
              waited in the all-reduce on steps where another rank came later (ranks take turns: jitter)
  other       framework time (the loop, loggers, hooks, per-step collectives)
  cpu wait    time the training threads were ready but had no CPU: other processes, or ranks x threads
              beyond the cores ("oversubscribed" says which); on CPUs also gloo's all-reduce threads,
              which 2 ranks x 1 thread on 2 cores leave without a core; it inflates no other part
  unexplained the measured gap minus the parts (timed steps against the throughput)
A point whose efficiency is below 0.8 is never "healthy": its verdict is the largest part, with a fix
that keeps the global batch.

What N would give (with runs on 1 and 2 devices): compute and data wait are fitted as fixed + per-sample
through the two runs, the framework time is the 2-device run's, the all-reduce follows a ring (the
latency the doctor measured at 2 ranks x (N-1), the rest x 2(N-1)/N), the straggler wait grows like the
expected maximum of N ranks' jitter. It assumes one device (and enough cores) per rank, no wait for a CPU
and the same interconnect at N as at 2 (not true across nodes: run the sweep there).
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from ddpkit.scaling.gap import PARTS, explain, format_explain, measured_without_cpu_wait, predict
from ddpkit.scaling.record import DoctorRecord, SchemaError

from .ranks import preflight, visible_cores

# Written in a sweep's output folder: `--ckpt_path last`, `best` and `auto` from a folder above it skip its runs
# (ddpkit.run.ckpt_paths.newest_last_checkpoint): short measurements, not the training a user means to continue.
SWEEP_MARKER = ".ddpkit-sweep"


def mark_sweep(out: Path, tool: str) -> None:
    """Mark `out` as a folder of `tool`'s short runs (SWEEP_MARKER): `--ckpt_path last/best/auto` skip them."""
    (out / SWEEP_MARKER).write_text(f"Runs of {tool}: --ckpt_path last, best and auto from a folder above skip them.\n")


def main_command(main: str) -> list[str]:
    """The command that starts the project CLI: `python PATH` for a file, `python -m NAME` for a module name."""
    if main.endswith(".py") or Path(main).exists():
        if not Path(main).is_file():
            raise SystemExit(f"error: no {main} here: run from the project's root, or name it with --main PATH")
        return [sys.executable, str(Path(main).resolve())]
    return [sys.executable, "-m", main]


def threads_per_process(devices: list[int]) -> int:
    """CPU threads every process of every run gets: OMP_NUM_THREADS if set, else cores / the most devices.

    The same number in every run, so that runs compare like with like: left alone, Lightning gives each
    process cores // processes threads, and a lone process's extra threads (which may fight each other,
    or other jobs) would make the speed-up mean something else.
    """
    if os.environ.get("OMP_NUM_THREADS"):
        return int(os.environ["OMP_NUM_THREADS"])
    return max(1, visible_cores() // max(devices))


def run_fit(
    main: list[str], devices: int, root: Path, fit_args: list[str], max_steps: int, timeout: float, threads: int
) -> DoctorRecord:
    """One fit (`main`: the command of main_command) on `devices` devices under `root`, `threads` CPU threads per
    process; return its doctor summary."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    cmd = [*main, "fit", "--trainer.devices", str(devices), "--trainer.max_steps", str(max_steps)]
    cmd += ["--trainer.default_root_dir", str(root), "--doctor.measure_comm", "true"]  # worth its cost in a sweep
    cmd += fit_args  # the user's args come last and win
    log = root.with_suffix(".log")
    with log.open("w") as out:
        # Own session: on timeout the whole process group (every rank) is killed, nothing is left behind.
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise SystemExit(f"{devices} devices: timed out after {timeout:.0f}s, see {log}") from None
    summaries = sorted(root.rglob("doctor.json"), key=lambda p: p.stat().st_mtime)
    if code != 0 or not summaries:
        tail = "".join(log.read_text().splitlines(keepends=True)[-20:])
        raise SystemExit(f"{devices} devices: fit exited {code} without a doctor.json ({log}):\n{tail}")
    return DoctorRecord.from_dict(json.loads(summaries[-1].read_text()), str(summaries[-1]))


def table_rows(summaries: list[DoctorRecord]) -> list[dict]:
    """One row per run; speed-up, efficiency and the gap's parts relative to the run with the fewest devices."""
    base = min(summaries, key=lambda s: s.world_size)
    rows = []
    for s in sorted(summaries, key=lambda s: s.world_size):
        e = explain(base, s)
        rows.append(
            {
                "devices": s.world_size,
                "samples_per_s": round(s.samples_per_s, 1),
                # 4 decimals: the table and the printed decomposition round these again to 1-2, and must agree
                # (0.355 kept as 0.355 prints as 0.35 in one and 0.36 from the unrounded 0.3551 in the other).
                "speedup": round(e["speedup"], 4),
                "efficiency": round(e["efficiency"], 4),
                "step_ms": round(e["step_ms"], 4),
                "ideal_step_ms": round(e["ideal_step_ms"], 4),
                "gap_ms": round(e["gap_ms"], 4),
                "parts_ms": {k: round(v, 4) for k, v in e["parts_ms"].items()},
                "unexplained_ms": round(e["unexplained_ms"], 4),
                "oversubscribed": e["oversubscribed"],
                "peak_mem_mb": [round(r.peak_mem_mb) for r in s.ranks],
                "verdict": e["verdict"] if s is not base else s.verdict,
                "fix": e["fix"],
            }
        )
    return rows


def predictions(summaries: list[DoctorRecord], devices: list[int]) -> list[dict]:
    """Predicted step and speed-up at each of `devices` from the 1- and 2-device runs, next to the
    measurement where there is one; [] without both runs."""
    by_n = {s.world_size: s for s in summaries}
    if 1 not in by_n or 2 not in by_n:
        return []
    out = []
    waits = [by_n[n].cpu_wait_pct for n in (1, 2)]
    # Fitted through runs that waited for a CPU, the parts hold less than they would on free cores.
    caveat = (
        f"note: the 1- and 2-device runs waited {waits[0]:.0f}% and {waits[1]:.0f}% of their steps for a CPU: "
        "the prediction assumes a CPU for every rank, so it is unreliable here"
        if max(waits) >= 20
        else ""
    )
    for n in devices:
        p = predict(by_n[1], by_n[2], n)
        row = {"devices": n, "predicted_step_ms": round(p["step_ms"], 2), "predicted_speedup": round(p["speedup"], 3)}
        row["caveat"] = caveat
        if n in by_n:
            e = explain(by_n[1], by_n[n])
            row["measured_speedup"] = round(e["speedup"], 3)
            # The prediction assumes a CPU for every rank: compare it with the measurement without that wait too.
            row["measured_speedup_without_cpu_wait"] = round(measured_without_cpu_wait(by_n[1], by_n[n]), 3)
            row["error_pct"] = round(100 * (p["speedup"] / row["measured_speedup_without_cpu_wait"] - 1), 1)
        out.append(row)
    return out


# Column heads of the parts, in PARTS' order.
PART_HEADS = {"compute": "compute", "comm": "comm", "data": "data", "straggler": "straggler", "other": "other"}
PART_HEADS["cpu_wait"] = "cpu wait"


def markdown(rows: list[dict], predicted: list[dict] | None = None) -> str:
    parts = " | ".join(PART_HEADS[k] for k in PARTS)
    lines = [
        f"| devices | samples/s | speed-up | efficiency | step ms | ideal ms | gap ms | {parts} | unexplained "
        "| peak MB per rank | verdict |",
        "|" + "---|" * (10 + len(PARTS)),
    ]
    for r in rows:
        mem = " / ".join(str(m) for m in r["peak_mem_mb"])
        cells = [r["gap_ms"], *(r["parts_ms"][k] for k in PARTS), r["unexplained_ms"]]
        gap = " | ".join("" if r is rows[0] else f"{ms:.1f}" for ms in cells)  # the base has no gap
        lines.append(
            f"| {r['devices']} | {r['samples_per_s']:.0f} | {r['speedup']:.2f} | {r['efficiency']:.2f} | "
            f"{r['step_ms']:.1f} | {r['ideal_step_ms']:.1f} | {gap} | {mem} | {r['verdict']} |"
        )
    text = "\n".join(lines) + "\n"
    if predicted and predicted[0].get("caveat"):
        text += f"\n{predicted[0]['caveat']}\n"
    if predicted:
        text += (
            "\n| devices | predicted step ms | predicted speed-up | measured | measured without cpu wait | error |\n"
        )
        text += "|---|---|---|---|---|---|\n"
        for p in predicted:
            keys = ("measured_speedup", "measured_speedup_without_cpu_wait")
            measured = " | ".join(f"{p[k]:.2f}" if k in p else "" for k in keys)
            error = f"{p['error_pct']:+.0f}%" if "error_pct" in p else ""
            predicted_cells = f"{p['predicted_step_ms']:.1f} | {p['predicted_speedup']:.2f}"
            text += f"| {p['devices']} | {predicted_cells} | {measured} | {error} |\n"
    return text


def plot(rows: list[dict], path: Path) -> bool:
    """Left: measured against ideal speed-up. Right: each device count's step, the ideal part and the gap
    stacked by cause. False (and a note) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        print('matplotlib is not installed: no plot (pip install -e ".[scaling]")')
        return False
    devices = [r["devices"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5), gridspec_kw={"width_ratios": [1, 1.3]})
    left.plot(devices, [d / devices[0] for d in devices], "--", color="gray", label="ideal")
    left.plot(devices, [r["speedup"] for r in rows], "o-", label="measured")
    for r in rows:
        left.annotate(f"{r['efficiency']:.2f}", (r["devices"], r["speedup"]), textcoords="offset points", xytext=(0, 8))
    left.set(xlabel="devices", ylabel=f"speed-up over {devices[0]} device(s)", xticks=devices)
    left.set_title("speed-up (labels: efficiency)")
    left.margins(x=0.1)
    left.set_ylim(bottom=0)
    left.legend(loc="upper left")
    x = range(len(rows))
    right.bar(x, [r["ideal_step_ms"] for r in rows], color="lightgray", label="ideal step")
    bottom = [r["ideal_step_ms"] for r in rows]
    colors = plt.get_cmap("tab10").colors
    labels = {**PART_HEADS, "unexplained": "unexplained"}
    for i, key in enumerate([*PARTS, "unexplained"]):
        ms = [max(0.0, r["unexplained_ms"] if key == "unexplained" else r["parts_ms"][key]) for r in rows]
        ms = [0.0 if r is rows[0] else m for r, m in zip(rows, ms, strict=True)]
        if any(ms):
            right.bar(x, ms, bottom=bottom, color=colors[i], label=labels[key])
            bottom = [b + m for b, m in zip(bottom, ms, strict=True)]
    tops = [max(r["step_ms"], b) for r, b in zip(rows, bottom, strict=True)]
    for i, r in enumerate(rows):
        label = "base" if i == 0 else r["verdict"]
        right.annotate(label, (i, tops[i]), textcoords="offset points", xytext=(0, 4), ha="center", fontsize=8)
    right.set_ylim(0, 1.15 * max(tops))  # room for the verdicts
    right.set(xticks=list(x), xticklabels=[str(d) for d in devices], xlabel="devices", ylabel="ms per step")
    right.set_title("step = ideal + the gap by cause")
    right.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def sweep(
    main: list[str], devices: list[int], out: Path, fit_args: list[str], max_steps: int, timeout: float
) -> list[dict]:
    summaries = []
    mark_sweep(out, "python -m ddpkit.scaling")
    threads = threads_per_process(devices)
    print(f"{threads} CPU thread(s) per process in every run (OMP_NUM_THREADS)", flush=True)
    for n in devices:
        print(f"fit on {n} device(s) ...", flush=True)
        summaries.append(run_fit(main, n, out / f"devices_{n}", fit_args, max_steps, timeout, threads))
    rows = table_rows(summaries)
    predicted = predictions(summaries, sorted({n for n in [*devices, 4, 8] if n > 2}))
    table = markdown(rows, predicted)
    (out / "scaling.md").write_text(table)
    record = {"fit_args": fit_args, "threads_per_process": threads, "rows": rows, "predictions": predicted}
    (out / "scaling.json").write_text(json.dumps(record, indent=2) + "\n")
    plotted = plot(rows, out / "scaling.png")
    print(table)
    base = min(summaries, key=lambda s: s.world_size)
    for s in sorted(summaries, key=lambda s: s.world_size):
        if s is not base:
            print(format_explain(explain(base, s)))
        for f in s.findings:
            print(f"{s.world_size} device(s), the doctor on that run alone: {f['cause']}: {f['fix']}")
    print(f"written: {out / 'scaling.md'}, scaling.json" + (", scaling.png" if plotted else ""))
    return rows


def load_summary(path: Path) -> DoctorRecord:
    """The doctor's summary of a run: doctor.json itself, or the newest one under a run directory."""
    found = [path] if path.is_file() else sorted(path.rglob("doctor.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit(f"no doctor.json in {path} (the doctor writes it when the run has a logger)")
    try:
        return DoctorRecord.from_dict(json.loads(found[-1].read_text()), str(found[-1]))
    except SchemaError as error:
        raise SystemExit(f"error: {error}") from None


def explain_runs(paths: list[Path]) -> None:
    """Print why the second run is not N times faster than the first; predictions from 1 and 2 devices."""
    base, run = (load_summary(p) for p in paths)
    try:
        print(format_explain(explain(base, run)))
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    predicted = predictions([base, run], [4, 8])
    if predicted and predicted[0]["caveat"]:
        print(predicted[0]["caveat"])
    for p in predicted:
        print(
            f"predicted on {p['devices']} devices: {p['predicted_step_ms']:.1f} ms per step, speed-up "
            f"{p['predicted_speedup']:.2f} (see --help for the model's limits)"
        )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ours, fit_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(
        prog="python -m ddpkit.scaling", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--main",
        default="main.py",
        help="the project CLI to run: a file (default ./main.py) or a module name (ddpkit.testing.toy: the toy model)",
    )
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2], help="device counts to run (default 1 2)")
    parser.add_argument("--out", type=Path, default=Path("scaling"), help="output directory (default ./scaling)")
    parser.add_argument("--max-steps", type=int, default=100, help="optimizer steps per fit (default 100)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds before a fit is killed")
    parser.add_argument("--preflight", action="store_true", help="check devices, backend and ranks; no training")
    parser.add_argument(
        "--explain",
        type=Path,
        nargs=2,
        metavar=("RUN_1", "RUN_N"),
        help="decompose the gap of two finished runs of the same config (run directories or doctor.json files)",
    )
    args = parser.parse_args(ours)
    if args.explain:
        explain_runs(args.explain)
    elif args.preflight:
        preflight(main_command(args.main), max(args.devices), fit_args)
    else:
        main = main_command(args.main)  # before any folder is made: a wrong --main fails at once
        args.out.mkdir(parents=True, exist_ok=True)
        sweep(main, args.devices, args.out, fit_args, args.max_steps, args.timeout)


if __name__ == "__main__":
    main()
