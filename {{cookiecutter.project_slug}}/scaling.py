"""Scaling sweep and preflight: how fast this project trains on 1, 2, ... devices, and why.

    python scaling.py --devices 1 2 4 -- --trainer.max_steps 300     # one short fit per device count
    python scaling.py --preflight --devices 4                        # what each process will see

The sweep runs `python main.py fit --trainer.devices N <your fit args>` once per device count, as real
processes, with the same *global* batch (config.yaml's global_batch_size is split over the devices), so
rows compare like with like. The scaling doctor of each run writes doctor.json; this script collects them
into <out>/scaling.md, <out>/scaling.json and <out>/scaling.png (speed-up against the ideal line; the plot
needs matplotlib: `pip install -e ".[scaling]"`). Each run's full output is in <out>/devices_N.log.
"""

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

MAIN = Path(__file__).resolve().with_name("main.py")


def visible_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one, as under SLURM)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def threads_per_process(devices: list[int]) -> int:
    """CPU threads every process of every run gets: OMP_NUM_THREADS if set, else cores / the most devices.

    The same number in every run, so that runs compare like with like: left alone, Lightning gives each
    process cores // processes threads, and a lone process's extra threads (which may fight each other,
    or other jobs) would make the speed-up mean something else.
    """
    if os.environ.get("OMP_NUM_THREADS"):
        return int(os.environ["OMP_NUM_THREADS"])
    return max(1, visible_cores() // max(devices))


def run_fit(devices: int, root: Path, fit_args: list[str], max_steps: int, timeout: float, threads: int) -> dict:
    """One fit on `devices` devices under `root`, `threads` CPU threads per process; return its doctor summary."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    cmd = [sys.executable, str(MAIN), "fit", "--trainer.devices", str(devices), "--trainer.max_steps", str(max_steps)]
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
    return json.loads(summaries[-1].read_text())


def table_rows(summaries: list[dict]) -> list[dict]:
    """One row per run; speed-up and efficiency relative to the run with the fewest devices."""
    base = min(summaries, key=lambda s: s["world_size"])
    rows = []
    for s in sorted(summaries, key=lambda s: s["world_size"]):
        speedup = s["samples_per_s"] / base["samples_per_s"] if base["samples_per_s"] else 0.0
        ideal = s["world_size"] / base["world_size"]
        rows.append(
            {
                "devices": s["world_size"],
                "samples_per_s": round(s["samples_per_s"], 1),
                "speedup": round(speedup, 3),
                "efficiency": round(speedup / ideal, 3),
                "step_ms": round(s["step_ms"], 2),
                "data_wait_pct": round(s["data_wait_pct"], 1),
                "comm_pct": round(s["comm_pct"], 1),
                "peak_mem_mb": [round(r["peak_mem_mb"]) for r in s["ranks"]],
                "verdict": s["verdict"],
            }
        )
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| devices | samples/s | speed-up | efficiency | step ms | data wait % | comm % | peak MB per rank | verdict |",
        "|" + "---|" * 9,
    ]
    for r in rows:
        mem = " / ".join(str(m) for m in r["peak_mem_mb"])
        lines.append(
            f"| {r['devices']} | {r['samples_per_s']:.0f} | {r['speedup']:.2f} | {r['efficiency']:.2f} | "
            f"{r['step_ms']:.1f} | {r['data_wait_pct']:.0f} | {r['comm_pct']:.0f} | {mem} | {r['verdict']} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> bool:
    """Measured speed-up against the ideal line; False (and a note) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        print('matplotlib is not installed: no plot (pip install -e ".[scaling]")')
        return False
    devices = [r["devices"] for r in rows]
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.plot(devices, [d / devices[0] for d in devices], "--", color="gray", label="ideal")
    ax.plot(devices, [r["speedup"] for r in rows], "o-", label="measured")
    for r in rows:
        ax.annotate(r["verdict"], (r["devices"], r["speedup"]), textcoords="offset points", xytext=(-6, 6), ha="right")
    ax.margins(x=0.2)  # room for the verdict labels
    ax.set(xlabel="devices", ylabel=f"speed-up over {devices[0]} device(s)", xticks=devices, title="Scaling")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def sweep(devices: list[int], out: Path, fit_args: list[str], max_steps: int, timeout: float) -> list[dict]:
    summaries = []
    threads = threads_per_process(devices)
    print(f"{threads} CPU thread(s) per process in every run (OMP_NUM_THREADS)", flush=True)
    for n in devices:
        print(f"fit on {n} device(s) ...", flush=True)
        summaries.append(run_fit(n, out / f"devices_{n}", fit_args, max_steps, timeout, threads))
    rows = table_rows(summaries)
    table = markdown(rows)
    (out / "scaling.md").write_text(table)
    record = {"fit_args": fit_args, "threads_per_process": threads, "rows": rows}
    (out / "scaling.json").write_text(json.dumps(record, indent=2) + "\n")
    plotted = plot(rows, out / "scaling.png")
    print(table)
    for s in summaries:
        for f in s["findings"]:
            print(f"{s['world_size']} device(s): {f['cause']}: {f['fix']}")
    print(f"written: {out / 'scaling.md'}, scaling.json" + (", scaling.png" if plotted else ""))
    return rows


# ---- preflight -------------------------------------------------------------------------------------------
def _rank_report(rank: int, world: int, port: int, queue, cuda: bool) -> None:
    """One process of the preflight: join the process group as training would, report what it sees."""
    import torch
    import torch.distributed as dist

    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(rank)  # one node: local rank = rank, as Lightning maps it
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    ones = torch.ones(1, device=device)
    dist.all_reduce(ones)  # proves the backend can talk between all ranks
    cores = visible_cores()
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    current = torch.cuda.current_device() if cuda else None
    queue.put((rank, str(device), current, name, cores, int(ones.item())))
    dist.destroy_process_group()


def _fit_config(fit_args: list[str]) -> dict | None:
    """The merged config of a fit with these args (`main.py fit --print_config`), None if it fails."""
    import yaml

    out = subprocess.run(
        [sys.executable, str(MAIN), "fit", *fit_args, "--print_config"], capture_output=True, text=True, timeout=300
    )
    return yaml.safe_load(out.stdout) if out.returncode == 0 else None


def _num_workers(config: dict | None) -> str:
    """The fit's effective --data.num_workers."""
    if config is None:
        return "? (fit --print_config failed)"
    data = config.get("data") or {}
    return str((data.get("init_args") or data).get("num_workers", "? (not an argument of this data module)"))


def _uses_cuda(config: dict | None, cuda_available: bool) -> bool:
    """Whether the fit runs on GPUs: `--trainer.accelerator gpu/cuda`, or `auto` with a GPU visible."""
    accelerator = ((config or {}).get("trainer") or {}).get("accelerator", "auto")
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and cuda_available)


def preflight(devices: int, fit_args: list[str]) -> None:
    """Print what the seed guides say to check by hand before a multi-device run."""
    import torch
    import torch.multiprocessing as mp

    config = _fit_config(fit_args)
    cuda = _uses_cuda(config, torch.cuda.is_available())  # the fit's accelerator: cpu means gloo, GPUs or not
    cores = visible_cores()
    print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
    print(f"visible devices (torch.cuda.device_count()): {torch.cuda.device_count()}")
    print(f"CUDA_VISIBLE_DEVICES: {os.environ.get('CUDA_VISIBLE_DEVICES', '(not set)')}")
    print(f"backend: {'nccl' if cuda else 'gloo'}")
    if cuda and devices > torch.cuda.device_count():
        raise SystemExit(f"{devices} devices requested but only {torch.cuda.device_count()} visible")
    # Lightning gives each rank cores // ranks threads unless OMP_NUM_THREADS is set.
    print(f"CPU cores visible: {cores}; per rank with {devices} ranks: {max(1, cores // devices)}")
    print(f"OMP_NUM_THREADS: {os.environ.get('OMP_NUM_THREADS', '(not set: Lightning sets cores per rank)')}")
    print(f"dataloader workers per rank (--data.num_workers): {_num_workers(config)}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(_rank_report, args=(devices, port, queue, cuda), nprocs=devices, start_method="spawn")
    reports = sorted(queue.get() for _ in range(devices))
    print("rank | device | current_device | name | cores visible | all_reduce(1)")
    for rank, device, current, name, rank_cores, total in reports:
        print(f"{rank:>4} | {device} | {current} | {name} | {rank_cores} | {total}")
    if any(r[5] != devices for r in reports):
        raise SystemExit("all_reduce gave a wrong sum: the process group is broken")
    print(f"ok: {devices} processes joined one {'nccl' if cuda else 'gloo'} group and all-reduced correctly")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ours, fit_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2], help="device counts to run (default 1 2)")
    parser.add_argument("--out", type=Path, default=Path("scaling"), help="output directory (default ./scaling)")
    parser.add_argument("--max-steps", type=int, default=100, help="optimizer steps per fit (default 100)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds before a fit is killed")
    parser.add_argument("--preflight", action="store_true", help="check devices, backend and ranks; no training")
    args = parser.parse_args(ours)
    if args.preflight:
        preflight(max(args.devices), fit_args)
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        sweep(args.devices, args.out, fit_args, args.max_steps, args.timeout)


if __name__ == "__main__":
    main()
